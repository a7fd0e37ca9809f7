// Every role's metric set in one registry: still one well-formed exposition (series that two
// roles share, e.g. kvr_requests_waiting by label role, must not clash).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "kvr/controller/metrics.h"
#include "kvr/decode/metrics.h"
#include "kvr/kv_store/metrics.h"
#include "kvr/prefill_node/metrics.h"
#include "metrics_test_util.h"

// In the helpers' namespace (metrics_test_util.h): Offline, ExpectPromtoolClean, HttpGet.
namespace kvr::metrics::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

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
}  // namespace kvr::metrics::testing
