// PagedKvStore attachments: per (sequence, layer) opaque blobs describing the layer's first
// rows. Guarded by the sequence's capability, held in pool pages (capacity, eviction order),
// freed with the sequence, and kept by a fork only where they describe rows the child shares.

#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

// In the test helpers' namespace (test_pattern.h, store_test_util.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

// 32-byte rows; 256-byte pages hold 8 of them.
constexpr SequenceShape kShape{.n_layers = 3, .n_kv_heads = 2, .head_dim = 8, .dtype = DType::kF16};
constexpr uint64_t kPageBytes = 256;

std::unique_ptr<PagedKvStore> MakeStore(uint64_t capacity, bool evict_cached = true) {
  return MakeTestStore(
      {.pool = {.capacity_bytes = capacity, .page_bytes = kPageBytes, .try_huge_pages = false},
       .evict_cached = evict_cached});
}

// `n` bytes that differ with `seed`, spanning several pages for n > kPageBytes.
std::vector<uint8_t> Blob(size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 7 + i / 251);
  return b;
}

void WriteRows(PagedKvStore& store, SequenceId id, uint32_t n) {
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_TRUE(WritePatternRows(store, kShape, id, layer, 0, n, id).ok());
  }
}

TEST(AttachmentTest, PutGetReplaceAndCapability) {
  auto store = MakeStore(64 * kPageBytes);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  const uint64_t free_before = store->Stats().free_pages;

  auto none = store->GetAttachment(TestRef(1), 0);
  EXPECT_TRUE(absl::IsNotFound(none.status())) << none.status();

  // Three pages and a bit; other layers stay empty.
  const std::vector<uint8_t> blob = Blob(3 * kPageBytes + 17, 3);
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 1, 64, blob).ok());
  EXPECT_EQ(store->Stats().free_pages, free_before - 4);
  auto got = store->GetAttachment(TestRef(1), 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->rows, 64u);
  EXPECT_EQ(got->bytes, blob);
  EXPECT_TRUE(absl::IsNotFound(store->GetAttachment(TestRef(1), 0).status()));
  auto info = store->GetSequence(TestRef(1));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages, 4u);

  // A wrong capability reads and writes nothing, with the answer of an unknown id.
  const SequenceRef wrong{1, TestCapability(2)};
  auto denied = store->GetAttachment(wrong, 1);
  EXPECT_TRUE(absl::IsPermissionDenied(denied.status())) << denied.status();
  EXPECT_THAT(denied.status().message(), HasSubstr("no sequence 1 with this capability"));
  EXPECT_TRUE(absl::IsPermissionDenied(store->PutAttachment(wrong, 1, 8, Blob(10, 9))));
  EXPECT_TRUE(absl::IsPermissionDenied(store->PutAttachment({1, Capability{}}, 1, 8, Blob(1, 1))));
  EXPECT_EQ(store->GetAttachment(TestRef(1), 1)->bytes, blob);

  // A layer past the shape; too many bytes.
  EXPECT_TRUE(absl::IsOutOfRange(store->PutAttachment(TestRef(1), 3, 0, blob)));
  EXPECT_TRUE(absl::IsOutOfRange(store->GetAttachment(TestRef(1), 3).status()));
  std::vector<uint8_t> huge(kMaxAttachmentBytes + 1);
  absl::Status too_big = store->PutAttachment(TestRef(1), 0, 0, huge);
  EXPECT_TRUE(absl::IsInvalidArgument(too_big)) << too_big;

  // Replacing frees the old pages; an empty blob is an attachment of no pages.
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 1, 128, Blob(kPageBytes, 5)).ok());
  EXPECT_EQ(store->Stats().free_pages, free_before - 1);
  EXPECT_EQ(store->GetAttachment(TestRef(1), 1)->rows, 128u);
  EXPECT_EQ(store->GetAttachment(TestRef(1), 1)->bytes, Blob(kPageBytes, 5));
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 2, 0, {}).ok());
  auto empty = store->GetAttachment(TestRef(1), 2);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->bytes.empty());
  EXPECT_EQ(store->Stats().free_pages, free_before - 1);
}

TEST(AttachmentTest, FreedWithTheSequenceAndReadOnlyOnceReleased) {
  auto store = MakeStore(64 * kPageBytes);
  const uint64_t free_at_start = store->Stats().free_pages;
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 0, 8, Blob(2 * kPageBytes, 1)).ok());
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 2, 8, Blob(kPageBytes + 1, 2)).ok());
  EXPECT_EQ(store->Stats().free_pages, free_at_start - 4);

  // Released and kept: still readable, not writable; the old attachment stays.
  ASSERT_TRUE(store->Release(TestRef(1), absl::Minutes(1)).ok());
  EXPECT_EQ(store->GetAttachment(TestRef(1), 0)->bytes, Blob(2 * kPageBytes, 1));
  absl::Status put = store->PutAttachment(TestRef(1), 0, 8, Blob(3, 3));
  EXPECT_TRUE(absl::IsFailedPrecondition(put)) << put;
  EXPECT_EQ(store->GetAttachment(TestRef(1), 0)->bytes, Blob(2 * kPageBytes, 1));
  EXPECT_EQ(store->Stats().free_pages, free_at_start - 4);

  // Freed: every page comes back.
  ASSERT_TRUE(store->Release(TestRef(1), absl::ZeroDuration()).ok());
  EXPECT_EQ(store->Stats().free_pages, free_at_start);
  EXPECT_TRUE(absl::IsPermissionDenied(store->GetAttachment(TestRef(1), 0).status()));
}

