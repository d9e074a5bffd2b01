"""Planner properties (a)-(h) on rosters alone: no process group, every rank's plan built locally."""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections import defaultdict

import numpy as np
import pytest
from helpers.layouts import rosters_for
from helpers.plans import WORLD, all_plans, check_exact_coverage, check_matching, scenarios, with_shared_layouts
from hypothesis import given, settings
from hypothesis import strategies as st

from refit import LayoutError, PlanError, Replicate, Shard
from refit.layout import dtype_from_name, region_numel, region_overlap_numel
from refit.plan import (
    PlanCache,
    PlanStats,
    RosterEntry,
    build_rank_plan,
    default_plan_cache,
    merge_rosters,
    min_bytes_needed,
)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.sampled_from([16, 64, 1 << 20]))
def test_plans_agree_and_cover_exactly(params, bucket_bytes):
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    plans = all_plans(index, bucket_bytes)
    check_matching(plans)
    check_exact_coverage(index, plans)
    moved = sum(p.bytes_sent for p in plans.values())
    payload = sum(op.nbytes for p in plans.values() for op in p.send_ops())
    assert payload == min_bytes_needed(index), "bytes moved equal the minimum needed"
    assert moved - payload <= 8 * sum(len(p.sends) for p in plans.values()), "only alignment padding on top"


@settings(max_examples=80, deadline=None)
@given(scenarios())
def test_appending_ranks_keeps_task_ids(params):
    """(b): a new engine joining (higher ranks, appended to the rosters) renumbers nothing."""
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    before = all_plans(index)
    grown = []
    for name, shape, src, dsts in params:
        dm = np.arange(WORLD, WORLD + 3)
        grown.append((name, shape, src, dsts + [(dm, [Shard(0)] if shape else [Replicate()], "float32")]))
    bigger = merge_rosters(rosters_for(grown, WORLD + 3), WORLD + 3)
    after = all_plans(bigger)
    for r in range(WORLD):
        old = {op.task_id: (op.name, op.box) for op in before[r].recv_ops() + before[r].local if op.dst == r}
        new = {op.task_id: (op.name, op.box) for op in after[r].recv_ops() + after[r].local if op.dst == r}
        assert old == new


def test_replicas_share_the_sending_load():
    """(d): no replica sends more than ceil(total/replicas) plus one region of a param."""
    shape = (64, 16)
    src = (np.arange(4), [Replicate()], "float32")  # 4 replicas
    dsts = [(np.arange(4 + 3 * g, 7 + 3 * g), [Shard(0)], "float32") for g in range(4)]  # 4 engines of TP3
    index = merge_rosters(rosters_for([("w", shape, src, dsts)], 16), 16)
    plans = all_plans(index, bucket_bytes=1 << 20)
    sent = [plans[r].bytes_sent for r in range(4)]
    total = sum(sent)
    assert total == 4 * math.prod(shape) * 4
    biggest_region = max(region_numel(d.region(shape, r)) * 4 for d in index.specs["w"].dsts for r in d.mesh_ranks)
    assert max(sent) <= math.ceil(total / 4) + biggest_region
    assert min(sent) > 0


