// PagedKvStore::ReservePageTable and the pool's shareable memory (local_pool.h): the page
// table's addresses must hold exactly the rows that RangeRead returns, also for rows written
// after the table was made.

#include <cstring>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

// In the test helpers' namespace (test_pattern.h, store_test_util.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

// 64-byte rows in 1 KiB pages: 16 rows per page.
constexpr SequenceShape kShape{
    .n_layers = 2, .n_kv_heads = 3, .head_dim = 16, .dtype = DType::kF16};
constexpr uint64_t kPageBytes = 1024;
constexpr uint32_t kRowsPerPage = 16;

std::unique_ptr<PagedKvStore> MakeStore(uint64_t pages) {
  return MakeTestStore({.pool = {.capacity_bytes = pages * kPageBytes, .page_bytes = kPageBytes}});
}

absl::StatusOr<uint64_t> WritePattern(PagedKvStore& store, SequenceId seq, uint32_t layer,
                                      uint64_t start, uint32_t n) {
  return WritePatternRows(store, kShape, seq, layer, start, n, seq);
}

// Every committed row of every (layer, head), read at the table's address in `base`, equals
// what RangeRead returns (and the pattern that was written).
void ExpectTableMatchesRangeRead(const PagedKvStore& store, const PageTable& table,
                                 const uint8_t* base, SequenceId seq) {
  const size_t row_bytes = kShape.RowBytes();
  auto info = store.GetSequence(TestRef(seq));
  ASSERT_TRUE(info.ok());
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    const uint64_t rows = info->committed_rows[layer];
    ASSERT_LE(rows, uint64_t{table.pages_per_head} * table.tokens_per_page);
    for (uint32_t head = 0; head < kShape.n_kv_heads; ++head) {
      std::vector<uint8_t> expected(rows * row_bytes);
      const RangeEntry range{
          .sequence = TestRef(seq), .layer = layer, .head = head, .start = 0, .n_rows = rows};
      ASSERT_TRUE(store.RangeRead({&range, 1}, expected).ok());
      for (uint64_t r = 0; r < rows; ++r) {
        const uint8_t* at = base + table.RowOffset(layer, head, r);
        ASSERT_EQ(std::memcmp(at, expected.data() + r * row_bytes, row_bytes), 0)
            << "layer " << layer << " head " << head << " row " << r;
        ASSERT_TRUE(RowMatches(kShape, seq, layer, head, r, at));
      }
    }
  }
}

TEST(PageTableTest, ReservesDensePagesForEveryHead) {
  auto store = MakeStore(64);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  auto table = store->ReservePageTable(TestRef(1), 40);  // 3 pages per (layer, head)
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->shape, kShape);
  EXPECT_EQ(table->tokens_per_page, kRowsPerPage);
  EXPECT_EQ(table->page_bytes, kPageBytes);
  EXPECT_EQ(table->pages_per_head, 3u);
  EXPECT_EQ(table->committed_rows, std::vector<uint64_t>({0, 0}));
  ASSERT_EQ(table->pages.size(), 2u * 3u * 3u);
  EXPECT_EQ(std::set<PageId>(table->pages.begin(), table->pages.end()).size(), 18u);
  for (PageId p : table->pages) EXPECT_LT(p, 64u);
  EXPECT_EQ(store->Stats().free_pages, 64u - 18u);
  EXPECT_EQ(store->GetSequence(TestRef(1))->pages, 18u);
}

TEST(PageTableTest, GrowthIsIdempotentAndKeepsEarlierPages) {
  auto store = MakeStore(64);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  auto first = store->ReservePageTable(TestRef(1), 40);
  ASSERT_TRUE(first.ok());
  // Same or fewer rows: the same table, nothing allocated.
  for (uint64_t rows : {40, 48, 1, 0}) {
    auto again = store->ReservePageTable(TestRef(1), rows);
    ASSERT_TRUE(again.ok()) << rows;
    EXPECT_EQ(again->pages, first->pages) << rows;
    EXPECT_EQ(again->pages_per_head, 3u) << rows;
  }
  EXPECT_EQ(store->Stats().free_pages, 64u - 18u);
  // More rows: one more page per list, appended; the earlier pages stay where they were.
  auto grown = store->ReservePageTable(TestRef(1), 49);
  ASSERT_TRUE(grown.ok());
  ASSERT_EQ(grown->pages_per_head, 4u);
  EXPECT_EQ(store->Stats().free_pages, 64u - 24u);
  for (size_t list = 0; list < 6; ++list) {
    for (size_t p = 0; p < 3; ++p) {
      EXPECT_EQ(grown->pages[list * 4 + p], first->pages[list * 3 + p]) << list << " " << p;
    }
  }
}

