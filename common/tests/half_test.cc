#include "kvr/common/half.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include <gtest/gtest.h>

namespace kvr {
namespace {

TEST(HalfTest, Fp16RoundTripsEveryValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f)))) << h;
      continue;
    }
    EXPECT_EQ(FloatToFp16(f), h) << "fp16 bits " << h << " -> " << f;
  }
}

TEST(HalfTest, Fp16KnownValues) {
  EXPECT_EQ(Fp16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(Fp16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(FloatToFp16(1e6f), 0x7c00);                     // overflow -> +inf
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -26)), 0x0000);  // below half the smallest: 0
  // Halfway between 1 and the next fp16 (1 + 2^-10) rounds to even (1.0).
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
}

TEST(HalfTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties to even -> 1.0.
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (!std::isnan(f)) EXPECT_EQ(FloatToBf16(f), h);
  }
}

TEST(HalfTest, Bf16ByteBuffersAtAnyAlignment) {
  const float in[3] = {1.0f, 1.0f + 3 * std::ldexp(1.0f, -8), -2.5f};
  unsigned char bytes[7] = {};
  FloatsToBf16Bytes(in, 3, bytes + 1);  // odd address: rows inside a byte buffer
  for (int i = 0; i < 3; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes + 1 + 2 * i, sizeof(h));
    EXPECT_EQ(h, FloatToBf16(in[i])) << i;
  }
  float out[3];
  Bf16BytesToFloats(bytes + 1, 3, out);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i], Bf16ToFloat(FloatToBf16(in[i]))) << i;
}

}  // namespace
}  // namespace kvr
