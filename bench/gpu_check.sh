#!/usr/bin/env bash
# One call on the GPU machine: install, then the steps asked for, each logged in full to $OUT,
# with a short summary printed last.
#   bash bench/gpu_check.sh [tests] [stress] [generate] [kernels [--quick]] [throughput] [tp]
# STEP_TIMEOUT (seconds) bounds each step; TESTS picks the test paths (default: tests);
# PYTEST_ADDOPTS, KERNEL_ARGS and THROUGHPUT_ARGS pass options through (shell words: KERNEL_ARGS='--match "fp8 cache"').
set -uo pipefail
step_timeout=${STEP_TIMEOUT:-1800}
OUT=${OUT:-/tmp/tritonllm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt"
eval "kernel_args=(${KERNEL_ARGS:-})"
summary=""
quick=""
[[ " $* " == *" --quick "* ]] && quick="--quick"
for step in "$@"; do
  case $step in
    tests)
      timeout "$step_timeout" python -m pytest ${TESTS:-tests} -q -p no:cacheprovider > "$OUT/tests.log" 2>&1; rc=$?
      summary+=$'\n== tests (rc '$rc$')\n'"$(grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25)" ;;
    stress)  # the stress test at its GPU size, printing its counts
      PYTEST_ADDOPTS= timeout "$step_timeout" python -m pytest tests/engine/test_stress.py -q -s -p no:cacheprovider > "$OUT/stress.log" 2>&1; rc=$?
      summary+=$'\n== stress (rc '$rc$')\n'"$(grep -E "^stress:|passed|failed" "$OUT/stress.log")" ;;
    generate)  # the README's first command, after its install
      timeout "$step_timeout" tritonllm generate > "$OUT/generate.log" 2>&1; rc=$?
      summary+=$'\n== tritonllm generate (rc '$rc$')\n'"$(tail -8 "$OUT/generate.log")" ;;
    kernels)
      timeout "$step_timeout" python bench/kernels.py $quick "${kernel_args[@]}" --report "$OUT/kernels.md" > "$OUT/kernels.log" 2>&1; rc=$?
      cp kernels/configs/*.json "$OUT/" 2>/dev/null
      summary+=$'\n== kernels (rc '$rc$')\n'"$(cat "$OUT/kernels.md" 2>/dev/null || tail -20 "$OUT/kernels.log")" ;;
    throughput)
      timeout "$step_timeout" python bench/throughput.py --no-tqdm ${THROUGHPUT_ARGS:-} >> "$OUT/throughput.log" 2>&1; rc=$?
      summary+=$'\n== throughput '"${THROUGHPUT_ARGS:-}"' (rc '$rc$')\n'"$(tail -7 "$OUT/throughput.log")" ;;
    tp)  # two GPUs: the tensor-parallel and shutdown tests over NCCL, then 8B at TP 1 and TP 2
      timeout "$step_timeout" python -m pytest tests/engine/test_llm.py tests/models/test_qwen3.py -q -p no:cacheprovider \
        -k "tensor_parallel or worker or close or exit" > "$OUT/tp_tests.log" 2>&1; rc=$?
      summary+=$'\n== tensor-parallel tests (rc '$rc$')\n'"$(grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tp_tests.log" | tail -8)"
      for tp in 1 2; do
        timeout "$step_timeout" python bench/throughput.py --no-tqdm --model qwen3-8b --tp $tp > "$OUT/throughput_8b_tp$tp.log" 2>&1; rc=$?
        summary+=$'\n== qwen3-8b TP '$tp' (rc '$rc$')\n'"$(tail -1 "$OUT/throughput_8b_tp$tp.log")"
      done ;;
  esac
done
echo "$summary"
cat "$OUT/gpu.txt"
