#include "method_util.h"

#include <cblas.h>

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
  if (n == 0) return;
  // [group, hd] x [n, hd (rows `stride` apart)]^T -> [group, n]: one SGEMM reads each key once
  // for the whole query group.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, group, static_cast<int>(n), hd, scale,
              query + static_cast<int64_t>(kvh) * group * hd, hd, base, static_cast<int>(stride),
              0.f, out->data(), static_cast<int>(n));
}

}  // namespace kvr::retrieval::internal
