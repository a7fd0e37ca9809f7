// assign_bench: ClusterKV's k-means assignment kernel alone, the 3xTF32 kernel that splits its
// operands inside the k loop (ArgmaxGemmTcKernel) against the pre-split one
// (ArgmaxGemmTcSplitKernel, argmax_gemm.cuh) and the fp32 CUDA-core kernel, in the same process,
// at the Llama-3-8B shapes of build_cuda_bench's clusterkv rows: 8 KV-head rows, n = L - 16
// points (the sinks are not clustered), C = L / 80 centres, d = 128, cosine. Points are random
// unit-free vectors generated on the GPU, centres copies of evenly spaced points (as the plan's
// initial centroids). Prints us per call (mean of --iters after a warm-up, CUDA events), the
// useful rate 2 n C d per row, and whether the pre-split kernel's ids and best distances are
// bit-equal to the in-loop-split kernel's (they must be). The centres' split (done by the
// k-means update in the real build, no extra launch) is not timed.
//
//   assign_bench [--contexts 8192,32768,131072] [--iters 5]

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../argmax_gemm.cuh"
#include "cuda_bench_util.h"

namespace {

namespace bi = kvr::retrieval::cuda::build_internal;

__device__ uint32_t Hash(uint64_t i) {
  uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
}

__global__ void FillPoints(float* x, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = static_cast<float>(Hash(i)) * (2.0f / 4294967296.0f) - 1.0f;
}

// c[r, j] = x[r, j * n / k]; halves as the k-means writers store them.
template <int D>
__global__ void PickCentres(const float* x, int n, int max_points, int k, float* c, uint32_t* big,
                            uint32_t* small) {
  const int r = blockIdx.y, j = blockIdx.x;
  const int src = static_cast<int>(static_cast<int64_t>(j) * n / k);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    bi::StoreSplitTf32(x[(static_cast<int64_t>(r) * max_points + src) * D + d], c, big, small,
                       (static_cast<int64_t>(r) * k + j) * D + d);
  }
}

