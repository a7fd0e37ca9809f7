// The baselines: full, streaming, exact (oracle) and quest (page min/max bounds).

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/prebuilt.h"
#include "kvr/retrieval/registry.h"
#include "method_util.h"

namespace kvr::retrieval {
namespace {

using internal::CandidateRange;

absl::Status CheckBuilt(bool built, std::string_view method) {
  if (!built) {
    return absl::FailedPreconditionError(
        absl::StrCat(std::string(method), ": Build must be called before Append/Select"));
  }
  return absl::OkStatus();
}

// full: selects every candidate whatever the budget (dense attention through the sparse path).
// streaming: selects nothing (sink + local window only). Neither holds any summary.
class TrivialIndex final : public RetrievalIndex {
 public:
  TrivialIndex(const IndexShape& shape, bool select_all, int64_t size = 0)
      : RetrievalIndex(shape), select_all_(select_all), size_(size) {}

  std::string_view method() const override { return select_all_ ? "full" : "streaming"; }
  int64_t size() const override { return size_; }
  absl::Status Build(const BuildInput& input) override {
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, shape().head_dim, "Build keys"));
    size_ = input.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Append(const AppendInput& input) override {
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, shape().head_dim, "Append keys"));
    size_ += input.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Select(const SelectRequest& request, Selection* out) override {
    KVR_ASSIGN_OR_RETURN(const CandidateRange c,
                         internal::BeginSelect(request, shape(), size_, out));
    if (select_all_) internal::SelectEveryCandidate(c, out);
    return absl::OkStatus();
  }
  int64_t MemoryBytes() const override { return 0; }
  absl::Status SerializePayload(ByteWriter& writer) const override { return absl::OkStatus(); }

 private:
  bool select_all_;
  int64_t size_;
};

// exact: the oracle. Keeps every key and ranks candidates by their true attention scores
// (GQA-aggregated per IndexParams::gqa; the default sums the group's softmax probabilities, so it
// maximises the attention mass the selected set covers, summed over the group).
class ExactIndex final : public RetrievalIndex {
 public:
  ExactIndex(const IndexShape& shape, const IndexParams& params)
      : RetrievalIndex(shape), gqa_(params.gqa) {}

  std::string_view method() const override { return "exact"; }
  int64_t size() const override { return size_; }
  absl::Status Build(const BuildInput& input) override {
    if (built_) return absl::FailedPreconditionError("exact: Build called twice");
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, shape().head_dim, "Build keys"));
    built_ = true;
    internal::AppendPacked(input.keys, shape().n_kv_heads, shape().head_dim, &keys_);
    size_ = input.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Append(const AppendInput& input) override {
    KVR_RETURN_IF_ERROR(CheckBuilt(built_, method()));
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, shape().head_dim, "Append keys"));
    internal::AppendPacked(input.keys, shape().n_kv_heads, shape().head_dim, &keys_);
    size_ += input.keys.n_tokens;
    return absl::OkStatus();
  }
  absl::Status Select(const SelectRequest& request, Selection* out) override {
    KVR_RETURN_IF_ERROR(CheckBuilt(built_, method()));
    KVR_ASSIGN_OR_RETURN(const internal::CandidateRange c,
                         internal::BeginSelect(request, shape(), size_, out));
    if (c.count() == 0) return absl::OkStatus();
    const int hd = shape().head_dim;
    const int64_t row = static_cast<int64_t>(shape().n_kv_heads) * hd;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      internal::GroupLogits(request.query, shape(), kvh, keys_.data() + c.begin * row + kvh * hd,
                            row, c.count(), scale, &logits_);
      std::vector<float> agg =
          internal::AggregateGroupScores(gqa_, logits_, shape().group_size(), c.count());
      std::vector<int64_t> top = TopKIndices(agg, request.budget);
      auto& ids = out->per_head[kvh];
      ids.reserve(top.size());
      for (int64_t i : top) ids.push_back(c.begin + i);
      std::sort(ids.begin(), ids.end());
    }
    return absl::OkStatus();
  }
  int64_t MemoryBytes() const override {
    return static_cast<int64_t>(keys_.size() * sizeof(float));
  }
  absl::Status SerializePayload(ByteWriter& writer) const override {
    writer.Put<uint8_t>(static_cast<uint8_t>(gqa_));
    writer.PutArray<float>(keys_);
    return absl::OkStatus();
  }

  static absl::StatusOr<std::unique_ptr<RetrievalIndex>> Read(const IndexShape& shape,
                                                              const IndexParams& params,
                                                              int64_t size, ByteReader& r) {
    auto index = std::make_unique<ExactIndex>(shape, params);
    KVR_ASSIGN_OR_RETURN(index->gqa_, internal::ReadGqa(r, "exact"));
    const int64_t row = static_cast<int64_t>(shape.n_kv_heads) * shape.head_dim;
    KVR_RETURN_IF_ERROR(r.GetArray("exact keys", &index->keys_, size * row));
    if (static_cast<int64_t>(index->keys_.size()) != size * row) {
      return absl::DataLossError(absl::StrCat("exact payload: ", index->keys_.size(),
                                              " key floats for ", size, " tokens of ", row));
    }
    index->size_ = size;
    index->built_ = true;
    return index;
  }

 private:
  GqaAggregation gqa_;
  bool built_ = false;
  int64_t size_ = 0;
  std::vector<float> keys_;    // [size, n_kv_heads, head_dim]
  std::vector<float> logits_;  // scratch [group, n_candidates]
};

