#pragma once
// `kvr eval endpoint`: the tasks of tasks.h sent through a serving endpoint (kvr's public gRPC
// API through kvr::loadgen's Backend, the client `kvr bench` uses) for every method and budget
// asked, greedy, with `full` as the reference; each answer scored by its task's rule.
//
// Reported per (task, length, method, budget): accuracy (mean score; a failed request scores
// 0), agreement with `full` (the share of samples whose normalised answer equals full's answer
// to the same prompt, over the samples full answered; a failed request disagrees; `full`'s own
// row is 1 by construction unless its requests failed), decode tokens/s ((output tokens - 1) /
// (latency - TTFT), summed over the requests that made more than one token), mean TTFT and the
// mean prompt tokens the server counted.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/eval_endpoint/tasks.h"
#include "kvr/loadgen/backend.h"
#include "nlohmann/json.hpp"

namespace kvr::eval_endpoint {

inline constexpr char kReferenceMethod[] = "full";

struct SuiteOptions {
  std::vector<std::string> tasks;    // empty: all (TaskNames)
  std::vector<std::string> methods;  // `full` is run first whether named or not
  std::vector<uint32_t> budgets;     // each method but full at each budget
  std::vector<uint32_t> lengths;     // prompt lengths in tokens
  uint32_t samples = 2;              // per (task, length)
  uint64_t seed = 0;
  uint32_t concurrency = 1;  // requests in flight per (method, budget)
  // Sink tokens and local window of every request; unset: the server's defaults (kvr: 64 and
  // 512, so a prompt of 1K tokens has ~450 candidates to select from).
  std::optional<uint32_t> n_sink;
  std::optional<uint32_t> local_window;
  // The model's context: a prompt is at most context - its max_tokens whatever the length.
  uint32_t context = 8192;
  double request_timeout_s = 600;
};

// The samples of every (task, length), `options.samples` each: qa_licenses takes `corpus`.
[[nodiscard]] absl::StatusOr<std::vector<Sample>> GenerateSamples(
    const SuiteOptions& options, const TokenCounter& counter,
    const std::vector<std::string>* corpus);

// One request's outcome.
struct SampleResult {
  std::string task;
  uint32_t length = 0;  // the length asked for (Sample::target_tokens may be less)
  uint32_t index = 0;
  std::string method;
  uint32_t budget = 0;  // 0 for full
  bool success = false;
  std::string error;
  std::string answer;
  std::vector<std::string> expected;  // the sample's answers (ScoreResults)
  double score = 0;
  std::optional<bool> agrees_with_full;  // nullopt when full's request failed
  uint32_t prompt_tokens = 0;            // as the server counted them
  uint32_t output_tokens = 0;
  double ttft_s = 0, latency_s = 0;
};

struct GroupResult {
  std::string task;
  uint32_t length = 0;
  std::string method;
  uint32_t budget = 0;
  uint32_t samples = 0, failed = 0;
  double accuracy = 0;
  std::optional<double> agreement;  // nullopt when full answered none of the samples
  double tokens_per_s = 0;          // decode
  double mean_ttft_ms = 0;
  double mean_prompt_tokens = 0;
};

struct SuiteReport {
  std::string model;
  std::vector<SampleResult> samples;
  std::vector<GroupResult> groups;
};

// The (method, budget) runs in the order they are sent: full (budget 0) first, then each other
// method at each budget. InvalidArgument without budgets for a method that needs one.
[[nodiscard]] absl::StatusOr<std::vector<std::pair<std::string, uint32_t>>> Runs(
    const SuiteOptions& options);

// Sends every sample for every run through `backend` (requests of one run at most
// options.concurrency at a time, temperature 0, each sample's max_tokens) and scores them.
// `progress` (may be null) gets a line per finished run. Failed requests are results, not
// errors; errors are the backend's refusal of the model or the options.
[[nodiscard]] absl::StatusOr<SuiteReport> RunSuite(
    loadgen::Backend& backend, const std::string& model, const SuiteOptions& options,
    const std::vector<Sample>& samples, const std::function<void(const std::string&)>& progress);

// Fills each result's score (its sample's rule on its answer; 0 when the request failed) and
// agrees_with_full (against the `full` result of the same task, length and index). `samples`
// and `results` are as GenerateSamples and RunSuite make them: results[r * samples.size() + i]
// is run r's answer to samples[i].
void ScoreResults(const std::vector<Sample>& samples, std::vector<SampleResult>& results);

// Groups per (task, length, method, budget), in the order of the results.
std::vector<GroupResult> Aggregate(const std::vector<SampleResult>& results);

// A fixed-width table of the groups.
std::string FormatTable(const std::vector<GroupResult>& groups);

// {"config": ..., "groups": [...], "samples": [...]}; `extra_config` is merged into "config"
// (the command puts the target, the tokenizer and the corpus files there).
nlohmann::json ToJson(const SuiteOptions& options, const SuiteReport& report,
                      const nlohmann::json& extra_config);

}  // namespace kvr::eval_endpoint
