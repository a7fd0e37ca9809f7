// In-process StoreServer with real gRPC and UCX (loopback), plus the fake client: the same
// calls must behave the same on both.

#include <memory>

#include "gmock/gmock.h"
#include "grpc_test_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/server.h"
#include "kvr/kv_store/test_pattern.h"

// In the test helpers' namespace (test_pattern.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

constexpr SequenceShape kShape{
    .n_layers = 2, .n_kv_heads = 2, .head_dim = 16, .dtype = DType::kBf16};

StoreOptions SmallStore() {
  StoreOptions options;
  options.pool = {.capacity_bytes = 4 << 20, .page_bytes = 4096};
  return options;
}

// An in-process StoreServer of `options` over a SmallStore() pool, on a free loopback port;
// null, the test failed, when it cannot start.
std::unique_ptr<StoreServer> StartServer(StoreServerOptions options = {}) {
  options.store = SmallStore();
  absl::StatusOr<std::unique_ptr<StoreServer>> server = StoreServer::Start(std::move(options));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

// The address of `server`'s gRPC port.
std::string AddressOf(const StoreServer& server) {
  return absl::StrCat("127.0.0.1:", server.port());
}

// Puts rows [0, n_rows) of every layer of sequence `seq`, the test pattern's.
absl::Status PutPatternLayers(KvStoreClient& client, SequenceId seq, uint32_t n_rows) {
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    absl::StatusOr<uint64_t> committed = PutPatternRows(client, kShape, seq, layer, 0, n_rows);
    if (!committed.ok()) return committed.status();
  }
  return absl::OkStatus();
}

// Runs the same script against any KvStoreClient; returns the gathered rows.
void ExerciseClient(KvStoreClient& client) {
  ASSERT_TRUE(client.CreateSequence(TestRef(5), kShape, 10, absl::Seconds(60)).ok());
  for (uint32_t layer = 0; layer < 2; ++layer) {
    auto committed = PutPatternRows(client, kShape, 5, layer, 0, 70);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(*committed, 70u);
  }
  auto tail = MakePatternRows(kShape, 5, 1, 70, 1);
  ASSERT_EQ(
      *client.Append({.sequence = TestRef(5), .layer = 1, .n_rows = 1, .k = tail.k, .v = tail.v}),
      71u);
  std::vector<uint32_t> idx = {70, 0, 33};
  std::vector<GatherEntry> entries = {
      {.sequence = TestRef(5), .layer = 1, .head = 1, .indices = idx}};
  std::vector<uint8_t> out(GatherBytes(entries, kShape.RowBytes()));
  ASSERT_TRUE(client.Gather(entries, out).ok());
  for (size_t i = 0; i < idx.size(); ++i) {
    EXPECT_TRUE(RowMatches(kShape, 5, 1, 1, idx[i], out.data() + i * kShape.RowBytes()));
  }
  std::vector<RangeEntry> range = {
      {.sequence = TestRef(5), .layer = 0, .head = 0, .start = 60, .n_rows = 10}};
  std::vector<uint8_t> range_out(10 * kShape.RowBytes());
  ASSERT_TRUE(client.RangeRead(range, range_out).ok());
  EXPECT_TRUE(RowMatches(kShape, 5, 0, 0, 69, range_out.data() + 9 * kShape.RowBytes()));
  // Errors are the same codes on both implementations.
  std::vector<uint32_t> far = {71};
  std::vector<GatherEntry> bad = {{.sequence = TestRef(5), .layer = 1, .head = 0, .indices = far}};
  std::vector<uint8_t> one(kShape.RowBytes());
  EXPECT_TRUE(absl::IsOutOfRange(client.Gather(bad, one)));
  EXPECT_TRUE(absl::IsPermissionDenied(client.Lease(TestRef(6), absl::Seconds(1))));
  EXPECT_TRUE(absl::IsAlreadyExists(
      client.CreateSequence(TestRef(5), kShape, 0, absl::ZeroDuration()).status()));
  ASSERT_TRUE(client.Lease(TestRef(5), absl::Seconds(120)).ok());
  auto info = client.GetSequence(TestRef(5));
  ASSERT_TRUE(info.ok());
  EXPECT_GT(info->lease_expiry_unix_ms, absl::ToUnixMillis(absl::Now()));
  EXPECT_EQ(info->shape, kShape);
  auto stats = client.Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sequences, 1u);
  EXPECT_GT(stats->used_bytes, 0u);
  ASSERT_TRUE(client.Release(TestRef(5), absl::ZeroDuration()).ok());
  EXPECT_EQ(client.Stats()->used_bytes, 0u);
}

