#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "attention.cuh"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"

namespace kvr::model::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;

// ---- prefill -----------------------------------------------------------------------------
//
// FlashAttention-2 style, on mma.sync m16n8k16 (bf16 in, float32 accumulate) with fragments in
// registers: each warp owns 16 query rows; S = Q K^T stays in registers, is masked and turned
// into probabilities there, and its accumulator layout is reused as the A operand of P V, so
// neither S nor P touches shared memory. K/V tiles are double-buffered with cp.async.
// Fragment layouts are those of the PTX ISA for mma.m16n8k16: in a warp, lane = 4 g + t holds
// rows g and g + 8 of the accumulator, columns 2 t and 2 t + 1 of each 8-wide tile.

// 4 warps of 16 query rows, two blocks per multiprocessor (~250 registers a thread). Measured
// on the H100 at 8K tokens: 8 warps (128 queries a block, one block per multiprocessor) took
// 111 ms of attention where 4 warps took 87 ms (one run each).
constexpr int kPrefillThreads = 128;
constexpr int kBlockQ = kPrefillThreads / 32 * 16;  // queries per block: 16 rows per warp
constexpr int kBlockK = 64;                         // keys per shared-memory tile

template <int HD>
struct PrefillSmem {
  static constexpr int kLd = HD + 8;  // bf16 row stride: 16-byte pad, conflict-free ldmatrix
  static constexpr int kTile = kBlockK * kLd;
  static constexpr int kBytes = (kBlockQ * kLd + 2 * 2 * kTile) * 2;  // Q + 2 stages of K, V
};

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(p)));
}

// d[16x8] += a[16x16] b[16x8]
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The double-buffered K/V pipeline at tile `tile` of n_tiles: issues the next tile's load into the
// other stage (load_kv(tile, stage)), then waits until this tile's stage is in shared memory for
// the whole block.
template <typename LoadKv>
__device__ __forceinline__ void WaitKvTile(int tile, int n_tiles, const LoadKv& load_kv) {
  if (tile + 1 < n_tiles) {
    load_kv(tile + 1, (tile & 1) ^ 1);
    CpAsyncWait<1>();
  } else {
    CpAsyncWait<0>();
  }
  __syncthreads();
}

// S[16, 8 kN] = Q K^T for the warp: qf holds its 16 query rows as A fragments, sk the kN * 8 keys
// (row stride kLd) in shared memory.
template <int HD, int kN, int kLd>
__device__ __forceinline__ void QkTile(float (&sc)[kN][4], const uint32_t (&qf)[HD / 16][4],
                                       const bf16* sk, int lane) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk += 2) {
      uint32_t b[4];  // keys n*8.., dims kk*16 .. kk*16 + 31
      LdMatrixX4(b, sk + (n * 8 + lane % 8) * kLd + kk * 16 + (lane / 8) * 8);
      Mma16816(sc[n], qf[kk], b[0], b[1]);
      Mma16816(sc[n], qf[kk + 1], b[2], b[3]);
    }
  }
}

// Masks S (keys k0 + n*8 + 2t + (e & 1); visible(key, e): e < 2 is row g, else row g + 8), scales
// it to log2 units and returns the tile's row maxima in mx0 / mx1 (over the row's 4 lanes).
template <int kN, typename Visible>
__device__ __forceinline__ void MaskScaleRowMax(float (&sc)[kN][4], int64_t k0, int t,
                                                float scale_log2, Visible visible, float& mx0,
                                                float& mx1) {
  mx0 = -INFINITY;
  mx1 = -INFINITY;
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t key = k0 + n * 8 + 2 * t + (e & 1);
      const float v = visible(key, e) ? sc[n][e] * scale_log2 : -INFINITY;
      sc[n][e] = v;
      if (e < 2) {
        mx0 = fmaxf(mx0, v);
      } else {
        mx1 = fmaxf(mx1, v);
      }
    }
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
}

// The online softmax's new maxima: m0 / m1 become n0 / n1, and the running sums and output rows
// are scaled by a0 (row g) / a1 (row g + 8).
template <int kJ>
__device__ __forceinline__ void MoveMax(float& m0, float& m1, float n0, float n1, float a0,
                                        float a1, float& l0, float& l1, float (&o)[kJ][4]) {
  m0 = n0;
  m1 = n1;
  l0 *= a0;
  l1 *= a1;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    o[j][0] *= a0;
    o[j][1] *= a0;
    o[j][2] *= a1;
    o[j][3] *= a1;
  }
}

