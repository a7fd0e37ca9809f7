#include "kvr/model/dequant.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"

// Every formula below follows ggml-quants.c `dequantize_row_*` operation by operation: the fp16
// scales are widened to fp32 first, then each product and sum is a separate fp32 operation in
// the reference's order. This file is compiled with -ffp-contract=off (model/formats.cmake) so
// that `a * b + c` is never fused into an FMA, which would change the rounding and break
// bit-exactness with ggml and the gguf Python package.

namespace kvr::model {
namespace {

constexpr int64_t kQk = 32;    // elements per block of the Q4_0..Q8_0 family
constexpr int64_t kQkK = 256;  // elements per super-block of the K-quants

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return Fp16ToFloat(h);
}

// The unquantised types have one-element blocks: n_blocks is the element count.
void DequantF32(const uint8_t* src, int64_t n, float* y) {
  std::memcpy(y, src, static_cast<size_t>(n) * sizeof(float));
}

void DequantF16(const uint8_t* src, int64_t n, float* y) {
  Fp16BytesToFloats(src, static_cast<size_t>(n), y);
}

void DequantBf16(const uint8_t* src, int64_t n, float* y) {
  Bf16BytesToFloats(src, static_cast<size_t>(n), y);
}

// One 4- or 5-bit value q of a block with scale d and, in the "_1" formats, minimum m: ggml's
// q * d + m for those, (q - offset) * d for the "_0" formats (no addition of a zero m: that
// would turn -0 into +0).
template <bool kMin>
float Dequant1(int q, int offset, float d, float m) {
  if constexpr (kMin) {
    return static_cast<float>(q) * d + m;
  } else {
    return static_cast<float>(q - offset) * d;
  }
}

// block_q4_0 { half d; uint8 qs[16]; } : 18 bytes (kMin false)
// block_q4_1 { half d; half m; uint8 qs[16]; } : 20 bytes (kMin true)
template <bool kMin>
void DequantQ4(const uint8_t* x, int64_t nb, float* y) {
  constexpr int kHeader = kMin ? 4 : 2;
  for (int64_t i = 0; i < nb; ++i, x += kHeader + kQk / 2, y += kQk) {
    const float d = Half(x);
    const float m = kMin ? Half(x + 2) : 0.f;
    const uint8_t* qs = x + kHeader;
    for (int j = 0; j < kQk / 2; ++j) {
      y[j] = Dequant1<kMin>(qs[j] & 0x0F, 8, d, m);
      y[j + kQk / 2] = Dequant1<kMin>(qs[j] >> 4, 8, d, m);
    }
  }
}

// block_q5_0 { half d; uint8 qh[4]; uint8 qs[16]; } : 22 bytes; qh bit j is bit 4 of element j
// (kMin false).
// block_q5_1 { half d; half m; uint8 qh[4]; uint8 qs[16]; } : 24 bytes (kMin true)
template <bool kMin>
void DequantQ5(const uint8_t* x, int64_t nb, float* y) {
  constexpr int kScales = kMin ? 4 : 2;
  for (int64_t i = 0; i < nb; ++i, x += kScales + 4 + kQk / 2, y += kQk) {
    const float d = Half(x);
    const float m = kMin ? Half(x + 2) : 0.f;
    uint32_t qh;
    std::memcpy(&qh, x + kScales, sizeof(qh));
    const uint8_t* qs = x + kScales + 4;
    for (int j = 0; j < kQk / 2; ++j) {
      const uint8_t xh0 = ((qh >> (j + 0)) << 4) & 0x10;
      const uint8_t xh1 = ((qh >> (j + 12))) & 0x10;
      y[j] = Dequant1<kMin>((qs[j] & 0x0F) | xh0, 16, d, m);
      y[j + kQk / 2] = Dequant1<kMin>((qs[j] >> 4) | xh1, 16, d, m);
    }
  }
}

// block_q8_0 { half d; int8 qs[32]; } : 34 bytes
void DequantQ8_0(const uint8_t* x, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, x += 34, y += kQk) {
    const float d = Half(x);
    const auto* qs = reinterpret_cast<const int8_t*>(x + 2);
    for (int j = 0; j < kQk; ++j) y[j] = static_cast<float>(qs[j]) * d;
  }
}

// block_q2_K { uint8 scales[16]; uint8 qs[64]; half d; half dmin; } : 84 bytes
void DequantQ2_K(const uint8_t* x, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, x += 84) {
    const float d = Half(x + 80);
    const float min = Half(x + 82);
    const uint8_t* scales = x;
    const uint8_t* q = x + 16;
    int is = 0;
    for (int n = 0; n < kQkK; n += 128) {
      int shift = 0;
      for (int j = 0; j < 4; ++j) {
        uint8_t sc = scales[is++];
        float dl = d * static_cast<float>(sc & 0xF);
        float ml = min * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((q[l] >> shift) & 3) - ml;
        sc = scales[is++];
        dl = d * static_cast<float>(sc & 0xF);
        ml = min * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) {
          *y++ = dl * static_cast<float>((q[l + 16] >> shift) & 3) - ml;
        }
        shift += 2;
      }
      q += 32;
    }
  }
}