// A child forked from a released-and-kept parent reads the parent's rows, shares its pages and
// appends its own; errors match on both implementations.
// Attachments through the client: put/get round trip of a multi-page blob, the capability
// check, NOT_FOUND for a layer without one, and a fork inheriting it.
void ExerciseAttachments(KvStoreClient& client) {
  ASSERT_TRUE(client.CreateSequence(TestRef(30), kShape, 0, absl::ZeroDuration()).ok());
  std::vector<uint8_t> blob(3 * 4096 + 5);
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>(i * 13 + 1);
  ASSERT_TRUE(client.PutAttachment(TestRef(30), 1, 0, blob).ok());
  auto got = client.GetAttachment(TestRef(30), 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->rows, 0u);
  EXPECT_EQ(got->bytes, blob);
  EXPECT_TRUE(absl::IsNotFound(client.GetAttachment(TestRef(30), 0).status()));
  const SequenceRef wrong{30, TestCapability(31)};
  EXPECT_TRUE(absl::IsPermissionDenied(client.GetAttachment(wrong, 1).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(client.PutAttachment(wrong, 1, 0, blob)));
  auto fork = client.ForkSequence(TestRef(31), TestRef(30), 0, 0, absl::ZeroDuration());
  ASSERT_TRUE(fork.ok()) << fork.status();
  got = client.GetAttachment(TestRef(31), 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes, blob);
  ASSERT_TRUE(client.Release(TestRef(31), absl::ZeroDuration()).ok());
  ASSERT_TRUE(client.Release(TestRef(30), absl::ZeroDuration()).ok());
}

void ExerciseFork(KvStoreClient& client) {
  // bf16 head_dim 16: 64-byte rows, 64 per 4 KiB page.
  ASSERT_TRUE(client.CreateSequence(TestRef(20), kShape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(PutPatternLayers(client, 20, 150).ok());
  ASSERT_TRUE(client.Release(TestRef(20), absl::Seconds(60)).ok());
  auto fork = client.ForkSequence(TestRef(21), TestRef(20), 140, 200, absl::Seconds(60));
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->rows, 140u);
  EXPECT_EQ(fork->tokens_per_page, 64u);
  EXPECT_EQ(fork->shared_pages, 2u * 4);          // 2 full pages in each of 4 (layer, head)
  EXPECT_EQ(fork->reserved_bytes, 2u * 4 * 4096);  // pages 3 (the copied tail) and 4 of 4
  auto stats = client.Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->shared_pages, 8u);
  EXPECT_EQ(stats->forks, 1u);
  EXPECT_EQ(stats->forked_rows, 140u);
  auto tail = MakePatternRows(kShape, 21, 1, 140, 1);
  ASSERT_EQ(
      *client.Append({.sequence = TestRef(21), .layer = 1, .n_rows = 1, .k = tail.k, .v = tail.v}),
      141u);
  std::vector<uint32_t> idx = {0, 127, 128, 139, 140};
  std::vector<GatherEntry> entries = {
      {.sequence = TestRef(21), .layer = 1, .head = 1, .indices = idx}};
  std::vector<uint8_t> out(GatherBytes(entries, kShape.RowBytes()));
  ASSERT_TRUE(client.Gather(entries, out).ok());
  for (size_t i = 0; i < idx.size(); ++i) {
    EXPECT_TRUE(RowMatches(kShape, idx[i] < 140 ? 20 : 21, 1, 1, idx[i],
                           out.data() + i * kShape.RowBytes()))
        << idx[i];
  }
  EXPECT_TRUE(absl::IsPermissionDenied(
      client.ForkSequence(TestRef(22), TestRef(99), 1, 0, absl::ZeroDuration()).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(
      client.ForkSequence(TestRef(22), {20, TestRef(21).cap}, 1, 0, absl::ZeroDuration())
          .status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      client.ForkSequence({22, Capability{}}, TestRef(20), 1, 0, absl::ZeroDuration()).status()));
  EXPECT_TRUE(absl::IsAlreadyExists(
      client.ForkSequence(TestRef(21), TestRef(20), 1, 0, absl::ZeroDuration()).status()));
  EXPECT_TRUE(absl::IsResourceExhausted(
      client.ForkSequence(TestRef(22), TestRef(20), 1, 1 << 30, absl::ZeroDuration()).status()));
  ASSERT_TRUE(client.Release(TestRef(20), absl::ZeroDuration()).ok());
  ASSERT_TRUE(client.Release(TestRef(21), absl::ZeroDuration()).ok());
  EXPECT_EQ(client.Stats()->used_bytes, 0u);
  EXPECT_EQ(client.Stats()->shared_pages, 0u);
}

// Puts of several layers and gathers of several layers in flight at once, as prefill and
// decode overlap them with compute.
void ExerciseAsync(KvStoreClient& client) {
  const SequenceShape shape{.n_layers = 4, .n_kv_heads = 2, .head_dim = 32, .dtype = DType::kF16};
  ASSERT_TRUE(client.CreateSequence(TestRef(9), shape, 0, absl::ZeroDuration()).ok());
  std::vector<testing::PatternRows> rows;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    rows.push_back(MakePatternRows(shape, 9, layer, 0, 300));
  }
  std::vector<std::unique_ptr<KvStoreOp>> puts;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    puts.push_back(client.StartPutLayer({.sequence = TestRef(9),
                                         .layer = layer,
                                         .start_row = 0,
                                         .n_rows = 300,
                                         .k = rows[layer].k,
                                         .v = rows[layer].v}));
  }
  for (auto& op : puts) {
    auto committed = op->Wait();
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(*committed, 300u);
    EXPECT_TRUE(op->Done());
    EXPECT_TRUE(absl::IsFailedPrecondition(op->Wait().status()));  // once only
  }
  std::vector<uint32_t> idx = {299, 7, 150};
  std::vector<std::vector<GatherEntry>> entries(4);
  std::vector<std::vector<uint8_t>> outs(4);
  std::vector<std::unique_ptr<KvStoreOp>> gathers;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    entries[layer] = {{.sequence = TestRef(9), .layer = layer, .head = 1, .indices = idx}};
    outs[layer].resize(GatherBytes(entries[layer], shape.RowBytes()));
    gathers.push_back(client.StartGather(entries[layer], outs[layer]));
  }
  for (uint32_t layer = 0; layer < 4; ++layer) {
    auto bytes = gathers[layer]->Wait();
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(*bytes, outs[layer].size());
    for (size_t i = 0; i < idx.size(); ++i) {
      EXPECT_TRUE(
          RowMatches(shape, 9, layer, 1, idx[i], outs[layer].data() + i * shape.RowBytes()));
    }
  }
  // An op dropped without Wait() still completes before its buffers go away.
  std::vector<uint8_t> dropped_out(GatherBytes(entries[0], shape.RowBytes()));
  client.StartGather(entries[0], dropped_out).reset();
  EXPECT_TRUE(RowMatches(shape, 9, 0, 1, 299, dropped_out.data()));
  ASSERT_TRUE(client.Release(TestRef(9), absl::ZeroDuration()).ok());
}

