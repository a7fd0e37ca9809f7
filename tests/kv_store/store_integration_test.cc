// Integration tests of kvr-store with real processes.
//
// StoreScenarioTest.* run a scenario against a kvr-store: by default a child process on
// 127.0.0.1 (UCX picks shared memory / TCP); when KVR_STORE_EXTERNAL_TARGET is set, against
// that store instead (KVR_STORE_EXTERNAL_PID names its pid, for the kill scenario).
//
// NetnsTest.* rerun every scenario across two network namespaces: kvr-store in a "store host"
// namespace, this binary (filtered to one scenario) in a "client host" namespace, joined by a
// veth pair with a private /30, UCX over TCP on the veth. Skipped, with the reason printed,
// where namespaces cannot be created (no CAP_SYS_ADMIN, no `ip`).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/test_pattern.h"
#include "kvr/kv_store/wire.h"
#include "store_process.h"

// In the test helpers' namespace (test_pattern.h, store_process.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr uint64_t kCapacityBytes = 64 << 20;
constexpr uint64_t kPageBytes = 64 << 10;
// The SmolLM2 layout: 3 kv heads, head_dim 64, f16 -> 256-byte rows, 256 rows per page.
constexpr SequenceShape kShape{.n_layers = 4, .n_kv_heads = 3, .head_dim = 64,
                               .dtype = DType::kF16};

std::optional<std::string> Env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// Counts rows of `out` (laid out as `entries` request) that differ from the pattern.
size_t CountBadRows(const SequenceShape& shape, std::span<const GatherEntry> entries,
                    const std::vector<uint8_t>& out) {
  size_t bad = 0;
  const uint8_t* p = out.data();
  for (const GatherEntry& e : entries) {
    for (uint32_t i : e.indices) {
      if (!RowMatches(shape, e.sequence.id, e.layer, e.head, i, p)) ++bad;
      p += shape.RowBytes();
    }
  }
  return bad;
}

class StoreScenarioTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto target = Env("KVR_STORE_EXTERNAL_TARGET")) {
      target_ = *target;
      auto pid = Env("KVR_STORE_EXTERNAL_PID");
      ASSERT_TRUE(pid.has_value()) << "KVR_STORE_EXTERNAL_PID must come with the target";
      ASSERT_TRUE(absl::SimpleAtoi(*pid, &external_pid_));
      return;
    }
    auto proc = StoreProcess::Start(
        {KVR_STORE_BINARY, "--listen", "127.0.0.1:0", "--capacity-bytes",
         absl::StrCat(kCapacityBytes), "--page-bytes", absl::StrCat(kPageBytes),
         // The writer client reads ranges by RMA where the endpoint has it natively.
         "--rma-reads", "true"},
        {}, absl::Seconds(20));
    ASSERT_TRUE(proc.ok()) << proc.status();
    local_.emplace(*std::move(proc));
    target_ = absl::StrCat("127.0.0.1:", local_->port());
  }

  std::unique_ptr<UcxKvStoreClient> Connect(std::string name, bool rma = true) {
    UcxClientOptions options;
    options.name = std::move(name);
    options.timeout = absl::Seconds(5);
    options.rma_reads = rma;
    auto client = UcxKvStoreClient::Connect(target_, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  void KillStore() {
    if (local_) {
      local_->Kill(SIGKILL);
    } else {
      kill(external_pid_, SIGKILL);
    }
  }

  std::string target_;
  std::optional<StoreProcess> local_;
  pid_t external_pid_ = -1;
};

TEST_F(StoreScenarioTest, TwoClientsReadBackBitExactByGatherAndRange) {
  auto writer = Connect("writer", /*rma=*/true);
  auto reader = Connect("reader", /*rma=*/false);
  ASSERT_TRUE(writer && reader);
  auto transports = writer->DataPlaneTransports();
  std::printf("data plane over %s; range reads: writer client via %s, reader client via %s\n",
              transports.ok() ? absl::StrJoin(*transports, ",").c_str() : "?",
              writer->range_read_path().c_str(), reader->range_read_path().c_str());
  ASSERT_TRUE(writer->CreateSequence(TestRef(1), kShape, 600, absl::ZeroDuration()).ok());
  ASSERT_TRUE(reader->CreateSequence(TestRef(2), kShape, 0, absl::ZeroDuration()).ok());
  // Layer-wise puts in uneven chunks that cross 256-row pages, as prefill would send them.
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    uint64_t at = 0;
    for (uint32_t n : {300u, 1u, 399u}) {
      auto committed = PutPatternRows(*writer, kShape, 1, layer, at, n);
      ASSERT_TRUE(committed.ok()) << committed.status();
      at += n;
      ASSERT_EQ(*committed, at);
    }
    ASSERT_TRUE(PutPatternRows(*reader, kShape, 2, layer, 0, 50).ok());
  }
  // Decode-style append of one row.
  auto one = MakePatternRows(kShape, 1, 3, 700, 1);
  auto appended =
      writer->Append({.sequence = TestRef(1), .layer = 3, .n_rows = 1, .k = one.k, .v = one.v});
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(*appended, 701u);

  // One gather covering many heads, layers and both sequences.
  std::mt19937 rng(42);
  std::vector<std::vector<uint32_t>> lists;
  std::vector<GatherEntry> entries;
  for (uint32_t layer : {0u, 3u}) {
    for (uint32_t head = 0; head < kShape.n_kv_heads; ++head) {
      std::vector<uint32_t> idx(257);
      for (uint32_t& i : idx) i = rng() % (layer == 3 ? 701 : 700);
      lists.push_back(std::move(idx));
    }
  }
  lists.push_back({49, 0, 7});
  for (size_t i = 0; i + 1 < lists.size(); ++i) {
    entries.push_back({.sequence = TestRef(1),
                       .layer = i < 3 ? 0u : 3u,
                       .head = static_cast<uint32_t>(i % 3),
                       .indices = lists[i]});
  }
  entries.push_back({.sequence = TestRef(2), .layer = 1, .head = 2, .indices = lists.back()});
  for (KvStoreClient* client : {static_cast<KvStoreClient*>(reader.get()),
                                static_cast<KvStoreClient*>(writer.get())}) {
    std::vector<uint8_t> out(GatherBytes(entries, kShape.RowBytes()));
    ASSERT_TRUE(client->Gather(entries, out).ok());
    EXPECT_EQ(CountBadRows(kShape, entries, out), 0u);
  }
  std::printf("gathers: writer client via %s, reader client via %s\n",
              writer->range_read_path().c_str(), reader->range_read_path().c_str());
  // Over shared memory (cma: native RMA) the writer's reads above and below went through RMA,
  // so what they checked is the RMA path; over TCP both clients use messages.
  if (transports.ok() && absl::StrContains(absl::StrJoin(*transports, ","), "cma")) {
    EXPECT_EQ(writer->range_read_path(), "rma");
  }
  EXPECT_EQ(reader->range_read_path(), "am");
  // A row appended after the writer's gather located the layer's rows must be read right (on
  // the RMA path its place is not known yet), beside rows located before it.
  auto two = MakePatternRows(kShape, 1, 3, 701, 1);
  ASSERT_TRUE(
      writer->Append({.sequence = TestRef(1), .layer = 3, .n_rows = 1, .k = two.k, .v = two.v})
          .ok());
  const std::vector<uint32_t> tail = {701, 700, 0, 701, 350};
  const std::vector<GatherEntry> after = {
      {.sequence = TestRef(1), .layer = 3, .head = 0, .indices = tail}};
  for (KvStoreClient* client :
       {static_cast<KvStoreClient*>(reader.get()), static_cast<KvStoreClient*>(writer.get())}) {
    std::vector<uint8_t> out(GatherBytes(after, kShape.RowBytes()));
    ASSERT_TRUE(client->Gather(after, out).ok());
    EXPECT_EQ(CountBadRows(kShape, after, out), 0u);
    // A row the store does not hold is refused, naming it, on either path.
    const std::vector<uint32_t> past = {5, 702};
    const std::vector<GatherEntry> bad = {
        {.sequence = TestRef(1), .layer = 3, .head = 1, .indices = past}};
    std::vector<uint8_t> bad_out(GatherBytes(bad, kShape.RowBytes()));
    const absl::Status refused = client->Gather(bad, bad_out);
    EXPECT_EQ(refused.code(), absl::StatusCode::kOutOfRange) << refused;
    // Another client's sequence is not located for a wrong capability.
    const std::vector<GatherEntry> foreign = {
        {.sequence = {.id = 1, .cap = TestRef(2).cap}, .layer = 0, .head = 0, .indices = past}};
    EXPECT_EQ(client->Gather(foreign, bad_out).code(), absl::StatusCode::kPermissionDenied);
  }

  // Range reads, through RMA (where native) and through active messages.
  const std::vector<RangeEntry> ranges = {
      {.sequence = TestRef(1), .layer = 2, .head = 1, .start = 100, .n_rows = 500},
      {.sequence = TestRef(1), .layer = 3, .head = 0, .start = 0, .n_rows = 701},
      {.sequence = TestRef(2), .layer = 0, .head = 2, .start = 10, .n_rows = 40}};
  for (UcxKvStoreClient* client : {reader.get(), writer.get()}) {
    std::vector<uint8_t> out((500 + 701 + 40) * kShape.RowBytes());
    absl::Status st = client->RangeRead(ranges, out);
    ASSERT_TRUE(st.ok()) << client->range_read_path() << ": " << st;
    const uint8_t* p = out.data();
    size_t bad = 0;
    for (const RangeEntry& r : ranges) {
      for (uint64_t row = r.start; row < r.start + r.n_rows; ++row) {
        if (!RowMatches(kShape, r.sequence.id, r.layer, r.head, row, p)) ++bad;
        p += kShape.RowBytes();
      }
    }
    EXPECT_EQ(bad, 0u) << client->range_read_path();
  }
  auto info = reader->GetSequence(TestRef(1));
  ASSERT_TRUE(info.ok());
  EXPECT_THAT(info->committed_rows, ::testing::ElementsAre(700, 700, 700, 702));
  EXPECT_EQ(info->tokens_per_page, 256u);
}

