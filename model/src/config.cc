#include "kvr/model/config.h"

#include <cmath>
#include <numbers>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/common/status.h"
#include "kvr/model/gguf.h"
#include "nlohmann/json.hpp"

namespace kvr::model {

absl::string_view ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama:
      return "llama";
    case Architecture::kMistral:
      return "mistral";
    case Architecture::kQwen2:
      return "qwen2";
  }
  return "unknown";
}

int64_t ModelConfig::ParameterCount() const {
  const int64_t h = hidden;
  int64_t per_layer = 2 * h                                                    // norms
                      + h * (q_dim() + 2 * kv_dim())                           // wq, wk, wv
                      + (qkv_bias ? q_dim() + 2 * kv_dim() : 0) + q_dim() * h  // wo
                      + 3 * h * ffn;                                           // gate, up, down
  int64_t total = per_layer * n_layers + int64_t{vocab} * h + h;
  if (!tied_embeddings) total += int64_t{vocab} * h;
  return total;
}

absl::Status ModelConfig::Validate() const {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config '", name, "' (", ArchitectureName(arch), "): ", what));
  };
  if (n_layers <= 0) return bad(absl::StrCat("n_layers must be positive, got ", n_layers));
  if (hidden <= 0) return bad(absl::StrCat("hidden size must be positive, got ", hidden));
  if (n_heads <= 0 || n_kv_heads <= 0) {
    return bad(absl::StrCat("head counts must be positive, got ", n_heads, " query / ", n_kv_heads,
                            " kv"));
  }
  if (n_heads % n_kv_heads != 0) {
    return bad(
        absl::StrCat("n_heads (", n_heads, ") is not a multiple of n_kv_heads (", n_kv_heads, ")"));
  }
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return bad(absl::StrCat("head_dim must be positive and even, got ", head_dim));
  }
  if (ffn <= 0) return bad(absl::StrCat("ffn size must be positive, got ", ffn));
  if (vocab <= 0) return bad(absl::StrCat("vocab size must be positive, got ", vocab));
  if (!(rms_eps > 0.f)) return bad(absl::StrCat("rms eps must be positive, got ", rms_eps));
  if (!(rope_theta > 0.f))
    return bad(absl::StrCat("rope theta must be positive, got ", rope_theta));
  if (context_length <= 0) {
    return bad(absl::StrCat("context length must be positive, got ", context_length));
  }
  if (!rope_freq_factors.empty() && rope_freq_factors.size() != static_cast<size_t>(head_dim / 2)) {
    return bad(absl::StrCat("rope_freq_factors has ", rope_freq_factors.size(),
                            " entries, expected head_dim / 2 = ", head_dim / 2));
  }
  if (has_llama3_scaling) {
    const Llama3RopeScaling& s = llama3_scaling;
    if (!(s.factor > 0.f) || !(s.high_freq_factor > s.low_freq_factor) ||
        s.original_context_length <= 0) {
      return bad(
          "llama3 rope scaling needs factor > 0, high_freq_factor > low_freq_factor and "
          "original_max_position_embeddings > 0");
    }
  }
  return absl::OkStatus();
}

namespace {

// The shape a model file declares, as its reader gets it (integers int64, floats double).
struct DeclaredShape {
  int64_t n_layers = 0;
  int64_t hidden = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t ffn = 0;
  int64_t vocab = 0;
  int64_t context_length = 0;
  double rms_eps = 0;
};

// The shape fields of `c` from `s` (Validate checks them afterwards).
void SetShape(const DeclaredShape& s, ModelConfig& c) {
  c.n_layers = static_cast<int>(s.n_layers);
  c.hidden = static_cast<int>(s.hidden);
  c.n_heads = static_cast<int>(s.n_heads);
  c.n_kv_heads = static_cast<int>(s.n_kv_heads);
  c.head_dim = static_cast<int>(s.head_dim);
  c.ffn = static_cast<int>(s.ffn);
  c.vocab = static_cast<int>(s.vocab);
  c.context_length = s.context_length;
  c.rms_eps = static_cast<float>(s.rms_eps);
}

absl::StatusOr<Architecture> ArchitectureFromGgufName(absl::string_view name) {
  if (name == "llama") return Architecture::kLlama;
  if (name == "mistral") return Architecture::kMistral;
  if (name == "qwen2") return Architecture::kQwen2;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported model architecture '", name,
                   "' (general.architecture); kvr supports llama, mistral and qwen2"));
}

}  // namespace

