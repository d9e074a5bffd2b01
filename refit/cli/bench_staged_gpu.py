"""``refit bench --path staged --device cuda``: one GPU decoding an 8B model while refits land.

One process holds Llama-3-8B in vLLM's fused layout (bf16, about 16 GB, ``bench_gpu``'s
model) on one GPU and decodes with it: a step runs a batch of tokens through every weight
matrix once, which is what a decode step costs on a GPU (it reads the whole model). A
refit's bytes arrive from ``--gpu-source``:

* ``host``: pinned host memory, at PCIe's rate, as from a NIC or a trainer offloaded to the
  host: the case of disaggregated RL, where a transfer takes hundreds of milliseconds;
* ``device``: a second copy on the same GPU (colocated trainer), at HBM's rate.

Modes, each over the same steps:

* **blocking**: between two steps the bytes are copied into the live weights; decoding
  waits for the whole arrival (pause, transfer, resume);
* **staged swap**: the bytes land on a side stream in a second set of weights while decoding
  goes on; between two steps the two sets are swapped;
* **staged copy**: the bytes land in staging tensors (``allocate_staging``, ``fraction`` of
  them on the GPU and the rest in pinned host memory) while decoding goes on; between two
  steps ``copy_staged_into_live`` copies them in, the switch a copy-mode engine makes.

Reported per mode: tokens/s without and with refits, the stall of each refit (blocking: the
arrival; staged: the switch), the longest step overlapping each refit less the median step,
and the arrival time. The reference is one device-to-device copy of the model, the bound the
switch is held to.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from refit.cli.bench_gpu import fused_engine
from refit.cli.output import show
from refit.runtime.weights_state import allocate_staging, copy_staged_into_live

GB = 1e9


class Decoder:
    """A decode step over a set of weights: ``batch`` tokens through every matrix, read once."""

    def __init__(self, params: dict[str, torch.Tensor], batch: int):
        self.matrices = [n for n, t in params.items() if t.dim() == 2 and "embed_tokens" not in n]
        dims = {params[n].shape[1] for n in self.matrices}
        self.x = {d: torch.randn(batch, d, dtype=torch.bfloat16, device="cuda") for d in dims}
        self.y = {n: torch.empty(batch, params[n].shape[0], dtype=torch.bfloat16, device="cuda")
                  for n in self.matrices}

    def step(self, weights: dict[str, torch.Tensor]) -> None:
        for n in self.matrices:
            w = weights[n]
            torch.mm(self.x[w.shape[1]], w.t(), out=self.y[n])
        # this stream only: a device-wide sync would also wait for the refit's copies on their own stream
        torch.cuda.current_stream().synchronize()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _arrive(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], stream) -> tuple[torch.cuda.Event, list]:
    """Queue the bytes of a refit into ``dst`` on ``stream``; host-staged parts on a thread."""
    host = [n for n, t in dst.items() if t.device.type == "cpu"]
    with torch.cuda.stream(stream):
        for n, t in dst.items():
            if t.device.type == "cuda":
                t.copy_(src[n], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    threads = []
    if host:
        # bytes for host staging land in host memory (a NIC's DMA would put them there)
        def land() -> None:
            for n in host:
                dst[n].copy_(src[n].cpu() if src[n].device.type == "cuda" else src[n])

        th = threading.Thread(target=land, daemon=True)
        th.start()
        threads.append(th)
    return done, threads


def run_mode(mode: str, fraction: float, live: dict, source: dict, decoder: Decoder, args) -> dict:
    serving = {"weights": live}
    other = staging = None
    if mode == "staged swap":
        other = {n: torch.empty_like(t) for n, t in live.items()}
    elif mode == "staged copy":
        staging = allocate_staging(live, fraction)
    stream = torch.cuda.Stream()
    for _ in range(5):
        decoder.step(serving["weights"])
    steps: list[float] = []
    quiet_start = time.perf_counter()
    while time.perf_counter() - quiet_start < args.interval * args.refits:
        decoder.step(serving["weights"])
        steps.append(time.perf_counter())
    quiet = [b - a for a, b in zip(steps, steps[1:])]
    median_step = statistics.median(quiet)
    quiet_tps = len(quiet) * args.batch / (steps[-1] - steps[0])

    busy_start = time.perf_counter()
    busy = [busy_start]
    stalls, arrivals, marks = [], [], []
    next_refit, arriving = busy_start + args.interval / 2, None
    while len(stalls) < args.refits:
        decoder.step(serving["weights"])
        now = time.perf_counter()
        busy.append(now)
        if arriving is None and now >= next_refit:
            if mode == "blocking":
                done, threads = _arrive(live, source, torch.cuda.current_stream())
                for th in threads:
                    th.join()
                done.synchronize()
                end = time.perf_counter()
                stalls.append(end - now)
                arrivals.append(end - now)
                marks.append((now, end))
                next_refit = now + args.interval
            else:
                target = other if mode == "staged swap" else staging
                arriving = (now, *_arrive(target, source, stream))
        elif arriving is not None:
            started, done, threads = arriving
            if done.query() and not any(th.is_alive() for th in threads):
                arrived = time.perf_counter()
                if mode == "staged swap":
                    serving["weights"], other = other, serving["weights"]
                else:
                    copy_staged_into_live(live, staging)
                end = time.perf_counter()
                stalls.append(end - arrived)
                arrivals.append(arrived - started)
                marks.append((started, end))
                arriving = None
                next_refit = max(started + args.interval, end)
    busy_tps = (len(busy) - 1) * args.batch / (busy[-1] - busy[0])
    pairs = list(zip(busy, busy[1:]))
    excess = [max([b - a for a, b in pairs if b >= t0 and a <= t1] or [t1 - t0]) - median_step for t0, t1 in marks]
    del other, staging
    torch.cuda.empty_cache()
    return {"mode": mode, "device_fraction": fraction if mode == "staged copy" else None,
            "tokens_per_s_without_refits": quiet_tps, "tokens_per_s_with_refits": busy_tps,
            "throughput_ratio": busy_tps / quiet_tps, "median_step_s": median_step,
            "stall_s": statistics.median(stalls), "stall_max_s": max(stalls),
            "gap_excess_median_s": statistics.median(excess), "arrival_median_s": statistics.median(arrivals),
            "refits": len(stalls)}


def run_bench(args) -> dict:
    if not torch.cuda.is_available():
        from refit.errors import ConfigError

        raise ConfigError("--path staged --device cuda needs a GPU; none is visible")
    live, _ = fused_engine({}, torch.bfloat16, "cuda")
    for t in live.values():
        t.normal_(0, 0.02)
    nbytes = _nbytes(live)
    staging = {n: torch.empty_like(t) for n, t in live.items()}
    copy_staged_into_live(staging, live)
    t0 = time.perf_counter()
    for _ in range(3):
        copy_staged_into_live(staging, live)
    d2d_s = (time.perf_counter() - t0) / 3
    del staging
    decoder = Decoder(live, args.batch)
    results = []
    for source_kind in args.gpu_source.split(","):
        if source_kind == "host":
            source = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for n, t in live.items()}
        else:
            source = {n: t.clone() for n, t in live.items()}
        modes = [("blocking", 1.0), ("staged swap", 1.0), ("staged copy", 1.0)]
        if source_kind == "host":
            modes.append(("staged copy", args.staging_fraction))
        rows = [run_mode(m, f, live, source, decoder, args) for m, f in modes]
        for r in rows:
            r["source"] = source_kind
            r["stall_over_blocking_pause"] = r["stall_s"] / rows[0]["stall_s"]
            r["stall_over_d2d_copy"] = r["stall_s"] / d2d_s
        results.extend(rows)
        del source
        torch.cuda.empty_cache()
    return {"path": "staged", "device": torch.cuda.get_device_name(), "model": "llama3-8b (vLLM fused, bf16)",
            "bytes": nbytes, "d2d_copy_s": d2d_s, "d2d_copy_GBps": nbytes / d2d_s / GB, "batch": args.batch,
            "interval_s": args.interval, "refits": args.refits, "modes": results,
            "targets": {f"{r['source']} {r['mode']}" + (f" {r['device_fraction']:g}" if r["device_fraction"] else ""):
                        {"stall_at_most_d2d_copy": r["stall_s"] <= d2d_s * 1.05,
                         "throughput_at_least_90pct": r["throughput_ratio"] >= 0.90}
                        for r in results if r["mode"] != "blocking"}}


def print_table(r: dict) -> None:
    from refit.cli.bench_staged import print_modes

    rows = [[m["source"], m["mode"] + ("" if m["device_fraction"] is None else f" ({m['device_fraction']:g} on GPU)"),
             f"{m['tokens_per_s_without_refits']:.0f}", f"{m['tokens_per_s_with_refits']:.0f}",
             f"{m['throughput_ratio']:.3f}", f"{m['median_step_s'] * 1e3:.2f} ms", f"{m['stall_s'] * 1e3:.3f} ms",
             f"{m['stall_over_blocking_pause']:.4f}", f"{m['stall_over_d2d_copy']:.3f}",
             f"{m['gap_excess_median_s'] * 1e3:.2f} ms", f"{m['arrival_median_s'] * 1e3:.1f} ms"] for m in r["modes"]]
    print_modes(f"refit bench --path staged --device cuda: {r['model']}, {r['bytes'] / GB:.1f} GB, {r['device']}, "
                f"a refit every {r['interval_s']}s",
                ("source", "mode", "tok/s no refit", "tok/s refits", "ratio", "step", "stall", "stall/blocking",
                 "stall/d2d", "gap excess", "arrival"), rows,
                f"one device-to-device copy of the model: {r['d2d_copy_s'] * 1e3:.2f} ms "
                f"({r['d2d_copy_GBps']:.0f} GB/s); batch {r['batch']}, {r['refits']} refits a mode", labels=2)


def run(args) -> int:
    from refit.errors import ConfigError

    if args.gpu_source is None:
        args.gpu_source = "host,device"
    if not set(args.gpu_source.split(",")) <= {"host", "device"}:
        raise ConfigError(f"--gpu-source: give host, device or both (host,device), got {args.gpu_source!r}")
    if not 0.0 < args.staging_fraction <= 1.0:
        raise ConfigError(f"--staging-fraction must be within (0, 1], got {args.staging_fraction}")
    result = run_bench(args)
    show(result, args.json, print_table)
    return 0
