// The proto side of the handoff: defaults for unset fields and the layer count check.

#include "kvr/decode/service.h"

#include "gtest/gtest.h"

namespace kvr::decode {
namespace {

namespace cv1 = ::kvr::cluster::v1;

TEST(HandoffFromProtoTest, AppliesDefaultsAndChecksTheLayerCount) {
  cv1::HandoffHeader header;
  header.set_request_id("r1");
  header.set_sequence_id(9);
  const kv_store::Capability cap = kv_store::Capability::Generate();
  header.set_sequence_capability(cap.ToBytes());
  header.set_prompt_tokens(100);
  header.set_first_token(5);
  header.set_n_layers(2);
  header.set_text_so_far("Hi");
  header.set_pending_utf8("\xE2");
  header.mutable_sampling()->set_max_tokens(7);
  header.mutable_sampling()->add_stop("END");
  header.mutable_retrieval()->set_budget(32);
  std::vector<cv1::HandoffLayer> layers(2);
  layers[1].set_layer(1);
  layers[1].add_local_positions(99);
  layers[1].set_local_kv(std::string(16, 'x'));
  absl::StatusOr<Handoff> h = HandoffFromProto(header, layers, nullptr);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->store_ref().cap.Matches(cap));
  EXPECT_EQ(h->store_ref().id, 9u);
  EXPECT_EQ(h->method, "full");  // unset method
  EXPECT_EQ(h->budget, 32);
  EXPECT_EQ(h->n_sink, Handoff{}.n_sink);  // unset: the library default
  EXPECT_EQ(h->sampling.max_tokens, 7u);
  EXPECT_EQ(h->sampling.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(h->deadline, absl::InfiniteFuture());
  EXPECT_EQ(h->pending_utf8, "\xE2");
  ASSERT_EQ(h->layers.size(), 2u);
  EXPECT_EQ(h->layers[1].local_positions, std::vector<int64_t>{99});
  EXPECT_EQ(h->layers[1].local_kv.size(), 16u);

  layers.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(HandoffFromProto(header, layers, nullptr).status()));
}

}  // namespace
}  // namespace kvr::decode
