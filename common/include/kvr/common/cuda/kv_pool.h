#pragma once
// The paged layout of KV rows that the GPU reads in place (DESIGN.md 4b): the KV store keeps, per
// (sequence, layer, kv head), rows [k | v] in fixed-size pages of consecutive rows; a decode GPU
// reads the selected rows straight from those pages (the store's pool mapped and registered with
// CUDA on the same host), from a sequence's own host KV, or from HBM, through one page table.
// Plain structs and one inline address function, usable from host and device code; no CUDA
// runtime calls here.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvr::cuda {

// Where slot b's row pages lie: page index i starts at byte `base + i * page_bytes` and holds
// `page_rows` consecutive rows of one (sequence, layer, kv head).
// - A KV store's page pool registered with CUDA (zero-copy, the decode node's row source on the
//   same host): base = the pool's device address, page_bytes = the store's page size, page_rows =
//   its tokens per page, page indices = the store's page ids.
// - A contiguous array per head (a sequence's own host KV, an HBM pool, tests): page_bytes =
//   row bytes, so a "page index" is the row index of the page's first row.
struct KvPoolSlot {
  const void* base = nullptr;
  int64_t page_bytes = 0;
  int32_t page_rows = 0;  // > 0
  int32_t reserved = 0;
};

// The rows of one layer, paged (as the KV store keeps them, kv-store/.../store.h): row r of
// (sequence slot b, kv head h) is row r % page_rows of page pages[(b * n_kv_heads + h) *
// max_pages + r / page_rows] of slot b. The pages may lie in HBM, in pinned host memory mapped
// into the GPU or in a registered store pool; the kernels read them in place.
struct KvPoolView {
  const KvPoolSlot* slots = nullptr;  // device [batch]
  const int32_t* pages = nullptr;     // device [batch, n_kv_heads, max_pages]
  int max_pages = 0;
  int n_kv_heads = 0;
};

// Address of row r of (b, h) (bh = b * n_kv_heads + h); device code (and host code over host
// copies of the tables).
__host__ __device__ inline const void* KvPoolRow(const KvPoolView& v, int64_t bh, int64_t r,
                                                 size_t row_bytes) {
  const KvPoolSlot& s = v.slots[bh / v.n_kv_heads];
  const int64_t p = r / s.page_rows;
  const int64_t page = v.pages[bh * v.max_pages + p];
  return static_cast<const uint8_t*>(s.base) + page * s.page_bytes +
         (r - p * s.page_rows) * static_cast<int64_t>(row_bytes);
}

[[nodiscard]] inline bool KvPoolViewSet(const KvPoolView& v) {
  return v.slots != nullptr && v.pages != nullptr && v.max_pages > 0 && v.n_kv_heads > 0;
}

}  // namespace kvr::cuda
