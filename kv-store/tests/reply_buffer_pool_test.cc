#include "data_plane.h"
#include "gtest/gtest.h"

namespace kvr::kv_store {
namespace {

TEST(ReplyBufferPoolTest, ReusesReturnedBuffersAndBoundsWhatItKeeps) {
  ReplyBufferPool pool(/*max_buffers=*/2, /*max_kept_bytes=*/1 << 20);
  uint8_t* first = nullptr;
  {
    auto a = *pool.Acquire(1000);
    ASSERT_EQ(a->span().size(), 1000u);
    first = a->span().data();
  }
  // The returned buffer serves the next request that fits, with the requested size.
  {
    auto b = *pool.Acquire(600);
    EXPECT_EQ(b->span().data(), first);
    EXPECT_EQ(b->span().size(), 600u);
    // While it is on loan, another request gets a different buffer.
    auto c = *pool.Acquire(600);
    EXPECT_NE(c->span().data(), first);
  }
  // A request bigger than every idle buffer gets a new one.
  auto big = *pool.Acquire(5000);
  EXPECT_NE(big->span().data(), first);
  big.reset();
  // At most max_buffers idle buffers are kept (the largest ones).
  EXPECT_EQ(pool.idle_buffers(), 2u);
  // Buffers above max_kept_bytes are not kept.
  pool.Acquire(2 << 20)->reset();
  EXPECT_EQ(pool.idle_buffers(), 2u);
  auto again = *pool.Acquire(4000);  // served by the 5000-byte buffer
  EXPECT_EQ(pool.idle_buffers(), 1u);
}

// The store's memory outside its pool is bounded: one reply above max_reply_bytes is refused
// naming the limit, and so is one that would take the replies on loan past
// max_outstanding_bytes; once they are returned the store serves again.
TEST(ReplyBufferPoolTest, RefusesRepliesPastItsLimits) {
  ReplyBufferPool pool(2, 1 << 20, {.max_reply_bytes = 1000, .max_outstanding_bytes = 1500});
  auto too_big = pool.Acquire(1001);
  ASSERT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("max_reply_bytes 1000"), std::string::npos);
  auto a = pool.Acquire(1000);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool.outstanding_bytes(), 1000u);
  auto b = pool.Acquire(600);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("busy"), std::string::npos);
  auto c = pool.Acquire(500);
  ASSERT_TRUE(c.ok());
  a->reset();
  c->reset();
  EXPECT_EQ(pool.outstanding_bytes(), 0u);
  EXPECT_TRUE(pool.Acquire(1000).ok());
}

}  // namespace
}  // namespace kvr::kv_store
