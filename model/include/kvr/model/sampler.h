#pragma once
// Token sampling: greedy, temperature, top-k and nucleus (top-p), deterministic for a given seed.
//
// Thread safety: a Sampler holds its random state; use one per sequence.

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace kvr::model {

struct SamplingOptions {
  float temperature = 0.f;  // <= 0: greedy (argmax; ties go to the lowest id)
  float top_p = 1.f;        // in (0, 1]: sample from the smallest set of tokens whose mass >= top_p
  uint64_t seed = 0;
  // > 0: sample among the top_k most likely tokens only (before top_p, which then applies to
  // their renormalised mass, as Hugging Face's TopKLogitsWarper -> TopPLogitsWarper); 0: off.
  uint32_t top_k = 0;
};

class Sampler {
 public:
  // InvalidArgument for top_p outside (0, 1] or a non-finite temperature.
  [[nodiscard]] static absl::StatusOr<Sampler> Create(const SamplingOptions& options);

  // Picks a token from `logits` [vocab]. InvalidArgument for an empty vector or one whose
  // logits are all NaN.
  [[nodiscard]] absl::StatusOr<int32_t> Sample(std::span<const float> logits);
  // Whether Sample is the argmax (temperature <= 0).
  bool greedy() const { return options_.temperature <= 0.f; }
  // What a greedy Sample returns, given the argmax found elsewhere (e.g. on the GPU; as ArgMax:
  // negative when no logit is finite, which is InvalidArgument here as in Sample).
  [[nodiscard]] static absl::StatusOr<int32_t> GreedyPick(int32_t argmax);

  const SamplingOptions& options() const { return options_; }

 private:
  explicit Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {}

  SamplingOptions options_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;  // (probability, id), reused across calls
};

// Index of the largest finite logit (lowest id among ties); -1 when there is none.
int32_t ArgMax(std::span<const float> logits);
// The largest logit minus the second largest: how near a greedy choice is to a tie.
float TopTwoGap(std::span<const float> logits);

}  // namespace kvr::model
