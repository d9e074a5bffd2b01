"""FP8 quantized before the wire, over real gloo processes: bit-identical to quantizing the full tensor.

Every source rank computes its shard's partial amaxes, the ranks merge them, each quantizes
its own elements, and ``xferdtensor`` moves the FP8 weight and the scales shard to shard to
a destination layout of another shape; every destination compares bits with the reference.
"""

from __future__ import annotations

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


BAD = {
    "dst_dtype": r"dst_tensor: rank 2 passed torch.bfloat16; an FP8 destination of fmt='e4m3' is float8_e4m3fn "
                 r"\(on rank\(s\) \[2, 3\]\); nothing was moved",
    "scale_shape": r"dst_scale: rank 2's global shape \[4, 4\] is not the scale grid \[4, 2\] of a \[64, 32\] weight",
    "shapes_differ": r"xferdtensor_fp8: src_tensor / dst_tensor global shapes differ: \[64, 32\] on rank\(s\) "
                     r"\[0, 1\]; \[64, 48\] on rank\(s\) \[2, 3\]; nothing was moved",
    "unaligned_scales": r"dst_scale: rank 3 holds weight rows \[\(30, 60\)\] of dim 0 \(60 long\) but the scales of "
                        r"blocks \[\(2, 4\)\] only; an FP8 shard needs .* \(on rank\(s\) \[3\]\); nothing was moved",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_fp8_destinations_raise_on_every_rank_before_moving_bytes(fleet, kind):
    import re

    results = fleet.run(fp8_jobs.bad_call, kind, timeout_s=60)
    assert all(res is not None and re.search(BAD[kind], res) for res in results), results
