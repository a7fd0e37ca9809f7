#pragma once
// Fused "GEMM + row argmax": for every point x_i of a row, the centre c maximising
//   cosine:  -(1 - x_i . c)          (KMeans' cosine distance, minimised; ops.cc)
//   else:    x_i . c - bias[c]       (HeadCodebook::Assign: z . c^z - |c^z|^2 / 2; codebook.cc)
// ties to the lower centre id, NaN never chosen (centre 0 when nothing compares greater, as the
// CPU loops). The [n, k] score matrix is never written: a CTA keeps a 128-point tile of x in
// shared memory (transposed), streams every centre through in 128 x 16 tiles, and keeps each
// point's running best in registers (8 x 8 outputs per thread, fp32 FMA). Private to
// kvr::retrieval_cuda_build.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kvr/retrieval/cuda/build.cuh"

namespace kvr::retrieval::cuda::build_internal {

struct ArgmaxGemmArgs {
  int rows = 0;
  const float* x = nullptr;  // row r: x + r * x_row_stride, points [n, D] contiguous
  int64_t x_row_stride = 0;
  const int32_t* n_points = nullptr;  // n of row r = n_points[r / n_points_div]
  int n_points_div = 1;
  const float* c = nullptr;  // centres of row r: c + (r % c_mod) * c_row_stride, [k, D]
  // The centres' tf32 big / small halves (SplitTf32 of c), same layout as c: only the
  // pre-split 3xTF32 kernel (ArgmaxGemmTcSplitKernel) reads them, and it reads nothing else of c.
  const uint32_t* c_big = nullptr;
  const uint32_t* c_small = nullptr;
  int64_t c_row_stride = 0;
  int c_mod = 1 << 30;
  const int32_t* n_c = nullptr;  // k of row r = n_c ? n_c[r] : k_const
  int k_const = 0;
  const float* bias = nullptr;  // [k] at bias + (r % c_mod) * bias_row_stride (non-cosine)
  int64_t bias_row_stride = 0;
  const int32_t* skip = nullptr;  // optional [rows]: rows with skip[r] != 0 are not touched
  // Outputs at + r * out_row_stride + i. `ids` is int32 or uint16 (template OutT).
  void* ids = nullptr;
  int64_t out_row_stride = 0;
  float* best_dist = nullptr;  // optional, cosine: 1 - best dot
  int32_t* changed = nullptr;  // optional [rows]: set to 1 when an id differs from the old one
};

// The CTA's share of the work in every kernel below: row blockIdx.y, points [m0, m0 + kBm) of
// its n, against k centres of centre row crow.
struct ArgmaxTile {
  int row, n, m0, k, crow;
};
// False when the CTA has nothing to do: a skipped row, no point from m0 on, or no centre.
template <int kBm>
__device__ __forceinline__ bool ArgmaxTileBegin(const ArgmaxGemmArgs& a, ArgmaxTile& t) {
  t.row = blockIdx.y;
  if (a.skip != nullptr && a.skip[t.row] != 0) return false;
  t.n = a.n_points[t.row / a.n_points_div];
  t.m0 = blockIdx.x * kBm;
  if (t.m0 >= t.n) return false;
  t.k = a.n_c != nullptr ? a.n_c[t.row] : a.k_const;
  if (t.k <= 0) return false;
  t.crow = t.row % a.c_mod;
  return true;
}

inline constexpr int kAgBm = 128, kAgBn = 128, kAgBk = 16, kAgThreads = 256;
template <int D>
constexpr size_t ArgmaxGemmSmemBytes() {
  return sizeof(float) * (static_cast<size_t>(D) * (kAgBm + 4) + kAgBk * (kAgBn + 4));
}

template <int D, bool kCosine, typename OutT>
__global__ void __launch_bounds__(kAgThreads, 2) ArgmaxGemmKernel(const ArgmaxGemmArgs a) {
  constexpr int kLdx = kAgBm + 4, kLdc = kAgBn + 4;
  extern __shared__ __align__(16) float smem[];
  float* xs = smem;             // [D][kLdx] transposed point tile
  float* cs = smem + D * kLdx;  // [kAgBk][kLdc] transposed centre tile
  ArgmaxTile tile;
  if (!ArgmaxTileBegin<kAgBm>(a, tile)) return;
  const int row = tile.row, n = tile.n, m0 = tile.m0, k = tile.k, crow = tile.crow;
  const float* x = a.x + row * a.x_row_stride;
  const float* c = a.c + crow * a.c_row_stride;
  const float* bias = kCosine ? nullptr : a.bias + crow * a.bias_row_stride;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;

  for (int idx = tid; idx < kAgBm * (D / 4); idx += kAgThreads) {
    const int m = idx / (D / 4), d4 = idx % (D / 4);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m0 + m < n)
      v = *reinterpret_cast<const float4*>(x + static_cast<int64_t>(m0 + m) * D + d4 * 4);
    xs[(d4 * 4 + 0) * kLdx + m] = v.x;
    xs[(d4 * 4 + 1) * kLdx + m] = v.y;
    xs[(d4 * 4 + 2) * kLdx + m] = v.z;
    xs[(d4 * 4 + 3) * kLdx + m] = v.w;
  }

