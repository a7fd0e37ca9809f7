#pragma once
// Device-side helpers shared by the attend kernels (private to retrieval/cuda/attend).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvr/retrieval/cuda/gather.cuh"

namespace kvr::retrieval::cuda::detail {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N consecutive elements loaded in one access (N * sizeof(T) is 4, 8 or 16 bytes), as floats.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void LoadFloats(const T* p, float (&out)[N]) {
  const Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = ToFloat(x.v[i]);
}

// Runtime dtype / head_dim -> template constants (CONVENTIONS.md 5: small dispatch helpers).
#define KVR_DISPATCH_ROW_DTYPE(dtype, T, ...) \
  [&] {                                       \
    switch (dtype) {                          \
      case RowDType::kF32: {                  \
        using T = float;                      \
        return __VA_ARGS__();                 \
      }                                       \
      case RowDType::kF16: {                  \
        using T = __half;                     \
        return __VA_ARGS__();                 \
      }                                       \
      default: {                              \
        using T = __nv_bfloat16;              \
        return __VA_ARGS__();                 \
      }                                       \
    }                                         \
  }()

#define KVR_DISPATCH_HEAD_DIM(head_dim, D, ...) \
  [&] {                                         \
    if ((head_dim) == 64) {                     \
      constexpr int D = 64;                     \
      return __VA_ARGS__();                     \
    }                                           \
    constexpr int D = 128;                      \
    return __VA_ARGS__();                       \
  }()

}  // namespace kvr::retrieval::cuda::detail
