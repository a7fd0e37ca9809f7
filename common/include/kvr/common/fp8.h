#pragma once
// OCP FP8 E4M3 ("e4m3fn": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; largest finite
// 448, no infinities, NaN = 0x7f / 0xff) and the scaled fp8 KV row format built on it.
//
// Narrowing follows CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) (cuda_fp8.hpp):
// round to nearest even; magnitudes above 464 (448 + half an ulp) and infinities saturate to
// +-448; NaN becomes 0x7f whatever its sign; -0 keeps its sign (0x80). Bit-identity with that
// intrinsic was checked once, over every float, by a host program built against
// cuda_fp8.hpp; it is not a committed test (the CPU build has no CUDA headers): the parity test
// of the GPU row kernel, when it exists, is where it is checked for good.
// A GPU kernel that uses that intrinsic (or cvt.rn.satfinite.e4m3x2.f32) and the same float
// division and multiplication produces the same bytes and values as the functions below.
//
// Scaled fp8 rows: a vector of `head_dim` values (one KV head's K, or its V, of one token) is
// stored as head_dim e4m3 codes of x / scale plus one float scale = max|x| / 448 over the
// vector's finite values, so the largest magnitude maps to the top of the e4m3 range. Decoding
// is code * scale. Fp8RowLayout below fixes the bytes of a row of several such vectors.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvr {

inline constexpr float kFp8E4m3Max = 448.f;

// Exact widening; 0x7f and 0xff decode to NaN.
inline float Fp8E4m3ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  uint32_t bits;
  if (exponent == 0xfu && mantissa == 0x7u) {
    bits = sign | 0x7fc00000u;  // quiet NaN
  } else if (exponent == 0) {
    // Subnormal: mantissa * 2^-9, exact in float.
    float f = static_cast<float>(mantissa) * (1.f / 512.f);
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else {
    bits = sign | (exponent - 7 + 127) << 23 | mantissa << 20;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Narrowing with round-to-nearest-even and saturation (see the file comment). Inline and
// branch-free (both roundings computed, one selected), so that encoding loops compile to
// straight-line code: the store encodes every row of an fp8 sequence as it is written.
inline uint8_t FloatToFp8E4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7fffffffu;
  // Normal (from 2^-6): exponent field = float exponent - 127 + 7 and the top 3 of 23 mantissa
  // bits, i.e. (abs >> 20) - (120 << 3), rounded half to even on the 20 bits dropped by adding
  // 0x7ffff plus the kept lowest bit first (no branch on the dropped bits, which are random); a
  // mantissa carry moves into the exponent.
  const uint32_t normal = ((abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20) - (120u << 3);
  // Below 2^-6: value = n * 2^-9 with n in [0, 8] rounded half to even, by adding 2^23 (the
  // float addition rounds to an integer in the default rounding mode; the scaling is exact).
  // n == 8 is the code of 2^-6, the right answer for that rounding.
  float a;
  std::memcpy(&a, &abs, sizeof(a));
  const float shifted = a * 512.f + 8388608.f;
  uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  uint32_t code = abs < 0x3c800000u ? shifted_bits - 0x4b000000u : normal;
  // Above 464 (0x43e80000) rounding would leave the range: saturate (infinities too). 464
  // itself is the tie between 448 and the missing 480 and rounds to 448 (even) above.
  code = abs > 0x43e80000u ? 0x7eu : code;
  // NaN: 0x7f, its sign dropped as __nv_cvt_float_to_fp8 does.
  return static_cast<uint8_t>(abs > 0x7f800000u ? 0x7fu : (sign | code));
}

// The scale of one vector: max |x| over its finite values / 448; 1 when that maximum is 0 (a
// zero vector, or one without finite values), so that encoding never divides by zero.
float Fp8Scale(const float* x, size_t n);

// Codes of x[i] / scale (scale from Fp8Scale or any positive finite value). Every float has a
// code: NaN -> 0x7f, beyond the range -> +-448.
void EncodeFp8(const float* x, size_t n, float scale, uint8_t* codes);

// x[i] = Fp8E4m3ToFloat(codes[i]) * scale.
void DecodeFp8(const uint8_t* codes, size_t n, float scale, float* x);

// Scales and encodes `x` in place of a round trip through storage: x[i] becomes the value a
// reader of the fp8 row would see. What an evaluation of the format's quality cost applies to
// rows that would be read from fp8 storage.
void RoundTripFp8(float* x, size_t n);

// Byte layout of one fp8 row holding `n_vectors` vectors of `head_dim` values, each with its
// own scale:
//   [n_vectors * head_dim e4m3 codes][n_vectors float scales, host byte order][0-7 zero bytes]
// e.g. a store row [k | v] of one (token, KV head) is n_vectors = 2: k codes, v codes, k scale,
// v scale (136 bytes at head_dim 64 instead of 256 in bf16; 264 instead of 512 at 128).
// Why one contiguous range per row rather than scales in a separate array: the store gathers
// whole rows by index (one range per row, one region per reply), and the hot cache keeps rows
// in fixed slots; scales inside the row keep both unchanged. Why codes first: the codes start
// at the row's start, so a warp reads them with aligned vector loads (8 bytes per lane: a row
// stride that is a multiple of 8 keeps every row 8-aligned in an 8-aligned buffer), then
// broadcasts the n_vectors scales read from ScaleOffset().
struct Fp8RowLayout {
  int n_vectors = 2;
  int head_dim = 0;

  size_t CodeBytes() const { return static_cast<size_t>(n_vectors) * head_dim; }
  size_t ScaleOffset() const { return CodeBytes(); }
  // A multiple of 8.
  size_t RowBytes() const { return (CodeBytes() + sizeof(float) * n_vectors + 7) / 8 * 8; }
};

// Encodes one row: `src` [n_vectors, head_dim] floats -> `dst` (layout.RowBytes() bytes, any
// alignment; padding bytes are written as zero).
void EncodeFp8Row(const Fp8RowLayout& layout, const float* src, uint8_t* dst);
// Decodes one row written by EncodeFp8Row into `dst` [n_vectors, head_dim].
void DecodeFp8Row(const Fp8RowLayout& layout, const uint8_t* src, float* dst);

}  // namespace kvr
