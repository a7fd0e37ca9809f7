// Every store operation on a sequence demands the sequence's capability: a wrong or missing
// one is refused with PERMISSION_DENIED, with exactly the message an unknown id gets, and
// changes nothing (rows, watermarks, pages, lease, free pages).

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

// In the test helpers' namespace (test_pattern.h, store_test_util.h).
namespace kvr::kv_store::testing {
namespace {

// 64-byte rows in 1 KiB pages: 16 rows per page.
constexpr SequenceShape kShape{
    .n_layers = 2, .n_kv_heads = 2, .head_dim = 16, .dtype = DType::kF16};
constexpr uint64_t kPageBytes = 1024;
constexpr SequenceId kId = 0x5EC12E7;
constexpr uint32_t kRows = 20;

std::unique_ptr<PagedKvStore> MakeStore() {
  return MakeTestStore({.pool = {.capacity_bytes = 64 * kPageBytes, .page_bytes = kPageBytes}});
}

// Everything a refused call must leave as it was.
struct Snapshot {
  SequenceInfo info;
  StoreStats stats;
  std::vector<uint8_t> rows;  // every committed row of every (layer, head), in RangeRead order
};

Snapshot Take(PagedKvStore& store, const SequenceRef& owner) {
  Snapshot s;
  absl::StatusOr<SequenceInfo> info = store.GetSequence(owner);
  EXPECT_TRUE(info.ok()) << info.status();
  s.info = *info;
  s.stats = store.Stats();
  std::vector<RangeEntry> all;
  for (uint32_t l = 0; l < kShape.n_layers; ++l) {
    for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
      all.push_back({.sequence = owner,
                     .layer = l,
                     .head = h,
                     .start = 0,
                     .n_rows = s.info.committed_rows[l]});
    }
  }
  s.rows.resize(*store.RangeBytes(all));
  EXPECT_TRUE(store.RangeRead(all, s.rows).ok());
  return s;
}

void ExpectUnchanged(const Snapshot& before, const Snapshot& after) {
  EXPECT_EQ(after.info.committed_rows, before.info.committed_rows);
  EXPECT_EQ(after.info.pages, before.info.pages);
  EXPECT_EQ(after.info.lease_expiry_unix_ms, before.info.lease_expiry_unix_ms);
  EXPECT_EQ(after.info.released_kept, before.info.released_kept);
  EXPECT_EQ(after.stats.sequences, before.stats.sequences);
  EXPECT_EQ(after.stats.free_pages, before.stats.free_pages);
  EXPECT_EQ(after.stats.bytes_written, before.stats.bytes_written);
  EXPECT_TRUE(after.rows == before.rows);
}

// One attempt per store operation, each naming the sequence by `ref`; returns each one's
// status, keyed by operation.
std::vector<std::pair<std::string, absl::Status>> EveryOperation(PagedKvStore& store,
                                                                 const SequenceRef& ref) {
  std::vector<std::pair<std::string, absl::Status>> out;
  auto rows = MakePatternRows(kShape, ref.id, 0, kRows, 1);
  out.emplace_back("Write", store
                                .Write({.sequence = ref,
                                        .layer = 0,
                                        .start_row = LayerRows::kAtEnd,
                                        .n_rows = 1,
                                        .k = rows.k,
                                        .v = rows.v})
                                .status());
  const std::vector<uint32_t> idx = {0, 3};
  const std::vector<GatherEntry> gather = {
      {.sequence = ref, .layer = 0, .head = 1, .indices = idx}};
  out.emplace_back("GatherBytes", store.GatherBytes(gather).status());
  std::vector<uint8_t> buf(2 * kShape.RowBytes());
  out.emplace_back("Gather", store.Gather(gather, buf));
  const std::vector<RangeEntry> range = {
      {.sequence = ref, .layer = 1, .head = 0, .start = 0, .n_rows = 2}};
  out.emplace_back("RangeBytes", store.RangeBytes(range).status());
  out.emplace_back("RangeRead", store.RangeRead(range, buf));
  out.emplace_back("LocateRange", store.LocateRange(range[0]).status());
  out.emplace_back("ReservePageTable grow", store.ReservePageTable(ref, 64).status());
  out.emplace_back("ReservePageTable report", store.ReservePageTable(ref, 0).status());
  out.emplace_back("Lease", store.Lease(ref, absl::Seconds(1)));
  out.emplace_back("GetSequence", store.GetSequence(ref).status());
  out.emplace_back("Release keep", store.Release(ref, absl::Seconds(30)));
  out.emplace_back("Release", store.Release(ref, absl::ZeroDuration()));
  return out;
}

TEST(CapabilityTest, WrongOrMissingCapabilityIsDeniedLikeAnUnknownIdAndChangesNothing) {
  auto store = MakeStore();
  const SequenceRef owner{kId, Capability::Generate()};
  ASSERT_TRUE(store->CreateSequence(owner, kShape, 32, absl::Minutes(5)).ok());
  for (uint32_t l = 0; l < kShape.n_layers; ++l) {
    auto rows = MakePatternRows(kShape, kId, l, 0, kRows);
    ASSERT_TRUE(store
                    ->Write({.sequence = owner,
                             .layer = l,
                             .start_row = 0,
                             .n_rows = kRows,
                             .k = rows.k,
                             .v = rows.v})
                    .ok());
  }
  ASSERT_TRUE(store->ReservePageTable(owner, 32).ok());
  const Snapshot before = Take(*store, owner);

  // Wrong capabilities: a fresh random one, none (all zero), and the owner's with one bit
  // flipped in its last byte (a compare that stops early would still reject it, but this
  // makes sure the whole value counts).
  Capability flipped = owner.cap;
  flipped.bytes.back() ^= 1;
  const std::vector<std::pair<std::string, Capability>> wrong = {
      {"random", Capability::Generate()}, {"none", Capability{}}, {"one bit off", flipped}};
  std::vector<std::vector<std::pair<std::string, absl::Status>>> denied;
  for (const auto& [what, cap] : wrong) {
    SCOPED_TRACE(what);
    denied.push_back(EveryOperation(*store, {kId, cap}));
    for (const auto& [op, st] : denied.back()) {
      EXPECT_TRUE(absl::IsPermissionDenied(st)) << op << ": " << st;
      EXPECT_THAT(st.message(), ::testing::HasSubstr("with this capability")) << op;
    }
    ExpectUnchanged(before, Take(*store, owner));
  }

  // The owner's rows are intact and still served to the owner.
  std::vector<uint8_t> row(kShape.RowBytes());
  const std::vector<uint32_t> idx = {kRows - 1};
  ASSERT_TRUE(
      store->Gather({{{.sequence = owner, .layer = 1, .head = 1, .indices = idx}}}, row).ok());
  EXPECT_TRUE(RowMatches(kShape, kId, 1, 1, kRows - 1, row.data()));

  // Now make the id unknown: every operation's answer is the same, word for word, as with a
  // wrong capability, so a caller cannot tell "exists" from "does not".
  ASSERT_TRUE(store->Release(owner, absl::ZeroDuration()).ok());
  const auto unknown = EveryOperation(*store, owner);
  for (const auto& attempt : denied) {
    ASSERT_EQ(attempt.size(), unknown.size());
    for (size_t i = 0; i < unknown.size(); ++i) {
      EXPECT_EQ(attempt[i].second, unknown[i].second) << unknown[i].first;
    }
  }
  EXPECT_EQ(store->Stats().free_pages, 64u);
}

// A batch naming a sequence the caller owns and, in a later entry, the same id with another
// capability is refused as a whole: the check is per entry, not per run of equal ids.
TEST(CapabilityTest, EveryEntryOfABatchIsChecked) {
  auto store = MakeStore();
  const SequenceRef owner{kId, Capability::Generate()};
  ASSERT_TRUE(store->CreateSequence(owner, kShape, 0, absl::ZeroDuration()).ok());
  auto rows = MakePatternRows(kShape, kId, 0, 0, 4);
  ASSERT_TRUE(store
                  ->Write({.sequence = owner,
                           .layer = 0,
                           .start_row = 0,
                           .n_rows = 4,
                           .k = rows.k,
                           .v = rows.v})
                  .ok());
  const SequenceRef thief{kId, Capability::Generate()};
  const std::vector<uint32_t> idx = {1};
  const std::vector<GatherEntry> gather = {
      {.sequence = owner, .layer = 0, .head = 0, .indices = idx},
      {.sequence = thief, .layer = 0, .head = 1, .indices = idx}};
  std::vector<uint8_t> out(2 * kShape.RowBytes());
  absl::Status st = store->Gather(gather, out);
  EXPECT_TRUE(absl::IsPermissionDenied(st)) << st;
  EXPECT_EQ(st.message(), absl::StrFormat("entry 1: no sequence %d with this capability", kId));
  EXPECT_TRUE(absl::IsPermissionDenied(store->GatherBytes(gather).status()));
  const std::vector<RangeEntry> range = {
      {.sequence = owner, .layer = 0, .head = 0, .start = 0, .n_rows = 1},
      {.sequence = thief, .layer = 0, .head = 0, .start = 0, .n_rows = 1}};
  EXPECT_TRUE(absl::IsPermissionDenied(store->RangeRead(range, out)));
}

TEST(CapabilityTest, CreationNeedsACapabilityAndADuplicateKeepsTheFirst) {
  auto store = MakeStore();
  EXPECT_TRUE(absl::IsInvalidArgument(
      store->CreateSequence({kId, Capability{}}, kShape, 0, absl::ZeroDuration()).status()));
  const SequenceRef first{kId, Capability::Generate()};
  ASSERT_TRUE(store->CreateSequence(first, kShape, 16, absl::ZeroDuration()).ok());
  const uint64_t free_pages = store->Stats().free_pages;
  // The creator of a colliding id learns to pick another; it gains no access.
  const SequenceRef second{kId, Capability::Generate()};
  EXPECT_TRUE(absl::IsAlreadyExists(
      store->CreateSequence(second, kShape, 16, absl::ZeroDuration()).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(store->GetSequence(second).status()));
  EXPECT_TRUE(store->GetSequence(first).ok());
  EXPECT_EQ(store->Stats().free_pages, free_pages);
}

}  // namespace
}  // namespace kvr::kv_store::testing
