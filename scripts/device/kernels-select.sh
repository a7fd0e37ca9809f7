#!/usr/bin/env bash
# GPU selection kernels: build here, check and time on the device.
#
#   bash scripts/device/kernels-select.sh bundle   # here: build gpu_parity_test and
#                                                  # select_cuda_bench, copy them + non-system
#                                                  # shared libraries to .device/kernels-select/
#   bash scripts/device/kernels-select.sh run [quick|quant]  # there (device tool, carry
#                                                  # .device/kernels-select): the selectors'
#                                                  # rows of the parity table,
#                                                  # compute-sanitizer memcheck + racecheck on a
#                                                  # subset, the bench, torch topk anchor
#     quick: the bench at 128K, batch 1 and 4, budget 1024 only
#     quant: pariskv / ctkvr / a2ats only: their parity tests, memcheck on
#            them, the bench for those methods and torch SDPA dense decode (no torch `exact`)
#
# `run` builds nothing. Logs and CSVs go to $OUT (the device tool's output folder) or ./out.
set -euo pipefail
. "$(dirname "$0")/lib.sh"  # build_targets, stage_targets, compute_sanitizer, dispatch_bundle_run
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEV=.device/kernels-select
BUILD=${KVR_BUILD_DIR:-build-kselect2}

bundle() {
  local targets=(gpu_parity_test select_cuda_bench)
  build_targets "$BUILD" "${targets[@]}"
  stage_targets "$BUILD" "$DEV" "${targets[@]}"
  cp retrieval/bench/select_cuda_bench_torch.py "$DEV/" 2>/dev/null || true
  du -sh "$DEV"
}

run() {
  local mode=${1:-}
  local out=${OUT:-$ROOT/out/kernels-select}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$ROOT/$DEV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  local san
  san=$(compute_sanitizer)
  local status=0
  # The selectors' rows of gpu_parity_test (tests/gpu_parity) and their contract tests.
  local filter='Select/*:QuantSelect/*:SelectContract.*:QuantSelectContract.*'
  local subset='Select/*BatchedTopK*:Select/*Quest*:Select/*ClusterKv*:Select/*bf16_d128_h32x8_gqa0*'
  subset+=':Select/*f32_d64_h9x3_gqa1*'
  local t_parity=120 t_mem=150 t_bench=200
  if [[ $mode == quant ]]; then  # sized for a 4-minute device allowance
    filter='QuantSelect/*:QuantSelectContract.*'
    subset=$filter
    t_parity=60 t_mem=60 t_bench=75
  fi
  echo "== parity"
  timeout $t_parity "$DEV/gpu_parity_test" --gtest_filter="$filter" >"$out/parity.log" 2>&1 ||
    status=1
  grep -E "^\[ parity \]|^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$out/parity.log" | head -80
  sed -n '/^=== GPU parity table/,/^=== end of GPU parity table/p' "$out/parity.log"
  echo "== compute-sanitizer memcheck: $subset"
  timeout $t_mem "$san" --tool memcheck --error-exitcode 3 "$DEV/gpu_parity_test" \
    --gtest_filter="$subset" >"$out/memcheck.log" 2>&1 || status=1
  tail -2 "$out/memcheck.log"
  if [[ $mode != quant ]]; then
    timeout 120 "$san" --tool racecheck --error-exitcode 3 "$DEV/gpu_parity_test" \
      --gtest_filter='Select/*BatchedTopK*' >"$out/racecheck.log" 2>&1 || status=1
    tail -2 "$out/racecheck.log"
  fi
  echo "== bench"
  local args=()
  [[ $mode == quick ]] && args=(--contexts 131072 --batches 1,4 --budgets 1024 --iters 20)
  [[ $mode == quant ]] && args=(--methods pariskv,ctkvr,a2ats --iters 20)
  timeout $t_bench "$DEV/select_cuda_bench" "${args[@]}" | tee "$out/bench.txt" || status=1
  if [[ -f $DEV/select_cuda_bench_torch.py ]]; then
    echo "== torch anchor (same run)"
    local targs=("${args[@]}")
    # quant: SDPA dense only (no torch `exact`), one budget: the anchor for the ratios.
    [[ $mode == quant ]] && targs=(--methods sdpa --budgets 1024 --iters 20)
    timeout $t_bench python3 "$DEV/select_cuda_bench_torch.py" "${targs[@]}" | tee "$out/torch.txt" ||
      status=1
  fi
  echo "status $status"
  return $status
}

dispatch_bundle_run "bundle|run [quick|quant]" "$@"
