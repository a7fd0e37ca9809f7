// GPU selection microbenchmark (retrieval/cuda/include/kvr/retrieval/cuda/selection.cuh): time
// per layer of each selector on the Llama-3-8B attention shape (32 query / 8 KV heads,
// head_dim 128), for every (context, batch, budget), with the summary bytes each step scans and
// the achieved GB/s against the H100's measured HBM copy ceiling (3.0 TB/s, DESIGN.md 6).
//
//   select_cuda_bench [--methods exact,quest,clusterkv,topk,pariskv,ctkvr,a2ats]
//                     [--contexts 8192,32768,131072] [--batches 1,4,16]
//                     [--budgets 256,1024] [--iters 50] [--csv]
// B/tok/kvh: summary bytes held per token and KV head (exact: the bf16 keys themselves).
//
// Data: random keys / page bounds (pure speed; the selected set barely changes the work). Sink 16
// and local window 256 are excluded from the candidates as in a decode step. Timing: CUDA events
// around `iters` back-to-back launches after 3 warm-up launches; small working sets (8K at batch
// 1: 16 MiB of keys) stay in the 50 MiB L2, so their GB/s can exceed the HBM ceiling.

#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_util.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/half.h"
#include "kvr/retrieval/cuda/selection.cuh"

namespace {

using kvr::bench::Alloc;
using kvr::bench::AttachWorkspace;
using kvr::bench::FillTiled;
using kvr::bench::TileOnDevice;
using kvr::bench::Upload;
using kvr::cuda::DeviceBuffer;
namespace rc = kvr::retrieval::cuda;

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kSink = 16, kLocal = 256;
constexpr double kHbmBytesPerS = 3.0e12;
constexpr int kWarmups = 3;

struct Row {
  std::string method;
  int context, batch, budget;
  double us;
  double bytes;              // summary bytes scanned per layer step
  double bytes_per_token = 0;  // summary bytes held per token and KV head
};

// Fills `dst` ([n_elems] bf16) by tiling a random block generated on the host.
void FillRandomBf16(uint16_t* dst, size_t n_elems) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  FillTiled(dst, n_elems, size_t{1} << 22, [&] { return kvr::FloatToBf16(nd(rng)); });
}

// Mean microseconds of `launch` after kWarmups warm-up launches.
template <typename Launch>
double TimeUs(Launch launch, int iters, cudaStream_t stream) {
  return kvr::bench::TimeUs(stream, kWarmups, iters, launch);
}

std::vector<float> RandomQuery(int batch, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(batch) * kHeads * kHeadDim);
  for (float& x : q) x = nd(rng);
  return q;
}

// Every sequence's candidates: the tokens between the sink and the local window.
struct Candidates {
  DeviceBuffer<int32_t> begin, end;
  Candidates(int batch, int context)
      : begin(Upload(std::vector<int32_t>(batch, kSink))),
        end(Upload(std::vector<int32_t>(batch, context - kLocal))) {}
  rc::CandidateRanges view() { return {begin.data(), end.data()}; }
};

// A selector's output: `budget` ids and a count per (sequence, KV head) row.
struct Output {
  int budget;
  DeviceBuffer<int32_t> ids, counts;
  Output(int rows, int budget)
      : budget(budget),
        ids(Alloc<int32_t>(static_cast<size_t>(rows) * budget)),
        counts(Alloc<int32_t>(rows)) {}
  rc::SelectionOutput view() { return {budget, ids.data(), counts.data()}; }
};

// The attention shape of every selector's parameters (ParisKV's head size is its codec's).
template <typename Params>
void SetShape(Params& p, int batch) {
  rc::SetAttentionShape(p, batch, kHeads, kKvHeads, kHeadDim);
}

