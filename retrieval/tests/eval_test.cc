// `kvr eval retrieval` on the real test model (SmolLM2-135M, $KVR_TEST_MODEL), at a context
// small enough for a unit test: the metrics of the baselines whose answer is known.
//   full: every metric equals dense (recall 1, mass 1, output error 0, agreement 1, and free
//         greedy decoding token for token equal to dense greedy);
//   exact: recall 1 by construction, mass below 1 (budget < candidates);
//   streaming: recall 0 (it selects nothing), mass below exact's.

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hot_cache_sim.h"
#include "kvr/common/paths.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/cuda/selection_replay.h"
#include "kvr/retrieval/keydiff.h"
#include "retrieval_eval.h"
#include "selection_trace.h"
#include "thinned_prefix.h"

namespace kvr::retrieval::eval {
namespace {

// The real model (SmolLM2) with float32 weights, or the test skipped without it. float32:
// "full" must reproduce the dense reference token for token, and the reference's teacher-forced
// logits come from a many-token forward pass, which with packed weights takes the SGEMM path
// while decode steps take the 8-bit gemv.
class RetrievalEvalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = kvr::TestModelPath();
    if (!std::filesystem::exists(path)) GTEST_SKIP() << "no test model at " << path;
    kvr::model::LoadOptions load_options;
    load_options.weights = kvr::model::WeightStorage::kFloat32;
    auto loaded = kvr::model::LoadModel(path, load_options, &pool);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    loaded_ = *std::move(loaded);
  }
  ThreadPool pool{0};
  kvr::model::LoadedModel loaded_;
};

TEST_F(RetrievalEvalTest, BaselinesOnTheRealModel) {
  EvalOptions o;
  o.contexts = {320};
  o.budgets = {16};
  o.methods = {"full", "exact", "streaming"};
  o.steps = 6;
  o.free_tokens = 12;
  o.n_sink = 8;
  o.local_window = 32;
  // Room for every token: a row selected once stays cached (< 512 tokens, 512 sets of 8 ways).
  o.hot_cache_rows = 4096;
  const std::filesystem::path traces =
      std::filesystem::path(::testing::TempDir()) / "eval_test_selection_traces";
  std::filesystem::remove_all(traces);
  std::filesystem::create_directories(traces);
  o.trace_dir = traces.string();
  auto rows = RunRetrievalEval(o, loaded_, &pool, nullptr);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 3u);
  std::map<std::string, EvalRow> by;
  for (const EvalRow& r : *rows) by[r.method] = r;
  const EvalRow& full = by.at("full");
  EXPECT_EQ(full.steps, 6);
  EXPECT_DOUBLE_EQ(full.recall, 1.0);
  EXPECT_NEAR(full.mass, 1.0, 1e-6);
  EXPECT_LT(full.rel_error, 1e-4);
  EXPECT_DOUBLE_EQ(full.agreement, 1.0);
  EXPECT_EQ(full.free_tokens, 12);
  EXPECT_DOUBLE_EQ(full.free_agreement, 1.0);
  EXPECT_EQ(full.free_prefix, 12);
  const EvalRow& exact = by.at("exact");
  EXPECT_DOUBLE_EQ(exact.recall, 1.0);
  EXPECT_LT(exact.mass, 1.0);
  EXPECT_GT(exact.mass, 0.0);
  const EvalRow& streaming = by.at("streaming");
  EXPECT_DOUBLE_EQ(streaming.recall, 0.0);
  EXPECT_LT(streaming.mass, exact.mass);
  // Hot cache replay: streaming selects nothing; exact's top-16 moves from step to step but
  // keeps some rows, and with nothing evicted every row the previous step selected is a hit.
  EXPECT_EQ(streaming.hot_hit_rate, 0.0);
  EXPECT_EQ(streaming.step_overlap, 0.0);
  EXPECT_GT(exact.step_overlap, 0.0);
  EXPECT_LT(exact.step_overlap, 1.0);
  EXPECT_GE(exact.hot_hit_rate, exact.step_overlap * 10 / 11 - 1e-12);  // step 1 is cold
  EXPECT_LT(exact.hot_hit_rate, 1.0);
  for (const EvalRow& r : *rows) {
    EXPECT_GE(r.free_prefix, 1) << r.method;  // the prefill's token is common to all
    EXPECT_LE(r.free_prefix, 12) << r.method;
    EXPECT_GE(r.free_agreement, static_cast<double>(r.free_prefix) / 12 - 1e-12) << r.method;
  }
  // The table and JSON carry the free-decoding columns.
  EXPECT_NE(FormatTable(*rows).find("free(pfx)"), std::string::npos);
  EXPECT_NE(ToJson(o, *rows).find("\"free_prefix\": 12"), std::string::npos);
  EXPECT_NE(ToJson(o, *rows).find("\"hot_hit_rate\""), std::string::npos);
  EXPECT_NE(FormatTable(*rows).find("4096 rows per layer"), std::string::npos);

  // The free decodings' selections were recorded, one file per method that selects within the
  // budget (not full): exact's replayed through the same hot cache gives the hit rate the
  // evaluator reported.
  std::map<std::string, SelectionTrace> recorded;
  for (const auto& entry : std::filesystem::directory_iterator(traces)) {
    auto t = ReadSelectionTrace(entry.path().string());
    ASSERT_TRUE(t.ok()) << t.status();
    recorded[t->method] = *std::move(t);
  }
  ASSERT_EQ(recorded.size(), 2u);
  const SelectionTrace& t = recorded.at("exact");
  EXPECT_EQ(t.budget, 16);
  EXPECT_EQ(t.n_sink, 8);
  EXPECT_EQ(t.local_window, 32);
  ASSERT_EQ(t.steps.size(), 11u);  // 12 free tokens: the prefill's, then 11 decode steps
  HotCacheSim sim(4096);
  for (size_t i = 0; i < t.steps.size(); ++i) {
    const SelectionTrace::Step& step = t.steps[i];
    if (i > 0) {
      EXPECT_EQ(step.position, t.steps[i - 1].position + 1);
    }
    ASSERT_EQ(step.heads.size(), static_cast<size_t>(t.n_layers) * t.n_kv_heads);
    for (size_t h = 0; h < step.heads.size(); ++h) {
      const std::vector<int32_t>& ids = step.heads[h];
      ASSERT_EQ(ids.size(), 16u);
      for (int32_t id : ids) {
        EXPECT_GE(id, t.CandidatesBegin());
        EXPECT_LT(id, t.CandidatesEnd(step));
      }
      sim.Step(static_cast<int>(h / t.n_kv_heads), static_cast<int>(h % t.n_kv_heads),
               std::vector<int64_t>(ids.begin(), ids.end()));
    }
  }
  EXPECT_DOUBLE_EQ(sim.hit_rate(), exact.hot_hit_rate);
  for (const SelectionTrace::Step& step : recorded.at("streaming").steps) {
    for (const auto& ids : step.heads) EXPECT_TRUE(ids.empty());
  }
}