TEST_F(StoreScenarioTest, ConcurrentReaderNeverSeesPartialLayer) {
  auto writer = Connect("writer");
  auto reader = Connect("reader");
  ASSERT_TRUE(writer && reader);
  constexpr uint32_t kRows = 512;
  constexpr SequenceId kSequences = 4;
  std::atomic<bool> writer_done{false};
  std::atomic<uint64_t> full{0}, invisible{0}, bad_rows{0}, other_errors{0};
  absl::Mutex mu;
  std::string first_error;
  std::thread reading([&] {
    std::vector<uint32_t> idx(kRows);
    for (uint32_t i = 0; i < kRows; ++i) idx[i] = (i * 37) % kRows;  // all rows, shuffled
    std::vector<uint8_t> out(size_t{kRows} * kShape.n_kv_heads * kShape.RowBytes());
    bool last_pass = false;
    while (!last_pass) {
      last_pass = writer_done.load();
      for (SequenceId seq = 1; seq <= kSequences; ++seq) {
        for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
          std::vector<GatherEntry> entries;
          for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
            entries.push_back(
                {.sequence = TestRef(seq), .layer = layer, .head = h, .indices = idx});
          }
          absl::Status st = reader->Gather(entries, out);
          if (absl::IsOutOfRange(st) || absl::IsPermissionDenied(st)) {
            ++invisible;
          } else if (!st.ok()) {
            ++other_errors;
            absl::MutexLock lock(&mu);
            if (first_error.empty()) first_error = st.ToString();
          } else {
            bad_rows += CountBadRows(kShape, entries, out);
            ++full;
          }
        }
      }
    }
  });
  for (SequenceId seq = 1; seq <= kSequences; ++seq) {
    ASSERT_TRUE(writer->CreateSequence(TestRef(seq), kShape, 0, absl::ZeroDuration()).ok());
    for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
      // Half a layer first: a reader asking for all rows must not get it.
      ASSERT_TRUE(PutPatternRows(*writer, kShape, seq, layer, 0, kRows / 2).ok());
      ASSERT_TRUE(PutPatternRows(*writer, kShape, seq, layer, kRows / 2, kRows / 2).ok());
    }
  }
  writer_done = true;
  reading.join();
  std::printf("reader: %llu full layers, %llu not yet visible\n",
              static_cast<unsigned long long>(full.load()),
              static_cast<unsigned long long>(invisible.load()));
  EXPECT_EQ(bad_rows.load(), 0u);
  EXPECT_EQ(other_errors.load(), 0u) << first_error;
  // The reader's last pass ran after every write had completed.
  EXPECT_GE(full.load(), kSequences * kShape.n_layers);
}

TEST_F(StoreScenarioTest, ReleaseFreesEveryPage) {
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_TRUE(a && b);
  auto baseline = a->Stats();
  ASSERT_TRUE(baseline.ok()) << baseline.status();
  for (SequenceId seq : {21, 22, 23}) {
    KvStoreClient& c = seq == 23 ? static_cast<KvStoreClient&>(*b) : *a;
    ASSERT_TRUE(
        c.CreateSequence(TestRef(seq), kShape, seq == 21 ? 1000 : 0, absl::ZeroDuration()).ok());
    for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
      ASSERT_TRUE(PutPatternRows(c, kShape, seq, layer, 0, 300).ok());
    }
  }
  auto during = b->Stats();
  ASSERT_TRUE(during.ok());
  EXPECT_EQ(during->sequences, baseline->sequences + 3);
  EXPECT_GT(during->used_bytes, baseline->used_bytes);
  // One is kept under a lease for reuse first: still held, still readable.
  ASSERT_TRUE(a->Release(TestRef(22), absl::Seconds(30)).ok());
  EXPECT_EQ(b->Stats()->used_bytes, during->used_bytes);
  std::vector<uint32_t> idx = {299};
  std::vector<GatherEntry> e = {{.sequence = TestRef(22), .layer = 1, .head = 2, .indices = idx}};
  std::vector<uint8_t> row(kShape.RowBytes());
  ASSERT_TRUE(b->Gather(e, row).ok());
  EXPECT_TRUE(RowMatches(kShape, 22, 1, 2, 299, row.data()));
  ASSERT_TRUE(a->Release(TestRef(21), absl::ZeroDuration()).ok());
  ASSERT_TRUE(b->Release(TestRef(22), absl::ZeroDuration()).ok());
  ASSERT_TRUE(b->Release(TestRef(23), absl::ZeroDuration()).ok());
  auto after = a->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->used_bytes, baseline->used_bytes);
  EXPECT_EQ(after->free_pages, baseline->free_pages);
  EXPECT_EQ(after->sequences, baseline->sequences);
  EXPECT_TRUE(absl::IsPermissionDenied(a->Release(TestRef(21), absl::ZeroDuration())));
}

