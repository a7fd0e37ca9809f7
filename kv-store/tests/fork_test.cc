// PagedKvStore::ForkSequence: a child starts from a parent's rows, sharing its full pages and
// copying the partly covered last one; both go on appending into pages of their own; shared
// pages are counted once and come back exactly when the last holder lets go.

#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

// In the test helpers' namespace (test_pattern.h, store_test_util.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// 32-byte rows; 256-byte pages hold 8 of them.
constexpr SequenceShape kShape{.n_layers = 3, .n_kv_heads = 2, .head_dim = 8,
                               .dtype = DType::kF16};
constexpr uint64_t kLists = 3 * 2;

std::unique_ptr<PagedKvStore> MakeStore(uint64_t capacity, uint64_t page_bytes = 256) {
  return MakeTestStore(
      {.pool = {.capacity_bytes = capacity, .page_bytes = page_bytes, .try_huge_pages = false}});
}

// Writes rows [start, start + n) of `layer` of sequence `seq`, with the pattern of `pattern`.
absl::StatusOr<uint64_t> Append(PagedKvStore& store, SequenceId seq, uint32_t layer,
                                uint64_t start, uint32_t n, SequenceId pattern) {
  return WritePatternRows(store, kShape, seq, layer, start, n, pattern);
}

void AppendAllLayers(PagedKvStore& store, SequenceId seq, uint64_t start, uint32_t n,
                     SequenceId pattern) {
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_TRUE(Append(store, seq, layer, start, n, pattern).ok()) << "layer " << layer;
  }
}

// Reads every committed row of every (layer, head) of `seq` three ways (RangeRead, Gather in
// reverse order, the pool bytes LocateRange points at) and checks row r against the pattern
// of owner(r). Returns the number of rows checked.
uint64_t CheckRows(PagedKvStore& store, SequenceId seq,
                   const std::function<SequenceId(uint64_t)>& owner) {
  auto info = store.GetSequence(TestRef(seq));
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return 0;
  uint64_t checked = 0;
  const size_t row_bytes = kShape.RowBytes();
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    const uint64_t n = info->committed_rows[layer];
    if (n == 0) continue;
    for (uint32_t head = 0; head < kShape.n_kv_heads; ++head) {
      const RangeEntry range{
          .sequence = TestRef(seq), .layer = layer, .head = head, .start = 0, .n_rows = n};
      std::vector<uint8_t> by_range(n * row_bytes);
      EXPECT_TRUE(store.RangeRead({&range, 1}, by_range).ok());
      std::vector<uint32_t> idx(n);
      for (uint64_t r = 0; r < n; ++r) idx[r] = static_cast<uint32_t>(n - 1 - r);
      const GatherEntry gather{.sequence = TestRef(seq), .layer = layer, .head = head,
                               .indices = idx};
      std::vector<uint8_t> by_gather(n * row_bytes);
      EXPECT_TRUE(store.Gather({&gather, 1}, by_gather).ok());
      auto segments = store.LocateRange(range);
      EXPECT_TRUE(segments.ok()) << segments.status();
      std::vector<uint8_t> by_locate;
      for (const auto& s : *segments) {
        const uint8_t* src = store.pool().base() + s.pool_offset;
        by_locate.insert(by_locate.end(), src, src + s.bytes);
      }
      EXPECT_EQ(by_locate, by_range) << "seq " << seq << " layer " << layer << " head " << head;
      for (uint64_t r = 0; r < n; ++r) {
        EXPECT_TRUE(RowMatches(kShape, owner(r), layer, head, r, by_range.data() + r * row_bytes))
            << "seq " << seq << " layer " << layer << " head " << head << " row " << r;
        EXPECT_TRUE(RowMatches(kShape, owner(r), layer, head, r,
                               by_gather.data() + (n - 1 - r) * row_bytes))
            << "gather: seq " << seq << " layer " << layer << " head " << head << " row " << r;
        ++checked;
      }
    }
  }
  return checked;
}

