// pariskv: GPU encode and selection (selection.cuh), the CPU ParisKvIndex (retrieval/src/
// pariskv.cc, pariskv_codes.cc, srht.cc) step for step.
//
// Encode (ParisEncodeKernel): P / m lanes per key, lane b owns subspace b (m coordinates in
// registers). Key norm by Dot8 (the CPU's Dot order), the two SRHT rounds (signs from the seed's
// SplitMix64 stream; Walsh-Hadamard butterflies inside the lane for strides < m, across lanes by
// shuffles above: every butterfly is the CPU's a + b / a - b), 1 / P, / |k|, then per subspace the
// CPU's Norm, nearest magnitude level, alpha and weight. No operation is fused or reordered, so
// codes and weights are the CPU's bytes; each token also adds to the centroid counts.
//
// Select, per (sequence, KV head) row:
//  1. ParisQueryKernel, grid (B, group, rows): the group head's |q| and rotated unit query (SRHT
//     in shared memory, CPU order), the 2^m centroid scores of subspace b (AllCentroidDots'
//     chain of flips), their rank by (score desc, id asc) among non-empty centroids, the count
//     prefix in rank order and the tier bonus (CollisionBonus): bonus [rows, group, B, 2^m].
//  2. ParisCollisionKernel, grid (token chunks, n_kv_heads, batch): the group-summed bonus table
//     in shared memory; per candidate token the sum over subspaces of table[b][centroid id]
//     (ids read off the sign bits, four subspaces' worth of bits per 32-bit word), written as
//     uint16, and a histogram of those scores ([rows, group * tiers * B + 1]).
//  3. ParisCandidatesKernel, one CTA per row: the bucket top-k threshold from the histogram
//     (suffix sums) and an ordered compaction: every token above it, then the first `take` at
//     it, in position order: the C candidates, ascending.
//  4. ParisRerankKernel, grid (candidate chunks, n_kv_heads, batch): per group head the LUT
//     value(code) * xq[p] ([group, P, 16] in shared memory), eq. (10) per candidate in the CPU's
//     order, logits (+ chunk softmax partials) or the aggregated score.
//  5. FinishRerank (rerank.cu): group aggregation, BatchedTopK, candidate index -> token id.
// Bytes per step: codes P / 2 per selectable token and KV head (64 at d = 128) for the vote, and
// codes + weights (P / 2 + 2B = 96) for the C candidates (5-10% of the context).

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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

constexpr int kEncodeThreads = 256;
constexpr int kTokChunk = 2048;  // tokens per CTA of the collision kernel
constexpr int kRerankChunk = 256;
constexpr int kCandThreads = 1024;

struct Levels {
  float v[8];
};

// ---- encode ----------------------------------------------------------------------------------

struct EncodeArgs {
  int n_tokens;
  int head_dim;
  const void* keys;  // float or bf16 bits (the kernel's K)
  int64_t key_token_stride;
  int64_t key_head_stride;
  int first;
  uint8_t* codes;
  int64_t codes_head_stride;
  uint16_t* weights;
  int64_t weights_head_stride;
  uint32_t* counts;
  internal::SrhtSigns signs;
  Levels levels;
};

template <int P, int M>
__device__ __forceinline__ void SrhtLane(float (&x)[M], int sub, const internal::SrhtSigns& signs) {
#pragma unroll
  for (int round = 0; round < 2; ++round) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const int c = sub * M + i;
      if ((signs.bits[round][c >> 5] >> (c & 31)) & 1u) x[i] = -x[i];
    }
#pragma unroll
    for (int half = 1; half < M; half <<= 1) {
#pragma unroll
      for (int block = 0; block < M; block += 2 * half) {
#pragma unroll
        for (int j = block; j < block + half; ++j) {
          const float a = x[j], b = x[j + half];
          x[j] = __fadd_rn(a, b);
          x[j + half] = __fsub_rn(a, b);
        }
      }
    }
#pragma unroll
    for (int half = M; half < P; half <<= 1) {
      const int o = half / M;  // lane distance of the partner subspace
      const bool upper = (sub & o) != 0;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, x[i], o);
        x[i] = upper ? __fsub_rn(other, x[i]) : __fadd_rn(x[i], other);
      }
    }
  }
  const float inv = 1.f / static_cast<float>(P);
#pragma unroll
  for (int i = 0; i < M; ++i) x[i] = __fmul_rn(x[i], inv);
}