// Every selector's candidates (the tokens between the sink and the local window, as Candidates;
// the bound where the parameters have one) and output.
template <typename Params>
void SetCandidates(Params& p, Candidates& cand, Output& out, int context) {
  p.cand = cand.view();
  if constexpr (requires { p.max_candidates; }) p.max_candidates = context - kLocal - kSink;
  p.out = out.view();
}

Row BenchExact(int context, int batch, int budget, int iters, cudaStream_t stream) {
  const size_t n_keys = static_cast<size_t>(batch) * kKvHeads * context * kHeadDim;
  auto keys = Alloc<uint16_t>(n_keys);
  FillRandomBf16(keys.data(), n_keys);
  std::mt19937 rng(2);
  auto d_q = Upload(RandomQuery(batch, rng));
  Candidates cand(batch, context);
  Output out(batch * kKvHeads, budget);
  rc::ExactSelectParams p;
  SetShape(p, batch);
  p.query = d_q.data();
  p.keys.data = keys.data();
  p.keys.dtype = rc::KeyDType::kBf16;
  p.keys.token_stride = kHeadDim;
  p.keys.head_stride = static_cast<int64_t>(context) * kHeadDim;
  p.keys.batch_stride = static_cast<int64_t>(kKvHeads) * context * kHeadDim;
  SetCandidates(p, cand, out, context);
  const auto ws = AttachWorkspace(p, rc::ExactSelectWorkspaceBytes(p));
  const double us = TimeUs([&] { return rc::ExactSelect(p, stream); }, iters, stream);
  const double bytes = static_cast<double>(batch) * kKvHeads * p.max_candidates * kHeadDim * 2;
  return {"exact", context, batch, budget, us, bytes, kHeadDim * 2.0};
}

// quest: fp32 page bounds [n_pages, n_kv_heads, 2, head_dim] per sequence, page 16.
Row BenchQuest(int context, int batch, int budget, int iters, cudaStream_t stream) {
  constexpr int kPage = 16;
  const int n_pages = context / kPage;
  const int64_t batch_stride = static_cast<int64_t>(n_pages) * kKvHeads * 2 * kHeadDim;
  const size_t n_floats = static_cast<size_t>(batch) * batch_stride;
  auto bounds = Alloc<float>(n_floats);
  {
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    FillTiled(bounds.data(), n_floats, size_t{1} << 22, [&] { return nd(rng); });
  }
  std::mt19937 rng(2);
  auto d_q = Upload(RandomQuery(batch, rng));
  Candidates cand(batch, context);
  Output out(batch * kKvHeads, budget);
  rc::QuestSelectParams p;
  SetShape(p, batch);
  p.page_size = kPage;
  p.query = d_q.data();
  p.bounds = bounds.data();
  p.bounds_batch_stride = batch_stride;
  SetCandidates(p, cand, out, context);
  const auto ws = AttachWorkspace(p, rc::QuestSelectWorkspaceBytes(p));
  const double us = TimeUs([&] { return rc::QuestSelect(p, stream); }, iters, stream);
  // Pages overlapping the candidates, 2 * head_dim fp32 each per KV head.
  const double pages = (context - kLocal - 1) / kPage - kSink / kPage + 1;
  const double bytes = static_cast<double>(batch) * kKvHeads * pages * 2 * kHeadDim * 4;
  return {"quest", context, batch, budget, us, bytes, 2.0 * kHeadDim * 4 / kPage};
}

// topk: BatchedTopK alone over batch * 8 rows of `context` fp32 scores (the last stage of exact;
// scores exp(N(0, 2)) like softmax-aggregated scores).
Row BenchTopK(int context, int batch, int budget, int iters, cudaStream_t stream) {
  const int rows = batch * kKvHeads;
  const size_t n = static_cast<size_t>(rows) * context;
  std::vector<float> host(n);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (auto& h : host) h = std::exp(nd(rng));
  auto scores = Upload(host);
  auto d_n = Upload(std::vector<int32_t>(rows, context));
  Output out(rows, budget);
  rc::TopKParams p;
  p.rows = rows;
  p.row_stride = context;
  p.scores = scores.data();
  p.n_valid = d_n.data();
  p.out = out.view();
  const auto ws = AttachWorkspace(p, rc::BatchedTopKWorkspaceBytes(p));
  const double us = TimeUs([&] { return rc::BatchedTopK(p, stream); }, iters, stream);
  return {"topk", context, batch, budget, us, static_cast<double>(n) * 4, 0};
}

