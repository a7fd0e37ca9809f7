#include "kvr/kv_store/page_pool.h"

#include <sys/mman.h>
#include <unistd.h>

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

TEST(PagePoolTest, SharedPageReturnsOnlyWhenTheLastReferenceIsFreed) {
  auto pool = PagePool::Create({.capacity_bytes = 4 * 1024, .page_bytes = 1024});
  ASSERT_TRUE(pool.ok());
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(2, pages).ok());
  EXPECT_EQ(pool->references(pages[0]), 1u);
  EXPECT_EQ(pool->shared_pages(), 0u);
  // Two more holders of the first page, one more of the second.
  const std::vector<PageId> first = {pages[0]};
  pool->Share(first);
  pool->Share(pages);
  EXPECT_EQ(pool->references(pages[0]), 3u);
  EXPECT_EQ(pool->references(pages[1]), 2u);
  EXPECT_EQ(pool->shared_pages(), 2u);
  EXPECT_EQ(pool->free_pages(), 2u);
  pool->Free(pages);  // each down by one: 2 and 1
  EXPECT_EQ(pool->free_pages(), 2u);
  EXPECT_EQ(pool->shared_pages(), 1u);
  pool->Free(std::vector<PageId>{pages[1]});  // the second page's last reference
  EXPECT_EQ(pool->free_pages(), 3u);
  EXPECT_EQ(pool->references(pages[1]), 0u);
  pool->Free(first);
  EXPECT_EQ(pool->free_pages(), 3u);
  EXPECT_EQ(pool->shared_pages(), 0u);
  pool->Free(first);
  EXPECT_EQ(pool->free_pages(), 4u);
  EXPECT_EQ(pool->refcount_errors(), 0u);
  // A page comes back from Allocate with one reference, whatever it had before.
  std::vector<PageId> again;
  ASSERT_TRUE(pool->Allocate(4, again).ok());
  for (PageId p : again) EXPECT_EQ(pool->references(p), 1u);
  EXPECT_EQ(pool->free_pages(), 0u);
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

TEST(PagePoolTest, PoolIsASealedMemfdWithAnId) {
  auto pool = PagePool::Create({.capacity_bytes = 8 * 4096, .page_bytes = 4096});
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_GE(pool->fd(), 0);
  EXPECT_EQ(pool->pool_id().size(), 32u);
  EXPECT_EQ(pool->pool_id().find_first_not_of("0123456789abcdef"), std::string::npos);
  auto other = PagePool::Create({.capacity_bytes = 8 * 4096, .page_bytes = 4096});
  ASSERT_TRUE(other.ok());
  EXPECT_NE(pool->pool_id(), other->pool_id());
  EXPECT_GE(pool->mapped_bytes(), pool->capacity_bytes());
  // Whoever holds the fd can neither shrink the pool under the store nor map it writable.
  EXPECT_NE(ftruncate(pool->fd(), 4096), 0);
  void* writable =
      mmap(nullptr, pool->mapped_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, pool->fd(), 0);
  EXPECT_EQ(writable, MAP_FAILED) << "F_SEAL_FUTURE_WRITE missing (kernel before 5.1?)";
  if (writable != MAP_FAILED) munmap(writable, pool->mapped_bytes());
  // A read-only view shows what the store writes, at once: byte o of the file is base() + o.
  void* view = mmap(nullptr, pool->mapped_bytes(), PROT_READ, MAP_SHARED, pool->fd(), 0);
  ASSERT_NE(view, MAP_FAILED);
  pool->PageData(5)[17] = 0xAB;
  EXPECT_EQ(static_cast<const uint8_t*>(view)[5 * 4096 + 17], 0xAB);
  munmap(view, pool->mapped_bytes());
  // Moving the pool keeps the fd and the id.
  const int fd = pool->fd();
  const std::string id = pool->pool_id();
  PagePool moved = std::move(*pool);
  EXPECT_EQ(moved.fd(), fd);
  EXPECT_EQ(moved.pool_id(), id);
}

}  // namespace
}  // namespace kvr::kv_store
