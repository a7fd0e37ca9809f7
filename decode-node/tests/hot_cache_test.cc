#include "kvr/decode/hot_cache.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvr::decode {
namespace {

TEST(HotCacheTest, HitsMissesLruEvictionAtTheByteBoundAndDrop) {
  const std::vector<float> row(8, 1.f);  // 32 bytes
  HotCache cache(3 * 32);
  EXPECT_EQ(cache.Find({1, 0, 0, 5}), nullptr);
  cache.Insert({1, 0, 0, 5}, row.data(), 8);
  cache.Insert({1, 0, 1, 5}, row.data(), 8);
  cache.Insert({2, 0, 0, 5}, row.data(), 8);
  ASSERT_NE(cache.Find({1, 0, 0, 5}), nullptr);  // now most recent
  cache.Insert({2, 1, 0, 6}, row.data(), 8);     // evicts (1, 0, 1, 5), the least recent
  EXPECT_EQ(cache.Find({1, 0, 1, 5}), nullptr);
  EXPECT_NE(cache.Find({1, 0, 0, 5}), nullptr);
  EXPECT_EQ(cache.bytes(), 3 * 32);
  EXPECT_EQ(cache.evictions(), 1);
  cache.DropSequence(2);
  EXPECT_EQ(cache.entries(), 1);
  EXPECT_EQ(cache.bytes(), 32);
  HotCache off(0);
  off.Insert({1, 0, 0, 0}, row.data(), 8);
  EXPECT_EQ(off.Find({1, 0, 0, 0}), nullptr);
}

}  // namespace
}  // namespace kvr::decode