// clusterkv: L/80 clusters of 80 consecutive non-sink tokens per KV head (the paper's C0),
// random fp32 centroids.
Row BenchClusterKv(int context, int batch, int budget, int iters, cudaStream_t stream) {
  constexpr int kClusterSize = 80;
  const int n_clusters = (context - kSink) / kClusterSize;
  const int n_members = n_clusters * kClusterSize;
  const int rows = batch * kKvHeads;
  std::vector<float> cent(static_cast<size_t>(rows) * n_clusters * kHeadDim);
  std::mt19937 rng(6);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : cent) x = nd(rng);
  std::vector<int32_t> nc(rows, n_clusters), off(static_cast<size_t>(rows) * (n_clusters + 1)),
      mem(static_cast<size_t>(rows) * n_members);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c <= n_clusters; ++c)
      off[static_cast<size_t>(r) * (n_clusters + 1) + c] = c * kClusterSize;
    for (int m = 0; m < n_members; ++m) mem[static_cast<size_t>(r) * n_members + m] = kSink + m;
  }
  auto d_cent = Upload(cent);
  auto d_nc = Upload(nc);
  auto d_off = Upload(off);
  auto d_mem = Upload(mem);
  std::vector<float> q(static_cast<size_t>(batch) * kHeads * kHeadDim);
  for (float& x : q) x = nd(rng);
  auto d_q = Upload(q);
  Candidates cand(batch, context);
  Output out(rows, budget);
  rc::ClusterKvSelectParams p;
  SetShape(p, batch);
  p.query = d_q.data();
  p.centroids = d_cent.data();
  p.n_clusters = d_nc.data();
  p.offsets = d_off.data();
  p.members = d_mem.data();
  p.max_clusters = n_clusters;
  p.max_members = n_members;
  SetCandidates(p, cand, out, context);
  const auto ws = AttachWorkspace(p, rc::ClusterKvSelectWorkspaceBytes(p));
  const double us = TimeUs([&] { return rc::ClusterKvSelect(p, stream); }, iters, stream);
  const double bytes = static_cast<double>(rows) * n_clusters * kHeadDim * 4;
  return {"clusterkv", context, batch, budget, us, bytes,
          kHeadDim * 4.0 / kClusterSize + 4.0 + 4.0 / kClusterSize};
}

// C of ScheduleParisKv (pariskv.h) for the bytes column (default options).
struct ParisKvScheduleLite {
  int64_t n_candidates;
};
ParisKvScheduleLite ScheduleLite(int64_t n, int64_t budget) {
  const double beta = n <= 16384    ? 0.10
                      : n >= 131072 ? 0.05
                                    : 0.10 - 0.05 * std::log(n / 16384.0) / std::log(8.0);
  const int64_t c = std::max<int64_t>({static_cast<int64_t>(std::ceil(beta * n)), 4 * budget, budget});
  return {std::min(n, c)};
}

