// Retrieval summaries built during a GPU prefill (prefill_summaries.h: the model's per-layer
// build hook) against the same kernels run afterwards over the same device KV cache
// (CudaModel::RebuildForTesting): the results must be bitwise equal, for the builds on the
// side stream (layer-pipelined) and on the main stream. A build that read a layer's keys before
// the layer's K append (a missing event dependency) or while another build used the shared
// workspace would differ. Also: the logits are bitwise those of a prefill without summaries,
// the buffers were poisoned (NaN / -1) and the valid part is written and plausible.
// CTest label `gpu`; skipped without a GPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/retrieval/cuda/prefill_summaries.h"

namespace kvr::retrieval::cuda {
namespace {

using model::CudaModel;
using model::CudaModelOptions;
using model::CudaSequence;
using model::LogitsMode;
using model::ModelConfig;
using model::SequenceId;
using model::cuda_test::Tokens;

struct Case {
  const char* method;
  int iterations;
  const char* name;
};

// Two sequences (lengths 700 and 389, capacities above them) prefilled together in chunks of
// 256 tokens; the chunk that completes each prompt asks for the build.
void CheckShape(const std::string& shape, int n_layers) {
  auto config = model::DummyConfig(shape, n_layers);
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig& c = *config;
  CudaModelOptions opt;
  opt.max_batch_tokens = 512;
  opt.max_sequences = 4;
  auto model_or = model::CreateCudaModelWithRandomWeights(c, 3, opt);
  ASSERT_TRUE(model_or.ok()) << model_or.status();
  CudaModel& m = **model_or;
  auto builders = PrefillSummaryBuilders::Create(c, opt.device);
  ASSERT_TRUE(builders.ok()) << builders.status();
  const std::vector<int> lengths = {700, 389};
  const std::vector<int64_t> capacities = {1024, 400};
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < lengths.size(); ++i) prompts.push_back(Tokens(lengths[i], c.vocab, 5 + i));

  // Prefills both sequences (ids base, base + 1), with builders of `o` unless `o` is null;
  // returns the logits of every chunk; `built` gets the builders.
  std::vector<const PrefillSummaryBuilder*> built;
  auto prefill = [&](SequenceId base, const PrefillSummaryOptions* o) {
    const bool build = o != nullptr;
    std::vector<float> all;
    built.clear();
    for (size_t i = 0; i < lengths.size(); ++i) {
      std::unique_ptr<PrefillSummaryBuilder> b;
      if (build) {
        auto made = (*builders)->ForSequence(*o, capacities[i]);
        EXPECT_TRUE(made.ok()) << made.status();
        if (made.ok()) b = *std::move(made);
      }
      built.push_back(b.get());
      EXPECT_TRUE(m.AddSequence(base + i, capacities[i], std::move(b)).ok());
    }
    std::vector<int> done(lengths.size(), 0);
    while (done[0] < lengths[0] || done[1] < lengths[1]) {
      std::vector<CudaSequence> batch;
      for (size_t i = 0; i < lengths.size(); ++i) {
        const int n = std::min(256, lengths[i] - done[i]);
        if (n == 0) continue;
        CudaSequence s{base + static_cast<SequenceId>(i),
                       std::span(prompts[i]).subspan(done[i], n)};
        s.build = build && done[i] + n == lengths[i];
        batch.push_back(s);
        done[i] += n;
      }
      std::vector<float> logits(batch.size() * c.vocab);
      const absl::Status st = m.Forward(batch, LogitsMode::kLast, logits);
      EXPECT_TRUE(st.ok()) << st;
      if (build) {
        bool any = false;
        for (const CudaSequence& s : batch) any = any || s.build;
        if (any) {
          EXPECT_GT(m.last_build_ms(), 0.0);
        }
      }
      all.insert(all.end(), logits.begin(), logits.end());
    }
    return all;
  };

  const std::vector<float> plain = prefill(100, nullptr);
  ASSERT_TRUE(m.ReleaseSequence(100).ok());
  ASSERT_TRUE(m.ReleaseSequence(101).ok());