uint64_t UsedPages(const PagedKvStore& store) {
  return store.pool().total_pages() - store.pool().free_pages();
}

// Parent 1 holds 40 rows per layer (5 full pages of 8). Each fork point is checked for the
// child's result, its rows, its appends and the parent's rows afterwards.
TEST(ForkTest, ForkAtBoundaryMidPageZeroAndPastTheEnd) {
  struct Case {
    uint64_t rows;
    uint64_t n;            // rows the child starts with
    uint64_t shared;       // per (layer, head)
    uint64_t fresh;        // per (layer, head): tail copy + reservation
    uint64_t expected_tokens;
  };
  const Case cases[] = {
      {.rows = 16, .n = 16, .shared = 2, .fresh = 0, .expected_tokens = 0},   // page boundary
      {.rows = 13, .n = 13, .shared = 1, .fresh = 1, .expected_tokens = 0},   // mid page
      {.rows = 0, .n = 0, .shared = 0, .fresh = 0, .expected_tokens = 0},     // nothing shared
      {.rows = 1000, .n = 40, .shared = 5, .fresh = 0, .expected_tokens = 0}, // clamped
      {.rows = 21, .n = 21, .shared = 2, .fresh = 4, .expected_tokens = 48},  // + reservation
      {.rows = 0, .n = 0, .shared = 0, .fresh = 2, .expected_tokens = 9},
  };
  SequenceId child = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " expected " << c.expected_tokens);
    auto store = MakeStore(1 << 20);
    ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
    AppendAllLayers(*store, 1, 0, 40, /*pattern=*/1);
    const uint64_t used_before = UsedPages(*store);
    ++child;
    auto fork = store->ForkSequence(TestRef(child), TestRef(1), c.rows, c.expected_tokens,
                                    absl::ZeroDuration());
    ASSERT_TRUE(fork.ok()) << fork.status();
    EXPECT_EQ(fork->rows, c.n);
    EXPECT_EQ(fork->tokens_per_page, 8u);
    EXPECT_EQ(fork->shared_pages, c.shared * kLists);
    EXPECT_EQ(fork->reserved_bytes, c.fresh * kLists * 256);
    EXPECT_EQ(UsedPages(*store) - used_before, c.fresh * kLists);
    EXPECT_EQ(store->Stats().shared_pages, c.shared * kLists);
    auto info = store->GetSequence(TestRef(child));
    ASSERT_TRUE(info.ok());
    EXPECT_THAT(info->committed_rows, ElementsAre(c.n, c.n, c.n));
    EXPECT_EQ(info->shape, kShape);
    EXPECT_FALSE(info->released_kept);
    EXPECT_EQ(CheckRows(*store, child, [](uint64_t) { return SequenceId{1}; }), c.n * kLists);

    // The child appends after n with its own pattern; the parent appends after 40.
    AppendAllLayers(*store, child, c.n, 19, /*pattern=*/child);
    AppendAllLayers(*store, 1, 40, 7, /*pattern=*/1);
    const uint64_t n = c.n;
    EXPECT_EQ(CheckRows(*store, child,
                        [&](uint64_t r) { return r < n ? SequenceId{1} : child; }),
              (n + 19) * kLists);
    EXPECT_EQ(CheckRows(*store, 1, [](uint64_t) { return SequenceId{1}; }), 47u * kLists);
    EXPECT_EQ(store->Stats().forks, 1u);
    EXPECT_EQ(store->Stats().forked_rows, c.n);
    EXPECT_EQ(store->pool().refcount_errors(), 0u);
  }
}

