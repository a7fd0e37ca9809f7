// ctkvr: centroid recall, qcIVF list union, rerank (selection.cuh), the CPU CtkvrIndex::Select
// (retrieval/src/ctkvr.cc) without its FIFO update.
//
//  1. CtkvrCosKernel, grid (centroid chunks of 32, rows): the group's unit queries (the CPU's
//     NormaliseGroup: Norm in Dot order, division) and the cosine to each query centroid (max
//     over the group, Dot8N = the CPU's Dot, so near-equal cosines order as on the CPU; empty
//     lists -3).
//     CtkvrRecallKernel, one CTA per (sequence, KV head) row: the top C' by (cosine desc, index
//     asc); their lists' ids inside the candidate range are set in a per-row bitmap (which also
//     de-duplicates), then read back in order: the recalled set, ascending, as the CPU's sort +
//     unique.
//  2. CtkvrRerankKernel, grid (recalled chunks, n_kv_heads, batch): q.k * scale per group head
//     over the recalled keys (8 lanes per key, the CPU's Dot order), logits + chunk softmax
//     partials, or the aggregated score.
//  3. FinishRerank (rerank.cu): group aggregation, BatchedTopK, index -> token id.
// Bytes per step: the centroids (C x group x head_dim x 4: 4 MiB per KV head at C = 2048,
// Llama-3-8B) dominate; the recalled keys add C' x rho x head_dim x dtype.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "quant_common.cuh"
#include "select_common.cuh"