TEST(PageTableTest, RowsWrittenLaterLandInTheReservedPages) {
  auto store = MakeStore(64);
  ASSERT_TRUE(store->CreateSequence(TestRef(3), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(WritePattern(*store, 3, 0, 0, 5).ok());  // before the table
  auto table = store->ReservePageTable(TestRef(3), 45);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->committed_rows, std::vector<uint64_t>({5, 0}));
  const uint64_t free_after_reserve = store->Stats().free_pages;
  // Uneven writes crossing page boundaries, explicit start and kAtEnd appends (decode).
  ASSERT_TRUE(WritePattern(*store, 3, 0, 5, 20).ok());
  ASSERT_TRUE(WritePattern(*store, 3, 1, 0, 17).ok());
  for (uint64_t r = 25; r < 45; ++r) {
    auto rows = MakePatternRows(kShape, 3, 0, r, 1);
    ASSERT_TRUE(store
                    ->Write({.sequence = TestRef(3),
                             .layer = 0,
                             .start_row = LayerRows::kAtEnd,
                             .n_rows = 1,
                             .k = rows.k,
                             .v = rows.v})
                    .ok());
  }
  ASSERT_TRUE(WritePattern(*store, 3, 1, 17, 28).ok());
  EXPECT_EQ(store->Stats().free_pages, free_after_reserve);  // no page was added
  ExpectTableMatchesRangeRead(*store, *table, store->pool().base(), 3);
  // The same through a second, read-only mapping of the pool's memfd (what a decode node on
  // the store's host gets).
  auto mapping = LocalPoolMapping::Map(store->pool().fd(), store->pool().mapped_bytes(), kPageBytes,
                                       store->pool().pool_id());
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  EXPECT_NE(mapping->base(), store->pool().base());
  ExpectTableMatchesRangeRead(*store, *table, mapping->base(), 3);
  EXPECT_TRUE(RowMatches(kShape, 3, 1, 2, 44, mapping->Row(*table, 1, 2, 44)));
  // A layer's rows as a model's cache holds them: token t's K of head h at [t, h * head_dim]
  // of `k`, its V likewise in `v`, each the matching half of the row RangeRead returns.
  {
    constexpr uint64_t kRows = 45;
    const size_t half = kShape.RowBytes() / 2, token = kShape.TokenHalfBytes();
    std::vector<uint8_t> k(kRows * token), v(kRows * token);
    ASSERT_TRUE(mapping
                    ->CopyLayerRows(*table, 1, kRows, std::as_writable_bytes(std::span(k)),
                                    std::as_writable_bytes(std::span(v)))
                    .ok());
    for (uint32_t head = 0; head < kShape.n_kv_heads; ++head) {
      std::vector<uint8_t> rows(kRows * kShape.RowBytes());
      const RangeEntry range{
          .sequence = TestRef(3), .layer = 1, .head = head, .start = 0, .n_rows = kRows};
      ASSERT_TRUE(store->RangeRead({&range, 1}, rows).ok());
      for (uint64_t r = 0; r < kRows; ++r) {
        const uint8_t* want = rows.data() + r * kShape.RowBytes();
        ASSERT_EQ(std::memcmp(k.data() + r * token + head * half, want, half), 0) << r;
        ASSERT_EQ(std::memcmp(v.data() + r * token + head * half, want + half, half), 0) << r;
      }
    }
    // Spans of the wrong size, and rows past the table's pages, are refused.
    EXPECT_EQ(
        mapping
            ->CopyLayerRows(*table, 1, kRows, std::as_writable_bytes(std::span(k).first(token)),
                            std::as_writable_bytes(std::span(v)))
            .code(),
        absl::StatusCode::kInvalidArgument);
    std::vector<uint8_t> big(1000 * token);
    EXPECT_EQ(mapping
                  ->CopyLayerRows(*table, 1, 1000, std::as_writable_bytes(std::span(big)),
                                  std::as_writable_bytes(std::span(big)))
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  // A view larger than the file is refused.
  EXPECT_FALSE(LocalPoolMapping::Map(store->pool().fd(), store->pool().mapped_bytes() + 4096,
                                     kPageBytes, store->pool().pool_id())
                   .ok());
}

TEST(PageTableTest, UnevenLayersAreEvenedOut) {
  auto store = MakeStore(64);
  ASSERT_TRUE(store->CreateSequence(TestRef(4), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(WritePattern(*store, 4, 0, 0, 40).ok());  // layer 0: 3 pages per head, layer 1: 0
  auto table = store->ReservePageTable(TestRef(4), 0);
  ASSERT_TRUE(table.ok());
  EXPECT_EQ(table->pages_per_head, 3u);
  EXPECT_EQ(store->GetSequence(TestRef(4))->pages, 18u);
  ExpectTableMatchesRangeRead(*store, *table, store->pool().base(), 4);
}

TEST(PageTableTest, ShortfallAllocatesNothingAndNamesIt) {
  auto store = MakeStore(30);
  ASSERT_TRUE(store->CreateSequence(TestRef(5), kShape, 16, absl::ZeroDuration()).ok());  // 6 pages
  ASSERT_TRUE(
      store->CreateSequence(TestRef(9), kShape, 32, absl::ZeroDuration()).ok());  // 12 pages
  const uint64_t free_before = store->Stats().free_pages;
  ASSERT_EQ(free_before, 12u);
  // 4 pages per list = 24, 18 more than the 6 held; 12 free.
  auto table = store->ReservePageTable(TestRef(5), 64);
  EXPECT_TRUE(absl::IsResourceExhausted(table.status())) << table.status();
  EXPECT_THAT(table.status().message(), HasSubstr("sequence 5"));
  EXPECT_THAT(table.status().message(), HasSubstr("need 18432 bytes (18 pages), 12288 free"));
  EXPECT_EQ(store->Stats().free_pages, free_before);
  EXPECT_EQ(store->GetSequence(TestRef(5))->pages, 6u);
  // What fits still works afterwards.
  EXPECT_TRUE(store->ReservePageTable(TestRef(5), 48).ok());
  EXPECT_EQ(store->Stats().free_pages, 0u);
}

TEST(PageTableTest, HugeRowCountsAreRefusedWithoutOverflow) {
  auto store = MakeStore(64);
  ASSERT_TRUE(store->CreateSequence(TestRef(6), kShape, 0, absl::ZeroDuration()).ok());
  for (uint64_t rows : {~uint64_t{0}, uint64_t{1} << 63, (uint64_t{1} << 32) * kRowsPerPage,
                        uint64_t{64} * kRowsPerPage}) {
    auto table = store->ReservePageTable(TestRef(6), rows);
    EXPECT_TRUE(absl::IsResourceExhausted(table.status())) << rows << ": " << table.status();
    EXPECT_THAT(table.status().message(), HasSubstr("more than the store's 64 pages"));
  }
  EXPECT_EQ(store->Stats().free_pages, 64u);
  EXPECT_EQ(store->GetSequence(TestRef(6))->pages, 0u);
}

TEST(PageTableTest, UnknownAndKeptSequences) {
  auto store = MakeStore(64);
  EXPECT_TRUE(absl::IsPermissionDenied(store->ReservePageTable(TestRef(99), 10).status()));
  ASSERT_TRUE(store->CreateSequence(TestRef(7), kShape, 16, absl::ZeroDuration()).ok());
  ASSERT_TRUE(WritePattern(*store, 7, 0, 0, 10).ok());
  ASSERT_TRUE(WritePattern(*store, 7, 1, 0, 10).ok());
  ASSERT_TRUE(store->Release(TestRef(7), absl::Seconds(60)).ok());
  // A kept sequence is read-only: its table can be read, not grown.
  auto table = store->ReservePageTable(TestRef(7), 16);
  ASSERT_TRUE(table.ok()) << table.status();
  ExpectTableMatchesRangeRead(*store, *table, store->pool().base(), 7);
  EXPECT_TRUE(absl::IsFailedPrecondition(store->ReservePageTable(TestRef(7), 17).status()));
  ASSERT_TRUE(store->Release(TestRef(7), absl::ZeroDuration()).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(store->ReservePageTable(TestRef(7), 0).status()));
}

}  // namespace
}  // namespace kvr::kv_store::testing
