#!/usr/bin/env bash
# Every GPU test of the tree (CTest label `gpu`) on the device machine, one call: the GPU parity
# table of the CUDA kernels (gpu_parity_test, tests/gpu_parity), the CUDA model runtime, the
# prefill and decode nodes' CUDA backends; a table of passed / failed per binary, then the parity
# table. Builds nothing there: `bundle` (here) copies the stripped test binaries and the
# non-system shared libraries they need into .device/gputests/ (xz), as
# scripts/device/cuda-model.sh does.
#   here:   BUILD_DIR=build bash scripts/device/gpu-tests.sh bundle
#           (GPU_TESTS=gpu_parity_test ... bundle: that binary alone, for `parity`)
#   device: bash scripts/device/gpu-tests.sh run        (carry [.device/gputests])
#           bash scripts/device/gpu-tests.sh parity     (gpu_parity_test alone: its table)
#           GPU_TESTS="decode_gpu_test" MEMCHECK="decode_gpu_test" bash ... run   (a subset)
#           PARITY_FILTER='Select/*' bash ... parity   (some rows of the table)
# Logs go to $OUT (the parity table also to $OUT/parity_table.txt).
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # bundle_bins, bundle_libs, pack_bundle, unpack_bundle*, use_stage_libs
readonly kBundle=.device/gputests
readonly kStage=/tmp/kvr-gputests
readonly kAll="gpu_parity_test model_cuda_model_test retrieval_cuda_decode_test
  retrieval_cuda_decode_load_test retrieval_cuda_prefill_summaries_test model_cuda_export_test
  model_cuda_graph_test prefill_gpu_test decode_gpu_test"
# GPU_TESTS: bundle / run only these (default: all); MEMCHECK_FILTER: a gtest filter for the
# memcheck runs; MEMCHECK: binaries to run again under
# compute-sanitizer memcheck.
kTests="${GPU_TESTS:-$kAll}"
mode="${1:-}"
if [[ $mode == parity ]]; then
  kTests=gpu_parity_test
  mode=run
fi
out="${OUT:-out}"
mkdir -p "$out"

case "$mode" in
  bundle)
    build="${BUILD_DIR:-build}"
    files=()
    for t in $kTests; do
      f=$(find "$build" -maxdepth 3 -type f -name "$t" | head -1)
      [[ -n "$f" ]] || { echo "missing $t in $build" >&2; exit 1; }
      files+=("$f")
    done
    bundle_bins "$kBundle" "${files[@]}" || exit 1
    du -sh "$kBundle"
    ;;
  run)
    unpack_bundle "$kBundle" "$kStage" || exit 1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    status=0
    printf '%-36s %6s %6s %6s %8s\n' binary passed failed skipped seconds
    for t in $kTests; do
      start=$(date +%s%N)
      filter=-*Gguf*
      limit="${TEST_TIMEOUT_S:-240}"
      # The parity table holds every kernel's rows (the former per-kernel binaries together).
      [[ $t == gpu_parity_test ]] && filter="${PARITY_FILTER:-*}" limit="${PARITY_TIMEOUT_S:-420}"
      timeout "$limit" "$kStage/bin/$t" --gtest_filter="$filter" > "$out/$t.log" 2>&1
      rc=$?
      secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
      passed=$(grep -c '^\[       OK \]' "$out/$t.log")
      failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$out/$t.log")
      skipped=$(grep -c '^\[  SKIPPED \] [A-Za-z]' "$out/$t.log")
      printf '%-36s %6d %6d %6d %8s%s\n' "$t" "$passed" "$failed" "$skipped" "$secs" \
        "$([[ $rc -ne 0 ]] && echo "  rc $rc")"
      [[ $rc -eq 0 ]] || { status=1; grep -E 'Failure|FAILED' "$out/$t.log" | head -5; }
    done
    if [[ -f $out/gpu_parity_test.log ]]; then
      sed -n '/^=== GPU parity table/,/^=== end of GPU parity table/p' "$out/gpu_parity_test.log" |
        tee "$out/parity_table.txt"
      [[ -s $out/parity_table.txt ]] || echo "gpu_parity_test printed no table (crashed or timed out?)"
    fi
    for t in ${MEMCHECK:-}; do
      timeout "${MEMCHECK_S:-300}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$kStage/bin/$t" --gtest_filter="${MEMCHECK_FILTER:--*Gguf*}" \
        > "$out/memcheck_$t.log" 2>&1
      rc=$?
      echo "memcheck $t: rc $rc  $(grep 'ERROR SUMMARY' "$out/memcheck_$t.log" | tail -1)"
      [[ $rc -eq 0 ]] || status=1
    done
    echo "gpu-tests: status $status"
    exit $status
    ;;
  *)
    echo "usage: $0 bundle|run|parity" >&2
    exit 2
    ;;
esac
