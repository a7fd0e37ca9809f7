#pragma once
// IEEE fp16 and bfloat16 <-> float conversions (bit-exact, round-to-nearest-even on narrowing).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvr {

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Narrows `n` floats to bf16 values written at `dst` (round to nearest even). `dst` may have any
// alignment: KV rows packed into a byte buffer in the store's dtype.
inline void FloatsToBf16Bytes(const float* src, size_t n, void* dst) {
  auto* out = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = FloatToBf16(src[i]);
    std::memcpy(out + 2 * i, &h, sizeof(h));
  }
}

// Widens `n` 16-bit values read at `src` (any alignment) to floats with `Widen`.
template <float (*Widen)(uint16_t)>
inline void HalfBytesToFloats(const void* src, size_t n, float* dst) {
  const auto* in = static_cast<const uint8_t*>(src);
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, sizeof(h));
    dst[i] = Widen(h);
  }
}

// Widens `n` bf16 values read at `src` (any alignment) to floats (exact).
inline void Bf16BytesToFloats(const void* src, size_t n, float* dst) {
  HalfBytesToFloats<Bf16ToFloat>(src, n, dst);
}

inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while ((mantissa & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mantissa & 0x3ffu) << 13;
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else {
    bits = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Widens `n` fp16 values read at `src` (any alignment) to floats (exact).
inline void Fp16BytesToFloats(const void* src, size_t n, float* dst) {
  HalfBytesToFloats<Fp16ToFloat>(src, n, dst);
}

inline uint16_t FloatToFp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // fp16 subnormal or zero: value = n * 2^-24, n rounded half-even
    float a;
    std::memcpy(&a, &abs, sizeof(a));
    // Exact scaling by a power of two; nearbyint rounds half-to-even in the default FP mode.
    // n == 1024 encodes the smallest normal, which is the right answer for that rounding.
    const auto n = static_cast<uint32_t>(std::nearbyint(a * 16777216.0f));
    return static_cast<uint16_t>(sign | n);
  }
  uint32_t result = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

}  // namespace kvr