TEST_F(StoreScenarioTest, FullStoreRefusesWithResourceExhaustedAndLosesNothing) {
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_TRUE(a && b);
  auto baseline = a->Stats();
  ASSERT_TRUE(baseline.ok());
  const SequenceShape shape{.n_layers = 4, .n_kv_heads = 2, .head_dim = 64,
                            .dtype = DType::kF16};
  // Reserve all but 64 of the free pages: (free - 64) / 8 lists pages per list.
  const uint64_t lists = shape.n_layers * shape.n_kv_heads;
  const uint64_t pages_each = (baseline->free_pages - 64) / lists;
  ASSERT_GT(pages_each, 8u);
  ASSERT_TRUE(a->CreateSequence(TestRef(31), shape, pages_each * 256, absl::ZeroDuration()).ok());
  for (uint32_t layer = 0; layer < shape.n_layers; ++layer) {
    ASSERT_TRUE(PutPatternRows(*a, shape, 31, layer, 0, 1000).ok());
  }
  const uint64_t free_before = a->Stats()->free_pages;
  // Another sequence whose reservation does not fit.
  absl::Status st = b->CreateSequence(TestRef(32), shape, 64 * 256, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("need"));
  EXPECT_THAT(st.message(), HasSubstr("free of"));
  // A write to another sequence needing more pages than are free.
  ASSERT_TRUE(b->CreateSequence(TestRef(33), shape, 0, absl::ZeroDuration()).ok());
  const uint32_t grow_rows = static_cast<uint32_t>((free_before / shape.n_kv_heads + 1) * 256);
  absl::StatusOr<uint64_t> w = PutPatternRows(*b, shape, 33, 0, 0, grow_rows);
  EXPECT_TRUE(absl::IsResourceExhausted(w.status())) << w.status();
  EXPECT_THAT(w.status().message(), HasSubstr("free of"));
  EXPECT_EQ(b->GetSequence(TestRef(33))->committed_rows[0], 0u);
  // Nothing stored was lost: every row of layer 1 and the full layer 0 read back exactly.
  std::vector<uint32_t> idx(1000);
  for (uint32_t i = 0; i < 1000; ++i) idx[i] = i;
  std::vector<GatherEntry> entries;
  for (uint32_t h = 0; h < 2; ++h) {
    entries.push_back({.sequence = TestRef(31), .layer = 1, .head = h, .indices = idx});
  }
  std::vector<uint8_t> out(GatherBytes(entries, shape.RowBytes()));
  ASSERT_TRUE(b->Gather(entries, out).ok());
  EXPECT_EQ(CountBadRows(shape, entries, out), 0u);
  auto info = b->GetSequence(TestRef(31));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->committed_rows[0], 1000u);
  EXPECT_EQ(a->Stats()->free_pages, free_before);
  // Small writes that fit still succeed; releasing returns to baseline.
  EXPECT_TRUE(PutPatternRows(*a, shape, 31, 2, 1000, 10).ok());
  ASSERT_TRUE(a->Release(TestRef(31), absl::ZeroDuration()).ok());
  ASSERT_TRUE(b->Release(TestRef(33), absl::ZeroDuration()).ok());
  EXPECT_EQ(a->Stats()->free_pages, baseline->free_pages);
}

