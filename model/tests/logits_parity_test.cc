// Logits parity with an independent implementation: Hugging Face transformers loading the same
// SmolLM2 GGUF, float32 on the CPU (fixtures/logits, made by scripts/logits_reference.py).
//
// The fixture's input ids are fed directly, so the comparison isolates the forward pass from
// the tokenizer. Error measure: for each prompt, max_i |ours_i - ref_i| / max_i |ref_i| over the
// full vocabulary at the prompt's last position (a relative error with the vector's scale as
// floor, so near-zero logits do not blow it up). Bound: 1e-3.

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"
#include "nlohmann/json.hpp"

namespace kvr::model {
namespace {

constexpr double kMaxRelativeError = 1e-3;

struct Prompt {
  std::string name;
  std::string text;
  std::vector<int32_t> input_ids;
  std::vector<int32_t> greedy_ids;
  std::vector<float> last_logits;                                     // [vocab]
  std::vector<std::pair<int64_t, std::vector<int32_t>>> checkpoints;  // position, top-8 ids
  std::vector<std::vector<float>> checkpoint_logits;                  // their logits
};

class LogitsParityTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    pool_ = new ThreadPool(0);
    // The exact float32 path: the reference is float32 transformers.
    LoadOptions options;
    options.weights = WeightStorage::kFloat32;
    auto loaded = LoadModel(TestModelPath(), options, pool_);
    ASSERT_TRUE(loaded.ok()) << "loading " << TestModelPath() << ": " << loaded.status()
                             << " (scripts/fetch-model.sh fetches it)";
    loaded_ = new LoadedModel(std::move(*loaded));

    const std::string dir = KVR_LOGITS_FIXTURE_DIR;
    std::ifstream json_in(dir + "/reference.json");
    ASSERT_TRUE(json_in) << "missing " << dir << "/reference.json";
    const auto meta = nlohmann::json::parse(json_in);
    const int vocab = meta["vocab"].get<int>();
    ASSERT_EQ(vocab, loaded_->model->config().vocab);
    std::ifstream logits_in(dir + "/last_logits.f32", std::ios::binary);
    ASSERT_TRUE(logits_in) << "missing " << dir << "/last_logits.f32";
    prompts_ = new std::vector<Prompt>;
    for (const auto& p : meta["prompts"]) {
      Prompt prompt;
      prompt.name = p["name"].get<std::string>();
      prompt.text = p["text"].get<std::string>();
      prompt.input_ids = p["input_ids"].get<std::vector<int32_t>>();
      prompt.greedy_ids = p["greedy_ids"].get<std::vector<int32_t>>();
      prompt.last_logits.resize(vocab);
      logits_in.read(reinterpret_cast<char*>(prompt.last_logits.data()), vocab * sizeof(float));
      ASSERT_TRUE(logits_in) << "last_logits.f32 is short";
      for (const auto& c : p["checkpoints"]) {
        prompt.checkpoints.emplace_back(c["position"].get<int64_t>(),
                                        c["top_ids"].get<std::vector<int32_t>>());
        prompt.checkpoint_logits.push_back(c["top_logits"].get<std::vector<float>>());
      }
      prompts_->push_back(std::move(prompt));
    }
    ASSERT_EQ(prompts_->size(), 4u);
  }
  static void TearDownTestSuite() {
    delete prompts_;
    delete loaded_;
    delete pool_;
  }

  static ThreadPool* pool_;
  static LoadedModel* loaded_;
  static std::vector<Prompt>* prompts_;
};

ThreadPool* LogitsParityTest::pool_ = nullptr;
LoadedModel* LogitsParityTest::loaded_ = nullptr;
std::vector<Prompt>* LogitsParityTest::prompts_ = nullptr;

