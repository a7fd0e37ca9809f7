// CTKVR qcIVF build (build.cuh, CtkvrBuild): the last C prefill queries become unit query
// centroids, and per centroid and KV head the top-rho listable keys by max-over-group softmax
// probability form its list (CPU reference: CtkvrIndex::Build, retrieval/src/ctkvr.cc).
//
// Steps (all on `stream`, no host synchronisation):
//   1. CentroidPrepKernel   gathers the C_b queries of every (b, h, c, g) into an fp32 buffer
//                           (the GEMM operand) and writes the unit centroids of the summary with
//                           the CPU's Norm order (8 partial sums, no FMA): bit-equal centroids.
//   2. LayoutKernel         n_centroids and list_offsets (every list of b has rho_b entries).
//   3. QkTileKernel<kStats> logits of 128 query rows (128 / group centroids x the group) against
//                           spans of 1024 listable keys on tensor cores (3xTF32 as
//                           argmax_gemm.cuh, the query tile split once per CTA; 16-bit keys
//                           are exact tf32: two products); per query row and span a running
//                           (max, sum exp).
//   4. LseKernel            per query row log-sum-exp over its spans.
//   5. per chunk of centroids:
//      QkTileKernel<kScores> the same logits again, score = max_g (logit - lse_g) (the log of
//                           the CPU's max-over-group softmax probability: same order) into a
//                           [rows, listable] buffer;
//      BatchedTopK          (selection.cuh) the top rho of each row, ascending ids, ties to the
//                           lower token (as TopKIndices);
//      CompactKernel        rows into the lists at c * rho_b.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "argmax_gemm.cuh"
#include "build_common.cuh"
#include "kvr/common/status.h"
#include "kvr/retrieval/cuda/build.cuh"
#include "kvr/retrieval/cuda/dot8.cuh"
#include "kvr/retrieval/cuda/selection.cuh"

