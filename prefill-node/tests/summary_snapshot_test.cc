// Summary snapshots (summary_snapshot.h): the key, the framing and its checks, and
// AppendPositions' split at the first position with a kept query. Synthetic keys, no model.

#include "kvr/prefill_node/summary_snapshot.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "kvr/retrieval/all_methods.h"

namespace kvr::prefill_node {
namespace {

using ::testing::HasSubstr;

constexpr int kKvHeads = 2, kHeads = 4, kHeadDim = 8;

retrieval::IndexShape Shape(int layer = 3) {
  return {.n_heads = kHeads,
          .n_kv_heads = kKvHeads,
          .head_dim = kHeadDim,
          .layer = layer,
          .n_layers = 4,
          .rope = {retrieval::RopeStyle::kHalfSplit, 10000.f, 0}};
}

std::vector<float> Random(int64_t n, int seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

// An index of `method` built over the first `rows` of `keys` ([n, kKvHeads * kHeadDim]).
std::unique_ptr<retrieval::RetrievalIndex> Built(const retrieval::MethodRegistry& registry,
                                                 const std::string& method,
                                                 const std::vector<float>& keys, int64_t rows,
                                                 const retrieval::IndexParams& params) {
  auto index = registry.Make(method, Shape(), params);
  EXPECT_TRUE(index.ok()) << index.status();
  retrieval::BuildInput in;
  in.keys = {keys.data(), rows, kKvHeads * kHeadDim};
  EXPECT_TRUE((*index)->Build(in).ok());
  return *std::move(index);
}

TEST(SummarySnapshotTest, KeyNamesModelMethodAndEveryParameter) {
  model::ModelConfig c;
  c.n_layers = 4;
  c.n_heads = kHeads;
  c.n_kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  retrieval::IndexParams p;
  const std::string key = SnapshotKey("m", c, "quest", p);
  EXPECT_EQ(key, SnapshotKey("m", c, "quest", p));  // deterministic
  EXPECT_NE(key, SnapshotKey("other", c, "quest", p));
  EXPECT_NE(key, SnapshotKey("m", c, "clusterkv", p));
  retrieval::IndexParams budget = p;
  budget.budget += 1;
  EXPECT_NE(key, SnapshotKey("m", c, "quest", budget));
  retrieval::IndexParams option = p;
  option.options["n_clusters"] = "9";
  EXPECT_NE(key, SnapshotKey("m", c, "quest", option));
  model::ModelConfig wider = c;
  wider.head_dim *= 2;
  EXPECT_NE(key, SnapshotKey("m", wider, "quest", p));
}

TEST(SummarySnapshotTest, OpenChecksWhatTheSnapshotIsOf) {
  auto registry = retrieval::AllMethods();
  ASSERT_TRUE(registry.ok());
  retrieval::IndexParams params;
  params.budget = 8;
  const std::vector<float> keys = Random(100 * kKvHeads * kHeadDim, 1);
  auto index = Built(*registry, "quest", keys, 64, params);
  auto bytes = retrieval::SerializeIndex(*index);
  ASSERT_TRUE(bytes.ok());
  const std::vector<uint8_t> frame = FrameSnapshot("k", *bytes);

  auto opened = OpenSnapshot(frame, 64, "k", "quest", Shape(), *registry, params);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->size(), 64);
  auto again = retrieval::SerializeIndex(**opened);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *bytes);

  auto other_key = OpenSnapshot(frame, 64, "k2", "quest", Shape(), *registry, params);
  EXPECT_TRUE(absl::IsFailedPrecondition(other_key.status())) << other_key.status();
  EXPECT_THAT(other_key.status().message(), HasSubstr("snapshot key"));
  auto other_method = OpenSnapshot(frame, 64, "k", "clusterkv", Shape(), *registry, params);
  EXPECT_THAT(other_method.status().message(), HasSubstr("snapshot method"));
  auto other_rows = OpenSnapshot(frame, 128, "k", "quest", Shape(), *registry, params);
  EXPECT_THAT(other_rows.status().message(), HasSubstr("snapshot size"));
  auto other_layer = OpenSnapshot(frame, 64, "k", "quest", Shape(2), *registry, params);
  EXPECT_FALSE(other_layer.ok());

