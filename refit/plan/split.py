"""One rank's plan cut in two by peer: the pairs one transport moves, and the rest.

A fleet spread over several nodes moves the pairs inside a node through shared memory
(CUDA IPC), and only the pairs between nodes over the network. Both ends of a pair
decide alike, since each cut depends only on the pair (the same node set on every rank),
and a bucket keeps its index, so the two parts' sends and receives still match one to one.
"""

from __future__ import annotations

from collections.abc import Collection

from refit.errors import PlanError
from refit.plan.rank_plan import RankPlan


def split_plan(plan: RankPlan, near: Collection[int]) -> tuple[RankPlan, RankPlan]:
    """``plan`` as (the pairs with a rank in ``near``, the others); local copies go with the first.

    ``near`` is every rank this rank reaches the first way (its node's other ranks). Fan-out
    plans are refused: their all-gather groups span the cut.
    """
    if plan.fanout:
        raise PlanError(f"rank {plan.rank}: a fan-out plan cannot be split by peer (its all-gather groups span the "
                        "split); build it with fanout=False")
    near = frozenset(int(r) for r in near) - {plan.rank}

    def part(label: str, keep) -> RankPlan:
        return RankPlan(plan.rank, plan.world_size, plan.bucket_bytes, plan.key + ("split", label, tuple(sorted(near))),
                        sends=[b for b in plan.sends if keep(b.peer)], recvs=[b for b in plan.recvs if keep(b.peer)],
                        local=list(plan.local) if label == "near" else [])

    return part("near", near.__contains__), part("far", lambda p: p not in near)


__all__ = ["split_plan"]
