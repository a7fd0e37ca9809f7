#include "kvr/retrieval/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include <cblas.h>

#include "absl/strings/str_cat.h"

namespace kvr::retrieval {

float Dot(const float* a, const float* b, int n) {
  // Eight independent partial sums: without -ffast-math the compiler may not reorder a single
  // float accumulation, so this is what lets it use SIMD lanes.
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

float Norm(const float* a, int n) { return std::sqrt(Dot(a, a, n)); }

std::vector<int64_t> TopKIndices(std::span<const float> scores, int64_t k) {
  const int64_t n = static_cast<int64_t>(scores.size());
  k = std::clamp<int64_t>(k, 0, n);
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  auto better = [&](int64_t a, int64_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  if (k < n) {
    std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
    idx.resize(k);
  }
  std::sort(idx.begin(), idx.end(), better);
  return idx;
}

float SoftmaxInPlace(std::span<float> x) {
  if (x.empty()) return -std::numeric_limits<float>::infinity();
  const float m = *std::max_element(x.begin(), x.end());
  if (!std::isfinite(m)) {  // all -inf: an empty distribution
    std::fill(x.begin(), x.end(), 0.f);
    return m;
  }
  double sum = 0;
  for (float& v : x) {
    v = std::exp(v - m);
    sum += v;
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (float& v : x) v *= inv;
  return m + static_cast<float>(std::log(sum));
}

namespace {

void NormaliseRow(float* v, int dim) {
  const float n = Norm(v, dim);
  if (n > 0.f) {
    const float inv = 1.f / n;
    for (int i = 0; i < dim; ++i) v[i] *= inv;
  }
}

float SquaredDistance(const float* a, const float* b, int dim) {
  float s = 0.f;
  for (int i = 0; i < dim; ++i) {
    const float d = a[i] - b[i];
    s += d * d;
  }
  return s;
}

}  // namespace

std::vector<int64_t> KMeansRandomInitPoints(int64_t n_points, int64_t k, uint64_t seed) {
  k = std::clamp<int64_t>(k, 0, std::max<int64_t>(0, n_points));
  std::mt19937_64 rng(seed);
  std::vector<int64_t> perm(n_points);
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t c = 0; c < k; ++c) {
    const int64_t j = std::uniform_int_distribution<int64_t>(c, n_points - 1)(rng);
    std::swap(perm[c], perm[j]);
  }
  perm.resize(k);
  return perm;
}

absl::StatusOr<KMeansResult> KMeans(const float* points, int64_t n_points, int dim, int64_t stride,
                                    const KMeansOptions& options) {
  if (n_points < 1) return absl::InvalidArgumentError("k-means: no points");
  if (options.n_clusters < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("k-means: n_clusters must be >= 1, got ", options.n_clusters));
  }
  if (dim < 1 || stride < dim) {
    return absl::InvalidArgumentError(absl::StrCat("k-means: bad dim ", dim, " / stride ", stride));
  }
  const int64_t k = std::min<int64_t>(options.n_clusters, n_points);
  // Points copied contiguously (normalised for cosine): the iterations re-read them k times.
  std::vector<float> x(n_points * dim);  // [n_points, dim]
  for (int64_t i = 0; i < n_points; ++i) {
    std::copy_n(points + i * stride, dim, x.data() + i * dim);
    if (options.cosine) NormaliseRow(x.data() + i * dim, dim);
  }
  // Distance to be minimised: cosine -> 1 - dot (points and centroids unit norm), else L2^2.
  auto distance = [&](const float* p, const float* c) {
    return options.cosine ? 1.f - Dot(p, c, dim) : SquaredDistance(p, c, dim);
  };

  std::mt19937_64 rng(options.seed);
  KMeansResult result;
  result.centroids.assign(k * dim, 0.f);  // [k, dim]
  if (options.plus_plus_init) {
    std::vector<float> d2(n_points, std::numeric_limits<float>::infinity());
    int64_t first = std::uniform_int_distribution<int64_t>(0, n_points - 1)(rng);
    std::copy_n(x.data() + first * dim, dim, result.centroids.data());
    for (int64_t c = 1; c < k; ++c) {
      const float* prev = result.centroids.data() + (c - 1) * dim;
      double total = 0;
      for (int64_t i = 0; i < n_points; ++i) {
        d2[i] = std::min(d2[i], std::max(0.f, distance(x.data() + i * dim, prev)));
        total += d2[i];
      }
      int64_t pick = 0;
      if (total > 0) {
        double r = std::uniform_real_distribution<double>(0, total)(rng);
        for (pick = 0; pick < n_points - 1; ++pick) {
          r -= d2[pick];
          if (r <= 0) break;
        }
      } else {
        pick = std::uniform_int_distribution<int64_t>(0, n_points - 1)(rng);
      }
      std::copy_n(x.data() + pick * dim, dim, result.centroids.data() + c * dim);
    }
  } else {
    // Distinct random points (ClusterKV: "randomly sample key vectors as initial centroids").
    const std::vector<int64_t> picks = KMeansRandomInitPoints(n_points, k, options.seed);
    for (int64_t c = 0; c < k; ++c) {
      std::copy_n(x.data() + picks[c] * dim, dim, result.centroids.data() + c * dim);
    }
  }

  result.assignment.assign(n_points, -1);
  std::vector<float> best_d(n_points);
  std::vector<double> sums(k * dim);
  std::vector<int64_t> counts(k);
  // Assignment through one SGEMM per chunk of points: dots = X C^T. Cosine: distance 1 - dot;
  // L2: |x|^2 - 2 x.c + |c|^2, where |x|^2 does not change the argmin.
  constexpr int64_t kChunk = 1024;
  std::vector<float> dots(kChunk * k);  // [chunk, k]
  std::vector<float> c_norm2(k);
  for (int it = 0; it < std::max(1, options.max_iterations); ++it) {
    bool changed = false;
    for (int64_t c = 0; c < k; ++c) {
      const float* cc = result.centroids.data() + c * dim;
      c_norm2[c] = Dot(cc, cc, dim);
    }
    for (int64_t i0 = 0; i0 < n_points; i0 += kChunk) {
      const int64_t rows = std::min(kChunk, n_points - i0);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                  static_cast<int>(k), dim, 1.f, x.data() + i0 * dim, dim, result.centroids.data(),
                  dim, 0.f, dots.data(), static_cast<int>(k));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const float* drow = dots.data() + r * k;
        int32_t best = 0;
        float bd = std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < k; ++c) {
          const float d = options.cosine ? 1.f - drow[c] : c_norm2[c] - 2.f * drow[c];
          if (d < bd) {
            bd = d;
            best = static_cast<int32_t>(c);
          }
        }
        // Store the true distance for empty-cluster re-seeding.
        best_d[i] = options.cosine ? bd : bd + Dot(x.data() + i * dim, x.data() + i * dim, dim);
        if (result.assignment[i] != best) {
          result.assignment[i] = best;
          changed = true;
        }
      }
    }
    result.iterations = it + 1;
    if (!changed && it > 0) break;
    std::fill(sums.begin(), sums.end(), 0.0);
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n_points; ++i) {
      const int32_t c = result.assignment[i];
      ++counts[c];
      const float* p = x.data() + i * dim;
      for (int j = 0; j < dim; ++j) sums[c * dim + j] += p[j];
    }
    for (int64_t c = 0; c < k; ++c) {
      float* centroid = result.centroids.data() + c * dim;
      if (counts[c] == 0) {
        // Re-seed an empty cluster with the point worst served by its centroid.
        const int64_t far = std::max_element(best_d.begin(), best_d.end()) - best_d.begin();
        std::copy_n(x.data() + far * dim, dim, centroid);
        best_d[far] = 0.f;
        continue;
      }
      for (int j = 0; j < dim; ++j) centroid[j] = static_cast<float>(sums[c * dim + j] / counts[c]);
      if (options.cosine) NormaliseRow(centroid, dim);
    }
  }
  return result;
}

}  // namespace kvr::retrieval
