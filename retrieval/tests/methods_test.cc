// Per-method tests: hand-made key sets with a known answer, byte-format round trips (and corrupt
// or truncated bytes), append-after-build recall against the exact oracle, and budget >= context.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/ctkvr.h"
#include "kvr/retrieval/keydiff.h"
#include "kvr/retrieval/prebuilt.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/serialization.h"
#include "test_util.h"

namespace kvr::retrieval {
namespace {

using testing::CoreRegistry;
using ::testing::ElementsAreArray;
using testing::ExpectInvalidArgument;
using testing::ExpectOtherMethodRefused;
using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::SmallShape;
using testing::View;

std::unique_ptr<RetrievalIndex> MakeBuilt(const MethodRegistry& r, std::string_view method,
                                          const IndexShape& s, const IndexParams& p,
                                          const std::vector<float>& keys,
                                          const std::vector<float>& queries) {
  auto index = r.Make(method, s, p);
  EXPECT_TRUE(index.ok()) << index.status();
  if (!index.ok()) return nullptr;
  BuildInput in{View(keys, s.n_kv_heads, s.head_dim), View(queries, s.n_heads, s.head_dim), 0};
  absl::Status st = (*index)->Build(in);
  EXPECT_TRUE(st.ok()) << method << ": " << st;
  return std::move(*index);
}

std::vector<int64_t> Range(int64_t a, int64_t b) {
  std::vector<int64_t> v(b - a);
  std::iota(v.begin(), v.end(), a);
  return v;
}

// A query for every head pointing along unit direction `axis` (scaled), so that q.k is large
// exactly for keys along that axis.
std::vector<float> AxisQuery(const IndexShape& s, int axis, float scale = 8.f) {
  std::vector<float> q(s.n_heads * s.head_dim, 0.f);
  for (int h = 0; h < s.n_heads; ++h) q[h * s.head_dim + axis] = scale;
  return q;
}

// Keys: small noise, with tokens in `hot` carrying a big component along `axis`.
std::vector<float> KeysWithHotSet(const IndexShape& s, int64_t n, const std::vector<int64_t>& hot,
                                  int axis, uint64_t seed) {
  std::vector<float> k = RandomTensor(n, s.n_kv_heads, s.head_dim, seed, 0.1f);
  for (int64_t t : hot) {
    for (int h = 0; h < s.n_kv_heads; ++h) k[(t * s.n_kv_heads + h) * s.head_dim + axis] += 3.f;
  }
  return k;
}

TEST(ExactTest, FindsThePlantedKeys) {
  IndexShape s = SmallShape();
  const std::vector<int64_t> hot = {7, 19, 33, 60};
  std::vector<float> keys = KeysWithHotSet(s, 80, hot, 3, 1);
  IndexParams p;
  auto index = MakeBuilt(CoreRegistry(), "exact", s, p, keys, {});
  std::vector<float> q = AxisQuery(s, 3);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), 80, 4, 4, 70}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(hot));
  // Sinks and the local window are never returned.
  ASSERT_TRUE(index->Select({q.data(), 80, 2, 8, 40}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray({19, 33}));
}

TEST(QuestTest, SelectsThePageHoldingTheKeyAndTrimsToBudget) {
  IndexShape s = SmallShape();
  IndexParams p;
  p.quest.page_size = 16;
  std::vector<float> keys = KeysWithHotSet(s, 96, {50}, 5, 2);  // page 3 = [48, 64)
  auto index = MakeBuilt(CoreRegistry(), "quest", s, p, keys, {});
  std::vector<float> q = AxisQuery(s, 5);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), 96, 16, 0, 96}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(Range(48, 64)));
  ASSERT_TRUE(index->Select({q.data(), 96, 5, 0, 96}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(Range(48, 53)));
  EXPECT_EQ(index->MemoryBytes(), 6 * 2 * 2 * 16 * 4);  // pages x heads x (min,max) x dim x 4
}

TEST(ClusterKvTest, SelectsTheClusterAlignedWithTheQuery) {
  IndexShape s = SmallShape();
  // Tokens 0..3 sinks; others alternate between a cluster along axis 1 and one along axis 2.
  const int64_t n = 64;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 3, 0.05f);
  std::vector<int64_t> axis2;
  for (int64_t t = 4; t < n; ++t) {
    const int axis = (t % 3 == 0) ? 2 : 1;
    if (axis == 2) axis2.push_back(t);
    for (int h = 0; h < s.n_kv_heads; ++h)
      keys[(t * s.n_kv_heads + h) * s.head_dim + axis] += 1.f + (t % 5);
  }
  IndexParams p;
  p.n_sink = 4;
  p.clusterkv.n_clusters = 2;
  auto index = MakeBuilt(CoreRegistry(), "clusterkv", s, p, keys, {});
  std::vector<float> q = AxisQuery(s, 2);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), n, static_cast<int64_t>(axis2.size()), 4, n}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(axis2));
  // Budget smaller than the cluster: trimmed to the budget, still only axis-2 tokens.
  ASSERT_TRUE(index->Select({q.data(), n, 5, 4, n}, &sel).ok());
  for (const auto& ids : sel.per_head) {
    EXPECT_EQ(ids.size(), 5u);
    for (int64_t id : ids) EXPECT_EQ(id % 3, 0);
  }
}

