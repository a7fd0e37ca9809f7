#pragma once
// Shipped indexes (SerializeIndex bytes) from summaries that were built elsewhere, e.g. on the
// GPU during prefill (retrieval/cuda prefill_summaries.h, on the model's build hook): the bytes
// are those that SerializeIndex writes for the CPU index holding the same state, so a decode
// node deserialises them as if the prefill node had built the index on the CPU.
//
// Every function checks the arrays against the shape and the token count (InvalidArgument
// naming the array), so a wrong buffer layout is an error here, not a corrupt index later.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// quest over `size` tokens: `bounds` [ceil(size / page_size), n_kv_heads, 2, head_dim] fp32, per
// page and KV head the per-channel min then max key (retrieval/cuda QuestPageBounds' layout).
// page_size and the GQA aggregation come from `params`.
[[nodiscard]] absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltQuest(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const float> bounds);

// clusterkv right after its prefill Build over `size` tokens: the first min(params.n_sink, size)
// tokens are sinks (never clustered), every other token is in exactly one cluster of its head.
struct PrebuiltClusterKvHead {
  std::span<const float> centroids;  // [n_clusters, head_dim]: mean key of each cluster
  std::span<const int32_t> offsets;  // [n_clusters + 1] into ids, ascending, offsets[0] = 0
  std::span<const int32_t> ids;      // [size - n_sink] token ids grouped by cluster
};
// `heads` has n_kv_heads entries. append_every / append_clusters / max_iterations / seed are
// params' (after the clusterkv.* options), as ClusterKvIndex::Build derives them.
[[nodiscard]] absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltClusterKv(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const PrebuiltClusterKvHead> heads);

// keydiff right after its prefill Build over `size` tokens (every token summed into the mean):
// per KV head the mean key as the CPU index ships it, float(sum / size) of the fp64 key sum, and
// every token's score (cos(k_t, mean), KeyDiffBuild's). `heads` has n_kv_heads entries; the fill
// is params.keydiff.fill.
struct PrebuiltKeyDiffHead {
  std::span<const float> mean;    // [head_dim]
  std::span<const float> scores;  // [size]
};
[[nodiscard]] absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltKeyDiff(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const PrebuiltKeyDiffHead> heads);

// The clusters of shipped clusterkv bytes right after the prefill Build (no generated tokens
// appended yet): what a GPU decode node uploads instead of clustering again. InvalidArgument when
// the bytes are not a clusterkv index (naming the method found) or hold appended tokens.
struct PrebuiltClusterKvData {
  int64_t size = 0;    // tokens the index covers
  int64_t n_sink = 0;  // never clustered
  std::vector<std::vector<float>> centroids;  // per KV head [n_clusters, head_dim]
  std::vector<std::vector<int32_t>> offsets;  // per KV head [n_clusters + 1]
  std::vector<std::vector<int32_t>> ids;      // per KV head, grouped by cluster
};
class MethodRegistry;
[[nodiscard]] absl::StatusOr<PrebuiltClusterKvData> ParsePrebuiltClusterKv(
    std::span<const uint8_t> bytes, const MethodRegistry& registry);

}  // namespace kvr::retrieval
