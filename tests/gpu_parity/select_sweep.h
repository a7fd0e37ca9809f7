#pragma once
// The harness of the selector rows (select_rows.cc, quant_select_rows.cc, build_rows.cc): one
// launch of a selector into poisoned outputs, the CPU indexes of a batch, and the sweep every
// selector row makes: per budget a launch compared with the CPU index's Select of the same
// request row by row (the contract of each row, equal counts, the sets' agreement), then, where
// the selector takes them, per-row budgets. A row says only its inputs, its parameters and its
// bars.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/index.h"
#include "kvr/retrieval/registry.h"

namespace kvr::gpu_parity {

// The core and quant methods, registered once for the binary.
inline retrieval::MethodRegistry& Registry() {
  static retrieval::MethodRegistry* r = [] {
    auto* reg = new retrieval::MethodRegistry;
    EXPECT_TRUE(retrieval::RegisterCoreMethods(*reg).ok());
    EXPECT_TRUE(retrieval::RegisterQuantMethods(*reg).ok());
    return reg;
  }();
  return *r;
}

inline retrieval::IndexShape ShapeOf(int n_heads, int n_kv_heads, int head_dim) {
  retrieval::IndexShape s;
  s.n_heads = n_heads;
  s.n_kv_heads = n_kv_heads;
  s.head_dim = head_dim;
  return s;
}

// A selector row's shape: key dtype (where the selector reads keys), head_dim, heads, KV heads,
// aggregation, and pariskv's subspace_dim (0: none).
struct SelectCase {
  retrieval::cuda::KeyDType dtype;
  int hd, nh, nkv;
  retrieval::GqaAggregation gqa;
  int m = 0;
};

inline std::string ShapeName(const SelectCase& c) {
  return "d" + std::to_string(c.hd) + "_h" + std::to_string(c.nh) + "x" + std::to_string(c.nkv) +
         "_gqa" + std::to_string(static_cast<int>(c.gqa)) +
         (c.m > 0 ? "_m" + std::to_string(c.m) : "");
}

// Candidate ranges of a batch: sequence b of n[b] tokens has candidates
// [min(sink, n[b]), max(begin, n[b] - local)); max_candidates is the longest range.
struct Candidates {
  std::vector<int32_t> begin, end;
  int max_candidates = 0;
};
inline Candidates CandidatesOf(const std::vector<int>& n, int sink, int local) {
  Candidates c;
  for (int len : n) {
    c.begin.push_back(std::min(sink, len));
    c.end.push_back(std::max(c.begin.back(), len - local));
    c.max_candidates = std::max(c.max_candidates, c.end.back() - c.begin.back());
  }
  return c;
}

// The device copies of a batch's queries [batch, nh, hd] and candidate ranges (and the longest).
struct DeviceInputs {
  kvr::cuda::DeviceBuffer<float> query;
  kvr::cuda::DeviceBuffer<int32_t> begin, end;
  int max_candidates = 0;
};
inline DeviceInputs UploadInputs(const std::vector<float>& query, const Candidates& cand) {
  return {kvr::cuda::testing::Upload(query), kvr::cuda::testing::Upload(cand.begin),
          kvr::cuda::testing::Upload(cand.end), cand.max_candidates};
}

// The parameters every selector shares: shape, scale, aggregation, queries, candidates (and
// their longest range where P has max_candidates).
template <typename P>
P CommonParams(const SelectCase& c, int batch, const DeviceInputs& in) {
  P p;
  retrieval::cuda::SetAttentionShape(p, batch, c.nh, c.nkv, c.hd);
  p.gqa = c.gqa;
  p.query = in.query.data();
  p.cand = {in.begin.data(), in.end.data()};
  if constexpr (requires(P & q) { q.max_candidates; }) p.max_candidates = in.max_candidates;
  return p;
}

// n floats scale * N(0, 1) drawn with `nd` from `rng` (a row's queries).
inline std::vector<float> Normal(size_t n, float scale, std::normal_distribution<float>& nd,
                                 std::mt19937& rng) {
  std::vector<float> v(n);
  for (float& x : v) x = scale * nd(rng);
  return v;
}

// The shape the contract tests hand a launcher before breaking one field: batch 1, 32 heads over
// 8 KV heads, head_dim 128 (where P has it), budget 16, no buffers.
template <typename P>
P ContractParams() {
  P p;
  p.batch = 1;
  p.n_heads = 32;
  p.n_kv_heads = 8;
  if constexpr (requires(P & q) { q.head_dim; }) p.head_dim = 128;
  p.out.budget = 16;
  return p;
}

// One CPU index per sequence of a batch, and their views for the *LayoutFromIndexes helpers.
struct CpuIndexes {
  std::vector<std::unique_ptr<retrieval::RetrievalIndex>> owned;
  std::vector<const retrieval::RetrievalIndex*> views;
};

// Per sequence b an index of `method`: `keys(b)` gives its [n_build[b] + n_append, nkv, hd]
// keys; it is built on the first n_build[b] (`prefill(b, keys, &in)`, when given, adds the
// prefill queries; what it points to must outlive the call), then appended the remaining
// n_append (none: no Append).
inline void BuildCpuIndexes(const std::string& method, const retrieval::IndexShape& shape,
                            const retrieval::IndexParams& params, const std::vector<int>& n_build,
                            int n_append, const std::function<std::vector<float>(int b)>& keys,
                            const std::function<void(int b, const std::vector<float>& keys,
                                                     retrieval::BuildInput*)>& prefill,
                            CpuIndexes* out) {
  const int64_t stride = static_cast<int64_t>(shape.n_kv_heads) * shape.head_dim;
  for (size_t b = 0; b < n_build.size(); ++b) {
    const std::vector<float> k = keys(static_cast<int>(b));
    auto index = Registry().Make(method, shape, params);
    ASSERT_TRUE(index.ok()) << index.status();
    retrieval::BuildInput in;
    in.keys = {k.data(), n_build[b], stride};
    if (prefill) prefill(static_cast<int>(b), k, &in);
    ASSERT_OK((*index)->Build(in));
    if (n_append > 0) {
      retrieval::AppendInput app;
      app.keys = {k.data() + n_build[b] * stride, n_append, stride};
      ASSERT_OK((*index)->Append(app));
    }
    out->views.push_back(index->get());
    out->owned.push_back(std::move(*index));
  }
}

// Ids [rows, budget] and counts [rows] of one selector launch.
struct Selected {
  std::vector<int32_t> ids, counts;
};

// Launches a selector: `p` has its inputs set (outputs and workspace not); ids and counts are
// poisoned with kPoisonByte, the workspace with `workspace_byte`; rows = batch * n_kv_heads.
template <typename P>
void LaunchSelector(P p, int budget, int rows, size_t (*workspace_bytes)(const P&),
                    absl::Status (*select)(const P&, cudaStream_t), Selected* out,
                    int workspace_byte = kvr::cuda::testing::kNanByte) {
  using kvr::cuda::testing::kPoisonByte;
  p.out.budget = budget;  // the workspace size depends on it
  auto ids = kvr::cuda::testing::Poisoned<int32_t>(static_cast<size_t>(rows) * budget, kPoisonByte);
  auto counts = kvr::cuda::testing::Poisoned<int32_t>(rows, kPoisonByte);
  p.out = {budget, ids.data(), counts.data()};
  kvr::cuda::testing::LaunchWithWorkspace(p, workspace_bytes, select, workspace_byte);
  if (::testing::Test::HasFatalFailure()) return;
  out->ids = kvr::cuda::testing::Download(ids, static_cast<size_t>(rows) * budget);
  out->counts = kvr::cuda::testing::Download(counts, rows);
}

// One launch at `budget`, with per-row budgets (device [batch]) or none, into `out`.
using SelectLaunch = std::function<void(int budget, const int32_t* row_budgets, Selected* out)>;

// The launch of a selector over a batch: CommonParams, then `set(p)` adds the selector's own
// inputs; per-row budgets go to P::budgets where the selector has them. `in` must outlive it.
template <typename P>
SelectLaunch Launcher(const SelectCase& c, int batch, const DeviceInputs& in,
                      std::function<void(P&)> set, size_t (*workspace_bytes)(const P&),
                      absl::Status (*select)(const P&, cudaStream_t)) {
  return [=, &in](int budget, const int32_t* row_budgets, Selected* out) {
    P p = CommonParams<P>(c, batch, in);
    set(p);
    if constexpr (requires(P & q) { q.budgets; }) p.budgets = row_budgets;
    LaunchSelector(p, budget, batch * c.nkv, workspace_bytes, select, out);
  };
}

// ids [batch * n_kv_heads, budget] and counts [batch * n_kv_heads] of a launch over candidates
// [begin[b], end[b]); `cpu(b, &selection)` selects sequence b on the CPU. Every row obeys the
// contract (kvr::cuda::testing::CheckIdRow, no count left poisoned), its count equals the CPU's,
// and `agree` adds the row. `where` names the launch in failure messages.
inline void CompareWithCpuSelect(const std::vector<int32_t>& ids,
                                 const std::vector<int32_t>& counts, int budget, int n_kv_heads,
                                 const std::vector<int32_t>& begin, const std::vector<int32_t>& end,
                                 const std::function<absl::Status(int, retrieval::Selection*)>& cpu,
                                 const std::string& where,
                                 kvr::cuda::testing::SetAgreement* agree) {
  for (size_t b = 0; b < begin.size(); ++b) {
    retrieval::Selection sel;
    ASSERT_OK(cpu(static_cast<int>(b), &sel));
    for (int h = 0; h < n_kv_heads; ++h) {
      const std::string at = where + " seq " + std::to_string(b) + " head " + std::to_string(h);
      const size_t row = b * n_kv_heads + h;
      ASSERT_NE(counts[row], kvr::cuda::testing::kPoison) << at;
      const auto got = kvr::cuda::testing::CheckIdRow(ids.data() + row * budget, counts[row],
                                                      budget, begin[b], end[b], at);
      const auto& want = sel.per_head[h];
      ASSERT_EQ(got.size(), want.size()) << at;
      agree->Add(got, want);
    }
  }
}

// A launch at budget `wide` with per-row budgets against the launches at each row's budget
// (`uniform`: budget -> its launch): row by row the same counts and ids. Records and returns the
// rows that differ.
inline int ExpectRowsAsAtTheirBudget(const Selected& got, int wide, int nkv,
                                     const std::vector<int32_t>& row_budgets,
                                     const std::map<int, Selected>& uniform) {
  int differ = 0;
  for (size_t b = 0; b < row_budgets.size(); ++b) {
    const Selected& want = uniform.at(row_budgets[b]);
    for (int h = 0; h < nkv; ++h) {
      const size_t row = b * nkv + h;
      EXPECT_EQ(got.counts[row], want.counts[row]) << "per-row budget, seq " << b << " head " << h;
      if (got.counts[row] != want.counts[row]) {
        ++differ;
        continue;
      }
      const int32_t* g = got.ids.data() + row * wide;
      const int32_t* w = want.ids.data() + row * row_budgets[b];
      const bool same = std::equal(g, g + got.counts[row], w);
      EXPECT_TRUE(same) << "per-row budget, seq " << b << " head " << h;
      differ += !same;
    }
  }
  kvr::cuda::testing::RecordMeasure("per-row budgets: rows != uniform launch", differ, "0",
                                    differ == 0);
  return differ;
}

// The bar of one budget's sweep: identical sets on >= identical_tenths / 10 of the rows and the
// named overlap (selected CPU ids / CPU ids) at least `min_overlap`.
struct AgreementBar {
  std::string overlap;  // "recall", "token overlap"
  double min_overlap = 0;
  int identical_tenths = 9;
  void Expect(const std::string& what, int budget,
              const kvr::cuda::testing::SetAgreement& agree) const {
    std::printf("[ parity ] %s: %d/%d rows identical, %s %.5f\n", what.c_str(), agree.identical,
                agree.rows, overlap.c_str(), agree.recall());
    const std::string k = "k=" + std::to_string(budget) + ": ";
    kvr::cuda::testing::ExpectAtLeast(k + overlap, agree.recall(), min_overlap);
    kvr::cuda::testing::ExpectAtLeast(k + "identical rows", agree.identical,
                                      agree.rows * identical_tenths / 10);
  }
};

// A selector against its CPU index over a batch: queries [batch, query_stride] (a2ats: at
// `position`), candidates `cand`, each of `budgets` held to `bar`; with `row_budgets`, one more
// launch at `wide` with those per-row budgets (each one of `budgets`).
struct SelectSweep {
  std::string name;  // failure messages: name + " budget " + k
  int n_kv_heads = 0;
  const std::vector<float>* query = nullptr;
  int64_t query_stride = 0;
  const std::vector<int64_t>* position = nullptr;
  Candidates cand;
  std::vector<int> budgets;
  AgreementBar bar;
  std::vector<int32_t> row_budgets;
  int wide = 0;
};

// The sweep of a row at `budgets` (per-row budgets none; set them after).
inline SelectSweep SweepOf(const std::string& name, const SelectCase& c,
                           const std::vector<float>& query, const Candidates& cand,
                           std::vector<int> budgets, const AgreementBar& bar) {
  SelectSweep s;
  s.name = name;
  s.n_kv_heads = c.nkv;
  s.query = &query;
  s.query_stride = static_cast<int64_t>(c.nh) * c.hd;
  s.cand = cand;
  s.budgets = std::move(budgets);
  s.bar = bar;
  return s;
}

// `cpu(b, request, &selection)` selects sequence b on the CPU.
using CpuSelect =
    std::function<absl::Status(int b, const retrieval::SelectRequest&, retrieval::Selection*)>;

inline CpuSelect SelectOn(const CpuIndexes& indexes) {
  return [&indexes](int b, const retrieval::SelectRequest& req, retrieval::Selection* sel) {
    return indexes.owned[b]->Select(req, sel);
  };
}

inline void RunSelectSweep(const SelectSweep& s, const SelectLaunch& launch, const CpuSelect& cpu) {
  std::map<int, Selected> uniform;  // each budget's launch, for the per-row budgets
  for (int budget : s.budgets) {
    Selected got;
    launch(budget, nullptr, &got);
    if (::testing::Test::HasFatalFailure()) return;
    auto cpu_b = [&](int b, retrieval::Selection* sel) {
      retrieval::SelectRequest req;
      req.query = s.query->data() + b * s.query_stride;
      if (s.position != nullptr) req.query_position = (*s.position)[b];
      req.budget = budget;
      req.n_sink = s.cand.begin[b];
      req.local_begin = s.cand.end[b];
      return cpu(b, req, sel);
    };
    const std::string where = s.name + " budget " + std::to_string(budget);
    kvr::cuda::testing::SetAgreement agree;
    CompareWithCpuSelect(got.ids, got.counts, budget, s.n_kv_heads, s.cand.begin, s.cand.end, cpu_b,
                         where, &agree);
    if (::testing::Test::HasFatalFailure()) return;
    s.bar.Expect(where, budget, agree);
    uniform[budget] = std::move(got);
  }
  if (s.row_budgets.empty()) return;
  // A decode batch whose requests ask for different budgets: one launch at the widest budget
  // with row b capped at row_budgets[b] selects, row by row, what a launch at that budget did.
  auto d_budgets = kvr::cuda::testing::Upload(s.row_budgets);
  Selected got;
  launch(s.wide, d_budgets.data(), &got);
  if (::testing::Test::HasFatalFailure()) return;
  ExpectRowsAsAtTheirBudget(got, s.wide, s.n_kv_heads, s.row_budgets, uniform);
}

}  // namespace kvr::gpu_parity