// A trace file round-trips, and a damaged one is refused with the file and the fault named.
TEST(SelectionTraceTest, RoundTripAndDamage) {
  SelectionTrace t;
  t.method = "clusterkv";
  t.n_layers = 2;
  t.n_kv_heads = 2;
  t.budget = 3;
  t.n_sink = 4;
  t.local_window = 8;
  t.prompt_tokens = 100;
  t.steps.push_back({100, {{4, 9, 50}, {5}, {}, {10, 11, 12}}});
  t.steps.push_back({101, {{4, 9, 51}, {6}, {7}, {10, 11, 13}}});
  const std::string path = ::testing::TempDir() + "/selection_trace_test.kvrsel";
  ASSERT_TRUE(WriteSelectionTrace(path, t).ok());
  auto back = ReadSelectionTrace(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->method, "clusterkv");
  EXPECT_EQ(back->prompt_tokens, 100);
  ASSERT_EQ(back->steps.size(), 2u);
  EXPECT_EQ(back->steps[1].position, 101);
  EXPECT_EQ(back->steps[1].heads, t.steps[1].heads);
  EXPECT_EQ(back->CandidatesEnd(back->steps[0]), 93);

  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& b) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << b;
  };
  auto refused = [&](const std::string& what) {
    auto r = ReadSelectionTrace(path);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status();
  };
  write(bytes.substr(0, bytes.size() - 2));
  refused("truncated");
  write(bytes + "x");
  refused("bytes after the last step");
  std::string bad = bytes;
  bad[0] = 'X';
  write(bad);
  refused("magic");
  t.steps[0].position = 99;  // before the prompt's end
  ASSERT_TRUE(WriteSelectionTrace(path, t).ok());
  refused("before the prompt's end");
  t.steps[0].position = 100;
  t.steps[0].heads[0] = {9, 4};  // not ascending
  ASSERT_TRUE(WriteSelectionTrace(path, t).ok());
  refused("not ascending");
  t.steps[0].heads[0] = {4, 9, 50, 60};  // over the budget
  ASSERT_TRUE(WriteSelectionTrace(path, t).ok());
  refused("more than the budget");
  EXPECT_EQ(ReadSelectionTrace(path + ".missing").status().code(), absl::StatusCode::kNotFound);
}