namespace kvr::retrieval::cuda {
namespace {

using build_internal::Carver;
using build_internal::CheckKeys;
using build_internal::DispatchHeadDim;
using build_internal::DispatchKeyType;
using build_internal::Invalid;
using build_internal::KeyBase;
using build_internal::LaunchStatus;
using build_internal::LoadKey;
using build_internal::LoadSplitA;
using build_internal::Mma3xTf32Step;
using build_internal::SplitTf32;
using build_internal::ZeroMmaAcc;

constexpr const char* kOp = "CtkvrBuild";
constexpr int kBm = 128;  // query rows per CTA (128 / group whole centroids)
constexpr int kBn = 128;  // keys per tile
constexpr int kSpanTiles = 8;
constexpr int kSpanKeys = kBn * kSpanTiles;  // keys per CTA
constexpr int kThreads = 256;
constexpr int kLt = kBn + 1;  // logits tile pitch
constexpr int64_t kAutoScoreFloats = int64_t{64} << 20;  // 256 MiB of fp32 scores per chunk

// Per-sequence plan rows (CtkvrBuildPlan::per_seq).
struct Seq {
  int first, listable, n_centroids, len, query_first;
};
__device__ __forceinline__ Seq LoadSeq(const int32_t* per_seq, int batch, int b) {
  return {per_seq[b], per_seq[batch + b], per_seq[2 * batch + b], per_seq[3 * batch + b],
          per_seq[4 * batch + b]};
}

int CentroidsPerTile(int group) { return kBm / group; }

absl::Status CudaError(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

struct Geometry {
  int group = 0, cpt = 0, chunk = 0, n_spans = 0, rows_bh = 0;
  int64_t score_stride = 0;
  int chunk_rows = 0;  // batch * n_kv_heads * chunk
};

Geometry MakeGeometry(const CtkvrBuildParams& p) {
  Geometry g;
  g.group = p.n_heads / p.n_kv_heads;
  g.cpt = CentroidsPerTile(g.group);
  g.rows_bh = p.batch * p.n_kv_heads;
  g.n_spans = (p.max_listable + kSpanKeys - 1) / kSpanKeys;
  g.score_stride = (static_cast<int64_t>(p.max_listable) + 3) / 4 * 4;
  const int all = (p.max_centroids + g.cpt - 1) / g.cpt * g.cpt;
  int chunk = p.centroid_chunk;
  if (chunk <= 0) {
    const int64_t fit = kAutoScoreFloats / (static_cast<int64_t>(g.rows_bh) * g.score_stride);
    chunk = static_cast<int>(std::min<int64_t>(all, std::max<int64_t>(g.cpt, fit)));
  }
  chunk = std::min(chunk, all);
  g.chunk = (chunk + g.cpt - 1) / g.cpt * g.cpt;
  g.chunk_rows = g.rows_bh * g.chunk;
  return g;
}

struct Buffers {
  float* q = nullptr;        // [rows_bh, max_centroids * group, D] raw queries
  float2* partial = nullptr;  // [rows_bh, max_centroids * group, n_spans] (max, sum exp)
  float* lse = nullptr;       // [rows_bh, max_centroids * group]
  float* scores = nullptr;    // [chunk_rows, score_stride]
  int32_t* n_valid = nullptr;    // [chunk_rows]
  int32_t* id_offset = nullptr;  // [chunk_rows]
  int32_t* top_ids = nullptr;    // [chunk_rows, max_list_length]
  int32_t* top_counts = nullptr;  // [chunk_rows]
  void* topk_ws = nullptr;
  size_t topk_ws_bytes = 0;
};

TopKParams TopKFor(const CtkvrBuildParams& p, const Geometry& g, const Buffers& w) {
  TopKParams t;
  t.rows = g.chunk_rows;
  t.row_stride = g.score_stride;
  t.scores = w.scores;
  t.n_valid = w.n_valid;
  t.id_offset = w.id_offset;
  t.out = {p.max_list_length, w.top_ids, w.top_counts};
  return t;
}

size_t Carve(const CtkvrBuildParams& p, const Geometry& g, void* base, Buffers* w) {
  Carver c(base);
  const size_t qrows = static_cast<size_t>(g.rows_bh) * p.max_centroids * g.group;
  w->q = c.Take<float>(qrows * p.head_dim);
  w->partial = c.Take<float2>(qrows * g.n_spans);
  w->lse = c.Take<float>(qrows);
  w->scores = c.Take<float>(static_cast<size_t>(g.chunk_rows) * g.score_stride);
  w->n_valid = c.Take<int32_t>(g.chunk_rows);
  w->id_offset = c.Take<int32_t>(g.chunk_rows);
  w->top_ids = c.Take<int32_t>(static_cast<size_t>(g.chunk_rows) * p.max_list_length);
  w->top_counts = c.Take<int32_t>(g.chunk_rows);
  w->topk_ws_bytes = BatchedTopKWorkspaceBytes(TopKFor(p, g, *w));
  w->topk_ws = c.TakeBytes(w->topk_ws_bytes);
  return c.used();
}

// ---- 1. centroids -----------------------------------------------------------------------------
// grid (max_centroids, rows_bh), 256 threads: warp w handles group members g = w, w + 8, ...
template <int D, typename T>
__global__ void __launch_bounds__(256)
    CentroidPrepKernel(KeyView queries, const int32_t* __restrict__ per_seq, int batch,
                       int n_kv_heads, int n_heads, int group, int max_centroids,
                       float* __restrict__ qbuf, float* __restrict__ centroids,
                       float* __restrict__ norms) {
  const int c = blockIdx.x, bh = blockIdx.y;
  const int b = bh / n_kv_heads, h = bh % n_kv_heads;
  const Seq s = LoadSeq(per_seq, batch, b);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int kPer = D / 32;
  for (int g = warp; g < group; g += 8) {
    const size_t at = ((static_cast<size_t>(bh) * max_centroids + c) * group + g) * D;
    if (c >= s.n_centroids) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        qbuf[at + lane + 32 * i] = 0.f;
        centroids[at + lane + 32 * i] = 0.f;
      }
      continue;
    }
    const int64_t base = KeyBase(queries, b, h * group + g, n_heads) +
                         static_cast<int64_t>(s.query_first + c) * queries.token_stride;
    float v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      v[i] = LoadKey<T>(queries.data, base + lane + 32 * i);
      qbuf[at + lane + 32 * i] = v[i];
    }
    // Norm as kvr::retrieval::Norm (ops.cc): partial j sums elements j, j + 8, ... in order.
    float acc = 0.f;
    if (lane < 8) {
      for (int i = 0; i < D; i += 8) {
        const float x = LoadKey<T>(queries.data, base + i + lane);
        acc = __fadd_rn(acc, __fmul_rn(x, x));
      }
    }
    float a[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = __shfl_sync(0xffffffffu, acc, j);
    const float ss = __fadd_rn(__fadd_rn(__fadd_rn(a[0], a[4]), __fadd_rn(a[1], a[5])),
                               __fadd_rn(__fadd_rn(a[2], a[6]), __fadd_rn(a[3], a[7])));
    const float norm = sqrtf(ss);
    if (norms != nullptr && lane == 0) norms[at / D] = norm;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      float out = v[i];
      if (s.listable <= 0) {
        out = 0.f;  // the CPU keeps empty entries: zero centroids in the layout
      } else if (norm > 0.f) {
        out = __fdiv_rn(v[i], norm);
      }
      centroids[at + lane + 32 * i] = out;
    }
  }
}

