#include "kvr/retrieval/cuda/decode_attention.cuh"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "row_util.cuh"

namespace kvr::retrieval::cuda {
namespace {

using detail::FromFloat;
using detail::LoadFloats;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxGroup = 8;
// Rows each lane group loads before it uses any (memory parallelism): with 16-byte loads a
// lane holds 2 x kRowsPerIter x 8 bf16 values of them.
constexpr int kRowsPerIter = 2;
constexpr int kMinRowsPerSplit = 32;
constexpr int kMaxRowsPerSplit = 256;  // where the batch alone fills the GPU
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// One block per (split, kv head, sequence). A row is spread over kRowLanes lanes, each holding
// kLane consecutive elements of k and of v (one 16-byte load each), so a warp works on 32 /
// kRowLanes rows at once (4 at head_dim 64 in bf16) and reduces a dot product in
// log2(kRowLanes) shuffle levels; each lane group walks kRowsPerIter rows per step (memory
// parallelism), and every query head of the group (at most G) reuses the loaded rows from
// registers. Scores live in the log2 domain (q is pre-scaled by scale * log2(e)) so the online
// softmax uses exp2f. The lane groups of a warp then merge their (m, l, acc) by shuffles, the
// block folds its warps' and writes one fp32 partial (o, lse2) per query head to the workspace:
//   part_o   [batch, n_heads, n_splits, D]
//   part_lse [batch, n_heads, n_splits]  (log2 domain, -inf when the split had no rows)
// (Measured 2026-11-27 on SmolLM2's head_dim 64 at b256: the former layout, a row over all 32
// lanes with 4-byte loads and 5 shuffle levels, took 10.6 ms per step for rows that HBM reads
// in ~3 ms; this one 5.5 ms. BENCHMARKS.md, "a row over 8 lanes".)
template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads)
    DecodeAttentionSplitKernel(DecodeAttentionParams p, int rows_per_split, float* part_o,
                               float* part_lse) {
  constexpr int kLane = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  constexpr int kRowLanes = D / kLane;                     // lanes per row: 8, 16 or 32
  static_assert(kRowLanes >= 8 && kRowLanes <= 32 && 32 % kRowLanes == 0);
  constexpr int kSub = 32 / kRowLanes;            // rows a warp holds at once
  constexpr int kWarpRows = kSub * kRowsPerIter;  // rows per warp step
  constexpr int64_t kRow = 2 * D;                 // elements per [k | v] row
  const int split = blockIdx.x;
  const int n_splits = gridDim.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int sub = lane / kRowLanes;  // which of the warp's rows
  const int sl = lane % kRowLanes;   // which elements of it: [sl * kLane, (sl + 1) * kLane)
  const int group = p.n_heads / p.n_kv_heads;
  const int64_t bh = static_cast<int64_t>(b) * p.n_kv_heads + h;

  const int n_res = p.resident_counts != nullptr ? p.resident_counts[b] : 0;
  const int n_sel = p.counts != nullptr ? p.counts[bh] : 0;
  const int total = n_res + n_sel;
  const int begin = split * rows_per_split;
  // The last split takes whatever is left, so rows past max_rows are never dropped.
  const int end = split == n_splits - 1 ? total : min(total, begin + rows_per_split);

  const T* res_base = p.resident != nullptr
                          ? static_cast<const T*>(p.resident) + bh * p.resident_capacity * kRow
                          : nullptr;
  const T* gat_base =
      p.gathered != nullptr ? static_cast<const T*>(p.gathered) + bh * p.budget * kRow : nullptr;
  const int32_t* ids = nullptr;
  if (gat_base == nullptr && n_sel > 0) ids = p.ids + bh * p.budget;
  auto row_ptr = [&](int j) -> const T* {
    if (j < n_res) return res_base + j * kRow;
    const int i = j - n_res;
    if (gat_base != nullptr) return gat_base + i * kRow;
    return static_cast<const T*>(KvPoolRow(p.pool, bh, ids[i], kRow * sizeof(T)));
  };

  float q[G][kLane];
  float m[G];
  float l[G];
  float acc[G][kLane];
  const T* q_base =
      static_cast<const T*>(p.q) + (static_cast<int64_t>(b) * p.n_heads + h * group) * D;
  const float q_scale = p.scale * kLog2e;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kLane; ++e) {
      q[g][e] = 0.f;
      acc[g][e] = 0.f;
    }
    if (g < group) {
      LoadFloats<T, kLane>(q_base + g * D + sl * kLane, q[g]);
#pragma unroll
      for (int e = 0; e < kLane; ++e) q[g][e] *= q_scale;
    }
  }

  // Every lane of a warp takes the same steps (the shuffles need the whole warp); a lane
  // group's rows past `end` are masked.
  for (int j0 = begin + warp * kWarpRows; j0 < end; j0 += kWarps * kWarpRows) {
    float k[kRowsPerIter][kLane];
    float v[kRowsPerIter][kLane];
    bool valid[kRowsPerIter];
#pragma unroll
    for (int r = 0; r < kRowsPerIter; ++r) {
      const int j = j0 + sub * kRowsPerIter + r;
      valid[r] = j < end;
      if (valid[r]) {
        const T* row = row_ptr(j);
        LoadFloats<T, kLane>(row + sl * kLane, k[r]);
        LoadFloats<T, kLane>(row + D + sl * kLane, v[r]);
      } else {
#pragma unroll
        for (int e = 0; e < kLane; ++e) k[r][e] = v[r][e] = 0.f;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= group) break;  // uniform across the block
      float s[kRowsPerIter];
#pragma unroll
      for (int r = 0; r < kRowsPerIter; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kLane; ++e) dot = fmaf(q[g][e], k[r][e], dot);
        s[r] = dot;
      }
#pragma unroll
      for (int off = kRowLanes / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int r = 0; r < kRowsPerIter; ++r) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
      }
      float mx = m[g];
