#pragma once
// Pieces shared by the summary-building .cu files (private to kvr::retrieval_cuda_build).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/retrieval/cuda/build.cuh"
#include "kvr/retrieval/cuda/kernel_util.cuh"

namespace kvr::retrieval::cuda::build_internal {

using ::kvr::retrieval::cuda::internal::AlignUp;
using ::kvr::retrieval::cuda::internal::Carver;
using ::kvr::retrieval::cuda::internal::DispatchHeadDim;
using ::kvr::retrieval::cuda::internal::DispatchKeyType;
using ::kvr::retrieval::cuda::internal::kAlign;

inline absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// Validates a KeyView for `batch` x `n_kv_heads` sequences of `head_dim`-wide keys.
inline absl::Status CheckKeys(const char* op, const KeyView& k, int head_dim) {
  if (k.data == nullptr) return Invalid(op, "keys.data is null");
  if (k.dtype != KeyDType::kF32 && k.dtype != KeyDType::kF16 && k.dtype != KeyDType::kBf16) {
    return Invalid(op, absl::StrCat("keys.dtype ", static_cast<int>(k.dtype), " unknown"));
  }
  if (k.token_stride < head_dim) {
    return Invalid(op,
                   absl::StrCat("keys.token_stride ", k.token_stride, " < head_dim ", head_dim));
  }
  if (k.head_offset == nullptr && (k.head_stride < 0 || k.batch_stride < 0)) {
    return Invalid(op, "keys.head_stride / batch_stride negative");
  }
  return absl::OkStatus();
}

inline absl::Status LaunchStatus(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(kernel, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

// Element offset of key (b, h, token 0).
__device__ __forceinline__ int64_t KeyBase(const KeyView& k, int b, int h, int n_kv_heads) {
  return k.head_offset != nullptr ? k.head_offset[b * n_kv_heads + h]
                                  : b * k.batch_stride + h * k.head_stride;
}

template <typename T>
__device__ __forceinline__ float LoadKey(const void* data, int64_t i);
template <>
__device__ __forceinline__ float LoadKey<float>(const void* data, int64_t i) {
  return static_cast<const float*>(data)[i];
}
template <>
__device__ __forceinline__ float LoadKey<__half>(const void* data, int64_t i) {
  return __half2float(static_cast<const __half*>(data)[i]);
}
template <>
__device__ __forceinline__ float LoadKey<__nv_bfloat16>(const void* data, int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
}

}  // namespace kvr::retrieval::cuda::build_internal
