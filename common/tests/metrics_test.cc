// MetricsServer: the registry, build and node info, scrape hooks and the HTTP server.
#include "kvr/common/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kvr/common/metric_families.h"
#include "metrics_test_util.h"

// In the helpers' namespace (metrics_test_util.h): Offline, ExpectExposes, ExpectPromtoolClean,
// HttpGet.
namespace kvr::metrics::testing {
namespace {

using ::testing::HasSubstr;

TEST(MetricsServerTest, DisabledServesNothingButRecordsInfo) {
  auto server = Offline("decode");
  EXPECT_EQ(server->port(), 0);
  EXPECT_FALSE(server->serving());
  const std::string text = server->ScrapeText();
  ExpectExposes(text, {"kvr_node_info{name=\"decode-0\",role=\"decode\"} 1", "kvr_build_info{"});
}

TEST(MetricsServerTest, RejectsBadPort) {
  EXPECT_FALSE(MetricsServer::Start({.port = 70000}).ok());
}

TEST(MetricsServerTest, PortZeroPicksAPortAndServesHttp) {
  auto server = MetricsServer::Start({.host = "127.0.0.1", .port = 0, .role = "store"});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  // A polled value, refreshed by a scrape hook before every scrape.
  prometheus::Gauge& polled =
      GaugeFamily((*server)->registry(), "kvr_test_polled", "Scrapes so far").Add({});
  uint64_t polls = 0;
  (*server)->AddScrapeHook([&] {
    ++polls;
    polled.Set(static_cast<double>(10 * polls));
  });
  absl::StatusOr<std::string> body = HttpGet((*server)->port());
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(polls, 1u);
  EXPECT_THAT(*body, HasSubstr("kvr_test_polled 10"));
  body = HttpGet((*server)->port());
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("kvr_test_polled 20"));
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

}  // namespace
}  // namespace kvr::metrics::testing
