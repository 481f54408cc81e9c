#!/usr/bin/env bash
# One call on the GPU machine: install, then the steps asked for, each logged in full to $OUT,
# with a short summary printed last.
#   bash bench/gpu_check.sh [tests] [kernels [--quick]] [throughput]
# STEP_TIMEOUT (seconds) bounds each step; PYTEST_ADDOPTS and KERNEL_ARGS pass options through.
set -uo pipefail
step_timeout=${STEP_TIMEOUT:-1800}
OUT=${OUT:-/tmp/tritonllm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt"
summary=""
quick=""
[[ " $* " == *" --quick "* ]] && quick="--quick"
for step in "$@"; do
  case $step in
    tests)
      timeout "$step_timeout" python -m pytest tests -q -p no:cacheprovider > "$OUT/tests.log" 2>&1; rc=$?
      summary+=$'\n== tests (rc '$rc$')\n'"$(grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25)" ;;
    kernels)
      timeout "$step_timeout" python bench/kernels.py $quick ${KERNEL_ARGS:-} --report "$OUT/kernels.md" > "$OUT/kernels.log" 2>&1; rc=$?
      cp kernels/configs/*.json "$OUT/" 2>/dev/null
      summary+=$'\n== kernels (rc '$rc$')\n'"$(cat "$OUT/kernels.md" 2>/dev/null || tail -20 "$OUT/kernels.log")" ;;
    throughput)
      timeout "$step_timeout" python bench/throughput.py --no-tqdm > "$OUT/throughput.log" 2>&1; rc=$?
      summary+=$'\n== throughput (rc '$rc$')\n'"$(tail -6 "$OUT/throughput.log")" ;;
  esac
done
echo "$summary"
cat "$OUT/gpu.txt"
