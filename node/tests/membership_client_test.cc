// MembershipClient against an in-process fake kvr.cluster.v1.Membership service.
#include "kvr/node/membership_client.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvr::node {
namespace {

namespace cv1 = ::kvr::cluster::v1;

// Assigns ids node-1, node-2, ...; heartbeats every 20 ms; NOT_FOUND for forgotten ids.
class FakeMembership final : public cv1::Membership::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const cv1::RegisterRequest* request,
                        cv1::RegisterResponse* response) override {
    absl::MutexLock lock(&mu_);
    const std::string id = absl::StrCat("node-", ++registers_);
    live_.insert(id);
    last_register_ = *request;
    response->set_node_id(id);
    response->mutable_heartbeat_interval()->set_nanos(20'000'000);
    response->mutable_lease()->set_seconds(1);
    response->set_live_stores(live_stores_);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const cv1::HeartbeatRequest* request,
                         cv1::HeartbeatResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (!live_.contains(request->node_id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown node " + request->node_id());
    }
    ++heartbeats_;
    last_load_ = request->load();
    response->set_live_stores(live_stores_);
    return grpc::Status::OK;
  }
  grpc::Status Deregister(grpc::ServerContext*, const cv1::DeregisterRequest* request,
                          cv1::DeregisterResponse*) override {
    absl::MutexLock lock(&mu_);
    deregistered_.push_back(request->node_id());
    live_.erase(request->node_id());
    return grpc::Status::OK;
  }

  void Forget(const std::string& id) {
    absl::MutexLock lock(&mu_);
    live_.erase(id);
  }
  std::vector<std::string> deregistered() const {
    absl::MutexLock lock(&mu_);
    return deregistered_;
  }
  // Waits until `pred` holds (under the lock) or 10 s pass.
  bool Await(std::function<bool(const FakeMembership&)> pred) {
    absl::MutexLock lock(&mu_);
    auto cond = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return pred(*this); };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(10));
  }

  mutable absl::Mutex mu_;
  int registers_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  cv1::RegisterRequest last_register_ ABSL_GUARDED_BY(mu_);
  cv1::NodeLoad last_load_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> deregistered_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> live_ ABSL_GUARDED_BY(mu_);
  uint32_t live_stores_ ABSL_GUARDED_BY(mu_) = 0;  // what Register/Heartbeat answer
};

std::unique_ptr<grpc::Server> Serve(FakeMembership* service, int port, int* bound) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                           bound);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

MembershipClient::Options StoreOptions(const std::string& controller, std::atomic<uint64_t>* free) {
  MembershipClient::Options o;
  o.controller = controller;
  o.registration.set_role(cv1::NODE_ROLE_STORE);
  o.registration.set_name("store-under-test");
  o.registration.set_protocol_version(1);
  o.registration.mutable_endpoints()->set_grpc_address("10.0.0.7:50070");
  o.registration.mutable_endpoints()->set_ucx_worker_address("ucx-bytes");
  o.registration.mutable_capacity()->set_memory_bytes(1 << 20);
  o.load = [free] {
    cv1::NodeLoad load;
    load.set_free_memory_bytes(free->load());
    return load;
  };
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(200);
  return o;
}

// A fake controller on a free port of 127.0.0.1, and the free memory the store under test
// reports.
class MembershipClientTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(port_, 0); }
  // StoreOptions with the fake controller.
  MembershipClient::Options Options() {
    return StoreOptions(absl::StrCat("127.0.0.1:", port_), &free_);
  }

  FakeMembership fake_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_ = Serve(&fake_, 0, &port_);
  std::atomic<uint64_t> free_{5};
};

TEST_F(MembershipClientTest, RegistersHeartbeatsLoadAndDeregistersOnStop) {
  free_ = 1000;
  std::string announced;
  MembershipClient::Options o = Options();
  o.on_registered = [&announced](const std::string& id) { announced = id; };
  MembershipClient client(std::move(o));
  ASSERT_TRUE(client.WaitRegistered(absl::Seconds(10)));
  EXPECT_EQ(client.node_id(), "node-1");
  {
    absl::MutexLock lock(&fake_.mu_);
    EXPECT_EQ(fake_.last_register_.role(), cv1::NODE_ROLE_STORE);
    EXPECT_EQ(fake_.last_register_.endpoints().grpc_address(), "10.0.0.7:50070");
    EXPECT_EQ(fake_.last_register_.endpoints().ucx_worker_address(), "ucx-bytes");
    EXPECT_EQ(fake_.last_register_.capacity().memory_bytes(), 1u << 20);
    EXPECT_EQ(fake_.last_register_.load().free_memory_bytes(), 1000u);
  }
  free_ = 777;
  ASSERT_TRUE(fake_.Await([](const FakeMembership& f) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return f.heartbeats_ >= 2 && f.last_load_.free_memory_bytes() == 777;
  }));
  client.Stop();
  EXPECT_EQ(announced, "node-1");
  EXPECT_EQ(client.node_id(), "");
  EXPECT_FALSE(client.WaitRegistered(absl::ZeroDuration()));
  EXPECT_EQ(fake_.deregistered(), std::vector<std::string>{"node-1"});
  EXPECT_EQ(fake_.registers_, 1);
}

