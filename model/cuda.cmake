# kvr::model_cuda: the CUDA backend of the model runtime (cuda_model.h), its kernel and model
# parity tests (CTest label `gpu`) and its benchmark. Included from model/CMakeLists.txt.
# Without nvcc the target still exists and its factories answer Unimplemented (CONVENTIONS 7).
if(KVR_HAVE_CUDA)
  # CMake 3.25 (Debian 12) knows no nvcc flag for C++20, which the dependencies' cxx_std_20
  # feature also asks of CUDA sources: name it (as retrieval/cuda_attend.cmake does).
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  add_library(kvr_model_cuda cuda/cuda_model.cu cuda/ops.cu cuda/attention.cu)
  target_include_directories(kvr_model_cuda PUBLIC include PRIVATE cuda)
  target_link_libraries(kvr_model_cuda
    PUBLIC kvr::model absl::status absl::statusor
    PRIVATE kvr::common_cuda CUDA::cublas absl::strings)
  target_compile_options(kvr_model_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
else()
  add_library(kvr_model_cuda cuda/cuda_model_stub.cc)
  target_include_directories(kvr_model_cuda PUBLIC include)
  target_link_libraries(kvr_model_cuda PUBLIC kvr::model absl::status absl::statusor)
endif()
add_library(kvr::model_cuda ALIAS kvr_model_cuda)
kvr_warnings(kvr_model_cuda)

if(KVR_HAVE_CUDA)
  # Kernel parity against the CPU building blocks (RmsNorm, ApplyRope, DenseAttention): rows of
  # tests/gpu_parity (gpu_parity_test).
  # Whole-model parity against the CPU Model: dummy shapes and the SmolLM2 GGUF.
  kvr_add_test(model_cuda_model_test
    SOURCES tests/cuda_model_test.cc
    LIBS kvr::model_cuda kvr::model kvr::gpu_testing kvr::common absl::strings
    LABELS gpu)

  # The sparse decode's tests (an attention hook of this model) live with it:
  # retrieval/cuda_decode.cmake (retrieval_cuda_decode_test, retrieval_cuda_decode_load_test).

  # Per-layer builds (CudaLayerBuilder; retrieval's summaries are one, tested with them in
  # retrieval/cuda_build.cmake): builds during prefill == the same builds afterwards.

  # Per-layer KV export (the GPU prefill node's): rows and queries vs the CPU.
  kvr_add_test(model_cuda_export_test
    SOURCES tests/cuda_export_test.cc
    LIBS kvr_model_cuda kvr::model kvr::gpu_testing kvr::common_cuda kvr::common absl::strings
    LABELS gpu)
  target_include_directories(model_cuda_export_test PRIVATE cuda)
  # CUDA graphs of dense greedy decode steps against launch-by-launch steps.
  kvr_add_test(model_cuda_graph_test
    SOURCES tests/cuda_graph_test.cc
    LIBS kvr_model_cuda kvr::model
    LABELS gpu)

  add_executable(cuda_model_bench bench/cuda_model_bench.cc)
  kvr_warnings(cuda_model_bench)
  target_link_libraries(cuda_model_bench PRIVATE kvr::model_cuda kvr::model kvr::common
                                                 CLI11::CLI11 absl::str_format absl::strings)
endif()
