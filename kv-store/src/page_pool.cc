#include "kvr/kv_store/page_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "kvr/common/status.h"

// 2 MiB hugetlb pages whatever the system's default huge page size; older libc headers lack it.
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)
#endif

namespace kvr::kv_store {
namespace {
constexpr uint64_t kHugePageBytes = 2ull << 20;
constexpr uint64_t kMaxPages = ~PageId{0};

struct MappedFd {
  int fd = -1;
  uint8_t* base = nullptr;
};

// Creates a memfd of `bytes` with `extra_flags` and maps all of it read-write, MAP_SHARED. With
// `align_huge` the mapping starts on a 2 MiB boundary (file offset 0 there too), which THP
// needs to back the range with huge pages: an address range one huge page larger is reserved,
// the file is mapped over its aligned part and the slack on both sides is given back.
absl::StatusOr<MappedFd> MapMemfd(uint64_t bytes, unsigned extra_flags, bool align_huge) {
  const int fd = memfd_create("kvr-store-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING | extra_flags);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("memfd_create for the page pool failed: %s", strerror(errno)));
  }
  auto fail = [fd](const std::string& what) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s for the page pool failed: %s", what, strerror(err)));
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(absl::StrFormat("ftruncate of a memfd to %d bytes", bytes));
  }
  void* where = nullptr;
  int fixed = 0;
  void* reserved = MAP_FAILED;
  const uint64_t reserved_bytes = bytes + kHugePageBytes;
  if (align_huge) {
    reserved = mmap(nullptr, reserved_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (reserved == MAP_FAILED) {
      return fail(absl::StrFormat("reserving %d bytes of address space", reserved_bytes));
    }
    const auto addr = reinterpret_cast<uintptr_t>(reserved);
    where = reinterpret_cast<void*>((addr + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
    fixed = MAP_FIXED;
  }
  void* mem = mmap(where, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | fixed, fd, 0);
  if (mem == MAP_FAILED) {
    absl::Status st = fail(absl::StrFormat("mmap of %d bytes", bytes));
    if (reserved != MAP_FAILED) munmap(reserved, reserved_bytes);
    return st;
  }
  if (reserved != MAP_FAILED) {
    auto* lo = static_cast<uint8_t*>(reserved);
    auto* hi = lo + reserved_bytes;
    auto* used_lo = static_cast<uint8_t*>(mem);
    auto* used_hi = used_lo + bytes;
    if (used_lo > lo) munmap(lo, static_cast<size_t>(used_lo - lo));
    if (hi > used_hi) munmap(used_hi, static_cast<size_t>(hi - used_hi));
  }
  return MappedFd{.fd = fd, .base = static_cast<uint8_t*>(mem)};
}

// madvise(MADV_HUGEPAGE) succeeds on shmem whatever the policy; only
// /sys/kernel/mm/transparent_hugepage/shmem_enabled says whether huge pages can come. The
// selected policy is the bracketed word, e.g. "always within_size advise [never] deny force".
bool ShmemThpAllowed() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string text;
  if (!std::getline(in, text)) return true;  // unknown: trust madvise
  const size_t open = text.find('[');
  const size_t close_at = text.find(']', open);
  if (open == std::string::npos || close_at == std::string::npos) return true;
  const std::string policy = text.substr(open + 1, close_at - open - 1);
  return policy != "never" && policy != "deny";
}

// Best effort: kernels before 5.1 lack F_SEAL_FUTURE_WRITE, and the seals only harden the pool
// against readers that got its fd; the store works without them.
void Seal(int fd) {
#ifdef F_SEAL_FUTURE_WRITE
  (void)fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE);
#endif
  (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
}

std::string RandomPoolId() {
  std::random_device entropy;  // the kernel's getrandom on Linux
  std::string id(16, '\0');
  for (size_t i = 0; i < id.size(); i += 4) {
    const uint32_t word = entropy();
    std::memcpy(id.data() + i, &word, 4);
  }
  return absl::BytesToHexString(id);
}

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
  // With huge pages in mind the file covers whole 2 MiB pages (hugetlb requires it; shmem THP
  // in "within_size" mode backs only whole huge pages inside the file size).
  const uint64_t file_bytes = options.try_huge_pages
                                  ? (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes
                                  : bytes;
  if (options.try_huge_pages) {
    // A hugetlb memfd reserves its huge pages at mmap (MAP_NORESERVE is not used), so mmap
    // fails at once when too few are free instead of a later touch raising SIGBUS.
    absl::StatusOr<MappedFd> huge =
        MapMemfd(file_bytes, MFD_HUGETLB | MFD_HUGE_2MB, /*align_huge=*/false);
    if (huge.ok()) {
      pool.fd_ = huge->fd;
      pool.base_ = huge->base;
      pool.backing_ = PageBacking::kHugeTlb;
    }
  }
  if (pool.fd_ < 0) {
    KVR_ASSIGN_OR_RETURN(MappedFd plain,
                         MapMemfd(file_bytes, 0, /*align_huge=*/options.try_huge_pages));
    pool.fd_ = plain.fd;
    pool.base_ = plain.base;
    pool.backing_ = PageBacking::kSmallPages;
    if (options.try_huge_pages && madvise(plain.base, file_bytes, MADV_HUGEPAGE) == 0 &&
        ShmemThpAllowed()) {
      pool.backing_ = PageBacking::kTransparentHugePages;
    }
  }
  pool.mapped_bytes_ = file_bytes;
  Seal(pool.fd_);
  pool.pool_id_ = RandomPoolId();
  pool.state_ = std::make_unique<State>();
  std::vector<PageId>& free = pool.state_->free;
  free.resize(pages);
  // Handed out from the back: low page ids first, so a fresh pool fills from its start.
  for (uint64_t i = 0; i < pages; ++i) free[i] = static_cast<PageId>(pages - 1 - i);
  pool.state_->refs.assign(pages, 0);
  return pool;
}

PagePool::~PagePool() { Unmap(); }

void PagePool::Unmap() {
  if (base_ != nullptr) munmap(base_, mapped_bytes_);
  if (fd_ >= 0) close(fd_);
  base_ = nullptr;
  fd_ = -1;
}

PagePool::PagePool(PagePool&& other) noexcept { *this = std::move(other); }

PagePool& PagePool::operator=(PagePool&& other) noexcept {
  if (this == &other) return *this;
  Unmap();
  base_ = std::exchange(other.base_, nullptr);
  mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
  fd_ = std::exchange(other.fd_, -1);
  pool_id_ = std::move(other.pool_id_);
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
  for (auto it = free.end() - static_cast<ptrdiff_t>(n); it != free.end(); ++it) {
    state_->refs[*it] = 1;
  }
  out.insert(out.end(), free.end() - static_cast<ptrdiff_t>(n), free.end());
  free.resize(free.size() - n);
  return absl::OkStatus();
}

void PagePool::Share(std::span<const PageId> pages) {
  if (pages.empty()) return;
  absl::MutexLock lock(&state_->mu);
  for (PageId page : pages) {
    uint32_t& refs = state_->refs[page];
    if (refs == 0) {
      // Sharing a free page would hand it to two owners behind the free list's back.
      assert(false && "PagePool::Share of a free page");
      ++state_->refcount_errors;
      continue;
    }
    if (refs == 1) ++state_->shared;
    ++refs;
  }
}

void PagePool::Free(std::span<const PageId> pages) {
  if (pages.empty()) return;
  absl::MutexLock lock(&state_->mu);
  for (PageId page : pages) {
    uint32_t& refs = state_->refs[page];
    if (refs == 0) {
      // Putting it on the free list a second time would let two owners allocate it.
      assert(false && "PagePool::Free of a free page");
      ++state_->refcount_errors;
      continue;
    }
    if (refs == 2) --state_->shared;
    if (--refs == 0) state_->free.push_back(page);
  }
}

uint64_t PagePool::free_pages() const {
  absl::MutexLock lock(&state_->mu);
  return state_->free.size();
}

uint64_t PagePool::shared_pages() const {
  absl::MutexLock lock(&state_->mu);
  return state_->shared;
}

uint32_t PagePool::references(PageId page) const {
  absl::MutexLock lock(&state_->mu);
  return page < state_->refs.size() ? state_->refs[page] : 0;
}

uint64_t PagePool::refcount_errors() const {
  absl::MutexLock lock(&state_->mu);
  return state_->refcount_errors;
}

}  // namespace kvr::kv_store