// Prefix reuse: a second client forks a cached (released-and-kept) sequence over gRPC; a UCX
// gather and range read of the child's rows return exactly the parent's bytes; the child
// appends into pages of its own; and the parent's release leaves the child whole.
TEST_F(StoreScenarioTest, ForkedSequenceReadsTheParentsRowsOverUcx) {
  auto a = Connect("a", /*rma=*/true);
  auto b = Connect("b", /*rma=*/false);
  ASSERT_TRUE(a && b);
  auto baseline = a->Stats();
  ASSERT_TRUE(baseline.ok()) << baseline.status();
  // 700 rows: pages of 256 rows, so 2 full pages and a partial one per (layer, kv head).
  ASSERT_TRUE(a->CreateSequence(TestRef(41), kShape, 0, absl::ZeroDuration()).ok());
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_TRUE(PutPatternRows(*a, kShape, 41, layer, 0, 400).ok());
    ASSERT_TRUE(PutPatternRows(*a, kShape, 41, layer, 400, 300).ok());
  }
  ASSERT_TRUE(a->Release(TestRef(41), absl::Seconds(60)).ok());

  const uint64_t lists = uint64_t{kShape.n_layers} * kShape.n_kv_heads;
  auto fork = b->ForkSequence(TestRef(42), TestRef(41), 600, 800, absl::Seconds(60));
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->rows, 600u);
  EXPECT_EQ(fork->tokens_per_page, 256u);
  EXPECT_EQ(fork->shared_pages, 2 * lists);
  EXPECT_EQ(fork->reserved_bytes, 2 * lists * kPageBytes);  // the copied tail + 1 reserved
  auto stats = a->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->forks, baseline->forks + 1);
  EXPECT_EQ(stats->forked_rows, baseline->forked_rows + 600);
  EXPECT_EQ(stats->shared_pages, baseline->shared_pages + 2 * lists);
  auto info = b->GetSequence(TestRef(42));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->committed_rows, ::testing::Each(600u));

  // Gather the same rows of child and parent over UCX: equal bytes, and the parent's pattern.
  std::vector<uint32_t> idx = {599, 0, 255, 256, 511, 512, 513, 300, 598};
  for (uint32_t i = 0; i < 600; i += 37) idx.push_back(i);
  std::vector<GatherEntry> child_entries, parent_entries;
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
      child_entries.push_back({.sequence = TestRef(42), .layer = layer, .head = h, .indices = idx});
      parent_entries.push_back(
          {.sequence = TestRef(41), .layer = layer, .head = h, .indices = idx});
    }
  }
  std::vector<uint8_t> child_rows(GatherBytes(child_entries, kShape.RowBytes()));
  std::vector<uint8_t> parent_rows(child_rows.size());
  ASSERT_TRUE(b->Gather(child_entries, child_rows).ok());
  ASSERT_TRUE(a->Gather(parent_entries, parent_rows).ok());
  EXPECT_TRUE(child_rows == parent_rows);
  EXPECT_EQ(CountBadRows(kShape, parent_entries, child_rows), 0u);
  // A range read of all 600 rows of one (layer, head), by RMA where the writer has it.
  std::vector<RangeEntry> child_range = {
      {.sequence = TestRef(42), .layer = 3, .head = 2, .start = 0, .n_rows = 600}};
  std::vector<RangeEntry> parent_range = {
      {.sequence = TestRef(41), .layer = 3, .head = 2, .start = 0, .n_rows = 600}};
  std::vector<uint8_t> child_run(600 * kShape.RowBytes()), parent_run(child_run.size());
  ASSERT_TRUE(a->RangeRead(child_range, child_run).ok());
  ASSERT_TRUE(b->RangeRead(parent_range, parent_run).ok());
  EXPECT_TRUE(child_run == parent_run);

  // The child appends after row 600 (the parent, kept read-only, cannot).
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_TRUE(PutPatternRows(*b, kShape, 42, layer, 600, 10).ok());
  }
  EXPECT_TRUE(absl::IsFailedPrecondition(PutPatternRows(*a, kShape, 41, 0, 700, 1).status()));
  // Errors over gRPC: a wrong parent capability reads like an unknown id; a child needs one.
  absl::Status st =
      b->ForkSequence(TestRef(43), {41, TestRef(42).cap}, 600, 0, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsPermissionDenied(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("no sequence 41 with this capability"));
  st = b->ForkSequence({43, Capability{}}, TestRef(41), 600, 0, absl::ZeroDuration()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;

  // The parent goes; the child still reads its rows and then its own appended ones.
  ASSERT_TRUE(a->Release(TestRef(41), absl::ZeroDuration()).ok());
  std::vector<uint32_t> tail_idx = {0, 256, 599, 600, 609};
  std::vector<GatherEntry> tail_entries = {
      {.sequence = TestRef(42), .layer = 2, .head = 1, .indices = tail_idx}};
  std::vector<uint8_t> tail_rows(GatherBytes(tail_entries, kShape.RowBytes()));
  ASSERT_TRUE(b->Gather(tail_entries, tail_rows).ok());
  for (size_t i = 0; i < tail_idx.size(); ++i) {
    EXPECT_TRUE(RowMatches(kShape, tail_idx[i] < 600 ? 41 : 42, 2, 1, tail_idx[i],
                           tail_rows.data() + i * kShape.RowBytes()))
        << "row " << tail_idx[i];
  }
  ASSERT_TRUE(b->Release(TestRef(42), absl::ZeroDuration()).ok());
  auto after = a->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->free_pages, baseline->free_pages);
  EXPECT_EQ(after->shared_pages, baseline->shared_pages);
}

