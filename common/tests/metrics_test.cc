#include "kvr/common/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "metrics_test_util.h"

namespace kvr::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

#ifndef KVR_PROMTOOL
#define KVR_PROMTOOL "promtool"
#endif

std::unique_ptr<MetricsServer> Offline(const std::string& role) {
  auto server = MetricsServer::Start({.port = -1, .role = role, .node_name = role + "-0"});
  EXPECT_TRUE(server.ok()) << server.status();
  return std::move(*server);
}

void ExpectPromtoolClean(const std::string& text) {
  if (std::string(KVR_PROMTOOL).empty()) GTEST_SKIP() << "promtool not found at configure time";
  int code = 0;
  const std::string out = testing::PromtoolCheck(text, &code, KVR_PROMTOOL);
  EXPECT_EQ(code, 0) << out << "\n--- exposition ---\n" << text;
  EXPECT_EQ(out, "") << text;
}

TEST(MetricsServerTest, DisabledServesNothingButRecordsInfo) {
  auto server = Offline("decode");
  EXPECT_EQ(server->port(), 0);
  EXPECT_FALSE(server->serving());
  const std::string text = server->ScrapeText();
  EXPECT_THAT(text, HasSubstr("kvr_node_info{name=\"decode-0\",role=\"decode\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_build_info{"));
}

TEST(MetricsServerTest, RejectsBadPort) {
  EXPECT_FALSE(MetricsServer::Start({.port = 70000}).ok());
}

TEST(MetricsServerTest, PortZeroPicksAPortAndServesHttp) {
  auto server = MetricsServer::Start({.host = "127.0.0.1", .port = 0, .role = "store"});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  StoreMetrics store((*server)->registry());
  uint64_t polls = 0;
  (*server)->AddScrapeHook([&] {
    ++polls;
    store.Update({.capacity_bytes = 1000, .used_bytes = 10 * polls, .evictions = polls});
  });
  absl::StatusOr<std::string> body = testing::HttpGet((*server)->port());
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(polls, 1u);
  EXPECT_THAT(*body, HasSubstr("kvr_store_capacity_bytes 1000"));
  EXPECT_THAT(*body, HasSubstr("kvr_store_used_bytes 10"));
  body = testing::HttpGet((*server)->port());
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("kvr_store_used_bytes 20"));
  EXPECT_THAT(*body, HasSubstr("kvr_store_evictions_total 2"));
  ExpectPromtoolClean(*body);
  (*server)->ClearScrapeHooks();
}

