#include "kvr/kv_store/local_pool.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"

namespace kvr::kv_store {

absl::StatusOr<LocalPoolMapping> LocalPoolMapping::Map(int fd, uint64_t bytes, uint64_t page_bytes,
                                                       std::string pool_id) {
  if (bytes == 0 || page_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cannot map a pool of %d bytes in pages of %d bytes", bytes, page_bytes));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("fstat of the pool fd failed: %s", strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the pool fd holds %d bytes, %d were announced", st.st_size, bytes));
  }
  void* mem = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (mem == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "mmap of the store's pool (%d bytes, read-only) failed: %s", bytes, strerror(errno)));
  }
  LocalPoolMapping mapping;
  mapping.base_ = static_cast<const uint8_t*>(mem);
  mapping.bytes_ = bytes;
  mapping.page_bytes_ = page_bytes;
  mapping.pool_id_ = std::move(pool_id);
  return mapping;
}

LocalPoolMapping::~LocalPoolMapping() { Unmap(); }

void LocalPoolMapping::Unmap() {
  if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), bytes_);
  base_ = nullptr;
}

LocalPoolMapping::LocalPoolMapping(LocalPoolMapping&& other) noexcept { *this = std::move(other); }

LocalPoolMapping& LocalPoolMapping::operator=(LocalPoolMapping&& other) noexcept {
  if (this == &other) return *this;
  Unmap();
  base_ = std::exchange(other.base_, nullptr);
  bytes_ = std::exchange(other.bytes_, 0);
  page_bytes_ = std::exchange(other.page_bytes_, 0);
  pool_id_ = std::move(other.pool_id_);
  return *this;
}

}  // namespace kvr::kv_store

namespace kvr::kv_store {

absl::Status LocalPoolMapping::CopyLayerRows(const PageTable& table, uint32_t layer,
                                             uint64_t n_rows, std::span<std::byte> k,
                                             std::span<std::byte> v) const {
  const SequenceShape& s = table.shape;
  const size_t token = s.TokenHalfBytes();   // K (or V) of one token, all heads, as written
  const size_t half = token / s.n_kv_heads;  // one head's K (or V) of one token
  if (layer >= s.n_layers || n_rows > uint64_t{table.pages_per_head} * table.tokens_per_page ||
      k.size() != n_rows * token || v.size() != n_rows * token) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CopyLayerRows: layer %d, %d rows of %d bytes per token (K and V spans of %d and %d "
        "bytes; the table holds %d layers, %d rows)",
        layer, n_rows, token, k.size(), v.size(), s.n_layers,
        uint64_t{table.pages_per_head} * table.tokens_per_page));
  }
  if (s.dtype == DType::kFp8E4m3) {
    const Fp8RowLayout layout{2, static_cast<int>(s.head_dim)};
    std::vector<float> kv(2 * size_t{s.head_dim});  // [2, head_dim]
    for (uint64_t t = 0; t < n_rows; ++t) {
      for (uint32_t h = 0; h < s.n_kv_heads; ++h) {
        DecodeFp8Row(layout, Row(table, layer, h, t), kv.data());
        FloatsToBf16Bytes(kv.data(), s.head_dim, k.data() + t * token + h * half);
        FloatsToBf16Bytes(kv.data() + s.head_dim, s.head_dim, v.data() + t * token + h * half);
      }
    }
    return absl::OkStatus();
  }
  for (uint64_t t = 0; t < n_rows; ++t) {
    for (uint32_t h = 0; h < s.n_kv_heads; ++h) {
      const uint8_t* row = Row(table, layer, h, t);  // [K | V] of one head
      std::memcpy(k.data() + t * token + h * half, row, half);
      std::memcpy(v.data() + t * token + h * half, row + half, half);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvr::kv_store