#pragma unroll
      for (int r = 0; r < kRowsPerIter; ++r) {
        if (valid[r]) mx = fmaxf(mx, s[r]);
      }
      // mx = -inf: no row of this lane group so far (l and acc are 0).
      const float corr = mx == -INFINITY ? 1.f : exp2f(m[g] - mx);  // m = -inf: 0
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < kLane; ++e) acc[g][e] *= corr;
#pragma unroll
      for (int r = 0; r < kRowsPerIter; ++r) {
        const float pr = valid[r] ? exp2f(s[r] - mx) : 0.f;
        l[g] += pr;
#pragma unroll
        for (int e = 0; e < kLane; ++e) acc[g][e] = fmaf(pr, v[r][e], acc[g][e]);
      }
      m[g] = mx;
    }
  }
  // The warp's lane groups hold partial states over the same elements: merge them.
#pragma unroll
  for (int off = kRowLanes; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mx = fmaxf(m[g], m_o);
      const float c_self = m[g] == -INFINITY ? 0.f : exp2f(m[g] - mx);
      const float c_other = m_o == -INFINITY ? 0.f : exp2f(m_o - mx);
      l[g] = l[g] * c_self + l_o * c_other;
#pragma unroll
      for (int e = 0; e < kLane; ++e) {
        const float a_o = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        acc[g][e] = acc[g][e] * c_self + a_o * c_other;
      }
      m[g] = mx;
    }
  }

  __shared__ float sm_m[kWarps][G];
  __shared__ float sm_l[kWarps][G];
  __shared__ float sm_acc[kWarps][G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g < group) {
      if (lane == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
      if (sub == 0) {
#pragma unroll
        for (int e = 0; e < kLane; ++e) sm_acc[warp][g][sl * kLane + e] = acc[g][e];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * D; idx += kThreads) {
    const int g = idx / D;
    const int d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float sum_l = 0.f;
    float sum_a = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float c = exp2f(sm_m[w][g] - mx);
        sum_l = fmaf(sm_l[w][g], c, sum_l);
        sum_a = fmaf(sm_acc[w][g][d], c, sum_a);
      }
    }
    const int64_t o = (static_cast<int64_t>(b) * p.n_heads + h * group + g) * n_splits + split;
    part_o[o * D + d] = sum_l > 0.f ? sum_a / sum_l : 0.f;
    if (d == 0) part_lse[o] = sum_l > 0.f ? mx + log2f(sum_l) : -INFINITY;
  }
}