namespace kvr::retrieval::cuda {

namespace {

using internal::AlignUp;
using internal::kMaxGroup;

constexpr int kRecallThreads = 256;
constexpr int kRerankChunk = 256;  // recalled keys per CTA of the rerank

struct Args {
  int n_kv_heads, group, head_dim, n_recall;
  float scale;
  GqaAggregation gqa;
  const float* query;
  const float* centroids;
  const int32_t* n_centroids;
  const int32_t* offsets;
  const int32_t* lists;
  const int32_t* lengths;  // optional [rows, max_centroids]
  int max_centroids, max_list_entries;
  KeyView keys;
  CandidateRanges cand;
  float* cos;        // [rows, max_centroids]
  uint32_t* bitmap;  // [rows, words]
  int words;
  int32_t* recalled;  // [rows, ld]
  int32_t* n_recalled;
  int32_t* n_recalled_out;  // optional [rows]: the recall's count before the ld cap
  int ld;
  float* logits;     // kSumSoftmax [rows, group, ld]
  float2* partials;  // [rows, n_chunks, group]
  int n_chunks;
  float* scores;  // [rows, ld]
};

// Cosine of the group's unit queries to 32 centroids per CTA (8 lanes per dot product, the CPU's
// Dot order), max over the group, -3 for an empty list: cos [rows, max_centroids].
// End of list c of `row` (see CtkvrSelectParams::list_lengths).
__device__ __forceinline__ int ListEnd(const Args& a, const int32_t* off, int row, int c) {
  return a.lengths != nullptr ? off[c] + a.lengths[static_cast<int64_t>(row) * a.max_centroids + c]
                              : off[c + 1];
}

template <int kHeadDim>
static __global__ void __launch_bounds__(256) CtkvrCosKernel(Args a) {
  constexpr int kPerCta = 32;
  const int row = blockIdx.y;
  const int group = a.group;
  const int nc = a.n_centroids[row];
  const int c_begin = blockIdx.x * kPerCta;
  if (c_begin >= nc) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float qn[kMaxGroup * kHeadDim];
  const float* q = a.query + static_cast<int64_t>(row) * group * kHeadDim;
  for (int i = threadIdx.x; i < group * kHeadDim; i += blockDim.x) qn[i] = q[i];
  __syncthreads();
  if (warp < group) {  // NormaliseGroup: Norm in Dot order, then a division per element
    const float nrm = sqrtf(internal::Dot8N<kHeadDim>(qn + warp * kHeadDim, qn + warp * kHeadDim));
    __syncwarp();
    if (nrm > 0.f) {
      for (int i = lane; i < kHeadDim; i += 32) {
        qn[warp * kHeadDim + i] = __fdiv_rn(qn[warp * kHeadDim + i], nrm);
      }
    }
  }
  __syncthreads();
  const int32_t* off = a.offsets + static_cast<int64_t>(row) * (a.max_centroids + 1);
  const float* cent =
      a.centroids + static_cast<int64_t>(row) * a.max_centroids * group * kHeadDim;
  const int c = c_begin + warp * 4 + (lane >> 3);
  const bool valid = c < nc;
  const int cc = valid ? c : c_begin;
  float best = -2.f;
  for (int g = 0; g < group; ++g) {
    const float d = internal::Dot8N<kHeadDim>(
        qn + g * kHeadDim, cent + (static_cast<int64_t>(cc) * group + g) * kHeadDim);
    best = (best < d) ? d : best;  // std::max(best, d)
  }
  if (valid && (lane & 7) == 0) {
    a.cos[static_cast<int64_t>(row) * a.max_centroids + c] =
        ListEnd(a, off, row, c) == off[c] ? -3.f : best;
  }
}

static __global__ void __launch_bounds__(kRecallThreads) CtkvrRecallKernel(Args a) {
  const int row = blockIdx.x;
  const int b = row / a.n_kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  extern __shared__ float cosv[];  // [max_centroids]
  __shared__ int s_chosen[32];
  __shared__ int s_warp[kRecallThreads / 32];
  const int nc = a.n_centroids[row];
  const int32_t* off = a.offsets + static_cast<int64_t>(row) * (a.max_centroids + 1);
  for (int c = threadIdx.x; c < nc; c += blockDim.x) {
    cosv[c] = a.cos[static_cast<int64_t>(row) * a.max_centroids + c];
  }
  __syncthreads();
  const int n_pick = min(a.n_recall, nc);
  if (warp == 0) {
    for (int r = 0; r < n_pick; ++r) {
      float bv = -INFINITY;
      int bc = INT_MAX;
      for (int c = lane; c < nc; c += 32) {
        const float v = cosv[c];
        if (v > bv || (v == bv && c < bc)) {
          bv = v;
          bc = c;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
        const int c2 = __shfl_xor_sync(0xffffffffu, bc, o);
        if (v2 > bv || (v2 == bv && c2 < bc)) {
          bv = v2;
          bc = c2;
        }
      }
      if (lane == 0) {
        s_chosen[r] = bc;
        cosv[bc] = -INFINITY;  // below every cosine (>= -3): never picked again
      }
      __syncwarp();
    }
  }
  __syncthreads();
  const int lo = max(0, a.cand.begin[b]);
  const int hi = a.cand.end[b];
  uint32_t* bits = a.bitmap + static_cast<int64_t>(row) * a.words;  // written below: no __ldg
  const int32_t* lists = a.lists + static_cast<int64_t>(row) * a.max_list_entries;
  for (int r = 0; r < n_pick; ++r) {
    const int c = s_chosen[r];
    const int end = ListEnd(a, off, row, c);
    for (int i = off[c] + threadIdx.x; i < end; i += blockDim.x) {
      const int id = lists[i];
      if (id >= lo && id < hi) atomicOr(&bits[id >> 5], 1u << (id & 31));
    }
  }
  __syncthreads();
  int32_t* out = a.recalled + static_cast<int64_t>(row) * a.ld;
  const int w_lo = lo >> 5;
  const int w_hi = hi > lo ? min(a.words, (hi + 31) >> 5) : w_lo;
  int running = 0;
  for (int base = w_lo; base < w_hi; base += kRecallThreads) {
    const int wi = base + threadIdx.x;
    uint32_t word = wi < w_hi ? bits[wi] : 0u;
    const int pc = __popc(word);
    const int incl = internal::WarpInclusiveScanInt(pc, lane);
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int before = running;
    int total = 0;
    for (int w = 0; w < kRecallThreads / 32; ++w) {
      if (w < warp) before += s_warp[w];
      total += s_warp[w];
    }
    int pos = before + incl - pc;
    while (word != 0u) {
      const int bit = __ffs(word) - 1;
      word &= word - 1u;
      if (pos < a.ld) out[pos] = wi * 32 + bit;
      ++pos;
    }
    running += total;
    __syncthreads();  // s_warp is rewritten by the next tile
  }
  if (threadIdx.x == 0) {
    a.n_recalled[row] = min(running, a.ld);
    if (a.n_recalled_out != nullptr) a.n_recalled_out[row] = running;
  }
}

template <typename T, int kHeadDim, int kG>
static __global__ void __launch_bounds__(256) CtkvrRerankKernel(Args a) {
  constexpr int kPer = kHeadDim / 8;
  const int b = blockIdx.z, h = blockIdx.y, row = b * a.n_kv_heads + h;
  const int n = a.n_recalled[row];
  const int begin = blockIdx.x * kRerankChunk;
  if (begin >= n) return;
  const int end = min(n, begin + kRerankChunk);
  const int group = a.group;
  __shared__ float q[kG * kHeadDim];
  __shared__ float2 part[8][8];
  const float* qsrc = a.query + static_cast<int64_t>(row) * group * kHeadDim;
  for (int i = threadIdx.x; i < group * kHeadDim; i += blockDim.x) q[i] = qsrc[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = lane & 7, sub = lane >> 3;
  const int64_t head_base = a.keys.head_offset != nullptr
                                ? a.keys.head_offset[row]
                                : static_cast<int64_t>(b) * a.keys.batch_stride +
                                      static_cast<int64_t>(h) * a.keys.head_stride;
  const T* keys = static_cast<const T*>(a.keys.data) + head_base;
  const bool paged = a.keys.pool.slots != nullptr;
  const int32_t* ids = a.recalled + static_cast<int64_t>(row) * a.ld;
  const bool softmax = a.gqa == GqaAggregation::kSumSoftmax;
  float run_max = -INFINITY, run_sum = 0.f;  // statistics of group head j (lanes j < group)
  for (int base = begin; base < end; base += 32) {
    const int i = base + warp * 4 + sub;
    const bool valid = i < end;
    const int t = ids[valid ? i : begin];
    const T* k =
        paged ? static_cast<const T*>(kvr::cuda::KvPoolRow(a.keys.pool, row, t, a.keys.row_bytes))
              : keys + static_cast<int64_t>(t) * a.keys.token_stride;
    float kv[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) kv[e] = internal::Widen(k[8 * e + j]);
    float dots[kG];
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float acc = 0.f;
      if (g < group) {
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc = __fadd_rn(acc, __fmul_rn(q[g * kHeadDim + 8 * e + j], kv[e]));
      }
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 4));
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
      dots[g] = __fmul_rn(a.scale, acc);
    }
    if (!valid) continue;
    if (softmax) {
      float mine = 0.f;
#pragma unroll
      for (int g = 0; g < kG; ++g) mine = (j == g) ? dots[g] : mine;
      if (j < group) {
        a.logits[(static_cast<int64_t>(row) * group + j) * a.ld + i] = mine;
        if (mine > run_max) {
          run_sum *= __expf(run_max - mine);
          run_max = mine;
        }
        run_sum += __expf(mine - run_max);
      }
    } else if (j == 0) {
      float agg = a.gqa == GqaAggregation::kMaxLogit ? -INFINITY : 0.f;
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g < group) {
          agg = a.gqa == GqaAggregation::kMaxLogit ? fmaxf(agg, dots[g]) : __fadd_rn(agg, dots[g]);
        }
      }
      a.scores[static_cast<int64_t>(row) * a.ld + i] = agg;
    }
  }
  if (!softmax) return;
  // Lanes j, j + 8, j + 16, j + 24 hold head j's statistics: merge them, then over the warps.
