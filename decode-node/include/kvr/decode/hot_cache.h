#pragma once
// The decode node's hot cache: KV rows fetched from the store in recent steps, so that a row
// selected again (the selection of a head changes little from one step to the next) is not
// fetched again. Keyed by (sequence, layer, kv_head, position); each entry is one store row
// [2 * head_dim] floats ([k | v]). Bounded by bytes (payload bytes: the rows' floats); the
// least recently used rows are evicted first (LRU).
//
// Thread safety: none; the decode loop's thread owns it.
// Lifetime: a pointer returned by Find is valid until the next Insert/DropSequence/Clear.

#include <cstdint>
#include <list>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"

namespace kvr::decode {

struct RowKey {
  uint64_t sequence = 0;
  uint32_t layer = 0;
  uint32_t head = 0;
  int64_t position = 0;

  bool operator==(const RowKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const RowKey& k) {
    return H::combine(std::move(h), k.sequence, k.layer, k.head, k.position);
  }
};

class HotCache {
 public:
  // `capacity_bytes` 0 disables the cache (every lookup misses, nothing is kept).
  explicit HotCache(int64_t capacity_bytes) : capacity_bytes_(capacity_bytes) {}

  // The row, marked most recently used, or null.
  const float* Find(const RowKey& key);
  // Copies `floats` floats of `row` in (replacing an entry with the same key), then evicts
  // least recently used rows until the cache fits its bound. A row larger than the whole
  // bound is not kept.
  void Insert(const RowKey& key, const float* row, int64_t floats);
  // Drops every row of the sequence.
  void DropSequence(uint64_t sequence);
  void Clear();

  int64_t bytes() const { return bytes_; }
  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t entries() const { return static_cast<int64_t>(map_.size()); }
  int64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    RowKey key;
    std::vector<float> row;
  };
  void Erase(std::list<Entry>::iterator it);

  int64_t capacity_bytes_;
  int64_t bytes_ = 0;
  int64_t evictions_ = 0;
  std::list<Entry> lru_;  // front: most recently used
  absl::flat_hash_map<RowKey, std::list<Entry>::iterator> map_;
};

}  // namespace kvr::decode