  std::vector<uint8_t> bad_magic = frame;
  bad_magic[0] ^= 1;
  EXPECT_THAT(
      OpenSnapshot(bad_magic, 64, "k", "quest", Shape(), *registry, params).status().message(),
      HasSubstr("snapshot magic"));
  std::vector<uint8_t> other_version = frame;
  other_version[4] = 2;
  EXPECT_THAT(
      OpenSnapshot(other_version, 64, "k", "quest", Shape(), *registry, params).status().message(),
      HasSubstr("snapshot version"));
  // Every truncation is an error, never a crash or a wrong index.
  for (size_t n = 0; n < frame.size(); n += 7) {
    EXPECT_FALSE(
        OpenSnapshot(std::span(frame).first(n), 64, "k", "quest", Shape(), *registry, params).ok())
        << n;
  }
  std::vector<uint8_t> longer = frame;
  longer.push_back(0);
  EXPECT_FALSE(OpenSnapshot(longer, 64, "k", "quest", Shape(), *registry, params).ok());
}

// Recording index: which positions each Append got, and whether with queries.
class RecordingIndex final : public retrieval::RetrievalIndex {
 public:
  RecordingIndex() : RetrievalIndex(Shape()) {}
  std::string_view method() const override { return "recording"; }
  int64_t size() const override { return size_; }
  absl::Status Build(const retrieval::BuildInput& in) override {
    size_ = in.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Append(const retrieval::AppendInput& in) override {
    calls.push_back({size_, in.keys.n_tokens, in.queries.n_tokens, in.keys.data, in.queries.data});
    size_ += in.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Select(const retrieval::SelectRequest&, retrieval::Selection*) override {
    return absl::UnimplementedError("recording");
  }
  int64_t MemoryBytes() const override { return 0; }
  absl::Status SerializePayload(retrieval::ByteWriter&) const override { return absl::OkStatus(); }
  struct Call {
    int64_t first, n_keys, n_queries;
    const float* keys;
    const float* queries;
  };
  std::vector<Call> calls;
  int64_t size_ = 0;
};

TEST(SummarySnapshotTest, AppendPositionsPassesTheQueriesOfThePositionsThatHaveOne) {
  const int64_t row = kKvHeads * kHeadDim, q_row = kHeads * kHeadDim;
  const std::vector<float> keys = Random(100 * row, 2);
  const std::vector<float> queries = Random(30 * q_row, 3);  // positions [70, 100)
  const retrieval::TokenTensor k{keys.data(), 100, row};
  const retrieval::TokenTensor q{queries.data(), 30, q_row};

  RecordingIndex index;
  index.size_ = 64;
  ASSERT_TRUE(AppendPositions(index, k, 90, q, 70).ok());
  ASSERT_EQ(index.calls.size(), 2u);
  EXPECT_EQ(index.calls[0].first, 64);
  EXPECT_EQ(index.calls[0].n_keys, 6);  // [64, 70): no query kept
  EXPECT_EQ(index.calls[0].n_queries, 0);
  EXPECT_EQ(index.calls[0].keys, keys.data() + 64 * row);
  EXPECT_EQ(index.calls[1].n_keys, 20);  // [70, 90) with their queries
  EXPECT_EQ(index.calls[1].n_queries, 20);
  EXPECT_EQ(index.calls[1].queries, queries.data());
  ASSERT_TRUE(AppendPositions(index, k, 100, q, 70).ok());
  ASSERT_EQ(index.calls.size(), 3u);
  EXPECT_EQ(index.calls[2].n_queries, 10);
  EXPECT_EQ(index.calls[2].queries, queries.data() + 20 * q_row);
  EXPECT_EQ(index.size(), 100);
  // Nothing to append; no queries at all.
  ASSERT_TRUE(AppendPositions(index, k, 100, q, 70).ok());
  EXPECT_EQ(index.calls.size(), 3u);
  RecordingIndex plain;
  ASSERT_TRUE(AppendPositions(plain, k, 50, {}, 0).ok());
  ASSERT_EQ(plain.calls.size(), 1u);
  EXPECT_EQ(plain.calls[0].n_keys, 50);
  EXPECT_EQ(plain.calls[0].n_queries, 0);
}

}  // namespace
}  // namespace kvr::prefill_node
