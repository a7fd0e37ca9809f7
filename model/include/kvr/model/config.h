#pragma once
// The shape and hyper-parameters of a Llama-family model, read from GGUF metadata or from a
// Hugging Face config.json. Everything the forward pass needs to know about a model, and
// nothing about where its weights come from.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace kvr::model {

class GgufFile;

enum class Architecture {
  kLlama,    // Llama 2/3, SmolLM2 (GGUF "llama", HF LlamaForCausalLM)
  kMistral,  // GGUF "mistral" (llama.cpp writes Mistral as "llama"), HF MistralForCausalLM
  kQwen2,    // GGUF "qwen2", HF Qwen2ForCausalLM: QKV bias, NEOX rope
};

absl::string_view ArchitectureName(Architecture arch);

// Llama 3.1-style frequency-dependent RoPE scaling (HF rope_type "llama3").
struct Llama3RopeScaling {
  float factor = 1.f;
  float low_freq_factor = 1.f;
  float high_freq_factor = 4.f;
  int64_t original_context_length = 8192;
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  std::string name;  // informational (general.name / _name_or_path / dummy shape)
  int n_layers = 0;
  int hidden = 0;      // embedding width
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (GQA)
  int head_dim = 0;
  int ffn = 0;  // MLP intermediate width
  int vocab = 0;
  float rms_eps = 1e-5f;
  float rope_theta = 10000.f;
  // Exactly one of these describes RoPE scaling, or neither (plain RoPE):
  bool has_llama3_scaling = false;
  Llama3RopeScaling llama3_scaling;  // from config.json rope_scaling / rope_parameters
  // Per-frequency divisors [head_dim / 2], as GGUF stores llama3 scaling (rope_freqs.weight).
  std::vector<float> rope_freq_factors;
  bool tied_embeddings = false;  // output projection = token embedding
  bool qkv_bias = false;
  int64_t context_length = 0;  // maximum positions the model supports

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  // Parameters, counting a tied output once.
  int64_t ParameterCount() const;

  // Checks internal consistency (positive sizes, n_heads % n_kv_heads == 0, even head_dim, ...).
  [[nodiscard]] absl::Status Validate() const;
};

// Reads `general.architecture` and the `<arch>.*` keys. Unsupported architectures give
// InvalidArgument naming the architecture. `rope_freq_factors` is filled from the
// rope_freqs.weight tensor when the file has one; `tied_embeddings` from the absence of
// output.weight.
[[nodiscard]] absl::StatusOr<ModelConfig> ConfigFromGguf(const GgufFile& file);

// Reads a Hugging Face config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM).
[[nodiscard]] absl::StatusOr<ModelConfig> ConfigFromHfJson(const nlohmann::json& config);

// The RoPE inverse frequencies [head_dim / 2] after scaling, as Hugging Face computes them.
std::vector<float> RopeInverseFrequencies(const ModelConfig& config);

}  // namespace kvr::model
