#include "kvr/eval_endpoint/suite.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvr/common/status.h"
#include "kvr/loadgen/report.h"
#include "kvr/loadgen/runner.h"

namespace kvr::eval_endpoint {
namespace {

using Key = std::tuple<std::string, uint32_t, uint32_t>;  // task, length asked, index

}  // namespace

absl::StatusOr<std::vector<Sample>> GenerateSamples(const SuiteOptions& options,
                                                    const TokenCounter& counter,
                                                    const std::vector<std::string>* corpus) {
  const std::vector<std::string>& tasks = options.tasks.empty() ? TaskNames() : options.tasks;
  if (options.lengths.empty()) return absl::InvalidArgumentError("no lengths given");
  if (options.samples == 0) return absl::InvalidArgumentError("samples must be > 0");
  std::vector<Sample> samples;
  for (const std::string& task : tasks) {
    for (uint32_t length : options.lengths) {
      for (uint32_t i = 0; i < options.samples; ++i) {
        SampleSpec spec{task, length, options.seed, i, corpus};
        // Room for the answer: the prompt and max_tokens must fit the context. The sample's
        // max_tokens is known only once it is made, so it is made again if it does not fit.
        KVR_ASSIGN_OR_RETURN(Sample s, GenerateSample(spec, counter));
        if (s.prompt_tokens + s.max_tokens > options.context) {
          if (options.context <= s.max_tokens) {
            return absl::InvalidArgumentError("context too small for any prompt");
          }
          spec.target_tokens = std::min(length, options.context - s.max_tokens);
          KVR_ASSIGN_OR_RETURN(s, GenerateSample(spec, counter));
        }
        s.target_tokens = length;  // reported as asked; prompt_tokens says what was sent
        samples.push_back(std::move(s));
      }
    }
  }
  return samples;
}

absl::StatusOr<std::vector<std::pair<std::string, uint32_t>>> Runs(const SuiteOptions& options) {
  std::vector<std::pair<std::string, uint32_t>> runs = {{kReferenceMethod, 0}};
  for (const std::string& m : options.methods) {
    if (m == kReferenceMethod) continue;
    if (options.budgets.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("method ", m, " needs --budgets"));
    }
    for (uint32_t b : options.budgets) {
      if (std::find(runs.begin(), runs.end(), std::make_pair(m, b)) == runs.end()) {
        runs.emplace_back(m, b);
      }
    }
  }
  return runs;
}

absl::StatusOr<SuiteReport> RunSuite(loadgen::Backend& backend, const std::string& model,
                                     const SuiteOptions& options,
                                     const std::vector<Sample>& samples,
                                     const std::function<void(const std::string&)>& progress) {
  if (samples.empty()) return absl::InvalidArgumentError("no samples");
  KVR_ASSIGN_OR_RETURN(const auto runs, Runs(options));
  std::vector<loadgen::Prompt> prompts;
  for (const Sample& s : samples) {
    loadgen::Prompt p;
    p.text = s.prompt;
    p.max_tokens = s.max_tokens;
    p.approx_tokens = s.prompt_tokens;
    prompts.push_back(std::move(p));
  }
  SuiteReport report;
  report.model = model;
  for (const auto& [method, budget] : runs) {
    loadgen::RunOptions o;
    o.request.model = model;
    o.request.temperature = 0;
    o.request.method = method;
    if (budget > 0) o.request.budget = budget;
    o.request.n_sink = options.n_sink;
    o.request.local_window = options.local_window;
    o.request.timeout_s = options.request_timeout_s;
    o.max_concurrency = std::max<uint32_t>(1, options.concurrency);
    o.num_requests = prompts.size();
    KVR_ASSIGN_OR_RETURN(loadgen::RunOutcome outcome, loadgen::RunBenchmark(backend, o, prompts));
    if (outcome.results.size() != samples.size()) {
      return absl::InternalError(absl::StrCat(method, ": ", outcome.results.size(), " results for ",
                                              samples.size(), " samples"));
    }
    uint32_t failed = 0;
    for (size_t i = 0; i < samples.size(); ++i) {
      const loadgen::RequestResult& r = outcome.results[i];
      SampleResult out;
      out.task = samples[i].task;
      out.length = samples[i].target_tokens;
      out.index = samples[i].index;
      out.method = method;
      out.budget = budget;
      out.success = r.success;
      out.error = r.success ? "" : absl::StrCat(r.error_code, ": ", r.error);
      out.answer = r.generated_text;
      out.prompt_tokens = r.prompt_len;
      out.output_tokens = r.output_len;
      out.ttft_s = r.ttft_s;
      out.latency_s = r.latency_s;
      failed += r.success ? 0 : 1;
      report.samples.push_back(std::move(out));
    }
    if (progress) {
      progress(absl::StrFormat("%s%s: %zu requests, %u failed, %.1f s", method,
                               budget > 0 ? absl::StrCat(" budget ", budget) : "", samples.size(),
                               failed, outcome.duration_s));
    }
  }
  ScoreResults(samples, report.samples);
  report.groups = Aggregate(report.samples);
  return report;
}

void ScoreResults(const std::vector<Sample>& samples, std::vector<SampleResult>& results) {
  std::map<Key, const Sample*> by_key;
  for (const Sample& s : samples) by_key[{s.task, s.target_tokens, s.index}] = &s;
  std::map<Key, std::string> reference;
  for (const SampleResult& r : results) {
    if (r.method == kReferenceMethod && r.success) {
      reference[{r.task, r.length, r.index}] = NormalizeAnswer(r.answer);
    }
  }
  for (SampleResult& r : results) {
    const Key key{r.task, r.length, r.index};
    const auto s = by_key.find(key);
    r.score = r.success && s != by_key.end() ? Score(*s->second, r.answer) : 0;
    if (s != by_key.end()) r.expected = s->second->answers;
    const auto ref = reference.find(key);
    if (ref == reference.end()) {
      r.agrees_with_full.reset();
    } else {
      r.agrees_with_full = r.success && NormalizeAnswer(r.answer) == ref->second;
    }
  }
}