TEST(ClusterKvTest, RankTrimmedTakesTheTrimmedClustersHighestScoringTokens) {
  IndexShape s = SmallShape();
  // As above: the axis-2 cluster holds tokens t % 3 == 0, their axis-2 component 1 + t % 5.
  const int64_t n = 64;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 3, 0.05f);
  for (int64_t t = 4; t < n; ++t) {
    const int axis = (t % 3 == 0) ? 2 : 1;
    for (int h = 0; h < s.n_kv_heads; ++h)
      keys[(t * s.n_kv_heads + h) * s.head_dim + axis] += 1.f + (t % 5);
  }
  IndexParams p;
  p.n_sink = 4;
  p.clusterkv.n_clusters = 2;
  p.clusterkv.rank_trimmed = true;
  MethodRegistry r = CoreRegistry();
  auto index = MakeBuilt(r, "clusterkv", s, p, keys, {});
  std::vector<float> q = AxisQuery(s, 2);
  // Budget 4 inside the 20-token cluster: its four largest keys (t % 5 == 4), not its first four.
  const std::vector<int64_t> largest = {9, 24, 39, 54};
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), n, 4, 4, n}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(largest));
  // The choice survives the byte format (the keys travel with it).
  auto bytes = SerializeIndex(*index);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto copy = DeserializeIndex(*bytes, r, IndexParams{}, &s);
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_TRUE((*copy)->Select({q.data(), n, 4, 4, n}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(largest));
}

// Prebuilt summaries (prebuilt.h): the bytes a GPU-built summary ships as.
TEST(PrebuiltTest, QuestBoundsGiveTheCpuIndexBytes) {
  IndexShape s = SmallShape();
  const int64_t n = 53;  // a partial last page
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 11);
  IndexParams p;
  p.quest.page_size = 8;
  auto cpu = MakeBuilt(CoreRegistry(), "quest", s, p, keys, {});
  auto want = SerializeIndex(*cpu);
  ASSERT_TRUE(want.ok());
  // Page bounds computed here: [pages, n_kv_heads, 2, head_dim], min then max.
  const int64_t pages = (n + 7) / 8, hd = s.head_dim;
  std::vector<float> bounds(pages * s.n_kv_heads * 2 * hd);
  for (int64_t pg = 0; pg < pages; ++pg) {
    for (int h = 0; h < s.n_kv_heads; ++h) {
      float* mn = &bounds[((pg * s.n_kv_heads + h) * 2) * hd];
      float* mx = mn + hd;
      for (int64_t t = pg * 8; t < std::min(n, pg * 8 + 8); ++t) {
        for (int d = 0; d < hd; ++d) {
          const float k = keys[(t * s.n_kv_heads + h) * hd + d];
          mn[d] = t == pg * 8 ? k : std::min(mn[d], k);
          mx[d] = t == pg * 8 ? k : std::max(mx[d], k);
        }
      }
    }
  }
  auto got = SerializePrebuiltQuest(s, p, n, bounds);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, *want);
  bounds.pop_back();
  auto bad = SerializePrebuiltQuest(s, p, n, bounds);
  ExpectInvalidArgument(bad.status(), "bounds has");
}

// A keydiff summary built elsewhere (the GPU's KeyDiffBuild) ships as the bytes of the CPU
// index over the same keys, given the fp64 key sums' means and the scores.
TEST(PrebuiltTest, KeyDiffMeansAndScoresGiveTheCpuIndexBytes) {
  IndexShape s = SmallShape();
  const int64_t n = 77;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 17);
  IndexParams p;
  p.keydiff.fill = 0.75f;
  auto cpu = MakeBuilt(CoreRegistry(), "keydiff", s, p, keys, {});
  auto want = SerializeIndex(*cpu);
  ASSERT_TRUE(want.ok());
  auto state = KeyDiffStateOf(*cpu);
  ASSERT_TRUE(state.ok());
  // The means as a builder computes them: fp64 sums of the keys, divided once, rounded to fp32.
  std::vector<std::vector<float>> means(s.n_kv_heads, std::vector<float>(s.head_dim));
  std::vector<PrebuiltKeyDiffHead> heads;
  for (int h = 0; h < s.n_kv_heads; ++h) {
    for (int d = 0; d < s.head_dim; ++d) {
      double sum = 0;
      for (int64_t t = 0; t < n; ++t) sum += keys[(t * s.n_kv_heads + h) * s.head_dim + d];
      means[h][d] = static_cast<float>(sum / n);
    }
    heads.push_back({means[h], state->heads[h].scores});
  }
  auto got = SerializePrebuiltKeyDiff(s, p, n, heads);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, *want);
  heads[1].scores = heads[1].scores.first(n - 1);
  auto bad = SerializePrebuiltKeyDiff(s, p, n, heads);
  ExpectInvalidArgument(bad.status(), "head 1");
}

