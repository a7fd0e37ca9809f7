// StoreClientCache: when a node keeps its store client and when it connects again. With fake
// clients (health and instance set by the test), then with a real StoreServer restarted on
// the same port.

#include "kvr/kv_store/client_cache.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/server.h"
#include "kvr/kv_store/test_pattern.h"

namespace kvr::kv_store {
namespace {

using ::testing::HasSubstr;

// A client whose health and instance the test sets; its data calls are never made here.
class FakeStoreClient final : public KvStoreClient {
 public:
  explicit FakeStoreClient(std::string instance) : instance_(std::move(instance)) {}

  std::unique_ptr<KvStoreOp> StartPutLayer(const LayerRows&) override { return nullptr; }
  std::unique_ptr<KvStoreOp> StartGather(std::span<const GatherEntry>,
                                         std::span<uint8_t>) override {
    return nullptr;
  }
  absl::StatusOr<CreateResult> CreateSequence(const SequenceRef&, const SequenceShape&, uint64_t,
                                              absl::Duration) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<ForkResult> ForkSequence(const SequenceRef&, const SequenceRef&, uint64_t,
                                          uint64_t, absl::Duration) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status RangeRead(std::span<const RangeEntry>, std::span<uint8_t>) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status Release(const SequenceRef&, absl::Duration) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status Lease(const SequenceRef&, absl::Duration) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<SequenceInfo> GetSequence(const SequenceRef&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<StoreStats> Stats() override { return absl::UnimplementedError("fake"); }
  absl::StatusOr<PageTable> ReservePageTable(const SequenceRef&, uint64_t) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::shared_ptr<const LocalPoolMapping>> MapLocalPool() override {
    return absl::UnimplementedError("fake");
  }

  absl::Status Health() const override { return health_; }
  std::string instance_id() const override { return instance_; }

  void Fail() { health_ = absl::UnavailableError("endpoint to kvr-store failed"); }

 private:
  std::string instance_;
  absl::Status health_;
};

// What the connector sees: one "store" per address whose current instance the test changes,
// as a restart would.
struct FakeStores {
  std::string instance = "a";
  absl::Status refuse;  // when not OK, connecting fails with it
  std::vector<FakeStoreClient*> opened;

