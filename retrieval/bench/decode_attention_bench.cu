// Per-layer decode data path on the GPU, Llama-3-8B attention shape (32 q / 8 kv heads,
// head_dim 128, bf16): select + gather + attend for contexts x batches x budgets, beside the
// measured ceilings (HBM device-to-device copy, pinned host -> device copy). torch SDPA dense
// decode on the same shapes is timed by sdpa_dense.py in the same device call
// (scripts/device/retrieval-bench.sh), which prints the ratio table.
//
// Stages, each timed as the mean over `iters` back-to-back launches (rotating over selection
// sets whose rows exceed the 50 MB L2, so repeated launches do not read cached rows):
//   select      kernels-select's ExactSelect (GQA sum-softmax scores over every candidate key in
//               HBM + batched top-k) and QuestSelect (16-token page min/max bounds, fp32, on
//               random bounds: speed only); when that library is absent, no select is timed (0).
//   gather_host GatherRows zero-copy from pinned host memory mapped into the GPU.
//   gather_hbm  GatherRows from a KV pool in HBM.
//   attend      DecodeAttention over resident (64 sink + 448 local) + gathered rows.
//   fused_host  DecodeAttention reading the selected rows straight from mapped host memory.
//   *_graph     the same stages (and totals, hot included) captured in a CUDA graph: GPU time
//               without the per-launch host overhead (~4-5 us per launch seen on the lent H100).
//   hot         HotCache::Gather (2x budget slots per head, 4 ways) at steady state on a chain
//               of selections where each step keeps `overlap` of the previous step's ids.
// Totals (one loop of the whole step, so launch gaps count): select + gather_host + attend,
// select + fused_host, select + hot + attend.
//
// Prediction (written before measuring): 128K, batch 1, budget 1024: rows moved per layer =
// 1024 x 8 x 512 B = 4 MiB; over PCIe at the measured ~55 GB/s pinned ceiling that is ~76 us
// (gather_host), while attend reads 4.5 MiB from HBM (~2 us at 3 TB/s, but ~5-8 us of launch +
// latency for two small kernels), and exact select reads all keys (256 MiB, ~90 us at 3 TB/s).
// So plain gather from host alone misses the 0.15x SDPA target (~30 us); with a hot cache at hit
// rate h only (1 - h) x 4 MiB crosses the link: h = 0.7 -> ~23 us.
//
// Memory: both pools are the real size (batch x 8 heads x ctx rows of 512 B: 8 GiB of HBM and
// 8 GiB of pinned host memory at 128K, batch 16).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cuda_bench_util.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/retrieval/cuda/decode_attention.cuh"
#include "kvr/retrieval/cuda/gather.cuh"
#include "kvr/retrieval/cuda/hot_cache.cuh"
#if KVR_HAVE_CUDA_SELECT
#include "kvr/retrieval/cuda/selection.cuh"
#endif

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::CudaEvent;
using kvr::cuda::CudaStream;
using kvr::cuda::DeviceBuffer;
using kvr::cuda::PinnedBuffer;

constexpr int kHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kSink = 64;
constexpr int kLocal = 448;
constexpr int kResident = kSink + kLocal;
constexpr size_t kRowBytes = 2 * kHeadDim * 2;  // bf16 [k | v]

template <typename T>
T Must(absl::StatusOr<T> v) {
  BENCH_CHECK(v.status());
  return *std::move(v);
}

// Deterministic pseudo-random bf16 in [-1, 1) (hash of the index): fills GBs in milliseconds.
__global__ void FillBf16(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32);
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16((x >> 8) * (2.f / 16777216.f) - 1.f);
  }
}
// Quest page bounds: min = -|x|, max = +|x| per channel ([pages, heads, 2, d] fp32).
__global__ void FillBounds(float* p, size_t n_pairs, int head_dim, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n_pairs;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    const float a = (x >> 8) * (1.f / 16777216.f);
    const size_t ph = i / head_dim;  // (page, head)
    const size_t d = i % head_dim;
    p[ph * 2 * head_dim + d] = -a;
    p[ph * 2 * head_dim + head_dim + d] = a;
  }
}
__global__ void Bf16ToF32(const __nv_bfloat16* in, float* out, size_t n) {
  const size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (i < n) out[i] = __bfloat162float(in[i]);
}