absl::StatusOr<ModelConfig> ConfigFromGguf(const GgufFile& file) {
  ModelConfig c;
  KVR_ASSIGN_OR_RETURN(absl::string_view arch_name, file.GetString("general.architecture"));
  KVR_ASSIGN_OR_RETURN(c.arch, ArchitectureFromGgufName(arch_name));
  const std::string a(arch_name);
  if (file.Has("general.name")) {
    KVR_ASSIGN_OR_RETURN(absl::string_view name, file.GetString("general.name"));
    c.name = std::string(name);
  }
  auto get_int = [&](const std::string& key) -> absl::StatusOr<int64_t> {
    return file.GetInt(absl::StrCat(a, ".", key));
  };
  auto get_int_or = [&](const std::string& key, int64_t fallback) -> absl::StatusOr<int64_t> {
    const std::string full = absl::StrCat(a, ".", key);
    if (!file.Has(full)) return fallback;
    return file.GetInt(full);
  };
  auto get_float_or = [&](const std::string& key, double fallback) -> absl::StatusOr<double> {
    const std::string full = absl::StrCat(a, ".", key);
    if (!file.Has(full)) return fallback;
    return file.GetFloat(full);
  };
  DeclaredShape s;
  KVR_ASSIGN_OR_RETURN(s.n_layers, get_int("block_count"));
  KVR_ASSIGN_OR_RETURN(s.hidden, get_int("embedding_length"));
  KVR_ASSIGN_OR_RETURN(s.n_heads, get_int("attention.head_count"));
  KVR_ASSIGN_OR_RETURN(s.n_kv_heads, get_int_or("attention.head_count_kv", s.n_heads));
  KVR_ASSIGN_OR_RETURN(s.ffn, get_int("feed_forward_length"));
  KVR_ASSIGN_OR_RETURN(s.context_length, get_int("context_length"));
  KVR_ASSIGN_OR_RETURN(
      s.head_dim, get_int_or("attention.key_length", s.n_heads > 0 ? s.hidden / s.n_heads : 0));
  KVR_ASSIGN_OR_RETURN(s.rms_eps, get_float_or("attention.layer_norm_rms_epsilon", 1e-5));
  KVR_ASSIGN_OR_RETURN(double theta, get_float_or("rope.freq_base", 10000.0));
  KVR_ASSIGN_OR_RETURN(int64_t rope_dims, get_int_or("rope.dimension_count", s.head_dim));
  if (rope_dims != s.head_dim) {
    return absl::UnimplementedError(
        absl::StrCat("partial RoPE (", a, ".rope.dimension_count = ", rope_dims,
                     ", head_dim = ", s.head_dim, ") is not supported"));
  }
  if (file.Has(absl::StrCat(a, ".vocab_size"))) {
    KVR_ASSIGN_OR_RETURN(s.vocab, get_int("vocab_size"));
  } else {
    KVR_ASSIGN_OR_RETURN(const GgufTensorInfo* embd, file.FindTensor("token_embd.weight"));
    s.vocab = embd->dims.size() == 2 ? embd->dims[1] : 0;
  }
  SetShape(s, c);
  c.rope_theta = static_cast<float>(theta);
  c.tied_embeddings = !file.HasTensor("output.weight");
  c.qkv_bias = file.HasTensor("blk.0.attn_q.bias");

  // RoPE scaling. llama.cpp writes llama3 scaling as a rope_freqs.weight tensor of divisors;
  // linear scaling as a type + factor.
  const std::string scaling_type_key = absl::StrCat(a, ".rope.scaling.type");
  std::string scaling_type = "none";
  if (file.Has(scaling_type_key)) {
    KVR_ASSIGN_OR_RETURN(absl::string_view t, file.GetString(scaling_type_key));
    scaling_type = std::string(t);
  }
  if (file.HasTensor("rope_freqs.weight")) {
    KVR_ASSIGN_OR_RETURN(c.rope_freq_factors, file.DequantizeTensor("rope_freqs.weight"));
  } else if (scaling_type == "linear") {
    KVR_ASSIGN_OR_RETURN(double factor, get_float_or("rope.scaling.factor", 1.0));
    c.rope_freq_factors.assign(c.head_dim / 2, static_cast<float>(factor));
  } else if (scaling_type != "none") {
    return absl::UnimplementedError(
        absl::StrCat("RoPE scaling type '", scaling_type, "' (", scaling_type_key,
                     ") is not supported; kvr supports none, linear and llama3"));
  }
  KVR_RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::StatusOr<ModelConfig> ConfigFromHfJson(const nlohmann::json& j) {
  using nlohmann::json;
  if (!j.is_object()) return absl::InvalidArgumentError("config.json is not a JSON object");
  ModelConfig c;
  std::string arch_name;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string()) {
    arch_name = j["architectures"][0].get<std::string>();
  } else if (j.contains("model_type") && j["model_type"].is_string()) {
    arch_name = j["model_type"].get<std::string>();
  }
  if (arch_name == "LlamaForCausalLM" || arch_name == "llama") {
    c.arch = Architecture::kLlama;
  } else if (arch_name == "MistralForCausalLM" || arch_name == "mistral") {
    c.arch = Architecture::kMistral;
  } else if (arch_name == "Qwen2ForCausalLM" || arch_name == "qwen2") {
    c.arch = Architecture::kQwen2;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unsupported model architecture '", arch_name.empty() ? "<missing>" : arch_name,
        "' in config.json; kvr supports LlamaForCausalLM, MistralForCausalLM and "
        "Qwen2ForCausalLM"));
  }
  c.name = j.value("_name_or_path", arch_name);
  // Typed field access with errors that name the field.
  auto get_int = [&](const char* key, std::optional<int64_t> fallback) -> absl::StatusOr<int64_t> {
    if (!j.contains(key) || j[key].is_null()) {
      if (fallback) return *fallback;
      return absl::InvalidArgumentError(absl::StrCat("config.json lacks '", key, "'"));
    }
    if (!j[key].is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json '", key, "' is not an integer"));
    }
    return j[key].get<int64_t>();
  };
  auto get_float = [&](const json& obj, const char* key,
                       std::optional<double> fallback) -> absl::StatusOr<double> {
    if (!obj.contains(key) || obj[key].is_null()) {
      if (fallback) return *fallback;
      return absl::InvalidArgumentError(absl::StrCat("config.json lacks '", key, "'"));
    }
    if (!obj[key].is_number()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json '", key, "' is not a number"));
    }
    return obj[key].get<double>();
  };
  DeclaredShape s;
  KVR_ASSIGN_OR_RETURN(s.n_layers, get_int("num_hidden_layers", std::nullopt));
  KVR_ASSIGN_OR_RETURN(s.hidden, get_int("hidden_size", std::nullopt));
  KVR_ASSIGN_OR_RETURN(s.n_heads, get_int("num_attention_heads", std::nullopt));
  KVR_ASSIGN_OR_RETURN(s.n_kv_heads, get_int("num_key_value_heads", s.n_heads));
  KVR_ASSIGN_OR_RETURN(s.head_dim, get_int("head_dim", s.n_heads > 0 ? s.hidden / s.n_heads : 0));
  KVR_ASSIGN_OR_RETURN(s.ffn, get_int("intermediate_size", std::nullopt));
  KVR_ASSIGN_OR_RETURN(s.vocab, get_int("vocab_size", std::nullopt));
  KVR_ASSIGN_OR_RETURN(s.context_length, get_int("max_position_embeddings", int64_t{4096}));
  KVR_ASSIGN_OR_RETURN(s.rms_eps, get_float(j, "rms_norm_eps", 1e-6));
  SetShape(s, c);
  c.tied_embeddings = j.value("tie_word_embeddings", false);
  c.qkv_bias = c.arch == Architecture::kQwen2 ? true : j.value("attention_bias", false);

  // transformers 5 moved rope_theta/rope_scaling into rope_parameters; accept both.
  const json empty = json::object();
  const json& rope_params = j.contains("rope_parameters") && j["rope_parameters"].is_object()
                                ? j["rope_parameters"]
                                : empty;
  const json& rope_scaling =
      j.contains("rope_scaling") && j["rope_scaling"].is_object() ? j["rope_scaling"] : rope_params;
  KVR_ASSIGN_OR_RETURN(double theta, j.contains("rope_theta")
                                         ? get_float(j, "rope_theta", std::nullopt)
                                         : get_float(rope_params, "rope_theta", 10000.0));
  c.rope_theta = static_cast<float>(theta);
  std::string rope_type = "default";
  if (rope_scaling.contains("rope_type") && rope_scaling["rope_type"].is_string()) {
    rope_type = rope_scaling["rope_type"].get<std::string>();
  } else if (rope_scaling.contains("type") && rope_scaling["type"].is_string()) {
    rope_type = rope_scaling["type"].get<std::string>();
  }
  if (rope_type == "llama3") {
    c.has_llama3_scaling = true;
    KVR_ASSIGN_OR_RETURN(double factor, get_float(rope_scaling, "factor", std::nullopt));
    KVR_ASSIGN_OR_RETURN(double low, get_float(rope_scaling, "low_freq_factor", 1.0));
    KVR_ASSIGN_OR_RETURN(double high, get_float(rope_scaling, "high_freq_factor", 4.0));
    KVR_ASSIGN_OR_RETURN(double original,
                         get_float(rope_scaling, "original_max_position_embeddings", 8192.0));
    c.llama3_scaling = {static_cast<float>(factor), static_cast<float>(low),
                        static_cast<float>(high), static_cast<int64_t>(original)};
  } else if (rope_type == "linear") {
    KVR_ASSIGN_OR_RETURN(double factor, get_float(rope_scaling, "factor", std::nullopt));
    c.rope_freq_factors.assign(c.head_dim > 0 ? c.head_dim / 2 : 0, static_cast<float>(factor));
  } else if (rope_type != "default") {
    return absl::UnimplementedError(
        absl::StrCat("RoPE scaling type '", rope_type,
                     "' in config.json is not supported; kvr supports default, linear and llama3"));
  }
  KVR_RETURN_IF_ERROR(c.Validate());
  return c;
}

