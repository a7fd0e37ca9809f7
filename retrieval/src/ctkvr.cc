// CTKVR (centroid-then-token KV retrieval).
//
// Build (Algorithm 1): the last C prefill queries become query centroids. For every centroid and
// KV head, the top-rho keys by attention score (softmax per query head, max over the GQA group,
// as in the paper's footnote 3) form that centroid's qcIVF list.
// Select (Algorithm 2): cosine of the decode query to every centroid (max over the group) picks
// the top-C' centroids; their lists are merged and de-duplicated (recall), then the recalled keys
// are reranked by their true attention score (GQA per IndexParams::gqa) to the budget.
// Dynamic centroid update (sec. 3.1.3): after a Select, the decode query and the top-rho of its
// reranked keys replace the OLDEST entry of the qcIVF (FIFO over the C entries), when
// CtkvrParams::fifo_size > 0; fifo_size bounds how many of the C entries rotate (the newest
// prefill centroids stay once the rotating part is full).
//
// Choices:
//  - Defaults as in the paper (sec. 4.1.1) for C = min(2048, L/16) and rho = 2.5 * budget
//    (IndexParams::budget at Build time), clipped to the clusterable tokens. An explicit C larger
//    than the prefill queries given to Build is an error. C' = 6, not the paper's 4: its own sweep
//    (Fig. 10, App. C.2) has accuracy still rising with C' up to ~5; on SmolLM2 at 8K (BENCHMARKS.md,
//    budget 243, FIFO on) recall is 0.939 / 0.955 / 0.963 at C' = 4 / 6 / 8, and 6 keeps the
//    recalled lists (C' x rho) within 1.5x of the paper's.
//  - The FIFO update is on by default (fifo_size 2048 >= the default C: every centroid rotates):
//    +0.013 recall at budget 243, +0.03 at 81 (BENCHMARKS.md). The GPU selector
//    (retrieval/cuda/select) reads the qcIVF; the GPU decode's ctkvr lane grows and rotates it
//    between selections as this index does (retrieval/cuda/decode/src/ctkvr_lane.cu).
//  - Sinks are never listed (always attended); the local window is listed (it leaves the window).
//  - Generated tokens (Append): the paper leaves them to the GPU-resident recent window. Here a
//    new key is also inserted into every list whose centroid would rank it in its top-rho (its
//    max-over-group logit beats the list's smallest), so tokens that leave our (shorter) local
//    window stay reachable. AppendInput::queries are not needed.
//  - Reranking needs the recalled keys. The CPU reference keeps a copy of all keys; MemoryBytes()
//    counts only the qcIVF and centroids, which is what a decode node holds: the rerank reads the
//    keys where the KV lives (CTKVR reranks on the CPU side of its CPU-GPU split).

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/ctkvr.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/registry.h"
#include "method_util.h"

namespace kvr::retrieval {
namespace {

struct Entry {
  std::vector<float> centroid;  // [group, head_dim] unit-normalised queries of the group
  std::vector<float> norms;     // [group] their original norms (for logits in Append)
  std::vector<int32_t> list;    // token ids, sorted ascending
  float threshold = 0.f;        // smallest max-over-group logit in `list` (insertion test)
};

class CtkvrIndex final : public RetrievalIndex {
 public:
  CtkvrIndex(const IndexShape& shape, const IndexParams& params)
      : RetrievalIndex(shape), params_(params), heads_(shape.n_kv_heads) {}

  std::string_view method() const override { return "ctkvr"; }
  int64_t size() const override { return size_; }

