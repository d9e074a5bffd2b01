#!/usr/bin/env bash
# The one command a device call runs for `refit bench --path sync --device cuda`: sync_weights()
# with verify on, next to the raw transport of the same plan in the same workers (--fleet local:
# the GPU machine has no Ray). Over NCCL when torch sees 2 or more GPUs (one per rank; the default
# layout fits the GPUs: 4 -> trainer TP2 -> 2 engine shards of TP1, 2 -> 1 -> 1), and over NIXL
# one-sided writes on any number of GPUs (ranks share them) when the NIXL wheel is carried in
# .whl/. Prints a short table last; the JSON results and logs go to $OUT.
#
#   run(kind="nvidia-h200-x2", command="bash scripts/gpu_bench_sync.sh", carry=[".whl"])
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-bench-sync
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
"$PY" -c 'import sys, torch; from refit.transport.nixl import nixl_available; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0), "nixl", nixl_available())' 2>&1 | tee "$OUT/env.log"

rc=0
bench() {  # name, then the bench's flags
  local name=$1; shift
  timeout -s INT -k 10 280 "$PY" -m refit.cli bench --path sync --device cuda --json "$@" \
    > "$OUT/sync_$name.json" 2> "$OUT/sync_$name.err"
  local r=$?; rc=$(( rc || r )); echo "bench $name rc=$r"; [ $r = 0 ] || tail -8 "$OUT/sync_$name.err"
}
if [ "$GPUS" -ge 2 ]; then
  bench nccl-bf16 --fleet local                                                # the 8B Llama shape, bf16 -> bf16
  bench nccl-fp32-bf16 --fleet local --dtype float32 --dst-dtype bfloat16        # cast while packing
fi
if "$PY" -c 'from refit.transport.nixl import nixl_available as a; raise SystemExit(not a())'; then
  bench nixl-bf16 --transport nixl --fleet process   # a process per rank: CUDA IPC between ranks on one GPU
fi

# flags that a run does not read are refused by name (rc 2), before anything starts
"$PY" -m refit.cli bench --device cuda --transport nixl --src 2 > /dev/null 2> "$OUT/refused.err"
echo "bench --transport nixl --src 2: rc=$? ($(tail -1 "$OUT/refused.err"))"

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':15} {'layout':40} {'GB/step':>7} {'sync ms':>8} {'p90':>7} {'GB/s':>6} {'raw ms':>7} {'p90':>7} "
      f"{'GB/s':>6} {'+cksum ms':>9} {'sync/raw':>8} verified correct")
for f in sorted(out.glob("sync_*.json")):
    try:
        r = json.loads(f.read_text())
    except Exception as e:  # noqa: BLE001
        print(f"{f.stem[5:]:15} no result: {type(e).__name__}")
        continue
    s, w, c = r["sync"], r["raw"], r["raw_checksummed"]
    print(f"{f.stem[5:]:15} {r['layout']:40} {r['bytes_per_step'] / 1e9:7.2f} {s['median_s'] * 1e3:8.1f} "
          f"{s['p90_s'] * 1e3:7.1f} {s['GBps']:6.1f} {w['median_s'] * 1e3:7.1f} {w['p90_s'] * 1e3:7.1f} "
          f"{w['GBps']:6.1f} {c['median_s'] * 1e3:9.1f} {r['sync_over_raw']:8.2f} {str(r['verified']):8} {r['correct']}")
    print(f"{'':15} {r['device']}. {r['layout_note']}")
PY
echo "gpu_bench_sync: rc=$rc (JSON and logs in $OUT)"
exit $rc