TEST(PrebuiltTest, ClusterKvClustersSelectLikeTheCpuIndex) {
  IndexShape s = SmallShape();
  const int64_t n = 64;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 3, 0.05f);
  std::vector<int32_t> axis1, axis2;
  for (int64_t t = 4; t < n; ++t) {
    const int axis = (t % 3 == 0) ? 2 : 1;
    (axis == 2 ? axis2 : axis1).push_back(static_cast<int32_t>(t));
    for (int h = 0; h < s.n_kv_heads; ++h)
      keys[(t * s.n_kv_heads + h) * s.head_dim + axis] += 1.f + (t % 5);
  }
  IndexParams p;
  p.n_sink = 4;
  // Cluster 0 = the axis-1 tokens, cluster 1 = the axis-2 tokens, centroids = mean keys.
  std::vector<std::vector<float>> centroids(s.n_kv_heads);
  std::vector<int32_t> offsets = {0, static_cast<int32_t>(axis1.size()),
                                  static_cast<int32_t>(axis1.size() + axis2.size())};
  std::vector<int32_t> ids = axis1;
  ids.insert(ids.end(), axis2.begin(), axis2.end());
  std::vector<PrebuiltClusterKvHead> heads;
  for (int h = 0; h < s.n_kv_heads; ++h) {
    std::vector<float>& c = centroids[h];
    c.assign(2 * s.head_dim, 0.f);
    for (int k = 0; k < 2; ++k) {
      const std::vector<int32_t>& members = k == 0 ? axis1 : axis2;
      for (int32_t t : members) {
        for (int d = 0; d < s.head_dim; ++d) {
          c[k * s.head_dim + d] += keys[(t * s.n_kv_heads + h) * s.head_dim + d] / members.size();
        }
      }
    }
    heads.push_back({c, offsets, ids});
  }
  auto bytes = SerializePrebuiltClusterKv(s, p, n, heads);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto index = DeserializeIndex(*bytes, CoreRegistry(), p);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ((*index)->size(), n);
  auto again = SerializeIndex(**index);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *bytes);
  // Its typed state (what the GPU layout reads): the same clusters, nothing pending.
  {
    auto st = ClusterKvStateOf(**index);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->n_sink, 4);
    EXPECT_EQ(st->pending_begin, n);
    EXPECT_TRUE(st->pending_keys.empty());
    ASSERT_EQ(st->heads.size(), 2u);
    for (int h = 0; h < 2; ++h) {
      EXPECT_THAT(st->heads[h].ids, ElementsAreArray(ids));
      EXPECT_THAT(st->heads[h].offsets, ElementsAreArray(offsets));
      EXPECT_THAT(st->heads[h].centroids, ElementsAreArray(centroids[h]));
    }
  }
  // As the CPU-built index of ClusterKvTest.SemanticClustersSelectWholeCluster.
  std::vector<float> q = AxisQuery(s, 2);
  Selection sel;
  ASSERT_TRUE((*index)->Select({q.data(), n, static_cast<int64_t>(axis2.size()), 4, n}, &sel).ok());
  std::vector<int64_t> want(axis2.begin(), axis2.end());
  for (const auto& got : sel.per_head) EXPECT_THAT(got, ElementsAreArray(want));
  // Generated tokens still go through the CPU index's incremental clustering.
  std::vector<float> more = RandomTensor(40, s.n_kv_heads, s.head_dim, 5);
  EXPECT_TRUE((*index)->Append({View(more, s.n_kv_heads, s.head_dim), {}}).ok());
  EXPECT_EQ((*index)->size(), n + 40);

  // Parsed back (what a GPU decode node uploads): the same clusters.
  auto parsed = ParsePrebuiltClusterKv(*bytes, CoreRegistry());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->size, n);
  EXPECT_EQ(parsed->n_sink, 4);
  ASSERT_EQ(parsed->ids.size(), 2u);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(parsed->ids[h], ids);
    EXPECT_EQ(parsed->offsets[h], offsets);
    EXPECT_EQ(parsed->centroids[h], centroids[h]);
  }
  auto appended = SerializeIndex(**index);  // 40 tokens appended above: not a prefill state
  ASSERT_TRUE(appended.ok());
  EXPECT_EQ(ParsePrebuiltClusterKv(*appended, CoreRegistry()).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto quest = MakeBuilt(CoreRegistry(), "quest", s, p, keys, {});
  auto quest_bytes = SerializeIndex(*quest);
  ASSERT_TRUE(quest_bytes.ok());
  auto not_ckv = ParsePrebuiltClusterKv(*quest_bytes, CoreRegistry());
  EXPECT_THAT(std::string(not_ckv.status().message()), HasSubstr("'quest' index"));
  ExpectOtherMethodRefused(ClusterKvStateOf(*quest).status(), "quest");

  // Layout errors name what is wrong.
  std::vector<int32_t> dup = ids;
  dup[1] = dup[0];
  heads[1].ids = dup;
  auto bad = SerializePrebuiltClusterKv(s, p, n, heads);
  ExpectInvalidArgument(bad.status(), "head 1");
  heads[1].ids = std::span<const int32_t>(ids).subspan(1);
  bad = SerializePrebuiltClusterKv(s, p, n, heads);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("ids ending at offset"));
  heads.pop_back();
  bad = SerializePrebuiltClusterKv(s, p, n, heads);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("1 heads, expected 2"));
}