// grid (ceil(max_q / kBlockQ), n_heads, n_seqs).
template <int HD>
__global__ void __launch_bounds__(kPrefillThreads) PrefillKernel(AttentionParams p) {
  using L = PrefillSmem<HD>;
  constexpr int kLd = L::kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);  // [kBlockQ, kLd]
  bf16* s_kv = s_q + kBlockQ * kLd;           // [2 stages][K, V][kBlockK, kLd]

  const SeqKv s = p.seqs[blockIdx.z];
  const int q0 = blockIdx.x * kBlockQ;
  if (q0 >= s.n_q) return;
  const int h = blockIdx.y;
  const int kvh = h / (p.n_heads / p.n_kv_heads);
  const int kv_dim = p.n_kv_heads * HD;
  const int nq = min(kBlockQ, s.n_q - q0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Keys beyond the block's last query are masked for every row: stop there.
  const int64_t kv_end = min(s.length, s.first_position + q0 + nq);
  const int n_tiles = static_cast<int>((kv_end + kBlockK - 1) / kBlockK);

  auto load_kv = [&](int tile, int stage) {
    constexpr int kChunks = HD / 8;
    const int64_t k0 = int64_t{tile} * kBlockK;
    bf16* dk = s_kv + (2 * stage) * L::kTile;
    bf16* dv = dk + L::kTile;
    for (int c = threadIdx.x; c < kBlockK * kChunks; c += kPrefillThreads) {
      const int r = c / kChunks, d = (c % kChunks) * 8;
      const bool ok = k0 + r < kv_end;
      const int64_t row = ok ? k0 + r : k0;  // a valid address even when nothing is read
      CpAsync16(dk + r * kLd + d, KRow(s, p.layer, row, kv_dim) + kvh * HD + d, ok);
      CpAsync16(dv + r * kLd + d, VRow(s, p.layer, row, kv_dim) + kvh * HD + d, ok);
    }
    CpAsyncCommit();
  };

  load_kv(0, 0);
  {
    constexpr int kChunks = HD / 8;
    const bf16* src = p.q + (int64_t{s.q_begin} + q0) * p.n_heads * HD + int64_t{h} * HD;
    for (int c = threadIdx.x; c < kBlockQ * kChunks; c += kPrefillThreads) {
      const int r = c / kChunks, d = (c % kChunks) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < nq) v = *reinterpret_cast<const uint4*>(src + int64_t{r} * p.n_heads * HD + d);
      *reinterpret_cast<uint4*>(s_q + r * kLd + d) = v;
    }
  }
  __syncthreads();
  uint32_t qf[HD / 16][4];  // A fragments of this warp's 16 query rows
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    LdMatrixX4(qf[kk], s_q + (warp * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kLd + kk * 16 +
                           (lane / 16) * 8);
  }

  float o[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g and g + 8
  const int64_t pos0 = s.first_position + q0 + warp * 16 + g, pos1 = pos0 + 8;
  const float scale_log2 = p.scale * kLog2e;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    WaitKvTile(tile, n_tiles, load_kv);
    const bf16* sk = s_kv + (2 * stage) * L::kTile;
    const bf16* sv = sk + L::kTile;
    const int64_t k0 = int64_t{tile} * kBlockK;

    float sc[kBlockK / 8][4];  // S of 16 rows x 64 keys
    QkTile<HD, kBlockK / 8, kLd>(sc, qf, sk, lane);

    // Causal mask, scale to log2 units, online softmax. (Skipping the mask on tiles wholly
    // below the diagonal measured slower on the H100, one run each: 106 ms against 87 ms of
    // attention at 8K tokens; not understood yet.)
    float mx0, mx1;
    MaskScaleRowMax(
        sc, k0, t, scale_log2,
        [&](int64_t key, int e) { return key <= (e < 2 ? pos0 : pos1) && key < kv_end; }, mx0, mx1);
    // Key 0 is visible to every query, so after the first tile the maxima are finite.
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float a0 = exp2f(m0 - n0), a1 = exp2f(m1 - n1);
    MoveMax(m0, m1, n0, n1, a0, a1, l0, l1, o);
    uint32_t pa[kBlockK / 16][4];  // P as A fragments, 16 keys each
#pragma unroll
    for (int n = 0; n < kBlockK / 8; ++n) {
      const float p0 = exp2f(sc[n][0] - m0), p1 = exp2f(sc[n][1] - m0);
      const float p2 = exp2f(sc[n][2] - m1), p3 = exp2f(sc[n][3] - m1);
      l0 += p0 + p1;
      l1 += p2 + p3;
      pa[n / 2][(n % 2) * 2] = PackBf16(p0, p1);
      pa[n / 2][(n % 2) * 2 + 1] = PackBf16(p2, p3);
    }

    // O[16, HD] += P[16, 64] V[64, HD]
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < HD / 8; j += 2) {
        uint32_t b[4];  // keys kk*16 .. kk*16 + 15, dims j*8 .. j*8 + 15
        LdMatrixX4Trans(
            b, sv + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kLd + (j + lane / 16) * 8);
        Mma16816(o[j], pa[kk], b[0], b[1]);
        Mma16816(o[j + 1], pa[kk], b[2], b[3]);
      }
    }
    __syncthreads();  // this stage is overwritten by the load issued next iteration
  }

  // Row sums are spread over the 4 lanes of a row group.
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const int r0 = q0 + warp * 16 + g;
  const float inv0 = 1.f / l0, inv1 = 1.f / l1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + half * 8;
    if (r >= s.n_q) continue;
    const float inv = half == 0 ? inv0 : inv1;
    bf16* dst = p.out + (int64_t{s.q_begin} + r) * p.n_heads * HD + int64_t{h} * HD + 2 * t;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      *reinterpret_cast<__nv_bfloat162*>(dst + j * 8) =
          __floats2bfloat162_rn(o[j][half * 2] * inv, o[j][half * 2 + 1] * inv);
    }
  }
}

