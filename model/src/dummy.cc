#include "kvr/model/dummy.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/common/status.h"

namespace kvr::model {

std::vector<std::string> DummyShapeNames() {
  return {"smollm2-135m", "qwen2-0.5b", "llama3-8b", "tiny"};
}

absl::StatusOr<ModelConfig> DummyConfig(absl::string_view shape, int n_layers_override) {
  ModelConfig c;
  c.name = std::string(shape);
  if (shape == "smollm2-135m") {
    // HuggingFaceTB/SmolLM2-135M-Instruct config.json.
    c.arch = Architecture::kLlama;
    c.n_layers = 30, c.hidden = 576, c.n_heads = 9, c.n_kv_heads = 3, c.head_dim = 64;
    c.ffn = 1536, c.vocab = 49152, c.rms_eps = 1e-5f, c.rope_theta = 100000.f;
    c.tied_embeddings = true, c.context_length = 8192;
  } else if (shape == "qwen2-0.5b") {
    // Qwen/Qwen2-0.5B config.json.
    c.arch = Architecture::kQwen2;
    c.n_layers = 24, c.hidden = 896, c.n_heads = 14, c.n_kv_heads = 2, c.head_dim = 64;
    c.ffn = 4864, c.vocab = 151936, c.rms_eps = 1e-6f, c.rope_theta = 1000000.f;
    c.tied_embeddings = true, c.qkv_bias = true, c.context_length = 32768;
  } else if (shape == "llama3-8b") {
    // meta-llama/Llama-3.1-8B config.json.
    c.arch = Architecture::kLlama;
    c.n_layers = 32, c.hidden = 4096, c.n_heads = 32, c.n_kv_heads = 8, c.head_dim = 128;
    c.ffn = 14336, c.vocab = 128256, c.rms_eps = 1e-5f, c.rope_theta = 500000.f;
    c.has_llama3_scaling = true;
    c.llama3_scaling = {8.f, 1.f, 4.f, 8192};
    c.context_length = 131072;
  } else if (shape == "tiny") {
    // Small enough for unit tests, with GQA, QKV bias and llama3 scaling exercised.
    c.arch = Architecture::kQwen2;
    c.n_layers = 2, c.hidden = 64, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16;
    c.ffn = 128, c.vocab = 256, c.rms_eps = 1e-5f, c.rope_theta = 10000.f;
    c.has_llama3_scaling = true;
    c.llama3_scaling = {4.f, 1.f, 4.f, 64};
    c.qkv_bias = true, c.context_length = 1024;
  } else {
    return absl::NotFoundError(
        absl::StrCat("unknown dummy model shape '", shape,
                     "'; known shapes: ", absl::StrJoin(DummyShapeNames(), ", ")));
  }
  if (n_layers_override > 0) c.n_layers = n_layers_override;
  KVR_RETURN_IF_ERROR(c.Validate());
  return c;
}

}  // namespace kvr::model
