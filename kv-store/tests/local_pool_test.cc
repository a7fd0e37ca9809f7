// Same-host zero-copy reads against a real kvr-store process on 127.0.0.1: the pool handed over
// the store's local socket, mapped read-only, must hold at the page table's addresses exactly
// the rows that RangeRead returns. UCX runs over TCP on the loopback device, set explicitly.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_process.h"

// In the test helpers' namespace (test_pattern.h, store_process.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

// The SmolLM2 layout: 256-byte rows, 256 rows per 64 KiB page.
constexpr SequenceShape kShape{
    .n_layers = 3, .n_kv_heads = 3, .head_dim = 64, .dtype = DType::kF16};

std::string SocketPath(const std::string& tag) {
  return absl::StrCat(::testing::TempDir(), "kvr-store-", getpid(), "-", tag, ".sock");
}

absl::StatusOr<StoreProcess> StartStore(const std::string& local_socket) {
  if (local_socket.empty()) return StartLoopbackStore(KVR_STORE_BINARY, {});
  return StartLoopbackStore(KVR_STORE_BINARY, {"--local-socket", local_socket});
}

std::unique_ptr<UcxKvStoreClient> Connect(int port) {
  UcxClientOptions options;
  options.name = "local-pool-test";
  options.timeout = absl::Seconds(5);
  options.ucx_config = {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}};
  auto client = UcxKvStoreClient::Connect(absl::StrCat("127.0.0.1:", port), options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// The permissions ("r--s") of the /proc/self/maps line whose range holds `addr`.
std::optional<std::string> MappingPermissions(const void* addr) {
  const auto want = reinterpret_cast<uintptr_t>(addr);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 2) continue;
    std::vector<std::string> range = absl::StrSplit(fields[0], '-');
    uint64_t lo = 0, hi = 0;
    if (range.size() != 2 || !absl::SimpleHexAtoi(range[0], &lo) ||
        !absl::SimpleHexAtoi(range[1], &hi)) {
      continue;
    }
    if (want >= lo && want < hi) return fields[1];
  }
  return std::nullopt;
}

TEST(LocalPoolTest, MappedPoolHoldsTheRowsAtThePageTableAddresses) {
  const std::string path = SocketPath("map");
  auto store = StartStore(path);
  ASSERT_TRUE(store.ok()) << store.status();
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto client = Connect(store->port());
  ASSERT_NE(client, nullptr);

  // Prefill-like puts before the table, decode-like appends after it, across page boundaries.
  constexpr SequenceId kSeq = 11;
  ASSERT_TRUE(client->CreateSequence(TestRef(kSeq), kShape, 0, absl::ZeroDuration()).ok());
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_TRUE(PutPatternRows(*client, kShape, kSeq, layer, 0, 300).ok());
  }
  auto table = client->ReservePageTable(TestRef(kSeq), 700);  // 3 pages per (layer, head)
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->tokens_per_page, 256u);
  EXPECT_EQ(table->pages_per_head, 3u);
  EXPECT_EQ(table->committed_rows, std::vector<uint64_t>(3, 300));
  ASSERT_EQ(table->pages.size(), 3u * 3u * 3u);
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_TRUE(PutPatternRows(*client, kShape, kSeq, layer, 300, 250).ok());
    for (uint64_t r = 550; r < 560; ++r) {
      auto rows = MakePatternRows(kShape, kSeq, layer, r, 1);
      ASSERT_TRUE(client
                      ->Append({.sequence = TestRef(kSeq),
                                .layer = layer,
                                .n_rows = 1,
                                .k = rows.k,
                                .v = rows.v})
                      .ok());
    }
  }
  auto info = client->GetSequence(TestRef(kSeq));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages, 27u);  // the appends added no page

  auto mapping = client->MapLocalPool();
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  EXPECT_EQ((*mapping)->page_bytes(), 64u << 10);
  EXPECT_GE((*mapping)->bytes(), 64u << 20);
  EXPECT_EQ((*mapping)->pool_id().size(), 32u);
  const size_t row_bytes = kShape.RowBytes();
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    for (uint32_t head = 0; head < kShape.n_kv_heads; ++head) {
      std::vector<uint8_t> expected(560 * row_bytes);
      const RangeEntry range{
          .sequence = TestRef(kSeq), .layer = layer, .head = head, .start = 0, .n_rows = 560};
      ASSERT_TRUE(client->RangeRead({&range, 1}, expected).ok());
      for (uint64_t r = 0; r < 560; ++r) {
        const uint8_t* at = (*mapping)->Row(*table, layer, head, r);
        ASSERT_EQ(std::memcmp(at, expected.data() + r * row_bytes, row_bytes), 0)
            << "layer " << layer << " head " << head << " row " << r;
        ASSERT_TRUE(RowMatches(kShape, kSeq, layer, head, r, at));
      }
    }
  }
  // One mapping per client, shared.
  auto again = client->MapLocalPool();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), mapping->get());
  // Read-only and shared in this process's address space.
  const std::optional<std::string> perms = MappingPermissions((*mapping)->base());
  ASSERT_TRUE(perms.has_value());
  EXPECT_EQ(*perms, "r--s");
  const std::optional<std::string> last_perms =
      MappingPermissions((*mapping)->base() + (*mapping)->bytes() - 1);
  ASSERT_TRUE(last_perms.has_value());
  EXPECT_EQ(*last_perms, "r--s");
  // Another client of the same store gets its own mapping of the same pool.
  auto other = Connect(store->port());
  ASSERT_NE(other, nullptr);
  auto other_mapping = other->MapLocalPool();
  ASSERT_TRUE(other_mapping.ok()) << other_mapping.status();
  EXPECT_EQ((*other_mapping)->pool_id(), (*mapping)->pool_id());
  EXPECT_TRUE(RowMatches(kShape, kSeq, 2, 1, 559, (*other_mapping)->Row(*table, 2, 1, 559)));

  ASSERT_TRUE(client->Release(TestRef(kSeq), absl::ZeroDuration()).ok());
  // The socket file goes with the store.
  store->Kill(SIGTERM);
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

