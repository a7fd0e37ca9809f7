#include "kvr/decode/text.h"

#include "gtest/gtest.h"

namespace kvr::decode {
namespace {

TEST(TextStreamTest, HoldsIncompleteUtf8AndContinuesThePrefillNodesBytes) {
  EXPECT_EQ(CompleteUtf8Prefix("ab\xE2\x82"), 2u);
  EXPECT_EQ(CompleteUtf8Prefix("ab\xE2\x82\xAC"), 5u);
  // The prefill node held back the first byte of "€".
  TextStream text({}, "x", "\xE2");
  std::string out, matched;
  EXPECT_FALSE(text.Push("\x82", &out, &matched));
  EXPECT_EQ(out, "");
  EXPECT_FALSE(text.Push("\xAC!", &out, &matched));
  EXPECT_EQ(out, "\xE2\x82\xAC!");
  EXPECT_FALSE(text.Push("\xC3", &out, &matched));
  EXPECT_EQ(text.Flush(), "\xEF\xBF\xBD");
}

TEST(TextStreamTest, StopStringIsNotReturnedAndMayStartInEarlierText) {
  TextStream text({"END", "\n\n"}, "Hello", "");
  std::string out, matched;
  EXPECT_FALSE(text.Push(" wor", &out, &matched));
  EXPECT_FALSE(text.Push("ld E", &out, &matched));
  EXPECT_EQ(out, " world ");  // "E" held back: it may start "END"
  EXPECT_TRUE(text.Push("NDing", &out, &matched));
  EXPECT_EQ(out, " world ");
  EXPECT_EQ(matched, "END");

  TextStream other({"\n\n"}, "a\n", "");
  std::string out2, matched2;
  EXPECT_TRUE(other.Push("\nb", &out2, &matched2));  // match across the prefill boundary
  EXPECT_EQ(out2, "");
  EXPECT_EQ(matched2, "\n\n");
}

}  // namespace
}  // namespace kvr::decode
