// quest: page-bound scoring, top pages, and expansion of the pages to token ids.
//
// Kernels (grid z = sequence, y = KV head):
//  1. QuestBoundsKernel: head_dim / (16 bytes of bounds) lanes per page, so several pages per
//     warp (kChunk pages per CTA); a lane holds 4 (fp32) or 8 (bf16) channels of min and max
//     (16-byte loads) and of every query head of the group; bound_g = scale * sum_d max(q_d
//     min_d, q_d max_d), reduced over the page's lanes. Writes
//     per-head bounds + chunk (max, sum exp) partials for kSumSoftmax, else the aggregate.
//  2. (kSumSoftmax) SoftmaxAggregateKernel (select_common.cuh).
//  3. Top-(ceil(budget / page_size) + 2) pages per row with the batched top-k (ascending pages):
//     at most two pages (the first and the last candidate page) are partial, so these always
//     hold the budget.
//  4. QuestExpandKernel: ranks the chosen pages by (score desc, page asc) as the CPU's
//     TopKIndices, walks them in rank order to find how many tokens each contributes (the last
//     one trimmed to its first tokens) and writes the tokens in ascending order.
// Bytes: the fp32 bounds, 2 * head_dim * 4 / page_size bytes per token and KV head (64 B at
// d = 128, page 16: a quarter of bf16 K), or half that in bf16, read once.

#include <cuda_bf16.h>
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

using internal::AlignUp;
using internal::kMaxGroup;
using internal::RowLd;
using internal::StoreItemLogits;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 256;      // pages per CTA of the bounds kernel
constexpr int kMaxPages = 1024;  // pages chosen per row (ceil(budget / page_size) + 2)

struct BoundsArgs {
  int n_kv_heads, group, page_size;
  float scale;
  GqaAggregation gqa;
  const float* query;
  const void* bounds;
  int64_t batch_stride;  // elements
  CandidateRanges cand;
  int ld;            // row length of logits / scores
  float* logits;     // kSumSoftmax: [rows, group, ld]; else aggregated [rows, ld]
  float2* partials;  // [rows, n_chunks, group]
  int n_chunks;
  int32_t* n_pages;     // [rows]
  int32_t* first_page;  // [rows]
};

// 16 bytes of bounds (4 fp32 or 8 bf16) as floats, in one aligned load.
__device__ __forceinline__ void LoadBounds(const float* p, float (&out)[4]) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ __forceinline__ void LoadBounds(const __nv_bfloat16* p, float (&out)[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k]));
    out[2 * k] = f.x, out[2 * k + 1] = f.y;
  }
}

