"""The pieces every executor shares: bucket views, pack / unpack, direct blocks, checksums.

Each executor moves buckets its own way (rounds of send/recv, CUDA streams, one-sided
writes); what a bucket's bytes are, where they come from and where they land is decided
here once, so two transports can never disagree about the wire format of one plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import Protocol

import torch

from refit.layout import dtype_from_name
from refit.plan import Bucket, Op, RankPlan
from refit.transport.base import TensorMap

ALIGN = 256  # staging slots are cut on this grain (the plan's op alignment)
ROW = 4096  # checksum rows: position-weighted, each summed as 512 int64 words
_ROW_WORDS = ROW // 8


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as one flat uint8 view (no copy for contiguous tensors)."""
    return t.reshape(-1).view(torch.uint8)


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def op_view(buf: torch.Tensor, op: Op, offset: int) -> torch.Tensor:
    """The op's block inside a flat byte buffer, in its wire dtype and shape."""
    return buf[offset: offset + op.nbytes].view(dtype_from_name(op.wire_dtype)).view(op.box.shape)


def single_block(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> tuple[Op, torch.Tensor] | None:
    """The bucket's one op and its tensor, when the bucket is one block already in the wire dtype."""
    if len(bucket.ops) != 1:
        return None
    op = bucket.ops[0]
    t = tensors[op.name]
    return (op, t) if t.dtype == dtype_from_name(op.wire_dtype) else None


def direct_view(bucket: Bucket, tensors: Mapping[str, torch.Tensor], side: str) -> torch.Tensor | None:
    """The tensor region itself as bytes, when the bucket is one contiguous block needing no cast.

    Such a bucket is sent from, or received into, the tensor itself: the two ends decide
    this independently, since the wire carries the same bytes either way.
    """
    found = single_block(bucket, tensors)
    if found is None:
        return None
    op, t = found
    view = t[op.box.src_slices() if side == "src" else op.box.dst_slices()]
    if not view.is_contiguous():
        return None
    return flat_bytes(view)


def pack_bucket(bucket: Bucket, src: TensorMap, buf: torch.Tensor, *, ledger: ChecksumLedger | None = None,
                key: tuple[int, int] | None = None) -> torch.Tensor:
    """Copy (and cast) the bucket's source blocks into the flat byte buffer ``buf``.

    Alignment gaps are zeroed, so a bucket's bytes (and its checksum) depend on the
    weights alone and never on what the staging memory held before. With a ``ledger``
    the checksum is taken while packing (see ``ChecksumLedger``).
    """
    pos = 0
    summer = ledger.summer(key, buf, bucket.nbytes, sent=True) if ledger is not None else None
    for op, off in zip(bucket.ops, bucket.offsets):
        if off > pos:
            buf[pos:off].zero_()
        for piece, end in _pieces(op, summer):
            op_view(buf, op, off)[piece].copy_(src[op.name][op.box.src_slices()][piece])
            if summer is not None:
                summer.upto(off + end)
        pos = off + op.nbytes
    if bucket.nbytes > pos:
        buf[pos:bucket.nbytes].zero_()
    if summer is not None:
        summer.upto(bucket.nbytes)
    return buf


def unpack_bucket(bucket: Bucket, buf: torch.Tensor, dst: TensorMap, *, ledger: ChecksumLedger | None = None,
                  key: tuple[int, int] | None = None) -> None:
    """Copy (and cast) the bucket's blocks from the flat byte buffer ``buf`` into their destinations.

    With a ``ledger`` the checksum of what arrived is taken while unpacking.
    """
    summer = ledger.summer(key, buf, bucket.nbytes, sent=False) if ledger is not None else None
    for op, off in zip(bucket.ops, bucket.offsets):
        if summer is not None:
            summer.upto(off)  # alignment gaps: zeros that arrived
        for piece, end in _pieces(op, summer):
            if summer is not None:  # sum the piece first: the copy out of it then reads it from cache
                summer.upto(off + end)
            dst[op.name][op.box.dst_slices()][piece].copy_(op_view(buf, op, off)[piece])
    if summer is not None:
        summer.upto(bucket.nbytes)


def local_copies(plan: RankPlan, src: TensorMap, dst: TensorMap) -> int:
    """The plan's blocks that stay on this rank; returns the bytes copied."""
    moved = 0
    for op in plan.local:
        dst[op.name][op.box.dst_slices()].copy_(src[op.name][op.box.src_slices()])
        moved += op.nbytes
    return moved


# -- checksums ---------------------------------------------------------------------------------

PIECE_BYTES = 4 << 20  # on the host, checksums follow the copies in pieces that are still in cache


def _pieces(op: Op, summer: _Summer | None) -> list[tuple[slice | EllipsisType, int]]:
    """The op's block cut along its first dim into pieces of about ``PIECE_BYTES`` (host checksums only).

    Each piece comes with the byte offset, within the op, where it ends; a piece ends on a
    256-byte boundary of the bucket, so the checksum of what was copied so far can be taken
    right after each copy, while it is still in cache, instead of reading the whole bucket
    again from memory afterwards.
    """
    shape = op.box.shape
    if summer is None or not summer.pieces or op.nbytes <= PIECE_BYTES or not shape or shape[0] < 2:
        return [(Ellipsis, op.nbytes)]
    row = op.nbytes // shape[0]
    step = ALIGN // math.gcd(row, ALIGN)  # rows between 256-byte boundaries
    per = max(step, PIECE_BYTES // row // step * step)
    return [(slice(lo, min(lo + per, shape[0])), min(lo + per, shape[0]) * row) for lo in range(0, shape[0], per)]


def _row_sums_into(span: torch.Tensor, out: torch.Tensor) -> None:
    """Sums of the int64 words of each 4 KiB row of ``span`` into ``out`` (a short last row is zero-padded)."""
    if span.data_ptr() % 8:
        span = span.clone()  # a view into a 2-byte dtype may start mid-word
    full = span.numel() // ROW
    if full:
        torch.sum(span[: full * ROW].view(torch.int64).view(full, _ROW_WORDS), 1, out=out[:full])
    if span.numel() > full * ROW:
        last = torch.zeros(ROW, dtype=torch.uint8, device=span.device)
        last[: span.numel() - full * ROW].copy_(span[full * ROW:])
        out[full] = last.view(torch.int64).sum()


class _Summer:
    """The checksum of one bucket, taken span by span as its bytes are written or read.

    Row ``i`` of ``R`` weighs ``2 (R - i) + 1``: the sum of the row sums' running totals
    gives ``R - i``, so a span only sums its rows (one reduction, no weights) and the
    weighting happens once per bucket. Odd weights keep every single flipped bit visible
    in int64 arithmetic, which wraps: with an even weight, the top bit of a word would
    vanish.
    """

    def __init__(self, buf: torch.Tensor, nbytes: int, pieces: bool):
        self.buf = buf
        self.nbytes = nbytes
        self.done = 0
        self.pieces = pieces
        self.sums = torch.empty(-(-nbytes // ROW), dtype=torch.int64, device=buf.device)

    def upto(self, end: int) -> None:
        """Sum the rows up to ``end`` (rounded down to a row, except at the bucket's end): every byte
        below ``end`` is final (packed, or arrived)."""
        end = self.nbytes if end >= self.nbytes else end // ROW * ROW
        if end > self.done:
            _row_sums_into(self.buf[self.done:end], self.sums[self.done // ROW: -(-end // ROW)])
            self.done = end

    def value(self) -> torch.Tensor:
        if not self.sums.numel():
            return torch.tensor(self.nbytes, dtype=torch.int64, device=self.sums.device)
        return 2 * self.sums.cumsum(0).sum() + self.sums.sum() + self.nbytes


class SummedStreams(Protocol):
    """Checksum streams whose rows a kernel summed while copying them (``refit.transport.copy_sum``)."""

    device: torch.device

    def stream_values(self) -> torch.Tensor:
        """Every stream's checksum after the last launch, as ``_Summer.value`` gives it (int64, on the device)."""
        ...


@dataclass(frozen=True, eq=False)
class _StreamValue:
    """One stream of a ``SummedStreams``: a checksum taken in the copy's pass, weighted at settle."""

    batch: SummedStreams
    stream: int


def _stream_values(refs: list[_StreamValue]) -> dict[int, int]:
    """id(ref) -> value, each batch's streams weighted on its device and all read with one synchronisation."""
    batches = list({id(r.batch): r.batch for r in refs}.values())
    if not batches:
        return {}
    by_device: dict[torch.device, list] = {}
    for b in batches:
        by_device.setdefault(b.device, []).append(b)
    read: dict[int, list[int]] = {}
    for group in by_device.values():
        values = [b.stream_values() for b in group]
        flat = torch.cat(values).tolist()
        pos = 0
        for b, v in zip(group, values):
            read[id(b)] = flat[pos: pos + v.numel()]
            pos += v.numel()
    return {id(r): read[id(r.batch)][r.stream] for r in refs}


def checksum_tensor(buf: torch.Tensor) -> torch.Tensor:
    """A position-weighted checksum of a flat byte buffer, as a 0-d int64 tensor on its device.

    The bytes are read as 4 KiB rows of int64 words; each row is summed and row ``i`` of
    ``R`` is weighted by ``2 (R - i) + 1``. A flipped bit or byte, bytes displaced across
    rows (a chunk written at the wrong offset) or a bucket delivered to the wrong peer all
    change it; a swap of two words inside one row does not. It checks the wire: both ends
    sum the same bucket bytes. Rows of 4 KiB are what GPUs reduce at full memory speed
    (measured on an H200: 4.4 TB/s, against 1.1 TB/s for 256-byte rows). The rows can be
    summed span by span, in any order (``ChecksumLedger`` does, following the copies).
    The value stays on the device. Not a cryptographic digest.
    """
    summer = _Summer(buf, buf.numel(), pieces=False)
    summer.upto(buf.numel())
    return summer.value()


def checksum(buf: torch.Tensor) -> int:
    """``checksum_tensor`` read back to the host (one synchronisation; for one-off checks)."""
    return int(checksum_tensor(buf).item())


class ChecksumLedger:
    """Per-bucket checksums of one refit, taken while packing and unpacking, read once.

    On the host a checksum follows the copies in pieces of ``PIECE_BYTES`` that are still
    in cache: reading every bucket again from memory afterwards cost a CPU refit half as
    much again as the transfer. On a GPU each bucket is one span (fewer kernels; the
    memory is fast). The values stay on the device until ``settle``: reading each one as
    it is computed stalled the CUDA pipeline at every bucket.
    """

    def __init__(self) -> None:
        self._sent: list[tuple[tuple[int, int], _Summer]] = []
        self._received: list[tuple[tuple[int, int], _Summer]] = []
        self._sent_views: dict[tuple[torch.device, int, int], _Summer] = {}
        self._blocks: list[tuple[bool, tuple[int, int], list[_Summer]]] = []  # (sent, key, one summer per block)

    def summer(self, key: tuple[int, int], buf: torch.Tensor, nbytes: int, *, sent: bool) -> _Summer:
        s = _Summer(buf, nbytes, pieces=buf.device.type == "cpu")
        (self._sent if sent else self._received).append((key, s))
        return s

    def sent(self, key: tuple[int, int], buf: torch.Tensor) -> None:
        """The checksum of a whole send buffer (a block sent from the tensor itself).

        A block sent to several peers (every engine replica needs the same shard) is summed
        once: the sources do not change during a refit.
        """
        view = (buf.device, buf.data_ptr(), buf.numel())
        summer = self._sent_views.get(view)
        if summer is None:
            summer = self._sent_views[view] = _Summer(buf, buf.numel(), pieces=False)
            summer.upto(buf.numel())
        self._sent.append((key, summer))

    def received(self, key: tuple[int, int], buf: torch.Tensor) -> None:
        """The checksum of a whole receive buffer (a block received into the tensor itself)."""
        self.summer(key, buf, buf.numel(), sent=False).upto(buf.numel())

    def blocks(self, key: tuple[int, int], bufs: list[torch.Tensor], *, sent: bool) -> None:
        """The checksum of a bucket that is never packed, from its blocks' bytes where they lie.

        ``bufs`` are the blocks' bytes in bucket order (flat byte views, or copies of strided
        or cast blocks), in a form both ends agree on. Each is summed as its own span and the sums combined with
        odd weights by position, so a block that lands in another block's place changes the
        value like a flipped bit does. Both ends of a bucket must use this form (the value
        differs from a packed bucket's).
        """
        summers = []
        for buf in bufs:
            summer = _Summer(buf, buf.numel(), pieces=False)
            summer.upto(buf.numel())
            summers.append(summer)
        self._blocks.append((sent, key, summers))

    def summed(self, key: tuple[int, int], batch: SummedStreams, stream: int, *, sent: bool) -> None:
        """The checksum of a packed bucket whose rows ``batch`` summed while copying it (its ``stream``)."""
        (self._sent if sent else self._received).append((key, _StreamValue(batch, stream)))

    def summed_blocks(self, key: tuple[int, int], batch: SummedStreams, streams: list[int], *, sent: bool) -> None:
        """``blocks`` (the form of a bucket that is never packed) whose rows ``batch`` summed while
        copying them: one stream per block, in bucket order."""
        self._blocks.append((sent, key, [_StreamValue(batch, k) for k in streams]))

    def settle(self) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
        """Every checksum as host ints: (sent, received), each keyed (peer, bucket index).

        The weighting of every bucket's rows runs here, for all buckets of a device at
        once, and the values are read with one synchronisation: a few kernels per refit
        instead of a few per bucket (a refit of an 8B model has hundreds of buckets, and
        launching their kernels one by one cost more than summing the bytes).
        """
        entries = self._sent + self._received + [(k, x) for _, k, xs in self._blocks for x in xs]
        unique = list({id(s): s for _, s in entries}.values())  # a block sent to several peers: summed once
        summers = [s for s in unique if isinstance(s, _Summer)]
        refs = [s for s in unique if isinstance(s, _StreamValue)]
        values: list[int] = [0] * len(summers)
        by_device: dict[torch.device, list[int]] = {}
        for i, summer in enumerate(summers):
            by_device.setdefault(summer.sums.device, []).append(i)
        value_of = _stream_values(refs)
        for device, idx in by_device.items():
            rows = [summers[i].sums.numel() for i in idx]
            sums = torch.cat([summers[i].sums for i in idx])
            bucket = torch.repeat_interleave(torch.arange(len(idx), device=device),
                                             torch.tensor(rows, device=device), output_size=sums.numel())
            ends = torch.tensor(list(itertools.accumulate(rows)), dtype=torch.int64, device=device)
            weights = 2 * (ends[bucket] - torch.arange(sums.numel(), device=device)) + 1  # 2 (R - i) + 1
            totals = torch.tensor([summers[i].nbytes for i in idx], dtype=torch.int64, device=device)
            totals.index_add_(0, bucket, sums * weights)
            for i, v in zip(idx, totals.tolist()):
                values[i] = v
        value_of.update({id(s): v for s, v in zip(summers, values)})
        sent = {k: value_of[id(s)] for k, s in self._sent}
        received = {k: value_of[id(s)] for k, s in self._received}
        for is_sent, key, block_summers in self._blocks:
            total = len(block_summers)
            for i, summer in enumerate(block_summers):
                total += (2 * i + 1) * value_of[id(summer)]
            (sent if is_sent else received)[key] = (total + (1 << 63)) % (1 << 64) - (1 << 63)  # int64, as on device
        return sent, received


_POOL_GRAIN = 1 << 20  # staging capacities are rounded up to this, so odd sizes share buffers


class StagingPool:
    """Host-driven staging buffers, kept across refits.

    Fresh multi-MB host buffers are new pages from the kernel each time, and faulting
    them in cost more than the copies into them (measured: 35x slower packing). The pool
    never holds more than the peak staging of one refit; ``release()`` gives it back.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        capacity = -(-nbytes // _POOL_GRAIN) * _POOL_GRAIN
        free = self._free.get(capacity)
        base = free.pop() if free else torch.empty(capacity, dtype=torch.uint8, device=self.device)
        return base[:nbytes]

    def give_back(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        self._free.setdefault(base.numel(), []).append(base)

    def release(self) -> None:
        self._free.clear()


__all__ = [
    "ALIGN", "ChecksumLedger", "StagingPool", "align", "checksum", "checksum_tensor", "direct_view", "flat_bytes",
    "local_copies", "op_view", "pack_bucket", "single_block", "unpack_bucket",
]
