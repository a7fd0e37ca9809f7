# kvr::retrieval_cuda_attend: the GPU decode data path (gather of selected rows from HBM or
# mapped host memory, hot cache, sparse split-KV decode attention) and its benchmark.
# Only when nvcc was found (CONVENTIONS.md 7); its parity rows are in tests/gpu_parity.
if(KVR_HAVE_CUDA)
  kvr_add_library(retrieval_cuda_attend CUDA
    SOURCES cuda/attend/src/gather.cu cuda/attend/src/hot_cache.cu
            cuda/attend/src/decode_attention.cu
    INCLUDES cuda/attend/include
    PUBLIC kvr::common_cuda absl::status absl::statusor absl::strings)

  # Parity with the CPU reference: rows of tests/gpu_parity (gpu_parity_test).

  add_executable(decode_attention_bench bench/decode_attention_bench.cu)
  # kvr::retrieval_cuda_bench_util (BENCH_CHECK) is defined in cuda_select.cmake.
  target_link_libraries(decode_attention_bench PRIVATE kvr::retrieval_cuda_attend
                                                       kvr::retrieval_cuda_bench_util)
  target_compile_options(decode_attention_bench PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
  kvr_warnings(decode_attention_bench)
  # Times kernels-select's ExactSelect as the select stage when that part is in the tree
  # (cuda_select.cmake is included after this file, so test for the file, not the target).
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/cuda_select.cmake)
    target_link_libraries(decode_attention_bench PRIVATE kvr_retrieval_cuda_select)
    target_compile_definitions(decode_attention_bench PRIVATE KVR_HAVE_CUDA_SELECT=1)
  endif()
endif()