// pariskv: random fp32 keys of one sequence ([context, 8, 128], a 4096-token block tiled) are
// encoded on the GPU (ParisKvEncode, timed as "pariskv_enc": budget 0, bytes = keys read) into
// every sequence's summary, then ParisKvSelect (m = 8, B = 16, 6 tiers, scheduled beta / rho).
std::vector<Row> BenchParisKv(int context, int batch, const std::vector<int>& budgets, int iters,
                              cudaStream_t stream) {
  constexpr int kP = kHeadDim, kM = 8, kB = kP / kM;
  std::vector<Row> rows_out;
  const size_t key_row = static_cast<size_t>(kKvHeads) * kHeadDim;
  auto keys = Alloc<float>(static_cast<size_t>(context) * key_row);
  {
    std::mt19937 rng(8);
    std::normal_distribution<float> nd(0.f, 1.f);
    FillTiled(keys.data(), static_cast<size_t>(context) * key_row, 4096 * key_row,
              [&] { return nd(rng); });
  }
  const int rows = batch * kKvHeads;
  auto codes = Alloc<uint8_t>(static_cast<size_t>(rows) * context * (kP / 2));
  auto weights = Alloc<uint16_t>(static_cast<size_t>(rows) * context * kB);
  auto counts = Alloc<uint32_t>(static_cast<size_t>(rows) * kB * (1 << kM));
  BENCH_CHECK_CUDA(cudaMemset(counts.data(), 0, counts.bytes()));
  rc::ParisKvCodec codec;
  codec.head_dim = kHeadDim;
  codec.padded_dim = kP;
  codec.subspace_dim = kM;
  codec.rotation_seed = 0x1234;
  // Lloyd-Max levels for m = 8 (pariskv_codes.cc computes them; the exact values do not matter
  // for speed).
  const float levels[8] = {0.03f, 0.09f, 0.16f, 0.23f, 0.31f, 0.40f, 0.51f, 0.68f};
  std::copy(levels, levels + 8, codec.levels);
  rc::ParisKvEncodeParams e;
  e.n_tokens = context;
  e.n_kv_heads = kKvHeads;
  e.codec = codec;
  e.keys.data = keys.data();
  e.keys.dtype = rc::KeyDType::kF32;
  e.keys.token_stride = static_cast<int64_t>(key_row);
  e.keys.head_stride = kHeadDim;
  e.codes_head_stride = static_cast<int64_t>(context) * (kP / 2);
  e.weights_head_stride = static_cast<int64_t>(context) * kB;
  for (int b = 0; b < batch; ++b) {
    e.codes = codes.data() + static_cast<size_t>(b) * kKvHeads * context * (kP / 2);
    e.weights = weights.data() + static_cast<size_t>(b) * kKvHeads * context * kB;
    e.counts = counts.data() + static_cast<size_t>(b) * kKvHeads * kB * (1 << kM);
    BENCH_CHECK(rc::ParisKvEncode(e, stream));
  }
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  if (batch == 1) {  // encode cost does not depend on the batch: one row per context
    e.codes = codes.data();
    e.weights = weights.data();
    e.counts = nullptr;  // keep the counts of exactly one pass
    const double us = TimeUs([&] { return rc::ParisKvEncode(e, stream); }, iters, stream);
    rows_out.push_back({"pariskv_enc", context, 1, 0, us,
                        static_cast<double>(context) * key_row * 4, kP / 2.0 + 2.0 * kB});
  }
  std::mt19937 rng(9);
  auto d_q = Upload(RandomQuery(batch, rng));
  Candidates cand(batch, context);
  auto d_ntok = Upload(std::vector<int32_t>(batch, context));
  for (int budget : budgets) {
    Output out(rows, budget);
    rc::ParisKvSelectParams p;
    SetShape(p, batch);
    p.codec = codec;
    p.query = d_q.data();
    p.codes = codes.data();
    p.weights = weights.data();
    p.counts = counts.data();
    p.n_tokens = d_ntok.data();
    p.max_tokens = context;
    SetCandidates(p, cand, out, context);
    const auto ws = AttachWorkspace(p, rc::ParisKvSelectWorkspaceBytes(p));
    const double us = TimeUs([&] { return rc::ParisKvSelect(p, stream); }, iters, stream);
    const ParisKvScheduleLite sched = ScheduleLite(p.max_candidates, budget);
    const double bytes = static_cast<double>(rows) *
                         (static_cast<double>(p.max_candidates) * (kP / 2) +
                          static_cast<double>(sched.n_candidates) * (kP / 2 + 2 * kB));
    rows_out.push_back({"pariskv", context, batch, budget, us, bytes, kP / 2.0 + 2.0 * kB});
  }
  return rows_out;
}