template <int P, int M, typename K>
static __global__ void __launch_bounds__(kEncodeThreads) ParisEncodeKernel(EncodeArgs a) {
  constexpr int kB = P / M;  // lanes per key
  constexpr int kKeysPerWarp = 32 / kB;
  constexpr int kNc = 1 << M;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % kB, slot = lane / kB;
  const int h = blockIdx.y;
  const int t = (blockIdx.x * (kEncodeThreads / 32) + warp) * kKeysPerWarp + slot;
  const bool valid = t < a.n_tokens;
  const int tc = valid ? t : a.n_tokens - 1;  // every lane runs the shuffles
  const K* key = static_cast<const K*>(a.keys) + static_cast<int64_t>(tc) * a.key_token_stride +
                 static_cast<int64_t>(h) * a.key_head_stride;
  const float norm = sqrtf(internal::Dot8(key, key, a.head_dim));
  float x[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const int c = sub * M + i;
    x[i] = c < a.head_dim ? internal::Widen(key[c]) : 0.f;
  }
  SrhtLane<P, M>(x, sub, a.signs);
  if (norm > 0.f) {
#pragma unroll
    for (int i = 0; i < M; ++i) x[i] = __fdiv_rn(x[i], norm);
  }
  const float r = sqrtf(internal::SelfDotCpuOrder<M>(x));
  uint32_t packed = 0;
  uint32_t id = 0;
  float weight = 0.f;
  if (r > 1e-20f) {
    float alpha = 0.f;
#pragma unroll
    for (int j = 0; j < M; ++j) {
      const float u = __fdiv_rn(x[j], r);
      const float tt = fabsf(u);
      int best = 0;
      float best_err = fabsf(__fsub_rn(tt, a.levels.v[0]));
#pragma unroll
      for (int l = 1; l < 8; ++l) {
        const float err = fabsf(__fsub_rn(tt, a.levels.v[l]));
        if (err < best_err) {
          best_err = err;
          best = l;
        }
      }
      const bool neg = u < 0.f;
      packed |= static_cast<uint32_t>(best | (neg ? 8 : 0)) << (4 * j);
      id |= static_cast<uint32_t>(neg) << j;
      alpha = __fadd_rn(alpha, __fmul_rn(a.levels.v[best], tt));
    }
    weight = __fdiv_rn(__fmul_rn(norm, r), alpha);
    if (65504.f < weight) weight = 65504.f;  // std::min(w, kMaxFp16)
  }
  if (!valid) return;
  const int64_t pos = static_cast<int64_t>(a.first) + t;
  uint8_t* code_dst = a.codes + h * a.codes_head_stride + pos * (P / 2) + sub * (M / 2);
  if constexpr (M == 8) {
    *reinterpret_cast<uint32_t*>(code_dst) = packed;
  } else if constexpr (M == 4) {
    *reinterpret_cast<uint16_t*>(code_dst) = static_cast<uint16_t>(packed);
  } else {
    *code_dst = static_cast<uint8_t>(packed);
  }
  a.weights[h * a.weights_head_stride + pos * kB + sub] =
      __half_as_ushort(__float2half_rn(weight));
  if (a.counts != nullptr) {
    atomicAdd(a.counts + (static_cast<int64_t>(h) * kB + sub) * kNc + id, 1u);
  }
}

// ---- select ----------------------------------------------------------------------------------

struct Sched {
  int n_candidates;
  double rho;
};

// ScheduleParisKv (pariskv.cc) in double on the device.
__device__ Sched Schedule(int n_sel, int budget, double candidate_ratio, double collision_ratio,
                          int tiers, int min_per_budget) {
  Sched s{0, 0.0};
  if (n_sel <= 0) return s;
  double beta = candidate_ratio;
  if (beta <= 0) {
    const double k_short = 16384, k_long = 131072;
    const double n = static_cast<double>(n_sel);
    if (n <= k_short) {
      beta = 0.10;
    } else if (n >= k_long) {
      beta = 0.05;
    } else {
      beta = 0.10 - 0.05 * log(n / k_short) / log(k_long / k_short);
    }
  }
  const int64_t by_ratio = static_cast<int64_t>(ceil(beta * n_sel));
  const int64_t by_budget = static_cast<int64_t>(budget) * min_per_budget;
  int64_t c = by_ratio > by_budget ? by_ratio : by_budget;
  c = c > budget ? c : budget;
  c = c < n_sel ? c : n_sel;
  s.n_candidates = static_cast<int>(c);
  const double eff = static_cast<double>(c) / n_sel;
  const double rho = tiers > 1 ? tiers * eff : 2 * eff;
  s.rho = collision_ratio > 0 ? collision_ratio : (rho < 1.0 ? rho : 1.0);
  return s;
}

struct SelectArgs {
  int n_kv_heads, group, budget;
  float scale;
  GqaAggregation gqa;
  int tiers, min_per_budget;
  double candidate_ratio, collision_ratio;
  int head_dim;
  internal::SrhtSigns signs;
  Levels levels;
  const float* query;
  const uint8_t* codes;
  const uint16_t* weights;
  const uint32_t* counts;
  const int32_t* n_tokens;
  int max_tokens;
  CandidateRanges cand;
  // workspace
  float* xq;        // [rows, group, P]
  float* qnorm;     // [rows, group]
  uint8_t* bonus;   // [rows, group, B, 2^m]
  int32_t* hist;    // [rows, n_bins]
  int n_bins;
  uint16_t* score16;  // [rows, ld16]
  int ld16;
  int32_t* cand_ids;  // [rows, ldc]
  int32_t* n_cand;    // [rows]
  int ldc;
  float* logits;      // kSumSoftmax [rows, group, ldc]
  float2* partials;   // [rows, n_rchunks, group]
  int n_rchunks;
  float* scores;      // [rows, ldc]
};

