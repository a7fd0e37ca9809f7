// ControllerMetrics: what it is told appears in the exposition, which promtool accepts.
#include "kvr/controller/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "metrics_test_util.h"

// In the helpers' namespace (metrics_test_util.h): Offline, ExpectExposes, ExpectPromtoolClean,
// HttpGet.
namespace kvr::metrics::testing {
namespace {

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
  ExpectExposes(text,
                {"kvr_time_to_first_token_seconds_count{method=\"clusterkv\",model=\"smol\"} 1",
                 "kvr_time_to_first_token_seconds_bucket{method=\"clusterkv\",model=\"smol\",le="
                 "\"0.25\"} 0",
                 "kvr_time_to_first_token_seconds_bucket{method=\"clusterkv\",model=\"smol\",le="
                 "\"0.5\"} 1",
                 "kvr_inter_token_latency_seconds_count{method=\"clusterkv\",model=\"smol\"} 3",
                 "kvr_inter_token_latency_seconds_bucket{method=\"clusterkv\",model=\"smol\",le="
                 "\"0.01\"} 3",
                 "kvr_e2e_request_latency_seconds_sum{method=\"clusterkv\",model=\"smol\"} 1.5",
                 "kvr_request_queue_time_seconds_count", "kvr_time_per_output_token_seconds_count",
                 "kvr_requests_total{method=\"clusterkv\",model=\"smol\",outcome=\"ok\"} 1",
                 "outcome=\"resource_exhausted\"} 1",
                 "kvr_request_success_total{finish_reason=\"length\",method=\"clusterkv\",model="
                 "\"smol\"} 1",
                 "kvr_requests_running 1", "kvr_prompt_tokens_total{model=\"smol\"} 100",
                 "kvr_generation_tokens_total{model=\"smol\"} 7",
                 "kvr_request_attempts_total{model=\"smol\"} 1",
                 "kvr_node_failures_total{role=\"decode\"} 1"});
  // Roles that saw no failure are exported at 0 (rate() works before the first failure).
  ExpectExposes(text, {"kvr_node_failures_total{role=\"prefill\"} 0",
                       "kvr_node_failures_total{role=\"store\"} 0"});
  ExpectPromtoolClean(text);
}

}  // namespace
}  // namespace kvr::metrics::testing
