"""Block-scaled FP8, shard by shard: exact against quantizing the full tensor, for any layout.

Pure (no process group): every rank of a random layout computes its partial amaxes, they are
merged by max, and every rank quantizes its own elements; the bits must equal the reference
quantizer run on the full tensor, and the blocks that needed merging must be exactly the
ones ``cut_blocks`` names.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from helpers.fp8_jobs import weights
from helpers.layouts import local_region, meshes
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.errors import LayoutError
from refit.layout import Replicate, Shard, StridedShard, shard_region
from refit.models.fp8 import (
    block_amax,
    dequantize,
    factors_from_amax,
    partial_amax,
    quantize_aligned,
    quantize_local,
    quantize_reference,
    scales_from_amax,
)
from refit.plan.quant import BlockFp8, cut_blocks, scale_name, scale_placements


@st.composite
def layouts(draw):
    block = draw(st.sampled_from([(16, 8), (8, 16), (32, 32), (128, 128)]))
    lead = draw(st.lists(st.integers(1, 3), max_size=1))
    shape = (*lead, draw(st.integers(1, 3 * block[0] + 7)), draw(st.integers(1, 3 * block[1] + 7)))
    mesh = draw(meshes(list(range(6)), max_ndim=2))
    choices = [Replicate()] + [Shard(d) for d in range(len(shape))] + \
        [StridedShard(d, sf) for d in range(len(shape)) for sf in (2, 3)]
    placements = [draw(st.sampled_from(choices)) for _ in range(mesh.ndim)]
    return {"block": block, "fmt": draw(st.sampled_from(["e4m3", "e5m2"])), "shape": shape, "mesh": mesh,
            "placements": placements, "seed": draw(st.integers(0, 10_000))}


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_shard_by_shard_quantization_is_bit_identical_to_the_full_tensors(case):
    fmt = BlockFp8(case["block"], case["fmt"])
    shape, mesh, placements = case["shape"], case["mesh"], case["placements"]
    full = weights(shape, case["seed"])
    want_q, want_s = quantize_reference(full, fmt)
    regions = [shard_region(shape, mesh.shape, c, placements) for c in np.ndindex(*mesh.shape)]
    partials = [partial_amax(local_region(full, r), r, shape, fmt) for r in regions]
    merged = torch.stack(partials).amax(0)
    assert torch.equal(merged, block_amax(full, fmt))
    scale_inv = scales_from_amax(merged, fmt)
    assert torch.equal(scale_inv, want_s)
    for r in regions:
        got = quantize_local(local_region(full, r), r, merged, fmt)
        assert torch.equal(got.view(torch.uint8), local_region(want_q.view(torch.uint8), r)), (case, r)

    # the blocks whose amax needed other ranks' parts are exactly the cut ones
    cuts = cut_blocks(shape, mesh, placements, fmt)
    whole = torch.zeros(fmt.scale_shape(shape), dtype=torch.bool)
    for r, p in zip(regions, partials):
        touched = local_region(torch.ones(shape), r).numel() > 0
        if touched:
            whole |= p == merged  # this rank alone knows the block's amax ...
    for block in itertools.product(*(range(n) for n in fmt.scale_shape(shape))):
        if not cuts.is_cut(block):
            assert whole[block], (case, block)  # ... for every block no boundary cuts
    assert cuts.count == sum(cuts.is_cut(b) for b in itertools.product(*(range(n) for n in cuts.grid)))


@st.composite
def often_whole_blocks(draw):
    """Layouts whose dims are often whole numbers of blocks (a partial one at the end at times),
    so that shards holding whole blocks are common, beside ``layouts()``'s arbitrary ones."""
    case = draw(layouts())
    if draw(st.booleans()):
        br, bc = case["block"]
        *lead, _, _ = case["shape"]
        rows = br * draw(st.integers(1, 8)) - draw(st.sampled_from([0, 0, 0, br // 2]))
        cols = bc * draw(st.integers(1, 8)) - draw(st.sampled_from([0, 0, 0, bc // 2]))
        case["shape"] = (*lead, rows, cols)
    return case


@settings(max_examples=300, deadline=None)
@given(often_whole_blocks())
def test_scales_are_sharded_like_the_weight_exactly_when_each_rank_makes_its_own_blocks_alone(case):
    """Where ``scale_placements`` gives placements, every rank quantizing its shard on its own gets
    the reference bits and the reference scales of the grid shard those placements give it;
    where it gives none, some shard cuts a block or is not one interval per blocked dim."""
    fmt = BlockFp8(case["block"], case["fmt"])
    shape, mesh, placements = case["shape"], case["mesh"], case["placements"]
    got = scale_placements(shape, mesh.shape, placements, fmt.block)
    regions = {c: shard_region(shape, mesh.shape, c, placements) for c in np.ndindex(*mesh.shape)}
    if got is None:
        assert cut_blocks(shape, mesh, placements, fmt).count or any(
            len(d) > 1 for r in regions.values() for d in r[-2:]) or any(
            r[:-2] != shard_region(fmt.scale_shape(shape), mesh.shape, c, placements)[:-2]
            for c, r in regions.items()), case
        return
    assert tuple(got) == tuple(placements)
    full = weights(shape, case["seed"])
    want_q, want_s = quantize_reference(full, fmt)
    for c, r in regions.items():
        grid = shard_region(fmt.scale_shape(shape), mesh.shape, c, got)
        local = local_region(full, r)
        if local.numel() == 0:
            assert local_region(want_s, grid).numel() == 0, (case, c)
            continue
        q, s = quantize_aligned(local, fmt)
        assert torch.equal(s, local_region(want_s, grid)), (case, c)
        assert torch.equal(q.view(torch.uint8), local_region(want_q.view(torch.uint8), r)), (case, c)


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_the_block_shaped_quantizer_equals_the_reference(case):
    fmt = BlockFp8(case["block"], case["fmt"])
    full = weights(case["shape"], case["seed"])
    q, s = quantize_aligned(full, fmt)
    want_q, want_s = quantize_reference(full, fmt)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def test_the_per_block_divisions_are_correctly_rounded():
    # the same bits on a CPU and a GPU need IEEE division, not a multiply by a reciprocal
    amax = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * 100
    fmt = BlockFp8()
    assert torch.equal(scales_from_amax(amax, fmt), (amax.double() / 448).float())
    assert torch.equal(factors_from_amax(amax, fmt), (448 / amax.double()).float())


def test_the_reference_follows_the_published_convention():
    fmt = BlockFp8((2, 2))
    x = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.0, 0.25], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    q, s = quantize_reference(x, fmt)
    # one scale per 2x2 block (partial blocks at the edges), amax / 448, an all-zero block still finite
    assert s.shape == (2, 2) and s.dtype == torch.float32
    assert torch.allclose(s, torch.tensor([[4 / 448, 0.5 / 448], [1e-12 / 448, 1e-12 / 448]]))
    assert q.dtype == torch.float8_e4m3fn and float(q[1, 0]) == 448.0 and float(q[0, 1]) == -224.0
    assert torch.equal(dequantize(q, s, fmt), x.float())  # these values are exact in e4m3


def test_uneven_tp_cuts_only_the_blocks_its_boundaries_fall_in():
    fmt = BlockFp8()
    # 7168 rows over TP 3 (2390, 2389, 2389): boundaries inside blocks 18 and 37
    cuts = cut_blocks((7168, 2048), [0, 1, 2], [Shard(0)], fmt)
    assert cuts.rows == (18, 37) and cuts.cols == () and cuts.count == 2 * 16
    # TP 8 divides it into multiples of 128: nothing to exchange
    assert cut_blocks((7168, 2048), list(range(8)), [Shard(0)], fmt).count == 0


def test_bad_formats_and_shapes_are_refused_by_name():
    with pytest.raises(LayoutError, match="fmt must be one of"):
        BlockFp8(fmt="e3m4")
    with pytest.raises(LayoutError, match="block must be two positive sizes"):
        BlockFp8(block=(128, 0))
    with pytest.raises(LayoutError, match="needs a matrix"):
        BlockFp8().scale_shape((4096,))
    assert scale_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight_scale_inv"


def test_fp8_destinations_get_scale_sources_or_a_named_refusal():
    from refit.errors import PlanError
    from refit.plan import RosterEntry, merge_rosters
    from refit.plan.quant import check_fp8_destinations

    rosters = {r: [RosterEntry.make("w", (32, 32), "bfloat16", [0, 1], [Shard(0)], "src")] for r in (0, 1)}
    rosters[2] = [RosterEntry.make("w", (32, 32), "float8_e4m3fn", [2], [Replicate()], "dst")]
    index = merge_rosters(rosters, 3)
    with pytest.raises(PlanError, match=r"engine: w: rank 2 receives it in float8_e4m3fn but not w_scale_inv"):
        check_fp8_destinations(index, 2, (16, 16))
    # asked for, and held by no trainer: a source derived from the weight's, replicated over its ranks
    rosters[2].append(RosterEntry.make("w_scale_inv", (2, 2), "float32", [2], [Replicate()], "dst"))
    index = merge_rosters(rosters, 3)
    spec = index.specs["w_scale_inv"]
    assert spec.src.mesh_ranks == (0, 1) and set(spec.src.placements) == {Replicate()} and spec.src.dtype == "float32"
    check_fp8_destinations(index, 2, (16, 16))
    with pytest.raises(PlanError, match=r"w_scale_inv is \[2, 2\], not the scale grid \[4, 4\] of 8x8 blocks"):
        check_fp8_destinations(index, 2, (8, 8))


def test_each_fp8_param_is_planned_at_pack_when_its_shards_hold_whole_blocks_else_with_merged_amaxes():
    from refit.errors import PlanError
    from refit.plan import RosterEntry, group_roster, merge_rosters
    from refit.plan.quant import MERGE_AMAX_THEN_QUANTIZE, QUANTIZE_AT_PACK, plan_quantization

    def rosters(engine_block):
        src = {r: [RosterEntry.make("whole", (96, 40), "bfloat16", [0, 1, 2], [Shard(0)], "src"),  # 32 rows a rank
                   RosterEntry.make("cut", (64, 40), "bfloat16", [0, 1, 2], [Shard(0)], "src"),  # 22/22/20 rows
                   RosterEntry.make("norm", (40,), "bfloat16", [0, 1, 2], [Replicate()], "src")] for r in range(3)}
        dst = [RosterEntry.make(n, s, "float8_e4m3fn", [3], [Replicate()], "dst") for n, s in
               (("whole", (96, 40)), ("cut", (64, 40)))]
        dst += [RosterEntry.make(f"{n}_scale_inv", s, "float32", [3], [Replicate()], "dst") for n, s in
                (("whole", (6, 3)), ("cut", (4, 3)))]
        dst.append(RosterEntry.make("norm", (40,), "bfloat16", [3], [Replicate()], "dst"))
        return {**{r: group_roster(e) for r, e in src.items()}, 3: group_roster(dst, fp8_block=engine_block)}

    index = merge_rosters(rosters((16, 16)), 4)
    assert index.specs["whole_scale_inv"].src.placements == (Shard(0),)
    assert set(index.specs["cut_scale_inv"].src.placements) == {Replicate()}
    for rank in range(3):
        plan = plan_quantization(index, rank, ["cut", "norm", "whole"], block=(16, 16))
        assert [(op.name, op.mode) for op in plan.ops] == [("cut", MERGE_AMAX_THEN_QUANTIZE),
                                                            ("whole", QUANTIZE_AT_PACK)]
        whole = plan.ops[1]
        assert whole.region == (((32 * rank, 32 * rank + 32),), ((0, 40),)) and plan.scale_shape(whole) == (2, 3)
        assert plan.scale_shape(plan.ops[0]) == (4, 3) and plan.merges() == [((0, 1, 2), ["cut"])]
        assert plan.merged_amax_bytes == 4 * 4 * 3
    assert plan_quantization(index, 0, ["norm"], block=(16, 16)) is None
    # an engine that does not say its block: every grid replicated, every param merged
    index = merge_rosters(rosters(None), 4)
    assert {op.mode for op in plan_quantization(index, 0, ["cut", "whole"], block=(16, 16)).ops} == \
        {MERGE_AMAX_THEN_QUANTIZE}
    # a trainer whose block differs from the engines' (same grid shape): refused, naming the grid
    index = merge_rosters(rosters((16, 16)), 4)
    with pytest.raises(PlanError, match=r"trainer: whole_scale_inv: its source is sharded like whole, whose shards "
                                        r"do not hold whole 17x16 blocks; the engines and the trainer disagree"):
        plan_quantization(index, 0, ["whole"], block=(17, 16))


def test_quantizing_into_the_fp8_copy_compiled_or_eager_gives_the_reference_bits():
    """What a trainer rank runs per param: the amax, the scales written in place beside the
    factors, the FP8 written into its copy. Eager, and compiled as on a GPU (here by the CPU
    backend), the bits are the reference quantizer's; the compiled store needs no FP8 temporary."""
    from refit.models.fp8 import aligned_amax, quantize_aligned_into, scales_into

    fmt = BlockFp8((16, 16))
    x = weights((2, 40, 48), 7)  # a partial block of rows
    want_q, want_s = quantize_reference(x, fmt)
    for amax_fn, quantize_fn in ((aligned_amax, quantize_aligned_into),
                                 (torch.compile(aligned_amax), torch.compile(quantize_aligned_into))):
        scales = torch.full(fmt.scale_shape(x.shape), float("nan"))
        out = torch.zeros(x.shape, dtype=torch.float8_e4m3fn)
        factors = scales_into(scales, amax_fn(x, fmt), fmt)
        assert quantize_fn(out, x, factors, fmt) is out
        assert torch.equal(scales, want_s) and torch.equal(out.view(torch.uint8), want_q.view(torch.uint8))


def test_fp8_weights_are_planned_from_their_fp8_copies_so_whole_blocks_go_in_place():
    """A weight that leaves its trainer ranks quantized is planned FP8 to FP8: its contiguous
    blocks are direct (sent from the FP8 copy straight into the engine's tensor), never a cast
    through staging; the scales stay float32, a weight without asked-for scales stays a cast,
    and one that some engine wants in bf16 stays bf16 for plan_quantization to refuse."""
    from refit.errors import PlanError
    from refit.plan import RosterEntry, build_rank_plan, group_roster, merge_rosters
    from refit.plan.quant import plan_quantization

    big = (256, 512)  # 128 rows a trainer rank: 128 KiB of FP8, over the direct threshold
    src = {r: group_roster([RosterEntry.make(n, big, "bfloat16", [0, 1], [Shard(0)], "src")
                            for n in ("col", "row", "plain")]) for r in (0, 1)}

    def engine(row_dtype="float8_e4m3fn"):
        dst = [RosterEntry.make("col", big, "float8_e4m3fn", [2], [Replicate()], "dst"),
               RosterEntry.make("row", big, row_dtype, [2], [Replicate()], "dst"),
               RosterEntry.make("plain", big, "float8_e4m3fn", [2], [Replicate()], "dst")]
        dst += [RosterEntry.make(f"{n}_scale_inv", (2, 4), "float32", [2], [Replicate()], "dst")
                for n in ("col", "row")]
        return group_roster(dst, fp8_block=(128, 128))

    index = merge_rosters({**src, 2: engine()}, 3)
    assert {n: index.specs[n].src.dtype for n in ("col", "row", "plain", "col_scale_inv")} == {
        "col": "float8_e4m3fn", "row": "float8_e4m3fn", "plain": "bfloat16", "col_scale_inv": "float32"}
    for rank in (0, 1):
        plan = build_rank_plan(index, rank)
        ops = {op.name: op for b in plan.sends for op in b.ops}
        assert (ops["col"].src_dtype, ops["col"].wire_dtype, ops["col"].direct) == ("float8_e4m3fn",) * 2 + (True,)
        assert ops["plain"].src_dtype == "bfloat16" and not ops["plain"].direct  # a cast, no scales: staged
        recv = {op.name: op for b in build_rank_plan(index, 2).recvs for op in b.ops}
        assert recv["col"].direct and recv["col"].nbytes == 128 * 512
    # one engine wanting a bf16 copy: the weight stays bf16 and the trainer's plan names the conflict
    index = merge_rosters({**src, 2: engine(), 3: group_roster(
        [RosterEntry.make("row", big, "bfloat16", [3], [Replicate()], "dst")])}, 4)
    assert index.specs["row"].src.dtype == "bfloat16" and index.specs["col"].src.dtype == "float8_e4m3fn"
    with pytest.raises(PlanError, match=r"row: destinations want it as \['bfloat16', 'float8_e4m3fn'\]"):
        plan_quantization(index, 0, ["col", "row"], block=(128, 128))
