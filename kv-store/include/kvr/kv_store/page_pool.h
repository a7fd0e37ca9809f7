#pragma once
// PagePool: the store's memory, one big shared mapping of a memfd cut into fixed-size pages.
//
// One mapping (rather than malloc per page) so that the data plane registers it with UCX once
// (ucp_mem_map) and remote readers can address any page with one rkey. The memory is a memfd
// mapped MAP_SHARED (not anonymous private memory) so that a process on the same host that is
// handed the fd (the store's local socket, local_pool.h) can map the very same pages
// read-only: byte `o` of the file is byte `o` past base(). Huge pages cut TLB misses on
// gathers that touch rows all over the pool: a hugetlb memfd (MFD_HUGETLB, 2 MiB; needs
// reserved pages, vm.nr_hugepages) is tried first, then a plain memfd with
// madvise(MADV_HUGEPAGE) (shmem transparent huge pages: only when
// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them, which the kernel's default
// "never" does not), then plain 4 KiB pages; `backing()` says which one was obtained.
//
// The file is sealed against shrinking and growing (a reader holding the fd must not be able
// to truncate pages from under the store) and, where the kernel has F_SEAL_FUTURE_WRITE, against
// any new writable mapping or write(); the store's own mapping stays writable.
//
// Sharing: every allocated page has a reference count. Allocate hands pages out with count 1,
// Share adds one reference per page (a forked sequence holding its parent's full pages, see
// PagedKvStore::ForkSequence) and Free drops one; a page goes back to the free list only when
// its count reaches zero. The counts are one uint32 per page, kept under the free list's
// mutex, so sharing costs no allocation and no extra lock.
//
// Thread safety: Allocate/Share/Free/counters are safe to call concurrently. Page memory itself
// is not synchronised here; the store's visibility protocol orders writers and readers.

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
  // Adds one reference to each of `pages`, which must be allocated (count >= 1); a page named
  // twice gets two. Every reference is dropped by its own Free.
  void Share(std::span<const PageId> pages);
  // Drops one reference to each of `pages`; a page whose count reaches zero is free again.
  // Sharing a free page or freeing one is a caller bug: it asserts in debug builds, and
  // otherwise the page is left alone and refcount_errors() counts it.
  void Free(std::span<const PageId> pages);

  uint8_t* PageData(PageId page) const { return base_ + size_t{page} * page_bytes_; }
  uint8_t* base() const { return base_; }
  // Bytes of the memfd, all mapped at base(): capacity_bytes() rounded up to 2 MiB where huge
  // pages were tried. What a same-host reader maps.
  uint64_t mapped_bytes() const { return mapped_bytes_; }
  uint64_t capacity_bytes() const { return total_pages_ * page_bytes_; }
  uint64_t page_bytes() const { return page_bytes_; }
  uint64_t total_pages() const { return total_pages_; }
  // Pages on the free list (count zero).
  uint64_t free_pages() const;
  // Allocated pages with more than one reference (held by more than one sequence).
  uint64_t shared_pages() const;
  // References of `page` (0: free). For tests and checks.
  uint32_t references(PageId page) const;
  // Shares and frees of free pages (see Free); stays 0 unless the store has a bug.
  uint64_t refcount_errors() const;
  PageBacking backing() const { return backing_; }
  // The memfd behind the pool (owned; closed with the pool), opened read-write. Hand others a
  // read-only reopening of it (see local_pool.h), never this descriptor.
  int fd() const { return fd_; }
  // Random 128-bit identity of this pool, chosen at creation: 32 lowercase hex digits. Lets a
  // reader that got an fd through a socket path check that it maps the pool the store it
  // talks to over gRPC actually has (not another store's that took over the path).
  const std::string& pool_id() const { return pool_id_; }

 private:
  // Guards the free list and the reference counts; held separately from the page memory.
  struct State {
    absl::Mutex mu;
    std::vector<PageId> free ABSL_GUARDED_BY(mu);
    std::vector<uint32_t> refs ABSL_GUARDED_BY(mu);  // [total_pages] references per page
    uint64_t shared ABSL_GUARDED_BY(mu) = 0;          // pages with refs > 1
    uint64_t refcount_errors ABSL_GUARDED_BY(mu) = 0;
  };
  PagePool() = default;
  void Unmap();

  // First page = file offset 0; 2 MiB aligned where huge pages are wanted.
  uint8_t* base_ = nullptr;
  uint64_t mapped_bytes_ = 0;
  int fd_ = -1;
  std::string pool_id_;
  uint64_t page_bytes_ = 0;
  uint64_t total_pages_ = 0;
  PageBacking backing_ = PageBacking::kSmallPages;
  std::unique_ptr<State> state_;  // heap-held so the pool stays movable
};

}  // namespace kvr::kv_store
