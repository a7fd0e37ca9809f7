// Batched top-k by radix select (one CTA per row), written in ascending index order.
//
// Per row: scores become order-preserving uint32 keys (NaN -> excluded). Three histogram passes
// over the row (11, 11 and 10 bits, most significant first, 2048 shared-memory bins, warp-
// aggregated with __match_any_sync because scores of one row share few exponents) find the exact
// key T of the k-th largest score and how many of the scores equal to T are taken. One more pass
// compacts, in index order, every score > T and the first (lowest-index) scores == T: the output
// is ascending with no sort, and ties go to the lower index as in kvr::retrieval::TopKIndices.
//
// Cost: 4 reads of the row (the rows are usually L2-resident: they were just written by the
// scoring kernel). One CTA per row is enough at batch >= 4 with 8 KV heads; at batch 1 it leaves
// most SMs idle, which the microbench shows (select_cuda_bench).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "topk_device.cuh"

namespace kvr::retrieval::cuda {
namespace {

constexpr int kThreads = 1024;

static __global__ void __launch_bounds__(kThreads)
    BatchedTopKKernel(const float* __restrict__ scores, int64_t row_stride,
                      const int32_t* __restrict__ n_valid, const int32_t* __restrict__ id_offset,
                      int budget, int32_t* __restrict__ ids, int32_t* __restrict__ counts) {
  __shared__ internal::TopKShared shared;
  const int row = blockIdx.x;
  const int n = n_valid[row];
  const int offset = id_offset != nullptr ? id_offset[row] : 0;
  internal::RowTopK<kThreads>(scores + row * row_stride, n, offset, budget,
                              ids + static_cast<int64_t>(row) * budget, counts + row, shared);
}

}  // namespace

absl::Status LaunchBatchedTopK(const TopKParams& p, cudaStream_t stream) {
  if (p.rows == 0) return absl::OkStatus();
  BatchedTopKKernel<<<p.rows, kThreads, 0, stream>>>(p.scores, p.row_stride, p.n_valid, p.id_offset,
                                                     p.out.budget, p.out.ids, p.out.counts);
  return kvr::cuda::LastLaunchStatus("BatchedTopKKernel");
}

absl::Status BatchedTopK(const TopKParams& p, cudaStream_t stream) {
  if (p.rows < 0) return absl::InvalidArgumentError(absl::StrCat("BatchedTopK: rows ", p.rows));
  if (p.out.budget < 1 || p.out.budget > kMaxBudget) {
    return absl::InvalidArgumentError(
        absl::StrCat("BatchedTopK: budget must be in [1, ", kMaxBudget, "], got ", p.out.budget));
  }
  if (p.rows > 0 && (p.scores == nullptr || p.n_valid == nullptr || p.out.ids == nullptr ||
                     p.out.counts == nullptr)) {
    return absl::InvalidArgumentError("BatchedTopK: null scores, n_valid, ids or counts");
  }
  if (p.row_stride < 0) {
    return absl::InvalidArgumentError(absl::StrCat("BatchedTopK: row_stride ", p.row_stride));
  }
  return LaunchBatchedTopK(p, stream);
}

}  // namespace kvr::retrieval::cuda