def _groups(index):
    """Params sharing shape and layouts: the planner lays their bytes end to end."""
    out = defaultdict(list)
    for spec in index.specs.values():
        out[(spec.shape, spec.src, spec.dsts)].append(spec.name)
    return out


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.booleans())
def test_load_bound_holds_for_random_layouts(params, shared):
    """(d) per group of params sharing shape and layouts: each replica of a source shard sends
    at most its even share of the group's bytes plus one param's consumer bytes."""
    if shared:
        params = with_shared_layouts(params)
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    plans = all_plans(index, bucket_bytes=1 << 30)
    for (shape, src, dsts), names in _groups(index).items():
        per_rank = defaultdict(int)
        for r, p in plans.items():
            for op in p.send_ops():
                if op.name in names:
                    per_rank[r] += op.nbytes
        for r in src.mesh_ranks:
            key = src.shard_key(r)
            replicas = src.replicas(key)
            total = sum(per_rank[x] for x in replicas)
            region = src.region(shape, r)
            one = max((region_overlap_numel(region, d.region(shape, x)) *
                       dtype_from_name(d.dtype).itemsize * 2  # upper bound on wire itemsize ratio
                       for d in dsts for x in d.mesh_ranks), default=0)
            assert per_rank[r] <= math.ceil(total / len(replicas)) + one


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.booleans())
def test_a_destination_meets_few_replicas_of_a_group(params, shared):
    """A destination rank gets a group's part of one source shard from the replicas whose
    windows its bytes span: one or two when its share is below one replica's, never one per param."""
    if shared:
        params = with_shared_layouts(params)
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    plans = all_plans(index, bucket_bytes=1 << 30)
    for (_, src, dsts), names in _groups(index).items():
        got = defaultdict(lambda: defaultdict(int))  # shard -> destination -> bytes
        senders = defaultdict(lambda: defaultdict(set))
        for d in {x for lay in dsts for x in lay.mesh_ranks}:
            for op in plans[d].recv_ops():
                if op.name in names:
                    key = src.shard_key(op.src)
                    got[key][d] += op.nbytes
                    senders[key][d].add(op.src)
        for key, per_dst in got.items():
            whole, k = sum(per_dst.values()), len(src.replicas(key))
            for d, nbytes in per_dst.items():
                # its bytes are one contiguous stretch of the group's stream: they meet at most
                # the windows that stretch spans
                assert len(senders[key][d]) <= -(-nbytes * k // whole) + 1


def test_planning_work_follows_own_ops():
    """(e): adding engines that a rank has nothing to do with does not grow its planning work."""
    def index_with(engines):
        src = (np.arange(8), [Shard(0)], "bfloat16")
        dsts = [(np.arange(8 + 4 * g, 12 + 4 * g), [Shard(0)], "bfloat16") for g in range(engines)]
        params = [(f"layer{i}.w", (256, 64), src, dsts) for i in range(4)]
        world = 8 + 4 * engines
        return merge_rosters(rosters_for(params, world), world)

    def work(index, rank):
        stats = PlanStats()
        plan = build_rank_plan(index, rank, stats=stats)
        return stats, len(plan.recv_ops()) + len(plan.send_ops())

    small_stats, small_ops = work(index_with(2), 9)
    big_stats, big_ops = work(index_with(64), 9)
    assert small_ops == big_ops
    assert big_stats.regions == small_stats.regions
    assert big_stats.consumers_walked == small_stats.consumers_walked
    # a source rank's work grows with the consumers it serves, proportionally
    s_small, ops_small = work(index_with(2), 0)
    s_big, ops_big = work(index_with(64), 0)
    assert ops_big == 32 * ops_small
    assert s_big.regions <= 40 * s_small.regions


def test_buckets_coalesce_in_canonical_order():
    """(f): many small params between one pair travel in few buckets of bounded size."""
    params = [(f"t{i:03d}", (16, 16), ([0], [Replicate()], "float32"), [([1], [Replicate()], "float32")])
              for i in range(100)]
    index = merge_rosters(rosters_for(params, 2), 2)
    plan = build_rank_plan(index, 0, bucket_bytes=16 * 16 * 4 * 10)
    assert len(plan.sends) == 10 and all(len(b.ops) == 10 for b in plan.sends)
    names = [op.name for b in plan.sends for op in b.ops]
    assert names == sorted(names)
    assert [b.index for b in plan.sends] == list(range(10))


def test_large_block_is_split_into_row_blocks():
    params = [("big", (1000, 10), ([0], [Replicate()], "float32"), [([1], [Replicate()], "float32")])]
    index = merge_rosters(rosters_for(params, 2), 2)
    plan = build_rank_plan(index, 0, bucket_bytes=4000)
    assert len(plan.sends) == 10
    assert all(b.nbytes == 4000 for b in plan.sends)


def test_cast_happens_on_the_narrow_side():
    """(g): fp32 -> bf16 is cast while packing: the wire carries 2 bytes per element."""
    params = [("w", (8, 8), ([0], [Replicate()], "float32"), [([1], [Replicate()], "bfloat16")])]
    index = merge_rosters(rosters_for(params, 2), 2)
    plan = build_rank_plan(index, 0)
    (op,) = plan.send_ops()
    assert op.wire_dtype == "bfloat16" and plan.bytes_sent == 8 * 8 * 2
    widening = [("w", (8, 8), ([0], [Replicate()], "bfloat16"), [([1], [Replicate()], "float32")])]
    plan = build_rank_plan(merge_rosters(rosters_for(widening, 2), 2), 0)
    assert plan.send_ops()[0].wire_dtype == "bfloat16"


def test_plan_cache_key_has_world_size_and_digest():
    """(h)"""
    params = [("w", (8, 8), ([0], [Replicate()], "float32"), [([1], [Replicate()], "float32")])]
    cache = PlanCache()
    a = merge_rosters(rosters_for(params, 2), 2)
    cache.get(a, 0)
    cache.get(merge_rosters(rosters_for(params, 2), 2), 0)
    assert (cache.hits, cache.misses) == (1, 1)
    grown = merge_rosters(rosters_for(params, 3), 3)  # same rosters, one more (idle) rank
    assert grown.digest != a.digest
    p = cache.get(grown, 0)
    assert cache.misses == 2 and p.key[0] == 3
    changed = [("w", (8, 8), ([0], [Replicate()], "float32"), [([1], [Replicate()], "bfloat16")])]
    cache.get(merge_rosters(rosters_for(changed, 2), 2), 0)
    assert cache.misses == 3


def test_index_and_plan_are_frozen_and_pickle_without_planning_state():
    params = [("w", (8, 8), ([0], [Shard(0)], "float32"), [([1, 2], [Shard(1)], "float32")])]
    index = merge_rosters(rosters_for(params, 3), 3)
    cache = PlanCache()
    plan = cache.get(index, 1)
    for obj, attr, value in ((index, "world_size", 4), (index, "digest", "x"), (plan, "sends", []),
                             (plan, "fanout", True)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, value)
    assert not hasattr(index, "__dict__") and not hasattr(plan, "__dict__")  # nothing stashed on them
    assert index.digest == merge_rosters(rosters_for(params, 3), 3).digest  # made with the index

    copy = pickle.loads(pickle.dumps(index))
    assert (copy.world_size, copy.digest, dict(copy.by_rank)) == (index.world_size, index.digest, dict(index.by_rank))
    assert dict(copy.specs) == dict(index.specs)
    assert b"PlannerCache" not in pickle.dumps(index)
    assert pickle.loads(pickle.dumps(plan)) == plan
    # the planning state belongs to the cache, keyed on the digest: a copy of the index shares it
    assert cache.planner(copy) is cache.planner(index)
    assert cache.planner(index) is not default_plan_cache().planner(index)
    assert build_rank_plan(copy, 1, cache=cache) == plan


# -- bad input: clear errors naming the param and the ranks -------------------------------

def _entry(name, shape, mesh, placements, role, dtype="float32"):
    return RosterEntry.make(name, shape, dtype, mesh, placements, role)


def test_destination_without_source():
    rosters = {0: [_entry("w", (4,), [0], [Shard(0)], "src")], 1: [_entry("v", (4,), [1], [Shard(0)], "dst")]}
    with pytest.raises(PlanError, match=r"v: destination ranks \[1\] need this param but no source rank holds it"):
        merge_rosters(rosters, 2)


def test_shape_mismatch():
    rosters = {0: [_entry("w", (4, 2), [0], [Shard(0)], "src")], 1: [_entry("w", (4, 3), [1], [Shard(0)], "dst")]}
    with pytest.raises(PlanError, match=r"w: global shape mismatch: \[4, 2\] on ranks \[0\]; \[4, 3\] on ranks \[1\]"):
        merge_rosters(rosters, 2)


def test_placements_count_and_shard_dim():
    with pytest.raises(LayoutError, match=r"w \(src on rank 0\): 1 placement"):
        merge_rosters({0: [_entry("w", (4,), [[0]], [Shard(0)], "src")]}, 1)
    with pytest.raises(LayoutError, match=r"w \(dst on rank 1\): Shard\(3\) shards dim 3"):
        merge_rosters({0: [_entry("w", (4,), [0], [Shard(0)], "src")],
                       1: [_entry("w", (4,), [1], [Shard(3)], "dst")]}, 2)


def test_mesh_rank_outside_group_and_duplicates():
    with pytest.raises(LayoutError, match=r"mesh rank\(s\) \[5\] outside the process group of world size 2"):
        merge_rosters({0: [_entry("w", (4,), [0, 5], [Shard(0)], "src")]}, 2)
    with pytest.raises(LayoutError, match=r"rank\(s\) \[0\] listed more than once"):
        merge_rosters({0: [_entry("w", (4,), [0, 0], [Shard(0)], "src")]}, 2)


def test_mesh_rank_that_did_not_report():
    with pytest.raises(PlanError, match=r"w: src ranks \[1\] are in mesh \[0, 1\] reported by ranks \[0\]"):
        merge_rosters({0: [_entry("w", (4,), [0, 1], [Shard(0)], "src")], 1: []}, 2)


def test_sources_disagree():
    rosters = {0: [_entry("w", (4,), [0, 1], [Shard(0)], "src")], 1: [_entry("w", (4,), [0, 1], [Replicate()], "src")]}
    with pytest.raises(PlanError, match="source ranks disagree"):
        merge_rosters(rosters, 2)