  StoreClientCache::Connector Connector() {
    return [this](const std::string&) -> absl::StatusOr<std::shared_ptr<KvStoreClient>> {
      if (!refuse.ok()) return refuse;
      auto client = std::make_shared<FakeStoreClient>(instance);
      opened.push_back(client.get());
      return client;
    };
  }
};

TEST(ShouldReconnectTest, Decisions) {
  const absl::Status ok;
  const absl::Status dead = absl::UnavailableError("peer failed");
  EXPECT_EQ(ShouldReconnect(ok, "a", "a"), ReconnectReason::kKeep);
  EXPECT_EQ(ShouldReconnect(ok, "a", ""), ReconnectReason::kKeep);
  // A store (or a fake) that does not report its instance cannot be called replaced.
  EXPECT_EQ(ShouldReconnect(ok, "", "b"), ReconnectReason::kKeep);
  EXPECT_EQ(ShouldReconnect(ok, "a", "b"), ReconnectReason::kReplaced);
  // A dead transport goes whatever the instances say.
  EXPECT_EQ(ShouldReconnect(dead, "a", "a"), ReconnectReason::kUnhealthy);
  EXPECT_EQ(ShouldReconnect(dead, "", ""), ReconnectReason::kUnhealthy);
}

TEST(StoreClientCacheTest, KeepsAHealthyClient) {
  FakeStores stores;
  StoreClientCache cache(stores.Connector());
  auto first = cache.Get("s:1", "a");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = cache.Get("s:1", "a");
  ASSERT_TRUE(second.ok());
  auto any = cache.Get("s:1");
  ASSERT_TRUE(any.ok());
  EXPECT_EQ(first->get(), second->get());
  EXPECT_EQ(first->get(), any->get());
  EXPECT_EQ(cache.connects(), 1u);
  // Another address is another store.
  ASSERT_TRUE(cache.Get("s:2").ok());
  EXPECT_EQ(cache.connects(), 2u);
}

TEST(StoreClientCacheTest, ReconnectsAfterATransportError) {
  FakeStores stores;
  std::vector<std::string> drops;
  StoreClientCache cache(stores.Connector(),
                         [&](const std::string& address, const std::string& why) {
                           drops.push_back(absl::StrCat(address, " ", why));
                         });
  auto old = cache.Get("s:1", "a");
  ASSERT_TRUE(old.ok());
  // The store died: its endpoint failed. A new store comes up at the address.
  stores.opened.back()->Fail();
  stores.instance = "b";
  // Without an expected instance (the decode path before it learns one) health alone decides.
  auto fresh = cache.Get("s:1");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_NE(fresh->get(), old->get());
  EXPECT_EQ((*fresh)->instance_id(), "b");
  EXPECT_EQ(cache.connects(), 2u);
  ASSERT_EQ(drops.size(), 1u);
  EXPECT_THAT(drops[0], HasSubstr("s:1 the store died"));
  // The request that still holds the old client keeps a valid (failing) object.
  EXPECT_FALSE((*old)->Health().ok());
  // The new one is kept from then on.
  ASSERT_TRUE(cache.Get("s:1", "b").ok());
  EXPECT_EQ(cache.connects(), 2u);
}

TEST(StoreClientCacheTest, ReconnectsWhenTheStoreWasReplaced) {
  FakeStores stores;
  StoreClientCache cache(stores.Connector());
  ASSERT_TRUE(cache.Get("s:1", "a").ok());
  // Restarted before the transport noticed anything: only the identity tells.
  stores.instance = "b";
  auto fresh = cache.Get("s:1", "b");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ((*fresh)->instance_id(), "b");
  EXPECT_EQ(cache.connects(), 2u);
}

TEST(StoreClientCacheTest, AStaleExpectationIsUnavailable) {
  FakeStores stores;
  stores.instance = "b";
  StoreClientCache cache(stores.Connector());
  // The caller was told about instance "a", which is gone: its sequences with it.
  auto got = cache.Get("s:1", "a");
  EXPECT_TRUE(absl::IsUnavailable(got.status())) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("restarted"));
  // The live store's client stays cached for callers that name it.
  ASSERT_TRUE(cache.Get("s:1", "b").ok());
  EXPECT_EQ(cache.connects(), 1u);
}

TEST(StoreClientCacheTest, AFailedConnectIsUnavailableAndRetried) {
  FakeStores stores;
  stores.refuse = absl::DeadlineExceededError("GetDataPlaneInfo: deadline");
  StoreClientCache cache(stores.Connector());
  auto got = cache.Get("s:1");
  EXPECT_TRUE(absl::IsUnavailable(got.status())) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("s:1"));
  stores.refuse = absl::OkStatus();
  EXPECT_TRUE(cache.Get("s:1").ok());
  EXPECT_TRUE(absl::IsInvalidArgument(cache.Get("").status()));
}

// The real thing: a store restarted on the same port is reached again, by its new instance.
TEST(StoreClientCacheTest, RealStoreRestartedOnTheSamePort) {
  StoreServerOptions options;
  options.store.pool = {.capacity_bytes = 4 << 20, .page_bytes = 4096};
  auto first = StoreServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*first)->port());
  StoreClientCache cache(
      [](const std::string& target) -> absl::StatusOr<std::shared_ptr<KvStoreClient>> {
        UcxClientOptions o;
        o.timeout = absl::Seconds(5);
        auto c = UcxKvStoreClient::Connect(target, o);
        if (!c.ok()) return c.status();
        return std::shared_ptr<KvStoreClient>(std::move(*c));
      });
  auto a = cache.Get(address);
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string instance_a = (*a)->instance_id();
  EXPECT_EQ(instance_a.size(), 32u);
  const SequenceShape shape{.n_layers = 1, .n_kv_heads = 1, .head_dim = 8, .dtype = DType::kF32};
  ASSERT_TRUE((*a)->CreateSequence(testing::TestRef(1), shape, 4, absl::Seconds(30)).ok());

  (*first)->Shutdown();
  first->reset();
  options.listen = address;
  auto second = StoreServer::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  // A fresh client of the new store tells its instance; the cache, asked for it, reconnects.
  auto probe = UcxKvStoreClient::Connect(address);
  ASSERT_TRUE(probe.ok()) << probe.status();
  const std::string instance_b = (*probe)->instance_id();
  EXPECT_NE(instance_b, instance_a);
  auto b = cache.Get(address, instance_b);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(b->get(), a->get());
  EXPECT_EQ(cache.connects(), 2u);
  // The new store works through it, and the old sequence is gone with the old store.
  // (An unknown sequence answers as a wrong capability would: PERMISSION_DENIED.)
  EXPECT_TRUE(absl::IsPermissionDenied((*b)->GetSequence(testing::TestRef(1)).status()));
  ASSERT_TRUE((*b)->CreateSequence(testing::TestRef(2), shape, 4, absl::Seconds(30)).ok());
  std::vector<uint8_t> k(8 * sizeof(float), 1), v(8 * sizeof(float), 2);
  auto put = (*b)->PutLayer(
      {.sequence = testing::TestRef(2), .layer = 0, .start_row = 0, .n_rows = 1, .k = k, .v = v});
  ASSERT_TRUE(put.ok()) << put.status();
  // Asking for the old instance now says it is gone.
  EXPECT_TRUE(absl::IsUnavailable(cache.Get(address, instance_a).status()));
}

}  // namespace
}  // namespace kvr::kv_store