#pragma unroll
  for (int o = 8; o < 32; o <<= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, run_max, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, run_sum, o);
    internal::MergeMaxSum(run_max, run_sum, m2, s2);
  }
  if (lane < 8) part[warp][lane] = make_float2(run_max, run_sum);
  __syncthreads();
  if (threadIdx.x < group) {
    const int g = threadIdx.x;
    float m = -INFINITY, s = 0.f;
    for (int w = 0; w < 8; ++w) internal::MergeMaxSum(m, s, part[w][g].x, part[w][g].y);
    a.partials[(static_cast<int64_t>(row) * a.n_chunks + blockIdx.x) * group + g] =
        make_float2(m, s);
  }
}

int Group(const CtkvrSelectParams& p) { return p.n_kv_heads > 0 ? p.n_heads / p.n_kv_heads : 0; }

int MaxRecall(const CtkvrSelectParams& p) {
  const int64_t r = static_cast<int64_t>(p.n_recall) * std::max(1, p.max_list_length);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(r, std::max(1, p.max_tokens))));
}

struct Workspace {
  float* cos = nullptr;
  uint32_t* bitmap = nullptr;
  size_t bitmap_bytes = 0;
  int words = 0;
  internal::RerankBuffers rerank;  // ids: the recalled token ids
  size_t bytes = 0;
};

