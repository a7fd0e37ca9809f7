// The same random llama (and qwen2) model written as a Hugging Face checkpoint (config.json +
// model.safetensors, rotate-half Q/K rows) and as a GGUF file (llama.cpp tensor names, Q/K rows
// permuted as llama.cpp's converter does) loads to identical weights and identical logits:
// the loaders undo the GGUF permutation (llama) and agree on every tensor's layout (llama,
// qwen2 with QKV bias).

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "gguf_builder.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/config.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/dummy.h"
#include "kvr/model/gguf.h"
#include "kvr/model/model.h"
#include "kvr/model/safetensors.h"
#include "kvr/model/weights.h"
#include "nlohmann/json.hpp"

namespace kvr::model {
namespace {

namespace fs = std::filesystem;

struct Tensor {
  std::vector<int64_t> shape;  // PyTorch order
  std::vector<float> data;
};
using TensorMap = std::map<std::string, Tensor>;

// Splits the fused runtime layout back into Hugging Face tensors.
TensorMap ToHfTensors(const ModelConfig& c, const ModelWeights& w) {
  TensorMap t;
  const int64_t h = c.hidden, q = c.q_dim(), kv = c.kv_dim(), f = c.ffn;
  auto slice = [](const std::vector<float>& v, int64_t begin, int64_t n) {
    return std::vector<float>(v.begin() + begin, v.begin() + begin + n);
  };
  t["model.embed_tokens.weight"] = {{c.vocab, h}, w.token_embd};
  t["model.norm.weight"] = {{h}, w.output_norm};
  if (!c.tied_embeddings) t["lm_head.weight"] = {{c.vocab, h}, w.output};
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t[p + "input_layernorm.weight"] = {{h}, l.attn_norm};
    t[p + "self_attn.q_proj.weight"] = {{q, h}, slice(l.wqkv, 0, q * h)};
    t[p + "self_attn.k_proj.weight"] = {{kv, h}, slice(l.wqkv, q * h, kv * h)};
    t[p + "self_attn.v_proj.weight"] = {{kv, h}, slice(l.wqkv, (q + kv) * h, kv * h)};
    if (c.qkv_bias) {
      t[p + "self_attn.q_proj.bias"] = {{q}, slice(l.bqkv, 0, q)};
      t[p + "self_attn.k_proj.bias"] = {{kv}, slice(l.bqkv, q, kv)};
      t[p + "self_attn.v_proj.bias"] = {{kv}, slice(l.bqkv, q + kv, kv)};
    }
    t[p + "self_attn.o_proj.weight"] = {{h, q}, l.wo};
    t[p + "post_attention_layernorm.weight"] = {{h}, l.ffn_norm};
    t[p + "mlp.gate_proj.weight"] = {{f, h}, slice(l.w_gate_up, 0, f * h)};
    t[p + "mlp.up_proj.weight"] = {{f, h}, slice(l.w_gate_up, f * h, f * h)};
    t[p + "mlp.down_proj.weight"] = {{h, f}, l.w_down};
  }
  return t;
}

void WriteSafetensors(const TensorMap& tensors, const std::string& path) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t bytes = t.data.size() * sizeof(float);
    header[name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = text.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << text;
  for (const auto& [name, t] : tensors) {
    out.write(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
  }
}

// llama.cpp's converter: w.reshape(n_head, 2, d/2, in).swapaxes(1, 2).
std::vector<float> Permute(const std::vector<float>& w, int n_head, int d, int64_t in) {
  std::vector<float> out(w.size());
  for (int h = 0; h < n_head; ++h) {
    for (int i = 0; i < d / 2; ++i) {
      for (int j = 0; j < 2; ++j) {
        std::memcpy(&out[(int64_t{h} * d + 2 * i + j) * in],
                    &w[(int64_t{h} * d + j * (d / 2) + i) * in], in * sizeof(float));
      }
    }
  }
  return out;
}

// A GGUF v3 file with llama or qwen2 metadata and F32 tensors, as llama.cpp's converter writes
// them: llama's Q/K rows permuted, qwen2's not (it uses NEOX rope) but with QKV biases.
void WriteGguf(const ModelConfig& c, const TensorMap& hf, const std::string& path) {
  const bool llama = c.arch == Architecture::kLlama;
  const std::string a = llama ? "llama" : "qwen2";
  gguf_test::GgufBuilder b;
  auto kv_u32 = [&](const std::string& k, uint32_t v) { b.Kv(k, GgufValueType::kUint32, v); };
  auto kv_f32 = [&](const std::string& k, float v) { b.Kv(k, GgufValueType::kFloat32, v); };

  // GGUF names, with Q/K permuted.
  std::vector<std::pair<std::string, Tensor>> tensors;
  auto add = [&](const std::string& name, const std::string& hf_name, bool permute_heads = false,
                 int n_head = 0) {
    Tensor t = hf.at(hf_name);
    if (permute_heads) {
      t.data = Permute(t.data, n_head, c.head_dim, t.shape.size() == 2 ? t.shape[1] : 1);
    }
    tensors.emplace_back(name, std::move(t));
  };
  add("token_embd.weight", "model.embed_tokens.weight");
  add("output_norm.weight", "model.norm.weight");
  if (!c.tied_embeddings) add("output.weight", "lm_head.weight");
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string g = "blk." + std::to_string(i) + ".";
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(g + "attn_norm.weight", p + "input_layernorm.weight");
    add(g + "attn_q.weight", p + "self_attn.q_proj.weight", llama, c.n_heads);
    add(g + "attn_k.weight", p + "self_attn.k_proj.weight", llama, c.n_kv_heads);
    add(g + "attn_v.weight", p + "self_attn.v_proj.weight");
    if (c.qkv_bias) {
      add(g + "attn_q.bias", p + "self_attn.q_proj.bias");
      add(g + "attn_k.bias", p + "self_attn.k_proj.bias");
      add(g + "attn_v.bias", p + "self_attn.v_proj.bias");
    }
    add(g + "attn_output.weight", p + "self_attn.o_proj.weight");
    add(g + "ffn_norm.weight", p + "post_attention_layernorm.weight");
    add(g + "ffn_gate.weight", p + "mlp.gate_proj.weight");
    add(g + "ffn_up.weight", p + "mlp.up_proj.weight");
    add(g + "ffn_down.weight", p + "mlp.down_proj.weight");
  }
  b.Counts(tensors.size(), 10);
  b.KvStr("general.architecture", a);
  kv_u32(a + ".block_count", c.n_layers);
  kv_u32(a + ".context_length", static_cast<uint32_t>(c.context_length));
  kv_u32(a + ".embedding_length", c.hidden);
  kv_u32(a + ".feed_forward_length", c.ffn);
  kv_u32(a + ".attention.head_count", c.n_heads);
  kv_u32(a + ".attention.head_count_kv", c.n_kv_heads);
  kv_f32(a + ".rope.freq_base", c.rope_theta);
  kv_f32(a + ".attention.layer_norm_rms_epsilon", c.rms_eps);
  kv_u32(a + ".vocab_size", c.vocab);
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    // ggml order (fastest dimension first), F32 (type 0).
    b.TensorInfo(name, {t.shape.rbegin(), t.shape.rend()}, 0, offset);
    offset += (t.data.size() * 4 + 31) / 32 * 32;
  }
  b.Align(32);
  for (const auto& [name, t] : tensors) b.Raw(t.data.data(), t.data.size() * 4).Align(32);
  b.WriteTo(path);
}

