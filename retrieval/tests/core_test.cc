// Registry, params validation, byte format, numeric helpers and the log-sum-exp merge.

#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/partial_attention.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/rope.h"
#include "kvr/retrieval/serialization.h"
#include "test_util.h"

namespace kvr::retrieval {
namespace {

using testing::CoreRegistry;
using testing::ExpectInvalidArgument;
using ::testing::HasSubstr;
using testing::RandomTensor;
using testing::SmallShape;
using testing::View;

TEST(RegistryTest, RegistersEveryCoreMethod) {
  MethodRegistry r = CoreRegistry();
  for (std::string_view name : kCoreMethodNames) EXPECT_TRUE(r.Has(name)) << name;
  EXPECT_EQ(r.Names().size(), std::size(kCoreMethodNames));
}

TEST(RegistryTest, UnknownMethodListsValidOnes) {
  MethodRegistry r = CoreRegistry();
  auto index = r.Make("clusterkvv", SmallShape(), IndexParams{});
  ASSERT_FALSE(index.ok());
  ExpectInvalidArgument(index.status(), "clusterkvv");
  EXPECT_THAT(std::string(index.status().message()), HasSubstr("clusterkv, ctkvr, exact"));
}

TEST(RegistryTest, DuplicateRegistrationFails) {
  MethodRegistry r = CoreRegistry();
  EXPECT_EQ(RegisterCoreMethods(r).code(), absl::StatusCode::kAlreadyExists);
}

TEST(ParamsTest, BadParamsGetClearErrors) {
  MethodRegistry r = CoreRegistry();
  IndexParams p;
  p.budget = 0;
  auto a = r.Make("exact", SmallShape(), p);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("budget must be > 0"));

  IndexShape s = SmallShape();
  s.n_heads = 5;
  auto b = r.Make("exact", s, IndexParams{});
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("not a multiple of n_kv_heads"));

  IndexParams q;
  q.quest.page_size = -1;
  EXPECT_THAT(std::string(r.Make("quest", SmallShape(), q).status().message()),
              HasSubstr("page_size"));
}

TEST(ParamsTest, CtkvrCentroidsLargerThanContextIsAnError) {
  MethodRegistry r = CoreRegistry();
  IndexShape s = SmallShape();
  IndexParams p;
  p.ctkvr.n_centroids = 100;
  auto index = r.Make("ctkvr", s, p);
  ASSERT_TRUE(index.ok());
  std::vector<float> keys = RandomTensor(50, s.n_kv_heads, s.head_dim, 1);
  std::vector<float> queries = RandomTensor(50, s.n_heads, s.head_dim, 2);
  BuildInput in{View(keys, s.n_kv_heads, s.head_dim), View(queries, s.n_heads, s.head_dim), 0};
  absl::Status st = (*index)->Build(in);
  ExpectInvalidArgument(st, "larger than the 50-token context");
}

TEST(ParamsTest, ClusterKvMoreClustersThanTokensIsAnError) {
  MethodRegistry r = CoreRegistry();
  IndexShape s = SmallShape();
  IndexParams p;
  p.n_sink = 4;
  p.clusterkv.n_clusters = 60;
  auto index = r.Make("clusterkv", s, p);
  ASSERT_TRUE(index.ok());
  std::vector<float> keys = RandomTensor(50, s.n_kv_heads, s.head_dim, 1);
  absl::Status st = (*index)->Build({View(keys, s.n_kv_heads, s.head_dim), {}, 0});
  ExpectInvalidArgument(st, "n_clusters (60)");
}

TEST(ParamsTest, ClusterKvOptionsSetIterationsAndClusters) {
  IndexParams p;
  p.options["clusterkv.max_iterations"] = "3";
  p.options["clusterkv.n_clusters"] = "7";
  p.options["pariskv.tiers"] = "2";  // another method's option: ignored
  absl::StatusOr<IndexParams> applied = ApplyClusterKvOptions(p);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->clusterkv.max_iterations, 3);
  EXPECT_EQ(applied->clusterkv.n_clusters, 7);

  // The registry's factory applies them: 7 clusters over 46 clusterable tokens.
  MethodRegistry r = CoreRegistry();
  IndexShape s = SmallShape();
  p.n_sink = 4;
  p.options["clusterkv.n_clusters"] = "60";
  auto index = r.Make("clusterkv", s, p);
  ASSERT_TRUE(index.ok());
  std::vector<float> keys = RandomTensor(50, s.n_kv_heads, s.head_dim, 1);
  absl::Status st = (*index)->Build({View(keys, s.n_kv_heads, s.head_dim), {}, 0});
  EXPECT_THAT(std::string(st.message()), HasSubstr("n_clusters (60)"));

  for (const auto& [name, value, want] :
       {std::tuple<std::string, std::string, std::string>{"clusterkv.max_iterations", "0",
                                                          "must be in [1, 100]"},
        {"clusterkv.max_iterations", "x", "is not an integer"},
        {"clusterkv.n_clusters", "-1", "must be >= 0"},
        {"clusterkv.bogus", "1", "unknown option 'clusterkv.bogus'"}}) {
    IndexParams bad;
    bad.options[name] = value;
    auto made = r.Make("clusterkv", s, bad);
    ASSERT_FALSE(made.ok()) << name << "=" << value;
    ExpectInvalidArgument(made.status(), want);
  }
}

