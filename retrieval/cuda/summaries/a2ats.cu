// A2atsQuantise: WRoPE keys (un-rotated to pre-RoPE) and their query-aware codeword ids, as
// A2atsIndex::Encode (a2ats.cc) + HeadCodebook::Assign (codebook.cc):
//   1. WhitenKernel: per 32 tokens of a (sequence, head): un-rotate by the token position with
//      rope.cc's arithmetic (angle in fp64, cos / sin rounded to fp32, the two products and the
//      sum / difference in fp32 without FMA contraction), then z = k' L (fp32)   -> workspace
//   2. ArgmaxGemm (argmax_gemm.cuh): id = argmax_c z . c^z - |c^z|^2 / 2 over the head's codebook.

#include "argmax_gemm.cuh"
#include "build_common.cuh"
#include "kvr/common/status.h"
#include "kvr/retrieval/codebook.h"

namespace kvr::retrieval::cuda {
namespace {

using build_internal::Invalid;
using build_internal::KeyBase;
using build_internal::LoadKey;

constexpr int kWhitenTokens = 32;

// Grid (ceil(max_tokens / 32), rows), D threads.
template <typename T, int D>
__global__ void __launch_bounds__(D) WhitenKernel(A2atsQuantiseParams p, float* __restrict__ z) {
  __shared__ float ks[kWhitenTokens][D + 1];
  const int row = blockIdx.y;
  const int b = row / p.n_kv_heads, h = row % p.n_kv_heads;
  const int len = p.seq_len[b];
  const int t0 = blockIdx.x * kWhitenTokens;
  if (t0 >= len) return;
  const int nt = min(kWhitenTokens, len - t0);
  const int j = threadIdx.x;
  const int64_t base = KeyBase(p.keys, b, h, p.n_kv_heads);
  for (int t = 0; t < kWhitenTokens; ++t) {
    ks[t][j] = t < nt ? LoadKey<T>(p.keys.data,
                                   base + static_cast<int64_t>(t0 + t) * p.keys.token_stride + j)
                      : 0.f;
  }
  __syncthreads();
  const RopeStyle style = p.rope.style;
  const int rot = p.rope.rotary_dim > 0 ? p.rope.rotary_dim : D;
  const int half = rot / 2;
  if (style != RopeStyle::kNone && j < half) {
    const double freq = pow(static_cast<double>(p.rope.theta), -2.0 * j / rot);
    const int ia = style == RopeStyle::kAdjacentPairs ? 2 * j : j;
    const int ib = style == RopeStyle::kAdjacentPairs ? 2 * j + 1 : j + half;
    const int64_t first = p.first_position != nullptr ? p.first_position[b] : 0;
    for (int t = 0; t < nt; ++t) {
      const double position = -static_cast<double>(first + t0 + t);
      if (position == 0.0) continue;  // ApplyRope returns early at position 0
      const double angle = position * freq;
      const float c = static_cast<float>(cos(angle));
      const float s = static_cast<float>(sin(angle));
      const float x = ks[t][ia], y = ks[t][ib];
      ks[t][ia] = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s));
      ks[t][ib] = __fadd_rn(__fmul_rn(x, s), __fmul_rn(y, c));
    }
  }
  __syncthreads();
  // z[t, j] = sum_i k'[t, i] L[i, j]
  const float* chol = p.chol + static_cast<int64_t>(h) * D * D;
  float acc[kWhitenTokens];
#pragma unroll
  for (int t = 0; t < kWhitenTokens; ++t) acc[t] = 0.f;
  for (int i = 0; i < D; ++i) {
    const float l = chol[i * D + j];
#pragma unroll
    for (int t = 0; t < kWhitenTokens; ++t) acc[t] = fmaf(ks[t][i], l, acc[t]);
  }
  float* out = z + (static_cast<int64_t>(row) * p.max_tokens + t0) * D + j;
  for (int t = 0; t < nt; ++t) out[static_cast<int64_t>(t) * D] = acc[t];
}