class WeightsFormatTest : public testing::TestWithParam<Architecture> {};

TEST_P(WeightsFormatTest, HfAndGgufOfTheSameModelGiveTheSameWeightsAndLogits) {
  ThreadPool pool(2);
  auto config = DummyConfig("tiny");
  ASSERT_TRUE(config.ok());
  config->arch = GetParam();
  config->qkv_bias = GetParam() == Architecture::kQwen2;
  config->has_llama3_scaling = false;
  config->tied_embeddings = false;
  auto original = RandomWeights(*config, 9, &pool);
  ASSERT_TRUE(original.ok());
  const TensorMap hf = ToHfTensors(*config, *original);

  const fs::path dir =
      fs::temp_directory_path() / ("kvr_weights_format_" + std::to_string(getpid()));
  fs::create_directories(dir / "hf");
  WriteSafetensors(hf, (dir / "hf" / "model.safetensors").string());
  const nlohmann::json hf_config = {
      {"architectures",
       {GetParam() == Architecture::kLlama ? "LlamaForCausalLM" : "Qwen2ForCausalLM"}},
      {"hidden_size", config->hidden},
      {"intermediate_size", config->ffn},
      {"num_hidden_layers", config->n_layers},
      {"num_attention_heads", config->n_heads},
      {"num_key_value_heads", config->n_kv_heads},
      {"vocab_size", config->vocab},
      {"rms_norm_eps", config->rms_eps},
      {"rope_theta", config->rope_theta},
      {"max_position_embeddings", config->context_length},
      {"tie_word_embeddings", false}};
  std::ofstream(dir / "hf" / "config.json") << hf_config.dump();
  WriteGguf(*config, hf, (dir / "model.gguf").string());

  auto checkpoint = SafetensorsCheckpoint::Open((dir / "hf").string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto hf_cfg = ConfigFromHfJson(checkpoint->config());
  ASSERT_TRUE(hf_cfg.ok()) << hf_cfg.status();
  auto hf_weights = LoadHfWeights(*checkpoint, *hf_cfg, &pool);
  ASSERT_TRUE(hf_weights.ok()) << hf_weights.status();

  auto gguf = GgufFile::Open((dir / "model.gguf").string());
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  auto gguf_cfg = ConfigFromGguf(*gguf);
  ASSERT_TRUE(gguf_cfg.ok()) << gguf_cfg.status();
  EXPECT_EQ(gguf_cfg->n_kv_heads, config->n_kv_heads);
  EXPECT_EQ(gguf_cfg->arch, GetParam());
  EXPECT_EQ(gguf_cfg->qkv_bias, config->qkv_bias);
  EXPECT_EQ(hf_cfg->qkv_bias, config->qkv_bias);
  EXPECT_FALSE(gguf_cfg->tied_embeddings);
  auto gguf_weights = LoadGgufWeights(*gguf, *gguf_cfg, &pool);
  ASSERT_TRUE(gguf_weights.ok()) << gguf_weights.status();
  fs::remove_all(dir);

  for (int i = 0; i < config->n_layers; ++i) {
    EXPECT_EQ(hf_weights->layers[i].wqkv, original->layers[i].wqkv) << "layer " << i;
    EXPECT_EQ(gguf_weights->layers[i].wqkv, original->layers[i].wqkv) << "layer " << i;
    EXPECT_EQ(gguf_weights->layers[i].bqkv, original->layers[i].bqkv) << "layer " << i;
    EXPECT_EQ(hf_weights->layers[i].bqkv, original->layers[i].bqkv) << "layer " << i;
    EXPECT_EQ(gguf_weights->layers[i].w_gate_up, original->layers[i].w_gate_up);
    EXPECT_EQ(gguf_weights->layers[i].w_down, original->layers[i].w_down);
  }
  EXPECT_EQ(gguf_weights->output, original->output);

  auto hf_model = Model::Create(*hf_cfg, std::move(*hf_weights), &pool);
  auto gguf_model = Model::Create(*gguf_cfg, std::move(*gguf_weights), &pool);
  ASSERT_TRUE(hf_model.ok() && gguf_model.ok());
  DenseAttention attention(&pool);
  const std::vector<int32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79};
  KvCache a = (*hf_model)->NewCache(), b = (*gguf_model)->NewCache();
  auto la = (*hf_model)->Prefill(1, a, prompt, attention);
  auto lb = (*gguf_model)->Prefill(1, b, prompt, attention);
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_EQ(*la, *lb);
}