__device__ __forceinline__ void RowRange(const SelectArgs& a, int b, int& lo, int& n_sel) {
  lo = max(0, a.cand.begin[b]);
  const int hi = min(a.cand.end[b], a.n_tokens[b]);
  n_sel = max(0, hi - lo);
}

template <int P, int M>
static __global__ void __launch_bounds__(256) ParisQueryKernel(SelectArgs a) {
  constexpr int kB = P / M;
  constexpr int kNc = 1 << M;
  const int sb = blockIdx.x, g = blockIdx.y, row = blockIdx.z;
  const int b = row / a.n_kv_heads, h = row % a.n_kv_heads;
  __shared__ float x[P];
  __shared__ float q[P];
  __shared__ uint64_t keys[kNc];
  __shared__ int by_rank[kNc];
  __shared__ long long prefix[kNc];
  __shared__ float qn;
  const int tid = threadIdx.x;
  const float* qsrc = a.query + (static_cast<int64_t>(b) * a.n_kv_heads * a.group +
                                 static_cast<int64_t>(h) * a.group + g) * a.head_dim;
  for (int i = tid; i < P; i += blockDim.x) q[i] = i < a.head_dim ? qsrc[i] : 0.f;
  __syncthreads();
  if (tid < 32) {
    const float d = internal::Dot8(q, q, a.head_dim);
    if (tid == 0) qn = sqrtf(d);
  }
  __syncthreads();
  const float qnorm = qn;
  for (int i = tid; i < P; i += blockDim.x) {
    x[i] = (i < a.head_dim && qnorm > 0.f) ? __fdiv_rn(q[i], qnorm) : 0.f;
  }
  __syncthreads();
  for (int round = 0; round < 2; ++round) {
    for (int i = tid; i < P; i += blockDim.x) {
      if ((a.signs.bits[round][i >> 5] >> (i & 31)) & 1u) x[i] = -x[i];
    }
    __syncthreads();
    for (int half = 1; half < P; half <<= 1) {
      for (int t = tid; t < P / 2; t += blockDim.x) {
        const int j = (t / half) * 2 * half + t % half;
        const float u = x[j], v = x[j + half];
        x[j] = __fadd_rn(u, v);
        x[j + half] = __fsub_rn(u, v);
      }
      __syncthreads();
    }
  }
  const float inv_p = 1.f / static_cast<float>(P);
  for (int i = tid; i < P; i += blockDim.x) x[i] = __fmul_rn(x[i], inv_p);
  __syncthreads();
  if (sb == 0) {
    for (int i = tid; i < P; i += blockDim.x) {
      a.xq[(static_cast<int64_t>(row) * a.group + g) * P + i] = x[i];
    }
    if (tid == 0) a.qnorm[static_cast<int64_t>(row) * a.group + g] = qnorm;
  }
  // Centroid scores of subspace sb (AllCentroidDots): s0 = sum(x) / sqrt(m), then each set bit j
  // (ascending) subtracts 2 x_j / sqrt(m).
  const float* xs = x + sb * M;
  const float inv_sqrt_m = 1.f / sqrtf(static_cast<float>(M));
  const uint32_t* cnt = a.counts + (static_cast<int64_t>(row) * kB + sb) * kNc;
  for (int c = tid; c < kNc; c += blockDim.x) {
    float all = 0.f;
#pragma unroll
    for (int j = 0; j < M; ++j) all = __fadd_rn(all, xs[j]);
    float s = __fmul_rn(all, inv_sqrt_m);
#pragma unroll
    for (int j = 0; j < M; ++j) {
      if ((c >> j) & 1) s = __fsub_rn(s, __fmul_rn(__fmul_rn(2.f, xs[j]), inv_sqrt_m));
    }
    keys[c] = cnt[c] > 0 ? internal::DescendingKey(s, c) : ~0ull;
  }
  __syncthreads();
  int my_rank[(kNc + 255) / 256];
  for (int c = tid, k = 0; c < kNc; c += blockDim.x, ++k) {
    const uint64_t key = keys[c];
    int r = 0;
    for (int o = 0; o < kNc; ++o) r += keys[o] < key;
    my_rank[k] = r;
    if (key != ~0ull) by_rank[r] = static_cast<int>(cnt[c]);
  }
  int n_nonempty = 0;
  for (int o = 0; o < kNc; ++o) n_nonempty += keys[o] != ~0ull;
  __syncthreads();
  if (tid < 32) {  // exclusive prefix of the counts in rank order: a warp scan
    constexpr int kPer = (kNc + 31) / 32;
    const int first = tid * kPer;
    long long local = 0;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (first + e < n_nonempty) local += by_rank[first + e];
    }
    long long incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const long long u = __shfl_up_sync(0xffffffffu, incl, o);
      if (tid >= o) incl += u;
    }
    long long running = incl - local;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (first + e < n_nonempty) {
        prefix[first + e] = running;
        running += by_rank[first + e];
      }
    }
  }
  __syncthreads();
  int lo = 0, n_sel = 0;
  RowRange(a, b, lo, n_sel);
  const Sched sched = Schedule(n_sel, a.budget, a.candidate_ratio, a.collision_ratio, a.tiers,
                               a.min_per_budget);
  const double rho_keys = sched.rho * static_cast<double>(a.n_tokens[b]);
  const double slice = (rho_keys > 1.0 ? rho_keys : 1.0) / a.tiers;
  uint8_t* out = a.bonus + ((static_cast<int64_t>(row) * a.group + g) * kB + sb) * kNc;
  for (int c = tid, k = 0; c < kNc; c += blockDim.x, ++k) {
    int bonus = 0;
    if (keys[c] != ~0ull) {
      const int tier = static_cast<int>(static_cast<double>(prefix[my_rank[k]]) / slice);
      bonus = tier < a.tiers ? a.tiers - tier : 0;
    }
    out[c] = static_cast<uint8_t>(bonus);
  }
}