TEST(MetricsServerTest, BusyPortIsUnavailable) {
  auto first = MetricsServer::Start({.host = "127.0.0.1", .port = 0});
  ASSERT_TRUE(first.ok());
  auto second = MetricsServer::Start({.host = "127.0.0.1", .port = (*first)->port()});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

TEST(ControllerMetricsTest, RecordsWhatItIsTold) {
  auto server = Offline("controller");
  ControllerMetrics m(server->registry());
  m.ObserveTimeToFirstToken("smol", "clusterkv", 0.3);
  m.ObserveQueueTime("smol", "clusterkv", 0.002);
  m.ObserveInterTokenLatency("smol", "clusterkv", 0.03, 3);
  m.ObserveTimePerOutputToken("smol", "clusterkv", 0.01);
  m.ObserveE2eLatency("smol", "clusterkv", 1.5);
  m.CountRequest("smol", "clusterkv", "ok");
  m.CountRequest("", "", "resource_exhausted");
  m.CountSuccess("smol", "clusterkv", "length");
  m.RequestStarted();
  m.RequestStarted();
  m.RequestEnded();
  m.AddPromptTokens("smol", 100);
  m.AddGenerationTokens("smol", 7);
  m.CountAttempt("smol");
  m.CountNodeFailure("decode");
  const std::string text = server->ScrapeText();
  EXPECT_THAT(
      text,
      HasSubstr("kvr_time_to_first_token_seconds_count{method=\"clusterkv\",model=\"smol\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_time_to_first_token_seconds_bucket{method=\"clusterkv\",model="
                              "\"smol\",le=\"0.25\"} 0"));
  EXPECT_THAT(text, HasSubstr("kvr_time_to_first_token_seconds_bucket{method=\"clusterkv\",model="
                              "\"smol\",le=\"0.5\"} 1"));
  EXPECT_THAT(
      text,
      HasSubstr("kvr_inter_token_latency_seconds_count{method=\"clusterkv\",model=\"smol\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvr_inter_token_latency_seconds_bucket{method=\"clusterkv\",model="
                              "\"smol\",le=\"0.01\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvr_e2e_request_latency_seconds_sum{method=\"clusterkv\","
                              "model=\"smol\"} 1.5"));
  EXPECT_THAT(text, HasSubstr("kvr_request_queue_time_seconds_count"));
  EXPECT_THAT(text, HasSubstr("kvr_time_per_output_token_seconds_count"));
  EXPECT_THAT(
      text, HasSubstr("kvr_requests_total{method=\"clusterkv\",model=\"smol\",outcome=\"ok\"} 1"));
  EXPECT_THAT(text, HasSubstr("outcome=\"resource_exhausted\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_request_success_total{finish_reason=\"length\","
                              "method=\"clusterkv\",model=\"smol\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_requests_running 1"));
  EXPECT_THAT(text, HasSubstr("kvr_prompt_tokens_total{model=\"smol\"} 100"));
  EXPECT_THAT(text, HasSubstr("kvr_generation_tokens_total{model=\"smol\"} 7"));
  EXPECT_THAT(text, HasSubstr("kvr_request_attempts_total{model=\"smol\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_node_failures_total{role=\"decode\"} 1"));
  // Roles that saw no failure are exported at 0 (rate() works before the first failure).
  EXPECT_THAT(text, HasSubstr("kvr_node_failures_total{role=\"prefill\"} 0"));
  EXPECT_THAT(text, HasSubstr("kvr_node_failures_total{role=\"store\"} 0"));
  ExpectPromtoolClean(text);
}

TEST(PrefillMetricsTest, RecordsWhatItIsTold) {
  auto server = Offline("prefill");
  PrefillMetrics m(server->registry());
  m.ObservePrefillStep("smol", "pariskv", 0.8);
  m.AddPrefillTokens("smol", 4096);
  m.AddShippedBytes("smol", "store", 1 << 20);
  m.AddShippedBytes("smol", "decode", 4096);
  m.SetWaiting(3);
  m.SetQueuedTokens(12000);
  m.CountPrefill("smol", "ok");
  const std::string text = server->ScrapeText();
  EXPECT_THAT(text,
              HasSubstr("kvr_prefill_step_seconds_count{method=\"pariskv\",model=\"smol\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_prefill_tokens_total{model=\"smol\"} 4096"));
  EXPECT_THAT(
      text, HasSubstr("kvr_kv_shipped_bytes_total{destination=\"store\",model=\"smol\"} 1048576"));
  EXPECT_THAT(text,
              HasSubstr("kvr_kv_shipped_bytes_total{destination=\"decode\",model=\"smol\"} 4096"));
  EXPECT_THAT(text, HasSubstr("kvr_requests_waiting{role=\"prefill\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvr_prefill_queued_tokens 12000"));
  EXPECT_THAT(text, HasSubstr("kvr_prefill_requests_total{model=\"smol\",outcome=\"ok\"} 1"));
  ExpectPromtoolClean(text);
}

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
  m.CountSequence("smol", "ok");
  const std::string text = server->ScrapeText();
  EXPECT_THAT(text, HasSubstr("kvr_decode_step_seconds_count{model=\"smol\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_decode_tokens_total{model=\"smol\"} 4"));
  EXPECT_THAT(text, HasSubstr("kvr_decode_batch_size{model=\"smol\"} 4"));
  EXPECT_THAT(text, HasSubstr("kvr_requests_waiting{role=\"decode\"} 2"));
  EXPECT_THAT(text, HasSubstr("kvr_kv_fetched_bytes_total{method=\"ctkvr\",model=\"smol\"} 5632"));
  EXPECT_THAT(text, HasSubstr("kvr_kv_fetched_rows_total{method=\"ctkvr\",model=\"smol\"} 11"));
  EXPECT_THAT(text, HasSubstr("kvr_kv_fetch_latency_seconds_count{model=\"smol\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_kv_offloaded_bytes_total{model=\"smol\"} 2048"));
  EXPECT_THAT(text, HasSubstr("kvr_hot_cache_hits_total{method=\"ctkvr\",model=\"smol\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvr_hot_cache_misses_total{method=\"ctkvr\",model=\"smol\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_hot_cache_hit_ratio{method=\"ctkvr\",model=\"smol\"} 0.75"));
  EXPECT_THAT(text, HasSubstr("kvr_summaries_bytes{method=\"ctkvr\",model=\"smol\"} 65536"));
  EXPECT_THAT(
      text, HasSubstr("kvr_retrieval_recall_bucket{method=\"ctkvr\",model=\"smol\",le=\"0.8\"} 0"));
  EXPECT_THAT(
      text, HasSubstr("kvr_retrieval_recall_bucket{method=\"ctkvr\",model=\"smol\",le=\"0.9\"} 1"));
  EXPECT_THAT(
      text,
      HasSubstr(
          "kvr_retrieval_attention_mass_bucket{method=\"ctkvr\",model=\"smol\",le=\"0.98\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_decode_sequences_total{model=\"smol\",outcome=\"ok\"} 1"));
  ExpectPromtoolClean(text);
}

