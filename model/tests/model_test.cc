// The forward pass on small random models (dummy "tiny" shape) and the config readers: batched
// decode equals decoding alone, chunked prefill equals one pass, context and architecture
// errors, dummy shapes.

#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <filesystem>
#include <fstream>
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
#include "kvr/model/sampler.h"
#include "nlohmann/json.hpp"

namespace kvr::model {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Model> TinyModel(ThreadPool* pool, int64_t context = 0) {
  auto config = DummyConfig("tiny");
  EXPECT_TRUE(config.ok()) << config.status();
  if (context > 0) config->context_length = context;
  auto weights = RandomWeights(*config, 42, pool);
  EXPECT_TRUE(weights.ok()) << weights.status();
  auto model = Model::Create(*config, std::move(*weights), pool);
  EXPECT_TRUE(model.ok()) << model.status();
  return std::move(*model);
}

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 37 + salt * 11 + 5) % 256;
  return t;
}

float MaxAbsDiff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST(ModelTest, LogitsAreFiniteAndDependOnTheInput) {
  ThreadPool pool(2);
  auto model = TinyModel(&pool);
  DenseAttention attention(&pool);
  KvCache a = model->NewCache(), b = model->NewCache();
  auto la = model->Prefill(1, a, Tokens(9, 0), attention);
  auto lb = model->Prefill(2, b, Tokens(9, 1), attention);
  ASSERT_TRUE(la.ok() && lb.ok());
  for (float x : *la) ASSERT_TRUE(std::isfinite(x));
  EXPECT_GT(MaxAbsDiff(*la, *lb), 1e-3f);
  EXPECT_EQ(a.n_tokens(), 9);
}

TEST(ModelTest, BatchedDecodeOfThreeSequencesEqualsDecodingEachAlone) {
  ThreadPool pool(2);
  auto model = TinyModel(&pool);
  DenseAttention attention(&pool);
  const int vocab = model->config().vocab;
  const std::vector<std::vector<int32_t>> prompts = {Tokens(5, 1), Tokens(17, 2), Tokens(1, 3)};
  const int kSteps = 6;

  // Alone: each sequence prefilled and decoded greedily by itself.
  std::vector<std::vector<int32_t>> alone_tokens(3);
  std::vector<std::vector<float>> alone_logits(3);
  for (int s = 0; s < 3; ++s) {
    KvCache cache = model->NewCache();
    auto logits = model->Prefill(s, cache, prompts[s], attention);
    ASSERT_TRUE(logits.ok());
    for (int step = 0; step < kSteps; ++step) {
      const int32_t next = ArgMax(*logits);
      alone_tokens[s].push_back(next);
      ForwardSequence seq{static_cast<SequenceId>(s), &cache, std::span(&next, 1)};
      ASSERT_TRUE(model->Forward(std::span(&seq, 1), attention, LogitsMode::kLast, *logits).ok());
      alone_logits[s].insert(alone_logits[s].end(), logits->begin(), logits->end());
    }
  }
  // Batched: the same sequences advanced together, one Forward per step.
  std::vector<KvCache> caches;
  std::vector<int32_t> next(3);
  for (int s = 0; s < 3; ++s) {
    caches.push_back(model->NewCache());
    auto logits = model->Prefill(s, caches[s], prompts[s], attention);
    ASSERT_TRUE(logits.ok());
    next[s] = ArgMax(*logits);
  }
  std::vector<std::vector<float>> batched_logits(3);
  std::vector<float> logits(3 * vocab);
  for (int step = 0; step < kSteps; ++step) {
    std::vector<ForwardSequence> batch;
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(next[s], alone_tokens[s][step]) << "sequence " << s << " step " << step;
      batch.push_back({static_cast<SequenceId>(s), &caches[s], std::span(&next[s], 1)});
    }
    ASSERT_TRUE(model->Forward(batch, attention, LogitsMode::kLast, logits).ok());
    for (int s = 0; s < 3; ++s) {
      std::span<const float> row(logits.data() + s * vocab, vocab);
      batched_logits[s].insert(batched_logits[s].end(), row.begin(), row.end());
      next[s] = ArgMax(row);
    }
  }
  for (int s = 0; s < 3; ++s) {
    EXPECT_LT(MaxAbsDiff(batched_logits[s], alone_logits[s]), 1e-4f) << "sequence " << s;
    EXPECT_EQ(caches[s].n_tokens(), static_cast<int64_t>(prompts[s].size()) + kSteps);
  }
}

TEST(ModelTest, ChunkedPrefillEqualsOnePassAndAllLogitsEndWithTheLast) {
  ThreadPool pool(2);
  auto model = TinyModel(&pool);
  DenseAttention attention(&pool);
  const int vocab = model->config().vocab;
  const auto prompt = Tokens(50, 4);
  KvCache one = model->NewCache(), chunked = model->NewCache(), all = model->NewCache();
  auto l1 = model->Prefill(1, one, prompt, attention, 512);
  auto l2 = model->Prefill(1, chunked, prompt, attention, 7);
  ASSERT_TRUE(l1.ok() && l2.ok());
  EXPECT_LT(MaxAbsDiff(*l1, *l2), 1e-4f);
  std::vector<float> every(50 * vocab);
  ForwardSequence seq{1, &all, prompt};
  ASSERT_TRUE(model->Forward(std::span(&seq, 1), attention, LogitsMode::kAll, every).ok());
  EXPECT_LT(MaxAbsDiff(std::span(every).subspan(49 * vocab), *l1), 1e-5f);
  // The first position's logits equal a one-token prefill.
  KvCache first = model->NewCache();
  auto l0 = model->Prefill(1, first, std::span(prompt).first(1), attention);
  ASSERT_TRUE(l0.ok());
  EXPECT_LT(MaxAbsDiff(std::span(every).first(vocab), *l0), 1e-5f);
}