// quest: pages of `page_size` consecutive tokens (QuestPageSize: 16 by default; 0 scales them
// to the budget); per page and KV head the per-channel min and
// max key. Upper bound of q.k over a page: sum_d max(q_d min_d, q_d max_d) (Quest, sec. 3).
// Pages are ranked by that bound (GQA-aggregated) and their candidate tokens taken in order until
// the budget is reached; the last page is trimmed. Bounds are kept in float32 here (Quest keeps
// the model dtype); bytes per token per head = 2 * head_dim * 4 / page_size.
class QuestIndex final : public RetrievalIndex {
 public:
  QuestIndex(const IndexShape& shape, const IndexParams& params)
      : RetrievalIndex(shape), page_size_(QuestPageSize(params)), gqa_(params.gqa) {}

  std::string_view method() const override { return "quest"; }
  int64_t size() const override { return size_; }
  absl::Status Build(const BuildInput& input) override {
    if (built_) return absl::FailedPreconditionError("quest: Build called twice");
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, shape().head_dim, "Build keys"));
    built_ = true;
    AddTokens(input.keys);
    return absl::OkStatus();
  }
  absl::Status Append(const AppendInput& input) override {
    KVR_RETURN_IF_ERROR(CheckBuilt(built_, method()));
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, shape().head_dim, "Append keys"));
    AddTokens(input.keys);
    return absl::OkStatus();
  }
  absl::Status Select(const SelectRequest& request, Selection* out) override {
    KVR_RETURN_IF_ERROR(CheckBuilt(built_, method()));
    KVR_ASSIGN_OR_RETURN(const internal::CandidateRange c,
                         internal::BeginSelect(request, shape(), size_, out));
    if (c.count() == 0) return absl::OkStatus();
    const int hd = shape().head_dim;
    const int group = shape().group_size();
    const int64_t first_page = c.begin / page_size_;
    const int64_t n_pages = (c.end - 1) / page_size_ + 1 - first_page;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    std::vector<float> bounds(static_cast<size_t>(group) * n_pages);  // [group, n_pages]
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      for (int g = 0; g < group; ++g) {
        const float* q = request.query + static_cast<int64_t>(kvh * group + g) * hd;
        for (int64_t p = 0; p < n_pages; ++p) {
          const float* mn = Min(first_page + p, kvh);
          const float* mx = Max(first_page + p, kvh);
          float s = 0.f;
          for (int d = 0; d < hd; ++d) s += std::max(q[d] * mn[d], q[d] * mx[d]);
          bounds[g * n_pages + p] = scale * s;
        }
      }
      std::vector<float> agg = internal::AggregateGroupScores(gqa_, bounds, group, n_pages);
      std::vector<int64_t> order = TopKIndices(agg, n_pages);
      auto& ids = out->per_head[kvh];
      for (int64_t p : order) {
        const int64_t page = first_page + p;
        const int64_t lo = std::max(c.begin, page * page_size_);
        const int64_t hi = std::min(c.end, (page + 1) * page_size_);
        for (int64_t t = lo; t < hi && static_cast<int64_t>(ids.size()) < request.budget; ++t) {
          ids.push_back(t);
        }
        if (static_cast<int64_t>(ids.size()) >= request.budget) break;
      }
      std::sort(ids.begin(), ids.end());
    }
    return absl::OkStatus();
  }
  int64_t MemoryBytes() const override {
    return static_cast<int64_t>(bounds_.size() * sizeof(float));
  }
  absl::Status SerializePayload(ByteWriter& writer) const override {
    writer.Put<int32_t>(page_size_);
    writer.Put<uint8_t>(static_cast<uint8_t>(gqa_));
    writer.PutArray<float>(bounds_);
    return absl::OkStatus();
  }
  static absl::StatusOr<std::unique_ptr<RetrievalIndex>> Read(const IndexShape& shape,
                                                              const IndexParams& params,
                                                              int64_t size, ByteReader& r) {
    auto index = std::make_unique<QuestIndex>(shape, params);
    KVR_RETURN_IF_ERROR(r.Get("quest page_size", &index->page_size_));
    if (index->page_size_ <= 0 || index->page_size_ > (1 << 20)) {
      return absl::DataLossError(absl::StrCat("quest payload: bad page_size ", index->page_size_));
    }
    KVR_ASSIGN_OR_RETURN(index->gqa_, internal::ReadGqa(r, "quest"));
    const int64_t n_pages = (size + index->page_size_ - 1) / index->page_size_;
    const int64_t expect = n_pages * index->PageFloats();
    KVR_RETURN_IF_ERROR(r.GetArray("quest bounds", &index->bounds_, expect));
    if (static_cast<int64_t>(index->bounds_.size()) != expect) {
      return absl::DataLossError(absl::StrCat("quest payload: ", index->bounds_.size(),
                                              " bound floats, expected ", expect));
    }
    index->size_ = size;
    index->built_ = true;
    return index;
  }

  // The index after Build over `size` tokens whose page bounds are `bounds` (prebuilt.h).
  static absl::StatusOr<std::unique_ptr<QuestIndex>> FromBounds(const IndexShape& shape,
                                                                const IndexParams& params,
                                                                int64_t size,
                                                                std::span<const float> bounds) {
    auto index = std::make_unique<QuestIndex>(shape, params);
    if (index->page_size_ <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("prebuilt quest: page_size ", index->page_size_, " must be > 0"));
    }
    if (size < 0) return absl::InvalidArgumentError("prebuilt quest: negative size");
    const int64_t n_pages = (size + index->page_size_ - 1) / index->page_size_;
    const int64_t expect = n_pages * index->PageFloats();
    if (static_cast<int64_t>(bounds.size()) != expect) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prebuilt quest: bounds has ", bounds.size(), " floats, expected ", expect, " (",
          n_pages, " pages of ", size, " tokens x ", shape.n_kv_heads, " KV heads x 2 x ",
          shape.head_dim, ")"));
    }
    index->bounds_.assign(bounds.begin(), bounds.end());
    index->size_ = size;
    index->built_ = true;
    return index;
  }

 private:
  // Page layout: [n_pages][n_kv_heads][2][head_dim] (min then max).
  int64_t PageFloats() const {
    return static_cast<int64_t>(shape().n_kv_heads) * 2 * shape().head_dim;
  }
  float* Min(int64_t page, int kvh) {
    return bounds_.data() + page * PageFloats() + static_cast<int64_t>(kvh) * 2 * shape().head_dim;
  }
  float* Max(int64_t page, int kvh) { return Min(page, kvh) + shape().head_dim; }

  void AddTokens(const TokenTensor& keys) {
    const int hd = shape().head_dim;
    for (int64_t i = 0; i < keys.n_tokens; ++i, ++size_) {
      const int64_t page = size_ / page_size_;
      const bool fresh = size_ % page_size_ == 0;
      if (fresh) bounds_.resize((page + 1) * PageFloats());
      for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
        const float* k = keys.At(i, kvh, hd);
        float* mn = Min(page, kvh);
        float* mx = Max(page, kvh);
        for (int d = 0; d < hd; ++d) {
          mn[d] = fresh ? k[d] : std::min(mn[d], k[d]);
          mx[d] = fresh ? k[d] : std::max(mx[d], k[d]);
        }
      }
    }
  }

  int32_t page_size_;
  GqaAggregation gqa_;
  bool built_ = false;
  int64_t size_ = 0;
  std::vector<float> bounds_;
};

