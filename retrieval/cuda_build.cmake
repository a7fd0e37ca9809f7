# kvr::retrieval_cuda_build (sources in cuda/summaries/): GPU summary building at prefill: ClusterKV
# k-means + layout, Quest page bounds, KeyDiff scores, A2ATS quantise, CTKVR qcIVF build. Contract and launchers:
# cuda/include/kvr/retrieval/cuda/build.cuh. The builders behind the model's per-layer build hook
# (cuda/include/kvr/retrieval/cuda/prefill_summaries.h) are its host part: without nvcc the
# target still exists with a stub whose factory answers Unimplemented, so the prefill node links
# it unconditionally. Its parity rows are in tests/gpu_parity; the prefill test here carries the
# CTest label `gpu` (CI compiles it, never runs it).
if(KVR_HAVE_CUDA AND TARGET kvr_retrieval_quant AND TARGET kvr_retrieval_cuda_select)
  # kvr::retrieval_cuda_select for the shared KeyView / KeyDType of selection.cuh and the
  # selector's layout (the build writes it).
  kvr_add_library(retrieval_cuda_build CUDA
    SOURCES cuda/summaries/clusterkv.cu cuda/summaries/quest.cu cuda/summaries/keydiff.cu
            cuda/summaries/a2ats.cu cuda/summaries/ctkvr.cu cuda/summaries/plan.cc
            cuda/summaries/prefill_summaries.cc
    INCLUDES cuda/include
    PRIVATE_INCLUDES cuda/summaries
    PUBLIC kvr::retrieval_cuda_select kvr::retrieval_quant kvr::common_cuda kvr::retrieval_core
           kvr::model_cuda kvr::model absl::status absl::statusor absl::strings)
  set_target_properties(kvr_retrieval_cuda_build PROPERTIES CUDA_STANDARD 20
                                                            CUDA_STANDARD_REQUIRED ON)

  # Parity of the builders (and of the pre-split assignment kernel of argmax_gemm.cuh) with
  # their references: rows of tests/gpu_parity (gpu_parity_test).

  kvr_add_executable(build_cuda_bench
    SOURCES cuda/summaries/bench/build_cuda_bench.cc
    LIBS kvr::retrieval_cuda_build kvr::retrieval_cuda_bench_util kvr::common)

  # ClusterKV's assignment kernel alone: in-loop vs pre-split 3xTF32 (and fp32) in one process.
  add_executable(assign_bench cuda/summaries/bench/assign_bench.cu)
  target_link_libraries(assign_bench PRIVATE kvr::retrieval_cuda_build
                                             kvr::retrieval_cuda_bench_util)
  set_target_properties(assign_bench PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  kvr_warnings(assign_bench)

  # The builders during a real prefill == the same builds afterwards (RebuildForTesting), on the
  # side stream and on the main stream.
  kvr_add_test(retrieval_cuda_prefill_summaries_test
    SOURCES cuda/summaries/tests/prefill_summaries_test.cc
    LIBS kvr::retrieval_cuda_build kvr::model_cuda kvr::model kvr::gpu_testing kvr::common
         absl::strings
    INCLUDES ${PROJECT_SOURCE_DIR}/model/tests
    LABELS gpu)
  # Prefill with summary building: overhead per method against no build, side vs main stream.
  kvr_add_executable(prefill_summaries_bench
    SOURCES cuda/summaries/bench/prefill_summaries_bench.cc
    LIBS kvr::retrieval_cuda_build kvr::model_cuda kvr::model kvr::common CLI11::CLI11
         absl::str_format absl::strings)
else()
  kvr_add_library(retrieval_cuda_build
    SOURCES cuda/summaries/prefill_summaries_stub.cc
    INCLUDES cuda/include
    PUBLIC kvr::model_cuda kvr::model kvr::retrieval_core absl::status absl::statusor)
endif()
