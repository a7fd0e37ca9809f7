#include "kvr/loadgen/report.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace kvr::loadgen {
namespace {

void AddDistribution(nlohmann::json& j, const std::string& name, const Distribution& d) {
  j[absl::StrCat("mean_", name, "_ms")] = d.mean_ms;
  j[absl::StrCat("median_", name, "_ms")] = d.median_ms;
  j[absl::StrCat("std_", name, "_ms")] = d.std_ms;
  j[absl::StrCat("p90_", name, "_ms")] = d.p90_ms;
  j[absl::StrCat("p99_", name, "_ms")] = d.p99_ms;
}

void Line(std::string& out, absl::string_view label, absl::string_view value) {
  absl::StrAppendFormat(&out, "%-40s %-10s\n", label, value);
}
std::string F2(double v) { return absl::StrFormat("%.2f", v); }

void Section(std::string& out, absl::string_view title) {
  const size_t n = 50;
  const size_t pad = title.size() + 2 < n ? n - title.size() - 2 : 0;
  absl::StrAppend(&out, std::string(pad / 2, '-'), " ", title, " ", std::string(pad - pad / 2, '-'),
                  "\n");
}

void DistributionLines(std::string& out, absl::string_view name, absl::string_view title,
                       const Distribution& d) {
  Section(out, title);
  Line(out, absl::StrCat("Mean ", name, " (ms):"), F2(d.mean_ms));
  Line(out, absl::StrCat("Median ", name, " (ms):"), F2(d.median_ms));
  Line(out, absl::StrCat("P90 ", name, " (ms):"), F2(d.p90_ms));
  Line(out, absl::StrCat("P99 ", name, " (ms):"), F2(d.p99_ms));
}

}  // namespace

nlohmann::json ResultJson(const RunInfo& info, const BenchmarkMetrics& m,
                          const std::vector<RequestResult>& results, double duration_s) {
  nlohmann::json j;
  j["date"] = info.date;
  j["endpoint_type"] = info.backend;
  j["backend"] = info.backend;
  j["label"] = nullptr;
  j["model_id"] = info.model_id;
  j["tokenizer_id"] =
      info.tokenizer_id.empty() ? nlohmann::json(nullptr) : nlohmann::json(info.tokenizer_id);
  j["num_prompts"] = info.num_prompts;
  j["request_rate"] =
      std::isinf(info.request_rate) ? nlohmann::json("inf") : nlohmann::json(info.request_rate);
  j["burstiness"] = info.burstiness;
  j["max_concurrency"] = OrNull(info.max_concurrency);
  j["duration"] = duration_s;
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["total_input_tokens"] = m.total_input;
  j["total_output_tokens"] = m.total_output;
  j["request_throughput"] = m.request_throughput;
  j["request_goodput"] = OrNull(m.request_goodput);
  j["output_throughput"] = m.output_throughput;
  j["total_token_throughput"] = m.total_token_throughput;
  nlohmann::json input_lens = nlohmann::json::array(), output_lens = nlohmann::json::array(),
                 ttfts = nlohmann::json::array(), itls = nlohmann::json::array(),
                 latencies = nlohmann::json::array(), start_times = nlohmann::json::array(),
                 texts = nlohmann::json::array(), errors = nlohmann::json::array();
  for (const RequestResult& r : results) {
    input_lens.push_back(r.prompt_len);
    output_lens.push_back(r.success ? r.output_len : 0);
    ttfts.push_back(r.success ? r.ttft_s : 0.0);
    itls.push_back(r.itl_s);
    latencies.push_back(r.success ? r.latency_s : 0.0);
    start_times.push_back(r.start_time_s);
    texts.push_back(r.generated_text);
    errors.push_back(r.success ? std::string() : absl::StrCat(r.error_code, ": ", r.error));
  }
  j["input_lens"] = std::move(input_lens);
  j["output_lens"] = std::move(output_lens);
  j["ttfts"] = std::move(ttfts);
  j["itls"] = std::move(itls);
  j["latencies"] = std::move(latencies);
  j["start_times"] = std::move(start_times);
  j["generated_texts"] = std::move(texts);
  j["errors"] = std::move(errors);
  AddDistribution(j, "ttft", m.ttft);
  AddDistribution(j, "tpot", m.tpot);
  AddDistribution(j, "itl", m.itl);
  AddDistribution(j, "e2el", m.e2el);
  // kvr's own keys.
  j["dataset"] = info.dataset;
  j["retrieval_method"] = info.method;
  j["retrieval_budget"] = OrNull(info.budget);
  j["error_counts"] = m.errors_by_code;
  j["retrieval_bytes_per_token"] = m.retrieval_bytes_per_token;
  j["hot_cache_hit_rate"] = OrNull(m.hot_cache_hit_rate);
  j["passkey_accuracy"] = OrNull(m.passkey_accuracy);
  // Per request: the controller's own TTFT (null where the server reported none).
  nlohmann::json server_ttfts = nlohmann::json::array();
  for (const RequestResult& r : results) server_ttfts.push_back(OrNull(r.server_ttft_s));
  j["server_ttfts"] = std::move(server_ttfts);
  return j;
}

std::string FormatReport(const RunInfo& info, const BenchmarkMetrics& m, double duration_s) {
  std::string out;
  absl::StrAppend(&out, "============ Serving Benchmark Result ============\n");
  Line(out, "Backend:", info.backend);
  Line(out, "Successful requests:", absl::StrCat(m.completed));
  Line(out, "Failed requests:", absl::StrCat(m.failed));
  for (const auto& [code, n] : m.errors_by_code) {
    Line(out, absl::StrCat("  ", code, ":"), absl::StrCat(n));
  }
  if (info.max_concurrency) {
    Line(out, "Maximum request concurrency:", absl::StrCat(*info.max_concurrency));
  }
  Line(out, "Request rate configured (RPS):",
       std::isinf(info.request_rate) ? "inf" : F2(info.request_rate));
  Line(out, "Benchmark duration (s):", F2(duration_s));
  Line(out, "Total input tokens:", absl::StrCat(m.total_input));
  Line(out, "Total generated tokens:", absl::StrCat(m.total_output));
  Line(out, "Request throughput (req/s):", F2(m.request_throughput));
  if (m.request_goodput) Line(out, "Request goodput (req/s):", F2(*m.request_goodput));
  Line(out, "Output token throughput (tok/s):", F2(m.output_throughput));
  Line(out, "Total token throughput (tok/s):", F2(m.total_token_throughput));
  DistributionLines(out, "TTFT", "Time to First Token", m.ttft);
  DistributionLines(out, "TPOT", "Time per Output Token (excl. 1st token)", m.tpot);
  DistributionLines(out, "ITL", "Inter-token Latency", m.itl);
  DistributionLines(out, "E2EL", "End-to-end Latency", m.e2el);
  Section(out, "kvr retrieval");
  Line(out, "Retrieval bytes per output token:", F2(m.retrieval_bytes_per_token));
  Line(out, "Hot-cache hit rate:",
       m.hot_cache_hit_rate ? absl::StrFormat("%.3f", *m.hot_cache_hit_rate) : "n/a");
  if (m.passkey_accuracy) {
    Line(out, "Passkey accuracy:", absl::StrFormat("%.3f", *m.passkey_accuracy));
  }
  absl::StrAppend(&out, std::string(50, '='), "\n");
  return out;
}

}  // namespace kvr::loadgen