TEST(LocalPoolTest, PageTableErrorsComeBackWithTheirCodes) {
  auto store = StartStore(SocketPath("errors"));
  ASSERT_TRUE(store.ok()) << store.status();
  auto client = Connect(store->port());
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(absl::IsPermissionDenied(client->ReservePageTable(TestRef(5), 10).status()));
  ASSERT_TRUE(client->CreateSequence(TestRef(5), kShape, 0, absl::ZeroDuration()).ok());
  auto huge = client->ReservePageTable(TestRef(5), ~uint64_t{0});
  EXPECT_TRUE(absl::IsResourceExhausted(huge.status())) << huge.status();
  // 64 MiB = 1024 pages, 90 of them held by another sequence; 9 lists x 113 pages = 1017
  // do not fit the 934 left, and nothing is taken.
  ASSERT_TRUE(client->CreateSequence(TestRef(6), kShape, 10 * 256, absl::ZeroDuration()).ok());
  auto big = client->ReservePageTable(TestRef(5), 113 * 256);
  EXPECT_TRUE(absl::IsResourceExhausted(big.status())) << big.status();
  EXPECT_THAT(big.status().message(), HasSubstr("(1017 pages), 61210624 free"));
  EXPECT_EQ(client->Stats()->used_bytes, 90u << 16);
}

TEST(LocalPoolTest, StoreWithoutLocalSocketIsRefusedByName) {
  auto store = StartStore("");
  ASSERT_TRUE(store.ok()) << store.status();
  auto client = Connect(store->port());
  ASSERT_NE(client, nullptr);
  auto mapping = client->MapLocalPool();
  EXPECT_TRUE(absl::IsFailedPrecondition(mapping.status())) << mapping.status();
  EXPECT_THAT(mapping.status().message(), HasSubstr(absl::StrCat("store 127.0.0.1:", store->port(),
                                                                 " offers no local socket")));
  // Page tables do not need the socket.
  ASSERT_TRUE(client->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  EXPECT_TRUE(client->ReservePageTable(TestRef(1), 1).ok());
}

TEST(LocalPoolTest, UnreachableSocketIsUnavailable) {
  const std::string path = SocketPath("gone");
  auto store = StartStore(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto client = Connect(store->port());
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(unlink(path.c_str()), 0);
  auto mapping = client->MapLocalPool();
  EXPECT_TRUE(absl::IsUnavailable(mapping.status())) << mapping.status();
  EXPECT_THAT(mapping.status().message(), HasSubstr(path));
}

TEST(LocalPoolTest, SecondStoreDoesNotTakeOverALiveSocket) {
  const std::string path = SocketPath("busy");
  auto store = StartStore(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto second = StartStore(path);
  EXPECT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("served by another live process"));
  // The first store still hands its pool out.
  auto client = Connect(store->port());
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->MapLocalPool().ok());
}

}  // namespace
}  // namespace kvr::kv_store::testing