  const Case cases[] = {{"quest", 0, "quest"},
                        {"keydiff", 0, "keydiff"},
                        {"pariskv", 0, "pariskv"},
                        {"clusterkv", 10, "clusterkv it10"},
                        {"clusterkv", 2, "clusterkv it2"}};
  SequenceId next = 200;
  for (const Case& cs : cases) {
    for (bool side : {true, false}) {
      const std::string what = shape + " " + cs.name + (side ? " side stream" : " main stream");
      PrefillSummaryOptions o;
      o.method = cs.method;
      o.side_stream = side;
      o.params.n_sink = 16;
      o.params.budget = 64;
      if (cs.iterations > 0) o.params.clusterkv.max_iterations = cs.iterations;
      const SequenceId base = next;
      next += 10;
      const std::vector<float> logits = prefill(base, &o);
      ASSERT_EQ(built.size(), lengths.size());
      ASSERT_EQ(logits.size(), plain.size());
      EXPECT_EQ(std::memcmp(logits.data(), plain.data(), plain.size() * sizeof(float)), 0)
          << what << ": logits differ from a prefill without summaries";
      for (size_t i = 0; i < lengths.size(); ++i) {
        const SequenceId id = base + i;
        ASSERT_NE(built[i], nullptr);
        auto during = built[i]->CopyBackForTesting();
        ASSERT_TRUE(during.ok()) << during.status();
        ASSERT_TRUE(m.RebuildForTesting(id).ok()) << what;
        auto after = built[i]->CopyBackForTesting();
        ASSERT_TRUE(after.ok()) << after.status();
        ASSERT_EQ(during->f32.size(), after->f32.size());
        ASSERT_EQ(during->i32.size(), after->i32.size());
        const bool f_eq = std::memcmp(during->f32.data(), after->f32.data(),
                                      after->f32.size() * sizeof(float)) == 0;
        const bool i_eq = std::memcmp(during->i32.data(), after->i32.data(),
                                      after->i32.size() * sizeof(int32_t)) == 0;
        EXPECT_TRUE(f_eq && i_eq) << what << " seq " << i << ": not bitwise equal to a rebuild";

        // The valid part: written, finite, plausible.
        const int64_t len = lengths[i], cap = capacities[i];
        const int nkv = c.n_kv_heads, d = c.head_dim, L = c.n_layers;
        int64_t bad = 0, checked = 0;
        const std::string method = cs.method;
        if (method == "quest") {
          const int64_t pages = (len + 15) / 16, cap_pages = (cap + 15) / 16;
          for (int l = 0; l < L; ++l)
            for (int64_t p = 0; p < pages; ++p)
              for (int h = 0; h < nkv; ++h) {
                const float* b = after->f32.data() + ((l * cap_pages + p) * nkv + h) * 2 * d;
                for (int j = 0; j < d; ++j, ++checked) {
                  bad += !(std::isfinite(b[j]) && std::isfinite(b[d + j]) && b[j] <= b[d + j]);
                }
              }
        } else if (method == "keydiff") {
          // Per layer: scores [nkv, cap], then the mean keys [nkv, d].
          const int64_t per_layer = nkv * (cap + d);
          ASSERT_EQ(static_cast<int64_t>(after->f32.size()), L * per_layer);
          for (int l = 0; l < L; ++l)
            for (int h = 0; h < nkv; ++h) {
              for (int64_t t = 0; t < len; ++t, ++checked) {
                const float v = after->f32[l * per_layer + h * cap + t];
                bad += !(std::isfinite(v) && v >= -1.001f && v <= 1.001f);
              }
              for (int j = 0; j < d; ++j, ++checked) {
                bad += !std::isfinite(after->f32[l * per_layer + nkv * cap + h * d + j]);
              }
            }
        } else if (method == "pariskv") {
          // Bytes per layer: codes [nkv, cap, d / 2], then fp16 weights [nkv, cap, d / 8] (the
          // default m = 8): every weight of the built tokens written (not the NaN poison),
          // finite and not negative.
          const int64_t per_layer = static_cast<int64_t>(after->i32.size()) / L * 4;
          const int64_t n_sub = d / 8;
          ASSERT_EQ(per_layer, (nkv * cap * (d / 2) + nkv * cap * n_sub * 2 + 3) / 4 * 4);
          const auto* bytes = reinterpret_cast<const uint8_t*>(after->i32.data());
          for (int l = 0; l < L; ++l) {
            const auto* w =
                reinterpret_cast<const uint16_t*>(bytes + l * per_layer + nkv * cap * (d / 2));
            for (int h = 0; h < nkv; ++h)
              for (int64_t t = 0; t < len * n_sub; ++t, ++checked) {
                const float v = kvr::Fp16ToFloat(w[h * cap * n_sub + t]);
                bad += !(std::isfinite(v) && v >= 0.f);
              }
          }
        } else {
          // i32 per layer: n_clusters [nkv], offsets [nkv, K + 1], members [nkv, P].
          const int64_t per_layer = static_cast<int64_t>(after->i32.size()) / L;
          const int64_t K = (per_layer - nkv - nkv - (cap - 16) * nkv) / nkv;  // P = cap - sinks
          for (int l = 0; l < L; ++l)
            for (int h = 0; h < nkv; ++h, ++checked) {
              const int32_t* li = after->i32.data() + l * per_layer;
              const int32_t n = li[h];
              const int32_t* off = li + nkv + h * (K + 1);
              bad += !(n >= 1 && n <= K && off[0] == 0 && off[n] == len - 16);
            }
        }
        EXPECT_EQ(bad, 0) << what << " seq " << i << ": " << bad << " of " << checked
                          << " summary entries implausible";
        std::printf("[ summary ] %-40s seq %zu len %4lld  bitwise %s  checked %lld\n",
                    what.c_str(), i, static_cast<long long>(len), f_eq && i_eq ? "equal" : "DIFF",
                    static_cast<long long>(checked));
      }
      ASSERT_TRUE(m.ReleaseSequence(base).ok());
      ASSERT_TRUE(m.ReleaseSequence(base + 1).ok());
    }
  }
}

TEST(CudaPrefillSummariesTest, Llama3ShapeTwoLayers) {
  SKIP_WITHOUT_GPU();
  CheckShape("llama3-8b", 2);
}

TEST(CudaPrefillSummariesTest, Smollm2ShapeHeadDim64) {
  SKIP_WITHOUT_GPU();
  CheckShape("smollm2-135m", 3);
}

TEST(CudaPrefillSummariesTest, RejectsBadOptions) {
  SKIP_WITHOUT_GPU();
  auto config = model::DummyConfig("smollm2-135m", 1);
  ASSERT_TRUE(config.ok());
  auto m = model::CreateCudaModelWithRandomWeights(*config, 1, CudaModelOptions{});
  ASSERT_TRUE(m.ok()) << m.status();
  auto builders = PrefillSummaryBuilders::Create(*config, 0);
  ASSERT_TRUE(builders.ok()) << builders.status();
  PrefillSummaryOptions o;
  o.method = "quest";
  o.params.quest.page_size = 0;
  const absl::Status bad = (*builders)->ForSequence(o, 64).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("quest.page_size 0"), std::string_view::npos) << bad;
  o.method = "exact";
  o.params.quest.page_size = 16;
  const absl::Status none = (*builders)->ForSequence(o, 64).status();
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.message().find("'exact'"), std::string_view::npos) << none;
  // pariskv's options are parsed as its CPU index's factory parses them.
  o.method = "pariskv";
  o.params.options = {{"pariskv.subspace_dim", "3"}};
  const absl::Status bad_m = (*builders)->ForSequence(o, 64).status();
  EXPECT_EQ(bad_m.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_m.message().find("pariskv.subspace_dim"), std::string_view::npos) << bad_m;
  model::ModelConfig wide = *config;
  wide.head_dim = 96;
  EXPECT_FALSE(PrefillSummaryBuilders::Ships(wide, "pariskv", IndexParams{}))
      << "the GPU encode takes head_dim 64 or 128 only";
  EXPECT_TRUE(PrefillSummaryBuilders::Ships(*config, "pariskv", IndexParams{}));
  // ctkvr's options are applied as its CPU index's factory applies them: a bad one is named.
  o.method = "ctkvr";
  o.params.options = {{"ctkvr.fifo_size", "-1"}};
  const absl::Status bad_option = (*builders)->ForSequence(o, 64).status();
  EXPECT_EQ(bad_option.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_option.message().find("ctkvr.fifo_size"), std::string_view::npos) << bad_option;
  // A sequence without a builder has nothing to rebuild.
  ASSERT_TRUE((*m)->AddSequence(1, 64).ok());
  EXPECT_EQ((*m)->RebuildForTesting(1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*m)->RebuildForTesting(2).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvr::retrieval::cuda
