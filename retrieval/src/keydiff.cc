#include "kvr/retrieval/keydiff.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kvr/common/key_diff.h"
#include "kvr/retrieval/ops.h"

namespace kvr::retrieval {

std::vector<float> KeyDiffScores(const TokenTensor& keys, int head, int head_dim) {
  std::vector<float> scores(keys.n_tokens);
  if (keys.n_tokens > 0) {
    kvr::KeyDiffScores(keys.At(0, head, head_dim), static_cast<size_t>(keys.n_tokens),
                       static_cast<size_t>(head_dim), static_cast<size_t>(keys.row_stride),
                       scores.data());
  }
  return scores;
}

std::vector<int64_t> KeyDiffEvictionOrder(std::span<const float> scores,
                                          std::span<const int64_t> protected_tokens) {
  std::vector<int64_t> order;
  order.reserve(scores.size());
  for (int64_t t = 0; t < static_cast<int64_t>(scores.size()); ++t) {
    if (!std::binary_search(protected_tokens.begin(), protected_tokens.end(), t)) {
      order.push_back(t);
    }
  }
  // Highest cosine to the mean = least distinctive = evicted first; ties: older first.
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
  return order;
}

KeyDiffTracker::KeyDiffTracker(int head_dim) : head_dim_(head_dim), sum_d_(head_dim, 0.0) {}

std::vector<float> KeyDiffTracker::Mean() const {
  std::vector<float> mean(head_dim_, 0.f);
  if (count_ > 0) {
    for (int i = 0; i < head_dim_; ++i) mean[i] = static_cast<float>(sum_d_[i] / count_);
  }
  return mean;
}

void KeyDiffTracker::Restore(std::span<const float> mean, int64_t count) {
  for (int i = 0; i < head_dim_; ++i) sum_d_[i] = static_cast<double>(mean[i]) * count;
  count_ = count;
}

void KeyDiffTracker::Add(const float* key) {
  for (int i = 0; i < head_dim_; ++i) sum_d_[i] += key[i];
  ++count_;
}

void KeyDiffTracker::Remove(const float* key) {
  for (int i = 0; i < head_dim_; ++i) sum_d_[i] -= key[i];
  --count_;
}

float KeyDiffTracker::Score(const float* key) const {
  if (count_ <= 0) return 0.f;
  // cos(k, mean) == cos(k, sum): the mean's scale drops out.
  double dot = 0, nk = 0, ns = 0;
  for (int i = 0; i < head_dim_; ++i) {
    dot += key[i] * sum_d_[i];
    nk += static_cast<double>(key[i]) * key[i];
    ns += sum_d_[i] * sum_d_[i];
  }
  if (nk == 0 || ns == 0) return 0.f;
  return static_cast<float>(dot / std::sqrt(nk * ns));
}

}  // namespace kvr::retrieval
