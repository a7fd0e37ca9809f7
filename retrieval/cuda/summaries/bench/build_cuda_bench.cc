// build_cuda_bench: time per layer of the GPU summary builders (build.cuh) at Llama-3-8B shapes
// (8 KV heads, head_dim 128, bf16 keys laid out token-major [batch, L, 8, 128], i.e. the K cache
// as the runtime writes it).
//
//   build_cuda_bench [--contexts 8192,32768,131072] [--batch 1] [--iters 3] [--codebook 1024,4096]
//                    [--builders quest,keydiff,a2ats,clusterkv,ctkvr]
//
// Keys: a mixture of 64 directions per head plus noise (k-means has structure to find; random
// noise alone never converges). One line per (builder, context): us per layer (mean of --iters
// after a warm-up, CUDA events), and the achieved rate against its ceiling:
//   clusterkv  rate of the assignment GEMMs (2 n C d per iteration) vs the H100 SXM's 67 TF/s
//              fp32 datasheet peak (the 3xtf32 rows run on tensor cores; same useful flops);
//              "1it" = one Lloyd step + layout, "10it" = the CPU default (fewer when every row
//              settles earlier, so the rate is a lower bound)
//   a2ats      2 n d (d + L) flop per key per head vs the same 67 TFLOP/s
//   quest, keydiff  key bytes read (keydiff reads them twice) vs 3.0 TB/s HBM (DESIGN.md 6)
//   ctkvr      CtkvrBuild at the CPU defaults for budget 1024 (C = min(2048, L/16), rho = 2560,
//              32 query heads): 2 passes x 2 C group (L - 16) d flop per KV head vs 67 TF/s
//              (3xTF32 tensor cores; the rate includes the score write-out and BatchedTopK)

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_util.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/half.h"
#include "kvr/retrieval/cuda/build.cuh"

