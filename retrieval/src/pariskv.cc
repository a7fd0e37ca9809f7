#include "kvr/retrieval/pariskv.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/serialization.h"
#include "method_util.h"
#include "pariskv_codes.h"
#include "srht.h"

namespace kvr::retrieval {
namespace {

using internal::kMagnitudeLevels;
using Levels = std::array<float, kMagnitudeLevels>;

constexpr uint32_t kPayloadVersion = 1;
// Salt mixed into IndexParams::seed so that the rotation differs from other seeded choices
// (k-means initialisations) made from the same seed.
constexpr uint64_t kRotationSalt = 0x50617269734b5631ull;  // "ParisKV1"
constexpr float kMaxFp16 = 65504.f;

// One rotation per (model seed, head_dim): every layer and head of a model shares it, as in the
// paper ("a shared orthogonal rotation R").
uint64_t RotationSeed(uint64_t seed, int head_dim) {
  uint64_t state = seed ^ kRotationSalt ^ (static_cast<uint64_t>(head_dim) << 40);
  return internal::SplitMix64Next(state);
}

absl::StatusOr<double> ParseDouble(absl::string_view name, absl::string_view value) {
  double out = 0;
  const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), out);
  if (ec != std::errc() || ptr != value.data() + value.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("option ", name, ": '", value, "' is not a number"));
  }
  return out;
}

absl::Status CheckTokenTensor(const TokenTensor& t, int n_heads, int head_dim,
                              absl::string_view what) {
  if (t.n_tokens < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative n_tokens"));
  if (t.n_tokens == 0) return absl::OkStatus();
  if (t.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": data is null"));
  if (t.row_stride < static_cast<int64_t>(n_heads) * head_dim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: row_stride %d is smaller than n_heads * head_dim = %d", what,
                        t.row_stride, static_cast<int64_t>(n_heads) * head_dim));
  }
  return absl::OkStatus();
}

class ParisKvIndex final : public internal::KeyEncodingIndex {
 public:
  ParisKvIndex(const IndexShape& shape, const IndexParams& params, const ParisKvOptions& options,
               int subspace_dim, internal::Srht srht, const Levels& levels)
      : KeyEncodingIndex(shape),
        options_(options),
        gqa_(params.gqa),
        pool_(params.pool),
        m_(subspace_dim),
        srht_(std::move(srht)),
        levels_(levels),
        heads_(shape.n_kv_heads) {
    padded_dim_ = srht_.output_dim();
    n_subspaces_ = padded_dim_ / m_;
    n_centroids_ = 1 << m_;
    for (Head& head : heads_)
      head.counts.assign(static_cast<size_t>(n_subspaces_) * n_centroids_, 0);
  }

  std::string_view method() const override { return kParisKvMethodName; }
  // Appended keys are encoded like prefill keys (KeyEncodingIndex): the centroids are
  // data-independent, so nothing learned goes stale (the paper's drift argument).
  absl::Status Select(const SelectRequest& request, Selection* out) override;

  int64_t MemoryBytes() const override {
    int64_t bytes = 0;
    for (const Head& head : heads_) {
      bytes += static_cast<int64_t>(head.codes.size() + head.weights.size() * sizeof(uint16_t) +
                                    head.counts.size() * sizeof(uint32_t));
    }
    return bytes;
  }

  ParisKvState State() const {
    ParisKvState s;
    s.subspace_dim = m_;
    s.padded_dim = padded_dim_;
    s.rotation_seed = srht_.seed();
    s.levels.assign(levels_.begin(), levels_.end());
    for (const Head& h : heads_) s.heads.push_back({h.codes, h.weights, h.counts});
    return s;
  }

  absl::Status SerializePayload(ByteWriter& writer) const override {
    writer.Put<uint32_t>(kPayloadVersion);
    writer.Put<int32_t>(m_);
    writer.Put<int32_t>(padded_dim_);
    writer.Put<uint64_t>(srht_.seed());
    writer.PutArray<float>(levels_);
    for (const Head& head : heads_) {
      writer.PutArray<uint8_t>(head.codes);
      writer.PutArray<uint16_t>(head.weights);
    }
    return absl::OkStatus();
  }

