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
# lossy casts and settings that differ between ranks (``xfer_jobs.extra_bad_call``)
EXTRA_BAD = {
    "complex_to_real": (r"tensor: the source is complex64 on rank\(s\) \[0, 1\] but the destination is float32 on "
                        r"rank\(s\) \[2, 3\]: complex to real drops the imaginary part"),
    "float_to_int": (r"tensor: the source is float32 on rank\(s\) \[0, 1\] but the destination is int8 on "
                     r"rank\(s\) \[2, 3\]: floating point to integer truncates"),
    "strict_casts_disagree": (r"xferdtensor: strict_casts: the ranks disagree \(rank\(s\) \[0, 1, 2\]: False; "
                              r"rank\(s\) \[3\]: True\)"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(BAD) + sorted(EXTRA_BAD))
def test_bad_input_raises_on_every_rank_before_moving_bytes(fleet, kind):
    import re

    caller, pattern = (xfer_jobs.bad_call, BAD[kind]) if kind in BAD else (xfer_jobs.extra_bad_call, EXTRA_BAD[kind])
    results = fleet.run(caller, kind, timeout_s=60)
    assert all(r is not None for r in results), results
    assert len({msg for _, msg in results}) == 1, "every rank raises the same error"
    etype, msg = results[0]
    assert etype in ("PlanError", "LayoutError")
    assert re.search(pattern, msg), msg
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


RESHARDER_BAD = {
    "bucket_bytes": (r"Resharder: bucket_bytes: the ranks disagree \(rank\(s\) \[0, 1, 2\]: 67108864; "
                     r"rank\(s\) \[3\]: 1024\); every rank must pass the same bucket_bytes"),
    "timeout_disagree": (r"Resharder: timeout_s: the ranks disagree \(rank\(s\) \[0, 1, 3\]: 60.0; "
                         r"rank\(s\) \[2\]: 5.0\)"),
    "timeout_inf": r"timeout_s must be a finite number of seconds > 0, got inf \(on rank\(s\) \[1\]\)",
    "strict_casts_disagree": (r"Resharder: strict_casts: the ranks disagree \(rank\(s\) \[0\]: True; "
                              r"rank\(s\) \[1, 2, 3\]"),
    "none_tensor": r"src\['w'\]: the tensor is None; .* \(on rank\(s\) \[1\]\)",
    "not_a_triple": r"dst\['w'\]: expected \(tensor, mesh, placements\), got DTensorRef \(on rank\(s\) \[2\]\)",
    "float_to_int": r"w: the source is float32 on rank\(s\) \[0, 1\] but the destination is int8 on rank\(s\) \[2, 3\]",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(RESHARDER_BAD))
def test_resharder_one_rank_bad_argument_raises_the_same_error_everywhere(fleet, kind):
    """One rank's setting or tensor unlike the others': every rank raises the same PlanError at
    construction, none dies inside the transfer or waits out its timeout."""
    import re

    results = fleet.run(xfer_jobs.resharder_bad_call, kind, timeout_s=60)
    assert all(r is not None for r in results), results
    assert len(set(results)) == 1, results
    etype, msg = results[0]
    assert etype == "PlanError" and re.search(RESHARDER_BAD[kind], msg), msg
    assert fleet.run(xfer_jobs.resharder_bad_call, "none") == [None] * WORLD  # the group is still usable


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["xfer", "resharder"])
def test_values_beyond_a_narrower_dtype_are_reported_per_param(fleet, how):
    results = fleet.run(xfer_jobs.overflowing_casts, how, timeout_s=60)
    for r, res in enumerate(results):
        assert res["outcome"] == "ok", res
        if r >= 2:
            assert res["inf"], "the cast still happens: 1e5 lands in fp16 as inf"
        sent = how == "xfer" or r < 2  # xferdtensor lists every rank's; a Resharder run, this rank's own
        assert bool(res["listed"]) == sent, res
        for line in res["listed"]:
            assert "float32 source holds magnitudes up to 100000, beyond the float16 destination's largest " \
                   "finite value 65504" in line, line
        assert bool(res["warnings"]) == (r < 2), res  # warned where the values are
    if how == "xfer":
        assert [line.split(":")[0] for line in results[2]["listed"]] == ["src_tensor", "src_tensor"]
        assert "rank 0's" in results[2]["listed"][0] and "rank 1's" in results[2]["listed"][1]
    else:
        assert results[0]["listed"][0].startswith("w: rank 0's float32 source")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["xfer_strict", "resharder_strict"])
