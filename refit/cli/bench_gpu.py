"""``refit bench --device cuda``: an 8B model refit between two GPUs, against raw NCCL and broadcasts.

Two processes, one GPU each, joined by a ``StatelessProcessGroup(backend="nccl")``. Rank 0
is the trainer: Llama-3-8B's tensors in Hugging Face layout (separate q/k/v and gate/up,
bf16, about 16 GB, 291 tensors). Rank 1 is the engine: the same weights in vLLM's fused
layout (``qkv_proj``, ``gate_up_proj``), each HF tensor a view of its fused parameter, so
bytes land in place. In the same run it measures:

* **refit**: the plan executed by the streamed NCCL transport (steady state, back to back);
* **raw NCCL**: one ``ncclSend``/``ncclRecv`` of one flat buffer of the same bytes;
* **per-tensor broadcast**: one NCCL broadcast per tensor into a fresh buffer, then the
  engine's copy into its fused parameter (the loop most RL frameworks run), both as a
  pure stream-ordered loop and with the per-tensor metadata handshake frameworks do;
* **xferdtensor_golden** per tensor;
* **fp32 -> bf16**: an fp32 trainer copy, cast while packing;
* **hygiene**: 50 refits, staging peak and GPU memory before / after;
* **abort**: how fast ``abort()`` releases a rank blocked in an NCCL receive;
* **IPC pull** (experimental): the engine maps the trainer's tensors over CUDA IPC and pulls
  them with copy engines, the same-host path that can beat NCCL.

With ``--transport nixl`` the same plan is moved instead by the streamed NCCL executor and by
``refit.transport.nixl``'s one-sided WRITEs, in place and with every bucket staged.

Every destination tensor is checked bit for bit after the refits (and the golden run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import statistics
import sys
import time
from typing import Any

import torch

from refit.cli.bench_sync import GB, MIB, fill_pattern, holds_pattern
from refit.layout import DTensorRef, Replicate, dtype_name
from refit.models.fused import FusedLayout
from refit.models.specs import MODELS, ModelSpec
from refit.plan import RankPlan, RosterEntry, build_rank_plan, merge_rosters, pack_buckets
from refit.testing.launch import DeviceFleet, abort_blocked_recv
from refit.transport.factory import make_executor
from refit.transport.nixl import DEFAULT_CHUNK_BYTES, NixlChannel, NixlExecutor
from refit.transport.streamed import release_staging
from refit.transport.xfer import xferdtensor_golden

# -- the model -------------------------------------------------------------------------------------

def bench_spec(model: dict) -> ModelSpec:
    """Llama-3-8B's shapes (``refit.models.specs``) with the fields ``model`` gives replaced.

    ``model`` may set ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``inter`` and
    ``vocab``: the tests run the whole flow on a tiny model over gloo.
    """
    fields = dict(layers="num_layers", hidden="hidden_size", heads="num_heads", kv_heads="num_kv_heads",
                  head_dim="head_dim", inter="intermediate_size", vocab="vocab_size")
    return dataclasses.replace(MODELS["llama3-8b"], **{fields[k]: v for k, v in model.items()})


def hf_tensors(model: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the bench's model (``bench_spec``) in Hugging Face naming."""
    return [(p.name, p.shape) for p in bench_spec(model).params()]


def fused_engine(model: dict, dtype, device) -> tuple[dict, dict]:
    """vLLM-style parameters (fused qkv_proj / gate_up_proj) and, per HF name, a view into them."""
    params, views = FusedLayout(bench_spec(model)).build(lambda shape: torch.empty(shape, dtype=dtype, device=device))
    return params, {name: ref.to_local() for name, (ref, _, _) in views.items()}


def whole(shape: tuple[int, ...]) -> tuple:
    """The region of a whole tensor (``bench_sync.pattern``'s positions): ranks here hold whole tensors."""
    return tuple(((0, n),) for n in shape)


# -- per-rank benchmark ---------------------------------------------------------------------------

def _device(group):
    return group.device if getattr(group, "device", None) is not None else torch.device("cpu")


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _allocated(dev) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def _sync_barrier(group, dev: torch.device | None = None) -> None:
    """This rank's device drained (the group's, or ``dev``), then a barrier of the group."""
    _sync(dev if dev is not None else _device(group))
    group.barrier()


def _make_plan(group, src, dst, bucket_bytes: int) -> tuple[RankPlan, float]:
    """This rank's plan, and the seconds its build took (merging the rosters not counted)."""
    mine = [RosterEntry.make(n, tuple(t.shape), dtype_name(t.dtype), [0], [Replicate()], "src")
            for n, t in src.items()]
    mine += [RosterEntry.make(n, tuple(t.shape), dtype_name(t.dtype), [1], [Replicate()], "dst")
             for n, t in dst.items()]
    gathered = group.all_gather_object(mine)
    index = merge_rosters(dict(enumerate(gathered)), group.world_size)
    t0 = time.perf_counter()
    plan = build_rank_plan(index, group.rank, bucket_bytes=bucket_bytes)
    return plan, time.perf_counter() - t0


