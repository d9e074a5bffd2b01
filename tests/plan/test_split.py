"""``split_plan``: a plan cut by node is two plans that each match on both ends, and together the whole."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.layouts import rosters_for
from helpers.plans import WORLD, all_plans, check_matching, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st

from refit import PlanError, Replicate, Shard
from refit.plan import build_rank_plan, merge_rosters, split_plan


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.lists(st.integers(0, 2), min_size=WORLD, max_size=WORLD), st.sampled_from([16, 1 << 20]))
def test_split_by_node_keeps_both_halves_matched_and_loses_nothing(params, node_of, bucket_bytes):
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    plans = all_plans(index, bucket_bytes)
    near, far = {}, {}
    for r, plan in plans.items():
        same = {q for q in range(WORLD) if node_of[q] == node_of[r]}
        near[r], far[r] = split_plan(plan, same)
        assert {b.peer for b in near[r].sends + near[r].recvs} <= same - {r}
        assert not ({b.peer for b in far[r].sends + far[r].recvs} & same)
        # together the whole plan, each bucket in one part, local copies in the near part
        assert sorted((b.peer, b.index) for b in near[r].sends + far[r].sends) == \
            sorted((b.peer, b.index) for b in plan.sends)
        assert sorted((b.peer, b.index) for b in near[r].recvs + far[r].recvs) == \
            sorted((b.peer, b.index) for b in plan.recvs)
        assert near[r].local == plan.local and far[r].local == []
        assert near[r].key != far[r].key != plan.key
    check_matching(near)  # each part's sends meet their receives on the other end
    check_matching(far)


def test_fanout_plans_are_not_split():
    params = [("w", (8, 4), (np.array([0]), [Replicate()], "float32"),
               [(np.array([1, 2]), [Shard(0)], "float32"), (np.array([3, 4]), [Shard(0)], "float32")])]
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    plan = build_rank_plan(index, 0, fanout=True)
    with pytest.raises(PlanError, match="fan-out plan cannot be split"):
        split_plan(plan, {1, 2})
