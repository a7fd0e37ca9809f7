#pragma once
// The prefill node's Prometheus metric set (PrefillMetrics). Registry, naming and thread
// safety: kvr/common/metrics.h.

#include <cstdint>
#include <memory>
#include <string_view>

#include "kvr/common/metrics.h"

namespace kvr::metrics {

// kvr-prefill.
class PrefillMetrics {
 public:
  explicit PrefillMetrics(prometheus::Registry& registry);
  ~PrefillMetrics();

  // kvr_prefill_step_seconds{model,method}: one prefill (all layers, summaries, shipping) of
  // one request's prompt.
  void ObservePrefillStep(std::string_view model, std::string_view method, double seconds);
  // kvr_prefill_tokens_total{model}: prompt tokens prefilled.
  void AddPrefillTokens(std::string_view model, uint64_t n);
  // kvr_kv_shipped_bytes_total{model,destination}: KV rows sent to the store
  // (destination="store") and summaries + sink/local KV sent to decode nodes
  // (destination="decode").
  void AddShippedBytes(std::string_view model, std::string_view destination, uint64_t bytes);
  // kvr_requests_waiting{role="prefill"}: requests queued on this node, not yet running.
  // kvr_prefill_queued_tokens: prompt tokens queued or running.
  void SetWaiting(int64_t requests);
  void SetQueuedTokens(int64_t tokens);
  // kvr_prefill_requests_total{model,outcome}: prefills finished, outcome "ok" or a gRPC code.
  void CountPrefill(std::string_view model, std::string_view outcome);
  // kvr_prefill_index_layers_total{model,source}: layers' retrieval summaries of prefills
  // that reused a cached prefix, source "extended" (the prefix's snapshot extended by Append)
  // or "rebuilt" (built from the rows: no usable snapshot).
  void AddSummaryLayers(std::string_view model, std::string_view source, uint64_t layers);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

}  // namespace kvr::metrics