TEST(ClusterKvTest, IncrementalClustersCoverGeneratedTokens) {
  IndexShape s = SmallShape();
  std::vector<float> keys = RandomTensor(64, s.n_kv_heads, s.head_dim, 4, 0.1f);
  IndexParams p;
  p.n_sink = 4;
  p.clusterkv.n_clusters = 4;
  p.clusterkv.append_every = 8;
  p.clusterkv.append_clusters = 2;
  auto index = MakeBuilt(CoreRegistry(), "clusterkv", s, p, keys, {});
  // 10 generated tokens: 8 get clustered, 2 stay pending; token 70 is the hot one (pending).
  std::vector<float> gen = KeysWithHotSet(s, 10, {6, 9}, 7, 5);
  ASSERT_TRUE(index->Append({View(gen, s.n_kv_heads, s.head_dim), {}}).ok());
  EXPECT_EQ(index->size(), 74);
  std::vector<float> q = AxisQuery(s, 7);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), 74, 1, 4, 74}, &sel).ok());
  for (const auto& ids : sel.per_head) {
    ASSERT_EQ(ids.size(), 1u);
    EXPECT_TRUE(ids[0] == 70 || ids[0] == 73) << ids[0];
  }
}

TEST(CtkvrTest, ListsOfMatchingCentroidsAreRecalledAndReranked) {
  IndexShape s = SmallShape();
  const int64_t n = 128;
  const std::vector<int64_t> hot = {20, 40, 90, 100};
  std::vector<float> keys = KeysWithHotSet(s, n, hot, 9, 6);
  // Prefill queries: noise, with the last 8 pointing along axis 9.
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 7, 0.1f);
  for (int64_t t = n - 8; t < n; ++t) {
    for (int h = 0; h < s.n_heads; ++h) queries[(t * s.n_heads + h) * s.head_dim + 9] += 5.f;
  }
  IndexParams p;
  p.n_sink = 4;
  p.ctkvr.n_centroids = 16;
  p.ctkvr.list_length = 8;
  p.ctkvr.n_recall = 2;
  auto index = MakeBuilt(CoreRegistry(), "ctkvr", s, p, keys, queries);
  std::vector<float> q = AxisQuery(s, 9);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), n, 4, 4, n}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(hot));
}

// CtkvrStateOf: the index's parameters, keys and qcIVF entries (unit centroids of the group,
// ascending lists inside the indexed tokens); another method's index is refused by name.
TEST(CtkvrTest, StateHandsOutTheIndexsEntries) {
  IndexShape s = SmallShape();
  const int64_t n = 128;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 5);
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 7);
  IndexParams p;
  p.n_sink = 4;
  p.ctkvr.n_centroids = 16;
  p.ctkvr.list_length = 8;
  p.ctkvr.n_recall = 2;
  p.ctkvr.fifo_size = 4;
  auto index = MakeBuilt(CoreRegistry(), "ctkvr", s, p, keys, queries);
  auto st = CtkvrStateOf(*index);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->n_sink, 4);
  EXPECT_EQ(st->n_centroids, 16);
  EXPECT_EQ(st->rho, 8);
  EXPECT_EQ(st->n_recall, 2);
  EXPECT_EQ(st->fifo_size, 4);
  EXPECT_EQ(st->keys.size(), keys.size());
  ASSERT_EQ(st->heads.size(), static_cast<size_t>(s.n_kv_heads));
  const int group = s.group_size();
  for (const auto& entries : st->heads) {
    ASSERT_EQ(entries.size(), 16u);
    for (const CtkvrState::Entry& e : entries) {
      ASSERT_EQ(e.centroid.size(), static_cast<size_t>(group) * s.head_dim);
      EXPECT_EQ(e.norms.size(), static_cast<size_t>(group));
      for (int g = 0; g < group; ++g) {
        double sq = 0;
        for (int i = 0; i < s.head_dim; ++i) {
          const float x = e.centroid[g * s.head_dim + i];
          sq += x * x;
        }
        EXPECT_NEAR(sq, 1.0, 1e-4);
      }
      EXPECT_LE(e.list.size(), 8u);
      EXPECT_TRUE(std::is_sorted(e.list.begin(), e.list.end()));
      for (int32_t id : e.list) EXPECT_TRUE(id >= 4 && id < n) << id;
    }
  }
  auto keydiff = MakeBuilt(CoreRegistry(), "keydiff", s, IndexParams{}, keys, {});
  ExpectOtherMethodRefused(CtkvrStateOf(*keydiff).status(), "keydiff");
}

