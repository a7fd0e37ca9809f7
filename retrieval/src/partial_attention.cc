#include "kvr/retrieval/partial_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvr/retrieval/ops.h"

namespace kvr::retrieval {

float AttendPartial(const PartialAttentionInput& in, float* out, std::span<float> scores_scratch) {
  const int64_t n = in.rows.empty() ? in.n_rows : static_cast<int64_t>(in.rows.size());
  std::fill_n(out, in.head_dim, 0.f);
  if (n == 0) return -std::numeric_limits<float>::infinity();
  auto row = [&](int64_t i) { return in.rows.empty() ? i : in.rows[i]; };
  float* s = scores_scratch.data();
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    s[i] = in.scale * Dot(in.q, in.keys + row(i) * in.row_stride, in.head_dim);
    m = std::max(m, s[i]);
  }
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float p = std::exp(s[i] - m);
    sum += p;
    const float* v = in.values + row(i) * in.row_stride;
    for (int d = 0; d < in.head_dim; ++d) out[d] += p * v[d];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int d = 0; d < in.head_dim; ++d) out[d] *= inv;
  return m + static_cast<float>(std::log(sum));
}

void MergeAttentionPartial(float* out_a, float* lse_a, const float* out_b, float lse_b,
                           int head_dim) {
  if (lse_b == -std::numeric_limits<float>::infinity()) return;
  if (*lse_a == -std::numeric_limits<float>::infinity()) {
    std::copy_n(out_b, head_dim, out_a);
    *lse_a = lse_b;
    return;
  }
  const float m = std::max(*lse_a, lse_b);
  const float wa = std::exp(*lse_a - m);
  const float wb = std::exp(lse_b - m);
  const float inv = 1.f / (wa + wb);
  for (int d = 0; d < head_dim; ++d) out_a[d] = (wa * out_a[d] + wb * out_b[d]) * inv;
  *lse_a = m + std::log(wa + wb);
}

void MergeAttentionPartials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                            int n_heads, int head_dim) {
  for (int h = 0; h < n_heads; ++h) {
    MergeAttentionPartial(out_a + static_cast<int64_t>(h) * head_dim, lse_a + h,
                          out_b + static_cast<int64_t>(h) * head_dim, lse_b[h], head_dim);
  }
}

}  // namespace kvr::retrieval
