#include "kvr/kv_store/page_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"

namespace kvr::kv_store {
namespace {
constexpr uint64_t kHugePageBytes = 2ull << 20;
constexpr uint64_t kMaxPages = ~PageId{0};
}  // namespace

std::string PageBackingName(PageBacking backing) {
  switch (backing) {
    case PageBacking::kHugeTlb:
      return "hugetlb";
    case PageBacking::kTransparentHugePages:
      return "thp";
    case PageBacking::kSmallPages:
      return "4k";
  }
  return "unknown";
}

absl::StatusOr<PagePool> PagePool::Create(const PagePoolOptions& options) {
  if (options.page_bytes < 64 || options.page_bytes % 64 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "page_bytes must be a positive multiple of 64, got %d", options.page_bytes));
  }
  const uint64_t pages = options.capacity_bytes / options.page_bytes;
  if (pages == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("capacity_bytes %d holds no page of %d bytes", options.capacity_bytes,
                        options.page_bytes));
  }
  if (pages > kMaxPages) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "capacity_bytes %d / page_bytes %d = %d pages exceeds the limit of %d; use bigger pages",
        options.capacity_bytes, options.page_bytes, pages, kMaxPages));
  }
  PagePool pool;
  pool.page_bytes_ = options.page_bytes;
  pool.total_pages_ = pages;
  const uint64_t bytes = pages * options.page_bytes;
  void* mem = MAP_FAILED;
  if (options.try_huge_pages) {
    const uint64_t huge_bytes = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    // Without MAP_NORESERVE the kernel reserves the huge pages now and mmap fails when too
    // few are free; with it, a touch of an unbacked page would SIGBUS later.
    mem = mmap(nullptr, huge_bytes, PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (mem != MAP_FAILED) {
      pool.mapped_bytes_ = huge_bytes;
      pool.backing_ = PageBacking::kHugeTlb;
    }
  }
  if (mem == MAP_FAILED) {
    // Over-allocate by one huge page so that the base can be aligned to 2 MiB, which THP needs
    // to back the whole range with huge pages.
    const uint64_t map_bytes = bytes + (options.try_huge_pages ? kHugePageBytes : 0);
    mem = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("mmap of %d bytes for the page pool failed", map_bytes));
    }
    pool.mapped_bytes_ = map_bytes;
    pool.backing_ = PageBacking::kSmallPages;
    if (options.try_huge_pages) {
      auto addr = reinterpret_cast<uintptr_t>(mem);
      const uintptr_t aligned = (addr + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
      if (madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE) == 0) {
        pool.backing_ = PageBacking::kTransparentHugePages;
      }
      // The whole mapping is kept and unmapped as one; only the aligned part is used.
      pool.base_ = reinterpret_cast<uint8_t*>(aligned);
      pool.unmap_base_ = static_cast<uint8_t*>(mem);
    }
  }
  if (pool.base_ == nullptr) pool.base_ = static_cast<uint8_t*>(mem);
  if (pool.unmap_base_ == nullptr) pool.unmap_base_ = static_cast<uint8_t*>(mem);
  pool.state_ = std::make_unique<State>();
  std::vector<PageId>& free = pool.state_->free;
  free.resize(pages);
  // Handed out from the back: low page ids first, so a fresh pool fills from its start.
  for (uint64_t i = 0; i < pages; ++i) free[i] = static_cast<PageId>(pages - 1 - i);
  return pool;
}

PagePool::~PagePool() { Unmap(); }

void PagePool::Unmap() {
  if (unmap_base_ != nullptr) munmap(unmap_base_, mapped_bytes_);
  unmap_base_ = nullptr;
  base_ = nullptr;
}

PagePool::PagePool(PagePool&& other) noexcept { *this = std::move(other); }

PagePool& PagePool::operator=(PagePool&& other) noexcept {
  if (this == &other) return *this;
  Unmap();
  base_ = std::exchange(other.base_, nullptr);
  unmap_base_ = std::exchange(other.unmap_base_, nullptr);
  mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
  page_bytes_ = std::exchange(other.page_bytes_, 0);
  total_pages_ = std::exchange(other.total_pages_, 0);
  backing_ = other.backing_;
  state_ = std::move(other.state_);
  return *this;
}

absl::Status PagePool::Allocate(size_t n, std::vector<PageId>& out) {
  absl::MutexLock lock(&state_->mu);
  std::vector<PageId>& free = state_->free;
  if (n > free.size()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "need %d bytes (%d pages), %d free of %d", uint64_t{n} * page_bytes_, n,
        uint64_t{free.size()} * page_bytes_, capacity_bytes()));
  }
  out.insert(out.end(), free.end() - static_cast<ptrdiff_t>(n), free.end());
  free.resize(free.size() - n);
  return absl::OkStatus();
}

void PagePool::Free(std::span<const PageId> pages) {
  if (pages.empty()) return;
  absl::MutexLock lock(&state_->mu);
  state_->free.insert(state_->free.end(), pages.begin(), pages.end());
}

uint64_t PagePool::free_pages() const {
  absl::MutexLock lock(&state_->mu);
  return state_->free.size();
}

}  // namespace kvr::kv_store