// Mean microseconds of launch() (returns cudaError_t) over `iters` after one warm-up, on the
// default stream.
template <typename Launch>
double TimeUs(int iters, Launch&& launch) {
  return kvr::bench::TimeUs(nullptr, 1, iters,
                            [&] { return kvr::cuda::CudaStatus(launch(), "launch"); });
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts = {8192, 32768, 131072};
  int iters = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--contexts" && i + 1 < argc) {
      contexts = kvr::bench::ParseList(argv[++i]);
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--contexts 8192,32768,131072] [--iters 5]\n", argv[0]);
      return 2;
    }
  }
  constexpr int D = 128, kRows = 8;
  std::printf("%-8s %8s %6s | %22s | %22s %7s | %22s | %s\n", "context", "n", "C",
              "3xtf32 in-loop split", "3xtf32 pre-split", "speedup", "fp32 CUDA cores",
              "pre-split vs in-loop");
  int status = 0;
  for (const int64_t L : contexts) {
    const int n = static_cast<int>(L - 16), k = static_cast<int>(L / 80);
    const int64_t xs = static_cast<int64_t>(kRows) * n * D,
                  cs = static_cast<int64_t>(kRows) * k * D;
    float *x, *c, *dist_ref, *dist_new;
    uint32_t *cb, *csm;
    int32_t *np, *ids_ref, *ids_new;
    BENCH_CHECK_CUDA(cudaMalloc(&x, xs * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&c, cs * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&cb, cs * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&csm, cs * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&np, kRows * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&ids_ref, static_cast<int64_t>(kRows) * n * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&ids_new, static_cast<int64_t>(kRows) * n * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&dist_ref, static_cast<int64_t>(kRows) * n * 4));
    BENCH_CHECK_CUDA(cudaMalloc(&dist_new, static_cast<int64_t>(kRows) * n * 4));
    FillPoints<<<static_cast<int>((xs + 255) / 256), 256>>>(x, xs);
    PickCentres<D><<<dim3(k, kRows), 128>>>(x, n, n, k, c, cb, csm);
    const std::vector<int32_t> hn(kRows, n);
    BENCH_CHECK_CUDA(cudaMemcpy(np, hn.data(), kRows * 4, cudaMemcpyHostToDevice));
    BENCH_CHECK_CUDA(cudaGetLastError());
    bi::ArgmaxGemmArgs a;
    a.rows = kRows;
    a.x = x;
    a.x_row_stride = static_cast<int64_t>(n) * D;
    a.n_points = np;
    a.c = c;
    a.c_big = cb;
    a.c_small = csm;
    a.c_row_stride = static_cast<int64_t>(k) * D;
    a.c_mod = kRows;
    a.k_const = k;
    a.out_row_stride = n;
    bi::ArgmaxGemmArgs a_ref = a, a_new = a;
    a_ref.ids = ids_ref;
    a_ref.best_dist = dist_ref;
    a_new.ids = ids_new;
    a_new.best_dist = dist_new;
    const double us_ref =
        TimeUs(iters, [&] { return bi::LaunchArgmaxGemmTc<D, true, int32_t>(a_ref, n, nullptr); });
    const double us_new = TimeUs(
        iters, [&] { return bi::LaunchArgmaxGemmTcSplit<D, true, int32_t>(a_new, n, nullptr); });
    const int64_t items = static_cast<int64_t>(kRows) * n;
    std::vector<int32_t> hr(items), hw(items);
    std::vector<uint32_t> dr(items), dw(items);
    BENCH_CHECK_CUDA(cudaMemcpy(hr.data(), ids_ref, items * 4, cudaMemcpyDeviceToHost));
    BENCH_CHECK_CUDA(cudaMemcpy(hw.data(), ids_new, items * 4, cudaMemcpyDeviceToHost));
    BENCH_CHECK_CUDA(cudaMemcpy(dr.data(), dist_ref, items * 4, cudaMemcpyDeviceToHost));
    BENCH_CHECK_CUDA(cudaMemcpy(dw.data(), dist_new, items * 4, cudaMemcpyDeviceToHost));
    int64_t same_ids = 0, same_dist = 0;
    for (int64_t i = 0; i < items; ++i) {
      same_ids += hr[i] == hw[i];
      same_dist += dr[i] == dw[i];
    }
    if (same_ids != items || same_dist != items) status = 1;
    bi::ArgmaxGemmArgs a_f = a_ref;  // fp32 kernel, output over the reference's
    const double us_f =
        TimeUs(iters, [&] { return bi::LaunchArgmaxGemm<D, true, int32_t>(a_f, n, nullptr); });
    const double flops = 2.0 * kRows * n * static_cast<double>(k) * D;
    char ref_s[64], new_s[64], f_s[64];
    std::snprintf(ref_s, sizeof(ref_s), "%9.1f us %5.1f TF/s", us_ref, flops / us_ref * 1e-6);
    std::snprintf(new_s, sizeof(new_s), "%9.1f us %5.1f TF/s", us_new, flops / us_new * 1e-6);
    std::snprintf(f_s, sizeof(f_s), "%9.1f us %5.1f TF/s", us_f, flops / us_f * 1e-6);
    std::printf(
        "%-8lld %8d %6d | %22s | %22s %6.2fx | %22s | ids %lld/%lld, dist %lld/%lld bit-equal\n",
        static_cast<long long>(L), n, k, ref_s, new_s, us_ref / us_new, f_s,
        static_cast<long long>(same_ids), static_cast<long long>(items),
        static_cast<long long>(same_dist), static_cast<long long>(items));
    std::fflush(stdout);
    for (void* p : {static_cast<void*>(x), static_cast<void*>(c), static_cast<void*>(cb),
                    static_cast<void*>(csm), static_cast<void*>(np), static_cast<void*>(ids_ref),
                    static_cast<void*>(ids_new), static_cast<void*>(dist_ref),
                    static_cast<void*>(dist_new)}) {
      BENCH_CHECK_CUDA(cudaFree(p));
    }
  }
  return status;
}
