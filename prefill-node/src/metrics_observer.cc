#include "kvr/prefill_node/metrics_observer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"

namespace kvr::prefill_node {
namespace {

// What the current thread's request added to the queue gauges (see the header).
struct QueuedHere {
  bool queued = false;
  uint32_t tokens = 0;
};
thread_local QueuedHere queued_here;

std::string Outcome(const absl::Status& status) {
  if (status.ok()) return "ok";
  return absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
}

}  // namespace

PrefillMetricsObserver::PrefillMetricsObserver(metrics::PrefillMetrics* metrics, std::string model)
    : metrics_(metrics), model_(std::move(model)) {
  metrics_->SetWaiting(0);
  metrics_->SetQueuedTokens(0);
  // Series that exist before the first request, so dashboards show 0 rather than nothing.
  metrics_->AddPrefillTokens(model_, 0);
  metrics_->AddShippedBytes(model_, "store", 0);
  metrics_->AddShippedBytes(model_, "decode", 0);
  metrics_->AddSummaryLayers(model_, "extended", 0);
  metrics_->AddSummaryLayers(model_, "rebuilt", 0);
}

void PrefillMetricsObserver::OnQueued(uint32_t prompt_tokens) {
  queued_here = {.queued = true, .tokens = prompt_tokens};
  const int64_t n = in_flight_.fetch_add(1) + 1;
  // One request runs the model at a time (PrefillEngine's model lock); the rest wait.
  metrics_->SetWaiting(std::max<int64_t>(0, n - 1));
  metrics_->SetQueuedTokens(queued_tokens_.fetch_add(prompt_tokens) + prompt_tokens);
}

void PrefillMetricsObserver::OnLayerReady(int layer, absl::Duration index_build,
                                          uint64_t summary_bytes, uint64_t kv_bytes) {
  // The layer's rows are on their way to the store now; summaries and sink/local rows go to
  // the decode node with the handoff (counted at the end, from handoff_bytes).
  metrics_->AddShippedBytes(model_, "store", kv_bytes);
}

void PrefillMetricsObserver::OnFinished(const absl::Status& status, const PrefillResult* result,
                                        absl::Duration total) {
  if (queued_here.queued) {
    const int64_t n = in_flight_.fetch_sub(1) - 1;
    metrics_->SetWaiting(std::max<int64_t>(0, n - 1));
    metrics_->SetQueuedTokens(queued_tokens_.fetch_sub(queued_here.tokens) - queued_here.tokens);
    queued_here = {};
  }
  metrics_->CountPrefill(model_, Outcome(status));
  if (status.ok() && result != nullptr) {
    metrics_->ObservePrefillStep(model_, result->method, absl::ToDoubleSeconds(result->prefill_time));
    metrics_->AddPrefillTokens(model_, result->prompt_tokens);
    metrics_->AddShippedBytes(model_, "decode", result->handoff_bytes);
    metrics_->AddSummaryLayers(model_, "extended", result->summary_layers_extended);
    metrics_->AddSummaryLayers(model_, "rebuilt", result->summary_layers_rebuilt);
  }
}

}  // namespace kvr::prefill_node