TEST(ModelTest, PromptLongerThanContextIsAnErrorNamingBothNumbers) {
  ThreadPool pool(1);
  auto model = TinyModel(&pool, /*context=*/32);
  DenseAttention attention(&pool);
  KvCache cache = model->NewCache();
  auto logits = model->Prefill(1, cache, Tokens(40, 0), attention);
  ASSERT_FALSE(logits.ok());
  EXPECT_EQ(logits.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(logits.status().message()), HasSubstr("40 tokens"));
  EXPECT_THAT(std::string(logits.status().message()), HasSubstr("32 tokens"));
  EXPECT_EQ(cache.n_tokens(), 0);  // nothing was run
  // Decoding past the context is refused as well.
  ASSERT_TRUE(model->Prefill(1, cache, Tokens(32, 0), attention).ok());
  const int32_t token = 3;
  std::vector<float> out(model->config().vocab);
  ForwardSequence seq{1, &cache, std::span(&token, 1)};
  const absl::Status status = model->Forward(std::span(&seq, 1), attention, LogitsMode::kLast, out);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("33"));
}

TEST(ModelTest, RejectsTokensOutsideTheVocabulary) {
  ThreadPool pool(1);
  auto model = TinyModel(&pool);
  DenseAttention attention(&pool);
  KvCache cache = model->NewCache();
  const std::vector<int32_t> bad = {1, 256};
  auto logits = model->Prefill(1, cache, bad, attention);
  EXPECT_EQ(logits.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(logits.status().message()), HasSubstr("256"));
}

TEST(DummyTest, NamedShapesAreValid) {
  for (const std::string& name : DummyShapeNames()) {
    auto config = DummyConfig(name);
    ASSERT_TRUE(config.ok()) << name << ": " << config.status();
  }
  auto llama = DummyConfig("llama3-8b");
  ASSERT_TRUE(llama.ok());
  EXPECT_NEAR(static_cast<double>(llama->ParameterCount()), 8.03e9, 0.01e9);
  auto smol = DummyConfig("smollm2-135m");
  ASSERT_TRUE(smol.ok());
  EXPECT_NEAR(static_cast<double>(smol->ParameterCount()), 134.5e6, 0.5e6);
  auto fewer = DummyConfig("llama3-8b", 2);
  ASSERT_TRUE(fewer.ok());
  EXPECT_EQ(fewer->n_layers, 2);
  auto unknown = DummyConfig("gpt5");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("llama3-8b"));
}

TEST(DummyTest, RandomWeightsAreDeterministicInTheSeed) {
  ThreadPool pool(2);
  auto config = DummyConfig("tiny");
  ASSERT_TRUE(config.ok());
  auto a = RandomWeights(*config, 1, &pool), b = RandomWeights(*config, 1, nullptr),
       c = RandomWeights(*config, 2, &pool);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->layers[1].wqkv, b->layers[1].wqkv);  // thread count does not matter
  EXPECT_NE(a->layers[1].wqkv, c->layers[1].wqkv);
}

TEST(ConfigTest, ReadsLlama3HfConfig) {
  const auto j = nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "tie_word_embeddings": false,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}})");
  auto c = ConfigFromHfJson(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kLlama);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->n_kv_heads, 8);
  EXPECT_TRUE(c->has_llama3_scaling);
  EXPECT_FLOAT_EQ(c->llama3_scaling.factor, 8.f);
  EXPECT_EQ(c->llama3_scaling.original_context_length, 8192);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->tied_embeddings);
}

TEST(ConfigTest, ReadsQwen2HfConfigWithBiasAndTiedEmbeddings) {
  const auto j = nlohmann::json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "vocab_size": 151936, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "tie_word_embeddings": true})");
  auto c = ConfigFromHfJson(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kQwen2);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->tied_embeddings);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_FLOAT_EQ(c->rope_theta, 1e6f);
}

TEST(ConfigTest, UnsupportedHfArchitectureIsNamed) {
  const auto j = nlohmann::json::parse(
      R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 768, "num_hidden_layers": 12})");
  auto c = ConfigFromHfJson(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("GPT2LMHeadModel"));
}

TEST(ConfigTest, MissingHfFieldIsNamed) {
  const auto j = nlohmann::json::parse(R"({"architectures": ["LlamaForCausalLM"],
      "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 10})");
  auto c = ConfigFromHfJson(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("num_hidden_layers"));
}

// A crafted GGUF v3 file with string metadata only and no tensors.
std::string WriteGguf(const std::vector<std::pair<std::string, std::string>>& kv) {
  gguf_test::GgufBuilder b;
  b.Counts(0, kv.size());
  for (const auto& [key, value] : kv) b.KvStr(key, value);
  b.Align(32);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvr_config_test_" + std::to_string(::getpid()) + ".gguf"))
                               .string();
  b.WriteTo(path);
  return path;
}

TEST(ConfigTest, UnsupportedGgufArchitectureIsNamed) {
  const std::string path = WriteGguf({{"general.architecture", "mamba"}});
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto c = ConfigFromGguf(*file);
  std::filesystem::remove(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("'mamba'"));
}

TEST(ConfigTest, ValidateCatchesBadGqa) {
  auto c = DummyConfig("tiny");
  ASSERT_TRUE(c.ok());
  c->n_kv_heads = 3;  // 4 heads are not a multiple of 3
  EXPECT_THAT(std::string(c->Validate().message()), HasSubstr("multiple"));
}

}  // namespace
}  // namespace kvr::model
