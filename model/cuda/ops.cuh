#pragma once
// Host launchers of the CUDA model's elementwise and row kernels (ops.cu): embedding gather,
// RMSNorm, QKV bias + RoPE + KV-cache append, SwiGLU, argmax, bf16 conversion and random fill.
// Plain C++ references: RmsNorm / ApplyRope in model.h, ArgMax in sampler.h; parity tests in
// model/tests/cuda_ops_test.cc. Every launcher is asynchronous on `stream` and returns the
// launch error, if any.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvr::model::cuda {

using bf16 = __nv_bfloat16;

// One sequence of a batch, as the kernels see it. The sequence's cache is one allocation
// [n_layers, 2, capacity, n_kv_heads, head_dim] bf16: K of layer l at ((2 l) capacity + pos),
// V at ((2 l + 1) capacity + pos), in rows of kv_dim elements.
struct SeqKv {
  bf16* base = nullptr;
  int64_t capacity = 0;        // rows per layer and K/V
  int64_t first_position = 0;  // position of the sequence's first new token
  int64_t length = 0;          // tokens in the cache once the new ones are appended
  int32_t q_begin = 0;         // row of the first new token in the batch's [n_tokens, ...] tensors
  int32_t n_q = 0;             // new tokens
};

__host__ __device__ inline bf16* KRow(const SeqKv& s, int layer, int64_t pos, int kv_dim) {
  return s.base + ((2 * int64_t{layer}) * s.capacity + pos) * kv_dim;
}
__host__ __device__ inline bf16* VRow(const SeqKv& s, int layer, int64_t pos, int kv_dim) {
  return s.base + ((2 * int64_t{layer} + 1) * s.capacity + pos) * kv_dim;
}

struct EmbedParams {
  const int32_t* tokens = nullptr;  // [n_tokens]
  const bf16* table = nullptr;      // [vocab, hidden]
  float* x = nullptr;               // [n_tokens, hidden]
  int64_t n_tokens = 0;
  int hidden = 0;
};
[[nodiscard]] absl::Status LaunchEmbed(const EmbedParams& p, cudaStream_t stream);

// y[r] = x[rows[r]] / sqrt(mean(x[rows[r]]^2) + eps) * weight; exactly one of y_f32 / y_bf16.
struct RmsNormParams {
  const float* x = nullptr;       // [*, dim]
  const int32_t* rows = nullptr;  // [n_rows] source rows of x, or null for rows 0 .. n_rows-1
  const float* weight = nullptr;  // [dim]
  float* y_f32 = nullptr;         // [n_rows, dim]
  bf16* y_bf16 = nullptr;         // [n_rows, dim]
  int64_t n_rows = 0;
  int dim = 0;
  float eps = 1e-5f;
};
[[nodiscard]] absl::Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream);

// Adds the QKV bias, rotates Q and K (Hugging Face rotate-half pairs (i, i + head_dim/2), angle
// position * inv_freq[i] rounded to float as ApplyRope does), writes Q as bf16 and appends K and
// V to each token's sequence cache at `layer`.
struct QkvRopeParams {
  const float* qkv = nullptr;          // [n_tokens, n_heads*head_dim + 2*n_kv_heads*head_dim]
  const float* bias = nullptr;         // [q_dim + 2 kv_dim] or null
  const float* inv_freq = nullptr;     // [head_dim / 2]
  const int32_t* token_seq = nullptr;  // [n_tokens] index into seqs
  const SeqKv* seqs = nullptr;         // [n_seqs]
  bf16* q = nullptr;                   // [n_tokens, n_heads, head_dim]
  int64_t n_tokens = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int layer = 0;
};
[[nodiscard]] absl::Status LaunchQkvRope(const QkvRopeParams& p, cudaStream_t stream);

// act = silu(gate) * up, gate and up the two halves of each gate_up row.
struct SwiGluParams {
  const float* gate_up = nullptr;  // [n_tokens, 2 * ffn]
  bf16* act = nullptr;             // [n_tokens, ffn]
  int64_t n_tokens = 0;
  int ffn = 0;
};
[[nodiscard]] absl::Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream);

// out[r] = argmax of row r (ties: lowest index).
struct ArgMaxParams {
  const float* x = nullptr;  // [n_rows, n_cols]
  int32_t* out = nullptr;    // [n_rows]
  int64_t n_rows = 0;
  int n_cols = 0;
};
[[nodiscard]] absl::Status LaunchArgMax(const ArgMaxParams& p, cudaStream_t stream);

// dst[i] = bf16(src[i]), round to nearest even.
[[nodiscard]] absl::Status LaunchToBf16(const float* src, bf16* dst, int64_t n,
                                        cudaStream_t stream);
// dst[i] = float(src[i]): exact widening (the bf16 bits in the high half of a float32). Plain
// C++ reference: Bf16BitsToFloat below; parity in model/tests/cuda_export_test.cc.
[[nodiscard]] absl::Status LaunchBf16ToF32(const bf16* src, float* dst, int64_t n,
                                           cudaStream_t stream);
inline float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}
// dst[i] = bf16 of a uniform value of standard deviation `stddev` from a hash of (seed, i).
[[nodiscard]] absl::Status LaunchRandomBf16(bf16* dst, int64_t n, uint64_t seed, float stddev,
                                            cudaStream_t stream);
// dst[i] = value.
[[nodiscard]] absl::Status LaunchFillF32(float* dst, int64_t n, float value, cudaStream_t stream);

}  // namespace kvr::model::cuda
