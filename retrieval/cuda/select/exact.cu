// exact: GQA-aggregated true scores over every candidate key, then the batched top-k.
//
// Kernels (grid z = sequence, y = KV head):
//  1. ExactLogitsKernel: one CTA per chunk of kChunk candidates. A key is read once for the whole
//     query group: kLanes = head_dim / kVec lanes hold 16 bytes of it each (8 bf16/fp16 or 4
//     fp32), multiply with their slice of every query head (registers), and reduce across the
//     lanes with shuffles. Writes scale * q.k per group head ([rows, group, max_cand]) and, for
//     kSumSoftmax, each chunk's (max, sum exp) per group head; for the other aggregations it
//     writes the aggregated score directly.
//  2. (kSumSoftmax) SoftmaxAggregateKernel (select_common.cuh): log-sum-exp per group head from the
//  chunk
//     partials, then score = sum_g exp(logit_g - lse_g) ([rows, max_cand]).
//  3. BatchedTopK over the scores (topk.cu).
// Bytes: the keys (n * n_kv_heads * head_dim * dtype) dominate: at 128K, bf16, 8 KV heads that
// is 256 MiB per sequence, ~90 us at 3 TB/s; the fp32 logits add 2 * 4 * group bytes per
// candidate and head (16 MiB), the top-k 4 more reads of 4 bytes (mostly from L2).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "select_common.cuh"
#include "topk_device.cuh"

