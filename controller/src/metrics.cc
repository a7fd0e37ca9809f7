#include "kvr/controller/metrics.h"

#include "kvr/common/metric_families.h"

namespace kvr::metrics {

struct ControllerMetrics::Families {
  explicit Families(prometheus::Registry& r)
      : ttft(HistogramFamily(r, "kvr_time_to_first_token_seconds",
                             "Arrival at the controller to first token sent to the client"),
             {"model", "method"}, buckets::FirstToken()),
        queue(HistogramFamily(r, "kvr_request_queue_time_seconds",
                              "Arrival at the controller to prefill dispatched"),
              {"model", "method"}, buckets::Request()),
        itl(HistogramFamily(r, "kvr_inter_token_latency_seconds",
                            "Gap between consecutive tokens reaching the client"),
            {"model", "method"}, buckets::TokenGap()),
        tpot(HistogramFamily(r, "kvr_time_per_output_token_seconds",
                             "(e2e - ttft) / (completion tokens - 1) per finished request"),
             {"model", "method"}, buckets::TokenGap()),
        e2e(HistogramFamily(r, "kvr_e2e_request_latency_seconds",
                            "Arrival at the controller to end of stream, any outcome"),
            {"model", "method"}, buckets::Request()),
        requests(CounterFamily(r, "kvr_requests_total",
                               "Requests ended, by outcome (ok or lower-case gRPC code)"),
                 {"model", "method", "outcome"}),
        success(CounterFamily(r, "kvr_request_success_total",
                              "Requests that ended OK, by finish reason"),
                {"model", "method", "finish_reason"}),
        running(GaugeFamily(r, "kvr_requests_running", "Requests placed on nodes and not yet ended")
                    .Add({})),
        prompt_tokens(
            CounterFamily(r, "kvr_prompt_tokens_total", "Prompt tokens of finished requests"),
            {"model"}),
        cached_tokens(CounterFamily(r, "kvr_prompt_cached_tokens_total",
                                    "Prompt tokens whose KV was reused from a cached prefix"),
                      {"model"}),
        prefix_requests(CounterFamily(r, "kvr_prefix_cache_requests_total",
                                      "Finished requests that reused a cached prefix (hit) or "
                                      "computed their whole prompt (miss)"),
                        {"model", "result"}),
        generation_tokens(CounterFamily(r, "kvr_generation_tokens_total",
                                        "Completion tokens streamed to clients"),
                          {"model"}),
        attempts(CounterFamily(r, "kvr_request_attempts_total",
                               "Placement attempts (more than requests when retried)"),
                 {"model"}),
        node_failures(CounterFamily(r, "kvr_node_failures_total",
                                    "Node errors seen during request attempts, by node role"),
                      {"role"}) {}
  HistogramL ttft, queue, itl, tpot, e2e;
  CounterL requests, success;
  prometheus::Gauge& running;
  CounterL prompt_tokens, cached_tokens, prefix_requests, generation_tokens, attempts,
      node_failures;
};

ControllerMetrics::ControllerMetrics(prometheus::Registry& registry)
    : f_(std::make_unique<Families>(registry)) {
  // Exported at 0 from the start, so that rate() and alerts see the series before the first
  // failure (a labelled counter has no sample until a child exists).
  for (std::string_view role : {"prefill", "decode", "store"}) f_->node_failures.Get({role});
}
ControllerMetrics::~ControllerMetrics() = default;

void ControllerMetrics::ObserveTimeToFirstToken(std::string_view model, std::string_view method,
                                                double seconds) {
  f_->ttft.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::ObserveQueueTime(std::string_view model, std::string_view method,
                                         double seconds) {
  f_->queue.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::ObserveInterTokenLatency(std::string_view model, std::string_view method,
                                                 double seconds, uint32_t n_tokens) {
  if (n_tokens == 0) return;
  prometheus::Histogram& h = f_->itl.Get({model, method});
  const double each = seconds / n_tokens;
  for (uint32_t i = 0; i < n_tokens; ++i) h.Observe(each);
}
void ControllerMetrics::ObserveTimePerOutputToken(std::string_view model, std::string_view method,
                                                  double seconds) {
  f_->tpot.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::ObserveE2eLatency(std::string_view model, std::string_view method,
                                          double seconds) {
  f_->e2e.Get({model, method}).Observe(seconds);
}
void ControllerMetrics::CountRequest(std::string_view model, std::string_view method,
                                     std::string_view outcome) {
  f_->requests.Get({model, method, outcome}).Increment();
}
void ControllerMetrics::CountSuccess(std::string_view model, std::string_view method,
                                     std::string_view finish_reason) {
  f_->success.Get({model, method, finish_reason}).Increment();
}
void ControllerMetrics::RequestStarted() { f_->running.Increment(); }
void ControllerMetrics::RequestEnded() { f_->running.Decrement(); }
void ControllerMetrics::AddPromptTokens(std::string_view model, uint64_t n) {
  f_->prompt_tokens.Get({model}).Increment(static_cast<double>(n));
}
void ControllerMetrics::AddCachedPromptTokens(std::string_view model, uint64_t n) {
  f_->cached_tokens.Get({model}).Increment(static_cast<double>(n));
  f_->prefix_requests.Get({model, n > 0 ? "hit" : "miss"}).Increment();
}
void ControllerMetrics::AddGenerationTokens(std::string_view model, uint64_t n) {
  f_->generation_tokens.Get({model}).Increment(static_cast<double>(n));
}
void ControllerMetrics::CountAttempt(std::string_view model) {
  f_->attempts.Get({model}).Increment();
}
void ControllerMetrics::CountNodeFailure(std::string_view role) {
  f_->node_failures.Get({role}).Increment();
}

}  // namespace kvr::metrics
