#include "kvr/kv_store/metrics.h"

#include <algorithm>
#include <mutex>

#include "kvr/common/metric_families.h"

namespace kvr::metrics {

struct StoreMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : capacity(
            GaugeFamily(r, "kvr_store_capacity_bytes", "Bytes of the store's page pool").Add({})),
        used(GaugeFamily(r, "kvr_store_used_bytes", "Bytes of the page pool in use").Add({})),
        pages(GaugeFamily(r, "kvr_store_pages", "Pages of the pool, by state (free, used)")),
        sequences(GaugeFamily(r, "kvr_store_sequences", "Sequences held by the store").Add({})),
        evictions(CounterFamily(r, "kvr_store_evictions_total",
                                "Sequences evicted by the capacity policy, by reason (expired: "
                                "lease ran out; cached_lru: released-and-kept, least recently "
                                "used first; thinned: a cached one lost its least distinctive "
                                "pages, its summaries kept)")),
        shared_pages(GaugeFamily(r, "kvr_store_shared_pages",
                                 "Pages held by more than one sequence (forks share prefixes)")
                         .Add({})),
        cached_sequences(GaugeFamily(r, "kvr_store_cached_sequences",
                                     "Released-and-kept sequences, kept for prefix reuse (part "
                                     "of kvr_store_sequences)")
                             .Add({})),
        cached_bytes(GaugeFamily(r, "kvr_store_cached_bytes",
                                 "Bytes of pages only cached sequences hold: what evicting them "
                                 "all would free")
                         .Add({})),
        forks(
            CounterFamily(r, "kvr_store_forks_total", "Sequences created by forking another's rows")
                .Add({})),
        forked_rows(CounterFamily(r, "kvr_store_forked_rows_total",
                                  "Rows per (layer, kv head) that forks started their "
                                  "sequences with, summed")
                        .Add({})),
        expired(CounterFamily(r, "kvr_store_expired_sequences_total",
                              "Sequences dropped because their lease expired")
                    .Add({})),
        written(CounterFamily(r, "kvr_store_written_bytes_total", "KV bytes written to the store")
                    .Add({})),
        read(
            CounterFamily(r, "kvr_store_read_bytes_total", "KV bytes read from the store").Add({})),
        free_pages(pages.Add({{"state", "free"}})),
        used_pages(pages.Add({{"state", "used"}})),
        evictions_expired(evictions.Add({{"reason", "expired"}})),
        evictions_cached_lru(evictions.Add({{"reason", "cached_lru"}})),
        evictions_thinned(evictions.Add({{"reason", "thinned"}})),
        thinned_pages(CounterFamily(r, "kvr_store_thinned_pages_total",
                                    "Pages freed by thinning cached sequences")
                          .Add({})) {}
  prometheus::Gauge& capacity;
  prometheus::Gauge& used;
  prometheus::Family<prometheus::Gauge>& pages;
  prometheus::Gauge& sequences;
  prometheus::Family<prometheus::Counter>& evictions;
  prometheus::Gauge& shared_pages;
  prometheus::Gauge& cached_sequences;
  prometheus::Gauge& cached_bytes;
  prometheus::Counter& forks;
  prometheus::Counter& forked_rows;
  prometheus::Counter& expired;
  prometheus::Counter& written;
  prometheus::Counter& read;
  prometheus::Gauge& free_pages;
  prometheus::Gauge& used_pages;
  prometheus::Counter& evictions_expired;
  prometheus::Counter& evictions_cached_lru;
  prometheus::Counter& evictions_thinned;
  prometheus::Counter& thinned_pages;
  // Previous values of the monotonic fields, to turn absolute values into increments.
  std::mutex mu;
  StoreSnapshot last;
};

StoreMetrics::StoreMetrics(prometheus::Registry& registry)
    : f_(std::make_unique<Families>(registry)) {}
StoreMetrics::~StoreMetrics() = default;

namespace {
double Increase(uint64_t now, uint64_t before) {
  return static_cast<double>(now >= before ? now - before : now);
}
}  // namespace

void StoreMetrics::Update(const StoreSnapshot& s) {
  f_->capacity.Set(static_cast<double>(s.capacity_bytes));
  f_->used.Set(static_cast<double>(s.used_bytes));
  f_->free_pages.Set(static_cast<double>(s.free_pages));
  f_->used_pages.Set(static_cast<double>(s.total_pages - std::min(s.free_pages, s.total_pages)));
  f_->sequences.Set(static_cast<double>(s.sequences));
  f_->shared_pages.Set(static_cast<double>(s.shared_pages));
  f_->cached_sequences.Set(static_cast<double>(s.cached_sequences));
  f_->cached_bytes.Set(static_cast<double>(s.cached_bytes));
  std::lock_guard<std::mutex> lock(f_->mu);
  f_->evictions_expired.Increment(Increase(s.evictions_expired, f_->last.evictions_expired));
  f_->evictions_cached_lru.Increment(
      Increase(s.evictions_cached_lru, f_->last.evictions_cached_lru));
  f_->evictions_thinned.Increment(Increase(s.evictions_thinned, f_->last.evictions_thinned));
  f_->thinned_pages.Increment(Increase(s.thinned_pages, f_->last.thinned_pages));
  f_->forks.Increment(Increase(s.forks, f_->last.forks));
  f_->forked_rows.Increment(Increase(s.forked_rows, f_->last.forked_rows));
  f_->expired.Increment(Increase(s.expired_sequences, f_->last.expired_sequences));
  f_->written.Increment(Increase(s.bytes_written, f_->last.bytes_written));
  f_->read.Increment(Increase(s.bytes_read, f_->last.bytes_read));
  f_->last = s;
}

}  // namespace kvr::metrics
