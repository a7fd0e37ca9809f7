// DecodeMetrics: what it is told appears in the exposition, which promtool accepts.
#include "kvr/decode/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "metrics_test_util.h"

// In the helpers' namespace (metrics_test_util.h): Offline, ExpectExposes, ExpectPromtoolClean,
// HttpGet.
namespace kvr::metrics::testing {
namespace {

TEST(DecodeMetricsTest, RecordsWhatItIsTold) {
  auto server = Offline("decode");
  DecodeMetrics m(server->registry());
  m.ObserveDecodeStep("smol", 0.02);
  m.AddDecodeTokens("smol", 4);
  m.SetBatchSize("smol", 4);
  m.SetWaiting(2);
  m.AddFetched("smol", "ctkvr", 5120, 10);
  m.AddFetched("smol", "ctkvr", 512, 1);
  m.ObserveFetchLatency("smol", 0.0003);
  m.AddOffloadedBytes("smol", 2048);
  m.AddHotCache("smol", "ctkvr", 3, 1);
  m.SetSummaryBytes("smol", "ctkvr", 1 << 16);
  m.ObserveRecall("smol", "ctkvr", 0.85);
  m.ObserveAttentionMass("smol", "ctkvr", 0.97);
  m.AddQualitySampled("smol", "ctkvr", /*selecting=*/true, 1);
  m.AddQualitySampled("smol", "ctkvr", /*selecting=*/false, 3);
  m.CountSequence("smol", "ok");
  const std::string text = server->ScrapeText();
  ExpectExposes(
      text, {"kvr_decode_step_seconds_count{model=\"smol\"} 1",
             "kvr_decode_tokens_total{model=\"smol\"} 4", "kvr_decode_batch_size{model=\"smol\"} 4",
             "kvr_requests_waiting{role=\"decode\"} 2",
             "kvr_kv_fetched_bytes_total{method=\"ctkvr\",model=\"smol\"} 5632",
             "kvr_kv_fetched_rows_total{method=\"ctkvr\",model=\"smol\"} 11",
             "kvr_kv_fetch_latency_seconds_count{model=\"smol\"} 1",
             "kvr_kv_offloaded_bytes_total{model=\"smol\"} 2048",
             "kvr_hot_cache_hits_total{method=\"ctkvr\",model=\"smol\"} 3",
             "kvr_hot_cache_misses_total{method=\"ctkvr\",model=\"smol\"} 1",
             "kvr_hot_cache_hit_ratio{method=\"ctkvr\",model=\"smol\"} 0.75",
             "kvr_summaries_bytes{method=\"ctkvr\",model=\"smol\"} 65536",
             "kvr_retrieval_recall_bucket{method=\"ctkvr\",model=\"smol\",le=\"0.8\"} 0",
             "kvr_retrieval_recall_bucket{method=\"ctkvr\",model=\"smol\",le=\"0.9\"} 1",
             "kvr_retrieval_attention_mass_bucket{method=\"ctkvr\",model=\"smol\",le=\"0.98\"} 1",
             "kvr_decode_sequences_total{model=\"smol\",outcome=\"ok\"} 1",
             "kvr_retrieval_selecting_samples_total{method=\"ctkvr\",model=\"smol\"} 1",
             "kvr_retrieval_nonselecting_samples_total{method=\"ctkvr\",model=\"smol\"} 3"});
  ExpectPromtoolClean(text);
}

}  // namespace
}  // namespace kvr::metrics::testing
