#include "kvr/controller/membership.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_cluster.h"

namespace kvr::controller {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace kvr::controller::testing;

class MembershipTest : public ::testing::Test {
 protected:
  ManualClock clock_;
  Membership membership_{&clock_, absl::Seconds(10)};
};

TEST_F(MembershipTest, RegisterAssignsUniqueIdsInRegistrationOrder) {
  auto a = membership_.Register(Prefill("p:1"));
  auto b = membership_.Register(Decode("d:1"));
  auto c = membership_.Register(Store("s:1"));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, "prefill-1");
  EXPECT_EQ(*b, "decode-2");
  EXPECT_EQ(*c, "store-3");
  std::vector<std::string> ids;
  for (const auto& n : membership_.LiveNodes()) ids.push_back(n.id);
  EXPECT_THAT(ids, ElementsAre("prefill-1", "decode-2", "store-3"));
  EXPECT_EQ(membership_.LiveNodes(NodeRole::kDecode).size(), 1u);
}

TEST_F(MembershipTest, RejectsMalformedRegistrationsNamingTheField) {
  NodeRegistration no_addr = Prefill("");
  EXPECT_THAT(std::string(membership_.Register(no_addr).status().message()),
              HasSubstr("grpc_address"));
  NodeRegistration no_models = Prefill("p:1");
  no_models.capacity.models.clear();
  EXPECT_THAT(std::string(membership_.Register(no_models).status().message()),
              HasSubstr("capacity.models"));
  NodeRegistration no_slots = Decode("d:1", /*slots=*/0);
  EXPECT_THAT(std::string(membership_.Register(no_slots).status().message()),
              HasSubstr("batch_slots"));
  NodeRegistration no_ucx = Store("s:1");
  no_ucx.endpoints.ucx_worker_address.clear();
  EXPECT_THAT(std::string(membership_.Register(no_ucx).status().message()),
              HasSubstr("ucx_worker_address"));
  NodeRegistration no_ctx = Decode("d:1");
  no_ctx.capacity.models[0].context_length = 0;
  EXPECT_THAT(std::string(membership_.Register(no_ctx).status().message()),
              HasSubstr("context_length"));
  EXPECT_TRUE(membership_.LiveNodes().empty());
}

TEST_F(MembershipTest, LeaseLapsesWithoutHeartbeats) {
  auto id = membership_.Register(Prefill("p:1"));
  ASSERT_TRUE(id.ok());
  clock_.Advance(absl::Seconds(9));
  EXPECT_EQ(membership_.LiveNodes().size(), 1u);
  clock_.Advance(absl::Seconds(1));
  EXPECT_TRUE(membership_.LiveNodes().empty());
  auto hb = membership_.Heartbeat(*id, {});
  EXPECT_TRUE(absl::IsNotFound(hb.status())) << hb.status();
}

TEST_F(MembershipTest, HeartbeatRenewsLeaseAndReplacesLoad) {
  auto id = membership_.Register(Prefill("p:1"));
  ASSERT_TRUE(id.ok());
  clock_.Advance(absl::Seconds(8));
  auto expiry = membership_.Heartbeat(*id, {.queued_prefill_tokens = 77});
  ASSERT_TRUE(expiry.ok());
  EXPECT_EQ(*expiry, clock_.Now() + absl::Seconds(10));
  clock_.Advance(absl::Seconds(8));
  auto node = membership_.Find(*id);
  ASSERT_TRUE(node.has_value());
  EXPECT_EQ(node->effective_load.queued_prefill_tokens, 77u);
}

TEST_F(MembershipTest, PendingLoadAddsUntilNextHeartbeat) {
  auto id = membership_.Register(Decode("d:1", 4, 1000));
  ASSERT_TRUE(id.ok());
  membership_.AddPending(*id, {.sequences = 1, .memory_bytes = 300});
  membership_.AddPending(*id, {.sequences = 1, .memory_bytes = 900});
  auto node = membership_.Find(*id);
  EXPECT_EQ(node->effective_load.running_sequences, 2u);
  EXPECT_EQ(node->effective_load.free_memory_bytes, 0u);  // saturates, never wraps
  ASSERT_TRUE(membership_.Heartbeat(*id, {.running_sequences = 2, .free_memory_bytes = 500}).ok());
  node = membership_.Find(*id);
  EXPECT_EQ(node->effective_load.running_sequences, 2u);
  EXPECT_EQ(node->effective_load.free_memory_bytes, 500u);
}

TEST_F(MembershipTest, MarkFailedAndDeregisterRemoveTheNode) {
  auto p = membership_.Register(Prefill("p:1"));
  auto d = membership_.Register(Decode("d:1"));
  membership_.MarkFailed(*p);
  EXPECT_FALSE(membership_.Find(*p).has_value());
  EXPECT_TRUE(membership_.Deregister(*d).ok());
  EXPECT_TRUE(absl::IsNotFound(membership_.Deregister(*d)));
  EXPECT_TRUE(membership_.LiveNodes().empty());
}

