"""Rosters as groups: ranks report one entry per layout, the merge reads each distinct group
once, and the index, its digest and every plan are what the per-entry merge gave."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
from helpers.layouts import rosters_for
from helpers.plans import WORLD, scenarios, with_shared_layouts
from helpers.reference_merge import reference_merge
from helpers.tiny_models import MODELS_AND_LAYOUTS
from hypothesis import given, settings
from hypothesis import strategies as st

from refit import LayoutError, PlanError, Replicate, Shard
from refit.comm import wire
from refit.models import build_index, build_roster_groups, build_rosters, parse_engine, parse_train
from refit.plan import RosterEntry, RosterGroup, build_rank_plan, group_roster, merge_rosters


def _as_gathered(rosters):
    """Each rank's grouped roster after a trip through the wire format, as the merge gets it."""
    return {r: wire.unpack(wire.pack(group_roster(es))) for r, es in rosters.items()}


def _ops(plan):
    return sorted((op.task_id, op.name, op.src, op.dst, op.box, op.wire_dtype, op.direct)
                  for op in plan.send_ops() + plan.recv_ops() + plan.local)


def _same_index(a, b):
    assert a.world_size == b.world_size
    assert dict(a.specs) == dict(b.specs)
    assert a.by_rank == b.by_rank
    assert a.digest == b.digest


@settings(max_examples=80, deadline=None)
@given(scenarios(), st.booleans())
def test_grouped_merge_equals_the_per_entry_merge_op_for_op(params, shared):
    if shared:
        params = with_shared_layouts(params)
    rosters = rosters_for(params, WORLD)
    want = reference_merge(rosters, WORLD)
    for got in (merge_rosters(rosters, WORLD), merge_rosters(_as_gathered(rosters), WORLD)):
        _same_index(got, want)
        for r in range(WORLD):
            assert _ops(build_rank_plan(got, r, bucket_bytes=64)) == _ops(build_rank_plan(want, r, bucket_bytes=64))


@pytest.mark.parametrize("model, train, engine", MODELS_AND_LAYOUTS)
def test_model_roster_groups_merge_to_the_direct_index(model, train, engine):
    t, e = parse_train(train), parse_engine(engine)
    world = t.world + e.world
    groups = build_roster_groups(model, t, e)
    entries = build_rosters(model, t, e)
    # a rank's groups are its entries, grouped
    for r in range(world):
        mine = sorted((g.role, n) for g in groups[r] for n in g.names)
        assert mine == sorted((x.role, x.name) for x in entries[r])
    merged = merge_rosters({r: wire.unpack(wire.pack(v)) for r, v in groups.items()}, world)
    _same_index(merged, build_index(model, t, e))
    _same_index(merged, reference_merge(entries, world))


def _entry(name, shape, mesh, placements, role, dtype="float32"):
    return RosterEntry.make(name, shape, dtype, mesh, placements, role)


BAD = [
    ({0: [_entry("w", (4,), [0], [Shard(0)], "src")], 1: [_entry("v", (4,), [1], [Shard(0)], "dst")]}, 2),
    ({0: [_entry("w", (4, 2), [0], [Shard(0)], "src")], 1: [_entry("w", (4, 3), [1], [Shard(0)], "dst")]}, 2),
    ({0: [_entry("w", (4,), [[0]], [Shard(0)], "src")]}, 1),
    ({0: [_entry("w", (4,), [0], [Shard(0)], "src")], 1: [_entry("w", (4,), [1], [Shard(3)], "dst")]}, 2),
    ({0: [_entry("w", (4,), [0, 5], [Shard(0)], "src")]}, 2),
    ({0: [_entry("w", (4,), [0, 0], [Shard(0)], "src")]}, 2),
    ({0: [_entry("w", (4,), [0, 1], [Shard(0)], "src")], 1: []}, 2),
    ({0: [_entry("w", (4,), [0, 1], [Shard(0)], "src")], 1: [_entry("w", (4,), [0, 1], [Replicate()], "src")]}, 2),
    ({0: [_entry("w", (4,), [0], [Shard(0)], "src")], 1: [_entry("w", (4,), [1, 2], [Shard(0)], "dst")],
      2: [_entry("w", (4,), [2], [Shard(0)], "dst")]}, 3),  # rank 2 in two destination layouts
    ({0: [_entry("w", (4,), [1], [Shard(0)], "src")]}, 2),  # rank 0 reports a mesh without it
    ({5: [_entry("w", (4,), [0], [Shard(0)], "src")]}, 2),  # a roster from outside the group
    # among others sharing the layout, one name a rank of the mesh did not report
    ({0: [_entry("a", (4,), [0, 1], [Shard(0)], "src"), _entry("b", (4,), [0, 1], [Shard(0)], "src")],
      1: [_entry("a", (4,), [0, 1], [Shard(0)], "src")]}, 2),
]


@pytest.mark.parametrize("rosters, world", BAD)
def test_bad_rosters_raise_what_the_per_entry_merge_raised(rosters, world):
    with pytest.raises((PlanError, LayoutError)) as want:
        reference_merge(rosters, world)
    for given_ in (rosters, _as_gathered(rosters)):
        with pytest.raises(type(want.value), match=re.escape(str(want.value))):
            merge_rosters(given_, world)


def test_a_group_that_does_not_match_its_digest_is_refused():
    g = RosterGroup.make(["a", "b"], [(4,), (4,)], "float32", [0], [Shard(0)], "src")
    forged = RosterGroup(("a", "c"), g.shapes, g.dtype, g.mesh, g.placements, g.role, g.digest)
    with pytest.raises(PlanError, match="rank 0's roster group does not match its digest"):
        merge_rosters({0: [forged]}, 1)


def test_identical_groups_are_read_once():
    """Ranks of one mesh report the same names: one distinct group, however many ranks."""
    names = [f"layers.{i}.w" for i in range(50)]
    mesh = np.arange(8).reshape(2, 4)
    rosters = {r: [RosterGroup.make(names, [(8, 8)] * 50, "float32", mesh, [Replicate(), Shard(0)], "src")]
               for r in range(8)}
    rosters.update({8 + r: [RosterGroup.make(names, [(8, 8)] * 50, "float32", [8 + r], [Replicate()], "dst")]
                    for r in range(4)})
    index = merge_rosters(rosters, 12)
    assert len(index.specs.groups) == 1  # one (source, destinations) set for all 50 names
    assert [lay.mesh_ranks for lay in index.specs["layers.7.w"].dsts] == [(8,), (9,), (10,), (11,)]
    assert index.by_rank[0] is index.by_rank[7]  # ranks with the same params share one list
    # the controller ships the index to every rank: the specs travel as groups and are made on demand
    _ = index.specs["layers.3.w"]
    back = pickle.loads(pickle.dumps(index))
    assert back.specs._made == {} and dict(back.specs) == dict(index.specs)
    assert back.by_rank == index.by_rank and back.digest == index.digest