  // Takes codes and weights encoded elsewhere into an empty index, for SerializePrebuiltParisKv
  // only: the per-centroid counts (derived state, not shipped; a reader counts them again as it
  // loads the bytes) are left at zero, which spares a pass over every token at prefill.
  absl::Status SetHeads(int64_t size, std::span<const PrebuiltParisKvHead> heads) {
    if (size_ != 0) return absl::FailedPreconditionError("pariskv: SetHeads on a non-empty index");
    if (size < 0) return absl::InvalidArgumentError(absl::StrCat("prebuilt pariskv: size ", size));
    if (heads.size() != heads_.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "prebuilt pariskv: %d heads, the shape has %d KV heads", heads.size(), heads_.size()));
    }
    const uint64_t code_bytes = static_cast<uint64_t>(size) * (padded_dim_ / 2);
    const uint64_t n_weights = static_cast<uint64_t>(size) * n_subspaces_;
    for (size_t h = 0; h < heads.size(); ++h) {
      if (heads[h].codes.size() != code_bytes || heads[h].weights.size() != n_weights) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "prebuilt pariskv: KV head %d has %d code bytes and %d weights, %d tokens need %d "
            "and %d",
            h, heads[h].codes.size(), heads[h].weights.size(), size, code_bytes, n_weights));
      }
      heads_[h].codes.assign(heads[h].codes.begin(), heads[h].codes.end());
      heads_[h].weights.assign(heads[h].weights.begin(), heads[h].weights.end());
    }
    size_ = size;
    return absl::OkStatus();
  }

  // Restores heads from a payload whose fixed fields the caller has already checked.
  absl::Status LoadHeads(int64_t size, ByteReader& payload) {
    const uint64_t code_bytes = static_cast<uint64_t>(size) * (padded_dim_ / 2);
    const uint64_t n_weights = static_cast<uint64_t>(size) * n_subspaces_;
    for (int h = 0; h < static_cast<int>(heads_.size()); ++h) {
      Head& head = heads_[h];
      KVR_RETURN_IF_ERROR(payload.GetArray("pariskv codes", &head.codes, code_bytes));
      KVR_RETURN_IF_ERROR(payload.GetArray("pariskv weights", &head.weights, n_weights));
      if (head.codes.size() != code_bytes || head.weights.size() != n_weights) {
        return absl::DataLossError(absl::StrFormat(
            "pariskv payload: KV head %d has %d code bytes and %d weights, the header's %d "
            "tokens need %d and %d",
            h, head.codes.size(), head.weights.size(), size, code_bytes, n_weights));
      }
      for (int64_t t = 0; t < size; ++t) CountToken(head, t, +1);
    }
    size_ = size;
    return payload.ExpectEnd("the pariskv payload");
  }

 private:
  struct Head {
    std::vector<uint8_t> codes;     // [n_tokens, padded_dim / 2], two 4-bit codes per byte
    std::vector<uint16_t> weights;  // [n_tokens, n_subspaces], fp16 scale weights w_b
    // [n_subspaces, 2^m] keys per sign-pattern centroid, over all indexed tokens. Derived from
    // the codes (not shipped); the collision stage needs it to place the top-rho cut.
    std::vector<uint32_t> counts;
  };

  const uint8_t* TokenCodes(const Head& head, int64_t t) const {
    return head.codes.data() + t * (padded_dim_ / 2);
  }

  void CountToken(Head& head, int64_t t, int delta) {
    const uint8_t* codes = TokenCodes(head, t);
    for (int b = 0; b < n_subspaces_; ++b) {
      const uint32_t id = internal::CentroidIdFromPacked(codes + b * (m_ / 2), m_);
      head.counts[static_cast<size_t>(b) * n_centroids_ + id] += delta;
    }
  }

  absl::Status Encode(const TokenTensor& keys, absl::string_view what) override;
  // Encodes one key ([head_dim]) into codes ([padded_dim / 2]) and weights ([n_subspaces]).
  void EncodeKey(const float* key, std::span<float> rotated, std::span<uint8_t> nibbles,
                 uint8_t* codes, uint16_t* weights) const;

  ParisKvOptions options_;
  GqaAggregation gqa_;
  ThreadPool* pool_;  // not owned; may be null
  int m_;
  int padded_dim_ = 0;
  int n_subspaces_ = 0;
  int n_centroids_ = 0;
  internal::Srht srht_;
  Levels levels_;
  std::vector<Head> heads_;  // [n_kv_heads]
};

