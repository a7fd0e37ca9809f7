#!/usr/bin/env bash
# Every GPU test of the tree (CTest label `gpu`) on the device machine, one call: the parity
# tests of the CUDA kernels, the CUDA model runtime, the prefill and decode nodes' CUDA
# backends; a table of passed / failed per binary. Builds nothing there: `bundle` (here) copies
# the stripped test binaries and the non-system shared libraries they need into
# .device/gputests/ (xz), as scripts/device/cuda-model.sh does.
#   here:   BUILD_DIR=build bash scripts/device/gpu-tests.sh bundle
#   device: bash scripts/device/gpu-tests.sh run        (carry [.device/gputests])
#           GPU_TESTS="decode_gpu_test" MEMCHECK="decode_gpu_test" bash ... run   (a subset)
# Logs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # bundle_bins, bundle_libs, pack_bundle
readonly kBundle=.device/gputests
readonly kStage=/tmp/kvr-gputests
readonly kAll="model_cuda_ops_test model_cuda_model_test retrieval_cuda_decode_test
  retrieval_cuda_decode_load_test retrieval_cuda_prefill_summaries_test model_cuda_export_test
  model_cuda_graph_test prefill_gpu_test decode_gpu_test retrieval_cuda_select_test
  retrieval_cuda_attend_test retrieval_cuda_build_test"
# GPU_TESTS: run only these (bundle always takes all); MEMCHECK_FILTER: a gtest filter for the
# memcheck runs; MEMCHECK: binaries to run again under
# compute-sanitizer memcheck.
readonly kTests="${GPU_TESTS:-$kAll}"
out="${OUT:-out}"
mkdir -p "$out"

case "${1:-}" in
  bundle)
    build="${BUILD_DIR:-build}"
    files=()
    for t in $kAll; do
      f=$(find "$build" -maxdepth 2 -type f -name "$t" | head -1)
      [[ -n "$f" ]] || { echo "missing $t in $build" >&2; exit 1; }
      files+=("$f")
    done
    bundle_bins "$kBundle" "${files[@]}" || exit 1
    du -sh "$kBundle"
    ;;
  run)
    rm -rf "$kStage" && mkdir -p "$kStage" && tar -C "$kStage" -xJf "$kBundle/bundle.tar.xz" || exit 1
    export LD_LIBRARY_PATH="$kStage/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    status=0
    printf '%-36s %6s %6s %6s %8s\n' binary passed failed skipped seconds
    for t in $kTests; do
      start=$(date +%s%N)
      timeout "${TEST_TIMEOUT_S:-240}" "$kStage/bin/$t" --gtest_filter=-*Gguf* > "$out/$t.log" 2>&1
      rc=$?
      secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
      passed=$(grep -c '^\[       OK \]' "$out/$t.log")
      failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$out/$t.log")
      skipped=$(grep -c '^\[  SKIPPED \] [A-Za-z]' "$out/$t.log")
      printf '%-36s %6d %6d %6d %8s%s\n' "$t" "$passed" "$failed" "$skipped" "$secs" \
        "$([[ $rc -ne 0 ]] && echo "  rc $rc")"
      [[ $rc -eq 0 ]] || { status=1; grep -E 'Failure|FAILED' "$out/$t.log" | head -5; }
    done
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
    echo "usage: $0 bundle|run" >&2
    exit 2
    ;;
esac
