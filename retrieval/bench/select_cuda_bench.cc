// GPU selection microbenchmark (retrieval/cuda/include/kvr/retrieval/cuda/selection.cuh): time
// per layer of each selector on the Llama-3-8B attention shape (32 query / 8 KV heads,
// head_dim 128), for every (context, batch, budget), with the summary bytes each step scans and
// the achieved GB/s against the H100's measured HBM copy ceiling (3.0 TB/s, DESIGN.md 6).
//
//   select_cuda_bench [--methods exact,quest,clusterkv,topk] [--contexts 8192,32768,131072]
//   [--batches 1,4,16]
//                     [--budgets 256,1024] [--iters 50] [--csv]
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
#include <type_traits>
#include <vector>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/half.h"
#include "kvr/retrieval/cuda/selection.cuh"

namespace {

using kvr::cuda::DeviceBuffer;
namespace rc = kvr::retrieval::cuda;

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kSink = 16, kLocal = 256;
constexpr double kHbmBytesPerS = 3.0e12;

#define BENCH_CHECK(expr)                                               \
  do {                                                                  \
    const absl::Status s_ = (expr);                                     \
    if (!s_.ok()) {                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                   std::string(s_.message()).c_str());                  \
      std::exit(1);                                                     \
    }                                                                   \
  } while (false)

template <typename T>
DeviceBuffer<T> Alloc(size_t n) {
  auto b = DeviceBuffer<T>::Create(n);
  BENCH_CHECK(b.status());
  return std::move(*b);
}

struct Row {
  std::string method;
  int context, batch, budget;
  double us;
  double bytes;  // summary bytes scanned per layer step
};

// Fills `dst` ([n_elems] bf16) by tiling a random block generated on the host.
void FillRandomBf16(uint16_t* dst, size_t n_elems) {
  const size_t block = std::min<size_t>(n_elems, size_t{1} << 22);
  std::vector<uint16_t> host(block);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& h : host) h = kvr::FloatToBf16(nd(rng));
  BENCH_CHECK(kvr::cuda::CudaStatus(cudaMemcpy(dst, host.data(), block * 2, cudaMemcpyHostToDevice),
                                    "upload"));
  for (size_t off = block; off < n_elems; off += block) {
    const size_t len = std::min(block, n_elems - off);
    BENCH_CHECK(kvr::cuda::CudaStatus(cudaMemcpy(dst + off, dst, len * 2, cudaMemcpyDeviceToDevice),
                                      "tile"));
  }
}

template <typename Launch>
double TimeUs(Launch launch, int iters, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) BENCH_CHECK(launch());
  auto start = kvr::cuda::CudaEvent::Create();
  auto stop = kvr::cuda::CudaEvent::Create();
  BENCH_CHECK(start.status());
  BENCH_CHECK(stop.status());
  BENCH_CHECK(kvr::cuda::CudaStatus(cudaEventRecord(start->get(), stream), "record"));
  for (int i = 0; i < iters; ++i) BENCH_CHECK(launch());
  BENCH_CHECK(kvr::cuda::CudaStatus(cudaEventRecord(stop->get(), stream), "record"));
  BENCH_CHECK(kvr::cuda::CudaStatus(cudaEventSynchronize(stop->get()), "sync"));
  float ms = 0.f;
  BENCH_CHECK(kvr::cuda::CudaStatus(cudaEventElapsedTime(&ms, start->get(), stop->get()), "time"));
  return 1000.0 * ms / iters;
}

Row BenchExact(int context, int batch, int budget, int iters, cudaStream_t stream) {
  const size_t n_keys = static_cast<size_t>(batch) * kKvHeads * context * kHeadDim;
  auto keys = Alloc<uint16_t>(n_keys);
  FillRandomBf16(keys.data(), n_keys);
  std::vector<float> q(static_cast<size_t>(batch) * kHeads * kHeadDim);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : q) x = nd(rng);
  auto d_q = Alloc<float>(q.size());
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(d_q.data(), q.data(), q.size() * 4, cudaMemcpyHostToDevice), "q"));
  std::vector<int32_t> begin(batch, kSink), end(batch, context - kLocal);
  auto d_begin = Alloc<int32_t>(batch), d_end = Alloc<int32_t>(batch);
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(d_begin.data(), begin.data(), batch * 4, cudaMemcpyHostToDevice), "begin"));
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(d_end.data(), end.data(), batch * 4, cudaMemcpyHostToDevice), "end"));
  auto ids = Alloc<int32_t>(static_cast<size_t>(batch) * kKvHeads * budget);
  auto counts = Alloc<int32_t>(static_cast<size_t>(batch) * kKvHeads);
  rc::ExactSelectParams p;
  p.batch = batch;
  p.n_heads = kHeads;
  p.n_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.scale = 1.f / std::sqrt(static_cast<float>(kHeadDim));
  p.query = d_q.data();
  p.keys.data = keys.data();
  p.keys.dtype = rc::KeyDType::kBf16;
  p.keys.token_stride = kHeadDim;
  p.keys.head_stride = static_cast<int64_t>(context) * kHeadDim;
  p.keys.batch_stride = static_cast<int64_t>(kKvHeads) * context * kHeadDim;
  p.cand = {d_begin.data(), d_end.data()};
  p.max_candidates = context - kLocal - kSink;
  p.out = {budget, ids.data(), counts.data()};
  auto ws = Alloc<char>(rc::ExactSelectWorkspaceBytes(p));
  p.workspace = ws.data();
  p.workspace_bytes = ws.bytes();
  const double us = TimeUs([&] { return rc::ExactSelect(p, stream); }, iters, stream);
  const double bytes = static_cast<double>(batch) * kKvHeads * p.max_candidates * kHeadDim * 2;
  return {"exact", context, batch, budget, us, bytes};
}

