#include "kvr/decode/metrics_observer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "metrics_test_util.h"

namespace kvr::decode {
namespace {

using metrics::testing::ExpectExposes;

TEST(DecodeMetricsObserverTest, RecordsStepsFetchesCacheAndQuality) {
  auto server = *metrics::MetricsServer::Start({.port = -1, .role = "decode"});
  metrics::DecodeMetrics m(server->registry());
  DecodeMetricsObserver observer(&m, "smol", "clusterkv");
  const std::string before = server->ScrapeText();
  ExpectExposes(
      before, {"kvr_decode_tokens_total{model=\"smol\"} 0",
               "kvr_kv_fetched_bytes_total{method=\"clusterkv\",model=\"smol\"} 0",
               "kvr_retrieval_selecting_samples_total{method=\"clusterkv\",model=\"smol\"} 0",
               "kvr_retrieval_nonselecting_samples_total{method=\"clusterkv\",model=\"smol\"} 0"});

  observer.OnStep({.seconds = 0.02, .batch_size = 3, .tokens = 3, .waiting = 1});
  observer.OnStep({.seconds = 0.03, .batch_size = 2, .tokens = 2, .waiting = 0});
  observer.OnFetch({.seconds = 0.001, .rows = 10, .bytes = 5120});
  observer.OnHotCache(6, 2);  // the all-method totals: not counted again
  observer.OnRetrieval(
      "clusterkv",
      {.hot_cache_hits = 6, .hot_cache_misses = 2, .rows_fetched = 10, .bytes_fetched = 5120});
  observer.OnRetrieval(
      "quest",
      {.hot_cache_hits = 1, .hot_cache_misses = 1, .rows_fetched = 1, .bytes_fetched = 512});
  observer.OnOffload(2048);
  observer.OnSummaryBytes(3 << 20);  // all methods: not recorded
  observer.OnMethodSummaryBytes("clusterkv", 1 << 20);
  observer.OnSequenceEnd("eos", 5);
  observer.OnQualitySampled("clusterkv", /*selecting=*/true);
  observer.ObserveQuality("clusterkv", 0.9, 0.99);
  observer.OnQualitySampled("clusterkv", /*selecting=*/false);
  observer.OnQualitySampled("clusterkv", /*selecting=*/false);

  const std::string text = server->ScrapeText();
  const std::string labels = "method=\"clusterkv\",model=\"smol\"";
  ExpectExposes(
      text,
      {"kvr_decode_step_seconds_count{model=\"smol\"} 2",
       "kvr_decode_tokens_total{model=\"smol\"} 5", "kvr_decode_batch_size{model=\"smol\"} 2",
       "kvr_requests_waiting{role=\"decode\"} 0", "kvr_kv_fetched_bytes_total{" + labels + "} 5120",
       "kvr_kv_fetched_rows_total{" + labels + "} 10",
       "kvr_kv_fetch_latency_seconds_count{model=\"smol\"} 1",
       "kvr_hot_cache_hits_total{" + labels + "} 6", "kvr_hot_cache_misses_total{" + labels + "} 2",
       "kvr_hot_cache_hit_ratio{" + labels + "} 0.75",
       "kvr_summaries_bytes{" + labels + "} 1048576",
       "kvr_kv_fetched_bytes_total{method=\"quest\",model=\"smol\"} 512",
       "kvr_hot_cache_hit_ratio{method=\"quest\",model=\"smol\"} 0.5",
       "kvr_kv_offloaded_bytes_total{model=\"smol\"} 2048",
       "kvr_decode_sequences_total{model=\"smol\",outcome=\"eos\"} 1",
       "kvr_retrieval_recall_count{" + labels + "} 1",
       "kvr_retrieval_attention_mass_sum{" + labels + "} 0.99",
       "kvr_retrieval_selecting_samples_total{" + labels + "} 1",
       "kvr_retrieval_nonselecting_samples_total{" + labels + "} 2"});
}

}  // namespace
}  // namespace kvr::decode
