#!/usr/bin/env bash
# One device call comparing this tree with another checkout of refit (BEFORE, e.g. the main branch's)
# on the same GPU: `refit bench --path sync --device cuda` on the 8B model (trainer TP2 -> 2 engine
# shards of TP1, a process per rank, all on the one GPU) for each run of RUNS, before then after,
# with the fused kernels; the tree's FP8 kernel check and NIXL GPU test first (CHECKS=0 skips them).
# JSON and logs go to $OUT/before and $OUT/after; the table is printed last.
#
#   BEFORE=.. RUNS="nixl nixl-fp8 ipc" bash scripts/gpu_before_after.sh
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-before-after
BEFORE=$(cd "${BEFORE:?a checkout to compare with}" && pwd)
RUNS=${RUNS:-"nixl nixl-fp8 ipc"}
rc=0
if [ "${CHECKS:-1}" = 1 ]; then
  timeout 300 "$PY" tests/helpers/quantize_check.py cuda > "$OUT/quantize_check.log" 2>&1; r=$?; rc=$(( rc || r ))
  echo "quantize_check rc=$r: $(tail -1 "$OUT/quantize_check.log")"
  timeout -s INT -k 10 200 "$PY" -m pytest -q -m gpu tests/gpu/test_nixl_gpu.py -p no:cacheprovider \
    > "$OUT/pytest_nixl_gpu.log" 2>&1; r=$?; rc=$(( rc || r ))
  echo "pytest tests/gpu/test_nixl_gpu.py rc=$r: $(tail -1 "$OUT/pytest_nixl_gpu.log")"
fi
flags() { case $1 in nixl) echo "--transport nixl" ;; nixl-fp8) echo "--transport nixl --dst-dtype fp8" ;;
  ipc) echo "--transport ipc" ;; nixl-staged) echo "--transport nixl --staged" ;; esac; }
mkdir -p "$OUT/before" "$OUT/after"
for run in $RUNS; do
  for side in before after; do
    tree=$([ $side = before ] && echo "$BEFORE" || echo "$PWD")
    # shellcheck disable=SC2046
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH#*:}" timeout -s INT -k 10 "${BENCH_TIMEOUT:-150}" "$PY" -m refit.cli \
      bench --path sync --device cuda --fleet process --iters 10 --warmup 2 --json $(flags "$run") \
      > "$OUT/$side/sync_$run.json" 2> "$OUT/$side/sync_$run.err"); r=$?; rc=$(( rc || r ))
    echo "bench $side $run rc=$r"; [ $r = 0 ] || tail -5 "$OUT/$side/sync_$run.err"
  done
done
"$PY" - "$OUT" $RUNS <<'PY'
import json, pathlib, sys
out, runs = pathlib.Path(sys.argv[1]), sys.argv[2:]
def load(side, run):
    try:
        text = (out / side / f"sync_{run}.json").read_text()
        return json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
print(f"{'run':10} {'side':6} {'GB/step':>7} {'sync ms':>8} {'raw ms':>7} {'flat ms':>7} {'sync/raw':>8} {'buckets':>7} "
      f"{'quant GB/s':>10} correct")
rows = {}
for run in runs:
    for side in ("before", "after"):
        r = rows[(side, run)] = load(side, run)
        if "error" in r:
            print(f"{run:10} {side:6} no result: {r['error'][:80]}")
            continue
        f = r.get("flat_copy") or {"median_s": float("nan")}
        q = r.get("quantize") or {}
        print(f"{run:10} {side:6} {r['bytes_per_step'] / 1e9:7.2f} {r['sync']['median_s'] * 1e3:8.1f} "
              f"{r['raw']['median_s'] * 1e3:7.1f} {f['median_s'] * 1e3:7.1f} {r['sync_over_raw']:8.2f} "
              f"{r.get('buckets_per_step', 0):7} {q.get('kernel_GBps', 0):10.0f} {r['correct']}")
for side in ("before", "after"):
    a, b = rows.get((side, "nixl"), {}), rows.get((side, "nixl-fp8"), {})
    if "sync" in a and "sync" in b:
        print(f"{side}: FP8 sync speed / bf16 sync speed (NIXL) = {a['sync']['median_s'] / b['sync']['median_s']:.2f}x, "
              f"raw {a['raw']['median_s'] / b['raw']['median_s']:.2f}x")
PY
echo "gpu_before_after: rc=$rc (JSON and logs in $OUT)"
exit $rc
