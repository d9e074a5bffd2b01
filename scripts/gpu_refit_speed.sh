#!/usr/bin/env bash
# The one device call of verified and FP8 refits at copy speed on one GPU: the fused kernels checked
# bit for bit, the IPC executor's GPU tests, the kernels timed alone (scripts/kernel_bench.py),
# then `refit bench --path sync --device cuda` on the 8B model (trainer TP2 -> 2 engine shards of
# TP1, a process per rank, all on the one GPU)
# over IPC, NIXL, NIXL staged and NIXL into FP8 engines, each with the fused kernels (after) and
# with REFIT_FUSED=0 (before: eager copies, checksums and quantizer). NIXL and msgpack wheels are
# carried in .whl/. Prints the table last; JSON and logs go to $OUT.
#
#   run(kind="nvidia-h200", command="bash scripts/gpu_refit_speed.sh", carry=[".whl"])
#
# FUSED="1 0" (the default) runs both; FUSED=1 or FUSED=0 one half, when a call's time is short.
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-speed
rc=0
[ "${FUSED:-1 0}" = 0 ] || for check in copy_sum_check quantize_check; do
  timeout 300 "$PY" "tests/helpers/$check.py" cuda > "$OUT/$check.log" 2>&1; r=$?; rc=$(( rc || r ))
  echo "$check rc=$r: $(tail -1 "$OUT/$check.log")"
done
# the IPC executor's GPU tests (fused and eager checksums equal, exact refits, a dead engine named) and
# NIXL's (unverified and verified refits exact). The 53-refit memory-hygiene case of the IPC tests
# (case1, about 100 s per allocator on one H100) does not fit this call beside the benches:
# scripts/gpu_ipc.sh runs the whole file. A timeout reads rc=124 (or 130), never as a pass.
[ "${FUSED:-1 0}" = 0 ] || { timeout -s INT -k 10 240 "$PY" -m pytest -q -m gpu tests/gpu/test_ipc_gpu.py tests/gpu/test_nixl_gpu.py -k "not case1" -p no:cacheprovider \
  > "$OUT/pytest_ipc_gpu.log" 2>&1; r=$?; rc=$(( rc || r )); echo "pytest -m gpu tests/gpu/test_ipc_gpu.py tests/gpu/test_nixl_gpu.py -k 'not case1' rc=$r: $(tail -1 "$OUT/pytest_ipc_gpu.log")"; }
[ "${FUSED:-1 0}" = 0 ] || { timeout 300 "$PY" scripts/kernel_bench.py > "$OUT/kernel_bench.log" 2>&1; rc=$(( rc || $? )); }
bench() {  # name, REFIT_FUSED, then the bench's flags
  local name=$1 fused=$2; shift 2
  REFIT_FUSED=$fused timeout -s INT -k 10 ${BENCH_TIMEOUT:-240} "$PY" -m refit.cli bench --path sync --device cuda \
    --fleet process --iters 10 --warmup 2 --json "$@" > "$OUT/sync_$name.json" 2> "$OUT/sync_$name.err"
  local r=$?; rc=$(( rc || r )); echo "bench $name rc=$r"; [ $r = 0 ] || tail -5 "$OUT/sync_$name.err"
}
for fused in ${FUSED:-1 0}; do
  tag=$([ $fused = 1 ] && echo fused || echo eager)
  bench "ipc-$tag" $fused --transport ipc
  bench "nixl-$tag" $fused --transport nixl
  bench "nixl-fp8-$tag" $fused --transport nixl --dst-dtype fp8
  bench "nixl-staged-$tag" $fused --transport nixl --staged
done
[ -f "$OUT/kernel_bench.log" ] && cat "$OUT/kernel_bench.log"
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        text = (out / f"sync_{name}.json").read_text()
        return json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
print(f"{'run':17} {'GB/step':>7} {'sync ms':>8} {'raw ms':>7} {'+cksum':>7} {'flat ms':>7} {'sync/raw':>8} "
      f"{'sync/flat':>9} {'switch':>7} {'buckets':>7} verified correct")
rows = {}
for tag in ("eager", "fused"):
    for run in ("ipc", "nixl", "nixl-fp8", "nixl-staged"):
        name = f"{run}-{tag}"
        r = rows[name] = load(name)
        if "error" in r:
            print(f"{name:17} no result: {r['error'][:80]}")
            continue
        f = r.get("flat_copy") or {"median_s": float("nan")}
        sw = r.get("switch_median_s")
        print(f"{name:17} {r['bytes_per_step'] / 1e9:7.2f} {r['sync']['median_s'] * 1e3:8.1f} "
              f"{r['raw']['median_s'] * 1e3:7.1f} {r['raw_checksummed']['median_s'] * 1e3:7.1f} "
              f"{f['median_s'] * 1e3:7.1f} {r['sync_over_raw']:8.2f} {r['sync_over_flat'] or 0:9.2f} "
              f"{'' if sw is None else f'{sw * 1e3:.1f}':>7} {r.get('buckets_per_step', 0):7} "
              f"{str(r['verified']):8} {r['correct']}")
        q = r.get("quantize")
        if q:
            print(f"{'':17} quantize kernels alone {q['kernel_s'] * 1e3:.1f} ms, {q['kernel_GBps']:.0f} GB/s of bf16")
for tag in ("eager", "fused"):
    a, b = rows.get(f"nixl-{tag}", {}), rows.get(f"nixl-fp8-{tag}", {})
    if "sync" in a and "sync" in b:
        print(f"{tag}: FP8 sync speed / bf16 sync speed (NIXL) = {a['sync']['median_s'] / b['sync']['median_s']:.2f}x")
PY
echo "gpu_refit_speed: rc=$rc (JSON and logs in $OUT)"
exit $rc