// kLanes = head_dim / kChan lanes score one page (each kChan channels of min and of max: one
// 16-byte load each), so a warp scores 32 / kLanes pages at a time (4 at head_dim 64 in bf16)
// and reduces each over kLanes lanes only: the reductions, not the bytes, bound this kernel
// with one page per warp.
// kGroup: the most query heads per KV head this instance takes (4 or kMaxGroup): the query
// registers are sized by it, and fewer registers let more CTAs hide the loads' latency.
template <int kHeadDim, typename T, int kGroup>
static __global__ void __launch_bounds__(kThreads) QuestBoundsKernel(BoundsArgs a) {
  constexpr int kChan = 16 / static_cast<int>(sizeof(T));  // 4 fp32 or 8 bf16
  constexpr int kLanes = kHeadDim / kChan;                 // 8, 16 or 32 (>= kMaxGroup)
  constexpr int kPagesPerWarp = 32 / kLanes;
  static_assert(kLanes >= kMaxGroup && kLanes <= 32, "a page's lanes hold every group head");
  static_assert(kGroup <= kMaxGroup);
  const int b = blockIdx.z, h = blockIdx.y, chunk = blockIdx.x;
  const int row = b * a.n_kv_heads + h;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % kLanes, slot = lane / kLanes;
  const int cb = a.cand.begin[b], ce = a.cand.end[b];
  const int first = cb / a.page_size;
  const int n = ce > cb ? (ce - 1) / a.page_size + 1 - first : 0;
  if (chunk == 0 && threadIdx.x == 0) {
    a.n_pages[row] = n;
    a.first_page[row] = first;
  }
  const int group = a.group;
  float q[kGroup][kChan];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (g < group) {
      const float* qp = a.query + (static_cast<int64_t>(row) * group + g) * kHeadDim + sub * kChan;
#pragma unroll
      for (int j = 0; j < kChan; ++j) q[g][j] = qp[j];
    }
  }
  const bool softmax = a.gqa == GqaAggregation::kSumSoftmax;
  float* out_row = a.logits + static_cast<int64_t>(row) * (softmax ? group : 1) * a.ld;
  float run_max = -INFINITY, run_sum = 0.f;  // head `sub` (subs < group) of this lane's pages
  const int p_end = min(n, (chunk + 1) * kChunk);
  const T* base =
      static_cast<const T*>(a.bounds) + b * a.batch_stride + static_cast<int64_t>(h) * 2 * kHeadDim;
  const int64_t page_elems = static_cast<int64_t>(a.n_kv_heads) * 2 * kHeadDim;
  // Every lane runs every iteration (the reductions shuffle across the whole warp); lanes whose
  // page is past the chunk's end score nothing.
  for (int p0 = chunk * kChunk + warp * kPagesPerWarp; p0 < p_end; p0 += kWarps * kPagesPerWarp) {
    const int p = p0 + slot;
    const bool valid = p < p_end;
    float lo[kChan], hi[kChan];
    if (valid) {
      const T* mn = base + (first + p) * page_elems + sub * kChan;
      LoadBounds(mn, lo);
      LoadBounds(mn + kHeadDim, hi);
    } else {
#pragma unroll
      for (int j = 0; j < kChan; ++j) lo[j] = hi[j] = 0.f;
    }
    float bound[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      float s = 0.f;
      if (g < group) {
#pragma unroll
        for (int j = 0; j < kChan; ++j) s += fmaxf(q[g][j] * lo[j], q[g][j] * hi[j]);
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      }
      bound[g] = a.scale * s;
    }
    if (valid) {
      StoreItemLogits(softmax, a.gqa, bound, group, sub, out_row, a.ld, p, run_max, run_sum);
    }
  }
  if (!softmax) return;
    // Head `sub`'s running (max, sum exp) merged over the warp's page slots: lane g < group then
    // holds the warp's.
#pragma unroll
  for (int o = kLanes; o < 32; o <<= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, run_max, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, run_sum, o);
    internal::MergeMaxSum(run_max, run_sum, m2, s2);
  }
  __shared__ float2 part[kWarps][kMaxGroup];
  if (lane < group) part[warp][lane] = make_float2(run_max, run_sum);
  __syncthreads();
  if (threadIdx.x < group) {
    const int g = threadIdx.x;
    float m = -INFINITY, s = 0.f;
    for (int w = 0; w < kWarps; ++w) internal::MergeMaxSum(m, s, part[w][g].x, part[w][g].y);
    a.partials[(static_cast<int64_t>(row) * a.n_chunks + chunk) * group + g] = make_float2(m, s);
  }
}

