"""The stateless process group (gloo here; NCCL in test_gpu.py) and the streamed transport on CPU."""

from __future__ import annotations

import pickle
import sys
import types

import pytest
import torch

import comm_jobs
from refit.comm.group import StatelessProcessGroup, _pickle_vllm_unique_id, free_port
from refit.errors import RefitError
from refit.testing.launch import LocalFleet
from refit.transport.streamed import ALIGN, Lanes, StagingArena, _Slot

WORLD = 4


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(WORLD) as f:
        yield f


def test_gloo_basics(fleet):
    out = fleet.run(comm_jobs.gloo_basics)
    for r, o in enumerate(out):
        assert o["gathered"] == [{"rank": i} for i in range(WORLD)]
        assert o["broadcast"] == [float(WORLD - 1)] * 3
        assert o["ring"] == [10.0 + (r - 1) % WORLD] * 4


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


def test_split_children_are_aborted_first(fleet):
    out = fleet.run(comm_jobs.split_and_abort, timeout_s=60)
    for r, o in enumerate(out):
        assert o["members"] == [i for i in range(WORLD) if i % 2 == r % 2]
        assert o["child_rank"] == r // 2 and o["child_world"] == WORLD // 2
        assert o["gathered"] == o["members"]
        assert o["child_broadcast"] == [float(o["members"][0])] * 2
        assert o["order"] == ["child", "parent-done"] and o["child_aborted"]
    # the fleet's groups are aborted now: rebuild the fleet for any later test in this module


def test_abort_is_idempotent_and_safe_unbuilt():
    g = StatelessProcessGroup("127.0.0.1", free_port(), 0, 1)
    g.abort()
    g.abort()
    assert g.aborted and g.store is None and "aborted" in repr(g)
    with pytest.raises(Exception, match="aborted"):
        g.all_gather_object(1)
    never = object.__new__(StatelessProcessGroup)
    never._init_state("refit", 0, 1, "gloo", 1.0)
    never.abort()  # a group whose rendezvous never happened
    assert never.aborted


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_backend_without_gpu_is_a_clear_error():
    port = free_port()
    with pytest.raises(RefitError, match="needs a CUDA device"):
        StatelessProcessGroup("127.0.0.1", port, 0, 1, backend="nccl")
    StatelessProcessGroup("127.0.0.1", port, 0, 1).abort()  # the store was dropped: the port is free again


def test_bad_arguments():
    with pytest.raises(RefitError, match="outside world size"):
        StatelessProcessGroup("127.0.0.1", free_port(), 2, 2)
    with pytest.raises(RefitError, match="backend"):
        StatelessProcessGroup("127.0.0.1", free_port(), 0, 1, backend="mpi")
    with pytest.raises(RefitError, match="peer"):
        StatelessProcessGroup("127.0.0.1", free_port(), 0, 1, peer="sglang")


def test_vllm_unique_id_wire_format(monkeypatch):
    raw = bytes(range(128))
    blob = _pickle_vllm_unique_id(raw)
    assert not any(m.startswith("vllm") for m in sys.modules), "fake modules are removed again"
    # unpickle the way a vLLM rank does: with vLLM's own ctypes type under its module name
    import ctypes

    name = "vllm.distributed.device_communicators.pynccl_wrapper"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    class ncclUniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__ = name
    ncclUniqueId.__qualname__ = "ncclUniqueId"
    sys.modules[name].ncclUniqueId = ncclUniqueId
    uid = pickle.loads(blob)
    assert type(uid) is ncclUniqueId and bytes(uid.internal) == raw
    assert _pickle_vllm_unique_id(raw) == blob, "with vLLM loaded, its own type gives the same bytes"
    with pytest.raises(RefitError, match="128 bytes"):
        _pickle_vllm_unique_id(b"short")


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
    assert isinstance(_Slot(0, 1), _Slot)


def test_gpu_benchmark_flow_runs_on_cpu():
    """The GPU benchmark's whole flow (plans, fused views, baselines, golden, hygiene, summary) on a
    tiny model over gloo: what the one device call will run, minus NCCL."""
    from refit.cli import bench_gpu
    tiny = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "vocab": 128}
    cfg = dict(bench_gpu._cfg(object()), layers=2, model=tiny, iters=2, refits=3, bucket_mib=1, bucket32_mib=1,
               group_mib=1, staging_mib=1)
    with LocalFleet(2) as f:
        r0, r1 = f.run(bench_gpu._bench_rank, cfg, timeout_s=120)
    s = bench_gpu.summarize(r0, r1, {"release_s": 0.0, "abort_call_s": 0.0, "error": "n/a"})
    assert all(s["verified"].values()), s["verify_failures"]
    assert s["hygiene_fp32_src"]["peak_staging_bytes"] <= s["hygiene_fp32_src"]["budget"]
    assert s["hygiene_fp32_src"]["capacity"] <= 1 << 20
    assert r1["fused_params"] < r1["tensors"]
    bench_gpu.print_table(s)
