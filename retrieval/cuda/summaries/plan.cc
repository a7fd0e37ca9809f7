// Host side of ClusterKvBuild: the parameters the CPU ClusterKvIndex derives (clusterkv.h) and
// the k-means initial points (ops.h), so that the GPU build starts where the CPU does. And the
// same for CtkvrBuild (C, rho and the sinks as CtkvrIndex::Build, ctkvr.cc).

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/ctkvr.h"
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

absl::StatusOr<CtkvrBuildPlan> MakeCtkvrBuildPlan(const IndexShape& shape,
                                                  const IndexParams& params,
                                                  std::span<const int64_t> seq_lens,
                                                  std::span<const int64_t> n_queries) {
  if (shape.n_kv_heads < 1 || shape.head_dim < 1 || shape.n_heads < shape.n_kv_heads ||
      shape.n_heads % shape.n_kv_heads != 0) {
    return absl::InvalidArgumentError("MakeCtkvrBuildPlan: bad shape");
  }
  if (seq_lens.empty()) return absl::InvalidArgumentError("MakeCtkvrBuildPlan: empty batch");
  if (n_queries.size() != seq_lens.size()) {
    return absl::InvalidArgumentError("MakeCtkvrBuildPlan: n_queries and seq_lens differ in size");
  }
  CtkvrBuildPlan plan;
  plan.batch = static_cast<int>(seq_lens.size());
  plan.n_kv_heads = shape.n_kv_heads;
  plan.group = shape.n_heads / shape.n_kv_heads;
  plan.head_dim = shape.head_dim;
  plan.n_recall = CtkvrRecall(params);
  const int nb = plan.batch;
  plan.per_seq.assign(static_cast<size_t>(5) * nb, 0);
  for (int b = 0; b < nb; ++b) {
    const int64_t n = seq_lens[b], nq = n_queries[b];
    if (n < 0 || n >= (int64_t{1} << 31) || nq < 0 || nq >= (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(
          absl::StrCat("MakeCtkvrBuildPlan: sequence ", b, " length ", n, " queries ", nq));
    }
    // As CtkvrIndex::Build.
    int64_t c = params.ctkvr.n_centroids;
    if (c == 0) {
      c = std::min<int64_t>({2048, std::max<int64_t>(1, n / 16), nq});
    } else if (c > n) {
      return absl::InvalidArgumentError(absl::StrCat("ctkvr: C (", c,
                                                     " query centroids) is larger than the ", n,
                                                     "-token context (sequence ", b, ")"));
    } else if (c > nq) {
      return absl::InvalidArgumentError(
          absl::StrCat("ctkvr: C (", c, " query centroids) is larger than the ", nq,
                       " prefill queries passed to Build (sequence ", b, ")"));
    }
    if (c <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ctkvr: Build needs prefill queries (sequence ", b, " has none)"));
    }
    const int64_t sink = std::min(params.n_sink, n);
    const int64_t listable = n - sink;
    int64_t rho = params.ctkvr.list_length > 0
                      ? params.ctkvr.list_length
                      : static_cast<int64_t>(std::ceil(2.5 * static_cast<double>(params.budget)));
    rho = std::max<int64_t>(1, std::min(rho, listable));
    const int64_t len = listable > 0 ? rho : 0;
    plan.per_seq[b] = static_cast<int32_t>(sink);
    plan.per_seq[nb + b] = static_cast<int32_t>(listable);
    plan.per_seq[2 * nb + b] = static_cast<int32_t>(c);
    plan.per_seq[3 * nb + b] = static_cast<int32_t>(len);
    plan.per_seq[4 * nb + b] = static_cast<int32_t>(nq - c);
    plan.max_centroids = std::max<int>(plan.max_centroids, static_cast<int>(c));
    plan.max_list_length = std::max<int>(plan.max_list_length, static_cast<int>(len));
    plan.max_listable = std::max<int>(plan.max_listable, static_cast<int>(listable));
  }
  const int64_t entries = static_cast<int64_t>(plan.max_centroids) * plan.max_list_length;
  if (entries >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("MakeCtkvrBuildPlan: C x rho = ", entries, " list entries per head"));
  }
  plan.max_list_entries = static_cast<int>(entries);
  return plan;
}

}  // namespace kvr::retrieval::cuda