// ---- 6. the insertion thresholds ----------------------------------------------------------------
// grid (max_centroids, rows_bh), 256 threads, 8 lanes per listed key: the smallest over the list
// of max_g scale * Dot(q_g, k) with the queries as given (qbuf) and Dot's order of sums.
template <int D, typename T>
__global__ void __launch_bounds__(256)
    ThresholdKernel(KeyView keys, const int32_t* __restrict__ per_seq, int batch, int n_kv_heads,
                    int group, int max_centroids, int64_t max_list_entries, float scale,
                    const float* __restrict__ qbuf, const int32_t* __restrict__ lists,
                    float* __restrict__ thresholds) {
  const int c = blockIdx.x, bh = blockIdx.y;
  const int b = bh / n_kv_heads, h = bh % n_kv_heads;
  const Seq s = LoadSeq(per_seq, batch, b);
  float* out = thresholds + static_cast<int64_t>(bh) * max_centroids + c;
  if (c >= s.n_centroids) return;
  if (s.listable <= 0 || s.len <= 0) {
    if (threadIdx.x == 0) *out = 0.f;
    return;
  }
  const int slot = threadIdx.x >> 3;
  const float* q = qbuf + (static_cast<size_t>(bh) * max_centroids + c) * group * D;
  const int32_t* list = lists + bh * max_list_entries + static_cast<int64_t>(c) * s.len;
  const int64_t head = KeyBase(keys, b, h, n_kv_heads);
  float low = INFINITY;
  for (int base = 0; base < s.len; base += 32) {
    const int i = base + slot;
    const int t = list[i < s.len ? i : 0];
    const int64_t k0 = head + static_cast<int64_t>(t) * keys.token_stride;
    float best = -INFINITY;
    for (int g = 0; g < group; ++g) {
      const float dot = internal::Dot8N<D>(q + g * D, static_cast<const T*>(keys.data) + k0);
      best = fmaxf(best, __fmul_rn(scale, dot));
    }
    if (i < s.len) low = fminf(low, best);
  }
  for (int o = 16; o > 0; o >>= 1) low = fminf(low, __shfl_xor_sync(0xffffffffu, low, o));
  __shared__ float warp_low[8];
  if ((threadIdx.x & 31) == 0) warp_low[threadIdx.x >> 5] = low;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = INFINITY;
    for (int w = 0; w < 8; ++w) m = fminf(m, warp_low[w]);
    *out = m;
  }
}

// ---- 2. n_centroids, list_offsets ---------------------------------------------------------------
__global__ void LayoutKernel(const int32_t* __restrict__ per_seq, int batch, int n_kv_heads,
                             int max_centroids, int32_t* __restrict__ n_centroids,
                             int32_t* __restrict__ offsets) {
  const int64_t total = static_cast<int64_t>(batch) * n_kv_heads * (max_centroids + 1);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int bh = static_cast<int>(i / (max_centroids + 1));
    const int c = static_cast<int>(i % (max_centroids + 1));
    const Seq s = LoadSeq(per_seq, batch, bh / n_kv_heads);
    offsets[i] = min(c, s.n_centroids) * s.len;
    if (c == 0) n_centroids[bh] = s.n_centroids;
  }
}

// ---- 3. / 5. logits tiles -----------------------------------------------------------------------
struct QkArgs {
  int batch = 0, n_kv_heads = 0, group = 0, cpt = 0, max_centroids = 0;
  int c0 = 0, cc = 0;  // centroids [c0, c0 + cc) (cc a multiple of cpt)
  float scale = 0.f;
  const float* q = nullptr;
  KeyView keys;
  const int32_t* per_seq = nullptr;
  int n_spans = 0;
  float2* partial = nullptr;  // stats
  const float* lse = nullptr;  // scores
  float* scores = nullptr;
  int64_t score_stride = 0;
};

// Shared memory: the query tile pre-split into tf32 big / small halves (once per CTA), the key
// tile, and the 128 x 128 logits tile aliased onto the key tile (used after the mma).
template <int D>
constexpr int QkKeyRegionFloats() {
  return kBn * (D + 4) > kBm * kLt ? kBn * (D + 4) : kBm * kLt;
}
template <int D>
constexpr size_t QkSmemBytes() {
  return sizeof(float) *
         (2 * static_cast<size_t>(kBm) * (D + 4) + QkKeyRegionFloats<D>() + kBm);
}

