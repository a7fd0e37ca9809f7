#include "kvr/controller/placement.h"

#include <gmock/gmock.h>
#include <map>
#include <string>
#include <vector>
#include <gtest/gtest.h>

#include "test_cluster.h"

namespace kvr::controller {
namespace {

using ::testing::HasSubstr;
using namespace kvr::controller::testing;

class PlacementTest : public ::testing::Test {
 protected:
  std::string Add(NodeRegistration r) { return *membership_.Register(std::move(r)); }
  PlacementRequest Request(uint64_t prompt = 100, uint32_t max_tokens = 100) {
    return PlacementRequest{"smollm2", "full", prompt, max_tokens, {}};
  }

  ManualClock clock_;
  Membership membership_{&clock_, absl::Seconds(10)};
  Placement placement_{&membership_};
};

TEST_F(PlacementTest, PicksLeastLoadedNodes) {
  Add(Prefill("p:1", /*queued=*/500));
  const std::string p2 = Add(Prefill("p:2", /*queued=*/100));
  Add(Decode("d:1", /*slots=*/2));
  const std::string d2 = Add(Decode("d:2", /*slots=*/8));
  Add(Store("s:1", 1 << 20));
  const std::string s2 = Add(Store("s:2", 1 << 30));
  auto d = placement_.Place(Request());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->prefill.id, p2);
  EXPECT_EQ(d->decode.id, d2);
  EXPECT_EQ(d->store.id, s2);
  EXPECT_EQ(d->kv_bytes, 200u * 1000u);
  EXPECT_EQ(d->summary_bytes, 200u * 10u);
}

TEST_F(PlacementTest, TiesGoToEarliestRegistration) {
  const std::string p1 = Add(Prefill("p:1"));
  Add(Prefill("p:2"));
  const std::string d1 = Add(Decode("d:1"));
  Add(Decode("d:2"));
  const std::string s1 = Add(Store("s:1"));
  Add(Store("s:2"));
  auto d = placement_.Place(Request());
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->prefill.id, p1);
  EXPECT_EQ(d->decode.id, d1);
  EXPECT_EQ(d->store.id, s1);
}

TEST_F(PlacementTest, PendingLoadSpreadsConsecutiveRequests) {
  const std::string p1 = Add(Prefill("p:1"));
  const std::string p2 = Add(Prefill("p:2"));
  const std::string d1 = Add(Decode("d:1"));
  const std::string d2 = Add(Decode("d:2"));
  Add(Store("s:1"));
  auto a = placement_.Place(Request());
  auto b = placement_.Place(Request());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->prefill.id, p1);
  EXPECT_EQ(b->prefill.id, p2);
  EXPECT_EQ(a->decode.id, d1);
  EXPECT_EQ(b->decode.id, d2);
}

// Sequences spread over equal stores: requests placed between two heartbeats alternate (the
// pending sequence counts), and so do requests that each end before the next (after a
// heartbeat both stores report nothing held again: round robin).
TEST_F(PlacementTest, SequencesSpreadOverStores) {
  Add(Prefill("p:1"));
  Add(Decode("d:1", /*slots=*/16));
  const std::string s1 = Add(Store("s:1"));
  const std::string s2 = Add(Store("s:2"));
  std::map<std::string, int> placed;
  for (int i = 0; i < 4; ++i) {
    auto d = placement_.Place(Request());
    ASSERT_TRUE(d.ok()) << d.status();
    ++placed[d->store.id];
  }
  EXPECT_EQ(placed[s1], 2);
  EXPECT_EQ(placed[s2], 2);

  // One at a time: each request has finished (the stores heartbeat an empty pool) before the
  // next is placed.
  std::vector<std::string> order;
  for (int i = 0; i < 4; ++i) {
    for (const std::string& s : {s1, s2}) {
      ASSERT_TRUE(membership_.Heartbeat(s, {.free_memory_bytes = 1ull << 32}).ok());
    }
    auto d = placement_.Place(Request());
    ASSERT_TRUE(d.ok()) << d.status();
    order.push_back(d->store.id);
  }
  // The first round ended on s2, so the rotation resumes at s1.
  EXPECT_THAT(order, ::testing::ElementsAre(s1, s2, s1, s2));
}

// The store that holds fewer sequences wins over one with more free bytes; a store without
// room for the KV is never picked, however empty.
TEST_F(PlacementTest, FewestSequencesWinsAmongStoresWithRoom) {
  Add(Prefill("p:1"));
  Add(Decode("d:1", /*slots=*/16));
  const std::string big = Add(Store("s:big", 1ull << 34));
  const std::string small = Add(Store("s:small", 1ull << 30));
  const std::string tiny = Add(Store("s:tiny", 1000));
  ASSERT_TRUE(
      membership_.Heartbeat(big, {.running_sequences = 3, .free_memory_bytes = 1ull << 34}).ok());
  ASSERT_TRUE(
      membership_.Heartbeat(small, {.running_sequences = 1, .free_memory_bytes = 1ull << 30})
          .ok());
  ASSERT_TRUE(membership_.Heartbeat(tiny, {.free_memory_bytes = 1000}).ok());
  auto d = placement_.Place(Request());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->store.id, small);
  // small now holds 1 + 1 pending; big 3: small again, then big once they are level.
  d = placement_.Place(Request());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->store.id, small);
  d = placement_.Place(Request());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->store.id, big);  // 3 each: most free bytes
}

