// Thinning (StoreOptions::cached_eviction = kThin): under pressure a cached sequence loses, per
// (layer, kv head), the pages whose keys the KeyDiff score ranks least distinctive, down to its
// floor, before any cached sequence goes whole; sinks, recent rows, shared pages and
// attachments stay; and a dropped row is never read as if it were there.

#include <array>
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

// f32 rows of head_dim 4: 32 bytes, 4 rows per 128-byte page.
constexpr SequenceShape kShape{.n_layers = 1, .n_kv_heads = 2, .head_dim = 4, .dtype = DType::kF32};
constexpr uint64_t kPageBytes = 128;
constexpr uint64_t kRowsPerPage = 4;

std::unique_ptr<PagedKvStore> MakeStore(uint64_t pages, CachedEviction policy) {
  return MakeTestStore({.pool = {.capacity_bytes = pages * kPageBytes,
                                 .page_bytes = kPageBytes,
                                 .try_huge_pages = false},
                        .evict_cached = true,
                        .cached_eviction = policy,
                        .thin_keep_fraction = 0.5,
                        .thin_policy = {.sink_rows = 4, .recent_rows = 4}});
}

// Key of row `r` of head `h`: along x, except in the head's two distinctive pages (head 0:
// pages 2 and 5; head 1: pages 1 and 6), where it points along y or z. Those pages, the sink
// page 0 and the recent page 7 are what thinning at keep fraction 0.5 keeps of 8 pages.
std::array<float, 4> Key(uint32_t h, uint64_t r) {
  const uint64_t page = r / kRowsPerPage;
  const uint64_t first = h == 0 ? 2 : 1;
  const uint64_t second = h == 0 ? 5 : 6;
  if (page == first) return {0, 1, 0, 0};
  if (page == second) return {0, 0, 1, 0};
  return {1, 0, 0, 0};
}
float Value(uint32_t h, uint64_t r, uint32_t d) { return static_cast<float>(r * 10 + h) + d / 8.f; }

// Creates `id` with rows [0, n) of Key/Value, in one write; `keys` all along x when uniform.
void WriteSequence(PagedKvStore& store, SequenceId id, uint32_t n, bool uniform = false) {
  ASSERT_TRUE(store.CreateSequence(TestRef(id), kShape, 0, absl::ZeroDuration()).ok());
  std::vector<float> k(size_t{n} * kShape.n_kv_heads * kShape.head_dim);
  std::vector<float> v(k.size());
  for (uint32_t r = 0; r < n; ++r) {
    for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
      const std::array<float, 4> key = uniform ? std::array<float, 4>{1, 0, 0, 0} : Key(h, r);
      for (uint32_t d = 0; d < kShape.head_dim; ++d) {
        k[(size_t{r} * kShape.n_kv_heads + h) * kShape.head_dim + d] = key[d];
        v[(size_t{r} * kShape.n_kv_heads + h) * kShape.head_dim + d] = Value(h, r, d);
      }
    }
  }
  const LayerRows rows{.sequence = TestRef(id),
                       .layer = 0,
                       .start_row = 0,
                       .n_rows = n,
                       .k = {reinterpret_cast<const uint8_t*>(k.data()), k.size() * 4},
                       .v = {reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4}};
  ASSERT_TRUE(store.Write(rows).ok());
}

// Rows [start, start + n) of head `h` of `id` by RangeRead; checks each one's V.
absl::Status ReadRange(PagedKvStore& store, SequenceId id, uint32_t h, uint64_t start, uint64_t n) {
  const RangeEntry range{
      .sequence = TestRef(id), .layer = 0, .head = h, .start = start, .n_rows = n};
  std::vector<float> out(n * 2 * kShape.head_dim);
  absl::Status st =
      store.RangeRead({&range, 1}, {reinterpret_cast<uint8_t*>(out.data()), out.size() * 4});
  if (!st.ok()) return st;
  for (uint64_t i = 0; i < n; ++i) {
    for (uint32_t d = 0; d < kShape.head_dim; ++d) {
      EXPECT_EQ(out[i * 8 + 4 + d], Value(h, start + i, d)) << "row " << start + i;
    }
  }
  return absl::OkStatus();
}

