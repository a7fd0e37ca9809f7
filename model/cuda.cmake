# kvr::model_cuda: the CUDA backend of the model runtime (cuda_model.h), its kernel and model
# parity tests (CTest label `gpu`) and its benchmark. Included from model/CMakeLists.txt.
# Without nvcc the target still exists and its factories answer Unimplemented (CONVENTIONS 7).
if(KVR_HAVE_CUDA)
  kvr_add_library(model_cuda CUDA
    SOURCES cuda/cuda_model.cu cuda/ops.cu cuda/attention.cu
    INCLUDES include
    PRIVATE_INCLUDES cuda
    PUBLIC kvr::model absl::status absl::statusor
    PRIVATE kvr::common_cuda CUDA::cublas absl::strings)
else()
  kvr_add_library(model_cuda
    SOURCES cuda/cuda_model_stub.cc
    INCLUDES include
    PUBLIC kvr::model absl::status absl::statusor)
endif()

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
    INCLUDES cuda
    LABELS gpu)
  # CUDA graphs of dense greedy decode steps against launch-by-launch steps.
  kvr_add_test(model_cuda_graph_test
    SOURCES tests/cuda_graph_test.cc
    LIBS kvr_model_cuda kvr::model
    LABELS gpu)

  kvr_add_executable(cuda_model_bench
    SOURCES bench/cuda_model_bench.cc
    LIBS kvr::model_cuda kvr::model kvr::common CLI11::CLI11 absl::str_format absl::strings)
endif()
