#!/usr/bin/env bash
# The device call for `refit demo --device cuda` (2 GPUs; no Ray or NIXL installed there): unpack
# the carried packages, run the GPU tests, then the demo on GPUs, over NCCL (one GPU per rank)
# and over NIXL (ranks share the GPUs, with a kill mid-refit). Prints a short table last.
# The packages are not committed; build them once (Ray ~45 MB and NIXL ~31 MB as wheels exceed
# the 64 MiB a call carries, so both go in one xz tarball of their unpacked files, ~46 MB):
#   bash ../shared/tools/device-ray-wheels.sh .whl-ray     # Ray and its small dependencies
#   (NIXL: the trimmed nixl-cu13 cp312 wheel in .whl/, see docs/nixl.md)
#   bash scripts/pack_site.sh                              # -> .site/site.tar.xz
#
#   run(kind="nvidia-h200-x2", carry=[".site"], command="bash scripts/gpu_demo.sh")
set -o pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh refit-gpu-demo
"$PY" -c 'import ray, torch, transformers; from refit.transport.nixl import nixl_available; print("ray", ray.__version__, "torch", torch.__version__, "transformers", transformers.__version__, "nixl", nixl_available(), "gpus", torch.cuda.device_count())' 2>&1 | tee "$OUT/env.log"

timeout -s INT -k 10 300 "$PY" -m pytest -q -m gpu tests/gpu/test_gpu.py -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest.log"
rc_tests=$?

# the default demo needs 9 GPUs over NCCL: it must say so, not fail inside NCCL
timeout 120 "$PY" -m refit.cli demo --device cuda 2>&1 | tail -1 | tee "$OUT/demo_default.log"
rc=0
run() {  # name, then the demo's flags
  local name=$1; shift
  timeout -s INT -k 10 240 "$PY" -m refit.cli demo --device cuda --json "$@" > "$OUT/demo_$name.json" 2> "$OUT/demo_$name.err"
  local r=$?; rc=$(( rc || r )); echo "demo $name rc=$r"; [ $r = 0 ] || tail -8 "$OUT/demo_$name.err"
}
run nccl-llama --trainer-dp 1 --trainer-tp 1 --engine-tp 1 --engines 1 --kill-step 0
run nixl-llama --nixl --trainer-tp 1
run nixl-qwen3-moe-ep --nixl --trainer-tp 1 --model qwen3-moe --engine-ep
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"{'run':18} {'step':>4} {'refit s':>8} {'bytes':>9} {'verified':>8} {'max|dlogit|':>11} {'shards':10} event")
for f in sorted(out.glob("demo_*.json")):
    try:
        r = json.loads(f.read_text()[f.read_text().index("{"):])
    except Exception as e:
        print(f.stem, "no result:", type(e).__name__); continue
    for s in r["steps"]:
        ev = "recovered in %.2fs" % s["recovery_s"] if s["recovery_s"] is not None else ("re-admitted" if any("re-admitted" in e for e in s["events"]) else "-")
        print(f"{f.stem[5:]:18} {s['step']:>4} {s['refit_s']:>8.3f} {s['bytes']:>9} {str(s['verified']):>8} "
              f"{s['max_abs_logit_diff']:>11.2e} {str(s['shards']):10} {ev}")
    print(f"{f.stem[5:]:18} ok={r['all_verified_and_logits_match']} readmitted={r['killed_shard_readmitted']} "
          f"trainer={r['trainer']} engines={r['engines']} total={r['total_s']:.1f}s")
PY
echo "gpu_demo: tests rc=$rc_tests, demo rc=$rc"