void Fill(void* p, size_t bytes, uint32_t seed, cudaStream_t s) {
  FillBf16<<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), bytes / 2, seed);
  BENCH_CHECK(kvr::cuda::LastLaunchStatus("FillBf16"));
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return out;
}

// Mean microseconds per call of fn(i), i = 0..iters-1, after `warmup` calls.
template <typename Fn>
double TimeUs(cudaStream_t s, int iters, Fn&& fn, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn(i);
  CudaEvent a = Must(CudaEvent::Create()), b = Must(CudaEvent::Create());
  BENCH_CHECK_CUDA(cudaEventRecord(a.get(), s));
  for (int i = 0; i < iters; ++i) fn(i);
  BENCH_CHECK_CUDA(cudaEventRecord(b.get(), s));
  BENCH_CHECK_CUDA(cudaEventSynchronize(b.get()));
  float ms = 0;
  BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, a.get(), b.get()));
  return 1000.0 * ms / iters;
}

// Mean microseconds per call when `iters` calls are captured in one CUDA graph and replayed: the
// GPU time of the stage without per-launch host overhead (a decode node captures its layer step
// in a graph the same way). The hot cache is not timed this way: its step number is a kernel
// argument that a replayed graph would repeat.
template <typename Fn>
double TimeGraphUs(cudaStream_t s, int iters, Fn&& fn) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BENCH_CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < iters; ++i) fn(i);
  BENCH_CHECK_CUDA(cudaStreamEndCapture(s, &graph));
  BENCH_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  BENCH_CHECK_CUDA(cudaGraphLaunch(exec, s));  // warm-up
  constexpr int kReplays = 3;
  CudaEvent a = Must(CudaEvent::Create()), b = Must(CudaEvent::Create());
  BENCH_CHECK_CUDA(cudaEventRecord(a.get(), s));
  for (int r = 0; r < kReplays; ++r) BENCH_CHECK_CUDA(cudaGraphLaunch(exec, s));
  BENCH_CHECK_CUDA(cudaEventRecord(b.get(), s));
  BENCH_CHECK_CUDA(cudaEventSynchronize(b.get()));
  float ms = 0;
  BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, a.get(), b.get()));
  BENCH_CHECK_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CHECK_CUDA(cudaGraphDestroy(graph));
  return 1000.0 * ms / (kReplays * iters);
}

// Streams `bytes` of (mapped host) memory through the GPU with 16-byte loads: the zero-copy
// read ceiling, without the gather's random row order.
__global__ void StreamRead(const uint4* __restrict__ p, size_t n, uint4* __restrict__ sink) {
  uint4 acc = {0, 0, 0, 0};
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  }
  if (acc.x == 0x12345678u) sink[0] = acc;  // keeps the loads alive
}

// `n_sets` selections of `budget` distinct ids in [lo, hi) per (b, h), ascending (the contract).
// chain_overlap < 0: independent sets; else set s+1 keeps that fraction of set s.
std::vector<int32_t> MakeSelections(int n_sets, int bh, int budget, int lo, int hi,
                                    double chain_overlap, std::mt19937& rng) {
  std::vector<int32_t> all(static_cast<size_t>(n_sets) * bh * budget);
  std::uniform_int_distribution<int> pick(lo, hi - 1);
  std::vector<int32_t> cur, next;
  std::vector<char> used(hi, 0);  // all zero between uses (cleared entry by entry)
  for (int h = 0; h < bh; ++h) {
    cur.clear();
    for (int s = 0; s < n_sets; ++s) {
      next.clear();
      if (chain_overlap >= 0 && !cur.empty()) {
        std::shuffle(cur.begin(), cur.end(), rng);
        next.assign(cur.begin(), cur.begin() + static_cast<int>(chain_overlap * budget));
        for (int32_t x : cur) used[x] = 1;  // fresh ids are new to the previous step too
      }
      for (int32_t x : next) used[x] = 1;
      while (static_cast<int>(next.size()) < budget) {
        const int32_t x = pick(rng);
        if (!used[x]) {
          used[x] = 1;
          next.push_back(x);
        }
      }
      for (int32_t x : next) used[x] = 0;
      for (int32_t x : cur) used[x] = 0;
      std::sort(next.begin(), next.end());
      std::copy(next.begin(), next.end(), all.begin() + (static_cast<size_t>(s) * bh + h) * budget);
      cur = next;
    }
  }
  return all;
}