namespace {

using kvr::cuda::DeviceBuffer;
namespace rc = kvr::retrieval::cuda;

constexpr double kFp32Peak = 67e12;
constexpr double kHbm = 3.0e12;

using kvr::bench::Alloc;
using kvr::bench::AttachWorkspace;
using kvr::bench::ParseList;
using kvr::bench::Upload;

const char* MathName(rc::AssignMath m) { return m == rc::AssignMath::kFp32 ? "fp32" : "3xtf32"; }

// Mean microseconds of launch() (returns absl::Status) over `iters` after one warm-up.
template <typename Launch>
double TimeUs(cudaStream_t stream, int iters, Launch&& launch) {
  return kvr::bench::TimeUs(stream, 1, iters, launch);
}

// The key cache every builder reads and its shape, set in a builder's parameters.
template <typename Params>
void SetKeys(Params& p, int batch, int n_kv_heads, int head_dim, const rc::KeyView& keys) {
  p.batch = batch;
  p.n_kv_heads = n_kv_heads;
  p.head_dim = head_dim;
  p.keys = keys;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts = {8192, 32768, 131072};
  std::vector<int64_t> codebooks = {1024, 4096};
  int batch = 1, iters = 3;
  std::string builders = "quest,keydiff,a2ats,clusterkv,ctkvr";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--contexts"))
      contexts = ParseList(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--codebook"))
      codebooks = ParseList(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--batch"))
      batch = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters"))
      iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--builders"))
      builders = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  builders = "," + builders + ",";
  const auto want = [&builders](const char* name) {
    return builders.find(std::string(",") + name + ",") != std::string::npos;
  };
  if (!kvr::cuda::HaveCudaDevice()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  auto stream_or = kvr::cuda::CudaStream::Create();
  BENCH_CHECK(stream_or.status());
  cudaStream_t stream = stream_or->get();
  constexpr int kNkv = 8, kD = 128;
  std::printf("build_cuda_bench on %s: batch %d, %d KV heads, d %d, bf16 keys, %d iters\n",
              prop.name, batch, kNkv, kD, iters);
  std::printf("%-26s %8s %12s %10s %s\n", "builder", "context", "us/layer", "rate", "of ceiling");

  const int64_t max_l = *std::max_element(contexts.begin(), contexts.end());
  // Keys for the longest context; shorter contexts use a prefix of every sequence.
  const size_t elems = static_cast<size_t>(batch) * max_l * kNkv * kD;
  std::vector<uint16_t> host(elems);
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> g(0.f, 1.f);
    std::vector<float> dirs(static_cast<size_t>(kNkv) * 64 * kD);
    for (float& v : dirs) v = g(rng);
    uint64_t x = 88172645463325252ull;
    auto next = [&x]() {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return x;
    };
    for (size_t t = 0; t < static_cast<size_t>(batch) * max_l; ++t) {
      for (int h = 0; h < kNkv; ++h) {
        const float* dir = dirs.data() + (static_cast<size_t>(h) * 64 + next() % 64) * kD;
        for (int i = 0; i < kD; ++i) {
          // Sum of 4 uniforms: roughly normal noise, cheap enough for 134M values.
          const uint64_t r = next();
          const float n = (static_cast<float>(r & 0xffff) + ((r >> 16) & 0xffff) +
                           ((r >> 32) & 0xffff) + ((r >> 48) & 0xffff)) /
                              65536.f -
                          2.f;
          host[(t * kNkv + h) * kD + i] = kvr::FloatToBf16(1.5f * dir[i] + 1.2f * n);
        }
      }
    }
  }
  auto keys = Upload(host);
  // CTKVR prefill queries (the last kMaxQueries of each sequence; C <= 2048 of them are used):
  // bf16 [batch, kMaxQueries, kNh, kD], random (the cost does not depend on values).
  constexpr int kNh = 32, kMaxQueries = 2048;
  DeviceBuffer<uint16_t> queries;
  {
    std::vector<uint16_t> q(static_cast<size_t>(batch) * kMaxQueries * kNh * kD);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (uint16_t& v : q) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      v = kvr::FloatToBf16(static_cast<float>(x & 0xffff) / 32768.f - 1.f);
    }
    queries = Upload(q);
  }

  for (int64_t L : contexts) {
    rc::KeyView view;
    view.data = keys.data();
    view.dtype = rc::KeyDType::kBf16;
    view.token_stride = kNkv * kD;
    view.head_stride = kD;
    view.batch_stride = max_l * kNkv * kD;
    std::vector<int32_t> lens_h(batch, static_cast<int32_t>(L));
    auto lens = Upload(lens_h);
    const double key_bytes = static_cast<double>(batch) * L * kNkv * kD * 2;
    const int rows = batch * kNkv;

    // Quest (page 16).
    if (want("quest")) {
      const int64_t pages = (L + 15) / 16;
      auto bounds = Alloc<float>(static_cast<size_t>(batch) * pages * kNkv * 2 * kD);
      rc::QuestBoundsParams p;
      SetKeys(p, batch, kNkv, kD, view);
      p.page_size = 16;
      p.seq_len = lens.data();
      p.max_tokens = static_cast<int>(L);
      p.bounds = bounds.data();
      p.bounds_batch_stride = pages * kNkv * 2 * kD;
      const double us = TimeUs(stream, iters, [&] { return rc::QuestPageBounds(p, stream); });
      const double bw = (key_bytes + key_bytes / 16 * 2 * 2) / (us * 1e-6);  // + fp32 bounds
      std::printf("%-26s %8lld %12.1f %7.0f GB/s %5.1f%% of 3.0 TB/s\n", "quest bounds p16",
                  static_cast<long long>(L), us, bw / 1e9, 100 * bw / kHbm);
    }
    // KeyDiff.
    if (want("keydiff")) {
      auto scores = Alloc<float>(static_cast<size_t>(rows) * L);
      rc::KeyDiffBuildParams p;
      SetKeys(p, batch, kNkv, kD, view);
      p.seq_len = lens.data();
      p.max_tokens = static_cast<int>(L);
      p.scores = scores.data();
      p.score_stride = L;
      const auto ws = AttachWorkspace(p, rc::KeyDiffBuildWorkspaceBytes(p));
      const double us = TimeUs(stream, iters, [&] { return rc::KeyDiffBuild(p, stream); });
      const double bw = 2 * key_bytes / (us * 1e-6);
      std::printf("%-26s %8lld %12.1f %7.0f GB/s %5.1f%% of 3.0 TB/s\n", "keydiff scores",
                  static_cast<long long>(L), us, bw / 1e9, 100 * bw / kHbm);
    }
    // A2ATS (identity-ish whitening and random codewords: the cost does not depend on values).
    for (int64_t size : want("a2ats") ? codebooks : std::vector<int64_t>{}) {
      for (rc::AssignMath math : {rc::AssignMath::kFp32, rc::AssignMath::k3xTf32}) {
        std::mt19937 rng(3);
        std::normal_distribution<float> g(0.f, 1.f);
        std::vector<float> chol(static_cast<size_t>(kNkv) * kD * kD, 0.f);
        for (int h = 0; h < kNkv; ++h)
          for (int i = 0; i < kD; ++i)
            for (int j = 0; j <= i; ++j)
              chol[(static_cast<size_t>(h) * kD + i) * kD + j] = i == j ? 1.f : 0.05f * g(rng);
        std::vector<float> cw(static_cast<size_t>(kNkv) * size * kD), hn(kNkv * size);
        for (float& v : cw) v = g(rng);
        for (int64_t c = 0; c < kNkv * size; ++c) {
          double s = 0;
          for (int i = 0; i < kD; ++i) s += cw[c * kD + i] * cw[c * kD + i];
          hn[c] = static_cast<float>(0.5 * s);
        }
        auto d_chol = Upload(chol);
        auto d_cw = Upload(cw);
        auto d_hn = Upload(hn);
        auto ids = Alloc<uint16_t>(static_cast<size_t>(rows) * L);
        rc::A2atsQuantiseParams p;
        SetKeys(p, batch, kNkv, kD, view);
        p.seq_len = lens.data();
        p.max_tokens = static_cast<int>(L);
        p.rope.style = kvr::retrieval::RopeStyle::kHalfSplit;
        p.rope.theta = 500000.f;
        p.codebook_size = static_cast<int>(size);
        p.chol = d_chol.data();
        p.codewords = d_cw.data();
        p.half_norms = d_hn.data();
        p.math = math;
        p.ids = ids.data();
        p.id_stride = L;
        const auto ws = AttachWorkspace(p, rc::A2atsQuantiseWorkspaceBytes(p));
        const double us = TimeUs(stream, iters, [&] { return rc::A2atsQuantise(p, stream); });
        const double flops = 2.0 * rows * L * kD * (kD + size);
        const double rate = flops / (us * 1e-6);
        char name[64];
        std::snprintf(name, sizeof(name), "a2ats L=%lld %s", static_cast<long long>(size),
                      MathName(math));
        std::printf("%-26s %8lld %12.1f %7.1f TF/s %5.1f%% of 67 TF/s fp32\n", name,
                    static_cast<long long>(L), us, rate / 1e12, 100 * rate / kFp32Peak);
      }
    }
    // ClusterKV: the CPU defaults at budget 1024 (C0 = L/80, 16 sinks), 1 and 10 iterations.
    for (int max_it : want("clusterkv") ? std::vector<int>{1, 10} : std::vector<int>{})
      for (rc::AssignMath math : {rc::AssignMath::kFp32, rc::AssignMath::k3xTf32}) {
        kvr::retrieval::IndexShape shape;
        shape.n_heads = 32;
        shape.n_kv_heads = kNkv;
        shape.head_dim = kD;
        kvr::retrieval::IndexParams params;
        params.budget = 1024;
        params.clusterkv.max_iterations = max_it;
        std::vector<int64_t> seq(batch, L);
        auto plan = rc::MakeClusterKvBuildPlan(shape, params, seq);
        BENCH_CHECK(plan.status());
        auto first = Upload(plan->first_token);
        auto n_points = Upload(plan->n_points);
        auto n_init = Upload(plan->n_init);
        auto init = Upload(plan->init_points);
        const int K = plan->max_clusters, P = plan->max_points;
        auto centroids = Alloc<float>(static_cast<size_t>(rows) * K * kD);
        auto n_clusters = Alloc<int32_t>(rows);
        auto offsets = Alloc<int32_t>(static_cast<size_t>(rows) * (K + 1));
        auto members = Alloc<int32_t>(static_cast<size_t>(rows) * P);
        rc::ClusterKvBuildParams p;
        SetKeys(p, batch, kNkv, kD, view);
        p.max_points = P;
        p.max_clusters = K;
        p.max_iterations = plan->max_iterations;
        p.math = math;
        p.first_token = first.data();
        p.n_points = n_points.data();
        p.n_init = n_init.data();
        p.init_points = init.data();
        p.centroids = centroids.data();
        p.n_clusters = n_clusters.data();
        p.offsets = offsets.data();
        p.members = members.data();
        const auto ws = AttachWorkspace(p, rc::ClusterKvBuildWorkspaceBytes(p));
        const double us = TimeUs(stream, iters, [&] { return rc::ClusterKvBuild(p, stream); });
        const double flops = 2.0 * rows * P * static_cast<double>(K) * kD * max_it;
        const double rate = flops / (us * 1e-6);
        std::vector<int32_t> nc(rows);
        BENCH_CHECK_CUDA(
            cudaMemcpy(nc.data(), n_clusters.data(), rows * 4, cudaMemcpyDeviceToHost));
        char name[64];
        std::snprintf(name, sizeof(name), "clusterkv C=%d %dit %s", K, max_it, MathName(math));
        std::printf(
            "%-26s %8lld %12.1f %7.1f TF/s %5.1f%% of 67 TF/s fp32 (<=, %d clusters kept)\n", name,
            static_cast<long long>(L), us, rate / 1e12, 100 * rate / kFp32Peak, nc[0]);
      }
    // CTKVR qcIVF build: the CPU defaults at budget 1024 (C = min(2048, L/16) query centroids,
    // rho = 2560, 16 sinks), 32 query heads (group 4), bf16 prefill queries.
    if (want("ctkvr")) {
      kvr::retrieval::IndexShape shape;
      shape.n_heads = kNh;
      shape.n_kv_heads = kNkv;
      shape.head_dim = kD;
      kvr::retrieval::IndexParams params;
      params.budget = 1024;
      std::vector<int64_t> seq(batch, L), nq(batch, kMaxQueries);
      auto plan = rc::MakeCtkvrBuildPlan(shape, params, seq, nq);
      BENCH_CHECK(plan.status());
      auto per_seq = Upload(plan->per_seq);
      const int C = plan->max_centroids, E = plan->max_list_entries;
      auto centroids = Alloc<float>(static_cast<size_t>(rows) * C * (kNh / kNkv) * kD);
      auto n_centroids = Alloc<int32_t>(rows);
      auto offsets = Alloc<int32_t>(static_cast<size_t>(rows) * (C + 1));
      auto lists = Alloc<int32_t>(static_cast<size_t>(rows) * E);
      rc::CtkvrBuildParams p;
      SetKeys(p, batch, kNkv, kD, view);
      p.n_heads = kNh;
      p.scale = 1.f / std::sqrt(static_cast<float>(kD));
      p.queries.data = queries.data();
      p.queries.dtype = rc::KeyDType::kBf16;
      p.queries.token_stride = kNh * kD;
      p.queries.head_stride = kD;
      p.queries.batch_stride = static_cast<int64_t>(kMaxQueries) * kNh * kD;
      p.per_seq = per_seq.data();
      p.max_centroids = C;
      p.max_list_length = plan->max_list_length;
      p.max_listable = plan->max_listable;
      p.centroids = centroids.data();
      p.n_centroids = n_centroids.data();
      p.list_offsets = offsets.data();
      p.lists = lists.data();
      const auto ws = AttachWorkspace(p, rc::CtkvrBuildWorkspaceBytes(p));
      const double us = TimeUs(stream, iters, [&] { return rc::CtkvrBuild(p, stream); });
      // Useful flops: two passes (log-sum-exp, scores) of 2 C group listable d per KV head.
      const double flops =
          2.0 * 2.0 * rows * static_cast<double>(C) * (kNh / kNkv) * plan->max_listable * kD;
      const double rate = flops / (us * 1e-6);
      char name[64];
      std::snprintf(name, sizeof(name), "ctkvr C=%d rho=%d", C, plan->max_list_length);
      std::printf("%-26s %8lld %12.1f %7.1f TF/s %5.1f%% of 67 TF/s fp32 (3xtf32 mma)\n", name,
                  static_cast<long long>(L), us, rate / 1e12, 100 * rate / kFp32Peak);
    }
  }
  return 0;
}