// A cached sequence is thinned rather than evicted: per head the four least distinctive of
// the six candidate pages go, the distinctive pages, the sink page and the recent page stay;
// the freed pages make the new sequence fit; the attachment stays; dropped rows fail reads by
// every read path; kept rows read back exactly; a fork takes only the whole rows below the
// first hole.
TEST(ThinningTest, DropsTheLeastDistinctivePagesAndNeverReadsAHoleAsARow) {
  auto store = MakeStore(20, CachedEviction::kThin);
  WriteSequence(*store, 1, 32);  // 8 pages per head, 16 in all
  const std::vector<uint8_t> summary = {7, 7, 7};
  ASSERT_TRUE(store->PutAttachment(TestRef(1), 0, 32, summary).ok());  // one more page
  ASSERT_TRUE(store->Release(TestRef(1), absl::Hours(1)).ok());
  ASSERT_EQ(store->pool().free_pages(), 3u);

  // 8 pages for the new sequence: 5 short, so the cached one is thinned (8 pages freed).
  ASSERT_TRUE(store->CreateSequence(TestRef(2), kShape, 16, absl::ZeroDuration()).ok());
  auto info = store->GetSequence(TestRef(1));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->thinned_pages, 8u);
  EXPECT_EQ(info->pages, 9u);        // 4 row pages per head and the attachment's
  EXPECT_EQ(info->intact_rows, 4u);  // head 0's first hole is page 1
  EXPECT_EQ(info->committed_rows[0], 32u);
  EXPECT_EQ(store->pool().free_pages(), 3u);
  StoreStats stats = store->Stats();
  EXPECT_EQ(stats.evictions_thinned, 1u);
  EXPECT_EQ(stats.thinned_pages, 8u);
  EXPECT_EQ(stats.evictions_cached_lru, 0u);
  EXPECT_EQ(stats.evictions, 0u);

  // Kept: head 0 pages 0, 2, 5, 7; head 1 pages 0, 1, 6, 7.
  for (uint64_t page : {0, 2, 5, 7}) EXPECT_TRUE(ReadRange(*store, 1, 0, page * 4, 4).ok());
  for (uint64_t page : {0, 1, 6, 7}) EXPECT_TRUE(ReadRange(*store, 1, 1, page * 4, 4).ok());
  for (uint64_t page : {1, 3, 4, 6}) {
    absl::Status st = ReadRange(*store, 1, 0, page * 4 + 1, 2);
    EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
    EXPECT_THAT(st.message(), HasSubstr("thinned"));
  }
  absl::Status st = ReadRange(*store, 1, 1, 0, 32);  // spans head 1's holes at pages 2..5
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("row 8 of sequence 1 layer 0 head 1"));

  const std::vector<uint32_t> kept = {0, 8, 20, 28};
  const std::vector<uint32_t> mixed = {0, 13};
  std::vector<uint8_t> out(4 * kShape.RowBytes());
  const GatherEntry good{.sequence = TestRef(1), .layer = 0, .head = 0, .indices = kept};
  ASSERT_TRUE(store->Gather({&good, 1}, out).ok());
  float v0;
  std::memcpy(&v0, out.data() + 3 * kShape.RowBytes() + 16, sizeof(v0));
  EXPECT_EQ(v0, Value(0, 28, 0));
  const GatherEntry bad{.sequence = TestRef(1), .layer = 0, .head = 0, .indices = mixed};
  st = store->Gather({&bad, 1}, std::span(out).first(2 * kShape.RowBytes()));
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("row 13 of sequence 1"));

  const RangeEntry hole{.sequence = TestRef(1), .layer = 0, .head = 0, .start = 4, .n_rows = 4};
  EXPECT_TRUE(absl::IsFailedPrecondition(store->LocateRange(hole).status()));
  const RangeEntry whole{.sequence = TestRef(1), .layer = 0, .head = 0, .start = 8, .n_rows = 4};
  EXPECT_TRUE(store->LocateRange(whole).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(store->ReservePageTable(TestRef(1), 0).status()));

  auto attachment = store->GetAttachment(TestRef(1), 0);
  ASSERT_TRUE(attachment.ok()) << attachment.status();
  EXPECT_EQ(attachment->bytes, summary);
  EXPECT_EQ(attachment->rows, 32u);

  // A fork past the first hole is refused; one within the whole rows shares them.
  st = store->ForkSequence(TestRef(3), TestRef(1), 32, 0, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("only rows [0, 4) are whole"));
  EXPECT_FALSE(store->GetSequence(TestRef(3)).ok());
  EXPECT_EQ(store->pool().free_pages(), 3u);  // nothing leaked by the refused fork
  auto forked = store->ForkSequence(TestRef(3), TestRef(1), 4, 0, absl::ZeroDuration());
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(forked->rows, 4u);
  EXPECT_TRUE(ReadRange(*store, 3, 0, 0, 4).ok());
  EXPECT_TRUE(ReadRange(*store, 3, 1, 0, 4).ok());
}

