// Rows of the GPU selectors (selection.cuh) against the CPU references:
//  - BatchedTopK against kvr::retrieval::TopKIndices (identical sets: the scores are the same
//    floats, ties go to the lower index on both), including heavy ties and NaN scores;
//  - ExactSelect against the registry's `exact` index (baselines.cc) on the same key values
//    (keys rounded to the GPU dtype first), swept over dtypes, head_dim, GQA group, aggregation,
//    budgets and per-sequence candidate ranges. GPU and CPU sum in different orders, so sets may
//    differ only by tokens whose reference score is within a tolerance of the k-th score;
//  - QuestSelect / ClusterKvSelect against the `quest` / `clusterkv` indexes: identical counts,
//    identical sets on >= 90% of the rows, >= 0.97 token overlap; per-row budgets;
//  - ExactSelect over paged keys against the same keys read contiguously (identical output).
// Outputs are poisoned before each launch; every output id is checked (range, ascending,
// distinct, -1 padding).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/common/half.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/registry.h"
#include "parity.h"
#include "select_sweep.h"

namespace kvr::gpu_parity {
namespace {

using namespace kvr::retrieval;
using namespace kvr::retrieval::cuda;
using namespace kvr::cuda::testing;
using kvr::cuda::DeviceBuffer;

std::string S(int64_t v) { return std::to_string(v); }

// ExactSelect's rows name the key dtype too.
std::string Name(const SelectCase& c) {
  return std::string(c.dtype == KeyDType::kF32   ? "f32"
                     : c.dtype == KeyDType::kF16 ? "f16"
                                                 : "bf16") +
         "_" + ShapeName(c);
}

// ---- BatchedTopK ------------------------------------------------------------------------------

// ties 0: random floats with NaN every 97th; 1: 5 distinct values; 2: all equal. short_rows: rows
// of at most 4096 scores (a row stride of 4096, 4095 at budget 255), which take smaller CTAs.
void TopKRow(int budget, int ties, bool short_rows = false) {
  std::mt19937 rng(7 + 3 * budget + ties);
  const std::vector<int> lengths = short_rows
                                       ? std::vector<int>{0, 1, 5, 1000, 1024, 1025, 2047, 4095}
                                       : std::vector<int>{0, 1, 5, 1000, 1024, 1025, 4097, 70000};
  const int rows = static_cast<int>(lengths.size());
  // An odd row stride exercises the unaligned (scalar load) path.
  const int64_t stride =
      short_rows ? (budget == 255 ? 4095 : 4096) : (budget == 255 ? 70001 : 70000);
  std::vector<float> scores(rows * stride, 0.f);
  std::vector<int32_t> n_valid(rows), offset(rows);
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  for (int r = 0; r < rows; ++r) {
    n_valid[r] = lengths[r];
    offset[r] = 100 * r;
    for (int i = 0; i < lengths[r]; ++i) {
      float v = ties == 0 ? u(rng) : ties == 1 ? static_cast<float>(rng() % 5) : 1.f;
      if (ties == 0 && i % 97 == 13) v = std::nanf("");
      scores[r * stride + i] = v;
    }
  }
  auto d_scores = Upload(scores);
  auto d_n = Upload(n_valid);
  auto d_off = Upload(offset);
  auto ids = Poisoned<int32_t>(rows * budget, kPoisonByte);
  auto counts = Poisoned<int32_t>(rows, kPoisonByte);
  TopKParams p;
  p.rows = rows;
  p.row_stride = stride;
  p.scores = d_scores.data();
  p.n_valid = d_n.data();
  p.id_offset = d_off.data();
  p.out = {budget, ids.data(), counts.data()};
  // Two-stage path (segments of 16K) with scratch, except budget 16: one CTA per row.
  DeviceBuffer<char> scratch;
  if (budget != 16) {
    scratch = Scratch(BatchedTopKWorkspaceBytes(p), kPoisonByte);
    p.workspace = scratch.data();
    p.workspace_bytes = scratch.bytes();
  }
  ASSERT_OK(BatchedTopK(p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto h_ids = Download(ids, rows * budget);
  const auto h_counts = Download(counts, rows);
  int differ = 0;
  for (int r = 0; r < rows; ++r) {
    const std::string where = "budget " + S(budget) + " ties " + S(ties) + " len " + S(lengths[r]) +
                              (short_rows ? " (short rows)" : "");
    // CPU: NaN scores are never chosen, so rank only the finite ones.
    std::vector<float> finite;
    std::vector<int64_t> index;
    for (int i = 0; i < lengths[r]; ++i) {
      const float v = scores[r * stride + i];
      if (!std::isnan(v)) {
        finite.push_back(v);
        index.push_back(i);
      }
    }
    std::vector<int64_t> expect;
    for (int64_t j : TopKIndices(finite, budget)) expect.push_back(offset[r] + index[j]);
    std::sort(expect.begin(), expect.end());
    ASSERT_NE(h_counts[r], kPoison) << where;
    const auto got = CheckIdRow(h_ids.data() + r * budget, h_counts[r], budget, offset[r],
                                offset[r] + lengths[r], where);
    EXPECT_EQ(got, expect) << where;
    differ += got != expect;
  }
  RecordMeasure("rows != TopKIndices", differ, "0", differ == 0);
}

// ---- ExactSelect ------------------------------------------------------------------------------

uint16_t ToHalfBits(float f, KeyDType t) {
  return t == KeyDType::kBf16 ? FloatToBf16(f) : FloatToFp16(f);
}
float FromHalfBits(uint16_t h, KeyDType t) {
  return t == KeyDType::kBf16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

// Every differing token of one row (in either set only) must be a near-tie of the k-th
// reference score (double) within a tolerance: fp32 summation order resolves those differently.
// Returns the differing tokens; adds those that are no near-tie to `far_tokens`.
int NearTieDiff(const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                const std::vector<double>& agg, int64_t first, const std::string& where,
                int64_t* far_tokens) {
  std::vector<double> sorted(agg);
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  const double kth = sorted[got.size() - 1];
  const double tol = 1e-4 * std::max(std::abs(sorted[0]), 1e-30) + 1e-6 * std::abs(kth);
  std::set<int64_t> a(got.begin(), got.end()), w(want.begin(), want.end());
  int diff = 0;
  for (int64_t t : a)
    if (!w.count(t)) {
      ++diff;
      EXPECT_NEAR(agg[t - first], kth, tol) << where << " extra token " << t;
      *far_tokens += std::abs(agg[t - first] - kth) > tol;
    }
  for (int64_t t : w) {
    if (!a.count(t)) {
      EXPECT_NEAR(agg[t - first], kth, tol) << where << " missing " << t;
      *far_tokens += std::abs(agg[t - first] - kth) > tol;
    }
  }
  return diff;
}

// GQA-aggregated reference scores (double) of candidates [first, first + n) of KV head h:
// `key(i)` is candidate i's key, q the group's first query head.
std::vector<double> AggregatedScores(const float* q, int n, int group, int hd, double scale,
                                     GqaAggregation gqa,
                                     const std::function<const float*(int)>& key) {
  std::vector<double> logit(static_cast<size_t>(group) * n), agg(n, 0.0);
  for (int g = 0; g < group; ++g) {
    const float* qg = q + static_cast<size_t>(g) * hd;
    double mx = -1e300;
    for (int i = 0; i < n; ++i) {
      const float* k = key(i);
      double s = 0;
      for (int d = 0; d < hd; ++d) s += static_cast<double>(qg[d]) * k[d];
      logit[g * n + i] = s * scale;
      mx = std::max(mx, s * scale);
    }
    double z = 0;
    for (int i = 0; i < n; ++i) z += std::exp(logit[g * n + i] - mx);
    for (int i = 0; i < n; ++i) {
      const double l = logit[g * n + i];
      if (gqa == GqaAggregation::kSumSoftmax) {
        agg[i] += std::exp(l - mx) / z;
      } else if (gqa == GqaAggregation::kMaxLogit) {
        agg[i] = g == 0 ? l : std::max(agg[i], l);
      } else {
        agg[i] += l;
      }
    }
  }
  return agg;
}

void ExactRow(const SelectCase& c) {
  const int hd = c.hd, nkv = c.nkv, nh = c.nh, group = nh / nkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  // Sequences of different lengths and candidate windows (sink 16, local window 64).
  const std::vector<int> ctx = {40, 3000, 20000};
  const int batch = static_cast<int>(ctx.size());
  const int max_ctx = *std::max_element(ctx.begin(), ctx.end());
  std::mt19937 rng(11 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  // Keys packed [batch, n_kv_heads, max_ctx, hd] (head-major: exercises the stride view), with
  // topic structure so that scores have a spread like real keys.
  std::vector<float> topics(32 * hd);
  for (float& x : topics) x = nd(rng);
  const size_t n_keys = static_cast<size_t>(batch) * nkv * max_ctx * hd;
  std::vector<float> keys(n_keys, 0.f);
  auto key_at = [&](int b, int h, int t) {
    return &keys[((static_cast<size_t>(b) * nkv + h) * max_ctx + t) * hd];
  };
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < nkv; ++h)
      for (int t = 0; t < ctx[b]; ++t) {
        const int topic = (t / 40 + h * 7) % 32;
        for (int d = 0; d < hd; ++d) {
          const float v = topics[topic * hd + d] + 0.7f * nd(rng);
          // The values the GPU sees.
          key_at(b, h, t)[d] =
              c.dtype == KeyDType::kF32 ? v : FromHalfBits(ToHalfBits(v, c.dtype), c.dtype);
        }
      }
  const std::vector<float> query = Normal(static_cast<size_t>(batch) * nh * hd, 1.5f, nd, rng);
  const Candidates cand = CandidatesOf(ctx, 16, 64);
  DeviceBuffer<float> d_keys_f;
  DeviceBuffer<uint16_t> d_keys_h;
  const void* key_ptr = nullptr;
  if (c.dtype == KeyDType::kF32) {
    d_keys_f = Upload(keys);
    key_ptr = d_keys_f.data();
  } else {
    std::vector<uint16_t> bits(n_keys);
    for (size_t i = 0; i < n_keys; ++i) bits[i] = ToHalfBits(keys[i], c.dtype);
    d_keys_h = Upload(bits);
    key_ptr = d_keys_h.data();
  }
  const DeviceInputs in = UploadInputs(query, cand);
  // CPU references on the same key values, token-major as the index expects.
  IndexParams params;
  params.gqa = c.gqa;
  CpuIndexes cpu;
  BuildCpuIndexes(
      "exact", ShapeOf(nh, nkv, hd), params, ctx, 0,
      [&](int b) {
        std::vector<float> tok(static_cast<size_t>(ctx[b]) * nkv * hd);
        for (int t = 0; t < ctx[b]; ++t)
          for (int h = 0; h < nkv; ++h)
            std::memcpy(&tok[(static_cast<size_t>(t) * nkv + h) * hd], key_at(b, h, t),
                        hd * sizeof(float));
        return tok;
      },
      nullptr, &cpu);
  if (::testing::Test::HasFatalFailure()) return;
  auto launch = Launcher<ExactSelectParams>(
      c, batch, in,
      [&](ExactSelectParams& p) {
        p.keys.data = key_ptr;
        p.keys.dtype = c.dtype;
        p.keys.token_stride = hd;
        p.keys.head_stride = static_cast<int64_t>(max_ctx) * hd;
        p.keys.batch_stride = static_cast<int64_t>(nkv) * max_ctx * hd;
      },
      ExactSelectWorkspaceBytes, ExactSelect);

  for (int budget : {1, 100, 1024, 2048}) {
    Selected out;
    launch(budget, nullptr, &out);
    if (::testing::Test::HasFatalFailure()) return;
    // The set differences of this budget: tokens in either set only, those of them that are no
    // near-tie of the k-th score, and rows with more than max(1, k / 100) of them.
    int64_t diff_tokens = 0, far_tokens = 0, rows_over = 0;
    for (int b = 0; b < batch; ++b) {
      SelectRequest req;
      req.query = query.data() + static_cast<size_t>(b) * nh * hd;
      req.budget = budget;
      req.n_sink = cand.begin[b];
      req.local_begin = cand.end[b];
      Selection sel;
      ASSERT_OK(cpu.owned[b]->Select(req, &sel));
      for (int h = 0; h < nkv; ++h) {
        const std::string where =
            Name(c) + " budget " + S(budget) + " seq " + S(b) + " head " + S(h);
        const int row = b * nkv + h;
        ASSERT_NE(out.counts[row], kPoison) << where;
        const auto got = CheckIdRow(out.ids.data() + static_cast<size_t>(row) * budget,
                                    out.counts[row], budget, cand.begin[b], cand.end[b], where);
        const auto& want = sel.per_head[h];
        ASSERT_EQ(got.size(), want.size()) << where;
        if (got == want) continue;
        const std::vector<double> agg =
            AggregatedScores(query.data() + (static_cast<size_t>(b) * nh + h * group) * hd,
                             cand.end[b] - cand.begin[b], group, hd, scale, c.gqa,
                             [&](int i) { return key_at(b, h, cand.begin[b] + i); });
        const int diff = NearTieDiff(got, want, agg, cand.begin[b], where, &far_tokens);
        const int max_diff = std::max<int>(1, static_cast<int>(got.size() / 100));
        EXPECT_LE(diff, max_diff) << where;
        diff_tokens += diff;
        rows_over += diff > max_diff;
      }
    }
    const std::string k = "k=" + S(budget) + ": ";
    RecordMeasure(k + "tokens off the CPU set", static_cast<double>(diff_tokens), "near-ties",
                  far_tokens == 0);
    RecordMeasure(k + "differing tokens not near-ties", static_cast<double>(far_tokens), "0",
                  far_tokens == 0);
    RecordMeasure(k + "rows with > max(1,k/100) differing", static_cast<double>(rows_over), "0",
                  rows_over == 0);
  }
}

// ---- QuestSelect / ClusterKvSelect ------------------------------------------------------------

// The bar of quest and clusterkv: identical sets on >= 90% of the rows, token overlap >= 0.97.
const AgreementBar kPageBar{"token overlap", 0.97};
// bf16 centroids against the CPU's fp32 ones: rounding moves a score by up to 2^-9 of it, so the
// cluster trimmed at the budget's edge may differ on more rows (measured on the H200: 7 of 9 and
// 20 of 24 rows identical at k=1024) while the tokens barely move (overlap >= 0.997 measured):
// the overlap bar is tighter, the identical-row bar looser.
const AgreementBar kRoundedCentroidBar{"token overlap", 0.99, 7};
const std::vector<int> kPageBudgets = {1, 40, 256, 1024};

// bf16 bounds (the sparse decode's) against the CPU's fp32 ones: each min rounded down and each
// max up to bf16 widens a page's bound by up to 2^-8 of its terms, so pages near the budget's
// edge may swap on more rows while the tokens barely move: as for bf16 centroids.
const AgreementBar kRoundedBoundsBar{"token overlap", 0.99, 7};

// One bound rounded outward to bf16: down for a min, up for a max (what __float2bfloat16_rd /
// _ru do on the GPU).
uint16_t Bf16Outward(float x, bool up) {
  uint16_t b = FloatToBf16(x);
  const float f = Bf16ToFloat(b);
  if (up ? f >= x : f <= x) return b;
  const bool negative = (b & 0x8000u) != 0;
  if ((b & 0x7fffu) == 0) return up ? uint16_t{0x0001} : uint16_t{0x8001};  // +-0 -> +-min
  return static_cast<uint16_t>(up != negative ? b + 1 : b - 1);             // one ulp outward
}

// quest: the CPU QuestIndex on the same keys; the GPU gets the same page bounds (min / max are
// exact in any order), in fp32, or rounded outward to bf16 when c.dtype is kBf16. Page bounds
// are sums in a different order on each side, so a near-tie between two pages may resolve
// differently: require identical counts, identical sets on nearly every row and >= 0.97 token
// overlap overall (bf16 bounds: kRoundedBoundsBar).
void QuestRow(const SelectCase& c) {
  const int hd = c.hd, nh = c.nh, nkv = c.nkv, group = nh / nkv, ps = 16;
  const std::vector<int> ctx = {30, 2000, 9000};
  const int batch = static_cast<int>(ctx.size());
  const int max_ctx = 9000;
  const int max_pages = (max_ctx + ps - 1) / ps;
  std::mt19937 rng(5 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::vector<float> topics = Normal(32 * hd, 1.f, nd, rng);
  const int64_t page_floats = static_cast<int64_t>(nkv) * 2 * hd;
  const int64_t batch_stride = max_pages * page_floats;
  std::vector<float> bounds(batch * batch_stride, 0.f);
  std::vector<std::vector<float>> keys(batch);  // [ctx, nkv, hd] token-major per sequence
  for (int b = 0; b < batch; ++b) {
    keys[b] = TopicKeysFrom(topics, ctx[b], nkv, hd, b, nd, rng);
    for (int t = 0; t < ctx[b]; ++t)
      for (int h = 0; h < nkv; ++h) {
        const float* k = &keys[b][(static_cast<size_t>(t) * nkv + h) * hd];
        float* mn = &bounds[b * batch_stride + (t / ps) * page_floats + h * 2 * hd];
        const bool fresh = t % ps == 0;
        for (int d = 0; d < hd; ++d) {
          mn[d] = fresh ? k[d] : std::min(mn[d], k[d]);
          mn[hd + d] = fresh ? k[d] : std::max(mn[hd + d], k[d]);
        }
      }
  }
  const std::vector<float> query = Normal(static_cast<size_t>(batch) * nh * hd, 1.5f, nd, rng);
  const Candidates cand = CandidatesOf(ctx, 16, 64 - 3);  // not page-aligned on purpose
  const bool bf16 = c.dtype == KeyDType::kBf16;
  std::vector<uint16_t> bounds_bf16;
  if (bf16) {
    bounds_bf16.resize(bounds.size());
    for (size_t i = 0; i < bounds.size(); ++i) {
      const bool max_half = (i % (2 * hd)) >= static_cast<size_t>(hd);
      const uint16_t b = Bf16Outward(bounds[i], max_half);
      const float f = Bf16ToFloat(b);
      ASSERT_TRUE(max_half ? f >= bounds[i] : f <= bounds[i]) << "bound " << i;
      bounds_bf16[i] = b;
    }
  }
  auto d_bounds = Upload(bounds);
  auto d_bounds_bf16 = Upload(bf16 ? bounds_bf16 : std::vector<uint16_t>(1));
  const DeviceInputs in = UploadInputs(query, cand);
  IndexParams params;
  params.gqa = c.gqa;
  params.quest.page_size = ps;
  CpuIndexes cpu;
  BuildCpuIndexes(
      "quest", ShapeOf(nh, nkv, hd), params, ctx, 0, [&](int b) { return keys[b]; }, nullptr, &cpu);
  if (::testing::Test::HasFatalFailure()) return;
  auto launch = Launcher<QuestSelectParams>(
      c, batch, in,
      [&](QuestSelectParams& p) {
        p.page_size = ps;
        p.bounds = bf16 ? static_cast<const void*>(d_bounds_bf16.data()) : d_bounds.data();
        p.bounds_dtype = bf16 ? KeyDType::kBf16 : KeyDType::kF32;
        p.bounds_batch_stride = batch_stride;
      },
      QuestSelectWorkspaceBytes, QuestSelect);
  SelectSweep sweep = SweepOf("quest d" + S(hd) + " group " + S(group) + (bf16 ? " bf16" : ""), c,
                              query, cand, kPageBudgets, bf16 ? kRoundedBoundsBar : kPageBar);
  sweep.row_budgets = {40, 1, 256};
  sweep.wide = 1024;
  RunSelectSweep(sweep, launch, SelectOn(cpu));
}

// clusterkv: the CPU ClusterKvIndex (prefill clusters + appended pending tokens) and the GPU
// selector on its layout (ClusterKvLayoutFromIndexes). Scores are sums in another order on the
// GPU, so near-tied clusters may swap: identical counts, identical sets on nearly every row and
// >= 0.97 token overlap overall. first_pick: ClusterKvSelectParams::first_pick (4: almost every
// row is ranked a second time; 0: the default, most rows once).
void ClusterKvRow(const SelectCase& c, int first_pick) {
  const int hd = c.hd, nh = c.nh, nkv = c.nkv;
  const std::vector<int> ctx = {600, 4000, 9000};
  const int n_append = 50;
  const int batch = static_cast<int>(ctx.size());
  std::mt19937 rng(9 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::vector<float> topics = Normal(32 * hd, 1.f, nd, rng);
  IndexParams params;
  params.gqa = c.gqa;
  params.n_sink = 16;
  CpuIndexes cpu;
  BuildCpuIndexes(
      "clusterkv", ShapeOf(nh, nkv, hd), params, ctx, n_append,
      [&](int b) { return TopicKeysFrom(topics, ctx[b] + n_append, nkv, hd, b, nd, rng); }, nullptr,
      &cpu);
  if (::testing::Test::HasFatalFailure()) return;
  auto layout = ClusterKvLayoutFromIndexes(cpu.views);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<float> query = Normal(static_cast<size_t>(batch) * nh * hd, 1.5f, nd, rng);
  std::vector<int> n(ctx);
  for (int& x : n) x += n_append;  // part of the pending tokens are in the local window
  const Candidates cand = CandidatesOf(n, 16, 30);
  const DeviceInputs in = UploadInputs(query, cand);
  // c.dtype is the centroids' on the GPU: kBf16 rounds the CPU index's fp32 centroids, as the
  // sparse decode keeps them; the CPU side keeps its own, so the bar also covers the rounding.
  const bool bf16 = c.dtype == KeyDType::kBf16;
  std::vector<uint16_t> cent_bf16;
  if (bf16) {
    for (const float x : layout->centroids) cent_bf16.push_back(FloatToBf16(x));
  }
  auto d_cent = Upload(layout->centroids);
  auto d_cent_bf16 = Upload(bf16 ? cent_bf16 : std::vector<uint16_t>{0});
  auto d_nc = Upload(layout->n_clusters);
  auto d_off = Upload(layout->offsets);
  auto d_mem = Upload(layout->members);
  auto launcher = [&](int pick) {
    return Launcher<ClusterKvSelectParams>(
        c, batch, in,
        [&, pick](ClusterKvSelectParams& p) {
          p.centroids = bf16 ? static_cast<const void*>(d_cent_bf16.data()) : d_cent.data();
          p.centroid_dtype = bf16 ? KeyDType::kBf16 : KeyDType::kF32;
          p.n_clusters = d_nc.data();
          p.offsets = d_off.data();
          p.members = d_mem.data();
          p.max_clusters = layout->max_clusters;
          p.max_members = layout->max_members;
          p.first_pick = pick;
        },
        ClusterKvSelectWorkspaceBytes, ClusterKvSelect);
  };
  auto launch = launcher(first_pick);
  if (first_pick > 0) {
    // The two passes select what one ranking of budget + 256 clusters selects, bit for bit,
    // with per-row budgets of 0 and rows whose candidates are fewer than the budget among them.
    auto one_pass = launcher(1 << 30);
    auto row_budgets = Upload(std::vector<int32_t>{0, 40, 1024});
    int differing = 0;
    for (const int budget : kPageBudgets) {
      for (const int32_t* rb : {static_cast<const int32_t*>(nullptr),
                                static_cast<const int32_t*>(row_budgets.data())}) {
        Selected two, one;
        launch(budget, rb, &two);
        one_pass(budget, rb, &one);
        differing += two.ids != one.ids || two.counts != one.counts;
      }
    }
    RecordMeasure("launches != one full ranking", differing, "0", differing == 0);
  }
  SelectSweep sweep =
      SweepOf("clusterkv d" + S(hd) + (bf16 ? " bf16" : "") + " first pick " + S(first_pick), c,
              query, cand, kPageBudgets, bf16 ? kRoundedCentroidBar : kPageBar);
  sweep.row_budgets = {256, 40, 1};
  sweep.wide = 1024;
  RunSelectSweep(sweep, launch, SelectOn(cpu));
}

// ---- ExactSelect over paged keys --------------------------------------------------------------

// ExactSelect over PAGED keys (the KV store's pages as the decode node reads them: [K | V] bf16
// rows in pages of 64 rows, the pages of every (sequence, KV head) scattered over one pool in a
// shuffled order) gives exactly the selection of the same keys read contiguously: the same
// values summed in the same order.
void ExactPagedRow() {
  const int batch = 2, nkv = 2, nh = 8, hd = 128, ctx = 3000, page_rows = 64;
  const int pages_per_head = (ctx + page_rows - 1) / page_rows;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> keys(static_cast<size_t>(batch) * nkv * ctx * hd);
  for (uint16_t& k : keys) k = FloatToBf16(nd(rng));
  const std::vector<float> query = Normal(static_cast<size_t>(batch) * nh * hd, 1.f, nd, rng);
  // The pool: page i at i * page_bytes; (b, h)'s pages drawn from a shuffled order.
  const int64_t row_elems = 2 * hd, page_elems = int64_t{page_rows} * row_elems;
  const int n_pages = batch * nkv * pages_per_head;
  std::vector<int32_t> order(n_pages);
  for (int i = 0; i < n_pages; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<uint16_t> pool(static_cast<size_t>(n_pages) * page_elems, FloatToBf16(7.f));
  std::vector<int32_t> pages(n_pages);
  for (int bh = 0; bh < batch * nkv; ++bh) {
    for (int p = 0; p < pages_per_head; ++p) {
      const int32_t page = order[bh * pages_per_head + p];
      pages[bh * pages_per_head + p] = page;
      for (int r = 0; r < page_rows && p * page_rows + r < ctx; ++r) {
        std::memcpy(&pool[page * page_elems + r * row_elems],
                    &keys[(static_cast<size_t>(bh) * ctx + p * page_rows + r) * hd],
                    hd * sizeof(uint16_t));
      }
    }
  }
  auto d_keys = Upload(keys);
  auto d_pool = Upload(pool);
  auto d_pages = Upload(pages);
  std::vector<kvr::cuda::KvPoolSlot> slots(batch, {d_pool.data(), page_elems * 2, page_rows, 0});
  auto d_slots = Upload(slots);
  const DeviceInputs in = UploadInputs(query, {.begin = {16, 16}, .end = {ctx - 64, ctx - 500}});
  const int budget = 256;
  Selected out[2];
  for (int paged = 0; paged < 2; ++paged) {
    ExactSelectParams p = CommonParams<ExactSelectParams>(
        {KeyDType::kBf16, hd, nh, nkv, GqaAggregation::kSumSoftmax}, batch, in);
    p.keys.dtype = KeyDType::kBf16;
    if (paged == 1) {
      p.keys.pool = {d_slots.data(), d_pages.data(), pages_per_head, nkv};
      p.keys.row_bytes = row_elems * 2;
    } else {
      p.keys.data = d_keys.data();
      p.keys.token_stride = hd;
      p.keys.head_stride = int64_t{ctx} * hd;
      p.keys.batch_stride = int64_t{nkv} * ctx * hd;
    }
    p.max_candidates = ctx;
    LaunchSelector(p, budget, batch * nkv, ExactSelectWorkspaceBytes, ExactSelect, &out[paged]);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_EQ(out[1].counts, out[0].counts);
  EXPECT_EQ(out[1].ids, out[0].ids);
  EXPECT_EQ(out[0].counts[0], budget);
  int64_t differ = 0;
  for (size_t i = 0; i < out[0].ids.size(); ++i) differ += out[1].ids[i] != out[0].ids[i];
  for (size_t i = 0; i < out[0].counts.size(); ++i) {
    differ += out[1].counts[i] != out[0].counts[i];
  }
  RecordMeasure("ids and counts != contiguous", static_cast<double>(differ), "0", differ == 0);
  // A paged view that does not fit the shape is refused.
  ExactSelectParams bad;
  bad.batch = batch;
  bad.n_heads = nh;
  bad.n_kv_heads = nkv;
  bad.head_dim = hd;
  bad.out.budget = budget;
  bad.keys.pool = {d_slots.data(), d_pages.data(), pages_per_head, nkv + 1};
  bad.keys.row_bytes = row_elems * 2;
  EXPECT_EQ(ExactSelect(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

class SelectContract : public kvr::cuda::testing::GpuTest {};

TEST_F(SelectContract, ExactSelectRejectsBadShapes) {
  auto p = ContractParams<ExactSelectParams>();
  p.head_dim = 96;
  EXPECT_EQ(ExactSelect(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.head_dim = 128;
  p.out.budget = kMaxBudget + 1;
  EXPECT_EQ(ExactSelect(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.out.budget = 16;
  EXPECT_EQ(ExactSelect(p, nullptr).code(), absl::StatusCode::kInvalidArgument);  // null ptrs
}

}  // namespace

std::vector<ParityRow> SelectRows() {
  std::vector<ParityRow> rows;
  for (int budget : {1, 16, 255, 1024, 4096}) {
    for (int ties : {0, 1, 2}) {
      rows.push_back({"BatchedTopK",
                      "k" + S(budget) +
                          (ties == 0   ? " random+NaN"
                           : ties == 1 ? " 5 values"
                                       : " all equal") +
                          " len 0..70000" + (budget == 255 ? " odd stride" : ""),
                      "TopKIndices", "identical sets", [=] { TopKRow(budget, ties); }});
      rows.push_back({"BatchedTopK",
                      "k" + S(budget) + " ties " + S(ties) + " len 0..4095 (short-row CTAs)" +
                          (budget == 255 ? " odd stride" : ""),
                      "TopKIndices", "identical sets", [=] { TopKRow(budget, ties, true); }});
    }
  }
  using G = GqaAggregation;
  for (const SelectCase& c : {SelectCase{KeyDType::kBf16, 128, 32, 8, G::kSumSoftmax},
                              SelectCase{KeyDType::kF16, 128, 32, 8, G::kSumSoftmax},
                              SelectCase{KeyDType::kF32, 128, 32, 8, G::kSumSoftmax},
                              SelectCase{KeyDType::kBf16, 64, 9, 3, G::kSumSoftmax},
                              SelectCase{KeyDType::kF32, 64, 9, 3, G::kMaxLogit},
                              SelectCase{KeyDType::kF16, 64, 8, 8, G::kSumLogit},
                              SelectCase{KeyDType::kBf16, 128, 32, 4, G::kMaxLogit},
                              SelectCase{KeyDType::kF32, 128, 32, 4, G::kSumSoftmax}}) {
    rows.push_back({"ExactSelect", Name(c) + " k1,100,1024,2048", "registry exact index",
                    "sets equal but near-ties of the k-th score (1e-4)", [=] { ExactRow(c); }});
  }
  // quest reads fp32 page bounds and these clusterkv rows fp32 centroids: the key dtype is not
  // theirs (the rows after these give clusterkv bf16 centroids).
  const SelectCase shapes[] = {{KeyDType::kF32, 128, 32, 8, G::kSumSoftmax},
                               {KeyDType::kF32, 64, 9, 3, G::kSumSoftmax},
                               {KeyDType::kF32, 64, 8, 4, G::kMaxLogit}};
  for (const SelectCase& c : shapes) {
    rows.push_back({"QuestSelect", ShapeName(c) + " k1,40,256,1024 + per-row", "quest index",
                    ">= 90% rows identical, overlap >= 0.97", [c] { QuestRow(c); }});
  }
  // bf16 page bounds rounded outward (the sparse decode's) against the CPU index's fp32 ones.
  for (const SelectCase& c : {SelectCase{KeyDType::kBf16, 64, 9, 3, G::kSumSoftmax},
                              SelectCase{KeyDType::kBf16, 128, 32, 8, G::kSumSoftmax}}) {
    rows.push_back({"QuestSelect", "bf16 bounds " + ShapeName(c) + " k1,40,256,1024 + per-row",
                    "quest index (fp32 bounds)", ">= 70% rows identical, overlap >= 0.99",
                    [c] { QuestRow(c); }});
  }
  for (const int first_pick : {0, 4}) {
    for (const SelectCase& c : shapes) {
      rows.push_back({"ClusterKvSelect",
                      ShapeName(c) + " k1,40,256,1024 + per-row, first pick " + S(first_pick),
                      "clusterkv index", ">= 90% rows identical, overlap >= 0.97",
                      [c, first_pick] { ClusterKvRow(c, first_pick); }});
    }
  }
  // bf16 centroids (the sparse decode's) against the CPU index's fp32 ones.
  for (const SelectCase& c : {SelectCase{KeyDType::kBf16, 64, 9, 3, G::kSumSoftmax},
                              SelectCase{KeyDType::kBf16, 128, 32, 8, G::kSumSoftmax}}) {
    rows.push_back({"ClusterKvSelect",
                    ShapeName(c) + " bf16 centroids k1,40,256,1024 + per-row, first pick 0",
                    "clusterkv index (fp32 centroids)", ">= 70% rows identical, overlap >= 0.99",
                    [c] { ClusterKvRow(c, 0); }});
  }
  rows.push_back({"ExactSelect", "paged bf16 d128 h8x2 pages of 64", "the same keys contiguous",
                  "identical ids", [] { ExactPagedRow(); }});
  return rows;
}

}  // namespace kvr::gpu_parity
