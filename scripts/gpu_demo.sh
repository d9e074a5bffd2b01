#!/usr/bin/env bash
# The device call for `refit demo --device cuda` (2 GPUs, no Ray installed there): install the
# carried Ray wheels, run the GPU tests of the synchronizer over NCCL, then the demo on GPUs.
# Build the wheels first (they are not committed): bash ../shared/tools/device-ray-wheels.sh .whl-ray
#
#   run(kind="nvidia-h200-x2", carry=[".whl-ray"], command="bash scripts/gpu_demo.sh")
set -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/refit-gpu-demo}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import ray' 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-ray/*.whl 2>&1 | tail -2
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
"$PY" -c 'import ray, torch, transformers; print("ray", ray.__version__, "torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())' 2>&1 | tee "$OUT/env.log"

timeout -s INT -k 10 300 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest.log"
rc_tests=$?

# the default demo needs 9 GPUs: it must say so, not fail inside NCCL
timeout 120 "$PY" -m refit.cli demo --device cuda 2>&1 | tail -3 | tee "$OUT/demo_default.log"
rc=0
for model in llama qwen3-moe; do
  timeout -s INT -k 10 240 "$PY" -m refit.cli demo --device cuda --model "$model" --trainer-dp 1 --trainer-tp 1 --engines 1 \
    --engine-tp 1 --kill-step 0 --steps 4 --json > "$OUT/demo_$model.json" 2> "$OUT/demo_$model.err"
  r=$?; rc=$(( rc || r ))
  echo "demo $model rc=$r"; tail -5 "$OUT/demo_$model.err"
done
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'model':10} {'step':>4} {'refit s':>8} {'bytes':>10} {'GB/s':>7} {'verified':>8} {'max|dlogit|':>11} tokens")
for model in ("llama", "qwen3-moe"):
    try:
        r = json.loads((out / f"demo_{model}.json").read_text())
    except Exception as e:
        print(model, "no result:", e); continue
    for s in r["steps"]:
        print(f"{model:10} {s['step']:>4} {s['refit_s']:>8.3f} {s['bytes']:>10} {s['gbps']:>7.3f} "
              f"{str(s['verified']):>8} {s['max_abs_logit_diff']:>11.2e} {s['tokens_match']}")
    print(model, "ok:", r["all_verified_and_logits_match"], "tolerance", r["logit_tolerance"], "total", round(r["total_s"], 1), "s")
PY
echo "gpu_demo: tests rc=$rc_tests, demo rc=$rc"