// ctkvr: C = min(2048, L / 16) query centroids ([C, 4, 128] fp32 per KV head), lists of
// rho = 2.5 x budget random ascending ids per centroid, C' = 4, bf16 keys for the rerank.
std::vector<Row> BenchCtkvr(int context, int batch, const std::vector<int>& budgets, int iters,
                            cudaStream_t stream) {
  constexpr int kGroup = kHeads / kKvHeads;
  const int n_cent = std::min(2048, context / 16);
  const int rows = batch * kKvHeads;
  std::vector<Row> rows_out;
  std::mt19937 rng(10);
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t cent_row = static_cast<size_t>(n_cent) * kGroup * kHeadDim;
  auto cent = Alloc<float>(rows * cent_row);
  {
    std::vector<float> host(cent_row);
    for (float& x : host) x = nd(rng);
    for (size_t i = 0; i < host.size(); i += kHeadDim) {  // unit query centroids
      float n2 = 0.f;
      for (int d = 0; d < kHeadDim; ++d) n2 += host[i + d] * host[i + d];
      for (int d = 0; d < kHeadDim; ++d) host[i + d] /= std::sqrt(n2);
    }
    BENCH_CHECK_CUDA(cudaMemcpy(cent.data(), host.data(), cent_row * 4, cudaMemcpyHostToDevice));
    TileOnDevice(cent.data(), cent_row, rows * cent_row);
  }
  const size_t n_keys = static_cast<size_t>(batch) * context * kKvHeads * kHeadDim;
  auto keys = Alloc<uint16_t>(n_keys);
  FillRandomBf16(keys.data(), n_keys);
  auto d_q = Upload(RandomQuery(batch, rng));
  Candidates cand(batch, context);
  auto d_nc = Upload(std::vector<int32_t>(rows, n_cent));
  for (int budget : budgets) {
    const int rho = std::min(context - kSink, static_cast<int>(std::ceil(2.5 * budget)));
    const size_t list_row = static_cast<size_t>(n_cent) * rho;
    std::vector<int32_t> off(static_cast<size_t>(rows) * (n_cent + 1));
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c <= n_cent; ++c) off[static_cast<size_t>(r) * (n_cent + 1) + c] = c * rho;
    auto d_off = Upload(off);
    auto lists = Alloc<int32_t>(rows * list_row);
    {
      std::vector<int32_t> host(list_row);
      // Ascending distinct ids: one random id in each of rho equal strides of the listable range.
      const double stride = static_cast<double>(context - kSink) / rho;
      std::uniform_real_distribution<double> u(0.0, 1.0);
      for (int c = 0; c < n_cent; ++c)
        for (int k = 0; k < rho; ++k)
          host[static_cast<size_t>(c) * rho + k] =
              kSink + static_cast<int32_t>((k + u(rng) * 0.999) * stride);
      BENCH_CHECK_CUDA(cudaMemcpy(lists.data(), host.data(), list_row * 4, cudaMemcpyHostToDevice));
      TileOnDevice(lists.data(), list_row, rows * list_row);
    }
    Output out(rows, budget);
    rc::CtkvrSelectParams p;
    SetShape(p, batch);
    p.n_recall = 4;
    p.query = d_q.data();
    p.centroids = cent.data();
    p.n_centroids = d_nc.data();
    p.list_offsets = d_off.data();
    p.lists = lists.data();
    p.max_centroids = n_cent;
    p.max_list_entries = static_cast<int>(list_row);
    p.max_list_length = rho;
    p.max_tokens = context;
    p.keys.data = keys.data();
    p.keys.dtype = rc::KeyDType::kBf16;
    p.keys.token_stride = static_cast<int64_t>(kKvHeads) * kHeadDim;
    p.keys.head_stride = kHeadDim;
    p.keys.batch_stride = static_cast<int64_t>(context) * kKvHeads * kHeadDim;
    SetCandidates(p, cand, out, context);
    const auto ws = AttachWorkspace(p, rc::CtkvrSelectWorkspaceBytes(p));
    const double us = TimeUs([&] { return rc::CtkvrSelect(p, stream); }, iters, stream);
    const double bytes =
        static_cast<double>(rows) * (cent_row * 4.0 + 4.0 * rho * (4 + kHeadDim * 2.0));
    rows_out.push_back({"ctkvr", context, batch, budget, us, bytes,
                        (cent_row * 4.0 + list_row * 4.0) / context});
  }
  return rows_out;
}

