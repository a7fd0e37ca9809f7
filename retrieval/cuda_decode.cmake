# kvr::retrieval_cuda_decode: the GPU sparse decode (cuda/decode/include/kvr/retrieval/cuda/
# sparse_decode.h), a per-layer attention hook of the CUDA model runtime (model::CudaAttention):
# slots, summaries, selection, hot cache, row sources / page tables and the sparse decode
# attention of the decode node's GPU path. Without nvcc the target still exists and its factory
# answers Unimplemented (CONVENTIONS.md 7), so the decode node links it unconditionally.
if(KVR_HAVE_CUDA AND TARGET kvr_retrieval_cuda_select AND TARGET kvr_retrieval_cuda_attend)
  kvr_add_library(retrieval_cuda_decode CUDA
    SOURCES cuda/decode/src/lanes.cu cuda/decode/src/pariskv_lane.cu
            cuda/decode/src/keydiff_lane.cu cuda/decode/src/a2ats_lane.cu
            cuda/decode/src/ctkvr_lane.cu cuda/decode/src/sparse_decode.cu
            cuda/decode/src/sparse_kernels.cu
    INCLUDES cuda/decode/include
    PRIVATE_INCLUDES cuda/decode/src
    PUBLIC kvr::model_cuda kvr::model absl::status absl::statusor
    PRIVATE kvr::retrieval_cuda_select kvr::retrieval_cuda_attend kvr::common_cuda kvr::common
            absl::strings absl::hash)

  # Sparse sequences (quest, clusterkv) against the model's dense path.
  kvr_add_test(retrieval_cuda_decode_test
    SOURCES cuda/decode/tests/sparse_decode_test.cc
    LIBS kvr::retrieval_cuda_decode kvr::model_cuda kvr::model kvr::retrieval_core kvr::gpu_testing
         kvr::common absl::strings
    INCLUDES ${PROJECT_SOURCE_DIR}/model/tests
    LABELS gpu)
  # A real past loaded into a sparse sequence == the dense sequence it came from.
  kvr_add_test(retrieval_cuda_decode_load_test
    SOURCES cuda/decode/tests/sparse_decode_load_test.cc
    LIBS kvr::retrieval_cuda_decode kvr::model_cuda kvr::model kvr::gpu_testing kvr::common
         absl::strings
    INCLUDES ${PROJECT_SOURCE_DIR}/model/tests
    LABELS gpu)
else()
  kvr_add_library(retrieval_cuda_decode
    SOURCES cuda/decode/src/sparse_decode_stub.cc
    INCLUDES cuda/decode/include
    PUBLIC kvr::model_cuda kvr::model absl::status absl::statusor)
endif()