// Row t of kN 32-bit words (rows of kN / 4 uint4, kN a multiple of 4) in 16-byte loads.
template <int kN>
__device__ __forceinline__ void LoadRow(const uint4* rows, int t, uint32_t (&w)[kN]) {
#pragma unroll
  for (int v = 0; v < kN / 4; ++v) {
    const uint4 u = __ldg(rows + static_cast<int64_t>(t) * (kN / 4) + v);
    w[4 * v] = u.x;
    w[4 * v + 1] = u.y;
    w[4 * v + 2] = u.z;
    w[4 * v + 3] = u.w;
  }
}

// Sign bits of the 8 codes in a 32-bit word (coordinate 2i: bit 3 of byte i, 2i + 1: bit 7) as
// an 8-bit id (bit j = coordinate j negative), as CentroidIdFromPacked.
__device__ __forceinline__ uint32_t SignByte(uint32_t w) {
  uint32_t x = (w >> 3) & 0x11111111u;
  x = (x | (x >> 3)) & 0x03030303u;
  x = (x | (x >> 6)) & 0x000F000Fu;
  x = (x | (x >> 12)) & 0xFFu;
  return x;
}

template <int P, int M>
static __global__ void __launch_bounds__(256) ParisCollisionKernel(SelectArgs a) {
  constexpr int kB = P / M;
  constexpr int kNc = 1 << M;
  constexpr int kWords = P / 8;  // 32-bit words of codes per token
  constexpr int kPerWord = 8 / M;
  const int b = blockIdx.z, h = blockIdx.y, row = b * a.n_kv_heads + h;
  int lo = 0, n_sel = 0;
  RowRange(a, b, lo, n_sel);
  const int begin = blockIdx.x * kTokChunk;
  if (begin >= n_sel) return;
  const int end = min(n_sel, begin + kTokChunk);
  extern __shared__ int smem[];
  int* hist = smem;                                                // [n_bins]
  uint16_t* table = reinterpret_cast<uint16_t*>(smem + a.n_bins);  // [B, 2^m]
  for (int i = threadIdx.x; i < a.n_bins; i += blockDim.x) hist[i] = 0;
  // Group-summed bonus table, four centroids per 32-bit load (bonus bytes never exceed 32, so
  // the per-byte sums are taken separately).
  const uint32_t* bonus = reinterpret_cast<const uint32_t*>(
      a.bonus + static_cast<int64_t>(row) * a.group * kB * kNc);
  for (int e4 = threadIdx.x; e4 < kB * kNc / 4; e4 += blockDim.x) {
    int s[4] = {0, 0, 0, 0};
    for (int g = 0; g < a.group; ++g) {
      const uint32_t w = bonus[static_cast<int64_t>(g) * (kB * kNc / 4) + e4];
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] += (w >> (8 * k)) & 0xFFu;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) table[4 * e4 + k] = static_cast<uint16_t>(s[k]);
  }
  __syncthreads();
  const uint4* codes = reinterpret_cast<const uint4*>(
      a.codes + static_cast<int64_t>(row) * a.max_tokens * (P / 2));
  uint16_t* out = a.score16 + static_cast<int64_t>(row) * a.ld16;
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += blockDim.x) {  // uniform trip count (warp atomics)
    const int i = base + threadIdx.x;
    const bool valid = i < end;
    const int t = lo + (valid ? i : begin);
    uint32_t w[kWords];
    LoadRow(codes, t, w);
    uint32_t total = 0;
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      const uint32_t id8 = SignByte(w[k]);
#pragma unroll
      for (int s = 0; s < kPerWord; ++s) {
        const int sb = k * kPerWord + s;
        total += table[sb * kNc + ((id8 >> (s * M)) & (kNc - 1))];
      }
    }
    // Scores of neighbouring tokens share few values: lanes with the same score add once.
    const unsigned active = __ballot_sync(0xffffffffu, valid);
    if (valid) {
      out[i] = static_cast<uint16_t>(total);
      const unsigned same = __match_any_sync(active, total);
      if (lane == __ffs(same) - 1) atomicAdd(&hist[total], __popc(same));
    }
  }
  __syncthreads();
  int32_t* ghist = a.hist + static_cast<int64_t>(row) * a.n_bins;
  for (int i = threadIdx.x; i < a.n_bins; i += blockDim.x) {
    if (hist[i] != 0) atomicAdd(&ghist[i], hist[i]);
  }
}

