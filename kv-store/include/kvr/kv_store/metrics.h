#pragma once
// The KV store's Prometheus metric set (StoreMetrics), set from its StoreStats on every
// scrape. Registry, naming and thread safety: kvr/common/metrics.h.

#include <cstdint>
#include <memory>
#include <string_view>

#include "kvr/common/metrics.h"

namespace kvr::metrics {

// kvr-store: its StoreStats, as absolute values polled on scrape.
struct StoreSnapshot {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t total_pages = 0;
  uint64_t free_pages = 0;
  uint64_t sequences = 0;
  uint64_t evictions_expired = 0;     // monotonic since start
  uint64_t evictions_cached_lru = 0;  // monotonic since start
  uint64_t expired_sequences = 0;     // monotonic since start
  uint64_t bytes_written = 0;         // monotonic since start
  uint64_t bytes_read = 0;            // monotonic since start
  uint64_t shared_pages = 0;
  uint64_t forks = 0;        // monotonic since start
  uint64_t forked_rows = 0;  // monotonic since start
  uint64_t cached_sequences = 0;
  uint64_t cached_bytes = 0;
  uint64_t evictions_thinned = 0;  // monotonic since start
  uint64_t thinned_pages = 0;      // monotonic since start
};

class StoreMetrics {
 public:
  explicit StoreMetrics(prometheus::Registry& registry);
  ~StoreMetrics();

  // Sets every store metric from `s`. Monotonic fields feed counters by their increase since
  // the previous call (a decrease, i.e. a restarted store core, is counted from zero).
  //   kvr_store_capacity_bytes, kvr_store_used_bytes, kvr_store_pages{state="free|used"},
  //   kvr_store_sequences, kvr_store_shared_pages, kvr_store_cached_sequences,
  //   kvr_store_cached_bytes (gauges);
  //   kvr_store_evictions_total{reason="expired|cached_lru|thinned"},
  //   kvr_store_thinned_pages_total, kvr_store_expired_sequences_total,
  //   kvr_store_written_bytes_total, kvr_store_read_bytes_total, kvr_store_forks_total,
  //   kvr_store_forked_rows_total (counters).
  void Update(const StoreSnapshot& s);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

}  // namespace kvr::metrics
