"""The host-driven executor: a rank's plan as rounds of send/recv (gloo, or any tensor-ordered group).

A bucket holding one block that is already contiguous in the right dtype is sent from,
or received into, the tensor itself, and all of those are posted at once before
anything waits: they cost no staging memory, and large tensors never take a copy.

The other buckets are packed. Bucket ``i`` of every pair travels in round ``i``. Every
rank posts a round's receives before its sends and only ever waits on rounds it has
already posted, so no rank can wait on a peer that is waiting on it, whatever the pair
pattern. ``depth`` rounds are in flight at once: packing round ``i+1`` overlaps the
wire of round ``i``, and staging memory stays bounded by ``depth x (send + receive
buckets of one round)``.

Source tensors made during the refit (``SourceProduction``: a trainer's FP8 copies) are
made round by round, just before the first bucket that reads them is packed or posted, so
quantizing the next round's params overlaps the wire of this one; a direct send that
reads one waits for its round instead of going first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from refit.errors import PlanError
from refit.plan import Bucket, RankPlan
from refit.transport.base import (
    Corruption,
    Executor,
    SourceProduction,
    TensorMap,
    TransferStats,
    device_of,
    op_names,
    require_tensors,
)
from refit.transport.buckets import (
    ChecksumLedger,
    StagingPool,
    direct_view,
    local_copies,
    pack_bucket,
    unpack_bucket,
)


@dataclass(frozen=True)
class _Posted:
    """One posted transfer: its bucket, the bytes it moves and whether they are the tensor itself."""

    bucket: Bucket
    buf: torch.Tensor
    direct: bool
    work: object


def _direct_or_staged(buckets: list[Bucket], tensors: TensorMap, side: str
                      ) -> tuple[list[tuple[Bucket, torch.Tensor]], dict[int, list[Bucket]]]:
    """``buckets`` that move straight from or into a view of their tensor, with that view, and the
    others (staged) by round."""
    direct: list[tuple[Bucket, torch.Tensor]] = []
    staged: dict[int, list[Bucket]] = {}
    for b in buckets:
        view = direct_view(b, tensors, side)
        if view is not None:
            direct.append((b, view))
        else:
            staged.setdefault(b.index, []).append(b)
    return direct, staged


class RoundsExecutor(Executor):
    """Runs a ``RankPlan`` by rounds on the host; see the module docstring."""

    transport = "rounds"
    streams_production = True

    def __init__(self, plan: RankPlan, comm, *, depth: int = 2, device: torch.device | None = None):
        if depth < 1:
            raise PlanError(f"depth must be >= 1, got {depth}")
        super().__init__(plan, comm)
        self.depth = depth
        self.device = device
        self._pool: StagingPool | None = None
        self._direct_recvs: list[tuple[Bucket, torch.Tensor]] = []
        self._direct_sends: list[tuple[Bucket, torch.Tensor]] = []
        self._staged_recvs: dict[int, list[Bucket]] = {}
        self._staged_sends: dict[int, list[Bucket]] = {}

    def _bind(self, src: TensorMap, dst: TensorMap) -> None:
        require_tensors(self.plan, src, dst)
        device = self.device or device_of(src, dst)
        if self._pool is None or self._pool.device != device:
            self._pool = StagingPool(device)
        self._direct_recvs, self._staged_recvs = _direct_or_staged(self.plan.recvs, dst, "dst")
        self._direct_sends, self._staged_sends = _direct_or_staged(self.plan.sends, src, "src")

    def _run(self, *, verify: bool, corrupt: Corruption | None,
             production: SourceProduction | None = None) -> TransferStats:
        stats = TransferStats()
        ledger = ChecksumLedger() if verify else None
        t0 = time.perf_counter()
        comm, src, dst = self.comm, self.src, self.dst
        # Blocks that need no staging go first and all at once: their receives write
        # straight into the destination tensors, so posting every one of them costs no
        # memory, and nobody waits on them until the staged rounds are done. A block of a
        # tensor made during the refit waits for its round.
        direct_recvs = [_Posted(b, v, True, comm.irecv(v, b.peer, tag=b.index)) for b, v in self._direct_recvs]
        direct_sends, corrupted_sends, deferred = [], [], {}
        for b, view in self._direct_sends:
            if corrupt is not None:  # a corrupted block must not touch the tensor: stage it
                corrupted_sends.append((b, view))
            elif production is not None and any(production.waiting(op.name) for op in b.ops):
                deferred.setdefault(b.index, []).append((b, view))
            else:
                direct_sends.append(_Posted(b, view, True, comm.isend(view, b.peer, tag=b.index)))
        if production is not None:
            production.produce(op_names([b for b, _ in corrupted_sends]))
        if ledger is not None:  # read while the wire reads them too: the sends are already posted
            for p in direct_sends:
                ledger.sent((p.bucket.peer, p.bucket.index), p.buf)
            for b, view in corrupted_sends:
                ledger.sent((b.peer, b.index), view)
        stats.zero_copy_buckets = len(direct_recvs) + len(direct_sends) + sum(map(len, deferred.values()))
        inflight: deque = deque()
        staging = 0
        for r in range(self.plan.num_rounds):
            recvs = []
            for b in self._staged_recvs.get(r, ()):
                buf = self._pool.take(b.nbytes)
                staging += b.nbytes
                recvs.append(_Posted(b, buf, False, comm.irecv(buf, b.peer, tag=b.index)))
            sends = []
            if production is not None:
                late = deferred.pop(r, [])
                production.produce(op_names([*self._staged_sends.get(r, ()), *(b for b, _ in late)]))
                for b, view in late:
                    sends.append(_Posted(b, view, True, comm.isend(view, b.peer, tag=b.index)))
                    if ledger is not None:
                        ledger.sent((b.peer, b.index), view)
            for b in self._staged_sends.get(r, ()):
                buf = pack_bucket(b, src, self._pool.take(b.nbytes), ledger=ledger, key=(b.peer, b.index))
                staging += b.nbytes
                if corrupt is not None:
                    corrupt(b.peer, b.index, buf)
                sends.append(_Posted(b, buf, False, comm.isend(buf, b.peer, tag=b.index)))
            if r == 0:
                for b, _ in corrupted_sends:
                    buf = pack_bucket(b, src, self._pool.take(b.nbytes))
                    corrupt(b.peer, b.index, buf)
                    sends.append(_Posted(b, buf, False, comm.isend(buf, b.peer, tag=b.index)))
                    staging += b.nbytes
            inflight.append((recvs, sends))
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, staging)
            if r == 0:
                stats.local_bytes = self._local(src, dst, production)
            while len(inflight) >= self.depth:
                staging -= self._finish(inflight.popleft(), stats, ledger)
        if self.plan.num_rounds == 0:
            stats.local_bytes = self._local(src, dst, production)
        while inflight:
            staging -= self._finish(inflight.popleft(), stats, ledger)
        self._finish((direct_recvs, direct_sends), stats, ledger)
        if ledger is not None:
            stats.checksums_sent, stats.checksums_received = ledger.settle()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _local(self, src: TensorMap, dst: TensorMap, production: SourceProduction | None) -> int:
        if production is not None:
            production.produce(dict.fromkeys(op.name for op in self.plan.local))
        return local_copies(self.plan, src, dst)

    def _finish(self, round_works, stats: TransferStats, ledger: ChecksumLedger | None) -> int:
        recvs, sends = round_works
        freed = 0
        for p in recvs:
            self.comm.wait(p.work)
            if p.direct:
                if ledger is not None:
                    ledger.received((p.bucket.peer, p.bucket.index), p.buf)
            else:
                unpack_bucket(p.bucket, p.buf, self.dst, ledger=ledger, key=(p.bucket.peer, p.bucket.index))
                freed += p.bucket.nbytes
                self._pool.give_back(p.buf)
            stats.bytes_received += p.bucket.nbytes
            stats.buckets_received += 1
        for p in sends:
            self.comm.wait(p.work)
            if not p.direct:
                freed += p.bucket.nbytes
                self._pool.give_back(p.buf)
            stats.bytes_sent += p.bucket.nbytes
            stats.buckets_sent += 1
        return freed

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.release()
        self._direct_recvs, self._direct_sends = [], []


__all__ = ["RoundsExecutor"]