struct Ceilings {
  double hbm_copy_gbs = 0;  // (read + write) bytes / s of a 1 GiB device-to-device copy
  double h2d_gbs = 0;       // pinned host -> device, 256 MiB
};

Ceilings MeasureCeilings(cudaStream_t s) {
  Ceilings c;
  const size_t big = size_t{1} << 30;
  auto a = Must(DeviceBuffer<uint8_t>::Create(big));
  auto b = Must(DeviceBuffer<uint8_t>::Create(big));
  Fill(a.data(), big, 1, s);
  const double us = TimeUs(s, 10, [&](int) {
    BENCH_CHECK_CUDA(cudaMemcpyAsync(b.data(), a.data(), big, cudaMemcpyDeviceToDevice, s));
  });
  c.hbm_copy_gbs = 2.0 * big / (us * 1e3);
  const size_t h = size_t{256} << 20;
  auto host = Must(PinnedBuffer<uint8_t>::Create(h));
  std::memset(host.data(), 1, h);
  const double us2 = TimeUs(s, 10, [&](int) {
    BENCH_CHECK_CUDA(cudaMemcpyAsync(b.data(), host.data(), h, cudaMemcpyHostToDevice, s));
  });
  c.h2d_gbs = static_cast<double>(h) / (us2 * 1e3);
  return c;
}

struct Options {
  std::vector<int> contexts{8192, 32768, 131072};
  std::vector<int> batches{1, 4, 16};
  std::vector<int> budgets{256, 1024, 2048};
  double overlap = 0.7;
  int iters = 20;
  std::string csv;
};

