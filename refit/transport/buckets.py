"""The pieces every executor shares: bucket views, pack / unpack, direct blocks, checksums.

Each executor moves buckets its own way (rounds of send/recv, CUDA streams, one-sided
writes); what a bucket's bytes are, where they come from and where they land is decided
here once, so two transports can never disagree about the wire format of one plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refit.layout import dtype_from_name
from refit.plan import Bucket, Op, RankPlan

ALIGN = 256  # staging slots and checksum rows are cut on this grain (the plan's op alignment)
_ROW_WORDS = ALIGN // 8


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


def pack_bucket(bucket: Bucket, src: Mapping[str, torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    """Copy (and cast) the bucket's source blocks into the flat byte buffer ``buf``.

    Alignment gaps are zeroed, so a bucket's bytes (and its checksum) depend on the
    weights alone and never on what the staging memory held before.
    """
    pos = 0
    for op, off in zip(bucket.ops, bucket.offsets):
        if off > pos:
            buf[pos:off].zero_()
        op_view(buf, op, off).copy_(src[op.name][op.box.src_slices()])
        pos = off + op.nbytes
    if bucket.nbytes > pos:
        buf[pos:bucket.nbytes].zero_()
    return buf


def unpack_bucket(bucket: Bucket, buf: torch.Tensor, dst: Mapping[str, torch.Tensor]) -> None:
    """Copy (and cast) the bucket's blocks from the flat byte buffer ``buf`` into their destinations."""
    for op, off in zip(bucket.ops, bucket.offsets):
        dst[op.name][op.box.dst_slices()].copy_(op_view(buf, op, off))


def local_copies(plan: RankPlan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> int:
    """The plan's blocks that stay on this rank; returns the bytes copied."""
    moved = 0
    for op in plan.local:
        dst[op.name][op.box.dst_slices()].copy_(src[op.name][op.box.src_slices()])
        moved += op.nbytes
    return moved


def checksum_tensor(buf: torch.Tensor) -> torch.Tensor:
    """A position-weighted checksum of a flat byte buffer, as a 0-d int64 tensor on its device.

    The bytes are read once as 256-byte rows of int64 words: each row is summed and the
    row sums are weighted by their position (a cumulative sum). Ops sit in buckets on
    256-byte boundaries, so a flipped byte, a block written to the wrong offset or a
    bucket delivered to the wrong peer all change it; a swap of two words inside one row
    does not. It stays on the device, so an executor collects every bucket's value and
    reads them all with one host synchronisation per refit. Not a cryptographic digest.
    """
    n = buf.numel()
    if buf.data_ptr() % 8:
        buf = buf.clone()  # a view into a 2-byte dtype may start mid-word
    rows = n // ALIGN
    head = buf[: rows * ALIGN].view(torch.int64)
    total = head.view(rows, _ROW_WORDS).sum(1).cumsum(0).sum() if rows else torch.zeros((), dtype=torch.int64,
                                                                                       device=buf.device)
    tail = buf[rows * ALIGN:]
    if tail.numel():
        total = total + tail.to(torch.int64).sum() * (rows + 1)
    return total + n


def checksum(buf: torch.Tensor) -> int:
    """``checksum_tensor`` read back to the host (one synchronisation; for one-off checks)."""
    return int(checksum_tensor(buf).item())


class ChecksumLedger:
    """Per-bucket checksums of one refit, kept on the device until the refit ends.

    Reading each value as it is computed costs a host synchronisation per bucket (two
    per bucket before, which stalled the CUDA pipeline at every one); the ledger reads
    them all at once.
    """

    def __init__(self) -> None:
        self._sent: list[tuple[tuple[int, int], torch.Tensor]] = []
        self._received: list[tuple[tuple[int, int], torch.Tensor]] = []

    def sent(self, key: tuple[int, int], buf: torch.Tensor) -> None:
        self._sent.append((key, checksum_tensor(buf)))

    def received(self, key: tuple[int, int], buf: torch.Tensor) -> None:
        self._received.append((key, checksum_tensor(buf)))

    def settle(self) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
        """Every checksum as host ints: (sent, received), each keyed (peer, bucket index)."""
        entries = self._sent + self._received
        if not entries:
            return {}, {}
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, value) in enumerate(entries):
            by_device.setdefault(value.device, []).append(i)
        values: list[int] = [0] * len(entries)
        for idx in by_device.values():
            host = torch.stack([entries[i][1] for i in idx]).tolist()
            for i, v in zip(idx, host):
                values[i] = v
        keys = [k for k, _ in entries]
        split = len(self._sent)
        return dict(zip(keys[:split], values[:split])), dict(zip(keys[split:], values[split:]))


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
