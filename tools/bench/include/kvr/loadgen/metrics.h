#pragma once
// What one request measured and the aggregate figures `kvr bench` reports, with the
// definitions of `vllm bench serve` (benchmarks/serve.py, calculate_metrics):
//   TTFT  time from sending the request to the first message carrying a token;
//   ITL   gaps between successive token-carrying messages of one request;
//   TPOT  (E2E latency - TTFT) / (output tokens - 1), per request with > 1 output token;
//   E2E   time from sending the request to the end of its stream;
//   goodput  completed requests per second that met every SLO given.
// Means, medians, standard deviations and percentiles are numpy's (linear interpolation,
// population std), in milliseconds.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kvr::loadgen {

struct RequestResult {
  bool success = false;
  // gRPC status code name ("DEADLINE_EXCEEDED", ...) and message; empty on success.
  std::string error_code;
  std::string error;
  uint32_t prompt_len = 0;  // as the server counted it, else the client's estimate
  uint32_t output_len = 0;  // completion tokens
  double start_time_s = 0;  // when it was sent, seconds since the run started
  double ttft_s = 0;
  double latency_s = 0;
  std::vector<double> itl_s;
  std::string generated_text;
  // From Completion.retrieval (kvr fields).
  uint64_t bytes_fetched = 0;
  uint64_t bytes_shipped = 0;
  uint64_t hot_cache_hits = 0;
  uint64_t hot_cache_misses = 0;
  // kvr servers: the TTFT the controller measured (arrival -> first token sent), so that
  // ttft_s minus it is what the client, the wire and the front door added.
  std::optional<double> server_ttft_s;
  // Passkey prompts only: the answer contained the key.
  std::optional<bool> passkey_correct;
};

// Linear-interpolated percentile (numpy's default) of `sorted_values`, p in [0, 100];
// 0 for an empty input.
double Percentile(const std::vector<double>& sorted_values, double p);

struct Distribution {
  double mean_ms = 0, median_ms = 0, std_ms = 0, p90_ms = 0, p99_ms = 0;
};

// Summary of values given in seconds; all zero for an empty input (as numpy on `[0]`).
Distribution Summarize(std::vector<double> values_s);

struct SloOptions {
  std::optional<double> ttft_ms;
  std::optional<double> tpot_ms;
  bool any() const { return ttft_ms.has_value() || tpot_ms.has_value(); }
};

struct BenchmarkMetrics {
  uint64_t completed = 0;
  uint64_t failed = 0;
  std::map<std::string, uint64_t> errors_by_code;
  uint64_t total_input = 0;
  uint64_t total_output = 0;
  double request_throughput = 0;
  std::optional<double> request_goodput;  // set when an SLO was given
  double output_throughput = 0;
  double total_token_throughput = 0;
  Distribution ttft, tpot, itl, e2el;
  // kvr: store bytes fetched by decode per output token; hot-cache hits / (hits + misses)
  // (nullopt when the server reported no lookups); passkey answers containing the key /
  // completed passkey requests (nullopt without passkey prompts).
  double retrieval_bytes_per_token = 0;
  std::optional<double> hot_cache_hit_rate;
  std::optional<double> passkey_accuracy;
};

// Aggregates `results` of a run that took `duration_s`.
BenchmarkMetrics ComputeMetrics(const std::vector<RequestResult>& results, double duration_s,
                                const SloOptions& slo);

}  // namespace kvr::loadgen
