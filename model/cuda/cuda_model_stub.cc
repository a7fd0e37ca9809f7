// The CUDA model factories of a build without nvcc (KVR_HAVE_CUDA off): they answer
// Unimplemented, so that callers link kvr::model_cuda and choose the backend at run time.

#include "absl/status/status.h"
#include "kvr/model/cuda_model.h"

namespace kvr::model {

bool CudaModelAvailable() { return false; }

absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModel(const ModelConfig&, const ModelWeights&,
                                                           const CudaModelOptions&) {
  return absl::UnimplementedError(
      "CreateCudaModel: this build of kvr has no CUDA (nvcc not found)");
}

absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModelWithRandomWeights(
    const ModelConfig&, uint64_t, const CudaModelOptions&) {
  return absl::UnimplementedError(
      "CreateCudaModelWithRandomWeights: this build of kvr has no CUDA (nvcc not found)");
}

}  // namespace kvr::model
