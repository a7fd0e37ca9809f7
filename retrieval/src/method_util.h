#pragma once
// Private helpers shared by the core methods' implementations.

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/thread_pool.h"
#include "kvr/retrieval/index.h"
#include "kvr/retrieval/serialization.h"

namespace kvr::retrieval::internal {

// A method option's integer value (IndexParams::options); the error names the option.
inline absl::StatusOr<int> ParseIntOption(absl::string_view name, absl::string_view value) {
  int out = 0;
  const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), out);
  if (ec != std::errc() || ptr != value.data() + value.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("option ", name, ": '", value, "' is not an integer"));
  }
  return out;
}

// RopeParams as the index bytes (registry.cc) and the a2ats codebook file write them: style
// (uint8), 3 zero bytes, theta (float), rotary_dim (int32).
inline void PutRope(ByteWriter& w, const RopeParams& rope) {
  w.Put<uint8_t>(static_cast<uint8_t>(rope.style));
  for (int i = 0; i < 3; ++i) w.Put<uint8_t>(0);
  w.Put<float>(rope.theta);
  w.Put<int32_t>(rope.rotary_dim);
}

// Reads what PutRope wrote; DATA_LOSS naming `format` (the bytes being read) for an unknown
// style.
inline absl::Status GetRope(ByteReader& r, absl::string_view format, RopeParams* rope) {
  uint8_t style = 0, pad = 0;
  if (absl::Status read = r.Get("rope style", &style); !read.ok()) return read;
  if (style > static_cast<uint8_t>(RopeStyle::kHalfSplit)) {
    return absl::DataLossError(absl::StrCat(format, ": unknown rope style ", int{style}));
  }
  rope->style = static_cast<RopeStyle>(style);
  for (int i = 0; i < 3; ++i) {
    if (absl::Status read = r.Get("rope reserved", &pad); !read.ok()) return read;
  }
  if (absl::Status read = r.Get("rope theta", &rope->theta); !read.ok()) return read;
  int32_t rotary_dim = 0;
  if (absl::Status read = r.Get("rope rotary_dim", &rotary_dim); !read.ok()) return read;
  rope->rotary_dim = rotary_dim;
  return absl::OkStatus();
}

// A payload's GQA aggregation byte (written as uint8_t); the errors name `method`.
inline absl::StatusOr<GqaAggregation> ReadGqa(ByteReader& r, const char* method) {
  uint8_t gqa = 0;
  const std::string field = absl::StrCat(method, " gqa");
  if (absl::Status read = r.Get(field, &gqa); !read.ok()) return read;
  if (gqa > static_cast<uint8_t>(GqaAggregation::kSumLogit)) {
    return absl::DataLossError(absl::StrCat(method, " payload: unknown gqa mode ", int{gqa}));
  }
  return static_cast<GqaAggregation>(gqa);
}

// Checks that `t` is a usable [n_tokens, n_heads, head_dim] view.
inline absl::Status ValidateTensor(const TokenTensor& t, int n_heads, int head_dim,
                                   const char* what) {
  if (t.n_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": negative n_tokens ", t.n_tokens));
  }
  if (t.n_tokens > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": null data for ", t.n_tokens, " tokens"));
  }
  if (t.n_tokens > 0 && t.row_stride < static_cast<int64_t>(n_heads) * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": row_stride ", t.row_stride,
        " is smaller than n_heads * head_dim = ", static_cast<int64_t>(n_heads) * head_dim));
  }
  return absl::OkStatus();
}

inline absl::Status ValidateSelect(const SelectRequest& r, const IndexShape& shape,
                                   const Selection* out) {
  if (out == nullptr) return absl::InvalidArgumentError("Select: null output");
  if (r.query == nullptr) return absl::InvalidArgumentError("Select: null query");
  if (r.budget <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Select: budget must be > 0 tokens per KV head, got ", r.budget));
  }
  if (r.n_sink < 0 || r.local_begin < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Select: n_sink and local_begin must be >= 0, got ", r.n_sink, ", ", r.local_begin));
  }
  return absl::OkStatus();
}

// Candidate positions [begin, end) of a request against an index of `size` tokens.
struct CandidateRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t count() const { return std::max<int64_t>(0, end - begin); }
  bool Contains(int64_t t) const { return t >= begin && t < end; }
};

inline CandidateRange Candidates(const SelectRequest& r, int64_t size) {
  return {std::min(r.n_sink, size), std::min(r.local_begin, size)};
}

inline void ResetSelection(Selection* out, int n_kv_heads) {
  out->per_head.resize(n_kv_heads);
  for (auto& v : out->per_head) v.clear();
}

// Every head selects every candidate of `c`, in order.
inline void SelectEveryCandidate(const CandidateRange& c, Selection* out) {
  for (auto& ids : out->per_head) {
    ids.resize(c.count());
    std::iota(ids.begin(), ids.end(), c.begin);
  }
}