TEST_F(StoreScenarioTest, MalformedRequestsGetErrorRepliesAndStoreKeepsServing) {
  auto c = Connect("malformed");
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->CreateSequence(TestRef(41), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(PutPatternRows(*c, kShape, 41, 0, 0, 10).ok());
  const auto gather_id = static_cast<uint16_t>(wire::MessageType::kGather);
  const auto write_id = static_cast<uint16_t>(wire::MessageType::kWrite);
  auto bytes = [](const std::string& s) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  std::vector<uint32_t> idx = {1, 2};
  std::vector<GatherEntry> entries = {
      {.sequence = TestRef(41), .layer = 0, .head = 0, .indices = idx}};
  wire::Encoded good = wire::EncodeGather(entries, absl::InfiniteFuture());

  struct Case {
    const char* what;
    absl::StatusOr<std::string> result;
    const char* expect;
  };
  std::vector<Case> cases;
  cases.push_back({"truncated header", c->RawCall(gather_id, bytes(good.header).first(7),
                                                  good.payload),
                   "truncated"});
  cases.push_back({"truncated payload",
                   c->RawCall(gather_id, bytes(good.header),
                              std::span(good.payload).first(good.payload.size() - 3)),
                   "gather payload has"});
  std::string bad_magic = good.header;
  bad_magic[1] ^= 0x5a;
  cases.push_back({"bad magic", c->RawCall(gather_id, bytes(bad_magic), good.payload),
                   "bad magic"});
  std::string wrong_type =
      wire::EncodeWriteHeader({.sequence = TestRef(41), .n_rows = 1}, absl::InfiniteFuture());
  cases.push_back({"wrong message type", c->RawCall(gather_id, bytes(wrong_type), good.payload),
                   "message type"});
  std::vector<GatherEntry> unknown = {{.sequence = TestRef(999), .indices = idx}};
  wire::Encoded enc_unknown = wire::EncodeGather(unknown, absl::InfiniteFuture());
  cases.push_back({"unknown sequence",
                   c->RawCall(gather_id, bytes(enc_unknown.header), enc_unknown.payload),
                   "no sequence 999 with this capability"});
  std::vector<uint32_t> far = {10};
  std::vector<GatherEntry> out_of_range = {
      {.sequence = TestRef(41), .layer = 0, .head = 1, .indices = far}};
  wire::Encoded enc_oor = wire::EncodeGather(out_of_range, absl::InfiniteFuture());
  cases.push_back({"index out of range",
                   c->RawCall(gather_id, bytes(enc_oor.header), enc_oor.payload),
                   "row 10 of sequence 41"});
  std::vector<GatherEntry> bad_head = {
      {.sequence = TestRef(41), .layer = 0, .head = 3, .indices = idx}};
  wire::Encoded enc_head = wire::EncodeGather(bad_head, absl::InfiniteFuture());
  cases.push_back({"head out of range",
                   c->RawCall(gather_id, bytes(enc_head.header), enc_head.payload),
                   "kv head 3"});
  // A write whose row size does not match the sequence's shape.
  std::string wh = wire::EncodeWriteHeader(
      {.sequence = TestRef(41), .start_row = LayerRows::kAtEnd, .n_rows = 2},
      absl::InfiniteFuture());
  std::vector<uint8_t> short_rows(2 * 2 * 100);
  cases.push_back({"wrong row size", c->RawCall(write_id, bytes(wh), short_rows), "need"});
  std::string late = wire::EncodeWriteHeader({.sequence = TestRef(41), .n_rows = 1},
                                             absl::Now() - absl::Seconds(5));
  cases.push_back({"past deadline", c->RawCall(write_id, bytes(late), short_rows),
                   "after its deadline"});
  for (const Case& k : cases) {
    EXPECT_FALSE(k.result.ok()) << k.what;
    EXPECT_THAT(k.result.status().message(), HasSubstr(k.expect)) << k.what;
  }
  // The typed client reports the same.
  std::vector<uint8_t> out(GatherBytes(out_of_range, kShape.RowBytes()));
  EXPECT_TRUE(absl::IsOutOfRange(c->Gather(out_of_range, out)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      c->CreateSequence(TestRef(42), {.n_layers = 1, .n_kv_heads = 0, .head_dim = 64}, 0,
                        absl::ZeroDuration())
          .status()));
  // And the store keeps serving: the next valid request succeeds, bit-exact.
  std::vector<uint8_t> rows(GatherBytes(entries, kShape.RowBytes()));
  ASSERT_TRUE(c->Gather(entries, rows).ok());
  EXPECT_EQ(CountBadRows(kShape, entries, rows), 0u);
  auto committed = PutPatternRows(*c, kShape, 41, 0, 10, 5);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(*committed, 15u);
}

TEST_F(StoreScenarioTest, KillingStoreMidReadGivesUnavailableWithinDeadline) {
  auto c = Connect("victim");
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->CreateSequence(TestRef(51), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(PutPatternRows(*c, kShape, 51, 0, 0, 4096).ok());
  std::vector<uint32_t> idx(4096);
  for (uint32_t i = 0; i < idx.size(); ++i) idx[i] = (i * 7919) % 4096;
  std::vector<GatherEntry> entries;
  for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
    entries.push_back({.sequence = TestRef(51), .layer = 0, .head = h, .indices = idx});
  }
  std::atomic<int> succeeded{0};
  std::atomic<bool> reader_done{false};
  absl::Status failure;
  absl::Time failed_at;
  std::thread reading([&] {
    std::vector<uint8_t> out(GatherBytes(entries, kShape.RowBytes()));
    // Bounded so that a client that never notices the kill fails the test instead of hanging.
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (absl::Now() < give_up) {
      absl::Status st = c->Gather(entries, out);
      if (!st.ok()) {
        failed_at = absl::Now();
        failure = st;
        break;
      }
      ++succeeded;
    }
    reader_done = true;
  });
  while (succeeded.load() < 3 && !reader_done.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (reader_done.load()) {
    reading.join();
    FAIL() << "reads failed before the store was killed: " << failure;
  }
  const absl::Time killed_at = absl::Now();
  KillStore();
  reading.join();
  ASSERT_FALSE(failure.ok()) << "reads kept succeeding after the store was killed";
  std::printf("after kill: %s in %s\n", failure.ToString().c_str(),
              absl::FormatDuration(failed_at - killed_at).c_str());
  EXPECT_TRUE(absl::IsUnavailable(failure)) << failure;
  EXPECT_THAT(failure.message(), HasSubstr("kvr-store"));
  EXPECT_LT(failed_at - killed_at, absl::Seconds(5));  // the client's deadline
  // Later calls fail at once too, on both planes.
  std::vector<uint8_t> out(GatherBytes(entries, kShape.RowBytes()));
  absl::Status again = c->Gather(entries, out);
  EXPECT_THAT(again.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled))
      << again;
  EXPECT_FALSE(c->Stats().ok());
}

TEST(StoreProcessTest, PrintsEffectiveConfigAndStopsGracefullyOnSigterm) {
  if (Env("KVR_STORE_EXTERNAL_TARGET")) GTEST_SKIP() << "local-only";
  auto proc = StoreProcess::Start({KVR_STORE_BINARY, "--listen", "127.0.0.1:0",
                                   "--capacity-bytes", "8MiB"},
                                  {"KVR_STORE_PAGE_BYTES=32KiB"}, absl::Seconds(20));
  ASSERT_TRUE(proc.ok()) << proc.status();
  EXPECT_THAT(proc->output(), HasSubstr("capacity_bytes: 8MiB  # flag"));
  EXPECT_THAT(proc->output(), HasSubstr("page_bytes: 32KiB  # env KVR_STORE_PAGE_BYTES"));
  EXPECT_THAT(proc->output(), HasSubstr("evict_expired: false  # default"));
  const int status = proc->Kill(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_THAT(proc->output(), HasSubstr("kvr-store: stopped"));
}

// ---------------------------------------------------------------------------------------------
// Two network namespaces.

std::optional<std::string> FindIp() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(p, X_OK) == 0) return std::string(p);
  }
  return std::nullopt;
}

class NetnsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (Env("KVR_STORE_EXTERNAL_TARGET")) {
      skip_reason_ = "already inside a namespace scenario";
      return;
    }
    auto ip = FindIp();
    if (!ip) {
      skip_reason_ = "no `ip` binary (iproute2) found";
      return;
    }
    ip_ = *ip;
    RemoveStaleNamespaces();
    const std::string tag = absl::StrCat(getpid());
    store_ns_ = "kvrs-" + tag + "-s";
    client_ns_ = "kvrs-" + tag + "-c";
    store_dev_ = "kvs" + tag;
    client_dev_ = "kvc" + tag;
    const std::vector<std::vector<std::string>> steps = {
        {ip_, "netns", "add", store_ns_},
        {ip_, "netns", "add", client_ns_},
        {ip_, "link", "add", store_dev_, "type", "veth", "peer", "name", client_dev_},
        {ip_, "link", "set", store_dev_, "netns", store_ns_},
        {ip_, "link", "set", client_dev_, "netns", client_ns_},
        {ip_, "-n", store_ns_, "addr", "add", "10.254.7.1/30", "dev", store_dev_},
        {ip_, "-n", client_ns_, "addr", "add", "10.254.7.2/30", "dev", client_dev_},
        {ip_, "-n", store_ns_, "link", "set", store_dev_, "up"},
        {ip_, "-n", client_ns_, "link", "set", client_dev_, "up"},
        {ip_, "-n", store_ns_, "link", "set", "lo", "up"},
        {ip_, "-n", client_ns_, "link", "set", "lo", "up"},
    };
    for (const auto& step : steps) {
      auto r = RunProcess(step, {}, absl::Seconds(10));
      if (!r.ok() || r->exit_code != 0) {
        skip_reason_ = absl::StrCat("cannot create network namespaces (`",
                                    absl::StrJoin(step, " "), "`: ",
                                    r.ok() ? r->output : r.status().ToString(), ")");
        TearDownTestSuite();
        return;
      }
      if (step[2] == "add" && step[1] == "netns") created_.push_back(step[3]);
    }
  }

  // Namespaces left by an earlier run of this test that crashed (its pid is gone).
  static void RemoveStaleNamespaces() {
    auto list = RunProcess({ip_, "netns", "list"}, {}, absl::Seconds(10));
    if (!list.ok() || list->exit_code != 0) return;
    for (absl::string_view line : absl::StrSplit(list->output, '\n')) {
      std::vector<std::string> parts = absl::StrSplit(line, absl::ByAnyChar(" -"));
      // "kvrs-<pid>-s" or "kvrs-<pid>-c", possibly followed by " (id: N)".
      int pid = 0;
      if (parts.size() < 3 || parts[0] != "kvrs" || !absl::SimpleAtoi(parts[1], &pid)) continue;
      if (kill(pid, 0) == 0 || errno != ESRCH) continue;
      (void)RunProcess({ip_, "netns", "del", absl::StrCat("kvrs-", pid, "-", parts[2])}, {},
                       absl::Seconds(10));
    }
  }

  static void TearDownTestSuite() {
    // Deleting a namespace also removes the veth end inside it (and so its peer).
    for (const std::string& ns : created_) {
      (void)RunProcess({ip_, "netns", "del", ns}, {}, absl::Seconds(10));
    }
    created_.clear();
  }

  void SetUp() override {
    if (!skip_reason_.empty()) {
      std::printf("skipped: %s\n", skip_reason_.c_str());
      GTEST_SKIP() << skip_reason_;
    }
  }

  // Runs StoreScenarioTest.<name> in the client namespace against a kvr-store in the store
  // namespace.
  void RunScenario(const std::string& name) {
    auto store =
        StoreProcess::Start({ip_, "netns", "exec", store_ns_, KVR_STORE_BINARY, "--listen",
                             "10.254.7.1:0", "--capacity-bytes", absl::StrCat(kCapacityBytes),
                             "--page-bytes", absl::StrCat(kPageBytes), "--rma-reads", "true"},
                            {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + store_dev_}, absl::Seconds(20));
    ASSERT_TRUE(store.ok()) << store.status();
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    ASSERT_GT(n, 0);
    self[n] = '\0';
    auto run = RunProcess(
        {ip_, "netns", "exec", client_ns_, self, "--gtest_filter=StoreScenarioTest." + name},
        {absl::StrCat("KVR_STORE_EXTERNAL_TARGET=10.254.7.1:", store->port()),
         absl::StrCat("KVR_STORE_EXTERNAL_PID=", store->pid()), "UCX_TLS=tcp",
         "UCX_NET_DEVICES=" + client_dev_},
        absl::Seconds(50));
    ASSERT_TRUE(run.ok()) << run.status();
    std::printf("%s", run->output.c_str());
    EXPECT_EQ(run->exit_code, 0) << run->output;
    EXPECT_THAT(run->output, HasSubstr("[  PASSED  ] 1 test."));
    EXPECT_THAT(run->output, ::testing::Not(HasSubstr("SKIPPED")));
  }

  static inline std::string skip_reason_;
  static inline std::string ip_;
  static inline std::string store_ns_, client_ns_, store_dev_, client_dev_;
  static inline std::vector<std::string> created_;
};

