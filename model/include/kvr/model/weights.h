#pragma once
// The weights of a Llama-family model, laid out for the CPU forward pass, in one of two
// storages:
//   - float32 (WeightStorage::kFloat32, and always for Hugging Face and dummy weights): every
//     matrix dequantised into the std::vector<float> fields; the exact reference path.
//   - packed (WeightStorage::kPacked, GGUF only): the matrices stay in the file's ggml formats
//     in the PackedMatrix fields (a quarter to an eighth of the float32 bytes) and the float
//     vectors of the matrices are empty; norms and biases stay float32.
// Either way matrices are row-major [out, in] (PyTorch's Linear layout) so that y = x W^T is one SGEMM
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
#include "kvr/model/packed_matrix.h"

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

  // Packed storage: the same four matrices, same shapes and row order.
  PackedMatrix packed_wqkv;
  PackedMatrix packed_wo;
  PackedMatrix packed_w_gate_up;
  PackedMatrix packed_w_down;
};

enum class WeightStorage { kFloat32, kPacked };

struct ModelWeights {
  std::vector<float> token_embd;   // [vocab, hidden]
  std::vector<float> output_norm;  // [hidden]
  std::vector<float> output;       // [vocab, hidden]; empty when tied to token_embd
  std::vector<LayerWeights> layers;
  // Packed storage: the embedding [vocab, hidden] and the untied output projection (empty when
  // tied); token_embd and output are then empty.
  PackedMatrix packed_token_embd;
  PackedMatrix packed_output;

  bool packed() const { return !packed_token_embd.empty(); }

  // The output projection [vocab, hidden].
  const float* output_matrix() const { return output.empty() ? token_embd.data() : output.data(); }
  // The output projection in packed storage.
  const PackedMatrix& packed_output_matrix() const {
    return packed_output.empty() ? packed_token_embd : packed_output;
  }
  // Bytes held by the weights (float vectors and packed matrices).
  int64_t allocated_bytes() const;
  // Checks every tensor's size against `config`.
  [[nodiscard]] absl::Status CheckShapes(const ModelConfig& config) const;
};

// Loads every tensor of a GGUF file (llama.cpp tensor names). Errors name the missing or
// mis-shaped tensor. kPacked keeps Q4_0/Q4_1/Q8_0/F16/BF16/F32 matrices as stored; a fused
// matrix whose parts differ in type, or a type the kernels do not take (the K-quants, Q5_x),
// is dequantised and requantised to Q8_0.
[[nodiscard]] absl::StatusOr<ModelWeights> LoadGgufWeights(
    const GgufFile& file, const ModelConfig& config, ThreadPool* pool,
    WeightStorage storage = WeightStorage::kFloat32);

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
// The same on rows of `row_bytes` bytes (packed rows permute as whole rows).
void UnpermuteRopeRowBytes(uint8_t* w, int n_head, int head_dim, int64_t row_bytes);

}  // namespace kvr::model
