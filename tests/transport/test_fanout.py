"""Replica fan-out: plans (exact coverage, matching ids, one copy per group from the sources,
ids stable when replicas join) and real execution over gloo with an all-gather in each group."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit import Replicate, Shard
from refit.testing.launch import LocalFleet
from refit.layout import region_numel
from refit.plan.planner import build_rank_plan, merge_rosters, min_bytes_needed

from layouts import local_slice, rosters_for
from test_plan import WORLD, check_matching, scenarios


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


# -- real transfers over gloo ---------------------------------------------------------------------

FLEET = 6


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(FLEET) as f:
        yield f


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) if len(shape) else torch.tensor(float(seed))


def fanout_job(group, params, seed, plan_kwargs):
    """Every rank: build its fan-out plan from the shared params, run it, check each element."""
    from refit.transport.factory import make_executor

    index = merge_rosters(rosters_for(params, group.world_size), group.world_size)
    plan = build_rank_plan(index, group.rank, fanout=True, **plan_kwargs)
    src, dst, want = {}, {}, {}
    for i, (name, shape, (sm, sp, sdt), dsts) in enumerate(params):
        full = _full(shape, seed + i)
        mine = local_slice(full.to(getattr(torch, sdt)), np.asarray(sm), sp, group.rank)
        if mine is not None:
            src[name] = mine
        for dm, dp, ddt in dsts:
            w = local_slice(full.to(getattr(torch, sdt)).to(getattr(torch, ddt)), np.asarray(dm), dp, group.rank)
            if w is not None:
                want[name] = w
                dst[name] = torch.full(w.shape, float("nan"), dtype=w.dtype)
    with make_executor(plan, group, depth=2) as executor:
        stats = executor.run(src, dst)
        gather = executor.last_gather
    ok = {name: bool(torch.equal(dst[name], want[name])) for name in want}
    return {"ok": ok, "gather_received": gather.bytes_received, "gather_sent": gather.bytes_sent,
            "received": stats.bytes_received - gather.bytes_received, "sent": stats.bytes_sent - gather.bytes_sent}


def _engine_params():
    """Two training ranks; four engine ranks as two TP2 replicas (2,3) and (4,5)."""
    reps = [np.array([2, 3]), np.array([4, 5])]
    return [
        ("qkv", (24, 10), (np.array([0, 1]), [Shard(0)], "float32"), [(m, [Shard(0)], "bfloat16") for m in reps]),
        ("o", (10, 24), (np.array([0, 1]), [Shard(1)], "float32"), [(m, [Shard(1)], "bfloat16") for m in reps]),
        ("norm", (10,), (np.array([[0, 1]]), [Replicate(), Replicate()], "float32"),
         [(m, [Replicate()], "float32") for m in reps]),
        # KV heads shared: one engine layout over all four ranks, [heads, ranks per head]
        ("k", (8, 6), (np.array([0, 1]), [Shard(0)], "float32"),
         [(np.array([[2, 3], [4, 5]]), [Shard(0), Replicate()], "float32")]),
        # colocated: rank 1 is also a destination and copies locally
        ("bias", (9,), (np.array([0, 1]), [Replicate()], "bfloat16"),
         [(np.array([1]), [Replicate()], "bfloat16"), (np.array([2]), [Replicate()], "bfloat16"),
          (np.array([3, 4, 5]), [Shard(0)], "bfloat16")]),
        ("scalar", (), (np.array([0]), [Replicate()], "float32"),
         [(np.array([r]), [Replicate()], "float32") for r in (2, 3, 4, 5)]),
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan_kwargs", [
    dict(bucket_bytes=64, fanout_stripe_bytes=16),
    dict(bucket_bytes=1 << 20, fanout_stripe_bytes=1 << 20),
    dict(bucket_bytes=128, fanout_stripe_bytes=8, fanout_domains=[0, 0, 1, 1, 1, 2]),
])
def test_fanout_over_gloo_every_element(fleet, plan_kwargs):
    params = _engine_params()
    results = fleet.run(fanout_job, params, 7, plan_kwargs, timeout_s=120)
    for r, res in enumerate(results):
        assert all(res["ok"].values()), (r, res)
    assert sorted(results[2]["ok"]) == ["bias", "k", "norm", "o", "qkv", "scalar"]
    assert sum(res["gather_received"] for res in results) > 0
    assert sum(res["gather_sent"] for res in results) == sum(res["gather_received"] for res in results)


@st.composite
def fleet_cases(draw):
    """Random layouts whose destinations often repeat one engine layout on other ranks."""
    from layouts import meshes, placements_for, shapes

    params = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(shapes(max_ndim=3, max_size=9))
        sm = draw(meshes([0, 1, 2]))
        sp = draw(placements_for(sm.ndim, len(shape)))
        dm = draw(meshes([2, 3, 4, 5] if draw(st.booleans()) else [3, 4, 5]))
        dp = draw(placements_for(dm.ndim, len(shape)))
        dt = draw(st.sampled_from(["float32", "bfloat16"]))
        dsts = [(dm, dp, dt)]
        free = [r for r in range(FLEET) if r not in dm.reshape(-1).tolist()]
        if len(free) >= dm.size:  # a second replica of the same engine layout
            dsts.append((np.array(free[: dm.size]).reshape(dm.shape), dp, dt))
        params.append((f"p{i}", shape, (sm, sp, draw(st.sampled_from(["float32", "bfloat16"]))), dsts))
    return params


@pytest.mark.timeout(600)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fleet_cases(), st.integers(0, 100), st.sampled_from([8, 64]))
def test_fanout_over_gloo_random_layouts(fleet, params, seed, stripe):
    results = fleet.run(fanout_job, params, seed, dict(bucket_bytes=96, fanout_stripe_bytes=stripe), timeout_s=120)
    for r, res in enumerate(results):
        assert all(res["ok"].values()), (r, res, params)
