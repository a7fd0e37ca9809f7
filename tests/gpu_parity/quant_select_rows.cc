// Rows of the GPU pariskv, ctkvr and a2ats kernels (selection.cuh) against the CPU indexes
// (retrieval/src/pariskv.cc, ctkvr.cc, a2ats.cc), built here through the method registry and
// uploaded through the *LayoutFromIndexes helpers (their payload bytes, as a prefill node ships
// them):
//  - ParisKvEncode: codes, weights and centroid counts byte-equal to the CPU index's, encoded in
//    two calls (prefill, then appended tokens); mismatches (a near-tie in a magnitude level or an
//    fp16 rounding, which the CPU order of operations should rule out) are counted and bounded.
//  - ParisKvSelect / CtkvrSelect / A2atsSelect: the selected sets against the CPU Select over
//    shapes, GQA groups and aggregations, budgets and per-sequence candidate ranges. The GPU
//    repeats the CPU's discrete steps in its operation order (collision tiers, bucket threshold,
//    centroid ranks, rerank logits), but kSumSoftmax's exp / sum differ in the last bits, and
//    a2ats's triangular solve / codeword dot products sum in another order than OpenBLAS: a
//    near-tie at the k-th score may resolve differently. Required: every row obeys the contract,
//    counts equal, recall >= 0.99 over each sweep and identical sets on >= 90% of the rows.
//    Outputs and scratch are poisoned before each launch.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/rope.h"
#include "parity.h"
#include "select_check.h"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::DeviceBuffer;
using kvr::cuda::testing::CheckIdRow;
using kvr::cuda::testing::Download;
using kvr::cuda::testing::ExpectAtLeast;
using kvr::cuda::testing::ExpectAtMost;
using kvr::cuda::testing::kPoisonByte;
using kvr::cuda::testing::Poisoned;
using kvr::cuda::testing::Scratch;
using kvr::cuda::testing::SetAgreement;
using kvr::cuda::testing::TopicKeys;
using kvr::cuda::testing::Upload;
using kvr::gpu_parity::CompareWithCpuSelect;
using kvr::gpu_parity::ParityRow;

// Recall / identical-row bookkeeping of one budget's sweep, printed and recorded.
struct Agreement : SetAgreement {
  void Expect(const std::string& what) const {
    std::printf("[ parity ] %s: %d/%d rows identical, recall %.5f\n", what.c_str(), identical, rows,
                recall());
    const std::string k = "k=" + std::to_string(budget) + ": ";
    ExpectAtLeast(k + "recall", recall(), 0.99);
    ExpectAtLeast(k + "identical rows", identical, rows * 9 / 10);
  }
  int budget = 0;
};

// The core and quant methods, registered once for the binary.
MethodRegistry& Registry() {
  static MethodRegistry* r = [] {
    auto* reg = new MethodRegistry;
    EXPECT_TRUE(RegisterCoreMethods(*reg).ok());
    EXPECT_TRUE(RegisterQuantMethods(*reg).ok());
    return reg;
  }();
  return *r;
}

struct QuantCase {
  int head_dim, n_heads, n_kv_heads;
  GqaAggregation gqa;
  int m;  // pariskv subspace_dim
};

std::string CaseName(const std::string& method, const QuantCase& c, int budget) {
  return method + " d" + std::to_string(c.head_dim) + " h" + std::to_string(c.n_heads) + "x" +
         std::to_string(c.n_kv_heads) + " gqa" + std::to_string(static_cast<int>(c.gqa)) + " m" +
         std::to_string(c.m) + " budget " + std::to_string(budget);
}

std::string ShapeName(const QuantCase& c) {
  return "d" + std::to_string(c.head_dim) + "_h" + std::to_string(c.n_heads) + "x" +
         std::to_string(c.n_kv_heads) + "_gqa" + std::to_string(static_cast<int>(c.gqa)) +
         (c.m > 0 ? "_m" + std::to_string(c.m) : "");
}

// ---- ParisKV encode -------------------------------------------------------------------------

