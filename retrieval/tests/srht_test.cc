#include "srht.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvr::retrieval::internal {
namespace {

std::vector<float> RandomVector(std::mt19937& rng, int n) {
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

double DotD(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

TEST(NextPowerOfTwoTest, Values) {
  EXPECT_EQ(NextPowerOfTwo(1), 1);
  EXPECT_EQ(NextPowerOfTwo(2), 2);
  EXPECT_EQ(NextPowerOfTwo(3), 4);
  EXPECT_EQ(NextPowerOfTwo(64), 64);
  EXPECT_EQ(NextPowerOfTwo(65), 128);
  EXPECT_EQ(NextPowerOfTwo(96), 128);
}

TEST(FastWalshHadamardTest, MatchesExplicitMatrixAndIsSelfInverseUpToScale) {
  // H[i][j] = (-1)^popcount(i & j) for the Sylvester construction the FWHT computes.
  constexpr int kN = 16;
  std::mt19937 rng(1);
  std::vector<float> x = RandomVector(rng, kN);
  std::vector<float> y = x;
  FastWalshHadamard(y);
  for (int i = 0; i < kN; ++i) {
    double expected = 0;
    for (int j = 0; j < kN; ++j) expected += (__builtin_popcount(i & j) % 2 ? -1.0 : 1.0) * x[j];
    EXPECT_NEAR(y[i], expected, 1e-4);
  }
  FastWalshHadamard(y);  // H H = n I
  for (int i = 0; i < kN; ++i) EXPECT_NEAR(y[i] / kN, x[i], 1e-5);
}

TEST(SrhtTest, RejectsBadDimension) {
  EXPECT_FALSE(Srht::Create(0, 1).ok());
  EXPECT_FALSE(Srht::Create(-3, 1).ok());
  EXPECT_FALSE(Srht::Create(1 << 20, 1).ok());
}

// Orthogonality: norms and inner products survive the rotation, including padded sizes.
TEST(SrhtTest, PreservesNormsAndInnerProducts) {
  for (int d : {8, 48, 64, 100, 128}) {
    auto srht = Srht::Create(d, 42);
    ASSERT_TRUE(srht.ok()) << srht.status();
    EXPECT_EQ(srht->output_dim(), NextPowerOfTwo(d));
    std::mt19937 rng(d);
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> a = RandomVector(rng, d), b = RandomVector(rng, d);
      std::vector<float> ra(srht->output_dim()), rb(srht->output_dim());
      srht->Apply(a, ra);
      srht->Apply(b, rb);
      const double na = std::sqrt(DotD(a, a));
      EXPECT_NEAR(std::sqrt(DotD(ra, ra)), na, 1e-5 * na) << "d=" << d;
      EXPECT_NEAR(DotD(ra, rb), DotD(a, b), 1e-4 * na * std::sqrt(DotD(b, b))) << "d=" << d;
    }
  }
}

TEST(SrhtTest, SeededAndDeterministic) {
  auto a = Srht::Create(64, 7), b = Srht::Create(64, 7), c = Srht::Create(64, 8);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::mt19937 rng(3);
  std::vector<float> x = RandomVector(rng, 64);
  std::vector<float> ya(64), yb(64), yc(64);
  a->Apply(x, ya);
  b->Apply(x, yb);
  c->Apply(x, yc);
  EXPECT_EQ(ya, yb);
  EXPECT_NE(ya, yc);
}

// The point of the rotation: a key whose energy sits in one "outlier" channel comes out spread
// over all coordinates (no coordinate keeps more than a small share of the energy).
TEST(SrhtTest, SpreadsOutlierChannel) {
  auto srht = Srht::Create(64, 99);
  ASSERT_TRUE(srht.ok());
  std::vector<float> x(64, 0.f);
  x[5] = 1.f;
  std::vector<float> y(64);
  srht->Apply(x, y);
  for (float v : y) EXPECT_LT(v * v, 0.2f);
}

}  // namespace
}  // namespace kvr::retrieval::internal
