"""Planning a refit into FP8 engines (``engine_dtype="fp8"``): which tensors go FP8, their scales, the bytes."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.reference_merge import reference_merge
from helpers.tiny_models import MODELS_AND_LAYOUTS

from refit.comm import wire
from refit.layout import Replicate
from refit.models import build_index, build_roster_groups, build_rosters, parse_engine, parse_train
from refit.models.parallel import LayoutBuilder
from refit.plan import build_rank_plan, itemsize, merge_rosters
from refit.plan.quant import BlockFp8, scale_name, scale_placements


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
        # the grid's source: laid out as the weight where its shards hold whole blocks (each rank
        # makes its own blocks' scales), else replicated over its ranks (they merge the amaxes)
        own = scale_placements(p.shape, w.src.mesh_shape, w.src.placements, fmt.block)
        assert s.src.mesh_ranks == w.src.mesh_ranks
        assert s.src.placements == (own if own is not None else (Replicate(),) * len(w.src.mesh_shape))
        # each engine rank gets its weight's share
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


def test_a_trainer_whose_shards_hold_whole_blocks_quantizes_every_fp8_param_at_pack():
    """Llama-3-8B's widths are multiples of 128: TP2 shards hold whole blocks, so every grid is
    sourced sharded like its weight and no trainer rank merges an amax."""
    from refit.models import get_model
    from refit.plan.quant import QUANTIZE_AT_PACK, plan_quantization

    model = dataclasses.replace(get_model("llama3-8b"), num_layers=1)
    t, e = parse_train("tp=2", world=2), parse_engine("tp=1", world=1)
    index = build_index(model, t, e, engine_dtype="fp8")
    grids = [index.specs[n] for n in index.specs if n.endswith("_scale_inv")]
    assert len(grids) == 7
    for s in grids:
        w = index.specs[s.name.removesuffix("_scale_inv")]
        assert s.src.placements == w.src.placements and any(not isinstance(p, Replicate) for p in s.src.placements)
    for rank in range(2):
        names = [n for n in index.by_rank[rank] if index.specs[n].src.coords(rank) is not None]
        plan = plan_quantization(index, rank, names)
        assert len(plan.ops) == 7 and {op.mode for op in plan.ops} == {QUANTIZE_AT_PACK}
        assert plan.merged_amax_bytes == 0