// Sum (or max) over the D threads of a block; every thread gets the result.
template <int D, bool kMax>
__device__ __forceinline__ float BlockReduce(float x, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, off);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  x = red[0];
#pragma unroll
  for (int w = 1; w < D / 32; ++w) x = kMax ? fmaxf(x, red[w]) : x + red[w];
  __syncthreads();  // red is reused by the next reduction
  return x;
}

// One block of D threads per (sequence, query head): merges the splits' partials by
// log-sum-exp (same algebra as MergeAttentionPartial) and writes out / lse. The split weights
// are computed once, in parallel, into shared memory ([n_splits] floats, dynamic); the weighted
// sum then streams the partials with 8 loads in flight per thread (a serial loop over hundreds
// of splits cost ~10 us at batch 1).
template <typename T, int D>
__global__ void __launch_bounds__(D)
    DecodeAttentionMergeKernel(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                               int n_splits, T* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float sm_w[];  // [n_splits]
  __shared__ float red[D / 32];
  const int64_t bq = blockIdx.x;
  const int d = threadIdx.x;
  const float* l2 = part_lse + bq * n_splits;
  float mx = -INFINITY;
  for (int s = d; s < n_splits; s += D) mx = fmaxf(mx, l2[s]);
  mx = BlockReduce<D, true>(mx, red);
  float w_sum = 0.f;
  for (int s = d; s < n_splits; s += D) {
    const float w = mx == -INFINITY ? 0.f : exp2f(l2[s] - mx);
    sm_w[s] = w;
    w_sum += w;
  }
  w_sum = BlockReduce<D, false>(w_sum, red);  // its barriers also publish sm_w
  float o = 0.f;
  const float* po = part_o + bq * n_splits * D + d;
#pragma unroll 8
  for (int s = 0; s < n_splits; ++s) o = fmaf(sm_w[s], po[static_cast<int64_t>(s) * D], o);
  out[bq * D + d] = FromFloat<T>(w_sum > 0.f ? o / w_sum : 0.f);
  if (lse != nullptr && d == 0) {
    lse[bq] = w_sum > 0.f ? (mx + log2f(w_sum)) * kLn2 : -INFINITY;
  }
}

absl::Status Validate(const DecodeAttentionParams& p) {
  if (p.batch <= 0 || p.n_heads <= 0 || p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      p.n_heads / p.n_kv_heads > kMaxGroup) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: need batch > 0 and n_heads a multiple (<= ", kMaxGroup,
                     "x) of n_kv_heads; got batch=", p.batch, " n_heads=", p.n_heads,
                     " n_kv_heads=", p.n_kv_heads));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (p.q == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("DecodeAttention: null q or out");
  }
  if (p.resident_counts != nullptr && (p.resident == nullptr || p.resident_capacity <= 0)) {
    return absl::InvalidArgumentError(
        "DecodeAttention: resident_counts set but resident rows or capacity missing");
  }
  if (p.counts != nullptr) {
    if (p.budget <= 0)
      return absl::InvalidArgumentError("DecodeAttention: counts set, budget <= 0");
    if (p.gathered == nullptr &&
        (!KvPoolViewSet(p.pool) || p.ids == nullptr)) {
      return absl::InvalidArgumentError(
          "DecodeAttention: selected rows need `gathered` or (pool tables, ids)");
    }
  }
  return absl::OkStatus();
}

// SM count of the current device, read once per process (an immutable cache, not state: the
// decode step must not pay a driver query per launch).
int MultiprocessorCount() {
  static const int sms = [] {
    int n = 132;
    int device = 0;
    if (cudaGetDevice(&device) == cudaSuccess) {
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    }
    return n;
  }();
  return sms;
}

}  // namespace

