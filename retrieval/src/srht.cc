#include "srht.h"

#include <algorithm>
#include <cassert>

#include "absl/strings/str_format.h"

namespace kvr::retrieval::internal {

uint64_t SplitMix64Next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

int NextPowerOfTwo(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

void FastWalshHadamard(std::span<float> x) {
  const size_t n = x.size();
  assert((n & (n - 1)) == 0);
  for (size_t half = 1; half < n; half <<= 1) {
    for (size_t block = 0; block < n; block += 2 * half) {
      for (size_t j = block; j < block + half; ++j) {
        const float a = x[j];
        const float b = x[j + half];
        x[j] = a + b;
        x[j + half] = a - b;
      }
    }
  }
}

absl::StatusOr<Srht> Srht::Create(int input_dim, uint64_t seed) {
  // 1 << 16 is far above any head dimension in use (64-256); the bound keeps a corrupt
  // serialised header from asking for gigabytes.
  if (input_dim < 1 || input_dim > (1 << 16)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("SRHT input dimension must be in [1, 65536], got %d", input_dim));
  }
  const int output_dim = NextPowerOfTwo(input_dim);
  std::vector<float> signs(static_cast<size_t>(kRounds) * output_dim);
  uint64_t state = seed;
  for (size_t i = 0; i < signs.size(); i += 64) {
    const uint64_t bits = SplitMix64Next(state);
    for (size_t j = 0; j < 64 && i + j < signs.size(); ++j) {
      signs[i + j] = ((bits >> j) & 1) ? -1.f : 1.f;
    }
  }
  return Srht(input_dim, output_dim, seed, std::move(signs));
}

void Srht::Apply(std::span<const float> in, std::span<float> out) const {
  assert(static_cast<int>(in.size()) == input_dim_);
  assert(static_cast<int>(out.size()) == output_dim_);
  std::copy(in.begin(), in.end(), out.begin());
  std::fill(out.begin() + input_dim_, out.end(), 0.f);
  for (int round = 0; round < kRounds; ++round) {
    const float* s = signs_.data() + static_cast<size_t>(round) * output_dim_;
    for (int i = 0; i < output_dim_; ++i) out[i] *= s[i];
    FastWalshHadamard(out);
  }
  // Each round multiplies the norm by sqrt(P); undo both at once.
  static_assert(kRounds == 2, "the normalisation below assumes two rounds");
  const float norm = 1.f / static_cast<float>(output_dim_);
  for (float& v : out) v *= norm;
}

}  // namespace kvr::retrieval::internal