def test_strict_casts_refuse_overflowing_values_on_every_rank_before_moving_bytes(fleet, how):
    results = fleet.run(xfer_jobs.overflowing_casts, how, timeout_s=60)
    assert len({res["listed"] for res in results}) == 1, results
    for res in results:
        assert res["outcome"] == "PlanError", res
        assert "strict_casts: source values do not fit their destination dtype" in res["listed"]
        assert "rank 0's float32 source" in res["listed"] and "rank 1's float32 source" in res["listed"]
        assert res["warnings"] == []
    if how == "xfer_strict":
        assert [res["untouched"] for res in results[2:]] == [True, True]
    else:  # refused before a byte moved, and the Resharder still runs once the values fit
        for r, res in enumerate(results):
            assert res["after"]["listed"] == [], res
            if r >= 2:
                assert res["after"]["untouched_before"] and res["after"]["arrived"], res


@pytest.mark.timeout(300)
def test_a_rank_killed_during_a_resharder_run_is_never_reported_as_success(tmp_path):
    """Rank 3 dies (SIGKILL) as the others run: every byte of theirs moved (rank 3 has no part in
    the data), yet no rank reports success, and each names rank 3 as the one that did not finish."""
    import json

    from refit.testing.launch import WorkerError

    with LocalFleet(4) as f:
        with pytest.raises(WorkerError) as info:
            f.run(xfer_jobs.resharder_rank_dies, str(tmp_path), timeout_s=200)
        assert set(info.value.failures) == {3} and info.value.failures[3][0] == "ProcessDied"
        f.close(kill=True)
    for r in range(3):
        kind, msg, arrived = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert kind == "TransportError", (r, msg)
        assert "the transfer finished here, but rank(s) [3] did not finish" in msg, (r, msg)
        assert arrived is (True if r == 2 else None)


@pytest.mark.timeout(300)
def test_bad_input_when_rank_0_the_store_host_leaves_gives_every_rank_a_refit_error():
    """Rank 0 hosts the store; once it raised on bad input it leaves (its group closed, the store with
    it). The others raise the same refit error, or one naming rank 0 and its store as gone, and so
    does their next call on that group: never torch's network error."""
    from refit.comm.rendezvous import new_secret

    cases = [(xfer_jobs.bad_call, k) for k in sorted(BAD)] + [(xfer_jobs.extra_bad_call, k) for k in sorted(EXTRA_BAD)]
    with LocalFleet(4) as f:
        for caller, kind in cases:
            port, secret = free_port(), new_secret()
            first = f.run(xfer_jobs.bad_call_on_a_group_whose_store_host_leaves, caller, kind, port, secret,
                          timeout_s=120)
            # the callers return the refit error they caught; anything else is reported as raised
            assert first[0][0] == "ok" and first[0][1][0] in ("PlanError", "LayoutError"), (kind, first[0])
            for r, (outcome, value) in enumerate(first[1:], 1):
                assert outcome == "ok", (kind, r, outcome, value)
                gone = value[0] == "TransportError" and "rank 0, which hosts it" in value[1]
                assert value == first[0][1] or gone, (kind, r, value)
            again = f.run(xfer_jobs.call_again_without_the_store_host, caller, kind, port, timeout_s=120)
            assert again[0] is None
            for r, (outcome, value) in enumerate(again[1:], 1):
                assert outcome == "ok" and value[0] == "TransportError", (kind, r, outcome, value)
                assert "is gone: rank 0, which hosts it, exited or closed its group" in value[1], (kind, r, value)
