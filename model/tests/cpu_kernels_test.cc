// Parity of the CPU matrix-vector kernels (cpu_kernels.h) and PackedMatMul with a float64
// reference, for every instruction set this machine can run (generic always) and every weight
// format the kernels take.
//
// Reference: the weights as DequantizeRow decodes them (bit-exact with ggml), times the float
// activations, summed in double. Tolerances:
//   - F32/F16/BF16 weights (float activations): |y - ref| <= 1e-5 * sum_i |w_i x_i| + 1e-6
//     (float accumulation over <= 1536 terms).
//   - Q4_0/Q4_1/Q8_0 weights (activations quantised to 8 bits per block of 32, rounding to
//     nearest): each activation moves by at most amax_block / 254, so
//     |y - ref| <= sum_blocks (amax_block / 254) * sum_{i in block} |w_i| (x 1.001) plus the
//     float term above. This bound is exact arithmetic, not a fitted number.
// The SIMD paths must also agree with the generic path (same integer sums, different float
// summation order) to 1e-5 relative, and quantise activations to identical bytes.

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/cpu_kernels.h"
#include "kvr/model/dequant.h"
#include "kvr/model/model.h"
#include "kvr/model/packed_matrix.h"

namespace kvr::model {
namespace {

constexpr GgmlType kBlockTypes[] = {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0};
constexpr GgmlType kFloatTypes[] = {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16};

std::vector<float> RandomValues(int64_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  // A few outliers, as real activations have: they set the block scales.
  for (int64_t i = 0; i < n; i += 97) v[static_cast<size_t>(i)] *= 8.f;
  return v;
}

std::vector<float> Dequantized(const PackedMatrix& w) {
  std::vector<float> out(static_cast<size_t>(w.rows * w.cols));
  for (int64_t r = 0; r < w.rows; ++r) {
    EXPECT_TRUE(DequantizeRow(w.type, w.row(r), w.cols, out.data() + r * w.cols).ok());
  }
  return out;
}

struct Reference {
  double value;
  double tolerance;
};

// The float64 product of dequantised row `wd` and `x`, with the tolerance described above.
Reference ReferenceDot(const float* wd, const float* x, int64_t k, bool quantized_activations) {
  double value = 0, magnitude = 0, quant_bound = 0;
  for (int64_t i = 0; i < k; ++i) {
    value += static_cast<double>(wd[i]) * x[i];
    magnitude += std::fabs(static_cast<double>(wd[i]) * x[i]);
  }
  if (quantized_activations) {
    for (int64_t b = 0; b < k; b += 32) {
      double amax = 0, wsum = 0;
      for (int64_t i = b; i < b + 32; ++i) {
        amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
        wsum += std::fabs(static_cast<double>(wd[i]));
      }
      quant_bound += amax / 254.0 * wsum;
    }
  }
  return {value, 1.001 * quant_bound + 1e-5 * magnitude + 1e-6};
}

std::string CaseName(int group, int d, int64_t n_keys) {
  return "group " + std::to_string(group) + " d " + std::to_string(d) + " keys " +
         std::to_string(n_keys);
}

struct Shape {
  int64_t n_rows, k, m;
};
constexpr Shape kShapes[] = {{1, 32, 1}, {17, 64, 1}, {64, 96, 3}, {33, 576, 1},
                             {40, 576, 8}, {16, 1536, 2}, {5, 160, 5}};

class CpuKernelsTest : public testing::TestWithParam<CpuIsa> {
 protected:
  const CpuKernels& kernels() const { return *CpuKernelsFor(GetParam()); }
};

// For every type of `types` and shape of kShapes: weights (random, seed `seed`) times activations
// (seed `seed` + 1) through `gemv(type, w, shape, x, y, ldy)`, y [m, ldy] poisoned with NaN,
// against the float64 reference (`quantized`: with the activation rounding bound). Output rows
// are `pad` floats apart: every written value must be finite and the gaps untouched.
template <typename Gemv>
void CheckGemv(std::span<const GgmlType> types, uint32_t seed, int64_t pad, bool quantized,
               const Gemv& gemv) {
  for (GgmlType type : types) {
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(GgmlTypeName(type) + " rows " + std::to_string(s.n_rows) + " k " +
                   std::to_string(s.k) + " m " + std::to_string(s.m));
      const std::vector<float> w_values = RandomValues(s.n_rows * s.k, seed, 0.05f);
      auto w = QuantizeMatrix(type, w_values.data(), s.n_rows, s.k);
      ASSERT_TRUE(w.ok()) << w.status();
      const std::vector<float> wd = Dequantized(*w);
      const std::vector<float> x = RandomValues(s.m * s.k, seed + 1);
      const int64_t ldy = s.n_rows + pad;
      std::vector<float> y(static_cast<size_t>(s.m * ldy), std::numeric_limits<float>::quiet_NaN());
      gemv(type, *w, s, x, y.data(), ldy);
      for (int64_t j = 0; j < s.m; ++j) {
        for (int64_t r = 0; r < s.n_rows; ++r) {
          const Reference ref =
              ReferenceDot(wd.data() + r * s.k, x.data() + j * s.k, s.k, quantized);
          const float got = y[j * ldy + r];
          ASSERT_TRUE(std::isfinite(got)) << "row " << r << " act " << j;
          EXPECT_NEAR(got, ref.value, ref.tolerance) << "row " << r << " act " << j;
        }
        for (int64_t r = s.n_rows; r < ldy; ++r) EXPECT_TRUE(std::isnan(y[j * ldy + r]));
      }
    }
  }
}

TEST_P(CpuKernelsTest, BlockGemvMatchesFloat64ReferenceWithinQuantisationBound) {
  CheckGemv(kBlockTypes, 1, 3, /*quantized=*/true,
            [&](GgmlType type, const PackedMatrix& w, const Shape& s, const std::vector<float>& x,
                float* y, int64_t ldy) {
              std::vector<ActivationBlock> a(static_cast<size_t>(s.m * s.k / 32));
              for (int64_t j = 0; j < s.m; ++j) {
                kernels().quantize_activations(x.data() + j * s.k, s.k, a.data() + j * s.k / 32);
              }
              kernels().gemv_blocks(type, w.bytes.data(), w.row_bytes, s.n_rows, s.k, a.data(), s.m,
                                    y, ldy);
            });
}

// No activation rounding: the float tolerance.
TEST_P(CpuKernelsTest, BlockGemvOnFloatActivationsMatchesFloat64Reference) {
  CheckGemv(kBlockTypes, 11, 2, /*quantized=*/false,
            [&](GgmlType type, const PackedMatrix& w, const Shape& s, const std::vector<float>& x,
                float* y, int64_t ldy) {
              kernels().gemv_blocks_f32(type, w.bytes.data(), w.row_bytes, s.n_rows, s.k, x.data(),
                                        s.m, y, ldy);
            });
}

TEST_P(CpuKernelsTest, DequantizesRowsBitExactlyLikeDequantizeRow) {
  const int64_t rows = 5, k = 160;
  const std::vector<float> w_values = RandomValues(rows * k, 16, 0.05f);
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kF32,
                        GgmlType::kF16, GgmlType::kBF16}) {
    SCOPED_TRACE(GgmlTypeName(type));
    auto w = QuantizeMatrix(type, w_values.data(), rows, k);
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<float> got(rows * k, std::numeric_limits<float>::quiet_NaN());
    kernels().dequantize_rows(type, w->bytes.data(), w->row_bytes, rows, k, got.data());
    const std::vector<float> ref = Dequantized(*w);
    for (int64_t i = 0; i < rows * k; ++i) ASSERT_EQ(got[i], ref[i]) << "element " << i;
  }
}

