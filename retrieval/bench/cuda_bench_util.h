#pragma once
// What the GPU retrieval microbenchmarks (select_cuda_bench, build_cuda_bench, assign_bench)
// share (CMake target kvr::retrieval_cuda_bench_util): exit on the first error, device buffers
// and uploads, random data tiled on the device, CUDA-event timing, comma-separated lists.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kvr/common/cuda/cuda_util.h"

// Exits (status 1) naming `expr` when the absl::Status it yields is not OK.
#define BENCH_CHECK(expr)                                               \
  do {                                                                  \
    const absl::Status s_ = (expr);                                     \
    if (!s_.ok()) {                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, \
                   std::string(s_.message()).c_str());                  \
      std::exit(1);                                                     \
    }                                                                   \
  } while (false)
// The same for a CUDA runtime call's cudaError_t.
#define BENCH_CHECK_CUDA(expr) BENCH_CHECK(kvr::cuda::CudaStatus((expr), #expr))

namespace kvr::bench {

// A device buffer of max(1, n) elements.
template <typename T>
cuda::DeviceBuffer<T> Alloc(size_t n) {
  auto b = cuda::DeviceBuffer<T>::Create(std::max<size_t>(1, n));
  BENCH_CHECK(b.status());
  return std::move(*b);
}

// A device copy of `v`.
template <typename T>
cuda::DeviceBuffer<T> Upload(const std::vector<T>& v) {
  auto d = Alloc<T>(v.size());
  BENCH_CHECK_CUDA(cudaMemcpy(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Copies the first `block` elements of `dst` over the rest of its `n` elements (on the device).
template <typename T>
void TileOnDevice(T* dst, size_t block, size_t n) {
  for (size_t off = block; off < n; off += block) {
    BENCH_CHECK_CUDA(
        cudaMemcpy(dst + off, dst, std::min(block, n - off) * sizeof(T), cudaMemcpyDeviceToDevice));
  }
}

// Fills `dst` ([n] elements on the device) with min(n, block) values of `next()` made on the
// host, uploaded once and tiled: random data at 128K contexts without generating all of it.
template <typename T, typename Next>
void FillTiled(T* dst, size_t n, size_t block, Next next) {
  block = std::min(n, block);
  std::vector<T> host(block);
  for (T& x : host) x = next();
  BENCH_CHECK_CUDA(cudaMemcpy(dst, host.data(), block * sizeof(T), cudaMemcpyHostToDevice));
  TileOnDevice(dst, block, n);
}

// A workspace of `bytes` set in the launch parameters `p` (its `workspace` and
// `workspace_bytes`); the caller keeps the returned buffer for as long as `p` is launched.
template <typename Params>
[[nodiscard]] cuda::DeviceBuffer<char> AttachWorkspace(Params& p, size_t bytes) {
  auto ws = Alloc<char>(bytes);
  p.workspace = ws.data();
  p.workspace_bytes = ws.bytes();
  return ws;
}

// Mean microseconds per call of `launch` (returns absl::Status) over `iters` back-to-back calls
// on `stream`, after `warmups` calls; CUDA events around the timed calls.
template <typename Launch>
double TimeUs(cudaStream_t stream, int warmups, int iters, Launch&& launch) {
  for (int i = 0; i < warmups; ++i) BENCH_CHECK(launch());
  BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
  auto start = cuda::CudaEvent::Create();
  auto stop = cuda::CudaEvent::Create();
  BENCH_CHECK(start.status());
  BENCH_CHECK(stop.status());
  BENCH_CHECK_CUDA(cudaEventRecord(start->get(), stream));
  for (int i = 0; i < iters; ++i) BENCH_CHECK(launch());
  BENCH_CHECK_CUDA(cudaEventRecord(stop->get(), stream));
  BENCH_CHECK_CUDA(cudaEventSynchronize(stop->get()));
  float ms = 0.f;
  BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, start->get(), stop->get()));
  return 1000.0 * ms / iters;
}

// "8192,32768" -> {8192, 32768}.
template <typename T = int64_t>
std::vector<T> ParseList(const std::string& s) {
  std::vector<T> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    out.push_back(static_cast<T>(std::stoll(s.substr(pos, comma - pos))));
    pos = comma + 1;
  }
  return out;
}

}  // namespace kvr::bench
