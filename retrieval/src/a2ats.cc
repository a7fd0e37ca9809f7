#include "kvr/retrieval/a2ats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/rope.h"
#include "kvr/retrieval/serialization.h"
#include "method_util.h"

namespace kvr::retrieval {
namespace {

// Version 1: the codeword ids. Version 2 (written only with a2ats.rerank > 0): then the rerank
// factor and the keys it reads.
constexpr uint32_t kPayloadVersion = 1;
constexpr uint32_t kPayloadVersionRerank = 2;
constexpr int kMaxRerank = 64;

// a2ats.rerank from params.options (0: off); any other a2ats.* option is an error.
absl::StatusOr<int> RerankOption(const IndexParams& params) {
  int rerank = 0;
  for (const auto& [name, value] : params.options) {
    if (!name.starts_with("a2ats.")) continue;
    if (name != "a2ats.rerank") {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown option '", name,
                       "'; a2ats has a2ats.rerank (its other knobs are calibration flags of `kvr "
                       "calibrate`, stored in the codebook file)"));
    }
    KVR_ASSIGN_OR_RETURN(rerank, internal::ParseIntOption(name, value));
    if (rerank < 0 || rerank > kMaxRerank) {
      return absl::InvalidArgumentError(
          absl::StrCat("option a2ats.rerank must be in [0, ", kMaxRerank, "], got ", value));
    }
  }
  return rerank;
}

// The codebooks from params.assets, checked against the index shape.
absl::StatusOr<std::shared_ptr<const A2atsCodebooks>> CodebooksFor(const IndexShape& shape,
                                                                   const IndexParams& params) {
  KVR_RETURN_IF_ERROR(RerankOption(params).status());
  if (params.assets == nullptr) {
    return absl::FailedPreconditionError(
        "a2ats needs query-aware codebooks: build them once per model with `kvr calibrate "
        "--model M --text FILE --out codebook.kvrcb` and pass the file (IndexParams::assets)");
  }
  if (params.assets->kind() != kA2atsCodebooksKind) {
    return absl::InvalidArgumentError(absl::StrCat("a2ats: IndexParams::assets holds '",
                                                   std::string(params.assets->kind()), "', not '",
                                                   std::string(kA2atsCodebooksKind), "'"));
  }
  auto books = std::dynamic_pointer_cast<const A2atsCodebooks>(params.assets);
  if (books == nullptr) {
    return absl::InvalidArgumentError("a2ats: IndexParams::assets is not an A2atsCodebooks");
  }
  ModelFingerprint model;
  model.n_layers = shape.n_layers > 0 ? shape.n_layers : books->model().n_layers;
  model.n_heads = shape.n_heads;
  model.n_kv_heads = shape.n_kv_heads;
  model.head_dim = shape.head_dim;
  model.rope = shape.rope;
  KVR_RETURN_IF_ERROR(CheckFingerprint(books->model(), model));
  if (shape.layer >= books->model().n_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a2ats: layer %d has no codebook (the file covers %d layers)", shape.layer,
                        books->model().n_layers));
  }
  return books;
}

class A2atsIndex final : public internal::KeyEncodingIndex {
 public:
  A2atsIndex(const IndexShape& shape, const IndexParams& params,
             std::shared_ptr<const A2atsCodebooks> books, int rerank)
      : KeyEncodingIndex(shape),
        gqa_(params.gqa),
        rerank_(rerank),
        pool_(params.pool),
        books_(std::move(books)),
        ids_(shape.n_kv_heads) {}

  std::string_view method() const override { return kA2atsMethodName; }
  absl::Status Select(const SelectRequest& request, Selection* out) override;

  // The key copy of a2ats.rerank is not counted: as for ctkvr's rerank, a decode node reads the
  // candidates' keys where the KV lives; the CPU reference keeps a copy.
  int64_t MemoryBytes() const override {
    int64_t bytes = 0;
    for (const auto& ids : ids_) bytes += static_cast<int64_t>(ids.size() * sizeof(uint16_t));
    return bytes;
  }

  A2atsState State() const {
    A2atsState s;
    s.codebook_hash = books_->content_hash();
    s.codebook_size = books_->head(shape().layer, 0).size;
    for (const auto& ids : ids_) s.ids.emplace_back(ids);
    return s;
  }

  absl::Status SerializePayload(ByteWriter& writer) const override {
    writer.Put<uint32_t>(rerank_ > 0 ? kPayloadVersionRerank : kPayloadVersion);
    writer.Put<uint64_t>(books_->content_hash());
    writer.Put<int32_t>(books_->head(shape().layer, 0).size);
    for (const auto& ids : ids_) writer.PutArray<uint16_t>(ids);
    if (rerank_ > 0) {
      writer.Put<int32_t>(rerank_);
      writer.PutArray<float>(keys_);
    }
    return absl::OkStatus();
  }

