#pragma once
// ggml tensor element types as stored in GGUF files, with their block geometry.
//
// Quantised types pack `block_size` consecutive elements of a row into `type_size` bytes; a
// row of n elements therefore takes n / block_size * type_size bytes and n must be a multiple
// of block_size. The numbering is ggml's (ggml.h `enum ggml_type`) because it is what GGUF
// stores on disk.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvr::model {

enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  // 4 and 5 were Q4_2 / Q4_3, removed from ggml.
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
};

struct GgmlTypeTraits {
  absl::string_view name;      // ggml's name, e.g. "q4_K", "bf16"
  int64_t block_size = 0;      // elements per block (1 for plain types)
  int64_t type_size = 0;       // bytes per block
  bool dequantizable = false;  // DequantizeRow supports it
};

// Traits of a type id read from a file. Unknown ids (including the removed 4 and 5) give
// InvalidArgument naming the id.
[[nodiscard]] absl::StatusOr<GgmlTypeTraits> GetGgmlTypeTraits(uint32_t type_id);
[[nodiscard]] absl::StatusOr<GgmlTypeTraits> GetGgmlTypeTraits(GgmlType type);

// "q4_K" for known types, "unknown(<id>)" otherwise; for messages.
std::string GgmlTypeName(GgmlType type);

// Parses ggml's name of a type, case-insensitively ("Q4_K", "q4_k", "bf16").
[[nodiscard]] absl::StatusOr<GgmlType> GgmlTypeFromName(absl::string_view name);

// Bytes taken by `n_elements` consecutive elements (a row). Fails when the type is unknown or
// n_elements is negative or not a multiple of the block size.
[[nodiscard]] absl::StatusOr<uint64_t> GgmlRowBytes(GgmlType type, int64_t n_elements);

}  // namespace kvr::model