  float best[8];
  int best_id[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    best[i] = -INFINITY;
    best_id[i] = 0;
  }
  for (int n0 = 0; n0 < k; n0 += kAgBn) {
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    for (int d0 = 0; d0 < D; d0 += kAgBk) {
      __syncthreads();  // previous tile consumed (and, first time, xs written)
#pragma unroll
      for (int r = 0; r < (kAgBn * kAgBk / 4) / kAgThreads; ++r) {
        const int idx = tid + r * kAgThreads;
        const int cn = idx / (kAgBk / 4), k4 = idx % (kAgBk / 4);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (n0 + cn < k)
          v = *reinterpret_cast<const float4*>(c + static_cast<int64_t>(n0 + cn) * D + d0 + k4 * 4);
        cs[(k4 * 4 + 0) * kLdc + cn] = v.x;
        cs[(k4 * 4 + 1) * kLdc + cn] = v.y;
        cs[(k4 * 4 + 2) * kLdc + cn] = v.z;
        cs[(k4 * 4 + 3) * kLdc + cn] = v.w;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kAgBk; ++kk) {
        const float* xr = xs + (d0 + kk) * kLdx;
        const float* cr = cs + kk * kLdc;
        const float4 a0 = *reinterpret_cast<const float4*>(xr + ty * 4);
        const float4 a1 = *reinterpret_cast<const float4*>(xr + 64 + ty * 4);
        const float4 b0 = *reinterpret_cast<const float4*>(cr + tx * 4);
        const float4 b1 = *reinterpret_cast<const float4*>(cr + 64 + tx * 4);
        const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
    }
    // Centre ids of this thread, ascending in j: strict '>' keeps the lowest id among equals.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int cid = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + (j - 4));
      if (cid < k) {
        const float bj = kCosine ? 0.f : bias[cid];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float v = kCosine ? -(1.f - acc[i][j]) : acc[i][j] - bj;
          if (v > best[i]) {
            best[i] = v;
            best_id[i] = cid;
          }
        }
      }
    }
  }
  // Reduce over the 16 lanes (tx) that share the same points: best value, then lowest id.
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v = best[i];
    int id = best_id[i];
    bool any = v > -INFINITY;  // something compared greater than -inf
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
      const int id2 = __shfl_xor_sync(0xffffffffu, id, o);
      const bool any2 = __shfl_xor_sync(0xffffffffu, any, o);
      if (any2 && (!any || v2 > v || (v2 == v && id2 < id))) {
        v = v2;
        id = id2;
        any = true;
      }
    }
    if (!any) id = 0;
    const int m = i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4);
    const int p = m0 + m;
    if (tx == 0 && p < n) {
      OutT* ids = static_cast<OutT*>(a.ids) + row * a.out_row_stride;
      if (a.changed != nullptr && static_cast<int>(ids[p]) != id) a.changed[row] = 1;
      ids[p] = static_cast<OutT>(id);
      if (a.best_dist != nullptr) {
        // The CPU's best distance: 1 - dot of the chosen centre (inf when none was chosen).
        a.best_dist[row * a.out_row_stride + p] = any ? -v : INFINITY;
      }
    }
  }
}