// The replay's CPU reference: runs of `run` rows at the recorded positions' offsets times `run`,
// distinct and ascending, cut at the candidates' end and at the budget.
TEST(SelectionReplayTest, RunsAtScaledPositions) {
  using kvr::retrieval::cuda::ReplayHeadIds;
  const int32_t recorded[] = {10, 11, 60, 109};
  std::vector<int32_t> out(64, -1);
  // Recorded candidates from 10, replayed from 100 at 4 rows a position.
  int n = ReplayHeadIds(recorded, 4, 10, 4, 100, 1100, 64, out.data());
  ASSERT_EQ(n, 16);
  const std::vector<int32_t> want = {100, 101, 102, 103, 104, 105, 106, 107,
                                     300, 301, 302, 303, 496, 497, 498, 499};
  EXPECT_EQ(std::vector<int32_t>(out.begin(), out.begin() + n), want);
  // A position before the recorded candidates counts as their first; runs never overlap.
  const int32_t early[] = {5, 10};
  n = ReplayHeadIds(early, 2, 10, 8, 100, 200, 64, out.data());
  ASSERT_EQ(n, 16);
  for (int i = 0; i < n; ++i) EXPECT_EQ(out[i], 100 + i);
  // The budget and the candidates' end cut the runs.
  EXPECT_EQ(ReplayHeadIds(recorded, 4, 10, 4, 100, 1100, 6, out.data()), 6);
  n = ReplayHeadIds(recorded, 4, 10, 4, 100, 302, 64, out.data());
  ASSERT_EQ(n, 10);
  EXPECT_EQ(out[9], 301);
  EXPECT_EQ(ReplayHeadIds(recorded, 4, 10, 4, 100, 100, 64, out.data()), 0);
  // Scattered: the k-th row of every position, then the (k+1)-th, `scatter` apart (ascending).
  n = ReplayHeadIds(recorded, 4, 10, 3, 100, 1100, 64, out.data(), 100);
  const std::vector<int32_t> scattered = {100, 101, 150, 199, 200, 201,
                                          250, 299, 300, 301, 350, 399};
  EXPECT_EQ(std::vector<int32_t>(out.begin(), out.begin() + n), scattered);
  // Cut at the candidates' end (inside a k) and at the budget.
  n = ReplayHeadIds(recorded, 4, 10, 3, 100, 260, 64, out.data(), 100);
  EXPECT_EQ(std::vector<int32_t>(out.begin(), out.begin() + n),
            (std::vector<int32_t>{100, 101, 150, 199, 200, 201, 250}));
  EXPECT_EQ(ReplayHeadIds(recorded, 4, 10, 3, 100, 1100, 5, out.data(), 100), 5);
}

