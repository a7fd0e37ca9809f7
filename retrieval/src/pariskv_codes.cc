#include "pariskv_codes.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_format.h"

namespace kvr::retrieval::internal {

namespace {

std::array<float, kMagnitudeLevels> ComputeDirectionLevels(int m) {
  // Discretise [0, 1] finely and run Lloyd-Max on the discretised density. 2^13 cells put the
  // levels within ~1e-4 of the continuous optimum, far below the 3-bit quantisation step.
  constexpr int kCells = 1 << 13;
  constexpr int kIterations = 100;
  const double exponent = (m - 3) / 2.0;
  std::vector<double> t(kCells), mass(kCells);
  for (int i = 0; i < kCells; ++i) {
    t[i] = (i + 0.5) / kCells;
    // Midpoint rule; for m = 2 the density has an integrable singularity at t = 1 that the
    // midpoint of the last cell stays clear of.
    mass[i] = std::pow(1.0 - t[i] * t[i], exponent);
  }
  const double total = std::accumulate(mass.begin(), mass.end(), 0.0);
  // Start from the conditional means of 8 equal-mass slices (a good Lloyd-Max initialisation).
  std::array<double, kMagnitudeLevels> level{};
  {
    std::array<double, kMagnitudeLevels> sum{}, weight{};
    double cum = 0;
    for (int i = 0; i < kCells; ++i) {
      const int slot =
          std::min(kMagnitudeLevels - 1, static_cast<int>(cum / total * kMagnitudeLevels));
      sum[slot] += mass[i] * t[i];
      weight[slot] += mass[i];
      cum += mass[i];
    }
    for (int l = 0; l < kMagnitudeLevels; ++l) level[l] = sum[l] / weight[l];
  }
  for (int iter = 0; iter < kIterations; ++iter) {
    std::array<double, kMagnitudeLevels> sum{}, weight{};
    int l = 0;
    for (int i = 0; i < kCells; ++i) {
      while (l + 1 < kMagnitudeLevels && t[i] > 0.5 * (level[l] + level[l + 1])) ++l;
      sum[l] += mass[i] * t[i];
      weight[l] += mass[i];
    }
    for (int j = 0; j < kMagnitudeLevels; ++j) {
      if (weight[j] > 0) level[j] = sum[j] / weight[j];
    }
  }
  std::array<float, kMagnitudeLevels> out{};
  for (int l = 0; l < kMagnitudeLevels; ++l) out[l] = static_cast<float>(level[l]);
  return out;
}

}  // namespace

absl::StatusOr<std::array<float, kMagnitudeLevels>> DirectionLevels(int m) {
  if (m < 2 || m > kMaxSubspaceDim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ParisKV subspace dimension must be in [2, %d], got %d", kMaxSubspaceDim, m));
  }
  // Computed once per process (a few ms each) and immutable afterwards: indexes are created per
  // (sequence, layer), far too often to rerun Lloyd-Max every time. Thread-safe static init.
  static const auto* const kTable = [] {
    auto* table = new std::array<std::array<float, kMagnitudeLevels>, kMaxSubspaceDim + 1>{};
    for (int d = 2; d <= kMaxSubspaceDim; ++d) (*table)[d] = ComputeDirectionLevels(d);
    return table;
  }();
  return (*kTable)[m];
}

float EncodeDirection(std::span<const float> u, const std::array<float, kMagnitudeLevels>& levels,
                      std::span<uint8_t> codes) {
  assert(codes.size() >= u.size());
  float dot = 0.f;
  for (size_t j = 0; j < u.size(); ++j) {
    const float t = std::fabs(u[j]);
    // Levels are sorted ascending; 8 compares are cheaper than a search.
    int best = 0;
    float best_err = std::fabs(t - levels[0]);
    for (int l = 1; l < kMagnitudeLevels; ++l) {
      const float err = std::fabs(t - levels[l]);
      if (err < best_err) {
        best_err = err;
        best = l;
      }
    }
    codes[j] = static_cast<uint8_t>(best | (u[j] < 0.f ? kSignBit : 0));
    dot += levels[best] * t;
  }
  return dot;
}

float CentroidDot(std::span<const float> x, uint32_t id) {
  float dot = 0.f;
  for (size_t j = 0; j < x.size(); ++j) dot += ((id >> j) & 1) ? -x[j] : x[j];
  return dot / std::sqrt(static_cast<float>(x.size()));
}

void AllCentroidDots(std::span<const float> x, std::span<float> scores) {
  const size_t m = x.size();
  assert(scores.size() == (size_t{1} << m));
  const float inv_sqrt_m = 1.f / std::sqrt(static_cast<float>(m));
  float all_positive = 0.f;
  for (float v : x) all_positive += v;
  scores[0] = all_positive * inv_sqrt_m;
  for (size_t j = 0; j < m; ++j) {
    const float flip = 2.f * x[j] * inv_sqrt_m;
    const size_t half = size_t{1} << j;
    for (size_t c = 0; c < half; ++c) scores[half + c] = scores[c] - flip;
  }
}

void CollisionBonus(std::span<const float> centroid_scores,
                    std::span<const uint32_t> centroid_counts, double rho_keys, int n_tiers,
                    std::span<uint8_t> bonus) {
  const size_t n_centroids = centroid_scores.size();
  assert(centroid_counts.size() == n_centroids && bonus.size() == n_centroids);
  assert(n_tiers >= 1 && n_tiers <= 255);
  std::fill(bonus.begin(), bonus.end(), 0);
  // Sort non-empty centroids by descending score with ties by id, as one 64-bit key each
  // (order-preserving bits of -score above the id): a plain integer sort, no comparator calls.
  std::vector<uint64_t> order;
  order.reserve(n_centroids);
  for (size_t c = 0; c < n_centroids; ++c) {
    if (centroid_counts[c] == 0) continue;
    uint32_t bits;
    const float neg = -centroid_scores[c] + 0.f;  // + 0.f folds -0 into +0
    std::memcpy(&bits, &neg, sizeof(bits));
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // float order -> uint order
    order.push_back((static_cast<uint64_t>(bits) << 32) | c);
  }
  std::sort(order.begin(), order.end());
  const double slice = std::max(rho_keys, 1.0) / n_tiers;
  double filled = 0;
  for (uint64_t key : order) {
    const uint32_t c = static_cast<uint32_t>(key & 0xFFFFFFFFu);
    const int tier = static_cast<int>(filled / slice);
    if (tier >= n_tiers) break;
    bonus[c] = static_cast<uint8_t>(n_tiers - tier);
    filled += centroid_counts[c];
  }
}

}  // namespace kvr::retrieval::internal