  // The state after a Build that assigned `ids` ([n_kv_heads][size]), rerank off.
  absl::Status SetIds(int64_t size, std::span<const std::span<const uint16_t>> ids) {
    if (size < 0 || static_cast<int64_t>(ids.size()) != shape().n_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat("prebuilt a2ats: ", ids.size(),
                                                     " id arrays for ", shape().n_kv_heads,
                                                     " KV heads, size ", size));
    }
    for (int h = 0; h < shape().n_kv_heads; ++h) {
      const int codebook_size = books_->head(shape().layer, h).size;
      if (static_cast<int64_t>(ids[h].size()) != size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prebuilt a2ats: KV head ", h, " has ", ids[h].size(), " ids for ", size, " tokens"));
      }
      for (uint16_t id : ids[h]) {
        if (id >= codebook_size) {
          return absl::InvalidArgumentError(absl::StrCat("prebuilt a2ats: KV head ", h,
                                                         ": codeword id ", id, " outside the ",
                                                         codebook_size, " codewords"));
        }
      }
      ids_[h].assign(ids[h].begin(), ids[h].end());
    }
    size_ = size;
    return absl::OkStatus();
  }

  absl::Status LoadIds(int64_t size, uint32_t version, ByteReader& payload) {
    const int codebook_size = books_->head(shape().layer, 0).size;
    for (int h = 0; h < shape().n_kv_heads; ++h) {
      KVR_RETURN_IF_ERROR(
          payload.GetArray("a2ats codeword ids", &ids_[h], static_cast<uint64_t>(size)));
      if (static_cast<int64_t>(ids_[h].size()) != size) {
        return absl::DataLossError(
            absl::StrFormat("a2ats payload: KV head %d has %d ids, the header says %d tokens", h,
                            ids_[h].size(), size));
      }
      for (uint16_t id : ids_[h]) {
        if (id >= codebook_size) {
          return absl::DataLossError(
              absl::StrFormat("a2ats payload: codeword id %d outside the codebook (%d codewords)",
                              id, codebook_size));
        }
      }
    }
    if (version == kPayloadVersionRerank) {
      KVR_RETURN_IF_ERROR(payload.Get("a2ats rerank", &rerank_));
      if (rerank_ < 1 || rerank_ > kMaxRerank) {
        return absl::DataLossError(absl::StrFormat("a2ats payload: rerank %d", rerank_));
      }
      const uint64_t floats = static_cast<uint64_t>(size) * shape().n_kv_heads * shape().head_dim;
      KVR_RETURN_IF_ERROR(payload.GetArray("a2ats rerank keys", &keys_, floats));
      if (keys_.size() != floats) {
        return absl::DataLossError("a2ats payload: rerank keys do not match the header size");
      }
    } else {
      rerank_ = 0;
    }
    size_ = size;
    return payload.ExpectEnd("the a2ats payload");
  }

 private:
  absl::Status Encode(const TokenTensor& keys, absl::string_view what) override;

  GqaAggregation gqa_;
  // a2ats.rerank: the top rerank_ x budget tokens by codeword score are reranked by their exact
  // scores to the budget (0: off; the codeword ranking alone).
  int32_t rerank_ = 0;
  std::vector<float> keys_;  // [size_, n_kv_heads, head_dim] as given (RoPE applied); rerank only
  ThreadPool* pool_;  // not owned; may be null
  std::shared_ptr<const A2atsCodebooks> books_;
  std::vector<std::vector<uint16_t>> ids_;  // [n_kv_heads][n_tokens]
};

absl::Status A2atsIndex::Encode(const TokenTensor& keys, absl::string_view what) {
  const IndexShape& s = shape();
  const int d = s.head_dim;
  if (keys.n_tokens < 0 || (keys.n_tokens > 0 && keys.data == nullptr) ||
      (keys.n_tokens > 0 && keys.row_stride < static_cast<int64_t>(s.n_kv_heads) * d)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: bad tensor (n_tokens %d, row_stride %d, need data and row_stride >= %d)", what,
        keys.n_tokens, keys.row_stride, static_cast<int64_t>(s.n_kv_heads) * d));
  }
  const int64_t n = keys.n_tokens;
  if (n == 0) return absl::OkStatus();
  if (rerank_ > 0) internal::AppendPacked(keys, s.n_kv_heads, d, &keys_);
  const int64_t first = size_;
  internal::ForEachHead(pool_, s.n_kv_heads, [&](int h) {
    std::vector<float> pre(static_cast<size_t>(n) * d);  // [n, head_dim] pre-RoPE keys
    for (int64_t i = 0; i < n; ++i) {
      float* row = pre.data() + i * d;
      std::copy_n(keys.At(i, h, d), d, row);
      ApplyRope(std::span<float>(row, d), -static_cast<double>(first + i), s.rope);
    }
    std::vector<uint16_t>& ids = ids_[h];
    ids.resize(first + n);
    std::vector<float> scratch;
    books_->head(s.layer, h).Assign(pre.data(), n, d, ids.data() + first, scratch);
  });
  size_ = first + n;
  return absl::OkStatus();
}

