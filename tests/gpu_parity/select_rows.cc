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
#include <map>
#include <memory>
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
#include "select_check.h"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::DeviceBuffer;
using kvr::cuda::testing::CheckIdRow;
using kvr::cuda::testing::Download;
using kvr::cuda::testing::ExpectAtLeast;
using kvr::cuda::testing::kPoison;
using kvr::cuda::testing::RecordMeasure;
using kvr::cuda::testing::SetAgreement;
using kvr::cuda::testing::Upload;
using kvr::gpu_parity::CompareWithCpuSelect;
using kvr::gpu_parity::ParityRow;

std::string S(int64_t v) { return std::to_string(v); }

// A launch at budget `wide` with per-row budgets (ids/counts downloaded) against the launches at
// each row's budget (`uniform`: budget -> its ids and counts): row by row the same counts and ids.
// Returns the rows that differ.
using UniformSelections = std::map<int, std::pair<std::vector<int32_t>, std::vector<int32_t>>>;
int ExpectRowsAsAtTheirBudget(const std::vector<int32_t>& ids, const std::vector<int32_t>& counts,
                              int wide, int nkv, const std::vector<int32_t>& row_budgets,
                              const UniformSelections& uniform) {
  int differ = 0;
  for (size_t b = 0; b < row_budgets.size(); ++b) {
    const auto& [want_ids, want_counts] = uniform.at(row_budgets[b]);
    for (int h = 0; h < nkv; ++h) {
      const size_t row = b * nkv + h;
      EXPECT_EQ(counts[row], want_counts[row]) << "per-row budget, seq " << b << " head " << h;
      if (counts[row] != want_counts[row]) {
        ++differ;
        continue;
      }
      const int32_t* got = ids.data() + row * wide;
      const int32_t* want = want_ids.data() + row * row_budgets[b];
      const bool same = std::equal(got, got + counts[row], want);
      EXPECT_TRUE(same) << "per-row budget, seq " << b << " head " << h;
      differ += !same;
    }
  }
  RecordMeasure("per-row budgets: rows != uniform launch", differ, "0", differ == 0);
  return differ;
}

// ---- BatchedTopK ------------------------------------------------------------------------------

