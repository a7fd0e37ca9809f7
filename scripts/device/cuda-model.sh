#!/usr/bin/env bash
# The CUDA model runtime on the device machine: kernel parity, model parity (dummy shapes and
# the SmolLM2 GGUF), compute-sanitizer, the benchmark and the torch SDPA anchor. Builds nothing
# there: `bundle` (here) copies the stripped binaries and the non-system shared libraries they
# need into .device/cudamodel/ (cuBLAS and the CUDA runtime are the device's own, CUDA 13.0 as
# here).
#
# The 98 MB GGUF is over the 64 MiB a call may carry, so it travels in two halves over two
# back-to-back calls (the warm machine keeps /tmp between them):
#   here:              scripts/device/cuda-model.sh bundle
#   call 1, carry [.device/cudamodel, .device/cudamodel-g1]:
#                      bash scripts/device/cuda-model.sh run     (tests, sanitizer, bench; stages
#                                                                 binaries + half 1 in /tmp)
#   call 2, carry [.device/cudamodel-g2]:
#                      bash scripts/device/cuda-model.sh gguf    (joins the halves, GGUF parity)
# Prefill with summary building, one call, carry [.device/cudamodel]:
#                      bash scripts/device/cuda-model.sh summaries   (summary test, bench table,
#                                                                     memcheck on the test)
# CUDA graphs of the dense greedy decode step, one call, carry [.device/cudamodel]:
#                      bash scripts/device/cuda-model.sh graphs   (graph test + memcheck, model
#                                                                  test, decode bench with and
#                                                                  without graphs)
# Logs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/lib.sh"  # bundle_bins, bundle_libs, pack_bundle, unpack_bundle*, use_stage_libs
readonly kBundle=.device/cudamodel
readonly kStage=/tmp/kvr-cudamodel
readonly kModelSha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
out="${OUT:-out}"
mkdir -p "$out"

case "${1:-}" in
  bundle)
    build="${BUILD_DIR:-build-cudamodel}"
    # OpenBLAS and ICU's data alone are 67 MB: the bundle travels xz-compressed (~15 MB).
    bundle_bins "$kBundle" "$build"/tests/gpu_parity/gpu_parity_test \
      "$build"/model/model_cuda_model_test \
      "$build"/model/{model_cuda_graph_test,cuda_model_bench} \
      "$build"/retrieval/{retrieval_cuda_prefill_summaries_test,prefill_summaries_bench} \
      model/bench/cuda_model_bench_sdpa.py || exit 1
    model="${KVR_TEST_MODEL:-$HOME/.cache/kvr/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
    # Uneven halves: the first travels with the bundle, both calls stay under 64 MiB.
    rm -rf .device/cudamodel-g1 .device/cudamodel-g2
    mkdir -p .device/cudamodel-g1 .device/cudamodel-g2
    head -c 44000000 "$model" > .device/cudamodel-g1/part00
    tail -c +44000001 "$model" > .device/cudamodel-g2/part01
    du -sh "$kBundle" .device/cudamodel-g1 .device/cudamodel-g2
    ;;
  run)
    unpack_bundle "$kBundle" "$kStage" || exit 1
    [[ -f .device/cudamodel-g1/part00 ]] && cp .device/cudamodel-g1/part00 "$kStage/"
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    status=0
    # The model's kernel rows of the GPU parity table.
    "$kStage/bin/gpu_parity_test" --gtest_filter='ModelOps/*' 2>&1 | tee "$out/ops_test.log" |
      grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) ' || true
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    "$kStage/bin/model_cuda_model_test" --gtest_filter=-*Gguf* 2>&1 | tee "$out/model_test.log" |
      grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED|parity) ' || true
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
      timeout 240 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
        "$kStage/bin/gpu_parity_test" \
        --gtest_filter='ModelOps/*Attention*:ModelOps/*Rope*:ModelOps/*RmsNorm*' \
        > "$out/sanitizer.log" 2>&1
      echo "compute-sanitizer memcheck (ops test): rc $?  $(grep -c 'Invalid\|ERROR SUMMARY' "$out/sanitizer.log") lines; $(grep 'ERROR SUMMARY' "$out/sanitizer.log")"
    else
      echo "compute-sanitizer not found"
    fi
    "$kStage/bin/cuda_model_bench" --shape llama3-8b --prefill 2048,8192 --batch 1,8,32 \
      --context 4096 2>&1 | tee "$out/bench.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    python3 "$kStage/bin/cuda_model_bench_sdpa.py" --prefill 2048,8192 --batch 1,8,32 \
      --context 4096 2>&1 | tee "$out/sdpa.log"
    echo "run: status $status"
    exit $status
    ;;
  summaries)
    unpack_bundle "$kBundle" "$kStage" || exit 1
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    status=0
    "$kStage/bin/retrieval_cuda_prefill_summaries_test" 2>&1 | tee "$out/summaries_test.log" |
      grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED|summary) |Failure|error' || true
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    "$kStage/bin/prefill_summaries_bench" --shape llama3-8b --prefill 8192,32768 \
      --summaries "${SUMMARIES:-none,quest,keydiff,clusterkv,clusterkv-it3}" --serial --reps 3 \
      2>&1 | tee "$out/bench_summaries.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
      timeout "${MEMCHECK_S:-100}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$kStage/bin/retrieval_cuda_prefill_summaries_test" \
        --gtest_filter=*Smollm2*:*Rejects* > "$out/sanitizer_summaries.log" 2>&1
      echo "compute-sanitizer memcheck (summaries test, smollm2 shape): rc $?  $(grep 'ERROR SUMMARY' "$out/sanitizer_summaries.log" | tail -1)"
    fi
    echo "summaries: status $status"
    exit $status
    ;;
  graphs)  # CUDA graphs of the dense greedy decode step: parity test, memcheck, model test, bench
    unpack_bundle "$kBundle" "$kStage" || exit 1
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    status=0
    for t in model_cuda_graph_test model_cuda_model_test; do
      "$kStage/bin/$t" --gtest_filter=-*Gguf* 2>&1 | tee "$out/$t.log" |
        grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED|graphs) |Failure' || true
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    done
    if [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
      timeout "${MEMCHECK_S:-120}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
        --error-exitcode 3 "$kStage/bin/model_cuda_graph_test" > "$out/sanitizer_graphs.log" 2>&1
      echo "compute-sanitizer memcheck (graph test): rc $?  $(grep 'ERROR SUMMARY' "$out/sanitizer_graphs.log" | tail -1)"
    fi
    for shape in ${GRAPH_SHAPES:-smollm2-135m llama3-8b}; do
      "$kStage/bin/cuda_model_bench" --shape "$shape" --prefill 512 --batch 1,8,32 \
        --context "${GRAPH_CONTEXT:-4096}" 2>&1 | tee -a "$out/bench_graphs.log"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    done
    echo "graphs: status $status"
    exit $status
    ;;
  gguf)
    cat "$kStage/part00" .device/cudamodel-g2/part01 > "$kStage/smollm2.gguf" || exit 1
    echo "$kModelSha256  $kStage/smollm2.gguf" | sha256sum -c - || exit 1
    use_stage_libs "$kStage"
    KVR_TEST_MODEL="$kStage/smollm2.gguf" "$kStage/bin/model_cuda_model_test" \
      --gtest_filter=*Gguf* 2>&1 | tee "$out/gguf_test.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *)
    echo "usage: $0 bundle|run|gguf|summaries|graphs" >&2
    exit 2
    ;;
esac
