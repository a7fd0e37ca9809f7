#pragma once
// KeyDiff (Park et al., "Key Similarity-Based KV Cache Eviction"): a key's eviction score is its
// cosine similarity to the anchor, the mean key of the head (the paper's evaluated variant,
// Figure 3; its Eq. 8 averages the unit keys, and its Table 2 finds the plain mean loses no
// accuracy). The keys most similar to the anchor are the least distinctive (they draw the
// least attention) and go first. No attention scores are needed, so the score can be computed
// from stored K rows alone: the KV store's thinning of cold cached prefixes and the retrieval
// eval's measurement of what that thinning costs both use these functions, so they drop the
// same pages. The score is the one kvr::retrieval::KeyDiffTracker keeps for the `keydiff`
// method; it lives here, not in the retrieval library, so that the store does not link the
// retrieval methods (and their BLAS) for one cosine.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace kvr {

// scores[i] = cos(key i, anchor), anchor = the mean of the keys. Key i is the `dim` floats at
// keys[i * stride]. A zero key or one with a non-finite element (the store holds whatever
// bytes a client wrote) scores 0 and is left out of the anchor; with no usable key, or keys
// that cancel out, every score is 0. Double-precision accumulation.
// keys: [n, stride] (the first `dim` of each row used); scores: [n].
void KeyDiffScores(const float* keys, size_t n, size_t dim, size_t stride, float* scores);

// Which pages of one (layer, kv head) may go, for a thinning that keeps whole pages.
struct KeyDiffPagePolicy {
  // Rows [0, sink_rows) (attention sinks) and the last `recent_rows` rows are always kept:
  // no page holding one of them is dropped.
  uint64_t sink_rows = 4;
  uint64_t recent_rows = 64;
};

// The pages to drop among the rows that `scores` ([rows], KeyDiffScores of the head's rows
// [0, rows)) covers, in pages of `page_rows` rows (the last one possibly partial): of its
// n = ceil(rows / page_rows) pages at least ceil(keep_fraction * n) stay, so at most the rest
// go, chosen among pages that hold no sink or recent row and are not marked in `pinned` ([n]
// or empty: none pinned), highest mean row score first (least distinctive first; ties: the
// lower page). Returns page indices in that order.
[[nodiscard]] std::vector<uint64_t> KeyDiffPagesToDrop(std::span<const float> scores,
                                                       uint64_t page_rows, double keep_fraction,
                                                       const KeyDiffPagePolicy& policy,
                                                       std::span<const bool> pinned = {});

}  // namespace kvr
