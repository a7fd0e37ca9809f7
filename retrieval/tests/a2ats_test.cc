#include "kvr/retrieval/a2ats.h"

#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/rope.h"
#include "pariskv_test_util.h"

namespace kvr::retrieval {
namespace {

using testing::ExactTopK;
using testing::MakeClusteredKeys;
using testing::MakeQuery;
using testing::MeanRecall;
using testing::Recall;

constexpr int kLayers = 2;

ModelFingerprint Model(int n_heads, int n_kv_heads, int head_dim, RopeParams rope) {
  ModelFingerprint m;
  m.model_name = "a2ats-test";
  m.n_layers = kLayers;
  m.n_heads = n_heads;
  m.n_kv_heads = n_kv_heads;
  m.head_dim = head_dim;
  m.rope = rope;
  return m;
}

IndexShape ShapeOf(const ModelFingerprint& m, int layer) {
  IndexShape s;
  s.n_heads = m.n_heads;
  s.n_kv_heads = m.n_kv_heads;
  s.head_dim = m.head_dim;
  s.layer = layer;
  s.n_layers = m.n_layers;
  s.rope = m.rope;
  return s;
}

// Rotates every head vector of token t by position first + t (what the runtime stores).
std::vector<float> Rotate(std::vector<float> v, int n_tokens, int n_heads, int d,
                          const RopeParams& rope, int64_t first) {
  for (int t = 0; t < n_tokens; ++t) {
    for (int h = 0; h < n_heads; ++h) {
      ApplyRope(std::span<float>(v.data() + (static_cast<size_t>(t) * n_heads + h) * d, d),
                static_cast<double>(first + t), rope);
    }
  }
  return v;
}

// Codebooks calibrated on data from the same distribution as the test data (another seed):
// keys from MakeClusteredKeys with the same centres, queries from MakeQuery.
std::shared_ptr<const A2atsCodebooks> Calibrate(const testing::ClusteredData& like,
                                                const ModelFingerprint& m, int codebook_size,
                                                uint32_t seed) {
  CodebookParams params;
  params.codebook_size = codebook_size;
  auto samples = CalibrationSamples::Create(m, params);
  EXPECT_TRUE(samples.ok()) << samples.status();
  constexpr int kCalibTokens = 3000;
  // Same centres: reuse `like` but draw fresh keys around them.
  testing::ClusteredData calib = like;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> pick(0, like.n_clusters - 1);
  calib.keys.assign(static_cast<size_t>(kCalibTokens) * m.n_kv_heads * m.head_dim, 0.f);
  for (int t = 0; t < kCalibTokens; ++t) {
    for (int h = 0; h < m.n_kv_heads; ++h) {
      const float* c =
          like.centres.data() + (static_cast<size_t>(h) * like.n_clusters + pick(rng)) * m.head_dim;
      for (int i = 0; i < m.head_dim; ++i) {
        calib.keys[(static_cast<size_t>(t) * m.n_kv_heads + h) * m.head_dim + i] =
            c[i] + 0.6f * normal(rng);
      }
    }
  }
  std::vector<float> queries;
  for (int t = 0; t < kCalibTokens; ++t) {
    auto q = MakeQuery(like, 0.5f, 1.f, seed * 7919 + t);
    queries.insert(queries.end(), q.begin(), q.end());
  }
  auto post_k = Rotate(calib.keys, kCalibTokens, m.n_kv_heads, m.head_dim, m.rope, 0);
  // Queries sit at positions far from the keys they attend, like decode queries.
  auto post_q = Rotate(queries, kCalibTokens, m.n_heads, m.head_dim, m.rope, 0);
  for (int layer = 0; layer < m.n_layers; ++layer) {
    EXPECT_TRUE(
        samples
            ->AddKeys(layer, TokenTensor{post_k.data(), kCalibTokens, m.n_kv_heads * m.head_dim}, 0)
            .ok());
    EXPECT_TRUE(
        samples
            ->AddQueries(layer, TokenTensor{post_q.data(), kCalibTokens, m.n_heads * m.head_dim}, 0)
            .ok());
  }
  auto books = BuildCodebooks(*samples, nullptr);
  EXPECT_TRUE(books.ok()) << books.status();
  return books.ok() ? *books : nullptr;
}

IndexParams WithBooks(std::shared_ptr<const A2atsCodebooks> books) {
  IndexParams p;
  p.assets = std::move(books);
  return p;
}

TEST(A2atsIndexTest, NeedsMatchingCodebooks) {
  const RopeParams none;
  ModelFingerprint m = Model(4, 2, 16, none);
  auto status = MakeA2atsIndex(ShapeOf(m, 0), IndexParams{}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("kvr calibrate"), std::string::npos) << status;

  auto data = MakeClusteredKeys(100, 2, 4, 16, 4, 0.5f, 1);
  auto books = Calibrate(data, m, 8, 1);
  ASSERT_NE(books, nullptr);
  IndexShape other = ShapeOf(m, 0);
  other.n_layers = 30;
  status = MakeA2atsIndex(other, WithBooks(books)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("another model"), std::string::npos) << status;
  other = ShapeOf(m, 0);
  other.head_dim = 32;
  other.rope = none;
  EXPECT_FALSE(MakeA2atsIndex(other, WithBooks(books)).ok());
  IndexParams opts = WithBooks(books);
  opts.options["a2ats.bogus"] = "1";
  EXPECT_FALSE(MakeA2atsIndex(ShapeOf(m, 0), opts).ok());
  EXPECT_TRUE(MakeA2atsIndex(ShapeOf(m, 1), WithBooks(books)).ok());
}

// With RoPE: the planted tokens' pre-RoPE keys equal the query direction, placed in the
// low-frequency channels (where real models keep their semantic energy and where WRoPE's fixed
// offset b barely rotates). Their post-RoPE keys differ by position, yet all land in the
// query's codeword and are returned.
TEST(A2atsIndexTest, FindsPlantedKeysThroughRope) {
  constexpr int kN = 1500, kD = 32;
  RopeParams rope;
  rope.style = RopeStyle::kHalfSplit;
  rope.theta = 10000.f;
  ModelFingerprint m = Model(2, 1, kD, rope);
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  std::vector<float> dir(kD, 0.f);
  for (int i : {12, 13, 14, 15, 28, 29, 30, 31}) dir[i] = 1.f + 0.2f * normal(rng);  // slow pairs
  std::vector<float> pre(static_cast<size_t>(kN) * kD);
  for (float& x : pre) x = 0.3f * normal(rng);
  const std::vector<int64_t> planted = {50, 400, 401, 900, 1100, 1300};
  for (int64_t t : planted) {
    for (int i = 0; i < kD; ++i) pre[t * kD + i] = 4.f * dir[i] + 0.05f * normal(rng);
  }
  testing::ClusteredData like;
  like.n_tokens = kN;
  like.n_kv_heads = 1;
  like.n_heads = 2;
  like.head_dim = kD;
  like.n_clusters = 1;
  like.centres = dir;
  // Calibrate on these very keys (plus queries along dir): a codebook for this "model".
  CodebookParams params;
  params.codebook_size = 32;
  auto samples = CalibrationSamples::Create(m, params);
  ASSERT_TRUE(samples.ok());
  auto post = Rotate(pre, kN, 1, kD, rope, 0);
  std::vector<float> q_pre(2 * kD);
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < kD; ++i) q_pre[g * kD + i] = dir[i] + 0.05f * normal(rng);
  std::vector<float> calib_q;
  for (int t = 0; t < 200; ++t) calib_q.insert(calib_q.end(), q_pre.begin(), q_pre.end());
  auto calib_q_post = Rotate(calib_q, 200, 2, kD, rope, 2000);
  for (int layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(samples->AddKeys(layer, TokenTensor{post.data(), kN, kD}, 0).ok());
    ASSERT_TRUE(
        samples->AddQueries(layer, TokenTensor{calib_q_post.data(), 200, 2 * kD}, 2000).ok());
  }
  auto books = BuildCodebooks(*samples, nullptr);
  ASSERT_TRUE(books.ok()) << books.status();
  auto index = MakeA2atsIndex(ShapeOf(m, 1), WithBooks(*books));
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_TRUE((*index)->Build(BuildInput{TokenTensor{post.data(), kN, kD}}).ok());
  const int64_t query_position = kN + 300;
  auto q_post = Rotate(q_pre, 1, 2, kD, rope, query_position);
  Selection sel;
  ASSERT_TRUE(
      (*index)->Select(SelectRequest{q_post.data(), query_position, 6, 4, kN - 64}, &sel).ok());
  EXPECT_EQ(sel.per_head[0], planted);
  // The exact oracle (true RoPE scores) agrees on this set.
  EXPECT_EQ(ExactTopK(post.data(), kD, q_post.data(), 2, 1, kD, 0, 4, kN - 64, 6), planted);
}

// 400 clustered keys (2 KV heads, 4 query heads, head_dim 16, no RoPE) and an a2ats index built
// over them with codebooks of 16 codewords calibrated on the same keys.
struct Built400 {
  ModelFingerprint m;
  testing::ClusteredData data;
  std::shared_ptr<const A2atsCodebooks> books;
  std::unique_ptr<RetrievalIndex> index;  // null when making or building it failed
};
Built400 BuildOn400Keys() {
  Built400 b{Model(4, 2, 16, RopeParams{}), MakeClusteredKeys(400, 2, 4, 16, 8, 0.5f, 3), {}, {}};
  b.books = Calibrate(b.data, b.m, 16, 3);
  auto index = MakeA2atsIndex(ShapeOf(b.m, 0), WithBooks(b.books));
  EXPECT_TRUE(index.ok()) << index.status();
  if (!index.ok()) return b;
  const absl::Status built =
      (*index)->Build(BuildInput{TokenTensor{b.data.keys.data(), 400, 32}});
  EXPECT_TRUE(built.ok()) << built;
  if (built.ok()) b.index = *std::move(index);
  return b;
}

// A2atsStateOf: the codebooks' hash and size and a codeword id per token and KV head, the ids
// the index selects by; another method's index is refused by name.
TEST(A2atsIndexTest, StateHandsOutTheCodewordIds) {
  Built400 b = BuildOn400Keys();
  ASSERT_NE(b.index, nullptr);
  const ModelFingerprint& m = b.m;
  const std::shared_ptr<const A2atsCodebooks>& books = b.books;
  const std::unique_ptr<RetrievalIndex>* index = &b.index;
  auto st = A2atsStateOf(**index);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->codebook_hash, books->content_hash());
  EXPECT_EQ(st->codebook_size, books->head(0, 0).size);
  ASSERT_EQ(st->ids.size(), 2u);
  for (const auto& ids : st->ids) {
    ASSERT_EQ(ids.size(), 400u);
    for (uint16_t id : ids) EXPECT_LT(id, st->codebook_size);
  }
  MethodRegistry core;
  ASSERT_TRUE(RegisterCoreMethods(core).ok());
  auto other = core.Make("exact", ShapeOf(m, 0), IndexParams{});
  ASSERT_TRUE(other.ok());
  EXPECT_NE(std::string(A2atsStateOf(**other).status().message()).find("'exact'"),
            std::string::npos);
}

