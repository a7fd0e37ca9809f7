#include "kvr/kv_store/types.h"

#include "absl/strings/str_format.h"

namespace kvr::kv_store {
namespace {
// Bounds that no real model reaches; they keep size arithmetic far from overflow.
constexpr uint32_t kMaxLayers = 4096;
constexpr uint32_t kMaxKvHeads = 4096;
constexpr uint32_t kMaxHeadDim = 8192;
}  // namespace

absl::StatusOr<DType> DTypeFromInt(uint32_t value) {
  switch (value) {
    case 1:
      return DType::kF32;
    case 2:
      return DType::kF16;
    case 3:
      return DType::kBf16;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("unknown dtype %d (expected 1=f32, 2=f16, 3=bf16)", value));
  }
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBf16:
      return "bf16";
  }
  return "unknown";
}

absl::Status SequenceShape::Validate() const {
  if (n_layers == 0 || n_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("n_layers must be in [1, %d], got %d", kMaxLayers, n_layers));
  }
  if (n_kv_heads == 0 || n_kv_heads > kMaxKvHeads) {
    return absl::InvalidArgumentError(
        absl::StrFormat("n_kv_heads must be in [1, %d], got %d", kMaxKvHeads, n_kv_heads));
  }
  if (head_dim == 0 || head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrFormat("head_dim must be in [1, %d], got %d", kMaxHeadDim, head_dim));
  }
  return DTypeFromInt(static_cast<uint32_t>(dtype)).status();
}

}  // namespace kvr::kv_store