namespace kvr::retrieval::cuda {

namespace {

using internal::AddToMaxSum;
using internal::AlignUp;
using internal::kMaxGroup;
using internal::RowLd;
using internal::StoreItemLogits;
constexpr int kLogitThreads = 256;
constexpr int kChunk = 512;  // candidates per CTA of the logits kernel
constexpr int kUnroll = 4;   // keys per lane in flight

// Loads 16 bytes of keys as floats.
template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
  static constexpr int kN = 4;
  __device__ __forceinline__ static void Load(const float* p, float* out) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  }
};
template <>
struct Vec16<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ __forceinline__ static void Load(const __nv_bfloat16* p, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};
template <>
struct Vec16<__half> {
  static constexpr int kN = 8;
  __device__ __forceinline__ static void Load(const __half* p, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

struct LogitsArgs {
  int n_kv_heads;
  int group;
  float scale;
  GqaAggregation gqa;
  const float* query;  // [batch, n_heads, head_dim]
  KeyView keys;
  CandidateRanges cand;
  int max_cand;
  float* logits;     // kSumSoftmax: [rows, group, max_cand]; else aggregated [rows, max_cand]
  float2* partials;  // kSumSoftmax: [rows, n_chunks, group] (max, sum exp)
  int n_chunks;
  int32_t* n_valid;          // [rows]
  int32_t* id_offset;        // [rows]
  const int32_t* row_count;  // optional [rows]: items [0, row_count[row]) instead of `cand`
};

// kGroup: compile-time upper bound of the runtime group (4 or 8): the query slices live in
// kGroup * kVec registers, so a group of 4 (Llama-3) does not pay for 8 (occupancy).
template <typename T, int kHeadDim, int kGroup>
static __global__ void __launch_bounds__(kLogitThreads, 2) ExactLogitsKernel(LogitsArgs a) {
  constexpr int kVec = Vec16<T>::kN;
  constexpr int kLanes = kHeadDim / kVec;  // lanes per key (8, 16 or 32)
  static_assert(kLanes <= 32 && 32 % kLanes == 0 && kLanes >= kGroup);
  constexpr int kKeysPerWarp = 32 / kLanes;
  constexpr int kWarps = kLogitThreads / 32;
  const int b = blockIdx.z, h = blockIdx.y, chunk = blockIdx.x;
  const int row = b * a.n_kv_heads + h;
  const int begin = a.row_count != nullptr ? 0 : a.cand.begin[b];
  const int n = a.row_count != nullptr ? a.row_count[row] : max(0, a.cand.end[b] - begin);
  if (chunk == 0 && threadIdx.x == 0) {
    a.n_valid[row] = n;
    a.id_offset[row] = begin;
  }
  const int group = a.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % kLanes;   // which 16-byte slice of the key
  const int slot = lane / kLanes;  // which key of the warp's kKeysPerWarp
  // This lane's slice of every query head of the group.
  float q[kGroup][kVec];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (g < group) {
      const float* qp =
          a.query +
          (static_cast<int64_t>(b) * a.n_kv_heads * group + static_cast<int64_t>(h) * group + g) *
              kHeadDim +
          sub * kVec;
#pragma unroll
      for (int j = 0; j < kVec; ++j) q[g][j] = qp[j] * a.scale;
    }
  }
  const int64_t head_base = a.keys.head_offset != nullptr
                                ? a.keys.head_offset[row]
                                : static_cast<int64_t>(b) * a.keys.batch_stride +
                                      static_cast<int64_t>(h) * a.keys.head_stride;
  const T* keys = static_cast<const T*>(a.keys.data) + head_base + sub * kVec;
  const bool paged = a.keys.pool.slots != nullptr;
  const bool softmax = a.gqa == GqaAggregation::kSumSoftmax;
  // Online (max, sum exp) of the logits of query head `sub` (lanes sub < group; every lane of a
  // key holds every head's dot product after the reduction, so each keeps one head: one exp per
  // key instead of `group`).
  float run_max = -INFINITY, run_sum = 0.f;
  const int chunk_begin = chunk * kChunk;
  const int chunk_end = min(n, chunk_begin + kChunk);
  float* out_row = a.logits + static_cast<int64_t>(row) * (softmax ? group : 1) * a.max_cand;
  constexpr int kStep = kWarps * kKeysPerWarp * kUnroll;
  // The reduce-scatter path needs one (key, head) pair per lane of a key: 16 lanes (16-bit keys
  // at d = 128) x (4 keys x 4 heads); it serves kSumSoftmax (the default). Else: butterflies.
  constexpr bool kReduceScatter = kLanes == kUnroll * kGroup;
  for (int i0 = chunk_begin + warp * kKeysPerWarp * kUnroll; i0 < chunk_end; i0 += kStep) {
    // All loads first (kUnroll 16-byte loads in flight per lane), then the arithmetic.
    float k[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kKeysPerWarp + slot;
      if (i < chunk_end) {
        const T* key = paged ? static_cast<const T*>(kvr::cuda::KvPoolRow(
                                   a.keys.pool, row, begin + i, a.keys.row_bytes)) +
                                   sub * kVec
                             : keys + static_cast<int64_t>(begin + i) * a.keys.token_stride;
        Vec16<T>::Load(key, k[u]);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) k[u][j] = 0.f;
      }
    }
    if (kReduceScatter && softmax) {
      // 16 partial sums per lane (key u, head g) reduced over the key's 16 lanes with a
      // reduce-scatter: 15 shuffles instead of 64; lane `sub` ends with the total of (u, g) =
      // (sub / kGroup, sub % kGroup), so each lane keeps one head's softmax statistics.
      float x[kUnroll * kGroup];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
          float d = 0.f;
#pragma unroll
          for (int j = 0; j < kVec; ++j) d = fmaf(q[g][j], k[u][j], d);
          x[u * kGroup + g] = d;
        }
      }
#pragma unroll
      for (int c = kUnroll * kGroup; c > 1; c >>= 1) {
        const int o = c / 2;  // lane offset == half the values still held
        const bool upper = (sub & o) != 0;
#pragma unroll
        for (int v = 0; v < c / 2; ++v) {
          const float send = upper ? x[v] : x[v + c / 2];
          const float keep = upper ? x[v + c / 2] : x[v];
          x[v] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
      }
      const int u = sub / kGroup, g = sub % kGroup;
      const int i = i0 + u * kKeysPerWarp + slot;
      if (i < chunk_end && g < group) {
        const float mine = x[0];
        out_row[static_cast<int64_t>(g) * a.max_cand + i] = mine;
        AddToMaxSum(run_max, run_sum, mine);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kKeysPerWarp + slot;
        float dot[kGroup];
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
          float s = 0.f;
          if (g < group) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) s = fmaf(q[g][j], k[u][j], s);
#pragma unroll
            for (int o = kLanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
          }
          dot[g] = s;
        }
        if (i >= chunk_end) continue;
        StoreItemLogits(softmax, a.gqa, dot, group, sub, out_row, a.max_cand, i, run_max, run_sum);
      }
    }
  }
  if (!softmax || chunk >= a.n_chunks) return;
  if (kReduceScatter) {
    // Lanes sub = g, g + kGroup, ... hold head g's statistics: merge them into lane sub = g.
#pragma unroll
    for (int o = kGroup; o < kLanes; o <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, run_max, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, run_sum, o);
      internal::MergeMaxSum(run_max, run_sum, m2, s2);
    }
  }
  // Chunk partials: lane (slot, sub = g) of every warp holds head g's (max, sum) of its keys.
  __shared__ float2 part[kWarps * kKeysPerWarp][kGroup];
  if (sub < group) part[warp * kKeysPerWarp + slot][sub] = make_float2(run_max, run_sum);
  __syncthreads();
  if (threadIdx.x < group) {
    const int g = threadIdx.x;
    float m = -INFINITY, s = 0.f;
    for (int w = 0; w < kWarps * kKeysPerWarp; ++w) {
      const float2 p = part[w][g];
      const float mm = fmaxf(m, p.x);
      s = (mm == -INFINITY) ? 0.f : s * __expf(m - mm) + p.y * __expf(p.x - mm);
      m = mm;
    }
    a.partials[(static_cast<int64_t>(row) * a.n_chunks + chunk) * group + g] = make_float2(m, s);
  }
}