// 16 bytes of keys as floats.
template <typename T>
__device__ __forceinline__ void RawToFloats(const uint4& r, float* out);
template <>
__device__ __forceinline__ void RawToFloats<float>(const uint4& r, float* out) {
  out[0] = __uint_as_float(r.x);
  out[1] = __uint_as_float(r.y);
  out[2] = __uint_as_float(r.z);
  out[3] = __uint_as_float(r.w);
}
template <>
__device__ __forceinline__ void RawToFloats<__nv_bfloat16>(const uint4& r, float* out) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void RawToFloats<__half>(const uint4& r, float* out) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
    out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
  }
}

// grid (n_spans, cc / cpt, rows_bh), 256 threads (8 warps as 2 (queries) x 4 (keys), warp tile
// 64 x 32, mma m16n8k8 tf32 as argmax_gemm.cuh: 3xTF32 for fp32 keys; for bf16 / fp16 keys the
// key is exactly a tf32 value (its small half is 0), so the big.small product is dropped: the
// same sums, two mma instead of three).
// kVec: keys 16-byte aligned (host-checked, no head_offset): 16-byte loads of the next key tile
// are issued before the current tile's mma (register prefetch); else scalar loads.
template <int D, typename T, bool kStats, bool kVec>
__global__ void __launch_bounds__(kThreads, 1) QkTileKernel(const QkArgs a) {
  constexpr int kLd = D + 4;
  constexpr bool kKey16 = !std::is_same_v<T, float>;
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));  // elements per 16 bytes
  constexpr int kChunksPerKey = D / kPerChunk;
  constexpr int kIters = kBn * kChunksPerKey / kThreads;  // 16-byte loads per thread per tile
  static_assert(kBn * kChunksPerKey % kThreads == 0);
  extern __shared__ __align__(16) float smem[];
  uint32_t* xb = reinterpret_cast<uint32_t*>(smem);  // [kBm][kLd] tf32 big halves of queries
  uint32_t* xsm = xb + kBm * kLd;                     // [kBm][kLd] small halves
  float* cs = smem + 2 * kBm * kLd;                   // [kBn][kLd] keys
  float* lt = cs;                                     // [kBm][kLt] logits (after the mma)
  float* lse_s = cs + QkKeyRegionFloats<D>();         // [kBm]
  const int bh = blockIdx.z;
  const int b = bh / a.n_kv_heads, h = bh % a.n_kv_heads;
  const Seq s = LoadSeq(a.per_seq, a.batch, b);
  const int cbeg = a.c0 + blockIdx.y * a.cpt;
  const int cend = min(s.n_centroids, a.c0 + a.cc);
  if (cbeg >= cend || s.listable <= 0) return;
  const int nc_here = min(a.cpt, cend - cbeg);
  const int rows_here = nc_here * a.group;
  const int span = blockIdx.x;
  const int k_begin = span * kSpanKeys;
  if (k_begin >= s.listable) return;
  const int k_end = min(s.listable, k_begin + kSpanKeys);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 4, wn = warp % 4;
  const int g8 = lane / 4, t4 = lane % 4;
  const int64_t qrow0 = static_cast<int64_t>(bh) * a.max_centroids * a.group +
                        static_cast<int64_t>(cbeg) * a.group;

  for (int idx = tid; idx < kBm * (D / 4); idx += kThreads) {
    const int m = idx / (D / 4), d4 = idx % (D / 4);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < rows_here) v = *reinterpret_cast<const float4*>(a.q + (qrow0 + m) * D + d4 * 4);
    const float vv[4] = {v.x, v.y, v.z, v.w};
    uint4 big, small;
    SplitTf32(vv[0], big.x, small.x);
    SplitTf32(vv[1], big.y, small.y);
    SplitTf32(vv[2], big.z, small.z);
    SplitTf32(vv[3], big.w, small.w);
    *reinterpret_cast<uint4*>(xb + m * kLd + d4 * 4) = big;
    *reinterpret_cast<uint4*>(xsm + m * kLd + d4 * 4) = small;
  }
  if constexpr (!kStats) {
    for (int m = tid; m < kBm; m += kThreads) lse_s[m] = m < rows_here ? a.lse[qrow0 + m] : 0.f;
  }
  const int64_t kbase = KeyBase(a.keys, b, h, a.n_kv_heads) +
                        static_cast<int64_t>(s.first) * a.keys.token_stride;
  const T* kptr = static_cast<const T*>(a.keys.data) + kbase;
  // Running (max, sum exp) of row tid / 2 over key half tid % 2 of every tile (stats).
  float run_m = -INFINITY, run_s = 0.f;
  const int my_row = tid >> 1, my_half = tid & 1;

  uint4 pre[kVec ? kIters : 1];
  const auto prefetch = [&](int n0) {
    const int nv = min(kBn, k_end - n0);
#pragma unroll
    for (int r = 0; r < kIters; ++r) {
      const int idx = tid + r * kThreads;
      const int kn = idx / kChunksPerKey, ch = idx % kChunksPerKey;
      pre[r] = make_uint4(0u, 0u, 0u, 0u);
      if (kn < nv) {
        pre[r] = *reinterpret_cast<const uint4*>(
            kptr + static_cast<int64_t>(n0 + kn) * a.keys.token_stride + ch * kPerChunk);
      }
    }
  };
  if constexpr (kVec) prefetch(k_begin);

  for (int n0 = k_begin; n0 < k_end; n0 += kBn) {
    const int n_valid = min(kBn, k_end - n0);
    __syncthreads();  // previous logits tile (aliasing the key tile) consumed
    if constexpr (kVec) {
#pragma unroll
      for (int r = 0; r < kIters; ++r) {
        const int idx = tid + r * kThreads;
        const int kn = idx / kChunksPerKey, ch = idx % kChunksPerKey;
        float f[kPerChunk];
        RawToFloats<T>(pre[r], f);
#pragma unroll
        for (int e = 0; e < kPerChunk; e += 4) {
          *reinterpret_cast<float4*>(cs + kn * kLd + ch * kPerChunk + e) =
              make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
        }
      }
    } else {
      for (int idx = tid; idx < kBn * D; idx += kThreads) {
        const int kn = idx / D, d = idx % D;
        float v = 0.f;
        if (kn < n_valid) {
          v = LoadKey<T>(a.keys.data,
                         kbase + static_cast<int64_t>(n0 + kn) * a.keys.token_stride + d);
        }
        cs[kn * kLd + d] = v;
      }
    }
    __syncthreads();
    if constexpr (kVec) {
      if (n0 + kBn < k_end) prefetch(n0 + kBn);  // in flight during the mma
    }
    float acc[4][4][4];
    ZeroMmaAcc(acc);
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 8) {
      uint32_t ab[4][4], as[4][4], bb[4][2], bs[4][2];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int o = (wm * 64 + mt * 16 + g8) * kLd + k0 + t4;
        LoadSplitA(xb, xsm, o, kLd, ab[mt], as[mt]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* p0 = cs + (wn * 32 + nt * 8 + g8) * kLd + k0 + t4;
        if constexpr (kKey16) {
          bb[nt][0] = __float_as_uint(p0[0]);  // exactly tf32: small half 0
          bb[nt][1] = __float_as_uint(p0[4]);
        } else {
          SplitTf32(p0[0], bb[nt][0], bs[nt][0]);
          SplitTf32(p0[4], bb[nt][1], bs[nt][1]);
        }
      }
      Mma3xTf32Step<!kKey16>(acc, ab, as, bb, bs);
    }
    __syncthreads();  // every warp done with the key tile: the logits tile overwrites it
    // acc[mt][nt][hh * 2 + j]: query row wm*64 + mt*16 + hh*8 + g8, key wn*32 + nt*8 + 2*t4 + j.
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int m = wm * 64 + mt * 16 + hh * 8 + g8;
            const int kk = wn * 32 + nt * 8 + 2 * t4 + j;
            lt[m * kLt + kk] = acc[mt][nt][hh * 2 + j] * a.scale;
          }
    __syncthreads();
    if constexpr (kStats) {
      const int lo = my_half * (kBn / 2), hi = min(lo + kBn / 2, n_valid);
      if (my_row < rows_here && hi > lo) {
        const float* row = lt + my_row * kLt;
        float m = -INFINITY;
        for (int k = lo; k < hi; ++k) m = fmaxf(m, row[k]);
        float sum = 0.f;
        for (int k = lo; k < hi; ++k) sum += expf(row[k] - m);
        if (m > run_m) {
          run_s = run_s * expf(run_m - m) + sum;  // run_m = -inf: 0 * 0
          run_m = m;
        } else {
          run_s += sum * expf(m - run_m);
        }
      }
    } else {
      const int total = nc_here * kBn;
      float* out = a.scores + (static_cast<int64_t>(bh) * a.cc + (cbeg - a.c0)) * a.score_stride;
      for (int idx = tid; idx < total; idx += kThreads) {
        const int ci = idx / kBn, k = idx % kBn;
        if (k >= n_valid) continue;
        float v = -INFINITY;
        for (int g = 0; g < a.group; ++g) {
          const int m = ci * a.group + g;
          v = fmaxf(v, lt[m * kLt + k] - lse_s[m]);
        }
        out[ci * a.score_stride + n0 + k] = v;
      }
    }
  }
  if constexpr (kStats) {
    const float m2 = __shfl_xor_sync(0xffffffffu, run_m, 1);
    const float s2 = __shfl_xor_sync(0xffffffffu, run_s, 1);
    const float mx = fmaxf(run_m, m2);
    float sum = 0.f;
    if (run_m > -INFINITY) sum += run_s * expf(run_m - mx);
    if (m2 > -INFINITY) sum += s2 * expf(m2 - mx);
    if (my_half == 0 && my_row < rows_here) {
      a.partial[(qrow0 + my_row) * a.n_spans + span] = make_float2(mx, sum);
    }
  }
}