// One CTA per row: pages[row, 0 .. page_count[row]) (ascending page indices relative to
// first_page) -> token ids.
static __global__ void __launch_bounds__(kThreads)
    QuestExpandKernel(int page_size, int ld, int max_pages, const float* __restrict__ scores,
                      const int32_t* __restrict__ pages, const int32_t* __restrict__ page_count,
                      const int32_t* __restrict__ first_page, CandidateRanges cand, int n_kv_heads,
                      int budget, const int32_t* __restrict__ budgets, int32_t* __restrict__ ids,
                      int32_t* __restrict__ counts) {
  const int row = blockIdx.x;
  const int b = row / n_kv_heads;
  // This row's budget; rows stay `budget` apart in ids.
  const int row_budget = budgets != nullptr ? max(0, min(budgets[b], budget)) : budget;
  const int np = page_count[row];
  const int cb = cand.begin[b], ce = cand.end[b];
  const int first = first_page[row];
  __shared__ float s_score[kMaxPages];
  __shared__ int s_page[kMaxPages];
  __shared__ int s_rank_len[kMaxPages];  // tokens of the page at rank r
  __shared__ int s_take[kMaxPages];      // tokens taken from the page at (ascending) slot i
  __shared__ int s_rank[kMaxPages];
  for (int i = threadIdx.x; i < np; i += kThreads) {
    const int p = pages[static_cast<int64_t>(row) * max_pages + i];
    s_page[i] = p;
    s_score[i] = scores[static_cast<int64_t>(row) * ld + p];
  }
  __syncthreads();
  // Rank by (score desc, page asc): pages are ascending, so a lower slot is a lower page.
  for (int i = threadIdx.x; i < np; i += kThreads) {
    const float si = s_score[i];
    int r = 0;
    for (int j = 0; j < np; ++j) {
      const float sj = s_score[j];
      r += (sj > si) || (sj == si && j < i);
    }
    s_rank[i] = r;
    const int page = first + s_page[i];
    const int lo = max(cb, page * page_size), hi = min(ce, (page + 1) * page_size);
    s_rank_len[r] = hi - lo;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // walk in rank order (np <= 1024, cheap)
    int total = 0;
    for (int r = 0; r < np; ++r) {
      const int t = min(s_rank_len[r], row_budget - total);
      s_rank_len[r] = max(t, 0);
      total += s_rank_len[r];
    }
    counts[row] = total;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < np; i += kThreads) s_take[i] = s_rank_len[s_rank[i]];
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive prefix over ascending slots
    int off = 0;
    for (int i = 0; i < np; ++i) {
      const int t = s_take[i];
      s_take[i] = off;
      off += t;
    }
  }
  __syncthreads();
  int32_t* out = ids + static_cast<int64_t>(row) * budget;
  for (int i = threadIdx.x; i < np; i += kThreads) {
    const int page = first + s_page[i];
    const int lo = max(cb, page * page_size);
    const int take = s_rank_len[s_rank[i]];
    for (int t = 0; t < take; ++t) out[s_take[i] + t] = lo + t;
  }
  const int total = counts[row];
  for (int j = total + threadIdx.x; j < budget; j += kThreads) out[j] = -1;
}

struct Workspace {
  float* logits = nullptr;
  float* scores = nullptr;
  float2* partials = nullptr;
  float* lse = nullptr;  // [rows, group]
  int32_t* n_pages = nullptr;
  int32_t* first_page = nullptr;
  int32_t* pages = nullptr;
  int32_t* page_count = nullptr;
  size_t bytes = 0;
};

int MaxPages(const QuestSelectParams& p) {
  return p.page_size > 0 ? p.max_candidates / p.page_size + 2 : 0;
}
int PagesToPick(const QuestSelectParams& p) {
  return p.page_size > 0 ? (p.out.budget + p.page_size - 1) / p.page_size + 2 : 0;
}

Workspace Carve(const QuestSelectParams& p, char* base) {
  const size_t rows = static_cast<size_t>(p.batch) * p.n_kv_heads;
  const int group = p.n_kv_heads > 0 ? p.n_heads / p.n_kv_heads : 0;
  const size_t ld = RowLd(MaxPages(p));
  const size_t n_chunks = (static_cast<size_t>(MaxPages(p)) + kChunk - 1) / kChunk;
  Workspace w;
  internal::Carver carve(base);
  w.scores = carve.Take<float>(rows * ld);
  if (p.gqa == GqaAggregation::kSumSoftmax) {
    w.logits = carve.Take<float>(rows * group * ld);
    w.partials = carve.Take<float2>(rows * n_chunks * group);
    w.lse = carve.Take<float>(rows * group);
  }
  w.n_pages = carve.Take<int32_t>(rows);
  w.first_page = carve.Take<int32_t>(rows);
  w.pages = carve.Take<int32_t>(rows * PagesToPick(p));
  w.page_count = carve.Take<int32_t>(rows);
  w.bytes = carve.used();
  return w;
}

}  // namespace

size_t QuestSelectWorkspaceBytes(const QuestSelectParams& p) { return Carve(p, nullptr).bytes; }

