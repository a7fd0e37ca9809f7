#pragma once
// The controller's Prometheus metric set (ControllerMetrics): one request as the client sees
// it. Registry, naming and thread safety: kvr/common/metrics.h.

#include <cstdint>
#include <memory>
#include <string_view>

#include "kvr/common/metrics.h"

namespace kvr::metrics {

// Front end (kvr-controller): one request as the client sees it. Implemented as a
// controller::RequestObserver in the controller.
class ControllerMetrics {
 public:
  explicit ControllerMetrics(prometheus::Registry& registry);
  ~ControllerMetrics();

  // kvr_time_to_first_token_seconds{model,method}: arrival at the controller -> first token
  // sent to the client (queue and every retry included).
  void ObserveTimeToFirstToken(std::string_view model, std::string_view method, double seconds);
  // kvr_request_queue_time_seconds{model,method}: arrival -> prefill dispatched (placement,
  // admission, retries of placement).
  void ObserveQueueTime(std::string_view model, std::string_view method, double seconds);
  // kvr_inter_token_latency_seconds{model,method}: gap between consecutive tokens reaching
  // the client. A chunk of n tokens arriving `seconds` after the previous chunk counts as n
  // observations of seconds / n (tokens inside a chunk were produced between the two).
  void ObserveInterTokenLatency(std::string_view model, std::string_view method, double seconds,
                                uint32_t n_tokens = 1);
  // kvr_time_per_output_token_seconds{model,method}: per finished request, (e2e - ttft) /
  // (completion tokens - 1).
  void ObserveTimePerOutputToken(std::string_view model, std::string_view method, double seconds);
  // kvr_e2e_request_latency_seconds{model,method}: arrival -> end of stream, any outcome.
  void ObserveE2eLatency(std::string_view model, std::string_view method, double seconds);
  // kvr_requests_total{model,method,outcome}: every request that ended, rejected ones
  // included. outcome is "ok" or the lower-case gRPC code that ended it (resource_exhausted,
  // deadline_exceeded, cancelled, unavailable, invalid_argument, ...). Rejected requests whose
  // model is unknown carry model="" and method="".
  // kvr_request_success_total{model,method,finish_reason}: OK requests by finish reason
  // (eos, stop, length, unspecified).
  void CountRequest(std::string_view model, std::string_view method, std::string_view outcome);
  void CountSuccess(std::string_view model, std::string_view method,
                    std::string_view finish_reason);
  // kvr_requests_running: requests placed on nodes and not yet ended (cluster-wide, as seen by
  // the controller).
  void RequestStarted();
  void RequestEnded();
  // kvr_prompt_tokens_total{model}, kvr_generation_tokens_total{model}: prompt tokens of
  // finished requests; completion tokens streamed to clients (also of failed requests).
  void AddPromptTokens(std::string_view model, uint64_t n);
  // kvr_prompt_cached_tokens_total{model}: prompt tokens of finished requests whose KV was
  // reused from a cached prefix instead of computed (part of kvr_prompt_tokens_total).
  // kvr_prefix_cache_requests_total{model,result}: finished requests that reused a cached
  // prefix (result="hit") or computed their whole prompt ("miss"); the hit rate is
  // hit / (hit + miss).
  void AddCachedPromptTokens(std::string_view model, uint64_t n);
  void AddGenerationTokens(std::string_view model, uint64_t n);
  // kvr_request_attempts_total{model}: placement attempts (> requests when retried).
  // kvr_node_failures_total{role}: node errors seen during attempts.
  void CountAttempt(std::string_view model);
  void CountNodeFailure(std::string_view role);

 private:
  struct Families;
  std::unique_ptr<Families> f_;
};

}  // namespace kvr::metrics
