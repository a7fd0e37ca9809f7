#include "kvr/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"

namespace kvr::model {

float TopTwoGap(std::span<const float> logits) {
  float first = -std::numeric_limits<float>::infinity(), second = first;
  for (float v : logits) {
    if (v > first) {
      second = first;
      first = v;
    } else if (v > second) {
      second = v;
    }
  }
  return first - second;
}

int32_t ArgMax(std::span<const float> logits) {
  int32_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) continue;
    if (best < 0 || logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

absl::StatusOr<Sampler> Sampler::Create(const SamplingOptions& options) {
  if (!std::isfinite(options.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite, got ", options.temperature));
  }
  if (!(options.top_p > 0.f && options.top_p <= 1.f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", options.top_p));
  }
  return Sampler(options);
}

absl::StatusOr<int32_t> Sampler::GreedyPick(int32_t argmax) {
  if (argmax < 0) return absl::InvalidArgumentError("Sample: no finite logit");
  return argmax;
}

absl::StatusOr<int32_t> Sampler::Sample(std::span<const float> logits) {
  if (logits.empty()) return absl::InvalidArgumentError("Sample: empty logits");
  KVR_ASSIGN_OR_RETURN(const int32_t best, GreedyPick(ArgMax(logits)));
  if (greedy()) return best;

  // Softmax at temperature T, from the largest logit down.
  const float max_logit = logits[best];
  const float inv_t = 1.f / options_.temperature;
  scratch_.clear();
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) continue;
    const float p = std::exp((logits[i] - max_logit) * inv_t);
    if (p == 0.f) continue;
    scratch_.emplace_back(p, static_cast<int32_t>(i));
    total += p;
  }
  // Probability descending, id ascending among equals: a total order, so the result depends
  // only on the logits and the random stream.
  auto before = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t sorted = 0;  // scratch_[0, sorted) is in `before` order
  if (options_.top_k > 0 && options_.top_k < scratch_.size()) {
    std::partial_sort(scratch_.begin(), scratch_.begin() + options_.top_k, scratch_.end(),
                      before);
    scratch_.resize(options_.top_k);
    sorted = scratch_.size();
    total = 0.0;
    for (const auto& [p, id] : scratch_) total += p;
  }
  size_t keep = scratch_.size();
  double kept_mass = total;
  if (options_.top_p < 1.f) {
    // The nucleus is usually a few dozen tokens: order a prefix first and sort everything only
    // when the prefix does not reach top_p (saves sorting the whole vocabulary every step).
    if (sorted < scratch_.size()) {
      sorted = std::min<size_t>(scratch_.size(), 256);
      std::partial_sort(scratch_.begin(), scratch_.begin() + sorted, scratch_.end(), before);
    }
    double cumulative = 0.0;
    for (size_t i = 0; i < scratch_.size(); ++i) {
      if (i == sorted) {
        std::sort(scratch_.begin() + sorted, scratch_.end(), before);
        sorted = scratch_.size();
      }
      cumulative += scratch_[i].first;
      if (cumulative >= options_.top_p * total) {
        keep = i + 1;
        kept_mass = cumulative;
        break;
      }
    }
  }
  std::uniform_real_distribution<double> uniform(0.0, kept_mass);
  const double target = uniform(rng_);
  double cumulative = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cumulative += scratch_[i].first;
    if (target < cumulative) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;  // rounding at the top end
}

}  // namespace kvr::model