template <int D, bool kCosine, typename OutT>
cudaError_t LaunchArgmaxGemm(const ArgmaxGemmArgs& a, int max_points, cudaStream_t stream) {
  if (a.rows <= 0 || max_points <= 0) return cudaSuccess;
  constexpr size_t smem = ArgmaxGemmSmemBytes<D>();
  const cudaError_t attr =
      cudaFuncSetAttribute(ArgmaxGemmKernel<D, kCosine, OutT>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  const dim3 grid((max_points + kAgBm - 1) / kAgBm, a.rows);
  ArgmaxGemmKernel<D, kCosine, OutT><<<grid, kAgThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kvr::retrieval::cuda::build_internal

namespace kvr::retrieval::cuda::build_internal {

// The same contract on tensor cores: 3xTF32 (x = big + small with big = tf32(x), small =
// tf32(x - big); x.c ~= big.big + big.small + small.big), which keeps fp32-level accuracy (the
// dropped small.small term is ~2^-22 relative) at tensor-core rates. mma.sync m16n8k8 tf32; a CTA
// holds 128 points and 128 centres (all of D) in shared memory, 8 warps as 2 (points) x 4
// (centres), warp tile 64 x 32. Ids may differ from the fp32 kernel only at near-ties.
inline constexpr int kTcBm = 128, kTcBn = 128, kTcThreads = 256;
template <int D>
constexpr size_t ArgmaxGemmTcSmemBytes() {
  return sizeof(float) * (static_cast<size_t>(kTcBm + kTcBn) * (D + 4)) +
         4 * kTcBm * (sizeof(float) + sizeof(int));
}

__device__ __forceinline__ void SplitTf32(float x, uint32_t& big, uint32_t& small) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(big) : "f"(x));
  const float rest = x - __uint_as_float(big);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(small) : "f"(rest));
}

__device__ __forceinline__ void MmaTf32(float (&c)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The accumulators of a 64 x 32 warp tile (4 x 4 mma m16n8k8), zeroed.
__device__ __forceinline__ void ZeroMmaAcc(float (&acc)[4][4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
}

// The A fragment of one m16 x k8 mma from pre-split tf32 halves in shared memory: big / small
// halves at xb / xsm + o (o: the thread's row g, column t), row pitch ld.
__device__ __forceinline__ void LoadSplitA(const uint32_t* xb, const uint32_t* xsm, int o, int ld,
                                           uint32_t (&ab)[4], uint32_t (&as)[4]) {
  ab[0] = xb[o];
  ab[1] = xb[o + 8 * ld];
  ab[2] = xb[o + 4];
  ab[3] = xb[o + 8 * ld + 4];
  as[0] = xsm[o];
  as[1] = xsm[o + 8 * ld];
  as[2] = xsm[o + 4];
  as[3] = xsm[o + 8 * ld + 4];
}

// One k step of 8 of the warp tile in 3xTF32: per output small.big, big.small, big.big (in that
// order, so that every kernel sums the same chain). kBSmall false: B is exactly tf32 (its small
// half is 0 and bs is not read), so the big.small product is left out.
template <bool kBSmall = true>
__device__ __forceinline__ void Mma3xTf32Step(float (&acc)[4][4][4], const uint32_t (&ab)[4][4],
                                              const uint32_t (&as)[4][4],
                                              const uint32_t (&bb)[4][2],
                                              const uint32_t (&bs)[4][2]) {
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      MmaTf32(acc[mt][nt], as[mt], bb[nt]);
      if constexpr (kBSmall) MmaTf32(acc[mt][nt], ab[mt], bs[nt]);
      MmaTf32(acc[mt][nt], ab[mt], bb[nt]);
    }
}

// The thread's best value and centre id of each of its 8 points (ids: none yet, above any).
__device__ __forceinline__ void TcInitBest(float (&best)[8], int (&best_id)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    best[i] = -INFINITY;
    best_id[i] = 0x7fffffff;
  }
}

