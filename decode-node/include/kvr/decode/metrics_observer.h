#pragma once
// The Prometheus side of DecodeObserver (owned by helper "metrics"): records a decode node's
// work in kvr::metrics::DecodeMetrics (kvr/common/metrics.h documents each metric). Stateless
// apart from the metric set, whose methods are thread-safe, so it is thread-safe too.
//
// The hooks carry no retrieval method: series with a method label get `method`, fixed at
// construction (the node's default method; "" when unknown). Retrieval quality
// (kvr_retrieval_recall, kvr_retrieval_attention_mass) has no hook yet: ObserveQuality is
// ready for the decode loop's sampled oracle comparison (--quality-sample-rate).

#include <cstdint>
#include <string>
#include <string_view>

#include "kvr/common/metrics.h"
#include "kvr/decode/observer.h"

namespace kvr::decode {

class DecodeMetricsObserver final : public DecodeObserver {
 public:
  // `metrics` is not owned and must outlive the observer; `model` is the served model name.
  DecodeMetricsObserver(metrics::DecodeMetrics* metrics, std::string model,
                        std::string method = "");

  void OnStep(const StepReport& step) override;
  void OnFetch(const FetchReport& fetch) override;
  void OnHotCache(int64_t hits, int64_t misses) override;
  void OnSummaryBytes(int64_t bytes) override;
  void OnSequenceEnd(std::string_view outcome, int64_t completion_tokens) override;

  // One sampled quality measurement (both 0..1): recall of the selected rows against the exact
  // top-k, and the attention mass the attended rows cover.
  void ObserveQuality(double recall, double attention_mass);

 private:
  metrics::DecodeMetrics* metrics_;
  const std::string model_;
  const std::string method_;
};

}  // namespace kvr::decode
