#pragma once
// The CPU's dot product order on the GPU, for kernels whose results must equal their CPU
// reference bit for bit: kvr::retrieval::Dot (ops.cc) keeps eight interleaved partial sums and
// combines them as ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)); here an aligned group of
// 8 lanes holds them (lane & 7 = partial sum j) and combines them by shuffles. Every lane of the
// warp must call these (shuffles over the full mask); all 8 lanes of a group return the result.
// Operands: float, fp16, bf16 (as __nv_bfloat16 or as its bits in a uint16_t), widened exactly.
// Not part of the selection or build contract (namespace internal).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace kvr::retrieval::cuda::internal {

__device__ __forceinline__ float Widen(float x) { return x; }
__device__ __forceinline__ float Widen(uint16_t bf16_bits) {
  return __uint_as_float(static_cast<uint32_t>(bf16_bits) << 16);
}
__device__ __forceinline__ float Widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float Widen(__half x) { return __half2float(x); }

// The 8 partial sums of a group combined in the CPU's order.
__device__ __forceinline__ float Combine8(float acc) {
  acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 4));   // a_j + a_(j+4)
  acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 1));   // (t0 + t1), (t2 + t3)
  return __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 2));  // (u0 + u2)
}

// Dot(a, b, n) for n a multiple of 8 (a and b may differ per group).
template <typename A, typename B>
__device__ __forceinline__ float Dot8(const A* a, const B* b, int n) {
  const int j = threadIdx.x & 7;
  float acc = 0.f;
  for (int i = j; i < n; i += 8) acc = __fadd_rn(acc, __fmul_rn(Widen(a[i]), Widen(b[i])));
  return Combine8(acc);
}

// Dot8 for a compile-time n: every load is issued before the dependent additions (the plain
// loop waits for each load in turn, which dominates when a and b are in global memory).
template <int kN, typename A, typename B>
__device__ __forceinline__ float Dot8N(const A* a, const B* b) {
  static_assert(kN % 8 == 0);
  const int j = threadIdx.x & 7;
  float av[kN / 8], bv[kN / 8];
#pragma unroll
  for (int e = 0; e < kN / 8; ++e) {
    av[e] = Widen(a[8 * e + j]);
    bv[e] = Widen(b[8 * e + j]);
  }
  float acc = 0.f;
#pragma unroll
  for (int e = 0; e < kN / 8; ++e) acc = __fadd_rn(acc, __fmul_rn(av[e], bv[e]));
  return Combine8(acc);
}

}  // namespace kvr::retrieval::cuda::internal