// ---- decode --------------------------------------------------------------------------------

// grid (n_kv_heads, n_splits, n_seqs). The query heads of one KV head's group are the rows of
// an m16n8k16 tile (rows >= group are zero), so decode runs on the same tensor-core path as
// prefill: K/V tiles of 64 keys are double-buffered into shared memory with cp.async by the
// whole block, warp w takes keys [16 w, 16 w + 16) of each tile with its own online softmax,
// and the four warps' states are merged through shared memory at the end into the split's
// partial output. Bandwidth-bound: the arithmetic is a few mma per 16 keys.
template <int HD>
__global__ void __launch_bounds__(kThreads) DecodeMmaKernel(AttentionParams p, int n_splits) {
  using L = PrefillSmem<HD>;
  constexpr int kLd = L::kLd;
  constexpr int kLdO = HD + 4;  // float stride of the merge scratch
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem);  // [16, kLd]
  bf16* s_kv = s_q + 16 * kLd;                // [2 stages][K, V][kBlockK, kLd]

  const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const SeqKv s = p.seqs[b];
  const int group = p.n_heads / p.n_kv_heads;
  const int kv_dim = p.n_kv_heads * HD;
  const int64_t per_split = (s.length + n_splits - 1) / n_splits;
  const int64_t begin = split * per_split;
  const int64_t end = min(s.length, begin + per_split);
  const int n_tiles = end > begin ? static_cast<int>((end - begin + kBlockK - 1) / kBlockK) : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  auto load_kv = [&](int tile, int stage) {
    constexpr int kChunks = HD / 8;
    const int64_t k0 = begin + int64_t{tile} * kBlockK;
    bf16* dk = s_kv + (2 * stage) * L::kTile;
    bf16* dv = dk + L::kTile;
    for (int c = threadIdx.x; c < kBlockK * kChunks; c += kThreads) {
      const int r = c / kChunks, d = (c % kChunks) * 8;
      const bool ok = k0 + r < end;
      const int64_t row = ok ? k0 + r : k0;
      CpAsync16(dk + r * kLd + d, KRow(s, p.layer, row, kv_dim) + kvh * HD + d, ok);
      CpAsync16(dv + r * kLd + d, VRow(s, p.layer, row, kv_dim) + kvh * HD + d, ok);
    }
    CpAsyncCommit();
  };
  if (n_tiles > 0) load_kv(0, 0);
  {
    constexpr int kChunks = HD / 8;
    const bf16* src = p.q + int64_t{s.q_begin} * p.n_heads * HD + int64_t{kvh} * group * HD;
    for (int c = threadIdx.x; c < 16 * kChunks; c += kThreads) {
      const int r = c / kChunks, d = (c % kChunks) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < group) v = *reinterpret_cast<const uint4*>(src + r * HD + d);
      *reinterpret_cast<uint4*>(s_q + r * kLd + d) = v;
    }
  }
  __syncthreads();
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    LdMatrixX4(qf[kk], s_q + (lane % 8 + ((lane / 8) % 2) * 8) * kLd + kk * 16 + (lane / 16) * 8);
  }
  float o[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g and g + 8
  const float scale_log2 = p.scale * kLog2e;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    WaitKvTile(tile, n_tiles, load_kv);
    const bf16* sk = s_kv + (2 * stage) * L::kTile + warp * 16 * kLd;  // this warp's 16 keys
    const bf16* sv = sk + L::kTile;
    const int64_t k0 = begin + int64_t{tile} * kBlockK + warp * 16;

    float sc[2][4];  // S of the group's rows x the warp's 16 keys
    QkTile<HD, 2, kLd>(sc, qf, sk, lane);
    float mx0, mx1;
    MaskScaleRowMax(
        sc, k0, t, scale_log2, [&](int64_t key, int) { return key < end; }, mx0, mx1);
    // A warp may not have seen a key yet (its slice of the last tile can be empty): subtract
    // 0 rather than -inf then, so that every weight is exp2(-inf) = 0 and nothing is NaN.
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float base0 = n0 == -INFINITY ? 0.f : n0, base1 = n1 == -INFINITY ? 0.f : n1;
    const float a0 = exp2f(m0 - base0), a1 = exp2f(m1 - base1);
    MoveMax(m0, m1, n0, n1, a0, a1, l0, l1, o);
    uint32_t pa[4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float p0 = exp2f(sc[n][0] - base0), p1 = exp2f(sc[n][1] - base0);
      const float p2 = exp2f(sc[n][2] - base1), p3 = exp2f(sc[n][3] - base1);
      l0 += p0 + p1;
      l1 += p2 + p3;
      pa[n * 2] = PackBf16(p0, p1);
      pa[n * 2 + 1] = PackBf16(p2, p3);
    }
#pragma unroll
    for (int j = 0; j < HD / 8; j += 2) {
      uint32_t bv[4];
      LdMatrixX4Trans(bv, sv + (((lane / 8) % 2) * 8 + lane % 8) * kLd + (j + lane / 16) * 8);
      Mma16816(o[j], pa, bv[0], bv[1]);
      Mma16816(o[j + 1], pa, bv[2], bv[3]);
    }
    __syncthreads();
  }

  // Merge the four warps: per-warp O, m and l through shared memory (the K/V area is free).
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  float* s_o = reinterpret_cast<float*>(s_kv);  // [kWarps, 16, kLdO]
  float* s_ml = s_o + kWarps * 16 * kLdO;       // [kWarps, 16, 2]
  float* wo = s_o + warp * 16 * kLdO;
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) {
    wo[g * kLdO + j * 8 + 2 * t] = o[j][0];
    wo[g * kLdO + j * 8 + 2 * t + 1] = o[j][1];
    wo[(g + 8) * kLdO + j * 8 + 2 * t] = o[j][2];
    wo[(g + 8) * kLdO + j * 8 + 2 * t + 1] = o[j][3];
  }
  if (t == 0) {
    s_ml[(warp * 16 + g) * 2] = m0;
    s_ml[(warp * 16 + g) * 2 + 1] = l0;
    s_ml[(warp * 16 + g + 8) * 2] = m1;
    s_ml[(warp * 16 + g + 8) * 2 + 1] = l1;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * HD; i += kThreads) {
    const int r = i / HD, d = i % HD;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_ml[(w * 16 + r) * 2]);
    float acc = 0.f, sum = 0.f;
    if (mx != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float mw = s_ml[(w * 16 + r) * 2];
        if (mw == -INFINITY) continue;
        const float wt = exp2f(mw - mx);
        acc += s_o[(w * 16 + r) * kLdO + d] * wt;
        sum += s_ml[(w * 16 + r) * 2 + 1] * wt;
      }
    }
    const int64_t idx = (int64_t{b} * p.n_heads + kvh * group + r) * p.max_splits + split;
    p.partial_o[idx * HD + d] = acc;
    if (d == 0) {
      p.partial_ml[idx * 2] = mx;
      p.partial_ml[idx * 2 + 1] = sum;
    }
  }
}