static __global__ void __launch_bounds__(kCandThreads) ParisCandidatesKernel(SelectArgs a) {
  const int row = blockIdx.x;
  const int b = row / a.n_kv_heads;
  int lo = 0, n_sel = 0;
  RowRange(a, b, lo, n_sel);
  const Sched sched = Schedule(n_sel, a.budget, a.candidate_ratio, a.collision_ratio, a.tiers,
                               a.min_per_budget);
  const int c_target = sched.n_candidates;
  if (c_target <= 0) {
    if (threadIdx.x == 0) a.n_cand[row] = 0;
    return;
  }
  extern __shared__ int hist[];  // [n_bins]
  __shared__ int s_warp[32];
  __shared__ int s_thr;
  __shared__ int s_above;
  __shared__ internal::CompactShared cs;
  const int n_bins = a.n_bins;
  const int32_t* ghist = a.hist + static_cast<int64_t>(row) * n_bins;
  for (int i = threadIdx.x; i < n_bins; i += blockDim.x) hist[i] = ghist[i];
  if (threadIdx.x == 0) {
    s_thr = 0;
    s_above = 0;
  }
  __syncthreads();
  // Thread k owns the bins [top - (k + 1) * per + 1, top - k * per] (descending score order).
  const int per = (n_bins + kCandThreads - 1) / kCandThreads;
  const int top = n_bins - 1 - threadIdx.x * per;
  int local = 0;
  for (int j = 0; j < per; ++j) {
    const int s = top - j;
    if (s >= 0) local += hist[s];
  }
  // The CPU walks down from the top while the scores above plus this bucket stay below C: the
  // threshold is the largest s >= 1 with suffix(s) >= C, else 0.
  int suffix = internal::BlockExclusiveScanInt(local, s_warp);
  for (int j = 0; j < per; ++j) {
    const int s = top - j;
    if (s < 0) break;
    suffix += hist[s];
    if (s >= 1 && suffix >= c_target) {
      atomicMax(&s_thr, s);
      break;
    }
  }
  __syncthreads();
  const int thr = s_thr;
  int above = 0;
  for (int j = 0; j < per; ++j) {
    const int s = top - j;
    if (s > thr) above += hist[s];
  }
  if (above != 0) atomicAdd(&s_above, above);
  __syncthreads();
  const int take = c_target - s_above;
  const uint16_t* sc = a.score16 + static_cast<int64_t>(row) * a.ld16;
  int32_t* out = a.cand_ids + static_cast<int64_t>(row) * a.ldc;
  const int ldc = a.ldc;
  const int n = internal::OrderedCompact<kCandThreads>(
      n_sel,
      [sc, thr](int i) {
        const int s = sc[i];
        return s > thr ? 1 : (s == thr ? 2 : 0);
      },
      0, take,
      [out, lo, ldc](int pos, int i) {
        if (pos < ldc) out[pos] = lo + i;
      },
      cs);
  if (threadIdx.x == 0) a.n_cand[row] = min(n, ldc);
}

template <int P, int M, int kG>
static __global__ void __launch_bounds__(256) ParisRerankKernel(SelectArgs a) {
  constexpr int kB = P / M;
  constexpr int kWords = P / 8;
  const int b = blockIdx.z, h = blockIdx.y, row = b * a.n_kv_heads + h;
  const int n = a.n_cand[row];
  const int begin = blockIdx.x * kRerankChunk;
  if (begin >= n) return;
  const int end = min(n, begin + kRerankChunk);
  const int group = a.group;
  extern __shared__ float lut[];  // [group, P, 16]
  __shared__ float2 part[8][kMaxGroup];
  for (int e = threadIdx.x; e < group * P * 16; e += blockDim.x) {
    const int g = e / (P * 16), p = (e / 16) % P, code = e % 16;
    const float mag = a.levels.v[code & 7];
    const float dec = (code & 8) ? -mag : mag;
    lut[e] = __fmul_rn(dec, a.xq[(static_cast<int64_t>(row) * group + g) * P + p]);
  }
  float qs[kG];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    qs[g] = g < group ? __fmul_rn(a.scale, a.qnorm[static_cast<int64_t>(row) * group + g]) : 0.f;
  }
  __syncthreads();
  const bool softmax = a.gqa == GqaAggregation::kSumSoftmax;
  float run_max[kG], run_sum[kG];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    run_max[g] = -INFINITY;
    run_sum[g] = 0.f;
  }
  const int32_t* cand = a.cand_ids + static_cast<int64_t>(row) * a.ldc;
  const uint4* codes = reinterpret_cast<const uint4*>(
      a.codes + static_cast<int64_t>(row) * a.max_tokens * (P / 2));
  const uint4* weights = reinterpret_cast<const uint4*>(
      a.weights + static_cast<int64_t>(row) * a.max_tokens * kB);
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int t = cand[i];
    uint32_t w[kWords];
    LoadRow(codes, t, w);
    uint32_t wt[kB / 2];  // fp16 pairs
    LoadRow(weights, t, wt);
    float est[kG];
#pragma unroll
    for (int g = 0; g < kG; ++g) est[g] = 0.f;
