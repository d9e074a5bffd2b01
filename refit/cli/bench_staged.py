"""``refit bench --path staged``: generation throughput and stalls while refits land, staged against blocking.

Reference engines (``refit.testing.engine``, one process per worker) generate in a loop, batch
after batch of greedy requests, while a ``ReshardWeightSynchronizer`` refits them from a trainer
every ``--interval`` seconds. Each mode runs on the same processes and the same plan:

* **blocking**: the transfer writes into the live weights, so generation is refused from the
  first byte until the commit (pause, transfer, resume);
* **staged swap**: the transfer lands in a second set of weights while generation goes on; the
  commit swaps the two between two steps;
* **staged copy**: the transfer lands in staging copies, ``--staging-fraction`` of them on the
  engine's device and the rest in host memory; the commit copies them in between two steps.

For each mode, one window without refits then one with ``--refits`` refits gives tokens/s with
and without. Two stalls are reported per refit:

* ``stall_s``: how long the refit itself kept the engine from running a step, measured in the
  engine: blocking, from the transfer's first byte to the commit; staged, the switch (swap or
  copy, with the serving lock held);
* ``gap_excess_*``: the longest step gap overlapping each refit, less the median step without
  refits: the switch plus what the transfer's share of the cores cost the step running beside
  it. On a host whose cores the transfer shares with generation this, not the switch, is what
  a staged refit costs, and it is noisy when other work shares the cores too.

On one host the clocks of the processes agree (``perf_counter`` is the monotonic clock), so the
engines' step times are cut at the controller's marks. On CPU the host is the device, so the
copy mode's fraction changes where nothing lands; it matters on a GPU.
"""

from __future__ import annotations

import statistics
import time

import torch

from refit.cli.fleets import Fleet, FleetLayout
from refit.cli.output import show
from refit.comm.group import free_port
from refit.control.synchronizer import ReshardWeightSynchronizer
from refit.testing.engine import CanonicalTrainer, EngineConfig, EngineWorker

CALL_S = 300.0


def bench_config(layers: int, hidden: int, vocab: int) -> dict:
    """A Llama-shaped HF config: heads of 32, GQA 4:1, MLP 11/4 of hidden."""
    head_dim = 32
    heads = max(hidden // head_dim, 4)
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1),
            "head_dim": head_dim, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6}


def window(steps: list[float], start: float, end: float, batch: int) -> dict:
    """Tokens/s and step gaps of the steps that ended within [start, end]."""
    inside = [t for t in steps if start <= t <= end]
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    # the gap from the window's start to its first step, and from its last to the end, count too
    edges = [inside[0] - start, end - inside[-1]] if inside else [end - start]
    return {"seconds": end - start, "steps": len(inside), "tokens_per_s": len(inside) * batch / (end - start),
            "median_step_s": statistics.median(gaps) if gaps else None, "longest_gap_s": max([*gaps, *edges])}


def refit_gaps(steps: list[float], marks: list[tuple[float, float]]) -> list[float]:
    """For each refit (its sync's start and end), the longest step gap that overlaps it."""
    pairs = list(zip(steps, steps[1:]))
    return [max([b - a for a, b in pairs if b >= t0 and a <= t1] or [t1 - t0]) for t0, t1 in marks]