// quest: fp32 page bounds [n_pages, n_kv_heads, 2, head_dim] per sequence, page 16.
Row BenchQuest(int context, int batch, int budget, int iters, cudaStream_t stream) {
  constexpr int kPage = 16;
  const int n_pages = context / kPage;
  const int64_t batch_stride = static_cast<int64_t>(n_pages) * kKvHeads * 2 * kHeadDim;
  const size_t n_floats = static_cast<size_t>(batch) * batch_stride;
  auto bounds = Alloc<float>(n_floats);
  {
    const size_t block = std::min<size_t>(n_floats, size_t{1} << 22);
    std::vector<float> host(block);
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& h : host) h = nd(rng);
    BENCH_CHECK(kvr::cuda::CudaStatus(
        cudaMemcpy(bounds.data(), host.data(), block * 4, cudaMemcpyHostToDevice), "upload"));
    for (size_t off = block; off < n_floats; off += block) {
      BENCH_CHECK(kvr::cuda::CudaStatus(
          cudaMemcpy(bounds.data() + off, bounds.data(), std::min(block, n_floats - off) * 4,
                     cudaMemcpyDeviceToDevice),
          "tile"));
    }
  }
  std::vector<float> q(static_cast<size_t>(batch) * kHeads * kHeadDim);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : q) x = nd(rng);
  auto d_q = Alloc<float>(q.size());
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(d_q.data(), q.data(), q.size() * 4, cudaMemcpyHostToDevice), "q"));
  std::vector<int32_t> begin(batch, kSink), end(batch, context - kLocal);
  auto d_begin = Alloc<int32_t>(batch), d_end = Alloc<int32_t>(batch);
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(d_begin.data(), begin.data(), batch * 4, cudaMemcpyHostToDevice), "begin"));
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(d_end.data(), end.data(), batch * 4, cudaMemcpyHostToDevice), "end"));
  auto ids = Alloc<int32_t>(static_cast<size_t>(batch) * kKvHeads * budget);
  auto counts = Alloc<int32_t>(static_cast<size_t>(batch) * kKvHeads);
  rc::QuestSelectParams p;
  p.batch = batch;
  p.n_heads = kHeads;
  p.n_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.page_size = kPage;
  p.scale = 1.f / std::sqrt(static_cast<float>(kHeadDim));
  p.query = d_q.data();
  p.bounds = bounds.data();
  p.bounds_batch_stride = batch_stride;
  p.cand = {d_begin.data(), d_end.data()};
  p.max_candidates = context - kLocal - kSink;
  p.out = {budget, ids.data(), counts.data()};
  auto ws = Alloc<char>(rc::QuestSelectWorkspaceBytes(p));
  p.workspace = ws.data();
  p.workspace_bytes = ws.bytes();
  const double us = TimeUs([&] { return rc::QuestSelect(p, stream); }, iters, stream);
  // Pages overlapping the candidates, 2 * head_dim fp32 each per KV head.
  const double pages = (context - kLocal - 1) / kPage - kSink / kPage + 1;
  const double bytes = static_cast<double>(batch) * kKvHeads * pages * 2 * kHeadDim * 4;
  return {"quest", context, batch, budget, us, bytes};
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
  auto scores = Alloc<float>(n);
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(scores.data(), host.data(), n * 4, cudaMemcpyHostToDevice), "scores"));
  std::vector<int32_t> n_valid(rows, context);
  auto d_n = Alloc<int32_t>(rows);
  BENCH_CHECK(kvr::cuda::CudaStatus(
      cudaMemcpy(d_n.data(), n_valid.data(), rows * 4, cudaMemcpyHostToDevice), "n"));
  auto ids = Alloc<int32_t>(static_cast<size_t>(rows) * budget);
  auto counts = Alloc<int32_t>(rows);
  rc::TopKParams p;
  p.rows = rows;
  p.row_stride = context;
  p.scores = scores.data();
  p.n_valid = d_n.data();
  p.out = {budget, ids.data(), counts.data()};
  auto ws = Alloc<char>(std::max<size_t>(1, rc::BatchedTopKWorkspaceBytes(p)));
  p.workspace = ws.data();
  p.workspace_bytes = ws.bytes();
  const double us = TimeUs([&] { return rc::BatchedTopK(p, stream); }, iters, stream);
  return {"topk", context, batch, budget, us, static_cast<double>(n) * 4};
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
  auto up = [](const auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    auto d = Alloc<T>(v.size());
    BENCH_CHECK(kvr::cuda::CudaStatus(
        cudaMemcpy(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload"));
    return d;
  };
  auto d_cent = up(cent);
  auto d_nc = up(nc);
  auto d_off = up(off);
  auto d_mem = up(mem);
  std::vector<float> q(static_cast<size_t>(batch) * kHeads * kHeadDim);
  for (float& x : q) x = nd(rng);
  auto d_q = up(q);
  auto d_begin = up(std::vector<int32_t>(batch, kSink));
  auto d_end = up(std::vector<int32_t>(batch, context - kLocal));
  auto ids = Alloc<int32_t>(static_cast<size_t>(rows) * budget);
  auto counts = Alloc<int32_t>(rows);
  rc::ClusterKvSelectParams p;
  p.batch = batch;
  p.n_heads = kHeads;
  p.n_kv_heads = kKvHeads;
  p.head_dim = kHeadDim;
  p.scale = 1.f / std::sqrt(static_cast<float>(kHeadDim));
  p.query = d_q.data();
  p.centroids = d_cent.data();
  p.n_clusters = d_nc.data();
  p.offsets = d_off.data();
  p.members = d_mem.data();
  p.max_clusters = n_clusters;
  p.max_members = n_members;
  p.cand = {d_begin.data(), d_end.data()};
  p.out = {budget, ids.data(), counts.data()};
  auto ws = Alloc<char>(rc::ClusterKvSelectWorkspaceBytes(p));
  p.workspace = ws.data();
  p.workspace_bytes = ws.bytes();
  const double us = TimeUs([&] { return rc::ClusterKvSelect(p, stream); }, iters, stream);
  const double bytes = static_cast<double>(rows) * n_clusters * kHeadDim * 4;
  return {"clusterkv", context, batch, budget, us, bytes};
}

std::vector<int> ParseList(const std::string& s) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    out.push_back(std::stoi(s.substr(pos, comma - pos)));
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPU retrieval selection microbenchmark (Llama-3-8B attention shape)"};
  std::string methods = "exact,quest,clusterkv,topk", contexts = "8192,32768,131072",
              batches = "1,4,16", budgets = "256,1024";
  int iters = 50;
  bool csv = false;
  app.add_option("--methods", methods,
                 "comma-separated: exact, quest, clusterkv, topk (BatchedTopK alone)");
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
    std::printf("method,context,batch,budget,us_per_layer,summary_mib,gb_per_s,frac_hbm\n");
  } else {
    std::printf("# %s; 32 q / 8 kv heads, d=128, sink %d, local %d; HBM ceiling %.1f TB/s\n",
                prop.name, kSink, kLocal, kHbmBytesPerS / 1e12);
    std::printf("%-10s %8s %6s %7s %12s %12s %9s %8s\n", "method", "context", "batch", "budget",
                "us/layer", "scanned_MiB", "GB/s", "of_HBM");
  }
  for (const std::string& m : {std::string("exact"), std::string("quest"), std::string("clusterkv"),
                               std::string("topk")}) {
    if (methods.find(m) == std::string::npos) continue;
    for (int context : ParseList(contexts))
      for (int batch : ParseList(batches))
        for (int budget : ParseList(budgets)) {
          Row r = m == "exact"       ? BenchExact(context, batch, budget, iters, stream->get())
                  : m == "quest"     ? BenchQuest(context, batch, budget, iters, stream->get())
                  : m == "clusterkv" ? BenchClusterKv(context, batch, budget, iters, stream->get())
                                     : BenchTopK(context, batch, budget, iters, stream->get());
          const double gbs = r.bytes / (r.us * 1e-6) / 1e9;
          if (csv) {
            std::printf("%s,%d,%d,%d,%.2f,%.2f,%.1f,%.3f\n", r.method.c_str(), r.context, r.batch,
                        r.budget, r.us, r.bytes / (1 << 20), gbs, gbs * 1e9 / kHbmBytesPerS);
          } else {
            std::printf("%-10s %8d %6d %7d %12.1f %12.1f %9.1f %8.3f\n", r.method.c_str(),
                        r.context, r.batch, r.budget, r.us, r.bytes / (1 << 20), gbs,
                        gbs * 1e9 / kHbmBytesPerS);
          }
          std::fflush(stdout);
        }
  }
  return 0;
}