void ParisKvEncodeRow(int hd, int m) {
  const int nkv = 3, n = 3000, n_first = 2000;
  std::mt19937 rng(100 + hd + m);
  std::vector<float> keys = TopicKeys(n, nkv, hd, rng, m);
  // A zero key and a key with one huge channel exercise the degenerate paths.
  std::fill_n(keys.begin() + static_cast<size_t>(5) * nkv * hd, nkv * hd, 0.f);
  keys[static_cast<size_t>(9) * nkv * hd + 3] = 3e4f;
  IndexShape shape;
  shape.n_heads = nkv * 2;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  IndexParams params;
  params.options["pariskv.subspace_dim"] = std::to_string(m);
  auto index = Registry().Make("pariskv", shape, params);
  ASSERT_TRUE(index.ok()) << index.status();
  BuildInput in;
  in.keys = {keys.data(), n_first, static_cast<int64_t>(nkv) * hd};
  ASSERT_OK((*index)->Build(in));
  AppendInput app;
  app.keys = {keys.data() + static_cast<size_t>(n_first) * nkv * hd, n - n_first,
              static_cast<int64_t>(nkv) * hd};
  ASSERT_OK((*index)->Append(app));
  const RetrievalIndex* view = index->get();
  auto layout = ParisKvLayoutFromIndexes(std::span<const RetrievalIndex* const>(&view, 1));
  ASSERT_TRUE(layout.ok()) << layout.status();
  const ParisKvCodec& codec = layout->codec;
  const int pd = codec.padded_dim, n_sub = pd / m;
  ASSERT_EQ(layout->max_tokens, n);

  auto d_keys = Upload(keys);
  auto codes = DeviceBuffer<uint8_t>::Create(layout->codes.size());
  auto weights = DeviceBuffer<uint16_t>::Create(layout->weights.size());
  auto counts = DeviceBuffer<uint32_t>::Create(layout->counts.size());
  ASSERT_TRUE(codes.ok() && weights.ok() && counts.ok());
  ASSERT_EQ(cudaMemset(codes->data(), 0xab, codes->bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemset(weights->data(), 0xff, weights->bytes()), cudaSuccess);  // NaN fp16
  ASSERT_EQ(cudaMemset(counts->data(), 0, counts->bytes()), cudaSuccess);
  for (const auto& [first, count] : {std::pair{0, n_first}, std::pair{n_first, n - n_first}}) {
    ParisKvEncodeParams p;
    p.n_tokens = count;
    p.n_kv_heads = nkv;
    p.codec = codec;
    p.keys = d_keys.data() + static_cast<size_t>(first) * nkv * hd;
    p.key_token_stride = static_cast<int64_t>(nkv) * hd;
    p.first = first;
    p.codes = codes->data();
    p.codes_head_stride = static_cast<int64_t>(n) * (pd / 2);
    p.weights = weights->data();
    p.weights_head_stride = static_cast<int64_t>(n) * n_sub;
    p.counts = counts->data();
    ASSERT_OK(ParisKvEncode(p, nullptr));
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto g_codes = Download(*codes, layout->codes.size());
  const auto g_weights = Download(*weights, layout->weights.size());
  const auto g_counts = Download(*counts, layout->counts.size());
  int64_t code_diff = 0, weight_diff = 0, big_weight_diff = 0;
  for (size_t i = 0; i < g_codes.size(); ++i) code_diff += g_codes[i] != layout->codes[i];
  for (size_t i = 0; i < g_weights.size(); ++i) {
    if (g_weights[i] != layout->weights[i]) {
      ++weight_diff;
      // A near-tie may flip the last fp16 bit; anything more is a bug.
      big_weight_diff += std::abs(static_cast<int>(g_weights[i]) - layout->weights[i]) > 1;
    }
  }
  std::printf("[ parity ] pariskv encode d%d m%d: %lld/%zu code bytes, %lld/%zu weights differ\n",
              hd, m, static_cast<long long>(code_diff), g_codes.size(),
              static_cast<long long>(weight_diff), g_weights.size());
  ExpectAtMost("code bytes != CPU", static_cast<double>(code_diff),
               static_cast<double>(g_codes.size() / 2000));
  ExpectAtMost("fp16 weights != CPU", static_cast<double>(weight_diff),
               static_cast<double>(g_weights.size() / 2000));
  ExpectAtMost("weights off by > 1 ulp", static_cast<double>(big_weight_diff), 0);
  if (code_diff == 0) {
    EXPECT_EQ(g_counts, layout->counts) << "d" << hd << " m" << m;
  }
}

// ---- ParisKV select -------------------------------------------------------------------------

void ParisKvSelectRow(const QuantCase& c) {
  const int hd = c.head_dim, nh = c.n_heads, nkv = c.n_kv_heads;
  const std::vector<int> ctx = {600, 5000, 20000};
  const int n_append = 40;
  const int batch = static_cast<int>(ctx.size());
  std::mt19937 rng(7 + hd + nh);
  IndexShape shape;
  shape.n_heads = nh;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  IndexParams params;
  params.gqa = c.gqa;
  params.options["pariskv.subspace_dim"] = std::to_string(c.m);
  std::vector<std::unique_ptr<RetrievalIndex>> indexes;
  std::vector<const RetrievalIndex*> views;
  for (int b = 0; b < batch; ++b) {
    const int n = ctx[b] + n_append;
    std::vector<float> keys = TopicKeys(n, nkv, hd, rng, b);
    auto index = Registry().Make("pariskv", shape, params);
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
  auto layout = ParisKvLayoutFromIndexes(views);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> query(static_cast<size_t>(batch) * nh * hd);
  for (float& x : query) x = 1.5f * nd(rng);
  std::vector<int32_t> begin(batch), end(batch);
  int max_cand = 0;
  for (int b = 0; b < batch; ++b) {
    begin[b] = 16;
    end[b] = ctx[b] + n_append - 64;
    max_cand = std::max(max_cand, end[b] - begin[b]);
  }
  auto d_query = Upload(query);
  auto d_begin = Upload(begin);
  auto d_end = Upload(end);
  auto d_codes = Upload(layout->codes);
  auto d_weights = Upload(layout->weights);
  auto d_counts = Upload(layout->counts);
  auto d_ntok = Upload(layout->n_tokens);
  for (int budget : {1, 64, 256, 1024}) {
    ParisKvSelectParams p;
    p.batch = batch;
    p.n_heads = nh;
    p.n_kv_heads = nkv;
    p.scale = 1.f / std::sqrt(static_cast<float>(hd));
    p.gqa = c.gqa;
    p.codec = layout->codec;
    p.query = d_query.data();
    p.codes = d_codes.data();
    p.weights = d_weights.data();
    p.counts = d_counts.data();
    p.n_tokens = d_ntok.data();
    p.max_tokens = layout->max_tokens;
    p.cand = {d_begin.data(), d_end.data()};
    p.max_candidates = max_cand;
    p.out.budget = budget;
    auto ids = Poisoned<int32_t>(batch * nkv * budget, kPoisonByte);
    auto counts = Poisoned<int32_t>(batch * nkv, kPoisonByte);
    auto ws = Scratch(ParisKvSelectWorkspaceBytes(p));
    p.out = {budget, ids.data(), counts.data()};
    p.workspace = ws.data();
    p.workspace_bytes = ws.bytes();
    ASSERT_OK(ParisKvSelect(p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto h_ids = Download(ids, batch * nkv * budget);
    const auto h_counts = Download(counts, batch * nkv);
    Agreement agree;
    agree.budget = budget;
    auto cpu = [&](int b, Selection* sel) {
      SelectRequest req;
      req.query = query.data() + static_cast<size_t>(b) * nh * hd;
      req.budget = budget;
      req.n_sink = begin[b];
      req.local_begin = end[b];
      return indexes[b]->Select(req, sel);
    };
    CompareWithCpuSelect(h_ids, h_counts, budget, nkv, begin, end, cpu,
                         CaseName("pariskv", c, budget), &agree);
    if (::testing::Test::HasFatalFailure()) return;
    agree.Expect(CaseName("pariskv", c, budget));
  }
}

// ---- CTKVR select ---------------------------------------------------------------------------

void CtkvrSelectRow(const QuantCase& c) {
  const int hd = c.head_dim, nh = c.n_heads, nkv = c.n_kv_heads;
  const std::vector<int> ctx = {500, 4000, 12000};
  const int n_append = 30, n_queries = 96;
  const int batch = static_cast<int>(ctx.size());
  std::mt19937 rng(31 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  IndexShape shape;
  shape.n_heads = nh;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  IndexParams params;
  params.gqa = c.gqa;
  params.n_sink = 16;
  params.budget = 128;  // rho = 2.5 x 128 = 320 keys per list
  params.ctkvr.n_centroids = 64;
  params.ctkvr.n_recall = 4;
  params.ctkvr.fifo_size = 0;  // the GPU selector keeps the qcIVF read-only
  std::vector<std::unique_ptr<RetrievalIndex>> indexes;
  std::vector<const RetrievalIndex*> views;
  for (int b = 0; b < batch; ++b) {
    const int n = ctx[b] + n_append;
    std::vector<float> keys = TopicKeys(n, nkv, hd, rng, b);
    // Prefill queries near the keys' topics, so that lists differ between centroids.
    std::vector<float> queries(static_cast<size_t>(n_queries) * nh * hd);
    for (int i = 0; i < n_queries; ++i)
      for (int qh = 0; qh < nh; ++qh) {
        const int src = (i * 37 + qh * 11) % ctx[b];
        const int kvh = qh / (nh / nkv);
        for (int d = 0; d < hd; ++d) {
          queries[(static_cast<size_t>(i) * nh + qh) * hd + d] =
              keys[(static_cast<size_t>(src) * nkv + kvh) * hd + d] + 0.5f * nd(rng);
        }
      }
    auto index = Registry().Make("ctkvr", shape, params);
    ASSERT_TRUE(index.ok()) << index.status();
    BuildInput in;
    in.keys = {keys.data(), ctx[b], static_cast<int64_t>(nkv) * hd};
    in.queries = {queries.data(), n_queries, static_cast<int64_t>(nh) * hd};
    in.queries_first_position = ctx[b] - n_queries;
    ASSERT_OK((*index)->Build(in));
    AppendInput app;
    app.keys = {keys.data() + static_cast<size_t>(ctx[b]) * nkv * hd, n_append,
                static_cast<int64_t>(nkv) * hd};
    ASSERT_OK((*index)->Append(app));
    views.push_back(index->get());
    indexes.push_back(std::move(*index));
  }
  auto layout = CtkvrLayoutFromIndexes(views);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> query(static_cast<size_t>(batch) * nh * hd);
  for (int b = 0; b < batch; ++b)
    for (int qh = 0; qh < nh; ++qh) {
      const int kvh = qh / (nh / nkv);
      const int src = (ctx[b] / 3 + 17 * qh) % ctx[b];
      for (int d = 0; d < hd; ++d)
        query[(static_cast<size_t>(b) * nh + qh) * hd + d] =
            layout
                ->keys[((static_cast<size_t>(b) * layout->max_tokens + src) * nkv + kvh) * hd + d] +
            0.8f * nd(rng);
    }
  std::vector<int32_t> begin(batch), end(batch);
  for (int b = 0; b < batch; ++b) {
    begin[b] = 16;
    end[b] = ctx[b] + n_append - 20;
  }
  auto d_query = Upload(query);
  auto d_begin = Upload(begin);
  auto d_end = Upload(end);
  auto d_cent = Upload(layout->centroids);
  auto d_nc = Upload(layout->n_centroids);
  auto d_off = Upload(layout->list_offsets);
  auto d_lists = Upload(layout->lists);
  auto d_keys = Upload(layout->keys);
  for (int budget : {1, 64, 256, 1024}) {
    CtkvrSelectParams p;
    p.batch = batch;
    p.n_heads = nh;
    p.n_kv_heads = nkv;
    p.head_dim = hd;
    p.scale = 1.f / std::sqrt(static_cast<float>(hd));
    p.gqa = c.gqa;
    p.n_recall = layout->n_recall;
    p.query = d_query.data();
    p.centroids = d_cent.data();
    p.n_centroids = d_nc.data();
    p.list_offsets = d_off.data();
    p.lists = d_lists.data();
    p.max_centroids = layout->max_centroids;
    p.max_list_entries = layout->max_list_entries;
    p.max_list_length = layout->max_list_length;
    p.max_tokens = layout->max_tokens;
    p.keys.data = d_keys.data();
    p.keys.dtype = KeyDType::kF32;
    p.keys.token_stride = static_cast<int64_t>(nkv) * hd;
    p.keys.head_stride = hd;
    p.keys.batch_stride = static_cast<int64_t>(layout->max_tokens) * nkv * hd;
    p.cand = {d_begin.data(), d_end.data()};
    p.out.budget = budget;
    auto ids = Poisoned<int32_t>(batch * nkv * budget, kPoisonByte);
    auto counts = Poisoned<int32_t>(batch * nkv, kPoisonByte);
    auto ws = Scratch(CtkvrSelectWorkspaceBytes(p));
    p.out = {budget, ids.data(), counts.data()};
    p.workspace = ws.data();
    p.workspace_bytes = ws.bytes();
    ASSERT_OK(CtkvrSelect(p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto h_ids = Download(ids, batch * nkv * budget);
    const auto h_counts = Download(counts, batch * nkv);
    Agreement agree;
    agree.budget = budget;
    auto cpu = [&](int b, Selection* sel) {
      SelectRequest req;
      req.query = query.data() + static_cast<size_t>(b) * nh * hd;
      req.budget = budget;
      req.n_sink = begin[b];
      req.local_begin = end[b];
      return indexes[b]->Select(req, sel);
    };
    CompareWithCpuSelect(h_ids, h_counts, budget, nkv, begin, end, cpu,
                         CaseName("ctkvr", c, budget), &agree);
    if (::testing::Test::HasFatalFailure()) return;
    agree.Expect(CaseName("ctkvr", c, budget));
  }
}

// ---- A2ATS select ---------------------------------------------------------------------------

void A2atsSelectRow(const QuantCase& c) {
  const int hd = c.head_dim, nh = c.n_heads, nkv = c.n_kv_heads;
  const int codebook_size = hd == 128 ? 512 : 256;
  std::mt19937 rng(53 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  ModelFingerprint model;
  model.model_name = "a2ats-gpu-test";
  model.n_layers = 1;
  model.n_heads = nh;
  model.n_kv_heads = nkv;
  model.head_dim = hd;
  model.rope = {RopeStyle::kHalfSplit, 10000.f, 0};
  CodebookParams cp;
  cp.codebook_size = codebook_size;
  cp.wrope_offset = 1024;
  std::vector<HeadCodebook> heads(nkv);
  for (HeadCodebook& book : heads) {
    book.head_dim = hd;
    book.size = codebook_size;
    book.chol.assign(static_cast<size_t>(hd) * hd, 0.f);
    for (int i = 0; i < hd; ++i) {
      for (int j = 0; j < i; ++j) book.chol[static_cast<size_t>(i) * hd + j] = 0.05f * nd(rng);
      book.chol[static_cast<size_t>(i) * hd + i] = 0.7f + 0.6f * std::abs(nd(rng)) / 3.f;
    }
    book.codewords.resize(static_cast<size_t>(codebook_size) * hd);
    for (float& x : book.codewords) x = nd(rng);
    book.Finalize();
  }
  auto books = std::make_shared<const A2atsCodebooks>(model, cp, std::move(heads), 1000, 1000);
  IndexShape shape;
  shape.n_heads = nh;
  shape.n_kv_heads = nkv;
  shape.head_dim = hd;
  shape.layer = 0;
  shape.n_layers = 1;
  shape.rope = model.rope;
  IndexParams params;
  params.gqa = c.gqa;
  params.assets = books;
  const std::vector<int> ctx = {300, 5000, 20000};
  const int n_append = 25;
  const int batch = static_cast<int>(ctx.size());
  std::vector<std::unique_ptr<RetrievalIndex>> indexes;
  std::vector<const RetrievalIndex*> views;
  for (int b = 0; b < batch; ++b) {
    const int n = ctx[b] + n_append;
    std::vector<float> keys = TopicKeys(n, nkv, hd, rng, b);
    auto index = Registry().Make("a2ats", shape, params);
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
  auto layout = A2atsLayoutFromIndexes(views, *books);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> query(static_cast<size_t>(batch) * nh * hd);
  for (float& x : query) x = 1.5f * nd(rng);
  std::vector<int64_t> position(batch);
  std::vector<int32_t> begin(batch), end(batch);
  int max_cand = 0;
  for (int b = 0; b < batch; ++b) {
    position[b] = ctx[b] + n_append;
    begin[b] = 16;
    end[b] = ctx[b] + n_append - 64;
    max_cand = std::max(max_cand, end[b] - begin[b]);
  }
  auto d_query = Upload(query);
  auto d_pos = Upload(position);
  auto d_begin = Upload(begin);
  auto d_end = Upload(end);
  auto d_chol = Upload(layout->chol_inv);
  auto d_cw = Upload(layout->codewords);
  auto d_ids = Upload(layout->ids);
  auto d_ntok = Upload(layout->n_tokens);
  for (int budget : {1, 64, 256, 1024}) {
    A2atsSelectParams p;
    p.batch = batch;
    p.n_heads = nh;
    p.n_kv_heads = nkv;
    p.head_dim = hd;
    p.scale = 1.f / std::sqrt(static_cast<float>(hd));
    p.gqa = c.gqa;
    p.rope = layout->rope;
    p.wrope_offset = layout->wrope_offset;
    p.codebook_size = layout->codebook_size;
    p.chol_inv = d_chol.data();
    p.codewords = d_cw.data();
    p.query = d_query.data();
    p.query_position = d_pos.data();
    p.ids = d_ids.data();
    p.n_tokens = d_ntok.data();
    p.max_tokens = layout->max_tokens;
    p.cand = {d_begin.data(), d_end.data()};
    p.max_candidates = max_cand;
    p.out.budget = budget;
    auto ids = Poisoned<int32_t>(batch * nkv * budget, kPoisonByte);
    auto counts = Poisoned<int32_t>(batch * nkv, kPoisonByte);
    auto ws = Scratch(A2atsSelectWorkspaceBytes(p));
    p.out = {budget, ids.data(), counts.data()};
    p.workspace = ws.data();
    p.workspace_bytes = ws.bytes();
    ASSERT_OK(A2atsSelect(p, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto h_ids = Download(ids, batch * nkv * budget);
    const auto h_counts = Download(counts, batch * nkv);
    Agreement agree;
    agree.budget = budget;
    auto cpu = [&](int b, Selection* sel) {
      SelectRequest req;
      req.query = query.data() + static_cast<size_t>(b) * nh * hd;
      req.query_position = position[b];
      req.budget = budget;
      req.n_sink = begin[b];
      req.local_begin = end[b];
      return indexes[b]->Select(req, sel);
    };
    CompareWithCpuSelect(h_ids, h_counts, budget, nkv, begin, end, cpu,
                         CaseName("a2ats", c, budget), &agree);
    if (::testing::Test::HasFatalFailure()) return;
    agree.Expect(CaseName("a2ats", c, budget));
  }
}

class QuantSelectContract : public kvr::cuda::testing::GpuTest {};

TEST_F(QuantSelectContract, LaunchersRejectBadShapes) {
  ParisKvSelectParams pk;
  pk.batch = 1;
  pk.n_heads = 32;
  pk.n_kv_heads = 8;
  pk.codec.head_dim = 96;
  pk.codec.padded_dim = 128;
  pk.out.budget = 16;
  EXPECT_EQ(ParisKvSelect(pk, nullptr).code(), absl::StatusCode::kInvalidArgument);
  pk.codec.head_dim = 128;
  pk.codec.subspace_dim = 2;  // P / m = 64 lanes: unsupported
  EXPECT_EQ(ParisKvSelect(pk, nullptr).code(), absl::StatusCode::kInvalidArgument);
  pk.codec.subspace_dim = 8;
  EXPECT_EQ(ParisKvSelect(pk, nullptr).code(), absl::StatusCode::kInvalidArgument);  // null ptrs
  CtkvrSelectParams ck;
  ck.batch = 1;
  ck.n_heads = 32;
  ck.n_kv_heads = 8;
  ck.head_dim = 128;
  ck.n_recall = 64;
  ck.out.budget = 16;
  EXPECT_EQ(CtkvrSelect(ck, nullptr).code(), absl::StatusCode::kInvalidArgument);
  A2atsSelectParams ak;
  ak.batch = 1;
  ak.n_heads = 32;
  ak.n_kv_heads = 8;
  ak.head_dim = 128;
  ak.codebook_size = 100000;
  ak.out.budget = 16;
  EXPECT_EQ(A2atsSelect(ak, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvr::retrieval::cuda

namespace kvr::gpu_parity {

std::vector<ParityRow> QuantSelectRows() {
  using namespace kvr::retrieval;
  using namespace kvr::retrieval::cuda;
  std::vector<ParityRow> rows;
  for (const auto& [hd, m] : {std::tuple{128, 8}, std::tuple{64, 8}, std::tuple{128, 4},
                              std::tuple{64, 4}, std::tuple{64, 2}}) {
    rows.push_back({"ParisKvEncode",
                    "d" + std::to_string(hd) + "_m" + std::to_string(m) + " h3 n3000 in 2 calls",
                    "pariskv index payload", "bytes equal but <= 1/2000 near-ties",
                    [hd = hd, m = m] { ParisKvEncodeRow(hd, m); }});
  }
  for (const QuantCase& c : {QuantCase{128, 32, 8, GqaAggregation::kSumSoftmax, 8},
                             QuantCase{64, 9, 3, GqaAggregation::kSumSoftmax, 8},
                             QuantCase{64, 8, 4, GqaAggregation::kMaxLogit, 4},
                             QuantCase{128, 32, 4, GqaAggregation::kSumLogit, 8}}) {
    rows.push_back({"ParisKvSelect", ShapeName(c) + " k1,64,256,1024", "pariskv index",
                    "recall >= 0.99, >= 90% rows identical", [=] { ParisKvSelectRow(c); }});
  }
  const QuantCase shapes[] = {QuantCase{128, 32, 8, GqaAggregation::kSumSoftmax, 0},
                              QuantCase{64, 9, 3, GqaAggregation::kSumSoftmax, 0},
                              QuantCase{64, 8, 4, GqaAggregation::kMaxLogit, 0},
                              QuantCase{128, 32, 4, GqaAggregation::kSumLogit, 0}};
  for (const QuantCase& c : shapes) {
    rows.push_back({"CtkvrSelect", ShapeName(c) + " k1,64,256,1024", "ctkvr index",
                    "recall >= 0.99, >= 90% rows identical", [=] { CtkvrSelectRow(c); }});
  }
  for (const QuantCase& c : shapes) {
    rows.push_back({"A2atsSelect", ShapeName(c) + " k1,64,256,1024", "a2ats index",
                    "recall >= 0.99, >= 90% rows identical", [=] { A2atsSelectRow(c); }});
  }
  return rows;
}

}  // namespace kvr::gpu_parity