TEST(ParamsTest, ClusterKvOptionsSetClustersPerBudgetAndTrimmedRanking) {
  IndexParams p;
  p.options["clusterkv.clusters_per_budget"] = "16";
  p.options["clusterkv.rank_trimmed"] = "1";
  absl::StatusOr<IndexParams> applied = ApplyClusterKvOptions(p);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->clusterkv.clusters_per_budget, 16);
  EXPECT_TRUE(applied->clusterkv.rank_trimmed);
  // C0 = max(L/80, k L/budget) capped at L/8: 16 * 8000 / 256 = 500 clusters.
  applied->budget = 256;
  EXPECT_EQ(*ClusterKvPrefillClusters(8000, 8016, *applied), 500);
  applied->budget = 64;  // 2000 -> capped at 8000 / 8
  EXPECT_EQ(*ClusterKvPrefillClusters(8000, 8016, *applied), 1000);
  for (const auto& [name, value] : {std::pair<std::string, std::string>{
                                        "clusterkv.clusters_per_budget", "0"},
                                    {"clusterkv.rank_trimmed", "2"}}) {
    IndexParams bad;
    bad.options[name] = value;
    EXPECT_EQ(ApplyClusterKvOptions(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
}

TEST(ParamsTest, QuestAndCtkvrOptionsReachTheIndex) {
  MethodRegistry r = CoreRegistry();
  IndexShape s = SmallShape();
  IndexParams p;
  p.options["quest.page_size"] = "4";
  auto quest = r.Make("quest", s, p);
  ASSERT_TRUE(quest.ok()) << quest.status();
  std::vector<float> keys = RandomTensor(40, s.n_kv_heads, s.head_dim, 3);
  ASSERT_TRUE((*quest)->Build({View(keys, s.n_kv_heads, s.head_dim), {}, 0}).ok());
  // 10 pages of 4 tokens x heads x (min, max) x dim x 4 bytes.
  EXPECT_EQ((*quest)->MemoryBytes(), 10 * s.n_kv_heads * 2 * s.head_dim * 4);

  p.options["ctkvr.n_centroids"] = "60";  // more than the 40 tokens: the index sees the option
  auto ctkvr = r.Make("ctkvr", s, p);
  ASSERT_TRUE(ctkvr.ok()) << ctkvr.status();
  std::vector<float> queries = RandomTensor(40, s.n_heads, s.head_dim, 4);
  absl::Status st = (*ctkvr)->Build(
      {View(keys, s.n_kv_heads, s.head_dim), View(queries, s.n_heads, s.head_dim), 0});
  EXPECT_THAT(std::string(st.message()), HasSubstr("C (60 query centroids)"));

  for (const auto& [method, name, value, want] :
       {std::tuple<std::string, std::string, std::string, std::string>{
            "quest", "quest.page_size", "-1", "must be in [0, 4096]"},
        {"quest", "quest.bogus", "1", "unknown option 'quest.bogus'"},
        {"ctkvr", "ctkvr.fifo_size", "-1", "must be >= 0"},
        {"ctkvr", "ctkvr.bogus", "1", "unknown option 'ctkvr.bogus'"}}) {
    IndexParams bad;
    bad.options[name] = value;
    auto made = r.Make(method, s, bad);
    ASSERT_FALSE(made.ok()) << name << "=" << value;
    EXPECT_THAT(std::string(made.status().message()), HasSubstr(want));
  }
}

TEST(SerializationTest, RejectsBadMagicVersionAndShape) {
  MethodRegistry r = CoreRegistry();
  auto index = r.Make("quest", SmallShape(), IndexParams{});
  ASSERT_TRUE(index.ok());
  std::vector<float> keys = RandomTensor(40, 2, 16, 3);
  ASSERT_TRUE((*index)->Build({View(keys, 2, 16), {}, 0}).ok());
  auto bytes = SerializeIndex(**index);
  ASSERT_TRUE(bytes.ok());

  std::vector<uint8_t> bad = *bytes;
  bad[0] ^= 0xff;
  auto a = DeserializeIndex(bad, r, IndexParams{});
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("bad magic"));

  bad = *bytes;
  bad[4] = 99;  // version
  auto b = DeserializeIndex(bad, r, IndexParams{});
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("format version 99"));

  IndexShape other = SmallShape();
  other.head_dim = 32;
  auto c = DeserializeIndex(*bytes, r, IndexParams{}, &other);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("another model or layer"));

  MethodRegistry empty;
  auto d = DeserializeIndex(*bytes, empty, IndexParams{});
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("'quest'"));

  std::vector<uint8_t> longer = *bytes;
  longer.push_back(0);
  EXPECT_THAT(std::string(DeserializeIndex(longer, r, IndexParams{}).status().message()),
              HasSubstr("trailing bytes"));
}

