"""Every ``refit`` command answers bad input in one line on stderr, exit code 2, before it starts anything.

Each case runs the command's real entry point (``refit.cli.main.main``) in this process,
with every start-up made impossible: Ray and vLLM cannot be imported and a process fleet,
worker, subprocess or fork cannot start. A command that missed the bad value would go on to
its expensive phase and fail there, or print to stdout; an empty stdout and exit code 2 are
the proof that it stopped before start-up. A few cases also run as a real subprocess, as a
user would, since in-process is what keeps 60 cases cheap on a small machine; the absurd
sizes among them run in an interpreter whose audit hook records (and refuses) every process
it would create, so that "nothing started" is read from the interpreter itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refit.cli.main import main

ROOT = Path(__file__).resolve().parents[2]

GOOD = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "torch_dtype": "bfloat16",
}
# config.json contents, by the name a case uses as {name} in its arguments
CONFIGS = {
    "good": json.dumps(GOOD),
    "truncated": json.dumps(GOOD)[:40],
    "empty": "",
    "list": "[1, 2, 3]",
    "zero_heads": json.dumps({**GOOD, "num_attention_heads": 0}),
    "no_vocab": json.dumps({k: v for k, v in GOOD.items() if k != "vocab_size"}),
    "bad_dtype": json.dumps({**GOOD, "torch_dtype": "bfloat17"}),
    "hidden_250": json.dumps({**GOOD, "hidden_size": 250}),
    "kv_heads_3": json.dumps({**GOOD, "num_key_value_heads": 3}),
    "text_layers": json.dumps({**GOOD, "num_hidden_layers": "2"}),
    "negative_experts": json.dumps({**GOOD, "num_experts": -4, "moe_intermediate_size": 64}),
    "layers_1e8": json.dumps({**GOOD, "num_hidden_layers": 10 ** 8}),
    "vocab_1e9": json.dumps({**GOOD, "vocab_size": 10 ** 9}),
    "experts_12m_tensors": json.dumps({**GOOD, "model_type": "qwen3_moe", "num_hidden_layers": 1000,
                                       "num_experts": 4096, "moe_intermediate_size": 64}),
}
PLAN = ["plan", "--train", "tp=2", "--train-gpus", "2", "--engine", "tp=1", "--engine-gpus", "2", "--repeats", "1"]

CASES = [
    # refit plan: the model's config.json
    (PLAN + ["--model", "{truncated}"], "not valid JSON"),
    (PLAN + ["--model", "{empty}"], "config is empty"),
    (PLAN + ["--model", "{list}"], "must be a JSON object"),
    (PLAN + ["--model", "{zero_heads}"], "num_attention_heads"),
    (PLAN + ["--model", "{no_vocab}"], "vocab_size"),
    (PLAN + ["--model", "{bad_dtype}"], "torch_dtype"),
    (PLAN + ["--model", "{hidden_250}"], "hidden_size 250 is not divisible by num_attention_heads 8"),
    (PLAN + ["--model", "{kv_heads_3}"], "num_key_value_heads"),
    (PLAN + ["--model", "{text_layers}"], "num_hidden_layers"),
    (PLAN + ["--model", "{negative_experts}"], "num_experts"),
    (PLAN + ["--model", "{folder}"], "without a config.json"),
    (PLAN + ["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (PLAN + ["--model", "{layers_1e8}"], "num_hidden_layers 100000000 is more than 1024"),
    (PLAN + ["--model", "{vocab_1e9}"], "vocab_size 1000000000 is more than 4194304"),
    (PLAN + ["--model", "{experts_12m_tensors}"], "12297003 tensors"),
    # refit plan: flags
    (PLAN + ["--model", "{good}", "--gpus-per-node", "0"], "--gpus-per-node"),
    (PLAN + ["--model", "{good}", "--nic-gbps", "0"], "--nic-gbps"),
    (PLAN + ["--model", "{good}", "--latency-us", "-1"], "--latency-us"),
    (PLAN + ["--model", "{good}", "--bucket-mb", "0"], "--bucket-mb"),
    (PLAN + ["--model", "{good}", "--repeats", "0"], "--repeats"),
    (PLAN + ["--model", "{good}", "--layers", "0"], "--layers"),
    (PLAN + ["--model", "{good}", "--scaling", "4,abc"], "--scaling"),
    (PLAN + ["--model", "{good}", "--scaling", ","], "--scaling"),
    (PLAN + ["--model", "{good}", "--fanout", "off,bogus"], "--fanout"),
    (PLAN + ["--model", "{good}", "--train-dtype", "float17"], "--train-dtype"),
    (PLAN + ["--model", "{good}", "--png", "{missing}/plan.png"], "--png"),
    (PLAN + ["--model", "{good}", "--png", "{folder}"], "--png"),
    (PLAN + ["--model", "{good}", "--png", "{folder}/plan.png", "--fanout", ""], "--png"),
    (PLAN + ["--model", "{good}", "--rank", "4"], "--rank 4"),
    (PLAN + ["--model", "{good}", "--rank", "1", "--scaling", "8"], "--scaling"),
    (PLAN + ["--model", "{good}", "--train", "tp=3"], "train layout 'tp=3'"),
    (PLAN + ["--model", "{good}", "--engine", "tp=2,ep=2"], "ep=2"),
    (["plan", "--no-such-flag"], "--no-such-flag"),
    (PLAN + ["--model", "{good}", "--json", "--markdown"], "argument --markdown: not allowed with argument --json"),
    (PLAN + ["--model", "{good}", "--per-rank"], "--per-rank"),
    (PLAN + ["--model", "{good}", "--engine-gpus", "1000000"], "--engine-gpus"),
    (PLAN + ["--model", "{good}", "--scaling", "100000"], "--scaling 100000"),
    (PLAN + ["--model", "{good}", "--delta", "1.5"], "--delta: must be within [0, 1]"),
    (PLAN + ["--model", "{good}", "--rank", "1", "--delta", "0.03"], "--delta"),
    # refit demo: refused before Ray is imported or started
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--trainer-dp", "0"], "--trainer-dp"),
    (["demo", "--engines", "0"], "--engines"),
    (["demo", "--engine-tp", "2,x"], "--engine-tp"),
    (["demo", "--engine-tp", "2,0"], "--engine-tp"),
    (["demo", "--kill-step", "9"], "--kill-step 9"),
    (["demo", "--kill-shard", "5"], "--kill-shard 5"),
    (["demo", "--engine-ep"], "--engine-ep"),
    (["demo", "--timeout", "0"], "--timeout"),
    (["demo", "--connect-timeout", "nan"], "--connect-timeout"),
    (["demo", "--device", "tpu"], "--device"),
    (["demo", "--engine", "vllm", "--steps", "3"], "--steps"),
    (["demo", "--engine", "vllm", "--timeout", "0"], "--timeout"),
    (["demo", "--engine-tp", "99"], "--engine-tp 99"),
    (["demo", "--engine-tp", "3"], "--engine-tp 3: engine tp=3: tp=3 does not divide the 4 query heads"),
    (["demo", "--trainer-tp", "3"], "--trainer-tp 3: trainer tp=3 must divide the 4 heads and 2 key/value heads"),
    (["demo", "--trainer-dp", "100000"], "--trainer-dp 100000"),
    (["demo", "--model", "qwen3-moe", "--engine-ep", "--engine-tp", "3", "--engines", "2"], "--engine-tp 3"),
    pytest.param(["demo", "--device", "cuda"], "--device cuda: torch sees no GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")),
    (["demo", "--engine", "vllm", "--trainer-tp", "3"], "--trainer-tp 3"),
    (["demo", "--engine", "vllm", "--trainer-dp", "100000"], "--trainer-dp 100000"),
    # refit bench: refused before a fleet of processes (or vLLM) starts
    (["bench", "--repeat", "0"], "--repeat"),
    (["bench", "--src", "100000"], "--src 100000"),
    (["bench", "--dst-dp", "100000"], "--dst-dp 100000"),
    (["bench", "--layers", "5000"], "--layers"),
    (["bench", "--hidden", "1000000"], "--hidden"),
    (["bench", "--path", "sync", "--src", "100000"], "--src 100000"),
    (["bench", "--path", "sync", "--src", "3"], "--src 3: train tp=3 does not divide the 8 key/value heads"),
    (["bench", "--path", "sync", "--dst-tp", "3"], "--dst-tp 3: engine tp=3 does not divide the 8 key/value heads"),
    (["bench", "--path", "staged", "--dst-tp", "100000"], "--dst-tp 100000"),
    (["bench", "--path", "staged", "--dst-tp", "3"], "--dst-tp 3: engine tp=3: tp=3 does not divide the 8 query"),
    (["bench", "--src", "0"], "--src"),
    (["bench", "--dtype", "float17"], "--dtype"),
    (["bench", "--bucket-mib", "nan"], "--bucket-mib"),
    (["bench", "--transport", "nixl"], "--transport nixl"),
    (["bench", "--repeat", "2", "--path", "sync"], "--repeat"),
    (["bench", "--path", "sync", "--iters", "0"], "--iters"),
    (["bench", "--path", "sync", "--refit-timeout", "0"], "--refit-timeout"),
    (["bench", "--path", "sync", "--model", "{zero_heads}"], "num_attention_heads"),
    (["bench", "--engine", "vllm", "--hidden", "100"], "--hidden 100"),
    (["bench", "--engine", "vllm", "--device", "cuda"], "--device"),
    (["bench", "--engine", "vllm", "--src", "2"], "--src"),
    (["bench", "--path", "staged", "--engine", "vllm", "--hidden", "300"], "--hidden 300"),
    (["bench", "--path", "staged", "--engine", "vllm", "--staging-fraction", "0.5"], "--staging-fraction"),
    (["bench", "--path", "staged", "--device", "cuda", "--gpu-source", "nic"], "--gpu-source"),
    (["bench", "--path", "staged", "--device", "cuda", "--dst-tp", "2"], "--dst-tp"),
    (["bench", "--path", "staged", "--gpu-source", "host"], "--gpu-source"),
    (["bench", "--path", "transport", "--staged"], "--staged"),
    (["bench", "--dst-dtype", "fp8"], "--dst-dtype fp8"),
    (["bench", "--device", "cuda", "--gpu-out", "{missing}/out.json"], "--gpu-out"),
    (["bench", "--device", "cuda", "--src", "2"], "--src"),
    (["bench", "--device", "cuda", "--transport", "nixl", "--nixl-timeout-s", "0"], "--nixl-timeout-s"),
    ([], "give a command"),
    (["nope"], "nope"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.fixture
def places(tmp_path) -> dict[str, str]:
    """What a case's {name} stands for: a folder holding that config.json, an empty folder, a missing one."""
    out = {"folder": str(tmp_path / "no_config"), "missing": str(tmp_path / "missing")}
    (tmp_path / "no_config").mkdir()
    for name, text in CONFIGS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        out[name] = str(tmp_path / name / "config.json")
    return out