// The epilogue of both 3xTF32 kernels (ArgmaxGemmTcKernel, ArgmaxGemmTcSplitKernel), one code so
// that their ids and best distances stay equal bit for bit.
// Folds a finished tile of centres from n0 into the thread's best: acc[mt][nt][h * 2 + j] is
// point wm*64 + mt*16 + h*8 + g, centre n0 + wn*32 + nt*8 + 2t + j. Ascending centre ids per
// thread (nt, then j): strict '>' keeps the lowest among equals.
template <bool kCosine>
__device__ __forceinline__ void TcFoldTile(const float (&acc)[4][4][4], int n0, int k,
                                           const float* bias, int wn, int t, float (&best)[8],
                                           int (&best_id)[8]) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int cid = n0 + wn * 32 + nt * 8 + 2 * t + j;
      if (cid < k) {
        const float bj = kCosine ? 0.f : bias[cid];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float acc_v = acc[mt][nt][h * 2 + j];
            const float v = kCosine ? -(1.f - acc_v) : acc_v - bj;
            const int i = mt * 2 + h;
            if (v > best[i]) {
              best[i] = v;
              best_id[i] = cid;
            }
          }
      }
    }
}

// Across the 4 lanes of a quad (same points, other centres), then across the 4 centre warps
// (red_v / red_i: [4][kTcBm] in shared memory; every thread of the CTA calls this), then the
// CTA's points' ids, changed flag and best distances are written.
template <typename OutT>
__device__ __forceinline__ void TcReduceStore(const ArgmaxGemmArgs& a, const float (&best)[8],
                                              const int (&best_id)[8], float* red_v, int* red_i,
                                              int row, int n, int m0, int tid, int wm, int wn,
                                              int g, int t) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v = best[i];
    int id = best_id[i];
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
      const int id2 = __shfl_xor_sync(0xffffffffu, id, o);
      if (v2 > v || (v2 == v && id2 < id)) {
        v = v2;
        id = id2;
      }
    }
    if (t == 0) {
      const int m = wm * 64 + (i / 2) * 16 + (i % 2) * 8 + g;
      red_v[wn * kTcBm + m] = v;
      red_i[wn * kTcBm + m] = id;
    }
  }
  __syncthreads();
  if (tid < kTcBm) {
    float v = red_v[tid];
    int id = red_i[tid];
#pragma unroll
    for (int w = 1; w < 4; ++w) {
      const float v2 = red_v[w * kTcBm + tid];
      const int id2 = red_i[w * kTcBm + tid];
      if (v2 > v || (v2 == v && id2 < id)) {
        v = v2;
        id = id2;
      }
    }
    const bool any = v > -INFINITY;
    if (!any) id = 0;
    const int p = m0 + tid;
    if (p < n) {
      OutT* ids = static_cast<OutT*>(a.ids) + row * a.out_row_stride;
      if (a.changed != nullptr && static_cast<int>(ids[p]) != id) a.changed[row] = 1;
      ids[p] = static_cast<OutT>(id);
      if (a.best_dist != nullptr) a.best_dist[row * a.out_row_stride + p] = any ? -v : INFINITY;
    }
  }
}

