"""Plans cached per rank, keyed so that a grown fleet never reuses a plan made for the old one."""

from __future__ import annotations

from typing import Any

from refit.plan.buckets import DEFAULT_BUCKET_BYTES
from refit.plan.rank_plan import (
    DEFAULT_STRIPE_BYTES,
    RankPlan,
    build_rank_plan,
    fanout_key,
    normalize_domains,
    plan_key,
)
from refit.plan.roster import ParamIndex


class PlanCache:
    """Plans keyed on (world size, roster digest, rank, bucket size).

    The world size is in the key on purpose: a fleet that grows by an engine whose
    rosters happen to digest the same must not reuse a plan sized for the old world.
    """

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._plans: dict[tuple, RankPlan] = {}
        self.hits = 0
        self.misses = 0

    def get(self, index: ParamIndex, rank: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            fanout: bool = False, fanout_domains: Any = None,
            fanout_stripe_bytes: int = DEFAULT_STRIPE_BYTES) -> RankPlan:
        domains = normalize_domains(fanout_domains, index.world_size) if fanout else None
        key = plan_key(index, rank, bucket_bytes, fanout=fanout_key(fanout, fanout_stripe_bytes, domains))
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan
        self.misses += 1
        plan = build_rank_plan(index, rank, bucket_bytes=bucket_bytes, fanout=fanout, fanout_domains=domains,
                               fanout_stripe_bytes=fanout_stripe_bytes)
        if len(self._plans) >= self.max_entries:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()


