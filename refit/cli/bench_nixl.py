"""``refit bench --device cuda --transport nixl``: NIXL next to streamed NCCL on one plan, in one run."""

from __future__ import annotations

import time
from typing import Any

import torch

from refit.transport.nixl import DEFAULT_CHUNK_BYTES, NixlTransport

GB = 1e9
MIB = 1 << 20


def _bench_rank(group, cfg: dict) -> dict:
    """One rank of ``bench``: the 8B refit of ``refit.cli.bench_gpu`` (HF trainer layout -> fused
    vLLM engine layout, bf16), one plan, moved by the streamed NCCL executor and by NIXL."""
    import math

    from refit.cli import bench_gpu as B
    from refit.transport.factory import make_executor

    dev = B._device(group)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    model = dict(cfg.get("model", {}), layers=cfg["layers"])
    names = B.hf_tensors(model)
    bf16 = torch.bfloat16
    src, dst = {}, {}
    if group.rank == 0:
        for i, (n, shape) in enumerate(names):
            src[n] = torch.empty(shape, dtype=bf16, device=dev)
            B.fill_pattern(src[n], cfg["seed"] + i)
    else:
        _, dst = B.fused_engine(model, bf16, dev)
    out: dict[str, Any] = {"rank": group.rank, "bytes": sum(math.prod(s) for _, s in names) * 2,
                           "tensors": len(names), "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}
    B._sync(dev)
    plan, _ = B._make_plan(group, cfg, src, dst, cfg["bucket_mib"] * MIB)
    out["plan"] = {"sends": len(plan.sends), "recvs": len(plan.recvs),
                   "single_block": sum(len(b.ops) == 1 for b in plan.sends + plan.recvs)}

    def poison():
        for d in dst.values():
            d.fill_(float("nan"))
        B._sync(dev)

    # NCCL, the streamed executor, on this plan
    kw = dict(staging_budget_bytes=cfg["staging_mib"] * MIB, group_bytes=cfg["group_mib"] * MIB)
    poison()
    make_executor(plan, group, transport="streamed", **kw).run(src, dst)
    out["verify_nccl"] = B._verify(group, model, dst, cfg["seed"], bf16)
    ex = make_executor(plan, group, transport="streamed", sync=False, **kw)
    out["nccl"] = B._timed_loop(group, lambda: ex.run(src, dst), cfg["iters"])
    # NIXL: in place (the default), and with every bucket staged
    for variant, direct in (("nixl", True), ("nixl_staged", False)):
        if variant == "nixl_staged" and not cfg.get("staged", True):
            continue
        t0 = time.perf_counter()
        t = NixlTransport(group.rank, device=dev, timeout_s=cfg["timeout_s"], direct=direct,
                          chunk_bytes=cfg["chunk_mib"] * MIB)
        try:
            t.prepare(plan, src, dst)
            t.handshake(group)  # the one collective, before any refit
            res: dict[str, Any] = {"setup_s": time.perf_counter() - t0}
            poison()
            st = t.run(src, dst)
            res.update(first_s=st.seconds, staging_bytes=st.staging_capacity_bytes, zero_copy=st.zero_copy_buckets)
            res["verify"] = B._verify(group, model, dst, cfg["seed"], bf16)
            res.update(B._timed_loop(group, lambda t=t: t.run(src, dst), cfg["iters"]))
            if group.rank == 0:  # fresh weights, poisoned destination, one more verified refit
                for i, (n, _) in enumerate(names):
                    B.fill_pattern(src[n], cfg["seed"] + 7 + i)
            poison()
            B._sync_barrier(group)
            t.run(src, dst)
            res["verify_fresh"] = B._verify(group, model, dst, cfg["seed"] + 7, bf16)
            if group.rank == 0:
                for i, (n, _) in enumerate(names):
                    B.fill_pattern(src[n], cfg["seed"] + i)
            B._sync_barrier(group)
        except Exception as e:  # noqa: BLE001 - reported in the table rather than losing the NCCL figures
            res = {"error": f"{type(e).__name__}: {e}"}
        finally:
            t.close()
        out[variant] = res
    return out


def bench_summary(r0: dict, r1: dict) -> dict:
    total = r1["bytes"]

    def gbps(key, field="steady_s"):
        a, b = r0.get(key, {}), r1.get(key, {})
        if field not in a or field not in b:
            return float("nan")
        return total / max(a[field], b[field]) / GB

    s = {"model": f"Llama-3 shapes, {r1['tensors']} HF tensors -> fused vLLM params, bf16", "bytes": total,
         "device": r1["device"], "plan": r1["plan"], "nccl_GBps": gbps("nccl"),
         "nccl_single_GBps": gbps("nccl", "single_s"),
         "verified": {"nccl": r1["verify_nccl"][0]}}
    for v in ("nixl", "nixl_staged"):
        if v not in r1:
            continue
        if "error" in r0[v] or "error" in r1[v]:
            s[v] = {"error": r0[v].get("error") or r1[v].get("error")}
            continue
        s[v] = {"GBps": gbps(v), "single_GBps": gbps(v, "single_s"), "setup_s": max(r0[v]["setup_s"], r1[v]["setup_s"]),
                "src_staging_MiB": r0[v]["staging_bytes"] / MIB, "dst_staging_MiB": r1[v]["staging_bytes"] / MIB}
        s[v]["over_nccl"] = s[v]["GBps"] / s["nccl_GBps"]
        s["verified"][v] = r1[v]["verify"][0] and r1[v]["verify_fresh"][0]
    return s


def print_bench(s: dict) -> None:
    print(f"\n{s['model']}; {s['bytes'] / GB:.2f} GB; {s['device']} x2; plan {s['plan']}")
    print(f"{'path':40s} {'GB/s':>8s} {'single':>8s}  note")
    print(f"{'NCCL, streamed executor':40s} {s['nccl_GBps']:8.1f} {s['nccl_single_GBps']:8.1f}  same plan")
    for v, label in (("nixl", "NIXL WRITE, in place (zero copy)"), ("nixl_staged", "NIXL WRITE, every bucket staged")):
        r = s.get(v)
        if r is None:
            continue
        if "error" in r:
            print(f"{label:40s} {'-':>8s} {'-':>8s}  {r['error']}")
            continue
        print(f"{label:40s} {r['GBps']:8.1f} {r['single_GBps']:8.1f}  x{r['over_nccl']:.3f} of NCCL; setup "
              f"{r['setup_s']:.2f}s; staging {r['src_staging_MiB']:.0f}/{r['dst_staging_MiB']:.0f} MiB (src/dst)")
    print(f"verified bit-exact: {s['verified']}")


DEFAULTS = {"layers": 32, "iters": 10, "bucket_mib": 1024, "chunk_mib": DEFAULT_CHUNK_BYTES // MIB,
            "staging_mib": 1024, "group_mib": 1024, "timeout_s": 60.0, "out": None}


def bench(overrides: dict[str, Any] | None = None, *, staged: bool = True, as_json: bool = False) -> int:
    """``refit bench --device cuda --transport nixl``: NIXL against NCCL on the 2-GPU 8B refit (same plan,
    same run), with ``overrides`` of ``DEFAULTS`` (what the command line's flags set)."""
    import json

    from refit.testing.launch import DeviceFleet

    unknown = sorted(set(overrides or {}) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"bench_nixl.bench: unknown settings {unknown}; known: {sorted(DEFAULTS)}")
    args = {**DEFAULTS, **(overrides or {})}
    if torch.cuda.device_count() < 2:
        print("the NIXL GPU bench needs 2 GPUs; torch sees", torch.cuda.device_count())
        return 2
    cfg = {**{k: v for k, v in args.items() if k != "out"}, "staged": staged, "seed": 1234}
    t0 = time.perf_counter()
    with DeviceFleet(2) as fleet:
        r0, r1 = fleet.run(_bench_rank, cfg, timeout_s=280)
    s = bench_summary(r0, r1)
    s["wall_s"] = time.perf_counter() - t0
    s["per_rank"] = [r0, r1]
    text = json.dumps(s, indent=1, default=str)
    if args["out"]:
        with open(args["out"], "w") as f:
            f.write(text)
    if as_json:
        print(text)
    else:
        print_bench(s)
    return 0 if all(s["verified"].values()) else 1

