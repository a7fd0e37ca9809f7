#pragma once
// PagedKvStore: the store's core, a plain class with no RPC inside. The
// gRPC control service and the UCX data plane are thin adapters over it.
//
// Layout: per (sequence, layer, kv_head) an append-only array of rows [k | v] (2 * head_dim
// elements of the sequence's dtype), kept in fixed-size pages of the PagePool; a page holds
// tokens_per_page = page_bytes / row_bytes consecutive rows of one (sequence, layer, head), so
// any run of rows inside one page is contiguous in memory.
//
// Visibility (two-phase write): every (sequence, layer) has a committed-row watermark. A write
// first reserves rows [start, start + n) of the layer for all heads (allocating pages), copies
// the data, and only then publishes start + n with a release store. Readers load the watermark
// with acquire and refuse any row at or past it, so they see either all heads of a write or
// none of it: never half a layer. Rows below the watermark are never written again.
//
// Capacity: page allocation is all-or-nothing per call; a shortfall returns RESOURCE_EXHAUSTED
// "need N bytes, M free of T" and nothing already stored changes. With evict_expired set, the
// store first evicts whole sequences whose lease expired (oldest expiry first).
//
// Lifetime: sequences are reference counted; Release removes a sequence from the index at once,
// and its pages go back to the pool when the last in-flight read or write of it finishes.
//
// Access: a sequence is created with a Capability (types.h) and every later operation on it
// must present the same one (SequenceRef; the sequence field of LayerRows, GatherEntry and
// RangeEntry). A wrong or missing capability and an unknown id get the same answer,
// PERMISSION_DENIED "no sequence <id> with this capability", and change nothing. Capabilities
// are compared in constant time.
//
// Thread safety: every public method may be called concurrently from any thread. At most one
// write per (sequence, layer) may be in flight; a second concurrent one fails
// FAILED_PRECONDITION (rows are append-only, so two writers of one layer are a caller bug).
// Lock order: store index mutex -> sequence mutex -> pool mutex; data copies run under a
// sequence's shared lock only.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/kv_store/page_pool.h"
#include "kvr/kv_store/types.h"

namespace kvr::kv_store {

struct StoreOptions {
  PagePoolOptions pool;
  // Evict whole sequences whose lease expired when space runs short (and in SweepExpired).
  bool evict_expired = false;
  // Injected so that lease tests need no sleeps.
  std::function<absl::Time()> now = [] { return absl::Now(); };
};

struct CreateResult {
  uint32_t tokens_per_page = 0;
  uint64_t reserved_bytes = 0;
};

class PagedKvStore {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PagedKvStore>> Create(StoreOptions options);
  ~PagedKvStore();
  PagedKvStore(const PagedKvStore&) = delete;
  PagedKvStore& operator=(const PagedKvStore&) = delete;

  // Registers a sequence guarded by `ref.cap` (INVALID_ARGUMENT when it is none).
  // ALREADY_EXISTS when the id is taken: the creator picks another id (ids are random, so this
  // is rare). Pages for `expected_tokens` rows per (layer, head) are reserved now
  // (RESOURCE_EXHAUSTED if they do not fit). lease == ZeroDuration: no expiry.
  [[nodiscard]] absl::StatusOr<CreateResult> CreateSequence(const SequenceRef& ref,
                                                            const SequenceShape& shape,
                                                            uint64_t expected_tokens,
                                                            absl::Duration lease);

  // Appends rows for all heads of one layer and commits them; returns the layer's committed
  // row count afterwards.
  [[nodiscard]] absl::StatusOr<uint64_t> Write(const LayerRows& rows);

  // Bytes a gather of `entries` returns (validates sequences, layers, heads and indices).
  [[nodiscard]] absl::StatusOr<uint64_t> GatherBytes(std::span<const GatherEntry> entries) const;
  // Copies the rows named by `entries` into `out` in request order, each row [k | v] of its
  // sequence's row size: out = concat over entries of [n_indices, 2 * head_dim]. `out` must be
  // exactly GatherBytes(entries) long. On error nothing useful is in `out`.
  [[nodiscard]] absl::Status Gather(std::span<const GatherEntry> entries,
                                    std::span<uint8_t> out) const;

  [[nodiscard]] absl::StatusOr<uint64_t> RangeBytes(std::span<const RangeEntry> ranges) const;
  // out = concat over ranges of [n_rows, 2 * head_dim].
  [[nodiscard]] absl::Status RangeRead(std::span<const RangeEntry> ranges,
                                       std::span<uint8_t> out) const;

  // Where the rows of one committed range lie in the pool: (offset from pool base, bytes) per
  // contiguous run. For RMA readers, which then read the pool directly; valid only while the
  // sequence is not released (the caller holds it, e.g. under a lease).
  struct Segment {
    uint64_t pool_offset = 0;
    uint64_t bytes = 0;
  };
  [[nodiscard]] absl::StatusOr<std::vector<Segment>> LocateRange(const RangeEntry& range) const;

  // Makes sure pages exist for rows [0, rows) of every (layer, head) of the sequence and
  // returns its page table (local_pool.h). Allocation is all-or-nothing: RESOURCE_EXHAUSTED
  // names the shortfall and nothing is allocated; an expired lease may be evicted first as for
  // writes. Every (layer, head) gets the same number of pages, max(ceil(rows /
  // tokens_per_page), the most any of them already has), so the table is one dense array;
  // rows == 0 only reports. Rows appended later land in exactly these pages (a page list only
  // grows at its end). A released-and-kept sequence can report its table but not grow it
  // (FAILED_PRECONDITION). The table is valid only while the sequence is held.
  [[nodiscard]] absl::StatusOr<PageTable> ReservePageTable(const SequenceRef& ref, uint64_t rows);

  // keep == ZeroDuration frees the sequence now; otherwise it stays readable (not writable)
  // until now + keep, then counts as expired.
  [[nodiscard]] absl::Status Release(const SequenceRef& ref, absl::Duration keep);
  // Sets the lease expiry to now + lease (ZeroDuration clears it).
  [[nodiscard]] absl::Status Lease(const SequenceRef& ref, absl::Duration lease);
  [[nodiscard]] absl::StatusOr<SequenceInfo> GetSequence(const SequenceRef& ref) const;

  // Evicts every expired sequence when evict_expired is set; returns how many.
  size_t SweepExpired();
  StoreStats Stats() const;

  const PagePool& pool() const { return pool_; }

 private:
  class Sequence;
  PagedKvStore(StoreOptions options, PagePool pool);

  // The sequence if `ref` names it with its capability; otherwise PERMISSION_DENIED, the same
  // for an unknown id and a wrong capability.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<Sequence>> Find(const SequenceRef& ref) const;
  // Allocates `n` pages, evicting expired sequences (never `keep`) first when allowed.
  [[nodiscard]] absl::Status AllocatePages(size_t n, std::vector<PageId>& out, SequenceId keep);
  size_t EvictExpired(size_t pages_wanted, SequenceId keep);

  StoreOptions options_;
  PagePool pool_;  // declared before the index: sequences return their pages on destruction
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SequenceId, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> evictions_{0};
  mutable std::atomic<uint64_t> bytes_written_{0};
  mutable std::atomic<uint64_t> bytes_read_{0};
};

}  // namespace kvr::kv_store
