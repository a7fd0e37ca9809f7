#include "kvr/kv_store/wire.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvr::kv_store::wire {
namespace {

using ::testing::HasSubstr;

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(WireTest, GatherRoundTrip) {
  const std::vector<uint32_t> a = {5, 1, 9}, b = {}, c = {7};
  const SequenceRef s3{3, Capability::Generate()}, s4{4, Capability::Generate()};
  const std::vector<GatherEntry> entries = {{.sequence = s3, .layer = 1, .head = 2, .indices = a},
                                            {.sequence = s4, .layer = 0, .head = 0, .indices = b},
                                            {.sequence = s3, .layer = 2, .head = 1, .indices = c}};
  Encoded enc = EncodeGather(entries, absl::InfiniteFuture());
  auto parsed = ParseGather(Bytes(enc.header), enc.payload, absl::Now());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->entries.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(parsed->entries[i].sequence.id, entries[i].sequence.id);
    EXPECT_TRUE(parsed->entries[i].sequence.cap.Matches(entries[i].sequence.cap));
    EXPECT_EQ(parsed->entries[i].layer, entries[i].layer);
    EXPECT_EQ(parsed->entries[i].head, entries[i].head);
    EXPECT_EQ(std::vector<uint32_t>(parsed->entries[i].indices.begin(),
                                    parsed->entries[i].indices.end()),
              std::vector<uint32_t>(entries[i].indices.begin(), entries[i].indices.end()));
  }
  // A misaligned payload (as a transport may deliver) parses the same, via a copy.
  std::vector<uint8_t> shifted(enc.payload.size() + 1);
  std::memcpy(shifted.data() + 1, enc.payload.data(), enc.payload.size());
  auto misaligned =
      ParseGather(Bytes(enc.header), std::span(shifted).subspan(1), absl::Now());
  ASSERT_TRUE(misaligned.ok());
  EXPECT_EQ(misaligned->entries[0].indices[2], 9u);
}

TEST(WireTest, WriteAndRangeRoundTrip) {
  std::vector<uint8_t> kv(64);
  const SequenceRef s9{9, Capability::Generate()};
  LayerRows rows{.sequence = s9, .layer = 3, .start_row = LayerRows::kAtEnd, .n_rows = 2};
  std::string header = EncodeWriteHeader(rows, absl::InfiniteFuture());
  auto parsed = ParseWrite(Bytes(header), kv, absl::Now());
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->sequence.id, 9u);
  EXPECT_TRUE(parsed->sequence.cap.Matches(s9.cap));
  EXPECT_EQ(parsed->start_row, LayerRows::kAtEnd);
  EXPECT_EQ(parsed->k.size(), 32u);
  EXPECT_EQ(parsed->v.data(), kv.data() + 32);

  const SequenceRef s1{1, Capability::Generate()};
  const std::vector<RangeEntry> ranges = {
      {.sequence = s1, .layer = 2, .head = 3, .start = 4, .n_rows = 5}};
  Encoded enc = EncodeRange(MessageType::kRangeRead, ranges, absl::InfiniteFuture());
  auto r = ParseRange(MessageType::kRangeRead, Bytes(enc.header), enc.payload, absl::Now());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0].sequence.id, 1u);
  EXPECT_TRUE((*r)[0].sequence.cap.Matches(s1.cap));
  EXPECT_FALSE((*r)[0].sequence.cap.Matches(s9.cap));
  EXPECT_EQ((*r)[0].start, 4u);
  EXPECT_EQ((*r)[0].n_rows, 5u);
}

// Version 1 carried no capabilities: such a message is refused, never served unchecked.
TEST(WireTest, VersionOneIsRefused) {
  const std::vector<uint32_t> a = {1};
  const std::vector<GatherEntry> entries = {
      {.sequence = {1, Capability::Generate()}, .indices = a}};
  Encoded enc = EncodeGather(entries, absl::InfiniteFuture());
  std::string old = enc.header;
  old[4] = 1;
  old[5] = 0;
  auto st = ParseGather(Bytes(old), enc.payload, absl::Now()).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("wire version 1 is not supported"));
}

TEST(CapabilityTest, GeneratedAreDistinctAndCompare) {
  const Capability a = Capability::Generate(), b = Capability::Generate();
  EXPECT_FALSE(a.IsNone());
  EXPECT_FALSE(a.Matches(b));
  EXPECT_TRUE(a.Matches(a));
  EXPECT_TRUE(Capability{}.IsNone());
  auto back = Capability::FromBytes(a.ToBytes());
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->Matches(a));
  EXPECT_TRUE(absl::IsInvalidArgument(Capability::FromBytes("short").status()));
  EXPECT_TRUE(Capability::FromBytesOrNone("short").IsNone());
}

TEST(WireTest, MalformedMessagesAreRefusedWithReasons) {
  const std::vector<uint32_t> a = {1, 2};
  const std::vector<GatherEntry> entries = {
      {.sequence = {1, Capability::Generate()}, .indices = a}};
  Encoded enc = EncodeGather(entries, absl::InfiniteFuture());
  const absl::Time now = absl::Now();

  // Truncated header.
  auto st = ParseGather(Bytes(enc.header).first(10), enc.payload, now).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_THAT(st.message(), HasSubstr("truncated"));
  // Truncated payload.
  st = ParseGather(Bytes(enc.header), std::span(enc.payload).first(enc.payload.size() - 1), now)
           .status();
  EXPECT_THAT(st.message(), HasSubstr("gather payload has"));
  // Bad magic and future version.
  std::string bad = enc.header;
  bad[0] ^= 0xff;
  EXPECT_THAT(ParseGather(Bytes(bad), enc.payload, now).status().message(),
              HasSubstr("bad magic"));
  bad = enc.header;
  bad[4] = 7;
  EXPECT_TRUE(absl::IsFailedPrecondition(ParseGather(Bytes(bad), enc.payload, now).status()));
  // Wrong message type for the handler.
  EXPECT_THAT(
      ParseRange(MessageType::kRangeRead, Bytes(enc.header), enc.payload, now).status().message(),
      HasSubstr("message type 2"));
  // An entry claiming more indices than the request carries.
  std::vector<uint8_t> lying = enc.payload;
  GatherEntryWire w;
  std::memcpy(&w, lying.data(), sizeof(w));
  w.n_indices = 1000;
  std::memcpy(lying.data(), &w, sizeof(w));
  EXPECT_THAT(ParseGather(Bytes(enc.header), lying, now).status().message(),
              HasSubstr("claims 1000 indices"));
  // Past its deadline.
  Encoded late = EncodeGather(entries, now - absl::Seconds(1));
  EXPECT_TRUE(absl::IsDeadlineExceeded(ParseGather(Bytes(late.header), late.payload, now).status()));
  // Odd-sized write payload.
  std::vector<uint8_t> odd(33);
  std::string wh = EncodeWriteHeader({.sequence = {1, Capability::Generate()}, .n_rows = 1},
                                     absl::InfiniteFuture());
  EXPECT_TRUE(absl::IsInvalidArgument(ParseWrite(Bytes(wh), odd, now).status()));
  // Reply of the wrong type.
  std::string reply = EncodeReply(MessageType::kGather, 0, 0);
  EXPECT_TRUE(ParseReply(Bytes(reply), MessageType::kGather).ok());
  EXPECT_FALSE(ParseReply(Bytes(reply), MessageType::kRangeRead).ok());
}

}  // namespace
}  // namespace kvr::kv_store::wire