// grid (n_heads, n_seqs), HD threads: out = sum_s O_s 2^(m_s - M) / sum_s l_s 2^(m_s - M).
template <int HD>
__global__ void __launch_bounds__(HD) DecodeMergeKernel(AttentionParams p, int n_splits) {
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const SeqKv s = p.seqs[b];
  const int64_t idx0 = (int64_t{b} * p.n_heads + h) * p.max_splits;
  float mx = -INFINITY;
  for (int i = 0; i < n_splits; ++i) mx = fmaxf(mx, p.partial_ml[(idx0 + i) * 2]);
  float o = 0.f, sum = 0.f;
  for (int i = 0; i < n_splits; ++i) {
    const float mi = p.partial_ml[(idx0 + i) * 2];
    if (mi == -INFINITY) continue;  // an empty split
    const float w = exp2f(mi - mx);
    o += p.partial_o[(idx0 + i) * HD + d] * w;
    sum += p.partial_ml[(idx0 + i) * 2 + 1] * w;
  }
  p.out[int64_t{s.q_begin} * p.n_heads * HD + int64_t{h} * HD + d] = __float2bfloat16(o / sum);
}

absl::Status CheckShape(const AttentionParams& p) {
  if (p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", p.n_heads,
                                                   " query heads are not a multiple of ",
                                                   p.n_kv_heads, " KV heads"));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::UnimplementedError(
        absl::StrCat("attention: head_dim ", p.head_dim, " (compiled: 64, 128)"));
  }
  return absl::OkStatus();
}