struct Workspace {
  float* logits = nullptr;
  float* scores = nullptr;
  float2* partials = nullptr;
  float* lse = nullptr;  // [rows, group]
  int32_t* n_valid = nullptr;
  int32_t* id_offset = nullptr;
  void* topk = nullptr;  // BatchedTopK scratch
  size_t topk_bytes = 0;
  size_t bytes = 0;
};

Workspace Carve(const ExactSelectParams& p, char* base, bool with_topk = true) {
  const size_t rows = static_cast<size_t>(p.batch) * p.n_kv_heads;
  const int group = p.n_kv_heads > 0 ? p.n_heads / p.n_kv_heads : 0;
  const size_t n_chunks = (static_cast<size_t>(p.max_candidates) + kChunk - 1) / kChunk;
  const bool softmax = p.gqa == GqaAggregation::kSumSoftmax;
  Workspace w;
  internal::Carver carve(base);
  const size_t ld = RowLd(p.max_candidates);
  w.scores = carve.Take<float>(rows * ld);
  if (softmax) {
    w.logits = carve.Take<float>(rows * group * ld);
    w.partials = carve.Take<float2>(rows * n_chunks * group);
    w.lse = carve.Take<float>(rows * group);
  }
  w.n_valid = carve.Take<int32_t>(rows);
  w.id_offset = carve.Take<int32_t>(rows);
  TopKParams t;
  t.rows = static_cast<int>(rows);
  t.row_stride = ld;
  t.out.budget = p.out.budget;
  w.topk_bytes = with_topk ? BatchedTopKWorkspaceBytes(t) : 0;
  w.topk = carve.TakeBytes(w.topk_bytes);
  w.bytes = carve.used();
  return w;
}

template <typename T, int kHeadDim>
void LaunchLogits(const LogitsArgs& a, dim3 grid, cudaStream_t stream) {
  if (a.group <= 4) {
    ExactLogitsKernel<T, kHeadDim, 4><<<grid, kLogitThreads, 0, stream>>>(a);
  } else {
    ExactLogitsKernel<T, kHeadDim, kMaxGroup><<<grid, kLogitThreads, 0, stream>>>(a);
  }
}

}  // namespace

size_t ExactSelectWorkspaceBytes(const ExactSelectParams& p) { return Carve(p, nullptr).bytes; }

