#!/usr/bin/env bash
# The one command a device call runs (2 GPUs): environment, the GPU tests, then the 2-GPU
# benchmark, whose short table is printed last. Logs and the JSON result go to $OUT.
#
#   run(kind="nvidia-h200-x2", command="bash scripts/gpu_check.sh")
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-check

{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -5
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  "$PY" -c 'import refit.comm.nccl as n; l = n.library(); print("refit nccl binding:", l.path, l.version)'
} 2>&1 | tee "$OUT/env.log"

timeout -s INT -k 10 240 "$PY" -m pytest -q -m gpu tests/gpu/test_gpu.py -p no:cacheprovider -s 2>&1 | tee "$OUT/pytest.log"
rc_tests=$?

timeout -s INT -k 10 300 "$PY" -m refit.cli.bench_gpu --gpu-out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
rc_bench=$?

echo "gpu_check: tests rc=$rc_tests, bench rc=$rc_bench (logs and bench.json in $OUT)"
exit $(( rc_tests != 0 || rc_bench != 0 ))
