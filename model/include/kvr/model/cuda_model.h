#pragma once
// The CUDA backend of the model runtime: the same Llama-family forward pass as the CPU `Model`
// (model.h), on one GPU, with bf16 weights and a bf16 device KV cache.
//
// - Weights are uploaded once, as bf16 (matrices and the embedding; norms and the QKV bias stay
//   float32). Every projection is one cuBLAS GEMM (bf16 in, float32 accumulate and output); the
//   residual adds are folded into the o_proj and down_proj GEMMs (beta = 1 onto the float32
//   residual stream).
// - Attention is dense and runs on the GPU (a causal flash-style kernel for prefill chunks, a
//   split-KV kernel with a log-sum-exp merge for decode steps): this backend does not go through
//   the `Attention` seam of attention.h, whose KvView is float32 host memory.
// - Each sequence owns a device KV cache [n_layers, 2 (K, V), capacity, n_kv_heads, head_dim]
//   bf16, keys with RoPE applied, reserved by AddSequence.
//
// This header has no CUDA types: the factories answer Unimplemented in a build without nvcc
// (CONVENTIONS.md 7), so callers link `kvr::model_cuda` unconditionally.
//
// Thread safety: none; one thread drives a CudaModel (it owns one CUDA stream and one cuBLAS
// handle). Forward is synchronous: it returns once the logits are back in host memory.

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/model/attention.h"
#include "kvr/model/config.h"
#include "kvr/model/model.h"
#include "kvr/model/weights.h"

namespace kvr::model {

struct CudaModelOptions {
  int device = 0;                   // CUDA device ordinal
  int64_t max_batch_tokens = 2048;  // new tokens per Forward (sizes the activation buffers)
  int max_sequences = 64;           // sequences per Forward
  int64_t max_logits_rows = 64;     // rows of the output projection per GEMM (kAll is chunked)
  // Times GEMMs, attention and the other kernels of each Forward with CUDA events
  // (last_profile()); costs a little host time per kernel, so off by default.
  bool profile = false;
};

// One sequence's part of a CudaModel::Forward call: the tokens that follow what its device KV
// cache already holds (a prefill chunk, or one token of a decode step).
struct CudaSequence {
  SequenceId id = 0;
  std::span<const int32_t> tokens;
};

// Where the GPU time of the last Forward went (profile = true), in milliseconds.
struct CudaForwardProfile {
  double total_ms = 0;      // first kernel to last, on the GPU
  double gemm_ms = 0;       // cuBLAS projections (QKV, O, gate/up, down, output)
  double attention_ms = 0;  // attention kernels (incl. the decode merge)
  double other_ms = 0;      // norms, RoPE, SwiGLU, embedding, argmax
};

class CudaModel {
 public:
  virtual ~CudaModel() = default;

  virtual const ModelConfig& config() const = 0;
  // Bytes of device memory held by the weights.
  virtual int64_t weight_bytes() const = 0;

  // Reserves the device KV cache of a new sequence for `capacity` tokens (at most the model's
  // context length). AlreadyExists for a known id, ResourceExhausted when the GPU is full.
  [[nodiscard]] virtual absl::Status AddSequence(SequenceId id, int64_t capacity) = 0;
  // Frees the sequence's KV cache. NotFound for an unknown id.
  [[nodiscard]] virtual absl::Status ReleaseSequence(SequenceId id) = 0;
  // Tokens held in the sequence's cache.
  [[nodiscard]] virtual absl::StatusOr<int64_t> SequenceLength(SequenceId id) const = 0;
  // For benchmarks: sets the sequence's length to `n_tokens`, filling its cache with
  // deterministic random K/V rows (no forward pass), so that decode can be timed at a long
  // context without a prefill.
  [[nodiscard]] virtual absl::Status FillSequenceForBenchmark(SequenceId id, int64_t n_tokens,
                                                              uint64_t seed) = 0;

  // Runs the new tokens of every sequence, appends their K/V to the sequences' caches and writes
  // the logits into `logits` (kLast: [batch, vocab]; kAll: [total new tokens, vocab]).
  // Errors: empty batch or sequence, unknown or repeated sequence, more tokens or sequences than
  // the options allow, a sequence past its capacity or the context length, token ids outside
  // the vocabulary, logits of the wrong size. On error no cache changes length.
  [[nodiscard]] virtual absl::Status Forward(std::span<const CudaSequence> batch, LogitsMode mode,
                                             std::span<float> logits) = 0;
  // As Forward with kLast, but takes the argmax of each sequence's logits on the GPU (ties go
  // to the lowest id, as ArgMax in sampler.h) and copies back only the tokens: [batch].
  [[nodiscard]] virtual absl::Status ForwardGreedy(std::span<const CudaSequence> batch,
                                                   std::span<int32_t> next_tokens) = 0;

  // GPU time split of the last Forward/ForwardGreedy (zeros unless profiling is on).
  virtual CudaForwardProfile last_profile() const = 0;
  // Turns the per-kernel event timing of CudaModelOptions::profile on or off.
  virtual void set_profile(bool on) = 0;
};

// Whether this build has the CUDA backend and a usable GPU.
bool CudaModelAvailable();

// Uploads `weights` (checked against `config`) to the GPU as bf16. Unimplemented in a build
// without CUDA; FailedPrecondition when no GPU is usable.
[[nodiscard]] absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModel(
    const ModelConfig& config, const ModelWeights& weights, const CudaModelOptions& options);

// Random weights generated on the GPU (deterministic in `seed`; scaled as RandomWeights in
// weights.h: norms 1, matrices with standard deviation 1/sqrt(fan_in)), for benchmarks of
// shapes whose float32 host weights would not fit in host memory.
[[nodiscard]] absl::StatusOr<std::unique_ptr<CudaModel>> CreateCudaModelWithRandomWeights(
    const ModelConfig& config, uint64_t seed, const CudaModelOptions& options);

}  // namespace kvr::model