absl::Status A2atsIndex::Select(const SelectRequest& request, Selection* out) {
  const IndexShape& s = shape();
  KVR_ASSIGN_OR_RETURN(const internal::SelectStart start,
                       internal::StartSelect(request, s.n_kv_heads, size_, "a2ats", out));
  if (start.done) return absl::OkStatus();
  const int64_t lo = start.candidates.begin;
  const int64_t hi = start.candidates.end;
  const int64_t n_sel = hi - lo;
  const int group = s.group_size();
  const int d = s.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  // Tokens the codeword ranking keeps: the budget, or rerank_ x budget for the exact rerank.
  const int64_t keep = rerank_ > 0 ? std::min(n_sel, rerank_ * request.budget) : request.budget;
  // WRoPE: the query at position p was rotated by p; scores use it rotated by b instead.
  const double rerotate = static_cast<double>(books_->params().wrope_offset) -
                          static_cast<double>(request.query_position);

  internal::ForEachHead(pool_, s.n_kv_heads, [&](int h) {
    const HeadCodebook& book = books_->head(s.layer, h);
    const int size = book.size;
    const std::vector<uint16_t>& ids = ids_[h];
    std::vector<int64_t> count(size, 0);  // selectable tokens per codeword
    for (int64_t t = lo; t < hi; ++t) ++count[ids[t]];

    std::vector<float> agg(size, gqa_ == GqaAggregation::kMaxLogit ? -INFINITY : 0.f);
    std::vector<float> score(size);
    std::vector<float> q(d), scratch;
    for (int g = 0; g < group; ++g) {
      std::copy_n(request.query + static_cast<int64_t>(h * group + g) * d, d, q.data());
      ApplyRope(q, rerotate, s.rope);
      book.Scores(q.data(), score.data(), scratch);
      for (float& v : score) v *= scale;
      switch (gqa_) {
        case GqaAggregation::kSumSoftmax: {
          // log Z = logsumexp over codewords of score + log count (tokens sharing a codeword
          // share its score).
          float mx = -INFINITY;
          for (int c = 0; c < size; ++c) {
            if (count[c] > 0) mx = std::max(mx, score[c]);
          }
          double z = 0;
          for (int c = 0; c < size; ++c) {
            if (count[c] > 0) z += static_cast<double>(count[c]) * std::exp(score[c] - mx);
          }
          const float log_z = mx + static_cast<float>(std::log(z));
          for (int c = 0; c < size; ++c) agg[c] += std::exp(score[c] - log_z);
          break;
        }
        case GqaAggregation::kMaxLogit:
          for (int c = 0; c < size; ++c) agg[c] = std::max(agg[c], score[c]);
          break;
        case GqaAggregation::kSumLogit:
          for (int c = 0; c < size; ++c) agg[c] += score[c];
          break;
      }
    }
    // Whole codewords from the best down until the budget is reached.
    std::vector<int> order;
    order.reserve(size);
    for (int c = 0; c < size; ++c) {
      if (count[c] > 0) order.push_back(c);
    }
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return agg[a] != agg[b] ? agg[a] > agg[b] : a < b; });
    std::vector<uint8_t> take(size, 0);  // 2 = every token, 1 = the boundary codeword
    int64_t filled = 0;
    int boundary = -1;
    for (int c : order) {
      if (filled + count[c] <= keep) {
        take[c] = 2;
        filled += count[c];
        if (filled == keep) break;
      } else {
        take[c] = 1;
        boundary = c;
        break;
      }
    }
    std::vector<int64_t>& selected = out->per_head[h];
    selected.reserve(keep);
    std::vector<int64_t> boundary_tokens;
    for (int64_t t = lo; t < hi; ++t) {
      const uint8_t k = take[ids[t]];
      if (k == 2) {
        selected.push_back(t);
      } else if (k == 1) {
        boundary_tokens.push_back(t);
      }
    }
    if (boundary >= 0) {
      // The most recent tokens of the boundary codeword fill the rest of the budget.
      const int64_t rest = keep - filled;
      selected.insert(selected.end(), boundary_tokens.end() - rest, boundary_tokens.end());
      std::inplace_merge(selected.begin(), selected.end() - rest, selected.end());
    }
    if (static_cast<int64_t>(selected.size()) > request.budget) {
      // Exact rerank: the kept tokens' true scores (keys and query both carry RoPE).
      const int64_t nk = static_cast<int64_t>(selected.size());
      const int64_t row = static_cast<int64_t>(s.n_kv_heads) * d;
      std::vector<float> gathered(static_cast<size_t>(nk) * d), logits;
      for (int64_t i = 0; i < nk; ++i) {
        std::copy_n(keys_.data() + selected[i] * row + static_cast<int64_t>(h) * d, d,
                    gathered.data() + i * d);
      }
      internal::GroupLogits(request.query, s, h, gathered.data(), d, nk, scale, &logits);
      std::vector<float> exact = internal::AggregateGroupScores(gqa_, logits, group, nk);
      std::vector<int64_t> top = TopKIndices(exact, request.budget);
      std::vector<int64_t> reranked(top.size());
      for (size_t i = 0; i < top.size(); ++i) reranked[i] = selected[top[i]];
      std::sort(reranked.begin(), reranked.end());
      selected = std::move(reranked);
    }
  });
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<RetrievalIndex>> MakeA2atsIndex(const IndexShape& shape,
                                                               const IndexParams& params) {
  KVR_RETURN_IF_ERROR(shape.Validate());
  KVR_ASSIGN_OR_RETURN(auto books, CodebooksFor(shape, params));
  KVR_ASSIGN_OR_RETURN(const int rerank, RerankOption(params));
  return std::make_unique<A2atsIndex>(shape, params, std::move(books), rerank);
}

