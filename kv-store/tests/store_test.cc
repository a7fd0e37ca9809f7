#include "kvr/kv_store/store.h"

#include <atomic>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

// In the test helpers' namespace (test_pattern.h, store_test_util.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

constexpr SequenceShape kShape{.n_layers = 3, .n_kv_heads = 2, .head_dim = 8,
                               .dtype = DType::kF16};  // 32-byte rows

std::unique_ptr<PagedKvStore> MakeStore(uint64_t capacity, uint64_t page_bytes = 256,
                                        bool evict = false,
                                        std::function<absl::Time()> now = nullptr,
                                        bool evict_cached = true) {
  StoreOptions options{.pool = {.capacity_bytes = capacity, .page_bytes = page_bytes},
                       .evict_expired = evict,
                       .evict_cached = evict_cached};
  if (now) options.now = std::move(now);
  return MakeTestStore(std::move(options));
}

absl::StatusOr<uint64_t> WritePattern(PagedKvStore& store, const SequenceShape& shape,
                                      SequenceId seq, uint32_t layer, uint64_t start, uint32_t n) {
  return WritePatternRows(store, shape, seq, layer, start, n, seq);
}

TEST(StoreTest, WrittenRowsReadBackBitExactByGatherAndRange) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBf16}) {
    SequenceShape shape = kShape;
    shape.dtype = dtype;
    auto store = MakeStore(1 << 20);
    ASSERT_TRUE(store->CreateSequence(TestRef(7), shape, 0, absl::ZeroDuration()).ok());
    // 100 rows in uneven writes, crossing page boundaries (256 B pages hold 8 or 4 rows).
    for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
      ASSERT_EQ(*WritePattern(*store, shape, 7, layer, 0, 37), 37u);
      ASSERT_EQ(*WritePattern(*store, shape, 7, layer, 37, 1), 38u);
      ASSERT_EQ(*WritePattern(*store, shape, 7, layer, 38, 62), 100u);
    }
    const std::vector<uint32_t> idx_a = {99, 0, 5, 5, 63, 38};
    const std::vector<uint32_t> idx_b = {1, 2, 3};
    const std::vector<GatherEntry> entries = {
        {.sequence = TestRef(7), .layer = 2, .head = 1, .indices = idx_a},
        {.sequence = TestRef(7), .layer = 0, .head = 0, .indices = idx_b}};
    auto bytes = store->GatherBytes(entries);
    ASSERT_TRUE(bytes.ok());
    ASSERT_EQ(*bytes, 9 * shape.RowBytes());
    std::vector<uint8_t> out(*bytes);
    ASSERT_TRUE(store->Gather(entries, out).ok());
    const uint8_t* p = out.data();
    for (const GatherEntry& e : entries) {
      for (uint32_t i : e.indices) {
        EXPECT_TRUE(RowMatches(shape, 7, e.layer, e.head, i, p)) << "row " << i;
        p += shape.RowBytes();
      }
    }
    const std::vector<RangeEntry> ranges = {
        {.sequence = TestRef(7), .layer = 1, .head = 1, .start = 3, .n_rows = 90}};
    std::vector<uint8_t> range_out(*store->RangeBytes(ranges));
    ASSERT_EQ(range_out.size(), 90 * shape.RowBytes());
    ASSERT_TRUE(store->RangeRead(ranges, range_out).ok());
    for (uint64_t r = 0; r < 90; ++r) {
      EXPECT_TRUE(RowMatches(shape, 7, 1, 1, 3 + r, range_out.data() + r * shape.RowBytes()));
    }
    // The located segments cover exactly the range's bytes, in order.
    auto segments = store->LocateRange(ranges[0]);
    ASSERT_TRUE(segments.ok());
    std::vector<uint8_t> via_segments;
    for (const auto& s : *segments) {
      const uint8_t* src = store->pool().base() + s.pool_offset;
      via_segments.insert(via_segments.end(), src, src + s.bytes);
    }
    EXPECT_EQ(via_segments, range_out);
  }
}

