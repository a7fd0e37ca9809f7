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
// "need N bytes, M free of T" and nothing already stored changes. Before refusing, the store
// evicts whole sequences: with evict_expired, those whose lease expired (oldest expiry first);
// then with evict_cached, released-and-kept ("cached for reuse") ones, least recently used
// first. A live (not released) sequence is only ever evicted for an expired lease. Evicting
// a sequence frees only the pages no other sequence shares, so eviction goes on, sequence by
// sequence in that order, until the allocation fits or nothing evictable is left.
//
// Thinning (StoreOptions::cached_eviction = kThin): before any cached sequence goes whole, the
// cached ones are thinned, least recently used first: in every (layer, kv head) the pages whose
// rows the KeyDiff score ranks least distinctive (kvr/common/key_diff.h) are freed, down to a
// floor (thin_keep_fraction of the pages; the sinks' and the recent rows' pages and pages
// shared with another sequence always stay). A sequence is thinned once; its attachments
// stay. Its dropped rows are holes: a read touching one (Gather, RangeRead, LocateRange) fails
// FAILED_PRECONDITION naming the row, ReservePageTable refuses it, a fork may take only rows
// below the first hole (GetSequence's intact_rows), so nothing reads a thinned prefix as whole.
//
// Sharing (ForkSequence): a forked sequence holds references to its parent's full committed
// pages (PagePool reference counts) instead of copies. Such a page lies wholly below both
// sequences' watermarks, and rows below a watermark are never written again, so a shared page
// is immutable: every page that is written belongs to exactly one sequence.
//
// Use: creating, releasing, forking from and reading (Gather, RangeRead, LocateRange,
// ReservePageTable) a sequence marks it used, with a tick of a store-wide logical clock (one
// relaxed atomic add per read request and sequence); least recently used = lowest tick.
//
// Lifetime: sequences are reference counted; Release removes a sequence from the index at once,
// and it drops its page references when the last in-flight read or write of it finishes (a
// page returns to the pool once no sequence holds it).
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
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/common/key_diff.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/kv_store/page_pool.h"
#include "kvr/kv_store/types.h"

namespace kvr::kv_store {

// How released-and-kept sequences give way to new work (StoreOptions::cached_eviction).
enum class CachedEviction {
  kLru,   // whole sequences, least recently used first
  kThin,  // thin them first (least recently used first), then whole sequences LRU
};

struct StoreOptions {
  PagePoolOptions pool;
  // Evict whole sequences whose lease expired when space runs short (and in SweepExpired).
  bool evict_expired = false;
  // Evict released-and-kept sequences (Release with keep > 0), least recently used first, when
  // space runs short, after the expired ones. A cache of finished sequences should give way to
  // new work rather than refuse it; off, a kept sequence holds its pages until its keep
  // expires (and then only goes with evict_expired).
  bool evict_cached = true;
  // With evict_cached: kThin thins cached sequences before evicting any whole (class comment).
  CachedEviction cached_eviction = CachedEviction::kLru;
  // Thinning keeps at least this fraction of every (layer, kv head)'s pages (rounded up).
  double thin_keep_fraction = 0.5;
  // Rows thinning never drops: attention sinks and the most recent rows.
  KeyDiffPagePolicy thin_policy;
  // Injected so that lease tests need no sleeps.
  std::function<absl::Time()> now = [] { return absl::Now(); };
};

struct CreateResult {
  uint32_t tokens_per_page = 0;
  uint64_t reserved_bytes = 0;
};

struct ForkResult {
  uint32_t tokens_per_page = 0;
  uint64_t reserved_bytes = 0;  // bytes of fresh pages taken (copied tail + reservation)
  uint64_t rows = 0;            // rows the child starts with, the same in every layer
  uint64_t shared_pages = 0;    // parent pages now shared with the child
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

