#pragma once
// Reading a sequence's rows in place, from the store's own pages, when the store runs on the
// same host (DESIGN.md 4b: the decode node maps the store's page pool read-only, registers it
// with CUDA and gathers the selected rows through a per-sequence page table).
//
// - PageTable: where the rows of one sequence lie in the pool (KvStoreClient::ReservePageTable).
// - LocalPoolMapping: the pool mapped read-only in this process (KvStoreClient::MapLocalPool).
//
// Lifetime: a page table is valid only while its sequence is held (not released, not evicted
// under an expired lease). Release returns the pages to the pool, which hands them to other
// sequences; a table used after that reads someone else's rows. Rows are immutable once
// committed, so reading rows below `committed_rows` while the sequence is held needs no lock.
//
// Security: the mapping shows every sequence in the pool, not only the caller's. The store
// hands the pool only over a 0600 Unix socket (kv-store/README.md).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/kv_store/page_pool.h"
#include "kvr/kv_store/types.h"

namespace kvr::kv_store {

// Rows of one sequence as pages of the pool: page p of (layer l, kv head h) holds rows
// [p*tokens_per_page, (p+1)*tokens_per_page) at pool byte offset
// pages[(l*n_kv_heads+h)*pages_per_head+p]*page_bytes, row r at
// + (r % tokens_per_page) * shape.RowBytes() (an fp8 sequence's rows as stored: Fp8RowLayout).
// Rows appended later (Write/PutLayer at kAtEnd)
// land in exactly these pages while they fit (r < pages_per_head * tokens_per_page); past
// that the store adds pages that only a new ReservePageTable reports.
struct PageTable {
  SequenceShape shape;
  uint32_t tokens_per_page = 0;
  uint64_t page_bytes = 0;
  // Same for every (layer, head): max(ceil(rows / tokens_per_page), pages any (layer, head)
  // already had).
  uint32_t pages_per_head = 0;
  // [n_layers] rows readable when the table was made; rows below it never change. Later
  // appends raise the store's watermark, not this snapshot (GetSequence has the current one).
  std::vector<uint64_t> committed_rows;
  std::vector<PageId> pages;  // [n_layers, n_kv_heads, pages_per_head]

  // Pool byte offset of row `row` of (layer, head); the caller keeps
  // row < pages_per_head * tokens_per_page, layer < n_layers, head < n_kv_heads.
  [[nodiscard]] uint64_t RowOffset(uint32_t layer, uint32_t head, uint64_t row) const {
    const size_t list = (size_t{layer} * shape.n_kv_heads + head) * pages_per_head;
    return uint64_t{pages[list + row / tokens_per_page]} * page_bytes +
           (row % tokens_per_page) * shape.RowBytes();
  }
};

// Read-only MAP_SHARED view of a same-host store's page pool (the pool's memfd, byte `o` of
// the file at base() + o). Move-only RAII (munmap). The view stays valid after the store
// exits (the kernel keeps the memory until the last mapping goes), but then no longer changes.
//
// For CUDA: register base()/bytes() with cudaHostRegister(..., cudaHostRegisterMapped |
// cudaHostRegisterReadOnly) — the mapping is PROT_READ, and without the read-only flag the
// driver asks for write access and fails. Registering pins every page of the pool.
class LocalPoolMapping {
 public:
  // Maps `bytes` of `fd` read-only from offset 0. Does not take `fd` (the caller closes it;
  // the mapping does not need it). `bytes` must not exceed the file's size.
  [[nodiscard]] static absl::StatusOr<LocalPoolMapping> Map(int fd, uint64_t bytes,
                                                            uint64_t page_bytes,
                                                            std::string pool_id);
  ~LocalPoolMapping();
  LocalPoolMapping(LocalPoolMapping&& other) noexcept;
  LocalPoolMapping& operator=(LocalPoolMapping&& other) noexcept;
  LocalPoolMapping(const LocalPoolMapping&) = delete;
  LocalPoolMapping& operator=(const LocalPoolMapping&) = delete;

  const uint8_t* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t page_bytes() const { return page_bytes_; }
  // PagePool::pool_id() of the store's pool.
  const std::string& pool_id() const { return pool_id_; }
  // Row `row` of (layer, head) of `table`, inside this mapping (same preconditions as
  // PageTable::RowOffset; the table must come from this pool).
  [[nodiscard]] const uint8_t* Row(const PageTable& table, uint32_t layer, uint32_t head,
                                   uint64_t row) const {
    return base_ + table.RowOffset(layer, head, row);
  }
  // Rows [0, n_rows) of `layer` of `table` laid out as a model's KV cache holds them: K into `k`
  // and V into `v`, each [n_rows, n_kv_heads * head_dim] elements of the sequence's dtype (as
  // bytes), heads side by side in a token's row. An fp8 sequence's rows are decoded
  // (DecodeFp8Row) and narrowed to bf16 (round to nearest even): its spans are bf16, what a
  // dense bf16 KV cache takes (SequenceShape::TokenHalfBytes per token, as for a write).
  // InvalidArgument when a span is not exactly that size or the rows lie beyond the table's
  // pages.
  [[nodiscard]] absl::Status CopyLayerRows(const PageTable& table, uint32_t layer, uint64_t n_rows,
                                           std::span<std::byte> k, std::span<std::byte> v) const;

 private:
  LocalPoolMapping() = default;
  void Unmap();

  const uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t page_bytes_ = 0;
  std::string pool_id_;
};

}  // namespace kvr::kv_store
