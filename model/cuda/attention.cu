#include <cuda_bf16.h>
#include <mma.h>

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

constexpr int kBlockQ = 16 * kWarps;  // queries per block: 16 rows per warp (one WMMA tile)
constexpr int kBlockK = 64;           // keys per shared-memory tile

constexpr int RoundUp(int n) { return (n + 127) / 128 * 128; }

// Shared-memory layout of the prefill kernel. Row strides are padded (by 16 bytes) against bank
// conflicts; every WMMA tile pointer stays 32-byte aligned.
template <int HD>
struct PrefillSmem {
  static constexpr int kLd = HD + 8;        // bf16 stride of Q, K, V rows
  static constexpr int kLdS = kBlockK + 4;  // float stride of a warp's scores
  static constexpr int kLdP = kBlockK + 8;  // bf16 stride of a warp's probabilities
  static constexpr int kLdO = HD + 4;       // float stride of a warp's output accumulator
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + RoundUp(kBlockQ * kLd * 2);
  static constexpr int kV = kK + RoundUp(kBlockK * kLd * 2);
  static constexpr int kS = kV + RoundUp(kBlockK * kLd * 2);
  static constexpr int kP = kS + RoundUp(kWarps * 16 * kLdS * 4);
  static constexpr int kO = kP + RoundUp(kWarps * 16 * kLdP * 2);
  static constexpr int kBytes = kO + RoundUp(kWarps * 16 * kLdO * 4);
};

// Copies `rows` rows of HD bf16 (16-byte chunks) into shared memory, zeros past `valid`.
template <int HD>
__device__ void LoadRows(bf16* dst, int ld, int rows, int valid, const bf16* src0,
                         int64_t src_stride) {
  constexpr int kChunks = HD / 8;
  for (int c = threadIdx.x; c < rows * kChunks; c += blockDim.x) {
    const int r = c / kChunks, d = (c % kChunks) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < valid) v = *reinterpret_cast<const uint4*>(src0 + r * src_stride + d);
    *reinterpret_cast<uint4*>(dst + r * ld + d) = v;
  }
}