void ParisKvIndex::EncodeKey(const float* key, std::span<float> rotated, std::span<uint8_t> nibbles,
                             uint8_t* codes, uint16_t* weights) const {
  const int d = shape().head_dim;
  const float norm = Norm(key, d);
  // Normalising before or after the (linear) rotation is the same; after saves a pass.
  srht_.Apply(std::span<const float>(key, d), rotated);
  if (norm > 0.f) {
    for (float& v : rotated) v /= norm;
  }
  std::fill(codes, codes + padded_dim_ / 2, 0);
  for (int b = 0; b < n_subspaces_; ++b) {
    std::span<float> sub = rotated.subspan(static_cast<size_t>(b) * m_, m_);
    const float r = Norm(sub.data(), m_);
    float weight = 0.f;
    if (r > 1e-20f) {
      for (float& v : sub) v /= r;
      const float alpha = internal::EncodeDirection(sub, levels_, nibbles);
      // alpha > 0 here (see EncodeDirection); clamp so that fp16 cannot overflow to inf for
      // absurd key norms.
      weight = std::min(norm * r / alpha, kMaxFp16);
    } else {
      // A (numerically) empty subspace contributes nothing; any code will do.
      std::fill(nibbles.begin(), nibbles.end(), 0);
    }
    uint8_t* packed = codes + b * (m_ / 2);
    for (int j = 0; j < m_; ++j) {
      packed[j >> 1] |= static_cast<uint8_t>(nibbles[j] << ((j & 1) * 4));
    }
    weights[b] = FloatToFp16(weight);
  }
}

absl::Status ParisKvIndex::Encode(const TokenTensor& keys, absl::string_view what) {
  const IndexShape& s = shape();
  KVR_RETURN_IF_ERROR(CheckTokenTensor(keys, s.n_kv_heads, s.head_dim, what));
  const int64_t n = keys.n_tokens;
  if (n == 0) return absl::OkStatus();
  const int64_t first = size_;
  internal::ForEachHead(pool_, s.n_kv_heads, [&](int h) {
    Head& head = heads_[h];
    head.codes.resize(static_cast<size_t>(first + n) * (padded_dim_ / 2));
    head.weights.resize(static_cast<size_t>(first + n) * n_subspaces_);
    std::vector<float> rotated(padded_dim_);  // [padded_dim]
    std::vector<uint8_t> nibbles(m_);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = first + i;
      EncodeKey(keys.At(i, h, s.head_dim), rotated, nibbles,
                head.codes.data() + t * (padded_dim_ / 2), head.weights.data() + t * n_subspaces_);
      CountToken(head, t, +1);
    }
  });
  size_ = first + n;
  return absl::OkStatus();
}