// The parent's layers hold different row counts (a prefill mid-way): n is the least.
TEST(ForkTest, RowsAreClampedToTheLeastCommittedLayer) {
  auto store = MakeStore(1 << 20);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(Append(*store, 1, 0, 0, 30, 1).ok());
  ASSERT_TRUE(Append(*store, 1, 1, 0, 27, 1).ok());
  ASSERT_TRUE(Append(*store, 1, 2, 0, 35, 1).ok());
  auto fork = store->ForkSequence(TestRef(2), TestRef(1), 1000, 0, absl::ZeroDuration());
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->rows, 27u);
  EXPECT_THAT(store->GetSequence(TestRef(2))->committed_rows, ElementsAre(27, 27, 27));
  EXPECT_EQ(CheckRows(*store, 2, [](uint64_t) { return SequenceId{1}; }), 27u * kLists);
}

// A released-and-kept parent can be forked though not written; the shared pages live on with
// whichever of the two goes last, in both orders, and then every page is free again.
TEST(ForkTest, PagesReturnToBaselineWhicheverGoesFirst) {
  for (bool parent_first : {true, false}) {
    SCOPED_TRACE(parent_first ? "parent released first" : "children released first");
    auto store = MakeStore(1 << 20);
    const uint64_t baseline = store->pool().free_pages();
    ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
    AppendAllLayers(*store, 1, 0, 29, 1);
    ASSERT_TRUE(store->Release(TestRef(1), absl::Minutes(5)).ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(Append(*store, 1, 0, 29, 1, 1).status()));
    ASSERT_TRUE(store->ForkSequence(TestRef(2), TestRef(1), 29, 64, absl::ZeroDuration()).ok());
    ASSERT_TRUE(store->ForkSequence(TestRef(3), TestRef(1), 24, 0, absl::ZeroDuration()).ok());
    // A fork of a fork shares pages that are already shared.
    ASSERT_TRUE(store->ForkSequence(TestRef(4), TestRef(3), 16, 0, absl::ZeroDuration()).ok());
    AppendAllLayers(*store, 2, 29, 40, 2);
    AppendAllLayers(*store, 4, 16, 3, 4);
    const std::vector<SequenceId> order =
        parent_first ? std::vector<SequenceId>{1, 3, 2, 4} : std::vector<SequenceId>{4, 2, 3, 1};
    for (SequenceId gone : order) {
      ASSERT_TRUE(store->Release(TestRef(gone), absl::ZeroDuration()).ok());
      // Whoever is left still reads its rows.
      if (store->GetSequence(TestRef(2)).ok()) {
        EXPECT_EQ(CheckRows(*store, 2, [](uint64_t r) { return r < 29 ? 1 : 2; }), 69u * kLists);
      }
      if (store->GetSequence(TestRef(3)).ok()) {
        EXPECT_EQ(CheckRows(*store, 3, [](uint64_t) { return 1; }), 24u * kLists);
      }
      if (store->GetSequence(TestRef(4)).ok()) {
        EXPECT_EQ(CheckRows(*store, 4, [](uint64_t r) { return r < 16 ? 1 : 4; }), 19u * kLists);
      }
    }
    EXPECT_EQ(store->pool().free_pages(), baseline);
    EXPECT_EQ(store->Stats().shared_pages, 0u);
    EXPECT_EQ(store->pool().refcount_errors(), 0u);
  }
}

