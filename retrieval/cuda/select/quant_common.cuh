#pragma once
// Pieces shared by the pariskv, ctkvr and a2ats selectors (private to kvr::retrieval_cuda_select).
//
// CPU operation order. Where the CPU reference makes a discrete choice from a float (a ParisKV
// magnitude level, a collision tier, a centroid rank), the GPU repeats the CPU's arithmetic in the
// same order with the same roundings, so that the choice is the same: `__fmul_rn` / `__fadd_rn`
// keep nvcc from contracting a * b + c into an FMA (the CPU build has no FMA: no -march), and
// Dot8 reproduces kvr::retrieval::Dot (ops.cc: eight interleaved partial sums, combined as
// ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kvr/retrieval/cuda/dot8.cuh"  // Dot8, Dot8N, Widen
#include "kvr/retrieval/cuda/kernel_util.cuh"  // Carver
#include "kvr/retrieval/cuda/selection.cuh"

namespace kvr::retrieval::cuda::internal {

// kvr::retrieval::Dot(x, x, n) of a thread-local array, n <= 8 (n = 8: the eight partial sums
// combined; n < 8: the CPU's tail loop from +0).
template <int kN>
__device__ __forceinline__ float SelfDotCpuOrder(const float* x) {
  if constexpr (kN == 8) {
    float a[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = __fadd_rn(0.f, __fmul_rn(x[j], x[j]));
    return __fadd_rn(__fadd_rn(__fadd_rn(a[0], a[4]), __fadd_rn(a[1], a[5])),
                     __fadd_rn(__fadd_rn(a[2], a[6]), __fadd_rn(a[3], a[7])));
  } else {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) s = __fadd_rn(s, __fmul_rn(x[j], x[j]));
    return s;
  }
}

// Order-preserving 64-bit sort key "score descending, id ascending" (as CollisionBonus builds
// it): bits of -score mapped to an unsigned order, above the id.
__device__ __forceinline__ uint64_t DescendingKey(float score, uint32_t id) {
  const float neg = -score + 0.f;  // + 0.f folds -0 into +0
  uint32_t bits = __float_as_uint(neg);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | id;
}

__device__ __forceinline__ int WarpInclusiveScanInt(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Block-wide exclusive prefix sum of `local` (one value per thread, in thread order), through
// `s_warp` [32] in shared memory. Every thread of the block calls it (it synchronises twice).
__device__ __forceinline__ int BlockExclusiveScanInt(int local, int* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int incl = WarpInclusiveScanInt(local, lane);
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int v = s_warp[lane];
    const int wi = WarpInclusiveScanInt(v, lane);
    s_warp[lane] = wi - v;
  }
  __syncthreads();
  return s_warp[warp] + incl - local;
}

struct CompactShared {
  int warp_a[32];
  int warp_b[32];
};

// Ordered compaction of items [0, n) by the whole CTA (kThreads, a multiple of 32): `cls(i)`
// returns 0 (drop), 1 (class A: always kept) or 2 (class B: kept when its rank among the class-B
// items, in index order, is in [b_lo, b_hi)). Kept items are passed to emit(pos, i) with pos their
// rank among the kept items (ascending i). Returns the number kept (every thread). cls must be
// deterministic (it is called twice per item).
template <int kThreads, typename Cls, typename Emit>
__device__ int OrderedCompact(int n, Cls cls, int b_lo, int b_hi, Emit emit, CompactShared& s) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  n = n > 0 ? n : 0;
  const int seg = (n + kWarps - 1) / kWarps;
  const int w_begin = min(n, warp * seg), w_end = min(n, (warp + 1) * seg);
  int ca = 0, cb = 0;
  for (int i = w_begin + lane; i < w_end; i += 32) {
    const int c = cls(i);
    ca += c == 1;
    cb += c == 2;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ca += __shfl_xor_sync(0xffffffffu, ca, o);
    cb += __shfl_xor_sync(0xffffffffu, cb, o);
  }
  __syncthreads();  // s may still be read by a previous call
  if (lane == 0) {
    s.warp_a[warp] = ca;
    s.warp_b[warp] = cb;
  }
  __syncthreads();
  int total_a = 0, total_b = 0, a_before = 0, b_before = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) {
      a_before = total_a;
      b_before = total_b;
    }
    total_a += s.warp_a[w];
    total_b += s.warp_b[w];
  }
  auto b_taken = [b_lo, b_hi](int ranks_below) {  // class-B items kept among ranks [0, r)
    return max(0, min(ranks_below, b_hi) - b_lo);
  };
  int taken_before = a_before + b_taken(b_before);
  const unsigned lt = (1u << lane) - 1u;
  for (int j0 = w_begin; j0 < w_end; j0 += 32) {
    const int i = j0 + lane;
    const int c = i < w_end ? cls(i) : 0;
    const unsigned ball_b = __ballot_sync(0xffffffffu, c == 2);
    const int rank_b = b_before + __popc(ball_b & lt);
    const bool take = c == 1 || (c == 2 && rank_b >= b_lo && rank_b < b_hi);
    const unsigned ball_t = __ballot_sync(0xffffffffu, take);
    if (take) emit(taken_before + __popc(ball_t & lt), i);
    taken_before += __popc(ball_t);
    b_before += __popc(ball_b);
  }
  return total_a + b_taken(total_b);
}