template <int HD>
absl::Status LaunchPrefill(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kBytes = PrefillSmem<HD>::kBytes;
  KVR_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(PrefillKernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  const dim3 grid((p.max_q + kBlockQ - 1) / kBlockQ, p.n_heads, p.n_seqs);
  PrefillKernel<HD><<<grid, kPrefillThreads, kBytes, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("PrefillKernel");
}

template <int HD>
absl::Status LaunchDecode(const AttentionParams& p, cudaStream_t stream) {
  const int n_splits = DecodeSplits(p);
  // The prefill layout with 16 query rows.
  constexpr int kBytes = PrefillSmem<HD>::kBytes - (PrefillSmem<HD>::kLd * (kBlockQ - 16)) * 2;
  KVR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      DecodeMmaKernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  DecodeMmaKernel<HD>
      <<<dim3(p.n_kv_heads, n_splits, p.n_seqs), kThreads, kBytes, stream>>>(p, n_splits);
  KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("DecodeMmaKernel"));
  DecodeMergeKernel<HD><<<dim3(p.n_heads, p.n_seqs), HD, 0, stream>>>(p, n_splits);
  return kvr::cuda::LastLaunchStatus("DecodeMergeKernel");
}

}  // namespace

absl::Status LaunchPrefillAttention(const AttentionParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(CheckShape(p));
  if (p.n_seqs == 0 || p.max_q == 0) return absl::OkStatus();
  return p.head_dim == 64 ? LaunchPrefill<64>(p, stream) : LaunchPrefill<128>(p, stream);
}

int DecodeSplits(const AttentionParams& p) {
  // Enough blocks to fill the GPU about four times, but at least 64 keys per split.
  const int64_t blocks = std::max<int64_t>(1, int64_t{p.n_seqs} * p.n_kv_heads);
  int64_t splits = (4 * int64_t{p.n_sms} + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, (p.max_length + 63) / 64);
  splits = std::clamp<int64_t>(splits, 1, std::max(1, p.max_splits));
  return static_cast<int>(splits);
}

absl::Status LaunchDecodeAttention(const AttentionParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(CheckShape(p));
  if (p.n_heads / p.n_kv_heads > kMaxDecodeGroup) {
    return absl::UnimplementedError(absl::StrCat("decode attention: GQA group of ",
                                                 p.n_heads / p.n_kv_heads, " (at most ",
                                                 kMaxDecodeGroup, ")"));
  }
  if (p.partial_o == nullptr || p.partial_ml == nullptr || p.max_splits < 1) {
    return absl::InvalidArgumentError("decode attention: no split scratch");
  }
  if (p.n_seqs == 0) return absl::OkStatus();
  return p.head_dim == 64 ? LaunchDecode<64>(p, stream) : LaunchDecode<128>(p, stream);
}

}  // namespace kvr::model::cuda
