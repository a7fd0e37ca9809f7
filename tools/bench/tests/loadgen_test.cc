// Unit tests of kvr::loadgen: arrival schedules, percentile math and metrics, datasets and
// JSONL errors, and the result JSON's keys (the vllm `--save-result` layout).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "kvr/common/paths.h"
#include "kvr/loadgen/dataset.h"
#include "kvr/loadgen/metrics.h"
#include "kvr/loadgen/progress.h"
#include "kvr/loadgen/report.h"
#include "kvr/loadgen/schedule.h"
#include "kvr/model/gguf.h"
#include "kvr/model/loader.h"
#include "kvr/model/tokenizer.h"

namespace kvr::loadgen {
namespace {

using ::testing::HasSubstr;

std::vector<double> Arrivals(const ArrivalOptions& o, int n) {
  ArrivalSchedule s(o);
  std::vector<double> t;
  for (int i = 0; i < n; ++i) t.push_back(s.Next());
  return t;
}

TEST(ScheduleTest, ConstantRateIsEvenlySpaced) {
  const std::vector<double> t = Arrivals({.rate = 4.0}, 9);
  for (int i = 0; i < 9; ++i) EXPECT_NEAR(t[i], 0.25 * i, 1e-12) << i;
}

TEST(ScheduleTest, InfiniteRateSendsAllAtOnce) {
  for (double t : Arrivals({}, 5)) EXPECT_EQ(t, 0.0);
}

TEST(ScheduleTest, PoissonHasTheMeanRateAndExponentialGaps) {
  const int n = 20000;
  const std::vector<double> t = Arrivals({.rate = 50.0, .poisson = true, .seed = 7}, n + 1);
  const double mean_gap = t[n] / n;
  EXPECT_NEAR(1.0 / mean_gap, 50.0, 50.0 * 0.03);
  // Exponential gaps: standard deviation equals the mean (a constant rate would give 0).
  double var = 0;
  for (int i = 1; i <= n; ++i) var += std::pow(t[i] - t[i - 1] - mean_gap, 2);
  EXPECT_NEAR(std::sqrt(var / n), mean_gap, mean_gap * 0.05);
}

TEST(ScheduleTest, PoissonIsDeterministicPerSeed) {
  const ArrivalOptions a{.rate = 10.0, .poisson = true, .seed = 1};
  ArrivalOptions b = a;
  b.seed = 2;
  EXPECT_EQ(Arrivals(a, 50), Arrivals(a, 50));
  EXPECT_NE(Arrivals(a, 50), Arrivals(b, 50));
}

TEST(ScheduleTest, BurstinessKeepsTheMeanRate) {
  const int n = 20000;
  const std::vector<double> t =
      Arrivals({.rate = 20.0, .poisson = true, .burstiness = 4.0, .seed = 3}, n + 1);
  EXPECT_NEAR(n / t[n], 20.0, 20.0 * 0.03);
}

TEST(ScheduleTest, RejectsBadOptions) {
  EXPECT_FALSE(ValidateArrivalOptions({.rate = 0}).ok());
  EXPECT_FALSE(ValidateArrivalOptions({.rate = -1}).ok());
  EXPECT_FALSE(ValidateArrivalOptions({.rate = std::nan("")}).ok());
  EXPECT_FALSE(ValidateArrivalOptions({.rate = 1, .burstiness = 0}).ok());
  EXPECT_TRUE(ValidateArrivalOptions({}).ok());
}

TEST(MetricsTest, PercentileInterpolatesLikeNumpy) {
  const std::vector<double> v = {1, 2, 3, 4};
  // numpy.percentile([1, 2, 3, 4], [0, 50, 90, 99, 100]) = [1, 2.5, 3.7, 3.97, 4]
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 2.5);
  EXPECT_NEAR(Percentile(v, 90), 3.7, 1e-12);
  EXPECT_NEAR(Percentile(v, 99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 4);
  EXPECT_DOUBLE_EQ(Percentile({5}, 99), 5);
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0);
}

TEST(MetricsTest, SummarizeInMilliseconds) {
  const Distribution d = Summarize({0.004, 0.001, 0.003, 0.002});
  EXPECT_NEAR(d.mean_ms, 2.5, 1e-9);
  EXPECT_NEAR(d.median_ms, 2.5, 1e-9);
  EXPECT_NEAR(d.std_ms, std::sqrt(1.25), 1e-9);  // population std
  EXPECT_NEAR(d.p90_ms, 3.7, 1e-9);
  EXPECT_NEAR(d.p99_ms, 3.97, 1e-9);
}

RequestResult Ok(double ttft, double latency, uint32_t out, std::vector<double> itl = {}) {
  RequestResult r;
  r.success = true;
  r.prompt_len = 10;
  r.output_len = out;
  r.ttft_s = ttft;
  r.latency_s = latency;
  r.itl_s = std::move(itl);
  return r;
}

TEST(MetricsTest, ThroughputTpotGoodputAndErrors) {
  std::vector<RequestResult> results = {Ok(0.1, 1.1, 11, {0.1, 0.1}), Ok(0.5, 0.5, 1),
                                        Ok(0.2, 2.2, 5)};
  RequestResult failed;
  failed.error_code = "UNAVAILABLE";
  results.push_back(failed);
  results.push_back(failed);
  results[0].bytes_fetched = 1000;
  results[0].hot_cache_hits = 3;
  results[0].hot_cache_misses = 1;
  const BenchmarkMetrics m = ComputeMetrics(results, 2.0, {.ttft_ms = 300, .tpot_ms = 200});
  EXPECT_EQ(m.completed, 3u);
  EXPECT_EQ(m.failed, 2u);
  EXPECT_EQ(m.errors_by_code.at("UNAVAILABLE"), 2u);
  EXPECT_EQ(m.total_input, 30u);
  EXPECT_EQ(m.total_output, 17u);
  EXPECT_DOUBLE_EQ(m.request_throughput, 1.5);
  EXPECT_DOUBLE_EQ(m.output_throughput, 8.5);
  EXPECT_DOUBLE_EQ(m.total_token_throughput, 23.5);
  // TPOTs: (1.1 - 0.1) / 10 = 0.1 and (2.2 - 0.2) / 4 = 0.5; the 1-token request has none.
  EXPECT_NEAR(m.tpot.mean_ms, 300, 1e-9);
  // Good: request 0 (ttft 100 ms, tpot 100 ms). Request 1 misses TTFT, request 2 TPOT.
  ASSERT_TRUE(m.request_goodput.has_value());
  EXPECT_DOUBLE_EQ(*m.request_goodput, 0.5);
  EXPECT_NEAR(m.itl.mean_ms, 100, 1e-9);
  EXPECT_NEAR(m.retrieval_bytes_per_token, 1000.0 / 17, 1e-9);
  ASSERT_TRUE(m.hot_cache_hit_rate.has_value());
  EXPECT_DOUBLE_EQ(*m.hot_cache_hit_rate, 0.75);
  EXPECT_FALSE(m.passkey_accuracy.has_value());
}

TEST(MetricsTest, NoSloMeansNoGoodput) {
  const BenchmarkMetrics m = ComputeMetrics({Ok(0.1, 0.2, 2)}, 1.0, {});
  EXPECT_FALSE(m.request_goodput.has_value());
  EXPECT_FALSE(m.hot_cache_hit_rate.has_value());
}

TEST(DatasetTest, SyntheticPromptsHitTheirLengthInWords) {
  const auto prompts = SyntheticPrompts(20, {.input_len = 200, .input_len_range = 50, .seed = 4});
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  ASSERT_EQ(prompts->size(), 20u);
  bool differ = false;
  for (const Prompt& p : *prompts) {
    EXPECT_GE(p.approx_tokens, 150u);
    EXPECT_LE(p.approx_tokens, 250u);
    differ |= p.approx_tokens != (*prompts)[0].approx_tokens;
  }
  EXPECT_TRUE(differ) << "a length range should give different lengths";
  const auto again = SyntheticPrompts(20, {.input_len = 200, .input_len_range = 50, .seed = 4});
  EXPECT_EQ((*again)[7].text, (*prompts)[7].text);
}

TEST(DatasetTest, SyntheticPromptsFollowATokenCounter) {
  // A "tokenizer" that counts characters / 4: the prompt is resized to ~target characters * 4.
  const TokenCounter chars = [](std::string_view t) -> absl::StatusOr<uint32_t> {
    return static_cast<uint32_t>(t.size() / 4);
  };
  const auto prompts = SyntheticPrompts(5, {.input_len = 300}, chars);
  ASSERT_TRUE(prompts.ok());
  for (const Prompt& p : *prompts) {
    EXPECT_NEAR(p.approx_tokens, 300.0, 15.0);
    EXPECT_NEAR(p.text.size() / 4.0, 300.0, 15.0);
  }
}

// The SmolLM2 tokenizer (what `kvr bench --tokenizer-model` loads): generated prompts land
// within 2% of their target token count.
TEST(DatasetTest, PromptsSizedWithTheModelTokenizer) {
  auto file = model::GgufFile::Open(TestModelPath());
  ASSERT_TRUE(file.ok()) << TestModelPath() << ": " << file.status();
  auto spec = model::TokenizerSpecFromGguf(*file);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto tokenizer = model::Tokenizer::FromGgufMetadata(*spec);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const TokenCounter count = [&](std::string_view text) -> absl::StatusOr<uint32_t> {
    auto ids = tokenizer->Encode(text, {.add_special = false});
    if (!ids.ok()) return ids.status();
    return static_cast<uint32_t>(ids->size());
  };
  for (const bool passkey : {false, true}) {
    const GeneratedDatasetOptions o{.input_len = 2000, .seed = 5};
    const auto prompts = passkey ? PasskeyPrompts(3, o, count) : SyntheticPrompts(3, o, count);
    ASSERT_TRUE(prompts.ok()) << prompts.status();
    for (const Prompt& p : *prompts) {
      const uint32_t actual = *count(p.text);
      EXPECT_EQ(p.approx_tokens, actual);
      EXPECT_NEAR(actual, 2000.0, 40.0) << (passkey ? "passkey" : "synthetic");
    }
  }
}

TEST(DatasetTest, PasskeyPromptsCarryTheirKey) {
  const auto prompts = PasskeyPrompts(10, {.input_len = 500, .seed = 9});
  ASSERT_TRUE(prompts.ok());
  for (const Prompt& p : *prompts) {
    ASSERT_EQ(p.passkey.size(), 5u);
    EXPECT_THAT(p.text, HasSubstr("The pass key is " + p.passkey + "."));
    EXPECT_THAT(p.text, HasSubstr("What is the pass key?"));
    EXPECT_NEAR(p.approx_tokens, 500.0, 40.0);
    EXPECT_TRUE(PasskeyAnswered(p, " " + p.passkey + "."));
    EXPECT_FALSE(PasskeyAnswered(p, " 00000"));
  }
}

absl::StatusOr<std::vector<Prompt>> Parse(const std::string& text) {
  std::istringstream in(text);
  return ParseJsonl(in, "f.jsonl");
}

TEST(DatasetTest, JsonlPromptsAndMessages) {
  const auto prompts = Parse(
      "{\"prompt\": \"hello there world\", \"max_tokens\": 7}\n"
      "\n"
      "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"},"
      " {\"role\": \"user\", \"content\": \"hi\"}]}\n");
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  ASSERT_EQ(prompts->size(), 2u);
  EXPECT_EQ((*prompts)[0].text, "hello there world");
  EXPECT_EQ((*prompts)[0].max_tokens, 7u);
  EXPECT_EQ((*prompts)[0].approx_tokens, 3u);
  ASSERT_EQ((*prompts)[1].messages.size(), 2u);
  EXPECT_EQ((*prompts)[1].messages[1].role, "user");
  EXPECT_FALSE((*prompts)[1].max_tokens.has_value());
}

