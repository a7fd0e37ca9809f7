#pragma once
// ClusterKV build parameters as the CPU index (retrieval/src/clusterkv.cc) derives them, exposed
// so that the GPU summary build (retrieval/cuda/summaries) clusters with the same cluster count and
// the same k-means seeds, and its results are comparable with the CPU's.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// C0, the prefill cluster count for `points` clusterable tokens (context minus sinks):
// params.clusterkv.n_clusters, or when 0 the scaled default max(L/80, k L/budget) in [1, L/8],
// k = params.clusterkv.clusters_per_budget.
// InvalidArgument when an explicit count exceeds `points` (> 0). `context` is for the message.
[[nodiscard]] absl::StatusOr<int64_t> ClusterKvPrefillClusters(int64_t points, int64_t context,
                                                               const IndexParams& params);
// The most clusters the scaled default gives `points` tokens, whatever the budget: L/8 (at
// least 1). What a GPU decode node reserves for a sequence's prefill clusters.
inline int64_t ClusterKvMaxDefaultClusters(int64_t points) {
  return points / 8 > 1 ? points / 8 : 1;
}

// params with the clusterkv.* method options applied (IndexParams::options, as `--option` of
// `kvr eval retrieval` and RetrievalParams.options of a request): clusterkv.max_iterations in
// [1, 100], clusterkv.n_clusters >= 0 (0: the scaled default), clusterkv.clusters_per_budget in
// [1, 256], clusterkv.rank_trimmed 0 or 1. Options of other methods are
// ignored; an unknown clusterkv.* name or a bad value is InvalidArgument naming it.
[[nodiscard]] absl::StatusOr<IndexParams> ApplyClusterKvOptions(const IndexParams& params);

// The k-means seed of one clustering call: `salt` is the KV head for the prefill clusters.
uint64_t ClusterKvKMeansSeed(const IndexParams& params, uint64_t salt, int layer);

// The state of a `clusterkv` index, read through its type rather than its serialised bytes: what
// the GPU selector uploads. Spans point into the index (valid while it lives and is not appended
// to). InvalidArgument for another method's index.
struct ClusterKvState {
  int64_t n_sink = 0;
  int64_t pending_begin = 0;  // tokens from here on are appended but not clustered yet
  std::span<const float> pending_keys;  // [size - pending_begin, n_kv_heads, head_dim]
  struct Head {
    std::span<const float> centroids;  // [n_clusters, head_dim] mean key of each cluster
    std::span<const int32_t> offsets;  // [n_clusters + 1] into ids (empty: no clusters)
    std::span<const int32_t> ids;      // token ids grouped by cluster
  };
  std::vector<Head> heads;  // [n_kv_heads]
};
[[nodiscard]] absl::StatusOr<ClusterKvState> ClusterKvStateOf(const RetrievalIndex& index);

}  // namespace kvr::retrieval
