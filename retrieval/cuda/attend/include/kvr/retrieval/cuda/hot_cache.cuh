#pragma once
// GPU hot cache of KV rows fetched in recent decode steps, so that only misses cross the link
// (DESIGN.md 2.4: "fetch rows not in the hot cache").
//
// One HotCache serves one layer for up to `batch` sequence slots; each (sequence slot, kv head)
// owns n_sets * ways row slots in HBM. A token id t lives in set t % n_sets; within a set the
// victim is the least recently used way (per-slot stamp of the last step that used it: LRU at
// step granularity); the r-th miss of a set within one step takes the r-th least recent way, so
// misses of one set do not fight over one victim. Gather() is one decode step: it copies every
// selected row into `out` (hits from the cache, HBM -> HBM; misses from the pool, e.g. zero-copy
// from mapped host memory) and fills the cache with the misses.
//
// Races inside a step are settled by a per-slot claim word (step << 32 | priority, atomicMax):
// a hit claims its slot with the top priority, so no miss of the same step overwrites a row that
// is being read; two misses that pick the same victim keep the one with the smaller id and the
// other is simply not cached this step. Claims carry the step, so they never need resetting.
//
// The step counter lives on the device, so Gather() can be captured in a CUDA graph and replayed
// (each replay is a new step).
//
// Thread safety: one stream at a time per HotCache (steps must run in order). Owns its device
// memory (move-only, CONVENTIONS.md 8).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/retrieval/cuda/gather.cuh"

namespace kvr::retrieval::cuda {

struct HotCacheShape {
  int batch = 0;  // sequence slots
  int n_kv_heads = 0;
  int head_dim = 0;  // 64 or 128
  RowDType dtype = RowDType::kBf16;  // of the rows written to `out`
  // The pool's rows, the staged rows and the cache's own: kFp8E4m3 (dtype must be bf16) keeps
  // fp8 rows in the cache (2 * head_dim + 8 bytes a row instead of 4 * head_dim) and decodes
  // every row, hit or miss, into `out` as bf16: value = e4m3 code * its vector's scale in fp32,
  // rounded to nearest bf16 (kvr/common/fp8.h's DecodeFp8Row, then bf16 rounding).
  PoolRowFormat pool_format = PoolRowFormat::kAsDType;
  int n_sets = 0;  // per (sequence slot, kv head)
  int ways = 0;    // 1..8
  int budget = 0;  // largest selection per (b, h) that Gather accepts
};

class HotCache {
 public:
  [[nodiscard]] static absl::StatusOr<HotCache> Create(const HotCacheShape& shape,
                                                       cudaStream_t stream);

  // One decode step. ids/counts/out as GatherParams (device pointers); `pool` is where misses
  // are read. Adds the number of hits to the device counter returned by hits(), and each
  // sequence slot's hits to slot_hits[b] (device [batch]; null: this cache's own slot_hits()).
  [[nodiscard]] absl::Status Gather(const KvPoolView& pool, const int32_t* ids,
                                    const int32_t* counts, void* out, cudaStream_t stream,
                                    unsigned long long* slot_hits = nullptr);
  // Gather in two halves, for rows that are not in a pool the GPU can read (a store on another
  // host): Lookup finds every selected entry in the cache (slot_of(): its cache slot when >= 0,
  // a miss when < 0; entries at or past counts[b, h] are not written) and counts the hits; the
  // caller then fetches the misses itself; Fill copies every row into `out`: hits from the
  // cache, misses from the pool or, for a slot whose KvPoolSlot::base is null, from `staged`
  // (device-readable rows, e.g. mapped pinned memory the host fetched them into: entry e's row
  // is staged row staged_index[e], an index the caller writes for those misses only), and
  // caches the misses. Lookup and Fill must alternate on one stream. A Fill may be split into
  // several over disjoint ranges of sequence slots ([first_slot, first_slot + n_slots); n_slots
  // -1: to the last), e.g. one per sequence as its fetch completes, so the GPU copies one
  // sequence's rows while the host waits for the next one's; every selected slot must be
  // filled before the next Lookup.
  [[nodiscard]] absl::Status Lookup(const int32_t* ids, const int32_t* counts, cudaStream_t stream,
                                    unsigned long long* slot_hits = nullptr);
  [[nodiscard]] absl::Status Fill(const KvPoolView& pool, const int32_t* ids, const int32_t* counts,
                                  void* out, cudaStream_t stream, const void* staged,
                                  const int32_t* staged_index, int first_slot = 0,
                                  int n_slots = -1);
  // Device [batch, n_kv_heads, budget]: the last Lookup's cache slot per entry (>= 0: a hit).
  const int32_t* slot_of() const { return slot_of_.data(); }

  // Forgets every row of sequence slot b (a new sequence takes the slot) and zeroes its hits.
  [[nodiscard]] absl::Status ResetSlot(int b, cudaStream_t stream);

  // Device counter of hits since creation (unsigned long long).
  const unsigned long long* hits() const { return counters_.data(); }
  // Device counters of hits per sequence slot [batch], since the slot's last ResetSlot.
  const unsigned long long* slot_hits() const { return counters_.data() + 1; }
  const HotCacheShape& shape() const { return shape_; }
  int slots_per_head() const { return shape_.n_sets * shape_.ways; }
  size_t data_bytes() const { return data_.bytes(); }
  // Bytes of one cached (and pool) row.
  size_t row_bytes() const {
    return PoolRowBytes(shape_.pool_format, shape_.dtype, shape_.head_dim);
  }

 private:
  HotCacheShape shape_;
  kvr::cuda::DeviceBuffer<int32_t> tags_;                 // [batch, n_kv_heads, slots], -1 empty
  kvr::cuda::DeviceBuffer<uint32_t> stamps_;              // [batch, n_kv_heads, slots]
  kvr::cuda::DeviceBuffer<unsigned long long> claims_;    // [batch, n_kv_heads, slots]
  kvr::cuda::DeviceBuffer<unsigned> fills_;               // [batch, n_kv_heads, n_sets]
  kvr::cuda::DeviceBuffer<int32_t> slot_of_;              // [batch, n_kv_heads, budget]
  kvr::cuda::DeviceBuffer<uint8_t> data_;                 // [batch, n_kv_heads, slots, row]
  kvr::cuda::DeviceBuffer<uint32_t> steps_;               // [2]: last completed step, current step
  kvr::cuda::DeviceBuffer<unsigned long long> counters_;  // [1 + batch] hits, per-slot hits
};

}  // namespace kvr::retrieval::cuda