// Fetched rows through bf16 and fp8 beside the cache's own rows, with `full` (every row between
// the sinks and the local window is fetched): the cache's rows reproduce dense (dNLL 0), fp8
// rows move the NLL a little but not by nothing and cost more output error than bf16 rows.
TEST_F(RetrievalEvalTest, FetchedRowFormatsChangeOnlyTheAttendedRows) {
  EvalOptions o;
  o.contexts = {320};
  o.budgets = {16};
  o.methods = {"full", "exact"};
  o.steps = 6;
  o.free_tokens = 4;
  o.n_sink = 8;
  o.local_window = 32;
  o.row_formats = {"cache", "bf16", "fp8"};
  auto rows = RunRetrievalEval(o, loaded_, &pool, nullptr);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 6u);
  std::map<std::string, EvalRow> by;
  for (const EvalRow& r : *rows) by[r.method + "/" + r.row_format] = r;
  const EvalRow& cache = by.at("full/cache");
  const EvalRow& bf16 = by.at("full/bf16");
  const EvalRow& fp8 = by.at("full/fp8");
  const std::string table = FormatTable(*rows);
  // Not bit-equal: the sparse path sums the softmax in two merged partials.
  EXPECT_NEAR(cache.nll_delta, 0.0, 1e-3) << table;
  EXPECT_DOUBLE_EQ(cache.agreement, 1.0);
  EXPECT_LT(cache.rel_error, 1e-4);
  EXPECT_GT(bf16.rel_error, cache.rel_error);
  EXPECT_GT(fp8.rel_error, 4 * bf16.rel_error);
  EXPECT_LT(fp8.rel_error, 0.1);
  EXPECT_GT(std::abs(fp8.nll_delta - cache.nll_delta), 1e-3) << table;
  EXPECT_LT(std::abs(fp8.nll_delta), 0.1) << table;
  // The selection reads the summaries and the query, not the fetched rows; the query itself
  // moves with the rows attended at earlier layers and steps, so mass differs a little.
  for (const char* method : {"full", "exact"}) {
    for (const char* format : {"bf16", "fp8"}) {
      const EvalRow& r = by.at(absl::StrCat(method, "/", format));
      const EvalRow& c = by.at(absl::StrCat(method, "/cache"));
      EXPECT_DOUBLE_EQ(r.recall, 1.0) << method << " " << format;
      EXPECT_NEAR(r.mass, c.mass, 0.01) << method << " " << format;
      EXPECT_EQ(r.budget, 16);
    }
  }
  // Against the first format's run of the same method: itself 1; the others a share.
  EXPECT_DOUBLE_EQ(cache.base_agreement, 1.0);
  EXPECT_DOUBLE_EQ(cache.base_free_agreement, 1.0);
  for (const EvalRow& r : *rows) {
    const EvalRow& c = by.at(r.method + "/cache");
    // Steps where both equal dense's argmax equal each other: at least this share.
    EXPECT_GE(r.base_agreement, 1.0 - (1.0 - r.agreement) - (1.0 - c.agreement) - 1e-12)
        << r.method << " " << r.row_format;
    EXPECT_LE(r.base_agreement, 1.0);
    EXPECT_GE(r.base_free_agreement, 1.0 / 4 - 1e-12);  // the prefill's token is common
  }
  // `full` with the cache's rows decodes as dense does here, so the comparison with it is the
  // comparison with dense.
  ASSERT_DOUBLE_EQ(cache.free_agreement, 1.0);
  EXPECT_DOUBLE_EQ(fp8.base_agreement, fp8.agreement);
  EXPECT_DOUBLE_EQ(fp8.base_free_agreement, fp8.free_agreement);
  EXPECT_NE(table.find("vs1st tf/free"), std::string::npos);
  EXPECT_EQ(fp8.fetched_row_bytes, 136);  // head_dim 64: 128 codes + 2 scales
  EXPECT_EQ(bf16.fetched_row_bytes, 256);
  EXPECT_NE(FormatTable(*rows).find("136 B per fetched row"), std::string::npos);
  EXPECT_NE(ToJson(o, *rows).find("\"row_format\": \"fp8\""), std::string::npos);

  o.row_formats = {"fp8", "int4"};
  auto bad = RunRetrievalEval(o, loaded_, &pool, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--row-format"), std::string::npos) << bad.status();
}

// The replayed hot cache's policy on hand-traced selections (the eval test above only sees a
// cache that never evicts): 8-way sets, token t in set t % n_sets, LRU per step, the r-th miss of
// a set takes the r-th least recent way not used this step, misses beyond those are not cached;
// (layer, KV head) caches are separate.
TEST(HotCacheSimTest, EightWayLruPerStep) {
  auto ids = [](std::initializer_list<int64_t> l) { return std::vector<int64_t>(l); };
  HotCacheSim one_set(8);
  one_set.Step(0, 0, ids({0, 1, 2, 3, 4, 5, 6, 7}));  // cold: 0/8, all cached
  one_set.Step(0, 0, ids({0, 1, 2, 3, 8, 9, 10, 11}));  // 4 hits; 8..11 evict 4..7 (LRU)
  one_set.Step(0, 0, ids({4, 5, 6, 7}));  // 0 hits: evicted; they evict 0..3 (stamp 2, first)
  // 4 hits (8..11); 12..15 take the 4 ways not used this step, 16 finds none: not cached.
  one_set.Step(0, 0, ids({8, 9, 10, 11, 12, 13, 14, 15, 16}));
  one_set.Step(0, 0, ids({12, 16}));  // 1 hit (12), 16 misses
  one_set.Step(0, 1, ids({0}));  // another head: its own cold cache
  one_set.Step(0, 1, ids({0}));  // a hit there although head 0 evicted token 0
  EXPECT_DOUBLE_EQ(one_set.hit_rate(), 10.0 / 33.0);
  // Overlap with the step before, per head: 4/8, 0/4, 0/9, 2/2; head 1: 1/1.
  EXPECT_DOUBLE_EQ(one_set.overlap(), 7.0 / 24.0);

  HotCacheSim two_sets(16);  // even tokens in set 0, odd in set 1
  two_sets.Step(3, 0, ids({0, 2, 4, 6, 8, 10, 12, 14, 16, 18}));  // set 0 keeps 0..14
  two_sets.Step(3, 0, ids({1, 16}));  // 2 misses: 16 evicts 0 in set 0, 1 goes to set 1
  two_sets.Step(3, 0, ids({1, 14}));  // 2 hits
  EXPECT_DOUBLE_EQ(two_sets.hit_rate(), 2.0 / 14.0);
  EXPECT_DOUBLE_EQ(two_sets.overlap(), 2.0 / 4.0);
}

