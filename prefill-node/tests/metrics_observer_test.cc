#include "kvr/prefill_node/metrics_observer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "metrics_test_util.h"

namespace kvr::prefill_node {
namespace {

using metrics::testing::ExpectExposes;

TEST(PrefillMetricsObserverTest, RecordsQueueBytesAndOutcomes) {
  auto server = *metrics::MetricsServer::Start({.port = -1, .role = "prefill"});
  metrics::PrefillMetrics m(server->registry());
  PrefillMetricsObserver observer(&m, "smol");

  // A request rejected before queueing (tokenization) must not move the queue gauges.
  observer.OnFinished(absl::InvalidArgumentError("prompt"), nullptr, absl::Milliseconds(1));

  observer.OnQueued(100);
  std::thread other([&] {
    observer.OnQueued(50);
    const std::string text = server->ScrapeText();
    ExpectExposes(text,
                  {"kvr_requests_waiting{role=\"prefill\"} 1", "kvr_prefill_queued_tokens 150"});
    observer.OnFinished(absl::UnavailableError("store"), nullptr, absl::Seconds(1));
  });
  other.join();
  observer.OnLayerReady(0, absl::Milliseconds(2), 64, 4096);
  observer.OnLayerReady(1, absl::Milliseconds(2), 64, 4096);
  PrefillResult result;
  result.prompt_tokens = 100;
  result.method = "clusterkv";
  result.prefill_time = absl::Milliseconds(250);
  result.handoff_bytes = 1000;
  observer.OnFinished(absl::OkStatus(), &result, absl::Milliseconds(300));

  const std::string text = server->ScrapeText();
  ExpectExposes(text,
                {"kvr_requests_waiting{role=\"prefill\"} 0", "kvr_prefill_queued_tokens 0",
                 "kvr_prefill_tokens_total{model=\"smol\"} 100",
                 "kvr_kv_shipped_bytes_total{destination=\"store\",model=\"smol\"} 8192",
                 "kvr_kv_shipped_bytes_total{destination=\"decode\",model=\"smol\"} 1000",
                 "kvr_prefill_step_seconds_sum{method=\"clusterkv\",model=\"smol\"} 0.25",
                 "kvr_prefill_requests_total{model=\"smol\",outcome=\"ok\"} 1",
                 "kvr_prefill_requests_total{model=\"smol\",outcome=\"unavailable\"} 1",
                 "kvr_prefill_requests_total{model=\"smol\",outcome=\"invalid_argument\"} 1"});
}

}  // namespace
}  // namespace kvr::prefill_node
