#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "kvr/common/cuda/cuda_util.h"
#include "ops.cuh"

namespace kvr::model::cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n, int threads = kThreads, int64_t cap = 65535LL * 16) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

// Sum over the block; every thread gets the result. `scratch` holds one float per warp.
__device__ float BlockSum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += scratch[w];
  return total;
}

__global__ void EmbedKernel(EmbedParams p) {
  const int64_t t = blockIdx.x;
  const bf16* src = p.table + int64_t{p.tokens[t]} * p.hidden;
  float* dst = p.x + t * p.hidden;
  for (int i = threadIdx.x; i < p.hidden; i += blockDim.x) dst[i] = __bfloat162float(src[i]);
}

// One block per row. The row is read twice (sum of squares, then scale); at the widths here
// (<= 8K floats) the second read hits L1/L2.
template <typename OutT>
__global__ void RmsNormKernel(RmsNormParams p, OutT* y) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int64_t src = p.rows == nullptr ? r : p.rows[r];
  const float* x = p.x + src * p.dim;
  float sum = 0.f;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) sum += x[i] * x[i];
  sum = BlockSum(sum, scratch);
  const float inv = rsqrtf(sum / p.dim + p.eps);
  OutT* out = y + r * p.dim;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    const float v = p.weight[i] * (x[i] * inv);
    if constexpr (sizeof(OutT) == 4) {
      out[i] = v;
    } else {
      out[i] = __float2bfloat16(v);
    }
  }
}

// One block per token: Q and K pairs rotated, V copied, all with the bias added.
__global__ void QkvRopeKernel(QkvRopeParams p) {
  const int64_t t = blockIdx.x;
  const SeqKv s = p.seqs[p.token_seq[t]];
  const int64_t pos = s.first_position + (t - s.q_begin);
  const int half = p.head_dim / 2;
  const int q_dim = p.n_heads * p.head_dim, kv_dim = p.n_kv_heads * p.head_dim;
  const float* row = p.qkv + t * (q_dim + 2 * kv_dim);
  bf16* k_dst = KRow(s, p.layer, pos, kv_dim);
  bf16* v_dst = VRow(s, p.layer, pos, kv_dim);
  const int n_pairs = (p.n_heads + p.n_kv_heads) * half;
  for (int j = threadIdx.x; j < n_pairs; j += blockDim.x) {
    const int head = j / half, i = j % half;  // heads 0..n_heads-1 are Q, then K
    const int col = head * p.head_dim + i;    // Q and K are adjacent in the row
    float x0 = row[col], x1 = row[col + half];
    if (p.bias != nullptr) {
      x0 += p.bias[col];
      x1 += p.bias[col + half];
    }
    // As ApplyRope: the angle is rounded to float, its sine and cosine taken accurately.
    const float angle = static_cast<float>(pos) * p.inv_freq[i];
    float sn, cs;
    sincosf(angle, &sn, &cs);
    const float y0 = x0 * cs - x1 * sn, y1 = x1 * cs + x0 * sn;
    if (head < p.n_heads) {
      bf16* q = p.q + t * q_dim + col;
      q[0] = __float2bfloat16(y0);
      q[half] = __float2bfloat16(y1);
    } else {
      bf16* k = k_dst + (col - q_dim);
      k[0] = __float2bfloat16(y0);
      k[half] = __float2bfloat16(y1);
    }
  }
  for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
    const int col = q_dim + kv_dim + j;
    float v = row[col];
    if (p.bias != nullptr) v += p.bias[col];
    v_dst[j] = __float2bfloat16(v);
  }
}

__device__ __forceinline__ float Silu(float g) { return g / (1.f + expf(-g)); }

// grid (column blocks, min(tokens, 65535)): no 64-bit index division per element, 16-byte
// loads when ffn % 4 == 0, and enough blocks for a single token (decode) too.
__global__ void SwiGluKernel(SwiGluParams p) {
  const bool vec = p.ffn % 4 == 0;
  const int j = (blockIdx.x * blockDim.x + threadIdx.x) * (vec ? 4 : 1);
  if (j >= p.ffn) return;
  for (int64_t t = blockIdx.y; t < p.n_tokens; t += gridDim.y) {
    const float* gate = p.gate_up + t * 2 * p.ffn;
    const float* up = gate + p.ffn;
    bf16* act = p.act + t * p.ffn;
    if (vec) {
      const float4 g = *reinterpret_cast<const float4*>(gate + j);
      const float4 u = *reinterpret_cast<const float4*>(up + j);
      *reinterpret_cast<__nv_bfloat162*>(act + j) =
          __floats2bfloat162_rn(Silu(g.x) * u.x, Silu(g.y) * u.y);
      *reinterpret_cast<__nv_bfloat162*>(act + j + 2) =
          __floats2bfloat162_rn(Silu(g.z) * u.z, Silu(g.w) * u.w);
    } else {
      act[j] = __float2bfloat16(Silu(gate[j]) * up[j]);
    }
  }
}

