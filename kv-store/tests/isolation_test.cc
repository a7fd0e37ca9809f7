// Tenant isolation against a real kvr-store process on 127.0.0.1 (UCX over TCP on lo): a second
// client that knows a live sequence's id but not its capability can neither read its rows
// (gather, range read, locate for RMA), nor append, lease, release, inspect or reserve its page
// table, over the data plane or gRPC; every refusal reads exactly like an unknown id; and the
// owner's stream goes on unaffected.

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvr/common/secure_random.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/test_pattern.h"
#include "kvr/kv_store/wire.h"
#include "kvr/proto/convert.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "store_process.h"

// In the test helpers' namespace (test_pattern.h, store_process.h).
namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

constexpr SequenceShape kShape{
    .n_layers = 2, .n_kv_heads = 3, .head_dim = 64, .dtype = DType::kF16};
constexpr uint32_t kPromptRows = 300;

absl::StatusOr<StoreProcess> StartStore(bool rma_reads) {
  return StartLoopbackStore(KVR_STORE_BINARY, {"--rma-reads", rma_reads ? "true" : "false"});
}

std::unique_ptr<UcxKvStoreClient> Connect(int port, const std::string& name) {
  UcxClientOptions options;
  options.name = name;
  options.timeout = absl::Seconds(5);
  options.ucx_config = {{"TLS", "tcp"}, {"NET_DEVICES", "lo"}};
  // Ask for RMA: the store decides whether any rkey exists.
  options.rma_reads = true;
  auto client = UcxKvStoreClient::Connect(absl::StrCat("127.0.0.1:", port), options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

LayerRows Rows(const SequenceRef& ref, uint32_t layer, uint64_t start, uint32_t n,
               testing::PatternRows& keep) {
  keep = MakePatternRows(kShape, ref.id, layer, start, n);
  return {
      .sequence = ref, .layer = layer, .start_row = start, .n_rows = n, .k = keep.k, .v = keep.v};
}

// Every operation a client can try on one sequence, over UCX and gRPC; the status of each.
std::vector<std::pair<std::string, absl::Status>> Attack(UcxKvStoreClient& client,
                                                         store::v1::KvStore::Stub& stub,
                                                         const SequenceRef& ref) {
  std::vector<std::pair<std::string, absl::Status>> out;
  const std::vector<uint32_t> idx = {0, 1, 2, 299};
  const std::vector<GatherEntry> gather = {
      {.sequence = ref, .layer = 0, .head = 0, .indices = idx}};
  std::vector<uint8_t> buf(idx.size() * kShape.RowBytes());
  out.emplace_back("gather (UCX)", client.Gather(gather, buf));
  const std::vector<RangeEntry> range = {
      {.sequence = ref, .layer = 0, .head = 1, .start = 0, .n_rows = 4}};
  out.emplace_back("range read (UCX)", client.RangeRead(range, buf));
  // The first step of an RMA read, sent raw: where do the rows lie?
  wire::Encoded locate =
      wire::EncodeRange(wire::MessageType::kLocateRange, range, absl::InfiniteFuture());
  out.emplace_back(
      "locate range (UCX)",
      client
          .RawCall(static_cast<uint16_t>(wire::MessageType::kLocateRange),
                   {reinterpret_cast<const uint8_t*>(locate.header.data()), locate.header.size()},
                   locate.payload)
          .status());
  testing::PatternRows keep;
  out.emplace_back("append (UCX)", client.Append(Rows(ref, 0, 0, 1, keep)).status());
  out.emplace_back("put at row 0 (UCX)", client.PutLayer(Rows(ref, 1, 0, 1, keep)).status());
  out.emplace_back("lease", client.Lease(ref, absl::Seconds(1)));
  out.emplace_back("get sequence", client.GetSequence(ref).status());
  out.emplace_back("reserve page table", client.ReservePageTable(ref, 1024).status());
  out.emplace_back("release keep", client.Release(ref, absl::Seconds(60)));
  out.emplace_back("release", client.Release(ref, absl::ZeroDuration()));
  // gRPC Append, which the typed client does not use.
  {
    store::v1::AppendRequest req;
    req.set_sequence_id(ref.id);
    req.set_capability(ref.cap.ToBytes());
    req.set_layer(0);
    req.set_at_end(true);
    req.set_n_rows(1);
    req.set_k(std::string(keep.k.begin(), keep.k.end()));
    req.set_v(std::string(keep.v.begin(), keep.v.end()));
    store::v1::AppendResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::Status st = stub.Append(&ctx, req, &resp);
    out.emplace_back("append (gRPC)", proto::FromGrpcStatus(st));
  }
  return out;
}

class IsolationTest : public ::testing::TestWithParam<bool> {};

TEST_P(IsolationTest, ASecondClientWithTheIdButNotTheCapabilityGetsNothing) {
  const bool rma_reads = GetParam();
  auto store = StartStore(rma_reads);
  ASSERT_TRUE(store.ok()) << store.status();
  auto owner = Connect(store->port(), "owner");
  auto other = Connect(store->port(), "other");
  ASSERT_TRUE(owner && other);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", store->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = store::v1::KvStore::NewStub(channel);

  // The store hands out an rkey to its pool only when told to.
  {
    store::v1::GetDataPlaneInfoResponse info;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    ASSERT_TRUE(stub->GetDataPlaneInfo(&ctx, {}, &info).ok());
    EXPECT_EQ(info.pool_rkey().empty(), !rma_reads);
    EXPECT_GT(info.pool_bytes(), 0u);
  }

  // The owner's sequence: a prompt put layer by layer, as prefill does.
  const SequenceRef mine{SecureRandomU64(), Capability::Generate()};
  ASSERT_TRUE(owner->CreateSequence(mine, kShape, kPromptRows + 64, absl::Minutes(5)).ok());
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    testing::PatternRows keep;
    ASSERT_TRUE(owner->PutLayer(Rows(mine, layer, 0, kPromptRows, keep)).ok());
  }
  ASSERT_TRUE(owner->ReservePageTable(mine, kPromptRows + 64).ok());
  absl::StatusOr<SequenceInfo> before = owner->GetSequence(mine);
  ASSERT_TRUE(before.ok()) << before.status();

  // The other client knows the id (say, guessed or leaked), not the capability.
  Capability flipped = mine.cap;
  flipped.bytes[0] ^= 0x80;
  const SequenceId unknown_id = mine.id ^ 0x1;
  const auto unknown = Attack(*other, *stub, {unknown_id, Capability::Generate()});
  for (const auto& [what, cap] : std::vector<std::pair<std::string, Capability>>{
           {"random capability", Capability::Generate()},
           {"no capability", Capability{}},
           {"one bit off", flipped}}) {
    SCOPED_TRACE(what);
    const auto tried = Attack(*other, *stub, {mine.id, cap});
    ASSERT_EQ(tried.size(), unknown.size());
    for (size_t i = 0; i < tried.size(); ++i) {
      const auto& [op, st] = tried[i];
      if (op == "locate range (UCX)" && !rma_reads) {
        // No RMA at all on this store: the locate message is refused for everyone.
        EXPECT_TRUE(absl::IsFailedPrecondition(st)) << op << ": " << st;
        continue;
      }
      EXPECT_TRUE(absl::IsPermissionDenied(st)) << op << ": " << st;
      EXPECT_THAT(st.message(), HasSubstr("with this capability")) << op;
      // Word for word what an unknown id gets (but for the id itself and the client's own
      // prefix, which names the store).
      EXPECT_EQ(st.message(),
                absl::StrReplaceAll(unknown[i].second.message(),
                                    {{absl::StrCat(unknown_id), absl::StrCat(mine.id)}}))
          << op;
      EXPECT_EQ(st.code(), unknown[i].second.code()) << op;
    }
  }

  // Nothing changed, and the owner's stream goes on: decode-like appends, then every row reads
  // back bit-exact by gather and range read.
  absl::StatusOr<SequenceInfo> after = owner->GetSequence(mine);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->committed_rows, before->committed_rows);
  EXPECT_EQ(after->pages, before->pages);
  EXPECT_EQ(after->lease_expiry_unix_ms, before->lease_expiry_unix_ms);
  EXPECT_FALSE(after->released_kept);
  for (uint32_t step = 0; step < 8; ++step) {
    for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
      testing::PatternRows keep;
      absl::StatusOr<uint64_t> rows = owner->Append(Rows(mine, layer, kPromptRows + step, 1, keep));
      ASSERT_TRUE(rows.ok()) << rows.status();
      EXPECT_EQ(*rows, kPromptRows + step + 1);
    }
  }
  const uint32_t total = kPromptRows + 8;
  std::vector<uint32_t> all(total);
  for (uint32_t i = 0; i < total; ++i) all[i] = i;
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    std::vector<GatherEntry> entries;
    std::vector<RangeEntry> ranges;
    for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
      entries.push_back({.sequence = mine, .layer = layer, .head = h, .indices = all});
      ranges.push_back({.sequence = mine, .layer = layer, .head = h, .start = 0, .n_rows = total});
    }
    std::vector<uint8_t> gathered(GatherBytes(entries, kShape.RowBytes()));
    ASSERT_TRUE(owner->Gather(entries, gathered).ok());
    std::vector<uint8_t> ranged(gathered.size());
    ASSERT_TRUE(owner->RangeRead(ranges, ranged).ok());
    EXPECT_TRUE(gathered == ranged);
    size_t bad = 0;
    for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
      for (uint32_t r = 0; r < total; ++r) {
        const size_t at = (size_t{h} * total + r) * kShape.RowBytes();
        if (!RowMatches(kShape, mine.id, layer, h, r, gathered.data() + at)) ++bad;
      }
    }
    EXPECT_EQ(bad, 0u) << "layer " << layer;
  }
  if (rma_reads) {
    // The owner may still locate its own rows for RMA.
    const std::vector<RangeEntry> range = {
        {.sequence = mine, .layer = 0, .head = 0, .start = 0, .n_rows = 4}};
    wire::Encoded locate =
        wire::EncodeRange(wire::MessageType::kLocateRange, range, absl::InfiniteFuture());
    EXPECT_TRUE(owner
                    ->RawCall(static_cast<uint16_t>(wire::MessageType::kLocateRange),
                              {reinterpret_cast<const uint8_t*>(locate.header.data()),
                               locate.header.size()},
                              locate.payload)
                    .ok());
  }
  EXPECT_TRUE(owner->Release(mine, absl::ZeroDuration()).ok());
}

INSTANTIATE_TEST_SUITE_P(RmaReads, IsolationTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "RmaOn" : "RmaOff";
                         });

}  // namespace
}  // namespace kvr::kv_store::testing
