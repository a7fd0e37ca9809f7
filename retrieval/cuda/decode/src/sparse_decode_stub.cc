// The sparse decode's factory and host link probes in a build without nvcc (KVR_HAVE_CUDA off):
// they answer Unimplemented, so that callers link kvr::retrieval_cuda_decode and choose the
// backend at run time.
#include "absl/status/status.h"
#include "kvr/retrieval/cuda/sparse_decode.h"

namespace kvr::retrieval::cuda {

absl::StatusOr<std::unique_ptr<SparseDecodeAttention>> CreateSparseDecodeAttention(
    model::CudaModel&) {
  return absl::UnimplementedError(
      "CreateSparseDecodeAttention: this build of kvr has no CUDA (nvcc not found)");
}

absl::StatusOr<HostTopology> GetHostTopology(int) {
  return absl::UnimplementedError("GetHostTopology: this build of kvr has no CUDA");
}

absl::StatusOr<HostLinkProbe> MeasureHostLink(int, int, bool, int64_t, int) {
  return absl::UnimplementedError("MeasureHostLink: this build of kvr has no CUDA");
}
absl::StatusOr<double> MeasureMappedRows(const void*, const void*, int64_t, int64_t, int) {
  return absl::UnimplementedError("MeasureMappedRows: this build of kvr has no CUDA");
}

}  // namespace kvr::retrieval::cuda
