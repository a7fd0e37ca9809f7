#include "kvr/common/byte_size.h"

#include <gtest/gtest.h>

namespace kvr {
namespace {

TEST(ByteSizeTest, DecimalAndBinaryUnits) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("4096B"), 4096u);
  EXPECT_EQ(*ParseByteSize("4GB"), 4'000'000'000u);
  EXPECT_EQ(*ParseByteSize("4GiB"), uint64_t{1} << 32);
  EXPECT_EQ(*ParseByteSize("4G"), 4'000'000'000u);
  EXPECT_EQ(*ParseByteSize("4Gi"), uint64_t{1} << 32);
  EXPECT_EQ(*ParseByteSize("64KiB"), 65536u);
  EXPECT_EQ(*ParseByteSize("64kB"), 64'000u);
  EXPECT_EQ(*ParseByteSize("64k"), 64'000u);
  EXPECT_EQ(*ParseByteSize("512MiB"), 512u << 20);
  EXPECT_EQ(*ParseByteSize("2TB"), 2'000'000'000'000u);
  EXPECT_EQ(*ParseByteSize("1PiB"), uint64_t{1} << 50);
}

TEST(ByteSizeTest, CaseAndWhiteSpace) {
  EXPECT_EQ(*ParseByteSize("4gib"), uint64_t{1} << 32);
  EXPECT_EQ(*ParseByteSize("4gb"), 4'000'000'000u);
  EXPECT_EQ(*ParseByteSize(" 3 MiB "), 3u << 20);
}

TEST(ByteSizeTest, RefusesWhatIsNotASize) {
  for (const char* bad : {"", "MiB", "GB", "-1GB", "1.5GiB", "4XB", "4 G B", "4Bi", "4iB", "4GiBB",
                          "4 bytes", "99999999999999TiB", "18446744073709551616"}) {
    absl::StatusOr<uint64_t> v = ParseByteSize(bad);
    ASSERT_FALSE(v.ok()) << "'" << bad << "' -> " << *v;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace kvr