// a2ats: 4096 codewords per KV head (the paper's size at 16K-96K), a random lower-triangular
// matrix as L^-1, random codewords and uint16 ids.
std::vector<Row> BenchA2ats(int context, int batch, const std::vector<int>& budgets, int iters,
                            cudaStream_t stream) {
  constexpr int kCodebook = 4096;
  const int rows = batch * kKvHeads;
  std::vector<Row> rows_out;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> chol(static_cast<size_t>(kKvHeads) * kHeadDim * kHeadDim, 0.f);
  for (int h = 0; h < kKvHeads; ++h)
    for (int i = 0; i < kHeadDim; ++i) {
      for (int j = 0; j < i; ++j)
        chol[(static_cast<size_t>(h) * kHeadDim + i) * kHeadDim + j] = 0.05f * nd(rng);
      chol[(static_cast<size_t>(h) * kHeadDim + i) * kHeadDim + i] = 1.f;
    }
  std::vector<float> cw(static_cast<size_t>(kKvHeads) * kCodebook * kHeadDim);
  for (float& x : cw) x = nd(rng);
  auto d_chol = Upload(chol);
  auto d_cw = Upload(cw);
  const size_t n_ids = static_cast<size_t>(rows) * context;
  auto ids_in = Alloc<uint16_t>(n_ids);
  {
    std::uniform_int_distribution<int> pick(0, kCodebook - 1);
    FillTiled(ids_in.data(), n_ids, size_t{1} << 22,
              [&] { return static_cast<uint16_t>(pick(rng)); });
  }
  auto d_q = Upload(RandomQuery(batch, rng));
  auto d_pos = Upload(std::vector<int64_t>(batch, context));
  Candidates cand(batch, context);
  auto d_ntok = Upload(std::vector<int32_t>(batch, context));
  for (int budget : budgets) {
    Output out(rows, budget);
    rc::A2atsSelectParams p;
    SetShape(p, batch);
    p.rope = {kvr::retrieval::RopeStyle::kHalfSplit, 500000.f, 0};
    p.wrope_offset = 2048;
    p.codebook_size = kCodebook;
    p.chol_inv = d_chol.data();
    p.codewords = d_cw.data();
    p.query = d_q.data();
    p.query_position = d_pos.data();
    p.ids = ids_in.data();
    p.n_tokens = d_ntok.data();
    p.max_tokens = context;
    SetCandidates(p, cand, out, context);
    const auto ws = AttachWorkspace(p, rc::A2atsSelectWorkspaceBytes(p));
    const double us = TimeUs([&] { return rc::A2atsSelect(p, stream); }, iters, stream);
    const double bytes = static_cast<double>(rows) * p.max_candidates * 2 * 2 +
                         static_cast<double>(kKvHeads) * kCodebook * kHeadDim * 4;
    rows_out.push_back({"a2ats", context, batch, budget, us, bytes, 2.0});
  }
  return rows_out;
}

