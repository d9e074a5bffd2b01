"""Planning a refit into FP8 engines (``engine_dtype="fp8"``): which tensors go FP8, their scales, the bytes."""

from __future__ import annotations

import pytest
from helpers.reference_merge import reference_merge
from helpers.tiny_models import MODELS_AND_LAYOUTS

from refit.comm import wire
from refit.layout import Replicate
from refit.models import build_index, build_roster_groups, build_rosters, parse_engine, parse_train
from refit.models.parallel import LayoutBuilder
from refit.plan import build_rank_plan, itemsize, merge_rosters
from refit.plan.quant import BlockFp8, scale_name


def _received_bytes(index) -> int:
    return sum(build_rank_plan(index, r).bytes_received + build_rank_plan(index, r).local_bytes
               for r in range(index.world_size))


@pytest.mark.parametrize("model, train, engine", MODELS_AND_LAYOUTS)
def test_fp8_engines_get_fp8_linear_weights_and_their_scales_laid_out_alike(model, train, engine):
    t, e = parse_train(train), parse_engine(engine)
    b = LayoutBuilder(model, t, e, engine_dtype="fp8")
    fmt = BlockFp8()
    names = {p.name: p for p in model.params()}
    index = build_index(model, t, e, engine_dtype="fp8")
    quantized = [p for p in names.values() if b.quantized(p)]
    assert quantized and not any(b.quantized(p) for p in names.values()
                                 if "embed" in p.name or "lm_head" in p.name or "norm" in p.name
                                 or p.name.endswith("mlp.gate.weight"))
    for p in quantized:
        w, s = index.specs[p.name], index.specs[scale_name(p.name)]
        assert all(d.dtype == "float8_e4m3fn" for d in w.dsts) and w.src.dtype == model.dtype
        assert s.shape == fmt.scale_shape(p.shape)
        # every source rank of the weight holds the whole scale grid; each engine rank its weight's share
        assert s.src.mesh_ranks == w.src.mesh_ranks and set(s.src.placements) == {Replicate()}
        assert [(d.mesh_ranks, d.placements) for d in s.dsts] == [(d.mesh_ranks, d.placements) for d in w.dsts]
        assert all(d.dtype == "float32" for d in s.dsts)
    for n, p in names.items():
        if not b.quantized(p):
            assert all(d.dtype == model.dtype for d in index.specs[n].dsts), n
    # what every rank reports merges to the same index
    world = t.world + e.world
    groups = build_roster_groups(model, t, e, engine_dtype="fp8")
    merged = merge_rosters({r: wire.unpack(wire.pack(v)) for r, v in groups.items()}, world)
    want = reference_merge(build_rosters(model, t, e, engine_dtype="fp8"), world)
    assert dict(merged.specs) == dict(want.specs) == dict(index.specs) and merged.digest == index.digest


def test_fp8_moves_about_half_the_bytes_of_bf16():
    model, train, engine = MODELS_AND_LAYOUTS[3]
    t, e = parse_train(train), parse_engine(engine)
    bf16 = _received_bytes(build_index(model, t, e))
    fp8 = _received_bytes(build_index(model, t, e, engine_dtype="fp8"))
    # the tiny model's embeddings, head and norms stay bf16 and its scale grids are as large as its
    # blocks are few; FP8 elements are one byte against two
    assert fp8 < bf16 * 0.8
    assert itemsize("float8_e4m3fn") == 1
