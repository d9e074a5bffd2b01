"""Random planning scenarios and the checks every planner test applies to the plans they give.

``scenarios`` draws params over ``WORLD`` ranks; ``check_matching`` and ``check_exact_coverage`` are
the planner's properties (a), (c) and (f), shared by the plain, fan-out, scale and simulator tests.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import strategies as st

from helpers.layouts import meshes, placements_for, shapes
from refit.layout import region_numel
from refit.plan import build_rank_plan

WORLD = 8


@st.composite
def scenarios(draw):
    """A few params, a source layout each and one to three destination layouts."""
    params = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(shapes(max_ndim=3, max_size=11))
        sm = draw(meshes(list(range(WORLD))))
        sp = draw(placements_for(sm.ndim, len(shape)))
        sdt = draw(st.sampled_from(["float32", "bfloat16"]))
        dsts = []
        free = list(range(WORLD))
        for _ in range(draw(st.integers(1, 3))):
            if not free:
                break
            dm = draw(meshes(free))
            free = [r for r in free if r not in dm.reshape(-1).tolist()]
            dsts.append((dm, draw(placements_for(dm.ndim, len(shape))), draw(st.sampled_from(["float32", "bfloat16"]))))
        params.append((f"p{i}", shape, (sm, sp, sdt), dsts))
    return params


def with_shared_layouts(params):
    """``params`` plus copies sharing each one's layouts (the layers of a stage), so that
    params share rosters groups and the planner's per-group replica windows, and some share
    only part of their destinations."""
    out = list(params)
    for name, shape, src, dsts in params:
        out.append((name + ".again", shape, src, dsts))
        out.append((name + ".third", shape, src, dsts))
        if len(dsts) > 1:
            out.append((name + ".fewer", shape, src, dsts[:1]))
    return out


def all_plans(index, bucket_bytes=64):
    return {r: build_rank_plan(index, r, bucket_bytes=bucket_bytes) for r in range(index.world_size)}


def check_exact_coverage(index, plans):
    """(c): every destination element is written exactly once, by a recv or a local copy."""
    for spec in index.specs.values():
        for layout in spec.dsts:
            for r in layout.mesh_ranks:
                region = layout.region(spec.shape, r)
                hits = Counter()
                for op in plans[r].recv_ops() + plans[r].local:
                    if op.name != spec.name:
                        continue
                    for idx in np.ndindex(*op.box.shape):
                        hits[tuple(s + i for s, i in zip(op.box.dst_start, idx))] += 1
                assert sum(hits.values()) == region_numel(region), (spec.name, r)
                assert all(v == 1 for v in hits.values()), (spec.name, r)


def check_matching(plans):
    """(a) and (f): a send and its recv carry the same task id, block, bucket and offset."""
    sends = {}
    for r, plan in plans.items():
        for b in plan.sends:
            assert b.nbytes <= plan.bucket_bytes or len(b.ops) == 1
            for op, off in zip(b.ops, b.offsets):
                sends[op.task_id] = (r, b.peer, b.index, off, op.box, op.name)
    recvs = {}
    for r, plan in plans.items():
        for b in plan.recvs:
            keys = [op.sort_key() for op in b.ops]
            assert keys == sorted(keys), "ops in a bucket follow the canonical order"
            for op, off in zip(b.ops, b.offsets):
                recvs[op.task_id] = (b.peer, r, b.index, off, op.box, op.name)
    assert sends == recvs
