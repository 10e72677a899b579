#!/usr/bin/env bash
# Build in place and run the GPU test suite and a short benchmark; logs go to $OUT (default ./gpu_out).
# Usage: bash tools/gpu_suite.sh STEP...   (default: all = build tests bench)
#   build                     pip install -e . with the PTXAS report ($OUT/ptxas.log)
#   tests                     kernel tests per backend, then the rest of the suite
#   kernels_tma kernels_tma_ws kernels_cuda   one backend's kernel tests
#   fuzz integration          tests/test_fuzz.py; tests/integrations/test_mmdet_gpu.py, test_mask2former_gpu.py
#   sanitize                  compute-sanitizer memcheck, racecheck and synccheck (tools/sanitize_cases.py)
#   bench graph               tools/benchmark_op.py (BENCH_ARGS); tools/cuda_graph_train_step.py
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

has() { [[ " $steps " == *" $1 "* || ( " $steps " == *" all "* && " build tests bench " == *" $1 "* ) ]]; }
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider --maxfail=20"

if has build; then
  run build ${BUILD_TIMEOUT:-600} env MMDEFORM_TMA_PTXAS_VERBOSE=1 python3 -m pip install --no-deps --no-build-isolation -v -e .
  grep -E "ptxas info|spill" "$OUT/build.log" >"$OUT/ptxas.log" || true
  run info 120 python3 -m mmdeform_tma.info
fi
for backend in cuda tma tma_ws; do
  if has tests || has "kernels_$backend"; then
    run "tests_$backend" ${TEST_TIMEOUT:-900} env MMDEFORM_TMA_TEST_BACKENDS=$backend $PYTEST tests/backends
  fi
done
if has tests; then
  run tests_cpu_suite_on_gpu ${TEST_TIMEOUT:-900} $PYTEST tests --ignore=tests/backends
fi
if has fuzz; then
  run fuzz ${TEST_TIMEOUT:-900} $PYTEST tests/test_fuzz.py
fi
if has integration; then
  run integration ${TEST_TIMEOUT:-900} $PYTEST tests/integrations/test_mmdet_gpu.py tests/integrations/test_mask2former_gpu.py
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    run "sanitize_$tool" ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 1 python3 tools/sanitize_cases.py --backends ${SANITIZE_BACKENDS:-cuda tma tma_ws}
  done
fi
if has graph; then
  run graph ${GRAPH_TIMEOUT:-300} python3 tools/cuda_graph_train_step.py ${GRAPH_ARGS:-}
fi
if has bench; then
  run bench ${BENCH_TIMEOUT:-900} python3 tools/benchmark_op.py --out "$OUT/op" ${BENCH_ARGS:-}
fi
exit $status
