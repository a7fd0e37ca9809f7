#pragma once
// The CPU forward pass of a Llama-family model (llama, mistral, qwen2, SmolLM2).
//
// One Forward call advances a batch of sequences: each brings the tokens that follow what its
// KvCache already holds (a prefill chunk: many tokens of one sequence; a decode step: one token
// of each of several sequences). All tokens of the batch go through the dense layers together
// as one [n_tokens, hidden] activation, so every projection is a single SGEMM; the attention
// step is handed to the `Attention` given by the caller, so that retrieval can swap in sparse
// attention without touching the model.
//
// Weights: float32 (every projection is an SGEMM; the exact reference) or packed in the GGUF's
// own formats (weights.h): then decode steps multiply on the packed rows with the CpuKernels of
// the CPU's widest instruction set and prefill dequantises tiles of rows for SGEMM
// (packed_matrix.h).
//
// Threads: the model spreads work over the ThreadPool it is given (GEMMs are split along their
// output columns, elementwise work along tokens) and runs OpenBLAS single-threaded inside each
// chunk, so there is exactly one set of threads and no oversubscription.
//
// Thread safety: Forward may be called from one thread at a time (the pool is shared).

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/model/attention.h"
#include "kvr/model/config.h"
#include "kvr/model/cpu_kernels.h"
#include "kvr/model/kv_cache.h"
#include "kvr/model/weights.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {

// One sequence's part of a Forward call.
struct ForwardSequence {
  SequenceId id = 0;
  // Holds the sequence's earlier tokens; the new ones are appended. A windowed cache (decode
  // node) takes one new token per Forward.
  KvCache* cache = nullptr;
  std::span<const int32_t> tokens;  // new tokens, at positions cache->n_tokens() ...
};

enum class LogitsMode {
  kLast,  // logits of each sequence's last new token: [batch, vocab]
  kAll,   // logits of every new token, sequences in order: [total new tokens, vocab]
};

class Model {
 public:
  // `pool` must outlive the model. Fails when the weights do not match the config.
  // `kv_dtype` is the precision of the KV rows: with kF16, Forward rounds every new K and V
  // row to half before it reaches any cache, and NewCache() stores half. So a float32 cache
  // (a node's, whose rows go to the KV store and to retrieval indexes as float) holds the same
  // values as a half cache of a single process, and the two agree bit for bit.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Model>> Create(
      ModelConfig config, ModelWeights weights, ThreadPool* pool, KvDType kv_dtype = KvDType::kF32);

  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  ThreadPool* pool() const { return pool_; }

  KvDType kv_dtype() const { return kv_dtype_; }

  // An empty dense cache shaped for this model, storing kv_dtype() rows (or `storage`'s: a
  // float32 cache for consumers that read float rows; the values are the same).
  KvCache NewCache() const { return NewCache(kv_dtype_); }
  KvCache NewCache(KvDType storage) const;

  // Runs the new tokens of every sequence and writes their logits into `logits` (sized for
  // `mode`). Errors: empty batch or sequence, token id outside the vocabulary, a sequence that
  // would run past the context length (InvalidArgument naming both numbers), logits of the
  // wrong size, or an error from `attention`.
  [[nodiscard]] absl::Status Forward(std::span<const ForwardSequence> batch, Attention& attention,
                                     LogitsMode mode, std::span<float> logits) const;

  // Prefill of one sequence in chunks of at most `chunk_tokens` tokens (bounds the activation
  // memory of long prompts). Returns the logits of the last token [vocab].
  [[nodiscard]] absl::StatusOr<std::vector<float>> Prefill(SequenceId id, KvCache& cache,
                                                           std::span<const int32_t> tokens,
                                                           Attention& attention,
                                                           int64_t chunk_tokens = 512) const;

 private:
  Model(ModelConfig config, ModelWeights weights, ThreadPool* pool, KvDType kv_dtype);

  ModelConfig config_;
  ModelWeights weights_;
  ThreadPool* pool_;
  KvDType kv_dtype_;
  const CpuKernels* kernels_;  // packed weights' gemv kernels (the CPU's widest ISA)
  std::vector<float> rope_inv_freq_;  // [head_dim / 2]
};

// ---- building blocks, exposed for tests and for other backends' parity checks ---------------

// y = x / sqrt(mean(x^2) + eps) * weight, over rows of `x` [n_rows, dim].
void RmsNorm(const float* x, const float* weight, int64_t n_rows, int dim, float eps, float* y);

// Rotates `x` [n_tokens, n_heads, head_dim] in place, token t at position positions[t], with
// Hugging Face's rotate-half pairing (i, i + head_dim / 2). `row_stride` is the number of floats
// between consecutive tokens.
void ApplyRope(float* x, int64_t n_tokens, int n_heads, int head_dim, int64_t row_stride,
               std::span<const int64_t> positions, std::span<const float> inv_freq);

// C[m, n] = A[m, k] * W[n, k]^T, split along n over `pool` (may be null). With allow_gemv one
// row takes sgemv; without, every m takes SGEMM calls of whole 64-column slices, whose rows
// do not depend on m (see PackedMatMul).
void MatMulTransposed(ThreadPool* pool, const float* a, int64_t m, int64_t k, const float* w,
                      int64_t n, float* c, bool allow_gemv = true);

}  // namespace kvr::model