// The opening of a Select over Candidates(request, size): `request` checked, `out` reset to
// n_kv_heads empty lists. count() == 0 of the range returned: nothing to rank, `out` is final.
inline absl::StatusOr<CandidateRange> BeginSelect(const SelectRequest& request,
                                                  const IndexShape& shape, int64_t size,
                                                  Selection* out) {
  if (absl::Status valid = ValidateSelect(request, shape, out); !valid.ok()) return valid;
  ResetSelection(out, shape.n_kv_heads);
  return Candidates(request, size);
}

// The opening of a Select that ranks the candidates itself (a2ats, pariskv): `request` checked
// (the errors name `method`; a negative n_sink counts as 0), `out` reset to n_kv_heads empty
// lists, and the candidates. `done` when nothing is left to rank: no candidate, or a budget
// that covers them all (every head then selects all of them, in order).
struct SelectStart {
  CandidateRange candidates;
  bool done = false;
};

inline absl::StatusOr<SelectStart> StartSelect(const SelectRequest& request, int n_kv_heads,
                                               int64_t size, absl::string_view method,
                                               Selection* out) {
  if (request.budget <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(method, " Select: budget must be > 0, got ", request.budget));
  }
  if (request.query == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(method, " Select: query is null"));
  }
  ResetSelection(out, n_kv_heads);
  SelectStart start{Candidates(request, size)};
  start.candidates.begin = std::max<int64_t>(0, start.candidates.begin);
  const int64_t n_sel = start.candidates.count();
  if (n_sel == 0) {
    start.done = true;
  } else if (request.budget >= n_sel) {
    SelectEveryCandidate(start.candidates, out);
    start.done = true;
  }
  return start;
}

// Combines per-head scores of one GQA group into one score per candidate.
// scores: [group, n] scaled logits (modified in place for kSumSoftmax); returns [n].
std::vector<float> AggregateGroupScores(GqaAggregation how, std::span<float> scores, int group,
                                        int64_t n);

// Logits of every query head of kv head `kvh` against `n` vectors:
// out[g * n + i] = scale * q_{kvh*group+g} . vec(i), vec(i) = base + i * stride.
void GroupLogits(const float* query, const IndexShape& shape, int kvh, const float* base,
                 int64_t stride, int64_t n, float scale, std::vector<float>* out);

// Copies keys of all heads into packed storage [n, n_kv_heads, head_dim].
inline void AppendPacked(const TokenTensor& t, int n_heads, int head_dim, std::vector<float>* dst) {
  const int64_t row = static_cast<int64_t>(n_heads) * head_dim;
  const size_t old = dst->size();
  dst->resize(old + t.n_tokens * row);
  for (int64_t i = 0; i < t.n_tokens; ++i) {
    std::copy_n(t.data + i * t.row_stride, row, dst->data() + old + i * row);
  }
}

// Runs fn(h) for h in [0, n), on the pool when there is one.
inline void ForEachHead(ThreadPool* pool, int n, const std::function<void(int)>& fn) {
  if (pool == nullptr || n <= 1) {
    for (int h = 0; h < n; ++h) fn(h);
    return;
  }
  pool->ParallelFor(static_cast<size_t>(n), [&](size_t begin, size_t end) {
    for (size_t h = begin; h < end; ++h) fn(static_cast<int>(h));
  });
}

// The base of an index that encodes each key on its own against what was fixed before the
// sequence (a2ats' offline codebooks, pariskv's data-independent centroids): appended keys are
// encoded exactly like prefill keys, so nothing learned goes stale, and an empty start is fine.
// Build is for an empty index only. The errors name method().
class KeyEncodingIndex : public RetrievalIndex {
 public:
  int64_t size() const override { return size_; }
  absl::Status Build(const BuildInput& input) final {
    if (size_ != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(std::string(method()), ": Build called on a non-empty index"));
    }
    return Encode(input.keys, absl::StrCat(std::string(method()), " Build keys"));
  }
  absl::Status Append(const AppendInput& input) final {
    return Encode(input.keys, absl::StrCat(std::string(method()), " Append keys"));
  }

 protected:
  using RetrievalIndex::RetrievalIndex;
  // Encodes `keys` ([n_tokens, n_kv_heads, head_dim]) as tokens [size_, size_ + n_tokens) and
  // advances size_; `what` names the tensor in errors.
  virtual absl::Status Encode(const TokenTensor& keys, absl::string_view what) = 0;

  int64_t size_ = 0;  // tokens encoded
};

// `index` as its concrete class `Index`, for a method's typed state accessor (`caller`, e.g.
// "KeyDiffStateOf"): InvalidArgument naming the method found when it is another method's index.
template <typename Index>
absl::StatusOr<const Index*> IndexAs(const RetrievalIndex& index, std::string_view caller,
                                     std::string_view method) {
  const auto* typed = dynamic_cast<const Index*>(&index);
  if (typed == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(caller), ": a '",
                                                   std::string(index.method()), "' index, not ",
                                                   std::string(method)));
  }
  return typed;
}

}  // namespace kvr::retrieval::internal