TEST_P(CpuKernelsTest, FloatGemvMatchesFloat64Reference) {
  CheckGemv(kFloatTypes, 3, 0, /*quantized=*/false,
            [&](GgmlType type, const PackedMatrix& w, const Shape& s, const std::vector<float>& x,
                float* y, int64_t ldy) {
              kernels().gemv_floats(type, w.bytes.data(), w.row_bytes, s.n_rows, s.k, x.data(), s.m,
                                    y, ldy);
            });
}

TEST_P(CpuKernelsTest, QuantisesActivationsLikeTheGenericPath) {
  const CpuKernels& generic = *CpuKernelsFor(CpuIsa::kGeneric);
  std::vector<float> x = RandomValues(32 * 40, 5);
  for (int i = 0; i < 32; ++i) x[32 + i] = 0.f;  // an all-zero block: d = 0, qs = 0
  x[64] = 0.5f * (x[65] = 127.f);                // a tie that rounds to even
  std::vector<ActivationBlock> mine(40), ref(40);
  kernels().quantize_activations(x.data(), 32 * 40, mine.data());
  generic.quantize_activations(x.data(), 32 * 40, ref.data());
  for (int b = 0; b < 40; ++b) {
    EXPECT_EQ(mine[b].d, ref[b].d) << "block " << b;
    EXPECT_EQ(mine[b].sum, ref[b].sum) << "block " << b;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      EXPECT_EQ(mine[b].qs[i], ref[b].qs[i]) << "block " << b << " element " << i;
      sum += mine[b].qs[i];
      // Round to nearest: within half a step of the input.
      EXPECT_LE(std::fabs(mine[b].qs[i] * mine[b].d - x[b * 32 + i]), 0.5001f * mine[b].d);
    }
    EXPECT_EQ(mine[b].sum, sum);
  }
  EXPECT_EQ(mine[1].d, 0.f);
  EXPECT_EQ(mine[2].qs[0], 64);  // 63.5 -> 64 (even)
}

