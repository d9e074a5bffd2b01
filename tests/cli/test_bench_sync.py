"""`refit bench --path sync` as a user runs it: a tiny model on CPU, endpoints on threads (LocalWorker)."""

import json
import subprocess
import sys


def bench(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refit.cli", "bench", *flags], capture_output=True, text=True,
                          timeout=timeout)


def test_sync_path_json_reports_both_paths_and_verified_bytes():
    proc = bench("--path", "sync", "--json", "--fleet", "local", "--layers", "1", "--hidden", "64", "--vocab", "96",
                 "--iters", "2", "--warmup", "1", "--dtype", "float32", "--dst-dtype", "bfloat16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert (r["path"], r["fleet"], r["device"]) == ("sync", "local", "cpu (gloo)")
    assert r["layout"] == "trainer TP2 -> 2 engine shard(s) of TP1" and r["world_size"] == 4
    assert (r["layers"], r["hidden"], r["dtype"], r["dst_dtype"], r["iters"]) == (1, 64, "float32", "bfloat16", 2)
    # two TP1 engine shards each receive every bf16 element once
    assert r["bytes_per_step"] == 2 * 2 * r["params"]
    for side in ("sync", "raw"):
        assert r[side]["median_s"] > 0 and r[side]["p90_s"] >= r[side]["median_s"] and r[side]["GBps"] > 0
    assert r["sync_over_raw"] == r["sync"]["median_s"] / r["raw"]["median_s"]
    assert r["verified"] and r["same_bytes"] and r["correct"] and r["wrong"] == {}
    assert r["rebuilds_after_init"] == 0


def test_staged_sync_path_reports_the_switch_and_lands_every_element():
    proc = bench("--path", "sync", "--json", "--fleet", "local", "--layers", "1", "--hidden", "64", "--vocab", "96",
                 "--iters", "2", "--warmup", "1", "--staged")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["staged"] and 0 < r["switch_median_s"] <= r["switch_max_s"]
    # the transfers landed in staging and the switches copied them in: the live weights are the trainer's
    assert r["verified"] and r["correct"] and r["wrong"] == {}


def test_fp8_engines_get_every_element_bit_exact_and_fewer_bytes():
    proc = bench("--path", "sync", "--json", "--fleet", "local", "--layers", "1", "--hidden", "256", "--vocab", "96",
                 "--iters", "2", "--warmup", "1", "--dst-dtype", "fp8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fp8 = json.loads(proc.stdout)
    assert fp8["dst_dtype"] == "fp8" and fp8["verified"] and fp8["correct"] and fp8["wrong"] == {}
    # the linear weights cross as one byte an element (and a scale a block), the norms and embeddings as bf16:
    # against two bytes an element of every param for each of the two engine shards in bf16
    assert fp8["bytes_per_step"] < 0.6 * (2 * 2 * fp8["params"])
    # quantization: the kernels timed alone, and each raw refit's share ahead of and beside the wire
    q = fp8["quantize"]
    assert q["kernel_s"] > 0 and q["kernel_GBps"] > 0 and q["wire_GBps"] > 0
    assert q["ahead_median_s"] > 0 and q["beside_median_s"] > 0
