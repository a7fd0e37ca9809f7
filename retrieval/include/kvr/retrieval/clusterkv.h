#pragma once
// ClusterKV build parameters as the CPU index (retrieval/src/clusterkv.cc) derives them, exposed
// so that the GPU summary build (retrieval/cuda/summaries) clusters with the same cluster count and
// the same k-means seeds, and its results are comparable with the CPU's.

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// C0, the prefill cluster count for `points` clusterable tokens (context minus sinks):
// params.clusterkv.n_clusters, or when 0 the scaled default max(L/80, k L/budget) in [1, L/8],
// k = params.clusterkv.clusters_per_budget.
// InvalidArgument when an explicit count exceeds `points` (> 0). `context` is for the message.
[[nodiscard]] absl::StatusOr<int64_t> ClusterKvPrefillClusters(int64_t points, int64_t context,
                                                               const IndexParams& params);

// params with the clusterkv.* method options applied (IndexParams::options, as `--option` of
// `kvr eval retrieval` and RetrievalParams.options of a request): clusterkv.max_iterations in
// [1, 100], clusterkv.n_clusters >= 0 (0: the scaled default), clusterkv.clusters_per_budget in
// [1, 256], clusterkv.rank_trimmed 0 or 1. Options of other methods are
// ignored; an unknown clusterkv.* name or a bad value is InvalidArgument naming it.
[[nodiscard]] absl::StatusOr<IndexParams> ApplyClusterKvOptions(const IndexParams& params);

// The k-means seed of one clustering call: `salt` is the KV head for the prefill clusters.
uint64_t ClusterKvKMeansSeed(const IndexParams& params, uint64_t salt, int layer);

}  // namespace kvr::retrieval
