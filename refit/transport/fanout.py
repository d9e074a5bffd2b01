"""Replica fan-out execution: stripes from the sources, then an all-gather inside each group.

A plan built with ``build_rank_plan(..., fanout=True)`` has two parts. Its ``sends`` /
``recvs`` carry, for every region that a group of destination ranks needs alike, one
stripe per member from the sources (so the sources send one copy per group, not one per
replica); its ``gather_sends`` / ``gather_recvs`` are the all-gather that completes the
region on every member, each member sending the stripes it received to the others.

``execute_fanout_plan`` runs both parts with the ordinary transport over the same
communicator (gloo or NCCL, whatever ``refit.transport.rounds`` drives): the first part as any
plan, then, after a barrier, the all-gather as a plan of its own whose *source* tensors
are this rank's destination tensors. The barrier keeps the two parts' messages between
one pair of ranks from ever being in flight together, so their round tags cannot be
confused; it costs one store round trip. Every rank of the communicator must call it,
including ranks with nothing to do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from refit.comm.group import Communicator
from refit.plan.planner import RankPlan
from refit.transport.rounds import TransferStats, execute_plan


@dataclass
class FanoutStats:
    """What one rank moved: from the sources (``main``) and inside its groups (``gather``)."""

    main: TransferStats
    gather: TransferStats
    seconds: float

    @property
    def bytes_sent(self) -> int:
        return self.main.bytes_sent + self.gather.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.main.bytes_received + self.gather.bytes_received


def execute_fanout_plan(plan: RankPlan, comm: Communicator, src: Mapping[str, torch.Tensor],
                        dst: Mapping[str, torch.Tensor], *, barrier: bool = True, **kwargs: Any) -> FanoutStats:
    """Run a fan-out plan: the source stripes, a barrier, then the all-gather in each group.

    ``kwargs`` go to ``refit.transport.rounds.execute_plan`` for both parts. A plan built
    without fan-out runs as usual (its all-gather is empty).
    """
    t0 = time.perf_counter()
    main = execute_plan(plan, comm, src, dst, **kwargs)
    if barrier and plan.fanout:
        comm.barrier()
    gather_plan = plan.gather_plan()
    if gather_plan.sends or gather_plan.recvs:
        gather = execute_plan(gather_plan, comm, dst, dst, **kwargs)
    else:
        gather = TransferStats()
    return FanoutStats(main, gather, time.perf_counter() - t0)


__all__ = ["FanoutStats", "execute_fanout_plan"]
