"""xferdtensor on real processes over gloo, against the expected slices and against the golden path."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import xfer_jobs
from helpers.layouts import meshes, placements_for, shapes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.comm.group import free_port
from refit.testing.launch import LocalFleet

WORLD = FLEET_SIZE = 4


@st.composite
def cases(draw):
    shape = draw(shapes(max_ndim=3, max_size=9))
    sm = draw(meshes(list(range(WORLD))))
    overlap = draw(st.booleans())
    pool = list(range(WORLD)) if overlap else [r for r in range(WORLD) if r not in sm.reshape(-1).tolist()]
    dm = draw(meshes(pool)) if pool else draw(meshes(list(range(WORLD))))
    return {
        "shape": shape,
        "seed": draw(st.integers(0, 1000)),
        "src_mesh": sm.tolist(),
        "src_pl": draw(placements_for(sm.ndim, len(shape))),
        "dst_mesh": dm.tolist(),
        "dst_pl": draw(placements_for(dm.ndim, len(shape))),
        "src_dtype": draw(st.sampled_from(["float32", "bfloat16", "float64"])),
        "dst_dtype": draw(st.sampled_from(["float32", "bfloat16"])),
    }


@pytest.mark.timeout(600)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_xferdtensor_matches_expected_and_golden(fleet, case):
    results = fleet.run(xfer_jobs.reshard, case, timeout_s=60)
    for r, res in enumerate(results):
        in_dst = r in np.array(case["dst_mesh"]).reshape(-1).tolist()
        if in_dst:
            assert res == {"xferdtensor": True, "xferdtensor_golden": True}, (r, case)
        else:
            assert res == {"xferdtensor": None, "xferdtensor_golden": None}


BAD = {
    "no_source": r"src_tensor: rank 0 is in src_mesh \[0, 1\] but passed None",
    "shape_mismatch": (r"global shape mismatch between ranks: \[8, 4\] on \['src@0', 'src@1'\]; "
                       r"\[8, 5\] on \['dst@2', 'dst@3'\]"),
    "placements_count": r"tensor \(src on rank 0\): 2 placement\(s\) .* for a 1-d mesh",
    "shard_dim": r"tensor \(dst on rank 2\): Shard\(2\) shards dim 2 of a 2-d tensor",
    "outside_group": r"dst_mesh: rank\(s\) \[9\] outside the process group of world size 4",
    "duplicate": r"rank\(s\) \[2\] listed more than once",
    "mesh_order_disagrees": (r"dst_mesh / dst_placement: the ranks disagree \(rank\(s\) \[0, 1\]: mesh=\[2, 3\] "
                             r"placements=\[Shard\(0\)\]; rank\(s\) \[2, 3\]: mesh=\[3, 2\]"),
    "placements_disagree": r"dst_mesh / dst_placement: the ranks disagree .*rank\(s\) \[3\]: mesh=\[2, 3\] "
                           r"placements=\[Shard\(1\)\]",
    "one_rank_outside_group": (r"dst_mesh: rank\(s\) \[9\] outside the process group of world size 4 "
                               r"\(on rank\(s\) \[0\]\)"),
    "local_shape": (r"dst_tensor / dst_placement: tensor: rank 2.s local dst tensor has shape \[3, 4\], "
                    r"but .*gives it \[4, 4\]"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_raises_on_every_rank_before_moving_bytes(fleet, kind):
    import re

    results = fleet.run(xfer_jobs.bad_call, kind, timeout_s=60)
    assert all(r is not None for r in results), results
    assert len({msg for _, msg in results}) == 1, "every rank raises the same error"
    etype, msg = results[0]
    assert etype in ("PlanError", "LayoutError")
    assert re.search(BAD[kind], msg), msg
    # the group is still usable afterwards: nothing was left half-sent
    case = {"shape": (5, 3), "seed": 1, "src_mesh": [0, 1], "src_pl": [xfer_jobs.refit.Shard(0)],
            "dst_mesh": [2, 3], "dst_pl": [xfer_jobs.refit.Shard(1)], "src_dtype": "float32", "dst_dtype": "float32"}
    assert all(r["xferdtensor"] in (True, None) for r in fleet.run(xfer_jobs.reshard, case))


@pytest.mark.timeout(300)
def test_torch_default_group_and_torch_dtensor_with_strided_shard():
    with LocalFleet(4) as f:
        f.run(xfer_jobs.init_default_group, free_port())
        results = f.run(xfer_jobs.torch_dtensor_strided)
        assert all(ok for _, ok in results), results
        case = {"shape": (7, 5), "seed": 3,
                "src_mesh": [[0, 1], [2, 3]], "src_pl": [xfer_jobs.refit.Shard(0), xfer_jobs.refit.Shard(1)],
                "dst_mesh": [1, 2], "dst_pl": [xfer_jobs.refit.Replicate()],
                "src_dtype": "float32", "dst_dtype": "bfloat16"}
        res = f.run(xfer_jobs.reshard, case, True)
        assert [r["xferdtensor"] for r in res] == [None, True, True, None]
        assert [r["xferdtensor_golden"] for r in res] == [None, True, True, None]
        f.run(xfer_jobs.destroy_default_group)


@pytest.mark.timeout(240)
def test_a_rank_that_fails_before_run_releases_the_others_naming_itself(fleet):
    """A rank leaving its ``with Resharder`` by an exception: the others raise at once, not at their timeout."""
    timeout_s = 100.0
    results = fleet.run(xfer_jobs.resharder_one_rank_fails, "with", timeout_s, timeout_s=200)
    assert results[1][0] == "RuntimeError"
    for r in (2, 3):  # rank 1's rows never came
        kind, msg, elapsed = results[r]
        assert kind == "TransportError" and "rank 1 failed: RuntimeError: the batch was bad" in msg, results[r]
        assert elapsed < timeout_s / 2, f"rank {r} waited {elapsed:.1f}s, as if nobody had told it"
    assert results[0][0] == "ok" or "rank 1 failed" in results[0][1], results[0]


@pytest.mark.timeout(240)
def test_a_rank_that_fails_silently_leaves_the_others_bounded_by_timeout_s(fleet):
    results = fleet.run(xfer_jobs.resharder_one_rank_fails, "silent", 3.0, timeout_s=200)
    assert results[1][0] == "RuntimeError"
    for r in (2, 3):
        kind, msg, _ = results[r]
        assert kind == "TransportError" and "the transfer stopped" in msg, results[r]