TEST(ServiceTest, UcxClientAgainstInProcessServer) {
  std::unique_ptr<StoreServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  auto client = UcxKvStoreClient::Connect(AddressOf(*server));
  ASSERT_TRUE(client.ok()) << client.status();
  ExerciseClient(**client);
  ExerciseAsync(**client);
  ExerciseFork(**client);
  ExerciseAttachments(**client);
}

// A gather that names more rows than the store answers in one reply (an amplification: a few
// bytes of indices asking for a huge reply) is refused naming the limit, and the store keeps
// serving the same client and others.
TEST(ServiceTest, RepliesAboveTheStoresLimitAreRefusedAndServiceGoesOn) {
  StoreServerOptions options;
  options.max_reply_bytes = 64 * kShape.RowBytes();
  std::unique_ptr<StoreServer> server = StartServer(std::move(options));
  ASSERT_NE(server, nullptr);
  auto client = UcxKvStoreClient::Connect(AddressOf(*server));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->CreateSequence(TestRef(5), kShape, 10, absl::Seconds(60)).ok());
  auto rows = MakePatternRows(kShape, 5, 0, 0, 10);
  ASSERT_TRUE((*client)
                  ->PutLayer({.sequence = TestRef(5),
                              .layer = 0,
                              .start_row = 0,
                              .n_rows = 10,
                              .k = rows.k,
                              .v = rows.v})
                  .ok());
  std::vector<uint32_t> many(65, 3);  // one row asked 65 times: 65 rows of reply
  std::vector<GatherEntry> entries = {
      {.sequence = TestRef(5), .layer = 0, .head = 0, .indices = many}};
  std::vector<uint8_t> out(GatherBytes(entries, kShape.RowBytes()));
  absl::Status refused = (*client)->Gather(entries, out);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_reply_bytes"));
  std::vector<RangeEntry> range = {
      {.sequence = TestRef(5), .layer = 0, .head = 0, .start = 0, .n_rows = 10}};
  std::vector<uint8_t> range_out(10 * kShape.RowBytes());
  for (int i = 0; i < 3; ++i) {  // still served, and the refused reply left nothing on loan
    ASSERT_TRUE((*client)->RangeRead(range, range_out).ok());
    EXPECT_TRUE(RowMatches(kShape, 5, 0, 0, 9, range_out.data() + 9 * kShape.RowBytes()));
  }
  many.resize(64);
  entries[0].indices = many;
  out.resize(GatherBytes(entries, kShape.RowBytes()));
  EXPECT_TRUE((*client)->Gather(entries, out).ok());
}

