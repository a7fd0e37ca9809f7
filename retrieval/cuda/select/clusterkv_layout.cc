// Host side of the GPU clusterkv selector: the device layout of CPU ClusterKvIndex objects, read
// through their typed state (ClusterKvStateOf): per KV head centroids, offsets and ids, then the
// pending (appended, not yet clustered) keys as singleton clusters.

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/cuda/selection.cuh"

namespace kvr::retrieval::cuda {
namespace {

struct Head {
  std::vector<float> centroids;
  std::vector<int32_t> offsets;
  std::vector<int32_t> ids;
};

}  // namespace

absl::StatusOr<ClusterKvHostLayout> ClusterKvLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes) {
  ClusterKvHostLayout out;
  if (indexes.empty()) return out;
  const IndexShape& shape = indexes[0]->shape();
  const int nkv = shape.n_kv_heads, hd = shape.head_dim;
  std::vector<std::vector<Head>> heads(indexes.size());
  for (size_t b = 0; b < indexes.size(); ++b) {
    const RetrievalIndex& index = *indexes[b];
    if (index.method() != "clusterkv") {
      return absl::InvalidArgumentError(absl::StrCat("ClusterKvLayoutFromIndexes: index ", b,
                                                     " is '", std::string(index.method()), "'"));
    }
    if (index.shape().n_kv_heads != nkv || index.shape().head_dim != hd) {
      return absl::InvalidArgumentError(
          absl::StrCat("ClusterKvLayoutFromIndexes: index ", b, " has another shape"));
    }
    KVR_ASSIGN_OR_RETURN(const ClusterKvState st, ClusterKvStateOf(index));
    const std::span<const float> pending = st.pending_keys;
    const int64_t pending_begin = st.pending_begin;
    const int64_t row = static_cast<int64_t>(nkv) * hd;
    const int64_t n_pending = static_cast<int64_t>(pending.size()) / row;
    heads[b].resize(nkv);
    for (int h = 0; h < nkv; ++h) {
      Head& head = heads[b][h];
      head.centroids.assign(st.heads[h].centroids.begin(), st.heads[h].centroids.end());
      head.offsets.assign(st.heads[h].offsets.begin(), st.heads[h].offsets.end());
      head.ids.assign(st.heads[h].ids.begin(), st.heads[h].ids.end());
      if (head.offsets.empty()) head.offsets.push_back(0);
      // Pending tokens: singleton clusters after the real ones (the CPU's unit order).
      for (int64_t i = 0; i < n_pending; ++i) {
        head.centroids.insert(head.centroids.end(), pending.begin() + i * row + h * hd,
                              pending.begin() + i * row + (h + 1) * hd);
        head.ids.push_back(static_cast<int32_t>(pending_begin + i));
        head.offsets.push_back(static_cast<int32_t>(head.ids.size()));
      }
      out.max_clusters = std::max(out.max_clusters, static_cast<int>(head.offsets.size()) - 1);
      out.max_members = std::max(out.max_members, static_cast<int>(head.ids.size()));
    }
  }
  out.max_clusters = std::max(1, out.max_clusters);  // keep every array non-empty
  out.max_members = out.max_members;
  out.batch = static_cast<int>(indexes.size());
  out.n_kv_heads = nkv;
  out.head_dim = hd;
  const size_t rows = static_cast<size_t>(out.batch) * nkv;
  out.centroids.assign(rows * out.max_clusters * hd, 0.f);
  out.n_clusters.assign(rows, 0);
  out.offsets.assign(rows * (out.max_clusters + 1), 0);
  out.members.assign(rows * out.max_members, -1);
  for (int b = 0; b < out.batch; ++b) {
    for (int h = 0; h < nkv; ++h) {
      const Head& head = heads[b][h];
      const size_t r = static_cast<size_t>(b) * nkv + h;
      const int nc = static_cast<int>(head.offsets.size()) - 1;
      out.n_clusters[r] = nc;
      std::copy(head.centroids.begin(), head.centroids.end(),
                out.centroids.begin() + r * out.max_clusters * hd);
      std::copy(head.offsets.begin(), head.offsets.end(),
                out.offsets.begin() + r * (out.max_clusters + 1));
      std::copy(head.ids.begin(), head.ids.end(), out.members.begin() + r * out.max_members);
    }
  }
  return out;
}

}  // namespace kvr::retrieval::cuda
