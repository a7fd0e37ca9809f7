#include "kvr/common/fp8.h"

#include <algorithm>
#include <cmath>

namespace kvr {

uint8_t FloatToFp8E4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;  // NaN, sign dropped as __nv_cvt_float_to_fp8 does
  // Above 464 (0x43e80000) rounding would leave the range: saturate (infinities too). 464
  // itself is the tie between 448 and the missing 480 and rounds to 448 (even) below.
  if (abs > 0x43e80000u) return static_cast<uint8_t>(sign | 0x7eu);
  if (abs < 0x3c800000u) {
    // Below 2^-6, the smallest normal: value = n * 2^-9 with n in [0, 8], n rounded half to
    // even. The scaling is exact (a power of two); nearbyint rounds half to even in the default
    // FP mode. n == 8 is the code of 2^-6, the right answer for that rounding.
    float a;
    std::memcpy(&a, &abs, sizeof(a));
    const auto n = static_cast<uint32_t>(std::nearbyint(a * 512.f));
    return static_cast<uint8_t>(sign | n);
  }
  // Normal: exponent field = float exponent - 127 + 7, the top 3 of 23 mantissa bits, rounded
  // half to even on the 20 bits dropped; a mantissa carry moves into the exponent.
  uint32_t code = ((abs >> 23) - 127 + 7) << 3 | ((abs >> 20) & 0x7u);
  const uint32_t rest = abs & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ++code;
  return static_cast<uint8_t>(sign | code);
}

float Fp8Scale(const float* x, size_t n) {
  float amax = 0.f;
  for (size_t i = 0; i < n; ++i) {
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
  }
  const float scale = amax / kFp8E4m3Max;
  return scale > 0.f ? scale : 1.f;
}

void EncodeFp8(const float* x, size_t n, float scale, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) codes[i] = FloatToFp8E4m3(x[i] / scale);
}

void DecodeFp8(const uint8_t* codes, size_t n, float scale, float* x) {
  for (size_t i = 0; i < n; ++i) x[i] = Fp8E4m3ToFloat(codes[i]) * scale;
}

void RoundTripFp8(float* x, size_t n) {
  const float scale = Fp8Scale(x, n);
  for (size_t i = 0; i < n; ++i) x[i] = Fp8E4m3ToFloat(FloatToFp8E4m3(x[i] / scale)) * scale;
}

void EncodeFp8Row(const Fp8RowLayout& layout, const float* src, uint8_t* dst) {
  const size_t hd = static_cast<size_t>(layout.head_dim);
  for (int v = 0; v < layout.n_vectors; ++v) {
    const float* x = src + v * hd;
    const float scale = Fp8Scale(x, hd);
    EncodeFp8(x, hd, scale, dst + v * hd);
    std::memcpy(dst + layout.ScaleOffset() + v * sizeof(float), &scale, sizeof(float));
  }
  const size_t used = layout.ScaleOffset() + sizeof(float) * layout.n_vectors;
  std::memset(dst + used, 0, layout.RowBytes() - used);
}

void DecodeFp8Row(const Fp8RowLayout& layout, const uint8_t* src, float* dst) {
  const size_t hd = static_cast<size_t>(layout.head_dim);
  for (int v = 0; v < layout.n_vectors; ++v) {
    float scale;
    std::memcpy(&scale, src + layout.ScaleOffset() + v * sizeof(float), sizeof(float));
    DecodeFp8(src + v * hd, hd, scale, dst + v * hd);
  }
}

}  // namespace kvr