absl::Status Validate(const A2atsQuantiseParams& p) {
  constexpr const char* op = "A2atsQuantise";
  if (p.batch < 1 || p.n_kv_heads < 1) return Invalid(op, "batch and n_kv_heads must be >= 1");
  if (p.batch * p.n_kv_heads > 65535) return Invalid(op, "batch x n_kv_heads must be <= 65535");
  if (p.head_dim != 64 && p.head_dim != 128) return Invalid(op, "head_dim must be 64 or 128");
  if (p.max_tokens < 0) return Invalid(op, "max_tokens must be >= 0");
  if (p.codebook_size < 1 || p.codebook_size > 65536) {
    return Invalid(op, "codebook_size must be in [1, 65536]");
  }
  if (p.math != AssignMath::kFp32 && p.math != AssignMath::k3xTf32) {
    return Invalid(op, "math must be kFp32 or k3xTf32");
  }
  const int rot = p.rope.rotary_dim > 0 ? p.rope.rotary_dim : p.head_dim;
  if (rot > p.head_dim || rot % 2 != 0)
    return Invalid(op, "rope.rotary_dim must be even and <= head_dim");
  KVR_RETURN_IF_ERROR(build_internal::CheckKeys(op, p.keys, p.head_dim));
  if (!p.seq_len || !p.chol || !p.codewords || !p.half_norms || !p.ids) {
    return Invalid(op, "seq_len, chol, codewords, half_norms and ids are required");
  }
  if (p.id_stride < p.max_tokens) return Invalid(op, "id_stride < max_tokens");
  if (p.workspace == nullptr || p.workspace_bytes < A2atsQuantiseWorkspaceBytes(p)) {
    return Invalid(op, "workspace missing or smaller than A2atsQuantiseWorkspaceBytes");
  }
  return absl::OkStatus();
}

}  // namespace

size_t A2atsQuantiseWorkspaceBytes(const A2atsQuantiseParams& p) {
  return build_internal::AlignUp(static_cast<size_t>(std::max(0, p.batch * p.n_kv_heads)) *
                                 std::max(1, p.max_tokens) * std::max(0, p.head_dim) *
                                 sizeof(float));
}

absl::Status A2atsQuantise(const A2atsQuantiseParams& p, cudaStream_t stream) {
  KVR_RETURN_IF_ERROR(Validate(p));
  if (p.max_tokens == 0) return absl::OkStatus();
  const int rows = p.batch * p.n_kv_heads;
  float* z = static_cast<float*>(p.workspace);
  return build_internal::DispatchKeyType(p.keys.dtype, [&]<typename T>() {
    return build_internal::DispatchHeadDim(p.head_dim, [&]<int D>() -> absl::Status {
      WhitenKernel<T, D>
          <<<dim3((p.max_tokens + kWhitenTokens - 1) / kWhitenTokens, rows), D, 0, stream>>>(p, z);
      KVR_RETURN_IF_ERROR(build_internal::LaunchStatus("A2atsQuantise whiten"));
      build_internal::ArgmaxGemmArgs a;
      a.rows = rows;
      a.x = z;
      a.x_row_stride = static_cast<int64_t>(p.max_tokens) * D;
      a.n_points = p.seq_len;
      a.n_points_div = p.n_kv_heads;
      a.c = p.codewords;
      a.c_row_stride = static_cast<int64_t>(p.codebook_size) * D;
      a.c_mod = p.n_kv_heads;
      a.k_const = p.codebook_size;
      a.bias = p.half_norms;
      a.bias_row_stride = p.codebook_size;
      a.ids = p.ids;
      a.out_row_stride = p.id_stride;
      KVR_CUDA_RETURN_IF_ERROR(
          (build_internal::LaunchArgmax<D, false, uint16_t>(p.math, a, p.max_tokens, stream)));
      return absl::OkStatus();
    });
  });
}

absl::StatusOr<A2atsHostCodebooks> A2atsLayerCodebooksFromHost(const A2atsCodebooks& books,
                                                               int layer) {
  const ModelFingerprint& m = books.model();
  if (layer < 0 || layer >= m.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("A2atsLayerCodebooksFromHost: layer ", layer,
                                                   " outside [0, ", m.n_layers, ")"));
  }
  A2atsHostCodebooks out;
  out.n_kv_heads = m.n_kv_heads;
  out.head_dim = m.head_dim;
  out.rope = m.rope;
  const int d = m.head_dim;
  for (int h = 0; h < m.n_kv_heads; ++h) {
    const HeadCodebook& hb = books.head(layer, h);
    if (h == 0) out.size = hb.size;
    if (hb.size != out.size || hb.head_dim != d || hb.chol.size() != static_cast<size_t>(d) * d ||
        hb.codewords.size() != static_cast<size_t>(hb.size) * d) {
      return absl::InvalidArgumentError(absl::StrCat("A2atsLayerCodebooksFromHost: layer ", layer,
                                                     " head ", h, " has another codebook shape"));
    }
    out.chol.insert(out.chol.end(), hb.chol.begin(), hb.chol.end());
    out.codewords.insert(out.codewords.end(), hb.codewords.begin(), hb.codewords.end());
    out.half_norms.insert(out.half_norms.end(), hb.half_norms.begin(), hb.half_norms.end());
  }
  return out;
}

}  // namespace kvr::retrieval::cuda