template <int D, bool kCosine, typename OutT>
__global__ void __launch_bounds__(kTcThreads, 1) ArgmaxGemmTcKernel(const ArgmaxGemmArgs a) {
  constexpr int kLd = D + 4;  // row pitch: fragment loads hit 32 distinct banks
  extern __shared__ __align__(16) float smem[];
  float* xs = smem;                 // [kTcBm][kLd] points
  float* cs = smem + kTcBm * kLd;   // [kTcBn][kLd] centres
  float* red_v = cs + kTcBn * kLd;  // [4][kTcBm] per centre-warp best value
  int* red_i = reinterpret_cast<int*>(red_v + 4 * kTcBm);
  ArgmaxTile tile;
  if (!ArgmaxTileBegin<kTcBm>(a, tile)) return;
  const int row = tile.row, n = tile.n, m0 = tile.m0, k = tile.k, crow = tile.crow;
  const float* x = a.x + row * a.x_row_stride;
  const float* c = a.c + crow * a.c_row_stride;
  const float* bias = kCosine ? nullptr : a.bias + crow * a.bias_row_stride;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 4, wn = warp % 4;  // 2 x 4 warps
  const int g = lane / 4, t = lane % 4;

  for (int idx = tid; idx < kTcBm * (D / 4); idx += kTcThreads) {
    const int m = idx / (D / 4), d4 = idx % (D / 4);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m0 + m < n)
      v = *reinterpret_cast<const float4*>(x + static_cast<int64_t>(m0 + m) * D + d4 * 4);
    *reinterpret_cast<float4*>(xs + m * kLd + d4 * 4) = v;
  }

  float best[8];
  int best_id[8];
  TcInitBest(best, best_id);
  for (int n0 = 0; n0 < k; n0 += kTcBn) {
    __syncthreads();  // previous centre tile consumed (first time: nothing)
    for (int idx = tid; idx < kTcBn * (D / 4); idx += kTcThreads) {
      const int cn = idx / (D / 4), d4 = idx % (D / 4);
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (n0 + cn < k)
        v = *reinterpret_cast<const float4*>(c + static_cast<int64_t>(n0 + cn) * D + d4 * 4);
      *reinterpret_cast<float4*>(cs + cn * kLd + d4 * 4) = v;
    }
    __syncthreads();
    float acc[4][4][4];
    ZeroMmaAcc(acc);
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 8) {
      uint32_t ab[4][4], as[4][4], bb[4][2], bs[4][2];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const float* p0 = xs + (wm * 64 + mt * 16 + g) * kLd + k0 + t;
        SplitTf32(p0[0], ab[mt][0], as[mt][0]);
        SplitTf32(p0[8 * kLd], ab[mt][1], as[mt][1]);
        SplitTf32(p0[4], ab[mt][2], as[mt][2]);
        SplitTf32(p0[8 * kLd + 4], ab[mt][3], as[mt][3]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* p0 = cs + (wn * 32 + nt * 8 + g) * kLd + k0 + t;
        SplitTf32(p0[0], bb[nt][0], bs[nt][0]);
        SplitTf32(p0[4], bb[nt][1], bs[nt][1]);
      }
      Mma3xTf32Step(acc, ab, as, bb, bs);
    }
    TcFoldTile<kCosine>(acc, n0, k, bias, wn, t, best, best_id);
  }
  TcReduceStore<OutT>(a, best, best_id, red_v, red_i, row, n, m0, tid, wm, wn, g, t);
}

// Launches a 3xTF32 kernel (kTcBm points per CTA, kTcThreads threads, `smem` dynamic bytes).
inline cudaError_t LaunchTcKernel(void (*kernel)(ArgmaxGemmArgs), size_t smem,
                                  const ArgmaxGemmArgs& a, int max_points, cudaStream_t stream) {
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem));
  if (attr != cudaSuccess) return attr;
  const dim3 grid((max_points + kTcBm - 1) / kTcBm, a.rows);
  kernel<<<grid, kTcThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <int D, bool kCosine, typename OutT>
cudaError_t LaunchArgmaxGemmTc(const ArgmaxGemmArgs& a, int max_points, cudaStream_t stream) {
  if (a.rows <= 0 || max_points <= 0) return cudaSuccess;
  return LaunchTcKernel(ArgmaxGemmTcKernel<D, kCosine, OutT>, ArgmaxGemmTcSmemBytes<D>(), a,
                        max_points, stream);
}