// SerializePrebuiltCtkvr from an index's own state gives that index's bytes (what a GPU build
// ships must be indistinguishable from a CPU build in the same state); a state that does not fit
// the shape is refused naming what.
TEST(CtkvrTest, PrebuiltStateGivesTheCpuIndexBytes) {
  IndexShape s = SmallShape();
  const int64_t n = 128;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 5);
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 7);
  IndexParams p;
  p.n_sink = 4;
  p.budget = 6;
  p.ctkvr.n_centroids = 16;
  auto index = MakeBuilt(CoreRegistry(), "ctkvr", s, p, keys, queries);
  auto want = SerializeIndex(*index);
  ASSERT_TRUE(want.ok()) << want.status();
  auto st = CtkvrStateOf(*index);
  ASSERT_TRUE(st.ok()) << st.status();
  auto got = SerializePrebuiltCtkvr(s, p, n, *st);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, *want);
  CtkvrState short_keys = *st;
  short_keys.keys = short_keys.keys.subspan(1);
  EXPECT_EQ(SerializePrebuiltCtkvr(s, p, n, short_keys).status().code(),
            absl::StatusCode::kInvalidArgument);
  CtkvrState bad_id = *st;
  const std::vector<int32_t> outside = {0, static_cast<int32_t>(n)};
  bad_id.heads[0][0].list = outside;
  const absl::Status refused = SerializePrebuiltCtkvr(s, p, n, bad_id).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("token id 128"), std::string_view::npos) << refused;
}

TEST(CtkvrTest, FifoUpdateReplacesOldestCentroidWithDecodeQuery) {
  IndexShape s = SmallShape();
  const int64_t n = 128;
  const std::vector<int64_t> hot_a = {20, 40}, hot_b = {60, 80};
  std::vector<float> keys = KeysWithHotSet(s, n, hot_a, 9, 8);
  for (int64_t t : hot_b) {
    for (int h = 0; h < s.n_kv_heads; ++h) keys[(t * s.n_kv_heads + h) * s.head_dim + 11] += 3.f;
  }
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 9, 0.1f);
  for (int h = 0; h < s.n_heads; ++h) queries[((n - 1) * s.n_heads + h) * s.head_dim + 9] += 5.f;
  IndexParams p;
  p.n_sink = 4;
  p.ctkvr.n_centroids = 1;  // one centroid (axis 9) whose list is {20, 40}
  p.ctkvr.list_length = 2;
  p.ctkvr.n_recall = 1;
  p.ctkvr.fifo_size = 1;
  auto index = MakeBuilt(CoreRegistry(), "ctkvr", s, p, keys, queries);
  Selection sel;
  std::vector<float> qb = AxisQuery(s, 11);
  // The only list is {20, 40}: an axis-11 query can only get those back...
  ASSERT_TRUE(index->Select({qb.data(), n, 2, 4, n}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(hot_a));
  // ...and the FIFO then replaced the centroid with that query and its reranked list.
  auto bytes = SerializeIndex(*index);
  ASSERT_TRUE(bytes.ok());
  EXPECT_GT(bytes->size(), 0u);
  std::vector<float> qa = AxisQuery(s, 9);
  ASSERT_TRUE(index->Select({qa.data(), n, 2, 4, n}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(hot_a));
}

TEST(CtkvrTest, AppendedKeysReachTheListsOfMatchingCentroids) {
  IndexShape s = SmallShape();
  const int64_t n = 64;
  std::vector<float> keys = KeysWithHotSet(s, n, {10, 30}, 9, 10);
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 11, 0.1f);
  for (int h = 0; h < s.n_heads; ++h) queries[((n - 1) * s.n_heads + h) * s.head_dim + 9] += 5.f;
  IndexParams p;
  p.n_sink = 4;
  p.ctkvr.n_centroids = 1;
  p.ctkvr.list_length = 2;
  p.ctkvr.n_recall = 1;
  auto index = MakeBuilt(CoreRegistry(), "ctkvr", s, p, keys, queries);
  std::vector<float> gen = KeysWithHotSet(s, 4, {2}, 9, 12);  // token 66 strongly along axis 9
  for (int h = 0; h < s.n_kv_heads; ++h) gen[(2 * s.n_kv_heads + h) * s.head_dim + 9] += 3.f;
  ASSERT_TRUE(index->Append({View(gen, s.n_kv_heads, s.head_dim), {}}).ok());
  std::vector<float> q = AxisQuery(s, 9);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), 68, 1, 4, 68}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray({66}));
}

