# kvr::retrieval_cuda_select: GPU decode-time scoring and selection.
# Contract and launchers: cuda/include/kvr/retrieval/cuda/selection.cuh. Only with nvcc
# (CONVENTIONS.md 7); its parity rows are in tests/gpu_parity (CTest label `gpu`).
if(KVR_HAVE_CUDA)
  kvr_add_library(retrieval_cuda_select CUDA
    SOURCES cuda/select/topk.cu cuda/select/exact.cu cuda/select/quest.cu cuda/select/clusterkv.cu
            cuda/select/clusterkv_layout.cc cuda/select/rerank.cu cuda/select/pariskv.cu
            cuda/select/ctkvr.cu cuda/select/a2ats.cu cuda/select/quant_layout.cc
    INCLUDES cuda/include
    PRIVATE_INCLUDES cuda/select
    PUBLIC kvr::common_cuda kvr::retrieval_core kvr::retrieval_quant absl::status absl::strings)
  set_target_properties(kvr_retrieval_cuda_select PROPERTIES CUDA_STANDARD 20
                                                             CUDA_STANDARD_REQUIRED ON)

  # Parity with the CPU references: rows of tests/gpu_parity (gpu_parity_test).

  # What the GPU microbenchmarks share (bench/cuda_bench_util.h): select_cuda_bench here,
  # build_cuda_bench and assign_bench (cuda_build.cmake).
  kvr_add_library(retrieval_cuda_bench_util INTERFACE
    INCLUDES bench
    PUBLIC kvr::common_cuda absl::status)

  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/bench/select_cuda_bench.cc)
    kvr_add_executable(select_cuda_bench
      SOURCES bench/select_cuda_bench.cc
      LIBS kvr::retrieval_cuda_select kvr::retrieval_cuda_bench_util kvr::common)
  endif()
endif()