absl::StatusOr<std::unique_ptr<RetrievalIndex>> ReadTrivial(const IndexShape& shape, bool all,
                                                            int64_t size) {
  return std::make_unique<TrivialIndex>(shape, all, size);
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltQuest(const IndexShape& shape,
                                                            const IndexParams& params,
                                                            int64_t size,
                                                            std::span<const float> bounds) {
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<QuestIndex> index,
                       QuestIndex::FromBounds(shape, params, size, bounds));
  return SerializeIndex(*index);
}

namespace {

// params with the quest.* method options applied: quest.page_size in [0, 4096] (0: scaled to the
// budget, QuestPageSize). Options of other
// methods are ignored; an unknown quest.* name or a bad value is InvalidArgument naming it.
absl::StatusOr<IndexParams> ApplyQuestOptions(const IndexParams& params) {
  IndexParams out = params;
  constexpr std::string_view kPrefix = "quest.";
  for (const auto& [name, value] : params.options) {
    if (!name.starts_with(kPrefix)) continue;  // another method's option
    const std::string_view key = std::string_view(name).substr(kPrefix.size());
    KVR_ASSIGN_OR_RETURN(const int v, internal::ParseIntOption(name, value));
    if (key == "page_size") {
      if (v < 0 || v > 4096) {
        return absl::InvalidArgumentError(
            absl::StrCat("option quest.page_size must be in [0, 4096], got ", value));
      }
      out.quest.page_size = v;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown option '", name, "'; quest has quest.page_size"));
    }
  }
  return out;
}

}  // namespace

