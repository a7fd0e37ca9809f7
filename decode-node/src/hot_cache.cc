#include "kvr/decode/hot_cache.h"

namespace kvr::decode {

const float* HotCache::Find(const RowKey& key) {
  auto it = map_.find(key);
  if (it == map_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->row.data();
}

void HotCache::Erase(std::list<Entry>::iterator it) {
  bytes_ -= static_cast<int64_t>(it->row.size() * sizeof(float));
  map_.erase(it->key);
  lru_.erase(it);
}

void HotCache::Insert(const RowKey& key, const float* row, int64_t floats) {
  const int64_t row_bytes = floats * static_cast<int64_t>(sizeof(float));
  if (auto it = map_.find(key); it != map_.end()) Erase(it->second);
  if (row_bytes > capacity_bytes_) return;
  while (bytes_ + row_bytes > capacity_bytes_ && !lru_.empty()) {
    Erase(std::prev(lru_.end()));
    ++evictions_;
  }
  lru_.push_front(Entry{key, std::vector<float>(row, row + floats)});
  map_[key] = lru_.begin();
  bytes_ += row_bytes;
}

void HotCache::DropSequence(uint64_t sequence) {
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    if (it->key.sequence == sequence) Erase(it);
    it = next;
  }
}

void HotCache::Clear() {
  lru_.clear();
  map_.clear();
  bytes_ = 0;
}

}  // namespace kvr::decode