// ties 0: random floats with NaN every 97th; 1: 5 distinct values; 2: all equal.
void TopKRow(int budget, int ties) {
  std::mt19937 rng(7 + 3 * budget + ties);
  const std::vector<int> lengths = {0, 1, 5, 1000, 1024, 1025, 4097, 70000};
  const int rows = static_cast<int>(lengths.size());
  // An odd row stride exercises the unaligned (scalar load) path.
  const int64_t stride = budget == 255 ? 70001 : 70000;
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
  auto ids = DeviceBuffer<int32_t>::Create(rows * budget);
  auto counts = DeviceBuffer<int32_t>::Create(rows);
  ASSERT_TRUE(ids.ok() && counts.ok());
  ASSERT_EQ(cudaMemset(ids->data(), 0x7f, ids->bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemset(counts->data(), 0x7f, counts->bytes()), cudaSuccess);
  TopKParams p;
  p.rows = rows;
  p.row_stride = stride;
  p.scores = d_scores.data();
  p.n_valid = d_n.data();
  p.id_offset = d_off.data();
  p.out = {budget, ids->data(), counts->data()};
  // Two-stage path (segments of 16K) with scratch, except budget 16: one CTA per row.
  DeviceBuffer<char> scratch;
  if (budget != 16) {
    auto s = DeviceBuffer<char>::Create(BatchedTopKWorkspaceBytes(p));
    ASSERT_TRUE(s.ok());
    scratch = std::move(*s);
    ASSERT_EQ(cudaMemset(scratch.data(), 0x7f, scratch.bytes()), cudaSuccess);
    p.workspace = scratch.data();
    p.workspace_bytes = scratch.bytes();
  }
  ASSERT_OK(BatchedTopK(p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto h_ids = Download(*ids, rows * budget);
  const auto h_counts = Download(*counts, rows);
  int differ = 0;
  for (int r = 0; r < rows; ++r) {
    const std::string where = "budget " + S(budget) + " ties " + S(ties) + " len " + S(lengths[r]);
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

struct ExactCase {
  KeyDType dtype;
  int head_dim;
  int n_heads, n_kv_heads;
  GqaAggregation gqa;
};

std::string Name(const ExactCase& c) {
  return std::string(c.dtype == KeyDType::kF32   ? "f32"
                     : c.dtype == KeyDType::kF16 ? "f16"
                                                 : "bf16") +
         "_d" + S(c.head_dim) + "_h" + S(c.n_heads) + "x" + S(c.n_kv_heads) + "_gqa" +
         S(static_cast<int>(c.gqa));
}

void ExactRow(const ExactCase& c) {
  const int hd = c.head_dim, nkv = c.n_kv_heads, nh = c.n_heads, group = nh / nkv;
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
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < nkv; ++h)
      for (int t = 0; t < ctx[b]; ++t) {
        const int topic = (t / 40 + h * 7) % 32;
        for (int d = 0; d < hd; ++d) {
          float v = topics[topic * hd + d] + 0.7f * nd(rng);
          float& k = keys[((static_cast<size_t>(b) * nkv + h) * max_ctx + t) * hd + d];
          if (c.dtype == KeyDType::kF32) {
            k = v;
          } else {
            k = FromHalfBits(ToHalfBits(v, c.dtype), c.dtype);  // the values the GPU sees
          }
        }
      }
  std::vector<float> query(static_cast<size_t>(batch) * nh * hd);
  for (float& x : query) x = 1.5f * nd(rng);
  std::vector<int32_t> begin(batch), end(batch);
  int max_cand = 0;
  for (int b = 0; b < batch; ++b) {
    begin[b] = std::min(16, ctx[b]);
    end[b] = std::max(begin[b], ctx[b] - 64);
    max_cand = std::max(max_cand, end[b] - begin[b]);
  }
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
  auto d_query = Upload(query);
  auto d_begin = Upload(begin);
  auto d_end = Upload(end);

  MethodRegistry registry;
  ASSERT_OK(RegisterCoreMethods(registry));
  IndexShape shape;
  shape.n_heads = nh;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  IndexParams params;
  params.gqa = c.gqa;

  for (int budget : {1, 100, 1024, 2048}) {
    ExactSelectParams p;
    p.batch = batch;
    p.n_heads = nh;
    p.n_kv_heads = nkv;
    p.head_dim = hd;
    p.scale = scale;
    p.gqa = c.gqa;
    p.query = d_query.data();
    p.keys.data = key_ptr;
    p.keys.dtype = c.dtype;
    p.keys.token_stride = hd;
    p.keys.head_stride = static_cast<int64_t>(max_ctx) * hd;
    p.keys.batch_stride = static_cast<int64_t>(nkv) * max_ctx * hd;
    p.cand = {d_begin.data(), d_end.data()};
    p.max_candidates = max_cand;
    p.out.budget = budget;  // the workspace size depends on it
    auto ids = DeviceBuffer<int32_t>::Create(batch * nkv * budget);
    auto counts = DeviceBuffer<int32_t>::Create(batch * nkv);
    auto ws = DeviceBuffer<char>::Create(ExactSelectWorkspaceBytes(p));
    ASSERT_TRUE(ids.ok() && counts.ok() && ws.ok());
    ASSERT_EQ(cudaMemset(ids->data(), 0x7f, ids->bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(counts->data(), 0x7f, counts->bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(ws->data(), 0xff, ws->bytes()), cudaSuccess);  // NaN-poisoned scratch
    p.out = {budget, ids->data(), counts->data()};
    p.workspace = ws->data();
    p.workspace_bytes = ws->bytes();
    ASSERT_OK(ExactSelect(p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto h_ids = Download(*ids, batch * nkv * budget);
    const auto h_counts = Download(*counts, batch * nkv);

    // The set differences of this budget: tokens in either set only, those of them that are no
    // near-tie of the k-th score, and rows with more than max(1, k / 100) of them.
    int64_t diff_tokens = 0, far_tokens = 0, rows_over = 0;
    for (int b = 0; b < batch; ++b) {
      // CPU reference on the same key values, token-major as the index expects.
      std::vector<float> tok(static_cast<size_t>(ctx[b]) * nkv * hd);
      for (int t = 0; t < ctx[b]; ++t)
        for (int h = 0; h < nkv; ++h)
          std::memcpy(&tok[(static_cast<size_t>(t) * nkv + h) * hd],
                      &keys[((static_cast<size_t>(b) * nkv + h) * max_ctx + t) * hd],
                      hd * sizeof(float));
      auto index = registry.Make("exact", shape, params);
      ASSERT_TRUE(index.ok()) << index.status();
      BuildInput in;
      in.keys = {tok.data(), ctx[b], static_cast<int64_t>(nkv) * hd};
      ASSERT_OK((*index)->Build(in));
      SelectRequest req;
      req.query = query.data() + static_cast<size_t>(b) * nh * hd;
      req.budget = budget;
      req.n_sink = begin[b];
      req.local_begin = end[b];
      Selection sel;
      ASSERT_OK((*index)->Select(req, &sel));
      for (int h = 0; h < nkv; ++h) {
        const std::string where =
            Name(c) + " budget " + S(budget) + " seq " + S(b) + " head " + S(h);
        const int row = b * nkv + h;
        ASSERT_NE(h_counts[row], kPoison) << where;
        const auto got = CheckIdRow(h_ids.data() + static_cast<size_t>(row) * budget, h_counts[row],
                                    budget, begin[b], end[b], where);
        const auto& want = sel.per_head[h];
        ASSERT_EQ(got.size(), want.size()) << where;
        if (got == want) continue;
        // Reference scores (double) to judge the differing tokens: each must sit at the k-th
        // score within tolerance (a near-tie resolved differently by fp32 summation order).
        const int n = end[b] - begin[b];
        std::vector<double> logit(static_cast<size_t>(group) * n), agg(n, 0.0);
        for (int g = 0; g < group; ++g) {
          const float* q = query.data() + (static_cast<size_t>(b) * nh + h * group + g) * hd;
          double mx = -1e300;
          for (int i = 0; i < n; ++i) {
            const float* k =
                &keys[((static_cast<size_t>(b) * nkv + h) * max_ctx + begin[b] + i) * hd];
            double s = 0;
            for (int d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * k[d];
            logit[g * n + i] = s * scale;
            mx = std::max(mx, s * scale);
          }
          double z = 0;
          for (int i = 0; i < n; ++i) z += std::exp(logit[g * n + i] - mx);
          for (int i = 0; i < n; ++i) {
            const double l = logit[g * n + i];
            if (c.gqa == GqaAggregation::kSumSoftmax) {
              agg[i] += std::exp(l - mx) / z;
            } else if (c.gqa == GqaAggregation::kMaxLogit) {
              agg[i] = g == 0 ? l : std::max(agg[i], l);
            } else {
              agg[i] += l;
            }
          }
        }
        std::vector<double> sorted(agg);
        std::sort(sorted.begin(), sorted.end(), std::greater<>());
        const double kth = sorted[got.size() - 1];
        const double tol = 1e-4 * std::max(std::abs(sorted[0]), 1e-30) + 1e-6 * std::abs(kth);
        std::set<int64_t> a(got.begin(), got.end()), w(want.begin(), want.end());
        int diff = 0;
        for (int64_t t : a)
          if (!w.count(t)) {
            ++diff;
            EXPECT_NEAR(agg[t - begin[b]], kth, tol) << where << " extra token " << t;
            far_tokens += std::abs(agg[t - begin[b]] - kth) > tol;
          }
        for (int64_t t : w) {
          if (!a.count(t)) {
            EXPECT_NEAR(agg[t - begin[b]], kth, tol) << where << " missing " << t;
            far_tokens += std::abs(agg[t - begin[b]] - kth) > tol;
          }
        }
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

// ---- QuestSelect ------------------------------------------------------------------------------

struct SelectShape {
  int hd, nh, nkv;
  GqaAggregation gqa;
};

std::string ShapeName(const SelectShape& s) {
  return "d" + S(s.hd) + "_h" + S(s.nh) + "x" + S(s.nkv) + "_gqa" + S(static_cast<int>(s.gqa));
}

// One budget's sweep: identical sets on >= 90% of the rows, token overlap >= 0.97.
void ExpectAgreement(const std::string& what, const SetAgreement& agree) {
  ExpectAtLeast(what + "identical rows", agree.identical, agree.rows * 9 / 10);
  ExpectAtLeast(what + "token overlap", agree.recall(), 0.97);
}

// quest: the CPU QuestIndex on the same keys; the GPU gets the same page bounds (min / max are
// exact in any order). Page bounds are sums in a different order on each side, so a near-tie
// between two pages may resolve differently: require identical counts, identical sets on nearly
// every row and >= 0.97 token overlap overall.
void QuestRow(const SelectShape& shp) {
  const auto [hd, nh, nkv, gqa] = shp;
  const int group = nh / nkv, ps = 16;
  const std::vector<int> ctx = {30, 2000, 9000};
  const int batch = static_cast<int>(ctx.size());
  const int max_ctx = 9000;
  const int max_pages = (max_ctx + ps - 1) / ps;
  std::mt19937 rng(5 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> topics(32 * hd);
  for (float& x : topics) x = nd(rng);
  const int64_t page_floats = static_cast<int64_t>(nkv) * 2 * hd;
  const int64_t batch_stride = max_pages * page_floats;
  std::vector<float> bounds(batch * batch_stride, 0.f);
  std::vector<std::vector<float>> keys(batch);  // [ctx, nkv, hd] token-major per sequence
  for (int b = 0; b < batch; ++b) {
    keys[b].resize(static_cast<size_t>(ctx[b]) * nkv * hd);
    for (int t = 0; t < ctx[b]; ++t)
      for (int h = 0; h < nkv; ++h) {
        const int topic = (t / 40 + h * 7 + b) % 32;
        for (int d = 0; d < hd; ++d) {
          const float v = topics[topic * hd + d] + 0.7f * nd(rng);
          keys[b][(static_cast<size_t>(t) * nkv + h) * hd + d] = v;
          float* mn = &bounds[b * batch_stride + (t / ps) * page_floats + h * 2 * hd];
          const bool fresh = t % ps == 0;
          mn[d] = fresh ? v : std::min(mn[d], v);
          mn[hd + d] = fresh ? v : std::max(mn[hd + d], v);
        }
      }
  }
  std::vector<float> query(static_cast<size_t>(batch) * nh * hd);
  for (float& x : query) x = 1.5f * nd(rng);
  std::vector<int32_t> begin(batch), end(batch);
  int max_cand = 0;
  for (int b = 0; b < batch; ++b) {
    begin[b] = std::min(16, ctx[b]);
    end[b] = std::max(begin[b], ctx[b] - 64 + 3);  // not page-aligned on purpose
    max_cand = std::max(max_cand, end[b] - begin[b]);
  }
  auto d_bounds = Upload(bounds);
  auto d_query = Upload(query);
  auto d_begin = Upload(begin);
  auto d_end = Upload(end);
  MethodRegistry registry;
  ASSERT_OK(RegisterCoreMethods(registry));
  IndexShape shape;
  shape.n_heads = nh;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  IndexParams params;
  params.gqa = gqa;
  params.quest.page_size = ps;
  // Each budget's rows, for the launch with per-row budgets at the end.
  UniformSelections uniform;
  auto params_for = [&]() {
    QuestSelectParams p;
    p.batch = batch;
    p.n_heads = nh;
    p.n_kv_heads = nkv;
    p.head_dim = hd;
    p.page_size = ps;
    p.scale = 1.f / std::sqrt(static_cast<float>(hd));
    p.gqa = gqa;
    p.query = d_query.data();
    p.bounds = d_bounds.data();
    p.bounds_batch_stride = batch_stride;
    p.cand = {d_begin.data(), d_end.data()};
    p.max_candidates = max_cand;
    return p;
  };
  for (int budget : {1, 40, 256, 1024}) {
    QuestSelectParams p = params_for();
    auto ids = DeviceBuffer<int32_t>::Create(batch * nkv * budget);
    auto counts = DeviceBuffer<int32_t>::Create(batch * nkv);
    p.out = {budget, nullptr, nullptr};
    auto ws = DeviceBuffer<char>::Create(QuestSelectWorkspaceBytes(p));
    ASSERT_TRUE(ids.ok() && counts.ok() && ws.ok());
    ASSERT_EQ(cudaMemset(ids->data(), 0x7f, ids->bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(counts->data(), 0x7f, counts->bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(ws->data(), 0xff, ws->bytes()), cudaSuccess);
    p.out = {budget, ids->data(), counts->data()};
    p.workspace = ws->data();
    p.workspace_bytes = ws->bytes();
    ASSERT_OK(QuestSelect(p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto h_ids = Download(*ids, batch * nkv * budget);
    const auto h_counts = Download(*counts, batch * nkv);
    uniform[budget] = {h_ids, h_counts};
    auto cpu = [&](int b, Selection* sel) -> absl::Status {
      auto index = registry.Make("quest", shape, params);
      if (!index.ok()) return index.status();
      BuildInput in;
      in.keys = {keys[b].data(), ctx[b], static_cast<int64_t>(nkv) * hd};
      if (absl::Status st = (*index)->Build(in); !st.ok()) return st;
      SelectRequest req;
      req.query = query.data() + static_cast<size_t>(b) * nh * hd;
      req.budget = budget;
      req.n_sink = begin[b];
      req.local_begin = end[b];
      return (*index)->Select(req, sel);
    };
    SetAgreement agree;
    CompareWithCpuSelect(h_ids, h_counts, budget, nkv, begin, end, cpu,
                         "quest d" + S(hd) + " group " + S(group) + " budget " + S(budget), &agree);
    if (::testing::Test::HasFatalFailure()) return;
    ExpectAgreement("k=" + S(budget) + ": ", agree);
  }
  // Per-row budgets (a decode batch whose requests ask for different budgets): one launch at
  // the widest budget with row b capped at budgets[b] selects, row by row, what a launch at
  // that budget selected.
  const std::vector<int32_t> row_budgets = {40, 1, 256};
  const int wide = 1024;
  auto d_budgets = Upload(row_budgets);
  QuestSelectParams p = params_for();
  p.budgets = d_budgets.data();
  auto ids = DeviceBuffer<int32_t>::Create(batch * nkv * wide);
  auto counts = DeviceBuffer<int32_t>::Create(batch * nkv);
  p.out = {wide, nullptr, nullptr};
  auto ws = DeviceBuffer<char>::Create(QuestSelectWorkspaceBytes(p));
  ASSERT_TRUE(ids.ok() && counts.ok() && ws.ok());
  p.out = {wide, ids->data(), counts->data()};
  p.workspace = ws->data();
  p.workspace_bytes = ws->bytes();
  ASSERT_OK(QuestSelect(p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectRowsAsAtTheirBudget(Download(*ids, batch * nkv * wide), Download(*counts, batch * nkv),
                            wide, nkv, row_budgets, uniform);
}

// ---- ClusterKvSelect --------------------------------------------------------------------------

// clusterkv: the CPU ClusterKvIndex (prefill clusters + appended pending tokens) and the GPU
// selector on its layout (ClusterKvLayoutFromIndexes). Scores are sums in another order on the
// GPU, so near-tied clusters may swap: identical counts, identical sets on nearly every row and
// >= 0.97 token overlap overall.
void ClusterKvRow(const SelectShape& shp) {
  const auto [hd, nh, nkv, gqa] = shp;
  const std::vector<int> ctx = {600, 4000, 9000};
  const int n_append = 50;
  const int batch = static_cast<int>(ctx.size());
  std::mt19937 rng(9 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> topics(32 * hd);
  for (float& x : topics) x = nd(rng);
  MethodRegistry registry;
  ASSERT_OK(RegisterCoreMethods(registry));
  IndexShape shape;
  shape.n_heads = nh;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  IndexParams params;
  params.gqa = gqa;
  params.n_sink = 16;
  std::vector<std::unique_ptr<RetrievalIndex>> indexes;
  std::vector<const RetrievalIndex*> views;
  for (int b = 0; b < batch; ++b) {
    const int n = ctx[b] + n_append;
    std::vector<float> keys(static_cast<size_t>(n) * nkv * hd);
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < nkv; ++h) {
        const int topic = (t / 40 + h * 7 + b) % 32;
        for (int d = 0; d < hd; ++d)
          keys[(static_cast<size_t>(t) * nkv + h) * hd + d] =
              topics[topic * hd + d] + 0.7f * nd(rng);
      }
    auto index = registry.Make("clusterkv", shape, params);
    ASSERT_TRUE(index.ok()) << index.status();
    BuildInput in;
    in.keys = {keys.data(), ctx[b], static_cast<int64_t>(nkv) * hd};
    ASSERT_OK((*index)->Build(in));
    AppendInput app;
    app.keys = {keys.data() + static_cast<size_t>(ctx[b]) * nkv * hd, n_append,
                static_cast<int64_t>(nkv) * hd};
    ASSERT_OK((*index)->Append(app));
    views.push_back(index->get());
    indexes.push_back(std::move(*index));
  }
  auto layout = ClusterKvLayoutFromIndexes(views);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> query(static_cast<size_t>(batch) * nh * hd);
  for (float& x : query) x = 1.5f * nd(rng);
  std::vector<int32_t> begin(batch), end(batch);
  for (int b = 0; b < batch; ++b) {
    begin[b] = 16;
    end[b] = ctx[b] + n_append - 30;  // part of the pending tokens are in the local window
  }
  auto d_query = Upload(query);
  auto d_begin = Upload(begin);
  auto d_end = Upload(end);
  auto d_cent = Upload(layout->centroids);
  auto d_nc = Upload(layout->n_clusters);
  auto d_off = Upload(layout->offsets);
  auto d_mem = Upload(layout->members);
  UniformSelections uniform;
  auto params_for = [&](int budget) {
    ClusterKvSelectParams p;
    p.batch = batch;
    p.n_heads = nh;
    p.n_kv_heads = nkv;
    p.head_dim = hd;
    p.scale = 1.f / std::sqrt(static_cast<float>(hd));
    p.gqa = gqa;
    p.query = d_query.data();
    p.centroids = d_cent.data();
    p.n_clusters = d_nc.data();
    p.offsets = d_off.data();
    p.members = d_mem.data();
    p.max_clusters = layout->max_clusters;
    p.max_members = layout->max_members;
    p.cand = {d_begin.data(), d_end.data()};
    p.out.budget = budget;
    return p;
  };
  for (int budget : {1, 40, 256, 1024}) {
    ClusterKvSelectParams p = params_for(budget);
    auto ids = DeviceBuffer<int32_t>::Create(batch * nkv * budget);
    auto counts = DeviceBuffer<int32_t>::Create(batch * nkv);
    auto ws = DeviceBuffer<char>::Create(ClusterKvSelectWorkspaceBytes(p));
    ASSERT_TRUE(ids.ok() && counts.ok() && ws.ok());
    ASSERT_EQ(cudaMemset(ids->data(), 0x7f, ids->bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(counts->data(), 0x7f, counts->bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(ws->data(), 0xff, ws->bytes()), cudaSuccess);
    p.out = {budget, ids->data(), counts->data()};
    p.workspace = ws->data();
    p.workspace_bytes = ws->bytes();
    ASSERT_OK(ClusterKvSelect(p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto h_ids = Download(*ids, batch * nkv * budget);
    const auto h_counts = Download(*counts, batch * nkv);
    uniform[budget] = {h_ids, h_counts};
    auto cpu = [&](int b, Selection* sel) {
      SelectRequest req;
      req.query = query.data() + static_cast<size_t>(b) * nh * hd;
      req.budget = budget;
      req.n_sink = begin[b];
      req.local_begin = end[b];
      return indexes[b]->Select(req, sel);
    };
    SetAgreement agree;
    CompareWithCpuSelect(h_ids, h_counts, budget, nkv, begin, end, cpu,
                         "clusterkv d" + S(hd) + " budget " + S(budget), &agree);
    if (::testing::Test::HasFatalFailure()) return;
    ExpectAgreement("k=" + S(budget) + ": ", agree);
  }
  // Per-row budgets, as for quest.
  const std::vector<int32_t> row_budgets = {256, 40, 1};
  const int wide = 1024;
  auto d_budgets = Upload(row_budgets);
  ClusterKvSelectParams p = params_for(wide);
  p.budgets = d_budgets.data();
  auto ids = DeviceBuffer<int32_t>::Create(batch * nkv * wide);
  auto counts = DeviceBuffer<int32_t>::Create(batch * nkv);
  auto ws = DeviceBuffer<char>::Create(ClusterKvSelectWorkspaceBytes(p));
  ASSERT_TRUE(ids.ok() && counts.ok() && ws.ok());
  p.out = {wide, ids->data(), counts->data()};
  p.workspace = ws->data();
  p.workspace_bytes = ws->bytes();
  ASSERT_OK(ClusterKvSelect(p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectRowsAsAtTheirBudget(Download(*ids, batch * nkv * wide), Download(*counts, batch * nkv),
                            wide, nkv, row_budgets, uniform);
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
  std::vector<float> query(static_cast<size_t>(batch) * nh * hd);
  for (float& q : query) q = nd(rng);
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
  auto d_query = Upload(query);
  const std::vector<int32_t> begin = {16, 16}, end = {ctx - 64, ctx - 500};
  auto d_begin = Upload(begin);
  auto d_end = Upload(end);
  const int budget = 256;
  std::vector<std::vector<int32_t>> ids(2), counts(2);
  for (int paged = 0; paged < 2; ++paged) {
    ExactSelectParams p;
    p.batch = batch;
    p.n_heads = nh;
    p.n_kv_heads = nkv;
    p.head_dim = hd;
    p.scale = 1.f / std::sqrt(static_cast<float>(hd));
    p.query = d_query.data();
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
    p.cand = {d_begin.data(), d_end.data()};
    p.max_candidates = ctx;
    p.out.budget = budget;
    auto d_ids = DeviceBuffer<int32_t>::Create(batch * nkv * budget);
    auto d_counts = DeviceBuffer<int32_t>::Create(batch * nkv);
    auto ws = DeviceBuffer<char>::Create(ExactSelectWorkspaceBytes(p));
    ASSERT_TRUE(d_ids.ok() && d_counts.ok() && ws.ok());
    p.out = {budget, d_ids->data(), d_counts->data()};
    p.workspace = ws->data();
    p.workspace_bytes = ws->bytes();
    ASSERT_OK(ExactSelect(p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ids[paged] = Download(*d_ids, batch * nkv * budget);
    counts[paged] = Download(*d_counts, batch * nkv);
  }
  EXPECT_EQ(counts[1], counts[0]);
  EXPECT_EQ(ids[1], ids[0]);
  EXPECT_EQ(counts[0][0], budget);
  int64_t differ = 0;
  for (size_t i = 0; i < ids[0].size(); ++i) differ += ids[1][i] != ids[0][i];
  for (size_t i = 0; i < counts[0].size(); ++i) differ += counts[1][i] != counts[0][i];
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
  ExactSelectParams p;
  p.batch = 1;
  p.n_heads = 32;
  p.n_kv_heads = 8;
  p.head_dim = 96;
  p.out.budget = 16;
  EXPECT_EQ(ExactSelect(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.head_dim = 128;
  p.out.budget = kMaxBudget + 1;
  EXPECT_EQ(ExactSelect(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.out.budget = 16;
  EXPECT_EQ(ExactSelect(p, nullptr).code(), absl::StatusCode::kInvalidArgument);  // null ptrs
}

}  // namespace
}  // namespace kvr::retrieval::cuda

namespace kvr::gpu_parity {

std::vector<ParityRow> SelectRows() {
  using namespace kvr::retrieval;
  using namespace kvr::retrieval::cuda;
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
    }
  }
  for (const ExactCase& c : {ExactCase{KeyDType::kBf16, 128, 32, 8, GqaAggregation::kSumSoftmax},
                             ExactCase{KeyDType::kF16, 128, 32, 8, GqaAggregation::kSumSoftmax},
                             ExactCase{KeyDType::kF32, 128, 32, 8, GqaAggregation::kSumSoftmax},
                             ExactCase{KeyDType::kBf16, 64, 9, 3, GqaAggregation::kSumSoftmax},
                             ExactCase{KeyDType::kF32, 64, 9, 3, GqaAggregation::kMaxLogit},
                             ExactCase{KeyDType::kF16, 64, 8, 8, GqaAggregation::kSumLogit},
                             ExactCase{KeyDType::kBf16, 128, 32, 4, GqaAggregation::kMaxLogit},
                             ExactCase{KeyDType::kF32, 128, 32, 4, GqaAggregation::kSumSoftmax}}) {
    rows.push_back({"ExactSelect", Name(c) + " k1,100,1024,2048", "registry exact index",
                    "sets equal but near-ties of the k-th score (1e-4)", [=] { ExactRow(c); }});
  }
  const SelectShape shapes[] = {{128, 32, 8, GqaAggregation::kSumSoftmax},
                                {64, 9, 3, GqaAggregation::kSumSoftmax},
                                {64, 8, 4, GqaAggregation::kMaxLogit}};
  for (const SelectShape& s : shapes) {
    rows.push_back({"QuestSelect", ShapeName(s) + " k1,40,256,1024 + per-row", "quest index",
                    ">= 90% rows identical, overlap >= 0.97", [=] { QuestRow(s); }});
  }
  for (const SelectShape& s : shapes) {
    rows.push_back({"ClusterKvSelect", ShapeName(s) + " k1,40,256,1024 + per-row",
                    "clusterkv index", ">= 90% rows identical, overlap >= 0.97",
                    [=] { ClusterKvRow(s); }});
  }
  rows.push_back({"ExactSelect", "paged bf16 d128 h8x2 pages of 64", "the same keys contiguous",
                  "identical ids", [] { ExactPagedRow(); }});
  return rows;
}

}  // namespace kvr::gpu_parity
