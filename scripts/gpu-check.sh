#!/usr/bin/env bash
# Every GPU check in one run, for a GPU machine lent for a few minutes (docs/device_check.md):
#   1. the GPU tests (kernels, HBM tier, pinned host memory, GDS, the engine side in HBM);
#   2. bench/device_check.py's bandwidth matrix (ratios to limits measured in the same run);
#   3. bench/ttft_pageback.py with the model in HBM: TTFT of page back vs recompute, 4k/16k tokens;
#   4. bench/forward_hooks.py: what the vLLM worker's save and load hooks add to a forward pass.
# Needs the project's dependencies (and CuPy, kvikio) importable by python3; PYTHON overrides it.
# Logs go to OUT (default: gpu-check-out in the repository). Each step has a time limit, so the
# whole run stays under 8 minutes (about 2 on an H200). Exit status: 0 when every step passed,
# else 1 (the GPU tests failed), 3 (a matrix row could not be measured), 4 (the TTFT step failed) or
# 5 (the forward-hooks step failed).
#   scripts/gpu-check.sh
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
py=${PYTHON:-python3}
out=${OUT:-$repo/gpu-check-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - start )) s)"; }
step "GPU tests"
timeout 180 "$py" -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/kernels tests/tiers tests/kvstore/test_mover.py \
  tests/engine_adapter/test_gpu_engine.py > "$out/gpu_tests.log" 2>&1
tests=$?
status=$(( tests == 0 ? 0 : 1 ))
echo "exit $tests"; grep -E "passed|failed|skipped|^FAILED|^ERROR" "$out/gpu_tests.log" | tail -20
step "device check"
timeout 120 "$py" bench/device_check.py --skip-tests > "$out/device_check.log" 2>&1
check=$?
[ $check -ne 0 ] && [ $status -eq 0 ] && status=3
echo "exit $check"; tail -20 "$out/device_check.log"
step "page back vs recompute, model in HBM"
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "skipped: torch sees no CUDA device"
  step "done"
  exit $status
fi
timeout 150 "$py" bench/ttft_pageback.py --device cuda --layers 16 --hidden 2048 --heads 16 --kv-heads 8 \
  --head-dim 128 --prefixes 4096,16384 --repeats 3 > "$out/ttft.log" 2>&1
ttft=$?
[ $ttft -ne 0 ] && [ $status -eq 0 ] && status=4
echo "exit $ttft"; tail -5 "$out/ttft.log"
step "the vLLM worker's hooks in a forward pass"
timeout 100 "$py" bench/forward_hooks.py --repeats 10 > "$out/forward_hooks.log" 2>&1
hooks=$?
[ $hooks -ne 0 ] && [ $status -eq 0 ] && status=5
echo "exit $hooks"; tail -5 "$out/forward_hooks.log"
step "done"
exit $status