TEST(StoreMetricsTest, CountersFollowMonotonicFieldsAcrossAReset) {
  auto server = Offline("store");
  StoreMetrics m(server->registry());
  m.Update({.capacity_bytes = 1 << 30,
            .used_bytes = 4096,
            .total_pages = 10,
            .free_pages = 7,
            .sequences = 2,
            .evictions = 3,
            .expired_sequences = 1,
            .bytes_written = 100,
            .bytes_read = 50});
  m.Update({.capacity_bytes = 1 << 30,
            .used_bytes = 8192,
            .total_pages = 10,
            .free_pages = 6,
            .sequences = 2,
            .evictions = 5,
            .expired_sequences = 1,
            .bytes_written = 300,
            .bytes_read = 50});
  m.Update({.capacity_bytes = 1 << 30,
            .used_bytes = 8192,
            .total_pages = 10,
            .free_pages = 6,
            .sequences = 2,
            .evictions = 1,
            .expired_sequences = 1,
            .bytes_written = 300,
            .bytes_read = 60});  // evictions went back: counted from zero
  const std::string text = server->ScrapeText();
  EXPECT_THAT(text, HasSubstr("kvr_store_capacity_bytes 1073741824"));
  EXPECT_THAT(text, HasSubstr("kvr_store_used_bytes 8192"));
  EXPECT_THAT(text, HasSubstr("kvr_store_pages{state=\"free\"} 6"));
  EXPECT_THAT(text, HasSubstr("kvr_store_pages{state=\"used\"} 4"));
  EXPECT_THAT(text, HasSubstr("kvr_store_sequences 2"));
  EXPECT_THAT(text, HasSubstr("kvr_store_evictions_total 6"));
  EXPECT_THAT(text, HasSubstr("kvr_store_expired_sequences_total 1"));
  EXPECT_THAT(text, HasSubstr("kvr_store_written_bytes_total 300"));
  EXPECT_THAT(text, HasSubstr("kvr_store_read_bytes_total 60"));
  ExpectPromtoolClean(text);
}

TEST(MetricsTest, AllSetsInOneRegistryPassPromtool) {
  // kvr_requests_waiting is shared by prefill and decode (label role); one registry holding
  // every set must still be one well-formed exposition.
  auto server = Offline("all");
  ControllerMetrics c(server->registry());
  PrefillMetrics p(server->registry());
  DecodeMetrics d(server->registry());
  StoreMetrics s(server->registry());
  p.SetWaiting(1);
  d.SetWaiting(2);
  const std::string text = server->ScrapeText();
  EXPECT_THAT(text, HasSubstr("kvr_requests_waiting{role=\"prefill\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvr_requests_waiting{role=\"decode\"} 2"));
  EXPECT_THAT(text, Not(HasSubstr("NaN")));
  ExpectPromtoolClean(text);
}

}  // namespace
}  // namespace kvr::metrics