absl::Status ParisKvIndex::Select(const SelectRequest& request, Selection* out) {
  const IndexShape& s = shape();
  KVR_ASSIGN_OR_RETURN(const internal::SelectStart start,
                       internal::StartSelect(request, s.n_kv_heads, size_, "pariskv", out));
  if (start.done) return absl::OkStatus();
  const int64_t lo = start.candidates.begin;
  const int64_t hi = start.candidates.end;
  const int64_t n_sel = hi - lo;
  const ParisKvSchedule schedule = ScheduleParisKv(options_, n_sel, request.budget);
  const int group = s.group_size();
  const int d = s.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  // The centroid counts cover every indexed token (sinks and the local window included, a few
  // percent of the context), so the top-rho cut is placed on that population.
  const double rho_keys = schedule.collision_ratio * static_cast<double>(size_);
  const int max_score = group * options_.tiers * n_subspaces_;

  internal::ForEachHead(pool_, s.n_kv_heads, [&](int h) {
    const Head& head = heads_[h];
    // Rotated unit queries of the group and their norms.
    std::vector<float> xq(static_cast<size_t>(group) * padded_dim_);  // [group, padded_dim]
    std::vector<float> qnorm(group);
    std::vector<float> unit(d);
    for (int g = 0; g < group; ++g) {
      const float* q = request.query + static_cast<int64_t>(h * group + g) * d;
      qnorm[g] = Norm(q, d);
      for (int j = 0; j < d; ++j) unit[j] = qnorm[g] > 0.f ? q[j] / qnorm[g] : 0.f;
      srht_.Apply(unit,
                  std::span<float>(xq).subspan(static_cast<size_t>(g) * padded_dim_, padded_dim_));
    }
    // Stage 1: per-subspace bonus tables, summed over the group: [n_subspaces, 2^m].
    std::vector<uint16_t> table(static_cast<size_t>(n_subspaces_) * n_centroids_, 0);
    std::vector<float> centroid_scores(n_centroids_);
    std::vector<uint8_t> bonus(n_centroids_);
    for (int g = 0; g < group; ++g) {
      for (int b = 0; b < n_subspaces_; ++b) {
        std::span<const float> xb(xq.data() + static_cast<size_t>(g) * padded_dim_ + b * m_, m_);
        internal::AllCentroidDots(xb, centroid_scores);
        internal::CollisionBonus(
            centroid_scores,
            std::span<const uint32_t>(head.counts.data() + static_cast<size_t>(b) * n_centroids_,
                                      n_centroids_),
            rho_keys, options_.tiers, bonus);
        for (int c = 0; c < n_centroids_; ++c) {
          table[static_cast<size_t>(b) * n_centroids_ + c] += bonus[c];
        }
      }
    }
    std::vector<uint16_t> score(n_sel);  // [n_sel] collision score
    std::vector<int64_t> histogram(max_score + 1, 0);
    for (int64_t i = 0; i < n_sel; ++i) {
      const uint8_t* codes = TokenCodes(head, lo + i);
      uint32_t total = 0;
      for (int b = 0; b < n_subspaces_; ++b) {
        total += table[static_cast<size_t>(b) * n_centroids_ +
                       internal::CentroidIdFromPacked(codes + b * (m_ / 2), m_)];
      }
      score[i] = static_cast<uint16_t>(total);
      ++histogram[total];
    }
    // Top-C by a counting pass over the small integer range (the paper's bucket_topk): every
    // token above the threshold score, then ties at the threshold in position order.
    int threshold = max_score;
    int64_t above = 0;
    while (threshold > 0 && above + histogram[threshold] < schedule.n_candidates) {
      above += histogram[threshold];
      --threshold;
    }
    int64_t take_at_threshold = schedule.n_candidates - above;
    std::vector<int64_t> candidates;  // offsets into [lo, hi)
    candidates.reserve(schedule.n_candidates);
    for (int64_t i = 0; i < n_sel; ++i) {
      if (score[i] > threshold) {
        candidates.push_back(i);
      } else if (score[i] == threshold && take_at_threshold > 0) {
        candidates.push_back(i);
        --take_at_threshold;
      }
    }
    // Stage 2: rerank with eq. (10). lut[g][p][code] = value(code) * xq[g][p].
    const int n_cand = static_cast<int>(candidates.size());
    std::vector<float> lut(static_cast<size_t>(padded_dim_) * 16);
    std::vector<float> logits(static_cast<size_t>(group) * n_cand);  // [group, n_cand]
    for (int g = 0; g < group; ++g) {
      const float* xg = xq.data() + static_cast<size_t>(g) * padded_dim_;
      for (int p = 0; p < padded_dim_; ++p) {
        for (int code = 0; code < 16; ++code) {
          lut[p * 16 + code] =
              internal::DecodeCoordinate(static_cast<uint8_t>(code), levels_) * xg[p];
        }
      }
      for (int c = 0; c < n_cand; ++c) {
        const int64_t t = lo + candidates[c];
        const uint8_t* codes = TokenCodes(head, t);
        const uint16_t* w = head.weights.data() + t * n_subspaces_;
        float est = 0.f;
        for (int b = 0; b < n_subspaces_; ++b) {
          // Two codes per byte: coordinate p in the low nibble, p + 1 in the high one.
          float dot = 0.f;
          const uint8_t* packed = codes + b * (m_ / 2);
          const float* lut_b = lut.data() + static_cast<size_t>(b) * m_ * 16;
          for (int i = 0; i < m_ / 2; ++i) {
            const uint8_t byte = packed[i];
            dot += lut_b[(2 * i) * 16 + (byte & 0xF)] + lut_b[(2 * i + 1) * 16 + (byte >> 4)];
          }
          est += Fp16ToFloat(w[b]) * dot;
        }
        logits[static_cast<size_t>(g) * n_cand + c] = scale * qnorm[g] * est;
      }
    }
    std::vector<float> agg(n_cand, 0.f);
    switch (gqa_) {
      case GqaAggregation::kSumSoftmax:
        for (int g = 0; g < group; ++g) {
          std::span<float> row(logits.data() + static_cast<size_t>(g) * n_cand, n_cand);
          SoftmaxInPlace(row);
          for (int c = 0; c < n_cand; ++c) agg[c] += row[c];
        }
        break;
      case GqaAggregation::kMaxLogit:
        std::fill(agg.begin(), agg.end(), -INFINITY);
        for (int g = 0; g < group; ++g) {
          for (int c = 0; c < n_cand; ++c) {
            agg[c] = std::max(agg[c], logits[static_cast<size_t>(g) * n_cand + c]);
          }
        }
        break;
      case GqaAggregation::kSumLogit:
        for (int g = 0; g < group; ++g) {
          for (int c = 0; c < n_cand; ++c) agg[c] += logits[static_cast<size_t>(g) * n_cand + c];
        }
        break;
    }
    std::vector<int64_t> top = TopKIndices(agg, request.budget);
    std::vector<int64_t>& ids = out->per_head[h];
    ids.reserve(top.size());
    for (int64_t c : top) ids.push_back(lo + candidates[c]);
    std::sort(ids.begin(), ids.end());
  });
  return absl::OkStatus();
}