def _repack(plan, direct_bytes: int, bucket_bytes: int):
    """The same ops cut into buckets with another direct threshold (both ends do the same)."""
    def cut(ops):
        by_peer = {}
        for op in ops:
            by_peer.setdefault(op.dst if op.src == plan.rank else op.src, []).append(op)
        out = [b for p, o in by_peer.items() for b in pack_buckets(o, p, bucket_bytes, direct_bytes)]
        return sorted(out, key=lambda b: (b.index, b.peer))

    return RankPlan(plan.rank, plan.world_size, bucket_bytes, plan.key + ("repack", direct_bytes, bucket_bytes),
                    sends=cut(plan.send_ops()), recvs=cut(plan.recv_ops()), local=list(plan.local))


def _breakdown(group, plan, src, dst, kw, n: int = 3) -> dict:
    """Where one synced refit's time goes: host setup / first group queued / all queued, and on
    the GPU: idle before the first NCCL group, first group start to last group end."""
    dev = _device(group)
    rows = []
    for _ in range(n):
        _sync_barrier(group)
        t = time.perf_counter()
        st = make_executor(plan, group, transport="streamed", timing=True, **kw).run(src, dst)
        _sync(dev)
        total = time.perf_counter() - t
        row = {"total_s": total, **{k: v for k, v in st.timing.items() if k != "events"}}
        ev = st.timing.get("events")
        if ev:
            row["gpu_idle_before_first_group_s"] = ev["begin"].elapsed_time(ev["first_group"]) / 1e3
            row["gpu_groups_s"] = ev["first_group"].elapsed_time(ev["last_group"]) / 1e3
        rows.append(row)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _timed_loop(group, fn, iters: int, warmup: int = 2, singles: int = 3, dev: torch.device | None = None) -> dict:
    """Back-to-back iterations (no host sync between them), then ``singles`` synced ones:
    seconds per iteration on this rank (whose device is the group's, or ``dev``)."""
    dev = dev if dev is not None else _device(group)
    for _ in range(warmup):
        fn()
    _sync_barrier(group, dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(dev)
    steady = (time.perf_counter() - t0) / iters
    times = []
    for _ in range(singles):
        _sync_barrier(group, dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return {"steady_s": steady, "single_s": statistics.median(times) if times else steady}


@dataclasses.dataclass(frozen=True)
class RankTensors:
    """One rank's side of the refit: rank 0, the trainer, holds ``src`` (the HF tensors); rank 1, the
    engine, holds ``params`` (the fused vLLM parameters) and ``dst``, per HF name a view into them."""

    rank: int
    device: torch.device
    model: dict  # ``bench_spec``'s overrides
    names: list[tuple[str, tuple[int, ...]]]
    src: dict[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]

    def header(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                else "cpu", "bytes": sum(math.prod(s) for _, s in self.names) * 2, "tensors": len(self.names),
                "fused_params": len(self.params)}

    def fill(self, seed: int) -> None:
        """The trainer's weights of ``seed`` (nothing on the engine)."""
        for i, (n, shape) in enumerate(self.names if self.rank == 0 else ()):
            fill_pattern(self.src[n], shape, whole(shape), seed + i)

    def poison(self) -> None:
        """NaN in every engine element: one that a refit misses fails the check."""
        for d in self.dst.values():
            d.fill_(float("nan"))
        _sync(self.device)

    def verify(self, seed: int) -> tuple[bool, list[str]]:
        """Whether the engine holds the trainer's weights of ``seed`` bit for bit; up to 5 names that differ.

        The pattern's values are exact in bf16 and fp32, so the fp32 trainer's cast lands the same bits."""
        bad = [n for i, (n, shape) in enumerate(self.names if self.rank == 1 else ())
               if not holds_pattern(self.dst[n], shape, whole(shape), seed + i)]
        return not bad, bad[:5]


def rank_tensors(group, cfg: dict, device: torch.device | None = None) -> RankTensors:
    """This rank's tensors in bf16 on its device (the group's, or ``device``), the trainer's
    filled with ``cfg["seed"]``."""
    dev = device if device is not None else _device(group)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model = dict(cfg.get("model", {}), layers=cfg["layers"])
    names = hf_tensors(model)
    src, dst, params = {}, {}, {}
    if group.rank == 0:
        src = {n: torch.empty(shape, dtype=torch.bfloat16, device=dev) for n, shape in names}
    else:
        params, dst = fused_engine(model, torch.bfloat16, dev)
    side = RankTensors(group.rank, dev, model, names, src, dst, params)
    side.fill(cfg["seed"])
    _sync(dev)
    return side


def _fresh_refit(group, side: RankTensors, seed: int, refit) -> tuple[bool, list[str]]:
    """New trainer weights, a poisoned engine, one ``refit()``: stale or missing bytes fail its check."""
    side.fill(seed)
    side.poison()
    _sync_barrier(group, side.device)
    refit()
    return side.verify(seed)


def _runner(group, plan, src, dst, **kw):
    """One refit of ``plan`` by the streamed NCCL executor, built once."""
    ex = make_executor(plan, group, transport="streamed", **kw)
    return lambda: ex.run(src, dst)


def transport_rank(group, cfg: dict) -> dict:
    side = rank_tensors(group, cfg)
    src, dst = side.src, side.dst
    out = side.header()
    budget = cfg["staging_mib"] * MIB
    kw = dict(staging_budget_bytes=budget, group_bytes=cfg["group_mib"] * MIB)
    plan = _bench_refit(group, side, cfg, kw, out)
    out["raw"] = _bench_raw(group, side.device, out["bytes"], cfg["iters"])
    out["sweep"] = _bench_sweep(group, side, plan, cfg, budget, out) if cfg["sweep"] else []
    _bench_broadcasts(group, side, cfg, out)
    out["hygiene_bf16"] = _hygiene(group, side.device, plan, src, dst, cfg["refits"], kw)
    # experimental: the engine pulls over CUDA IPC with copy engines (same host only)
    if cfg["ipc"] and side.device.type == "cuda":
        try:
            side.poison()
            out["ipc"] = _ipc_pull(group, src, dst, side.names, cfg)
            out["ipc"]["verified"] = side.verify(cfg["seed"] + 7)[0] if group.rank == 1 else None
        except Exception as e:  # an experiment must not sink the benchmark
            out["ipc"] = {"error": f"{type(e).__name__}: {e}"}
    if cfg["fp32"]:
        _bench_fp32(group, side, cfg, kw, out)
    release_staging(side.device)
    return out


def _bench_refit(group, side, cfg: dict, kw: dict, out: dict):
    """The refit in the main configuration, verified: first run, timed loop, a fresh executor, the breakdown."""
    src, dst = side.src, side.dst
    plan, build_s = _make_plan(group, src, dst, cfg["bucket_mib"] * MIB)
    out["plan"] = {"build_s": build_s, "rounds": plan.num_rounds, "sends": len(plan.sends),
                   "recvs": len(plan.recvs), "direct": sum(len(b.ops) == 1 for b in plan.sends + plan.recvs)}
    side.poison()
    st = make_executor(plan, group, transport="streamed", **kw).run(src, dst)
    out["refit_first_s"] = st.seconds
    out["refit_groups"] = st.groups
    out["refit_zero_copy"] = st.zero_copy_buckets
    out["verify_refit"] = side.verify(cfg["seed"])
    out["refit"] = _timed_loop(group, _runner(group, plan, src, dst, sync=False, **kw), cfg["iters"])
    out["verify_refit_fresh"] = _fresh_refit(
        group, side, cfg["seed"] + 7, lambda: make_executor(plan, group, transport="streamed", **kw).run(src, dst))
    out["refit_breakdown"] = _breakdown(group, plan, src, dst, kw)
    return plan


def _bench_raw(group, dev, nbytes: int, iters: int) -> dict:
    """Raw NCCL: one flat buffer of the same bytes."""
    bufs = {"flat": torch.empty(nbytes, dtype=torch.uint8, device=dev)}

    def raw():
        flat = bufs["flat"]
        works = group.p2p_group([], [(flat, 1)]) if group.rank == 0 else group.p2p_group([(flat, 0)], [])
        for w in works:  # gloo only: NCCL work is ordered on the stream
            group.wait(w)

    res = _timed_loop(group, raw, iters)
    bufs.clear()  # given back before the sweeps allocate theirs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _bench_sweep(group, side, plan, cfg: dict, budget: int, out: dict) -> list[dict]:
    """Bucket and group sizes, then fewer, larger NCCL ops (blocks under a threshold packed)."""
    src, dst, sweep = side.src, side.dst, []
    for b_mib, g_mib in [(1024, g) for g in (64, 256, 4096, 1 << 20)] + [(128, 1024)]:
        p, _ = _make_plan(group, src, dst, b_mib * MIB)
        res = _timed_loop(group, _runner(group, p, src, dst, sync=False, staging_budget_bytes=budget,
                                         group_bytes=g_mib * MIB), max(3, cfg["iters"] // 2))
        sweep.append({"bucket_mib": b_mib, "group_mib": g_mib, "packed": False, "rounds": p.num_rounds, **res})
    # fewer, larger NCCL ops: blocks under the threshold are packed (copies overlap the wire)
    for direct_mib, b_mib in ((16, 512), (64, 512), (1 << 20, 512), (1 << 20, 1024)):
        p = _repack(plan, direct_mib * MIB, b_mib * MIB)
        res = _timed_loop(group, _runner(group, p, src, dst, sync=False, staging_budget_bytes=budget,
                                         group_bytes=cfg["group_mib"] * MIB), max(3, cfg["iters"] // 2))
        sweep.append({"bucket_mib": b_mib, "group_mib": cfg["group_mib"], "packed": f"<{direct_mib}MiB",
                      "rounds": p.num_rounds, "ops": len(p.sends) + len(p.recvs), **res})
    side.poison()  # the last (all-packed) variant lands the same bytes
    make_executor(p, group, transport="streamed", staging_budget_bytes=budget).run(src, dst)
    out["verify_repacked"] = side.verify(cfg["seed"] + 7)
    return sweep


def _bench_broadcasts(group, side, cfg: dict, out: dict) -> None:
    """The per-tensor baselines: broadcast (with and without a per-tensor handshake) and xferdtensor_golden."""
    src, dst, dev, names = side.src, side.dst, side.device, side.names

    def bcast_loop(handshake: bool):
        def fn():
            for n, shape in names:
                if handshake:  # the engine learns name/dtype/shape per tensor (an RPC in real frameworks)
                    meta = group.broadcast_object((n, "bfloat16", shape) if group.rank == 0 else None, src=0)
                    assert meta[0] == n
                if group.rank == 0:
                    group.broadcast(src[n], 0)
                else:
                    tmp = torch.empty(shape, dtype=torch.bfloat16, device=dev)
                    group.broadcast(tmp, 0)
                    dst[n].copy_(tmp)  # load_weights into the fused parameter
        return fn

    out["bcast"] = _timed_loop(group, bcast_loop(False), max(2, cfg["iters"] // 3), warmup=1)
    out["verify_bcast"] = side.verify(cfg["seed"] + 7)
    out["bcast_handshake"] = _timed_loop(group, bcast_loop(True), 1, warmup=1, singles=0)

    def golden():
        for n, shape in names:
            s = DTensorRef(src[n], shape) if group.rank == 0 else None
            d = DTensorRef(dst[n], shape) if group.rank == 1 else None
            xferdtensor_golden(s, [0], [Replicate()], d, [1], [Replicate()], group)

    side.poison()
    out["golden"] = _timed_loop(group, golden, 1, warmup=1, singles=0)
    out["verify_golden"] = side.verify(cfg["seed"] + 7)


def _hygiene(group, dev, plan, src: dict, dst: dict, n: int, kw: dict) -> dict:
    """``n`` refits with fresh executors: staging stays bounded and GPU memory flat."""
    _sync(dev)
    base = _allocated(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    peaks, allocs = [], []
    for _ in range(n):
        stats = make_executor(plan, group, transport="streamed", **kw).run(src, dst)
        peaks.append(stats.peak_staging_bytes)
        allocs.append(_allocated(dev))
    peak_alloc = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else 0
    return {"refits": n, "peak_staging_bytes": max(peaks), "capacity": stats.staging_capacity_bytes,
            "budget": kw["staging_budget_bytes"], "alloc_first": allocs[0] - base, "alloc_last": allocs[-1] - base,
            "max_allocated_over_base": peak_alloc}


def _bench_fp32(group, side, cfg: dict, kw: dict, out: dict) -> None:
    """fp32 sources to bf16 destinations: the cast made while packing."""
    dst, dev = side.dst, side.device
    src32 = {}
    if group.rank == 0:
        for i, (n, shape) in enumerate(side.names):
            src32[n] = torch.empty(shape, dtype=torch.float32, device=dev)
            fill_pattern(src32[n], shape, whole(shape), cfg["seed"] + 11 + i)
        side.src.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    plan32, _ = _make_plan(group, src32, dst, cfg["bucket32_mib"] * MIB)
    side.poison()
    make_executor(plan32, group, transport="streamed", **kw).run(src32, dst)
    out["verify_fp32"] = side.verify(cfg["seed"] + 11)
    out["fp32"] = _timed_loop(group, _runner(group, plan32, src32, dst, sync=False, **kw), cfg["iters"])
    out["fp32_rounds"] = plan32.num_rounds
    out["fp32_breakdown"] = _breakdown(group, plan32, src32, dst, kw)
    out["hygiene_fp32"] = _hygiene(group, dev, plan32, src32, dst, cfg["refits"], kw)
    out["fp32_sweep"] = []
    if cfg["sweep"]:
        for b_mib, budget_mib, g_mib in ((256, 1024, 1024), (1024, 4096, 2048), (512, 1024, 1024)):
            p32, _ = _make_plan(group, src32, dst, b_mib * MIB)
            runner = _runner(group, p32, src32, dst, sync=False, staging_budget_bytes=budget_mib * MIB,
                             group_bytes=g_mib * MIB)
            res = _timed_loop(group, runner, max(3, cfg["iters"] // 2))
            out["fp32_sweep"].append({"bucket_mib": b_mib, "staging_mib": budget_mib, "group_mib": g_mib, **res})


def nixl_rank(group, cfg: dict) -> dict:
    """One rank of ``--transport nixl``: one plan moved by the streamed NCCL executor, then by NIXL's
    one-sided WRITEs in place (the default) and with every bucket staged."""
    side = rank_tensors(group, cfg)
    src, dst = side.src, side.dst
    out = side.header()
    plan, _ = _make_plan(group, src, dst, cfg["bucket_mib"] * MIB)
    out["plan"] = {"sends": len(plan.sends), "recvs": len(plan.recvs),
                   "single_block": sum(len(b.ops) == 1 for b in plan.sends + plan.recvs)}
    kw = dict(staging_budget_bytes=cfg["staging_mib"] * MIB, group_bytes=cfg["group_mib"] * MIB)
    side.poison()
    make_executor(plan, group, transport="streamed", **kw).run(src, dst)
    out["verify_nccl"] = side.verify(cfg["seed"])
    out["nccl"] = _timed_loop(group, _runner(group, plan, src, dst, sync=False, **kw), cfg["iters"])
    for variant, direct in (("nixl", True), ("nixl_staged", False)):
        if variant == "nixl_staged" and not cfg.get("staged", True):
            continue
        t0 = time.perf_counter()
        channel = NixlChannel(group.rank, device=side.device, timeout_s=cfg["timeout_s"], direct=direct,
                              chunk_bytes=cfg["chunk_mib"] * MIB)
        ex = NixlExecutor(plan, channel)
        try:
            ex.prepare(src, dst)
            channel.handshake(group)  # the one collective, before any refit
            res: dict[str, Any] = {"setup_s": time.perf_counter() - t0}
            side.poison()
            st = ex.run()
            res.update(first_s=st.seconds, staging_bytes=st.staging_capacity_bytes, zero_copy=st.zero_copy_buckets)
            res["verify"] = side.verify(cfg["seed"])
            res.update(_timed_loop(group, ex.run, cfg["iters"]))
            res["verify_fresh"] = _fresh_refit(group, side, cfg["seed"] + 7, ex.run)
            side.fill(cfg["seed"])  # the next variant starts from the first weights
            _sync_barrier(group)
        except Exception as e:  # reported in the table rather than losing the NCCL figures
            res = {"error": f"{type(e).__name__}: {e}"}
        finally:
            ex.close()
            channel.close()
        out[variant] = res
    return out


_IPC_CLASSES = ("torch.Tensor", "torch.nn.parameter.Parameter", "torch.storage.UntypedStorage",
                "torch.UntypedStorage", "torch.storage.TypedStorage")


def _ipc_export(reduced) -> list:
    """torch's CUDA IPC reduction of a tensor, as data: classes and dtypes by name.

    The store carries data only (it is never unpickled), so the rebuild function and
    classes of ``reduce_tensor`` travel as names and are looked up in a fixed list.
    """
    rebuild, args = reduced
    if rebuild.__name__ != "rebuild_cuda_tensor":
        raise RuntimeError(f"expected a CUDA tensor's IPC reduction, got {rebuild.__name__}")
    out = []
    for a in args:
        if isinstance(a, type):
            out.append({"class": f"{a.__module__}.{a.__qualname__}"})
        elif isinstance(a, torch.dtype):
            out.append({"dtype": str(a).removeprefix("torch.")})
        elif isinstance(a, torch.Size):
            out.append(tuple(int(x) for x in a))
        else:
            out.append(a)
    return out


def _ipc_import(args: list) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    real = []
    for a in args:
        if isinstance(a, dict) and "class" in a:
            if a["class"] not in _IPC_CLASSES:
                raise RuntimeError(f"IPC handle names class {a['class']!r}, not one of {_IPC_CLASSES}")
            module, _, name = a["class"].rpartition(".")
            real.append(getattr(importlib.import_module(module), name))
        elif isinstance(a, dict) and "dtype" in a:
            real.append(getattr(torch, a["dtype"]))
        else:
            real.append(a)
    return rebuild_cuda_tensor(*real)


def _ipc_pull(group, src, dst, names, cfg) -> dict:
    """Rank 1 maps rank 0's tensors (CUDA IPC) and copies them into its views with copy engines."""
    from torch.multiprocessing.reductions import reduce_tensor

    dev = group.device
    exported = {n: _ipc_export(reduce_tensor(t)) for n, t in src.items()} if group.rank == 0 else None
    handles = group.broadcast_object(exported, 0)
    out = {}
    if group.rank == 1:
        mapped = {n: _ipc_import(args) for n, args in handles.items()}
        same_dtype = all(mapped[n].dtype == dst[n].dtype for n, _ in names)
        out["same_dtype"] = same_dtype
        stream = torch.cuda.Stream(device=dev)

        def pull():
            with torch.cuda.stream(stream):
                for n, _ in names:
                    dst[n].copy_(mapped[n], non_blocking=True)
            torch.cuda.current_stream(dev).wait_stream(stream)
    else:
        def pull():
            pass

    def step():  # one refit: the trainer's weights are final (barrier), the engine pulls, then both go on
        group.barrier()
        pull()
        torch.cuda.synchronize()
        group.barrier()

    res = _timed_loop(group, step, max(3, cfg["iters"] // 2), warmup=1)
    out.update(res)
    if group.rank == 1:  # the copies alone, without the two handshakes of a refit
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            pull()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out["pull_only_s"] = statistics.median(times)
    if group.rank == 1:
        mapped.clear()
    group.barrier()
    return out


# -- command line -------------------------------------------------------------------------------

def add_gpu_arguments(p: argparse.ArgumentParser) -> None:
    from refit.cli.checks import positive_int, writable_file

    g = p.add_argument_group("--device cuda (2 GPUs, NCCL)")
    g.add_argument("--gpu-layers", type=positive_int, default=32,
                   help="transformer layers of the Llama-3-8B model [32]")
    g.add_argument("--gpu-bucket-mib", type=positive_int, default=1024, help="plan bucket size, MiB [1024]")
    g.add_argument("--gpu-bucket32-mib", type=positive_int, default=512,
                   help="bucket size of the fp32->bf16 plan, MiB [512]")
    g.add_argument("--gpu-group-mib", type=positive_int, default=1024,
                   help="bytes per NCCL group (window of rounds), MiB [1024]")
    g.add_argument("--gpu-staging-mib", type=positive_int, default=2048, help="staging budget, MiB [2048]")
    g.add_argument("--gpu-iters", type=positive_int, default=10, help="timed back-to-back refits [10]")
    g.add_argument("--gpu-refits", type=positive_int, default=50, help="refits of the memory-hygiene check [50]")
    g.add_argument("--gpu-no-sweep", action="store_true", help="skip the bucket/group size sweep")
    g.add_argument("--gpu-no-fp32", action="store_true", help="skip the fp32 -> bf16 variant")
    g.add_argument("--gpu-no-ipc", action="store_true", help="skip the experimental CUDA IPC pull")
    g.add_argument("--gpu-out", type=writable_file, default=None, help="also write the JSON result to this file")


def config_from_args(args) -> dict:
    get = lambda k, d: getattr(args, k, d)  # noqa: E731 - a caller's parser may not carry every option
    return {
        "layers": get("gpu_layers", 32), "bucket_mib": get("gpu_bucket_mib", 1024),
        "bucket32_mib": get("gpu_bucket32_mib", 512), "group_mib": get("gpu_group_mib", 1024),
        "staging_mib": get("gpu_staging_mib", 2048), "iters": get("gpu_iters", 10),
        "refits": get("gpu_refits", 50), "sweep": not get("gpu_no_sweep", False),
        "fp32": not get("gpu_no_fp32", False), "ipc": not get("gpu_no_ipc", False), "seed": 1234,
    }


def summarize(r0: dict, r1: dict, abort: dict) -> dict:
    total = r1["bytes"]
    gbps = lambda s: total / s / GB if s else float("nan")  # noqa: E731
    slowest = lambda k, m="steady_s": max(r0[k][m], r1[k][m])  # noqa: E731
    s = {
        "model": f"Llama-3-8B shapes, {r1['tensors']} HF tensors -> {r1['fused_params']} fused vLLM params, bf16",
        "bytes": total,
        "device": r1["device"],
        "plan": r1["plan"],
        "refit_GBps": gbps(slowest("refit")),
        "refit_single_GBps": gbps(slowest("refit", "single_s")),
        "raw_nccl_GBps": gbps(slowest("raw")),
        "raw_nccl_single_GBps": gbps(slowest("raw", "single_s")),
        "bcast_GBps": gbps(slowest("bcast")),
        "bcast_handshake_GBps": gbps(slowest("bcast_handshake")),
        "golden_GBps": gbps(slowest("golden")),
        "verified": {k: r1[k][0] for k in r1 if k.startswith("verify_")},
        "verify_failures": {k: r1[k][1] for k in r1 if k.startswith("verify_") and not r1[k][0]},
        "hygiene_bf16": r1["hygiene_bf16"],
        "hygiene_bf16_src": r0["hygiene_bf16"],
        "abort": abort,
        "sweep": [dict(v, GBps=gbps(max(v["steady_s"], w["steady_s"]))) for v, w in zip(r1["sweep"], r0["sweep"])],
        "breakdown": {"src": r0.get("refit_breakdown"), "dst": r1.get("refit_breakdown"),
                      "fp32_src": r0.get("fp32_breakdown"), "fp32_dst": r1.get("fp32_breakdown")},
    }
    if "fp32" in r1:
        s["fp32_to_bf16_GBps"] = gbps(slowest("fp32"))
        s["fp32_sweep"] = [dict(v, GBps=gbps(max(v["steady_s"], w["steady_s"])))
                           for v, w in zip(r1.get("fp32_sweep", []), r0.get("fp32_sweep", []))]
        s["hygiene_fp32_src"] = r0["hygiene_fp32"]
        s["hygiene_fp32"] = r1["hygiene_fp32"]
    if "ipc" in r1:
        s["ipc"] = r1["ipc"] if "error" in r1["ipc"] else {
            "GBps": gbps(max(r1["ipc"]["steady_s"], r0["ipc"].get("steady_s", 0))),
            "pull_only_GBps": gbps(r1["ipc"].get("pull_only_s", 0)), **r1["ipc"]}
    s["ratios"] = {
        "refit_over_raw": s["refit_GBps"] / s["raw_nccl_GBps"],
        "refit_over_raw_single": s["refit_single_GBps"] / s["raw_nccl_single_GBps"],
        "refit_over_bcast": s["refit_GBps"] / s["bcast_GBps"],
        "refit_over_bcast_handshake": s["refit_GBps"] / s["bcast_handshake_GBps"],
        "refit_over_golden": s["refit_GBps"] / s["golden_GBps"],
    }
    return s


def print_table(s: dict) -> None:
    rows = [
        ("refit (streamed NCCL, steady)", s["refit_GBps"], ""),
        ("refit (single, synced)", s["refit_single_GBps"], ""),
        ("raw NCCL send/recv, one flat buffer", s["raw_nccl_GBps"], f"refit/raw = {s['ratios']['refit_over_raw']:.3f}"),
        ("raw NCCL (single, synced)", s["raw_nccl_single_GBps"],
         f"refit/raw = {s['ratios']['refit_over_raw_single']:.3f}"),
        ("per-tensor broadcast (stream-ordered)", s["bcast_GBps"], f"refit/x = {s['ratios']['refit_over_bcast']:.2f}"),
        ("per-tensor broadcast + metadata handshake", s["bcast_handshake_GBps"],
         f"refit/x = {s['ratios']['refit_over_bcast_handshake']:.2f}"),
        ("xferdtensor_golden per tensor", s["golden_GBps"], f"refit/x = {s['ratios']['refit_over_golden']:.2f}"),
    ]
    if "fp32_to_bf16_GBps" in s:
        rows.append(("refit fp32 -> bf16 (cast at pack)", s["fp32_to_bf16_GBps"], "GB/s of bf16 on the wire"))
    ipc = s.get("ipc")
    if ipc:
        copies_alone = ipc.get("pull_only_GBps", float("nan"))
        rows.append(("IPC pull, copy engines (experimental)", ipc.get("GBps", float("nan")),
                     ipc.get("error", f"with handshakes; copies alone {copies_alone:.0f} GB/s")))
    print(f"\n{s['model']}; {s['bytes'] / GB:.2f} GB; {s['device']} x2")
    print(f"{'path':44s} {'GB/s':>8s}  note")
    for name, v, note in rows:
        print(f"{name:44s} {v:8.1f}  {note}")
    if s.get("sweep"):
        print("sweep (bucket MiB / group MiB [/packed] -> GB/s): " + ", ".join(
            f"{v['bucket_mib']}/{v['group_mib']}{'/packed' + str(v['packed']) if v['packed'] else ''}"
            f" -> {v['GBps']:.0f}"
            for v in s["sweep"]))
    for side, b in (s.get("breakdown") or {}).items():
        if b:
            print(f"single refit {side}: total {b['total_s'] * 1e3:.1f} ms = host setup {b['setup_s'] * 1e3:.1f}, "
                  f"1st group queued {b.get('first_group_queued_s', 0) * 1e3:.1f}, "
                  f"all queued {b['enqueue_s'] * 1e3:.1f}; "
                  f"GPU idle before 1st group {b.get('gpu_idle_before_first_group_s', 0) * 1e3:.1f}, "
                  f"groups {b.get('gpu_groups_s', 0) * 1e3:.1f}")
    if s.get("fp32_sweep"):
        print("fp32->bf16 sweep (bucket/staging/group MiB -> GB/s): " + ", ".join(
            f"{v['bucket_mib']}/{v['staging_mib']}/{v['group_mib']} -> {v['GBps']:.0f}" for v in s["fp32_sweep"]))
    for key in ("hygiene_bf16_src", "hygiene_bf16", "hygiene_fp32_src", "hygiene_fp32"):
        h = s.get(key)
        if h:
            print(f"{key}: {h['refits']} refits, peak staging {h['peak_staging_bytes'] / MIB:.1f} MiB "
                  f"(arena {h['capacity'] / MIB:.0f} MiB, budget {h['budget'] / MIB:.0f} MiB); allocated after "
                  f"first/last refit {h['alloc_first'] / MIB:.1f}/{h['alloc_last'] / MIB:.1f} MiB, "
                  f"peak over base {h['max_allocated_over_base'] / MIB:.1f} MiB")
    a = s["abort"]
    print(f"abort: blocked NCCL recv released in {a.get('release_s', float('nan')):.4f} s "
          f"(abort() call {a.get('abort_call_s', float('nan')):.3f} s, raised {a.get('error')})")
    print(f"verified bit-exact: {s['verified']}")


def nixl_summary(r0: dict, r1: dict) -> dict:
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


def print_nixl_table(s: dict) -> None:
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


def _two_gpus(what: str) -> bool:
    if torch.cuda.device_count() < 2:
        print(f"refit bench: {what} needs 2 GPUs; torch sees {torch.cuda.device_count()}", file=sys.stderr)
    return torch.cuda.device_count() >= 2


def _report(s: dict, ranks: list[dict], t0: float, out_path: str | None, as_json: bool, print_text) -> int:
    """``s`` with the wall time and both ranks' figures, written to ``out_path`` and printed as JSON or
    by ``print_text``; 0 when every check was bit-exact."""
    s["wall_s"] = time.perf_counter() - t0
    s["per_rank"] = ranks
    text = json.dumps(s, indent=1, default=str)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    if as_json:
        print(text)
    else:
        print_text(s)
    return 0 if all(s["verified"].values()) else 1


def run_gpu(args) -> int:
    if not _two_gpus("--device cuda"):
        return 2
    t0 = time.perf_counter()
    with DeviceFleet(2) as fleet:
        r0, r1 = fleet.run(transport_rank, config_from_args(args), timeout_s=260)
        fleet.rebuild()
        abort = fleet.run(abort_blocked_recv, timeout_s=60)[1]
    return _report(summarize(r0, r1, abort), [r0, r1], t0, getattr(args, "gpu_out", None),
                   getattr(args, "json", False), print_table)


NIXL_DEFAULTS = {"layers": 32, "iters": 10, "bucket_mib": 1024, "chunk_mib": DEFAULT_CHUNK_BYTES // MIB,
                 "staging_mib": 1024, "group_mib": 1024, "timeout_s": 60.0, "out": None}


def run_nixl(overrides: dict[str, Any] | None = None, *, staged: bool = True, as_json: bool = False) -> int:
    """``refit bench --device cuda --transport nixl``: NIXL against NCCL on the 2-GPU 8B refit (same plan,
    same run), with ``overrides`` of ``NIXL_DEFAULTS`` (what the command line's flags set)."""
    unknown = sorted(set(overrides or {}) - set(NIXL_DEFAULTS))
    if unknown:
        raise ValueError(f"run_nixl: unknown settings {unknown}; known: {sorted(NIXL_DEFAULTS)}")
    args = {**NIXL_DEFAULTS, **(overrides or {})}
    if not _two_gpus("--device cuda --transport nixl"):
        return 2
    cfg = {**{k: v for k, v in args.items() if k != "out"}, "staged": staged, "seed": 1234}
    t0 = time.perf_counter()
    with DeviceFleet(2) as fleet:
        r0, r1 = fleet.run(nixl_rank, cfg, timeout_s=280)
    return _report(nixl_summary(r0, r1), [r0, r1], t0, args["out"], as_json, print_nixl_table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="refit-bench-gpu", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_gpu_arguments(p)
    return run_gpu(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