// Codeword ids assigned elsewhere (the prefill GPU's A2atsQuantise) ship as the bytes of the
// CPU index that assigned the same ids; wrong counts, ids outside the codebook and the rerank
// option (whose payload carries keys) are refused, naming what is wrong.
TEST(A2atsIndexTest, PrebuiltIdsGiveTheCpuIndexBytes) {
  Built400 b = BuildOn400Keys();
  ASSERT_NE(b.index, nullptr);
  auto want = SerializeIndex(*b.index);
  ASSERT_TRUE(want.ok()) << want.status();
  auto st = A2atsStateOf(*b.index);
  ASSERT_TRUE(st.ok()) << st.status();
  auto got = SerializePrebuiltA2ats(ShapeOf(b.m, 0), WithBooks(b.books), 400, st->ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, *want);

  std::vector<uint16_t> short_ids(st->ids[1].begin(), st->ids[1].end() - 1);
  std::vector<std::span<const uint16_t>> ids = {st->ids[0], short_ids};
  auto bad = SerializePrebuiltA2ats(ShapeOf(b.m, 0), WithBooks(b.books), 400, ids);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("KV head 1 has 399 ids"), std::string::npos)
      << bad.status();
  std::vector<uint16_t> outside(st->ids[1].begin(), st->ids[1].end());
  outside[7] = static_cast<uint16_t>(st->codebook_size);
  ids = {st->ids[0], outside};
  bad = SerializePrebuiltA2ats(ShapeOf(b.m, 0), WithBooks(b.books), 400, ids);
  EXPECT_NE(std::string(bad.status().message()).find("outside the"), std::string::npos)
      << bad.status();
  IndexParams rerank = WithBooks(b.books);
  rerank.options["a2ats.rerank"] = "2";
  bad = SerializePrebuiltA2ats(ShapeOf(b.m, 0), rerank, 400, st->ids);
  EXPECT_NE(std::string(bad.status().message()).find("a2ats.rerank"), std::string::npos)
      << bad.status();
}