// Ten forks of a 2K-row parent cost the parent's pages once plus one tail page per (layer,
// head) each, not ten copies.
TEST(ForkTest, SharedPagesAreCountedOnce) {
  // 1 KiB pages: 32 rows each; 2048 rows = 64 pages per (layer, head), 384 in all.
  auto store = MakeStore(4 << 20, 1024);
  const uint64_t baseline = store->pool().free_pages();
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  AppendAllLayers(*store, 1, 0, 2048, 1);
  ASSERT_EQ(baseline - store->pool().free_pages(), 64u * kLists);
  for (SequenceId c = 10; c < 20; ++c) {
    auto fork = store->ForkSequence(TestRef(c), TestRef(1), 2043, 0, absl::ZeroDuration());
    ASSERT_TRUE(fork.ok()) << fork.status();
    EXPECT_EQ(fork->shared_pages, 63u * kLists);
    EXPECT_EQ(fork->reserved_bytes, kLists * 1024);
  }
  EXPECT_EQ(baseline - store->pool().free_pages(), 64u * kLists + 10 * kLists);
  const StoreStats stats = store->Stats();
  EXPECT_EQ(stats.shared_pages, 63u * kLists);
  EXPECT_EQ(stats.forks, 10u);
  EXPECT_EQ(stats.forked_rows, 10u * 2043);
  EXPECT_EQ(stats.sequences, 11u);
  EXPECT_EQ(CheckRows(*store, 17, [](uint64_t) { return 1; }), 2043u * kLists);
  for (SequenceId c = 10; c < 20; ++c) {
    ASSERT_TRUE(store->Release(TestRef(c), absl::ZeroDuration()).ok());
  }
  EXPECT_EQ(baseline - store->pool().free_pages(), 64u * kLists);
  ASSERT_TRUE(store->Release(TestRef(1), absl::ZeroDuration()).ok());
  EXPECT_EQ(store->pool().free_pages(), baseline);
  EXPECT_EQ(store->pool().refcount_errors(), 0u);
}

// cached_bytes counts only the pages that evicting every cached sequence would free: a cached
// parent's pages that a live child shares are not among them.
TEST(ForkTest, CachedBytesAreThePagesOnlyCachedSequencesHold) {
  auto store = MakeStore(4 << 20, 1024);  // 32 rows per page
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  AppendAllLayers(*store, 1, 0, 256, 1);  // 8 pages per (layer, head)
  EXPECT_EQ(store->Stats().cached_bytes, 0u);
  ASSERT_TRUE(store->Release(TestRef(1), absl::Minutes(1)).ok());
  StoreStats stats = store->Stats();
  EXPECT_EQ(stats.cached_sequences, 1u);
  EXPECT_EQ(stats.cached_bytes, 8u * kLists * 1024);
  // A live child shares the first 5 pages of each list (160 rows).
  ASSERT_TRUE(store->ForkSequence(TestRef(2), TestRef(1), 160, 0, absl::ZeroDuration()).ok());
  stats = store->Stats();
  EXPECT_EQ(stats.cached_sequences, 1u);
  EXPECT_EQ(stats.cached_bytes, 3u * kLists * 1024);
  // Released and kept too: every page is reclaimable again, each counted once.
  ASSERT_TRUE(store->Release(TestRef(2), absl::Minutes(1)).ok());
  stats = store->Stats();
  EXPECT_EQ(stats.cached_sequences, 2u);
  EXPECT_EQ(stats.cached_bytes, stats.used_bytes);
}

// A live parent keeps appending (and forking stays consistent) while children are forked
// from it: every child sees exactly the parent's rows below its n, whatever n it got.
TEST(ForkTest, LiveParentKeepsAppendingWhileForked) {
  auto store = MakeStore(8 << 20);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  AppendAllLayers(*store, 1, 0, 5, 1);
  std::atomic<bool> stop{false};
  std::atomic<bool> writer_done{false};
  std::atomic<uint64_t> write_errors{0};
  std::thread writer([&] {
    for (uint64_t at = 5; !stop.load() && at < 2000; ++at) {
      for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
        if (!Append(*store, 1, layer, at, 1, 1).ok()) ++write_errors;
      }
    }
    writer_done = true;
  });
  while (store->GetSequence(TestRef(1))->committed_rows[2] == 5) std::this_thread::yield();
  uint64_t last_n = 0;
  for (SequenceId c = 10; c < 210 && (c < 30 || !writer_done.load()); ++c) {
    auto fork = store->ForkSequence(TestRef(c), TestRef(1), ~uint64_t{0}, 0, absl::ZeroDuration());
    ASSERT_TRUE(fork.ok()) << fork.status();
    EXPECT_GE(fork->rows, last_n);  // watermarks only grow
    last_n = fork->rows;
    // The child appends right away, into its own pages, while the parent appends into its.
    AppendAllLayers(*store, c, fork->rows, 4, c);
    const uint64_t n = fork->rows;
    EXPECT_EQ(CheckRows(*store, c, [&](uint64_t r) { return r < n ? SequenceId{1} : c; }),
              (n + 4) * kLists);
  }
  stop = true;
  writer.join();
  EXPECT_EQ(write_errors.load(), 0u);
  EXPECT_GT(last_n, 5u);
  // The parent's rows were never touched by a child.
  const uint64_t parent_rows = store->GetSequence(TestRef(1))->committed_rows[0];
  EXPECT_EQ(CheckRows(*store, 1, [](uint64_t) { return 1; }), parent_rows * kLists);
}