template <int D, typename T, bool kStats, bool kVec>
cudaError_t LaunchQkAs(const QkArgs& a, int rows_bh, cudaStream_t stream) {
  constexpr size_t smem = QkSmemBytes<D>();
  const cudaError_t attr = cudaFuncSetAttribute(QkTileKernel<D, T, kStats, kVec>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  const dim3 grid(a.n_spans, a.cc / a.cpt, rows_bh);
  QkTileKernel<D, T, kStats, kVec><<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

// 16-byte key loads when every key row starts 16-byte aligned (no per-head offsets to check).
template <typename T>
bool KeysVectorisable(const KeyView& k) {
  const int64_t e = 16 / static_cast<int64_t>(sizeof(T));
  return k.head_offset == nullptr && reinterpret_cast<uintptr_t>(k.data) % 16 == 0 &&
         k.token_stride % e == 0 && k.head_stride % e == 0 && k.batch_stride % e == 0;
}

template <int D, typename T, bool kStats>
cudaError_t LaunchQk(const QkArgs& a, int rows_bh, cudaStream_t stream) {
  return KeysVectorisable<T>(a.keys) ? LaunchQkAs<D, T, kStats, true>(a, rows_bh, stream)
                                     : LaunchQkAs<D, T, kStats, false>(a, rows_bh, stream);
}

// ---- 4. log-sum-exp per query row -----------------------------------------------------------------
__global__ void LseKernel(const int32_t* __restrict__ per_seq, int batch, int n_kv_heads,
                          int group, int max_centroids, int n_spans,
                          const float2* __restrict__ partial, float* __restrict__ lse) {
  const int64_t rows_per_bh = static_cast<int64_t>(max_centroids) * group;
  const int64_t total = static_cast<int64_t>(batch) * n_kv_heads * rows_per_bh;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int bh = static_cast<int>(i / rows_per_bh);
    const int r = static_cast<int>(i % rows_per_bh);
    const Seq s = LoadSeq(per_seq, batch, bh / n_kv_heads);
    if (r >= s.n_centroids * group || s.listable <= 0) {
      lse[i] = 0.f;
      continue;
    }
    const int spans = (s.listable + kSpanKeys - 1) / kSpanKeys;
    const float2* p = partial + i * n_spans;
    float mx = -INFINITY;
    for (int k = 0; k < spans; ++k) mx = fmaxf(mx, p[k].x);
    float sum = 0.f;
    for (int k = 0; k < spans; ++k) {
      if (p[k].x > -INFINITY) sum += p[k].y * expf(p[k].x - mx);
    }
    lse[i] = mx + logf(sum);
  }
}

// ---- 5. chunk rows, compaction -------------------------------------------------------------------
__global__ void ChunkRowsKernel(const int32_t* __restrict__ per_seq, int batch, int n_kv_heads,
                                int c0, int cc, int chunk_rows, int32_t* __restrict__ n_valid,
                                int32_t* __restrict__ id_offset) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < chunk_rows; r += gridDim.x * blockDim.x) {
    const int bh = r / cc, c = c0 + r % cc;
    const Seq s = LoadSeq(per_seq, batch, bh / n_kv_heads);
    n_valid[r] = c < s.n_centroids && s.len > 0 ? s.listable : 0;
    id_offset[r] = s.first;
  }
}