TEST_F(NetnsTest, TwoClientsReadBackBitExactByGatherAndRange) {
  RunScenario("TwoClientsReadBackBitExactByGatherAndRange");
}
TEST_F(NetnsTest, ConcurrentReaderNeverSeesPartialLayer) {
  RunScenario("ConcurrentReaderNeverSeesPartialLayer");
}
TEST_F(NetnsTest, ReleaseFreesEveryPage) { RunScenario("ReleaseFreesEveryPage"); }
TEST_F(NetnsTest, FullStoreRefusesWithResourceExhaustedAndLosesNothing) {
  RunScenario("FullStoreRefusesWithResourceExhaustedAndLosesNothing");
}
TEST_F(NetnsTest, MalformedRequestsGetErrorRepliesAndStoreKeepsServing) {
  RunScenario("MalformedRequestsGetErrorRepliesAndStoreKeepsServing");
}
TEST_F(NetnsTest, ForkedSequenceReadsTheParentsRowsOverUcx) {
  RunScenario("ForkedSequenceReadsTheParentsRowsOverUcx");
}
TEST_F(NetnsTest, KillingStoreMidReadGivesUnavailableWithinDeadline) {
  RunScenario("KillingStoreMidReadGivesUnavailableWithinDeadline");
}

}  // namespace
}  // namespace kvr::kv_store::testing
