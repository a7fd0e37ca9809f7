// Host side of ClusterKvBuild: the parameters the CPU ClusterKvIndex derives (clusterkv.h) and
// the k-means initial points (ops.h), so that the GPU build starts where the CPU does.

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/cuda/build.cuh"
#include "kvr/retrieval/ops.h"

namespace kvr::retrieval::cuda {

absl::StatusOr<ClusterKvBuildPlan> MakeClusterKvBuildPlan(const IndexShape& shape,
                                                          const IndexParams& params,
                                                          std::span<const int64_t> seq_lens) {
  if (shape.n_kv_heads < 1 || shape.head_dim < 1) {
    return absl::InvalidArgumentError("MakeClusterKvBuildPlan: bad shape");
  }
  if (seq_lens.empty()) return absl::InvalidArgumentError("MakeClusterKvBuildPlan: empty batch");
  ClusterKvBuildPlan plan;
  plan.batch = static_cast<int>(seq_lens.size());
  plan.n_kv_heads = shape.n_kv_heads;
  plan.head_dim = shape.head_dim;
  plan.max_iterations = std::max(1, params.clusterkv.max_iterations);
  const int rows = plan.batch * plan.n_kv_heads;
  std::vector<std::vector<int64_t>> picks(rows);
  plan.first_token.resize(plan.batch);
  plan.n_points.assign(rows, 0);
  plan.n_init.assign(rows, 0);
  plan.max_points = 1;
  plan.max_clusters = 1;
  for (int b = 0; b < plan.batch; ++b) {
    const int64_t n = seq_lens[b];
    if (n < 0 || n >= (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(
          absl::StrCat("MakeClusterKvBuildPlan: sequence ", b, " length ", n));
    }
    const int64_t sink = std::min(params.n_sink, n);
    const int64_t points = n - sink;
    plan.first_token[b] = static_cast<int32_t>(sink);
    if (points <= 0) continue;
    KVR_ASSIGN_OR_RETURN(const int64_t c0, ClusterKvPrefillClusters(points, n, params));
    const int64_t k = std::min(c0, points);
    for (int h = 0; h < plan.n_kv_heads; ++h) {
      const int r = b * plan.n_kv_heads + h;
      plan.n_points[r] = static_cast<int32_t>(points);
      plan.n_init[r] = static_cast<int32_t>(k);
      picks[r] = KMeansRandomInitPoints(points, k, ClusterKvKMeansSeed(params, h, shape.layer));
    }
    plan.max_points = std::max<int>(plan.max_points, static_cast<int>(points));
    plan.max_clusters = std::max<int>(plan.max_clusters, static_cast<int>(k));
  }
  plan.init_points.assign(static_cast<size_t>(rows) * plan.max_clusters, -1);
  for (int r = 0; r < rows; ++r) {
    for (size_t c = 0; c < picks[r].size(); ++c) {
      plan.init_points[static_cast<size_t>(r) * plan.max_clusters + c] =
          static_cast<int32_t>(picks[r][c]);
    }
  }
  return plan;
}

}  // namespace kvr::retrieval::cuda