using kvr::bench::ParseList;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPU retrieval selection microbenchmark (Llama-3-8B attention shape)"};
  std::string methods = "exact,quest,clusterkv,topk,pariskv,ctkvr,a2ats", contexts = "8192,32768,131072",
              batches = "1,4,16", budgets = "256,1024";
  int iters = 50;
  bool csv = false;
  app.add_option("--methods", methods,
                 "comma-separated: exact, quest, clusterkv, topk (BatchedTopK alone), pariskv "
                 "(+ pariskv_enc: the encode kernel), ctkvr, a2ats");
  app.add_option("--contexts", contexts, "context lengths");
  app.add_option("--batches", batches, "batch sizes (sequences)");
  app.add_option("--budgets", budgets, "tokens per KV head");
  app.add_option("--iters", iters, "timed launches per point")->check(CLI::PositiveNumber);
  app.add_flag("--csv", csv, "print CSV");
  CLI11_PARSE(app, argc, argv);
  if (!kvr::cuda::HaveCudaDevice()) {
    std::fprintf(stderr, "select_cuda_bench: no CUDA device\n");
    return 2;
  }
  auto stream = kvr::cuda::CudaStream::Create();
  BENCH_CHECK(stream.status());
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (csv) {
    std::printf(
        "method,context,batch,budget,us_per_layer,summary_mib,gb_per_s,frac_hbm,bytes_per_token\n");
  } else {
    std::printf("# %s; 32 q / 8 kv heads, d=128, sink %d, local %d; HBM ceiling %.1f TB/s\n",
                prop.name, kSink, kLocal, kHbmBytesPerS / 1e12);
    std::printf("%-11s %8s %6s %7s %12s %12s %9s %8s %9s\n", "method", "context", "batch",
                "budget", "us/layer", "scanned_MiB", "GB/s", "of_HBM", "B/tok/kvh");
  }
  auto print = [&](const Row& r) {
    const double gbs = r.bytes / (r.us * 1e-6) / 1e9;
    if (csv) {
      std::printf("%s,%d,%d,%d,%.2f,%.2f,%.1f,%.3f,%.1f\n", r.method.c_str(), r.context, r.batch,
                  r.budget, r.us, r.bytes / (1 << 20), gbs, gbs * 1e9 / kHbmBytesPerS,
                  r.bytes_per_token);
    } else {
      std::printf("%-11s %8d %6d %7d %12.1f %12.1f %9.1f %8.3f %9.1f\n", r.method.c_str(),
                  r.context, r.batch, r.budget, r.us, r.bytes / (1 << 20), gbs,
                  gbs * 1e9 / kHbmBytesPerS, r.bytes_per_token);
    }
    std::fflush(stdout);
  };
  const std::vector<int> budget_list = ParseList<int>(budgets);
  for (const std::string& m : {std::string("exact"), std::string("quest"), std::string("clusterkv"),
                               std::string("topk"), std::string("pariskv"), std::string("ctkvr"),
                               std::string("a2ats")}) {
    if (methods.find(m) == std::string::npos) continue;
    for (int context : ParseList<int>(contexts))
      for (int batch : ParseList<int>(batches)) {
        if (m == "pariskv" || m == "ctkvr" || m == "a2ats") {
          const std::vector<Row> rs =
              m == "pariskv" ? BenchParisKv(context, batch, budget_list, iters, stream->get())
              : m == "ctkvr" ? BenchCtkvr(context, batch, budget_list, iters, stream->get())
                             : BenchA2ats(context, batch, budget_list, iters, stream->get());
          for (const Row& r : rs) print(r);
          continue;
        }
        for (int budget : budget_list) {
          print(m == "exact"       ? BenchExact(context, batch, budget, iters, stream->get())
                : m == "quest"     ? BenchQuest(context, batch, budget, iters, stream->get())
                : m == "clusterkv" ? BenchClusterKv(context, batch, budget, iters, stream->get())
                                   : BenchTopK(context, batch, budget, iters, stream->get()));
        }
      }
  }
  return 0;
}
