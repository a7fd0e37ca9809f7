#include "kvr/controller/metrics_observer.h"

#include <optional>
#include <string>

#include "absl/strings/ascii.h"

namespace kvr::controller {
namespace {

std::string FinishReasonLabel(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStopString:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kUnspecified:
      break;
  }
  return "unspecified";
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace

MetricsObserver::MetricsObserver(metrics::ControllerMetrics* metrics, const Clock* clock)
    : metrics_(metrics), clock_(clock) {}

std::string MetricsObserver::OutcomeLabel(const absl::Status& status) {
  if (status.ok()) return "ok";
  return absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
}

void MetricsObserver::OnRejected(const absl::Status& status) {
  metrics_->CountRequest("", "", OutcomeLabel(status));
}

void MetricsObserver::OnAttempt(const GenerateParams& params, const PlacementDecision& placement,
                                uint32_t attempt) {
  metrics_->CountAttempt(params.model);
  bool first = false;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = timings_.try_emplace(params.request_id);
    if (inserted) it->second.start = clock_->Now();
    first = inserted;
    it->second.prefill_node = placement.prefill.id;
    it->second.decode_node = placement.decode.id;
    it->second.store_node = placement.store.id;
  }
  if (first) metrics_->RequestStarted();
}

void MetricsObserver::OnNodeFailure(const GenerateParams& params, absl::string_view node_id,
                                    const absl::Status& error) {
  std::string role = "unknown";
  {
    absl::MutexLock lock(&mu_);
    auto it = timings_.find(params.request_id);
    if (it != timings_.end()) {
      if (node_id == it->second.prefill_node)
        role = "prefill";
      else if (node_id == it->second.decode_node)
        role = "decode";
      else if (node_id == it->second.store_node)
        role = "store";
    }
  }
  metrics_->CountNodeFailure(role);
}

void MetricsObserver::OnFirstToken(const GenerateParams& params, absl::Duration queue,
                                   absl::Duration time_to_first_token) {
  const absl::Time now = clock_->Now();
  {
    absl::MutexLock lock(&mu_);
    Timing& t = timings_[params.request_id];
    t.arrival = now - time_to_first_token;
    t.last_token = now;
  }
  metrics_->ObserveQueueTime(params.model, params.retrieval.method, Seconds(queue));
  metrics_->ObserveTimeToFirstToken(params.model, params.retrieval.method,
                                    Seconds(time_to_first_token));
  metrics_->AddGenerationTokens(params.model, 1);
}

void MetricsObserver::OnTokens(const GenerateParams& params, uint32_t n) {
  if (n == 0) return;
  const absl::Time now = clock_->Now();
  absl::Duration gap;
  {
    absl::MutexLock lock(&mu_);
    Timing& t = timings_[params.request_id];
    gap = t.last_token == absl::InfinitePast() ? absl::ZeroDuration() : now - t.last_token;
    t.last_token = now;
  }
  metrics_->ObserveInterTokenLatency(params.model, params.retrieval.method, Seconds(gap), n);
  metrics_->AddGenerationTokens(params.model, n);
}

void MetricsObserver::OnEnd(const GenerateParams& params, const absl::Status& outcome,
                            const FinalReport* report) {
  const absl::Time now = clock_->Now();
  std::optional<Timing> timing;
  {
    absl::MutexLock lock(&mu_);
    auto it = timings_.find(params.request_id);
    if (it != timings_.end()) {
      timing = std::move(it->second);
      timings_.erase(it);
    }
  }
  const std::string& model = params.model;
  const std::string& method = params.retrieval.method;
  metrics_->CountRequest(model, method, OutcomeLabel(outcome));
  if (timing.has_value()) metrics_->RequestEnded();
  if (outcome.ok() && report != nullptr) {
    metrics_->CountSuccess(model, method, FinishReasonLabel(report->completion.finish_reason));
    metrics_->AddPromptTokens(model, report->completion.prompt_tokens);
    metrics_->AddCachedPromptTokens(model, report->completion.cached_tokens);
    metrics_->ObserveE2eLatency(model, method,
                                Seconds(report->time_to_first_token + report->decode));
    if (report->completion.completion_tokens > 1) {
      metrics_->ObserveTimePerOutputToken(
          model, method, Seconds(report->decode) / (report->completion.completion_tokens - 1));
    }
    return;
  }
  if (timing.has_value()) {
    const absl::Time from =
        timing->arrival != absl::InfinitePast() ? timing->arrival : timing->start;
    metrics_->ObserveE2eLatency(model, method, Seconds(now - from));
  }
}

}  // namespace kvr::controller
