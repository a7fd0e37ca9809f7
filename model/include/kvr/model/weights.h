#pragma once
// The weights of a Llama-family model, dequantised to float32 and laid out for the CPU forward
// pass: row-major [out, in] matrices (PyTorch's Linear layout) so that y = x W^T is one SGEMM
// with W transposed. Q, K and V are fused into one matrix and gate/up into another so that each
// layer runs three large GEMMs instead of six.
//
// RoPE layout: Q and K rows are in Hugging Face's "rotate half" order (the pairs are (i,
// i + head_dim/2)). llama.cpp's converter permutes llama/mistral Q and K into interleaved
// pairs; LoadGgufWeights undoes that, so GGUF and safetensors give identical tensors and the
// KV cache has one layout whatever the source.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/model/config.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {

class GgufFile;
class SafetensorsCheckpoint;

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> wqkv;       // [q_dim + 2 * kv_dim, hidden]: rows of Q, then K, then V
  std::vector<float> bqkv;       // [q_dim + 2 * kv_dim], empty without QKV bias
  std::vector<float> wo;         // [hidden, q_dim]
  std::vector<float> ffn_norm;   // [hidden]
  std::vector<float> w_gate_up;  // [2 * ffn, hidden]: rows of gate, then up
  std::vector<float> w_down;     // [hidden, ffn]
};

struct ModelWeights {
  std::vector<float> token_embd;   // [vocab, hidden]
  std::vector<float> output_norm;  // [hidden]
  std::vector<float> output;       // [vocab, hidden]; empty when tied to token_embd
  std::vector<LayerWeights> layers;

  // The output projection [vocab, hidden].
  const float* output_matrix() const { return output.empty() ? token_embd.data() : output.data(); }
  int64_t allocated_bytes() const;
  // Checks every tensor's size against `config`.
  [[nodiscard]] absl::Status CheckShapes(const ModelConfig& config) const;
};

// Loads and dequantises every tensor of a GGUF file (llama.cpp tensor names). Errors name the
// missing or mis-shaped tensor.
[[nodiscard]] absl::StatusOr<ModelWeights> LoadGgufWeights(const GgufFile& file,
                                                           const ModelConfig& config,
                                                           ThreadPool* pool);

// Loads a Hugging Face checkpoint (model.layers.N.self_attn.q_proj.weight, ...).
[[nodiscard]] absl::StatusOr<ModelWeights> LoadHfWeights(const SafetensorsCheckpoint& checkpoint,
                                                         const ModelConfig& config,
                                                         ThreadPool* pool);

// Random weights for performance work (`--load-format dummy`): deterministic in `seed`, scaled
// so that activations stay finite through many layers (norm weights 1, matrices uniform with
// standard deviation ~ 1/sqrt(fan_in)).
[[nodiscard]] absl::StatusOr<ModelWeights> RandomWeights(const ModelConfig& config, uint64_t seed,
                                                         ThreadPool* pool);

// llama.cpp's converter permutes each head's rows of Q/K as
//   w.reshape(n_head, 2, head_dim / 2, in).swapaxes(1, 2)
// This undoes it in place on a [n_head * head_dim, in] matrix (or a bias with in = 1).
void UnpermuteRopeRows(float* w, int n_head, int head_dim, int64_t in);

}  // namespace kvr::model
