// The windowed KvCache mode (model/kv_cache.h) that the decode node keeps per sequence.

#include <vector>

#include "gtest/gtest.h"
#include "kvr/model/kv_cache.h"

namespace kvr::model {
namespace {

// Row t of a 1-layer, 1-head, dim-2 cache holds k = (t, t), v = (-t, -t).
void AppendPositions(KvCache& cache, int64_t first, int64_t n, bool at) {
  std::vector<float> k, v;
  for (int64_t t = first; t < first + n; ++t) {
    k.insert(k.end(), {float(t), float(t)});
    v.insert(v.end(), {-float(t), -float(t)});
  }
  absl::Status s = at ? cache.AppendAt(0, first, n, k.data(), v.data(), 2)
                      : cache.Append(0, n, k.data(), v.data(), 2);
  ASSERT_TRUE(s.ok()) << s;
}

std::vector<int64_t> Positions(const KvView& view) {
  return {view.positions.begin(), view.positions.end()};
}

TEST(KvCacheWindowTest, KeepsSinksAndTheLastWindowAndReportsEvictedRows) {
  KvCache cache = KvCache::Windowed(1, 1, 2, /*n_sink=*/2, /*local_window=*/3);
  ASSERT_TRUE(cache.windowed());
  AppendPositions(cache, 0, 4, false);  // 0 1 | 2 3
  EXPECT_EQ(Positions(cache.View(0)), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(cache.Evicted(0).n_rows, 0);
  for (int64_t t = 4; t < 60; ++t) {
    AppendPositions(cache, t, 1, false);
    const KvView view = cache.View(0);
    ASSERT_EQ(Positions(view), (std::vector<int64_t>{0, 1, t - 2, t - 1, t}));
    for (int64_t r = 0; r < view.n_rows; ++r) {
      ASSERT_EQ(view.k[r * view.row_stride], float(view.positions[r]));
      ASSERT_EQ(view.v[r * view.row_stride + 1], -float(view.positions[r]));
    }
    EXPECT_EQ(view.total_tokens, t + 1);
    EXPECT_EQ(cache.n_tokens(), t + 1);
    EXPECT_EQ(cache.resident_rows(0), 5);
    const KvView ev = cache.Evicted(0);
    if (t == 4) {  // the window had room for one more row
      EXPECT_EQ(ev.n_rows, 0);
      continue;
    }
    ASSERT_EQ(Positions(ev), (std::vector<int64_t>{t - 3}));
    EXPECT_EQ(ev.k[0], float(t - 3));
    cache.ClearEvicted(0);
  }
  // Bounded memory however long the sequence.
  EXPECT_LT(cache.allocated_bytes(), 1024);
}

TEST(KvCacheWindowTest, AppendAtLeavesAGapLikeAHandoff) {
  KvCache cache = KvCache::Windowed(1, 1, 2, 2, 4);
  AppendPositions(cache, 0, 2, true);
  AppendPositions(cache, 96, 4, true);  // local window of a 100-token prompt
  EXPECT_EQ(cache.n_tokens(), 100);
  EXPECT_EQ(Positions(cache.View(0)), (std::vector<int64_t>{0, 1, 96, 97, 98, 99}));
  EXPECT_EQ(cache.Evicted(0).n_rows, 0);
  AppendPositions(cache, 100, 1, false);
  EXPECT_EQ(Positions(cache.View(0)), (std::vector<int64_t>{0, 1, 97, 98, 99, 100}));
  EXPECT_EQ(Positions(cache.Evicted(0)), (std::vector<int64_t>{96}));
  std::vector<float> row(2);
  EXPECT_FALSE(cache.AppendAt(0, 50, 1, row.data(), row.data(), 2).ok());  // backwards
  KvCache dense(1, 1, 2);
  EXPECT_FALSE(dense.AppendAt(0, 5, 1, row.data(), row.data(), 2).ok());
}

}  // namespace
}  // namespace kvr::model
