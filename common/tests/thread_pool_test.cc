#include "kvr/common/thread_pool.h"

#include <atomic>
#include <vector>

#include <gtest/gtest.h>

namespace kvr {
namespace {

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  ThreadPool pool(4);
  for (size_t n : {1u, 3u, 17u, 1000u}) {
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
    });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(ThreadPoolTest, ManyCallsInARow) {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  for (int round = 0; round < 200; ++round) {
    pool.ParallelFor(64, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) sum.fetch_add(static_cast<long>(i));
    });
  }
  EXPECT_EQ(sum.load(), 200L * (63 * 64 / 2));
}

}  // namespace
}  // namespace kvr
