#include "thinned_prefix.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "kvr/model/kv_cache.h"
#include "kvr/retrieval/ops.h"

namespace kvr::retrieval::eval {

ThinMask MakeThinMask(const kvr::model::KvCache& cache, int n_kv_heads, int head_dim, int64_t rows,
                      uint64_t page_rows, double keep_fraction, const KeyDiffPagePolicy& policy,
                      ThinOrder order, uint64_t seed) {
  ThinMask mask;
  mask.rows = rows;
  mask.n_kv_heads = n_kv_heads;
  std::mt19937_64 rng(seed);
  std::vector<float> scores(static_cast<size_t>(rows));
  uint64_t kept = 0;
  mask.intact_rows = rows;
  for (int layer = 0; layer < cache.n_layers(); ++layer) {
    const kvr::model::KvView view = cache.View(layer);
    for (int h = 0; h < n_kv_heads; ++h) {
      // The same two calls the store makes for one (layer, kv head) of a cached sequence.
      KeyDiffScores(view.k + int64_t{h} * head_dim, static_cast<size_t>(rows),
                    static_cast<size_t>(head_dim), static_cast<size_t>(view.row_stride),
                    scores.data());
      std::vector<uint64_t> drop = KeyDiffPagesToDrop(scores, page_rows, keep_fraction, policy);
      if (order == ThinOrder::kRandom && !drop.empty()) {
        // The same number of pages among the same candidates (every page KeyDiff could drop
        // given no floor), uniformly.
        const std::vector<uint64_t> candidates = KeyDiffPagesToDrop(scores, page_rows, 0.0, policy);
        std::vector<uint64_t> shuffled = candidates;
        std::shuffle(shuffled.begin(), shuffled.end(), rng);
        shuffled.resize(drop.size());
        drop = std::move(shuffled);
      }
      std::vector<uint8_t> keep(static_cast<size_t>(rows), 1);
      for (uint64_t page : drop) {
        const uint64_t end = std::min<uint64_t>(rows, (page + 1) * page_rows);
        for (uint64_t r = page * page_rows; r < end; ++r) keep[r] = 0;
      }
      for (uint8_t k : keep) kept += k;
      mask.intact_rows = std::min<int64_t>(mask.intact_rows,
                                           std::find(keep.begin(), keep.end(), 0) - keep.begin());
      mask.kept.push_back(std::move(keep));
    }
  }
  const double all = static_cast<double>(rows) * static_cast<double>(mask.kept.size());
  mask.kept_fraction = all > 0 ? static_cast<double>(kept) / all : 1.0;
  return mask;
}

absl::Status MaskedAttention::Attend(const kvr::model::AttentionShape& shape,
                                     std::span<const kvr::model::AttentionRequest> batch) {
  const int hd = shape.head_dim;
  const int group = shape.n_heads / shape.n_kv_heads;
  for (const kvr::model::AttentionRequest& r : batch) {
    auto it = entries_.find(r.sequence);
    if (it == entries_.end()) {
      return absl::InternalError(
          absl::StrCat("thinned-prefix eval: unknown sequence ", r.sequence));
    }
    if (r.n_queries != 1 || r.kv.k == nullptr) {
      return absl::UnimplementedError("thinned-prefix eval: decode queries over float rows only");
    }
    const Entry& e = it->second;
    const int64_t n = r.first_position + 1;
    dense_.resize(static_cast<size_t>(n));
    masked_.resize(static_cast<size_t>(n));
    out_.resize(static_cast<size_t>(hd));
    for (int h = 0; h < shape.n_heads; ++h) {
      const int kvh = h / group;
      const std::vector<uint8_t>* keep =
          e.mask != nullptr ? &e.mask->kept[static_cast<size_t>(r.layer) * e.mask->n_kv_heads + kvh]
                            : nullptr;
      const int64_t masked_rows = keep != nullptr ? std::min<int64_t>(n, e.mask->rows) : 0;
      // The dense softmax and output only where they are measured (free decoding needs the
      // masked output alone).
      const bool measure = e.accum != nullptr;
      HeadLogits(shape, r, h, dense_);
      for (int64_t t = 0; t < n; ++t) {
        masked_[t] = t < masked_rows && (*keep)[t] == 0 ? -std::numeric_limits<float>::infinity()
                                                        : dense_[t];
      }
      SoftmaxInPlace(masked_);
      float* o = r.out + int64_t{h} * hd;
      WeightedValues(r, kvh, hd, masked_, o);
      if (!measure) continue;
      SoftmaxInPlace(dense_);
      WeightedValues(r, kvh, hd, dense_, out_.data());
      double mass = 0;
      for (int64_t t = 0; t < n; ++t) {
        if (t >= masked_rows || (*keep)[t] != 0) mass += dense_[t];
      }
      e.accum->Add(mass, o, out_);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvr::retrieval::eval