// A store that thins cached sequences (cached_eviction: thin), over gRPC and UCX: GetSequence
// reports the holes and the whole rows, a read of a hole is FAILED_PRECONDITION on the client
// (Gather and RangeRead alike), the whole rows read back, and Stats counts the thinning.
TEST(ServiceTest, ThinnedSequenceOverTheWire) {
  // f32 rows of head_dim 16: 128 bytes, 32 rows per 4 KiB page.
  constexpr SequenceShape shape{
      .n_layers = 1, .n_kv_heads = 1, .head_dim = 16, .dtype = DType::kF32};
  StoreServerOptions options;
  options.store.pool = {.capacity_bytes = 12 * 4096, .page_bytes = 4096};
  options.store.cached_eviction = CachedEviction::kThin;
  absl::StatusOr<std::unique_ptr<StoreServer>> server = StoreServer::Start(std::move(options));
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = UcxKvStoreClient::Connect(AddressOf(**server));
  ASSERT_TRUE(client.ok()) << client.status();
  KvStoreClient& c = **client;
  ASSERT_TRUE(c.CreateSequence(TestRef(1), shape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(PutPatternRows(c, shape, 1, 0, 0, 256).ok());  // 8 pages
  ASSERT_TRUE(c.Release(TestRef(1), absl::Hours(1)).ok());
  // 8 more pages with 4 free: the cached one is thinned (of 8 pages, at least 4 stay; the
  // sink page and the 2 recent ones always), not evicted.
  ASSERT_TRUE(c.CreateSequence(TestRef(2), shape, 256, absl::ZeroDuration()).ok());
  auto info = c.GetSequence(TestRef(1));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->thinned_pages, 4u);
  EXPECT_EQ(info->pages, 4u);
  EXPECT_TRUE(info->intact_rows == 32 || info->intact_rows == 64) << info->intact_rows;
  auto stats = c.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->evictions_thinned, 1u);
  EXPECT_EQ(stats->thinned_pages, 4u);
  EXPECT_EQ(stats->evictions_cached_lru, 0u);

  std::vector<RangeEntry> whole = {
      {.sequence = TestRef(1), .layer = 0, .head = 0, .start = 0, .n_rows = info->intact_rows}};
  std::vector<uint8_t> out(256 * shape.RowBytes());
  ASSERT_TRUE(c.RangeRead(whole, std::span(out).first(info->intact_rows * shape.RowBytes())).ok());
  for (uint64_t r = 0; r < info->intact_rows; ++r) {
    EXPECT_TRUE(RowMatches(shape, 1, 0, 0, r, out.data() + r * shape.RowBytes())) << r;
  }
  std::vector<RangeEntry> all = {
      {.sequence = TestRef(1), .layer = 0, .head = 0, .start = 0, .n_rows = 256}};
  absl::Status st = c.RangeRead(all, out);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("thinned"));
  std::vector<uint32_t> hole = {static_cast<uint32_t>(info->intact_rows)};
  std::vector<GatherEntry> gather = {
      {.sequence = TestRef(1), .layer = 0, .head = 0, .indices = hole}};
  st = c.Gather(gather, std::span(out).first(shape.RowBytes()));
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  // The recent rows stay.
  std::vector<RangeEntry> recent = {
      {.sequence = TestRef(1), .layer = 0, .head = 0, .start = 192, .n_rows = 64}};
  ASSERT_TRUE(c.RangeRead(recent, std::span(out).first(64 * shape.RowBytes())).ok());
  EXPECT_TRUE(RowMatches(shape, 1, 0, 0, 255, out.data() + 63 * shape.RowBytes()));
}

