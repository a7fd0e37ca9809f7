#include "kvr/decode/metrics_observer.h"

#include <utility>

namespace kvr::decode {

DecodeMetricsObserver::DecodeMetricsObserver(metrics::DecodeMetrics* metrics, std::string model,
                                             std::string method)
    : metrics_(metrics), model_(std::move(model)), method_(std::move(method)) {
  // Series that exist before the first step, so dashboards show 0 rather than nothing.
  metrics_->SetWaiting(0);
  metrics_->SetBatchSize(model_, 0);
  metrics_->AddDecodeTokens(model_, 0);
  metrics_->AddFetched(model_, method_, 0, 0);
  metrics_->AddHotCache(model_, method_, 0, 0);
  metrics_->SetSummaryBytes(model_, method_, 0);
  metrics_->AddOffloadedBytes(model_, 0);
}

void DecodeMetricsObserver::OnStep(const StepReport& step) {
  metrics_->ObserveDecodeStep(model_, step.seconds);
  metrics_->AddDecodeTokens(model_, static_cast<uint64_t>(step.tokens));
  metrics_->SetBatchSize(model_, step.batch_size);
  metrics_->SetWaiting(step.waiting);
}

void DecodeMetricsObserver::OnFetch(const FetchReport& fetch) {
  metrics_->AddFetched(model_, method_, static_cast<uint64_t>(fetch.bytes),
                       static_cast<uint64_t>(fetch.rows));
  metrics_->ObserveFetchLatency(model_, fetch.seconds);
}

void DecodeMetricsObserver::OnHotCache(int64_t hits, int64_t misses) {
  metrics_->AddHotCache(model_, method_, static_cast<uint64_t>(hits),
                        static_cast<uint64_t>(misses));
}

void DecodeMetricsObserver::OnSummaryBytes(int64_t bytes) {
  metrics_->SetSummaryBytes(model_, method_, bytes);
}

void DecodeMetricsObserver::OnSequenceEnd(std::string_view outcome, int64_t completion_tokens) {
  metrics_->CountSequence(model_, outcome);
}

void DecodeMetricsObserver::ObserveQuality(double recall, double attention_mass) {
  metrics_->ObserveRecall(model_, method_, recall);
  metrics_->ObserveAttentionMass(model_, method_, attention_mass);
}

}  // namespace kvr::decode
