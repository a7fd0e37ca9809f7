#include "kvr/common/key_diff.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvr {
namespace {

using ::testing::ElementsAre;

// Four keys in 2-D: three along x (one of them long), one along y. The anchor is the mean key,
// (8, 1) / 4, so the x keys score 8 / sqrt(65) whatever their length and the y key
// 1 / sqrt(65): the odd one out is the most distinctive.
TEST(KeyDiffTest, ScoresAreCosineToTheMeanKey) {
  const std::vector<float> keys = {1, 0, 0, 1, 5, 0, 2, 0};
  std::vector<float> scores(4);
  KeyDiffScores(keys.data(), 4, 2, 2, scores.data());
  const float x = static_cast<float>(8 / std::sqrt(65.0));
  const float y = static_cast<float>(1 / std::sqrt(65.0));
  EXPECT_NEAR(scores[0], x, 1e-6);
  EXPECT_NEAR(scores[1], y, 1e-6);
  EXPECT_NEAR(scores[2], x, 1e-6);
  EXPECT_NEAR(scores[3], x, 1e-6);
}

// The stride skips what follows the key in a row ([k | v] rows), and a zero key scores 0 and
// does not move the anchor.
TEST(KeyDiffTest, StrideSkipsValuesAndZeroKeysScoreZero) {
  // Rows of [k0, k1 | v0, v1]; v is large and must be ignored.
  const std::vector<float> rows = {1, 0, 99, 99, 0, 0, -7, 7, 0, 1, 50, -50};
  std::vector<float> scores(3);
  KeyDiffScores(rows.data(), 3, 2, 4, scores.data());
  EXPECT_NEAR(scores[0], std::sqrt(0.5f), 1e-6);  // anchor (1, 1) / 3, cos 45 degrees
  EXPECT_EQ(scores[1], 0.0f);
  EXPECT_NEAR(scores[2], std::sqrt(0.5f), 1e-6);
  // A NaN or infinite key is as unusable as a zero one.
  const std::vector<float> odd = {1, 0, NAN, 1, 0, 1, INFINITY, 0};
  std::vector<float> odd_scores(4);
  KeyDiffScores(odd.data(), 4, 2, 2, odd_scores.data());
  EXPECT_NEAR(odd_scores[0], std::sqrt(0.5f), 1e-6);
  EXPECT_EQ(odd_scores[1], 0.0f);
  EXPECT_NEAR(odd_scores[2], std::sqrt(0.5f), 1e-6);
  EXPECT_EQ(odd_scores[3], 0.0f);
}

// Pages of 4 rows over 22 rows (6 pages, the last partial). Sinks (rows 0..3: page 0) and the
// 6 recent rows (16..21: pages 4 and 5) are never candidates, nor a pinned page; the rest go
// highest mean score first, as many as the kept fraction (rounded up) leaves.
TEST(KeyDiffTest, PagesGoLeastDistinctiveFirstSparingSinksRecentAndPinned) {
  std::vector<float> scores(22, 0.0f);
  auto fill = [&](uint64_t page, float v) {
    for (uint64_t r = page * 4; r < std::min<uint64_t>(22, page * 4 + 4); ++r) scores[r] = v;
  };
  fill(0, 0.99f);  // sink: kept however similar
  fill(1, 0.5f);
  fill(2, 0.9f);
  fill(3, 0.7f);
  fill(4, 0.95f);  // recent
  fill(5, 0.98f);  // recent
  const KeyDiffPagePolicy policy{.sink_rows = 4, .recent_rows = 6};
  EXPECT_THAT(KeyDiffPagesToDrop(scores, 4, 0.0, policy), ElementsAre(2, 3, 1));
  EXPECT_THAT(KeyDiffPagesToDrop(scores, 4, 0.5, policy), ElementsAre(2, 3, 1));  // keep 3 of 6
  EXPECT_THAT(KeyDiffPagesToDrop(scores, 4, 0.6, policy), ElementsAre(2, 3));     // keep 4 (3.6)
  const bool pinned[] = {false, false, true, false, false, false};
  EXPECT_THAT(KeyDiffPagesToDrop(scores, 4, 0.6, policy, pinned), ElementsAre(3, 1));
  // A sink row inside page 1 protects it too.
  EXPECT_THAT(KeyDiffPagesToDrop(scores, 4, 0.0, {.sink_rows = 5, .recent_rows = 6}),
              ElementsAre(2, 3));
  EXPECT_THAT(KeyDiffPagesToDrop(scores, 4, 1.0, policy), ElementsAre());
  EXPECT_THAT(KeyDiffPagesToDrop({}, 4, 0.0, policy), ElementsAre());
}

}  // namespace
}  // namespace kvr