std::vector<GroupResult> Aggregate(const std::vector<SampleResult>& results) {
  using GroupKey = std::tuple<std::string, uint32_t, std::string, uint32_t>;
  struct Acc {
    GroupResult g;
    double score = 0, ttft = 0, prompt = 0;
    uint32_t completed = 0, agree = 0, compared = 0;
    double decode_tokens = 0, decode_s = 0;
  };
  std::vector<GroupKey> order;
  std::map<GroupKey, Acc> acc;
  for (const SampleResult& r : results) {
    const GroupKey key{r.task, r.length, r.method, r.budget};
    auto [it, inserted] = acc.try_emplace(key);
    Acc& a = it->second;
    if (inserted) {
      order.push_back(key);
      a.g.task = r.task;
      a.g.length = r.length;
      a.g.method = r.method;
      a.g.budget = r.budget;
    }
    ++a.g.samples;
    a.score += r.score;
    if (r.agrees_with_full.has_value()) {
      ++a.compared;
      a.agree += *r.agrees_with_full ? 1 : 0;
    }
    if (!r.success) {
      ++a.g.failed;
      continue;
    }
    ++a.completed;
    a.ttft += r.ttft_s;
    a.prompt += r.prompt_tokens;
    if (r.output_tokens > 1 && r.latency_s > r.ttft_s) {
      a.decode_tokens += r.output_tokens - 1;
      a.decode_s += r.latency_s - r.ttft_s;
    }
  }
  std::vector<GroupResult> out;
  for (const GroupKey& key : order) {
    Acc& a = acc[key];
    a.g.accuracy = a.score / a.g.samples;
    if (a.compared > 0) a.g.agreement = static_cast<double>(a.agree) / a.compared;
    if (a.completed > 0) {
      a.g.mean_ttft_ms = 1000 * a.ttft / a.completed;
      a.g.mean_prompt_tokens = a.prompt / a.completed;
    }
    a.g.tokens_per_s = a.decode_s > 0 ? a.decode_tokens / a.decode_s : 0;
    out.push_back(a.g);
  }
  return out;
}

std::string FormatTable(const std::vector<GroupResult>& groups) {
  std::ostringstream out;
  out << absl::StrFormat("%-18s %7s %-10s %6s %8s %9s %8s %9s %10s %4s %6s\n", "task", "length",
                         "method", "budget", "accuracy", "agree_full", "tok/s", "ttft_ms",
                         "prompt_tok", "n", "failed");
  for (const GroupResult& g : groups) {
    out << absl::StrFormat("%-18s %7u %-10s %6s %8.3f %9s %8.1f %9.1f %10.0f %4u %6u\n", g.task,
                           g.length, g.method, g.budget > 0 ? absl::StrCat(g.budget) : "-",
                           g.accuracy, g.agreement ? absl::StrFormat("%.3f", *g.agreement) : "-",
                           g.tokens_per_s, g.mean_ttft_ms, g.mean_prompt_tokens, g.samples,
                           g.failed);
  }
  return out.str();
}

nlohmann::json ToJson(const SuiteOptions& options, const SuiteReport& report,
                      const nlohmann::json& extra_config) {
  nlohmann::json config = {
      {"model", report.model},
      {"tasks", options.tasks.empty() ? TaskNames() : options.tasks},
      {"methods", options.methods},
      {"budgets", options.budgets},
      {"lengths", options.lengths},
      {"samples", options.samples},
      {"seed", options.seed},
      {"concurrency", options.concurrency},
      {"context", options.context},
      {"temperature", 0},
      {"n_sink", loadgen::OrNull(options.n_sink)},
      {"local_window", loadgen::OrNull(options.local_window)},
  };
  if (extra_config.is_object()) config.update(extra_config);
  nlohmann::json groups = nlohmann::json::array();
  for (const GroupResult& g : report.groups) {
    groups.push_back({{"task", g.task},
                      {"length", g.length},
                      {"method", g.method},
                      {"budget", g.budget},
                      {"samples", g.samples},
                      {"failed", g.failed},
                      {"accuracy", g.accuracy},
                      {"agreement_with_full", loadgen::OrNull(g.agreement)},
                      {"output_tokens_per_s", g.tokens_per_s},
                      {"mean_ttft_ms", g.mean_ttft_ms},
                      {"mean_prompt_tokens", g.mean_prompt_tokens}});
  }
  nlohmann::json samples = nlohmann::json::array();
  for (const SampleResult& r : report.samples) {
    samples.push_back({{"task", r.task},
                       {"length", r.length},
                       {"index", r.index},
                       {"method", r.method},
                       {"budget", r.budget},
                       {"success", r.success},
                       {"error", r.error},
                       {"answer", r.answer},
                       {"expected", r.expected},
                       {"score", r.score},
                       {"agrees_with_full", loadgen::OrNull(r.agrees_with_full)},
                       {"prompt_tokens", r.prompt_tokens},
                       {"output_tokens", r.output_tokens},
                       {"ttft_ms", 1000 * r.ttft_s},
                       {"latency_ms", 1000 * r.latency_s}});
  }
  return {{"config", config}, {"groups", groups}, {"samples", samples}};
}

}  // namespace kvr::eval_endpoint
