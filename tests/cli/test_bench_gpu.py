"""The per-rank flows of `refit bench --device cuda` (NCCL, and NIXL) on CPU over gloo."""

from __future__ import annotations

from refit.testing.launch import LocalFleet


def test_gpu_benchmark_flow_runs_on_cpu():
    """The GPU benchmark's whole flow (plans, fused views, baselines, golden, hygiene, summary) on a
    tiny model over gloo: what the one device call will run, minus NCCL."""
    from refit.cli import bench_gpu
    tiny = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "vocab": 128}
    cfg = dict(bench_gpu.config_from_args(object()), layers=2, model=tiny, iters=2, refits=3, bucket_mib=1,
               bucket32_mib=1, group_mib=1, staging_mib=1)
    with LocalFleet(2) as f:
        r0, r1 = f.run(bench_gpu.transport_rank, cfg, timeout_s=120)
    s = bench_gpu.summarize(r0, r1, {"release_s": 0.0, "abort_call_s": 0.0, "error": "n/a"})
    assert all(s["verified"].values()), s["verify_failures"]
    assert s["hygiene_fp32_src"]["peak_staging_bytes"] <= s["hygiene_fp32_src"]["budget"]
    assert s["hygiene_fp32_src"]["capacity"] <= 1 << 20
    assert r1["fused_params"] < r1["tensors"]
    bench_gpu.print_table(s)


def test_nixl_benchmark_flow_runs_on_cpu():
    """`refit bench --device cuda --transport nixl`'s per-rank flow on a tiny model in host memory:
    the streamed executor over gloo, then NIXL in place and staged, each checked bit for bit."""
    import pytest

    from refit.cli import bench_gpu
    from refit.transport.nixl import nixl_available

    if not nixl_available():
        pytest.skip("needs NIXL (refit[nixl])")
    tiny = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "vocab": 128}
    cfg = dict(bench_gpu.NIXL_DEFAULTS, layers=2, model=tiny, iters=2, bucket_mib=1, chunk_mib=1, staging_mib=1,
               group_mib=1, staged=True, seed=1234)
    with LocalFleet(2) as f:
        r0, r1 = f.run(bench_gpu.nixl_rank, cfg, timeout_s=120)
    s = bench_gpu.nixl_summary(r0, r1)
    assert s["verified"] == {"nccl": True, "nixl": True, "nixl_staged": True}, s
    bench_gpu.print_nixl_table(s)


def test_ipc_benchmark_flow_runs_on_cpu():
    """`refit bench --device cuda --transport ipc`'s per-rank flow on a tiny model in host memory
    (shared-memory segments instead of CUDA IPC; the hand-off baseline needs CUDA): the limit
    copies, the IPC refit checked bit for bit, and 3 more refits that must grow nothing."""
    from refit.cli import bench_ipc

    tiny = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "vocab": 128}
    cfg = dict(bench_ipc.DEFAULTS, layers=2, model=tiny, iters=2, refits=3, bucket_mib=1, seed=1234, nixl=False,
               devices=None)
    with LocalFleet(2) as f:
        r0, r1 = f.run(bench_ipc.ipc_rank, cfg, timeout_s=120)
    s = bench_ipc.summarize("colocated", r0, r1)
    assert s["verified"] == {"ipc": True, "hygiene_flat": True}, s
    assert s["ipc_GBps"] > 0 and s["ipc_over_d2d"] > 0
    bench_ipc.print_table([s])
