#include "kvr/common/fp8.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvr {

float Fp8Scale(const float* x, size_t n) {
  float amax = 0.f;
  for (size_t i = 0; i < n; ++i) {
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(x[i]));
  }
  const float scale = amax / kFp8E4m3Max;
  return scale > 0.f ? scale : 1.f;
}

void EncodeFp8(const float* x, size_t n, float scale, uint8_t* codes) {
  size_t i = 0;
#if defined(__SSE2__)
  // Four values at a time: FloatToFp8E4m3 step by step in 32-bit lanes (the same division, the
  // same integer rounding, both roundings computed and one selected), then packed to bytes.
  // Every lane op is exact, so the codes are FloatToFp8E4m3's (fp8_test holds them equal).
  const __m128 vscale = _mm_set1_ps(scale);
  const __m128i one = _mm_set1_epi32(1), round = _mm_set1_epi32(0x7ffff);
  const __m128i bias = _mm_set1_epi32(120 << 3), sign_bit = _mm_set1_epi32(0x80);
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
  const __m128 by512 = _mm_set1_ps(512.f), two23 = _mm_set1_ps(8388608.f);
  const __m128i two23_bits = _mm_set1_epi32(0x4b000000);
  const __m128i smallest_normal = _mm_set1_epi32(0x3c800000);
  const __m128i saturate_above = _mm_set1_epi32(0x43e80000), nan_above = _mm_set1_epi32(0x7f800000);
  const __m128i max_code = _mm_set1_epi32(0x7e), nan_code = _mm_set1_epi32(0x7f);
  auto select = [](__m128i mask, __m128i a, __m128i b) {  // mask ? a : b, per lane
    return _mm_or_si128(_mm_and_si128(mask, a), _mm_andnot_si128(mask, b));
  };
  for (; i + 4 <= n; i += 4) {
    const __m128i bits = _mm_castps_si128(_mm_div_ps(_mm_loadu_ps(x + i), vscale));
    const __m128i sign = _mm_and_si128(_mm_srli_epi32(bits, 24), sign_bit);
    const __m128i abs = _mm_and_si128(bits, abs_mask);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(abs, 20), one);
    const __m128i normal =
        _mm_sub_epi32(_mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(abs, round), lsb), 20), bias);
    const __m128i shifted =
        _mm_castps_si128(_mm_add_ps(_mm_mul_ps(_mm_castsi128_ps(abs), by512), two23));
    __m128i code =
        select(_mm_cmplt_epi32(abs, smallest_normal), _mm_sub_epi32(shifted, two23_bits), normal);
    code = select(_mm_cmpgt_epi32(abs, saturate_above), max_code, code);
    code = select(_mm_cmpgt_epi32(abs, nan_above), nan_code, _mm_or_si128(code, sign));
    const __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(code, code), code);
    const int32_t four = _mm_cvtsi128_si32(bytes);
    std::memcpy(codes + i, &four, sizeof(four));
  }
#endif
  for (; i < n; ++i) codes[i] = FloatToFp8E4m3(x[i] / scale);
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
