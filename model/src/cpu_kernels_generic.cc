// Portable kernels: the fallback on CPUs without AVX2 and the arithmetic that the SIMD versions
// reproduce (the same integer block sums; only the float accumulation order differs).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <vector>

#include "cpu_kernels_isa.h"
#include "kvr/common/half.h"
#include "kvr/model/dequant.h"

namespace kvr::model::generic {
namespace {

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return Fp16ToFloat(h);
}

inline uint16_t U16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return h;
}

// Dot product of one weight row of `nb` blocks with one activation row.
float DotBlocks(GgmlType type, const uint8_t* w, const ActivationBlock* a, int64_t nb) {
  float acc = 0.f;
  switch (type) {
    case GgmlType::kQ4_0:  // { half d; uint8 qs[16] }: element j = (nibble - 8) * d
      for (int64_t b = 0; b < nb; ++b, w += 18) {
        const uint8_t* qs = w + 2;
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          isum += (qs[j] & 0x0F) * a[b].qs[j] + (qs[j] >> 4) * a[b].qs[j + 16];
        }
        acc += Half(w) * a[b].d * static_cast<float>(isum - 8 * a[b].sum);
      }
      break;
    case GgmlType::kQ4_1:  // { half d; half m; uint8 qs[16] }: element j = nibble * d + m
      for (int64_t b = 0; b < nb; ++b, w += 20) {
        const uint8_t* qs = w + 4;
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          isum += (qs[j] & 0x0F) * a[b].qs[j] + (qs[j] >> 4) * a[b].qs[j + 16];
        }
        acc += Half(w) * a[b].d * static_cast<float>(isum) +
               Half(w + 2) * a[b].d * static_cast<float>(a[b].sum);
      }
      break;
    case GgmlType::kQ8_0:  // { half d; int8 qs[32] }
      for (int64_t b = 0; b < nb; ++b, w += 34) {
        const auto* qs = reinterpret_cast<const int8_t*>(w + 2);
        int32_t isum = 0;
        for (int j = 0; j < 32; ++j) isum += qs[j] * a[b].qs[j];
        acc += Half(w) * a[b].d * static_cast<float>(isum);
      }
      break;
    default:
      break;
  }
  return acc;
}

float DotFloats(GgmlType type, const uint8_t* w, const float* a, int64_t k) {
  float acc = 0.f;
  switch (type) {
    case GgmlType::kF32:
      for (int64_t i = 0; i < k; ++i) {
        float v;
        std::memcpy(&v, w + 4 * i, sizeof(v));
        acc += v * a[i];
      }
      break;
    case GgmlType::kF16:
      for (int64_t i = 0; i < k; ++i) acc += Fp16ToFloat(U16(w + 2 * i)) * a[i];
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < k; ++i) acc += Bf16ToFloat(U16(w + 2 * i)) * a[i];
      break;
    default:
      break;
  }
  return acc;
}

}  // namespace

void QuantizeActivations(const float* x, int64_t n, ActivationBlock* y) {
  for (int64_t b = 0; b < n / kActivationBlockSize; ++b) {
    const float* xb = x + b * kActivationBlockSize;
    float amax = 0.f;
    for (int i = 0; i < kActivationBlockSize; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < kActivationBlockSize; ++i) {
      // Round half to even, as the SIMD conversions do under the default rounding mode.
      const int q = static_cast<int>(std::nearbyint(xb[i] * id));
      y[b].qs[i] = static_cast<int8_t>(q);
      sum += q;
    }
    y[b].d = d;
    y[b].sum = sum;
  }
}

void GemvBlocks(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k,
                const ActivationBlock* a, int64_t m, float* y, int64_t ldy) {
  const int64_t nb = k / kActivationBlockSize;
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t j = 0; j < m; ++j) y[j * ldy + r] = DotBlocks(type, w + r * row_bytes, a + j * nb, nb);
  }
}

void GemvBlocksF32(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k,
                   const float* a, int64_t m, float* y, int64_t ldy) {
  // Each row decoded with the bit-exact reference dequantiser, then a float dot product.
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(k));
  for (int64_t r = 0; r < n_rows; ++r) {
    (void)DequantizeRow(type, w + r * row_bytes, k, row.data());
    for (int64_t j = 0; j < m; ++j) {
      const float* x = a + j * k;
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc += row[i] * x[i];
      y[j * ldy + r] = acc;
    }
  }
}

void DequantizeRows(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k,
                    float* out) {
  for (int64_t r = 0; r < n_rows; ++r) (void)DequantizeRow(type, w + r * row_bytes, k, out + r * k);
}

void AttendRows(const float* q, int n_heads, int d, float scale, const AttentionRows& rows,
                float* m, float* l, float* acc) {
  const auto element = [&](const void* base, int64_t r, int i) {
    const int64_t at = r * rows.row_stride + i;
    return rows.f16 ? Fp16ToFloat(static_cast<const uint16_t*>(base)[at])
                    : static_cast<const float*>(base)[at];
  };
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + int64_t{h} * d;
    float* ah = acc + int64_t{h} * d;
    for (int64_t r = 0; r < rows.n_rows; ++r) {
      float dot = 0.f;
      for (int i = 0; i < d; ++i) dot += qh[i] * element(rows.k, r, i);
      const float s = dot * scale;
      if (s > m[h]) {
        const float alpha = std::exp(m[h] - s);  // 0 for the first row (m = -inf)
        for (int i = 0; i < d; ++i) ah[i] *= alpha;
        l[h] *= alpha;
        m[h] = s;
      }
      const float p = std::exp(s - m[h]);
      l[h] += p;
      for (int i = 0; i < d; ++i) ah[i] += p * element(rows.v, r, i);
    }
  }
}

void GemvFloats(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k,
                const float* a, int64_t m, float* y, int64_t ldy) {
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t j = 0; j < m; ++j) y[j * ldy + r] = DotFloats(type, w + r * row_bytes, a + j * k, k);
  }
}

void SoftmaxPrefix(float* s, int64_t visible, int64_t n) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < visible; ++r) max_score = std::max(max_score, s[r]);
  float sum = 0.f;
  for (int64_t r = 0; r < visible; ++r) sum += (s[r] = std::exp(s[r] - max_score));
  const float inv = 1.f / sum;
  for (int64_t r = 0; r < visible; ++r) s[r] *= inv;
  std::fill(s + visible, s + n, 0.f);
}

}  // namespace kvr::model::generic