TEST(ServiceTest, FakeClientBehavesTheSame) {
  auto fake = FakeKvStoreClient::Create(SmallStore());
  ASSERT_TRUE(fake.ok());
  ExerciseClient(**fake);
  ExerciseAsync(**fake);
  ExerciseFork(**fake);
  ExerciseAttachments(**fake);
  (*fake)->InjectFailure(absl::UnavailableError("injected"));
  EXPECT_TRUE(absl::IsUnavailable((*fake)->Stats().status()));
  EXPECT_TRUE(absl::IsUnavailable(
      (*fake)->ForkSequence(TestRef(2), TestRef(1), 0, 0, absl::ZeroDuration()).status()));
  (*fake)->InjectFailure(absl::OkStatus());
  EXPECT_TRUE((*fake)->Stats().ok());
}

TEST(ServiceTest, FakeClientMapsItsOwnPoolForPageTables) {
  auto fake = FakeKvStoreClient::Create(SmallStore());
  ASSERT_TRUE(fake.ok());
  KvStoreClient& client = **fake;
  ASSERT_TRUE(client.CreateSequence(TestRef(3), kShape, 0, absl::ZeroDuration()).ok());
  auto table =
      client.ReservePageTable(TestRef(3), 100);  // bf16 d16: 64-byte rows, 64 per 4 KiB page
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->pages_per_head, 2u);
  ASSERT_TRUE(PutPatternLayers(client, 3, 100).ok());
  auto mapping = client.MapLocalPool();
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  EXPECT_NE((*mapping)->base(), (*fake)->store().pool().base());  // a second, read-only view
  EXPECT_EQ((*mapping)->pool_id(), (*fake)->store().pool().pool_id());
  for (uint32_t layer = 0; layer < 2; ++layer) {
    for (uint32_t head = 0; head < 2; ++head) {
      for (uint64_t r = 0; r < 100; ++r) {
        ASSERT_TRUE(RowMatches(kShape, 3, layer, head, r, (*mapping)->Row(*table, layer, head, r)))
            << layer << " " << head << " " << r;
      }
    }
  }
  EXPECT_EQ(client.MapLocalPool()->get(), mapping->get());
  (*fake)->InjectFailure(absl::UnavailableError("injected"));
  EXPECT_TRUE(absl::IsUnavailable(client.ReservePageTable(TestRef(3), 1).status()));
  EXPECT_TRUE(absl::IsUnavailable(client.MapLocalPool().status()));
}

