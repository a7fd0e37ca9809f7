// LeaseKeeper renews the leases of the sequences it keeps, and stops once their handle is
// dropped, so an expiring store frees a dead node's sequences within one lease.

#include "kvr/kv_store/lease_keeper.h"

#include "gtest/gtest.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/test_pattern.h"

// In the test helpers' namespace (test_pattern.h).
namespace kvr::kv_store::testing {
namespace {

constexpr SequenceShape kShape{.n_layers = 1, .n_kv_heads = 1, .head_dim = 8, .dtype = DType::kF32};

TEST(LeaseKeeperTest, RenewsKeptSequencesUntilTheHandleGoes) {
  StoreOptions so;
  so.pool = {.capacity_bytes = 1 << 20, .page_bytes = 4096, .try_huge_pages = false};
  so.evict_expired = true;
  auto store = FakeKvStoreClient::Create(so);
  ASSERT_TRUE(store.ok()) << store.status();
  FakeKvStoreClient& client = **store;
  const absl::Duration ttl = absl::Milliseconds(400);
  ASSERT_TRUE(client.CreateSequence(TestRef(1), kShape, 4, ttl).ok());
  ASSERT_TRUE(client.CreateSequence(TestRef(2), kShape, 4, ttl).ok());
  LeaseKeeper keeper({.ttl = ttl, .period = absl::Milliseconds(50)});
  auto kept = keeper.Keep(&client, nullptr, TestRef(1));
  // Three lease lengths later the kept sequence is alive, the other one expired and is swept.
  absl::SleepFor(3 * ttl);
  EXPECT_EQ(client.store().SweepExpired(), 1u);
  EXPECT_TRUE(client.GetSequence(TestRef(1)).ok());
  EXPECT_FALSE(client.GetSequence(TestRef(2)).ok());
  EXPECT_GE(keeper.renewals(), 10u);
  // Dropped: no more renewals; it expires within a lease.
  kept.reset();
  const uint64_t renewals = keeper.renewals();
  absl::SleepFor(2 * ttl);
  EXPECT_LE(keeper.renewals(), renewals + 1);  // at most one batch already taken
  EXPECT_EQ(client.store().SweepExpired(), 1u);
  EXPECT_FALSE(client.GetSequence(TestRef(1)).ok());
}

}  // namespace
}  // namespace kvr::kv_store::testing