TEST(DatasetTest, JsonlErrorsNameTheLine) {
  struct Case {
    std::string text, message;
  };
  const std::vector<Case> cases = {
      {"{\"prompt\": \"a\"}\n{not json\n", "f.jsonl:2: not valid JSON"},
      {"[1, 2]\n", "f.jsonl:1: expected a JSON object"},
      {"{\"text\": \"a\"}\n", "f.jsonl:1: needs exactly one of"},
      {"{\"prompt\": \"a\", \"messages\": []}\n", "needs exactly one of"},
      {"{\"prompt\": \"\"}\n", "\"prompt\" must be a non-empty string"},
      {"{\"prompt\": 5}\n", "\"prompt\" must be a non-empty string"},
      {"{\"messages\": [{\"role\": \"user\"}]}\n", "messages[0] needs string"},
      {"{\"messages\": []}\n", "\"messages\" must be a non-empty array"},
      {"{\"prompt\": \"a\", \"max_tokens\": 0}\n", "\"max_tokens\" must be a positive integer"},
      {"{\"prompt\": \"a\", \"max_tokens\": \"5\"}\n", "\"max_tokens\" must be a positive"},
      {"\n\n", "f.jsonl: no prompts"},
  };
  for (const Case& c : cases) {
    const auto r = Parse(c.text);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message)) << c.text;
  }
  EXPECT_EQ(LoadJsonl("/nonexistent/x.jsonl").status().code(), absl::StatusCode::kNotFound);
}

