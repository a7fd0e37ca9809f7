#!/usr/bin/env bash
# The decode node on the GPU on the device machine: the loaded-sparse-sequence
# parity test (retrieval_cuda_decode_load_test), the engine's CUDA-vs-CPU backend test
# (decode_gpu_test), compute-sanitizer memcheck on both, then gpu_decode_bench (llama3-8b random
# weights on the GPU, synthetic bf16 rows in a fake store: engine tok/s against raw CudaModel
# steps over the same sequences). Builds nothing there: `bundle` (here) copies the stripped
# binaries and the non-system shared libraries they need into .device/gpudecodenode/ (xz).
#   here:   BUILD_DIR=build-gpudecode bash scripts/device/gpu-decode-node.sh bundle
#   device: bash scripts/device/gpu-decode-node.sh run     (carry [".device/gpudecodenode"])
#           bash scripts/device/gpu-decode-node.sh bench   (the bench alone)
# Env: BENCH_ARGS (default: --contexts 8192,32768 --batches 1,4,8), MEMCHECK_S (per memcheck,
# 150). Logs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # bundle_bins, bundle_libs, pack_bundle, unpack_bundle*, use_stage_libs
readonly kBundle=.device/gpudecodenode
readonly kStage=/tmp/kvr-gpudecodenode
out="${OUT:-out}"
mkdir -p "$out"

stage() {
  unpack_bundle_once "$kBundle" "$kStage" bin/gpu_decode_bench || exit 1
}

bench() {
  # shellcheck disable=SC2086
  "$kStage/bin/gpu_decode_bench" ${BENCH_ARGS:---contexts 8192,32768 --batches 1,4,8} 2>&1 |
    tee -a "$out/bench.log"
  return "${PIPESTATUS[0]}"
}

case "${1:-}" in
  bundle)
    build="${BUILD_DIR:-build-gpudecode}"
    bundle_bins "$kBundle" "$build/retrieval/retrieval_cuda_decode_load_test" \
      "$build/decode-node/decode_gpu_test" "$build/decode-node/gpu_decode_bench" || exit 1
    du -sh "$kBundle"
    ;;
  run)
    rm -rf "$kStage"
    stage
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    echo "cpus $(nproc)  $(free -g | awk '/Mem:/{print "mem " $2 " GiB"}')"
    status=0
    for t in retrieval_cuda_decode_load_test decode_gpu_test; do
      "$kStage/bin/$t" 2>&1 | tee "$out/$t.log" |
        grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED|load|engine) |Failure|rror' || true
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    done
    if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
      for t in decode_gpu_test retrieval_cuda_decode_load_test; do
        filter='*'
        [[ $t == retrieval_cuda_decode_load_test ]] && filter='*Smollm2*'
        timeout "${MEMCHECK_S:-150}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
          --error-exitcode 3 "$kStage/bin/$t" --gtest_filter="$filter" > "$out/memcheck_$t.log" 2>&1
        echo "memcheck $t ($filter): rc $?  $(grep 'ERROR SUMMARY' "$out/memcheck_$t.log" | tail -1)"
      done
    else
      echo "compute-sanitizer not found"
    fi
    bench || status=1
    echo "gpu-decode-node run: status $status"
    exit $status
    ;;
  bench)
    stage
    bench
    exit $?
    ;;
  *)
    echo "usage: $0 bundle|run|bench" >&2
    exit 2
    ;;
esac
