#include "kvr/prefill_node/metrics.h"

#include "kvr/common/metric_families.h"

namespace kvr::metrics {

struct PrefillMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : step(HistogramFamily(r, "kvr_prefill_step_seconds",
                             "One request's prefill: all layers, summaries and KV shipping"),
             {"model", "method"}, buckets::FirstToken()),
        tokens(CounterFamily(r, "kvr_prefill_tokens_total", "Prompt tokens prefilled"), {"model"}),
        shipped(CounterFamily(r, "kvr_kv_shipped_bytes_total",
                              "KV and summary bytes sent by prefill, by destination"),
                {"model", "destination"}),
        waiting(GaugeFamily(r, "kvr_requests_waiting",
                            "Requests queued on a node and not yet running, by node role")
                    .Add({{"role", "prefill"}})),
        queued_tokens(GaugeFamily(r, "kvr_prefill_queued_tokens",
                                  "Prompt tokens queued or running on this prefill node")
                          .Add({})),
        prefills(CounterFamily(r, "kvr_prefill_requests_total",
                               "Prefills finished, by outcome (ok or lower-case gRPC code)"),
                 {"model", "outcome"}),
        summary_layers(CounterFamily(r, "kvr_prefill_index_layers_total",
                                     "Layers' retrieval summaries of prefills that reused a cached "
                                     "prefix, by source (extended snapshot or rebuilt)"),
                       {"model", "source"}) {}
  HistogramL step;
  CounterL tokens, shipped;
  prometheus::Gauge& waiting;
  prometheus::Gauge& queued_tokens;
  CounterL prefills;
  CounterL summary_layers;
};

PrefillMetrics::PrefillMetrics(prometheus::Registry& registry)
    : f_(std::make_unique<Families>(registry)) {}
PrefillMetrics::~PrefillMetrics() = default;

void PrefillMetrics::ObservePrefillStep(std::string_view model, std::string_view method,
                                        double seconds) {
  f_->step.Get({model, method}).Observe(seconds);
}
void PrefillMetrics::AddPrefillTokens(std::string_view model, uint64_t n) {
  f_->tokens.Get({model}).Increment(static_cast<double>(n));
}
void PrefillMetrics::AddShippedBytes(std::string_view model, std::string_view destination,
                                     uint64_t bytes) {
  f_->shipped.Get({model, destination}).Increment(static_cast<double>(bytes));
}
void PrefillMetrics::SetWaiting(int64_t requests) {
  f_->waiting.Set(static_cast<double>(requests));
}
void PrefillMetrics::SetQueuedTokens(int64_t tokens) {
  f_->queued_tokens.Set(static_cast<double>(tokens));
}
void PrefillMetrics::CountPrefill(std::string_view model, std::string_view outcome) {
  f_->prefills.Get({model, outcome}).Increment();
}

void PrefillMetrics::AddSummaryLayers(std::string_view model, std::string_view source,
                                      uint64_t layers) {
  f_->summary_layers.Get({model, source}).Increment(static_cast<double>(layers));
}

}  // namespace kvr::metrics
