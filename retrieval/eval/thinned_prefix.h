#pragma once
// The quality cost of a thinned cached prefix (the KV store's cached_eviction: thin), for
// `kvr eval retrieval --thin-keep`. The prompt's rows of every (layer, KV head) are thinned at
// page granularity exactly as the store thins a cached sequence (KeyDiffScores over the cached
// K rows, KeyDiffPagesToDrop with the store's default sinks and recent rows: one shared
// implementation, kvr/common/key_diff.h), or, as a control, by a random choice of as many
// pages per head; then the continuation attends densely over the kept rows only (the
// dropped ones masked), which is what a reader that attends over a thinned prefix's holes
// would compute.

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "head_quality.h"
#include "kvr/common/key_diff.h"
#include "kvr/model/attention.h"

namespace kvr::model {
class KvCache;
}  // namespace kvr::model

namespace kvr::retrieval::eval {

// How the dropped pages are chosen.
enum class ThinOrder {
  kKeyDiff,  // the store's choice: least distinctive pages first
  kRandom,   // as many pages per (layer, KV head) as KeyDiff drops, at random (a control)
};

// Which of the first `rows` rows of every (layer, KV head) a thinning keeps.
struct ThinMask {
  int64_t rows = 0;
  int n_kv_heads = 0;
  std::vector<std::vector<uint8_t>> kept;  // [n_layers * n_kv_heads][rows], 1 = kept
  double kept_fraction = 1;                // kept rows over all (layer, KV head, row)
  // Rows before the first dropped one of any (layer, KV head): what the prefill node reuses
  // of such a prefix (the store forks no further).
  int64_t intact_rows = 0;
};

// The mask of thinning the first `rows` rows of `cache` (float rows) in pages of `page_rows`,
// keeping at least `keep_fraction` of every (layer, KV head)'s pages. kRandom drops, per
// (layer, KV head), as many of the same candidate pages as kKeyDiff does, picked with `seed`.
[[nodiscard]] ThinMask MakeThinMask(const kvr::model::KvCache& cache, int n_kv_heads, int head_dim,
                                    int64_t rows, uint64_t page_rows, double keep_fraction,
                                    const KeyDiffPagePolicy& policy, ThinOrder order,
                                    uint64_t seed);

// Dense attention in which a decode query of a sequence that has a mask sees only the rows
// its mask keeps (rows past the mask's `rows`, the decoded ones, are all kept). Measures per
// query head the dense softmax mass on the kept rows and the relative error of the output
// against dense attention over every row. Decode calls only (one query per request):
// anything else is UNIMPLEMENTED.
class MaskedAttention final : public kvr::model::Attention {
 public:
  using Accum = HeadQuality;
  struct Entry {
    const ThinMask* mask = nullptr;
    Accum* accum = nullptr;  // may be null: not measured
  };
  explicit MaskedAttention(std::map<kvr::model::SequenceId, Entry> entries)
      : entries_(std::move(entries)) {}

  absl::Status Attend(const kvr::model::AttentionShape& shape,
                      std::span<const kvr::model::AttentionRequest> batch) override;

 private:
  std::map<kvr::model::SequenceId, Entry> entries_;
  std::vector<float> dense_, masked_, out_;
};

}  // namespace kvr::retrieval::eval
