"""Executes one rank's plan over a communicator: pack, send/recv by rounds, unpack in place.

A bucket holding one block that is already contiguous in the right dtype is sent from,
or received into, the tensor itself, and all of those are posted at once before
anything waits: they cost no staging memory, and large tensors never take a copy.

The other buckets are packed. Bucket ``i`` of every pair travels in round ``i``. Every
rank posts a round's receives before its sends and only ever waits on rounds it has
already posted, so no rank can wait on a peer that is waiting on it, whatever the pair
pattern. ``depth`` rounds are in flight at once: packing round ``i+1`` overlaps the
wire of round ``i``, and staging memory stays bounded by ``depth x (send + receive
buckets of one round)``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from refit.comm.group import Communicator
from refit.errors import PlanError
from refit.layout import dtype_from_name
from refit.plan.planner import Bucket, Op, RankPlan


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    local_bytes: int = 0
    buckets_sent: int = 0
    buckets_received: int = 0
    zero_copy_buckets: int = 0
    peak_staging_bytes: int = 0
    seconds: float = 0.0
    staging_capacity_bytes: int = 0  # staging memory held (streamed path: the arena, <= its budget)
    groups: int = 0  # streamed path: NCCL groups (windows of rounds) issued
    timing: dict = field(default_factory=dict)  # streamed path with timing=True: host and CUDA-event marks
    checksums_sent: dict[tuple[int, int], int] = field(default_factory=dict)
    checksums_received: dict[tuple[int, int], int] = field(default_factory=dict)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _op_view(buf: torch.Tensor, op: Op, offset: int) -> torch.Tensor:
    return buf[offset: offset + op.nbytes].view(dtype_from_name(op.wire_dtype)).view(op.box.shape)


def single_block(bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> tuple[Op, torch.Tensor] | None:
    """The bucket's one op and its tensor, when the bucket is one block already in the wire dtype."""
    if len(bucket.ops) != 1:
        return None
    op = bucket.ops[0]
    t = tensors[op.name]
    return (op, t) if t.dtype == dtype_from_name(op.wire_dtype) else None


def direct_view(bucket: Bucket, tensors: Mapping[str, torch.Tensor], side: str) -> torch.Tensor | None:
    """The tensor region itself, when the bucket is one block needing no cast or gather."""
    found = single_block(bucket, tensors)
    if found is None:
        return None
    op, t = found
    view = t[op.box.src_slices() if side == "src" else op.box.dst_slices()]
    if not view.is_contiguous():
        return None
    return _flat_bytes(view)