TEST(StoreTest, AppendAtEndAndAppendOnlyErrors) {
  auto store = MakeStore(1 << 20);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  auto rows = MakePatternRows(kShape, 1, 0, 0, 4);
  ASSERT_EQ(*store->Write({.sequence = TestRef(1),
                           .layer = 0,
                           .start_row = LayerRows::kAtEnd,
                           .n_rows = 4,
                           .k = rows.k,
                           .v = rows.v}),
            4u);
  auto more = MakePatternRows(kShape, 1, 0, 4, 1);
  ASSERT_EQ(*store->Write({.sequence = TestRef(1),
                           .layer = 0,
                           .start_row = LayerRows::kAtEnd,
                           .n_rows = 1,
                           .k = more.k,
                           .v = more.v}),
            5u);
  // Overwriting and leaving a gap are both refused.
  absl::Status overwrite = WritePattern(*store, kShape, 1, 0, 2, 1).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(overwrite)) << overwrite;
  EXPECT_THAT(overwrite.message(), HasSubstr("append-only"));
  EXPECT_TRUE(absl::IsFailedPrecondition(WritePattern(*store, kShape, 1, 0, 9, 1).status()));
  auto info = store->GetSequence(TestRef(1));
  ASSERT_TRUE(info.ok());
  EXPECT_THAT(info->committed_rows, ::testing::ElementsAre(5, 0, 0));
}

TEST(StoreTest, MalformedRequestsGetClearErrors) {
  auto store = MakeStore(1 << 20);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(WritePattern(*store, kShape, 1, 0, 0, 10).ok());
  std::vector<uint8_t> out(1 << 12);

  const std::vector<uint32_t> ok_idx = {0};
  const std::vector<uint32_t> bad_idx = {3, 10};
  auto gather_status = [&](std::vector<GatherEntry> e) { return store->GatherBytes(e).status(); };
  absl::Status st =
      gather_status({{.sequence = TestRef(2), .layer = 0, .head = 0, .indices = ok_idx}});
  EXPECT_TRUE(absl::IsPermissionDenied(st));
  EXPECT_THAT(st.message(), HasSubstr("entry 0: no sequence 2 with this capability"));
  st = gather_status({{.sequence = TestRef(1), .layer = 3, .head = 0, .indices = ok_idx}});
  EXPECT_TRUE(absl::IsOutOfRange(st));
  EXPECT_THAT(st.message(), HasSubstr("layer 3"));
  st = gather_status({{.sequence = TestRef(1), .layer = 0, .head = 2, .indices = ok_idx}});
  EXPECT_THAT(st.message(), HasSubstr("kv head 2"));
  st = gather_status({{.sequence = TestRef(1), .layer = 0, .head = 0, .indices = ok_idx},
                      {.sequence = TestRef(1), .layer = 0, .head = 0, .indices = bad_idx}});
  EXPECT_TRUE(absl::IsOutOfRange(st));
  EXPECT_THAT(st.message(), HasSubstr("entry 1: row 10"));
  EXPECT_THAT(st.message(), HasSubstr("10 committed rows"));
  // Gather itself validates too, and refuses a wrong-sized buffer.
  std::vector<GatherEntry> bad = {
      {.sequence = TestRef(1), .layer = 0, .head = 0, .indices = bad_idx}};
  EXPECT_TRUE(absl::IsOutOfRange(store->Gather(bad, out)));
  std::vector<GatherEntry> good = {
      {.sequence = TestRef(1), .layer = 0, .head = 0, .indices = ok_idx}};
  EXPECT_TRUE(absl::IsInvalidArgument(store->Gather(good, out)));
  std::vector<RangeEntry> range = {
      {.sequence = TestRef(1), .layer = 0, .head = 0, .start = 5, .n_rows = 6}};
  EXPECT_TRUE(absl::IsOutOfRange(store->RangeBytes(range).status()));

  // Wrong row size in a write.
  std::vector<uint8_t> k(31), v(31);
  st =
      store
          ->Write({.sequence = TestRef(1), .layer = 1, .start_row = 0, .n_rows = 1, .k = k, .v = v})
          .status();
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_THAT(st.message(), HasSubstr("need 32 bytes"));
  // Bad shapes at creation.
  EXPECT_TRUE(absl::IsInvalidArgument(
      store
          ->CreateSequence(TestRef(9), {.n_layers = 0, .n_kv_heads = 1, .head_dim = 8}, 0,
                           absl::ZeroDuration())
          .status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      store
          ->CreateSequence(TestRef(9),
                           {.n_layers = 1,
                            .n_kv_heads = 1,
                            .head_dim = 128,
                            .dtype = DType::kF32},  // 1 KiB rows > 256 B pages
                           0, absl::ZeroDuration())
          .status()));
  EXPECT_TRUE(absl::IsAlreadyExists(
      store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).status()));
  // After all of that the store still serves a valid request.
  std::vector<uint8_t> row(kShape.RowBytes());
  ASSERT_TRUE(store->Gather(good, row).ok());
  EXPECT_TRUE(RowMatches(kShape, 1, 0, 0, 0, row.data()));
}