TEST(A2atsIndexTest, BudgetCoveringCandidatesSelectsAllAndBudgetIsExact) {
  Built400 b = BuildOn400Keys();
  ASSERT_NE(b.index, nullptr);
  const testing::ClusteredData& data = b.data;
  const std::unique_ptr<RetrievalIndex>* index = &b.index;
  auto q = MakeQuery(data, 0.3f, 1.f, 4);
  Selection sel;
  for (int64_t budget : {334, 5000}) {
    ASSERT_TRUE((*index)->Select(SelectRequest{q.data(), 400, budget, 16, 350}, &sel).ok());
    std::vector<int64_t> expected(334);
    std::iota(expected.begin(), expected.end(), 16);
    for (const auto& ids : sel.per_head) EXPECT_EQ(ids, expected);
  }
  for (int64_t budget : {1, 7, 50, 333}) {
    ASSERT_TRUE((*index)->Select(SelectRequest{q.data(), 400, budget, 16, 350}, &sel).ok());
    for (const auto& ids : sel.per_head) {
      ASSERT_EQ(static_cast<int64_t>(ids.size()), budget);
      EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end()));
      EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end());
      EXPECT_GE(ids.front(), 16);
      EXPECT_LT(ids.back(), 350);
    }
  }
  EXPECT_EQ((*index)->Select(SelectRequest{q.data(), 400, 0, 16, 350}, &sel).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*index)->MemoryBytes(), 400 * 2 * 2) << "2 bytes per token per KV head";
}