def run_mode(name: str, trainers, engines, args, prompt: list[int], step0: int) -> dict:
    workers = [w for shard in engines for w in shard]
    staged = name != "blocking"
    fraction = args.staging_fraction if name == "staged copy" else 1.0
    for w in workers:
        w.call("refit_configure_staging", staged, device_fraction=fraction, require_version=False).result(CALL_S)
    sync = ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=args.refit_timeout)
    step = step0
    try:
        for _ in range(2):  # builds the plan and the staging once; both sets of a swap are written
            step += 1
            for t in trainers:
                t.call("set_step", step).result(CALL_S)
            sync.sync_weights()

        def serve(refits: int) -> tuple[dict, list[dict], list[float]]:
            for w in workers:
                w.call("start_serving", prompt, args.new_tokens, batch=args.batch).result(CALL_S)
            time.sleep(args.interval / 2)  # the loops reach their steady state
            start = time.perf_counter()
            results, syncs, marks = [], [], []
            nonlocal step
            for _ in range(refits):
                step += 1
                for t in trainers:
                    t.call("set_step", step).result(CALL_S)
                t0 = time.perf_counter()
                res = sync.sync_weights()
                syncs.append(time.perf_counter() - t0)
                marks.append((t0, time.perf_counter()))
                results.append(res)
                time.sleep(max(args.interval - (time.perf_counter() - t0), 0.0))
            if not refits:
                time.sleep(args.interval * args.refits)
            end = time.perf_counter()
            logs = [w.call("stop_serving").result(CALL_S) for w in workers]
            windows = [window(log["step_times"], start, end, args.batch) for log in logs]
            for log in logs:
                if log["error"]:
                    raise RuntimeError(f"a serving loop failed: {log['error']}")
            gaps = refit_gaps(sorted(logs[0]["step_times"]), marks)
            return {"windows": windows, "gaps": gaps, "versions": sorted({v for log in logs for r in log["requests"]
                                                            for v in r["versions"] if v is not None}),
                    "mixed_requests": sum(len(set(r["versions"])) > 1 for log in logs for r in log["requests"])}, \
                results, syncs

        quiet, _, _ = serve(0)
        busy, results, syncs = serve(args.refits)
        switches = [s["seconds"] for w in workers for s in w.call("refit_switches").result(CALL_S)[-args.refits:]]
    finally:
        sync.shutdown()
    # the first shard's first worker stands for the fleet (every shard runs the same loop)
    q, b = quiet["windows"][0], busy["windows"][0]
    step_s = q["median_step_s"] or 0.0
    excess = [g - step_s for g in busy["gaps"]]
    return {
        "mode": name, "device_fraction": fraction if staged else None,
        "tokens_per_s_without_refits": q["tokens_per_s"], "tokens_per_s_with_refits": b["tokens_per_s"],
        "throughput_ratio": b["tokens_per_s"] / q["tokens_per_s"],
        "median_step_s": q["median_step_s"], "longest_gap_s": b["longest_gap_s"],
        "longest_gap_without_refits_s": q["longest_gap_s"],
        # what the refit itself stops generation for, measured in the engine: blocking, from the
        # transfer's first byte to the commit; staged, the switch (the serving lock held)
        "stall_s": statistics.median(switches),
        "stall_max_s": max(switches),
        # the longest step gap overlapping each refit, less the median step without refits: the
        # switch plus what the transfer's share of the cores cost the steps running beside it
        "gap_excess_median_s": statistics.median(excess), "gap_excess_max_s": max(excess),
        "sync_median_s": statistics.median(syncs),
        "transfer_median_s": statistics.median(r.transfer_s for r in results),
        "refits": len(results), "versions_served": busy["versions"],
        "requests_across_a_switch": busy["mixed_requests"],
        "per_worker": [{"tokens_per_s": w["tokens_per_s"], "longest_gap_s": w["longest_gap_s"]}
                       for w in busy["windows"]],
    }, step


