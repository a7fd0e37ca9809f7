#!/usr/bin/env bash
# The prefill node on the GPU on the device machine: the KV export test and the
# engine's CUDA-vs-CPU backend test, compute-sanitizer memcheck on both, then gpu_prefill_bench
# (llama3-8b random weights: (a) forward, (b) + per-layer export, (c) the engine with a fake
# store per method, at 8K and 32K). Builds nothing there: `bundle` (here) copies the stripped
# binaries and the non-system shared libraries they need into .device/gpuprefill/ (xz).
#   here:   BUILD_DIR=build-gpuprefill scripts/device/gpu-prefill.sh bundle
#   device: bash scripts/device/gpu-prefill.sh run        (carry [.device/gpuprefill])
#           BENCH_ARGS='--store discard' bash scripts/device/gpu-prefill.sh bench   (bench only)
# Env: BENCH_ARGS (default: --prompt 8192,32768 --reps 2), MEMCHECK_S (per memcheck, 150).
# Logs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # bundle_bins, bundle_libs, pack_bundle, unpack_bundle*, use_stage_libs
readonly kBundle=.device/gpuprefill
readonly kStage=/tmp/kvr-gpuprefill
readonly kBins="model_cuda_export_test prefill_gpu_test gpu_prefill_bench"
out="${OUT:-out}"
mkdir -p "$out"

case "${1:-}" in
  bundle)
    build="${BUILD_DIR:-build-gpuprefill}"
    bundle_bins "$kBundle" "$build/model/model_cuda_export_test" \
      "$build/prefill-node/prefill_gpu_test" "$build/prefill-node/gpu_prefill_bench" || exit 1
    du -sh "$kBundle"
    ;;
  run)
    unpack_bundle "$kBundle" "$kStage" || exit 1
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    nproc
    status=0
    for t in model_cuda_export_test prefill_gpu_test; do
      "$kStage/bin/$t" 2>&1 | tee "$out/$t.log" |
        grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED|parity|near tie) |Failure|rror' || true
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    done
    if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
      timeout "${MEMCHECK_S:-150}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$kStage/bin/model_cuda_export_test" \
        --gtest_filter=*Bf16*:*Smollm2*:*Misuse* > "$out/memcheck_export.log" 2>&1
      echo "memcheck model_cuda_export_test: rc $?  $(grep 'ERROR SUMMARY' "$out/memcheck_export.log" | tail -1)"
      timeout "${MEMCHECK_S:-150}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$kStage/bin/prefill_gpu_test" > "$out/memcheck_engine.log" 2>&1
      echo "memcheck prefill_gpu_test: rc $?  $(grep 'ERROR SUMMARY' "$out/memcheck_engine.log" | tail -1)"
    else
      echo "compute-sanitizer not found"
    fi
    # shellcheck disable=SC2086
    "$kStage/bin/gpu_prefill_bench" ${BENCH_ARGS:---prompt 8192,32768 --reps 2} 2>&1 |
      tee "$out/bench.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    echo "gpu-prefill run: status $status"
    exit $status
    ;;
  bench)  # the bench alone, with BENCH_ARGS (e.g. --store discard --methods full,quest)
    unpack_bundle_once "$kBundle" "$kStage" bin/gpu_prefill_bench || exit 1
    # shellcheck disable=SC2086
    "$kStage/bin/gpu_prefill_bench" ${BENCH_ARGS:---prompt 8192,32768 --reps 2} 2>&1 |
      tee -a "$out/bench.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *)
    echo "usage: $0 bundle|run|bench" >&2
    exit 2
    ;;
esac
