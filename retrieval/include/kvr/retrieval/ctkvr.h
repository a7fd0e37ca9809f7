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

// params with the ctkvr.* method options applied (what the index's factory does):
// ctkvr.n_centroids, ctkvr.list_length, ctkvr.n_recall and ctkvr.fifo_size, each >= 0 (0: the
// default of CtkvrParams). Options of other methods are ignored; an unknown ctkvr.* name or a bad
// value is InvalidArgument naming it.
[[nodiscard]] absl::StatusOr<IndexParams> ApplyCtkvrOptions(const IndexParams& params);

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

// The bytes SerializeIndex writes for a `ctkvr` index over `size` tokens in `state` (its qcIVF
// built elsewhere: the GPU's CtkvrBuild at prefill). `params` as given to the registry (the
// ctkvr.* options are applied here, as the index's factory applies them); state.gqa, n_sink,
// n_centroids, rho, n_recall, fifo_size and next_fifo are taken as they are. InvalidArgument
// naming what does not fit (keys of another size, a head or entry count that is not the
// shape's, a centroid of the wrong size, a token id outside [0, size)).
[[nodiscard]] absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltCtkvr(const IndexShape& shape,
                                                                          const IndexParams& params,
                                                                          int64_t size,
                                                                          const CtkvrState& state);

}  // namespace kvr::retrieval
