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
// Rows longer than this are cut into segments of kSegment scores: one CTA per segment keeps the
// top `budget` of its segment, then one CTA per row merges the segments' candidates (the top-k
// of the union of per-segment top-ks is the top-k, with the same lower-index tie rule). One CTA
// per long row leaves the GPU idle at small batch (measured: 176 us for one 128K row).
constexpr int kSegment = 16384;

int Segments(const TopKParams& p) {
  return static_cast<int>((p.row_stride + kSegment - 1) / kSegment);
}

// Rows of at most kShortRow scores (clusterkv's ~2K clusters, quest's pages at 32K) take CTAs of
// kShortThreads, four times as many per SM: a CTA's time there goes to its barriers and the
// 2048-bin histogram passes more than to the loads (1,024-thread CTAs took 116 us for 768 rows
// of 2,047 scores on the H100). Measured only together with the other selection changes of
// BENCHMARKS.md "Cheaper selection", not alone.
constexpr int kShortRow = 4096;
constexpr int kShortThreads = 256;

template <int kT>
static __global__ void __launch_bounds__(kT)
    BatchedTopKKernel(const float* __restrict__ scores, int64_t row_stride,
                      const int32_t* __restrict__ n_valid, const int32_t* __restrict__ id_offset,
                      int budget, int32_t* __restrict__ ids, int32_t* __restrict__ counts) {
  __shared__ internal::TopKShared shared;
  const int row = blockIdx.x;
  const int n = n_valid[row];
  const int offset = id_offset != nullptr ? id_offset[row] : 0;
  internal::RowTopK<kT>(scores + row * row_stride, n, offset, budget,
                        ids + static_cast<int64_t>(row) * budget, counts + row, shared);
}

// Stage 1: grid (segments, rows); candidates [rows, segments, budget] (row-local indices).
static __global__ void __launch_bounds__(kThreads)
    TopKSegmentKernel(const float* __restrict__ scores, int64_t row_stride,
                      const int32_t* __restrict__ n_valid, int budget, int n_seg,
                      int32_t* __restrict__ cand) {
  __shared__ internal::TopKShared shared;
  const int row = blockIdx.y, seg = blockIdx.x;
  const int lo = seg * kSegment;
  const int n_here = min(max(n_valid[row] - lo, 0), kSegment);
  internal::RowTopK<kThreads>(scores + row * row_stride + lo, n_here, lo, budget,
                              cand + (static_cast<int64_t>(row) * n_seg + seg) * budget, nullptr,
                              shared);
}

// Stage 2: grid (rows); the top `budget` of the row's n_seg * budget candidates.
static __global__ void __launch_bounds__(kThreads)
    TopKMergeKernel(const float* __restrict__ scores, int64_t row_stride, int budget, int n_seg,
                    const int32_t* __restrict__ cand, const int32_t* __restrict__ id_offset,
                    int32_t* __restrict__ ids, int32_t* __restrict__ counts) {
  __shared__ internal::TopKShared shared;
  const int row = blockIdx.x;
  const int total = n_seg * budget;
  const int32_t* c = cand + static_cast<int64_t>(row) * total;
  const float* srow = scores + row * row_stride;
  const int offset = id_offset != nullptr ? id_offset[row] : 0;
  internal::RowTopKLoad4<kThreads>(
      [c, srow, total](int j) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * j + e;
          const int id = i < total ? c[i] : -1;
          v[e] = id >= 0 ? srow[id] : NAN;
        }
        return make_float4(v[0], v[1], v[2], v[3]);
      },
      total, [c, offset](int i) { return offset + c[i]; }, budget,
      ids + static_cast<int64_t>(row) * budget, counts + row, shared);
}

}  // namespace

size_t BatchedTopKWorkspaceBytes(const TopKParams& p) {
  const int n_seg = Segments(p);
  if (n_seg < 2 || p.rows <= 0) return 0;
  return static_cast<size_t>(p.rows) * n_seg * p.out.budget * sizeof(int32_t);
}

absl::Status LaunchBatchedTopK(const TopKParams& p, cudaStream_t stream) {
  if (p.rows == 0) return absl::OkStatus();
  const size_t need = BatchedTopKWorkspaceBytes(p);
  // Two stages only while one CTA per row leaves most SMs idle: measured on the H100 at 128K,
  // 32 rows: 95 us two-stage vs 176 us; 128 rows: 309 us two-stage vs 210 us.
  int device = 0, sms = 0;
  KVR_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  KVR_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (need > 0 && p.workspace != nullptr && p.workspace_bytes >= need && 2 * p.rows <= sms) {
    const int n_seg = Segments(p);
    auto* cand = static_cast<int32_t*>(p.workspace);
    TopKSegmentKernel<<<dim3(n_seg, p.rows), kThreads, 0, stream>>>(
        p.scores, p.row_stride, p.n_valid, p.out.budget, n_seg, cand);
    KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    TopKMergeKernel<<<p.rows, kThreads, 0, stream>>>(p.scores, p.row_stride, p.out.budget, n_seg,
                                                     cand, p.id_offset, p.out.ids, p.out.counts);
    return kvr::cuda::LastLaunchStatus("TopKMergeKernel");
  }
  if (p.row_stride <= kShortRow) {
    BatchedTopKKernel<kShortThreads><<<p.rows, kShortThreads, 0, stream>>>(
        p.scores, p.row_stride, p.n_valid, p.id_offset, p.out.budget, p.out.ids, p.out.counts);
  } else {
    BatchedTopKKernel<kThreads><<<p.rows, kThreads, 0, stream>>>(
        p.scores, p.row_stride, p.n_valid, p.id_offset, p.out.budget, p.out.ids, p.out.counts);
  }
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
