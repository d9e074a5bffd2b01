#!/usr/bin/env bash
# The one command a device call runs for staged refits on a GPU (one is enough):
#   1. `refit bench --path staged --device cuda`: an 8B model decoding on the GPU while refits
#      land, blocking against staged swap and staged copy, bytes from pinned host memory and
#      from a colocated copy;
#   2. `refit bench --path sync --device cuda --transport nixl --fleet process`, in place and
#      --staged: the whole sync_weights() path (a process per rank, NIXL between ranks on one
#      GPU), with the switch a staged engine makes at the commit.
# Wheels that the machine lacks (msgpack, NIXL) are carried in .whl/ and unpacked beside the tree.
# Prints a short table last; the JSON results and logs go to $OUT.
#
#   run(kind="nvidia-h200", command="bash scripts/gpu_staged.sh", carry=[".whl"])
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-staged
"$PY" -c 'import sys, torch; from refit.transport.nixl import nixl_available; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0), "nixl", nixl_available())' 2>&1 | tee "$OUT/env.log"

rc=0
timeout -s INT -k 10 300 "$PY" -m refit.cli bench --path staged --device cuda --batch 32 --refits 5 --json \
  > "$OUT/staged_gpu.json" 2> "$OUT/staged_gpu.err"
r=$?; rc=$(( rc || r )); echo "bench staged rc=$r"; [ $r = 0 ] || tail -8 "$OUT/staged_gpu.err"

for variant in inplace staged; do
  flag=""; [ $variant = staged ] && flag="--staged"
  timeout -s INT -k 10 200 "$PY" -m refit.cli bench --path sync --device cuda --transport nixl --fleet process \
    --iters 5 --warmup 1 $flag --json > "$OUT/sync_$variant.json" 2> "$OUT/sync_$variant.err"
  r=$?; rc=$(( rc || r )); echo "bench sync $variant rc=$r"; [ $r = 0 ] || tail -8 "$OUT/sync_$variant.err"
done

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    r = json.loads((out / "staged_gpu.json").read_text())
    print(f"{r['device']}: {r['model']}, {r['bytes'] / 1e9:.1f} GB; d2d copy {r['d2d_copy_s'] * 1e3:.2f} ms "
          f"({r['d2d_copy_GBps']:.0f} GB/s); batch {r['batch']}")
    print(f"{'source':7} {'mode':26} {'tok/s':>8} {'refits':>8} {'ratio':>6} {'step ms':>8} {'stall ms':>9} "
          f"{'/block':>7} {'/d2d':>6} {'gap+ ms':>8} {'arrive ms':>9}")
    for m in r["modes"]:
        mode = m["mode"] + (f" {m['device_fraction']:g}" if m["device_fraction"] is not None else "")
        print(f"{m['source']:7} {mode:26} {m['tokens_per_s_without_refits']:8.0f} {m['tokens_per_s_with_refits']:8.0f} "
              f"{m['throughput_ratio']:6.3f} {m['median_step_s'] * 1e3:8.2f} {m['stall_s'] * 1e3:9.3f} "
              f"{m['stall_over_blocking_pause']:7.4f} {m['stall_over_d2d_copy']:6.3f} "
              f"{m['gap_excess_median_s'] * 1e3:8.2f} {m['arrival_median_s'] * 1e3:9.1f}")
except Exception as e:  # noqa: BLE001
    print("staged: no result:", type(e).__name__, e)
for variant in ("inplace", "staged"):
    try:
        text = (out / f"sync_{variant}.json").read_text()  # NIXL's workers log to stdout before it
        r = json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
    except Exception as e:  # noqa: BLE001
        print(f"sync {variant}: no result: {type(e).__name__}")
        continue
    s = r["sync"]
    sw = f"switch {r['switch_median_s'] * 1e3:.2f} ms (max {r['switch_max_s'] * 1e3:.2f})" if r["staged"] else ""
    print(f"sync {variant:8} {r['layout']}: {r['bytes_per_step'] / 1e9:.2f} GB, sync {s['median_s'] * 1e3:.1f} ms "
          f"({s['GBps']:.0f} GB/s), raw {r['raw']['median_s'] * 1e3:.1f} ms; verified {r['verified']}, "
          f"correct {r['correct']} {sw}")
PY
echo "gpu_staged: rc=$rc (JSON and logs in $OUT)"
exit $rc