// block_q3_K { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d; } : 110 bytes.
// The 16 6-bit scales are packed as in ggml: low nibbles in bytes 0-7, high 2-bit pairs in 8-11.
void DequantQ3_K(const uint8_t* x, int64_t nb, float* y) {
  constexpr uint32_t kMask1 = 0x03030303;
  constexpr uint32_t kMask2 = 0x0f0f0f0f;
  for (int64_t i = 0; i < nb; ++i, x += 110) {
    const float d_all = Half(x + 108);
    const uint8_t* hm = x;
    const uint8_t* q = x + 32;
    uint32_t aux[4];
    std::memcpy(aux, x + 96, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kMask2) | (((tmp >> 4) & kMask1) << 4);
    aux[3] = ((aux[1] >> 4) & kMask2) | (((tmp >> 6) & kMask1) << 4);
    aux[0] = (aux[0] & kMask2) | (((tmp >> 0) & kMask1) << 4);
    aux[1] = (aux[1] & kMask2) | (((tmp >> 2) & kMask1) << 4);
    int8_t scales[16];
    std::memcpy(scales, aux, 16);
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < kQkK; n += 128) {
      int shift = 0;
      for (int j = 0; j < 4; ++j) {
        float dl = d_all * static_cast<float>(scales[is++] - 32);
        for (int l = 0; l < 16; ++l) {
          const int v = ((q[l + 0] >> shift) & 3) - ((hm[l + 0] & m) ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
        dl = d_all * static_cast<float>(scales[is++] - 32);
        for (int l = 0; l < 16; ++l) {
          const int v = ((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
        shift += 2;
        m <<= 1;
      }
      q += 32;
    }
  }
}

// The 12 packed bytes of 6-bit scales and mins of Q4_K / Q5_K (ggml's get_scale_min_k4).
inline void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

// The scales and mins of sub-blocks `is` and `is + 1` of a Q4_K / Q5_K super-block with scale d
// and minimum `min`: d * sc and min * m for each, as ggml computes them.
struct SubBlockScales {
  float d1, m1, d2, m2;
};
inline SubBlockScales ScaleMinPair(int is, const uint8_t* scales, float d, float min) {
  uint8_t sc, m;
  ScaleMinK4(is + 0, scales, &sc, &m);
  const float d1 = d * sc;
  const float m1 = min * m;
  ScaleMinK4(is + 1, scales, &sc, &m);
  return {d1, m1, d * sc, min * m};
}

// block_q4_K { half d; half dmin; uint8 scales[12]; uint8 qs[128]; } : 144 bytes
void DequantQ4_K(const uint8_t* x, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, x += 144) {
    const float d = Half(x);
    const float min = Half(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* q = x + 16;
    int is = 0;
    for (int j = 0; j < kQkK; j += 64) {
      const auto [d1, m1, d2, m2] = ScaleMinPair(is, scales, d, min);
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
      q += 32;
      is += 2;
    }
  }
}

// block_q5_K { half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]; } : 176 bytes
void DequantQ5_K(const uint8_t* x, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, x += 176) {
    const float d = Half(x);
    const float min = Half(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* qh = x + 16;
    const uint8_t* ql = x + 48;
    int is = 0;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < kQkK; j += 64) {
      const auto [d1, m1, d2, m2] = ScaleMinPair(is, scales, d, min);
      for (int l = 0; l < 32; ++l) {
        *y++ = d1 * static_cast<float>((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        *y++ = d2 * static_cast<float>((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
      }
      ql += 32;
      is += 2;
      u1 <<= 2;
      u2 <<= 2;
    }
  }
}

// block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; } : 210 bytes
void DequantQ6_K(const uint8_t* x, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, x += 210) {
    const float d = Half(x + 208);
    const uint8_t* ql = x;
    const uint8_t* qh = x + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(x + 192);
    for (int n = 0; n < kQkK; n += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        // (d * sc) first, as in the reference `d * sc[is] * q`.
        y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

// Each dequantisable type's row function: (block bytes, number of blocks, output elements).
struct Dequantizer {
  GgmlType type;
  void (*row)(const uint8_t* x, int64_t n_blocks, float* y);
};
constexpr Dequantizer kDequantizers[] = {
    {GgmlType::kF32, DequantF32},       {GgmlType::kF16, DequantF16},
    {GgmlType::kBF16, DequantBf16},     {GgmlType::kQ4_0, DequantQ4<false>},
    {GgmlType::kQ4_1, DequantQ4<true>}, {GgmlType::kQ5_0, DequantQ5<false>},
    {GgmlType::kQ5_1, DequantQ5<true>}, {GgmlType::kQ8_0, DequantQ8_0},
    {GgmlType::kQ2_K, DequantQ2_K},     {GgmlType::kQ3_K, DequantQ3_K},
    {GgmlType::kQ4_K, DequantQ4_K},     {GgmlType::kQ5_K, DequantQ5_K},
    {GgmlType::kQ6_K, DequantQ6_K},
};

}  // namespace

absl::Status DequantizeRow(GgmlType type, const void* src, int64_t n, float* dst) {
  auto traits = GetGgmlTypeTraits(type);
  if (!traits.ok()) return traits.status();
  if (!traits->dequantizable) {
    return absl::UnimplementedError(absl::StrCat("dequantisation of ggml type ", traits->name,
                                                 " (id ", static_cast<uint32_t>(type),
                                                 ") is not supported"));
  }
  if (n < 0 || n % traits->block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot dequantise ", n, " elements of ",
                                                   traits->name, ": not a multiple of the ",
                                                   traits->block_size, "-element block"));
  }
  for (const Dequantizer& d : kDequantizers) {
    if (d.type == type) {
      d.row(static_cast<const uint8_t*>(src), n / traits->block_size, dst);
      return absl::OkStatus();
    }
  }
  // Unreachable while the traits table's `dequantizable` and kDequantizers agree.
  return absl::InternalError(absl::StrCat("dequantisation table out of sync for ", traits->name));
}

}  // namespace kvr::model