absl::Status RegisterBaselines(MethodRegistry& registry) {
  // The two trivial methods: every token ("full") or none beyond sink and window.
  for (const bool all : {true, false}) {
    KVR_RETURN_IF_ERROR(registry.Register(
        all ? "full" : "streaming",
        all ? "every token (dense attention through the sparse path)"
            : "sink + local window only (selects nothing)",
        [all](const IndexShape& s,
              const IndexParams&) -> absl::StatusOr<std::unique_ptr<RetrievalIndex>> {
          return std::make_unique<TrivialIndex>(s, all);
        },
        [all](const IndexShape& s, const IndexParams&, int64_t size, ByteReader&) {
          return ReadTrivial(s, all, size);
        }));
  }
  KVR_RETURN_IF_ERROR(registry.Register(
      "exact", "oracle top-k by true attention scores over full keys",
      [](const IndexShape& s,
         const IndexParams& p) -> absl::StatusOr<std::unique_ptr<RetrievalIndex>> {
        return std::make_unique<ExactIndex>(s, p);
      },
      &ExactIndex::Read));
  KVR_RETURN_IF_ERROR(registry.Register(
      "quest", "pages with per-channel key min/max, ranked by the score upper bound",
      [](const IndexShape& s,
         const IndexParams& p) -> absl::StatusOr<std::unique_ptr<RetrievalIndex>> {
        KVR_ASSIGN_OR_RETURN(IndexParams params, ApplyQuestOptions(p));
        return std::make_unique<QuestIndex>(s, params);
      },
      &QuestIndex::Read));
  return absl::OkStatus();
}

}  // namespace kvr::retrieval