TEST(KeyDiffTest, MostDistinctiveKeysAreSelectedAndEvictedLast) {
  IndexShape s = SmallShape();
  const int64_t n = 40;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 13, 0.05f);
  for (int64_t t = 0; t < n; ++t) {
    for (int h = 0; h < s.n_kv_heads; ++h) keys[(t * s.n_kv_heads + h) * s.head_dim + 0] += 1.f;
  }
  const std::vector<int64_t> odd = {12, 25};  // point the other way
  for (int64_t t : odd) {
    for (int h = 0; h < s.n_kv_heads; ++h) keys[(t * s.n_kv_heads + h) * s.head_dim + 0] = -1.f;
  }
  auto index = MakeBuilt(CoreRegistry(), "keydiff", s, IndexParams{}, keys, {});
  std::vector<float> q = AxisQuery(s, 4);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), n, 2, 0, n}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(odd));

  std::vector<float> scores = KeyDiffScores(View(keys, s.n_kv_heads, s.head_dim), 0, s.head_dim);
  std::vector<int64_t> order = KeyDiffEvictionOrder(scores, std::vector<int64_t>{0, 1});
  ASSERT_EQ(order.size(), static_cast<size_t>(n - 2));
  EXPECT_THAT(std::set<int64_t>(order.end() - 2, order.end()), ::testing::ElementsAre(12, 25));
  EXPECT_EQ(std::count(order.begin(), order.end(), 0), 0);

  KeyDiffTracker tracker(s.head_dim);
  for (int64_t t = 0; t < n; ++t) tracker.Add(&keys[(t * s.n_kv_heads) * s.head_dim]);
  tracker.Remove(&keys[(12 * s.n_kv_heads) * s.head_dim]);
  EXPECT_EQ(tracker.count(), n - 1);
  EXPECT_LT(tracker.Score(&keys[(25 * s.n_kv_heads) * s.head_dim]), 0.f);
}

// KeyDiffStateOf hands out what the index selects from: its scores (those KeyDiffScores gives
// for the prompt), the running sum of every key and their count, after an Append too; another
// method's index is refused by name.
TEST(KeyDiffTest, StateIsTheIndexsScoresAndRunningSum) {
  IndexShape s = SmallShape();
  const int64_t n = 30;
  std::vector<float> keys = RandomTensor(n + 2, s.n_kv_heads, s.head_dim, 21);
  IndexParams p;
  p.keydiff.fill = 0.5f;
  auto index = MakeBuilt(CoreRegistry(), "keydiff", s, p,
                         std::vector<float>(keys.begin(), keys.begin() + n * s.n_kv_heads *
                                                                             s.head_dim),
                         {});
  ASSERT_TRUE(index->Append({View(keys, s.n_kv_heads, s.head_dim, n, 2), {}}).ok());
  auto state = KeyDiffStateOf(*index);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->fill, 0.5f);
  ASSERT_EQ(state->heads.size(), static_cast<size_t>(s.n_kv_heads));
  for (int h = 0; h < s.n_kv_heads; ++h) {
    const KeyDiffState::Head& hd = state->heads[h];
    ASSERT_EQ(hd.scores.size(), static_cast<size_t>(n + 2));
    EXPECT_EQ(hd.count, n + 2);
    // The prompt's scores are KeyDiffScores over the prompt; the sum is every key's.
    std::vector<float> prompt(keys.begin(), keys.begin() + n * s.n_kv_heads * s.head_dim);
    const std::vector<float> want = KeyDiffScores(View(prompt, s.n_kv_heads, s.head_dim), h,
                                                  s.head_dim);
    EXPECT_THAT(std::vector<float>(hd.scores.begin(), hd.scores.begin() + n),
                ElementsAreArray(want));
    ASSERT_EQ(hd.sum.size(), static_cast<size_t>(s.head_dim));
    for (int i = 0; i < s.head_dim; ++i) {
      double sum = 0;
      for (int64_t t = 0; t < n + 2; ++t) sum += keys[(t * s.n_kv_heads + h) * s.head_dim + i];
      EXPECT_EQ(hd.sum[i], sum) << "head " << h << " dim " << i;
    }
  }
  auto quest = MakeBuilt(CoreRegistry(), "quest", s, IndexParams{}, keys, {});
  ExpectOtherMethodRefused(KeyDiffStateOf(*quest).status(), "quest");
}