// Masked attention over a thinned prefix equals softmax attention computed directly over the
// kept rows alone (plus every row past the mask, the decoded ones); mass and error are
// measured against attention over every row.
TEST(MaskedAttentionTest, EqualsAttentionOverTheKeptRowsOnly) {
  constexpr int kHeads = 4, kKvHeads = 2, kDim = 8;
  constexpr int64_t kRows = 24, kMasked = 20;  // rows 20..23 are past the mask
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> k(kRows * kKvHeads * kDim), v(k.size()), q(kHeads * kDim);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  for (float& x : q) x = normal(rng);
  ThinMask mask;
  mask.rows = kMasked;
  mask.n_kv_heads = kKvHeads;
  mask.kept.assign(kKvHeads, std::vector<uint8_t>(kMasked, 1));
  for (int64_t r = 4; r < 12; ++r) mask.kept[0][r] = 0;  // head 0 loses rows 4..11
  mask.kept[1][17] = 0;                                  // head 1 loses row 17
  MaskedAttention::Accum accum;
  MaskedAttention attention({{7, {&mask, &accum}}});
  const kvr::model::AttentionShape shape{kHeads, kKvHeads, kDim, 0.35f};
  std::vector<float> out(kHeads * kDim, -99.f);
  kvr::model::AttentionRequest r;
  r.sequence = 7;
  r.first_position = kRows - 1;
  r.n_queries = 1;
  r.q = q.data();
  r.kv = {.k = k.data(),
          .v = v.data(),
          .n_rows = kRows,
          .row_stride = kKvHeads * kDim,
          .total_tokens = kRows};
  r.out = out.data();
  ASSERT_TRUE(attention.Attend(shape, {&r, 1}).ok());
  for (int h = 0; h < kHeads; ++h) {
    const int kvh = h / 2;
    std::vector<double> w;
    std::vector<int64_t> ids;
    for (int64_t t = 0; t < kRows; ++t) {
      if (t < kMasked && mask.kept[kvh][t] == 0) continue;
      double dot = 0;
      for (int d = 0; d < kDim; ++d) dot += q[h * kDim + d] * k[(t * kKvHeads + kvh) * kDim + d];
      w.push_back(0.35 * dot);
      ids.push_back(t);
    }
    const double m = *std::max_element(w.begin(), w.end());
    double z = 0;
    for (double& x : w) z += (x = std::exp(x - m));
    for (int d = 0; d < kDim; ++d) {
      double o = 0;
      for (size_t i = 0; i < ids.size(); ++i)
        o += w[i] / z * v[(ids[i] * kKvHeads + kvh) * kDim + d];
      EXPECT_NEAR(out[h * kDim + d], o, 1e-5) << "head " << h << " dim " << d;
    }
  }
  EXPECT_EQ(accum.head_samples, kHeads);
  EXPECT_LT(accum.mass, kHeads);  // every head lost some mass
  EXPECT_GT(accum.rel_error, 0);
  // Prefill calls are not what it measures.
  r.n_queries = 2;
  EXPECT_TRUE(absl::IsUnimplemented(attention.Attend(shape, {&r, 1})));
}