__global__ void ArgMaxKernel(ArgMaxParams p) {
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  const float* x = p.x + int64_t{blockIdx.x} * p.n_cols;
  float v = -FLT_MAX;
  int idx = p.n_cols;  // larger than any index: loses every tie
  for (int i = threadIdx.x; i < p.n_cols; i += blockDim.x) {
    if (x[i] > v) {  // strictly greater: the first (lowest) index of this thread wins
      v = x[i];
      idx = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) {
      v = ov;
      idx = oi;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    best_v[warp] = v;
    best_i[warp] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
      if (best_v[w] > v || (best_v[w] == v && best_i[w] < idx)) {
        v = best_v[w];
        idx = best_i[w];
      }
    }
    p.out[blockIdx.x] = idx < p.n_cols ? idx : 0;
  }
}

__global__ void ToBf16Kernel(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = __float2bfloat16(src[i]);
  }
}

// Two bf16 per thread (a 4-byte load, an 8-byte store) when both pointers allow it.
__global__ void Bf16ToF32Kernel(const bf16* src, float* dst, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(src) % 4 == 0) && (reinterpret_cast<uintptr_t>(dst) % 8 == 0)) {
    const int64_t pairs = n / 2;
    const auto* s2 = reinterpret_cast<const __nv_bfloat162*>(src);
    auto* d2 = reinterpret_cast<float2*>(dst);
    for (int64_t i = first; i < pairs; i += stride) d2[i] = __bfloat1622float2(s2[i]);
    if (first == 0 && n % 2 == 1) dst[n - 1] = __bfloat162float(src[n - 1]);
  } else {
    for (int64_t i = first; i < n; i += stride) dst[i] = __bfloat162float(src[i]);
  }
}

__device__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

__global__ void RandomBf16Kernel(bf16* dst, int64_t n, uint64_t seed, float stddev) {
  // Uniform on [-a, a) has standard deviation a / sqrt(3).
  const float a = stddev * 1.7320508f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = SplitMix64(seed * 0x100000001b3ULL + static_cast<uint64_t>(i));
    const float u = static_cast<float>(h >> 40) * (1.f / 16777216.f);  // [0, 1)
    dst[i] = __float2bfloat16((2.f * u - 1.f) * a);
  }
}

__global__ void FillF32Kernel(float* dst, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = value;
  }
}

}  // namespace

absl::Status LaunchEmbed(const EmbedParams& p, cudaStream_t stream) {
  if (p.n_tokens == 0) return absl::OkStatus();
  EmbedKernel<<<static_cast<unsigned>(p.n_tokens), kThreads, 0, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("EmbedKernel");
}

absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  if ((p.y_f32 == nullptr) == (p.y_bf16 == nullptr)) {
    return absl::InvalidArgumentError("LaunchRmsNorm: set exactly one of y_f32 and y_bf16");
  }
  if (p.n_rows == 0) return absl::OkStatus();
  const unsigned blocks = static_cast<unsigned>(p.n_rows);
  if (p.y_f32 != nullptr) {
    RmsNormKernel<float><<<blocks, kThreads, 0, stream>>>(p, p.y_f32);
  } else {
    RmsNormKernel<bf16><<<blocks, kThreads, 0, stream>>>(p, p.y_bf16);
  }
  return kvr::cuda::LastLaunchStatus("RmsNormKernel");
}

absl::Status LaunchQkvRope(const QkvRopeParams& p, cudaStream_t stream) {
  if (p.head_dim % 2 != 0) return absl::InvalidArgumentError("LaunchQkvRope: odd head_dim");
  if (p.n_tokens == 0) return absl::OkStatus();
  QkvRopeKernel<<<static_cast<unsigned>(p.n_tokens), 128, 0, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("QkvRopeKernel");
}

absl::Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream) {
  if (p.n_tokens == 0) return absl::OkStatus();
  const int per_block = kThreads * (p.ffn % 4 == 0 ? 4 : 1);
  const dim3 grid((p.ffn + per_block - 1) / per_block,
                  static_cast<unsigned>(std::min<int64_t>(p.n_tokens, 65535)));
  SwiGluKernel<<<grid, kThreads, 0, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("SwiGluKernel");
}

absl::Status LaunchArgMax(const ArgMaxParams& p, cudaStream_t stream) {
  if (p.n_rows == 0) return absl::OkStatus();
  ArgMaxKernel<<<static_cast<unsigned>(p.n_rows), 1024, 0, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("ArgMaxKernel");
}

absl::Status LaunchToBf16(const float* src, bf16* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  ToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(src, dst, n);
  return kvr::cuda::LastLaunchStatus("ToBf16Kernel");
}

absl::Status LaunchBf16ToF32(const bf16* src, float* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  Bf16ToF32Kernel<<<Blocks((n + 1) / 2), kThreads, 0, stream>>>(src, dst, n);
  return kvr::cuda::LastLaunchStatus("Bf16ToF32Kernel");
}

absl::Status LaunchRandomBf16(bf16* dst, int64_t n, uint64_t seed, float stddev,
                              cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  RandomBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(dst, n, seed, stddev);
  return kvr::cuda::LastLaunchStatus("RandomBf16Kernel");
}

absl::Status LaunchFillF32(float* dst, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  FillF32Kernel<<<Blocks(n), kThreads, 0, stream>>>(dst, n, value);
  return kvr::cuda::LastLaunchStatus("FillF32Kernel");
}

}  // namespace kvr::model::cuda
