#pragma once
// KeyDiff: key-diversity scores. A key that points away from the mean key direction tends to
// receive attention (KeyDiff, sec. 3.1-3.3): score_i = cos(k_i, mean_j k_j); LOWER cosine means
// more distinctive, and KeyDiff evicts the tokens with the HIGHEST cosine first. No queries are
// needed, so it works with FlashAttention-style kernels and on nodes that never see queries.
//
// What kvr uses it for (DESIGN.md 3):
//  - pinning: the most distinctive keys of a sequence can be pinned in the decode node's hot
//    cache / kept resident, since they keep being recalled;
//  - eviction under a memory budget: the KV store's capacity policy and the decode hot cache
//    evict the least distinctive rows first (KeyDiffEvictionOrder / KeyDiffTracker);
//  - as a `keydiff` selection method (registered in the core): the budget is filled with the
//    most distinctive candidates, independent of the query. It is the eviction policy seen as a
//    static selector, which makes it comparable in the evaluator with the query-aware methods;
//    it is expected to lose to them, since the paper applies it to eviction, not recall.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// Cosine of every key to the mean of `keys` for one head (kvr::KeyDiffScores, the score the KV
// store thins cached prefixes by).
// keys: [n_tokens, n_kv_heads, head_dim]; returns [n_tokens].
std::vector<float> KeyDiffScores(const TokenTensor& keys, int head, int head_dim);

// Token indices in eviction order (most similar to the mean, i.e. least distinctive, first),
// excluding indices in `protected_tokens` (sorted ascending; e.g. sinks and the local window).
std::vector<int64_t> KeyDiffEvictionOrder(std::span<const float> scores,
                                          std::span<const int64_t> protected_tokens = {});

// Streaming KeyDiff for one head: keeps the running key sum so that scores stay exact as tokens
// are appended or evicted, without a second pass over the keys. Used by capacity policies.
class KeyDiffTracker {
 public:
  explicit KeyDiffTracker(int head_dim);

  void Add(const float* key);     // [head_dim]
  void Remove(const float* key);  // [head_dim] a key previously added (eviction)
  int64_t count() const { return count_; }
  // Restores the count after a single Add of (mean * count) (deserialisation).
  void SetCount(int64_t count) { count_ = count; }
  // Starts from `count` keys whose mean is `mean` ([head_dim]): the sum mean * count in double,
  // exact for count < 2^29, so that Mean() gives `mean` back bit for bit (a summary built
  // elsewhere that ships the mean).
  void Restore(std::span<const float> mean, int64_t count);
  // cos(key, mean of the tracked keys); 0 when nothing is tracked.
  float Score(const float* key) const;
  std::vector<float> Mean() const;  // [head_dim]
  // The running key sum, as Score reads it.
  std::span<const double> sum() const { return sum_d_; }

 private:
  int head_dim_;
  int64_t count_ = 0;
  std::vector<double> sum_d_;  // [head_dim] accumulated in double: long sequences
};

// The state of a `keydiff` index, read through its type rather than its serialised bytes: what
// a GPU decode lane uploads to select and append as the index does. Spans point into the index
// (valid while it lives and is not appended to). InvalidArgument for another method's index.
struct KeyDiffState {
  float fill = 1.f;  // KeyDiffParams::fill
  struct Head {
    std::span<const float> scores;  // [size]
    std::span<const double> sum;    // [head_dim] the running key sum (KeyDiffTracker)
    int64_t count = 0;              // keys summed
  };
  std::vector<Head> heads;  // [n_kv_heads]
};
[[nodiscard]] absl::StatusOr<KeyDiffState> KeyDiffStateOf(const RetrievalIndex& index);

}  // namespace kvr::retrieval