absl::StatusOr<std::pair<internal::Srht, Levels>> MakeCodecs(int head_dim, int m, uint64_t seed) {
  KVR_ASSIGN_OR_RETURN(internal::Srht srht, internal::Srht::Create(head_dim, seed));
  if (srht.output_dim() % m != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pariskv: subspace_dim %d does not divide the rotated dimension %d (head_dim %d)", m,
        srht.output_dim(), head_dim));
  }
  KVR_ASSIGN_OR_RETURN(Levels levels, internal::DirectionLevels(m));
  return std::make_pair(std::move(srht), levels);
}

}  // namespace

absl::StatusOr<ParisKvOptions> ParseParisKvOptions(const IndexParams& params) {
  ParisKvOptions o;
  constexpr std::string_view kPrefix = "pariskv.";
  constexpr std::string_view kValid =
      "pariskv.subspace_dim, pariskv.tiers, pariskv.candidate_ratio, pariskv.collision_ratio, "
      "pariskv.min_candidates_per_budget";
  for (const auto& [name, value] : params.options) {
    if (!name.starts_with(kPrefix)) continue;  // another method's option
    const std::string_view key = std::string_view(name).substr(kPrefix.size());
    if (key == "subspace_dim") {
      KVR_ASSIGN_OR_RETURN(o.subspace_dim, internal::ParseIntOption(name, value));
      if (o.subspace_dim != 2 && o.subspace_dim != 4 && o.subspace_dim != 8) {
        return absl::InvalidArgumentError(
            absl::StrCat("option pariskv.subspace_dim must be 2, 4 or 8, got ", value));
      }
    } else if (key == "tiers") {
      KVR_ASSIGN_OR_RETURN(o.tiers, internal::ParseIntOption(name, value));
      if (o.tiers < 1 || o.tiers > 32) {
        return absl::InvalidArgumentError(
            absl::StrCat("option pariskv.tiers must be in [1, 32], got ", value));
      }
    } else if (key == "candidate_ratio" || key == "collision_ratio") {
      KVR_ASSIGN_OR_RETURN(double r, ParseDouble(name, value));
      if (!(r > 0 && r <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("option ", name, " must be in (0, 1], got ", value));
      }
      (key == "candidate_ratio" ? o.candidate_ratio : o.collision_ratio) = r;
    } else if (key == "min_candidates_per_budget") {
      KVR_ASSIGN_OR_RETURN(o.min_candidates_per_budget, internal::ParseIntOption(name, value));
      if (o.min_candidates_per_budget < 1 || o.min_candidates_per_budget > 1000) {
        return absl::InvalidArgumentError(absl::StrCat(
            "option pariskv.min_candidates_per_budget must be in [1, 1000], got ", value));
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown option '", name,
                       "'; valid options: ", absl::string_view(kValid.data(), kValid.size())));
    }
  }
  return o;
}

