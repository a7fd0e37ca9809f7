#include "kvr/kv_store/types.h"

#include <cstring>

#include "absl/strings/str_format.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/common/secure_random.h"

namespace kvr::kv_store {

Capability Capability::Generate() {
  Capability cap;
  // All zero is "none"; the chance is 2^-128, but the loop makes "never" exact.
  do {
    SecureRandomBytes(cap.bytes);
  } while (cap.IsNone());
  return cap;
}

absl::StatusOr<Capability> Capability::FromBytes(std::string_view bytes) {
  if (bytes.size() != kBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("capability must be %d bytes, got %d", kBytes, bytes.size()));
  }
  Capability cap;
  std::memcpy(cap.bytes.data(), bytes.data(), kBytes);
  return cap;
}

Capability Capability::FromBytesOrNone(std::string_view bytes) {
  absl::StatusOr<Capability> cap = FromBytes(bytes);
  return cap.ok() ? *cap : Capability{};
}

std::string Capability::ToBytes() const {
  return std::string(reinterpret_cast<const char*>(bytes.data()), kBytes);
}

bool Capability::IsNone() const {
  uint8_t any = 0;
  for (uint8_t b : bytes) any |= b;
  return any == 0;
}

bool Capability::Matches(const Capability& other) const {
  // volatile keeps the compiler from turning the loop into an early-exit memcmp.
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < kBytes; ++i) diff = diff | (bytes[i] ^ other.bytes[i]);
  return diff == 0;
}
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
    case 4:
      return DType::kFp8E4m3;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("unknown dtype %d (expected 1=f32, 2=f16, 3=bf16, 4=fp8_e4m3)", value));
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
    case DType::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "unknown";
}

void StoredRowToFloats(DType dtype, uint32_t head_dim, const uint8_t* row, float* k, float* v) {
  const size_t n = head_dim;
  if (dtype == DType::kFp8E4m3) {
    float scales[2];  // k's, v's (Fp8RowLayout: after the codes)
    std::memcpy(scales, row + Fp8RowLayout{2, static_cast<int>(head_dim)}.ScaleOffset(),
                sizeof(scales));
    DecodeFp8(row, n, scales[0], k);
    if (v != nullptr) DecodeFp8(row + n, n, scales[1], v);
    return;
  }
  const size_t half = n * DTypeSize(dtype);
  for (auto [src, dst] : {std::pair{row, k}, std::pair{row + half, v}}) {
    if (dst == nullptr) continue;
    switch (dtype) {
      case DType::kF32:
        std::memcpy(dst, src, half);
        break;
      case DType::kF16:
        Fp16BytesToFloats(src, n, dst);
        break;
      default:  // kBf16
        Bf16BytesToFloats(src, n, dst);
        break;
    }
  }
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
