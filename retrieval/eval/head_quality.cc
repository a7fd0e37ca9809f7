#include "head_quality.h"

#include <algorithm>
#include <cmath>

#include "kvr/retrieval/ops.h"

namespace kvr::retrieval::eval {

void HeadLogits(const kvr::model::AttentionShape& shape, const kvr::model::AttentionRequest& r,
                int h, std::span<float> logits) {
  const int hd = shape.head_dim;
  const int kvh = h / (shape.n_heads / shape.n_kv_heads);
  const float* q = r.q + int64_t{h} * hd;
  for (size_t t = 0; t < logits.size(); ++t) {
    logits[t] = shape.scale *
                Dot(q, r.kv.k + static_cast<int64_t>(t) * r.kv.row_stride + int64_t{kvh} * hd, hd);
  }
}

void WeightedValues(const kvr::model::AttentionRequest& r, int kvh, int head_dim,
                    std::span<const float> weights, float* out) {
  std::fill(out, out + head_dim, 0.f);
  for (size_t t = 0; t < weights.size(); ++t) {
    const float* v = r.kv.v + static_cast<int64_t>(t) * r.kv.row_stride + int64_t{kvh} * head_dim;
    for (int d = 0; d < head_dim; ++d) out[d] += weights[t] * v[d];
  }
}

void HeadQuality::Add(double head_mass, const float* out, std::span<const float> dense) {
  double diff = 0, norm = 0;
  for (size_t d = 0; d < dense.size(); ++d) {
    diff += (out[d] - dense[d]) * (out[d] - dense[d]);
    norm += dense[d] * dense[d];
  }
  mass += std::min(1.0, head_mass);
  rel_error += norm > 0 ? std::sqrt(diff / norm) : 0.0;
  ++head_samples;
}

}  // namespace kvr::retrieval::eval