namespace {

// `select`: ExactSelect (needs candidates and the output); else GroupScores.
absl::Status Validate(const ExactSelectParams& p, const Workspace& w, bool select) {
  if (p.batch < 0 || p.n_kv_heads <= 0 || p.n_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      p.n_heads / p.n_kv_heads > kMaxGroup) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ExactSelect: need batch >= 0 and n_heads a multiple of n_kv_heads with a group of at "
        "most ",
        kMaxGroup, "; got batch ", p.batch, ", n_heads ", p.n_heads, ", n_kv_heads ",
        p.n_kv_heads));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExactSelect: head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (select && (p.out.budget < 1 || p.out.budget > kMaxBudget)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExactSelect: budget must be in [1, ", kMaxBudget, "], got ", p.out.budget));
  }
  if (p.max_candidates < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExactSelect: max_candidates ", p.max_candidates));
  }
  const bool paged = p.keys.pool.slots != nullptr;
  if (paged && (!kvr::cuda::KvPoolViewSet(p.keys.pool) || p.keys.pool.n_kv_heads != p.n_kv_heads ||
                p.keys.row_bytes % 16 != 0 ||
                p.keys.row_bytes < static_cast<int64_t>(p.head_dim) *
                                       (p.keys.dtype == KeyDType::kF32 ? 4 : 2))) {
    return absl::InvalidArgumentError(
        "ExactSelect: paged keys need a set pool of n_kv_heads heads and rows of a 16-byte "
        "multiple holding head_dim keys");
  }
  if (p.query == nullptr || (!paged && p.keys.data == nullptr) ||
      (select && (p.cand.begin == nullptr || p.cand.end == nullptr || p.out.ids == nullptr ||
                  p.out.counts == nullptr))) {
    return absl::InvalidArgumentError("ExactSelect: null query, keys, candidates or output");
  }
  const size_t elem = p.keys.dtype == KeyDType::kF32 ? 4 : 2;
  if (!paged && (p.keys.token_stride * elem % 16 != 0 ||
      (p.keys.head_offset == nullptr &&
       (p.keys.head_stride * elem % 16 != 0 || p.keys.batch_stride * elem % 16 != 0)) ||
      reinterpret_cast<uintptr_t>(p.keys.data) % 16 != 0)) {
    return absl::InvalidArgumentError(
        "ExactSelect: keys and their strides must be 16-byte aligned (vector loads)");
  }
  if (p.workspace == nullptr || p.workspace_bytes < w.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ExactSelect: workspace of ", p.workspace_bytes, " bytes, need ", w.bytes));
  }
  return absl::OkStatus();
}

absl::Status LaunchScores(const ExactSelectParams& p, const int32_t* row_count, const Workspace& w,
                          cudaStream_t stream) {
  const int group = p.n_heads / p.n_kv_heads;
  const int n_chunks = std::max(1, (p.max_candidates + kChunk - 1) / kChunk);
  const bool softmax = p.gqa == GqaAggregation::kSumSoftmax;
  LogitsArgs a{p.n_kv_heads,
               group,
               p.scale,
               p.gqa,
               p.query,
               p.keys,
               p.cand,
               RowLd(p.max_candidates),
               softmax ? w.logits : w.scores,
               w.partials,
               n_chunks,
               w.n_valid,
               w.id_offset,
               row_count};
  const dim3 grid(n_chunks, p.n_kv_heads, p.batch);
  KVR_RETURN_IF_ERROR(internal::DispatchKeyType(p.keys.dtype, [&]<typename T>() {
    return internal::DispatchHeadDim(p.head_dim, [&]<int D>() {
      LaunchLogits<T, D>(a, grid, stream);
      return absl::OkStatus();
    });
  }));
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (softmax) {
    KVR_RETURN_IF_ERROR(internal::SoftmaxAggregate(
        p.batch, p.n_kv_heads, group, kChunk, n_chunks, RowLd(p.max_candidates), p.max_candidates,
        w.logits, w.partials, w.n_valid, w.lse, w.scores, stream));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

size_t GroupScoresWorkspaceBytes(const ExactSelectParams& p) {
  return Carve(p, nullptr, /*with_topk=*/false).bytes;
}

absl::Status GroupScores(const ExactSelectParams& p, const int32_t* row_count,
                         cudaStream_t stream) {
  const Workspace w = Carve(p, static_cast<char*>(p.workspace), /*with_topk=*/false);
  if (row_count == nullptr) return absl::InvalidArgumentError("GroupScores: null row_count");
  KVR_RETURN_IF_ERROR(Validate(p, w, /*select=*/false));
  if (p.batch == 0) return absl::OkStatus();
  return LaunchScores(p, row_count, w, stream);
}

}  // namespace internal

absl::Status ExactSelect(const ExactSelectParams& p, cudaStream_t stream) {
  const Workspace w = Carve(p, static_cast<char*>(p.workspace));
  KVR_RETURN_IF_ERROR(Validate(p, w, /*select=*/true));
  if (p.batch == 0) return absl::OkStatus();
  KVR_RETURN_IF_ERROR(LaunchScores(p, nullptr, w, stream));
  TopKParams t;
  t.rows = p.batch * p.n_kv_heads;
  t.row_stride = RowLd(p.max_candidates);
  t.scores = w.scores;
  t.n_valid = w.n_valid;
  t.id_offset = w.id_offset;
  t.out = p.out;
  t.workspace = w.topk;
  t.workspace_bytes = w.topk_bytes;
  return LaunchBatchedTopK(t, stream);
}

}  // namespace kvr::retrieval::cuda
