#include "kvr/common/fp8.h"

#include <algorithm>
#include <cmath>

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
