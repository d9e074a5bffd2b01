"""Replica fan-out execution: stripes from the sources, then an all-gather inside each group.

A plan built with ``build_rank_plan(..., fanout=True)`` has two parts. Its ``sends`` /
``recvs`` carry, for every region that a group of destination ranks needs alike, one
stripe per member from the sources (so the sources send one copy per group, not one per
replica); its ``gather_sends`` / ``gather_recvs`` are the all-gather that completes the
region on every member, each member sending the stripes it received to the others.

``FanoutExecutor`` runs both parts with two inner executors over the same communicator:
the first part as any plan, then, after a barrier, the all-gather as a plan of its own
whose *source* tensors are this rank's destination tensors. The barrier keeps the two
parts' messages between one pair of ranks from ever being in flight together, so their
round tags cannot be confused; it costs one store round trip. Every rank of the
communicator must run it, including ranks with nothing to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from refit.plan import RankPlan
from refit.transport.base import Corruption, Executor, TensorMap, TransferStats


class FanoutExecutor(Executor):
    """A fan-out plan: the source stripes, a barrier, then the all-gather in each group.

    ``make_part`` builds the executor of each part (the same transport for both).
    ``last_gather`` holds the all-gather's own stats after each run.
    """

    transport = "fanout"

    def __init__(self, plan: RankPlan, comm, make_part: Callable[[RankPlan], Executor], *, barrier: bool = True):
        super().__init__(plan, comm)
        self.barrier = barrier
        self.main = make_part(plan)
        gather_plan = plan.gather_plan()
        self.gather = make_part(gather_plan) if (gather_plan.sends or gather_plan.recvs) else None
        self.last_gather = TransferStats()

    def _bind(self, src: TensorMap, dst: TensorMap) -> None:
        self.main.prepare(src, dst)
        if self.gather is not None:
            self.gather.prepare(dst, dst)

    def _run(self, *, verify: bool, corrupt: Corruption | None) -> TransferStats:
        t0 = time.perf_counter()
        stats = self.main.run(verify=verify, corrupt=corrupt)
        if self.barrier and self.plan.fanout:
            self.comm.barrier()
        self.last_gather = self.gather.run(verify=verify) if self.gather is not None else TransferStats()
        g = self.last_gather
        stats.bytes_sent += g.bytes_sent
        stats.bytes_received += g.bytes_received
        stats.buckets_sent += g.buckets_sent
        stats.buckets_received += g.buckets_received
        stats.seconds = time.perf_counter() - t0
        return stats

    def _release(self) -> None:
        self.main.close()
        if self.gather is not None:
            self.gather.close()


__all__ = ["FanoutExecutor"]