ParisKvSchedule ScheduleParisKv(const ParisKvOptions& options, int64_t n_selectable,
                                int64_t budget) {
  ParisKvSchedule s;
  if (n_selectable <= 0) return s;
  double beta = options.candidate_ratio;
  if (beta <= 0) {
    constexpr double kShort = 16384, kLong = 131072;
    const double n = static_cast<double>(n_selectable);
    if (n <= kShort) {
      beta = 0.10;
    } else if (n >= kLong) {
      beta = 0.05;
    } else {
      beta = 0.10 - 0.05 * std::log(n / kShort) / std::log(kLong / kShort);
    }
  }
  const int64_t by_ratio = static_cast<int64_t>(std::ceil(beta * n_selectable));
  const int64_t by_budget = budget * options.min_candidates_per_budget;
  s.n_candidates = std::min(n_selectable, std::max({by_ratio, by_budget, budget}));
  const double effective_beta = static_cast<double>(s.n_candidates) / n_selectable;
  // With T > 1 tiers each tier covers about beta * n keys, so rho = T * beta lets the lowest tier
  // still separate "near" from "far" keys; with plain counting (T = 1) a wide rho would give
  // every key the same vote, so rho = 2 beta. Measured on clustered synthetic keys (8K tokens,
  // budgets 64/256, tests' generator): 6 tiers with rho = 0.6 beat rho = 0.1-0.3 by 2-8 recall
  // points and beat 1 tier at any rho; rho 0.6-1.0 were within 1 point of each other.
  const double rho = options.tiers > 1 ? options.tiers * effective_beta : 2 * effective_beta;
  s.collision_ratio = options.collision_ratio > 0 ? options.collision_ratio : std::min(1.0, rho);
  return s;
}

absl::StatusOr<std::unique_ptr<RetrievalIndex>> MakeParisKvIndex(const IndexShape& shape,
                                                                 const IndexParams& params) {
  KVR_RETURN_IF_ERROR(shape.Validate());
  KVR_ASSIGN_OR_RETURN(ParisKvOptions options, ParseParisKvOptions(params));
  const int m = std::min(options.subspace_dim, internal::NextPowerOfTwo(shape.head_dim));
  if (m < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("pariskv needs head_dim >= 2, got ", shape.head_dim));
  }
  KVR_ASSIGN_OR_RETURN(auto codecs,
                       MakeCodecs(shape.head_dim, m, RotationSeed(params.seed, shape.head_dim)));
  return std::make_unique<ParisKvIndex>(shape, params, options, m, std::move(codecs.first),
                                        codecs.second);
}

