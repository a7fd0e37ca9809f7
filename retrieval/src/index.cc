#include "kvr/retrieval/index.h"

#include "absl/strings/str_cat.h"

namespace kvr::retrieval {

absl::Status IndexShape::Validate() const {
  if (n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retrieval index shape: n_heads, n_kv_heads and head_dim must be positive, got ", n_heads,
        ", ", n_kv_heads, ", ", head_dim));
  }
  if (n_heads % n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("retrieval index shape: n_heads (", n_heads,
                                                   ") is not a multiple of n_kv_heads (",
                                                   n_kv_heads, ")"));
  }
  if (layer < 0 || (n_layers > 0 && layer >= n_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval index shape: layer ", layer, " outside [0, ", n_layers, ")"));
  }
  if (rope.rotary_dim < 0 || rope.rotary_dim > head_dim || rope.rotary_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("retrieval index shape: rope rotary_dim ",
                                                   rope.rotary_dim, " must be even and in [0, ",
                                                   head_dim, "]"));
  }
  if (rope.style != RopeStyle::kNone && !(rope.theta > 0.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval index shape: rope theta must be > 0, got ", rope.theta));
  }
  return absl::OkStatus();
}

absl::Status IndexParams::Validate() const {
  if (budget <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval params: budget must be > 0 tokens per KV head, got ", budget));
  }
  if (n_sink < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval params: n_sink must be >= 0, got ", n_sink));
  }
  if (local_window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval params: local_window must be >= 0, got ", local_window));
  }
  if (quest.page_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retrieval params: quest page_size must be >= 0 (0 = default), got ", quest.page_size));
  }
  if (clusterkv.n_clusters < 0 || clusterkv.append_every < 0 || clusterkv.append_clusters <= 0 ||
      clusterkv.max_iterations <= 0 || clusterkv.clusters_per_budget <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retrieval params: clusterkv n_clusters/append_every must be >= 0 (0 = default), "
        "append_clusters, max_iterations and clusters_per_budget > 0; got ",
        clusterkv.n_clusters, "/", clusterkv.append_every, "/", clusterkv.append_clusters, "/",
        clusterkv.max_iterations, "/", clusterkv.clusters_per_budget));
  }
  if (ctkvr.n_centroids < 0 || ctkvr.list_length < 0 || ctkvr.n_recall < 0 || ctkvr.fifo_size < 0) {
    return absl::InvalidArgumentError(
        "retrieval params: ctkvr n_centroids, list_length, n_recall and fifo_size must be >= 0 "
        "(0 = scaled default)");
  }
  if (!(keydiff.fill > 0.f && keydiff.fill <= 1.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval params: keydiff fill must be in (0, 1], got ", keydiff.fill));
  }
  return absl::OkStatus();
}

int QuestPageSize(const IndexParams& params) {
  if (params.quest.page_size > 0) return params.quest.page_size;
  return static_cast<int>(std::clamp<int64_t>(params.budget / 16, 1, 16));
}

}  // namespace kvr::retrieval
