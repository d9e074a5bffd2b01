#!/usr/bin/env bash
# The fused kernels on one GPU: bit for bit against the unfused checksums and quantize_reference,
# then their speed on the 8B model's bytes (scripts/kernel_bench.py). Prints a short table last.
#
#   run(kind="nvidia-h200", command="bash scripts/gpu_kernels.sh")
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-kernels
rc=0
for check in copy_sum_check quantize_check; do
  timeout 300 "$PY" "tests/helpers/$check.py" cuda > "$OUT/$check.log" 2>&1; r=$?; rc=$(( rc || r ))
  echo "$check rc=$r: $(tail -1 "$OUT/$check.log")"
done
timeout 300 "$PY" scripts/kernel_bench.py 2>&1 | tee "$OUT/kernel_bench.log"; rc=$(( rc || $? ))
exit $rc