absl::StatusOr<std::unique_ptr<RetrievalIndex>> DeserializeParisKvIndex(const IndexShape& shape,
                                                                        const IndexParams& params,
                                                                        int64_t size,
                                                                        ByteReader& payload) {
  KVR_RETURN_IF_ERROR(shape.Validate());
  // Encoding parameters (m, rotation, levels) come from the bytes: they describe the codes.
  // Selection knobs (tiers, ratios) come from the receiver's params.
  KVR_ASSIGN_OR_RETURN(ParisKvOptions options, ParseParisKvOptions(params));
  uint32_t version = 0;
  int32_t m = 0, padded_dim = 0;
  uint64_t seed = 0;
  std::vector<float> levels;
  KVR_RETURN_IF_ERROR(payload.Get("pariskv payload version", &version));
  if (version != kPayloadVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pariskv payload version %d is not supported (this build reads %d)",
                        version, kPayloadVersion));
  }
  KVR_RETURN_IF_ERROR(payload.Get("pariskv subspace_dim", &m));
  KVR_RETURN_IF_ERROR(payload.Get("pariskv padded_dim", &padded_dim));
  KVR_RETURN_IF_ERROR(payload.Get("pariskv rotation seed", &seed));
  KVR_RETURN_IF_ERROR(payload.GetArray("pariskv levels", &levels, kMagnitudeLevels));
  if (size < 0) {
    return absl::DataLossError(absl::StrCat("pariskv payload: negative size ", size));
  }
  if (m != 2 && m != 4 && m != 8) {
    return absl::DataLossError(absl::StrCat("pariskv payload: subspace_dim ", m, " is invalid"));
  }
  if (padded_dim != internal::NextPowerOfTwo(shape.head_dim)) {
    return absl::DataLossError(
        absl::StrFormat("pariskv payload: rotated dimension %d does not match head_dim %d",
                        padded_dim, shape.head_dim));
  }
  if (levels.size() != static_cast<size_t>(kMagnitudeLevels)) {
    return absl::DataLossError(absl::StrFormat("pariskv payload: %d magnitude levels, need %d",
                                               levels.size(), kMagnitudeLevels));
  }
  Levels level_array{};
  for (int l = 0; l < kMagnitudeLevels; ++l) {
    if (!(levels[l] > 0.f && levels[l] <= 1.f) || (l > 0 && levels[l] <= levels[l - 1])) {
      return absl::DataLossError(
          "pariskv payload: magnitude levels must be increasing and in (0, 1]");
    }
    level_array[l] = levels[l];
  }
  KVR_ASSIGN_OR_RETURN(auto codecs, MakeCodecs(shape.head_dim, m, seed));
  auto index = std::make_unique<ParisKvIndex>(shape, params, options, m, std::move(codecs.first),
                                              level_array);
  KVR_RETURN_IF_ERROR(index->LoadHeads(size, payload));
  return index;
}

absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltParisKv(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const PrebuiltParisKvHead> heads) {
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<RetrievalIndex> index, MakeParisKvIndex(shape, params));
  KVR_RETURN_IF_ERROR(static_cast<ParisKvIndex&>(*index).SetHeads(size, heads));
  return SerializeIndex(*index);
}

absl::StatusOr<ParisKvState> ParisKvStateOf(const RetrievalIndex& index) {
  KVR_ASSIGN_OR_RETURN(const ParisKvIndex* typed,
                       internal::IndexAs<ParisKvIndex>(index, "ParisKvStateOf", "pariskv"));
  return typed->State();
}

}  // namespace kvr::retrieval
