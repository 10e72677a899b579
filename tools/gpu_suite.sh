#!/usr/bin/env bash
# Build in place and run the GPU test suite and a short benchmark; logs go to $OUT (default ./gpu_out).
# Usage: bash tools/gpu_suite.sh STEP...   (default: all = build tests bench)
#   build                     pip install -e . with the PTXAS report ($OUT/ptxas.log). With BUILD_CACHE=DIR
#                             the built extension is kept in DIR with a hash of the sources it was built
#                             from (setup.py and mmdeform_tma/csrc), and a later build of the same sources
#                             copies it back instead: a device machine that stays warm between calls builds
#                             once. (Not the commit: the device's copy of .git can be stale, and a stale key
#                             once served an earlier build.) `python -m mmdeform_tma.info` follows a real build
#                             only: a cached copy is the same extension, and info costs about 20 s a call.
#   tests                     kernel tests per backend, then the rest of the suite
#   kernels_tma_ws kernels_cuda  one backend's kernel tests
#   unit                      the tests outside tests/backends, tests/integrations and test_fuzz.py: the
#                             operator, its dispatch and the tools, whose GPU cases skip on the CPU
#   fuzz integration          tests/test_fuzz.py; tests/integrations/test_mmdet_gpu.py, test_batched_targets.py,
#                             test_mask2former_gpu.py (about 550 s on a cold compile cache: the fast path's
#                             seven compiled cases are most of it, DINO's alone about 150 s). INTEGRATION_K
#                             selects by pytest -k, so that the step splits over calls or GPUs, e.g.
#                             "not fast_path" and "fast_path" (tools/end_to_end_evidence.sh splits it so)
#   host                      tools/benchmark_op.py --host-overhead over HOST_BACKENDS (default: auto tma_ws
#                             cuda mmcv; the pytorch rows take most of the time and no target reads them)
#   sanitize                  compute-sanitizer memcheck, racecheck and synccheck (tools/sanitize_cases.py)
#   dcnv4                     DCNv4's wheel, for `benchmark_op.py --compare dcnv4`: built from
#                             DCNV4_SDIST (default .deps/DCNv4-1.0.0.post2.tar.gz; about 6 min with 16 jobs)
#                             into DCNV4_WHEELS (default /tmp/dcnv4_wheels) unless a wheel is there already,
#                             then installed into /tmp/site (setup.sh's PYTHONPATH). A wheel brought back
#                             through $OUT and carried in an ignored folder saves the build next time
#   ab                        a kernel change against its base, in one call: builds AB_BASE (a source tree
#                             exported beside this one, e.g. `git archive REV | tar -x -C .ab_base`, kept
#                             out of git and carried with the call) in place, then runs tools/autotune.py
#                             AB_ARGS (e.g. "--presets detr_enc_bs2 --configs c4_t64_s2_m16") on the base and
#                             on this checkout, each with its own table: $OUT/autotune_ab_base.json and
#                             $OUT/autotune_ab_new.json. Run it after `build`; tools/kernel_code_diff.py names
#                             the kernels that differ between the two. (Session 24 ran these commands by hand;
#                             the step itself has run on the CPU tests only so far.)
#   ab_op                     the same base tree against this checkout on the operator benchmark: builds AB_BASE
#                             in place, then runs tools/benchmark_op.py AB_OP_ARGS (default: the deterministic
#                             encoder rows, `--presets detr_enc_bs2 detr_enc_bs8 --backends tma_ws --directions
#                             backward --deterministic`) on the base and on this checkout in turn, AB_ROUNDS times
#                             (default 2: rounds alternate, so clock drift reaches both), and tools/ab_compare.py
#                             writes each row's change and the deterministic-over-fast ratios to $OUT/ab_op.md.
#                             Run it after `build`. (Sessions 50-53 ran these commands from a scratch script.)
#   l1_banks                  item 134: tools/l1_gather_banks.py timed and under ncu (L1 wavefronts of a warp's
#                             row gathers in one bank half or both). Needs no build
#   bench graph               tools/benchmark_op.py (BENCH_ARGS); tools/cuda_graph_train_step.py
#   autotune                  tools/autotune.py over AUTOTUNE_BACKENDS (default tma_ws cuda), forward,
#                             backward and the deterministic backward; rewrites this GPU's table
#                             (AUTOTUNE_ARGS adds options, e.g. "--layouts --dtypes float16"), then lists
#                             the entries still measured on other kernel sources (--stale)
#   e2e                       tools/benchmark_e2e.py per model (E2E_MODELS, E2E_ARGS): stock against auto
#                             side by side (--paired E2E_PAIRED_ROUNDS, default 10), then stock against auto
#                             on the fast path; AMP fp16 (Mask2Former fp32). E2E_ROWS="paired fast" by default;
#                             name one of the two to run only it
#   parity                    loss parity, eager against --fast: 100 iterations of tools/train.py per
#                             model on the synthetic set (PARITY_MODELS), eager PARITY_EAGER_RUNS times
#                             (default 2: the second measures eager's run-to-run noise, the bound of
#                             tools/compare_loss_curves.py --repeats), then tools/test.py of the fast
#                             run's checkpoint, eager and --fast. PARITY_PARTS (default "eager fast compare
#                             test") names the parts to run, and PARITY_WORK (default $OUT/work) holds the
#                             runs, so that the parts split over device calls on a machine that stays warm
# Each step runs under `timeout`, so a hung kernel cannot take the whole run with it. With CPUS set (a
# taskset list such as 16-31) each step runs on those cores only: two suites on a machine of two GPUs,
# one per GPU (CUDA_VISIBLE_DEVICES) and per half of the cores, keep out of each other's host time.
# Every pytest run prints its slowest tests (--durations), which is what plans the next device call.
# DEADLINE (seconds since the epoch: `$(( $(date +%s) + 570 ))`) caps every step's limit at the time
# left before it, and skips a step with less than MIN_STEP_S (default 30) left, so that a device call
# ends, with its logs, before the call's own limit kills everything at once.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
steps=${*:-all}
status=0
if [ -n "${CPUS:-}" ] && ! command -v taskset >/dev/null; then
  echo "CPUS=$CPUS: this machine has no taskset; the steps run on every core"
  CPUS=
