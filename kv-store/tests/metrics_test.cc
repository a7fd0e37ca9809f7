// StoreMetrics: polled absolute values become gauges and counters, which promtool accepts.
#include "kvr/kv_store/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "metrics_test_util.h"

// In the helpers' namespace (metrics_test_util.h): Offline, ExpectExposes, ExpectPromtoolClean,
// HttpGet.
namespace kvr::metrics::testing {
namespace {

TEST(StoreMetricsTest, CountersFollowMonotonicFieldsAcrossAReset) {
  auto server = Offline("store");
  StoreMetrics m(server->registry());
  m.Update({.capacity_bytes = 1 << 30,
            .used_bytes = 4096,
            .total_pages = 10,
            .free_pages = 7,
            .sequences = 2,
            .evictions_expired = 3,
            .evictions_cached_lru = 2,
            .expired_sequences = 1,
            .bytes_written = 100,
            .bytes_read = 50,
            .shared_pages = 3,
            .forks = 2,
            .forked_rows = 700,
            .evictions_thinned = 1,
            .thinned_pages = 40});
  m.Update({.capacity_bytes = 1 << 30,
            .used_bytes = 8192,
            .total_pages = 10,
            .free_pages = 6,
            .sequences = 2,
            .evictions_expired = 5,
            .evictions_cached_lru = 4,
            .expired_sequences = 1,
            .bytes_written = 300,
            .bytes_read = 50,
            .shared_pages = 5,
            .forks = 3,
            .forked_rows = 900,
            .evictions_thinned = 3,
            .thinned_pages = 90});
  m.Update({.capacity_bytes = 1 << 30,
            .used_bytes = 8192,
            .total_pages = 10,
            .free_pages = 6,
            .sequences = 2,
            .evictions_expired = 1,
            .evictions_cached_lru = 4,
            .expired_sequences = 1,
            .bytes_written = 300,
            .bytes_read = 60,
            .shared_pages = 1,
            .forks = 3,
            .forked_rows = 900,
            .evictions_thinned = 3,
            .thinned_pages = 90});  // expired evictions went back: counted from zero
  const std::string text = server->ScrapeText();
  ExpectExposes(
      text, {"kvr_store_capacity_bytes 1073741824", "kvr_store_used_bytes 8192",
             "kvr_store_pages{state=\"free\"} 6", "kvr_store_pages{state=\"used\"} 4",
             "kvr_store_sequences 2", "kvr_store_evictions_total{reason=\"expired\"} 6",
             "kvr_store_evictions_total{reason=\"cached_lru\"} 4",
             "kvr_store_evictions_total{reason=\"thinned\"} 3", "kvr_store_thinned_pages_total 90",
             "kvr_store_shared_pages 1", "kvr_store_forks_total 3",
             "kvr_store_forked_rows_total 900", "kvr_store_expired_sequences_total 1",
             "kvr_store_written_bytes_total 300", "kvr_store_read_bytes_total 60"});
  ExpectPromtoolClean(text);
}

}  // namespace
}  // namespace kvr::metrics::testing