// grid (ceil(max_q / kBlockQ), n_heads, n_seqs). Warp w owns query rows [16 w, 16 w + 16) of the
// block; within the softmax, lane pairs share a row (lane / 2) and take alternate columns.
template <int HD>
__global__ void __launch_bounds__(kThreads) PrefillKernel(AttentionParams p) {
  using namespace nvcuda;
  using L = PrefillSmem<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem + L::kQ);
  bf16* s_k = reinterpret_cast<bf16*>(smem + L::kK);
  bf16* s_v = reinterpret_cast<bf16*>(smem + L::kV);

  const SeqKv s = p.seqs[blockIdx.z];
  const int q0 = blockIdx.x * kBlockQ;
  if (q0 >= s.n_q) return;
  const int h = blockIdx.y;
  const int kvh = h / (p.n_heads / p.n_kv_heads);
  const int kv_dim = p.n_kv_heads * HD;
  const int nq = min(kBlockQ, s.n_q - q0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_s = reinterpret_cast<float*>(smem + L::kS) + warp * 16 * L::kLdS;
  bf16* s_p = reinterpret_cast<bf16*>(smem + L::kP) + warp * 16 * L::kLdP;
  float* s_o = reinterpret_cast<float*>(smem + L::kO) + warp * 16 * L::kLdO;

  LoadRows<HD>(s_q, L::kLd, kBlockQ, nq,
               p.q + (int64_t{s.q_begin} + q0) * p.n_heads * HD + int64_t{h} * HD,
               int64_t{p.n_heads} * HD);
  for (int i = lane; i < 16 * HD; i += 32) s_o[(i / HD) * L::kLdO + i % HD] = 0.f;

  const int row = lane / 2, col0 = lane % 2;
  const int64_t q_pos = s.first_position + q0 + warp * 16 + row;
  const float scale_log2 = p.scale * kLog2e;
  float m = -INFINITY, l = 0.f;
  // Keys beyond the block's last query are masked for every row: stop there.
  const int64_t kv_end = min(s.length, s.first_position + q0 + nq);

  for (int64_t k0 = 0; k0 < kv_end; k0 += kBlockK) {
    const int valid = static_cast<int>(min(static_cast<int64_t>(kBlockK), kv_end - k0));
    __syncthreads();  // the previous tile's K/V are no longer read
    LoadRows<HD>(s_k, L::kLd, kBlockK, valid, KRow(s, p.layer, k0, kv_dim) + kvh * HD, kv_dim);
    LoadRows<HD>(s_v, L::kLd, kBlockK, valid, VRow(s, p.layer, k0, kv_dim) + kvh * HD, kv_dim);
    __syncthreads();

    // S[16, 64] = Q_w[16, HD] K^T[HD, 64]. K rows in shared memory are K^T in column-major.
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kBlockK / 16];
#pragma unroll
      for (int n = 0; n < kBlockK / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
        wmma::load_matrix_sync(a, s_q + warp * 16 * L::kLd + kk * 16, L::kLd);
#pragma unroll
        for (int n = 0; n < kBlockK / 16; ++n) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;
          wmma::load_matrix_sync(b, s_k + n * 16 * L::kLd + kk * 16, L::kLd);
          wmma::mma_sync(acc[n], a, b, acc[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < kBlockK / 16; ++n) {
        wmma::store_matrix_sync(s_s + n * 16, acc[n], L::kLdS, wmma::mem_row_major);
      }
    }
    __syncwarp();

    // Online softmax of row `row` (log2 domain), this lane's columns col0, col0 + 2, ...
    float* s_row = s_s + row * L::kLdS;
    float mx = -INFINITY;
    for (int j = col0; j < kBlockK; j += 2) {
      const int64_t key = k0 + j;
      const float v = (key <= q_pos && j < valid) ? s_row[j] * scale_log2 : -INFINITY;
      s_row[j] = v;
      mx = fmaxf(mx, v);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    // Key 0 is visible to every query, so after the first tile m_new is finite.
    const float m_new = fmaxf(m, mx);
    const float alpha = exp2f(m - m_new);
    bf16* p_row = s_p + row * L::kLdP;
    float sum = 0.f;
    for (int j = col0; j < kBlockK; j += 2) {
      const float pj = exp2f(s_row[j] - m_new);
      p_row[j] = __float2bfloat16(pj);
      sum += pj;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    float* o_row = s_o + row * L::kLdO;
    for (int j = col0; j < HD; j += 2) o_row[j] *= alpha;
    __syncwarp();

    // O_w[16, HD] += P[16, 64] V[64, HD]
    {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[kBlockK / 16];
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        wmma::load_matrix_sync(a[kk], s_p + kk * 16, L::kLdP);
      }
#pragma unroll
      for (int n = 0; n < HD / 16; ++n) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
        wmma::load_matrix_sync(o, s_o + n * 16, L::kLdO, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
          wmma::load_matrix_sync(b, s_v + kk * 16 * L::kLd + n * 16, L::kLd);
          wmma::mma_sync(o, a[kk], b, o);
        }
        wmma::store_matrix_sync(s_o + n * 16, o, L::kLdO, wmma::mem_row_major);
      }
    }
    __syncwarp();
  }

  const int qi = q0 + warp * 16 + row;
  if (qi < s.n_q) {
    const float inv = 1.f / l;
    const float* o_row = s_o + row * L::kLdO;
    bf16* dst = p.out + (int64_t{s.q_begin} + qi) * p.n_heads * HD + int64_t{h} * HD;
    for (int j = col0; j < HD; j += 2) dst[j] = __float2bfloat16(o_row[j] * inv);
  }
}

// ---- decode --------------------------------------------------------------------------------

