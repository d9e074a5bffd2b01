"""Replica fan-out executed over gloo, with an all-gather in each replica group, every element checked."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.fanout_jobs import engine_params, fanout_job
from helpers.layouts import meshes, placements_for, shapes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FLEET_SIZE = 6


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan_kwargs", [
    dict(bucket_bytes=64, fanout_stripe_bytes=16),
    dict(bucket_bytes=1 << 20, fanout_stripe_bytes=1 << 20),
    dict(bucket_bytes=128, fanout_stripe_bytes=8, fanout_domains=[0, 0, 1, 1, 1, 2]),
])
def test_fanout_over_gloo_every_element(fleet, plan_kwargs):
    params = engine_params()
    results = fleet.run(fanout_job, params, 7, plan_kwargs, timeout_s=120)
    for r, res in enumerate(results):
        assert all(res["ok"].values()), (r, res)
    assert sorted(results[2]["ok"]) == ["bias", "k", "norm", "o", "qkv", "scalar"]
    assert sum(res["gather_received"] for res in results) > 0
    assert sum(res["gather_sent"] for res in results) == sum(res["gather_received"] for res in results)


@st.composite
def fleet_cases(draw):
    """Random layouts whose destinations often repeat one engine layout on other ranks."""
    params = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(shapes(max_ndim=3, max_size=9))
        sm = draw(meshes([0, 1, 2]))
        sp = draw(placements_for(sm.ndim, len(shape)))
        dm = draw(meshes([2, 3, 4, 5] if draw(st.booleans()) else [3, 4, 5]))
        dp = draw(placements_for(dm.ndim, len(shape)))
        dt = draw(st.sampled_from(["float32", "bfloat16"]))
        dsts = [(dm, dp, dt)]
        free = [r for r in range(FLEET_SIZE) if r not in dm.reshape(-1).tolist()]
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
