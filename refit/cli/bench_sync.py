"""``refit bench --path sync``: what ``sync_weights()`` costs next to the bare transport of the same plan.

Users call ``ReshardWeightSynchronizer.sync_weights()``, while the transport figures come from a
bench's own worker loop. The difference is the control plane: a controller round trip per phase,
checksums of every bucket (verify) and the engines' commit. This bench times both in the same
worker processes on the same plan, alternating step by step so that drift hits both alike:

* **sync**: the wall time of ``sync_weights()`` with verification on, as a user sees it;
* **raw**: every rank's ``refit_transfer`` called at once through the synchronizer's own worker
  handles (no checksums, no commit), timed by the slowest rank's executor: the transport alone;
* **raw + checksums**: the same with ``verify=True``, which splits the difference between the two
  into what checksums cost and what the control plane costs.

``--fleet local`` puts the endpoints on threads of this process (``LocalWorker``); ``--fleet process``
gives every rank a process of its own without Ray (``ProcessWorker``); ``--fleet ray`` makes every
rank a Ray actor. The model is a ``refit.models.specs`` shape (``--model``), narrowed
with ``--layers`` / ``--hidden``; the trainer holds it TP over ``--src`` ranks and each of
``--dst-dp`` engine shards TP over ``--dst-tp`` workers. After the timed steps every engine
checks every element it holds against the trainer's pattern.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit.cli.fleets import Fleet, FleetLayout
from refit.cli.output import show
from refit.errors import ConfigError, LayoutError
from refit.layout import mesh_coords_of, region_shape, shard_region
from refit.models.fp8 import quantize_reference
from refit.models.parallel import EngineParallel, LayoutBuilder, TrainParallel
from refit.models.specs import ModelSpec, get_model
from refit.plan.quant import BlockFp8
from refit.plan.roster import SCALE_SUFFIX
from refit.runtime.endpoint import TrainerEndpoint
from refit.runtime.engine_endpoint import EngineEndpoint
from refit.runtime.protocol import Transfer
from refit.runtime.shards import LocalShard

GB = 1e9
MIB = 1 << 20
PATTERN_CHUNK = 1 << 24  # elements per chunk of the fill and the check (int64 temporaries: 128 MiB)
CPU_SHAPE = {"layers": 8, "hidden": 512}  # llama3-8b narrowed: ~175 MB moved per step to two TP1 shards
DEFAULT_LAYOUT = (2, 1, 2)  # trainer TP2 -> 2 engine shards of TP1
WIDTH_FIELDS = ("head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                "vocab_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


# -- the model and its values --------------------------------------------------------------------

def narrowed(spec: ModelSpec, *, layers: int | None, hidden: int | None, vocab: int | None) -> ModelSpec:
    """``spec`` with fewer layers and every width scaled by ``hidden / hidden_size`` (head counts kept).

    Head counts stay so that the TP layouts cut the same heads as in the full model; only
    the sizes shrink, which is what lets the 8B shape run on two CPU cores.
    """
    changes: dict[str, Any] = {}
    if hidden is not None and hidden != spec.hidden_size:
        factor = hidden / spec.hidden_size
        changes = {f: max(1, round(getattr(spec, f) * factor)) for f in WIDTH_FIELDS if getattr(spec, f)}
        changes["hidden_size"] = hidden
    if layers is not None:
        changes.update(num_layers=layers, first_dense_layers=min(spec.first_dense_layers, layers))
    if vocab is not None:
        changes["vocab_size"] = vocab
    if not changes:
        return spec
    return dataclasses.replace(spec, **changes)


def pattern(shape: tuple[int, ...], region, seed: int, device, rows: slice) -> torch.Tensor:
    """Values of a region's ``rows`` that depend on the global position: misplaced bytes show.

    Every value is k/64 with |k| <= 127, exact in bf16, fp16 and fp32, so a cast on the way
    changes nothing and a check can be bit for bit.
    """
    strides = [int(np.prod(shape[d + 1:])) for d in range(len(shape))]
    flat = None
    for d, intervals in enumerate(region):
        ix = torch.cat([torch.arange(a, b, dtype=torch.int64, device=device) for a, b in intervals])
        if d == 0:
            ix = ix[rows]
        term = (ix * strides[d]).reshape([-1 if k == d else 1 for k in range(len(shape))])
        flat = term if flat is None else flat + term
    k = ((flat * 2654435761 + seed * 97531) >> 5) % 255 - 127
    return k.to(torch.float32) / 64


def row_chunks(t: torch.Tensor):
    rows = t.shape[0]
    step = max(1, PATTERN_CHUNK // max(1, t[0].numel()))
    for a in range(0, rows, step):
        yield slice(a, min(a + step, rows))


def fill_pattern(t: torch.Tensor, shape: tuple[int, ...], region, seed: int) -> None:
    """Write ``pattern`` into ``t``, the local tensor of ``region`` of a global tensor of ``shape``."""
    for rows in row_chunks(t) if t.numel() else ():
        t[rows].copy_(pattern(shape, region, seed, t.device, rows))


def holds_pattern(t: torch.Tensor, shape: tuple[int, ...], region, seed: int) -> bool:
    """Whether ``t`` holds ``pattern`` bit for bit (in its own dtype)."""
    return all(torch.equal(t[rows], pattern(shape, region, seed, t.device, rows).to(t.dtype))
               for rows in (row_chunks(t) if t.numel() else ()))


@dataclass(frozen=True)
class HeldTensor:
    """One tensor as one rank holds it: where it sits in the global tensor, and its seed."""

    shard: LocalShard
    region: tuple
    seed: int


def held_tensors(params, layouts, local_rank: int, offset: int, device) -> dict[str, HeldTensor]:
    """This rank's part of every tensor of ``params``, laid out by ``layouts(param)`` (a ``TensorLayout``,
    whose dtype it is held in).

    ``offset`` is the layout's first rank: an engine reports meshes of its own shard's
    workers (0 ..), wherever the shard sits in the communicator. A tensor's seed is its
    position among the model's tensors (an FP8 weight's block scales share its seed).
    """
    out, seeds = {}, {}
    for p in params:
        seed = seeds[p.scales_of] if p.scales_of is not None else seeds.setdefault(p.name, len(seeds))
        lay = layouts(p)
        mesh = (np.asarray(lay.mesh_ranks) - offset).reshape(lay.mesh_shape)
        region = shard_region(p.shape, lay.mesh_shape, mesh_coords_of(mesh, local_rank), lay.placements)
        t = torch.zeros(region_shape(region), dtype=getattr(torch, lay.dtype), device=device)
        out[p.name] = HeldTensor(LocalShard(t, p.shape, mesh, lay.placements), region, seed)
    return out


class BenchTrainer(TrainerEndpoint):
    """A trainer rank: its TP shard of every tensor of ``model``, filled with ``pattern``."""

    def __init__(self, rank: int, world_size: int, *, model: ModelSpec, dtype: str, device: str = "cpu",
                 threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        builder = LayoutBuilder(model, TrainParallel(tp=world_size), EngineParallel(), train_dtype=dtype)
        self.held = held_tensors(model.params(), builder.src, rank, 0, device)
        for h in self.held.values():
            fill_pattern(h.shard.tensor, h.shard.global_shape, h.region, h.seed)

    def refit_sources(self):
        return {n: h.shard for n, h in self.held.items()}

    def bench_quantize(self, iters: int) -> dict | None:
        """The quantize kernels alone on this rank's shards (its FP8 params), timed; None without FP8."""
        st = self._refit_state()
        if st.quantized is None:
            return None
        local = {n: h.shard.tensor for n, h in self.held.items()}
        cuda = any(t.is_cuda for t in local.values())
        st.quantized.quantize_alone(local)  # warm-up: compiles on a GPU
        times = []
        for _ in range(iters):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            nbytes = st.quantized.quantize_alone(local)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return {"seconds": statistics.median(times), "bytes_in": nbytes}