// Recall vs the exact oracle on clustered data (no RoPE, so this measures the query-aware VQ
// alone): 4096 tokens, head_dim 64, GQA 3:1, 256 codewords, budget 128. Random selection
// would get 3%. Tokens of one cluster share almost the same score, so the codeword order finds
// the right clusters but not the order inside the boundary cluster; we require 50% (measured
// value printed), which any broken stage (wrong whitening, wrong sign, wrong ids) falls far below.
TEST(A2atsIndexTest, RecallOnClusteredDataAboveFloor) {
  constexpr int kN = 4096, kKv = 2, kHeads = 6, kD = 64;
  const RopeParams none;
  ModelFingerprint m = Model(kHeads, kKv, kD, none);
  auto data = MakeClusteredKeys(kN, kKv, kHeads, kD, 64, 0.6f, 7);
  auto books = Calibrate(data, m, 256, 11);
  ASSERT_NE(books, nullptr);
  auto index = MakeA2atsIndex(ShapeOf(m, 0), WithBooks(books));
  ASSERT_TRUE(index.ok());
  ASSERT_TRUE((*index)->Build(BuildInput{TokenTensor{data.keys.data(), kN, kKv * kD}}).ok());
  const absl::StatusOr<double> recall = MeanRecall(**index, data, 10, 128);
  ASSERT_TRUE(recall.ok()) << recall.status();
  std::printf("a2ats recall@128 on clustered data: %.3f\n", *recall);
  EXPECT_GT(*recall, 0.50);
}

