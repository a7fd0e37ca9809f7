// KeyDiffBuild: cos(k_t, sum of the keys) for every token of every (sequence, KV head), as
// kvr::retrieval::KeyDiffScores / KeyDiffTracker (keydiff.cc): the key sum, the dot product and
// both squared norms in fp64, the score rounded to fp32 at the end.
//   1. per chunk of 256 tokens, per (head, channel): fp64 partial sums    [batch, chunks, nkv, d]
//   2. the chunks summed in order                                         [batch, nkv, d]
//   3. one warp per token (8 per warp): dot and |k|^2 in fp64, |sum|^2 once per CTA of 64
//   (and, when asked, the mean keys float(sum / seq_len) after step 2)

#include "build_common.cuh"
#include "kvr/common/status.h"

namespace kvr::retrieval::cuda {
namespace {

using build_internal::Invalid;
using build_internal::KeyBase;
using build_internal::LoadKey;

constexpr int kChunk = 256;       // tokens per partial sum (512 CTAs at 128K x 1)
constexpr int kScoreTokens = 64;  // tokens per score CTA (8 warps x 8)

int Chunks(const KeyDiffBuildParams& p) { return (p.max_tokens + kChunk - 1) / kChunk; }

template <typename T>
__global__ void __launch_bounds__(512)
    PartialSumKernel(KeyDiffBuildParams p, int n_chunks, double* __restrict__ partial) {
  const int chunk = blockIdx.x, b = blockIdx.y;
  const int len = p.seq_len[b];
  const int t0 = chunk * kChunk, t1 = min(len, t0 + kChunk);
  const int hd = p.head_dim;
  double* out = partial + (static_cast<int64_t>(b) * n_chunks + chunk) * p.n_kv_heads * hd;
  for (int e = threadIdx.x; e < p.n_kv_heads * hd; e += blockDim.x) {
    const int h = e / hd, d = e % hd;
    const int64_t base = KeyBase(p.keys, b, h, p.n_kv_heads) + d;
    double s = 0.0;
    for (int t = t0; t < t1; ++t) {
      s += static_cast<double>(
          LoadKey<T>(p.keys.data, base + static_cast<int64_t>(t) * p.keys.token_stride));
    }
    out[e] = s;
  }
}

__global__ void SumChunksKernel(KeyDiffBuildParams p, int n_chunks,
                                const double* __restrict__ partial, double* __restrict__ sum) {
  const int b = blockIdx.x;
  const int per = p.n_kv_heads * p.head_dim;
  const int used = (p.seq_len[b] + kChunk - 1) / kChunk;
  for (int e = threadIdx.x; e < per; e += blockDim.x) {
    double s = 0.0;
#pragma unroll 8
    for (int c = 0; c < used; ++c) s += partial[(static_cast<int64_t>(b) * n_chunks + c) * per + e];
    sum[static_cast<int64_t>(b) * per + e] = s;
  }
}

__global__ void MeanKernel(KeyDiffBuildParams p, const double* __restrict__ sum) {
  const int b = blockIdx.x;
  const int per = p.n_kv_heads * p.head_dim;
  const int len = p.seq_len[b];
  for (int e = threadIdx.x; e < per; e += blockDim.x) {
    const int64_t at = static_cast<int64_t>(b) * per + e;
    p.means[at] = len > 0 ? static_cast<float>(sum[at] / static_cast<double>(len)) : 0.f;
  }
}

// Grid (ceil(max_tokens / 64), rows), 8 warps of 8 tokens each.
template <typename T, int D>
__global__ void __launch_bounds__(256)
    ScoreKernel(KeyDiffBuildParams p, const double* __restrict__ sum) {
  constexpr int kPer = D / 32;
  __shared__ double sum_s[D];
  __shared__ double ns_s;
  const int row = blockIdx.y;
  const int b = row / p.n_kv_heads, h = row % p.n_kv_heads;
  const int len = p.seq_len[b];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (blockIdx.x * kScoreTokens >= len) return;
  for (int d = threadIdx.x; d < D; d += blockDim.x)
    sum_s[d] = sum[static_cast<int64_t>(row) * D + d];
  __syncthreads();
  if (warp == 0) {
    double ns = 0.0;
    for (int d = lane; d < D; d += 32) ns += sum_s[d] * sum_s[d];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ns += __shfl_xor_sync(0xffffffffu, ns, o);
    if (lane == 0) ns_s = ns;
  }
  __syncthreads();
  const double ns = ns_s;
  double sv[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) sv[j] = sum_s[lane * kPer + j];
  const int64_t head = KeyBase(p.keys, b, h, p.n_kv_heads) + lane * kPer;
  const int t_begin = blockIdx.x * kScoreTokens + warp * 8;
  const int t_end = min(len, t_begin + 8);
  for (int t = t_begin; t < t_end; ++t) {
    const int64_t base = head + static_cast<int64_t>(t) * p.keys.token_stride;
    double dot = 0.0, nk = 0.0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float k = LoadKey<T>(p.keys.data, base + j);
      dot += k * sv[j];
      nk += static_cast<double>(k) * k;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      dot += __shfl_xor_sync(0xffffffffu, dot, o);
      nk += __shfl_xor_sync(0xffffffffu, nk, o);
    }
    if (lane == 0) {
      p.scores[static_cast<int64_t>(row) * p.score_stride + t] =
          (nk == 0.0 || ns == 0.0) ? 0.f : static_cast<float>(dot / sqrt(nk * ns));
    }
  }
}

struct Work {
  double* partial = nullptr;
  double* sum = nullptr;
  size_t bytes = 0;
};
Work Carve(const KeyDiffBuildParams& p, void* base) {
  build_internal::Carver c(base);
  Work w;
  const int64_t per = static_cast<int64_t>(p.n_kv_heads) * p.head_dim;
  w.partial = c.Take<double>(static_cast<size_t>(std::max(1, p.batch * Chunks(p))) * per);
  w.sum = c.Take<double>(static_cast<size_t>(std::max(1, p.batch)) * per);
  w.bytes = c.used();
  return w;
}

absl::Status Validate(const KeyDiffBuildParams& p) {
  constexpr const char* op = "KeyDiffBuild";
  if (p.batch < 1 || p.n_kv_heads < 1) return Invalid(op, "batch and n_kv_heads must be >= 1");
  if (p.batch * p.n_kv_heads > 65535) return Invalid(op, "batch x n_kv_heads must be <= 65535");
  if (p.head_dim != 64 && p.head_dim != 128) return Invalid(op, "head_dim must be 64 or 128");
  if (p.max_tokens < 0) return Invalid(op, "max_tokens must be >= 0");
  KVR_RETURN_IF_ERROR(build_internal::CheckKeys(op, p.keys, p.head_dim));
  if (p.seq_len == nullptr || p.scores == nullptr)
    return Invalid(op, "seq_len and scores are required");
  if (p.score_stride < p.max_tokens) return Invalid(op, "score_stride < max_tokens");
  if (p.workspace == nullptr || p.workspace_bytes < KeyDiffBuildWorkspaceBytes(p)) {
    return Invalid(op, "workspace missing or smaller than KeyDiffBuildWorkspaceBytes");
  }
  return absl::OkStatus();
}

}  // namespace

