// `keydiff` as a selection method: per KV head, the budget (times KeyDiffParams::fill) is filled
// with the candidates whose keys are most distinctive (lowest cosine to the mean key). It is
// query-agnostic, i.e. KeyDiff's eviction policy seen as a static selector (see keydiff.h).
//
// Scores: Build scores every key against the mean of the prefill keys; appended keys update the
// running mean (KeyDiffTracker) and are scored against it at insertion. Old scores are not
// refreshed as the mean drifts: the index keeps no keys (4 bytes per token per head), and over a
// few hundred generated tokens the mean of thousands of prefill keys barely moves.

#include <algorithm>
#include <cmath>
#include <span>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/keydiff.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/prebuilt.h"
#include "kvr/retrieval/registry.h"
#include "method_util.h"

namespace kvr::retrieval {
namespace {

class KeyDiffIndex final : public RetrievalIndex {
 public:
  KeyDiffIndex(const IndexShape& shape, const IndexParams& params)
      : RetrievalIndex(shape), fill_(params.keydiff.fill) {
    for (int h = 0; h < shape.n_kv_heads; ++h) trackers_.emplace_back(shape.head_dim);
    scores_.resize(shape.n_kv_heads);
  }

  std::string_view method() const override { return "keydiff"; }

  KeyDiffState State() const {
    KeyDiffState s;
    s.fill = fill_;
    for (int h = 0; h < shape().n_kv_heads; ++h) {
      s.heads.push_back({scores_[h], trackers_[h].sum(), trackers_[h].count()});
    }
    return s;
  }
  int64_t size() const override { return size_; }

