#include "kvr/common/log_limiter.h"

#include "gtest/gtest.h"

namespace kvr {
namespace {

TEST(LogLimiterTest, FirstThenOncePerIntervalCountingTheSuppressed) {
  LogLimiter limiter(absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  int64_t count = -1;
  ASSERT_TRUE(limiter.Allow(t0, &count));
  EXPECT_EQ(count, 1);
  for (int i = 1; i <= 99; ++i) EXPECT_FALSE(limiter.Allow(t0 + absl::Milliseconds(i), &count));
  ASSERT_TRUE(limiter.Allow(t0 + absl::Seconds(10), &count));
  EXPECT_EQ(count, 100) << "the 99 suppressed and this one";
  EXPECT_FALSE(limiter.Allow(t0 + absl::Seconds(19), &count));
  ASSERT_TRUE(limiter.Allow(t0 + absl::Seconds(21), &count));
  EXPECT_EQ(count, 2);
}

}  // namespace
}  // namespace kvr