TEST(ByteReaderTest, ArrayLengthIsBoundedBeforeAllocation) {
  ByteWriter w;
  w.Put<uint64_t>(uint64_t{1} << 60);  // absurd element count
  std::vector<uint8_t> bytes = w.Take();
  ByteReader r(bytes);
  std::vector<float> out;
  absl::Status s = r.GetArray("keys", &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'keys'"));
}

TEST(OpsTest, TopKIsOrderedAndDeterministic) {
  std::vector<float> s = {0.1f, 3.f, -1.f, 3.f, 2.f};
  EXPECT_THAT(TopKIndices(s, 3), ::testing::ElementsAre(1, 3, 4));
  EXPECT_THAT(TopKIndices(s, 10).size(), 5u);
}

TEST(OpsTest, CosineKMeansSeparatesTwoDirections) {
  // 30 points near +e0 and 20 near +e1 (with different magnitudes: cosine ignores them).
  const int dim = 8;
  std::vector<float> pts(50 * dim, 0.f);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (int i = 0; i < 50; ++i) {
    for (int d = 0; d < dim; ++d) pts[i * dim + d] = u(rng);
    pts[i * dim + (i < 30 ? 0 : 1)] += (i % 2 ? 1.f : 10.f);
  }
  KMeansOptions opt;
  opt.n_clusters = 2;
  opt.cosine = true;
  auto km = KMeans(pts.data(), 50, dim, dim, opt);
  ASSERT_TRUE(km.ok());
  for (int i = 1; i < 30; ++i) EXPECT_EQ(km->assignment[i], km->assignment[0]);
  for (int i = 31; i < 50; ++i) EXPECT_EQ(km->assignment[i], km->assignment[30]);
  EXPECT_NE(km->assignment[0], km->assignment[30]);
}

TEST(RopeTest, NegativePositionUndoesRotation) {
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalfSplit}) {
    RopeParams rope{style, 100000.f, 0};
    std::vector<float> v = RandomTensor(1, 1, 64, 7);
    std::vector<float> w = v;
    ApplyRope(w, 12345, rope);
    EXPECT_GT(std::abs(w[0] - v[0]) + std::abs(w[1] - v[1]), 1e-3f);
    ApplyRope(w, -12345, rope);
    for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(w[i], v[i], 1e-4f);
    // Relative property: <R_a q, R_b k> depends on a - b only.
    std::vector<float> q = RandomTensor(1, 1, 64, 8), k = RandomTensor(1, 1, 64, 9);
    std::vector<float> q1 = q, k1 = k, q2 = q, k2 = k;
    ApplyRope(q1, 500, rope);
    ApplyRope(k1, 100, rope);
    ApplyRope(q2, 1400, rope);
    ApplyRope(k2, 1000, rope);
    EXPECT_NEAR(Dot(q1.data(), k1.data(), 64), Dot(q2.data(), k2.data(), 64), 1e-3f);
  }
}

TEST(PartialAttentionTest, LseMergeOfDisjointPartsEqualsOneSoftmax) {
  const int hd = 8, n = 37;
  std::vector<float> q = RandomTensor(1, 1, hd, 1), k = RandomTensor(n, 1, hd, 2),
                     v = RandomTensor(n, 1, hd, 3);
  std::vector<float> scratch(n);
  PartialAttentionInput in{q.data(), k.data(), v.data(), hd, {}, n, hd, 0.5f};
  std::vector<float> full(hd);
  const float lse_full = AttendPartial(in, full.data(), scratch);

  std::vector<int64_t> a, b;
  for (int64_t i = 0; i < n; ++i) (i % 3 == 0 ? a : b).push_back(i);
  std::vector<float> oa(hd), ob(hd);
  in.rows = a;
  float lse = AttendPartial(in, oa.data(), scratch);
  in.rows = b;
  const float lse_b = AttendPartial(in, ob.data(), scratch);
  MergeAttentionPartial(oa.data(), &lse, ob.data(), lse_b, hd);
  EXPECT_NEAR(lse, lse_full, 1e-5f);
  for (int d = 0; d < hd; ++d) EXPECT_NEAR(oa[d], full[d], 1e-5f);

  // An empty partial (lse = -inf) is the identity on either side.
  std::vector<float> zero(hd, 0.f), copy = full;
  float l = lse_full;
  MergeAttentionPartial(copy.data(), &l, zero.data(), -std::numeric_limits<float>::infinity(), hd);
  EXPECT_EQ(copy, full);
  float l2 = -std::numeric_limits<float>::infinity();
  std::vector<float> empty(hd, 0.f);
  MergeAttentionPartial(empty.data(), &l2, full.data(), lse_full, hd);
  EXPECT_EQ(empty, full);
  EXPECT_EQ(l2, lse_full);
}

}  // namespace
}  // namespace kvr::retrieval
