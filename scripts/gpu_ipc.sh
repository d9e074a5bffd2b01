#!/usr/bin/env bash
# The device call for the IPC transport on one node: the CUDA IPC GPU tests (both allocators),
# `refit bench --device cuda --transport ipc` (every placement the machine has: colocated on one
# GPU, and across two GPUs when there are two), the synchronizer's whole path with ranks sharing
# the GPU (`--path sync --transport ipc`, NIXL beside it), and `refit demo --device cuda --colocate`
# when Ray is carried. Prints a short table last; JSON and logs go to $OUT.
#   bash ../shared/tools/device-ray-wheels.sh .whl-ray && bash scripts/pack_site.sh   # -> .site/site.tar.xz
#   run(carry=[".site"], command="bash scripts/gpu_ipc.sh [tests] [bench] [sync] [demo]")
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-ipc
STEPS="${*:-tests bench sync demo}"
"$PY" -c 'import torch; from refit.transport.nixl import nixl_available; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0), "nixl", nixl_available())' 2>&1 | tee "$OUT/env.log"
rc=0
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
if step tests; then
  timeout -s INT -k 10 420 "$PY" -m pytest -v -m gpu tests/gpu/test_ipc_gpu.py ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider -x --durations=0 -o faulthandler_timeout=100 > "$OUT/pytest.log" 2>&1
  r=$?; rc=$(( rc || r )); grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|s call" "$OUT/pytest.log" | tail -30
fi
if step bench; then
  timeout -s INT -k 10 400 "$PY" -m refit.cli bench --device cuda --transport ipc --json > "$OUT/bench_ipc.json" 2> "$OUT/bench_ipc.err"
  r=$?; rc=$(( rc || r )); echo "bench ipc rc=$r"; [ $r = 0 ] || tail -12 "$OUT/bench_ipc.err"
fi
if step sync; then
  for t in ${SYNC_TRANSPORTS:-ipc nixl}; do
    timeout -s INT -k 10 240 "$PY" -m refit.cli bench --path sync --device cuda --transport $t --fleet process --json \
      > "$OUT/sync_$t.json" 2> "$OUT/sync_$t.err"
    r=$?; rc=$(( rc || r )); echo "sync $t rc=$r"; [ $r = 0 ] || tail -8 "$OUT/sync_$t.err"
  done
fi
if step demo && "$PY" -c 'import ray' 2>/dev/null; then
  timeout -s INT -k 10 300 "$PY" -m refit.cli demo --device cuda --colocate --trainer-dp 1 --trainer-tp 1 --engine-tp 1 \
    --engines 2 --json > "$OUT/demo_colocate.json" 2> "$OUT/demo_colocate.err"
  r=$?; rc=$(( rc || r )); echo "demo colocate rc=$r"; [ $r = 0 ] || tail -8 "$OUT/demo_colocate.err"
fi
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    p = out / name
    if not p.exists():
        return None
    t = p.read_text()
    try:
        return json.loads(t[t.index("{"):])
    except Exception as e:
        print(name, "no result:", type(e).__name__); return None
b = load("bench_ipc.json")
for s in (b or {}).get("results", []):
    ms = lambda g: s["bytes"] / g / 1e6
    print(f"-- {s['placement']} GPUs {s['devices']} {s['device']}; {s['bytes']/1e9:.2f} GB; verified {s['verified']}")
    rows = [("d2d copy flat", s["d2d_flat_GBps"]), ("d2d copy per tensor", s["d2d_per_tensor_GBps"]), ("IPC refit", s["ipc_GBps"])]
    if "nixl" in s and "GBps" in s["nixl"]: rows.append(("NIXL refit", s["nixl"]["GBps"]))
    if "nccl_raw_GBps" in s: rows += [("NCCL raw", s["nccl_raw_GBps"]), ("NCCL refit", s["nccl_refit_GBps"])]
    if "handoff_GBps" in s: rows.append(("per-bucket hand-off", s["handoff_GBps"]))
    for name, g in rows:
        print(f"   {name:22s} {ms(g):8.2f} ms {g:8.0f} GB/s")
    print(f"   IPC / d2d {s['ipc_over_d2d']:.3f}   IPC / hand-off {s.get('ipc_over_handoff', float('nan')):.2f}   50-refit growth {s['hygiene_growth']}")
for t in ("ipc", "nixl"):
    r = load(f"sync_{t}.json")
    if r:
        print(f"sync {t:5s} {r['layout']}: sync {r['sync']['median_s']*1e3:.1f} ms, raw {r['raw']['median_s']*1e3:.1f} ms, "
              f"{r['bytes_per_step']/1e9:.2f} GB, verified {r['verified']}, correct {r['correct']}")
d = load("demo_colocate.json")
if d:
    print(f"demo --colocate: {d['trainer']} -> {d['engines']}: all verified and logits match {d['all_verified_and_logits_match']}, readmitted {d['killed_shard_readmitted']}")
    for s in d["steps"]:
        print(f"   step {s['step']} refit {s['refit_s']:.3f}s verified {s['verified']} max|dlogit| {s['max_abs_logit_diff']:.1e} shards {s['shards']} {s['events']}")
PY
exit $rc
