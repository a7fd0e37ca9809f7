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

namespace kvr::retrieval::cuda::build_internal {

struct ArgmaxGemmArgs {
  int rows = 0;
  const float* x = nullptr;  // row r: x + r * x_row_stride, points [n, D] contiguous
  int64_t x_row_stride = 0;
  const int32_t* n_points = nullptr;  // n of row r = n_points[r / n_points_div]
  int n_points_div = 1;
  const float* c = nullptr;  // centres of row r: c + (r % c_mod) * c_row_stride, [k, D]
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
  const int row = blockIdx.y;
  if (a.skip != nullptr && a.skip[row] != 0) return;
  const int n = a.n_points[row / a.n_points_div];
  const int m0 = blockIdx.x * kAgBm;
  if (m0 >= n) return;
  const int k = a.n_c != nullptr ? a.n_c[row] : a.k_const;
  if (k <= 0) return;
  const int crow = row % a.c_mod;
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