// grid (n_kv_heads, n_splits, n_seqs). Lanes split head_dim in 8-element (16-byte) slices, so a
// warp reads 32 / (HD / 8) keys at once; each (warp, key slot) keeps its own online-softmax
// state for every query head of the group, merged through shared memory at the end.
template <int HD>
__global__ void __launch_bounds__(kThreads) DecodeKernel(AttentionParams p, int n_splits) {
  constexpr int kLanesPerKey = HD / 8;
  constexpr int kKeysPerWarp = 32 / kLanesPerKey;
  constexpr int kSlots = kWarps * kKeysPerWarp;
  constexpr int G = kMaxDecodeGroup;
  __shared__ float s_q[G][HD];
  __shared__ float s_m[kSlots][G];
  __shared__ float s_l[kSlots][G];
  __shared__ float s_o[kSlots][G][HD];

  const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const SeqKv s = p.seqs[b];
  const int group = p.n_heads / p.n_kv_heads;
  const int kv_dim = p.n_kv_heads * HD;
  const int64_t per_split = (s.length + n_splits - 1) / n_splits;
  const int64_t begin = split * per_split;
  const int64_t end = min(s.length, begin + per_split);
  const float scale_log2 = p.scale * kLog2e;

  const bf16* q = p.q + int64_t{s.q_begin} * p.n_heads * HD + int64_t{kvh} * group * HD;
  for (int i = threadIdx.x; i < group * HD; i += blockDim.x) {
    s_q[i / HD][i % HD] = __bfloat162float(q[i]) * scale_log2;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key_slot = lane / kLanesPerKey, d0 = (lane % kLanesPerKey) * 8;
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }
  // The loop bound is uniform over the warp (shuffles need every lane); lanes past `end` idle.
  for (int64_t k0 = begin + warp * kKeysPerWarp; k0 < end; k0 += kWarps * kKeysPerWarp) {
    const int64_t key = k0 + key_slot;
    const bool valid = key < end;
    float kf[8], vf[8];
    if (valid) {
      const uint4 kr =
          *reinterpret_cast<const uint4*>(KRow(s, p.layer, key, kv_dim) + kvh * HD + d0);
      const uint4 vr =
          *reinterpret_cast<const uint4*>(VRow(s, p.layer, key, kv_dim) + kvh * HD + d0);
      const bf16* kb = reinterpret_cast<const bf16*>(&kr);
      const bf16* vb = reinterpret_cast<const bf16*>(&vr);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        kf[i] = __bfloat162float(kb[i]);
        vf[i] = __bfloat162float(vb[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) kf[i] = vf[i] = 0.f;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= group) break;  // uniform over the block
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) dot += kf[i] * s_q[g][d0 + i];
#pragma unroll
      for (int o = kLanesPerKey / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (valid) {
        const float m_new = fmaxf(m[g], dot);
        const float c = exp2f(m[g] - m_new), pw = exp2f(dot - m_new);
        l[g] = l[g] * c + pw;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * c + pw * vf[i];
        m[g] = m_new;
      }
    }
  }

  const int slot = warp * kKeysPerWarp + key_slot;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g >= group) break;
    if (lane % kLanesPerKey == 0) {
      s_m[slot][g] = m[g];
      s_l[slot][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) s_o[slot][g][d0 + i] = acc[g][i];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < group * HD; i += blockDim.x) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
    for (int sl = 0; sl < kSlots; ++sl) mx = fmaxf(mx, s_m[sl][g]);
    float o = 0.f, sum = 0.f;
    if (mx != -INFINITY) {
      for (int sl = 0; sl < kSlots; ++sl) {
        if (s_m[sl][g] == -INFINITY) continue;
        const float w = exp2f(s_m[sl][g] - mx);
        o += s_o[sl][g][d] * w;
        sum += s_l[sl][g] * w;
      }
    }
    const int64_t idx =
        (int64_t{b} * p.n_heads + kvh * group + g) * p.max_splits + split;  // partial index
    p.partial_o[idx * HD + d] = o;
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
  PrefillKernel<HD><<<grid, kThreads, kBytes, stream>>>(p);
  return kvr::cuda::LastLaunchStatus("PrefillKernel");
}

template <int HD>
absl::Status LaunchDecode(const AttentionParams& p, cudaStream_t stream) {
  // Enough blocks to fill the GPU about twice, but at least 64 keys per split.
  const int64_t blocks = int64_t{p.n_seqs} * p.n_kv_heads;
  int64_t splits = (2 * int64_t{p.n_sms} + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, (p.max_length + 63) / 64);
  splits = std::clamp<int64_t>(splits, 1, p.max_splits);
  const int n_splits = static_cast<int>(splits);
  DecodeKernel<HD><<<dim3(p.n_kv_heads, n_splits, p.n_seqs), kThreads, 0, stream>>>(p, n_splits);
  KVR_RETURN_IF_ERROR(kvr::cuda::LastLaunchStatus("DecodeKernel"));
  DecodeMergeKernel<HD><<<dim3(p.n_heads, p.n_seqs), HD, 0, stream>>>(p, n_splits);
  return kvr::cuda::LastLaunchStatus("DecodeMergeKernel");
}

}  // namespace

absl::Status LaunchPrefillAttention(const AttentionParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(CheckShape(p));
  if (p.n_seqs == 0 || p.max_q == 0) return absl::OkStatus();
  return p.head_dim == 64 ? LaunchPrefill<64>(p, stream) : LaunchPrefill<128>(p, stream);
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
