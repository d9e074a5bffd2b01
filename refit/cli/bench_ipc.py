"""``refit bench --device cuda --transport ipc``: the 8B refit between processes of one node.

Two processes: rank 0 the trainer (Llama-3-8B in Hugging Face layout, bf16, about 16 GB),
rank 1 the engine (the same weights in vLLM's fused layout, each HF tensor a view of its
fused parameter). They share one GPU (colocated: ``--placement colocated``) or sit on two
GPUs of the host (``--placement two-gpus``); by default every placement the machine has
runs. A gloo ``StatelessProcessGroup`` carries the control only. In the same run:

* **device-to-device copy** (the limit): in the engine's process, the same bytes copied from
  a second copy of the model into the fused parameters, tensor by tensor, and as 1 GiB
  flat copies;
* **refit over IPC**: ``refit.transport.ipc``; the engine maps the trainer's tensors once
  and copies every block of its plan straight out of them, one copy per byte;
* **refit over NIXL** on the same pair (when NIXL is installed);
* **raw NCCL send/recv** of one flat buffer of the same bytes (two GPUs only: NCCL holds
  one rank per GPU);
* **per-bucket hand-off** (what colocated frameworks run today): the trainer packs each
  bucket into a buffer, hands its CUDA IPC handle and the tensors' metadata to the engine,
  which copies every tensor out into its parameters and acknowledges; then the next bucket.

Every refit is checked bit for bit in the engine; 50 more IPC refits check that neither
mappings, descriptors nor GPU memory grow.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from refit.cli.bench_gpu import RankTensors, _fresh_refit, _make_plan, _sync, _timed_loop, rank_tensors
from refit.cli.bench_sync import GB, MIB
from refit.cli.output import show
from refit.comm.group import StatelessProcessGroup, free_port
from refit.comm.rendezvous import new_secret
from refit.errors import ConfigError
from refit.testing.launch import LocalFleet
from refit.transport.factory import make_executor
from refit.transport.ipc import IpcChannel, export_cuda, open_cuda
from refit.transport.nixl import NixlChannel, nixl_available

PLACEMENTS = ("colocated", "two-gpus")
DEFAULTS = {"layers": 32, "iters": 10, "bucket_mib": 1024, "handoff_mib": 512, "refits": 50, "timeout_s": 60.0}


def _limit(side: RankTensors, iters: int) -> dict:
    """The engine's own device-to-device copy of the same bytes: tensor by tensor into the fused
    parameters, and as 1 GiB flat copies."""
    dev = side.device
    bufs = {n: torch.empty(shape, dtype=torch.bfloat16, device=dev) for n, shape in side.names}
    for t in bufs.values():
        t.normal_()

    def per_tensor():
        for n, t in bufs.items():
            side.dst[n].copy_(t)

    def timed(fn) -> float:
        fn()
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(dev)
        return (time.perf_counter() - t0) / iters

    out = {"per_tensor_s": timed(per_tensor)}
    bufs.clear()
    total = sum(t.numel() for t in side.dst.values()) * 2
    flat = [torch.empty(total, dtype=torch.uint8, device=dev) for _ in range(2)]
    step = 1 << 30

    def flat_copy():
        for i in range(0, total, step):
            flat[1][i: i + step].copy_(flat[0][i: i + step])

    out["flat_s"] = timed(flat_copy)
    flat.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _resources(t: IpcChannel, dev) -> dict:
    return {"mapped": t.mapped_regions, "fds": len(os.listdir("/proc/self/fd")),
            "gpu_bytes": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0}


def _handoff(group, side: RankTensors, bucket_bytes: int):
    """One refit as colocated frameworks run it: per bucket, the trainer packs tensors into a
    buffer and hands its IPC handle and the tensors' metadata over; the engine opens it,
    copies each tensor into its parameter and acknowledges."""
    dev = side.device
    names = side.names
    buckets, cur, size = [], [], 0
    for n, shape in names:
        nbytes = 2 * math.prod(shape)
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((n, shape, size))
        size += nbytes
    buckets.append(cur)
    cap = max(sum(2 * math.prod(s) for _, s, _ in b) for b in buckets)
    buf = torch.empty(cap, dtype=torch.uint8, device=dev) if side.rank == 0 else None

    def refit():
        for b in buckets:
            if side.rank == 0:
                for n, shape, off in b:
                    buf[off: off + 2 * math.prod(shape)].view(torch.bfloat16).view(shape).copy_(side.src[n])
                _sync(dev)
                msg = (export_cuda(buf), [(n, tuple(shape), off) for n, shape, off in b])
            else:
                msg = None
            handle, meta = group.broadcast_object(msg, src=0)
            if side.rank == 1:
                remote = open_cuda(handle)
                for n, shape, off in meta:
                    side.dst[n].copy_(remote[off: off + 2 * math.prod(shape)].view(torch.bfloat16).view(shape))
                _sync(dev)
                del remote
            group.barrier()  # the engine's acknowledgement: the buffer may be packed again

    return refit


def ipc_rank(group, cfg: dict) -> dict:
    # ``devices`` None: host memory (the tests run the whole bench on a tiny model over gloo)
    dev = torch.device("cuda", cfg["devices"][group.rank]) if cfg["devices"] else torch.device("cpu")
    side = rank_tensors(group, cfg, dev)
    src, dst = side.src, side.dst
    out: dict[str, Any] = side.header()
    out["device_index"] = dev.index if dev.type == "cuda" else -1
    out["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or "default"
    plan, _ = _make_plan(group, src, dst, cfg["bucket_mib"] * MIB)
    out["plan"] = {"sends": len(plan.sends), "recvs": len(plan.recvs), "ops": len(plan.send_ops() or plan.recv_ops())}
    if group.rank == 1:
        out["limit"] = _limit(side, cfg["iters"])
    group.barrier()

    # --- refit over IPC
    t0 = time.perf_counter()
    ipc = IpcChannel(group.rank, device=dev, timeout_s=cfg["timeout_s"])
    ex = make_executor(plan, None, transport="ipc", ipc=ipc)
    ex.prepare(src, dst)
    ipc.handshake(group)
    out["ipc_setup_s"] = time.perf_counter() - t0
    side.poison()
    group.barrier()
    ex.run()
    _sync(dev)
    group.barrier()
    out["ipc_verify"] = side.verify(cfg["seed"])[0]
    out["ipc"] = _timed_loop(group, ex.run, cfg["iters"], dev=dev)
    out["ipc_verify_fresh"] = _fresh_refit(group, side, cfg["seed"] + 7, ex.run)[0]
    before = _resources(ipc, dev)
    for _ in range(cfg["refits"]):
        ex.run()
    _sync(dev)
    out["ipc_hygiene"] = {"before": before, "after": _resources(ipc, dev), "refits": cfg["refits"]}
    out["ipc_verify_after_hygiene"] = _fresh_refit(group, side, cfg["seed"] + 11, ex.run)[0]
    ex.close()
    ipc.close()
    group.barrier()

    # --- refit over NIXL, same plan, same pair
    if cfg["nixl"]:
        try:
            t0 = time.perf_counter()
            nixl = NixlChannel(group.rank, device=dev, timeout_s=cfg["timeout_s"])
            nex = make_executor(plan, None, transport="nixl", nixl=nixl)
            nex.prepare(src, dst)
            nixl.handshake(group)
            setup = time.perf_counter() - t0
            out["nixl"] = {**_timed_loop(group, nex.run, cfg["iters"], dev=dev), "setup_s": setup,
                           "verify": _fresh_refit(group, side, cfg["seed"] + 13, nex.run)[0]}
            nex.close()
            nixl.close()
        except Exception as e:  # reported in the table, the other rows still count
            out["nixl"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        group.barrier()

    # --- raw NCCL send/recv of the same bytes (one rank per GPU only)
    if cfg["devices"] and cfg["devices"][0] != cfg["devices"][1]:
        nccl = StatelessProcessGroup("127.0.0.1", cfg["nccl_port"], group.rank, 2, backend="nccl", device=dev,
                                     secret=cfg["nccl_secret"])
        flat = torch.empty(out["bytes"], dtype=torch.uint8, device=dev)

        def raw():
            if group.rank == 0:
                nccl.p2p_group([], [(flat, 1)])
            else:
                nccl.p2p_group([(flat, 0)], [])

        out["nccl_raw"] = _timed_loop(group, raw, cfg["iters"], dev=dev)
        del flat
        streamed = make_executor(plan, nccl, transport="streamed", device=dev)
        out["nccl_refit"] = {**_timed_loop(group, lambda: streamed.run(src, dst), cfg["iters"], dev=dev),
                             "verify": _fresh_refit(group, side, cfg["seed"] + 17, lambda: streamed.run(src, dst))[0]}
        streamed.close()
        nccl.abort()
        torch.cuda.empty_cache()
        group.barrier()

    # --- the per-bucket IPC hand-off frameworks run today (CUDA IPC handles: GPUs only)
    if dev.type != "cuda":
        return out
    handoff = _handoff(group, side, cfg["handoff_mib"] * MIB)
    out["handoff"] = {**_timed_loop(group, handoff, max(2, cfg["iters"] // 3), warmup=1, dev=dev),
                      "verify": _fresh_refit(group, side, cfg["seed"] + 19, handoff)[0]}
    return out


def summarize(placement: str, r0: dict, r1: dict) -> dict:
    total = r1["bytes"]
    gbps = lambda s: total / s / GB  # noqa: E731
    slowest = lambda k, m="steady_s": max(r0[k][m], r1[k][m])  # noqa: E731
    limit_s = min(r1["limit"]["per_tensor_s"], r1["limit"]["flat_s"])
    s: dict[str, Any] = {
        "placement": placement, "devices": [r0["device_index"], r1["device_index"]], "device": r1["device"],
        "allocator": r1["allocator"], "bytes": total, "tensors": r1["tensors"], "plan": r1["plan"],
        "d2d_per_tensor_GBps": gbps(r1["limit"]["per_tensor_s"]), "d2d_flat_GBps": gbps(r1["limit"]["flat_s"]),
        "ipc_s": slowest("ipc"), "ipc_GBps": gbps(slowest("ipc")), "ipc_single_GBps": gbps(slowest("ipc", "single_s")),
        "ipc_setup_s": max(r0["ipc_setup_s"], r1["ipc_setup_s"]),
        "hygiene": {"trainer": r0["ipc_hygiene"], "engine": r1["ipc_hygiene"]},
        "verified": {"ipc": r1["ipc_verify"] and r1["ipc_verify_fresh"] and r1["ipc_verify_after_hygiene"]},
    }
    s["ipc_over_d2d"] = s["ipc_GBps"] / gbps(limit_s)
    if "handoff" in r1:
        s.update(handoff_s=slowest("handoff"), handoff_GBps=gbps(slowest("handoff")))
        s["ipc_over_handoff"] = s["ipc_GBps"] / s["handoff_GBps"]
        s["verified"]["handoff"] = r1["handoff"]["verify"]
    grew = {side: {k: v["after"][k] - v["before"][k] for k in v["before"]} for side, v in s["hygiene"].items()}
    s["hygiene_growth"] = grew
    s["verified"]["hygiene_flat"] = all(g["mapped"] == 0 and g["fds"] == 0 and g["gpu_bytes"] == 0
                                        for g in grew.values())
    if "nixl" in r1:
        if "error" in r0.get("nixl", {}) or "error" in r1["nixl"]:
            s["nixl"] = {"error": r0.get("nixl", {}).get("error") or r1["nixl"]["error"]}
        else:
            s["nixl"] = {"GBps": gbps(slowest("nixl")), "setup_s": max(r0["nixl"]["setup_s"], r1["nixl"]["setup_s"])}
            s["verified"]["nixl"] = r1["nixl"]["verify"]
    if "nccl_raw" in r1:
        s["nccl_raw_GBps"] = gbps(slowest("nccl_raw"))
        s["nccl_refit_GBps"] = gbps(slowest("nccl_refit"))
        s["ipc_over_nccl_raw"] = s["ipc_GBps"] / s["nccl_raw_GBps"]
        s["verified"]["nccl_refit"] = r1["nccl_refit"]["verify"]
    return s


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 150)
    for s in results:
        table = Table(title=f"refit bench --transport ipc: 8B model ({s['bytes'] / GB:.2f} GB, {s['tensors']} tensors "
                            f"-> fused), {s['placement']} on {s['device']} (GPUs {s['devices']}, allocator "
                            f"{s['allocator']})")
        for col in ("path", "ms", "GB/s", "note"):
            table.add_column(col, justify="left" if col in ("path", "note") else "right")
        ms = lambda gbps, s=s: f"{s['bytes'] / gbps / 1e6:.2f}"  # noqa: E731
        table.add_row("device-to-device copy, flat 1 GiB", ms(s["d2d_flat_GBps"]), f"{s['d2d_flat_GBps']:.0f}",
                      "same process: the limit")
        table.add_row("device-to-device copy, per tensor", ms(s["d2d_per_tensor_GBps"]),
                      f"{s['d2d_per_tensor_GBps']:.0f}", "into the fused params")
        over = f", x{s['ipc_over_handoff']:.2f} of the hand-off" if "handoff_GBps" in s else ""
        table.add_row("refit over IPC", ms(s["ipc_GBps"]), f"{s['ipc_GBps']:.0f}",
                      f"x{s['ipc_over_d2d']:.3f} of the copy{over}")
        if "nixl" in s:
            n = s["nixl"]
            table.add_row("refit over NIXL", *(("-", "-", n["error"][:80]) if "error" in n else
                                              (ms(n["GBps"]), f"{n['GBps']:.0f}", f"setup {n['setup_s']:.2f}s")))
        if "nccl_raw_GBps" in s:
            table.add_row("raw NCCL send/recv", ms(s["nccl_raw_GBps"]), f"{s['nccl_raw_GBps']:.0f}", "one flat buffer")
            table.add_row("refit over NCCL", ms(s["nccl_refit_GBps"]), f"{s['nccl_refit_GBps']:.0f}", "streamed")
        if "handoff_GBps" in s:
            table.add_row("per-bucket IPC hand-off", ms(s["handoff_GBps"]), f"{s['handoff_GBps']:.0f}",
                          "pack, hand the handle over, engine copies out, ack")
        console.print(table)
        console.print(f"  verified bit-exact: {s['verified']}; 50 refits grew {s['hygiene_growth']}")


def run(args) -> int:
    """``refit bench --device cuda --transport ipc`` from the parsed command line."""
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda --transport ipc: torch sees no GPU")
    gpus = torch.cuda.device_count()
    wanted = [args.ipc_placement] if args.ipc_placement else [p for p in PLACEMENTS if p != "two-gpus" or gpus >= 2]
    if "two-gpus" in wanted and gpus < 2:
        raise ConfigError(f"--ipc-placement two-gpus needs 2 GPUs; torch sees {gpus}")
    cfg = {**DEFAULTS, "seed": 1234, "nixl": nixl_available() and not args.ipc_no_nixl}
    for k in ("layers", "iters", "bucket_mib"):
        v = getattr(args, f"gpu_{k}", None)
        if v is not None and k in cfg:
            cfg[k] = v
    t0 = time.perf_counter()
    results, ranks = [], []
    for placement in wanted:
        devices = [0, 0] if placement == "colocated" else [0, 1]
        run_cfg = {**cfg, "devices": devices, "nccl_port": free_port(), "nccl_secret": new_secret()}
        with LocalFleet(2, start_timeout_s=300) as fleet:
            r0, r1 = fleet.run(ipc_rank, run_cfg, timeout_s=560)
        results.append(summarize(placement, r0, r1))
        ranks.append([r0, r1])
    doc = {"results": results, "wall_s": time.perf_counter() - t0, "per_rank": ranks}
    if getattr(args, "gpu_out", None):
        with open(args.gpu_out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    show(doc, args.json, lambda _: print_table(results), indent=1)
    return 0 if all(all(s["verified"].values()) for s in results) else 1