def refit(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "refit.cli", *argv], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


class _StartUp(BaseException):
    """Raised by anything that would start a fleet: not an Exception, so no command can swallow it."""


@pytest.fixture
def no_start_up(monkeypatch):
    for name in ("ray", "vllm"):
        monkeypatch.setitem(sys.modules, name, None)  # `import ray` raises ImportError
    from refit.runtime import handles
    from refit.testing import launch

    def refuse(*args, **kwargs):
        raise _StartUp("the command started a fleet before refusing its input")

    monkeypatch.setattr(launch.LocalFleet, "_start", refuse)
    monkeypatch.setattr(handles.ProcessWorker, "__init__", refuse)
    import multiprocessing.process
    import subprocess as sp

    monkeypatch.setattr(sp.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)


def in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _case_id(case) -> str:
    argv = case.values[0] if hasattr(case, "values") else case[0]
    return " ".join(argv[:1] + argv[-2:]) or "no-command"


@pytest.mark.parametrize("argv, names", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_is_one_line_exit_2_before_start_up(argv, names, places, no_start_up, capsys):
    argv = [a.format(**places) for a in argv]
    code, stdout, stderr = in_process(argv, capsys)
    _check_refusal(argv, names.format(**places), code, stdout, stderr)


@pytest.mark.parametrize("argv, names", [CASES[0], next(c for c in CASES if "--gpus-per-node" in c[0]),
                                         next(c for c in CASES if c[0][:1] == ["demo"]),
                                         next(c for c in CASES if c[0][:1] == ["bench"]), CASES[-1]],
                         ids=["plan-config", "plan-flag", "demo", "bench", "no-command"])
def test_bad_input_as_a_user_runs_it(argv, names, places):
    argv = [a.format(**places) for a in argv]
    proc = refit(argv)
    _check_refusal(argv, names.format(**places), proc.returncode, proc.stdout, proc.stderr)


# Runs refit's entry point in an interpreter that records, and refuses, every process it would
# create, then reports what it saw on the last line of stderr. The audit hook sees subprocess,
# fork, posix_spawn and exec (Ray's start-up); multiprocessing's spawn (every fleet) calls
# _posixsubprocess.fork_exec, which raises no audit event, so that one is replaced.
WATCHED = """
import json, sys, subprocess, _posixsubprocess
started = []
def refuse(what):
    started.append(what)
    raise RuntimeError(f"refit started a process ({what}) before refusing its input")
def hook(event, args):
    if event in ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"):
        refuse(event)
sys.addaudithook(hook)
_posixsubprocess.fork_exec = subprocess._fork_exec = lambda *args: refuse("fork_exec")
from refit.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
except Exception as e:  # a refused start-up, raised through the command
    code = type(e).__name__
print(json.dumps({"code": code, "started": started, "ray": "ray" in sys.modules, "vllm": "vllm" in sys.modules}),
      file=sys.stderr)
"""
ABSURD = [
    (["bench", "--src", "100000"], "--src 100000"),
    (["demo", "--engine-tp", "99"], "--engine-tp 99"),
    (["demo", "--trainer-tp", "3"], "--trainer-tp 3"),
    (["demo", "--engine", "vllm", "--trainer-tp", "3"], "--trainer-tp 3"),
    pytest.param(["demo", "--device", "cuda"], "--device cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")),
    (PLAN + ["--model", "{layers_1e8}"], "num_hidden_layers 100000000"),
    (PLAN + ["--model", "{good}", "--json", "--markdown"], "--markdown: not allowed with argument --json"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv, names", ABSURD, ids=[_case_id(c) for c in ABSURD])
def test_absurd_sizes_are_refused_before_any_process_or_ray_starts(argv, names, places):
    """As a user runs them, in a fresh interpreter: refused in one line with exit code 2,
    no process created (not even to start and stop Ray again), Ray and vLLM never imported."""
    argv = [a.format(**places) for a in argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", WATCHED, *argv], capture_output=True, text=True, timeout=240,
                          env=env, cwd=ROOT)
    *lines, report = proc.stderr.strip().splitlines()
    seen = json.loads(report)
    assert seen == {"code": 2, "started": [], "ray": False, "vllm": False}, proc.stderr
    _check_refusal(argv, names.format(**places), seen["code"], proc.stdout, "\n".join(lines))


def _check_refusal(argv: list[str], names: str, code: int, stdout: str, stderr: str) -> None:
    both = stdout + stderr
    assert code == 2, both
    assert "Traceback" not in both, both
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    command = argv[0] if argv and argv[0] in ("plan", "demo", "bench") else None
    assert lines[0].startswith(f"refit {command}: " if command else "refit: "), lines[0]
    assert names in lines[0], lines[0]
    assert stdout == "", stdout  # nothing of the plan, the fleet or the benchmark


def test_config_errors_name_the_file(places):
    proc = refit(PLAN + ["--model", places["zero_heads"]])
    assert f"{places['zero_heads']}: num_attention_heads must be a positive integer, got 0" in proc.stderr


def test_good_input_still_plans(places):
    """The control: the same small plan with a sound config runs and exits 0."""
    proc = refit(PLAN + ["--model", places["good"], "--fanout", "off", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["world"] == 4
