#pragma once
// CTKVR's index state for the GPU (the method itself: retrieval/src/ctkvr.cc, registered in the
// core as "ctkvr").

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// C', the centroids a step recalls: params.ctkvr.n_recall, or the default (6) when it is 0. One
// definition for the CPU index and the GPU build plan.
int CtkvrRecall(const IndexParams& params);

// The state of a `ctkvr` index, read through its type rather than its serialised bytes: what
// the GPU selector uploads. Spans point into the index (valid while it lives and is not appended
// to). InvalidArgument for another method's index.
struct CtkvrState {
  GqaAggregation gqa = GqaAggregation::kSumSoftmax;
  int64_t n_sink = 0, n_centroids = 0, rho = 0, n_recall = 0, fifo_size = 0;
  int64_t next_fifo = 0;        // the FIFO cursor: Selects so far (the next rotated entry)
  std::span<const float> keys;  // [size, n_kv_heads, head_dim]: the copy the CPU reranks with
  struct Entry {
    std::span<const float> centroid;  // [group, head_dim] unit-normalised queries
    std::span<const float> norms;     // [group] their original norms
    std::span<const int32_t> list;    // token ids, ascending (the qcIVF list)
    float threshold = 0.f;            // smallest max-over-group logit in the list
  };
  std::vector<std::vector<Entry>> heads;  // [n_kv_heads][n_centroids]
};
[[nodiscard]] absl::StatusOr<CtkvrState> CtkvrStateOf(const RetrievalIndex& index);

}  // namespace kvr::retrieval