int DecodeAttentionSplits(const DecodeAttentionParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  // About kBlocksPerSm blocks per SM, splits of at least 32 rows. Measured on the H100
  // (2026-11-22, 32 q / 8 kv heads, d = 128, bf16): 8 rows per warp step (151 registers) or
  // 3-8 blocks per SM ran 5-40% slower at batch 4 / 16 than 4 rows and 2 blocks per SM.
  constexpr int64_t kBlocksPerSm = 2;
  const int64_t heads = std::max<int64_t>(1, static_cast<int64_t>(p.batch) * p.n_kv_heads);
  int64_t splits = (kBlocksPerSm * MultiprocessorCount() + heads - 1) / heads;
  const int64_t by_rows =
      std::max<int64_t>(1, (p.max_rows + kMinRowsPerSplit - 1) / kMinRowsPerSplit);
  if (heads >= kBlocksPerSm * MultiprocessorCount()) {
    // The (b, h) pairs alone fill the GPU (a big batch): one split each would leave every warp
    // a chain of max_rows / kWarps row steps (~80 at budget 1024 + a 272-row window), latency
    // bound (measured 2026-11-27 on SmolLM2 at b256: the attention stage 12.8 -> 10.6 ms with
    // the split). Split so that a warp
    // walks at most kMaxRowsPerSplit / kWarps rows.
    splits = std::max<int64_t>(splits, (p.max_rows + kMaxRowsPerSplit - 1) / kMaxRowsPerSplit);
  }
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(by_rows, 1024));
  return static_cast<int>(splits);
}

size_t DecodeAttentionWorkspaceBytes(const DecodeAttentionParams& p) {
  const size_t splits = static_cast<size_t>(DecodeAttentionSplits(p));
  return static_cast<size_t>(p.batch) * p.n_heads * splits * (p.head_dim + 1) * sizeof(float);
}

absl::Status DecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (absl::Status s = Validate(p); !s.ok()) return s;
  const int splits = DecodeAttentionSplits(p);
  const size_t need = DecodeAttentionWorkspaceBytes(p);
  if (p.workspace == nullptr || p.workspace_bytes < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: workspace of ", p.workspace_bytes, " bytes, need ", need));
  }
  const int rows_per_split = std::max(1, (p.max_rows + splits - 1) / splits);
  float* part_o = static_cast<float*>(p.workspace);
  float* part_lse = part_o + static_cast<size_t>(p.batch) * p.n_heads * splits * p.head_dim;
  const dim3 grid(splits, p.n_kv_heads, p.batch);
  return KVR_DISPATCH_ROW_DTYPE(p.dtype, T, [&] {
    return KVR_DISPATCH_HEAD_DIM(p.head_dim, D, [&]() -> absl::Status {
      // The group's registers are sized at compile time: 1, 2, 4 or 8 query heads per KV head.
      const int group = p.n_heads / p.n_kv_heads;
      if (group <= 1) {
        DecodeAttentionSplitKernel<T, D, 1>
            <<<grid, kThreads, 0, stream>>>(p, rows_per_split, part_o, part_lse);
      } else if (group <= 2) {
        DecodeAttentionSplitKernel<T, D, 2>
            <<<grid, kThreads, 0, stream>>>(p, rows_per_split, part_o, part_lse);
      } else if (group <= 4) {
        DecodeAttentionSplitKernel<T, D, 4>
            <<<grid, kThreads, 0, stream>>>(p, rows_per_split, part_o, part_lse);
      } else {
        DecodeAttentionSplitKernel<T, D, kMaxGroup>
            <<<grid, kThreads, 0, stream>>>(p, rows_per_split, part_o, part_lse);
      }
      if (absl::Status s = kvr::cuda::LastLaunchStatus("DecodeAttentionSplitKernel"); !s.ok()) {
        return s;
      }
      DecodeAttentionMergeKernel<T, D><<<p.batch * p.n_heads, D, splits * sizeof(float), stream>>>(
          part_o, part_lse, splits, static_cast<T*>(p.out), p.lse);
      return kvr::cuda::LastLaunchStatus("DecodeAttentionMergeKernel");
    });
  });
}

}  // namespace kvr::retrieval::cuda