TEST(A2atsIndexTest, ExactRerankRaisesRecallAndSurvivesTheByteFormat) {
  constexpr int kN = 2048, kKv = 2, kHeads = 6, kD = 64;
  const RopeParams none;
  ModelFingerprint m = Model(kHeads, kKv, kD, none);
  auto data = MakeClusteredKeys(kN, kKv, kHeads, kD, 32, 0.6f, 7);
  auto books = Calibrate(data, m, 128, 11);
  ASSERT_NE(books, nullptr);
  IndexParams with_rerank = WithBooks(books);
  with_rerank.options["a2ats.rerank"] = "4";
  auto plain = MakeA2atsIndex(ShapeOf(m, 0), WithBooks(books));
  auto reranked = MakeA2atsIndex(ShapeOf(m, 0), with_rerank);
  ASSERT_TRUE(plain.ok() && reranked.ok());
  const BuildInput in{TokenTensor{data.keys.data(), kN, kKv * kD}};
  ASSERT_TRUE((*plain)->Build(in).ok());
  ASSERT_TRUE((*reranked)->Build(in).ok());
  EXPECT_EQ((*reranked)->MemoryBytes(), (*plain)->MemoryBytes());  // the key copy is not counted
  auto bytes = SerializeIndex(**reranked);
  ASSERT_TRUE(bytes.ok());
  MethodRegistry registry;
  ASSERT_TRUE(RegisterQuantMethods(registry).ok());
  IndexShape shape = ShapeOf(m, 0);
  auto copy = DeserializeIndex(*bytes, registry, WithBooks(books), &shape);
  ASSERT_TRUE(copy.ok()) << copy.status();
  double recall_plain = 0, recall_reranked = 0;
  int count = 0;
  for (uint32_t trial = 0; trial < 5; ++trial) {
    auto q = MakeQuery(data, 0.5f, 1.f, 100 + trial);
    const SelectRequest req{q.data(), kN, 64, 16, kN - 128};
    Selection a, b, c;
    ASSERT_TRUE((*plain)->Select(req, &a).ok());
    ASSERT_TRUE((*reranked)->Select(req, &b).ok());
    ASSERT_TRUE((*copy)->Select(req, &c).ok());
    EXPECT_EQ(b.per_head, c.per_head);
    for (int h = 0; h < kKv; ++h) {
      ASSERT_EQ(b.per_head[h].size(), 64u);
      auto exact =
          ExactTopK(data.keys.data(), kKv * kD, q.data(), kHeads, kKv, kD, h, 16, kN - 128, 64);
      recall_plain += Recall(a.per_head[h], exact);
      recall_reranked += Recall(b.per_head[h], exact);
      ++count;
    }
  }
  std::printf("a2ats recall@64: %.3f, with rerank 4: %.3f\n", recall_plain / count,
              recall_reranked / count);
  EXPECT_GT(recall_reranked, recall_plain);
  for (const char* bad : {"-1", "65", "x"}) {
    IndexParams p = WithBooks(books);
    p.options["a2ats.rerank"] = bad;
    EXPECT_FALSE(MakeA2atsIndex(ShapeOf(m, 0), p).ok()) << bad;
  }
}