fi

run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2
  shift 2
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - $(date +%s)))
    if [ $left -lt ${MIN_STEP_S:-30} ]; then
      echo "=== $name: not run, $left s left before DEADLINE"
      status=1
      return
    fi
    [ $left -lt $limit ] && limit=$left
  fi
  echo "=== $name (limit $limit s)"
  local start=$SECONDS
  timeout "$limit" ${CPUS:+taskset -c "$CPUS"} "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc in $((SECONDS - start)) s  (log: $OUT/$name.log)"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

has() { [[ " $steps " == *" $1 "* || ( " $steps " == *" all "* && " build tests bench " == *" $1 "* ) ]]; }
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider --maxfail=20 --durations=15"

if has build; then
  sources=$(find setup.py mmdeform_tma/csrc -type f | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-16)
  if [ -n "${BUILD_CACHE:-}" ] && [ "$(cat "$BUILD_CACHE/SOURCES" 2>/dev/null)" = "$sources" ]; then
    echo "=== build: the cached extension of sources $sources ($BUILD_CACHE)"
    for so in "$BUILD_CACHE"/_C*.so; do  # by rename: a process that has the old file mapped keeps it whole
      name=$(basename "$so")
      cp "$so" "mmdeform_tma/.$name.copy" && mv -f "mmdeform_tma/.$name.copy" "mmdeform_tma/$name"
    done
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the warm machine's editable install may point here too
  else
    run build ${BUILD_TIMEOUT:-600} env MMDEFORM_TMA_PTXAS_VERBOSE=1 python3 -m pip install --no-deps --no-build-isolation -v -e .
    grep -E "ptxas info|spill" "$OUT/build.log" >"$OUT/ptxas.log" || true
    if [ -n "${BUILD_CACHE:-}" ] && ls mmdeform_tma/_C*.so >/dev/null 2>&1; then
      rm -rf "$BUILD_CACHE" && mkdir -p "$BUILD_CACHE" && cp mmdeform_tma/_C*.so "$BUILD_CACHE"/ && echo "$sources" >"$BUILD_CACHE/SOURCES"
    fi
    run info 120 python3 -m mmdeform_tma.info
  fi
fi
for backend in cuda tma_ws; do
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
  run integration ${TEST_TIMEOUT:-900} $PYTEST tests/integrations/test_mmdet_gpu.py tests/integrations/test_batched_targets.py \
    tests/integrations/test_mask2former_gpu.py ${INTEGRATION_K:+-k "$INTEGRATION_K"}
fi
if has unit; then
  run unit ${TEST_TIMEOUT:-900} $PYTEST tests --ignore=tests/backends --ignore=tests/integrations --ignore=tests/test_fuzz.py
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    run "sanitize_$tool" ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 1 python3 tools/sanitize_cases.py --backends ${SANITIZE_BACKENDS:-cuda tma_ws} ${SANITIZE_ARGS:-}
  done