Workspace Carve(const CtkvrSelectParams& p, char* base) {
  const size_t rows = static_cast<size_t>(p.batch) * p.n_kv_heads;
  const size_t group = Group(p);
  Workspace w;
  internal::Carver carve(base);
  w.cos = carve.Take<float>(rows * std::max(1, p.max_centroids));
  w.words = (std::max(1, p.max_tokens) + 31) / 32;
  w.bitmap_bytes = rows * w.words * sizeof(uint32_t);
  w.bitmap = reinterpret_cast<uint32_t*>(carve.TakeBytes(w.bitmap_bytes));
  w.rerank =
      internal::CarveRerank(carve, rows, group, MaxRecall(p), kRerankChunk, p.gqa, p.out.budget);
  w.bytes = carve.used();
  return w;
}

template <typename T, int kHeadDim>
void LaunchRerank(const Args& a, dim3 grid, cudaStream_t stream) {
  if (a.group <= 4) {
    CtkvrRerankKernel<T, kHeadDim, 4><<<grid, 256, 0, stream>>>(a);
  } else {
    CtkvrRerankKernel<T, kHeadDim, kMaxGroup><<<grid, 256, 0, stream>>>(a);
  }
}

}  // namespace

size_t CtkvrSelectWorkspaceBytes(const CtkvrSelectParams& p) { return Carve(p, nullptr).bytes; }

