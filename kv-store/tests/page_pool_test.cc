#include "kvr/kv_store/page_pool.h"

#include <set>

#include "gtest/gtest.h"

namespace kvr::kv_store {
namespace {

TEST(PagePoolTest, AllocatesDistinctAlignedPagesAndReportsBacking) {
  auto pool = PagePool::Create({.capacity_bytes = 8 * 4096, .page_bytes = 4096});
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(pool->total_pages(), 8u);
  EXPECT_EQ(pool->free_pages(), 8u);
  const std::string backing = PageBackingName(pool->backing());
  EXPECT_TRUE(backing == "hugetlb" || backing == "thp" || backing == "4k") << backing;
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(8, pages).ok());
  EXPECT_EQ(std::set<PageId>(pages.begin(), pages.end()).size(), 8u);
  for (PageId p : pages) {
    // Every page is writable memory inside the mapping.
    uint8_t* data = pool->PageData(p);
    data[0] = 1;
    data[4095] = 2;
    EXPECT_GE(data, pool->base());
    EXPECT_LE(data + 4096, pool->base() + pool->capacity_bytes());
  }
  EXPECT_EQ(pool->free_pages(), 0u);
}

TEST(PagePoolTest, ShortfallIsAllOrNothingAndNamesBytes) {
  auto pool = PagePool::Create({.capacity_bytes = 4 * 1024, .page_bytes = 1024});
  ASSERT_TRUE(pool.ok());
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(3, pages).ok());
  absl::Status st = pool->Allocate(2, pages);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_NE(st.message().find("need 2048 bytes"), std::string::npos) << st;
  EXPECT_NE(st.message().find("1024 free of 4096"), std::string::npos) << st;
  EXPECT_EQ(pages.size(), 3u);
  EXPECT_EQ(pool->free_pages(), 1u);
  pool->Free(pages);
  EXPECT_EQ(pool->free_pages(), 4u);
}

TEST(PagePoolTest, RejectsBadSizes) {
  EXPECT_TRUE(absl::IsInvalidArgument(
      PagePool::Create({.capacity_bytes = 100, .page_bytes = 4096}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      PagePool::Create({.capacity_bytes = 1 << 20, .page_bytes = 100}).status()));
}

TEST(PagePoolTest, MoveKeepsMapping) {
  auto pool = PagePool::Create({.capacity_bytes = 2 * 4096, .page_bytes = 4096});
  ASSERT_TRUE(pool.ok());
  uint8_t* base = pool->base();
  PagePool moved = std::move(*pool);
  EXPECT_EQ(moved.base(), base);
  std::vector<PageId> pages;
  EXPECT_TRUE(moved.Allocate(2, pages).ok());
}

}  // namespace
}  // namespace kvr::kv_store