// The store's KeyDiff score (kvr/common/key_diff.h) is the `keydiff` method's: cosine to the
// head's mean key, as the method's KeyDiffTracker scores a key once every key is added (its own
// running sum; retrieval::KeyDiffScores calls the store's function, so it is no witness).
TEST(MaskedAttentionTest, StoreScoreIsTheKeyDiffMethodsScore) {
  constexpr int kKvHeads = 3, kDim = 16;
  constexpr int64_t kTokens = 200;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.3f, 1.f);
  std::vector<float> keys(kTokens * kKvHeads * kDim);
  for (float& x : keys) x = normal(rng);
  for (int h = 0; h < kKvHeads; ++h) {
    KeyDiffTracker method(kDim);
    for (int64_t t = 0; t < kTokens; ++t) method.Add(keys.data() + (t * kKvHeads + h) * kDim);
    std::vector<float> store(kTokens);
    kvr::KeyDiffScores(keys.data() + h * kDim, kTokens, kDim, kKvHeads * kDim, store.data());
    for (int64_t t = 0; t < kTokens; ++t) {
      EXPECT_NEAR(store[t], method.Score(keys.data() + (t * kKvHeads + h) * kDim), 1e-5)
          << h << " " << t;
    }
  }
}

// Thinned-prefix rows on the real model: keeping everything reproduces dense (as `full`
// does); keeping half of every (layer, KV head)'s 16-row pages keeps exactly half the rows
// (20 pages: sink page, 4 recent pages, 15 candidates of which 10 go), for KeyDiff's choice and
// the random control alike, and costs attention mass and output error; keeping none leaves the
// sink and recent pages only.
TEST_F(RetrievalEvalTest, ThinnedPrefixRows) {
  EvalOptions o;
  o.contexts = {320};
  o.budgets = {16};
  o.methods = {"full"};
  o.steps = 6;
  o.free_tokens = 12;
  o.thin_keep = {1.0, 0.5, 0.0};
  o.thin_page_rows = 16;
  o.thin_random = true;
  auto rows = RunRetrievalEval(o, loaded_, &pool, nullptr);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 7u);  // full + 3 keeps x 2 orders
  std::map<std::string, EvalRow> by;
  for (const EvalRow& r : *rows) by[absl::StrCat(r.method, "@", r.kept_fraction)] = r;
  const EvalRow& whole = by.at("thin-kd@1");
  EXPECT_EQ(whole.budget, 320);
  EXPECT_EQ(whole.intact_rows, 320);
  EXPECT_NEAR(whole.mass, 1.0, 1e-6);
  EXPECT_LT(whole.rel_error, 1e-4);
  EXPECT_NEAR(whole.nll_delta, 0.0, 1e-3);
  EXPECT_DOUBLE_EQ(whole.agreement, 1.0);
  EXPECT_DOUBLE_EQ(whole.free_agreement, 1.0);
  for (const char* method : {"thin-kd", "thin-rnd"}) {
    const EvalRow& half = by.at(absl::StrCat(method, "@0.5"));
    EXPECT_EQ(half.budget, 160) << method;
    EXPECT_LT(half.mass, 1.0) << method;
    EXPECT_GT(half.mass, 0.0) << method;
    EXPECT_GT(half.rel_error, 0.0) << method;
    EXPECT_EQ(half.recall, -1) << method;
    // The sink page stays; some head drops page 1 or another before the recent pages.
    EXPECT_GE(half.intact_rows, 16) << method;
    EXPECT_LT(half.intact_rows, 256) << method;
    EXPECT_EQ(half.intact_rows % 16, 0) << method;
    const EvalRow& none = by.at(absl::StrCat(method, "@0.25"));
    EXPECT_EQ(none.budget, 80) << method;  // 5 of 20 pages
    EXPECT_LT(none.mass, half.mass + 1e-9) << method;
  }
  EXPECT_NE(FormatTable(*rows).find("thin-kd"), std::string::npos);
  EXPECT_NE(ToJson(o, *rows).find("\"kept_fraction\": 0.5"), std::string::npos);
  o.thin_keep = {1.5};
  rows = RunRetrievalEval(o, loaded_, &pool, nullptr);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find("--thin-keep"), std::string::npos);
}

TEST_F(RetrievalEvalTest, BadOptionsNameTheFlag) {
  EvalOptions o;
  o.contexts = {8000};
  o.free_tokens = 1000;  // 8000 + 1000 > SmolLM2's 8192 positions
  auto rows = RunRetrievalEval(o, loaded_, &pool, nullptr);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find("--free-tokens"), std::string::npos)
      << rows.status();
  o.contexts = {320};
  o.free_tokens = -1;
  rows = RunRetrievalEval(o, loaded_, &pool, nullptr);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find("--free-tokens"), std::string::npos);
}

}  // namespace
}  // namespace kvr::retrieval::eval
