// Dequantisation on hand-built blocks whose values are worked out by hand from the block
// layouts in ggml-common.h. Bit-exactness against the gguf Python package on real and random
// data is checked by model/tests/scripts/gguf_dequant_compare.py (ctest gguf_dequant_vs_*).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/half.h"
#include "kvr/model/dequant.h"
#include "kvr/model/tensor_types.h"

namespace kvr::model {
namespace {

using ::testing::HasSubstr;

void PutHalf(uint8_t* p, float v) {
  const uint16_t h = FloatToFp16(v);
  std::memcpy(p, &h, 2);
}

TEST(GgmlTypeTest, TraitsMatchGgml) {
  struct Expect {
    GgmlType type;
    int64_t block, bytes;
  };
  for (const Expect& e : {Expect{GgmlType::kF32, 1, 4}, Expect{GgmlType::kF16, 1, 2},
                          Expect{GgmlType::kBF16, 1, 2}, Expect{GgmlType::kQ4_0, 32, 18},
                          Expect{GgmlType::kQ4_1, 32, 20}, Expect{GgmlType::kQ5_0, 32, 22},
                          Expect{GgmlType::kQ5_1, 32, 24}, Expect{GgmlType::kQ8_0, 32, 34},
                          Expect{GgmlType::kQ4_K, 256, 144}, Expect{GgmlType::kQ5_K, 256, 176},
                          Expect{GgmlType::kQ6_K, 256, 210}, Expect{GgmlType::kQ2_K, 256, 84}}) {
    auto t = GetGgmlTypeTraits(e.type);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(t->block_size, e.block) << t->name;
    EXPECT_EQ(t->type_size, e.bytes) << t->name;
  }
  EXPECT_EQ(*GgmlTypeFromName("Q4_K"), GgmlType::kQ4_K);
  EXPECT_EQ(*GgmlTypeFromName("bf16"), GgmlType::kBF16);
  EXPECT_FALSE(GgmlTypeFromName("q9_9").ok());
  EXPECT_EQ(GgmlTypeName(GgmlType::kQ6_K), "q6_K");
  EXPECT_EQ(GgmlTypeName(static_cast<GgmlType>(4)), "unknown(4)");
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kQ6_K, 512), 420u);
  EXPECT_THAT(GgmlRowBytes(GgmlType::kQ4_0, 33).status().message(), HasSubstr("33 elements"));
  EXPECT_THAT(GetGgmlTypeTraits(5u).status().message(), HasSubstr("unknown ggml tensor type id 5"));
}

TEST(DequantTest, Q4_0) {
  uint8_t block[18];
  PutHalf(block, 0.5f);
  for (int j = 0; j < 16; ++j) block[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  std::vector<float> y(32);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ4_0, block, 32, y.data()).ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], (j - 8) * 0.5f);
    EXPECT_EQ(y[j + 16], (15 - j - 8) * 0.5f);
  }
}

TEST(DequantTest, Q4_1) {
  uint8_t block[20];
  PutHalf(block, 0.25f);
  PutHalf(block + 2, -1.f);
  for (int j = 0; j < 16; ++j) block[4 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  std::vector<float> y(32);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ4_1, block, 32, y.data()).ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], j * 0.25f - 1.f);
    EXPECT_EQ(y[j + 16], (15 - j) * 0.25f - 1.f);
  }
}

TEST(DequantTest, Q5_0AndQ5_1UseTheHighBits) {
  uint8_t b0[22];
  PutHalf(b0, 2.f);
  const uint32_t qh = 0xAAAAAAAAu;  // fifth bit set for odd elements
  std::memcpy(b0 + 2, &qh, 4);
  for (int j = 0; j < 16; ++j) b0[6 + j] = static_cast<uint8_t>(3 | (12 << 4));
  std::vector<float> y(32);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ5_0, b0, 32, y.data()).ok());
  for (int j = 0; j < 16; ++j) {
    const int hi = (j % 2) * 16;  // element j and element j + 16 have the same parity
    EXPECT_EQ(y[j], ((3 | hi) - 16) * 2.f) << j;
    EXPECT_EQ(y[j + 16], ((12 | hi) - 16) * 2.f) << j;
  }
  uint8_t b1[24];
  PutHalf(b1, 0.5f);
  PutHalf(b1 + 2, 1.f);
  std::memcpy(b1 + 4, &qh, 4);
  for (int j = 0; j < 16; ++j) b1[8 + j] = static_cast<uint8_t>(3 | (12 << 4));
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ5_1, b1, 32, y.data()).ok());
  EXPECT_EQ(y[0], 3 * 0.5f + 1.f);
  EXPECT_EQ(y[1], 19 * 0.5f + 1.f);
  EXPECT_EQ(y[17], 28 * 0.5f + 1.f);
}