// The child's page table begins with the parent's page ids (shared), then its own; rows it
// appends land at the table's addresses. Also for a child forked at 0.
TEST(ForkTest, ChildPageTablesShareThePrefixAndGrow) {
  auto store = MakeStore(1 << 20);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  AppendAllLayers(*store, 1, 0, 20, 1);
  auto parent_table = store->ReservePageTable(TestRef(1), 0);
  ASSERT_TRUE(parent_table.ok());
  ASSERT_EQ(parent_table->pages_per_head, 3u);
  for (uint64_t rows : {uint64_t{20}, uint64_t{16}, uint64_t{0}}) {
    SCOPED_TRACE(::testing::Message() << "forked at " << rows);
    const SequenceId c = 10 + rows;
    ASSERT_TRUE(store->ForkSequence(TestRef(c), TestRef(1), rows, 0, absl::ZeroDuration()).ok());
    auto table = store->ReservePageTable(TestRef(c), 40);
    ASSERT_TRUE(table.ok()) << table.status();
    ASSERT_EQ(table->pages_per_head, 5u);
    EXPECT_THAT(table->committed_rows, ElementsAre(rows, rows, rows));
    const uint64_t full = rows / 8;
    for (uint64_t list = 0; list < kLists; ++list) {
      for (uint64_t p = 0; p < 5; ++p) {
        const PageId mine = table->pages[list * 5 + p];
        if (p < full) {
          EXPECT_EQ(mine, parent_table->pages[list * 3 + p]) << "list " << list << " page " << p;
          EXPECT_GE(store->pool().references(mine), 2u);
        } else {
          EXPECT_EQ(store->pool().references(mine), 1u) << "list " << list << " page " << p;
        }
      }
    }
    AppendAllLayers(*store, c, rows, static_cast<uint32_t>(40 - rows), c);
    // Row r of (layer, head) lies where the table says.
    for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
      for (uint32_t head = 0; head < kShape.n_kv_heads; ++head) {
        for (uint64_t r = 0; r < 40; ++r) {
          const PageId page = table->pages[(layer * kShape.n_kv_heads + head) * 5 + r / 8];
          const uint8_t* at = store->pool().PageData(page) + (r % 8) * kShape.RowBytes();
          EXPECT_TRUE(RowMatches(kShape, r < rows ? 1 : c, layer, head, r, at))
              << "layer " << layer << " head " << head << " row " << r;
        }
      }
    }
  }
  EXPECT_EQ(CheckRows(*store, 1, [](uint64_t) { return 1; }), 20u * kLists);
}

