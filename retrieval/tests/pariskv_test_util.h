#pragma once
// Synthetic key/query sets with a known exact answer, shared by the ParisKV and A2ATS tests.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvr/retrieval/index.h"

namespace kvr::retrieval::testing {

// Clustered keys: `n_clusters` random centres (norm ~ sqrt(d)), each key a centre plus isotropic
// noise of relative size `noise`, with per-key norm jitter; the shape of real keys, which cluster
// by "meaning" and differ in magnitude.
struct ClusteredData {
  int n_tokens = 0, n_kv_heads = 0, n_heads = 0, head_dim = 0;
  std::vector<float> keys;     // [n_tokens, n_kv_heads, head_dim]
  std::vector<float> centres;  // [n_kv_heads, n_clusters, head_dim]
  int n_clusters = 0;
};

inline ClusteredData MakeClusteredKeys(int n_tokens, int n_kv_heads, int n_heads, int head_dim,
                                       int n_clusters, float noise, uint32_t seed) {
  ClusteredData data{n_tokens, n_kv_heads, n_heads, head_dim};
  data.n_clusters = n_clusters;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> jitter(0.6f, 1.4f);
  std::uniform_int_distribution<int> pick(0, n_clusters - 1);
  data.centres.resize(static_cast<size_t>(n_kv_heads) * n_clusters * head_dim);
  for (float& c : data.centres) c = normal(rng);
  data.keys.resize(static_cast<size_t>(n_tokens) * n_kv_heads * head_dim);
  for (int t = 0; t < n_tokens; ++t) {
    for (int h = 0; h < n_kv_heads; ++h) {
      const float* c =
          data.centres.data() + (static_cast<size_t>(h) * n_clusters + pick(rng)) * head_dim;
      float* k = data.keys.data() + (static_cast<size_t>(t) * n_kv_heads + h) * head_dim;
      const float j = jitter(rng);
      for (int i = 0; i < head_dim; ++i) k[i] = j * (c[i] + noise * normal(rng));
    }
  }
  return data;
}

// A decode query per query head: a random cluster centre of its KV head (shared by the group)
// plus per-head noise, scaled so that attention is peaked like a real retrieval head's.
inline std::vector<float> MakeQuery(const ClusteredData& data, float noise, float gain,
                                    uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> pick(0, data.n_clusters - 1);
  const int group = data.n_heads / data.n_kv_heads;
  std::vector<float> q(static_cast<size_t>(data.n_heads) * data.head_dim);
  for (int h = 0; h < data.n_kv_heads; ++h) {
    const float* c = data.centres.data() +
                     (static_cast<size_t>(h) * data.n_clusters + pick(rng)) * data.head_dim;
    for (int g = 0; g < group; ++g) {
      float* qh = q.data() + static_cast<size_t>(h * group + g) * data.head_dim;
      for (int i = 0; i < data.head_dim; ++i) qh[i] = gain * (c[i] + noise * normal(rng));
    }
  }
  return q;
}

// Exact oracle under GqaAggregation::kSumSoftmax: for KV head h, the `budget` tokens in [lo, hi)
// with the largest sum over the group of softmax(scale q_g . k) (ties: lower position).
inline std::vector<int64_t> ExactTopK(const float* keys, int64_t row_stride, const float* query,
                                      int n_heads, int n_kv_heads, int head_dim, int kv_head,
                                      int64_t lo, int64_t hi, int64_t budget) {
  const int group = n_heads / n_kv_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  const int64_t n = hi - lo;
  std::vector<double> mass(n, 0.0);
  std::vector<double> logits(n);
  for (int g = 0; g < group; ++g) {
    const float* q = query + static_cast<size_t>(kv_head * group + g) * head_dim;
    double mx = -1e300;
    for (int64_t i = 0; i < n; ++i) {
      const float* k = keys + (lo + i) * row_stride + static_cast<int64_t>(kv_head) * head_dim;
      double s = 0;
      for (int j = 0; j < head_dim; ++j) s += double(q[j]) * k[j];
      logits[i] = scale * s;
      mx = std::max(mx, logits[i]);
    }
    double z = 0;
    for (int64_t i = 0; i < n; ++i) z += std::exp(logits[i] - mx);
    for (int64_t i = 0; i < n; ++i) mass[i] += std::exp(logits[i] - mx) / z;
  }
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return mass[a] > mass[b]; });
  order.resize(std::min(budget, n));
  for (int64_t& i : order) i += lo;
  std::sort(order.begin(), order.end());
  return order;
}

inline double Recall(const std::vector<int64_t>& selected, const std::vector<int64_t>& exact) {
  if (exact.empty()) return 1.0;
  int64_t hits = 0;
  for (int64_t id : exact) hits += std::binary_search(selected.begin(), selected.end(), id);
  return static_cast<double>(hits) / exact.size();
}

// Mean recall of `index` (built on data.keys) against ExactTopK over `trials` decode queries
// (MakeQuery, seeds 100, 101, ...), each selecting `budget` tokens per KV head at position
// n_tokens with sink 16 and a local window of 256.
inline absl::StatusOr<double> MeanRecall(RetrievalIndex& index, const ClusteredData& data,
                                         int trials, int64_t budget) {
  const int64_t n = data.n_tokens;
  double total = 0;
  int count = 0;
  Selection sel;
  for (int trial = 0; trial < trials; ++trial) {
    const std::vector<float> q = MakeQuery(data, 0.5f, 1.f, 100 + static_cast<uint32_t>(trial));
    const absl::Status selected =
        index.Select(SelectRequest{q.data(), n, budget, 16, n - 256}, &sel);
    if (!selected.ok()) return selected;
    for (int h = 0; h < data.n_kv_heads; ++h) {
      const std::vector<int64_t> exact =
          ExactTopK(data.keys.data(), int64_t{data.n_kv_heads} * data.head_dim, q.data(),
                    data.n_heads, data.n_kv_heads, data.head_dim, h, 16, n - 256, budget);
      total += Recall(sel.per_head[h], exact);
      ++count;
    }
  }
  return total / count;
}

}  // namespace kvr::retrieval::testing
