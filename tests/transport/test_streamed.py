"""The streamed and rounds executors on gloo: exact reshards, the staging budget, bucket checksums, the ring."""

from __future__ import annotations

import pytest
import torch
from helpers import comm_jobs

from refit.transport.buckets import ALIGN
from refit.transport.streamed import Lanes, StagingArena, StagingSlot

WORLD = FLEET_SIZE = 4


@pytest.mark.parametrize("pipeline", ["streamed", "rounds"])
def test_plan_matches_on_gloo(fleet, pipeline):
    """Mixed layouts, casts, fan-out, traffic both ways, local copies and a strided destination,
    three refits with fresh data; the streamed path with a staging arena small enough to wrap."""
    cfg = {"pipeline": pipeline, "bucket_bytes": 256, "iters": 3, "strided_dst": ["f", "a"]}
    if pipeline == "streamed":
        cfg.update(staging_budget_bytes=8 << 10, group_bytes=2 << 10)
    out = fleet.run(comm_jobs.reshard_model, cfg, timeout_s=120)
    for o in out:
        assert o["ok"] == [True, True, True], o["rank"]
    if pipeline == "streamed":
        for o in out:
            caps = {s["capacity"] for s in o["stats"]}
            assert all(c <= 8 << 10 for c in caps), caps
            assert all(s["peak_staging"] <= s["capacity"] for s in o["stats"])
            assert len(caps) == 1, "staging does not grow across refits"
        assert sum(o["stats"][0]["groups"] for o in out) > WORLD, "rounds were split into several windows"


@pytest.mark.parametrize("pipeline", ["streamed", "rounds"])
def test_sources_made_during_the_refit_are_made_round_by_round_beside_the_wire(fleet, pipeline):
    """Source tensors a production makes (a trainer's FP8 copies) hold NaN until made: every
    element still lands exact, each is made once, and ranks make some only after their first
    sends were posted. With checksums and a corrupted bucket the corruption is still caught."""
    produced = ["a", "d", "e", "f", "g"]  # "b", "c": there before the run, as bf16 params beside FP8 ones
    cfg = {"pipeline": pipeline, "bucket_bytes": 256, "iters": 2, "strided_dst": ["f"], "produced": produced}
    if pipeline == "streamed":
        cfg.update(staging_budget_bytes=8 << 10, group_bytes=2 << 10)
    out = fleet.run(comm_jobs.reshard_model, cfg, timeout_s=120)
    overlapped = 0
    for o in out:
        assert o["ok"] == [True, True], o["rank"]
        for p in o["productions"]:
            made = [n for call in p["calls"] for n in call["made"]]
            assert p["left"] == [] and len(made) == len(set(made)), (o["rank"], p)
            overlapped += any(call["sends_posted"] > 0 for call in p["calls"])
    assert overlapped, "some rank made a source tensor after it had posted sends"
    base = dict(cfg, iters=1, verify=True)
    clean = fleet.run(comm_jobs.reshard_model, base, timeout_s=60)
    sent = {(o["rank"], p, i): v for o in clean for (p, i), v in o["stats"][0]["sums_sent"].items()}
    target = sorted(sent)[0]
    bad = fleet.run(comm_jobs.reshard_model, dict(base, corrupt=list(target)), timeout_s=60)
    sent = {(o["rank"], p, i): v for o in bad for (p, i), v in o["stats"][0]["sums_sent"].items()}
    got = {(p, o["rank"], i): v for o in bad for (p, i), v in o["stats"][0]["sums_received"].items()}
    assert [k for k in sent if sent[k] != got[k]] == [target]


def test_streamed_budget_too_small_is_a_clear_error(fleet):
    cfg = {"pipeline": "streamed", "bucket_bytes": 1024, "iters": 1, "staging_budget_bytes": 512}
    with pytest.raises(Exception, match="staging_budget_bytes=512"):
        fleet.run(comm_jobs.reshard_model, cfg, timeout_s=60)


def test_streamed_verify_detects_a_corrupted_bucket(fleet):
    base = {"pipeline": "streamed", "bucket_bytes": 256, "iters": 1, "verify": True}
    clean = fleet.run(comm_jobs.reshard_model, base, timeout_s=60)
    sent = {(o["rank"], p, i): v for o in clean for (p, i), v in o["stats"][0]["sums_sent"].items()}
    got = {(p, o["rank"], i): v for o in clean for (p, i), v in o["stats"][0]["sums_received"].items()}
    assert sent and sent == got
    target = sorted(sent)[0]  # (sender, receiver, bucket)
    bad = fleet.run(comm_jobs.reshard_model, dict(base, corrupt=list(target)), timeout_s=60)
    sent = {(o["rank"], p, i): v for o in bad for (p, i), v in o["stats"][0]["sums_sent"].items()}
    got = {(p, o["rank"], i): v for o in bad for (p, i), v in o["stats"][0]["sums_received"].items()}
    assert [k for k in sent if sent[k] != got[k]] == [target]


def test_staging_arena_ring_waits_for_readers():
    """Slots are reused oldest first, and only after every writing lane waited on the reader."""
    waited = []

    class FakeLanes(Lanes):
        def __init__(self):
            self.cuda = False

        def wait(self, name, fence):
            waited.append((name, fence))

        def host_wait(self, fence, what=""):
            waited.append(("host", fence))

    lanes = FakeLanes()
    arena = StagingArena(torch.device("cpu"), 4 * ALIGN)
    arena.ensure(4 * ALIGN, lanes)
    v1, s1 = arena.alloc(ALIGN, lanes)
    v2, s2 = arena.alloc(2 * ALIGN - 10, lanes)
    assert (s1.start, s2.start) == (0, ALIGN) and v2.numel() == 2 * ALIGN - 10
    s1.fence, s2.fence = "f1", "f2"
    v3, s3 = arena.alloc(ALIGN, lanes)  # fits at the tail, no wait
    assert s3.start == 3 * ALIGN and waited == []
    s3.fence = "f3"
    _, s4 = arena.alloc(ALIGN, lanes)  # wraps to 0: reclaims slot 1
    assert s4.start == 0 and waited == [("pack", "f1"), ("comm", "f1")]
    _, s5 = arena.alloc(2 * ALIGN, lanes)  # needs slot 2's region too
    assert s5.start == ALIGN and ("comm", "f2") in waited
    with pytest.raises(Exception, match="one window needs more"):
        arena.alloc(2 * ALIGN, lanes)  # s4 and s5 are unfenced (the current window)
    assert arena.peak <= arena.capacity
    with pytest.raises(Exception, match="exceed staging_budget_bytes"):
        arena.ensure(8 * ALIGN, lanes)
    assert isinstance(StagingSlot(0, 1), StagingSlot)