TEST(ForkTest, BadRequestsAreRefusedAndChangeNothing) {
  auto store = MakeStore(1 << 20);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  AppendAllLayers(*store, 1, 0, 12, 1);
  ASSERT_TRUE(store->CreateSequence(TestRef(2), kShape, 0, absl::ZeroDuration()).ok());
  AppendAllLayers(*store, 2, 0, 3, 2);
  const StoreStats before = store->Stats();
  auto unchanged = [&] {
    const StoreStats now = store->Stats();
    EXPECT_EQ(now.free_pages, before.free_pages);
    EXPECT_EQ(now.sequences, before.sequences);
    EXPECT_EQ(now.shared_pages, 0u);
    EXPECT_EQ(now.forks, 0u);
    EXPECT_TRUE(absl::IsPermissionDenied(store->GetSequence(TestRef(9)).status()));
    EXPECT_EQ(CheckRows(*store, 1, [](uint64_t) { return 1; }), 12u * kLists);
    EXPECT_EQ(CheckRows(*store, 2, [](uint64_t) { return 2; }), 3u * kLists);
  };
  // Wrong, missing and one-bit-off capabilities of the parent, and an unknown parent: the same
  // answer, word for word.
  Capability off_by_one = TestCapability(1);
  off_by_one.bytes[7] ^= 0x10;
  for (const SequenceRef& parent : {SequenceRef{1, TestCapability(2)}, SequenceRef{1, {}},
                                    SequenceRef{1, off_by_one}, TestRef(77)}) {
    absl::Status st =
        store->ForkSequence(TestRef(9), parent, 8, 16, absl::ZeroDuration()).status();
    EXPECT_TRUE(absl::IsPermissionDenied(st)) << st;
    EXPECT_EQ(st.message(), absl::StrFormat("no sequence %d with this capability", parent.id));
    unchanged();
  }
  // The child needs a capability of its own.
  absl::Status st =
      store->ForkSequence({9, Capability{}}, TestRef(1), 8, 0, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("needs a capability"));
  // A taken child id: ALREADY_EXISTS, and the sequence holding it is untouched.
  st = store->ForkSequence(TestRef(2), TestRef(1), 8, 0, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsAlreadyExists(st)) << st;
  // Into itself; with a negative lease.
  st = store->ForkSequence(TestRef(1), TestRef(1), 8, 0, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("into itself"));
  st = store->ForkSequence(TestRef(9), TestRef(1), 8, 0, absl::Seconds(-1)).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  unchanged();
}

// All-or-nothing: a fork whose pages do not fit is RESOURCE_EXHAUSTED naming the shortfall,
// and nothing changes; one that needs no fresh pages fits in a full pool.
TEST(ForkTest, ShortfallIsRefusedAndChangesNothing) {
  const SequenceShape shape = kShape;
  auto store = MakeStore(40 * 256);  // 40 pages
  ASSERT_TRUE(store->CreateSequence(TestRef(1), shape, 0, absl::ZeroDuration()).ok());
  AppendAllLayers(*store, 1, 0, 44, 1);  // 6 pages x 6 lists = 36, the last one half full
  ASSERT_EQ(store->pool().free_pages(), 4u);
  const auto refused = [&](uint64_t rows, uint64_t expected, const char* need) {
    SCOPED_TRACE(::testing::Message() << "rows " << rows << " expected " << expected);
    absl::Status st =
        store->ForkSequence(TestRef(9), TestRef(1), rows, expected, absl::ZeroDuration())
            .status();
    EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
    EXPECT_THAT(st.message(), HasSubstr(need));
    EXPECT_EQ(store->pool().free_pages(), 4u);
    EXPECT_EQ(store->Stats().shared_pages, 0u);
    EXPECT_EQ(store->Stats().sequences, 1u);
    EXPECT_TRUE(absl::IsPermissionDenied(store->GetSequence(TestRef(9)).status()));
  };
  refused(44, 0, "need 1536 bytes (6 pages), 1024 free of 10240");  // 6 tail pages
  refused(40, 48, "need 1536 bytes (6 pages)");  // 6 pages per list wanted, 5 shared
  refused(0, ~uint64_t{0}, "more than the store's 40 pages");
  EXPECT_EQ(CheckRows(*store, 1, [](uint64_t) { return 1; }), 44u * kLists);
  // On a page boundary with no reservation nothing new is needed.
  auto fork = store->ForkSequence(TestRef(9), TestRef(1), 40, 0, absl::ZeroDuration());
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->reserved_bytes, 0u);
  EXPECT_EQ(store->pool().free_pages(), 4u);
}

}  // namespace
}  // namespace kvr::kv_store::testing