fi
if has graph; then
  run graph ${GRAPH_TIMEOUT:-300} python3 tools/cuda_graph_train_step.py ${GRAPH_ARGS:-}
fi
if has autotune; then
  run autotune ${AUTOTUNE_TIMEOUT:-900} python3 tools/autotune.py --backends ${AUTOTUNE_BACKENDS:-tma_ws cuda} \
    --directions forward backward backward-deterministic --report "$OUT/autotune.json" ${AUTOTUNE_ARGS:-}
  # what the table still holds from other kernel sources, with the commands that re-tune it
  run autotune_stale 60 python3 tools/autotune.py --stale
fi
if has ab; then
  base=${AB_BASE:-.ab_base}
  if [ -f "$base/setup.py" ]; then
    base=$(cd "$base" && pwd)
    run ab_build_base ${BUILD_TIMEOUT:-600} bash -c "cd '$base' && python3 setup.py build_ext --inplace"
    for tree in base new; do  # each imports its own package first; the tables start empty
      dir=$([ $tree = base ] && echo "$base" || pwd)
      rm -f "$OUT/table_ab_$tree.json"
      label=$([ $tree = base ] && echo "ab base at $base" || echo "${MMDEFORM_TMA_COMMIT:-}")  # the base has no .git
      run "ab_autotune_$tree" ${AUTOTUNE_TIMEOUT:-900} env PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" MMDEFORM_TMA_COMMIT="$label" \
        python3 tools/autotune.py --table "$OUT/table_ab_$tree.json" --report "$OUT/autotune_ab_$tree.json" ${AB_ARGS:-}
    done
  else
    echo "=== ab: no source tree at $base (AB_BASE)"
    status=1
  fi
fi
if has ab_op; then
  base=${AB_BASE:-.ab_base}
  if [ -f "$base/setup.py" ]; then
    base=$(cd "$base" && pwd)
    run ab_op_build_base ${BUILD_TIMEOUT:-600} bash -c "cd '$base' && python3 setup.py build_ext --inplace"
    op_args=${AB_OP_ARGS:---presets detr_enc_bs2 detr_enc_bs8 --backends tma_ws --directions backward --deterministic}
    base_rounds=() new_rounds=()
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for tree in base new; do  # each imports its own package first
        dir=$([ $tree = base ] && echo "$base" || pwd)
        run "ab_op_${tree}_r$round" ${BENCH_TIMEOUT:-600} env PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" \
          python3 tools/benchmark_op.py $op_args --out "$OUT/ab_op_${tree}_r$round"
      done
      base_rounds+=("$OUT/ab_op_base_r$round.json")
      new_rounds+=("$OUT/ab_op_new_r$round.json")
    done
    run ab_op_compare 60 python3 tools/ab_compare.py "${base_rounds[@]}" --new "${new_rounds[@]}" --out "$OUT/ab_op.md"
  else
    echo "=== ab_op: no source tree at $base (AB_BASE)"
    status=1
  fi
fi
if has l1_banks; then
  # Item 134: L1 wavefronts of a warp's 64-byte row gathers, rows in one bank half or in both.
  run l1_banks 300 python3 tools/l1_gather_banks.py
  if command -v ncu >/dev/null; then
    run l1_banks_ncu 300 ncu --clock-control none --kernel-name gather_rows --metrics \
      gpu__time_duration.sum,l1tex__data_pipe_lsu_wavefronts.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__throughput.avg.pct_of_peak_sustained_active \
      python3 tools/l1_gather_banks.py --warmup 0 --iters 1
  else
    echo "=== l1_banks_ncu: no ncu on PATH"
    status=1
  fi
fi
if has host; then
  run host ${HOST_TIMEOUT:-300} python3 tools/benchmark_op.py --host-overhead --backends ${HOST_BACKENDS:-auto tma_ws cuda mmcv} \
    --out "$OUT/host_overhead"