TEST_P(CpuKernelsTest, AgreesWithTheGenericPath) {
  const CpuKernels& generic = *CpuKernelsFor(CpuIsa::kGeneric);
  const int64_t rows = 48, k = 1536, m = 2;
  const std::vector<float> w_values = RandomValues(rows * k, 6, 0.05f);
  const std::vector<float> x = RandomValues(m * k, 7);
  std::vector<ActivationBlock> a(static_cast<size_t>(m * k / 32));
  for (int64_t j = 0; j < m; ++j) generic.quantize_activations(x.data() + j * k, k, a.data() + j * k / 32);
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kF32,
                        GgmlType::kF16, GgmlType::kBF16}) {
    SCOPED_TRACE(GgmlTypeName(type));
    auto w = QuantizeMatrix(type, w_values.data(), rows, k);
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<float> mine(m * rows), ref(m * rows);
    if (IsBlockKernelType(type)) {
      kernels().gemv_blocks(type, w->bytes.data(), w->row_bytes, rows, k, a.data(), m, mine.data(), rows);
      generic.gemv_blocks(type, w->bytes.data(), w->row_bytes, rows, k, a.data(), m, ref.data(), rows);
    } else {
      kernels().gemv_floats(type, w->bytes.data(), w->row_bytes, rows, k, x.data(), m, mine.data(), rows);
      generic.gemv_floats(type, w->bytes.data(), w->row_bytes, rows, k, x.data(), m, ref.data(), rows);
    }
    const std::vector<float> wd = Dequantized(*w);
    for (int64_t i = 0; i < m * rows; ++i) {
      const Reference r = ReferenceDot(wd.data() + (i % rows) * k, x.data() + (i / rows) * k, k, false);
      EXPECT_NEAR(mine[i], ref[i], r.tolerance) << "output " << i;
    }
  }
}

// Online-softmax state of `heads` query heads before any row.
struct OnlineState {
  OnlineState(int heads, int d) : m(heads, -INFINITY), l(heads, 0.f), acc(int64_t{heads} * d, 0.f) {}
  std::vector<float> m, l, acc;
};

// K/V as the kernel reads them: float32, or the same values rounded to IEEE half (then `f32`
// holds the rounded values, which the float64 reference uses).
struct KvRowsUnderTest {
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  const void* data(bool half) const { return half ? static_cast<const void*>(f16.data()) : f32.data(); }
};
KvRowsUnderTest RowsOf(std::vector<float> values, bool half) {
  KvRowsUnderTest r;
  if (half) {
    for (float& x : values) r.f16.push_back(FloatToFp16(x)), x = Fp16ToFloat(r.f16.back());
  }
  r.f32 = std::move(values);
  return r;
}

