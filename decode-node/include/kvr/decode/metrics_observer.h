#pragma once
// The Prometheus side of DecodeObserver: records a decode node's work in
// kvr::metrics::DecodeMetrics (kvr/decode/metrics.h documents each metric). Stateless
// apart from the metric set, whose methods are thread-safe, so it is thread-safe too.
//
// Per-method series (fetched bytes/rows, hot cache, summaries) come from the per-method hooks
// (OnRetrieval, OnMethodSummaryBytes); the all-method hooks (OnHotCache, OnSummaryBytes) are not
// recorded again. OnFetch gives only the gather latency (one gather serves every method).
// Retrieval quality (kvr_retrieval_recall, kvr_retrieval_attention_mass) comes from OnQuality,
// DecodeAttention's sampled oracle comparison (--quality-sample-rate), and the count of sampled
// steps that selected / had nothing to select from OnQualitySampled.

#include <cstdint>
#include <string>
#include <string_view>

#include "kvr/decode/metrics.h"
#include "kvr/decode/observer.h"

namespace kvr::decode {

class DecodeMetricsObserver final : public DecodeObserver {
 public:
  // `metrics` is not owned and must outlive the observer; `model` is the served model name;
  // the series of `default_method` (e.g. the cluster's default) exist from the start at 0, so
  // dashboards show 0 rather than nothing before the first request.
  DecodeMetricsObserver(metrics::DecodeMetrics* metrics, std::string model,
                        std::string default_method = "");

  void OnStep(const StepReport& step) override;
  void OnFetch(const FetchReport& fetch) override;
  void OnRetrieval(std::string_view method, const RetrievalReport& report) override;
  void OnOffload(int64_t bytes) override;
  void OnMethodSummaryBytes(std::string_view method, int64_t bytes) override;
  void OnSequenceEnd(std::string_view outcome, int64_t completion_tokens) override;
  void OnQuality(std::string_view method, double recall, double attention_mass) override {
    ObserveQuality(method, recall, attention_mass);
  }
  void OnQualitySampled(std::string_view method, bool selecting) override;

  // One sampled quality measurement (both 0..1): recall of the selected rows against the exact
  // top-k, and the attention mass the attended rows cover.
  void ObserveQuality(std::string_view method, double recall, double attention_mass);

 private:
  metrics::DecodeMetrics* metrics_;
  const std::string model_;
};

}  // namespace kvr::decode
