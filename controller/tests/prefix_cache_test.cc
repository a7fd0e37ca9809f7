#include "kvr/controller/prefix_cache.h"

#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace kvr::controller {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1000);
const absl::Time kLater = kNow + absl::Minutes(5);

std::vector<uint32_t> Tokens(uint32_t n, uint32_t first = 100) {
  std::vector<uint32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

PrefixCache Cache(size_t max_entries = 16) {
  return PrefixCache({.block_tokens = 4, .max_entries = max_entries});
}

TEST(PrefixCacheTest, FindsTheLongestSharedPrefixTokenByToken) {
  PrefixCache cache = Cache();
  cache.Insert("m", "", "store-0", 7, "cap", Tokens(30), kLater, kNow);
  // The prompt shares 22 tokens (5 whole blocks and 2 more), then differs.
  std::vector<uint32_t> prompt = Tokens(22);
  prompt.push_back(1);
  prompt.push_back(2);
  auto hit = cache.Lookup("m", "", prompt, kNow);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->store_id, "store-0");
  EXPECT_EQ(hit->sequence_id, 7u);
  EXPECT_EQ(hit->capability, "cap");
  EXPECT_EQ(hit->tokens, 22u);
  EXPECT_EQ(cache.Stats().hits, 1u);
}

TEST(PrefixCacheTest, LeavesAtLeastOnePromptTokenToCompute) {
  PrefixCache cache = Cache();
  cache.Insert("m", "", "s", 1, "c", Tokens(40), kLater, kNow);
  auto hit = cache.Lookup("m", "", Tokens(12), kNow);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->tokens, 11u);
}

TEST(PrefixCacheTest, NeedsOneWholeSharedBlock) {
  PrefixCache cache = Cache();
  cache.Insert("m", "", "s", 1, "c", Tokens(40), kLater, kNow);
  std::vector<uint32_t> prompt = Tokens(3);
  prompt.insert(prompt.end(), {9, 9, 9, 9, 9});
  EXPECT_FALSE(cache.Lookup("m", "", prompt, kNow).has_value());
  // Shorter than a block: never recorded.
  cache.Insert("m", "", "s", 2, "c", Tokens(3), kLater, kNow);
  EXPECT_EQ(cache.Stats().entries, 1u);
}

TEST(PrefixCacheTest, ScopedByModelAndSalt) {
  PrefixCache cache = Cache();
  cache.Insert("m", "tenant-a", "s", 1, "c", Tokens(40), kLater, kNow);
  EXPECT_FALSE(cache.Lookup("m", "tenant-b", Tokens(41), kNow).has_value());
  EXPECT_FALSE(cache.Lookup("m", "", Tokens(41), kNow).has_value());
  EXPECT_FALSE(cache.Lookup("other", "tenant-a", Tokens(41), kNow).has_value());
  EXPECT_TRUE(cache.Lookup("m", "tenant-a", Tokens(41), kNow).has_value());
}

TEST(PrefixCacheTest, ExpiredAndForgottenEntriesAreNotFound) {
  PrefixCache cache = Cache();
  cache.Insert("m", "", "s", 1, "c", Tokens(40), kLater, kNow);
  EXPECT_FALSE(cache.Lookup("m", "", Tokens(41), kLater).has_value());
  EXPECT_EQ(cache.Stats().entries, 0u);
  cache.Insert("m", "", "s", 2, "c", Tokens(40), kLater, kNow);
  cache.Forget(2);
  EXPECT_FALSE(cache.Lookup("m", "", Tokens(41), kNow).has_value());
  // Already past its expiry: not recorded.
  cache.Insert("m", "", "s", 3, "c", Tokens(40), kNow, kNow);
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(PrefixCacheTest, TheLongerConversationWinsAndACoveredEntryGoes) {
  PrefixCache cache = Cache();
  // Turn 1, then turn 2 whose tokens extend turn 1's: turn 2 covers every block of turn 1.
  cache.Insert("m", "", "s", 1, "c1", Tokens(20), kLater, kNow);
  cache.Insert("m", "", "s", 2, "c2", Tokens(36), kLater, kNow);
  EXPECT_EQ(cache.Stats().entries, 1u);
  auto hit = cache.Lookup("m", "", Tokens(50), kNow);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->sequence_id, 2u);
  EXPECT_EQ(hit->tokens, 36u);
}

TEST(PrefixCacheTest, BranchesKeepTheirOwnTails) {
  PrefixCache cache = Cache();
  // Two conversations over one shared 16-token document that then differ.
  std::vector<uint32_t> a = Tokens(16), b = Tokens(16);
  for (uint32_t i = 0; i < 8; ++i) {
    a.push_back(500 + i);
    b.push_back(900 + i);
  }
  cache.Insert("m", "", "s", 1, "ca", a, kLater, kNow);
  cache.Insert("m", "", "s", 2, "cb", b, kLater, kNow);
  EXPECT_EQ(cache.Stats().entries, 2u);
  std::vector<uint32_t> qa = a, qb = b;
  qa.push_back(1);
  qb.push_back(1);
  EXPECT_EQ(cache.Lookup("m", "", qa, kNow)->sequence_id, 1u);
  EXPECT_EQ(cache.Lookup("m", "", qb, kNow)->sequence_id, 2u);
  // A third conversation over the document alone reuses it from either.
  std::vector<uint32_t> doc = Tokens(16);
  doc.push_back(7);
  auto hit = cache.Lookup("m", "", doc, kNow);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->tokens, 16u);
}

TEST(PrefixCacheTest, HoldsAtMostMaxEntriesDroppingTheLeastRecentlyUsed) {
  PrefixCache cache = Cache(2);
  cache.Insert("m", "", "s", 1, "c", Tokens(8, 1000), kLater, kNow);
  cache.Insert("m", "", "s", 2, "c", Tokens(8, 2000), kLater, kNow);
  // Entry 1 used: entry 2 is now the least recently used and goes.
  ASSERT_TRUE(cache.Lookup("m", "", Tokens(9, 1000), kNow).has_value());
  cache.Insert("m", "", "s", 3, "c", Tokens(8, 3000), kLater, kNow);
  EXPECT_EQ(cache.Stats().entries, 2u);
  EXPECT_TRUE(cache.Lookup("m", "", Tokens(9, 1000), kNow).has_value());
  EXPECT_FALSE(cache.Lookup("m", "", Tokens(9, 2000), kNow).has_value());
  EXPECT_TRUE(cache.Lookup("m", "", Tokens(9, 3000), kNow).has_value());
}

}  // namespace
}  // namespace kvr::controller