// One decode token's attention (attend_rows + FinishAttention) for a group of heads against a
// float64 softmax over the same (f32 or f16-rounded) rows. Tolerance 2e-5 x max|v|: float
// scores, the online rescaling (a few roundings per rise of the maximum) and the vectorised
// exp's < 2e-7 relative error.
TEST_P(CpuKernelsTest, AttendRowsMatchesFloat64Softmax) {
  struct Case {
    int group, d;
    int64_t n_keys, row_stride;
  };
  for (const bool half : {false, true}) {
    for (const Case& c : {Case{3, 64, 1, 192}, Case{3, 64, 9, 192}, Case{3, 64, 300, 200},
                          Case{1, 128, 17, 128}, Case{5, 64, 40, 320}, Case{8, 128, 33, 1024},
                          Case{2, 32, 65, 64}, Case{2, 40, 20, 80}, Case{4, 24, 8, 24}}) {
      SCOPED_TRACE(CaseName(c.group, c.d, c.n_keys) + (half ? " f16" : " f32"));
      const std::vector<float> q = RandomValues(c.group * c.d, 13, 0.5f);
      // Rising keys make the running maximum rise often (the rescaling path).
      std::vector<float> kvals = RandomValues(c.n_keys * c.row_stride, 14);
      for (int64_t r = 0; r < c.n_keys; ++r) {
        for (int i = 0; i < c.d; ++i) kvals[r * c.row_stride + i] += 0.01f * r * q[i];
      }
      const KvRowsUnderTest k = RowsOf(std::move(kvals), half);
      const KvRowsUnderTest v = RowsOf(RandomValues(c.n_keys * c.row_stride, 15), half);
      const float scale = 1.f / std::sqrt(static_cast<float>(c.d));
      OnlineState st(c.group, c.d);
      kernels().attend_rows(q.data(), c.group, c.d, scale,
                            {k.data(half), v.data(half), c.n_keys, c.row_stride, half},
                            st.m.data(), st.l.data(), st.acc.data());
      std::vector<float> out(c.group * c.d, std::numeric_limits<float>::quiet_NaN());
      FinishAttention(c.group, c.d, st.l.data(), st.acc.data(), out.data());
      double vmax = 0;
      for (float x : v.f32) vmax = std::max(vmax, std::fabs(static_cast<double>(x)));
      for (int g = 0; g < c.group; ++g) {
        std::vector<double> p(c.n_keys);
        double max_s = -INFINITY, sum = 0;
        for (int64_t r = 0; r < c.n_keys; ++r) {
          double s = 0;
          for (int i = 0; i < c.d; ++i) {
            s += static_cast<double>(q[g * c.d + i]) * k.f32[r * c.row_stride + i];
          }
          p[r] = s * scale;
          max_s = std::max(max_s, p[r]);
        }
        for (double& x : p) sum += (x = std::exp(x - max_s));
        for (int i = 0; i < c.d; ++i) {
          double ref = 0;
          for (int64_t r = 0; r < c.n_keys; ++r) ref += p[r] / sum * v.f32[r * c.row_stride + i];
          ASSERT_NEAR(out[g * c.d + i], ref, 2e-5 * vmax) << "head " << g << " dim " << i;
        }
      }
    }
  }
}