// Thinning goes least recently used first, one sequence at a time as far as the shortfall
// needs; a sequence is thinned once; when every cached one is thinned, whole ones go LRU.
TEST(ThinningTest, ThinsLeastRecentlyUsedFirstThenEvictsWhole) {
  auto store = MakeStore(36, CachedEviction::kThin);
  WriteSequence(*store, 1, 32);
  WriteSequence(*store, 2, 32);
  ASSERT_TRUE(store->Release(TestRef(1), absl::Hours(1)).ok());
  ASSERT_TRUE(store->Release(TestRef(2), absl::Hours(1)).ok());  // 2 is the more recent
  ASSERT_EQ(store->pool().free_pages(), 4u);

  ASSERT_TRUE(store->CreateSequence(TestRef(3), kShape, 16, absl::ZeroDuration()).ok());  // 8
  EXPECT_EQ(store->GetSequence(TestRef(1))->thinned_pages, 8u);
  EXPECT_EQ(store->GetSequence(TestRef(2))->thinned_pages, 0u);
  EXPECT_TRUE(ReadRange(*store, 2, 0, 0, 32).ok());

  ASSERT_TRUE(store->CreateSequence(TestRef(4), kShape, 24, absl::ZeroDuration()).ok());  // 12
  EXPECT_EQ(store->GetSequence(TestRef(2))->thinned_pages, 8u);
  EXPECT_EQ(store->Stats().evictions_thinned, 2u);
  EXPECT_EQ(store->Stats().evictions_cached_lru, 0u);

  // Nothing left to thin: sequence 1, least recently used, goes whole.
  ASSERT_TRUE(store->CreateSequence(TestRef(5), kShape, 16, absl::ZeroDuration()).ok());  // 8
  EXPECT_FALSE(store->GetSequence(TestRef(1)).ok());
  EXPECT_TRUE(store->GetSequence(TestRef(2)).ok());
  const StoreStats stats = store->Stats();
  EXPECT_EQ(stats.evictions_thinned, 2u);
  EXPECT_EQ(stats.thinned_pages, 16u);
  EXPECT_EQ(stats.evictions_cached_lru, 1u);
}

// Pages a fork shares are never thinned: the child reads every row it shares afterwards.
TEST(ThinningTest, SharedPagesStay) {
  auto store = MakeStore(20, CachedEviction::kThin);
  WriteSequence(*store, 1, 32, /*uniform=*/true);
  // The child shares pages 0..3 of both heads.
  ASSERT_TRUE(store->ForkSequence(TestRef(9), TestRef(1), 16, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->Release(TestRef(1), absl::Hours(1)).ok());
  ASSERT_EQ(store->pool().shared_pages(), 8u);

  ASSERT_TRUE(store->CreateSequence(TestRef(2), kShape, 16, absl::ZeroDuration()).ok());
  // Candidates per head: pages 1..6 of which 1..3 are shared; 4..6 go.
  EXPECT_EQ(store->GetSequence(TestRef(1))->thinned_pages, 6u);
  EXPECT_EQ(store->GetSequence(TestRef(1))->intact_rows, 16u);
  EXPECT_EQ(store->pool().shared_pages(), 8u);
  EXPECT_TRUE(ReadRange(*store, 9, 0, 0, 16).ok());
  EXPECT_TRUE(ReadRange(*store, 9, 1, 0, 16).ok());
  EXPECT_TRUE(ReadRange(*store, 1, 0, 0, 16).ok());
  EXPECT_TRUE(ReadRange(*store, 1, 0, 28, 4).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(ReadRange(*store, 1, 0, 16, 4)));
  // Releasing the child and then the parent gives every page back.
  ASSERT_TRUE(store->Release(TestRef(9), absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->Release(TestRef(1), absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->Release(TestRef(2), absl::ZeroDuration()).ok());
  EXPECT_EQ(store->pool().free_pages(), 20u);
  EXPECT_EQ(store->pool().refcount_errors(), 0u);
}

// The default policy evicts whole sequences and never thins; an unthinned sequence reports
// its fewest committed rows as intact.
TEST(ThinningTest, LruPolicyNeverThins) {
  auto store = MakeStore(20, CachedEviction::kLru);
  WriteSequence(*store, 1, 32);
  EXPECT_EQ(store->GetSequence(TestRef(1))->intact_rows, 32u);
  ASSERT_TRUE(store->Release(TestRef(1), absl::Hours(1)).ok());
  ASSERT_TRUE(store->CreateSequence(TestRef(2), kShape, 16, absl::ZeroDuration()).ok());
  EXPECT_FALSE(store->GetSequence(TestRef(1)).ok());
  EXPECT_EQ(store->Stats().evictions_thinned, 0u);
  EXPECT_EQ(store->Stats().evictions_cached_lru, 1u);
}

}  // namespace
}  // namespace kvr::kv_store::testing