class BenchEngine(EngineEndpoint):
    """An engine worker: its TP shard of every tensor of ``model``, zeroed until a refit lands."""

    def __init__(self, shard: int, worker: int, workers_per_shard: int, *, model: ModelSpec, dtype: str,
                 device: str = "cpu", threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        # dtype "fp8": the linear weights in 128x128 block-scaled float8_e4m3fn, with their scales
        self.builder = LayoutBuilder(model, TrainParallel(), EngineParallel(tp=workers_per_shard), engine_dtype=dtype)
        self.held = held_tensors(self.builder.params(), lambda p: self.builder.dsts(p)[0], worker,
                                 self.builder.engine_offset, device)

    def refit_destinations(self):
        return {n: h.shard for n, h in self.held.items()}

    def bench_wrong_tensors(self) -> list[str]:
        """Names of the tensors whose elements differ from the trainer's pattern, bit for bit (FP8
        weights and scales: from the reference quantizer run on the whole pattern)."""
        wrong = []
        for n, h in self.held.items():
            t = h.shard.tensor
            if t.dtype.is_floating_point and t.element_size() == 1 or n.endswith(SCALE_SUFFIX):
                weight = n.removesuffix(SCALE_SUFFIX)
                shape = self.held[weight].shard.global_shape
                whole = tuple(((0, int(x)),) for x in shape)
                q, scales = quantize_reference(pattern(shape, whole, h.seed, t.device, slice(None)), BlockFp8())
                want = (scales if n.endswith(SCALE_SUFFIX) else q)[tuple(slice(a, b) for (a, b), in h.region)]
                ok = torch.equal(t.view(torch.uint8), want.view(torch.uint8)) if t.element_size() == 1 \
                    else torch.equal(t, want)
            else:
                ok = holds_pattern(t, h.shard.global_shape, h.region, h.seed)
            if not ok:
                wrong.append(n)
        return wrong


# -- layout and fleet ------------------------------------------------------------------------------

class FlagError(ConfigError):
    """Flags that cannot run here; reported in one line, before anything starts."""


def choose_layout(args, gpus: int) -> tuple[FleetLayout, str]:
    """The layout of the flags; on GPUs (one per rank) the default shrinks to what torch sees.

    Returns the layout and, when it is not the default, a note that says why.
    """
    given = [args.src, args.dst_tp, args.dst_dp]
    layout = FleetLayout(*(g if g is not None else d for g, d in zip(given, DEFAULT_LAYOUT)))
    note = ""
    if args.device == "cuda" and args.transport in ("nixl", "ipc"):  # one-sided: ranks may share GPUs
        if not gpus:
            raise FlagError("--device cuda: torch sees no GPU")
        return layout, f"{args.transport.upper()}: {layout.world_size} ranks on {gpus} GPU(s), rank r on GPU r % {gpus}"
    if args.device == "cuda" and all(g is None for g in given) and layout.world_size > gpus:
        default, layout = layout, FleetLayout(1, 1, 1)
        note = (f"torch sees {gpus} GPU(s), one per rank over NCCL: {layout.describe()} instead of the default "
                f"{default.describe()} ({default.world_size} GPUs); --src / --dst-tp / --dst-dp choose")
    if args.device == "cuda" and layout.world_size > gpus:
        raise FlagError(f"{layout.describe()} needs {layout.world_size} GPUs (one per rank over NCCL); "
                        f"torch sees {gpus}")
    return layout, note


# -- the measurement -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyncStep:
    wall_s: float
    transfer_s: float
    bytes: int
    verified: bool
    rebuilt: bool


@dataclass(frozen=True)
class RawStep:
    seconds: float  # the slowest rank's executor time: the transport alone
    round_s: float  # the calls' wall time from here, controller dispatch included
    bytes: int
    quantize: list  # per trainer rank quantizing to FP8: its report (host seconds ahead of and beside the wire)
    buckets: int  # buckets received over all ranks (counted where checksums are: verified steps)


def timed_sync(sync) -> SyncStep:
    t0 = time.perf_counter()
    res = sync.sync_weights()
    return SyncStep(time.perf_counter() - t0, res.transfer_s, res.bytes, res.verified, res.rebuilt)


def timed_raw(sync, timeout_s: float, verify: bool = False) -> RawStep:
    """Every rank's ``Transfer`` of the live plan at once, as the synchronizer sends it (no commit)."""
    t0 = time.perf_counter()
    transfer = Transfer(sync.epoch, timeout_s=None, verify=verify)
    calls = {r: w.request(transfer) for r, w in sync.workers.items()}
    reports = [p.result(timeout_s) for p in calls.values()]
    return RawStep(max(r.seconds for r in reports), time.perf_counter() - t0,
                   sum(r.bytes_received for r in reports), [r.quantize for r in reports if r.quantize],
                   sum(len(r.received) for r in reports))


def spread(values: list[float], nbytes: int) -> dict:
    median = statistics.median(values)
    return {"median_s": median, "p90_s": float(np.percentile(values, 90)), "GBps": nbytes / median / GB}


FLAT_CHUNK = 4 << 30  # a flat copy's buffers: large copies run at the device's full rate


def flat_copy_figure(nbytes: int, *, gpus: int, peer: bool, iters: int = 10, warmup: int = 2) -> dict:
    """The copy's limit on this placement: ``nbytes`` copied flat, device to device (or GPU 0 to GPU 1
    when the ranks have a GPU each), in 4 GiB pieces; median of ``iters`` after ``warmup``. Run after
    the fleet is gone, so the buffers fit beside nothing."""
    src_dev = torch.device("cuda", 0)
    dst_dev = torch.device("cuda", 1) if peer and gpus >= 2 else src_dev
    size = min(nbytes, FLAT_CHUNK)
    src = torch.empty(size, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(size, dtype=torch.uint8, device=dst_dev)
    pieces = [min(size, nbytes - pos) for pos in range(0, nbytes, size)]
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        t0 = time.perf_counter()
        for n in pieces:
            dst[:n].copy_(src[:n])
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    fig = spread(times, nbytes)
    fig["placement"] = f"cuda:0 -> {dst_dev}"
    return fig


def quantize_figures(raws: list[RawStep], kernels: list[dict]) -> dict | None:
    """Whether quantizing on the trainer ranks can keep up with the wire (None: no FP8 engines).

    ``kernel``: the quantize kernels alone on the slowest trainer rank's shards, in GB/s of
    bf16 read. ``wire``: that rank's share of the raw transfer in GB/s of the same bf16 (the
    FP8 sent stands for twice its bytes), so a kernel faster than the wire is no bottleneck.
    ``ahead`` and ``beside``: host seconds of the raw refits' quantization before the executor
    starts (amaxes, their merge, scales) and while it runs (the FP8 weights, round by round;
    on a GPU, the time to queue them).
    """
    if not kernels:
        return None
    slowest = max(kernels, key=lambda k: k["seconds"])
    wire_s = statistics.median(r.seconds for r in raws)
    reports = [q for r in raws for q in r.quantize]
    return {
        "kernel_s": slowest["seconds"], "kernel_GBps": slowest["bytes_in"] / slowest["seconds"] / GB,
        "wire_GBps": slowest["bytes_in"] / wire_s / GB,
        "ahead_median_s": statistics.median(q["ahead_s"] for q in reports) if reports else None,
        "beside_median_s": statistics.median(q["beside_s"] for q in reports) if reports else None,
    }


def fused_kernels(device: str) -> bool:
    """Whether this run's GPU copies, checksums and FP8 quantization took the fused Triton kernels."""
    from refit.transport.copy_sum import fused_enabled

    return device == "cuda" and fused_enabled(torch.device("cuda"))


def run_sync_bench(args) -> dict:
    from refit import ReshardWeightSynchronizer

    if args.fleet == "ray" and importlib.util.find_spec("ray") is None:
        raise FlagError("--fleet ray needs Ray (pip install 'refit[ray]'); --fleet local runs without it")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    layout, note = choose_layout(args, gpus)
    shape = CPU_SHAPE if args.device == "cpu" else {"layers": None, "hidden": None}
    model = narrowed(get_model(args.model), layers=args.layers if args.layers is not None else shape["layers"],
                     hidden=args.hidden if args.hidden is not None else shape["hidden"], vocab=args.vocab)
    dtypes = (args.dtype or model.dtype, args.dst_dtype or args.dtype or model.dtype)
    for flag, size, parallel in (("--src", layout.trainer_tp, TrainParallel(tp=layout.trainer_tp)),
                                 ("--dst-tp", layout.engine_tp, EngineParallel(tp=layout.engine_tp))):
        try:  # what every rank checks when it builds its layout, refused before any rank starts
            parallel.check(model)
        except LayoutError as e:
            raise FlagError(f"{flag} {size}: {e}") from None
    kwargs: dict[str, Any] = {"refit_timeout_s": args.refit_timeout, "verify": True}
    if args.transport == "nixl":
        from refit.transport.nixl import nixl_available

        if not nixl_available():
            raise FlagError("--transport nixl needs NIXL (pip install 'refit[nixl]')")
        kwargs["transport"] = "nixl"
    if args.transport == "ipc":
        kwargs["transport"] = "ipc"
    if args.bucket_mib is not None:
        kwargs["bucket_bytes"] = int(args.bucket_mib * MIB)
    t0 = time.perf_counter()
    fleet = Fleet(args.fleet, layout, BenchTrainer, BenchEngine, trainer_kwargs={"model": model, "dtype": dtypes[0]},
                  engine_kwargs={"model": model, "dtype": dtypes[1]}, device=args.device,
                  start_timeout_s=600.0 if args.fleet == "ray" else 120.0)
    sync = None
    try:
        start_s = time.perf_counter() - t0
        sync = ReshardWeightSynchronizer(fleet.trainers, fleet.engines, **kwargs)
        if args.staged:
            # every transfer lands in staging copies on the engine's device; the commit copies them in
            from refit.runtime.workers import as_worker

            for w in (w for shard in fleet.engines for w in shard):
                as_worker(w, "engine worker").call("refit_configure_staging", True,
                                                   require_version=False).result(args.refit_timeout)
        t1 = time.perf_counter()
        sync.init_communicator()
        init_s = time.perf_counter() - t1
        for _ in range(args.warmup):
            timed_sync(sync)
            timed_raw(sync, args.refit_timeout)
            timed_raw(sync, args.refit_timeout, verify=True)
        syncs, raws, checked = [], [], []
        for _ in range(args.iters):
            syncs.append(timed_sync(sync))
            raws.append(timed_raw(sync, args.refit_timeout))
            checked.append(timed_raw(sync, args.refit_timeout, verify=True))
        switches = [x["seconds"] for r, w in sync.workers.items() if r >= layout.trainer_tp
                    for x in w.call("refit_switches").result(args.refit_timeout)[-args.iters:]]
        kernels = [k for r in range(layout.trainer_tp)
                   if (k := sync.workers[r].call("bench_quantize", args.iters).result(args.refit_timeout))]
        checks = {r: w.call("bench_wrong_tensors") for r, w in sync.workers.items() if r >= layout.trainer_tp}
        wrong = {f"rank {r}": bad for r, p in checks.items() if (bad := p.result(args.refit_timeout))}
    finally:
        if sync is not None:
            sync.shutdown()
        fleet.close()
    nbytes = raws[0].bytes
    sync_fig = spread([s.wall_s for s in syncs], syncs[0].bytes)
    sync_fig["transfer_median_s"] = statistics.median(s.transfer_s for s in syncs)
    raw_fig = spread([r.seconds for r in raws], nbytes)
    raw_fig["round_median_s"] = statistics.median(r.round_s for r in raws)
    checked_fig = spread([r.seconds for r in checked], nbytes)
    flat = flat_copy_figure(nbytes, gpus=gpus, peer=args.transport == "nccl") if args.device == "cuda" else None
    if args.transport == "nixl":
        device = f"{'cpu' if args.device == 'cpu' else torch.cuda.get_device_name(0)} (NIXL one-sided writes)"
    elif args.transport == "ipc":
        device = (f"{'cpu (shared memory)' if args.device == 'cpu' else torch.cuda.get_device_name(0) + ' (CUDA IPC)'}"
                  ", engines copy from the trainers' memory")
    else:
        device = "cpu (gloo)" if args.device == "cpu" else f"{torch.cuda.get_device_name(0)} (NCCL, one GPU per rank)"
    return {
        "quantize": quantize_figures(raws, kernels),
        "path": "sync", "fleet": args.fleet, "device": device, "layout": layout.describe(), "layout_note": note,
        "world_size": layout.world_size, "model": model.name, "layers": model.num_layers,
        "hidden": model.hidden_size, "tensors": model.num_tensors, "params": model.num_params,
        "dtype": dtypes[0], "dst_dtype": dtypes[1], "bytes_per_step": nbytes, "warmup": args.warmup,
        "iters": args.iters, "sync": sync_fig, "raw": raw_fig, "raw_checksummed": checked_fig,
        "buckets_per_step": checked[0].buckets,
        "sync_over_raw": sync_fig["median_s"] / raw_fig["median_s"],
        # the limit of this placement: a flat copy of the step's bytes (GPU only)
        "flat_copy": flat, "sync_over_flat": sync_fig["median_s"] / flat["median_s"] if flat else None,
        "fused": fused_kernels(args.device),
        "verified": all(s.verified for s in syncs), "same_bytes": all(s.bytes == nbytes for s in syncs),
        "rebuilds_after_init": sum(s.rebuilt for s in syncs), "correct": not wrong, "wrong": wrong,
        "fleet_start_s": start_s, "init_communicator_s": init_s,
        # what generation stops for per refit: staged, the switch (a copy of the staging into the live
        # weights, between two steps); in place, the engines' weights are torn from the first byte to
        # the commit (about the sync)
        "staged": args.staged, "switch_median_s": statistics.median(switches) if switches else None,
        "switch_max_s": max(switches) if switches else None,
    }


def print_sync_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"refit bench --path sync: {r['layout']}, {r['fleet']} fleet, {r['device']}")
    flat = r.get("flat_copy")
    columns = [("path", "left"), ("median", "right"), ("p90", "right"), ("GB/s", "right")]
    if flat:
        columns.append(("/ flat copy", "right"))
    for col, justify in [*columns, ("note", "left")]:
        table.add_column(col, justify=justify)

    def row(label: str, fig: dict, note: str) -> None:
        cells = [label, f"{fig['median_s'] * 1e3:.1f} ms", f"{fig['p90_s'] * 1e3:.1f} ms", f"{fig['GBps']:.2f}"]
        if flat:
            cells.append(f"{fig['median_s'] / flat['median_s']:.2f}x")
        table.add_row(*cells, note)

    s, w, c = r["sync"], r["raw"], r["raw_checksummed"]
    row("sync_weights(), verify on", s, f"transfer phase {s['transfer_median_s'] * 1e3:.1f} ms")
    row("raw transport, same plan", w, f"slowest rank's executor; round {w['round_median_s'] * 1e3:.1f} ms")
    row("raw transport + checksums", c, "what verify adds to the transport")
    if flat:
        row("flat copy, same bytes", flat, f"the copy's limit on this placement ({flat['placement']})")
    table.add_row("sync / raw", f"{r['sync_over_raw']:.2f}x", *[""] * (len(columns) - 1))
    if r["staged"]:
        table.add_row("switch (staged)", f"{r['switch_median_s'] * 1e3:.2f} ms",
                      f"max {r['switch_max_s'] * 1e3:.2f} ms", "",
                      "staging copied into the live weights at the commit: what generation stops for")
    q = r.get("quantize")
    if q:
        table.add_row("quantize kernels alone", f"{q['kernel_s'] * 1e3:.1f} ms", "", f"{q['kernel_GBps']:.2f}",
                      f"slowest trainer rank, GB/s of bf16 read; its share of the wire: {q['wire_GBps']:.2f}")
        if q["ahead_median_s"] is not None:
            table.add_row("quantize in the refit", f"{q['ahead_median_s'] * 1e3:.1f} ms", "", "",
                          f"amax, merge and scales ahead of the wire; "
                          f"{q['beside_median_s'] * 1e3:.1f} ms of FP8 weights made beside it")
    console = Console()
    console.print(table)
    if r["layout_note"]:
        console.print(r["layout_note"])
    console.print(f"{r['model']}: {r['layers']} layers, hidden {r['hidden']}, {r['tensors']} tensors, "
                  f"{r['dtype']} -> {r['dst_dtype']}; {r['bytes_per_step'] / 1e6:.1f} MB per step; "
                  f"{r['iters']} steps after {r['warmup']} warm-up; every sync verified: {r['verified']}; "
                  f"every engine element correct: {r['correct']}")


def run(args) -> int:
    result = run_sync_bench(args)
    if result["layout_note"] and args.json:
        print(result["layout_note"], file=sys.stderr)
    show(result, args.json, print_sync_table)
    ok = result["verified"] and result["correct"] and result["same_bytes"]
    if not ok:
        print(f"refit bench --path sync: verified={result['verified']} correct={result['correct']} "
              f"same_bytes={result['same_bytes']} {result['wrong']}", file=sys.stderr)
    return 0 if ok else 1
