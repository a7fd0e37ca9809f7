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
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/common/half.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/registry.h"
#include "kvr/retrieval/rope.h"
#include "parity.h"
#include "select_sweep.h"

namespace kvr::gpu_parity {
namespace {

using namespace kvr::retrieval;
using namespace kvr::retrieval::cuda;
using namespace kvr::cuda::testing;

// The bar of every quantised selector: recall >= 0.99, identical sets on >= 90% of the rows.
const AgreementBar kQuantBar{"recall", 0.99};
const std::vector<int> kBudgets = {1, 64, 256, 1024};

// The sweep of one quantised selector over a batch.
SelectSweep Sweep(const std::string& method, const SelectCase& c, const std::vector<float>& query,
                  const Candidates& cand) {
  return SweepOf(method + " " + ShapeName(c), c, query, cand, kBudgets, kQuantBar);
}

// Context lengths plus the appended tokens of each sequence.
std::vector<int> Plus(std::vector<int> ctx, int n_append) {
  for (int& x : ctx) x += n_append;
  return ctx;
}

// ---- ParisKV encode -------------------------------------------------------------------------

// bf16: the keys rounded to bf16 are encoded from their bits (a prefill's export) and must give
// the CPU's codes of the same values widened.
void ParisKvEncodeRow(int hd, int m, bool bf16) {
  const int nkv = 3, n = 3000, n_first = 2000;
  std::mt19937 rng(100 + hd + m);
  std::vector<float> keys = TopicKeys(n, nkv, hd, rng, m);
  // A zero key and a key with one huge channel exercise the degenerate paths.
  std::fill_n(keys.begin() + static_cast<size_t>(5) * nkv * hd, nkv * hd, 0.f);
  keys[static_cast<size_t>(9) * nkv * hd + 3] = 3e4f;
  std::vector<uint16_t> keys_bf16;
  if (bf16) {
    keys_bf16.resize(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      keys_bf16[i] = FloatToBf16(keys[i]);
      keys[i] = Bf16ToFloat(keys_bf16[i]);
    }
  }
  IndexParams params;
  params.options["pariskv.subspace_dim"] = std::to_string(m);
  CpuIndexes cpu;
  BuildCpuIndexes(
      "pariskv", ShapeOf(nkv * 2, nkv, hd), params, {n_first}, n - n_first,
      [&](int) { return keys; }, nullptr, &cpu);
  if (::testing::Test::HasFatalFailure()) return;
  auto layout = ParisKvLayoutFromIndexes(cpu.views);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const ParisKvCodec& codec = layout->codec;
  const int pd = codec.padded_dim, n_sub = pd / m;
  ASSERT_EQ(layout->max_tokens, n);

  auto d_keys = Upload(keys);
  auto d_keys_bf16 = Upload(keys_bf16);
  auto codes = Poisoned<uint8_t>(layout->codes.size(), 0xab);
  auto weights = Poisoned<uint16_t>(layout->weights.size(), kNanByte);  // NaN fp16
  auto counts = Poisoned<uint32_t>(layout->counts.size(), 0);
  for (const auto& [first, count] : {std::pair{0, n_first}, std::pair{n_first, n - n_first}}) {
    ParisKvEncodeParams p;
    p.n_tokens = count;
    p.n_kv_heads = nkv;
    p.codec = codec;
    if (bf16) {
      p.keys.data = d_keys_bf16.data() + static_cast<size_t>(first) * nkv * hd;
      p.keys.dtype = KeyDType::kBf16;
    } else {
      p.keys.data = d_keys.data() + static_cast<size_t>(first) * nkv * hd;
      p.keys.dtype = KeyDType::kF32;
    }
    p.keys.token_stride = static_cast<int64_t>(nkv) * hd;
    p.keys.head_stride = hd;
    p.first = first;
    p.codes = codes.data();
    p.codes_head_stride = static_cast<int64_t>(n) * (pd / 2);
    p.weights = weights.data();
    p.weights_head_stride = static_cast<int64_t>(n) * n_sub;
    p.counts = counts.data();
    ASSERT_OK(ParisKvEncode(p, nullptr));
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto g_codes = Download(codes, layout->codes.size());
  const auto g_weights = Download(weights, layout->weights.size());
  const auto g_counts = Download(counts, layout->counts.size());
  int64_t code_diff = 0, weight_diff = 0, big_weight_diff = 0;
  for (size_t i = 0; i < g_codes.size(); ++i) code_diff += g_codes[i] != layout->codes[i];
  for (size_t i = 0; i < g_weights.size(); ++i) {
    if (g_weights[i] != layout->weights[i]) {
      ++weight_diff;
      // A near-tie may flip the last fp16 bit; anything more is a bug.
      big_weight_diff += std::abs(static_cast<int>(g_weights[i]) - layout->weights[i]) > 1;
    }
  }
  std::printf("[ parity ] pariskv encode d%d m%d%s: %lld/%zu code bytes, %lld/%zu weights differ\n",
              hd, m, bf16 ? " bf16" : "", static_cast<long long>(code_diff), g_codes.size(),
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

void ParisKvSelectRow(const SelectCase& c) {
  const int hd = c.hd, nh = c.nh, nkv = c.nkv;
  const std::vector<int> ctx = {600, 5000, 20000};
  const int n_append = 40;
  const int batch = static_cast<int>(ctx.size());
  std::mt19937 rng(7 + hd + nh);
  IndexParams params;
  params.gqa = c.gqa;
  params.options["pariskv.subspace_dim"] = std::to_string(c.m);
  CpuIndexes cpu;
  BuildCpuIndexes(
      "pariskv", ShapeOf(nh, nkv, hd), params, ctx, n_append,
      [&](int b) { return TopicKeys(ctx[b] + n_append, nkv, hd, rng, b); }, nullptr, &cpu);
  if (::testing::Test::HasFatalFailure()) return;
  auto layout = ParisKvLayoutFromIndexes(cpu.views);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::vector<float> query = Normal(static_cast<size_t>(batch) * nh * hd, 1.5f, nd, rng);
  const Candidates cand = CandidatesOf(Plus(ctx, n_append), 16, 64);
  const DeviceInputs in = UploadInputs(query, cand);
  auto d_codes = Upload(layout->codes);
  auto d_weights = Upload(layout->weights);
  auto d_counts = Upload(layout->counts);
  auto d_ntok = Upload(layout->n_tokens);
  auto launch = Launcher<ParisKvSelectParams>(
      c, batch, in,
      [&](ParisKvSelectParams& p) {
        p.codec = layout->codec;
        p.codes = d_codes.data();
        p.weights = d_weights.data();
        p.counts = d_counts.data();
        p.n_tokens = d_ntok.data();
        p.max_tokens = layout->max_tokens;
      },
      ParisKvSelectWorkspaceBytes, ParisKvSelect);
  RunSelectSweep(Sweep("pariskv", c, query, cand), launch, SelectOn(cpu));
}

// ---- CTKVR select ---------------------------------------------------------------------------

void CtkvrSelectRow(const SelectCase& c) {
  const int hd = c.hd, nh = c.nh, nkv = c.nkv;
  const std::vector<int> ctx = {500, 4000, 12000};
  const int n_append = 30, n_queries = 96;
  const int batch = static_cast<int>(ctx.size());
  std::mt19937 rng(31 + hd + nh);
  std::normal_distribution<float> nd(0.f, 1.f);
  IndexParams params;
  params.gqa = c.gqa;
  params.n_sink = 16;
  params.budget = 128;  // rho = 2.5 x 128 = 320 keys per list
  params.ctkvr.n_centroids = 64;
  params.ctkvr.n_recall = 4;
  params.ctkvr.fifo_size = 0;  // the GPU selector keeps the qcIVF read-only
  // Prefill queries near the keys' topics, so that lists differ between centroids.
  std::vector<float> queries(static_cast<size_t>(n_queries) * nh * hd);
  auto prefill = [&](int b, const std::vector<float>& keys, BuildInput* in) {
    for (int i = 0; i < n_queries; ++i)
      for (int qh = 0; qh < nh; ++qh) {
        const int src = (i * 37 + qh * 11) % ctx[b];
        const int kvh = qh / (nh / nkv);
        for (int d = 0; d < hd; ++d) {
          queries[(static_cast<size_t>(i) * nh + qh) * hd + d] =
              keys[(static_cast<size_t>(src) * nkv + kvh) * hd + d] + 0.5f * nd(rng);
        }
      }
    in->queries = {queries.data(), n_queries, static_cast<int64_t>(nh) * hd};
    in->queries_first_position = ctx[b] - n_queries;
  };
  CpuIndexes cpu;
  BuildCpuIndexes(
      "ctkvr", ShapeOf(nh, nkv, hd), params, ctx, n_append,
      [&](int b) { return TopicKeys(ctx[b] + n_append, nkv, hd, rng, b); }, prefill, &cpu);
  if (::testing::Test::HasFatalFailure()) return;
  auto layout = CtkvrLayoutFromIndexes(cpu.views);
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
  const Candidates cand = CandidatesOf(Plus(ctx, n_append), 16, 20);
  const DeviceInputs in = UploadInputs(query, cand);
  auto d_cent = Upload(layout->centroids);
  auto d_nc = Upload(layout->n_centroids);
  auto d_off = Upload(layout->list_offsets);
  auto d_lists = Upload(layout->lists);
  auto d_keys = Upload(layout->keys);
  auto launch = Launcher<CtkvrSelectParams>(
      c, batch, in,
      [&](CtkvrSelectParams& p) {
        p.n_recall = layout->n_recall;
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
      },
      CtkvrSelectWorkspaceBytes, CtkvrSelect);
  RunSelectSweep(Sweep("ctkvr", c, query, cand), launch, SelectOn(cpu));
}

// ---- A2ATS select ---------------------------------------------------------------------------

void A2atsSelectRow(const SelectCase& c) {
  const int hd = c.hd, nh = c.nh, nkv = c.nkv;
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
  IndexShape shape = ShapeOf(nh, nkv, hd);
  shape.layer = 0;
  shape.n_layers = 1;
  shape.rope = model.rope;
  IndexParams params;
  params.gqa = c.gqa;
  params.assets = books;
  const std::vector<int> ctx = {300, 5000, 20000};
  const int n_append = 25;
  const int batch = static_cast<int>(ctx.size());
  CpuIndexes cpu;
  BuildCpuIndexes(
      "a2ats", shape, params, ctx, n_append,
      [&](int b) { return TopicKeys(ctx[b] + n_append, nkv, hd, rng, b); }, nullptr, &cpu);
  if (::testing::Test::HasFatalFailure()) return;
  auto layout = A2atsLayoutFromIndexes(cpu.views, *books);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<float> query = Normal(static_cast<size_t>(batch) * nh * hd, 1.5f, nd, rng);
  const std::vector<int> n = Plus(ctx, n_append);
  const std::vector<int64_t> position(n.begin(), n.end());
  const Candidates cand = CandidatesOf(n, 16, 64);
  const DeviceInputs in = UploadInputs(query, cand);
  auto d_pos = Upload(position);
  auto d_chol = Upload(layout->chol_inv);
  auto d_cw = Upload(layout->codewords);
  auto d_ids = Upload(layout->ids);
  auto d_ntok = Upload(layout->n_tokens);
  auto launch = Launcher<A2atsSelectParams>(
      c, batch, in,
      [&](A2atsSelectParams& p) {
        p.rope = layout->rope;
        p.wrope_offset = layout->wrope_offset;
        p.codebook_size = layout->codebook_size;
        p.chol_inv = d_chol.data();
        p.codewords = d_cw.data();
        p.query_position = d_pos.data();
        p.ids = d_ids.data();
        p.n_tokens = d_ntok.data();
        p.max_tokens = layout->max_tokens;
      },
      A2atsSelectWorkspaceBytes, A2atsSelect);
  SelectSweep sweep = Sweep("a2ats", c, query, cand);
  sweep.position = &position;
  RunSelectSweep(sweep, launch, SelectOn(cpu));
}

class QuantSelectContract : public kvr::cuda::testing::GpuTest {};

TEST_F(QuantSelectContract, LaunchersRejectBadShapes) {
  auto pk = ContractParams<ParisKvSelectParams>();
  pk.codec.head_dim = 96;
  pk.codec.padded_dim = 128;
  EXPECT_EQ(ParisKvSelect(pk, nullptr).code(), absl::StatusCode::kInvalidArgument);
  pk.codec.head_dim = 128;
  pk.codec.subspace_dim = 2;  // P / m = 64 lanes: unsupported
  EXPECT_EQ(ParisKvSelect(pk, nullptr).code(), absl::StatusCode::kInvalidArgument);
  pk.codec.subspace_dim = 8;
  EXPECT_EQ(ParisKvSelect(pk, nullptr).code(), absl::StatusCode::kInvalidArgument);  // null ptrs
  auto ck = ContractParams<CtkvrSelectParams>();
  ck.n_recall = 64;
  EXPECT_EQ(CtkvrSelect(ck, nullptr).code(), absl::StatusCode::kInvalidArgument);
  auto ak = ContractParams<A2atsSelectParams>();
  ak.codebook_size = 100000;
  EXPECT_EQ(A2atsSelect(ak, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace

std::vector<ParityRow> QuantSelectRows() {
  std::vector<ParityRow> rows;
  for (const auto& [hd, m] : {std::tuple{128, 8}, std::tuple{64, 8}, std::tuple{128, 4},
                              std::tuple{64, 4}, std::tuple{64, 2}}) {
    rows.push_back({"ParisKvEncode",
                    "d" + std::to_string(hd) + "_m" + std::to_string(m) + " h3 n3000 in 2 calls",
                    "pariskv index payload", "bytes equal but <= 1/2000 near-ties",
                    [hd = hd, m = m] { ParisKvEncodeRow(hd, m, false); }});
  }
  for (const auto& [hd, m] : {std::tuple{128, 8}, std::tuple{64, 8}}) {
    rows.push_back({"ParisKvEncode",
                    "d" + std::to_string(hd) + "_m" + std::to_string(m) + " bf16 keys h3 n3000",
                    "pariskv index payload of the widened keys",
                    "bytes equal but <= 1/2000 near-ties",
                    [hd = hd, m = m] { ParisKvEncodeRow(hd, m, true); }});
  }
  using G = GqaAggregation;
  constexpr KeyDType kF32 = KeyDType::kF32;  // the quantised selectors read no key dtype
  for (const SelectCase& c :
       {SelectCase{kF32, 128, 32, 8, G::kSumSoftmax, 8},
        SelectCase{kF32, 64, 9, 3, G::kSumSoftmax, 8}, SelectCase{kF32, 64, 8, 4, G::kMaxLogit, 4},
        SelectCase{kF32, 128, 32, 4, G::kSumLogit, 8}}) {
    rows.push_back({"ParisKvSelect", ShapeName(c) + " k1,64,256,1024", "pariskv index",
                    "recall >= 0.99, >= 90% rows identical", [=] { ParisKvSelectRow(c); }});
  }
  const SelectCase shapes[] = {{kF32, 128, 32, 8, G::kSumSoftmax},
                               {kF32, 64, 9, 3, G::kSumSoftmax},
                               {kF32, 64, 8, 4, G::kMaxLogit},
                               {kF32, 128, 32, 4, G::kSumLogit}};
  for (const auto& [kernel, reference, run] :
       {std::tuple{"CtkvrSelect", "ctkvr index", &CtkvrSelectRow},
        std::tuple{"A2atsSelect", "a2ats index", &A2atsSelectRow}}) {
    for (const SelectCase& c : shapes) {
      rows.push_back({kernel, ShapeName(c) + " k1,64,256,1024", reference,
                      "recall >= 0.99, >= 90% rows identical", [c, run = run] { run(c); }});
    }
  }
  return rows;
}

}  // namespace kvr::gpu_parity
