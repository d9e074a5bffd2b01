"""FP8 quantized before the wire, over real gloo processes: bit-identical to quantizing the full tensor.

Every source rank computes its shard's partial amaxes, the ranks merge them, each quantizes
its own elements, and ``xferdtensor`` moves the FP8 weight and the scales shard to shard to
a destination layout of another shape; every destination compares bits with the reference.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import fp8_jobs
from helpers.layouts import meshes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.layout import Replicate, Shard, StridedShard, shard_region

WORLD = FLEET_SIZE = 4


@st.composite
def cases(draw):
    block = draw(st.sampled_from([(16, 8), (8, 16), (32, 32)]))
    lead = draw(st.lists(st.integers(1, 2), max_size=1))
    shape = [*lead, draw(st.integers(1, 3 * block[0] + 5)), draw(st.integers(1, 3 * block[1] + 5))]
    sm = draw(meshes(list(range(WORLD)), max_ndim=2))
    dm = draw(meshes(list(range(WORLD)), max_ndim=2))
    src_choices = [Replicate()] + [Shard(d) for d in range(len(shape))] + [StridedShard(len(shape) - 2, 2)]
    dst_choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return {"block": block, "fmt": draw(st.sampled_from(["e4m3", "e5m2"])), "shape": shape,
            "seed": draw(st.integers(0, 10_000)), "src_mesh": sm.tolist(), "dst_mesh": dm.tolist(),
            "src_pl": [draw(st.sampled_from(src_choices)) for _ in range(sm.ndim)],
            "dst_pl": [draw(st.sampled_from(dst_choices)) for _ in range(dm.ndim)],
            "scale_pl": [draw(st.sampled_from(dst_choices)) for _ in range(dm.ndim)] if draw(st.booleans())
            else [Replicate()] * dm.ndim}


@pytest.mark.timeout(600)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_fp8_weights_and_scales_land_bit_identical_to_the_full_tensors(fleet, case):
    results = fleet.run(fp8_jobs.quantize_and_move, case, timeout_s=60)
    dst = np.array(case["dst_mesh"]).reshape(-1).tolist()
    if not _scales_cover_their_weights(case):  # refused on every rank, naming a rank short of scales
        assert all(res and "an FP8 shard needs the scales of every" in res.get("refused", "") for res in results)
        return
    for rank, res in enumerate(results):
        if rank in dst:
            assert res is not None and res.get("weight") and res.get("scale"), (rank, case, res)
        else:
            assert res is None


def _scales_cover_their_weights(case) -> bool:
    """Whether every destination rank's scale shard holds the scale of every block its weight shard touches."""
    shape, block = case["shape"], case["block"]
    dm = np.array(case["dst_mesh"])
    grid = [*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
    for coords in np.ndindex(*dm.shape):
        weight = shard_region(shape, dm.shape, coords, case["dst_pl"])
        scales = shard_region(grid, dm.shape, coords, case["scale_pl"])
        for w, s, b in zip(weight[-2:], scales[-2:], block):
            held = {i for lo, hi in s for i in range(lo, hi)}
            if any(i // b not in held for lo, hi in w for i in range(lo, hi)):
                return False
    return True


_NONE_MOVED = r"; nothing was moved$"
BAD = {  # kind -> (error class, what every rank's message must say)
    "dst_dtype": ("PlanError", r"^xferdtensor_fp8: dst_tensor: passed torch.bfloat16; an FP8 destination of "
                               r"fmt='e4m3' is float8_e4m3fn \(on rank\(s\) \[2, 3\]\)"),
    "scale_shape": ("PlanError", r"dst_scale: global shape \[4, 4\] is not the scale grid \[4, 2\] of a \[64, 32\] "
                                 r"weight in 16x16 blocks \(on rank\(s\) \[2, 3\]\)"),
    "shapes_differ": ("PlanError", r"tensor: global shape mismatch between ranks: \[64, 32\] on \['src@0', 'src@1'\]; "
                                   r"\[64, 48\] on \['dst@2', 'dst@3'\]"),
    "shapes_differ_same_ranks": ("PlanError", r"tensor: global shape mismatch between ranks: \[300, 256\] on "
                                              r"\['src@0', 'src@1'\]; \[300, 384\] on \['dst@0', 'dst@1'\]"),
    "src_local_shape": ("LayoutError", r"src_tensor / src_placement: tensor: rank 1's local src tensor has shape "
                                       r"\[149, 256\], but global shape \[300, 256\] .* gives it \[150, 256\]"),
    "dst_local_shape": ("LayoutError", r"dst_tensor / dst_placement: tensor: rank 3's local dst tensor has shape "
                                       r"\[31, 32\], but .* gives it \[32, 32\]"),
    "scale_local_shape": ("LayoutError", r"dst_scale / scale_placement: tensor_scale_inv: rank 3's local dst tensor "
                                         r"has shape \[3, 2\], but global shape \[4, 2\] .* gives it \[4, 2\]"),
    "scale_missing": ("PlanError", r"dst_scale: None passed by a rank in dst_mesh.* \(on rank\(s\) \[3\]\)"),
    "scale_dtype": ("PlanError", r"dst_scale: passed torch.bfloat16; quant's scales are float32 .* "
                                 r"\(on rank\(s\) \[2\]\)"),
    "scale_outside_mesh": ("PlanError", r"dst_scale: rank 0 passed a tensor but is not in scale_mesh \[2, 3\]"),
    "quant_differs": ("PlanError", r"quant: the ranks disagree \(rank\(s\) \[0, 2, 3\]: BlockFp8\(block=\(16, 16\).*; "
                                   r"rank\(s\) \[1\]: BlockFp8\(block=\(32, 16\)"),
    "quant_fmt_differs": ("PlanError", r"quant: the ranks disagree .*rank\(s\) \[3\]: BlockFp8\(.*fmt='e5m2'"),
    "quant_not_blockfp8": ("PlanError", r"quant: passed a str; .*BlockFp8 is needed \(on rank\(s\) \[2\]\)"),
    "src_dtype_differs": ("PlanError", r"src_tensor: dtype: the ranks disagree \(rank\(s\) \[0\]: bfloat16; "
                                       r"rank\(s\) \[1\]: float32\)"),
    "src_dtype_int": ("PlanError", r"src_tensor: holds torch.int32; quantizing needs .* \(on rank\(s\) \[0\]\)"),
    "src_none_in_mesh": ("PlanError", r"src_tensor: rank 1 is in src_mesh \[0, 1\] but passed None"),
    "dst_none_in_mesh": ("PlanError", r"dst_tensor: rank 3 is in dst_mesh \[2, 3\] but passed None"),
    "src_mesh_differs": ("PlanError", r"src_mesh / src_placement: the ranks disagree \(rank\(s\) \[0, 2, 3\]: "
                                      r"mesh=\[0, 1\] .*; rank\(s\) \[1\]: mesh=\[1, 0\]"),
    "dst_placement_differs": ("PlanError", r"dst_mesh / dst_placement: the ranks disagree .*rank\(s\) \[3\]: "
                                           r"mesh=\[2, 3\] placements=\[Replicate\(\)\]"),
    "scale_mesh_differs": ("PlanError", r"scale_mesh / scale_placement: the ranks disagree .*rank\(s\) \[2\]: "
                                        r"mesh=\[3, 2\]"),
    "scale_placement_differs": ("PlanError", r"scale_mesh / scale_placement: the ranks disagree \(rank\(s\) \[0\]: "
                                             r"mesh=\[2, 3\] placements=\[Shard\(0\)\]"),
    "scale_mesh_outside_group": ("PlanError", r"scale_mesh: rank\(s\) \[9\] outside the process group of world "
                                              r"size 4 \(on rank\(s\) \[2\]\)"),
    "unaligned_scales": ("PlanError", r"dst_scale: the weight shard holds rows \[\(30, 60\)\] of dim 0 \(60 long\) "
                                      r"but the scales of blocks \[\(2, 4\)\] only; an FP8 shard needs .* "
                                      r"\(on rank\(s\) \[3\]\)"),
}

# cut blocks (30-row shards of 16-row blocks): the source ranks merge amaxes, the path a lone rank's error would hang
GOOD_AFTER = {"block": (16, 16), "fmt": "e4m3", "shape": [60, 32], "seed": 4, "src_mesh": [0, 1], "dst_mesh": [2, 3],
              "src_pl": [Shard(0)], "dst_pl": [Shard(1)], "scale_pl": [Replicate()]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_fp8_call_raises_the_same_error_on_every_rank_before_moving_bytes(fleet, kind):
    """Each case has one rank (or a few) pass one argument wrong; every rank raises the same error, naming it.

    The fleet's group waits 120 s on a silent peer; ``fleet.run`` gives up after 60 s, so a
    rank left waiting in the amax merge or on the wire for a peer that raised fails the test.
    """
    results = fleet.run(fp8_jobs.bad_call, kind, timeout_s=60)
    assert all(res is not None for res in results), results
    assert len(set(results)) == 1, f"every rank raises the same error: {results}"
    error, message = results[0]
    assert error == BAD[kind][0], results[0]
    assert re.search(BAD[kind][1], message) and re.search(_NONE_MOVED, message), message
    # nothing was left half-sent: the next call on the group moves every bit
    after = fleet.run(fp8_jobs.quantize_and_move, GOOD_AFTER, timeout_s=60)
    assert [bool(res and res["weight"] and res["scale"]) for res in after] == [False, False, True, True], after