  // Creates sequence `child` (its own id and capability, checked as by CreateSequence) with
  // the shape of `parent`, whose rows [0, n) in every (layer, kv head) are the parent's, where
  // n = min(rows, the parent's committed rows in every layer); n may be 0 (then it is
  // CreateSequence with the parent's shape). The parent's pages wholly inside [0, n) are
  // shared, not copied; the rows of a partly covered last page are copied into a fresh page of
  // the child, so that the child appends after row n into pages of its own (as does the
  // parent). The child's watermark is n in every layer; pages for `expected_tokens` rows are
  // reserved and `lease` applies as for CreateSequence.
  //
  // The parent must be named with its capability (PERMISSION_DENIED as everywhere) and may be
  // live (only its committed rows count; a writer of it goes on undisturbed) or released and
  // kept. Counts as a use of the parent. INVALID_ARGUMENT for a none capability, a negative
  // lease or child id == parent id; ALREADY_EXISTS for a taken child id. Allocation is
  // all-or-nothing (RESOURCE_EXHAUSTED names the shortfall; nothing changes but evictions).
  // The shared pages stay allocated while either sequence holds them, whatever becomes of
  // the other (release, eviction).
  [[nodiscard]] absl::StatusOr<ForkResult> ForkSequence(const SequenceRef& child,
                                                        const SequenceRef& parent, uint64_t rows,
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

  // Attachments: at most one opaque blob per (sequence, layer) that describes the layer's rows
  // [0, rows) (types.h, Attachment). They live in pool pages like the rows: counted against
  // capacity (an allocation may evict as a Write's does; RESOURCE_EXHAUSTED when they do not
  // fit), in the sequence's page count (eviction order, GetSequence) and freed with the
  // sequence. ForkSequence gives the child every attachment of the parent whose `rows` lie
  // within the forked rows, sharing its pages (an attachment is never written after its put,
  // so a shared one is immutable); one describing rows the child does not share is left out.
  // The store does not check `rows` against the committed rows (a prefill puts a layer's
  // attachment while the layer's rows are still in flight); a fork compares it with the rows
  // it really shares, which are committed.
  //
  // PutAttachment replaces the layer's attachment (all-or-nothing: on any error the old one
  // stays). Same capability check as every call; OUT_OF_RANGE for a layer past the shape;
  // INVALID_ARGUMENT for more than kMaxAttachmentBytes; FAILED_PRECONDITION for a released
  // sequence (read-only, as for rows).
  [[nodiscard]] absl::Status PutAttachment(const SequenceRef& ref, uint32_t layer, uint64_t rows,
                                           std::span<const uint8_t> bytes);
  // The layer's attachment; NOT_FOUND when it has none. Counts as a use of the sequence.
  [[nodiscard]] absl::StatusOr<Attachment> GetAttachment(const SequenceRef& ref,
                                                         uint32_t layer) const;

  // keep == ZeroDuration frees the sequence now; otherwise it stays readable (not writable)
  // until now + keep, then counts as expired.
  [[nodiscard]] absl::Status Release(const SequenceRef& ref, absl::Duration keep);
  // Sets the lease expiry to now + lease (ZeroDuration clears it).
  [[nodiscard]] absl::Status Lease(const SequenceRef& ref, absl::Duration lease);
  [[nodiscard]] absl::StatusOr<SequenceInfo> GetSequence(const SequenceRef& ref) const;

  // The error of a read of dropped row `row` of a thinned sequence (FAILED_PRECONDITION).
  [[nodiscard]] static absl::Status ThinnedRowError(SequenceId id, uint32_t layer, uint32_t head,
                                                    uint64_t row);

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
  // Checks every entry of a gather (GatherBytes' errors) and returns the reply's bytes; with
  // `seqs`, appends each entry's sequence to it, which keeps their pages alive.
  [[nodiscard]] absl::StatusOr<uint64_t> CheckGather(
      std::span<const GatherEntry> entries, std::vector<std::shared_ptr<Sequence>>* seqs) const;
  // The same for a range read (RangeBytes' errors).
  [[nodiscard]] absl::StatusOr<uint64_t> CheckRanges(
      std::span<const RangeEntry> ranges, std::vector<std::shared_ptr<Sequence>>* seqs) const;
  // The copy of a checked read (Gather, RangeRead): `out` must be `total` bytes
  // (INVALID_ARGUMENT naming the `what` read otherwise). For each entry i, in order, with
  // seqs[i] (from CheckGather / CheckRanges) touched and reader-locked, copy_entry(seqs[i], i,
  // dst) copies the entry's rows to dst and returns the end of what it wrote, or the error
  // that ends the read. Counts `total` bytes as read.
  using EntryCopy =
      absl::FunctionRef<absl::StatusOr<uint8_t*>(const Sequence& seq, size_t i, uint8_t* dst)>;
  [[nodiscard]] absl::Status CopyEntries(std::string_view what,
                                         std::span<const std::shared_ptr<Sequence>> seqs,
                                         uint64_t total, std::span<uint8_t> out,
                                         EntryCopy copy_entry) const;
  // Allocates `n` pages; on a shortfall evicts (EvictFor, never a sequence in `keep`) and
  // tries again while eviction makes progress.
  [[nodiscard]] absl::Status AllocatePages(size_t n, std::vector<PageId>& out,
                                           std::span<const SequenceId> keep);
  bool EvictionOn() const { return options_.evict_expired || options_.evict_cached; }
  // Evicts in eviction order (class comment) until `pages_wanted` pages are free or nothing
  // evictable is left; returns how many sequences went. Takes the index lock: call it with no
  // sequence lock held.
  size_t EvictFor(size_t pages_wanted, std::span<const SequenceId> keep);
  // One round: removes victims from the index, in order, until their page counts (an upper
  // bound of what they free: shared pages stay) would cover `pages_wanted`, then drops them.
  // Only expired sequences when `cached` is false (the sweep). With
  // `hopeless_evicts_nothing`, evicts nothing when even all candidates could not cover it.
  // With thinning on (cached_eviction = kThin), cached candidates not yet thinned are thinned
  // (least recently used first) after the expired ones go and before any cached one goes
  // whole. Returns sequences evicted plus sequences thinned (its progress).
  size_t EvictRound(size_t pages_wanted, std::span<const SequenceId> keep, bool cached,
                    bool hopeless_evicts_nothing);
  // Marks `seq` used now (a tick of use_clock_).
  void Touch(const Sequence& seq) const;
  // Sets a new sequence's lease, records its first use and puts it in the index
  // (ALREADY_EXISTS when another create took the id meanwhile).
  [[nodiscard]] absl::Status Publish(SequenceId id, std::shared_ptr<Sequence> seq,
                                     absl::Duration lease);

  StoreOptions options_;
  PagePool pool_;  // declared before the index: sequences return their pages on destruction
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SequenceId, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<uint64_t> use_clock_{0};
  std::atomic<uint64_t> evictions_expired_{0};
  std::atomic<uint64_t> evictions_cached_lru_{0};
  std::atomic<uint64_t> thinned_sequences_{0};
  std::atomic<uint64_t> thinned_pages_{0};
  std::atomic<uint64_t> forks_{0};
  std::atomic<uint64_t> forked_rows_{0};
  mutable std::atomic<uint64_t> bytes_written_{0};
  mutable std::atomic<uint64_t> bytes_read_{0};
};

}  // namespace kvr::kv_store
