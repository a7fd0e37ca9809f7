// ClusterKV (Liu et al.): recall tokens at the granularity of semantic clusters of keys.
//
// Per KV head:
//  - prefill keys outside the sinks are clustered with cosine k-means into C0 clusters;
//  - the summary is the centroids (the MEAN of the member keys, not the unit direction: selection
//    ranks clusters by the inner product q.mu, as in the paper, and the mean keeps the keys'
//    magnitude, which the cosine assignment ignores) plus the token ids sorted by cluster with
//    per-cluster offsets;
//  - selection sorts clusters by their (GQA-aggregated) score and takes their candidate tokens in
//    that order until the budget, trimming the last cluster (in position order, or with
//    ClusterKvParams::rank_trimmed by the tokens' own scores, from a copy of the keys);
//  - generated tokens are buffered and every m of them are clustered into C+ new clusters.
//    Buffered tokens not yet clustered are scored exactly, as singleton clusters (the paper keeps
//    them in the GPU-resident recent window instead; our local window may be shorter than m).
//
// Choices (the paper's settings are for 32K contexts and budgets of 1-2K):
//  - C0 default: max(L/80, k L/budget) with k = ClusterKvParams::clusters_per_budget (16), at
//    most L/8. The paper's L/80 gives ~80-token clusters, 1/13 to 1/25 of its 1-2K budgets; at our
//    budgets (81-810) an 80-token cluster can exceed the whole budget, so the average cluster is
//    also kept at most 1/k of the budget (a step then spans about k clusters, as in the paper).
//    Measured at 8K, budget 243 (BENCHMARKS.md): recall 0.48 / 0.56 / 0.60 at k = 4 / 16 / 32,
//    summary 9 / 22 / 37 B per token and head; 16 is the paper's range at half the bytes of 32.
//  - rank_trimmed is off by default: +0.03 recall at k = 4 but +0.01 at k = 16, where the trimmed
//    cluster is a sixteenth of the budget, for a read of that cluster's keys per step.
//  - m = 320 and C+ = 4 as in the paper when not set: they only amortise clustering work, since
//    pending tokens are scored exactly; for contexts under 3200 tokens m is L/10 (>= 32).
//  - Sinks: the first IndexParams::n_sink tokens are never clustered (always attended).

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/prebuilt.h"
#include "kvr/retrieval/registry.h"
#include "method_util.h"

namespace kvr::retrieval {
namespace {

struct HeadClusters {
  std::vector<float> centroids;  // [n_clusters, head_dim] mean key of each cluster
  std::vector<int32_t> offsets;  // [n_clusters + 1] into ids
  std::vector<int32_t> ids;      // [n_clustered] token ids grouped by cluster
  int64_t n_clusters() const { return static_cast<int64_t>(offsets.size()) - 1; }
};

class ClusterKvIndex final : public RetrievalIndex {
 public:
  ClusterKvIndex(const IndexShape& shape, const IndexParams& params)
      : RetrievalIndex(shape), params_(params), heads_(shape.n_kv_heads) {
    for (auto& h : heads_) h.offsets = {0};
  }

  std::string_view method() const override { return "clusterkv"; }
  int64_t size() const override { return size_; }