absl::StatusOr<std::unique_ptr<RetrievalIndex>> DeserializeA2atsIndex(const IndexShape& shape,
                                                                      const IndexParams& params,
                                                                      int64_t size,
                                                                      ByteReader& payload) {
  KVR_RETURN_IF_ERROR(shape.Validate());
  KVR_ASSIGN_OR_RETURN(auto books, CodebooksFor(shape, params));
  uint32_t version = 0;
  uint64_t hash = 0;
  int32_t codebook_size = 0;
  KVR_RETURN_IF_ERROR(payload.Get("a2ats payload version", &version));
  if (version != kPayloadVersion && version != kPayloadVersionRerank) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a2ats payload version %d is not supported (this build reads %d)", version,
                        kPayloadVersion));
  }
  KVR_RETURN_IF_ERROR(payload.Get("a2ats codebook hash", &hash));
  KVR_RETURN_IF_ERROR(payload.Get("a2ats codebook size", &codebook_size));
  if (hash != books->content_hash()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a2ats index was built with other codebooks (content hash %016x, this node has "
        "%016x): load the same codebook file on prefill and decode nodes",
        hash, books->content_hash()));
  }
  if (codebook_size != books->head(shape.layer, 0).size || size < 0) {
    return absl::DataLossError(absl::StrFormat(
        "a2ats payload: codebook size %d / token count %d inconsistent with the codebooks (%d)",
        codebook_size, size, books->head(shape.layer, 0).size));
  }
  auto index = std::make_unique<A2atsIndex>(shape, params, std::move(books), 0);
  KVR_RETURN_IF_ERROR(index->LoadIds(size, version, payload));
  return index;
}

absl::StatusOr<int> A2atsRerank(const IndexParams& params) { return RerankOption(params); }

absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltA2ats(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const std::span<const uint16_t>> ids) {
  KVR_RETURN_IF_ERROR(shape.Validate());
  KVR_ASSIGN_OR_RETURN(auto books, CodebooksFor(shape, params));
  KVR_ASSIGN_OR_RETURN(const int rerank, RerankOption(params));
  if (rerank > 0) {
    return absl::InvalidArgumentError(
        "prebuilt a2ats: a2ats.rerank is set (its payload carries the keys: build it on the CPU)");
  }
  A2atsIndex index(shape, params, std::move(books), 0);
  KVR_RETURN_IF_ERROR(index.SetIds(size, ids));
  return SerializeIndex(index);
}

absl::StatusOr<A2atsState> A2atsStateOf(const RetrievalIndex& index) {
  KVR_ASSIGN_OR_RETURN(const A2atsIndex* typed,
                       internal::IndexAs<A2atsIndex>(index, "A2atsStateOf", "a2ats"));
  return typed->State();
}

}  // namespace kvr::retrieval
