"""`refit demo` as a user runs it: a real local Ray cluster, a kill mid-refit, recovery, re-admission."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")


@pytest.mark.timeout(700)
def test_refit_demo_json_reports_recovery_and_readmission():
    """The default demo, as the README runs it. (Its one-sided variants, --nixl and --colocate,
    differ only in the synchronizer's transport, which tests/control/test_one_sided_sync.py
    covers; each demo run costs the suite about 50 s of its time budget here.)"""
    transport = "communicator"
    proc = subprocess.run([sys.executable, "-m", "refit.cli", "demo", "--json", "--steps", "3"],
                          capture_output=True, text=True, timeout=600)  # Ray's workers run niced: slow when busy
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is the JSON alone (Ray's obituary of the killed worker goes to stderr)
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["verified"] and s["tokens_match"] and s["max_abs_logit_diff"] <= 1e-5 for s in steps)
    assert result["engines"].startswith("3 shards: TP2, TP2, TP1")  # the default: engine layouts of two sizes
    assert result["trainer_strided_shard_params"] > 0  # FSDP2 x TP: where _StridedShard appears
    assert result["transport"] == transport
    assert steps[0]["shards"] == [0, 1, 2]
    assert steps[1]["shards"] == [0, 2] and steps[1]["recovery_s"] is not None  # lost mid-refit, recovered
    assert steps[2]["shards"] == [0, 1, 2]  # restarted and re-admitted
    assert result["all_verified_and_logits_match"] and result["killed_shard_readmitted"]
    assert all(b["loss"] < a["loss"] for a, b in zip(steps, steps[1:])), [s["loss"] for s in steps]  # it learns


@pytest.mark.timeout(700)
def test_refit_demo_in_a_terminal_says_what_it_killed_and_keeps_rays_report_of_it_out():
    """The table a newcomer reads: the kill is the demo's own, said so in its words; Ray's report of the
    death (which reads like an OOM kill) goes to a file the demo names, not to the terminal."""
    proc = subprocess.run([sys.executable, "-m", "refit.cli", "demo", "--steps", "2", "--kill-step", "1"],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "the demo SIGKILLed shard 1 worker 0" in out and "to show recovery" in out
    assert "A worker died or was killed" not in out and "OOM" not in out, out[-3000:]
    log = next(line.split(": ", 1)[1].strip() for line in proc.stdout.splitlines() if "Ray's messages" in line)
    with open(log) as f:
        assert "A worker died or was killed" in f.read()  # Ray's own words, kept for whoever wants them


def test_refit_demo_says_clearly_when_ray_is_unreachable():
    proc = subprocess.run([sys.executable, "-m", "refit.cli", "demo", "--address", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refit demo: --address 127.0.0.1:1: no Ray cluster answers there" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv,message", [
    (["--engine-tp", "2,x"], "--engine-tp '2,x': give sizes like 2 or 2,2,1"),
    (["--engine-tp", "2,1", "--engines", "3"], "--engines 3 but --engine-tp 2,1 gives 2 shards"),
    (["--engine-tp", "2", "--engines", "1"], "losing a shard needs --engines 2 or more"),
    (["--kill-shard", "5"], "--kill-shard 5 is not a shard (0..2)"),
    (["--engine-ep"], "--engine-ep splits routed experts; --model llama has none"),
    (["--engine", "vllm", "--fp8"], "--engine vllm --fp8: vLLM's CPU build runs block-scaled FP8 layers only on "
                                    "CPUs with AMX tiles"),
])
def test_refit_demo_refuses_bad_flags_before_starting_anything(argv, message):
    proc = subprocess.run([sys.executable, "-m", "refit.cli", "demo", *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_refit_demo_says_clearly_when_a_port_answers_but_is_no_ray_head():
    import socket

    with socket.socket() as listener:  # the kernel completes the handshakes; nobody speaks Ray
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "refit.cli", "demo", "--address", f"127.0.0.1:{port}",
                               "--connect-timeout", "5"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert f"could not join the Ray cluster at 127.0.0.1:{port} within 5s" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_gpu_shortfall_counts_one_gpu_per_rank_over_nccl_and_the_largest_nccl_group_over_nixl():
    import argparse

    from refit.cli.demo import add_arguments, engine_sizes, gpu_shortfall

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def short(argv, have):
        args = parser.parse_args(["--device", "cuda", *argv])
        return gpu_shortfall(args, engine_sizes(args), have)

    assert "needs 9 GPUs" in short([], 8) and "the Ray cluster has 8" in short([], 8)
    assert short([], 9) is None
    assert "--nixl: needs 4 GPUs" in short(["--nixl"], 2)  # the trainer's 2x2 NCCL group
    assert short(["--nixl", "--trainer-tp", "1"], 2) is None  # 2x1 trainer, engine TP groups of 2 and 1
    assert "needs 3 GPUs" in short(["--nixl", "--trainer-tp", "1", "--engine-tp", "3,1"], 2)