def run_staged_bench(args) -> dict:
    config = bench_config(args.layers, args.hidden, args.vocab)
    spec = EngineConfig.from_hf(config).spec
    t0 = time.perf_counter()
    layout = FleetLayout(args.src, args.dst_tp, args.dst_dp)
    fleet = Fleet("process", layout, CanonicalTrainer, EngineWorker, trainer_kwargs={"config": config},
                  engine_kwargs={"config": config},
                  shard_kwargs=lambda s: {"tp_port": free_port() if args.dst_tp > 1 else None}, start_timeout_s=CALL_S)
    start_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.prompt_tokens,), generator=g).tolist()
    modes, step = [], 0
    try:
        for name in ("blocking", "staged swap", "staged copy"):
            result, step = run_mode(name, fleet.trainers, fleet.engines, args, prompt, step)
            modes.append(result)
    finally:
        fleet.close()
    blocking = modes[0]
    for m in modes:
        m["stall_over_blocking_pause"] = m["stall_s"] / blocking["stall_s"]
        m["gap_excess_over_blocking"] = m["gap_excess_median_s"] / blocking["gap_excess_median_s"]
    nbytes = spec.num_params * 4 * args.dst_dp
    return {"path": "staged", "device": "cpu (gloo)", "layout": layout.describe(), "model": spec.name,
            "layers": args.layers, "hidden": args.hidden,
            "vocab": args.vocab, "params": spec.num_params, "bytes_per_refit": nbytes, "batch": args.batch,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "interval_s": args.interval,
            "refits": args.refits, "fleet_start_s": start_s, "modes": modes,
            "targets": {m["mode"]: {"stall_at_most_10pct_of_blocking_pause": m["stall_over_blocking_pause"] <= 0.10,
                                    "gap_excess_at_most_10pct_of_blocking": m["gap_excess_over_blocking"] <= 0.10,
                                    "throughput_at_least_90pct": m["throughput_ratio"] >= 0.90}
                        for m in modes[1:]}}


def mode_cells(m: dict, step: str, stall_digits: int) -> list[str]:
    """What a staged bench's table shows of every mode (``mode_columns``): tokens/s without and with
    refits and their ratio, the median step (the ``step`` key), the stall and the gap excess, each
    also over blocking's."""
    return [f"{m['tokens_per_s_without_refits']:.0f}", f"{m['tokens_per_s_with_refits']:.0f}",
            f"{m['throughput_ratio']:.2f}", f"{m[step] * 1e3:.1f} ms", f"{m['stall_s'] * 1e3:.{stall_digits}f} ms",
            f"{m['stall_over_blocking_pause']:.3f}", f"{m['gap_excess_median_s'] * 1e3:.1f} ms",
            f"{m['gap_excess_over_blocking']:.2f}"]


def mode_columns(step: str) -> tuple[str, ...]:
    """The headers of ``mode_cells``, the median step's called ``step``."""
    return ("tok/s no refit", "tok/s refits", "ratio", step, "stall", "stall / blocking", "gap excess",
            "gap / blocking")


def print_modes(title: str, columns: tuple[str, ...], rows: list[list[str]], note: str, *, labels: int = 1) -> None:
    """A staged bench's table: a row of cells per mode under ``columns`` (the first ``labels`` of
    them name the row, left-aligned), then ``note``."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < labels else "right")
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(note)


def print_table(r: dict) -> None:
    rows = [[m["mode"] + (f" ({m['device_fraction']:g} on device)" if m["mode"] == "staged copy" else ""),
             *mode_cells(m, "median_step_s", 2), f"{m['sync_median_s'] * 1e3:.0f} ms"] for m in r["modes"]]
    print_modes(f"refit bench --path staged: {r['layout']}, {r['device']}, a refit every {r['interval_s']}s",
                ("mode", *mode_columns("median step"), "sync"), rows,
                f"{r['model']}: {r['params'] / 1e6:.1f}M params, {r['bytes_per_refit'] / 1e6:.0f} MB per refit; "
                f"batch {r['batch']}, {r['prompt_tokens']}-token prompts, {r['new_tokens']} new tokens a request; "
                f"{r['refits']} refits a mode")


def check_layout(args) -> None:
    """Refuse a ``--dst-tp`` the engines cannot cut the model by (heads, vocabulary, MLP), as each
    engine worker would, but before any process starts."""
    from refit.errors import ConfigError, LayoutError
    from refit.models.fused import FusedLayout

    spec = EngineConfig.from_hf(bench_config(args.layers, args.hidden, args.vocab)).spec
    try:
        FusedLayout(spec, tp_size=args.dst_tp)
    except LayoutError as e:
        raise ConfigError(f"--path staged --dst-tp {args.dst_tp}: {e}") from None


def run(args) -> int:
    result = run_staged_bench(args)
    show(result, args.json, print_table)
    return 0

