// PrefillMetrics: what it is told appears in the exposition, which promtool accepts.
#include "kvr/prefill_node/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "metrics_test_util.h"

// In the helpers' namespace (metrics_test_util.h): Offline, ExpectExposes, ExpectPromtoolClean,
// HttpGet.
namespace kvr::metrics::testing {
namespace {

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
  m.AddSummaryLayers("smol", "extended", 30);
  m.AddSummaryLayers("smol", "rebuilt", 2);
  const std::string text = server->ScrapeText();
  ExpectExposes(text,
                {"kvr_prefill_step_seconds_count{method=\"pariskv\",model=\"smol\"} 1",
                 "kvr_prefill_tokens_total{model=\"smol\"} 4096",
                 "kvr_kv_shipped_bytes_total{destination=\"store\",model=\"smol\"} 1048576",
                 "kvr_kv_shipped_bytes_total{destination=\"decode\",model=\"smol\"} 4096",
                 "kvr_requests_waiting{role=\"prefill\"} 3", "kvr_prefill_queued_tokens 12000",
                 "kvr_prefill_requests_total{model=\"smol\",outcome=\"ok\"} 1",
                 "kvr_prefill_index_layers_total{model=\"smol\",source=\"extended\"} 30",
                 "kvr_prefill_index_layers_total{model=\"smol\",source=\"rebuilt\"} 2"});
  ExpectPromtoolClean(text);
}

}  // namespace
}  // namespace kvr::metrics::testing