// SplitMix64 (retrieval/src/srht.cc): the ParisKV rotation signs are drawn from it, so the GPU
// reproduces the CPU's rotation from the seed alone.
inline uint64_t SplitMix64NextHost(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The SRHT's 2 x P signs as bits (set = -1), [round][P / 32] words, exactly Srht::Create.
struct SrhtSigns {
  uint32_t bits[2][4];  // P <= 128
};
inline SrhtSigns MakeSrhtSigns(uint64_t seed, int padded_dim) {
  SrhtSigns s{};
  uint64_t state = seed;
  const int total = 2 * padded_dim;
  for (int i = 0; i < total; i += 64) {
    const uint64_t bits = SplitMix64NextHost(state);
    for (int j = 0; j < 64 && i + j < total; ++j) {
      if ((bits >> j) & 1) {
        const int idx = i + j, round = idx / padded_dim, coord = idx % padded_dim;
        s.bits[round][coord >> 5] |= 1u << (coord & 31);
      }
    }
  }
  return s;
}

// The buffers of a rerank (pariskv, ctkvr): the items of each row (ascending token ids, up to
// ld of them), their per-head logits and chunk partials (kSumSoftmax), the aggregated scores and
// the top-k workspace.
struct RerankBuffers {
  int ld = 0;                  // items per row (row stride of logits / scores / ids)
  int32_t* ids = nullptr;      // [rows, ld] item -> token id, ascending per row
  int32_t* n_valid = nullptr;  // [rows]
  int n_chunks = 0;            // chunk partials per row
  float* logits = nullptr;     // kSumSoftmax: [rows, group, ld]
  float2* partials = nullptr;  // kSumSoftmax: [rows, n_chunks, group]
  float* lse = nullptr;        // kSumSoftmax: [rows, group]
  float* scores = nullptr;     // [rows, ld] (written by FinishRerank for kSumSoftmax, else input)
  void* topk = nullptr;
  size_t topk_bytes = 0;
};
// Takes the RerankBuffers of `rows` rows of at most max_items items (chunk items per partial,
// top `budget`) from `carve`, after whatever the caller carved before.
RerankBuffers CarveRerank(Carver& carve, size_t rows, size_t group, int max_items, int chunk,
                          GqaAggregation gqa, int budget);  // rerank.cu

// The tail of a rerank: per-item logits of every group head are written; this aggregates them
// over the group (kSumSoftmax: LseKernel + SoftmaxAggregateKernel over the chunk partials), takes
// the top `out.budget` with BatchedTopK and maps the chosen item indices to token ids through
// b.ids (ascending per row, so the output stays ascending). max_items: the largest n_valid.
absl::Status FinishRerank(int batch, int n_kv_heads, int group, GqaAggregation gqa, int max_items,
                          int chunk, const RerankBuffers& b, const SelectionOutput& out,
                          cudaStream_t stream);  // rerank.cu

}  // namespace kvr::retrieval::cuda::internal
