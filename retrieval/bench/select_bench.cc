// Selection cost of every core method on synthetic clustered keys (Llama-3-8B-like layer:
// 32 query / 8 KV heads, head_dim 128). Prints Build time, Select time per decode step (all KV
// heads of one layer), summary bytes per token per head, and the summary bytes scanned per
// second, with the fraction of the K bytes that the exact oracle scans in the same time
// (the CPU roofline here is the oracle's full key scan).
//
//   retrieval_select_bench [context=32768] [budget=1024] [steps=20]

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kvr/retrieval/registry.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvr::retrieval;
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 32768;
  const int64_t budget = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 20;
  IndexShape shape;
  shape.n_heads = 32;
  shape.n_kv_heads = 8;
  shape.head_dim = 128;
  shape.n_layers = 1;
  const int hd = shape.head_dim;
  const int64_t row = static_cast<int64_t>(shape.n_kv_heads) * hd;
  // Keys: 64 topics in runs of consecutive tokens plus noise, like real keys' locality.
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> topics(64 * hd);
  for (float& x : topics) x = nd(rng);
  std::vector<float> keys(n * row);
  int topic = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (t % 48 == 0) topic = static_cast<int>(rng() % 64);
    for (int64_t j = 0; j < row; ++j)
      keys[t * row + j] = topics[topic * hd + j % hd] + 0.5f * nd(rng);
  }
  const int64_t nq = 512;
  std::vector<float> queries(nq * shape.n_heads * hd);
  for (float& x : queries) x = nd(rng);
  MethodRegistry registry;
  if (!RegisterCoreMethods(registry).ok()) return 1;
  std::printf("context %lld, budget %lld, %d x %d heads, head_dim %d; K bytes/token/head fp16 %d\n",
              static_cast<long long>(n), static_cast<long long>(budget), shape.n_heads,
              shape.n_kv_heads, hd, 2 * hd);
  std::printf("%-10s %9s %11s %12s %12s\n", "method", "build_s", "select_us", "B/tok/head",
              "summary_GB/s");
  for (const std::string& method : registry.Names()) {
    IndexParams params;
    params.budget = budget;
    auto index = registry.Make(method, shape, params);
    if (!index.ok()) return 1;
    BuildInput in;
    in.keys = {keys.data(), n, row};
    in.queries = {queries.data(), nq, static_cast<int64_t>(shape.n_heads) * hd};
    in.queries_first_position = n - nq;
    auto t0 = Clock::now();
    if (absl::Status s = (*index)->Build(in); !s.ok()) {
      std::printf("%-10s build failed: %s\n", method.c_str(), std::string(s.message()).c_str());
      continue;
    }
    const double build = Since(t0);
    Selection sel;
    std::vector<float> q(shape.n_heads * hd);
    double total = 0;
    for (int s = 0; s < steps; ++s) {
      for (float& x : q) x = nd(rng);
      t0 = Clock::now();
      if (!(*index)->Select({q.data(), n, budget, 16, n - 256}, &sel).ok()) return 1;
      total += Since(t0);
    }
    const double per = total / steps;
    const double bytes = static_cast<double>((*index)->MemoryBytes());
    std::printf("%-10s %9.3f %11.1f %12.2f %12.2f\n", method.c_str(), build, 1e6 * per,
                bytes / (n * shape.n_kv_heads), per > 0 ? bytes / per / 1e9 : 0.0);
  }
  return 0;
}
