"""`refit bench --path staged` as a user runs it: a tiny model on CPU, a process per rank."""

import json
import subprocess
import sys


def test_staged_path_json_reports_every_mode_against_the_blocking_refit():
    proc = subprocess.run([sys.executable, "-m", "refit.cli", "bench", "--path", "staged", "--json", "--layers", "1",
                           "--hidden", "64", "--vocab", "256", "--refits", "2", "--interval", "0.2", "--batch", "1",
                           "--new-tokens", "2", "--prompt-tokens", "4"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["path"] == "staged" and r["layout"] == "trainer TP1 -> 1 engine shard(s) of TP1"
    modes = {m["mode"]: m for m in r["modes"]}
    assert list(modes) == ["blocking", "staged swap", "staged copy"]
    assert modes["staged copy"]["device_fraction"] == 0.125 and modes["blocking"]["device_fraction"] is None
    for m in modes.values():
        assert m["refits"] == 2 and m["tokens_per_s_without_refits"] > 0 and m["tokens_per_s_with_refits"] > 0
        assert m["stall_s"] >= 0 and m["stall_max_s"] >= m["stall_s"] and m["sync_median_s"] > 0
        assert m["versions_served"] == sorted(m["versions_served"]) and m["versions_served"]
    assert modes["blocking"]["stall_over_blocking_pause"] == 1.0
    assert set(r["targets"]) == {"staged swap", "staged copy"}