// A node restarted on its address (a new instance) replaces its old entry at once instead of
// both being placeable until the old lease lapses.
TEST_F(MembershipTest, ReRegistrationOnTheSameAddressReplacesTheOldEntry) {
  NodeRegistration first = Store("s:1");
  first.instance_id = "a";
  auto old_id = membership_.Register(first);
  ASSERT_TRUE(old_id.ok());
  ASSERT_TRUE(membership_.Register(Store("s:2")).ok());
  membership_.AddPending(*old_id, {.memory_bytes = 1000});
  clock_.Advance(absl::Seconds(1));
  NodeRegistration restarted = Store("s:1");
  restarted.instance_id = "b";
  std::vector<std::string> replaced;
  auto new_id = membership_.Register(restarted, &replaced);
  ASSERT_TRUE(new_id.ok());
  EXPECT_NE(*new_id, *old_id);
  EXPECT_THAT(replaced, ElementsAre(*old_id));
  EXPECT_FALSE(membership_.Find(*old_id).has_value());
  auto now = membership_.Find(*new_id);
  ASSERT_TRUE(now.has_value());
  EXPECT_EQ(now->registration.instance_id, "b");
  EXPECT_EQ(now->effective_load.free_memory_bytes, 1ull << 32) << "no pending load carried over";
  EXPECT_EQ(membership_.LiveNodes(NodeRole::kStore).size(), 2u);
  // The old process's heartbeat (if it were still alive) is told to register again.
  EXPECT_TRUE(absl::IsNotFound(membership_.Heartbeat(*old_id, {}).status()));
  // Marking the old id failed (a request that was placed on it) leaves the new entry alone.
  membership_.MarkFailed(*old_id);
  EXPECT_TRUE(membership_.Find(*new_id).has_value());
  // Another address is another node.
  replaced.clear();
  ASSERT_TRUE(membership_.Register(Store("s:3"), &replaced).ok());
  EXPECT_TRUE(replaced.empty());
}

// With identities checked, a node id is renewed and removed only by the identity that
// registered it, and an address held by one identity is not taken over by another while its
// lease runs.
TEST_F(MembershipTest, ANodeIdBelongsToTheIdentityThatRegisteredIt) {
  NodeRegistration a = Decode("d:1");
  a.identity = "decode-a";
  auto id = membership_.Register(a);
  ASSERT_TRUE(id.ok()) << id.status();

  absl::StatusOr<absl::Time> other = membership_.Heartbeat(*id, {}, "decode-b");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("'decode-a'"));
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("'decode-b'"));
  EXPECT_EQ(membership_.Deregister(*id, "decode-b").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(membership_.Heartbeat(*id, {}, "decode-a").ok());
  // Not checked (std::nullopt): the call is not refused.
  EXPECT_TRUE(membership_.Heartbeat(*id, {}).ok());

  NodeRegistration b = Decode("d:1");
  b.identity = "decode-b";
  std::vector<std::string> replaced;
  absl::StatusOr<std::string> taken = membership_.Register(b, &replaced);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(taken.status().message()), HasSubstr("grpc_address: 'd:1'"));
  EXPECT_TRUE(replaced.empty());
  ASSERT_EQ(membership_.LiveNodes().size(), 1u);
  EXPECT_EQ(membership_.LiveNodes()[0].id, *id);
  // The same identity restarted on its address replaces its old entry, as without identities.
  EXPECT_TRUE(membership_.Register(a, &replaced).ok());
  EXPECT_THAT(replaced, ElementsAre(*id));
  // Once the lease lapsed, the address is free for anyone.
  clock_.Advance(absl::Seconds(11));
  EXPECT_TRUE(membership_.Register(b).ok());

  EXPECT_TRUE(membership_.Deregister(membership_.LiveNodes()[0].id, "decode-b").ok());
}

TEST_F(MembershipTest, PresenceTellsNotYetFromNeverSeen) {
  ModelPresence p = membership_.Presence("smollm2");
  EXPECT_FALSE(p.any_model_served);
  EXPECT_FALSE(p.ever_registered);
  auto d = membership_.Register(Decode("d:1"));
  ASSERT_TRUE(d.ok());
  p = membership_.Presence("smollm2");
  EXPECT_TRUE(p.ever_registered);
  EXPECT_EQ(p.decode_nodes, 1u);
  EXPECT_EQ(p.prefill_nodes, 0u);
  EXPECT_FALSE(p.any_model_served);
  ASSERT_TRUE(membership_.Register(Prefill("p:1")).ok());
  p = membership_.Presence("smollm2");
  EXPECT_TRUE(p.any_model_served);
  EXPECT_EQ(p.prefill_nodes, 1u);
  EXPECT_FALSE(membership_.Presence("llama").ever_registered);
  // Nodes gone: the model is still known, just not served.
  clock_.Advance(absl::Seconds(11));
  p = membership_.Presence("smollm2");
  EXPECT_TRUE(p.ever_registered);
  EXPECT_FALSE(p.any_model_served);
  EXPECT_EQ(p.prefill_nodes + p.decode_nodes, 0u);
}

TEST_F(MembershipTest, ModelsNeedPrefillAndDecodeAndIntersectMethods) {
  ASSERT_TRUE(membership_.Register(Decode("d:1")).ok());
  EXPECT_TRUE(membership_.Models().empty()) << "a model without a prefill node cannot run";
  ASSERT_TRUE(membership_.Register(Prefill("p:1")).ok());
  NodeRegistration d2 = Decode("d:2");
  d2.capacity.models[0].context_length = 4096;
  d2.capacity.models[0].retrieval_methods = {{"full", 12.0}};
  ASSERT_TRUE(membership_.Register(d2).ok());
  auto m = membership_.FindModel("smollm2");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->info.context_length, 4096u);
  ASSERT_EQ(m->info.retrieval_methods.size(), 1u);
  EXPECT_EQ(m->info.retrieval_methods[0].name, "full");
  EXPECT_EQ(m->info.retrieval_methods[0].summary_bytes_per_token, 12.0);
  EXPECT_EQ(m->prefill_nodes, 1u);
  EXPECT_EQ(m->decode_nodes, 2u);
  EXPECT_FALSE(membership_.FindModel("llama").has_value());
}

}  // namespace
}  // namespace kvr::controller