TEST(TrivialMethodsTest, FullSelectsEveryCandidateStreamingNone) {
  IndexShape s = SmallShape();
  std::vector<float> keys = RandomTensor(50, s.n_kv_heads, s.head_dim, 14);
  MethodRegistry r = CoreRegistry();
  auto full = MakeBuilt(r, "full", s, IndexParams{}, keys, {});
  auto streaming = MakeBuilt(r, "streaming", s, IndexParams{}, keys, {});
  std::vector<float> q = AxisQuery(s, 0);
  Selection sel;
  ASSERT_TRUE(full->Select({q.data(), 50, 3, 4, 40}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(Range(4, 40)));
  ASSERT_TRUE(streaming->Select({q.data(), 50, 3, 4, 40}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_TRUE(ids.empty());
}

// ---- Properties every query-aware method must have --------------------------------------------

struct Case {
  std::string method;
};

class MethodProperties : public ::testing::TestWithParam<std::string> {
 protected:
  IndexParams Params(int64_t budget) const {
    IndexParams p;
    p.budget = budget;
    p.n_sink = 4;
    p.ctkvr.n_centroids = 32;
    p.clusterkv.append_every = 16;
    return p;
  }
};

TEST_P(MethodProperties, BudgetAtLeastContextSelectsEveryCandidate) {
  const std::string method = GetParam();
  if (method == "streaming") GTEST_SKIP() << "streaming selects nothing by definition";
  IndexShape s = SmallShape();
  const int64_t n = 200;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 21);
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 22);
  auto index = MakeBuilt(CoreRegistry(), method, s, Params(n), keys, queries);
  std::vector<float> q = RandomTensor(1, s.n_heads, s.head_dim, 23);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), n, n, 4, 180}, &sel).ok());
  for (const auto& ids : sel.per_head) EXPECT_THAT(ids, ElementsAreArray(Range(4, 180))) << method;
}

TEST_P(MethodProperties, SelectionIsBoundedDistinctAndOutsideSinkAndLocal) {
  const std::string method = GetParam();
  IndexShape s = SmallShape();
  const int64_t n = 300;
  std::vector<float> keys = RandomTensor(n, s.n_kv_heads, s.head_dim, 31);
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 32);
  auto index = MakeBuilt(CoreRegistry(), method, s, Params(24), keys, queries);
  std::vector<float> q = RandomTensor(1, s.n_heads, s.head_dim, 33);
  Selection sel;
  ASSERT_TRUE(index->Select({q.data(), n, 24, 4, 250}, &sel).ok());
  ASSERT_EQ(sel.per_head.size(), 2u);
  for (const auto& ids : sel.per_head) {
    if (method != "full") {
      EXPECT_LE(ids.size(), 24u);
    }
    EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end()));
    EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end());
    for (int64_t id : ids) {
      EXPECT_GE(id, 4);
      EXPECT_LT(id, 250);
    }
  }
  EXPECT_FALSE(index->Select({q.data(), n, 0, 4, 250}, &sel).ok());
}

TEST_P(MethodProperties, RoundTripGivesTheSameSelectionsAndCorruptBytesFail) {
  const std::string method = GetParam();
  IndexShape s = SmallShape();
  const int64_t n = 256;
  std::vector<float> keys = RandomTensor(n + 20, s.n_kv_heads, s.head_dim, 41);
  std::vector<float> queries = RandomTensor(n, s.n_heads, s.head_dim, 42);
  MethodRegistry r = CoreRegistry();
  std::vector<float> prefill(keys.begin(), keys.begin() + n * s.n_kv_heads * s.head_dim);
  auto index = MakeBuilt(r, method, s, Params(32), prefill, queries);
  ASSERT_TRUE(index->Append({View(keys, s.n_kv_heads, s.head_dim, n, 20), {}}).ok());
  auto bytes = SerializeIndex(*index);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto copy = DeserializeIndex(*bytes, r, Params(32), &s);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ((*copy)->method(), method);
  EXPECT_EQ((*copy)->size(), n + 20);
  EXPECT_EQ((*copy)->MemoryBytes(), index->MemoryBytes());
  for (uint64_t seed = 50; seed < 53; ++seed) {
    std::vector<float> q = RandomTensor(1, s.n_heads, s.head_dim, seed);
    Selection a, b;
    ASSERT_TRUE(index->Select({q.data(), n + 20, 32, 4, n + 10}, &a).ok());
    ASSERT_TRUE((*copy)->Select({q.data(), n + 20, 32, 4, n + 10}, &b).ok());
    EXPECT_EQ(a.per_head, b.per_head) << method;
  }
  // Every truncation is an error, never a crash.
  for (size_t cut = 0; cut < bytes->size(); cut += std::max<size_t>(1, bytes->size() / 97)) {
    std::span<const uint8_t> part(bytes->data(), cut);
    EXPECT_FALSE(DeserializeIndex(part, r, Params(32)).ok()) << method << " cut at " << cut;
  }
  // Wrong token count in the header (+256): the payload no longer matches. (full/streaming
  // have no payload, so for them the header count is the whole truth.)
  if (method != "full" && method != "streaming") {
    std::vector<uint8_t> bad = *bytes;
    const size_t size_offset = 4 + 2 + 2 + 4 + method.size() + 5 * 4 + 4 + 4 + 4;
    bad[size_offset + 1] ^= 0x01;
    EXPECT_FALSE(DeserializeIndex(bad, r, Params(32)).ok()) << method;
  }
}

