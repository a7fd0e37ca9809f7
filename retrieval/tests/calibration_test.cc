// A2ATS calibration through the model runtime, and both quant methods inside SparseAttention on
// a model: with a budget covering the context they must reproduce dense greedy decoding.

#include <cstdio>
#include <filesystem>
#include <random>
#include <vector>

#include <unistd.h>

#include "gtest/gtest.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/sparse_attention.h"

namespace kvr::retrieval {
namespace {

// SmolLM2's shape with 2 layers of random weights: plain RoPE (the "tiny" dummy shape uses
// llama3 scaling, which WRoPE does not support) and fast enough for a unit test.
model::LoadedModel LoadTiny(ThreadPool* pool, uint64_t seed) {
  model::LoadOptions options;
  options.format = model::LoadFormat::kDummy;
  options.dummy_seed = seed;
  options.dummy_layers = 2;
  auto loaded = model::LoadModel("smollm2-135m", options, pool);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return std::move(loaded).value();
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = pick(rng);
  return t;
}

std::shared_ptr<const A2atsCodebooks> CalibrateTiny(const model::Model& m, ThreadPool* pool) {
  auto fingerprint = FingerprintOf(m);
  EXPECT_TRUE(fingerprint.ok()) << fingerprint.status();
  CodebookParams params;
  params.codebook_size = 32;
  auto samples = CalibrationSamples::Create(*fingerprint, params);
  EXPECT_TRUE(samples.ok()) << samples.status();
  std::vector<std::vector<int32_t>> texts = {RandomTokens(300, m.config().vocab, 1),
                                             RandomTokens(200, m.config().vocab, 2)};
  EXPECT_TRUE(CollectCalibrationSamples(m, texts, *samples, 128).ok());
  const int group = m.config().n_heads / m.config().n_kv_heads;
  for (int layer = 0; layer < m.config().n_layers; ++layer) {
    for (int h = 0; h < m.config().n_kv_heads; ++h) {
      EXPECT_EQ(samples->head(layer, h).n_queries, 500 * group);
      EXPECT_EQ(samples->head(layer, h).n_keys_seen, 500);
    }
  }
  auto books = BuildCodebooks(*samples, pool);
  EXPECT_TRUE(books.ok()) << books.status();
  return books.ok() ? *books : nullptr;
}

TEST(CalibrationTest, ScaledRopeIsRefused) {
  ThreadPool pool(1);
  model::LoadOptions options;
  options.format = model::LoadFormat::kDummy;
  auto tiny = model::LoadModel("tiny", options, &pool);  // llama3-scaled RoPE
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  auto f = FingerprintOf(*tiny->model);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(f.status().message().find("scaled RoPE"), std::string::npos) << f.status();
}

TEST(CalibrationTest, FingerprintTellsModelsApart) {
  ThreadPool pool(2);
  auto a = LoadTiny(&pool, 1), b = LoadTiny(&pool, 1), c = LoadTiny(&pool, 2);
  auto fa = FingerprintOf(*a.model), fb = FingerprintOf(*b.model), fc = FingerprintOf(*c.model);
  ASSERT_TRUE(fa.ok() && fb.ok() && fc.ok());
  EXPECT_EQ(fa->model_hash, fb->model_hash) << "same weights, same hash";
  EXPECT_NE(fa->model_hash, fc->model_hash) << "other weights (another seed), another hash";
  EXPECT_EQ(fa->rope.style, RopeStyle::kHalfSplit);
  EXPECT_EQ(fa->n_layers, a.model->config().n_layers);
}

// Codebooks calibrated on one weight storage must load on the other: the fingerprint hashes the
// float32 values, which packed matrices give back exactly when dequantised.
TEST(CalibrationTest, FingerprintIsTheSamePackedOrFloat32) {
  const std::string path = TestModelPath();
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " missing (scripts/fetch-model.sh)";
  ThreadPool pool(2);
  model::LoadOptions f32_options;
  f32_options.weights = model::WeightStorage::kFloat32;
  auto f32 = model::LoadModel(path, f32_options, &pool);
  auto packed = model::LoadModel(path, {}, &pool);
  ASSERT_TRUE(f32.ok() && packed.ok());
  ASSERT_TRUE(packed->model->weights().packed());
  ASSERT_FALSE(f32->model->weights().packed());
  auto fa = FingerprintOf(*f32->model), fb = FingerprintOf(*packed->model);
  ASSERT_TRUE(fa.ok() && fb.ok());
  EXPECT_EQ(fa->model_hash, fb->model_hash);
}

TEST(CalibrationTest, CalibrateSaveLoadAndRefuseOtherModel) {
  ThreadPool pool(2);
  auto loaded = LoadTiny(&pool, 1);
  auto books = CalibrateTiny(*loaded.model, &pool);
  ASSERT_NE(books, nullptr);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvr_calib_test_" + std::to_string(::getpid()) + ".kvrcb"))
                               .string();
  ASSERT_TRUE(books->Save(path).ok());
  auto same = FingerprintOf(*loaded.model);
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE(A2atsCodebooks::Load(path, &*same).ok());
  auto other_model = LoadTiny(&pool, 7);
  auto other = FingerprintOf(*other_model.model);
  ASSERT_TRUE(other.ok());
  auto refused = A2atsCodebooks::Load(path, &*other);
  std::filesystem::remove(path);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("model hash"), std::string::npos) << refused.status();
}

// Greedy decoding with SparseAttention(method) at a budget >= context equals dense decoding:
// every index must select every non-resident token, so the attention is exact.
std::vector<int32_t> Greedy(const model::Model& m, model::Attention& attention,
                            const std::vector<int32_t>& prompt, int steps) {
  model::KvCache cache = m.NewCache();
  auto logits = m.Prefill(1, cache, prompt, attention, 64);
  EXPECT_TRUE(logits.ok()) << logits.status();
  std::vector<int32_t> out;
  std::vector<float> l = *logits;
  for (int s = 0; s < steps; ++s) {
    const int32_t token = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    out.push_back(token);
    const model::ForwardSequence step{1, &cache, std::span(&token, 1)};
    EXPECT_TRUE(m.Forward(std::span(&step, 1), attention, model::LogitsMode::kLast, l).ok());
  }
  attention.Release(1);
  return out;
}

TEST(CalibrationTest, QuantMethodsAtFullBudgetMatchDenseGreedy) {
  ThreadPool pool(2);
  auto loaded = LoadTiny(&pool, 1);
  const model::Model& m = *loaded.model;
  auto books = CalibrateTiny(m, &pool);
  ASSERT_NE(books, nullptr);
  const std::vector<int32_t> prompt = RandomTokens(400, m.config().vocab, 3);
  model::DenseAttention dense(&pool);
  const std::vector<int32_t> expected = Greedy(m, dense, prompt, 24);
  MethodRegistry registry;
  ASSERT_TRUE(RegisterQuantMethods(registry).ok());
  for (const char* method : {"pariskv", "a2ats"}) {
    SparseAttentionOptions options;
    options.method = method;
    options.params.budget = 4096;
    options.params.n_sink = 4;
    options.params.local_window = 32;
    options.params.assets = books;
    options.params.pool = &pool;
    auto rope = RopeParamsOf(m.config());
    ASSERT_TRUE(rope.ok());
    options.rope = *rope;
    options.n_layers = m.config().n_layers;
    auto sparse = SparseAttention::Create(&registry, options);
    ASSERT_TRUE(sparse.ok()) << sparse.status();
    EXPECT_EQ(Greedy(m, **sparse, prompt, 24), expected) << method;
    EXPECT_GT((*sparse)->stats().selected_rows, 0) << method << " selected through its index";
  }
}

}  // namespace
}  // namespace kvr::retrieval
