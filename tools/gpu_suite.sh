#!/usr/bin/env bash
# Build in place and run the GPU test suite and a short benchmark; logs go to $OUT (default ./gpu_out).
# Usage: bash tools/gpu_suite.sh [build|tests|bench|all]...   (default: all)
# Each step runs under `timeout`, so a hung kernel cannot take the whole run with it.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
steps=${*:-all}
status=0

run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2
  shift 2
  echo "=== $name"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc in $((SECONDS - start)) s  (log: $OUT/$name.log)"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

has() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }

if has build; then
  run build ${BUILD_TIMEOUT:-600} env MMDEFORM_TMA_PTXAS_VERBOSE=1 python3 -m pip install --no-deps --no-build-isolation -v -e .
  grep -E "ptxas info|spill" "$OUT/build.log" >"$OUT/ptxas.log" || true
  run info 120 python3 -m mmdeform_tma.info
fi
if has tests; then
  for backend in cuda tma tma_ws; do
    run "tests_$backend" ${TEST_TIMEOUT:-900} env MMDEFORM_TMA_TEST_BACKENDS=$backend python3 -m pytest -q -rs -p no:cacheprovider tests/backends --maxfail=20
  done
  run tests_cpu_suite_on_gpu ${TEST_TIMEOUT:-900} python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/backends --maxfail=20
fi
if has bench; then
  run bench ${BENCH_TIMEOUT:-900} python3 tools/benchmark_op.py --out "$OUT/op" ${BENCH_ARGS:-}
fi
exit $status
