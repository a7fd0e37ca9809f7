#pragma once
// Pieces shared by the selectors' .cu files (private to kvr::retrieval_cuda_select).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/retrieval/cuda/kernel_util.cuh"
#include "kvr/retrieval/cuda/selection.cuh"

namespace kvr::retrieval::cuda {

// topk.cu: BatchedTopK on the caller's stream, without the host-side checks of the public entry.
absl::Status LaunchBatchedTopK(const TopKParams& p, cudaStream_t stream);

}  // namespace kvr::retrieval::cuda

namespace kvr::retrieval::cuda::internal {

inline constexpr int kMaxGroup = 8;  // query heads per KV head
// Row length of fp32 scratch rows: a multiple of 4 so that every row is 16-byte aligned (the
// top-k reads rows with float4 loads).
inline int RowLd(int n) { return (n + 3) / 4 * 4; }

// (max, sum exp) pairs combined: the log-sum-exp merge of two partial softmax denominators.
__device__ __forceinline__ void MergeMaxSum(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  s = (mm == -INFINITY) ? 0.f : s * __expf(m - mm) + s2 * __expf(m2 - mm);
  m = mm;
}

// Folds logit `l` into an online softmax denominator: run_sum = sum exp(l_i - run_max) over the
// logits seen, run_max their maximum.
__device__ __forceinline__ void AddToMaxSum(float& run_max, float& run_sum, float l) {
  if (l > run_max) {
    run_sum *= __expf(run_max - l);
    run_max = l;
  }
  run_sum += __expf(l - run_max);
}

// The kMaxLogit (max) or kSumLogit (sum) aggregate of one item's logits `l` [kGroup], of which
// the first `group` are the KV head's query heads.
template <int kGroup>
__device__ __forceinline__ float AggregateLogits(GqaAggregation gqa, const float (&l)[kGroup],
                                                 int group) {
  float agg = gqa == GqaAggregation::kMaxLogit ? -INFINITY : 0.f;
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (g < group) agg = gqa == GqaAggregation::kMaxLogit ? fmaxf(agg, l[g]) : agg + l[g];
  }
  return agg;
}

// v[i] without a run-time register index (0 when i >= kN).
template <int kN>
__device__ __forceinline__ float PickFromRegisters(const float (&v)[kN], int i) {
  float out = 0.f;
#pragma unroll
  for (int g = 0; g < kN; ++g) out = (i == g) ? v[g] : out;
  return out;
}

// Stores item i's logits `l` (those of the group's heads, the same in every lane of the caller's
// lanes `sub`): with softmax, lane sub < group writes head sub's logit to out_row[sub * ld + i]
// and folds it into its running (max, sum exp); without, lane sub 0 writes the aggregate of the
// group to out_row[i].
template <int kGroup>
__device__ __forceinline__ void StoreItemLogits(bool softmax, GqaAggregation gqa,
                                                const float (&l)[kGroup], int group, int sub,
                                                float* out_row, int ld, int i, float& run_max,
                                                float& run_sum) {
  if (softmax) {
    const float mine = PickFromRegisters(l, sub);
    if (sub < group) {
      out_row[static_cast<int64_t>(sub) * ld + i] = mine;
      AddToMaxSum(run_max, run_sum, mine);
    }
  } else if (sub == 0) {
    out_row[i] = AggregateLogits(gqa, l, group);
  }
}

// kSumSoftmax, step 1: lse[row, g] from the per-chunk (max, sum exp) partials
// [rows, n_chunks, group] of a scoring kernel (chunks of `chunk` items, n_valid[row] items).
// Grid (rows), one warp per group head (blockDim = 32 * group).
static __global__ void LseKernel(int group, int chunk, int n_chunks,
                                 const float2* __restrict__ partials,
                                 const int32_t* __restrict__ n_valid, float* __restrict__ lse) {
  const int row = blockIdx.x;
  const int g = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (g >= group) return;
  const int used_chunks = (n_valid[row] + chunk - 1) / chunk;
  float m = -INFINITY, s = 0.f;
  for (int c = lane; c < used_chunks; c += 32) {
    const float2 p = partials[(static_cast<int64_t>(row) * n_chunks + c) * group + g];
    MergeMaxSum(m, s, p.x, p.y);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    MergeMaxSum(m, s, m2, s2);
  }
  if (lane == 0) lse[static_cast<int64_t>(row) * group + g] = m + logf(s);
}

// kSumSoftmax, step 2: score[row, i] = sum_g exp(logit[row, g, i] - lse[row, g]).
// Grid (ceil(max items / 1024), n_kv_heads, batch), 256 threads.
static __global__ void __launch_bounds__(256)
    SoftmaxAggregateKernel(int n_kv_heads, int group, int ld, const float* __restrict__ logits,
                           const float* __restrict__ lse, const int32_t* __restrict__ n_valid,
                           float* __restrict__ scores) {
  const int row = blockIdx.z * n_kv_heads + blockIdx.y;
  const int n = n_valid[row];
  constexpr int kPerBlock = 1024;
  float l_row[8];
#pragma unroll
  for (int g = 0; g < 8; ++g)
    l_row[g] = g < group ? lse[static_cast<int64_t>(row) * group + g] : 0.f;
  const int i_end = min(n, static_cast<int>(blockIdx.x + 1) * kPerBlock);
  const float* l = logits + static_cast<int64_t>(row) * group * ld;
  for (int i = blockIdx.x * kPerBlock + threadIdx.x; i < i_end; i += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      if (g < group) s += __expf(l[static_cast<int64_t>(g) * ld + i] - l_row[g]);
    }
    scores[static_cast<int64_t>(row) * ld + i] = s;
  }
}

// kSumSoftmax, both steps over rows = batch * n_kv_heads of at most max_items items (row stride
// ld; chunk partials as LseKernel's).
static inline absl::Status SoftmaxAggregate(int batch, int n_kv_heads, int group, int chunk,
                                            int n_chunks, int ld, int max_items,
                                            const float* logits, const float2* partials,
                                            const int32_t* n_valid, float* lse, float* scores,
                                            cudaStream_t stream) {
  const int rows = batch * n_kv_heads;
  LseKernel<<<rows, 32 * group, 0, stream>>>(group, chunk, n_chunks, partials, n_valid, lse);
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const dim3 grid(std::max(1, (max_items + 1023) / 1024), n_kv_heads, batch);
  SoftmaxAggregateKernel<<<grid, 256, 0, stream>>>(n_kv_heads, group, ld, logits, lse, n_valid,
                                                   scores);
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// exact.cu: the scoring half of ExactSelect (no top-k). Writes the GQA-aggregated scores of
// every item to the START of p.workspace: float [batch * n_kv_heads, RowLd(p.max_candidates)].
// With row_count (device [rows]) row r scores items [0, row_count[r]) of its keys instead of
// the candidate ranges (p.cand unused). p.out is unused.
size_t GroupScoresWorkspaceBytes(const ExactSelectParams& p);
absl::Status GroupScores(const ExactSelectParams& p, const int32_t* row_count, cudaStream_t stream);

}  // namespace kvr::retrieval::cuda::internal
