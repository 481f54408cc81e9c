#!/usr/bin/env bash
# One call on the GPU machine: install, the test suite natively, the kernel benchmarks.
# Full logs and the tuned-config JSON go to $OUT; the summary table is printed last.
#   bash bench/gpu_check.sh [bench/kernels.py arguments, e.g. --quick]
set -uo pipefail
OUT=${OUT:-/tmp/tritonllm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pip install -q -e . --no-deps --no-build-isolation > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt"
python -m pytest tests -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
tests_rc=$?
python bench/kernels.py "$@" --report "$OUT/report.md" > "$OUT/bench.log" 2>&1
bench_rc=$?
cp kernels/configs/*.json "$OUT/" 2>/dev/null
echo "== tests (rc $tests_rc)"; grep -E "passed|failed|error" "$OUT/tests.log" | tail -15
echo "== bench (rc $bench_rc)"; tail -5 "$OUT/bench.log" | grep -v "^|" ; cat "$OUT/report.md" 2>/dev/null
cat "$OUT/gpu.txt"