TEST(A2atsIndexTest, AppendMatchesBuildingAtOnce) {
  constexpr int kN = 1000, kD = 16;
  RopeParams rope;
  rope.style = RopeStyle::kAdjacentPairs;
  rope.theta = 10000.f;
  ModelFingerprint m = Model(4, 2, kD, rope);
  auto data = MakeClusteredKeys(kN, 2, 4, kD, 8, 0.5f, 5);
  auto books = Calibrate(data, m, 32, 5);
  auto post = Rotate(data.keys, kN, 2, kD, rope, 0);
  auto whole = MakeA2atsIndex(ShapeOf(m, 1), WithBooks(books));
  auto split = MakeA2atsIndex(ShapeOf(m, 1), WithBooks(books));
  ASSERT_TRUE(whole.ok() && split.ok());
  ASSERT_TRUE((*whole)->Build(BuildInput{TokenTensor{post.data(), kN, 2 * kD}}).ok());
  ASSERT_TRUE((*split)->Build(BuildInput{TokenTensor{post.data(), 600, 2 * kD}}).ok());
  ASSERT_TRUE(
      (*split)->Append(AppendInput{TokenTensor{post.data() + 600 * 2 * kD, 400, 2 * kD}}).ok());
  EXPECT_EQ((*split)->size(), kN);
  auto q = Rotate(MakeQuery(data, 0.4f, 1.f, 6), 1, 4, kD, rope, kN);
  Selection a, b;
  ASSERT_TRUE((*whole)->Select(SelectRequest{q.data(), kN, 40, 8, kN - 64}, &a).ok());
  ASSERT_TRUE((*split)->Select(SelectRequest{q.data(), kN, 40, 8, kN - 64}, &b).ok());
  EXPECT_EQ(a.per_head, b.per_head);
}

TEST(A2atsSerializationTest, RoundTripCorruptAndOtherCodebooks) {
  constexpr int kN = 500, kD = 16;
  const RopeParams none;
  ModelFingerprint m = Model(4, 2, kD, none);
  auto data = MakeClusteredKeys(kN, 2, 4, kD, 8, 0.5f, 8);
  auto books = Calibrate(data, m, 16, 8);
  IndexShape shape = ShapeOf(m, 1);
  auto index = MakeA2atsIndex(shape, WithBooks(books));
  ASSERT_TRUE(index.ok());
  ASSERT_TRUE((*index)->Build(BuildInput{TokenTensor{data.keys.data(), kN, 2 * kD}}).ok());
  auto bytes = SerializeIndex(**index);
  ASSERT_TRUE(bytes.ok());
  MethodRegistry registry;
  ASSERT_TRUE(RegisterQuantMethods(registry).ok());
  EXPECT_TRUE(registry.Has("a2ats") && registry.Has("pariskv"));
  auto copy = DeserializeIndex(*bytes, registry, WithBooks(books), &shape);
  ASSERT_TRUE(copy.ok()) << copy.status();
  auto q = MakeQuery(data, 0.4f, 1.f, 9);
  Selection a, b;
  ASSERT_TRUE((*index)->Select(SelectRequest{q.data(), kN, 30, 4, kN - 32}, &a).ok());
  ASSERT_TRUE((*copy)->Select(SelectRequest{q.data(), kN, 30, 4, kN - 32}, &b).ok());
  EXPECT_EQ(a.per_head, b.per_head);
  EXPECT_EQ(*SerializeIndex(**copy), *bytes);
  // The decode node holds other codebooks: refused, not misread.
  auto other_books = Calibrate(data, m, 16, 99);
  auto refused = DeserializeIndex(*bytes, registry, WithBooks(other_books), &shape);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("other codebooks"), std::string::npos)
      << refused.status();
  // No codebooks at all on the receiving side.
  EXPECT_EQ(DeserializeIndex(*bytes, registry, IndexParams{}, &shape).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Truncations and flipped bytes: a status or a working index, never a crash.
  for (size_t cut = 0; cut < bytes->size(); cut += 13) {
    EXPECT_FALSE(
        DeserializeIndex(std::span<const uint8_t>(bytes->data(), cut), registry, WithBooks(books))
            .ok());
  }
  std::mt19937 rng(2);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint8_t> corrupt = *bytes;
    corrupt[rng() % corrupt.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    auto r = DeserializeIndex(corrupt, registry, WithBooks(books));
    if (r.ok()) {
      Selection s;
      EXPECT_TRUE((*r)->Select(SelectRequest{q.data(), kN, 30, 4, kN - 32}, &s).ok());
    }
  }
}

}  // namespace
}  // namespace kvr::retrieval
