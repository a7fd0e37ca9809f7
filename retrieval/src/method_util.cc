#include "method_util.h"

#include <cmath>

#include "kvr/retrieval/ops.h"

namespace kvr::retrieval::internal {

std::vector<float> AggregateGroupScores(GqaAggregation how, std::span<float> scores, int group,
                                        int64_t n) {
  std::vector<float> out(n, how == GqaAggregation::kMaxLogit ? -INFINITY : 0.f);
  for (int g = 0; g < group; ++g) {
    std::span<float> row = scores.subspan(static_cast<size_t>(g) * n, n);
    if (how == GqaAggregation::kSumSoftmax) SoftmaxInPlace(row);
    for (int64_t i = 0; i < n; ++i) {
      out[i] = how == GqaAggregation::kMaxLogit ? std::max(out[i], row[i]) : out[i] + row[i];
    }
  }
  return out;
}

void GroupLogits(const float* query, const IndexShape& shape, int kvh, const float* base,
                 int64_t stride, int64_t n, float scale, std::vector<float>* out) {
  const int group = shape.group_size();
  const int hd = shape.head_dim;
  out->resize(static_cast<size_t>(group) * n);
  for (int g = 0; g < group; ++g) {
    const float* q = query + static_cast<int64_t>(kvh * group + g) * hd;
    float* o = out->data() + static_cast<int64_t>(g) * n;
    for (int64_t i = 0; i < n; ++i) o[i] = scale * Dot(q, base + i * stride, hd);
  }
}

}  // namespace kvr::retrieval::internal