#pragma unroll
    for (int sb = 0; sb < kB; ++sb) {
      const uint16_t wbits = static_cast<uint16_t>(wt[sb >> 1] >> ((sb & 1) * 16));
      const float wf = __half2float(__ushort_as_half(wbits));
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g < group) {
          const float* lg = lut + (g * P + sb * M) * 16;
          float dot = 0.f;
#pragma unroll
          for (int i2 = 0; i2 < M / 2; ++i2) {
            const int byte_idx = sb * (M / 2) + i2;
            const uint32_t byte = (w[byte_idx >> 2] >> ((byte_idx & 3) * 8)) & 0xFFu;
            dot = __fadd_rn(dot, __fadd_rn(lg[(2 * i2) * 16 + (byte & 0xF)],
                                           lg[(2 * i2 + 1) * 16 + (byte >> 4)]));
          }
          est[g] = __fadd_rn(est[g], __fmul_rn(wf, dot));
        }
      }
    }
    if (softmax) {
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g < group) {
          const float l = __fmul_rn(qs[g], est[g]);
          a.logits[(static_cast<int64_t>(row) * group + g) * a.ldc + i] = l;
          internal::AddToMaxSum(run_max[g], run_sum[g], l);
        }
      }
    } else {
      float agg = a.gqa == GqaAggregation::kMaxLogit ? -INFINITY : 0.f;
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (g < group) {
          const float l = __fmul_rn(qs[g], est[g]);
          agg = a.gqa == GqaAggregation::kMaxLogit ? fmaxf(agg, l) : __fadd_rn(agg, l);
        }
      }
      a.scores[static_cast<int64_t>(row) * a.ldc + i] = agg;
    }
  }
  if (!softmax) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int g = 0; g < kG; ++g) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, run_max[g], o);
      const float s2 = __shfl_xor_sync(0xffffffffu, run_sum[g], o);
      internal::MergeMaxSum(run_max[g], run_sum[g], m2, s2);
    }
    if (lane == 0) part[warp][g] = make_float2(run_max[g], run_sum[g]);
  }
  __syncthreads();
  if (threadIdx.x < group) {
    const int g = threadIdx.x;
    float m = -INFINITY, s = 0.f;
    for (int w = 0; w < 8; ++w) internal::MergeMaxSum(m, s, part[w][g].x, part[w][g].y);
    a.partials[(static_cast<int64_t>(row) * a.n_rchunks + blockIdx.x) * group + g] =
        make_float2(m, s);
  }
}

// ---- host ------------------------------------------------------------------------------------

int Group(const ParisKvSelectParams& p) { return p.n_kv_heads > 0 ? p.n_heads / p.n_kv_heads : 0; }
int Subspaces(const ParisKvCodec& c) { return c.subspace_dim > 0 ? c.padded_dim / c.subspace_dim : 0; }
int Centroids(const ParisKvCodec& c) { return 1 << c.subspace_dim; }
int Bins(const ParisKvSelectParams& p) { return Group(p) * p.tiers * Subspaces(p.codec) + 1; }

// Upper bound of C over every candidate count <= max_candidates (ScheduleParisKv: beta <= 0.10
// when scheduled, and C grows with the count).
int MaxCandidates(const ParisKvSelectParams& p) {
  const double beta = p.candidate_ratio > 0 ? p.candidate_ratio : 0.10;
  const int64_t by_ratio = static_cast<int64_t>(std::ceil(beta * p.max_candidates));
  const int64_t by_budget = static_cast<int64_t>(p.out.budget) * p.min_candidates_per_budget;
  const int64_t c = std::max<int64_t>({by_ratio, by_budget, p.out.budget});
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(p.max_candidates, c)));
}

struct Workspace {
  float* xq = nullptr;
  float* qnorm = nullptr;
  uint8_t* bonus = nullptr;
  int32_t* hist = nullptr;
  size_t hist_bytes = 0;
  uint16_t* score16 = nullptr;
  int ld16 = 0;
  internal::RerankBuffers rerank;  // ids: the candidates' token ids
  size_t bytes = 0;
};

Workspace Carve(const ParisKvSelectParams& p, char* base) {
  const size_t rows = static_cast<size_t>(p.batch) * p.n_kv_heads;
  const size_t group = Group(p);
  const size_t pd = p.codec.padded_dim;
  Workspace w;
  internal::Carver carve(base);
  w.xq = carve.Take<float>(rows * group * pd);
  w.qnorm = carve.Take<float>(rows * group);
  w.bonus = carve.Take<uint8_t>(rows * group * Subspaces(p.codec) *
                                static_cast<size_t>(Centroids(p.codec)));
  w.hist_bytes = rows * Bins(p) * sizeof(int32_t);
  w.hist = reinterpret_cast<int32_t*>(carve.TakeBytes(w.hist_bytes));
  w.ld16 = (std::max(1, p.max_candidates) + 7) / 8 * 8;
  w.score16 = carve.Take<uint16_t>(rows * w.ld16);
  w.rerank = internal::CarveRerank(carve, rows, group, MaxCandidates(p), kRerankChunk, p.gqa,
                                   p.out.budget);
  w.bytes = carve.used();
  return w;
}

