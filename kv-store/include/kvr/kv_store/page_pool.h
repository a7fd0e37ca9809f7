#pragma once
// PagePool: the store's memory, one big anonymous mapping cut into fixed-size pages.
//
// One mapping (rather than malloc per page) so that the data plane registers it with UCX once
// (ucp_mem_map) and remote readers can address any page with one rkey. Huge pages cut TLB
// misses on gathers that touch rows all over the pool: MAP_HUGETLB is tried first (needs
// reserved hugetlbfs pages), then transparent huge pages via madvise(MADV_HUGEPAGE), then
// plain 4 KiB pages; `backing()` says which one was obtained.
//
// Thread safety: Allocate/Free/counters are safe to call concurrently. Page memory itself is
// not synchronised here; the store's visibility protocol orders writers and readers.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvr::kv_store {

using PageId = uint32_t;

enum class PageBacking { kHugeTlb, kTransparentHugePages, kSmallPages };
[[nodiscard]] std::string PageBackingName(PageBacking backing);

struct PagePoolOptions {
  uint64_t capacity_bytes = 0;  // rounded down to a whole number of pages
  uint64_t page_bytes = 64 * 1024;
  bool try_huge_pages = true;
};

class PagePool {
 public:
  [[nodiscard]] static absl::StatusOr<PagePool> Create(const PagePoolOptions& options);
  ~PagePool();
  PagePool(PagePool&& other) noexcept;
  PagePool& operator=(PagePool&& other) noexcept;
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // All-or-nothing: appends `n` page ids to `out`, or returns RESOURCE_EXHAUSTED naming the
  // shortfall and takes nothing.
  [[nodiscard]] absl::Status Allocate(size_t n, std::vector<PageId>& out);
  void Free(std::span<const PageId> pages);

  uint8_t* PageData(PageId page) const { return base_ + size_t{page} * page_bytes_; }
  uint8_t* base() const { return base_; }
  uint64_t mapped_bytes() const { return mapped_bytes_; }
  uint64_t capacity_bytes() const { return total_pages_ * page_bytes_; }
  uint64_t page_bytes() const { return page_bytes_; }
  uint64_t total_pages() const { return total_pages_; }
  uint64_t free_pages() const;
  PageBacking backing() const { return backing_; }

 private:
  // Guards the free list; held separately from the page memory itself.
  struct State {
    absl::Mutex mu;
    std::vector<PageId> free ABSL_GUARDED_BY(mu);
  };
  PagePool() = default;
  void Unmap();

  uint8_t* base_ = nullptr;        // first page, 2 MiB aligned where huge pages are wanted
  uint8_t* unmap_base_ = nullptr;  // start of the whole mapping
  uint64_t mapped_bytes_ = 0;
  uint64_t page_bytes_ = 0;
  uint64_t total_pages_ = 0;
  PageBacking backing_ = PageBacking::kSmallPages;
  std::unique_ptr<State> state_;  // heap-held so the pool stays movable
};

}  // namespace kvr::kv_store