// A decode node that reads the store's pages in place (needs_local_store: --device cuda, one
// kv-store per decode pod) is placed only with a store of its host: with two such pods, each
// request's store is its decode node's own, whatever the stores' load; a decode node whose
// store has no room gives way to the next one; none with room is RESOURCE_EXHAUSTED saying so.
TEST_F(PlacementTest, DecodeNodesThatReadInPlaceGetAStoreOfTheirHost) {
  auto on = [](NodeRegistration r, const std::string& host, bool local) {
    r.host_id = host;
    r.needs_local_store = local;
    return r;
  };
  Add(Prefill("p:1"));
  const std::string d_a = Add(on(Decode("a:decode", /*slots=*/16), "host-a", true));
  const std::string d_b = Add(on(Decode("b:decode", /*slots=*/16), "host-b", true));
  const std::string s_a = Add(on(Store("a:store", 1ull << 30), "host-a", false));
  const std::string s_b = Add(on(Store("b:store", 1ull << 34), "host-b", false));
  std::map<std::string, std::string> store_of;
  for (int i = 0; i < 6; ++i) {
    auto d = placement_.Place(Request());
    ASSERT_TRUE(d.ok()) << d.status();
    store_of[d->decode.id] = d->store.id;  // must never change for a decode node
    EXPECT_EQ(d->store.id, d->decode.id == d_a ? s_a : s_b) << "request " << i;
  }
  EXPECT_EQ(store_of.size(), 2u) << "both decode nodes took requests";
  // host-a's store is full: every request goes to decode b (with its store), although a has
  // more free slots.
  ASSERT_TRUE(membership_.Heartbeat(s_a, {.free_memory_bytes = 1000}).ok());
  ASSERT_TRUE(membership_.Heartbeat(d_b, {.running_sequences = 10,
                                          .free_memory_bytes = 1ull << 30}).ok());
  auto d = placement_.Place(Request());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->decode.id, d_b);
  EXPECT_EQ(d->store.id, s_b);
  // Both full: refused, naming why.
  ASSERT_TRUE(membership_.Heartbeat(s_b, {.free_memory_bytes = 1000}).ok());
  const std::string s_c = Add(on(Store("c:store", 1ull << 34), "host-c", false));
  d = placement_.Place(Request());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("no store on their hosts"));
  // A decode node that reads over the network takes any store.
  const std::string d_c = Add(Decode("c:decode", /*slots=*/64));
  d = placement_.Place(Request());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->decode.id, d_c);
  EXPECT_EQ(d->store.id, s_c);
}

TEST_F(PlacementTest, FullDecodeSlotsAreResourceExhausted) {
  Add(Prefill("p:1"));
  Add(Decode("d:1", /*slots=*/1));
  Add(Store("s:1"));
  ASSERT_TRUE(placement_.Place(Request()).ok());
  auto second = placement_.Place(Request());
  EXPECT_TRUE(absl::IsResourceExhausted(second.status())) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("decode batch slots"));
}

TEST_F(PlacementTest, DecodeMemoryStoreMemoryAndPrefillQueueNameTheResource) {
  NodeRegistration p = Prefill("p:1");
  p.capacity.max_queued_prefill_tokens = 150;
  Add(p);
  Add(Decode("d:1", 4, /*free_bytes=*/1500));
  Add(Store("s:1", /*free_bytes=*/150'000));

  auto queue = placement_.Place(Request(/*prompt=*/200, 1));
  EXPECT_TRUE(absl::IsResourceExhausted(queue.status()));
  EXPECT_THAT(std::string(queue.status().message()), HasSubstr("prefill queue"));

  auto summaries = placement_.Place(Request(/*prompt=*/100, /*max_tokens=*/100));  // 2000 B
  EXPECT_TRUE(absl::IsResourceExhausted(summaries.status()));
  EXPECT_THAT(std::string(summaries.status().message()), HasSubstr("decode summary memory"));

  PlacementRequest cheap = Request(/*prompt=*/100, /*max_tokens=*/100);
  cheap.method = "clusterkv";  // 2 B/token: 400 B fit; the store needs 200 kB
  auto store = placement_.Place(cheap);
  EXPECT_TRUE(absl::IsResourceExhausted(store.status()));
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("store memory"));
}

TEST_F(PlacementTest, ExcludedNodesAreAvoidedAndMissingRolesAreNotFound) {
  const std::string p1 = Add(Prefill("p:1"));
  const std::string p2 = Add(Prefill("p:2"));
  Add(Decode("d:1"));
  Add(Store("s:1"));
  PlacementRequest req = Request();
  req.excluded = {p1};
  auto d = placement_.Place(req);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->prefill.id, p2);
  req.excluded = {p1, p2};
  EXPECT_TRUE(absl::IsNotFound(placement_.Place(req).status()));
  req.excluded = {};
  req.method = "pariskv";
  EXPECT_THAT(std::string(placement_.Place(req).status().message()),
              HasSubstr("retrieval method 'pariskv'"));
}

TEST(AdmissionTest, RefusesOverTheLimitAndTicketsGiveBack) {
  Admission admission(2);
  auto a = admission.Admit();
  auto b = admission.Admit();
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = admission.Admit();
  EXPECT_TRUE(absl::IsResourceExhausted(c.status()));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("requests in flight"));
  { Admission::Ticket released = std::move(*a); }
  EXPECT_EQ(admission.in_flight(), 1u);
  EXPECT_TRUE(admission.Admit().ok());
}

}  // namespace
}  // namespace kvr::controller
