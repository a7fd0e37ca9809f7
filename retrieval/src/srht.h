#pragma once
// Subsampled-randomised-Hadamard-style rotation (SRHT) shared by every key and query of one
// ParisKV index. Internal to kvr::retrieval_quant; exposed in src/ only so that tests can check
// the math directly.
//
// The transform maps R^d into R^P, P = next power of two >= d, as
//   R x = H D2 H D1 [x; 0] / P
// where H is the (unnormalised) Walsh-Hadamard matrix of size P and D1, D2 are diagonal +-1
// matrices drawn from a seeded SplitMix64 stream. Each H/sqrt(P) is orthogonal, so R is an
// isometry: inner products and norms are preserved exactly (up to float rounding), which is what
// ParisKV needs (<R k, R q> = <k, q>). Why two rounds: one H D round already spreads a vector
// with a few large "outlier" channels (common in LLM keys) over all coordinates, but the result
// is still a structured +-1 combination; a second round makes the coordinate distribution much
// closer to the Haar-random rotation that the paper's Beta priors (Prop. 4.1) assume, at a cost
// of another P log P adds. No subsampling: ParisKV needs an orthogonal map, not a sketch.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace kvr::retrieval::internal {

// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fully specified generator, so that the rotation
// for a given seed is identical on every platform and can be reproduced by a GPU kernel.
uint64_t SplitMix64Next(uint64_t& state);

// Smallest power of two >= n (n >= 1).
int NextPowerOfTwo(int n);

// In-place unnormalised fast Walsh-Hadamard transform; x.size() must be a power of two.
void FastWalshHadamard(std::span<float> x);

class Srht {
 public:
  static constexpr int kRounds = 2;

  // `input_dim` >= 1 (the head dimension). The output dimension is NextPowerOfTwo(input_dim).
  [[nodiscard]] static absl::StatusOr<Srht> Create(int input_dim, uint64_t seed);

  int input_dim() const { return input_dim_; }
  int output_dim() const { return output_dim_; }
  uint64_t seed() const { return seed_; }

  // out = R in. in: [input_dim], out: [output_dim]. `in` and `out` must not overlap.
  void Apply(std::span<const float> in, std::span<float> out) const;

 private:
  Srht(int input_dim, int output_dim, uint64_t seed, std::vector<float> signs)
      : input_dim_(input_dim), output_dim_(output_dim), seed_(seed), signs_(std::move(signs)) {}

  int input_dim_;
  int output_dim_;
  uint64_t seed_;
  std::vector<float> signs_;  // [kRounds, output_dim], entries +-1
};

}  // namespace kvr::retrieval::internal