TEST(StoreTest, ReleaseFreesEveryPage) {
  auto store = MakeStore(1 << 20);
  const StoreStats baseline = store->Stats();
  EXPECT_EQ(baseline.used_bytes, 0u);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 64, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->CreateSequence(TestRef(2), kShape, 0, absl::ZeroDuration()).ok());
  for (uint32_t layer = 0; layer < 3; ++layer) {
    ASSERT_TRUE(WritePattern(*store, kShape, 1, layer, 0, 100).ok());
    ASSERT_TRUE(WritePattern(*store, kShape, 2, layer, 0, 9).ok());
  }
  StoreStats during = store->Stats();
  EXPECT_EQ(during.sequences, 2u);
  // 100 rows of 32 B in 256 B pages = 13 pages per (layer, head) for sequence 1, 2 for seq 2.
  EXPECT_EQ(during.total_pages - during.free_pages, 3u * 2 * 13 + 3u * 2 * 2);
  ASSERT_TRUE(store->Release(TestRef(1), absl::ZeroDuration()).ok());
  ASSERT_TRUE(store->Release(TestRef(2), absl::ZeroDuration()).ok());
  StoreStats after = store->Stats();
  EXPECT_EQ(after.free_pages, baseline.free_pages);
  EXPECT_EQ(after.used_bytes, baseline.used_bytes);
  EXPECT_EQ(after.sequences, 0u);
  EXPECT_TRUE(absl::IsPermissionDenied(store->Release(TestRef(1), absl::ZeroDuration())));
}

TEST(StoreTest, FullStoreRefusesNamingShortfallAndLosesNothing) {
  auto store = MakeStore(16 * 256);  // 16 pages of 8 rows
  ASSERT_TRUE(store
                  ->CreateSequence(TestRef(1), {.n_layers = 1, .n_kv_heads = 2, .head_dim = 8}, 0,
                                   absl::ZeroDuration())
                  .ok());
  const SequenceShape shape{.n_layers = 1, .n_kv_heads = 2, .head_dim = 8};
  ASSERT_TRUE(WritePattern(*store, shape, 1, 0, 0, 56).ok());  // 7 pages x 2 heads
  absl::Status st = WritePattern(*store, shape, 1, 0, 56, 17).status();  // needs 3 x 2 pages
  ASSERT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("need 1536 bytes"));
  EXPECT_THAT(st.message(), HasSubstr("512 free of 4096"));
  // A create whose reservation does not fit is refused as well.
  EXPECT_TRUE(absl::IsResourceExhausted(
      store->CreateSequence(TestRef(2), shape, 100, absl::ZeroDuration()).status()));
  EXPECT_TRUE(absl::IsResourceExhausted(
      store->CreateSequence(TestRef(3), shape, 1000, absl::ZeroDuration()).status()));
  // Nothing stored was lost and the failed write left no trace.
  auto info = store->GetSequence(TestRef(1));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->committed_rows[0], 56u);
  std::vector<uint8_t> out(56 * shape.RowBytes());
  for (uint32_t head = 0; head < 2; ++head) {
    std::vector<RangeEntry> r = {
        {.sequence = TestRef(1), .layer = 0, .head = head, .start = 0, .n_rows = 56}};
    ASSERT_TRUE(store->RangeRead(r, out).ok());
    for (uint64_t row = 0; row < 56; ++row) {
      ASSERT_TRUE(RowMatches(shape, 1, 0, head, row, out.data() + row * shape.RowBytes()));
    }
  }
  EXPECT_EQ(store->Stats().free_pages, 2u);
  // A write that fits still succeeds.
  EXPECT_EQ(*WritePattern(*store, shape, 1, 0, 56, 8), 64u);
}

