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

from refit.layout import Replicate, Shard, StridedShard

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
            "scale_pl": [draw(st.sampled_from(dst_choices)) for _ in range(dm.ndim)]}


@pytest.mark.timeout(600)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_fp8_weights_and_scales_land_bit_identical_to_the_full_tensors(fleet, case):
    results = fleet.run(fp8_jobs.quantize_and_move, case, timeout_s=60)
    dst = np.array(case["dst_mesh"]).reshape(-1).tolist()
    for rank, res in enumerate(results):
        if rank in dst:
            assert res is not None and res["weight"] and res["scale"], (rank, case, res)
        else:
            assert res is None