TEST(DequantTest, Q4_KUnpacksSixBitScales) {
  uint8_t block[144] = {};
  PutHalf(block, 1.f);       // d
  PutHalf(block + 2, 0.5f);  // dmin
  uint8_t* scales = block + 4;
  scales[0] = 0x40 | 2;  // sub-block 0: scale 2; top bits (1) feed sub-block 4's scale
  scales[4] = 1;         // sub-block 0: min 1
  scales[1] = 3;         // sub-block 1: scale 3, min 0
  scales[8] = 0x53;      // sub-block 4: scale 3 | 1 << 4 = 19, min 5
  for (int i = 0; i < 128; ++i) block[16 + i] = 0x21;  // low nibble 1, high nibble 2
  std::vector<float> y(256);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ4_K, block, 256, y.data()).ok());
  EXPECT_EQ(y[0], 1.f * 2 * 1 - 0.5f * 1);     // sub-block 0, low nibbles
  EXPECT_EQ(y[40], 1.f * 3 * 2 - 0.f);         // sub-block 1, high nibbles
  EXPECT_EQ(y[130], 1.f * 19 * 1 - 0.5f * 5);  // sub-block 4
}

TEST(DequantTest, Q5_KAddsHighBit) {
  uint8_t block[176] = {};
  PutHalf(block, 1.f);
  PutHalf(block + 2, 0.f);
  block[4] = 1;          // sub-block 0 scale 1
  block[4 + 1] = 1;      // sub-block 1 scale 1
  block[16 + 0] = 0x03;  // qh[0]: bits 0 and 1 -> elements 0 and 32 get +16
  block[48 + 0] = 0x52;  // ql[0]: 2 (element 0) and 5 (element 32)
  std::vector<float> y(256);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ5_K, block, 256, y.data()).ok());
  EXPECT_EQ(y[0], 18.f);
  EXPECT_EQ(y[32], 21.f);
  EXPECT_EQ(y[1], 0.f);
}

TEST(DequantTest, Q6_K) {
  uint8_t block[210] = {};
  PutHalf(block + 208, 0.5f);
  auto* sc = reinterpret_cast<int8_t*>(block + 192);
  sc[0] = -3;
  sc[2] = 4;
  block[0] = 0x0F;          // ql[0] low nibble 15 (element 0)
  block[32] = 0x01;         // ql[32] low nibble 1 (element 32)
  block[128] = 2 | 1 << 2;  // qh[0]: element 0 high bits 2, element 32 high bits 1
  std::vector<float> y(256);
  ASSERT_TRUE(DequantizeRow(GgmlType::kQ6_K, block, 256, y.data()).ok());
  EXPECT_EQ(y[0], 0.5f * -3 * ((15 | 2 << 4) - 32));
  EXPECT_EQ(y[32], 0.5f * 4 * ((1 | 1 << 4) - 32));
}

TEST(DequantTest, PlainTypes) {
  const uint16_t bf16[3] = {0x3F80, 0xC000, 0x7F80};  // 1, -2, inf
  std::vector<float> y(3);
  ASSERT_TRUE(DequantizeRow(GgmlType::kBF16, bf16, 3, y.data()).ok());
  EXPECT_THAT(y, ::testing::ElementsAre(1.f, -2.f, std::numeric_limits<float>::infinity()));
  const uint16_t f16[3] = {0x3C00, 0xC000, 0x0400};  // 1, -2, 2^-14
  ASSERT_TRUE(DequantizeRow(GgmlType::kF16, f16, 3, y.data()).ok());
  EXPECT_THAT(y, ::testing::ElementsAre(1.f, -2.f, std::ldexp(1.f, -14)));
}

TEST(DequantTest, ErrorsNameTheType) {
  std::vector<uint8_t> src(1024);
  std::vector<float> y(256);
  absl::Status s = DequantizeRow(GgmlType::kIQ2_XXS, src.data(), 256, y.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("iq2_xxs"));
  s = DequantizeRow(static_cast<GgmlType>(4), src.data(), 32, y.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("unknown ggml tensor type id 4"));
  s = DequantizeRow(GgmlType::kQ4_0, src.data(), 33, y.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("q4_0"));
}

}  // namespace
}  // namespace kvr::model