TEST(StoreTest, ExpiredLeasesAreEvictedOnlyWhenConfigured) {
  absl::Time now = absl::FromUnixSeconds(1000);
  auto clock = [&now] { return now; };
  const SequenceShape shape{.n_layers = 1, .n_kv_heads = 1, .head_dim = 8};
  for (bool evict : {false, true}) {
    // Without evicting cached sequences: sequence 2 (released, kept) must stay either way.
    auto store = MakeStore(4 * 256, 256, evict, clock, /*evict_cached=*/false);
    ASSERT_TRUE(store->CreateSequence(TestRef(1), shape, 16, absl::Seconds(5)).ok());     // 2 pages
    ASSERT_TRUE(store->CreateSequence(TestRef(2), shape, 8, absl::ZeroDuration()).ok());  // 1 page
    ASSERT_TRUE(store->CreateSequence(TestRef(3), shape, 0, absl::ZeroDuration()).ok());
    ASSERT_TRUE(store->Release(TestRef(2), absl::Seconds(60)).ok());  // kept for reuse, read-only
    EXPECT_TRUE(absl::IsFailedPrecondition(WritePattern(*store, shape, 2, 0, 0, 1).status()));
    now += absl::Seconds(10);  // sequence 1 expired, 2 still kept
    EXPECT_EQ(store->Stats().expired_sequences, 1u);
    // Sequence 3 needs 2 pages; 1 is free.
    absl::StatusOr<uint64_t> w = WritePattern(*store, shape, 3, 0, 0, 16);
    if (!evict) {
      EXPECT_TRUE(absl::IsResourceExhausted(w.status())) << w.status();
      EXPECT_TRUE(store->GetSequence(TestRef(1)).ok());
      EXPECT_EQ(store->Stats().evictions, 0u);
    } else {
      EXPECT_TRUE(w.ok()) << w.status();
      EXPECT_TRUE(absl::IsPermissionDenied(store->GetSequence(TestRef(1)).status()));
      EXPECT_TRUE(store->GetSequence(TestRef(2)).ok());  // unexpired lease survives
      EXPECT_EQ(store->Stats().evictions, 1u);
    }
    // KeepAlive pushes expiry out; sweeping then evicts nothing more.
    ASSERT_TRUE(store->Lease(TestRef(2), absl::Seconds(100)).ok());
    now += absl::Seconds(70);
    EXPECT_EQ(store->SweepExpired(), 0u);
    EXPECT_TRUE(store->GetSequence(TestRef(2)).ok());
    now += absl::Seconds(40);
    EXPECT_EQ(store->SweepExpired(), evict ? 1u : 0u);
  }
}

// A reader racing a writer sees each layer either not yet visible (OUT_OF_RANGE) or fully
// correct for every head: never half a layer.
TEST(StoreTest, ConcurrentReaderNeverSeesPartialLayer) {
  const SequenceShape shape{.n_layers = 8, .n_kv_heads = 4, .head_dim = 32,
                            .dtype = DType::kBf16};
  auto store = MakeStore(64 << 20, 64 << 10);
  constexpr uint32_t kRows = 512;
  constexpr int kRounds = 6;
  std::atomic<bool> done{false};
  std::atomic<uint64_t> seen_full{0}, seen_invisible{0}, bad{0};
  std::thread reader([&] {
    std::vector<uint32_t> idx(kRows);
    for (uint32_t i = 0; i < kRows; ++i) idx[i] = kRows - 1 - i;
    std::vector<uint8_t> out(size_t{kRows} * shape.n_kv_heads * shape.RowBytes());
    while (!done.load()) {
      for (SequenceId seq = 1; seq <= kRounds; ++seq) {
        for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
          std::vector<GatherEntry> entries;
          for (uint32_t h = 0; h < shape.n_kv_heads; ++h) {
            entries.push_back(
                {.sequence = TestRef(seq), .layer = layer, .head = h, .indices = idx});
          }
          absl::Status st = store->Gather(entries, out);
          if (absl::IsOutOfRange(st) || absl::IsPermissionDenied(st)) {
            ++seen_invisible;
            continue;
          }
          if (!st.ok()) {
            ++bad;
            continue;
          }
          const uint8_t* p = out.data();
          for (uint32_t h = 0; h < shape.n_kv_heads; ++h) {
            for (uint32_t i : idx) {
              if (!RowMatches(shape, seq, layer, h, i, p)) ++bad;
              p += shape.RowBytes();
            }
          }
          ++seen_full;
        }
      }
    }
  });
  for (SequenceId seq = 1; seq <= kRounds; ++seq) {
    ASSERT_TRUE(store->CreateSequence(TestRef(seq), shape, 0, absl::ZeroDuration()).ok());
    for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
      // Two writes per layer: the first leaves the layer half-written (rows 0..255), which the
      // reader's request for all 512 rows must not accept.
      ASSERT_TRUE(WritePattern(*store, shape, seq, layer, 0, kRows / 2).ok());
      ASSERT_TRUE(WritePattern(*store, shape, seq, layer, kRows / 2, kRows / 2).ok());
    }
  }
  // Let the reader see the finished state at least once.
  while (seen_full.load() < kRounds * shape.n_layers) std::this_thread::yield();
  done = true;
  reader.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(seen_full.load(), 0u);
}

}  // namespace
}  // namespace kvr::kv_store::testing