  absl::Status Build(const BuildInput& input) override {
    if (built_) return absl::FailedPreconditionError("clusterkv: Build called twice");
    const int hd = shape().head_dim;
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, hd, "clusterkv Build keys"));
    const int64_t n = input.keys.n_tokens;
    const int64_t sink = std::min(params_.n_sink, n);
    const int64_t points = n - sink;
    KVR_ASSIGN_OR_RETURN(const int64_t c0, ClusterKvPrefillClusters(points, n, params_));
    MarkPrefilled(n, sink);
    if (params_.clusterkv.rank_trimmed) {
      internal::AppendPacked(input.keys, shape().n_kv_heads, hd, &keys_);
    }
    if (points > 0) {
      for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
        KVR_RETURN_IF_ERROR(AddClusters(kvh, input.keys.At(sink, kvh, hd), input.keys.row_stride,
                                        sink, points, c0, kvh));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Append(const AppendInput& input) override {
    if (!built_) return absl::FailedPreconditionError("clusterkv: Append before Build");
    const int hd = shape().head_dim;
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, hd, "clusterkv Append keys"));
    internal::AppendPacked(input.keys, shape().n_kv_heads, hd, &pending_keys_);
    if (params_.clusterkv.rank_trimmed) {
      internal::AppendPacked(input.keys, shape().n_kv_heads, hd, &keys_);
    }
    size_ += input.keys.n_tokens;
    const int64_t row = static_cast<int64_t>(shape().n_kv_heads) * hd;
    while (size_ - pending_begin_ >= append_every_) {
      for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
        KVR_RETURN_IF_ERROR(AddClusters(kvh, pending_keys_.data() + kvh * hd, row, pending_begin_,
                                        append_every_, params_.clusterkv.append_clusters,
                                        pending_begin_ + kvh));
      }
      pending_keys_.erase(pending_keys_.begin(), pending_keys_.begin() + append_every_ * row);
      pending_begin_ += append_every_;
    }
    return absl::OkStatus();
  }

  absl::Status Select(const SelectRequest& request, Selection* out) override {
    if (!built_) return absl::FailedPreconditionError("clusterkv: Select before Build");
    KVR_ASSIGN_OR_RETURN(const internal::CandidateRange c,
                         internal::BeginSelect(request, shape(), size_, out));
    if (c.count() == 0) return absl::OkStatus();
    const int hd = shape().head_dim;
    const int group = shape().group_size();
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    const int64_t row = static_cast<int64_t>(shape().n_kv_heads) * hd;
    const int64_t n_pending = size_ - pending_begin_;
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      const HeadClusters& h = heads_[kvh];
      const int64_t nc = h.n_clusters();
      // Units: clusters [0, nc), then pending tokens as singletons [nc, nc + n_pending).
      scores_.assign(static_cast<size_t>(group) * (nc + n_pending), 0.f);
      internal::GroupLogits(request.query, shape(), kvh, h.centroids.data(), hd, nc, scale, &tmp_);
      for (int g = 0; g < group; ++g) {
        std::copy_n(tmp_.data() + g * nc, nc, scores_.data() + g * (nc + n_pending));
      }
      if (n_pending > 0) {
        internal::GroupLogits(request.query, shape(), kvh, pending_keys_.data() + kvh * hd, row,
                              n_pending, scale, &tmp_);
        for (int g = 0; g < group; ++g) {
          std::copy_n(tmp_.data() + g * n_pending, n_pending,
                      scores_.data() + g * (nc + n_pending) + nc);
        }
      }
      std::vector<float> agg =
          internal::AggregateGroupScores(params_.gqa, scores_, group, nc + n_pending);
      std::vector<int64_t> order = TopKIndices(agg, nc + n_pending);
      auto& ids = out->per_head[kvh];
      const int64_t budget = request.budget;
      for (int64_t u : order) {
        if (u < nc) {
          member_.clear();
          for (int32_t j = h.offsets[u]; j < h.offsets[u + 1]; ++j) {
            if (c.Contains(h.ids[j])) member_.push_back(h.ids[j]);
          }
          const int64_t room = budget - static_cast<int64_t>(ids.size());
          if (static_cast<int64_t>(member_.size()) > room && params_.clusterkv.rank_trimmed) {
            TopMembersByScore(request.query, kvh, room);
          }
          const int64_t take = std::min<int64_t>(room, static_cast<int64_t>(member_.size()));
          ids.insert(ids.end(), member_.begin(), member_.begin() + take);
        } else if (c.Contains(pending_begin_ + (u - nc))) {
          ids.push_back(pending_begin_ + (u - nc));
        }
        if (static_cast<int64_t>(ids.size()) >= budget) break;
      }
      std::sort(ids.begin(), ids.end());
    }
    return absl::OkStatus();
  }

  // The key copy of rank_trimmed is not counted: as for ctkvr's rerank, a decode node reads the
  // trimmed cluster's keys where the KV lives; the CPU reference keeps a copy.
  int64_t MemoryBytes() const override {
    int64_t bytes = static_cast<int64_t>(pending_keys_.size() * sizeof(float));
    for (const auto& h : heads_) {
      bytes += (h.centroids.size() + h.offsets.size() + h.ids.size()) * 4;
    }
    return bytes;
  }

  ClusterKvState State() const {
    ClusterKvState s;
    s.n_sink = n_sink_;
    s.pending_begin = pending_begin_;
    s.pending_keys = pending_keys_;
    for (const HeadClusters& h : heads_) s.heads.push_back({h.centroids, h.offsets, h.ids});
    return s;
  }

  absl::Status SerializePayload(ByteWriter& w) const override {
    w.Put<uint8_t>(static_cast<uint8_t>(params_.gqa));
    w.Put<int64_t>(n_sink_);
    w.Put<int64_t>(append_every_);
    w.Put<int32_t>(params_.clusterkv.append_clusters);
    w.Put<int32_t>(params_.clusterkv.max_iterations);
    w.Put<uint64_t>(params_.seed);
    w.Put<int64_t>(pending_begin_);
    w.PutArray<float>(pending_keys_);
    w.Put<uint8_t>(params_.clusterkv.rank_trimmed ? 1 : 0);
    w.PutArray<float>(keys_);
    for (const auto& h : heads_) {
      w.PutArray<float>(h.centroids);
      w.PutArray<int32_t>(h.offsets);
      w.PutArray<int32_t>(h.ids);
    }
    return absl::OkStatus();
  }

  static absl::StatusOr<std::unique_ptr<RetrievalIndex>> Read(const IndexShape& shape,
                                                              const IndexParams& params,
                                                              int64_t size, ByteReader& r) {
    auto index = std::make_unique<ClusterKvIndex>(shape, params);
    KVR_ASSIGN_OR_RETURN(index->params_.gqa, internal::ReadGqa(r, "clusterkv"));
    KVR_RETURN_IF_ERROR(r.Get("clusterkv n_sink", &index->n_sink_));
    KVR_RETURN_IF_ERROR(r.Get("clusterkv append_every", &index->append_every_));
    KVR_RETURN_IF_ERROR(
        r.Get("clusterkv append_clusters", &index->params_.clusterkv.append_clusters));
    KVR_RETURN_IF_ERROR(
        r.Get("clusterkv max_iterations", &index->params_.clusterkv.max_iterations));
    KVR_RETURN_IF_ERROR(r.Get("clusterkv seed", &index->params_.seed));
    KVR_RETURN_IF_ERROR(r.Get("clusterkv pending_begin", &index->pending_begin_));
    if (index->append_every_ <= 0 || index->params_.clusterkv.append_clusters <= 0 ||
        index->params_.clusterkv.max_iterations <= 0 || index->n_sink_ < 0 ||
        index->pending_begin_ < index->n_sink_ || index->pending_begin_ > size) {
      return absl::DataLossError("clusterkv payload: corrupt parameters");
    }
    const int hd = shape.head_dim;
    const int64_t row = static_cast<int64_t>(shape.n_kv_heads) * hd;
    const int64_t n_pending = size - index->pending_begin_;
    KVR_RETURN_IF_ERROR(
        r.GetArray("clusterkv pending keys", &index->pending_keys_, n_pending * row));
    if (static_cast<int64_t>(index->pending_keys_.size()) != n_pending * row) {
      return absl::DataLossError("clusterkv payload: pending keys do not match the header size");
    }
    uint8_t rank_trimmed = 0;
    KVR_RETURN_IF_ERROR(r.Get("clusterkv rank_trimmed", &rank_trimmed));
    if (rank_trimmed > 1) return absl::DataLossError("clusterkv payload: bad rank_trimmed flag");
    index->params_.clusterkv.rank_trimmed = rank_trimmed == 1;
    KVR_RETURN_IF_ERROR(r.GetArray("clusterkv keys", &index->keys_, size * row));
    if (static_cast<int64_t>(index->keys_.size()) != (rank_trimmed ? size * row : 0)) {
      return absl::DataLossError("clusterkv payload: kept keys do not match the header size");
    }
    for (auto& h : index->heads_) {
      KVR_RETURN_IF_ERROR(r.GetArray("clusterkv centroids", &h.centroids, size * hd));
      KVR_RETURN_IF_ERROR(r.GetArray("clusterkv offsets", &h.offsets, size + 1));
      KVR_RETURN_IF_ERROR(r.GetArray("clusterkv ids", &h.ids, size));
      const int64_t nc = static_cast<int64_t>(h.offsets.size()) - 1;
      if (nc < 0 || static_cast<int64_t>(h.centroids.size()) != nc * hd || h.offsets[0] != 0 ||
          h.offsets.back() != static_cast<int32_t>(h.ids.size())) {
        return absl::DataLossError("clusterkv payload: inconsistent cluster tables");
      }
      for (int64_t i = 0; i < nc; ++i) {
        if (h.offsets[i] > h.offsets[i + 1]) {
          return absl::DataLossError("clusterkv payload: cluster offsets not ascending");
        }
      }
      for (int32_t id : h.ids) {
        if (id < 0 || id >= index->pending_begin_) {
          return absl::DataLossError(
              absl::StrCat("clusterkv payload: token id ", id, " outside the clustered range"));
        }
      }
    }
    index->size_ = size;
    index->built_ = true;
    return index;
  }

  // The clusters (prebuilt.h, ParsePrebuiltClusterKv), moved out: the index is spent.
  absl::StatusOr<PrebuiltClusterKvData> Export() && {
    if (pending_begin_ != size_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "clusterkv index holds ", size_ - pending_begin_, " appended tokens not clustered"));
    }
    PrebuiltClusterKvData d;
    d.size = size_;
    d.n_sink = n_sink_;
    for (HeadClusters& h : heads_) {
      d.centroids.push_back(std::move(h.centroids));
      d.offsets.push_back(std::move(h.offsets));
      d.ids.push_back(std::move(h.ids));
    }
    return d;
  }

  // The index right after Build over `size` tokens, with the clusters `heads` (prebuilt.h).
  static absl::StatusOr<std::unique_ptr<ClusterKvIndex>> FromClusters(
      const IndexShape& shape, const IndexParams& params, int64_t size,
      std::span<const PrebuiltClusterKvHead> heads) {
    if (static_cast<int>(heads.size()) != shape.n_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat("prebuilt clusterkv: ", heads.size(),
                                                     " heads, expected ", shape.n_kv_heads));
    }
    if (size < 0) return absl::InvalidArgumentError("prebuilt clusterkv: negative size");
    if (params.clusterkv.rank_trimmed) {
      return absl::InvalidArgumentError(
          "prebuilt clusterkv: rank_trimmed needs the keys, which prebuilt clusters do not carry");
    }
    auto index = std::make_unique<ClusterKvIndex>(shape, params);
    const int64_t sink = std::min(params.n_sink, size);
    const int hd = shape.head_dim;
    for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
      const PrebuiltClusterKvHead& in = heads[kvh];
      const std::string head = absl::StrCat("prebuilt clusterkv head ", kvh, ": ");
      if (in.offsets.empty() || in.offsets.front() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(head, "offsets must start at 0"));
      }
      const int64_t nc = static_cast<int64_t>(in.offsets.size()) - 1;
      if (static_cast<int64_t>(in.centroids.size()) != nc * hd) {
        return absl::InvalidArgumentError(absl::StrCat(head, "centroids has ", in.centroids.size(),
                                                       " floats, expected ", nc, " x ", hd));
      }
      if (static_cast<int64_t>(in.ids.size()) != size - sink ||
          in.offsets.back() != static_cast<int32_t>(in.ids.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            head, in.ids.size(), " ids ending at offset ", in.offsets.back(), ", expected ",
            size - sink, " (", size, " tokens minus ", sink, " sinks)"));
      }
      for (int64_t i = 0; i < nc; ++i) {
        if (in.offsets[i] > in.offsets[i + 1]) {
          return absl::InvalidArgumentError(absl::StrCat(head, "offsets not ascending"));
        }
      }
      std::vector<bool> seen(static_cast<size_t>(size), false);
      for (int32_t id : in.ids) {
        if (id < sink || id >= size || seen[id]) {
          return absl::InvalidArgumentError(absl::StrCat(
              head, "token id ", id, " is a sink, outside [0, ", size, ") or listed twice"));
        }
        seen[id] = true;
      }
      HeadClusters& h = index->heads_[kvh];
      h.centroids.assign(in.centroids.begin(), in.centroids.end());
      h.offsets.assign(in.offsets.begin(), in.offsets.end());
      h.ids.assign(in.ids.begin(), in.ids.end());
    }
    index->MarkPrefilled(size, sink);
    return index;
  }

 private:
  // The state right after the prefill Build over `n` tokens, the first `sink` never clustered
  // (Build and FromClusters; the clusters are theirs): every token clustered, none pending, and
  // m = append_every as the header derives it.
  void MarkPrefilled(int64_t n, int64_t sink) {
    n_sink_ = sink;
    append_every_ = params_.clusterkv.append_every > 0
                        ? params_.clusterkv.append_every
                        : (n >= 3200 ? 320 : std::max<int64_t>(32, n / 10));
    built_ = true;
    size_ = n;
    pending_begin_ = n;
  }

  // Reorders member_ (one cluster's candidate ids) so that its first `k` are the k with the
  // highest scores against the query group, combined per IndexParams::gqa over the cluster.
  void TopMembersByScore(const float* query, int kvh, int64_t k) {
    const int hd = shape().head_dim;
    const int group = shape().group_size();
    const int64_t row = static_cast<int64_t>(shape().n_kv_heads) * hd;
    const int64_t n = static_cast<int64_t>(member_.size());
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    member_scores_.assign(static_cast<size_t>(group) * n, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      internal::GroupLogits(query, shape(), kvh, keys_.data() + member_[i] * row + kvh * hd, row, 1,
                            scale, &tmp_);
      for (int g = 0; g < group; ++g) member_scores_[g * n + i] = tmp_[g];
    }
    std::vector<float> agg = internal::AggregateGroupScores(params_.gqa, member_scores_, group, n);
    std::vector<int64_t> order = TopKIndices(agg, k);
    std::vector<int64_t> top(order.size());
    for (size_t i = 0; i < order.size(); ++i) top[i] = member_[order[i]];
    member_ = std::move(top);
  }

  // Clusters `n` keys of one head (token ids first_id..first_id+n-1, rows `stride` floats apart)
  // into `k` new clusters appended to that head's tables.
  absl::Status AddClusters(int kvh, const float* keys, int64_t stride, int64_t first_id, int64_t n,
                           int64_t k, uint64_t salt) {
    const int hd = shape().head_dim;
    KMeansOptions opt;
    opt.n_clusters = static_cast<int>(std::min<int64_t>(k, n));
    opt.max_iterations = params_.clusterkv.max_iterations;
    opt.cosine = true;
    opt.seed = ClusterKvKMeansSeed(params_, salt, shape().layer);
    KVR_ASSIGN_OR_RETURN(KMeansResult km, KMeans(keys, n, hd, stride, opt));
    HeadClusters& h = heads_[kvh];
    const int64_t nc = opt.n_clusters;
    std::vector<int32_t> count(nc, 0);
    for (int32_t a : km.assignment) ++count[a];
    std::vector<double> mean(static_cast<size_t>(nc) * hd, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const float* key = keys + i * stride;
      double* m = mean.data() + static_cast<int64_t>(km.assignment[i]) * hd;
      for (int d = 0; d < hd; ++d) m[d] += key[d];
    }
    const int32_t base = static_cast<int32_t>(h.ids.size());
    std::vector<int32_t> cursor(nc);
    int32_t off = base;
    for (int64_t c = 0; c < nc; ++c) {
      if (count[c] == 0) continue;  // drop empty clusters (k-means re-seeds, but be safe)
      cursor[c] = off;
      off += count[c];
      for (int d = 0; d < hd; ++d) {
        h.centroids.push_back(static_cast<float>(mean[c * hd + d] / count[c]));
      }
      h.offsets.push_back(off);
    }
    h.ids.resize(off);
    for (int64_t i = 0; i < n; ++i) {
      h.ids[cursor[km.assignment[i]]++] = static_cast<int32_t>(first_id + i);
    }
    return absl::OkStatus();
  }

  IndexParams params_;
  bool built_ = false;
  int64_t size_ = 0;
  int64_t n_sink_ = 0;
  int64_t append_every_ = 320;
  int64_t pending_begin_ = 0;        // tokens [pending_begin_, size_) are not clustered yet
  std::vector<float> pending_keys_;  // [size_ - pending_begin_, n_kv_heads, head_dim]
  std::vector<HeadClusters> heads_;  // [n_kv_heads]
  std::vector<float> keys_;  // [size_, n_kv_heads, head_dim] only with rank_trimmed
  std::vector<float> scores_, tmp_, member_scores_;  // scratch
  std::vector<int64_t> member_;                      // scratch: one cluster's candidate ids
};

}  // namespace