std::vector<float> RopeInverseFrequencies(const ModelConfig& config) {
  const int half = config.head_dim / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    // As transformers: base ** (2i / dim) in float32, then its reciprocal.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(config.head_dim);
    inv[i] = 1.0f / std::pow(config.rope_theta, exponent);
  }
  if (config.has_llama3_scaling) {
    // transformers' _compute_llama3_parameters.
    const Llama3RopeScaling& s = config.llama3_scaling;
    const float old_ctx = static_cast<float>(s.original_context_length);
    const float low_freq_wavelen = old_ctx / s.low_freq_factor;
    const float high_freq_wavelen = old_ctx / s.high_freq_factor;
    for (int i = 0; i < half; ++i) {
      const float wavelen = 2.f * std::numbers::pi_v<float> / inv[i];
      float scaled = wavelen > low_freq_wavelen ? inv[i] / s.factor : inv[i];
      const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      if (medium) {
        const float smooth =
            (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        scaled = (1.f - smooth) * scaled / s.factor + smooth * scaled;
      }
      inv[i] = scaled;
    }
  }
  if (!config.rope_freq_factors.empty()) {
    for (int i = 0; i < half; ++i) inv[i] /= config.rope_freq_factors[i];
  }
  return inv;
}

}  // namespace kvr::model