absl::Status CtkvrSelect(const CtkvrSelectParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.n_kv_heads <= 0 || p.n_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      Group(p) > kMaxGroup) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CtkvrSelect: need n_heads a multiple of n_kv_heads with a group of at most ", kMaxGroup,
        "; got ", p.n_heads, " / ", p.n_kv_heads));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("CtkvrSelect: head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (p.out.budget < 1 || p.out.budget > kMaxBudget) {
    return absl::InvalidArgumentError(
        absl::StrCat("CtkvrSelect: budget must be in [1, ", kMaxBudget, "], got ", p.out.budget));
  }
  if (p.n_recall < 1 || p.n_recall > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("CtkvrSelect: n_recall (C') must be in [1, 32], got ", p.n_recall));
  }
  if (p.max_centroids < 1 || p.max_list_entries < 1 || p.max_tokens < 1 ||
      p.max_list_length < 0) {
    return absl::InvalidArgumentError(
        "CtkvrSelect: max_centroids, max_list_entries and max_tokens must be >= 1");
  }
  const bool paged = p.keys.pool.slots != nullptr;
  if (paged && (!kvr::cuda::KvPoolViewSet(p.keys.pool) || p.keys.pool.n_kv_heads != p.n_kv_heads ||
                p.keys.row_bytes % 16 != 0 ||
                p.keys.row_bytes <
                    static_cast<int64_t>(p.head_dim) * (p.keys.dtype == KeyDType::kF32 ? 4 : 2))) {
    return absl::InvalidArgumentError(
        "CtkvrSelect: paged keys need a set pool of n_kv_heads heads and rows of a 16-byte "
        "multiple holding head_dim keys");
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.query == nullptr || p.centroids == nullptr || p.n_centroids == nullptr ||
      p.list_offsets == nullptr || p.lists == nullptr || (!paged && p.keys.data == nullptr) ||
      p.cand.begin == nullptr || p.cand.end == nullptr || p.out.ids == nullptr ||
      p.out.counts == nullptr) {
    return absl::InvalidArgumentError("CtkvrSelect: null query, summary, keys, candidates or output");
  }
  const int group = Group(p);
  const size_t recall_smem = static_cast<size_t>(p.max_centroids) * sizeof(float);
  if (recall_smem > 200 * 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("CtkvrSelect: max_centroids ", p.max_centroids, " is too large"));
  }
  const Workspace w = Carve(p, static_cast<char*>(p.workspace));
  if (p.workspace == nullptr || p.workspace_bytes < w.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("CtkvrSelect: workspace of ", p.workspace_bytes, " bytes, need ", w.bytes));
  }
  Args a;
  a.n_kv_heads = p.n_kv_heads;
  a.group = group;
  a.head_dim = p.head_dim;
  a.n_recall = p.n_recall;
  a.scale = p.scale;
  a.gqa = p.gqa;
  a.query = p.query;
  a.centroids = p.centroids;
  a.n_centroids = p.n_centroids;
  a.offsets = p.list_offsets;
  a.lists = p.lists;
  a.lengths = p.list_lengths;
  a.max_centroids = p.max_centroids;
  a.max_list_entries = p.max_list_entries;
  a.keys = p.keys;
  a.cand = p.cand;
  a.cos = w.cos;
  a.bitmap = w.bitmap;
  a.words = w.words;
  a.recalled = w.rerank.ids;
  a.n_recalled = w.rerank.n_valid;
  a.n_recalled_out = p.n_recalled;
  a.ld = w.rerank.ld;
  a.logits = w.rerank.logits;
  a.partials = w.rerank.partials;
  a.n_chunks = w.rerank.n_chunks;
  a.scores = w.rerank.scores;
  const int rows = p.batch * p.n_kv_heads;
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(w.bitmap, 0, w.bitmap_bytes, stream));
  const dim3 cos_grid((p.max_centroids + 31) / 32, rows);
  if (p.head_dim == 64) {
    CtkvrCosKernel<64><<<cos_grid, 256, 0, stream>>>(a);
  } else {
    CtkvrCosKernel<128><<<cos_grid, 256, 0, stream>>>(a);
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  KVR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      CtkvrRecallKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(recall_smem)));
  CtkvrRecallKernel<<<rows, kRecallThreads, recall_smem, stream>>>(a);
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const dim3 grid(w.rerank.n_chunks, p.n_kv_heads, p.batch);
  KVR_RETURN_IF_ERROR(internal::DispatchKeyType(p.keys.dtype, [&]<typename T>() {
    return internal::DispatchHeadDim(p.head_dim, [&]<int D>() {
      LaunchRerank<T, D>(a, grid, stream);
      return absl::OkStatus();
    });
  }));
  KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("CtkvrRerankKernel"));
  return internal::FinishRerank(p.batch, p.n_kv_heads, group, p.gqa, MaxRecall(p), kRerankChunk,
                                w.rerank, p.out, stream);
}

}  // namespace kvr::retrieval::cuda