fi
if has dcnv4; then
  wheels=${DCNV4_WHEELS:-/tmp/dcnv4_wheels}
  sdist=${DCNV4_SDIST:-.deps/DCNv4-1.0.0.post2.tar.gz}
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    if [ -f "$sdist" ]; then
      source_dir=/tmp/dcnv4_source
      rm -rf "$source_dir" && mkdir -p "$source_dir" && tar xzf "$sdist" -C "$source_dir"
      run dcnv4_build ${DCNV4_TIMEOUT:-540} python3 -m pip wheel --no-deps --no-build-isolation -w "$wheels" \
        "$source_dir"/*/
    else
      echo "=== dcnv4: no wheel in $wheels and no sdist at $sdist (copy ../shared/device to .deps)"
      status=1
    fi
  fi
  if compgen -G "$wheels/*.whl" >/dev/null; then
    run dcnv4_install 120 python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$wheels"/*.whl
  fi
fi
if has bench; then
  run bench ${BENCH_TIMEOUT:-900} python3 tools/benchmark_op.py --out "$OUT/op" ${BENCH_ARGS:-}
fi
if has e2e; then
  for model in ${E2E_MODELS:-deformable-detr dino-4scale configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_tma-ws.py}; do
    config=configs/synthetic/${model}_r50_synthetic_tma-ws.py
    [ -f "$config" ] || config=$model  # a config path
    name=$(basename "$config" .py)
    # Mask2Former in fp32: mmdet's head is non-finite in AMP fp16 (tests/integrations/test_mask2former_gpu.py)
    precision=$([[ $name == mask2former* ]] && echo fp32 || echo amp-fp16)
    # the default path side by side with stock (the host drifts more between runs than the paths differ)
    if [[ " ${E2E_ROWS:-paired fast} " == *" paired "* ]]; then
      run "e2e_paired_$name" ${E2E_TIMEOUT:-900} python3 tools/benchmark_e2e.py --config "$config" --backends stock auto \
        --fast-backends --precisions $precision --paired ${E2E_PAIRED_ROUNDS:-10} --iters 10 --warmup 3 \
        --out "$OUT/e2e_paired_$name"
    fi
    # the fast path against stock, with the profiled breakdown (a cold compile cache needs over 200 s)
    if [[ " ${E2E_ROWS:-paired fast} " == *" fast "* ]]; then
      run "e2e_$name" ${E2E_TIMEOUT:-900} python3 tools/benchmark_e2e.py --config "$config" --backends stock \
        --fast-backends auto --precisions $precision --out "$OUT/e2e_$name" ${E2E_ARGS:-}
    fi
  done
fi
if has parity; then
  [ -d data/synthetic_coco ] || ${CPUS:+taskset -c "$CPUS"} python3 tools/make_synthetic_coco.py --out data/synthetic_coco >/dev/null
  options="train_cfg.max_epochs=1 default_hooks.logger.interval=1 log_processor.window_size=1 default_hooks.checkpoint.interval=1 randomness.seed=0"
  parts=" ${PARITY_PARTS:-eager fast compare test} "
  work=${PARITY_WORK:-$OUT/work}
  for model in ${PARITY_MODELS:-deformable-detr dino-4scale}; do
    config=configs/synthetic/${model}_r50_synthetic_tma-ws.py
    [ -f "$config" ] || config=$model  # a config path
    model=$(basename "$config" .py)
    # eager again, same seed: the run-to-run noise that the fast run's offset is judged against
    repeats=()
    for i in $(seq 2 $(( ${PARITY_EAGER_RUNS:-2} ))); do
      repeats+=("$work/$model-eager-$i")
    done
    if [[ $parts == *" eager "* ]]; then
      for eager in "$work/$model-eager" ${repeats[@]+"${repeats[@]}"}; do
        run "train_$(basename "$eager")" ${PARITY_TIMEOUT:-600} python3 tools/train.py "$config" --amp fp16 \
          --work-dir "$eager" --cfg-options $options
      done
    fi
    if [[ $parts == *" fast "* ]]; then
      run "train_${model}-fast" ${PARITY_TIMEOUT:-600} python3 tools/train.py "$config" --amp fp16 --fast \
        --work-dir "$work/$model-fast" --cfg-options $options
    fi
    if [[ $parts == *" compare "* ]]; then
      run "parity_$model" 120 python3 tools/compare_loss_curves.py "$work/$model-eager" "$work/$model-fast" \
        ${repeats[@]:+--repeats "${repeats[@]}"} --out "$OUT/loss_parity_$model"
    fi
    if [[ $parts == *" test "* ]]; then
      for mode in eager fast; do
        flag=$([ $mode = fast ] && echo --fast)
        run "test_${model}_$mode" ${PARITY_TIMEOUT:-600} python3 tools/test.py "$config" "$work/$model-fast/epoch_1.pth" \
          $flag --work-dir "$work/test-$model-$mode"
      done
    fi
  done
fi
exit $status