absl::Status QuestSelect(const QuestSelectParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.n_kv_heads <= 0 || p.n_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      p.n_heads / p.n_kv_heads > kMaxGroup) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuestSelect: need n_heads a multiple of n_kv_heads with a group of at most ",
                     kMaxGroup, "; got n_heads ", p.n_heads, ", n_kv_heads ", p.n_kv_heads));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuestSelect: head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (p.page_size < 1 || p.out.budget < 1 || p.out.budget > kMaxBudget ||
      PagesToPick(p) > kMaxPages) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuestSelect: need page_size >= 1, budget in [1, ", kMaxBudget,
                     "] and ceil(budget / page_size) + 2 <= ", kMaxPages, "; got page_size ",
                     p.page_size, ", budget ", p.out.budget));
  }
  if (p.max_candidates < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuestSelect: max_candidates ", p.max_candidates));
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.query == nullptr || p.bounds == nullptr || p.cand.begin == nullptr ||
      p.cand.end == nullptr || p.out.ids == nullptr || p.out.counts == nullptr) {
    return absl::InvalidArgumentError("QuestSelect: null query, bounds, candidates or output");
  }
  if (p.bounds_dtype != KeyDType::kF32 && p.bounds_dtype != KeyDType::kBf16) {
    return absl::InvalidArgumentError("QuestSelect: bounds must be fp32 or bf16");
  }
  const int64_t elem = p.bounds_dtype == KeyDType::kF32 ? 4 : 2;
  if (reinterpret_cast<uintptr_t>(p.bounds) % 16 != 0 || p.bounds_batch_stride * elem % 16 != 0) {
    return absl::InvalidArgumentError(
        "QuestSelect: bounds and bounds_batch_stride must be 16-byte aligned");
  }
  Workspace w = Carve(p, static_cast<char*>(p.workspace));
  if (p.workspace == nullptr || p.workspace_bytes < w.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuestSelect: workspace of ", p.workspace_bytes, " bytes, need ", w.bytes));
  }
  const int group = p.n_heads / p.n_kv_heads;
  const int max_pages = MaxPages(p);
  const int ld = RowLd(max_pages);
  const int n_chunks = std::max(1, (max_pages + kChunk - 1) / kChunk);
  const bool softmax = p.gqa == GqaAggregation::kSumSoftmax;
  BoundsArgs a{p.n_kv_heads,
               group,
               p.page_size,
               p.scale,
               p.gqa,
               p.query,
               p.bounds,
               p.bounds_batch_stride,
               p.cand,
               ld,
               softmax ? w.logits : w.scores,
               w.partials,
               n_chunks,
               w.n_pages,
               w.first_page};
  const dim3 grid(n_chunks, p.n_kv_heads, p.batch);
  const bool bf16 = p.bounds_dtype == KeyDType::kBf16;
  auto launch = [&]<int kGroup>() {
    if (p.head_dim == 64 && bf16) {
      QuestBoundsKernel<64, __nv_bfloat16, kGroup><<<grid, kThreads, 0, stream>>>(a);
    } else if (p.head_dim == 64) {
      QuestBoundsKernel<64, float, kGroup><<<grid, kThreads, 0, stream>>>(a);
    } else if (bf16) {
      QuestBoundsKernel<128, __nv_bfloat16, kGroup><<<grid, kThreads, 0, stream>>>(a);
    } else {
      QuestBoundsKernel<128, float, kGroup><<<grid, kThreads, 0, stream>>>(a);
    }
  };
  if (group <= 4) {
    launch.template operator()<4>();
  } else {
    launch.template operator()<kMaxGroup>();
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (softmax) {
    KVR_RETURN_IF_ERROR(internal::SoftmaxAggregate(p.batch, p.n_kv_heads, group, kChunk, n_chunks,
                                                   ld, max_pages, w.logits, w.partials, w.n_pages,
                                                   w.lse, w.scores, stream));
  }
  const int pick = PagesToPick(p);
  TopKParams t;
  t.rows = p.batch * p.n_kv_heads;
  t.row_stride = ld;
  t.scores = w.scores;
  t.n_valid = w.n_pages;
  t.id_offset = nullptr;
  t.out = {pick, w.pages, w.page_count};
  KVR_RETURN_IF_ERROR(LaunchBatchedTopK(t, stream));
  QuestExpandKernel<<<t.rows, kThreads, 0, stream>>>(
      p.page_size, ld, pick, w.scores, w.pages, w.page_count, w.first_page, p.cand, p.n_kv_heads,
      p.out.budget, p.budgets, p.out.ids, p.out.counts);
  return kvr::cuda::LastLaunchStatus("QuestExpandKernel");
}

}  // namespace kvr::retrieval::cuda