// A fork keeps the attachments that describe rows it shares (pages shared, not copied), drops
// the others; each side then replaces its own without touching the other's.
TEST(AttachmentTest, ForkKeepsTheAttachmentsWithinTheForkedRows) {
  auto store = MakeStore(256 * kPageBytes);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  WriteRows(*store, 1, 40);
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 0, 16, Blob(2 * kPageBytes, 10)).ok());
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 1, 32, Blob(kPageBytes, 11)).ok());
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 2, 40, Blob(kPageBytes, 12)).ok());
  const uint64_t shared_before = store->Stats().shared_pages;

  // 32 rows: layers 0 (16 rows) and 1 (32 rows) go with the child, layer 2 (40) does not.
  auto forked = store->ForkSequence(TestRef(2), TestRef(1), 32, 0, absl::ZeroDuration());
  ASSERT_TRUE(forked.ok()) << forked.status();
  ASSERT_EQ(forked->rows, 32u);
  EXPECT_EQ(store->GetAttachment(TestRef(2), 0)->bytes, Blob(2 * kPageBytes, 10));
  EXPECT_EQ(store->GetAttachment(TestRef(2), 0)->rows, 16u);
  EXPECT_EQ(store->GetAttachment(TestRef(2), 1)->bytes, Blob(kPageBytes, 11));
  EXPECT_TRUE(absl::IsNotFound(store->GetAttachment(TestRef(2), 2).status()));
  // The row pages (32 rows = 4 full pages per list) and the 3 attachment pages are shared.
  EXPECT_EQ(store->Stats().shared_pages - shared_before, 4 * 6 + 3);
  // The child's capability is its own.
  EXPECT_TRUE(absl::IsPermissionDenied(store->GetAttachment({2, TestCapability(1)}, 0).status()));

  // The child replaces one; the parent's stays.
  ASSERT_TRUE(store->PutAttachment(TestRef(2), 0, 32, Blob(kPageBytes, 20)).ok());
  EXPECT_EQ(store->GetAttachment(TestRef(1), 0)->bytes, Blob(2 * kPageBytes, 10));
  EXPECT_EQ(store->GetAttachment(TestRef(2), 0)->bytes, Blob(kPageBytes, 20));

  // The parent goes: the child's shared attachment survives it, and its pages come back only
  // when the child goes too.
  const uint64_t free_before_parent = store->Stats().free_pages;
  ASSERT_TRUE(store->Release(TestRef(1), absl::ZeroDuration()).ok());
  EXPECT_EQ(store->GetAttachment(TestRef(2), 1)->bytes, Blob(kPageBytes, 11));
  // Freed: the parent's 5 row pages per list, less the 4 shared, and its attachments of
  // layers 0 (2 pages, no longer shared since the child replaced its own) and 2 (1).
  EXPECT_EQ(store->Stats().free_pages - free_before_parent, 6 * 1 + 2 + 1);
  ASSERT_TRUE(store->Release(TestRef(2), absl::ZeroDuration()).ok());
  EXPECT_EQ(store->Stats().free_pages, store->Stats().total_pages);
}

// Attachments take pool pages: a put that does not fit is refused and changes nothing (or
// first evicts a cached sequence, as a write does); they count in the sequence's pages.
TEST(AttachmentTest, CountedAgainstCapacity) {
  auto store = MakeStore(16 * kPageBytes, /*evict_cached=*/false);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 8, absl::ZeroDuration()).ok());  // 6 pages
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 0, 8, Blob(4 * kPageBytes, 1)).ok());
  EXPECT_EQ(store->Stats().free_pages, 6u);
  absl::Status full = store->PutAttachment(TestRef(1), 1, 8, Blob(7 * kPageBytes, 2));
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_THAT(full.message(), HasSubstr("attachment"));
  EXPECT_TRUE(absl::IsNotFound(store->GetAttachment(TestRef(1), 1).status()));
  EXPECT_EQ(store->Stats().free_pages, 6u);
  // Replacing an attachment needs room for the new one before the old one goes.
  EXPECT_TRUE(
      absl::IsResourceExhausted(store->PutAttachment(TestRef(1), 0, 8, Blob(7 * kPageBytes, 3))));
  EXPECT_EQ(store->GetAttachment(TestRef(1), 0)->bytes, Blob(4 * kPageBytes, 1));

  // With eviction of cached sequences: a kept sequence, attachments and all, gives way.
  auto evicting = MakeStore(16 * kPageBytes, /*evict_cached=*/true);
  ASSERT_TRUE(evicting->CreateSequence(TestRef(1), kShape, 8, absl::ZeroDuration()).ok());
  ASSERT_TRUE(evicting->PutAttachment(TestRef(1), 0, 8, Blob(4 * kPageBytes, 1)).ok());
  ASSERT_TRUE(evicting->Release(TestRef(1), absl::Minutes(1)).ok());
  ASSERT_TRUE(evicting->CreateSequence(TestRef(2), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(evicting->PutAttachment(TestRef(2), 0, 0, Blob(12 * kPageBytes, 4)).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(evicting->GetSequence(TestRef(1)).status()));
  EXPECT_EQ(evicting->GetAttachment(TestRef(2), 0)->bytes, Blob(12 * kPageBytes, 4));
  EXPECT_EQ(evicting->Stats().evictions_cached_lru, 1u);
}

}  // namespace
}  // namespace kvr::kv_store::testing