  absl::Status Build(const BuildInput& input) override {
    if (built_) return absl::FailedPreconditionError("keydiff: Build called twice");
    const int hd = shape().head_dim;
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, hd, "keydiff Build keys"));
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      for (int64_t t = 0; t < input.keys.n_tokens; ++t) {
        trackers_[kvh].Add(input.keys.At(t, kvh, hd));
      }
      auto& s = scores_[kvh];
      s.resize(input.keys.n_tokens);
      for (int64_t t = 0; t < input.keys.n_tokens; ++t) {
        s[t] = trackers_[kvh].Score(input.keys.At(t, kvh, hd));
      }
    }
    size_ = input.keys.n_tokens;
    built_ = true;
    return absl::OkStatus();
  }

  absl::Status Append(const AppendInput& input) override {
    if (!built_) return absl::FailedPreconditionError("keydiff: Append before Build");
    const int hd = shape().head_dim;
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, hd, "keydiff Append keys"));
    for (int64_t t = 0; t < input.keys.n_tokens; ++t) {
      for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
        const float* k = input.keys.At(t, kvh, hd);
        trackers_[kvh].Add(k);
        scores_[kvh].push_back(trackers_[kvh].Score(k));
      }
    }
    size_ += input.keys.n_tokens;
    return absl::OkStatus();
  }

  absl::Status Select(const SelectRequest& request, Selection* out) override {
    if (!built_) return absl::FailedPreconditionError("keydiff: Select before Build");
    KVR_ASSIGN_OR_RETURN(const internal::CandidateRange c,
                         internal::BeginSelect(request, shape(), size_, out));
    if (c.count() == 0) return absl::OkStatus();
    const int64_t k = std::max<int64_t>(
        1, static_cast<int64_t>(std::floor(fill_ * static_cast<double>(request.budget))));
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      // Most distinctive first = lowest cosine: rank by the negated score.
      neg_.resize(c.count());
      for (int64_t i = 0; i < c.count(); ++i) neg_[i] = -scores_[kvh][c.begin + i];
      std::vector<int64_t> top = TopKIndices(neg_, k);
      auto& ids = out->per_head[kvh];
      for (int64_t i : top) ids.push_back(c.begin + i);
      std::sort(ids.begin(), ids.end());
    }
    return absl::OkStatus();
  }

  int64_t MemoryBytes() const override {
    int64_t bytes = 0;
    for (const auto& s : scores_) bytes += static_cast<int64_t>(s.size() * sizeof(float));
    return bytes + static_cast<int64_t>(shape().n_kv_heads) * shape().head_dim * 8;
  }

  absl::Status SerializePayload(ByteWriter& w) const override {
    w.Put<float>(fill_);
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      w.PutArray<float>(trackers_[kvh].Mean());
      w.Put<int64_t>(trackers_[kvh].count());
      w.PutArray<float>(scores_[kvh]);
    }
    return absl::OkStatus();
  }

  static absl::StatusOr<std::unique_ptr<RetrievalIndex>> Read(const IndexShape& shape,
                                                              const IndexParams& params,
                                                              int64_t size, ByteReader& r) {
    auto index = std::make_unique<KeyDiffIndex>(shape, params);
    KVR_RETURN_IF_ERROR(r.Get("keydiff fill", &index->fill_));
    if (!(index->fill_ > 0.f && index->fill_ <= 1.f)) {
      return absl::DataLossError(absl::StrCat("keydiff payload: bad fill ", index->fill_));
    }
    for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
      std::vector<float> mean;
      int64_t count = 0;
      KVR_RETURN_IF_ERROR(r.GetArray("keydiff mean", &mean, shape.head_dim));
      KVR_RETURN_IF_ERROR(r.Get("keydiff count", &count));
      KVR_RETURN_IF_ERROR(r.GetArray("keydiff scores", &index->scores_[kvh], size));
      if (static_cast<int>(mean.size()) != shape.head_dim || count < 0 ||
          static_cast<int64_t>(index->scores_[kvh].size()) != size) {
        return absl::DataLossError("keydiff payload: tables do not match the shape/size");
      }
      // Rebuild the running sum from mean * count (Add of the scaled mean, once).
      if (count > 0) {
        for (float& m : mean) m *= static_cast<float>(count);
        index->trackers_[kvh].Add(mean.data());
        index->trackers_[kvh].SetCount(count);
      }
    }
    index->size_ = size;
    index->built_ = true;
    return index;
  }

  // The index a prefill Build over `size` tokens leaves, from its mean keys and scores.
  static absl::StatusOr<std::unique_ptr<KeyDiffIndex>> FromPrebuilt(
      const IndexShape& shape, const IndexParams& params, int64_t size,
      std::span<const PrebuiltKeyDiffHead> heads) {
    auto bad = [](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat("prebuilt keydiff: ", parts...));
    };
    KVR_RETURN_IF_ERROR(shape.Validate());
    if (size < 0 || size >= (int64_t{1} << 29)) return bad("size ", size, " out of [0, 2^29)");
    if (static_cast<int64_t>(heads.size()) != shape.n_kv_heads) {
      return bad("heads has ", heads.size(), " entries for ", shape.n_kv_heads, " KV heads");
    }
    auto index = std::make_unique<KeyDiffIndex>(shape, params);
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      if (static_cast<int64_t>(heads[h].mean.size()) != shape.head_dim ||
          static_cast<int64_t>(heads[h].scores.size()) != size) {
        return bad("head ", h, ": mean has ", heads[h].mean.size(), " values (head_dim ",
                   shape.head_dim, "), scores ", heads[h].scores.size(), " (size ", size, ")");
      }
      if (size > 0) index->trackers_[h].Restore(heads[h].mean, size);
      index->scores_[h].assign(heads[h].scores.begin(), heads[h].scores.end());
    }
    index->size_ = size;
    index->built_ = true;
    return index;
  }

 private:
  float fill_;
  bool built_ = false;
  int64_t size_ = 0;
  std::vector<KeyDiffTracker> trackers_;    // [n_kv_heads]
  std::vector<std::vector<float>> scores_;  // [n_kv_heads][size]
  std::vector<float> neg_;                  // scratch
};

}  // namespace

absl::StatusOr<KeyDiffState> KeyDiffStateOf(const RetrievalIndex& index) {
  KVR_ASSIGN_OR_RETURN(const KeyDiffIndex* typed,
                       internal::IndexAs<KeyDiffIndex>(index, "KeyDiffStateOf", "keydiff"));
  return typed->State();
}

absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltKeyDiff(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const PrebuiltKeyDiffHead> heads) {
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<KeyDiffIndex> index,
                       KeyDiffIndex::FromPrebuilt(shape, params, size, heads));
  return SerializeIndex(*index);
}

absl::Status RegisterKeyDiff(MethodRegistry& registry) {
  return registry.Register(
      "keydiff", "KeyDiff: query-agnostic, most distinctive keys (lowest cosine to the mean key)",
      [](const IndexShape& s,
         const IndexParams& p) -> absl::StatusOr<std::unique_ptr<RetrievalIndex>> {
        return std::make_unique<KeyDiffIndex>(s, p);
      },
      &KeyDiffIndex::Read);
}

}  // namespace kvr::retrieval
