#!/usr/bin/env bash
# The end-to-end evidence set (issue 12: host cost, the fast and the default path against stock, the
# GPU tests of the training paths, loss parity) on a machine of two GPUs, in three device calls of
# under 600 s each. Lane E (GPU 0, the first half of the cores) runs everything that is timed; lane T
# (GPU 1, the other half) the tests and parity, which time nothing. On one GPU the set needs about
# 1,900 s, more than a session's device time (docs/perf_notes.md, "Session 22").
#
# Usage, from the repository root, after `source .deps/setup.sh`:
#   RESULTS=$OUT bash tools/end_to_end_evidence.sh 1      # then 2, then 3, each call at once
#   1: build and host cost (alone on the machine); T: the integration tests but Mask2Former's and three
#      fast-path cases (DINO's, and Deformable DETR's two of scope 'layers'), then Deformable DETR's two
#      eager runs of loss parity; E: Deformable DETR bs 2, the fast row, then the default path side by
#      side with stock
#   2: T: those three fast-path cases, Mask2Former's tests, the other GPU tests (gpu_suite.sh unit);
#      E: DINO's fast row, then DINO's and Mask2Former's default path side by side with stock
#   3: T: Deformable DETR's fast run of loss parity, the comparison and tools/test.py; E: Deformable
#      DETR bs 8, the fast row, then the kernel tests (timing nothing, after the row)
# Durations measured on an H100 x2 (docs/perf_notes.md, "Session 23"): the fast parity run alone is
# about 350 s, which is why the eager runs go to call 1. The parity runs live in PARITY_WORK
# (/tmp/evidence_parity), which a machine kept warm between the calls keeps.
# Every step's limit is capped by DEADLINE (default: CALL_SECONDS=570 from the start), so the call
# ends with its logs; a step that cannot start in time says so. Logs go to EVIDENCE_DIR (default
# /tmp/evidence_N; not OUT, which the device tool sets to the folder that comes back), one folder per
# lane; with RESULTS set, the logs and tables (not the checkpoints) are packed into
# RESULTS/evidence_N.tgz. Each call ends with tools/e2e_targets.py's table of the rows so far
# (EVIDENCE_DIR/targets.md).
set -u
call=${1:?which call: 1, 2 or 3}
case $call in 1 | 2 | 3) ;; *) echo "unknown call $call: 1, 2 or 3" >&2; exit 2 ;; esac
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$gpus" -lt 2 ]; then  # lane T would find no GPU 1, and its tests would all skip
  echo "end_to_end_evidence.sh needs two GPUs; nvidia-smi lists $gpus (on one, run gpu_suite.sh's steps)" >&2
  exit 2
fi
export DEADLINE=${DEADLINE:-$(($(date +%s) + ${CALL_SECONDS:-570}))}
export E2E_PAIRED_ROUNDS=${E2E_PAIRED_ROUNDS:-5} BUILD_CACHE=${BUILD_CACHE-/tmp/evidence_build}
evidence=${EVIDENCE_DIR:-/tmp/evidence_$call}
mkdir -p "$evidence"
export PARITY_WORK=${PARITY_WORK:-$(dirname "$evidence")/evidence_parity}
cores=$(nproc)
half=$((cores / 2))
SUITE="bash tools/gpu_suite.sh"
LANE_E="env CUDA_VISIBLE_DEVICES=0 CPUS=0-$((half - 1))"
LANE_T="env CUDA_VISIBLE_DEVICES=1 CPUS=$half-$((cores - 1))"
DETR=deformable-detr
MASK2FORMER=configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_tma-ws.py

# the extension first (a cached copy on a warm machine), host cost with the machine to itself
if [ "$call" = 1 ]; then
  OUT=$evidence $SUITE build host
else
  OUT=$evidence $SUITE build
fi

case $call in
  1)
    $LANE_T OUT="$evidence/t" INTEGRATION_K="not (fast_path and (dino or layers)) and not mask2former" PARITY_MODELS=$DETR \
      PARITY_PARTS=eager $SUITE integration parity >"$evidence/lane_t.txt" 2>&1 &
    $LANE_E OUT="$evidence/e" E2E_MODELS=$DETR E2E_ROWS=fast $SUITE e2e
    $LANE_E OUT="$evidence/e" E2E_MODELS=$DETR E2E_ROWS=paired $SUITE e2e
    ;;
  2)
    $LANE_T OUT="$evidence/t" INTEGRATION_K="(fast_path and (dino or layers)) or mask2former" $SUITE integration unit \
      >"$evidence/lane_t.txt" 2>&1 &
    $LANE_E OUT="$evidence/e" E2E_MODELS=dino-4scale E2E_ROWS=fast $SUITE e2e
    $LANE_E OUT="$evidence/e" E2E_MODELS="dino-4scale $MASK2FORMER" E2E_ROWS=paired $SUITE e2e
    ;;
  3)
    $LANE_T OUT="$evidence/t" PARITY_MODELS=$DETR PARITY_PARTS="fast compare test" $SUITE parity >"$evidence/lane_t.txt" 2>&1 &
    $LANE_E OUT="$evidence/e8" E2E_MODELS=$DETR E2E_ROWS=fast E2E_ARGS="--batch 8" $SUITE e2e
    $LANE_E OUT="$evidence/e8" $SUITE kernels_cuda kernels_tma_ws
    ;;
esac
wait
echo "=== lane T (GPU 1)"
cat "$evidence/lane_t.txt"
# this call's rows and those of the calls before it on this machine, against the issue's targets
earlier=()
for folder in "$(dirname "$evidence")"/evidence_[0-9]*; do
  [ -d "$folder" ] && [ "$folder" != "$evidence" ] && earlier+=("$folder")
done
echo "=== the targets (tools/e2e_targets.py)"
python3 tools/e2e_targets.py "$evidence" ${earlier[@]+"${earlier[@]}"} | tee "$evidence/targets.md"
if [ -n "${RESULTS:-}" ]; then
  # the logs and tables; the checkpoints (over 1 GB a parity run) would not come back from the device
  tar czf "$RESULTS/evidence_$call.tgz" --exclude='*.pth' -C "$(dirname "$evidence")" "$(basename "$evidence")"
fi