size_t KeyDiffBuildWorkspaceBytes(const KeyDiffBuildParams& p) { return Carve(p, nullptr).bytes; }

absl::Status KeyDiffBuild(const KeyDiffBuildParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(Validate(p));
  if (p.max_tokens == 0) return absl::OkStatus();
  const Work w = Carve(p, p.workspace);
  const int n_chunks = Chunks(p);
  const int rows = p.batch * p.n_kv_heads;
  return build_internal::DispatchKeyType(p.keys.dtype, [&]<typename T>() {
    return build_internal::DispatchHeadDim(p.head_dim, [&]<int D>() {
      const int threads = std::min(512, p.n_kv_heads * D);
      PartialSumKernel<T><<<dim3(n_chunks, p.batch), threads, 0, stream>>>(p, n_chunks, w.partial);
      KVR_RETURN_IF_ERROR(build_internal::LaunchStatus("KeyDiffBuild partial sums"));
      SumChunksKernel<<<p.batch, threads, 0, stream>>>(p, n_chunks, w.partial, w.sum);
      KVR_RETURN_IF_ERROR(build_internal::LaunchStatus("KeyDiffBuild sums"));
      if (p.means != nullptr) {
        MeanKernel<<<p.batch, threads, 0, stream>>>(p, w.sum);
        KVR_RETURN_IF_ERROR(build_internal::LaunchStatus("KeyDiffBuild means"));
      }
      ScoreKernel<T, D>
          <<<dim3((p.max_tokens + kScoreTokens - 1) / kScoreTokens, rows), 256, 0, stream>>>(p,
                                                                                             w.sum);
      return build_internal::LaunchStatus("KeyDiffBuild scores");
    });
  });
}

}  // namespace kvr::retrieval::cuda