// Recall of the exact top-k after appending generated tokens stays close to the recall right
// after Build. The keys form topic clusters in runs of consecutive tokens (like real text:
// semantic and positional locality) so that approximate methods have structure to exploit;
// queries are noisy copies of topic directions.
TEST_P(MethodProperties, AppendAfterBuildKeepsRecall) {
  const std::string method = GetParam();
  if (method == "streaming" || method == "keydiff") {
    GTEST_SKIP() << "query-agnostic or empty selection: recall is not its contract";
  }
  IndexShape s = SmallShape();
  const int n_topics = 12;
  const int64_t n = 600, m = 120;
  std::vector<float> topics = RandomTensor(n_topics, 1, s.head_dim, 61, 1.f);
  std::mt19937 rng(62);
  std::normal_distribution<float> noise(0.f, 0.3f);
  auto make_keys = [&](int64_t count) {
    std::vector<float> k(count * s.n_kv_heads * s.head_dim);
    int topic = 0;
    int64_t run_left = 0;
    for (int64_t t = 0; t < count; ++t) {
      if (run_left-- <= 0) {
        topic = static_cast<int>(rng() % n_topics);
        run_left = 8 + static_cast<int64_t>(rng() % 32);
      }
      for (int h = 0; h < s.n_kv_heads; ++h) {
        for (int d = 0; d < s.head_dim; ++d) {
          k[(t * s.n_kv_heads + h) * s.head_dim + d] = topics[topic * s.head_dim + d] + noise(rng);
        }
      }
    }
    return k;
  };
  auto make_query = [&](int topic) {
    std::vector<float> q(s.n_heads * s.head_dim);
    for (int h = 0; h < s.n_heads; ++h) {
      for (int d = 0; d < s.head_dim; ++d) {
        q[h * s.head_dim + d] = 2.f * topics[topic * s.head_dim + d] + noise(rng);
      }
    }
    return q;
  };
  std::vector<float> keys = make_keys(n), gen = make_keys(m);
  // Prefill queries (CTKVR): the last ones visit every topic.
  std::vector<float> queries(n * s.n_heads * s.head_dim);
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> q = make_query(static_cast<int>(t % n_topics));
    std::copy(q.begin(), q.end(), queries.begin() + t * s.n_heads * s.head_dim);
  }
  MethodRegistry r = CoreRegistry();
  IndexParams p = Params(40);
  p.ctkvr.n_centroids = 48;
  auto index = MakeBuilt(r, method, s, p, keys, queries);
  auto oracle = MakeBuilt(r, "exact", s, p, keys, queries);
  auto recall = [&](int64_t size) {
    double hit = 0, total = 0;
    for (int topic = 0; topic < n_topics; ++topic) {
      std::vector<float> q = make_query(topic);
      SelectRequest req{q.data(), size, 40, 4, size};
      Selection a, b;
      EXPECT_TRUE(index->Select(req, &a).ok());
      EXPECT_TRUE(oracle->Select(req, &b).ok());
      for (int h = 0; h < s.n_kv_heads; ++h) {
        std::set<int64_t> truth(b.per_head[h].begin(), b.per_head[h].end());
        for (int64_t id : a.per_head[h]) hit += truth.count(id);
        total += static_cast<double>(truth.size());
      }
    }
    return hit / total;
  };
  const double before = recall(n);
  AppendInput app{View(gen, s.n_kv_heads, s.head_dim), {}};
  ASSERT_TRUE(index->Append(app).ok());
  ASSERT_TRUE(oracle->Append(app).ok());
  const double after = recall(n + m);
  RecordProperty("recall_before", std::to_string(before));
  RecordProperty("recall_after", std::to_string(after));
  std::cout << method << " recall@40 before append " << before << ", after " << after << "\n";
  EXPECT_GE(after, before - 0.15) << method;
  EXPECT_GE(after, 0.3) << method;  // random selection would get ~40/650 = 0.06
}

INSTANTIATE_TEST_SUITE_P(CoreMethods, MethodProperties,
                         ::testing::Values("full", "exact", "quest", "streaming", "clusterkv",
                                           "ctkvr", "keydiff"));

}  // namespace
}  // namespace kvr::retrieval
