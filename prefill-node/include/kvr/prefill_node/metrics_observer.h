#pragma once
// The Prometheus side of PrefillObserver: records a prefill node's work in
// kvr::metrics::PrefillMetrics (kvr/prefill_node/metrics.h documents each metric).
//
// Thread safety: hooks run on request threads, concurrently. Counters are atomic; the queue
// gauges are kept in atomics here. OnQueued and OnFinished of one request run on the same thread
// (PrefillEngine::Run), so what a request added to the queue is remembered in a thread_local
// until its OnFinished (a request rejected before queueing, e.g. by tokenization, has
// OnFinished without OnQueued and must not be subtracted).

#include <atomic>
#include <cstdint>
#include <string>

#include "kvr/prefill_node/metrics.h"
#include "kvr/prefill_node/prefill_engine.h"

namespace kvr::prefill_node {

class PrefillMetricsObserver final : public PrefillObserver {
 public:
  // `metrics` is not owned and must outlive the observer. `model` is the served model name
  // (label model). The hooks do not carry the request's retrieval method, so the
  // kvr_prefill_step_seconds series has method="".
  PrefillMetricsObserver(metrics::PrefillMetrics* metrics, std::string model);

  void OnQueued(uint32_t prompt_tokens) override;
  void OnLayerReady(int layer, absl::Duration index_build, uint64_t summary_bytes,
                    uint64_t kv_bytes) override;
  void OnFinished(const absl::Status& status, const PrefillResult* result,
                  absl::Duration total) override;

 private:
  metrics::PrefillMetrics* metrics_;
  const std::string model_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> queued_tokens_{0};
};

}  // namespace kvr::prefill_node
