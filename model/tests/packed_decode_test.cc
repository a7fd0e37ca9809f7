// The packed-weight CPU path (weights kept in the GGUF's Q4_1/Q8_0 formats, 8-bit activations
// in decode) against the float32 path on the SmolLM2 GGUF, on the prompts of the logits fixture.
//
//   - With more than kMaxGemvRows tokens, prefill multiplies dequantised tiles of the same
//     weights with SGEMM, so its logits (LogitsMode::kAll: every projection takes the tiled
//     path) match the float32 path to float rounding: max |diff| / max |ref| <= 1e-4.
//   - Decode steps quantise activations to 8 bits. Teacher-forced on the float32 path's greedy
//     tokens, every step's logits stay within kDecodeRelativeError of the float32 logits
//     (measured: at most 0.065 over these prompts, 30 layers of 8-bit activations), and
//     where the two argmaxes differ the float32 top-2 gap at that step is below kTieGap (a near
//     tie that any approximation may flip). Agreement and the gaps are printed.
//   - The same decode checks hold for the default CPU path, packed weights with the half KV
//     cache (K and V rounded to f16), against the float32 weights and float32 KV.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"
#include "nlohmann/json.hpp"

namespace kvr::model {
namespace {

constexpr double kPrefillRelativeError = 1e-4;
constexpr double kDecodeRelativeError = 0.1;
constexpr float kTieGap = 0.5f;
constexpr int kSteps = 24;

double RelativeError(std::span<const float> got, std::span<const float> ref) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - ref[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
  }
  return diff / scale;
}

void CompareWithFloat32Path(KvDType packed_kv) {
  ThreadPool pool(0);
  LoadOptions f32_options;
  f32_options.weights = WeightStorage::kFloat32;
  f32_options.kv_dtype = KvDType::kF32;
  auto f32 = LoadModel(TestModelPath(), f32_options, &pool);
  ASSERT_TRUE(f32.ok()) << f32.status() << " (scripts/fetch-model.sh fetches the model)";
  LoadOptions packed_options;
  packed_options.kv_dtype = packed_kv;
  auto packed = LoadModel(TestModelPath(), packed_options, &pool);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const Model& a = *f32->model;
  const Model& b = *packed->model;
  ASSERT_TRUE(b.weights().packed());
  // Resident weights: the Q4_1 layers and the Q8_0 embedding, not 513 MiB of float32.
  std::printf("weights: float32 %.1f MiB, packed %.1f MiB\n",
              a.weights().allocated_bytes() / 1048576.0, b.weights().allocated_bytes() / 1048576.0);
  EXPECT_LT(b.weights().allocated_bytes(), 200ll << 20);

  std::ifstream json_in(std::string(KVR_LOGITS_FIXTURE_DIR) + "/reference.json");
  ASSERT_TRUE(json_in);
  const auto meta = nlohmann::json::parse(json_in);
  const int vocab = a.config().vocab;
  int steps = 0, agree = 0, prefill_checked = 0;
  for (const auto& p : meta["prompts"]) {
    const auto ids = p["input_ids"].get<std::vector<int32_t>>();
    SCOPED_TRACE(p["name"].get<std::string>());
    DenseAttention attention_a(&pool), attention_b(&pool);
    // Prefill logits to float rounding: with float32 KV only (half KV moves them by its own
    // rounding, which the decode checks below bound).
    if (static_cast<int64_t>(ids.size()) > kMaxGemvRows && packed_kv == KvDType::kF32) {
      std::vector<float> all_a(ids.size() * vocab), all_b(ids.size() * vocab);
      KvCache scratch_a = a.NewCache(), scratch_b = b.NewCache();
      const ForwardSequence seq_a{0, &scratch_a, ids}, seq_b{0, &scratch_b, ids};
      ASSERT_TRUE(a.Forward(std::span(&seq_a, 1), attention_a, LogitsMode::kAll, all_a).ok());
      ASSERT_TRUE(b.Forward(std::span(&seq_b, 1), attention_b, LogitsMode::kAll, all_b).ok());
      EXPECT_LE(RelativeError(all_b, all_a), kPrefillRelativeError);
      ++prefill_checked;
    }
    KvCache cache_a = a.NewCache(), cache_b = b.NewCache();
    auto logits_a = a.Prefill(0, cache_a, ids, attention_a);
    auto logits_b = b.Prefill(0, cache_b, ids, attention_b);
    ASSERT_TRUE(logits_a.ok() && logits_b.ok());
    std::vector<float> step_a = *logits_a, step_b = *logits_b;
    double worst = 0;
    for (int s = 0; s < kSteps; ++s) {
      const int32_t next_a = ArgMax(step_a), next_b = ArgMax(step_b);
      ++steps;
      if (next_a == next_b) {
        ++agree;
      } else {
        const float gap = TopTwoGap(step_a);
        std::printf("  step %d: float32 %d, packed %d, float32 top-2 gap %.3f\n", s, next_a,
                    next_b, gap);
        EXPECT_LT(gap, kTieGap) << "step " << s;
      }
      const int32_t token = next_a;  // teacher-forced: both continue with the float32 token
      const ForwardSequence seq_a{0, &cache_a, std::span(&token, 1)};
      const ForwardSequence seq_b{0, &cache_b, std::span(&token, 1)};
      ASSERT_TRUE(a.Forward(std::span(&seq_a, 1), attention_a, LogitsMode::kLast, step_a).ok());
      ASSERT_TRUE(b.Forward(std::span(&seq_b, 1), attention_b, LogitsMode::kLast, step_b).ok());
      ASSERT_EQ(static_cast<int>(step_b.size()), vocab);
      const double err = RelativeError(step_b, step_a);
      worst = std::max(worst, err);
      EXPECT_LE(err, kDecodeRelativeError) << "step " << s;
    }
    std::printf("%s: worst decode logits error %.4f (relative to max |logit|)\n",
                p["name"].get<std::string>().c_str(), worst);
  }
  if (packed_kv == KvDType::kF32) {
    EXPECT_GT(prefill_checked, 0);
  }
  std::printf("greedy agreement packed (%s KV) vs float32 (teacher-forced): %d / %d steps\n",
              KvDTypeName(packed_kv), agree, steps);
}

TEST(PackedDecode, MatchesFloat32PathOnSmolLM2) { CompareWithFloat32Path(KvDType::kF32); }

TEST(PackedDecode, WithHalfKvMatchesFloat32PathOnSmolLM2) { CompareWithFloat32Path(KvDType::kF16); }

}  // namespace
}  // namespace kvr::model
