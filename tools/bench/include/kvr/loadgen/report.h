#pragma once
// The run's report: the text summary on stdout and the --result-file JSON in the layout of
// `vllm bench serve --save-result` (same key names), plus kvr's own keys.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvr/loadgen/metrics.h"
#include "nlohmann/json.hpp"

namespace kvr::loadgen {

// An optional as JSON: its value, or null (how kvr's JSON reports write "not measured" or "not
// set").
template <typename T>
nlohmann::json OrNull(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

struct RunInfo {
  std::string date;                  // "%Y%m%d-%H%M%S", as vllm writes it
  std::string backend = "kvr-grpc";  // kvr-grpc | openai-chat | openai-completions
  std::string model_id;
  std::string tokenizer_id;  // --tokenizer-model path, may be empty
  std::string dataset;
  uint64_t num_prompts = 0;  // requests sent
  double request_rate = 0;   // infinity: "inf" in JSON
  double burstiness = 1.0;
  std::optional<uint32_t> max_concurrency;
  std::string method;
  std::optional<uint32_t> budget;
};

// The JSON document. vllm keys: date, backend, model_id, tokenizer_id, num_prompts,
// request_rate, burstiness, max_concurrency, duration, completed, failed, total_input_tokens,
// total_output_tokens, request_throughput, request_goodput, output_throughput,
// total_token_throughput, input_lens, output_lens, ttfts, itls, latencies, start_times,
// generated_texts, errors, {mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms. kvr keys:
// dataset, retrieval_method, retrieval_budget, error_counts (by gRPC code),
// retrieval_bytes_per_token, hot_cache_hit_rate, passkey_accuracy (null when not measured),
// server_ttfts (per request, the controller's TTFT in seconds; null where not reported).
nlohmann::json ResultJson(const RunInfo& info, const BenchmarkMetrics& metrics,
                          const std::vector<RequestResult>& results, double duration_s);

// The human-readable summary (vllm's "Serving Benchmark Result" block plus kvr lines).
std::string FormatReport(const RunInfo& info, const BenchmarkMetrics& metrics, double duration_s);

}  // namespace kvr::loadgen