// grid (chunk_rows): row r's top ids (ascending, rho_b of them) to lists[bh][c * rho_b].
__global__ void CompactKernel(const int32_t* __restrict__ per_seq, int batch, int n_kv_heads,
                              int c0, int cc, int max_list_length, int64_t max_list_entries,
                              const int32_t* __restrict__ top_ids,
                              const int32_t* __restrict__ top_counts, int32_t* __restrict__ lists) {
  const int r = blockIdx.x;
  const int bh = r / cc, c = c0 + r % cc;
  const Seq s = LoadSeq(per_seq, batch, bh / n_kv_heads);
  if (c >= s.n_centroids || s.len <= 0) return;
  const int n = min(s.len, top_counts[r]);
  const int32_t* src = top_ids + static_cast<int64_t>(r) * max_list_length;
  int32_t* dst = lists + bh * max_list_entries + static_cast<int64_t>(c) * s.len;
  for (int j = threadIdx.x; j < n; j += blockDim.x) dst[j] = src[j];
}

absl::Status Validate(const CtkvrBuildParams& p) {
  if (p.batch < 1 || p.n_kv_heads < 1 || p.n_heads < p.n_kv_heads ||
      p.n_heads % p.n_kv_heads != 0) {
    return Invalid(kOp, absl::StrCat("batch ", p.batch, ", heads ", p.n_heads, " / ",
                                     p.n_kv_heads, " (n_heads a multiple of n_kv_heads)"));
  }
  const int group = p.n_heads / p.n_kv_heads;
  if (group > kBm) return Invalid(kOp, absl::StrCat("GQA group ", group, " > ", kBm));
  if (p.head_dim != 64 && p.head_dim != 128) {
    return Invalid(kOp, absl::StrCat("head_dim ", p.head_dim, " (64 or 128)"));
  }
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) {
    return Invalid(kOp, absl::StrCat("scale ", p.scale));
  }
  if (static_cast<int64_t>(p.batch) * p.n_kv_heads > 65535) {
    return Invalid(kOp, "batch * n_kv_heads > 65535");
  }
  KVR_RETURN_IF_ERROR(CheckKeys(kOp, p.keys, p.head_dim));
  {
    const absl::Status qs = CheckKeys(kOp, p.queries, p.head_dim);
    if (!qs.ok()) return Invalid(kOp, absl::StrCat("queries: ", qs.message()));
  }
  if (p.per_seq == nullptr) return Invalid(kOp, "per_seq is null");
  if (p.max_centroids < 1 || p.max_listable < 1) {
    return Invalid(kOp, absl::StrCat("max_centroids ", p.max_centroids, ", max_listable ",
                                     p.max_listable, " (>= 1)"));
  }
  if (p.max_list_length < 1 || p.max_list_length > kMaxBudget) {
    return Invalid(kOp, absl::StrCat("max_list_length ", p.max_list_length, " (1 .. ",
                                     kMaxBudget, ": BatchedTopK's budget)"));
  }
  if (static_cast<int64_t>(p.max_centroids) * p.max_list_length >= (int64_t{1} << 31)) {
    return Invalid(kOp, "max_centroids * max_list_length >= 2^31");
  }
  if (p.centroid_chunk < 0) return Invalid(kOp, "centroid_chunk < 0");
  if (p.centroids == nullptr || p.n_centroids == nullptr || p.list_offsets == nullptr ||
      p.lists == nullptr) {
    return Invalid(kOp, "null output (centroids, n_centroids, list_offsets or lists)");
  }
  const Geometry g = MakeGeometry(p);
  if (g.chunk / g.cpt > 65535 || (p.max_centroids + g.cpt - 1) / g.cpt > 65535) {
    return Invalid(kOp, "too many centroid tiles per launch (max_centroids too large)");
  }
  const size_t need = CtkvrBuildWorkspaceBytes(p);
  if (p.workspace == nullptr || p.workspace_bytes < need) {
    return Invalid(kOp, absl::StrCat("workspace of ", p.workspace_bytes, " bytes, need ", need));
  }
  return absl::OkStatus();
}

}  // namespace

