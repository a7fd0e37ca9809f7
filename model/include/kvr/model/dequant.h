#pragma once
// Dequantisation of ggml tensor rows to float32, bit-exact with ggml's reference
// `dequantize_row_*` (ggml-quants.c) and with the `gguf` Python package's numpy dequantiser:
// fp16 scales are widened to fp32 first and every product/sum is done in fp32 in the same order
// as the reference C code.

#include <cstdint>

#include "absl/status/status.h"
#include "kvr/model/tensor_types.h"

namespace kvr::model {

// Decodes `n` elements of type `type` starting at `src` into dst[0..n).
// `src` must hold GgmlRowBytes(type, n) bytes; no alignment is required.
// Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Other
// types (Q8_1, Q8_K, the IQ and TQ families, integer types) give
// Unimplemented naming the type; n not a multiple of the block size gives InvalidArgument.
[[nodiscard]] absl::Status DequantizeRow(GgmlType type, const void* src, int64_t n, float* dst);

}  // namespace kvr::model
