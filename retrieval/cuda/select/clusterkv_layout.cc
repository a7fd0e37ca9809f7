// Host side of the GPU clusterkv selector: the device layout of CPU ClusterKvIndex objects, read
// from their payload (the shipped bytes, retrieval/src/clusterkv.cc SerializePayload): gqa,
// n_sink, append_every, append_clusters, max_iterations, seed, pending_begin, pending keys
// [n_pending, n_kv_heads, head_dim], then per KV head centroids, offsets and ids.

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/serialization.h"

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
    ByteWriter w;
    KVR_RETURN_IF_ERROR(index.SerializePayload(w));
    ByteReader r(w.bytes());
    uint8_t gqa = 0;
    int64_t n_sink = 0, append_every = 0, pending_begin = 0;
    int32_t append_clusters = 0, max_iterations = 0;
    uint64_t seed = 0;
    KVR_RETURN_IF_ERROR(r.Get("gqa", &gqa));
    KVR_RETURN_IF_ERROR(r.Get("n_sink", &n_sink));
    KVR_RETURN_IF_ERROR(r.Get("append_every", &append_every));
    KVR_RETURN_IF_ERROR(r.Get("append_clusters", &append_clusters));
    KVR_RETURN_IF_ERROR(r.Get("max_iterations", &max_iterations));
    KVR_RETURN_IF_ERROR(r.Get("seed", &seed));
    KVR_RETURN_IF_ERROR(r.Get("pending_begin", &pending_begin));
    std::vector<float> pending;
    KVR_RETURN_IF_ERROR(r.GetArray("pending keys", &pending));
    const int64_t row = static_cast<int64_t>(nkv) * hd;
    const int64_t n_pending = static_cast<int64_t>(pending.size()) / row;
    heads[b].resize(nkv);
    for (int h = 0; h < nkv; ++h) {
      Head& head = heads[b][h];
      KVR_RETURN_IF_ERROR(r.GetArray("centroids", &head.centroids));
      KVR_RETURN_IF_ERROR(r.GetArray("offsets", &head.offsets));
      KVR_RETURN_IF_ERROR(r.GetArray("ids", &head.ids));
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