int Run(const Options& o) {
  if (!kvr::cuda::HaveCudaDevice()) {
    std::fprintf(stderr, "decode_attention_bench: no CUDA device\n");
    return 1;
  }
  CudaStream stream = Must(CudaStream::Create());
  cudaStream_t s = stream.get();
  const Ceilings ceil = MeasureCeilings(s);
  std::printf("ceilings: hbm_copy %.0f GB/s (read+write), pinned_h2d %.1f GB/s\n",
              ceil.hbm_copy_gbs, ceil.h2d_gbs);
  FILE* csv = o.csv.empty() ? nullptr : std::fopen(o.csv.c_str(), "w");
  const char* header =
      "ctx,batch,budget,select_us,gather_host_us,gather_hbm_us,attend_us,fused_host_us,hot_us,"
      "hit_rate,total_host_us,total_fused_us,total_hot_us,gather_host_gbs,gather_host_frac,"
      "gather_hbm_gbs,gather_hbm_frac,select_bytes_per_token,hbm_copy_gbs,h2d_gbs,"
      "select_graph_us,gather_host_graph_us,attend_graph_us,fused_host_graph_us,"
      "total_host_graph_us,total_fused_graph_us,zero_copy_read_gbs,verified,quest_graph_us,"
      "hot_graph_us\n";
  if (csv) std::fputs(header, csv);
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const int max_budget = *std::max_element(o.budgets.begin(), o.budgets.end());
  std::mt19937 rng(42);
  bool header_printed = false;

  for (int ctx : o.contexts) {
    // KV pools of one layer: [max_batch, 8, ctx, 256] bf16 in HBM and in mapped pinned host memory.
    const size_t seq_bytes = size_t{kKvHeads} * ctx * kRowBytes;
    auto hbm_pool = Must(DeviceBuffer<uint8_t>::Create(seq_bytes * max_batch));
    Fill(hbm_pool.data(), hbm_pool.bytes(), 7, s);
    auto host_pool =
        Must(PinnedBuffer<uint8_t>::Create(seq_bytes * max_batch, cudaHostAllocMapped));
    BENCH_CHECK_CUDA(cudaMemcpyAsync(host_pool.data(), hbm_pool.data(), host_pool.bytes(),
                                     cudaMemcpyDeviceToHost, s));
    const void* host_dev = Must(host_pool.device_pointer());
    // Zero-copy streaming read of the first and the last 256 MiB of the mapped pool.
    double zero_copy_gbs = 0;
    {
      auto sink = Must(DeviceBuffer<uint4>::Create(1));
      const size_t n = std::min<size_t>(host_pool.bytes(), size_t{256} << 20);
      for (size_t off : {size_t{0}, host_pool.bytes() - n}) {
        const uint4* p =
            reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(host_dev) + off);
        const double us = TimeUs(
            s, 3,
            [&](int) {
              StreamRead<<<1056, 256, 0, s>>>(p, n / 16, sink.data());
              BENCH_CHECK(kvr::cuda::LastLaunchStatus("StreamRead"));
            },
            1);
        zero_copy_gbs = std::max(zero_copy_gbs, n / (us * 1e3));
        std::printf("ctx %d: zero-copy stream read at offset %zu MiB: %.1f GB/s\n", ctx, off >> 20,
                    n / (us * 1e3));
      }
    }
    for (int batch : o.batches) {
      const int bh = batch * kKvHeads;
      std::vector<int64_t> base_hbm(bh), key_off(bh);
      for (int i = 0; i < bh; ++i) {
        base_hbm[i] = static_cast<int64_t>(i) * ctx;
        key_off[i] = base_hbm[i] * 2 * kHeadDim;
      }
      auto up64 = [&](const std::vector<int64_t>& v) {
        auto d = Must(DeviceBuffer<int64_t>::Create(v.size()));
        BENCH_CHECK_CUDA(cudaMemcpy(d.data(), v.data(), v.size() * 8, cudaMemcpyHostToDevice));
        return d;
      };
      auto d_key_off = up64(key_off);
      // The pools as KvPoolViews: one page per (b, h) of ctx rows (page_bytes = row bytes, so a
      // page index is a row index), the layout a sequence's own host KV has.
      std::vector<int32_t> pages(bh);
      for (int i = 0; i < bh; ++i) pages[i] = static_cast<int32_t>(base_hbm[i]);
      auto d_pages = Must(DeviceBuffer<int32_t>::Create(pages.size()));
      BENCH_CHECK_CUDA(
          cudaMemcpy(d_pages.data(), pages.data(), pages.size() * 4, cudaMemcpyHostToDevice));
      auto slots_at = [&](const void* base) {
        std::vector<KvPoolSlot> slots(batch, KvPoolSlot{base, kRowBytes, ctx, 0});
        auto d = Must(DeviceBuffer<KvPoolSlot>::Create(slots.size()));
        BENCH_CHECK_CUDA(cudaMemcpy(d.data(), slots.data(), slots.size() * sizeof(KvPoolSlot),
                                    cudaMemcpyHostToDevice));
        return d;
      };
      auto d_slots_hbm = slots_at(hbm_pool.data()), d_slots_host = slots_at(host_dev);
      const KvPoolView view_hbm{d_slots_hbm.data(), d_pages.data(), 1, kKvHeads};
      const KvPoolView view_host{d_slots_host.data(), d_pages.data(), 1, kKvHeads};
      auto resident = Must(DeviceBuffer<uint8_t>::Create(size_t{1} * bh * kResident * kRowBytes));
      Fill(resident.data(), resident.bytes(), 11, s);
      std::vector<int32_t> res_counts(batch, kResident);
      auto d_res_counts = Must(DeviceBuffer<int32_t>::Create(batch));
      BENCH_CHECK_CUDA(
          cudaMemcpy(d_res_counts.data(), res_counts.data(), batch * 4, cudaMemcpyHostToDevice));
      auto q = Must(DeviceBuffer<__nv_bfloat16>::Create(size_t{1} * batch * kHeads * kHeadDim));
      Fill(q.data(), q.bytes(), 13, s);
      auto q32 = Must(DeviceBuffer<float>::Create(q.size()));
      Bf16ToF32<<<(q.size() + 255) / 256, 256, 0, s>>>(q.data(), q32.data(), q.size());
      auto out = Must(DeviceBuffer<__nv_bfloat16>::Create(q.size()));
      auto gathered = Must(DeviceBuffer<uint8_t>::Create(size_t{1} * bh * max_budget * kRowBytes));

      for (int budget : o.budgets) {
        const size_t step_bytes = size_t{1} * bh * budget * kRowBytes;
        const int n_sets =
            std::clamp<int>(static_cast<int>((size_t{256} << 20) / step_bytes), 8, 32);
        const int lo = kSink, hi = ctx - kLocal;
        const std::vector<int32_t> sel = MakeSelections(n_sets, bh, budget, lo, hi, -1, rng);
        const int chain_steps = 16 + 3 * (o.iters + 3);
        const std::vector<int32_t> chain =
            MakeSelections(chain_steps, bh, budget, lo, hi, o.overlap, rng);
        auto d_sel = Must(DeviceBuffer<int32_t>::Create(sel.size()));
        BENCH_CHECK_CUDA(
            cudaMemcpy(d_sel.data(), sel.data(), sel.size() * 4, cudaMemcpyHostToDevice));
        auto d_chain = Must(DeviceBuffer<int32_t>::Create(chain.size()));
        BENCH_CHECK_CUDA(
            cudaMemcpy(d_chain.data(), chain.data(), chain.size() * 4, cudaMemcpyHostToDevice));
        std::vector<int32_t> counts(bh, budget);
        auto d_counts = Must(DeviceBuffer<int32_t>::Create(bh));
        BENCH_CHECK_CUDA(
            cudaMemcpy(d_counts.data(), counts.data(), bh * 4, cudaMemcpyHostToDevice));
        auto ids_of = [&](int i) { return d_sel.data() + size_t{1} * (i % n_sets) * bh * budget; };

        // select (kernels-select's exact top-k), writing into a scratch selection.
        double select_us = 0;
        double quest_graph_us = 0;
        int select_bytes_per_token = 0;
        auto sel_ids = Must(DeviceBuffer<int32_t>::Create(size_t{1} * bh * budget));
        auto sel_counts = Must(DeviceBuffer<int32_t>::Create(bh));
        std::function<void()> select_fn = [] {};
#if KVR_HAVE_CUDA_SELECT
        std::vector<int32_t> cb(batch, lo), ce(batch, hi);
        auto d_cb = Must(DeviceBuffer<int32_t>::Create(batch));
        auto d_ce = Must(DeviceBuffer<int32_t>::Create(batch));
        BENCH_CHECK_CUDA(cudaMemcpy(d_cb.data(), cb.data(), batch * 4, cudaMemcpyHostToDevice));
        BENCH_CHECK_CUDA(cudaMemcpy(d_ce.data(), ce.data(), batch * 4, cudaMemcpyHostToDevice));
        ExactSelectParams ep{.batch = batch,
                             .n_heads = kHeads,
                             .n_kv_heads = kKvHeads,
                             .head_dim = kHeadDim,
                             .scale = 1.f / std::sqrt(float{kHeadDim}),
                             .query = q32.data(),
                             .keys = {.data = hbm_pool.data(),
                                      .dtype = KeyDType::kBf16,
                                      .token_stride = 2 * kHeadDim,
                                      .head_offset = d_key_off.data()},
                             .cand = {d_cb.data(), d_ce.data()},
                             .max_candidates = hi - lo,
                             .out = {budget, sel_ids.data(), sel_counts.data()}};
        auto sel_ws = Must(DeviceBuffer<uint8_t>::Create(ExactSelectWorkspaceBytes(ep)));
        ep.workspace = sel_ws.data();
        ep.workspace_bytes = sel_ws.bytes();
        select_fn = [&] { BENCH_CHECK(ExactSelect(ep, s)); };
        // quest (page min/max bounds, 16-token pages, fp32: 64 B per token per kv head).
        constexpr int kPage = 16;
        const int n_pages = (ctx + kPage - 1) / kPage;
        auto bounds = Must(
            DeviceBuffer<float>::Create(size_t{1} * batch * n_pages * kKvHeads * 2 * kHeadDim));
        FillBounds<<<1024, 256, 0, s>>>(bounds.data(), bounds.size() / 2, kHeadDim, 17);
        QuestSelectParams qp{
            .batch = batch,
            .n_heads = kHeads,
            .n_kv_heads = kKvHeads,
            .head_dim = kHeadDim,
            .page_size = kPage,
            .scale = 1.f / std::sqrt(float{kHeadDim}),
            .query = q32.data(),
            .bounds = bounds.data(),
            .bounds_batch_stride = static_cast<int64_t>(n_pages) * kKvHeads * 2 * kHeadDim,
            .cand = {d_cb.data(), d_ce.data()},
            .max_candidates = hi - lo,
            .out = {budget, sel_ids.data(), sel_counts.data()}};
        auto quest_ws = Must(DeviceBuffer<uint8_t>::Create(QuestSelectWorkspaceBytes(qp)));
        qp.workspace = quest_ws.data();
        qp.workspace_bytes = quest_ws.bytes();
        quest_graph_us = TimeGraphUs(s, o.iters, [&](int) { BENCH_CHECK(QuestSelect(qp, s)); });
        select_us = TimeUs(s, o.iters, [&](int) { select_fn(); });
        select_bytes_per_token = kKvHeads * kHeadDim * 2;  // exact scans every key (K half)
#endif

        GatherParams gp{.batch = batch,
                        .n_kv_heads = kKvHeads,
                        .budget = budget,
                        .head_dim = kHeadDim,
                        .dtype = RowDType::kBf16,
                        .counts = d_counts.data(),
                        .out = gathered.data()};
        auto gather_from = [&](const KvPoolView& pool, int i) {
          GatherParams g = gp;
          g.pool = pool;
          g.ids = ids_of(i);
          BENCH_CHECK(GatherRows(g, s));
        };
        const double gather_host_us =
            TimeUs(s, o.iters, [&](int i) { gather_from(view_host, i); });
        const double gather_hbm_us =
            TimeUs(s, o.iters, [&](int i) { gather_from(view_hbm, i); });
        // The host gather must deliver the same bytes as the HBM gather (same ids, same rows).
        bool verified = true;
        {
          std::vector<uint8_t> from_host(step_bytes), from_hbm(step_bytes);
          gather_from(view_host, 1);
          BENCH_CHECK_CUDA(cudaMemcpyAsync(from_host.data(), gathered.data(), step_bytes,
                                           cudaMemcpyDeviceToHost, s));
          gather_from(view_hbm, 1);
          BENCH_CHECK_CUDA(cudaMemcpyAsync(from_hbm.data(), gathered.data(), step_bytes,
                                           cudaMemcpyDeviceToHost, s));
          BENCH_CHECK(stream.Synchronize());
          verified = from_host == from_hbm;
        }
        const double gather_host_graph_us =
            TimeGraphUs(s, o.iters, [&](int i) { gather_from(view_host, i); });

        DecodeAttentionParams ap{.batch = batch,
                                 .n_heads = kHeads,
                                 .n_kv_heads = kKvHeads,
                                 .head_dim = kHeadDim,
                                 .dtype = RowDType::kBf16,
                                 .scale = 1.f / std::sqrt(float{kHeadDim}),
                                 .q = q.data(),
                                 .resident = resident.data(),
                                 .resident_capacity = kResident,
                                 .resident_counts = d_res_counts.data(),
                                 .budget = budget,
                                 .counts = d_counts.data(),
                                 .gathered = gathered.data(),
                                 .max_rows = kResident + budget,
                                 .out = out.data()};
        auto ws = Must(DeviceBuffer<uint8_t>::Create(DecodeAttentionWorkspaceBytes(ap)));
        ap.workspace = ws.data();
        ap.workspace_bytes = ws.bytes();
        const double attend_us =
            TimeUs(s, o.iters, [&](int) { BENCH_CHECK(DecodeAttention(ap, s)); });
        const double attend_graph_us =
            TimeGraphUs(s, o.iters, [&](int) { BENCH_CHECK(DecodeAttention(ap, s)); });
        DecodeAttentionParams fp = ap;
        fp.gathered = nullptr;
        fp.pool = view_host;
        auto fused = [&](int i) {
          fp.ids = ids_of(i);
          BENCH_CHECK(DecodeAttention(fp, s));
        };
        const double fused_host_us = TimeUs(s, o.iters, fused);
        const double fused_host_graph_us = TimeGraphUs(s, o.iters, fused);

        // Hot cache at steady state: 16 warm-up steps of the chain, then `iters` timed steps.
        auto cache = Must(HotCache::Create({.batch = batch,
                                            .n_kv_heads = kKvHeads,
                                            .head_dim = kHeadDim,
                                            .dtype = RowDType::kBf16,
                                            .n_sets = std::max(1, budget / 2),
                                            .ways = 4,
                                            .budget = budget},
                                           s));
        // Each call takes the next selection of the chain (never a repeat).
        int chain_pos = 0;
        auto hot_step = [&](int) {
          const int32_t* ids =
              d_chain.data() + size_t{1} * (chain_pos++ % chain_steps) * bh * budget;
          BENCH_CHECK(cache.Gather(view_host, ids, d_counts.data(), gathered.data(), s));
        };
        for (int i = 0; i < 16; ++i) hot_step(i);
        unsigned long long hits0 = 0, hits1 = 0;
        BENCH_CHECK_CUDA(cudaMemcpyAsync(&hits0, cache.hits(), 8, cudaMemcpyDeviceToHost, s));
        const double hot_us = TimeUs(s, o.iters, hot_step, 0);
        BENCH_CHECK_CUDA(cudaMemcpy(&hits1, cache.hits(), 8, cudaMemcpyDeviceToHost));
        const double hit_rate =
            static_cast<double>(hits1 - hits0) / (static_cast<double>(o.iters) * bh * budget);
        // GPU time of a hot-cache step: `iters` steps of the chain captured in a graph (the step
        // counter is on the device, so each replayed launch is a new step).
        const double hot_graph_us = TimeGraphUs(s, o.iters, hot_step);

        // Whole steps, launch gaps included.
        const double total_host_us = TimeUs(s, o.iters, [&](int i) {
          select_fn();
          gather_from(view_host, i);
          BENCH_CHECK(DecodeAttention(ap, s));
        });
        const double total_fused_us = TimeUs(s, o.iters, [&](int i) {
          select_fn();
          fused(i);
        });
        // Continues the chain (steady state; hit rate as measured above).
        const double total_hot_us = TimeUs(s, o.iters, [&](int i) {
          select_fn();
          hot_step(i);
          BENCH_CHECK(DecodeAttention(ap, s));
        });
        double select_graph_us = 0;
#if KVR_HAVE_CUDA_SELECT
        select_graph_us = TimeGraphUs(s, o.iters, [&](int) { select_fn(); });
#endif
        const double total_host_graph_us = TimeGraphUs(s, o.iters, [&](int i) {
          select_fn();
          gather_from(view_host, i);
          BENCH_CHECK(DecodeAttention(ap, s));
        });
        const double total_fused_graph_us = TimeGraphUs(s, o.iters, [&](int i) {
          select_fn();
          fused(i);
        });
        BENCH_CHECK(stream.Synchronize());

        const double gh_gbs = step_bytes / (gather_host_us * 1e3);
        const double gd_gbs = 2.0 * step_bytes / (gather_hbm_us * 1e3);  // read + write
        char line[768];
        std::snprintf(line, sizeof line,
                      "%d,%d,%d,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.3f,%.1f,%.1f,%.1f,%.1f,%.2f,%.0f,"
                      "%.2f,%d,%.0f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%d,%.1f,%.1f\n",
                      ctx, batch, budget, select_us, gather_host_us, gather_hbm_us, attend_us,
                      fused_host_us, hot_us, hit_rate, total_host_us, total_fused_us, total_hot_us,
                      gh_gbs, gh_gbs / ceil.h2d_gbs, gd_gbs, gd_gbs / ceil.hbm_copy_gbs,
                      select_bytes_per_token, ceil.hbm_copy_gbs, ceil.h2d_gbs, select_graph_us,
                      gather_host_graph_us, attend_graph_us, fused_host_graph_us,
                      total_host_graph_us, total_fused_graph_us, zero_copy_gbs, verified ? 1 : 0,
                      quest_graph_us, hot_graph_us);
        if (!header_printed) {
          std::printf("%s", header);
          header_printed = true;
        }
        std::fputs(line, stdout);
        std::fflush(stdout);
        if (csv) std::fputs(line, csv);
      }
    }
  }
  if (csv) std::fclose(csv);
  return 0;
}

}  // namespace
}  // namespace kvr::retrieval::cuda

int main(int argc, char** argv) {
  kvr::retrieval::cuda::Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    const char* v = argv[i + 1];
    if (f == "--contexts")
      o.contexts = kvr::retrieval::cuda::ParseList(v);
    else if (f == "--batches")
      o.batches = kvr::retrieval::cuda::ParseList(v);
    else if (f == "--budgets")
      o.budgets = kvr::retrieval::cuda::ParseList(v);
    else if (f == "--overlap")
      o.overlap = std::atof(v);
    else if (f == "--iters")
      o.iters = std::atoi(v);
    else if (f == "--csv")
      o.csv = v;
    else {
      std::fprintf(stderr,
                   "usage: decode_attention_bench [--contexts 8192,32768,131072] [--batches "
                   "1,4,16] [--budgets 256,1024,2048] [--overlap 0.7] [--iters 20] [--csv F]\n");
      return 2;
    }
  }
  return kvr::retrieval::cuda::Run(o);
}