  absl::Status Build(const BuildInput& input) override {
    if (built_) return absl::FailedPreconditionError("ctkvr: Build called twice");
    const int hd = shape().head_dim;
    const int group = shape().group_size();
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, hd, "ctkvr Build keys"));
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.queries, shape().n_heads, hd, "ctkvr Build queries"));
    const int64_t n = input.keys.n_tokens;
    const int64_t nq = input.queries.n_tokens;
    int64_t c = params_.ctkvr.n_centroids;
    if (c == 0) {
      c = std::min<int64_t>({2048, std::max<int64_t>(1, n / 16), nq});
    } else if (c > n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ctkvr: C (", c, " query centroids) is larger than the ", n, "-token context"));
    } else if (c > nq) {
      return absl::InvalidArgumentError(
          absl::StrCat("ctkvr: C (", c, " query centroids) is larger than the ", nq,
                       " prefill queries passed to Build (pass the last C queries)"));
    }
    if (c <= 0) {
      return absl::InvalidArgumentError(
          "ctkvr: Build needs prefill queries (BuildInput::queries is empty)");
    }
    n_sink_ = std::min(params_.n_sink, n);
    const int64_t listable = n - n_sink_;
    rho_ = params_.ctkvr.list_length > 0
               ? params_.ctkvr.list_length
               : static_cast<int64_t>(std::ceil(2.5 * static_cast<double>(params_.budget)));
    rho_ = std::max<int64_t>(1, std::min(rho_, listable));
    n_recall_ = CtkvrRecall(params_);
    fifo_size_ = std::min(params_.ctkvr.fifo_size, c);
    n_centroids_ = c;
    internal::AppendPacked(input.keys, shape().n_kv_heads, hd, &keys_);
    size_ = n;
    built_ = true;
    if (listable <= 0) {
      for (auto& h : heads_) h.assign(c, Entry{});
      return absl::OkStatus();
    }
    const int64_t row = static_cast<int64_t>(shape().n_kv_heads) * hd;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    // Logits of the C centroids' group queries against every listable key: one SGEMM per head.
    std::vector<float> logits(static_cast<size_t>(c) * group * listable);  // [c*group, listable]
    std::vector<float> q(static_cast<size_t>(c) * group * hd);             // [c*group, hd]
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      for (int64_t i = 0; i < c; ++i) {
        for (int g = 0; g < group; ++g) {
          const float* src = input.queries.At(nq - c + i, kvh * group + g, hd);
          std::copy_n(src, hd, q.data() + (i * group + g) * hd);
        }
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(c * group),
                  static_cast<int>(listable), hd, scale, q.data(), hd,
                  keys_.data() + n_sink_ * row + kvh * hd, static_cast<int>(row), 0.f,
                  logits.data(), static_cast<int>(listable));
      auto& entries = heads_[kvh];
      entries.resize(c);
      std::vector<float> prob(listable), score(listable), maxlogit(listable);
      for (int64_t i = 0; i < c; ++i) {
        std::fill(score.begin(), score.end(), 0.f);
        std::fill(maxlogit.begin(), maxlogit.end(), -std::numeric_limits<float>::infinity());
        for (int g = 0; g < group; ++g) {
          const float* l = logits.data() + (i * group + g) * listable;
          std::copy_n(l, listable, prob.data());
          SoftmaxInPlace(prob);
          for (int64_t t = 0; t < listable; ++t) {
            score[t] = std::max(score[t], prob[t]);
            maxlogit[t] = std::max(maxlogit[t], l[t]);
          }
        }
        Entry& e = entries[i];
        e.centroid.assign(q.begin() + i * group * hd, q.begin() + (i + 1) * group * hd);
        e.norms = NormaliseGroup(e.centroid.data());
        std::vector<int64_t> top = TopKIndices(score, rho_);
        e.list.clear();
        e.threshold = std::numeric_limits<float>::infinity();
        for (int64_t t : top) {
          e.list.push_back(static_cast<int32_t>(n_sink_ + t));
          e.threshold = std::min(e.threshold, maxlogit[t]);
        }
        std::sort(e.list.begin(), e.list.end());
      }
    }
    next_fifo_ = 0;
    return absl::OkStatus();
  }

  absl::Status Append(const AppendInput& input) override {
    if (!built_) return absl::FailedPreconditionError("ctkvr: Append before Build");
    const int hd = shape().head_dim;
    const int group = shape().group_size();
    KVR_RETURN_IF_ERROR(
        internal::ValidateTensor(input.keys, shape().n_kv_heads, hd, "ctkvr Append keys"));
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    // Centroids are unit-normalised; the insertion test needs logits of the ORIGINAL queries,
    // so we keep their norms.
    for (int64_t i = 0; i < input.keys.n_tokens; ++i) {
      const int32_t id = static_cast<int32_t>(size_ + i);
      for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
        const float* k = input.keys.At(i, kvh, hd);
        for (Entry& e : heads_[kvh]) {
          if (e.list.empty()) continue;
          float best = -std::numeric_limits<float>::infinity();
          for (int g = 0; g < group; ++g) {
            best = std::max(best, scale * e.norms[g] * Dot(e.centroid.data() + g * hd, k, hd));
          }
          if (best >= e.threshold) e.list.push_back(id);  // ids grow: list stays sorted
        }
      }
    }
    internal::AppendPacked(input.keys, shape().n_kv_heads, hd, &keys_);
    size_ += input.keys.n_tokens;
    return absl::OkStatus();
  }

  absl::Status Select(const SelectRequest& request, Selection* out) override {
    if (!built_) return absl::FailedPreconditionError("ctkvr: Select before Build");
    KVR_ASSIGN_OR_RETURN(const internal::CandidateRange range,
                         internal::BeginSelect(request, shape(), size_, out));
    if (range.count() == 0) return absl::OkStatus();
    const int hd = shape().head_dim;
    const int group = shape().group_size();
    const int64_t row = static_cast<int64_t>(shape().n_kv_heads) * hd;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    std::vector<float> qn(static_cast<size_t>(group) * hd);
    for (int kvh = 0; kvh < shape().n_kv_heads; ++kvh) {
      auto& entries = heads_[kvh];
      std::copy_n(request.query + static_cast<int64_t>(kvh) * group * hd, group * hd, qn.data());
      std::vector<float> qnorms = NormaliseGroup(qn.data());
      // Recall: cosine to each centroid, max over the group, top C'.
      std::vector<float> cos(entries.size());
      for (size_t i = 0; i < entries.size(); ++i) {
        float best = -2.f;
        for (int g = 0; g < group; ++g) {
          best = std::max(best, Dot(qn.data() + g * hd, entries[i].centroid.data() + g * hd, hd));
        }
        cos[i] = entries[i].list.empty() ? -3.f : best;
      }
      std::vector<int64_t> chosen = TopKIndices(cos, n_recall_);
      recalled_.clear();
      for (int64_t i : chosen) {
        for (int32_t id : entries[i].list) {
          if (range.Contains(id)) recalled_.push_back(id);
        }
      }
      std::sort(recalled_.begin(), recalled_.end());
      recalled_.erase(std::unique(recalled_.begin(), recalled_.end()), recalled_.end());
      const int64_t nr = static_cast<int64_t>(recalled_.size());
      // Rerank by the true scores of the recalled keys.
      logits_.resize(static_cast<size_t>(group) * nr);
      for (int g = 0; g < group; ++g) {
        const float* q = request.query + static_cast<int64_t>(kvh * group + g) * hd;
        for (int64_t j = 0; j < nr; ++j) {
          logits_[g * nr + j] = scale * Dot(q, keys_.data() + recalled_[j] * row + kvh * hd, hd);
        }
      }
      std::vector<float> maxlogit(nr, -std::numeric_limits<float>::infinity());
      for (int g = 0; g < group; ++g) {
        for (int64_t j = 0; j < nr; ++j) maxlogit[j] = std::max(maxlogit[j], logits_[g * nr + j]);
      }
      std::vector<float> agg = internal::AggregateGroupScores(params_.gqa, logits_, group, nr);
      std::vector<int64_t> order = TopKIndices(agg, std::max(request.budget, rho_));
      auto& ids = out->per_head[kvh];
      for (int64_t j = 0; j < static_cast<int64_t>(order.size()) && j < request.budget; ++j) {
        ids.push_back(recalled_[order[j]]);
      }
      std::sort(ids.begin(), ids.end());
      // Dynamic centroid update (FIFO): the decode query becomes a centroid listing its top
      // max(rho, budget) reranked keys (rho is clipped to the prefill at Build; the list must at
      // least cover what this step selected), replacing the oldest rotating entry.
      if (fifo_size_ > 0 && nr > 0) {
        const int64_t keep = std::max(rho_, request.budget);
        const int64_t slot = n_centroids_ - fifo_size_ + next_fifo_ % fifo_size_;
        Entry& e = entries[slot];
        e.centroid = qn;
        e.norms = qnorms;
        e.list.clear();
        e.threshold = std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < static_cast<int64_t>(order.size()) && j < keep; ++j) {
          e.list.push_back(static_cast<int32_t>(recalled_[order[j]]));
          e.threshold = std::min(e.threshold, maxlogit[order[j]]);
        }
        // Every recalled key listed: fewer than `keep` keys outrank any other, so later keys
        // always join (Append's test).
        if (nr <= keep) e.threshold = -std::numeric_limits<float>::infinity();
        // The local window's keys are no candidates now but will be once they leave it: they
        // join as Append's insertion test would have let them, had the entry existed then.
        for (int64_t t = range.end; t < size_; ++t) {
          float best = -std::numeric_limits<float>::infinity();
          for (int g = 0; g < group; ++g) {
            const float* q = request.query + static_cast<int64_t>(kvh * group + g) * hd;
            best = std::max(best, scale * Dot(q, keys_.data() + t * row + kvh * hd, hd));
          }
          if (best >= e.threshold) e.list.push_back(static_cast<int32_t>(t));
        }
        std::sort(e.list.begin(), e.list.end());
      }
    }
    if (fifo_size_ > 0) ++next_fifo_;
    return absl::OkStatus();
  }

  int64_t MemoryBytes() const override {
    int64_t bytes = 0;
    for (const auto& h : heads_) {
      for (const Entry& e : h)
        bytes += (e.centroid.size() + e.norms.size() + e.list.size() + 1) * 4;
    }
    return bytes;
  }

  CtkvrState State() const {
    CtkvrState s;
    s.gqa = params_.gqa;
    s.n_sink = n_sink_;
    s.n_centroids = n_centroids_;
    s.rho = rho_;
    s.n_recall = n_recall_;
    s.fifo_size = fifo_size_;
    s.next_fifo = next_fifo_;
    s.keys = keys_;
    for (const auto& h : heads_) {
      std::vector<CtkvrState::Entry>& entries = s.heads.emplace_back();
      for (const Entry& e : h) entries.push_back({e.centroid, e.norms, e.list, e.threshold});
    }
    return s;
  }

  absl::Status SerializePayload(ByteWriter& w) const override {
    w.Put<uint8_t>(static_cast<uint8_t>(params_.gqa));
    w.Put<int64_t>(n_sink_);
    w.Put<int64_t>(n_centroids_);
    w.Put<int64_t>(rho_);
    w.Put<int64_t>(n_recall_);
    w.Put<int64_t>(fifo_size_);
    w.Put<int64_t>(next_fifo_);
    w.PutArray<float>(keys_);
    for (const auto& h : heads_) {
      for (const Entry& e : h) {
        w.PutArray<float>(e.centroid);
        w.PutArray<float>(e.norms);
        w.PutArray<int32_t>(e.list);
        w.Put<float>(e.threshold);
      }
    }
    return absl::OkStatus();
  }

  // The index in `st` (SerializePrebuiltCtkvr), checked as Read checks bytes (CheckState).
  static absl::StatusOr<std::unique_ptr<CtkvrIndex>> FromState(const IndexShape& shape,
                                                               const IndexParams& params,
                                                               int64_t size, const CtkvrState& st) {
    KVR_RETURN_IF_ERROR(shape.Validate());
    auto bad = [](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat("prebuilt ctkvr: ", parts...));
    };
    if (size < 0) return bad("size ", size);
    if (static_cast<int>(st.heads.size()) != shape.n_kv_heads) {
      return bad(st.heads.size(), " heads for ", shape.n_kv_heads, " KV heads");
    }
    auto index = std::make_unique<CtkvrIndex>(shape, params);
    index->params_.gqa = st.gqa;
    index->n_sink_ = st.n_sink;
    index->n_centroids_ = st.n_centroids;
    index->rho_ = st.rho;
    index->n_recall_ = st.n_recall;
    index->fifo_size_ = st.fifo_size;
    index->next_fifo_ = st.next_fifo;
    index->keys_.assign(st.keys.begin(), st.keys.end());
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      if (static_cast<int64_t>(st.heads[h].size()) != st.n_centroids) {
        return bad("head ", h, ": ", st.heads[h].size(), " entries for C ", st.n_centroids);
      }
      for (const CtkvrState::Entry& in : st.heads[h]) {
        index->heads_[h].push_back({{in.centroid.begin(), in.centroid.end()},
                                    {in.norms.begin(), in.norms.end()},
                                    {in.list.begin(), in.list.end()},
                                    in.threshold});
      }
    }
    if (std::optional<std::string> wrong = index->CheckState(size)) return bad(*wrong);
    index->size_ = size;
    index->built_ = true;
    return index;
  }

  static absl::StatusOr<std::unique_ptr<RetrievalIndex>> Read(const IndexShape& shape,
                                                              const IndexParams& params,
                                                              int64_t size, ByteReader& r) {
    auto index = std::make_unique<CtkvrIndex>(shape, params);
    uint8_t gqa = 0;
    KVR_RETURN_IF_ERROR(r.Get("ctkvr gqa", &gqa));
    if (gqa > static_cast<uint8_t>(GqaAggregation::kSumLogit)) {
      return absl::DataLossError(absl::StrCat("ctkvr payload: unknown gqa mode ", int{gqa}));
    }
    index->params_.gqa = static_cast<GqaAggregation>(gqa);
    KVR_RETURN_IF_ERROR(r.Get("ctkvr n_sink", &index->n_sink_));
    KVR_RETURN_IF_ERROR(r.Get("ctkvr C", &index->n_centroids_));
    KVR_RETURN_IF_ERROR(r.Get("ctkvr rho", &index->rho_));
    KVR_RETURN_IF_ERROR(r.Get("ctkvr C'", &index->n_recall_));
    KVR_RETURN_IF_ERROR(r.Get("ctkvr fifo_size", &index->fifo_size_));
    KVR_RETURN_IF_ERROR(r.Get("ctkvr fifo cursor", &index->next_fifo_));
    // The counts below size the reads: checked before them.
    if (std::optional<std::string> wrong = index->CheckParameters(size)) {
      return absl::DataLossError(absl::StrCat("ctkvr payload: ", *wrong));
    }
    const int hd = shape.head_dim;
    const int group = shape.group_size();
    const int64_t row = static_cast<int64_t>(shape.n_kv_heads) * hd;
    KVR_RETURN_IF_ERROR(r.GetArray("ctkvr keys", &index->keys_, size * row));
    for (auto& h : index->heads_) {
      h.resize(index->n_centroids_);
      for (Entry& e : h) {
        KVR_RETURN_IF_ERROR(r.GetArray("ctkvr centroid", &e.centroid, group * hd));
        KVR_RETURN_IF_ERROR(r.GetArray("ctkvr centroid norms", &e.norms, group));
        KVR_RETURN_IF_ERROR(r.GetArray("ctkvr list", &e.list, size));
        KVR_RETURN_IF_ERROR(r.Get("ctkvr threshold", &e.threshold));
      }
    }
    if (std::optional<std::string> wrong = index->CheckState(size)) {
      return absl::DataLossError(absl::StrCat("ctkvr payload: ", *wrong));
    }
    index->size_ = size;
    index->built_ = true;
    return index;
  }

 private:
  // What is wrong with the parameters of an index over `size` tokens (nullopt: nothing).
  std::optional<std::string> CheckParameters(int64_t size) const {
    if (n_centroids_ < 0 || n_centroids_ > size || rho_ < 1 || n_recall_ < 1 || fifo_size_ < 0 ||
        fifo_size_ > n_centroids_ || next_fifo_ < 0 || n_sink_ < 0 || n_sink_ > size) {
      return absl::StrCat("corrupt parameters: C ", n_centroids_, ", rho ", rho_, ", C' ",
                          n_recall_, ", fifo ", fifo_size_, " (cursor ", next_fifo_, "), sinks ",
                          n_sink_, " for ", size, " tokens");
    }
    return std::nullopt;
  }
  // The parameters, then the keys and every entry (Read's and FromState's one check).
  std::optional<std::string> CheckState(int64_t size) const {
    if (std::optional<std::string> wrong = CheckParameters(size)) return wrong;
    const int hd = shape().head_dim, group = shape().group_size();
    const int64_t row = static_cast<int64_t>(shape().n_kv_heads) * hd;
    if (static_cast<int64_t>(keys_.size()) != size * row) {
      return absl::StrCat(keys_.size(), " key values for ", size, " tokens of ", row);
    }
    for (size_t h = 0; h < heads_.size(); ++h) {
      for (size_t i = 0; i < heads_[h].size(); ++i) {
        const Entry& e = heads_[h][i];
        if ((!e.centroid.empty() && static_cast<int>(e.centroid.size()) != group * hd) ||
            e.norms.size() * hd != e.centroid.size()) {
          return absl::StrCat("head ", h, " entry ", i, ": a centroid of ", e.centroid.size(),
                              " values and ", e.norms.size(), " norms");
        }
        for (int32_t id : e.list) {
          if (id < 0 || id >= size) {
            return absl::StrCat("head ", h, " entry ", i, ": token id ", id, " outside [0, ", size,
                                ")");
          }
        }
      }
    }
    return std::nullopt;
  }

  // Unit-normalises each of the group's query vectors in place; returns their norms.
  std::vector<float> NormaliseGroup(float* q) const {
    const int hd = shape().head_dim;
    std::vector<float> norms(shape().group_size());
    for (int g = 0; g < shape().group_size(); ++g) {
      norms[g] = Norm(q + g * hd, hd);
      if (norms[g] > 0.f) {
        for (int d = 0; d < hd; ++d) q[g * hd + d] /= norms[g];
      }
    }
    return norms;
  }

  IndexParams params_;
  bool built_ = false;
  int64_t size_ = 0;
  int64_t n_sink_ = 0;
  int64_t n_centroids_ = 0;
  int64_t rho_ = 1;
  int64_t n_recall_ = 4;
  int64_t fifo_size_ = 0;
  int64_t next_fifo_ = 0;
  std::vector<float> keys_;                // [size, n_kv_heads, head_dim] for reranking
  std::vector<std::vector<Entry>> heads_;  // [n_kv_heads][C]
  std::vector<int64_t> recalled_;          // scratch
  std::vector<float> logits_;              // scratch
};

}  // namespace

