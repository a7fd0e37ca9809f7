#include "kvr/common/key_diff.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvr {

void KeyDiffScores(const float* keys, size_t n, size_t dim, size_t stride, float* scores) {
  if (n == 0) return;
  std::vector<double> norm(n, 0.0);
  std::vector<double> anchor(dim, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const float* k = keys + i * stride;
    double sq = 0.0;
    for (size_t d = 0; d < dim; ++d) sq += double{k[d]} * k[d];
    norm[i] = std::sqrt(sq);
    if (!std::isfinite(norm[i])) norm[i] = 0.0;  // unusable: scores 0 below
    if (norm[i] == 0.0) continue;
    for (size_t d = 0; d < dim; ++d) anchor[d] += k[d];
  }
  // The sum, not the mean: the scale drops out of the cosine.
  double anchor_sq = 0.0;
  for (size_t d = 0; d < dim; ++d) anchor_sq += anchor[d] * anchor[d];
  const double anchor_norm = std::sqrt(anchor_sq);
  for (size_t i = 0; i < n; ++i) {
    if (norm[i] == 0.0 || anchor_norm == 0.0) {
      scores[i] = 0.0f;
      continue;
    }
    const float* k = keys + i * stride;
    double dot = 0.0;
    for (size_t d = 0; d < dim; ++d) dot += k[d] * anchor[d];
    scores[i] = static_cast<float>(dot / (norm[i] * anchor_norm));
  }
}

std::vector<uint64_t> KeyDiffPagesToDrop(std::span<const float> scores, uint64_t page_rows,
                                         double keep_fraction, const KeyDiffPagePolicy& policy,
                                         std::span<const bool> pinned) {
  const uint64_t rows = scores.size();
  if (rows == 0 || page_rows == 0) return {};
  const uint64_t n_pages = (rows + page_rows - 1) / page_rows;
  const auto keep_pages = static_cast<uint64_t>(
      std::ceil(std::clamp(keep_fraction, 0.0, 1.0) * static_cast<double>(n_pages)));
  const uint64_t max_pages = n_pages - std::min(keep_pages, n_pages);
  if (max_pages == 0) return {};
  // Rows [keep_from, rows) are recent; a page is a candidate when it lies wholly in
  // [sink_rows, keep_from).
  const uint64_t keep_from = rows > policy.recent_rows ? rows - policy.recent_rows : 0;
  struct Candidate {
    double score;
    uint64_t page;
  };
  std::vector<Candidate> candidates;
  for (uint64_t p = 0; p < n_pages; ++p) {
    const uint64_t first = p * page_rows;
    const uint64_t end = std::min(rows, first + page_rows);
    if (first < policy.sink_rows || end > keep_from) continue;
    if (!pinned.empty() && pinned[p]) continue;
    double sum = 0.0;
    for (uint64_t r = first; r < end; ++r) sum += scores[r];
    candidates.push_back({sum / static_cast<double>(end - first), p});
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.score > b.score; });
  std::vector<uint64_t> out;
  for (const Candidate& c : candidates) {
    if (out.size() >= max_pages) break;
    out.push_back(c.page);
  }
  return out;
}

}  // namespace kvr