size_t CtkvrBuildWorkspaceBytes(const CtkvrBuildParams& p) {
  if (p.batch < 1 || p.n_kv_heads < 1 || p.n_heads < p.n_kv_heads || p.max_centroids < 1 ||
      p.max_listable < 1 || p.max_list_length < 1 || p.n_heads % p.n_kv_heads != 0 ||
      p.n_heads / p.n_kv_heads > kBm || p.head_dim < 1) {
    return 0;
  }
  const Geometry g = MakeGeometry(p);
  Buffers w;
  return Carve(p, g, nullptr, &w);
}

absl::Status CtkvrBuild(const CtkvrBuildParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(Validate(p));
  const Geometry g = MakeGeometry(p);
  Buffers w;
  Carve(p, g, p.workspace, &w);
  const int64_t max_entries = static_cast<int64_t>(p.max_centroids) * p.max_list_length;

  const cudaError_t ms = cudaMemsetAsync(
      p.lists, 0xff, static_cast<size_t>(g.rows_bh) * max_entries * sizeof(int32_t), stream);
  KVR_RETURN_IF_ERROR(CudaError("CtkvrBuild lists memset", ms));
  {
    const int64_t total = static_cast<int64_t>(g.rows_bh) * (p.max_centroids + 1);
    const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
    LayoutKernel<<<blocks, 256, 0, stream>>>(p.per_seq, p.batch, p.n_kv_heads, p.max_centroids,
                                             p.n_centroids, p.list_offsets);
    KVR_RETURN_IF_ERROR(LaunchStatus("CtkvrBuild LayoutKernel"));
  }
  return DispatchHeadDim(p.head_dim, [&]<int D>() -> absl::Status {
    // 1. centroids (queries' dtype).
    KVR_RETURN_IF_ERROR(DispatchKeyType(p.queries.dtype, [&]<typename Q>() -> absl::Status {
      CentroidPrepKernel<D, Q><<<dim3(p.max_centroids, g.rows_bh), 256, 0, stream>>>(
          p.queries, p.per_seq, p.batch, p.n_kv_heads, p.n_heads, g.group, p.max_centroids, w.q,
          p.centroids, p.norms);
      return LaunchStatus("CtkvrBuild CentroidPrepKernel");
    }));
    return DispatchKeyType(p.keys.dtype, [&]<typename T>() -> absl::Status {
      QkArgs a;
      a.batch = p.batch;
      a.n_kv_heads = p.n_kv_heads;
      a.group = g.group;
      a.cpt = g.cpt;
      a.max_centroids = p.max_centroids;
      a.scale = p.scale;
      a.q = w.q;
      a.keys = p.keys;
      a.per_seq = p.per_seq;
      a.n_spans = g.n_spans;
      a.partial = w.partial;
      a.lse = w.lse;
      a.scores = w.scores;
      a.score_stride = g.score_stride;
      // 3. log-sum-exp partials over every centroid.
      a.c0 = 0;
      a.cc = (p.max_centroids + g.cpt - 1) / g.cpt * g.cpt;
      KVR_RETURN_IF_ERROR(CudaError("CtkvrBuild QkTileKernel<stats>",
                                    LaunchQk<D, T, true>(a, g.rows_bh, stream)));
      // 4.
      {
        const int64_t total = static_cast<int64_t>(g.rows_bh) * p.max_centroids * g.group;
        const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 8192));
        LseKernel<<<blocks, 256, 0, stream>>>(p.per_seq, p.batch, p.n_kv_heads, g.group,
                                              p.max_centroids, g.n_spans, w.partial, w.lse);
        KVR_RETURN_IF_ERROR(LaunchStatus("CtkvrBuild LseKernel"));
      }
      // 5. scores and lists, chunk by chunk.
      TopKParams tk = TopKFor(p, g, w);
      tk.workspace = w.topk_ws;
      tk.workspace_bytes = w.topk_ws_bytes;
      for (int c0 = 0; c0 < p.max_centroids; c0 += g.chunk) {
        ChunkRowsKernel<<<(g.chunk_rows + 255) / 256, 256, 0, stream>>>(
            p.per_seq, p.batch, p.n_kv_heads, c0, g.chunk, g.chunk_rows, w.n_valid, w.id_offset);
        KVR_RETURN_IF_ERROR(LaunchStatus("CtkvrBuild ChunkRowsKernel"));
        a.c0 = c0;
        a.cc = g.chunk;
        KVR_RETURN_IF_ERROR(CudaError("CtkvrBuild QkTileKernel<scores>",
                                      LaunchQk<D, T, false>(a, g.rows_bh, stream)));
        KVR_RETURN_IF_ERROR(BatchedTopK(tk, stream));
        CompactKernel<<<g.chunk_rows, 256, 0, stream>>>(p.per_seq, p.batch, p.n_kv_heads, c0,
                                                        g.chunk, p.max_list_length, max_entries,
                                                        w.top_ids, w.top_counts, p.lists);
        KVR_RETURN_IF_ERROR(LaunchStatus("CtkvrBuild CompactKernel"));
      }
      if (p.thresholds != nullptr) {
        ThresholdKernel<D, T><<<dim3(p.max_centroids, g.rows_bh), 256, 0, stream>>>(
            p.keys, p.per_seq, p.batch, p.n_kv_heads, g.group, p.max_centroids, max_entries,
            p.scale, w.q, p.lists, p.thresholds);
        KVR_RETURN_IF_ERROR(LaunchStatus("CtkvrBuild ThresholdKernel"));
      }
      return absl::OkStatus();
    });
  });
}

}  // namespace kvr::retrieval::cuda