TEST_F(LogitsParityTest, LogitsMatchTransformersOnFourPrompts) {
  ASSERT_NE(loaded_, nullptr);
  const Model& model = *loaded_->model;
  const int vocab = model.config().vocab;
  DenseAttention attention(pool_);
  double worst = 0;
  for (const Prompt& p : *prompts_) {
    KvCache cache = model.NewCache();
    const int64_t n = static_cast<int64_t>(p.input_ids.size());
    std::vector<float> logits(n * vocab);  // [n, vocab]
    const ForwardSequence seq{1, &cache, p.input_ids};
    ASSERT_TRUE(model.Forward(std::span(&seq, 1), attention, LogitsMode::kAll, logits).ok());
    const float* last = logits.data() + (n - 1) * vocab;
    double max_diff = 0, max_ref = 0;
    for (int i = 0; i < vocab; ++i) {
      max_diff = std::max(max_diff, std::abs(double{last[i]} - p.last_logits[i]));
      max_ref = std::max(max_ref, std::abs(double{p.last_logits[i]}));
    }
    const double relative = max_diff / max_ref;
    worst = std::max(worst, relative);
    std::cout << absl::StrFormat("[%s] %d tokens: max|diff| %.3g, max|ref| %.3g, relative %.3g\n",
                                 p.name, n, max_diff, max_ref, relative);
    EXPECT_LE(relative, kMaxRelativeError) << p.name;
    EXPECT_EQ(ArgMax(std::span(last, vocab)), ArgMax(p.last_logits)) << p.name;
    // Earlier positions (top-8 of the reference) agree to the same tolerance.
    for (size_t c = 0; c < p.checkpoints.size(); ++c) {
      const auto& [position, ids] = p.checkpoints[c];
      const float* row = logits.data() + position * vocab;
      for (size_t j = 0; j < ids.size(); ++j) {
        EXPECT_NEAR(row[ids[j]], p.checkpoint_logits[c][j], kMaxRelativeError * max_ref)
            << p.name << " position " << position << " token " << ids[j];
      }
    }
  }
  RecordProperty("worst_relative_error", absl::StrFormat("%.3g", worst));
  std::cout << absl::StrFormat("worst relative error over 4 prompts: %.3g (bound %.0e)\n", worst,
                               kMaxRelativeError);
}

TEST_F(LogitsParityTest, Greedy64TokenContinuationsAreIdenticalWhenDecodedAsOneBatch) {
  ASSERT_NE(loaded_, nullptr);
  const Model& model = *loaded_->model;
  const int vocab = model.config().vocab;
  DenseAttention attention(pool_);
  const size_t n_seq = prompts_->size();
  std::vector<KvCache> caches;
  std::vector<std::vector<int32_t>> generated(n_seq);
  std::vector<int32_t> next(n_seq);
  for (size_t s = 0; s < n_seq; ++s) {
    caches.push_back(model.NewCache());
    auto logits = model.Prefill(s, caches[s], (*prompts_)[s].input_ids, attention);
    ASSERT_TRUE(logits.ok()) << logits.status();
    next[s] = ArgMax(*logits);
  }
  // The reference decodes each prompt alone; here all four advance in one batched Forward per
  // step, which also checks the batched decode path. EOS does not stop either side.
  const size_t steps = (*prompts_)[0].greedy_ids.size();
  std::vector<float> logits(n_seq * vocab);
  for (size_t step = 0; step < steps; ++step) {
    std::vector<ForwardSequence> batch;
    for (size_t s = 0; s < n_seq; ++s) {
      generated[s].push_back(next[s]);
      batch.push_back({s, &caches[s], std::span(&next[s], 1)});
    }
    if (step + 1 == steps) break;
    ASSERT_TRUE(model.Forward(batch, attention, LogitsMode::kLast, logits).ok());
    for (size_t s = 0; s < n_seq; ++s)
      next[s] = ArgMax(std::span(logits).subspan(s * vocab, vocab));
  }
  for (size_t s = 0; s < n_seq; ++s) {
    EXPECT_EQ(generated[s], (*prompts_)[s].greedy_ids) << (*prompts_)[s].name;
  }
}

// End to end, `kvr generate` feeds our tokenizer's ids; they must be the reference's ids for
// these prompts (the chat prompt's special tokens included) for the parity to carry over.
TEST_F(LogitsParityTest, TokenizerGivesTheReferenceInputIds) {
  ASSERT_NE(loaded_, nullptr);
  ASSERT_TRUE(loaded_->tokenizer.has_value());
  for (const Prompt& p : *prompts_) {
    const bool chat = p.name == "chat";
    auto ids = loaded_->tokenizer->Encode(p.text, {.add_special = !chat, .parse_special = chat});
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, p.input_ids) << p.name;
  }
}

}  // namespace
}  // namespace kvr::model
