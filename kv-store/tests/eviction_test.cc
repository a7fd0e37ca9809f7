// The store's capacity policy: when an allocation falls short, expired sequences go first
// (evict_expired), then released-and-kept ones, least recently used first (evict_cached);
// live sequences never; and a request that cannot fit even then is refused without evicting.

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

// In the test helpers' namespace (test_pattern.h, store_test_util.h).
namespace kvr::kv_store::testing {
namespace {

// One (layer, head) of 32-byte rows: 8 rows per 256-byte page, so a sequence's pages are easy
// to count.
constexpr SequenceShape kShape{.n_layers = 1, .n_kv_heads = 1, .head_dim = 8,
                               .dtype = DType::kF16};

std::unique_ptr<PagedKvStore> MakeStore(uint64_t pages, bool evict_expired, bool evict_cached,
                                        std::function<absl::Time()> now = nullptr) {
  StoreOptions options{
      .pool = {.capacity_bytes = pages * 256, .page_bytes = 256, .try_huge_pages = false},
      .evict_expired = evict_expired,
      .evict_cached = evict_cached};
  if (now) options.now = std::move(now);
  return MakeTestStore(std::move(options));
}

absl::StatusOr<uint64_t> Append(PagedKvStore& store, SequenceId seq, uint64_t start, uint32_t n,
                                SequenceId pattern) {
  return WritePatternRows(store, kShape, seq, 0, start, n, pattern);
}

bool Held(PagedKvStore& store, SequenceId seq) { return store.GetSequence(TestRef(seq)).ok(); }

// True when rows [0, n) of `seq` read back as `pattern`'s and rows [n, end) as its own.
bool RowsIntact(PagedKvStore& store, SequenceId seq, uint64_t n, SequenceId pattern) {
  auto info = store.GetSequence(TestRef(seq));
  if (!info.ok()) return false;
  const uint64_t end = info->committed_rows[0];
  const RangeEntry range{.sequence = TestRef(seq), .start = 0, .n_rows = end};
  std::vector<uint8_t> out(end * kShape.RowBytes());
  if (!store.RangeRead({&range, 1}, out).ok()) return false;
  for (uint64_t r = 0; r < end; ++r) {
    if (!RowMatches(kShape, r < n ? pattern : seq, 0, 0, r, out.data() + r * kShape.RowBytes())) {
      return false;
    }
  }
  return true;
}

// Eight cached sequences fill the pool; then creates, writes and forks make room by evicting
// the least recently used of them, never a live one; a shared parent's eviction frees only
// what no child holds, so eviction goes on to the next; and with nothing evictable left, or a
// request that could not fit anyway, the answer is RESOURCE_EXHAUSTED.
TEST(EvictionTest, CachedSequencesGoLeastRecentlyUsedFirstAndLiveOnesNever) {
  auto store = MakeStore(16, /*evict_expired=*/false, /*evict_cached=*/true);
  for (SequenceId s = 1; s <= 8; ++s) {
    ASSERT_TRUE(store->CreateSequence(TestRef(s), kShape, 0, absl::ZeroDuration()).ok());
    ASSERT_TRUE(Append(*store, s, 0, 16, s).ok());  // 2 pages each
  }
  ASSERT_EQ(store->pool().free_pages(), 0u);
  for (SequenceId s = 1; s <= 8; ++s) {
    ASSERT_TRUE(store->Release(TestRef(s), absl::Hours(1)).ok());
  }
  // Uses after release: 1 is gathered, 2 range-read, 3 forked (child 9 shares both of its pages
  // and needs no fresh one). Least recently used first is now 4, 5, 6, 7, 8, 1, 2, 3.
  const std::vector<uint32_t> idx = {0, 15};
  const GatherEntry gather{.sequence = TestRef(1), .indices = idx};
  std::vector<uint8_t> out(2 * kShape.RowBytes());
  ASSERT_TRUE(store->Gather({&gather, 1}, out).ok());
  const RangeEntry range{.sequence = TestRef(2), .start = 0, .n_rows = 2};
  ASSERT_TRUE(store->RangeRead({&range, 1}, out).ok());
  ASSERT_TRUE(store->ForkSequence(TestRef(9), TestRef(3), 16, 0, absl::ZeroDuration()).ok());
  ASSERT_EQ(store->pool().free_pages(), 0u);

  // A create reserving 2 pages evicts 4 alone.
  ASSERT_TRUE(store->CreateSequence(TestRef(10), kShape, 16, absl::ZeroDuration()).ok());
  EXPECT_FALSE(Held(*store, 4));
  for (SequenceId s : {1, 2, 3, 5, 6, 7, 8, 9}) EXPECT_TRUE(Held(*store, s)) << s;
  EXPECT_EQ(store->Stats().evictions_cached_lru, 1u);

  // A write needing 3 pages evicts 5 and 6.
  ASSERT_TRUE(store->CreateSequence(TestRef(11), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(Append(*store, 11, 0, 24, 11).ok());
  EXPECT_FALSE(Held(*store, 5));
  EXPECT_FALSE(Held(*store, 6));
  for (SequenceId s : {1, 2, 3, 7, 8}) EXPECT_TRUE(Held(*store, s)) << s;
  EXPECT_EQ(store->pool().free_pages(), 1u);

  // A fork of 7 (never evicted for its own fork) at 12 rows reserving 40 needs 4 fresh pages:
  // 8 and then 1 go.
  auto fork = store->ForkSequence(TestRef(12), TestRef(7), 12, 40, absl::ZeroDuration());
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_FALSE(Held(*store, 8));
  EXPECT_FALSE(Held(*store, 1));
  for (SequenceId s : {2, 3, 7, 9, 10, 11, 12}) EXPECT_TRUE(Held(*store, s)) << s;
  EXPECT_EQ(store->Stats().evictions_cached_lru, 5u);
  EXPECT_EQ(store->pool().free_pages(), 1u);

  // Left: cached 2 (2 pages), 3 (2 pages, both shared with live 9), 7 (2 pages, one shared
  // with live 12): at most 6 pages by their counts, 3 in fact. A write needing 10 pages could
  // not fit even with all of them gone: refused, and nothing is evicted.
  absl::Status st = Append(*store, 11, 24, 80, 11).status();
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  for (SequenceId s : {2, 3, 7}) EXPECT_TRUE(Held(*store, s)) << s;
  EXPECT_EQ(store->Stats().evictions_cached_lru, 5u);

  // A write needing 4 pages: 2 and 3 would do by their page counts, but 3's pages stay with 9,
  // so eviction goes on to 7 (which frees one page; the other stays with 12).
  ASSERT_TRUE(Append(*store, 10, 0, 48, 10).ok());
  for (SequenceId s : {2, 3, 7}) EXPECT_FALSE(Held(*store, s)) << s;
  EXPECT_EQ(store->Stats().evictions_cached_lru, 8u);
  EXPECT_EQ(store->Stats().evictions, 8u);
  EXPECT_EQ(store->pool().free_pages(), 0u);
  // The children of evicted parents read their rows as before.
  EXPECT_TRUE(RowsIntact(*store, 9, 16, 3));
  EXPECT_TRUE(RowsIntact(*store, 12, 12, 7));
  EXPECT_TRUE(RowsIntact(*store, 11, 0, 11));
  EXPECT_TRUE(RowsIntact(*store, 10, 0, 10));

  // Nothing evictable is left: live sequences are never evicted.
  st = Append(*store, 11, 24, 1, 11).status();
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  st = store->CreateSequence(TestRef(13), kShape, 1, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  st = store->ForkSequence(TestRef(13), TestRef(11), 20, 0, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  for (SequenceId s : {9, 10, 11, 12}) EXPECT_TRUE(Held(*store, s)) << s;
  EXPECT_EQ(store->Stats().evictions, 8u);
  EXPECT_EQ(store->pool().refcount_errors(), 0u);
}

// With both policies on, an expired lease goes before any cached sequence, however long ago
// that was used; the reasons are counted apart; the sweep takes only expired ones.
TEST(EvictionTest, ExpiredLeasesGoBeforeCachedSequences) {
  absl::Time now = absl::FromUnixSeconds(1000);
  auto store = MakeStore(8, /*evict_expired=*/true, /*evict_cached=*/true, [&now] { return now; });
  ASSERT_TRUE(store->CreateSequence(TestRef(2), kShape, 16, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->Release(TestRef(2), absl::Hours(1)).ok());  // cached, the oldest use
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 16, absl::Seconds(5)).ok());  // live
  ASSERT_TRUE(store->CreateSequence(TestRef(3), kShape, 16, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->CreateSequence(TestRef(4), kShape, 16, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->Release(TestRef(4), absl::Hours(1)).ok());
  ASSERT_EQ(store->pool().free_pages(), 0u);
  now += absl::Seconds(10);  // 1's lease ran out: its node is gone

  ASSERT_TRUE(store->CreateSequence(TestRef(5), kShape, 16, absl::ZeroDuration()).ok());
  EXPECT_FALSE(Held(*store, 1));
  EXPECT_TRUE(Held(*store, 2));
  StoreStats stats = store->Stats();
  EXPECT_EQ(stats.evictions_expired, 1u);
  EXPECT_EQ(stats.evictions_cached_lru, 0u);

  ASSERT_TRUE(store->CreateSequence(TestRef(6), kShape, 16, absl::ZeroDuration()).ok());
  EXPECT_FALSE(Held(*store, 2));
  EXPECT_TRUE(Held(*store, 4));
  stats = store->Stats();
  EXPECT_EQ(stats.evictions_expired, 1u);
  EXPECT_EQ(stats.evictions_cached_lru, 1u);
  EXPECT_EQ(stats.evictions, 2u);

  // The sweep leaves cached sequences whose keep has not run out.
  EXPECT_EQ(store->SweepExpired(), 0u);
  EXPECT_TRUE(Held(*store, 4));
  now += absl::Hours(2);
  EXPECT_EQ(store->SweepExpired(), 1u);
  EXPECT_FALSE(Held(*store, 4));
  EXPECT_EQ(store->Stats().evictions_expired, 2u);
  for (SequenceId s : {3, 5, 6}) EXPECT_TRUE(Held(*store, s)) << s;
}

// evict_cached off: a kept sequence holds its pages until its keep runs out.
TEST(EvictionTest, CachedSequencesStayWhenNotEnabled) {
  auto store = MakeStore(4, /*evict_expired=*/false, /*evict_cached=*/false);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 32, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->Release(TestRef(1), absl::Hours(1)).ok());
  absl::Status st = store->CreateSequence(TestRef(2), kShape, 8, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_TRUE(Held(*store, 1));
  EXPECT_EQ(store->Stats().evictions, 0u);
}

}  // namespace
}  // namespace kvr::kv_store::testing