// ---------------------------------------------------------------------------------------------
// 3xTF32 with the operands split ONCE (ClusterKV's assignment): the same sums as
// ArgmaxGemmTcKernel, bit for bit (every output is the same chain of mma over the same fragment
// registers: per k step of 8, small.big, big.small, big.big; ids and best_dist identical), but
//  - the point tile is split into tf32 big / small halves once per CTA (not in every k step of
//    every warp that loads the fragment), kept in shared memory as two [kTcBm][D + 4] arrays;
//  - the centres arrive already split (c_big / c_small, written by whoever writes the centres:
//    ClusterKV's init / update / re-seed kernels, StoreSplitTf32), streamed through shared memory
//    in chunks of kTsKc dimensions with cp.async, double-buffered: the next chunk is in flight
//    during the current chunk's mma.
// So the inner loop is shared-memory loads and mma only. Same grid, warp layout (2 x 4 warps, warp
// tile 64 x 32) and epilogue as ArgmaxGemmTcKernel.
inline constexpr int kTsKc = 32;          // centre dimensions per pipeline stage
inline constexpr int kTsLdc = kTsKc + 4;  // 36: B fragment loads hit 32 distinct banks
template <int D>
constexpr size_t ArgmaxGemmTcSplitSmemBytes() {
  // points (big, small) + 2 stages x centres (big, small) + the cross-warp reduction
  return sizeof(uint32_t) * (2 * static_cast<size_t>(kTcBm) * (D + 4) +
                             2 * 2 * static_cast<size_t>(kTcBn) * kTsLdc) +
         4 * kTcBm * (sizeof(float) + sizeof(int));
}

// v and its tf32 halves (the centres' writers call this so the split matches SplitTf32 of v).
__device__ __forceinline__ void StoreSplitTf32(float v, float* out, uint32_t* big, uint32_t* small,
                                               int64_t i) {
  out[i] = v;
  if (big != nullptr) {
    uint32_t b, s;
    SplitTf32(v, b, s);
    big[i] = b;
    small[i] = s;
  }
}