def pack_bucket(b: Bucket, src: Mapping[str, torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    """Copy (and cast) the bucket's source blocks into the flat byte buffer ``buf``."""
    if b.nbytes != b.payload_bytes:
        buf.zero_()  # alignment padding: keep checksums deterministic
    for op, off in zip(b.ops, b.offsets):
        _op_view(buf, op, off).copy_(src[op.name][op.box.src_slices()])
    return buf


def unpack_bucket(b: Bucket, buf: torch.Tensor, dst: Mapping[str, torch.Tensor]) -> None:
    """Copy (and cast) the bucket's blocks from the flat byte buffer ``buf`` into their destinations."""
    for op, off in zip(b.ops, b.offsets):
        dst[op.name][op.box.dst_slices()].copy_(_op_view(buf, op, off))


def checksum(buf: torch.Tensor) -> int:
    """A cheap order-sensitive checksum of a byte buffer (position-weighted sum of int32 words).

    Catches a flipped or misplaced byte in a bucket; it is not a cryptographic digest.
    """
    n = buf.numel() // 4 * 4
    head = buf[:n]
    if head.data_ptr() % 4:
        head = head.clone()  # an in-place view of a bf16/fp16 tensor may start mid-word
    words = head.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=buf.device) % 65521
    total = int((words * weights).sum().item()) if words.numel() else 0
    tail = buf[n:].to(torch.int64)
    total += int(tail.sum().item()) if tail.numel() else 0
    return (total + buf.numel()) & 0xFFFFFFFFFFFF


_POOL_GRAIN = 1 << 20  # staging capacities are rounded up to this, so odd sizes share buffers


class PlanExecutor:
    """Runs a ``RankPlan`` against this rank's source and destination local tensors."""

    def __init__(self, plan: RankPlan, comm: Communicator, *, depth: int = 2, device: torch.device | None = None,
                 verify: bool = False, corrupt: Callable[[Bucket, torch.Tensor], None] | None = None,
                 pipeline: str = "auto", staging_budget_bytes: int | None = None, group_bytes: int | None = None,
                 sync: bool = True, timing: bool = False):
        """``pipeline``: ``"rounds"`` (this class's host-driven rounds), ``"streamed"`` (the
        CUDA-stream pipeline of ``refit.transport.streamed``, bounded by ``staging_budget_bytes``; on CPU
        tensors it runs on the host), or ``"auto"``: streamed for CUDA tensors on a
        stream-ordered (NCCL) communicator, rounds otherwise. ``sync=False`` (streamed only)
        returns once the work is queued; the caller's stream is ordered after it."""
        if depth < 1:
            raise PlanError(f"depth must be >= 1, got {depth}")
        if pipeline not in ("auto", "rounds", "streamed"):
            raise PlanError(f"pipeline must be 'auto', 'rounds' or 'streamed', got {pipeline!r}")
        self.pipeline = pipeline
        self.staging_budget_bytes = staging_budget_bytes
        self.group_bytes = group_bytes
        self.sync = sync
        self.timing = timing
        self.plan = plan
        self.comm = comm
        self.depth = depth
        self.device = device
        self.verify = verify
        self._corrupt = corrupt  # fault injection for tests: mutates a packed send buffer
        self._view_cache: dict[str, tuple] = {}
        self._pool: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._by_round_send: dict[int, list[Bucket]] = {}
        self._by_round_recv: dict[int, list[Bucket]] = {}
        for b in plan.sends:
            self._by_round_send.setdefault(b.index, []).append(b)
        for b in plan.recvs:
            self._by_round_recv.setdefault(b.index, []).append(b)

    def _device_of(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> torch.device:
        if self.device is not None:
            return self.device
        for t in list(src.values()) + list(dst.values()):
            return t.device
        return torch.device("cpu")

    def run(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> TransferStats:
        device = self._device_of(src, dst)
        mode = self.pipeline
        if mode == "auto":
            mode = "streamed" if device.type == "cuda" and getattr(self.comm, "stream_ordered", False) else "rounds"
        if mode == "streamed":
            from refit.transport.streamed import StreamedExecutor

            return StreamedExecutor(
                self.plan, self.comm, device=device, verify=self.verify, corrupt=self._corrupt,
                staging_budget_bytes=self.staging_budget_bytes, group_bytes=self.group_bytes, sync=self.sync,
                timing=self.timing,
            ).run(src, dst)
        stats = TransferStats()
        t0 = time.perf_counter()
        # Blocks that need no staging go first and all at once: their receives write
        # straight into the destination tensors, so posting every one of them costs no
        # memory, and nobody waits on them until the staged rounds are done.
        direct_recvs, direct_sends = [], []
        for b, view in self._direct_views(dst, "dst"):
            direct_recvs.append((b, view, True, self.comm.irecv(view, b.peer, tag=b.index)))
        for b, view in self._direct_views(src, "src") if self._corrupt is None else ():
            if self.verify:
                stats.checksums_sent[(b.peer, b.index)] = checksum(view)
            direct_sends.append((b, view, True, self.comm.isend(view, b.peer, tag=b.index)))
        stats.zero_copy_buckets = len(direct_recvs) + len(direct_sends)
        done = {("recv", w[0].peer, w[0].index) for w in direct_recvs}
        done |= {("send", w[0].peer, w[0].index) for w in direct_sends}
        inflight: deque = deque()
        staging = 0
        local_done = False
        for r in range(self.plan.num_rounds):
            recvs = []
            for b in self._by_round_recv.get(r, ()):
                if ("recv", b.peer, b.index) in done:
                    continue
                buf = self._staging(b.nbytes, device)
                staging += b.nbytes
                recvs.append((b, buf, False, self.comm.irecv(buf, b.peer, tag=b.index)))
            sends = []
            for b in self._by_round_send.get(r, ()):
                if ("send", b.peer, b.index) in done:
                    continue
                buf = self._pack(b, src, device)
                staging += b.nbytes
                if self.verify:
                    stats.checksums_sent[(b.peer, b.index)] = checksum(buf)
                if self._corrupt is not None:
                    self._corrupt(b, buf)
                sends.append((b, buf, False, self.comm.isend(buf, b.peer, tag=b.index)))
            inflight.append((recvs, sends))
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, staging)
            if not local_done:
                self._local_copies(src, dst, stats)
                local_done = True
            while len(inflight) >= self.depth:
                staging -= self._finish(inflight.popleft(), dst, stats)
        if not local_done:
            self._local_copies(src, dst, stats)
        while inflight:
            staging -= self._finish(inflight.popleft(), dst, stats)
        self._finish((direct_recvs, direct_sends), dst, stats)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _direct_views(self, tensors: Mapping[str, torch.Tensor], side: str) -> list[tuple[Bucket, torch.Tensor]]:
        """Buckets that move straight from / into ``tensors``, with their byte views.

        Kept across runs while the same tensor objects are handed in: a refit repeats
        every step with the same parameters, and rebuilding hundreds of views each time
        costs a CPU host more than the copies they avoid.
        """
        key = (side, tuple((n, id(t)) for n, t in tensors.items()))
        cached = self._view_cache.get(side)
        if cached is not None and cached[0] == key:
            return cached[1]
        buckets = self.plan.recvs if side == "dst" else self.plan.sends
        views = [(b, v) for b in buckets if (v := direct_view(b, tensors, side)) is not None]
        self._view_cache[side] = (key, views, dict(tensors))  # holds the tensors: ids stay theirs
        return views

    def _pack(self, b: Bucket, src: Mapping[str, torch.Tensor], device) -> torch.Tensor:
        return pack_bucket(b, src, self._staging(b.nbytes, device))

    def _staging(self, nbytes: int, device) -> torch.Tensor:
        """A staging buffer from the pool this executor keeps across refits.

        Fresh multi-MB host buffers are new pages from the kernel each time, and faulting
        them in cost more than the copies into them (measured: 35x slower packing). The
        pool never holds more than the peak staging of one refit; ``release_staging()``
        gives it back.
        """
        capacity = -(-nbytes // _POOL_GRAIN) * _POOL_GRAIN
        free = self._pool.get((capacity, str(device)))
        base = free.pop() if free else torch.empty(capacity, dtype=torch.uint8, device=device)
        return base[:nbytes]

    def _recycle(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        self._pool.setdefault((base.numel(), str(base.device)), []).append(base)

    def release_staging(self) -> None:
        """Drop the pooled staging buffers (they are otherwise reused by the next run)."""
        self._pool.clear()

    def _finish(self, round_works, dst: Mapping[str, torch.Tensor], stats: TransferStats) -> int:
        recvs, sends = round_works
        freed = 0
        for b, buf, direct, work in recvs:
            self.comm.wait(work)
            if self.verify:
                stats.checksums_received[(b.peer, b.index)] = checksum(buf)
            if not direct:
                unpack_bucket(b, buf, dst)
                freed += b.nbytes
                self._recycle(buf)
            stats.bytes_received += b.nbytes
            stats.buckets_received += 1
        for b, buf, direct, work in sends:
            self.comm.wait(work)
            if not direct:
                freed += b.nbytes
                self._recycle(buf)
            stats.bytes_sent += b.nbytes
            stats.buckets_sent += 1
        return freed

    def _local_copies(self, src, dst, stats: TransferStats) -> None:
        for op in self.plan.local:
            dst[op.name][op.box.dst_slices()].copy_(src[op.name][op.box.src_slices()])
            stats.local_bytes += op.nbytes


def execute_plan(plan: RankPlan, comm: Communicator, src: Mapping[str, torch.Tensor],
                 dst: Mapping[str, torch.Tensor], **kwargs) -> TransferStats:
    return PlanExecutor(plan, comm, **kwargs).run(src, dst)