TEST_F(MembershipClientTest, RegistersAgainAfterNotFound) {
  MembershipClient client(Options());
  ASSERT_TRUE(client.WaitRegistered(absl::Seconds(10)));
  fake_.Forget("node-1");  // e.g. the controller restarted
  ASSERT_TRUE(fake_.Await([](const FakeMembership& f)
                              ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.registers_ == 2; }));
  ASSERT_TRUE(client.WaitRegistered(absl::Seconds(10)));
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (client.node_id() != "node-2" && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(client.node_id(), "node-2");
  client.Stop();
  EXPECT_EQ(fake_.deregistered(), std::vector<std::string>{"node-2"});
}

TEST_F(MembershipClientTest, RegistersOnceTheControllerComesUp) {
  // A free port, then nothing listening on it.
  server_->Shutdown();
  server_.reset();
  MembershipClient client(Options());
  EXPECT_FALSE(client.WaitRegistered(absl::Milliseconds(300)));
  EXPECT_EQ(client.node_id(), "");
  int bound = 0;
  server_ = Serve(&fake_, port_, &bound);
  ASSERT_EQ(bound, port_);
  EXPECT_TRUE(client.WaitRegistered(absl::Seconds(10)));
  EXPECT_EQ(client.node_id(), "node-1");
  client.Stop();
  EXPECT_EQ(fake_.deregistered(), std::vector<std::string>{"node-1"});
}

TEST_F(MembershipClientTest, DestructorDeregistersAndStopWithoutControllerReturns) {
  {
    MembershipClient client(Options());
    ASSERT_TRUE(client.WaitRegistered(absl::Seconds(10)));
  }
  EXPECT_EQ(fake_.deregistered(), std::vector<std::string>{"node-1"});
  // Never registered (nothing listens on port 1): Stop returns promptly, deregisters nothing.
  const absl::Time start = absl::Now();
  {
    MembershipClient client(StoreOptions("127.0.0.1:1", &free_));
    EXPECT_FALSE(client.WaitRegistered(absl::Milliseconds(50)));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// The cluster view follows the controller's live-store count on every heartbeat, drops to 0 when
// the registration is lost and on Stop(): what the nodes' "kvr.ready" health follows.
TEST_F(MembershipClientTest, ClusterViewFollowsLiveStoresAndDropsOnLossAndStop) {
  free_ = 0;
  absl::Mutex mu;
  std::vector<uint32_t> seen;  // every callback value, in order
  MembershipClient::Options o = Options();
  o.on_cluster_view = [&](uint32_t n) {
    absl::MutexLock lock(&mu);
    seen.push_back(n);
  };
  auto last_is = [&](uint32_t want) {
    absl::MutexLock lock(&mu);
    auto cond = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return !seen.empty() && seen.back() == want; };
    return mu.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(10));
  };
  MembershipClient client(std::move(o));
  ASSERT_TRUE(client.WaitRegistered(absl::Seconds(10)));
  EXPECT_TRUE(last_is(0));  // no store yet
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.live_stores_ = 2;
  }
  EXPECT_TRUE(last_is(2));
  // The controller forgets the node: 0 at once, then 2 again after it registered again.
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.live_.clear();
  }
  ASSERT_TRUE(fake_.Await([](const FakeMembership& f)
                              ABSL_NO_THREAD_SAFETY_ANALYSIS { return f.registers_ >= 2; }));
  EXPECT_TRUE(last_is(2));
  {
    absl::MutexLock lock(&mu);
    EXPECT_NE(std::find(seen.begin(), seen.end(), 0u), seen.end());
    const auto first2 = std::find(seen.begin(), seen.end(), 2u);
    ASSERT_NE(first2, seen.end());
    EXPECT_NE(std::find(first2, seen.end(), 0u), seen.end()) << "no 0 after the loss";
  }
  client.Stop();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(seen.back(), 0u);
}

}  // namespace
}  // namespace kvr::node