// Bytes that do not decode as the request message get INVALID_ARGUMENT naming the method
// (not gRPC's bare INTERNAL), on every method, and the store keeps serving.
TEST(ServiceTest, UndecodableRequestsAreInvalidArgumentNamingTheMethod) {
  std::unique_ptr<StoreServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  auto channel = grpc::CreateChannel(AddressOf(*server), grpc::InsecureChannelCredentials());
  auto call = [&](const std::string& method, const std::string& bytes) {
    return RawUnaryCall(channel, method, bytes, absl::Seconds(5));
  };
  const std::string garbage = "\xff\xff\xff\xff\x0f garbage";
  for (const char* method :
       {"/kvr.store.v1.KvStore/CreateSequence", "/kvr.store.v1.KvStore/Append",
        "/kvr.store.v1.KvStore/Release", "/kvr.store.v1.KvStore/ReservePageTable",
        "/kvr.store.v1.KvStore/ForkSequence"}) {
    const grpc::Status s = call(method, garbage);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(s.error_message().find(method), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("not a valid"), std::string::npos) << s.error_message();
  }
  // A well-formed (empty) Stats request still answers.
  EXPECT_TRUE(call("/kvr.store.v1.KvStore/Stats", "").ok());
}

TEST(ServiceTest, HealthServiceServesAndExpiredDeadlinesAreRefused) {
  std::unique_ptr<StoreServer> server = StartServer();
  ASSERT_NE(server, nullptr);
  auto channel = grpc::CreateChannel(AddressOf(*server), grpc::InsecureChannelCredentials());
  // grpc.health.v1.Health/Check with an empty HealthCheckRequest; the reply is
  // HealthCheckResponse{status: SERVING (1)} = bytes 08 01. Sent through the generic stub so
  // the test needs no health proto of its own.
  std::string body;
  const grpc::Status status =
      RawUnaryCall(channel, "/grpc.health.v1.Health/Check", "", absl::Seconds(5), &body);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(body, std::string("\x08\x01", 2));

  // A client whose budget is already spent gets DEADLINE_EXCEEDED (gRPC refuses it before
  // sending; the store-side refusal of late data-plane work is covered by the integration
  // test "past deadline" case) and nothing is done on the store.
  UcxClientOptions late;
  late.timeout = absl::Seconds(5);
  auto client = UcxKvStoreClient::Connect(AddressOf(*server), late);
  ASSERT_TRUE(client.ok());
  UcxClientOptions spent;
  spent.timeout = -absl::Seconds(1);  // budget already spent when the call starts
  auto hurried = UcxKvStoreClient::Connect(AddressOf(*server), spent);
  EXPECT_TRUE(absl::IsDeadlineExceeded(hurried.status())) << hurried.status();
  EXPECT_EQ(server->store().Stats().sequences, 0u);
}

}  // namespace
}  // namespace kvr::kv_store::testing
