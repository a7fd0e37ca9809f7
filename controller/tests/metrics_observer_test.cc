#include "kvr/controller/metrics_observer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kvr/common/metrics.h"

#include "metrics_test_util.h"

namespace kvr::controller {
namespace {

using metrics::testing::ExpectExposes;
using ::testing::HasSubstr;

class MetricsObserverTest : public ::testing::Test {
 protected:
  MetricsObserverTest()
      : server_(*metrics::MetricsServer::Start({.port = -1, .role = "controller"})),
        metrics_(server_->registry()),
        observer_(&metrics_, &clock_) {
    params_.request_id = "r1";
    params_.model = "smol";
    params_.retrieval.method = "clusterkv";
    placement_.prefill.id = "p1";
    placement_.decode.id = "d1";
    placement_.store.id = "s1";
  }

  ManualClock clock_;
  std::unique_ptr<metrics::MetricsServer> server_;
  metrics::ControllerMetrics metrics_;
  MetricsObserver observer_;
  GenerateParams params_;
  PlacementDecision placement_;
};

TEST_F(MetricsObserverTest, SuccessfulRequestWithARetry) {
  observer_.OnAttempt(params_, placement_, 1);
  EXPECT_THAT(server_->ScrapeText(), HasSubstr("kvr_requests_running 1"));
  observer_.OnNodeFailure(params_, "p1", absl::UnavailableError("gone"));
  observer_.OnAttempt(params_, placement_, 2);
  clock_.Advance(absl::Milliseconds(300));
  observer_.OnFirstToken(params_, absl::Milliseconds(100), absl::Milliseconds(400));
  clock_.Advance(absl::Milliseconds(20));
  observer_.OnTokens(params_, 2);  // 2 tokens 20 ms after the first: 10 ms each
  clock_.Advance(absl::Milliseconds(30));
  observer_.OnTokens(params_, 1);
  FinalReport report;
  report.completion.finish_reason = FinishReason::kLength;
  report.completion.prompt_tokens = 50;
  report.completion.cached_tokens = 32;
  report.completion.completion_tokens = 4;
  report.time_to_first_token = absl::Milliseconds(400);
  report.decode = absl::Milliseconds(60);
  observer_.OnEnd(params_, absl::OkStatus(), &report);

  const std::string text = server_->ScrapeText();
  const std::string labels = "method=\"clusterkv\",model=\"smol\"";
  ExpectExposes(text, {"kvr_requests_running 0", "kvr_request_attempts_total{model=\"smol\"} 2",
                       "kvr_node_failures_total{role=\"prefill\"} 1",
                       "kvr_time_to_first_token_seconds_sum{" + labels + "} 0.4",
                       "kvr_request_queue_time_seconds_sum{" + labels + "} 0.1",
                       "kvr_inter_token_latency_seconds_count{" + labels + "} 3",
                       "kvr_inter_token_latency_seconds_sum{" + labels + "} 0.05",
                       "kvr_time_per_output_token_seconds_sum{" + labels + "} 0.02",
                       "kvr_e2e_request_latency_seconds_sum{" + labels + "} 0.46",
                       "kvr_requests_total{" + labels + ",outcome=\"ok\"} 1",
                       "kvr_request_success_total{finish_reason=\"length\"," + labels + "} 1",
                       "kvr_prompt_tokens_total{model=\"smol\"} 50",
                       "kvr_prompt_cached_tokens_total{model=\"smol\"} 32",
                       "kvr_prefix_cache_requests_total{model=\"smol\",result=\"hit\"} 1",
                       "kvr_generation_tokens_total{model=\"smol\"} 4"});
}

TEST_F(MetricsObserverTest, FailureBeforeFirstTokenAndRejection) {
  observer_.OnAttempt(params_, placement_, 1);
  clock_.Advance(absl::Seconds(2));
  observer_.OnEnd(params_, absl::DeadlineExceededError("deadline"), nullptr);
  observer_.OnRejected(absl::ResourceExhaustedError("full"));
  const std::string text = server_->ScrapeText();
  ExpectExposes(
      text,
      {"kvr_requests_running 0",
       "kvr_requests_total{method=\"clusterkv\",model=\"smol\",outcome=\"deadline_exceeded\"} 1",
       "kvr_requests_total{method=\"\",model=\"\",outcome=\"resource_exhausted\"} 1",
       "kvr_e2e_request_latency_seconds_sum{method=\"clusterkv\",model=\"smol\"} 2"});
  EXPECT_THAT(text, ::testing::Not(HasSubstr("kvr_request_success_total{")));
}

}  // namespace
}  // namespace kvr::controller