INSTANTIATE_TEST_SUITE_P(Architectures, WeightsFormatTest,
                         testing::Values(Architecture::kLlama, Architecture::kQwen2),
                         [](const testing::TestParamInfo<Architecture>& info) {
                           return std::string(ArchitectureName(info.param));
                         });

TEST(WeightsFormatErrorTest, MisShapedTensorIsNamed) {
  ThreadPool pool(1);
  auto config = DummyConfig("tiny");
  ASSERT_TRUE(config.ok());
  config->arch = Architecture::kLlama;
  config->qkv_bias = false;
  config->has_llama3_scaling = false;
  auto weights = RandomWeights(*config, 1, &pool);
  ASSERT_TRUE(weights.ok());
  TensorMap hf = ToHfTensors(*config, *weights);
  hf["model.layers.1.mlp.up_proj.weight"].shape = {config->hidden, config->ffn};  // transposed
  const fs::path dir = fs::temp_directory_path() / ("kvr_weights_bad_" + std::to_string(getpid()));
  fs::create_directories(dir);
  WriteSafetensors(hf, (dir / "model.safetensors").string());
  std::ofstream(dir / "config.json") << "{}";
  auto checkpoint = SafetensorsCheckpoint::Open(dir.string());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto loaded = LoadHfWeights(*checkpoint, *config, &pool);
  fs::remove_all(dir);
  ASSERT_FALSE(loaded.ok());
  EXPECT_THAT(std::string(loaded.status().message()),
              testing::HasSubstr("model.layers.1.mlp.up_proj.weight"));
}

}  // namespace
}  // namespace kvr::model
