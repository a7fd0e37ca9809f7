#pragma once
// A weight matrix kept in its ggml storage format (Q4_0, Q4_1, Q8_0, F16, BF16, F32) and the
// product C = A W^T computed on it without a float32 copy of W:
//   - few rows of A (decode): the CpuKernels gemv, A's rows quantised to 8-bit blocks on the fly
//     for the block formats;
//   - many rows (prefill): W is dequantised a tile of rows at a time (exactly as the float32
//     load would) into a per-thread buffer and multiplied with SGEMM.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/model/cpu_kernels.h"
#include "kvr/model/tensor_types.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {

struct PackedMatrix {
  GgmlType type = GgmlType::kF32;
  int64_t rows = 0;       // out features
  int64_t cols = 0;       // in features (a multiple of the type's block size)
  int64_t row_bytes = 0;  // GgmlRowBytes(type, cols)
  std::vector<uint8_t> bytes;  // [rows, row_bytes]

  bool empty() const { return rows == 0; }
  const uint8_t* row(int64_t r) const { return bytes.data() + r * row_bytes; }
  // Dequantises row r into out[0..cols) (bit-exact with DequantizeRow).
  void DequantizeRowInto(int64_t r, float* out) const;
};

// An empty [rows, cols] matrix of `type` whose bytes the caller fills row by row. Fails when
// `type` is unknown or cols is not a multiple of its block size.
[[nodiscard]] absl::StatusOr<PackedMatrix> NewPackedMatrix(GgmlType type, int64_t rows,
                                                           int64_t cols);

// Quantises float rows w [rows, cols] to `type` with ggml's reference quantisers
// (quantize_row_*_ref: Q4_0, Q4_1, Q8_0; round-to-nearest F16/BF16; F32 copies). Used for
// weights whose stored type the kernels do not take, and by tests.
[[nodiscard]] absl::StatusOr<PackedMatrix> QuantizeMatrix(GgmlType type, const float* w,
                                                          int64_t rows, int64_t cols);

// Up to this many rows of A take the gemv kernels; more take dequantised tiles and SGEMM.
constexpr int64_t kMaxGemvRows = 8;

// How the gemv path treats A with block-format weights.
enum class ActivationPrecision {
  kInt8,     // quantised to 8 bits per block of 32 (integer dot products; the fast path)
  kFloat32,  // kept in float32 (weights decoded to floats; for the logits, which pick tokens)
};

// C[m, n] = A[m, k] * W[n, k]^T with W packed (k == w.cols, n == w.rows), split along n over
// `pool` (may be null). m <= max_gemv_rows takes the gemv kernels. With max_gemv_rows 0 every
// m takes the tiled SGEMM, whose tiles are whole 64-row slices of W wherever n allows: a
// row of C then comes out the same whatever m is and wherever the row sits in A (measured
// with OpenBLAS for such tiles; narrower tail tiles are not), which is what lets a prompt
// prefilled from a cached prefix match a cold prefill bit for bit.
void PackedMatMul(ThreadPool* pool, const CpuKernels& kernels, const float* a, int64_t m,
                  int64_t k, const PackedMatrix& w, float* c,
                  ActivationPrecision precision = ActivationPrecision::kInt8,
                  int64_t max_gemv_rows = kMaxGemvRows);

}  // namespace kvr::model