absl::StatusOr<int64_t> ClusterKvPrefillClusters(int64_t points, int64_t context,
                                                 const IndexParams& params) {
  int64_t c0 = params.clusterkv.n_clusters;
  if (c0 == 0) {
    c0 = std::max<int64_t>(points / 80, int64_t{params.clusterkv.clusters_per_budget} * points /
                                            std::max<int64_t>(1, params.budget));
    c0 = std::clamp<int64_t>(c0, 1, ClusterKvMaxDefaultClusters(points));
  } else if (c0 > points && points > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "clusterkv: n_clusters (", c0, ") is larger than the ", points,
        " clusterable prefill tokens (context ", context, " minus ", context - points, " sinks)"));
  }
  return c0;
}

uint64_t ClusterKvKMeansSeed(const IndexParams& params, uint64_t salt, int layer) {
  return params.seed * 1000003 + salt * 7919 + static_cast<uint64_t>(layer);
}

absl::StatusOr<IndexParams> ApplyClusterKvOptions(const IndexParams& params) {
  IndexParams out = params;
  constexpr std::string_view kPrefix = "clusterkv.";
  for (const auto& [name, value] : params.options) {
    if (!name.starts_with(kPrefix)) continue;  // another method's option
    const std::string_view key = std::string_view(name).substr(kPrefix.size());
    KVR_ASSIGN_OR_RETURN(const int v, internal::ParseIntOption(name, value));
    if (key == "max_iterations") {
      if (v < 1 || v > 100) {
        return absl::InvalidArgumentError(
            absl::StrCat("option clusterkv.max_iterations must be in [1, 100], got ", value));
      }
      out.clusterkv.max_iterations = v;
    } else if (key == "clusters_per_budget") {
      if (v < 1 || v > 256) {
        return absl::InvalidArgumentError(absl::StrCat(
            "option clusterkv.clusters_per_budget must be in [1, 256], got ", value));
      }
      out.clusterkv.clusters_per_budget = v;
    } else if (key == "rank_trimmed") {
      if (v != 0 && v != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("option clusterkv.rank_trimmed must be 0 or 1, got ", value));
      }
      out.clusterkv.rank_trimmed = v == 1;
    } else if (key == "n_clusters") {
      if (v < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("option clusterkv.n_clusters must be >= 0 (0: default), got ", value));
      }
      out.clusterkv.n_clusters = v;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown option '", name,
          "'; clusterkv has clusterkv.max_iterations, clusterkv.n_clusters, "
          "clusterkv.clusters_per_budget, clusterkv.rank_trimmed"));
    }
  }
  return out;
}

absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltClusterKv(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const PrebuiltClusterKvHead> heads) {
  KVR_ASSIGN_OR_RETURN(IndexParams applied, ApplyClusterKvOptions(params));
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<ClusterKvIndex> index,
                       ClusterKvIndex::FromClusters(shape, applied, size, heads));
  return SerializeIndex(*index);
}

absl::StatusOr<PrebuiltClusterKvData> ParsePrebuiltClusterKv(std::span<const uint8_t> bytes,
                                                             const MethodRegistry& registry) {
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<RetrievalIndex> index,
                       DeserializeIndex(bytes, registry, IndexParams{}));
  auto* ckv = dynamic_cast<ClusterKvIndex*>(index.get());
  if (ckv == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "summaries are a '", std::string(index->method()), "' index, not clusterkv"));
  }
  return std::move(*ckv).Export();
}

absl::Status RegisterClusterKv(MethodRegistry& registry) {
  return registry.Register(
      "clusterkv", "ClusterKV: cosine k-means clusters of keys, cluster-ordered selection",
      [](const IndexShape& s,
         const IndexParams& p) -> absl::StatusOr<std::unique_ptr<RetrievalIndex>> {
        KVR_ASSIGN_OR_RETURN(IndexParams params, ApplyClusterKvOptions(p));
        return std::make_unique<ClusterKvIndex>(s, params);
      },
      &ClusterKvIndex::Read);
}

absl::StatusOr<ClusterKvState> ClusterKvStateOf(const RetrievalIndex& index) {
  KVR_ASSIGN_OR_RETURN(const ClusterKvIndex* typed,
                       internal::IndexAs<ClusterKvIndex>(index, "ClusterKvStateOf", "clusterkv"));
  return typed->State();
}

}  // namespace kvr::retrieval