__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int D, bool kCosine, typename OutT>
__global__ void __launch_bounds__(kTcThreads, 1) ArgmaxGemmTcSplitKernel(const ArgmaxGemmArgs a) {
  constexpr int kLd = D + 4;
  constexpr int kChunks = D / kTsKc;
  constexpr int kStage = kTcBn * kTsLdc;  // uint32 per half per stage
  constexpr int kPieces = 2 * kTcBn * (kTsKc / 4);  // 16-byte copies per stage (both halves)
  static_assert(D % kTsKc == 0 && kPieces % kTcThreads == 0);
  extern __shared__ __align__(16) float smem[];
  uint32_t* xb = reinterpret_cast<uint32_t*>(smem);  // [kTcBm][kLd] big halves of the points
  uint32_t* xsm = xb + kTcBm * kLd;                  // [kTcBm][kLd] small halves
  uint32_t* cst = xsm + kTcBm * kLd;                 // [2 stages][big, small][kTcBn][kTsLdc]
  float* red_v = reinterpret_cast<float*>(cst + 4 * kStage);  // [4][kTcBm]
  int* red_i = reinterpret_cast<int*>(red_v + 4 * kTcBm);
  ArgmaxTile tile;
  if (!ArgmaxTileBegin<kTcBm>(a, tile)) return;
  const int row = tile.row, n = tile.n, m0 = tile.m0, k = tile.k, crow = tile.crow;
  const float* x = a.x + row * a.x_row_stride;
  const uint32_t* cbig = a.c_big + crow * a.c_row_stride;
  const uint32_t* csmall = a.c_small + crow * a.c_row_stride;
  const float* bias = kCosine ? nullptr : a.bias + crow * a.bias_row_stride;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 4, wn = warp % 4;  // 2 x 4 warps
  const int g = lane / 4, t = lane % 4;

  // Chunk ci = (centre tile ci / kChunks, dimensions kTsKc * (ci % kChunks) ...) into stage s.
  const auto load_chunk = [&](int ci, int s) {
    const int n0 = (ci / kChunks) * kTcBn, d0 = (ci % kChunks) * kTsKc;
#pragma unroll
    for (int r = 0; r < kPieces / kTcThreads; ++r) {
      const int idx = tid + r * kTcThreads;
      const int half = idx / (kPieces / 2), j = idx % (kPieces / 2);
      const int cn = j / (kTsKc / 4), q = j % (kTsKc / 4);
      const bool valid = n0 + cn < k;
      const uint32_t* src = half == 0 ? cbig : csmall;
      if (valid) src += static_cast<int64_t>(n0 + cn) * D + d0 + q * 4;
      CpAsync16(cst + (2 * s + half) * kStage + cn * kTsLdc + q * 4, src, valid);
    }
    CpAsyncCommit();
  };
  const int total = ((k + kTcBn - 1) / kTcBn) * kChunks;
  load_chunk(0, 0);  // in flight while the points are split

  for (int idx = tid; idx < kTcBm * (D / 4); idx += kTcThreads) {
    const int m = idx / (D / 4), d4 = idx % (D / 4);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m0 + m < n)
      v = *reinterpret_cast<const float4*>(x + static_cast<int64_t>(m0 + m) * D + d4 * 4);
    uint4 big, small;
    SplitTf32(v.x, big.x, small.x);
    SplitTf32(v.y, big.y, small.y);
    SplitTf32(v.z, big.z, small.z);
    SplitTf32(v.w, big.w, small.w);
    *reinterpret_cast<uint4*>(xb + m * kLd + d4 * 4) = big;
    *reinterpret_cast<uint4*>(xsm + m * kLd + d4 * 4) = small;
  }

  float best[8];
  int best_id[8];
  TcInitBest(best, best_id);
  float acc[4][4][4];
  for (int ci = 0; ci < total; ++ci) {
    const int kc = ci % kChunks;
    if (ci + 1 < total) {
      load_chunk(ci + 1, (ci + 1) & 1);  // stage consumed at ci - 1 (trailing barrier)
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // chunk ci visible to every warp (first time: the points too)
    if (kc == 0) ZeroMmaAcc(acc);
    const uint32_t* cb = cst + (2 * (ci & 1)) * kStage;
    const uint32_t* cs = cb + kStage;
#pragma unroll
    for (int k0 = 0; k0 < kTsKc; k0 += 8) {
      uint32_t ab[4][4], as[4][4], bb[4][2], bs[4][2];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int o = (wm * 64 + mt * 16 + g) * kLd + kc * kTsKc + k0 + t;
        LoadSplitA(xb, xsm, o, kLd, ab[mt], as[mt]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int o = (wn * 32 + nt * 8 + g) * kTsLdc + k0 + t;
        bb[nt][0] = cb[o];
        bb[nt][1] = cb[o + 4];
        bs[nt][0] = cs[o];
        bs[nt][1] = cs[o + 4];
      }
      Mma3xTf32Step(acc, ab, as, bb, bs);
    }
    if (kc == kChunks - 1) {
      TcFoldTile<kCosine>(acc, (ci / kChunks) * kTcBn, k, bias, wn, t, best, best_id);
    }
    __syncthreads();  // every warp done with stage ci & 1 before chunk ci + 2 lands in it
  }
  TcReduceStore<OutT>(a, best, best_id, red_v, red_i, row, n, m0, tid, wm, wn, g, t);
}

template <int D, bool kCosine, typename OutT>
cudaError_t LaunchArgmaxGemmTcSplit(const ArgmaxGemmArgs& a, int max_points,
                                    cudaStream_t stream) {
  if (a.rows <= 0 || max_points <= 0) return cudaSuccess;
  if (a.c_big == nullptr || a.c_small == nullptr) return cudaErrorInvalidValue;
  return LaunchTcKernel(ArgmaxGemmTcSplitKernel<D, kCosine, OutT>, ArgmaxGemmTcSplitSmemBytes<D>(),
                        a, max_points, stream);
}

// The fp32 or the 3xTF32 kernel.
template <int D, bool kCosine, typename OutT>
cudaError_t LaunchArgmax(AssignMath math, const ArgmaxGemmArgs& a, int max_points,
                         cudaStream_t stream) {
  return math == AssignMath::k3xTf32 ? LaunchArgmaxGemmTc<D, kCosine, OutT>(a, max_points, stream)
                                     : LaunchArgmaxGemm<D, kCosine, OutT>(a, max_points, stream);
}

}  // namespace kvr::retrieval::cuda::build_internal
