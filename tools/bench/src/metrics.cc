#include "kvr/loadgen/metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvr::loadgen {

double Percentile(const std::vector<double>& sorted_values, double p) {
  if (sorted_values.empty()) return 0;
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * (sorted_values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, sorted_values.size() - 1);
  const double frac = rank - lo;
  return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac;
}

Distribution Summarize(std::vector<double> values_s) {
  Distribution d;
  if (values_s.empty()) return d;
  std::sort(values_s.begin(), values_s.end());
  const double n = static_cast<double>(values_s.size());
  const double mean = std::accumulate(values_s.begin(), values_s.end(), 0.0) / n;
  double var = 0;
  for (double v : values_s) var += (v - mean) * (v - mean);
  d.mean_ms = mean * 1e3;
  d.std_ms = std::sqrt(var / n) * 1e3;  // population std, as np.std
  d.median_ms = Percentile(values_s, 50) * 1e3;
  d.p90_ms = Percentile(values_s, 90) * 1e3;
  d.p99_ms = Percentile(values_s, 99) * 1e3;
  return d;
}

BenchmarkMetrics ComputeMetrics(const std::vector<RequestResult>& results, double duration_s,
                                const SloOptions& slo) {
  BenchmarkMetrics m;
  std::vector<double> ttfts, tpots, itls, e2els;
  uint64_t good = 0, fetched = 0, hits = 0, misses = 0, passkey_total = 0, passkey_right = 0;
  for (const RequestResult& r : results) {
    if (!r.success) {
      ++m.failed;
      ++m.errors_by_code[r.error_code.empty() ? "UNKNOWN" : r.error_code];
      continue;
    }
    ++m.completed;
    m.total_input += r.prompt_len;
    m.total_output += r.output_len;
    ttfts.push_back(r.ttft_s);
    e2els.push_back(r.latency_s);
    itls.insert(itls.end(), r.itl_s.begin(), r.itl_s.end());
    // vllm counts a TPOT of 0 for single-token outputs in goodput but leaves it out of the
    // TPOT statistics.
    double tpot = 0;
    if (r.output_len > 1) {
      tpot = (r.latency_s - r.ttft_s) / (r.output_len - 1);
      tpots.push_back(tpot);
    }
    if (slo.any()) {
      const bool ttft_ok = !slo.ttft_ms || r.ttft_s * 1e3 <= *slo.ttft_ms;
      const bool tpot_ok = !slo.tpot_ms || tpot * 1e3 <= *slo.tpot_ms;
      if (ttft_ok && tpot_ok) ++good;
    }
    fetched += r.bytes_fetched;
    hits += r.hot_cache_hits;
    misses += r.hot_cache_misses;
    if (r.passkey_correct.has_value()) {
      ++passkey_total;
      if (*r.passkey_correct) ++passkey_right;
    }
  }
  if (duration_s > 0) {
    m.request_throughput = m.completed / duration_s;
    m.output_throughput = m.total_output / duration_s;
    m.total_token_throughput = (m.total_input + m.total_output) / duration_s;
    if (slo.any()) m.request_goodput = good / duration_s;
  } else if (slo.any()) {
    m.request_goodput = 0;
  }
  m.ttft = Summarize(std::move(ttfts));
  m.tpot = Summarize(std::move(tpots));
  m.itl = Summarize(std::move(itls));
  m.e2el = Summarize(std::move(e2els));
  if (m.total_output > 0) {
    m.retrieval_bytes_per_token = static_cast<double>(fetched) / m.total_output;
  }
  if (hits + misses > 0) m.hot_cache_hit_rate = static_cast<double>(hits) / (hits + misses);
  if (passkey_total > 0) {
    m.passkey_accuracy = static_cast<double>(passkey_right) / passkey_total;
  }
  return m;
}

}  // namespace kvr::loadgen