TEST(ReportTest, JsonHasTheVllmKeys) {
  std::vector<RequestResult> results = {Ok(0.1, 1.1, 11, {0.1}), RequestResult{}};
  results[1].error_code = "DEADLINE_EXCEEDED";
  results[1].error = "deadline";
  const BenchmarkMetrics m = ComputeMetrics(results, 2.0, {});
  RunInfo info;
  info.date = "20261122-080000";
  info.model_id = "smollm2";
  info.num_prompts = 2;
  info.request_rate = std::numeric_limits<double>::infinity();
  info.max_concurrency = 4;
  const nlohmann::json j = ResultJson(info, m, results, 2.0);
  for (const char* key : {"date",
                          "backend",
                          "model_id",
                          "tokenizer_id",
                          "num_prompts",
                          "request_rate",
                          "burstiness",
                          "max_concurrency",
                          "duration",
                          "completed",
                          "failed",
                          "total_input_tokens",
                          "total_output_tokens",
                          "request_throughput",
                          "request_goodput",
                          "output_throughput",
                          "total_token_throughput",
                          "input_lens",
                          "output_lens",
                          "ttfts",
                          "itls",
                          "latencies",
                          "generated_texts",
                          "errors",
                          "retrieval_bytes_per_token",
                          "hot_cache_hit_rate",
                          "passkey_accuracy",
                          "error_counts"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  for (const char* metric : {"ttft", "tpot", "itl", "e2el"}) {
    for (const char* stat : {"mean", "median", "std", "p90", "p99"}) {
      const std::string key = std::string(stat) + "_" + metric + "_ms";
      EXPECT_TRUE(j.contains(key) && j[key].is_number()) << key;
    }
  }
  EXPECT_EQ(j["request_rate"], "inf");
  EXPECT_EQ(j["max_concurrency"], 4);
  EXPECT_EQ(j["completed"], 1);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_EQ(j["ttfts"].size(), 2u);
  EXPECT_EQ(j["output_lens"][1], 0);
  EXPECT_EQ(j["errors"][0], "");
  EXPECT_THAT(j["errors"][1].get<std::string>(), HasSubstr("DEADLINE_EXCEEDED"));
  EXPECT_EQ(j["error_counts"]["DEADLINE_EXCEEDED"], 1);
  EXPECT_TRUE(j["request_goodput"].is_null());
  EXPECT_THAT(FormatReport(info, m, 2.0), HasSubstr("Successful requests:"));
}

TEST(ProgressTest, DrawsCountsAndEndsTheLine) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressBar bar(10, f, std::chrono::milliseconds(0));
    bar.Update(3, 1);
    bar.Update(10, 2);
    bar.Finish();
  }
  std::rewind(f);
  char buf[1024] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const std::string out(buf, n);
  EXPECT_THAT(out, HasSubstr("3/10  1 failed"));
  EXPECT_THAT(out, HasSubstr("[==============================] 10/10  2 failed"));
  EXPECT_EQ(out.back(), '\n');
}

}  // namespace
}  // namespace kvr::loadgen
