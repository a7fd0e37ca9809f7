#include "kvr/decode/metrics_observer.h"

#include <utility>

namespace kvr::decode {

DecodeMetricsObserver::DecodeMetricsObserver(metrics::DecodeMetrics* metrics, std::string model,
                                             std::string default_method)
    : metrics_(metrics), model_(std::move(model)) {
  metrics_->SetWaiting(0);
  metrics_->SetBatchSize(model_, 0);
  metrics_->AddDecodeTokens(model_, 0);
  metrics_->AddFetched(model_, default_method, 0, 0);
  metrics_->AddHotCache(model_, default_method, 0, 0);
  metrics_->SetSummaryBytes(model_, default_method, 0);
  metrics_->AddOffloadedBytes(model_, 0);
  metrics_->AddQualitySampled(model_, default_method, /*selecting=*/true, 0);
  metrics_->AddQualitySampled(model_, default_method, /*selecting=*/false, 0);
}

void DecodeMetricsObserver::OnStep(const StepReport& step) {
  metrics_->ObserveDecodeStep(model_, step.seconds);
  metrics_->AddDecodeTokens(model_, static_cast<uint64_t>(step.tokens));
  metrics_->SetBatchSize(model_, step.batch_size);
  metrics_->SetWaiting(step.waiting);
}

void DecodeMetricsObserver::OnFetch(const FetchReport& fetch) {
  metrics_->ObserveFetchLatency(model_, fetch.seconds);
}

void DecodeMetricsObserver::OnRetrieval(std::string_view method, const RetrievalReport& report) {
  metrics_->AddFetched(model_, method, static_cast<uint64_t>(report.bytes_fetched),
                       static_cast<uint64_t>(report.rows_fetched));
  metrics_->AddHotCache(model_, method, static_cast<uint64_t>(report.hot_cache_hits),
                        static_cast<uint64_t>(report.hot_cache_misses));
}

void DecodeMetricsObserver::OnOffload(int64_t bytes) {
  metrics_->AddOffloadedBytes(model_, static_cast<uint64_t>(bytes));
}

void DecodeMetricsObserver::OnMethodSummaryBytes(std::string_view method, int64_t bytes) {
  metrics_->SetSummaryBytes(model_, method, bytes);
}

void DecodeMetricsObserver::OnSequenceEnd(std::string_view outcome, int64_t completion_tokens) {
  metrics_->CountSequence(model_, outcome);
}

void DecodeMetricsObserver::OnQualitySampled(std::string_view method, bool selecting) {
  metrics_->AddQualitySampled(model_, method, selecting, 1);
}

void DecodeMetricsObserver::ObserveQuality(std::string_view method, double recall,
                                           double attention_mass) {
  metrics_->ObserveRecall(model_, method, recall);
  metrics_->ObserveAttentionMass(model_, method, attention_mass);
}

}  // namespace kvr::decode