absl::StatusOr<IndexParams> ApplyCtkvrOptions(const IndexParams& params) {
  IndexParams out = params;
  constexpr std::string_view kPrefix = "ctkvr.";
  for (const auto& [name, value] : params.options) {
    if (!name.starts_with(kPrefix)) continue;  // another method's option
    const std::string_view key = std::string_view(name).substr(kPrefix.size());
    KVR_ASSIGN_OR_RETURN(const int v, internal::ParseIntOption(name, value));
    if (v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("option ", name, " must be >= 0 (0: default), got ", value));
    }
    if (key == "n_centroids") {
      out.ctkvr.n_centroids = v;
    } else if (key == "list_length") {
      out.ctkvr.list_length = v;
    } else if (key == "n_recall") {
      out.ctkvr.n_recall = v;
    } else if (key == "fifo_size") {
      out.ctkvr.fifo_size = v;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown option '", name,
                       "'; ctkvr has ctkvr.n_centroids, ctkvr.list_length, ctkvr.n_recall, "
                       "ctkvr.fifo_size"));
    }
  }
  return out;
}

int CtkvrRecall(const IndexParams& params) {
  return params.ctkvr.n_recall > 0 ? static_cast<int>(params.ctkvr.n_recall) : 6;
}

absl::StatusOr<CtkvrState> CtkvrStateOf(const RetrievalIndex& index) {
  KVR_ASSIGN_OR_RETURN(const CtkvrIndex* typed,
                       internal::IndexAs<CtkvrIndex>(index, "CtkvrStateOf", "ctkvr"));
  return typed->State();
}

absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltCtkvr(const IndexShape& shape,
                                                            const IndexParams& params, int64_t size,
                                                            const CtkvrState& state) {
  KVR_ASSIGN_OR_RETURN(IndexParams applied, ApplyCtkvrOptions(params));
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<CtkvrIndex> index,
                       CtkvrIndex::FromState(shape, applied, size, state));
  return SerializeIndex(*index);
}

absl::Status RegisterCtkvr(MethodRegistry& registry) {
  return registry.Register(
      "ctkvr", "CTKVR: last-C prefill queries as centroids, qcIVF lists, recall C' then rerank",
      [](const IndexShape& s,
         const IndexParams& p) -> absl::StatusOr<std::unique_ptr<RetrievalIndex>> {
        KVR_ASSIGN_OR_RETURN(IndexParams params, ApplyCtkvrOptions(p));
        return std::make_unique<CtkvrIndex>(s, params);
      },
      &CtkvrIndex::Read);
}

}  // namespace kvr::retrieval
