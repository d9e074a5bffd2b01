#!/usr/bin/env bash
# The one command a device call runs for FP8 refits on GPUs: the 8B model through sync_weights()
# into bf16 engines and into FP8 engines (linear weights in 128x128 block-scaled e4m3, quantized
# on the trainer ranks beside the wire), a process per rank: NCCL with a GPU each when there are
# two or more, else NIXL between ranks on the one GPU. Wheels that the machine lacks (msgpack,
# NIXL) are carried in .whl/. Prints a short table last; the JSON results and logs go to $OUT.
#
#   run(kind="nvidia-h200-x2", command="bash scripts/gpu_fp8.sh", carry=[".whl"])
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-fp8
rc=0
# two GPUs or more: NCCL between processes, one GPU each (the link-bound comparison);
# one GPU: NIXL between the processes sharing it
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
transport=(); [ "$gpus" -ge 2 ] || transport=(--transport nixl)
for dst in bfloat16 fp8; do
  timeout -s INT -k 10 280 "$PY" -m refit.cli bench --path sync --device cuda "${transport[@]}" --fleet process \
    --iters 5 --warmup 2 --dst-dtype $dst --json > "$OUT/sync_$dst.json" 2> "$OUT/sync_$dst.err"
  r=$?; rc=$(( rc || r )); echo "bench sync $dst rc=$r"; [ $r = 0 ] || tail -8 "$OUT/sync_$dst.err"
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for dst in ("bfloat16", "fp8"):
    try:
        text = (out / f"sync_{dst}.json").read_text()  # NIXL's workers log to stdout before it
        rows[dst] = json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
    except Exception as e:  # noqa: BLE001
        print(f"{dst}: no result: {type(e).__name__}")
for dst, r in rows.items():
    s, w = r["sync"], r["raw"]
    print(f"{dst:9} {r['layout']}: {r['bytes_per_step'] / 1e9:.2f} GB a step, sync {s['median_s'] * 1e3:.1f} ms "
          f"(p90 {s['p90_s'] * 1e3:.1f}), raw transport {w['median_s'] * 1e3:.1f} ms; verified {r['verified']}, "
          f"every element correct {r['correct']}")
q = rows.get("fp8", {}).get("quantize")
if q:
    print(f"quantize kernels alone: {q['kernel_s'] * 1e3:.1f} ms, {q['kernel_GBps']:.0f} GB/s of bf16 on the slowest "
          f"trainer rank, against its share of the wire at {q['wire_GBps']:.0f} GB/s of bf16")
if len(rows) == 2:
    a, b = rows["bfloat16"], rows["fp8"]
    print(f"fp8 / bf16: bytes {b['bytes_per_step'] / a['bytes_per_step']:.3f}, sync speed-up "
          f"{a['sync']['median_s'] / b['sync']['median_s']:.2f}x, raw speed-up "
          f"{a['raw']['median_s'] / b['raw']['median_s']:.2f}x")
PY
echo "gpu_fp8: rc=$rc (JSON and logs in $OUT)"
exit $rc