// The property the model's dense attention and the decode node's attention rely on to agree bit
// for bit: the same rows attended in one call, in runs of any lengths (a decode node's sinks,
// fetched rows and local window), or one head at a time give identical bits.
TEST_P(CpuKernelsTest, AttendRowsIsIndependentOfHowRowsAndHeadsAreSplit) {
  constexpr int kGroup = 3, kD = 64;
  constexpr int64_t kRows = 517, kStride = 3 * kD;
  for (const bool half : {false, true}) {
    SCOPED_TRACE(half ? "f16" : "f32");
    const std::vector<float> q = RandomValues(kGroup * kD, 21, 0.8f);
    const KvRowsUnderTest k = RowsOf(RandomValues(kRows * kStride, 22), half);
    const KvRowsUnderTest v = RowsOf(RandomValues(kRows * kStride, 23), half);
    const size_t elem = half ? 2 : 4;
    auto rows = [&](int64_t begin, int64_t n, int head_offset) {
      const auto* kb = static_cast<const uint8_t*>(k.data(half));
      const auto* vb = static_cast<const uint8_t*>(v.data(half));
      const size_t at = (begin * kStride + head_offset) * elem;
      return AttentionRows{kb + at, vb + at, n, kStride, half};
    };
    const float scale = 0.125f;
    OnlineState whole(kGroup, kD);
    kernels().attend_rows(q.data(), kGroup, kD, scale, rows(0, kRows, 0), whole.m.data(),
                          whole.l.data(), whole.acc.data());
    std::mt19937 rng(7);
    for (int trial = 0; trial < 20; ++trial) {
      OnlineState split(kGroup, kD);
      for (int h = 0; h < kGroup; ++h) {
        for (int64_t begin = 0; begin < kRows;) {
          const int64_t n = std::min<int64_t>(kRows - begin, 1 + rng() % 70);
          kernels().attend_rows(q.data() + h * kD, 1, kD, scale, rows(begin, n, 0),
                                split.m.data() + h, split.l.data() + h,
                                split.acc.data() + h * kD);
          begin += n;
        }
      }
      ASSERT_EQ(split.m, whole.m);
      ASSERT_EQ(split.l, whole.l);
      ASSERT_EQ(0, std::memcmp(split.acc.data(), whole.acc.data(), split.acc.size() * 4));
    }
  }
}

TEST_P(CpuKernelsTest, FinishAttentionOfNoRowsIsZero) {
  OnlineState st(2, 32);
  kernels().attend_rows(nullptr, 2, 32, 1.f, {nullptr, nullptr, 0, 32, false}, st.m.data(),
                        st.l.data(), st.acc.data());
  std::vector<float> out(64, std::numeric_limits<float>::quiet_NaN());
  FinishAttention(2, 32, st.l.data(), st.acc.data(), out.data());
  for (float x : out) ASSERT_EQ(x, 0.f);
}

// The prefill softmax of one query row against a float64 softmax of the same scores: the
// visible prefix sums to 1 and matches within 1e-6 absolute (the vectorised exp's < 2e-7
// relative error and float sums of up to 4,099 terms), the rest is exactly 0, for lengths on
// and off the eight-lane boundary and score spreads wide enough that some exponentials
// underflow.
TEST_P(CpuKernelsTest, SoftmaxPrefixMatchesFloat64Softmax) {
  struct Case {
    int64_t visible, n;
    float spread;
  };
  for (const Case& c :
       {Case{1, 1, 1.f}, Case{1, 9, 1.f}, Case{7, 7, 3.f}, Case{8, 16, 3.f}, Case{9, 9, 3.f},
        Case{100, 130, 10.f}, Case{4099, 4099, 30.f}, Case{513, 1024, 100.f}}) {
    SCOPED_TRACE(testing::Message()
                 << "visible " << c.visible << " of " << c.n << ", spread " << c.spread);
    const std::vector<float> scores = RandomValues(c.n, 31 + static_cast<uint32_t>(c.n), c.spread);
    std::vector<float> s = scores;
    kernels().softmax_prefix(s.data(), c.visible, c.n);
    double max_s = -INFINITY, sum = 0;
    for (int64_t r = 0; r < c.visible; ++r) max_s = std::max<double>(max_s, scores[r]);
    for (int64_t r = 0; r < c.visible; ++r) sum += std::exp(scores[r] - max_s);
    double total = 0;
    for (int64_t r = 0; r < c.visible; ++r) {
      ASSERT_NEAR(s[r], std::exp(scores[r] - max_s) / sum, 1e-6) << "row " << r;
      total += s[r];
    }
    EXPECT_NEAR(total, 1.0, 1e-5);
    for (int64_t r = c.visible; r < c.n; ++r) ASSERT_EQ(s[r], 0.f) << "row " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(AvailableIsas, CpuKernelsTest, testing::ValuesIn(AvailableCpuIsas()),
                         [](const testing::TestParamInfo<CpuIsa>& info) {
                           return std::string(CpuIsaName(info.param));
                         });

TEST(CpuKernels, GenericIsAlwaysAvailableAndBestIsOneOfThem) {
  ASSERT_NE(CpuKernelsFor(CpuIsa::kGeneric), nullptr);
  const std::vector<CpuIsa> isas = AvailableCpuIsas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), CpuIsa::kGeneric);
  bool found = false;
  for (CpuIsa isa : isas) found = found || BestCpuKernels().isa == isa;
  EXPECT_TRUE(found);
  std::printf("cpu kernels here:");
  for (CpuIsa isa : isas) std::printf(" %s", CpuIsaName(isa));
  std::printf("; best %s\n", CpuIsaName(BestCpuKernels().isa));
}

