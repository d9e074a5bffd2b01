"""`refit bench` on its transport path, and flags a run does not read."""

import json
import subprocess
import sys


def bench(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refit.cli", "bench", *flags], capture_output=True, text=True,
                          timeout=timeout)


def test_transport_path_json_checks_every_element_and_the_golden():
    proc = bench("--json", "--layers", "1", "--hidden", "64", "--vocab", "96", "--repeat", "1",
                 "--dst-dtype", "bfloat16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["layout"] == "TP4 -> TP2 x DP2" and r["world_size"] == 8
    assert r["correct"] and r["golden_correct"] and r["bytes_moved"] >= r["min_bytes_needed"]


def test_flags_of_another_run_are_refused_by_name():
    proc = bench("--path", "sync", "--repeat", "5", "--skip-golden", timeout=60)
    assert proc.returncode == 2
    assert "--repeat, --skip-golden do not apply" in proc.stderr
    proc = bench("--device", "cuda", "--transport", "nixl", "--src", "2", "--gpu-refits", "3", timeout=60)
    assert proc.returncode == 2
    assert "--gpu-refits, --src do not apply" in proc.stderr