absl::Status CheckCodec(const ParisKvCodec& c, const char* who) {
  if (c.head_dim != 64 && c.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": head_dim must be 64 or 128, got ", c.head_dim));
  }
  if (c.padded_dim != c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": padded_dim ", c.padded_dim,
                                                   " != head_dim ", c.head_dim));
  }
  if ((c.subspace_dim != 2 && c.subspace_dim != 4 && c.subspace_dim != 8) ||
      c.padded_dim / c.subspace_dim > 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": subspace_dim must be 2, 4 or 8 with padded_dim / subspace_dim <= 32, got m = ",
        c.subspace_dim, ", P = ", c.padded_dim));
  }
  return absl::OkStatus();
}

Levels LevelsOf(const ParisKvCodec& c) {
  Levels l;
  for (int i = 0; i < 8; ++i) l.v[i] = c.levels[i];
  return l;
}

// Calls fn.template operator()<P, M>() for the codec's (P, m).
template <typename Fn>
absl::Status DispatchCodec(const ParisKvCodec& c, Fn&& fn) {
  const int key = c.padded_dim * 16 + c.subspace_dim;
  switch (key) {
    case 64 * 16 + 8: fn.template operator()<64, 8>(); break;
    case 64 * 16 + 4: fn.template operator()<64, 4>(); break;
    case 64 * 16 + 2: fn.template operator()<64, 2>(); break;
    case 128 * 16 + 8: fn.template operator()<128, 8>(); break;
    case 128 * 16 + 4: fn.template operator()<128, 4>(); break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("pariskv: unsupported (P, m) = (",
                                                     c.padded_dim, ", ", c.subspace_dim, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParisKvCodecSupported(const ParisKvCodec& codec) {
  return CheckCodec(codec, "pariskv on the GPU");
}

absl::Status ParisKvEncode(const ParisKvEncodeParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(CheckCodec(p.codec, "ParisKvEncode"));
  if (p.n_tokens < 0 || p.n_kv_heads <= 0 || p.first < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ParisKvEncode: n_tokens ", p.n_tokens,
                                                   ", n_kv_heads ", p.n_kv_heads, ", first ",
                                                   p.first));
  }
  const KeyView& k = p.keys;
  if (k.dtype != KeyDType::kF32 && k.dtype != KeyDType::kBf16) {
    return absl::InvalidArgumentError("ParisKvEncode: keys.dtype must be kF32 or kBf16");
  }
  if (kvr::cuda::KvPoolViewSet(k.pool) || k.head_offset != nullptr) {
    return absl::InvalidArgumentError("ParisKvEncode: keys must not be paged or offset per head");
  }
  if (p.n_tokens == 0) return absl::OkStatus();
  if (k.data == nullptr || p.codes == nullptr || p.weights == nullptr ||
      k.head_stride < p.codec.head_dim ||
      k.token_stride < static_cast<int64_t>(p.n_kv_heads) * k.head_stride) {
    return absl::InvalidArgumentError(
        "ParisKvEncode: null keys / codes / weights, keys.head_stride < head_dim or "
        "keys.token_stride < n_kv_heads * head_stride");
  }
  const int sub = Subspaces(p.codec);
  if (reinterpret_cast<uintptr_t>(p.codes) % 4 != 0 || p.codes_head_stride % 4 != 0) {
    return absl::InvalidArgumentError("ParisKvEncode: codes must be 4-byte aligned");
  }
  EncodeArgs a{p.n_tokens,       p.codec.head_dim,
               k.data,           k.token_stride,
               k.head_stride,    p.first,
               p.codes,          p.codes_head_stride,
               p.weights,        p.weights_head_stride,
               p.counts,         internal::MakeSrhtSigns(p.codec.rotation_seed, p.codec.padded_dim),
               LevelsOf(p.codec)};
  const int keys_per_cta = (kEncodeThreads / 32) * (32 / sub);
  const dim3 grid((p.n_tokens + keys_per_cta - 1) / keys_per_cta, p.n_kv_heads);
  KVR_RETURN_IF_ERROR(DispatchCodec(p.codec, [&]<int P, int M>() {
    if (k.dtype == KeyDType::kBf16) {
      ParisEncodeKernel<P, M, uint16_t><<<grid, kEncodeThreads, 0, stream>>>(a);
    } else {
      ParisEncodeKernel<P, M, float><<<grid, kEncodeThreads, 0, stream>>>(a);
    }
  }));
  return kvr::cuda::LastLaunchStatus("ParisEncodeKernel");
}

size_t ParisKvSelectWorkspaceBytes(const ParisKvSelectParams& p) {
  return Carve(p, nullptr).bytes;
}

absl::Status ParisKvSelect(const ParisKvSelectParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(CheckCodec(p.codec, "ParisKvSelect"));
  if (p.batch < 0 || p.n_kv_heads <= 0 || p.n_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      Group(p) > kMaxGroup) {
    return absl::InvalidArgumentError(
        absl::StrCat("ParisKvSelect: need n_heads a multiple of n_kv_heads with a group of at "
                     "most ",
                     kMaxGroup, "; got ", p.n_heads, " / ", p.n_kv_heads));
  }
  if (p.out.budget < 1 || p.out.budget > kMaxBudget) {
    return absl::InvalidArgumentError(
        absl::StrCat("ParisKvSelect: budget must be in [1, ", kMaxBudget, "], got ", p.out.budget));
  }
  if (p.tiers < 1 || p.tiers > 32 || p.min_candidates_per_budget < 1 ||
      p.candidate_ratio < 0 || p.candidate_ratio > 1 || p.collision_ratio < 0 ||
      p.collision_ratio > 1) {
    return absl::InvalidArgumentError("ParisKvSelect: tiers / ratios out of range (pariskv.h)");
  }
  if (p.max_candidates < 0 || p.max_tokens < 0) {
    return absl::InvalidArgumentError("ParisKvSelect: negative max_candidates / max_tokens");
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.query == nullptr || p.codes == nullptr || p.weights == nullptr || p.counts == nullptr ||
      p.n_tokens == nullptr || p.cand.begin == nullptr || p.cand.end == nullptr ||
      p.out.ids == nullptr || p.out.counts == nullptr) {
    return absl::InvalidArgumentError("ParisKvSelect: null query, summary, candidates or output");
  }
  const Workspace w = Carve(p, static_cast<char*>(p.workspace));
  if (p.workspace == nullptr || p.workspace_bytes < w.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ParisKvSelect: workspace of ", p.workspace_bytes, " bytes, need ", w.bytes));
  }
  const int group = Group(p);
  const int rows = p.batch * p.n_kv_heads;
  SelectArgs a;
  a.n_kv_heads = p.n_kv_heads;
  a.group = group;
  a.budget = p.out.budget;
  a.scale = p.scale;
  a.gqa = p.gqa;
  a.tiers = p.tiers;
  a.min_per_budget = p.min_candidates_per_budget;
  a.candidate_ratio = p.candidate_ratio;
  a.collision_ratio = p.collision_ratio;
  a.head_dim = p.codec.head_dim;
  a.signs = internal::MakeSrhtSigns(p.codec.rotation_seed, p.codec.padded_dim);
  a.levels = LevelsOf(p.codec);
  a.query = p.query;
  a.codes = p.codes;
  a.weights = p.weights;
  a.counts = p.counts;
  a.n_tokens = p.n_tokens;
  a.max_tokens = p.max_tokens;
  a.cand = p.cand;
  a.xq = w.xq;
  a.qnorm = w.qnorm;
  a.bonus = w.bonus;
  a.hist = w.hist;
  a.n_bins = Bins(p);
  a.score16 = w.score16;
  a.ld16 = w.ld16;
  a.cand_ids = w.rerank.ids;
  a.n_cand = w.rerank.n_valid;
  a.ldc = w.rerank.ld;
  a.logits = w.rerank.logits;
  a.partials = w.rerank.partials;
  a.n_rchunks = w.rerank.n_chunks;
  a.scores = w.rerank.scores;
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(w.hist, 0, w.hist_bytes, stream));
  const int n_sub = Subspaces(p.codec);
  const int n_tok_chunks = std::max(1, (p.max_candidates + kTokChunk - 1) / kTokChunk);
  const size_t coll_smem = a.n_bins * sizeof(int) + n_sub * Centroids(p.codec) * sizeof(uint16_t);
  const size_t lut_smem = static_cast<size_t>(group) * p.codec.padded_dim * 16 * sizeof(float);
  absl::Status launch = absl::OkStatus();
  KVR_RETURN_IF_ERROR(DispatchCodec(p.codec, [&]<int P, int M>() {
    ParisQueryKernel<P, M><<<dim3(P / M, group, rows), 256, 0, stream>>>(a);
    ParisCollisionKernel<P, M>
        <<<dim3(n_tok_chunks, p.n_kv_heads, p.batch), 256, coll_smem, stream>>>(a);
    ParisCandidatesKernel<<<rows, kCandThreads, a.n_bins * sizeof(int), stream>>>(a);
    const dim3 rgrid(w.rerank.n_chunks, p.n_kv_heads, p.batch);
    if (group <= 4) {
      const cudaError_t e = cudaFuncSetAttribute(ParisRerankKernel<P, M, 4>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(lut_smem));
      if (e != cudaSuccess) launch = kvr::cuda::CudaStatus(e, "ParisRerankKernel smem");
      ParisRerankKernel<P, M, 4><<<rgrid, 256, lut_smem, stream>>>(a);
    } else {
      const cudaError_t e = cudaFuncSetAttribute(ParisRerankKernel<P, M, kMaxGroup>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(lut_smem));
      if (e != cudaSuccess) launch = kvr::cuda::CudaStatus(e, "ParisRerankKernel smem");
      ParisRerankKernel<P, M, kMaxGroup><<<rgrid, 256, lut_smem, stream>>>(a);
    }
  }));
  KVR_RETURN_IF_ERROR(launch);
  KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("ParisKvSelect kernels"));
  return internal::FinishRerank(p.batch, p.n_kv_heads, group, p.gqa, MaxCandidates(p), kRerankChunk,
                                w.rerank, p.out, stream);
}

}  // namespace kvr::retrieval::cuda