TEST(QuantizeMatrix, RoundTripsWithinHalfAStep) {
  const int64_t k = 256;
  const std::vector<float> x = RandomValues(k, 8);
  for (GgmlType type : kBlockTypes) {
    SCOPED_TRACE(GgmlTypeName(type));
    auto w = QuantizeMatrix(type, x.data(), 1, k);
    ASSERT_TRUE(w.ok()) << w.status();
    const std::vector<float> back = Dequantized(*w);
    for (int64_t b = 0; b < k; b += 32) {
      float lo = x[b], hi = x[b], amax = 0;
      for (int64_t i = b; i < b + 32; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
        amax = std::max(amax, std::fabs(x[i]));
      }
      // Half a step of each format (plus fp16 rounding of the scale and minimum). Q4_0 spans
      // [-8, 7] steps with the largest magnitude at -8, so values of the other sign beyond 7
      // steps clamp: up to one whole step there.
      const float bound = type == GgmlType::kQ8_0   ? 0.5f * amax / 127
                          : type == GgmlType::kQ4_0 ? amax / 8
                                                    : 0.5f * (hi - lo) / 15;
      for (int64_t i = b; i < b + 32; ++i) EXPECT_NEAR(back[i], x[i], 1.01f * bound + 2e-3f * amax);
    }
  }
  EXPECT_FALSE(QuantizeMatrix(GgmlType::kQ4_K, x.data(), 1, k).ok());
  EXPECT_FALSE(QuantizeMatrix(GgmlType::kQ4_0, x.data(), 1, 33).ok());
}

// PackedMatMul against the float32 SGEMM on the dequantised weights: the gemv path (m <=
// kMaxGemvRows) within the quantisation bound, the tiled SGEMM path (more rows) to float
// rounding, both split over a pool.
TEST(PackedMatMul, MatchesFloatMatMulOnDequantisedWeights) {
  ThreadPool pool(2);
  const int64_t n = 200, k = 576;
  const std::vector<float> w_values = RandomValues(n * k, 9, 0.05f);
  for (GgmlType type : {GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kBF16}) {
    auto w = QuantizeMatrix(type, w_values.data(), n, k);
    ASSERT_TRUE(w.ok()) << w.status();
    const std::vector<float> wd = Dequantized(*w);
    for (int64_t m : {int64_t{1}, int64_t{4}, kMaxGemvRows, kMaxGemvRows + 1, int64_t{70}})
    for (ActivationPrecision precision : {ActivationPrecision::kInt8, ActivationPrecision::kFloat32}) {
      SCOPED_TRACE(GgmlTypeName(type) + " m " + std::to_string(m) + " precision " +
                   std::to_string(static_cast<int>(precision)));
      const std::vector<float> x = RandomValues(m * k, 10);
      std::vector<float> got(m * n, std::numeric_limits<float>::quiet_NaN()), ref(m * n);
      PackedMatMul(&pool, BestCpuKernels(), x.data(), m, k, *w, got.data(), precision);
      MatMulTransposed(&pool, x.data(), m, k, wd.data(), n, ref.data());
      const bool quantized = m <= kMaxGemvRows && IsBlockKernelType(type) &&
                             precision == ActivationPrecision::kInt8;
      for (int64_t i = 0; i < m * n; ++i) {
        const Reference r = ReferenceDot(wd.data() + (i % n) * k, x.data() + (i / n) * k, k, quantized);
        ASSERT_NEAR(got[i], ref[i], r.tolerance) << "output " << i;
      }
    }
  }
}

}  // namespace
}  // namespace kvr::model
