#pragma once
// Small numeric building blocks shared by the retrieval methods (and usable by
// kvr::retrieval_quant): dot products, top-k, softmax, k-means. Plain CPU reference code; the
// CUDA kernels of a later issue are tested against these.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace kvr::retrieval {

float Dot(const float* a, const float* b, int n);
float Norm(const float* a, int n);

// Indices of the k largest `scores` (k clipped to scores.size()), in descending score order;
// ties broken by the lower index so results are deterministic.
std::vector<int64_t> TopKIndices(std::span<const float> scores, int64_t k);

// In-place softmax of `x` (max-subtracted). Returns log-sum-exp of the input.
float SoftmaxInPlace(std::span<float> x);

struct KMeansOptions {
  int n_clusters = 0;
  int max_iterations = 10;
  bool cosine = false;          // spherical k-means: unit-normalised points and centroids
  bool plus_plus_init = false;  // k-means++ seeding (else: distinct random points)
  uint64_t seed = 1;
};

struct KMeansResult {
  std::vector<float> centroids;     // [n_clusters, dim]; cosine: unit norm
  std::vector<int32_t> assignment;  // [n_points]
  int iterations = 0;
};

// The initial centroids of KMeans without plus_plus_init: k distinct point indices drawn from
// `seed` (a partial Fisher-Yates shuffle), in centroid order. Exposed so that the GPU k-means
// (retrieval/cuda/summaries) starts from exactly the CPU's centroids.
std::vector<int64_t> KMeansRandomInitPoints(int64_t n_points, int64_t k, uint64_t seed);

// Lloyd's k-means over `points` ([n_points, dim], consecutive rows `stride` floats apart).
// n_clusters is clipped to n_points. Empty clusters are re-seeded with the point farthest from
// its centroid. InvalidArgument for n_clusters < 1 or n_points < 1.
[[nodiscard]] absl::StatusOr<KMeansResult> KMeans(const float* points, int64_t n_points, int dim,
                                                  int64_t stride, const KMeansOptions& options);

}  // namespace kvr::retrieval
