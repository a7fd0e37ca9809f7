#pragma once
// Gather of selected KV rows into a contiguous device buffer (decode data path, DESIGN.md 2.4).
//
// Row layout is the store's (kv-store/include/kvr/kv_store/store.h): per (sequence, layer, kv
// head) rows [k | v] of 2 * head_dim elements, kept in pages of consecutive rows (KvPoolView).
// The pages may be device memory (a GPU KV pool in HBM) or host memory mapped into the GPU
// (cudaHostAllocMapped / cudaHostRegisterMapped, the store's own pool included: the kernel then
// reads across PCIe, zero-copy). Selections follow the
// contract of kernels-select (retrieval/cuda/include/kvr/retrieval/cuda/selection.cuh):
// ids [batch, n_kv_heads, budget] int32 with the first counts[b, h] entries valid, -1 padding.
//
// Host launchers only; kernels live in src/*.cu. Launchers are asynchronous on `stream` and
// return InvalidArgument for bad shapes, Internal for launch errors.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kvr/common/cuda/kv_pool.h"

namespace kvr::retrieval::cuda {

// Element type of the KV rows (values match kvr::kv_store::DType).
enum class RowDType : uint8_t { kF32 = 1, kF16 = 2, kBf16 = 3 };

[[nodiscard]] constexpr size_t RowDTypeSize(RowDType t) { return t == RowDType::kF32 ? 4 : 2; }
// Bytes of one [k | v] row.
[[nodiscard]] constexpr size_t RowBytes(RowDType t, int head_dim) {
  return 2 * static_cast<size_t>(head_dim) * RowDTypeSize(t);
}

// How a pool holds its rows when that differs from the attention's dtype: kFp8E4m3 rows are
// kvr/common/fp8.h's Fp8RowLayout{2, head_dim} ([k codes | v codes | k scale | v scale], e4m3
// codes of x / scale, float scales; 2 * head_dim + 8 bytes), the KV store's fp8 dtype. Readers
// decode them to the attention's dtype (bf16) as they copy them out.
enum class PoolRowFormat : uint8_t { kAsDType, kFp8E4m3 };
// Bytes of one pool row of `format` whose decoded rows are `t`.
[[nodiscard]] constexpr size_t PoolRowBytes(PoolRowFormat format, RowDType t, int head_dim) {
  return format == PoolRowFormat::kFp8E4m3 ? 2 * static_cast<size_t>(head_dim) + 2 * sizeof(float)
                                           : RowBytes(t, head_dim);
}

// The paged row layout (KvPoolSlot, KvPoolView, KvPoolRow) lives in common so that the model's
// kernels and these share it without the model depending on retrieval.
using kvr::cuda::KvPoolRow;
using kvr::cuda::KvPoolSlot;
using kvr::cuda::KvPoolView;
using kvr::cuda::KvPoolViewSet;

struct GatherParams {
  int batch = 0;
  int n_kv_heads = 0;
  int budget = 0;    // ids per (b, h)
  int head_dim = 0;  // 64 or 128
  RowDType dtype = RowDType::kBf16;
  KvPoolView pool;
  const int32_t* ids = nullptr;     // device [batch, n_kv_heads, budget], -1 padding
  const int32_t* counts = nullptr;  // device [batch, n_kv_heads], valid ids per (b, h)
  void* out = nullptr;              // device [batch, n_kv_heads, budget, 2 * head_dim]
};

// out[b, h, i] = pool row ids[b, h, i] of (b, h) for i < counts[b, h]; padding slots are not
// written. The pool's rows must be 16-byte aligned (row bytes and page bases multiples of 16). 16-byte loads and stores, one thread per 16-byte chunk of a row.
[[nodiscard]] absl::Status GatherRows(const GatherParams& p, cudaStream_t stream);

}  // namespace kvr::retrieval::cuda
