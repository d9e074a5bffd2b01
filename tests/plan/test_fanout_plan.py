"""Replica fan-out plans: exact coverage, matching ids, one copy per group from the sources, ids stable
when replicas join (the execution over gloo is in transport/test_fanout.py)."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
from helpers.layouts import rosters_for
from helpers.plans import WORLD, check_matching, scenarios
from hypothesis import given, settings
from hypothesis import strategies as st

from refit import Replicate, Shard
from refit.layout import region_numel
from refit.plan import build_rank_plan, merge_rosters, min_bytes_needed


def fan_plans(index, **kw):
    kw.setdefault("bucket_bytes", 64)
    kw.setdefault("fanout_stripe_bytes", 16)
    return {r: build_rank_plan(index, r, fanout=True, **kw) for r in range(index.world_size)}


def gather_ops(plan, side):
    return [op for b in (plan.gather_sends if side == "send" else plan.gather_recvs) for op in b.ops]


def check_fanout_plans(index, plans, domains=None):
    check_matching(plans)  # the sources' part
    sent = {(op.task_id, op.dst): (r, op.box, op.name) for r, p in plans.items() for op in gather_ops(p, "send")}
    got = {(op.task_id, op.dst): (op.src, op.box, op.name) for r, p in plans.items() for op in gather_ops(p, "recv")}
    assert sent == got  # the all-gather's sends and receives agree
    for spec in index.specs.values():
        for layout in spec.dsts:
            for r in layout.mesh_ranks:
                region = layout.region(spec.shape, r)
                hits = Counter()
                for op in plans[r].recv_ops() + plans[r].local + gather_ops(plans[r], "recv"):
                    if op.name == spec.name:
                        for idx in np.ndindex(*op.box.shape):
                            hits[tuple(s + i for s, i in zip(op.box.dst_start, idx))] += 1
                assert sum(hits.values()) == region_numel(region), (spec.name, r)
                assert all(v == 1 for v in hits.values()), (spec.name, r)
    for r, p in plans.items():
        for op in gather_ops(p, "send"):
            spec = index.specs[op.name]
            lay = next(lay for lay in spec.dsts if lay.coords(r) is not None)
            peer = next(lay for lay in spec.dsts if lay.coords(op.dst) is not None)
            assert lay.region(spec.shape, r) == peer.region(spec.shape, op.dst)  # only inside a group
            assert spec.src.coords(r) is None and spec.src.coords(op.dst) is None
            if domains is not None:
                assert domains[r] == domains[op.dst]


@settings(max_examples=120, deadline=None)
@given(scenarios(), st.sampled_from([1, 16, 1 << 20]), st.sampled_from([None, [0, 0, 0, 0, 1, 1, 1, 1]]))
def test_fanout_plans_cover_exactly_and_agree(params, stripe_bytes, domains):
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    plans = fan_plans(index, fanout_stripe_bytes=stripe_bytes, fanout_domains=domains)
    check_fanout_plans(index, plans, domains)
    from_sources = sum(p.bytes_sent for p in plans.values())
    assert from_sources <= min_bytes_needed(index) + 8 * sum(len(p.sends) for p in plans.values())


def test_sources_send_one_copy_per_group():
    """Four engine replicas of TP2 and a replicated norm: each region leaves the sources once."""
    params = [("w", (64, 32), (np.arange(2), [Shard(0)], "float32"),
               [(np.array([2 + 2 * e, 3 + 2 * e]), [Shard(0)], "bfloat16") for e in range(4)]),
              ("norm", (32,), (np.arange(2), [Replicate()], "float32"),
               [(np.array([2 + 2 * e, 3 + 2 * e]), [Replicate()], "bfloat16") for e in range(4)])]
    index = merge_rosters(rosters_for(params, 10), 10)
    plain = {r: build_rank_plan(index, r) for r in range(10)}
    plans = fan_plans(index)
    sent = defaultdict(int)
    for p in plans.values():
        for op in p.send_ops():
            sent[op.name] += op.nbytes
    assert sent == {"w": 64 * 32 * 2, "norm": 32 * 2}  # once, not four / eight times
    assert sum(p.bytes_received for p in plain.values()) == 4 * 64 * 32 * 2 + 8 * 32 * 2
    for r in range(2, 10):  # every engine rank still ends up with its whole region
        assert plans[r].bytes_received + plans[r].gather_bytes_received == plain[r].bytes_received
    owned = [plans[r].bytes_received for r in range(2, 10)]
    assert max(owned) - min(owned) <= 2 * 16  # stripes spread evenly over the members
    assert not plain[2].gather_recvs and not plain[2].fanout


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_fanout_task_ids_stable_when_replicas_join(params):
    """A replica joining (new ranks copying an existing engine layout) re-cuts nothing."""
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    before = fan_plans(index)
    grown, extra = [], 0
    for name, shape, src, dsts in params:
        dm, dp, dt = dsts[0]
        new = np.arange(WORLD, WORLD + dm.size).reshape(dm.shape)
        extra = max(extra, dm.size)
        grown.append((name, shape, src, dsts + [(new, dp, dt)]))
    bigger = merge_rosters(rosters_for(grown, WORLD + extra), WORLD + extra)
    after = fan_plans(bigger)

    def received(plan, r):
        ops = plan.recv_ops() + plan.local + gather_ops(plan, "recv")
        return {op.task_id: (op.name, op.box.start, op.box.shape) for op in ops if op.dst == r}

    for r in range(WORLD):
        assert received(before[r], r) == received(after[r], r)
