#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"

#include "absl/synchronization/notification.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "conversions.h"
#include "grpcpp/grpcpp.h"
#include "kvr/common/status.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/wire.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "kvr/transport/ucx.h"
#include "local_pool_socket.h"

namespace kvr::kv_store {

namespace v1 = ::kvr::store::v1;
using wire::MessageType;

namespace {

// A request naming the sequence of `ref` with its capability.
template <typename Request>
Request RequestFor(const SequenceRef& ref) {
  Request req;
  req.set_sequence_id(ref.id);
  req.set_capability(ref.cap.ToBytes());
  return req;
}

}  // namespace

struct UcxKvStoreClient::Impl {
  // A read whose peer died while its reply was streaming in: the transport keeps such a call
  // open until UCX releases the receive, which UCX 1.13 over TCP may never do once the
  // endpoint is force-closed (seen in the kill-the-store test). The request payload is
  // parked here until the call finishes or the worker is gone.
  struct Abandoned {
    transport::PendingCall call;
    std::shared_ptr<const std::vector<uint8_t>> request_payload;
  };

  UcxClientOptions options;
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvStore::Stub> stub;
  // Declared before the UCX objects so that it is destroyed after the worker has shut down.
  absl::Mutex graveyard_mu;
  std::vector<Abandoned> graveyard ABSL_GUARDED_BY(graveyard_mu);
  // Destroyed in reverse: rkey and endpoint before the worker, the worker before the context.
  std::optional<transport::Context> context;
  std::optional<transport::Worker> worker;
  std::optional<transport::Endpoint> endpoint;
  std::optional<transport::RemoteKey> rkey;
  uint64_t pool_base = 0;
  // From GetDataPlaneInfo, for MapLocalPool.
  uint64_t pool_bytes = 0;
  uint64_t page_bytes = 0;
  std::string local_socket;
  std::string host_id;
  std::string pool_id;
  absl::Mutex local_pool_mu;
  std::shared_ptr<const LocalPoolMapping> local_pool ABSL_GUARDED_BY(local_pool_mu);
  std::string instance_id;  // of the store process, from GetDataPlaneInfo

  // RMA gathers: where the rows of a (sequence, layer, KV head) lie in the store's pool, as
  // the store located them for rows [0, rows). Committed rows are immutable and stay in their
  // pages while the sequence is held, so a reader locates each row once; the key carries the
  // capability, so a new sequence under a reused id is located afresh.
  struct Located {
    uint64_t rows = 0;
    uint64_t row_bytes = 0;
    std::vector<uint64_t> first_row;    // per run of contiguous rows: its first row
    std::vector<uint64_t> pool_offset;  // and where that row starts in the pool
  };
  using LocatedKey =
      std::tuple<uint64_t, uint32_t, uint32_t, std::array<uint8_t, Capability::kBytes>>;
  absl::Mutex located_mu;
  absl::flat_hash_map<LocatedKey, Located> located ABSL_GUARDED_BY(located_mu);

  absl::Time Deadline() const { return absl::Now() + options.timeout; }

  void Prepare(grpc::ClientContext& ctx) const {
    ctx.set_deadline(absl::ToChronoTime(Deadline()));
  }

  // A control-plane call under the client's timeout; its errors name the store and `method`.
  template <typename Request, typename Response>
  absl::Status Call(grpc::Status (v1::KvStore::Stub::*rpc)(grpc::ClientContext*, const Request&,
                                                           Response*),
                    const char* method, const Request& req, Response* resp) const {
    grpc::ClientContext ctx;
    Prepare(ctx);
    return FromGrpc(((*stub).*rpc)(&ctx, req, resp),
                    absl::StrCat("kvr-store ", target, " ", method));
  }

  absl::Status Annotate(const absl::Status& st) const {
    return absl::Status(st.code(), absl::StrCat("kvr-store ", target, ": ", st.message()));
  }

  // Checks a reply against the request type and the expected payload size.
  absl::StatusOr<wire::ReplyHeader> CheckReply(MessageType type,
                                               const transport::Response& resp,
                                               size_t expected) const {
    KVR_ASSIGN_OR_RETURN(wire::ReplyHeader reply,
                         wire::ParseReply(transport::AsBytes(resp.header), type));
    if (reply.payload_bytes != expected || resp.payload_size != expected) {
      return absl::InternalError(absl::StrFormat(
          "kvr-store %s replied with %d payload bytes (header says %d), expected %d", target,
          resp.payload_size, reply.payload_bytes, expected));
    }
    return reply;
  }

  // A small round trip (write, locate): the transport's own deadline handling suffices.
  absl::StatusOr<transport::Response> CallSmall(MessageType type, std::string_view header,
                                                std::vector<transport::ByteView> payload,
                                                absl::Time deadline) {
    transport::CallOptions call;
    call.deadline = deadline;
    absl::StatusOr<transport::Response> resp = endpoint->CallSync(
        static_cast<transport::AmId>(type), transport::AsBytes(header), std::move(payload),
        std::move(call));
    if (!resp.ok()) return Annotate(resp.status());
    return resp;
  }

  // Starts a data-plane call whose reply payload (if any) lands in `out` (zero-copy
  // rendezvous). `payload` views memory that stays valid until the op is done: `owned` (the
  // encoded request) is held by the op, the rest is the caller's.
  std::unique_ptr<KvStoreOp> Start(MessageType type, std::string header,
                                   std::shared_ptr<const std::vector<uint8_t>> owned,
                                   std::vector<transport::ByteView> payload,
                                   std::span<uint8_t> out, absl::Time deadline);

  // The pool segments of `range` (kLocateRange, answered only for the sequence's capability).
  absl::StatusOr<std::vector<wire::SegmentWire>> Locate(const RangeEntry& range,
                                                        absl::Time deadline) {
    wire::Encoded enc = wire::EncodeRange(MessageType::kLocateRange, {&range, 1}, deadline);
    absl::StatusOr<transport::Response> resp =
        CallSmall(MessageType::kLocateRange, enc.header, {enc.payload}, deadline);
    if (!resp.ok()) return resp.status();
    KVR_ASSIGN_OR_RETURN(wire::ReplyHeader reply, wire::ParseReply(transport::AsBytes(resp->header),
                                                                   MessageType::kLocateRange));
    if (resp->payload.size() != reply.value * sizeof(wire::SegmentWire)) {
      return absl::InternalError("kvr-store sent a malformed segment list");
    }
    std::vector<wire::SegmentWire> segments(reply.value);
    if (!segments.empty()) {
      std::memcpy(segments.data(), resp->payload.data(), resp->payload.size());
    }
    return segments;
  }

  // Locates rows [loc.rows, need) of `entry`'s (sequence, layer, head) into `loc`, which is
  // left unchanged on an error.
  absl::Status Extend(const GatherEntry& entry, uint64_t need, absl::Time deadline, Located& loc)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(located_mu);
  // Forgets where a sequence's rows lie (it is released: its pages may be reused).
  void Forget(const SequenceRef& ref) {
    absl::MutexLock lock(&located_mu);
    absl::erase_if(located, [&](const auto& kv) {
      return std::get<0>(kv.first) == ref.id && std::get<3>(kv.first) == ref.cap.bytes;
    });
  }

  // The pieces of an RMA gather of `entries` into `out`, locating the rows not located yet.
  absl::StatusOr<std::vector<transport::GetPiece>> PlanGather(std::span<const GatherEntry> entries,
                                                              std::span<uint8_t> out,
                                                              absl::Time deadline);

  // Waits with `wait_for(poll)` (true once done) while the endpoint works. Once it has failed,
  // waits at most a short grace period: the peer is gone, so no further byte can land in the
  // caller's buffer, and the caller gets UNAVAILABLE now instead of a hang (the transport would
  // otherwise hold a call until UCX releases a rendezvous receive, which UCX 1.13 over TCP may
  // never do, and a get from a dead store may never complete). OK once done; else the failure.
  template <typename WaitFor>
  absl::Status AwaitWhileAlive(WaitFor wait_for) const {
    constexpr absl::Duration kPoll = absl::Milliseconds(50);
    constexpr absl::Duration kGrace = absl::Milliseconds(500);
    std::optional<absl::Time> failed_since;
    while (!wait_for(kPoll)) {
      absl::Status health = endpoint->health();
      if (health.ok()) continue;
      const absl::Time now = absl::Now();
      if (!failed_since) failed_since = now;
      if (now - *failed_since >= kGrace) return Annotate(health);
    }
    return absl::OkStatus();
  }

  // Parks a call abandoned after its endpoint failed (see Abandoned).
  void Abandon(transport::PendingCall call,
               std::shared_ptr<const std::vector<uint8_t>> owned) {
    absl::MutexLock lock(&graveyard_mu);
    std::erase_if(graveyard, [](const Abandoned& a) {
      return a.call.state() == transport::OpState::kDone;
    });
    graveyard.push_back({std::move(call), std::move(owned)});
  }
};

namespace {

// A data-plane call in flight; waits as Impl::AwaitWhileAlive says.
class UcxOp final : public KvStoreOp {
 public:
  UcxOp(UcxKvStoreClient::Impl* impl, MessageType type, transport::PendingCall call,
        std::shared_ptr<absl::Notification> done,
        std::shared_ptr<const std::vector<uint8_t>> owned, size_t expected_bytes)
      : impl_(impl), type_(type), call_(std::move(call)), done_(std::move(done)),
        owned_(std::move(owned)), expected_bytes_(expected_bytes) {}
  ~UcxOp() override {
    if (!waited_) (void)Wait();
  }

  bool Done() const override { return done_->HasBeenNotified(); }

  absl::StatusOr<uint64_t> Wait() override;

 private:
  UcxKvStoreClient::Impl* impl_;
  MessageType type_;
  transport::PendingCall call_;
  std::shared_ptr<absl::Notification> done_;
  std::shared_ptr<const std::vector<uint8_t>> owned_;
  size_t expected_bytes_;
  bool waited_ = false;
};

}  // namespace

absl::StatusOr<uint64_t> UcxOp::Wait() {
  if (waited_) return absl::FailedPreconditionError("KvStoreOp::Wait called twice");
  waited_ = true;
  const absl::Status alive = impl_->AwaitWhileAlive(
      [this](absl::Duration poll) { return done_->WaitForNotificationWithTimeout(poll); });
  if (!alive.ok()) {
    impl_->Abandon(std::move(call_), std::move(owned_));
    return alive;
  }
  absl::StatusOr<transport::Response> resp = call_.Wait();
  if (!resp.ok()) return impl_->Annotate(resp.status());
  KVR_ASSIGN_OR_RETURN(wire::ReplyHeader reply, impl_->CheckReply(type_, *resp, expected_bytes_));
  return type_ == MessageType::kWrite ? reply.value : uint64_t{expected_bytes_};
}

std::unique_ptr<KvStoreOp> UcxKvStoreClient::Impl::Start(
    MessageType type, std::string header, std::shared_ptr<const std::vector<uint8_t>> owned,
    std::vector<transport::ByteView> payload, std::span<uint8_t> out, absl::Time deadline) {
  auto done = std::make_shared<absl::Notification>();
  transport::CallOptions call;
  call.deadline = deadline;
  call.reply_buffer = out;
  call.on_done = [done] { done->Notify(); };
  transport::PendingCall pending =
      endpoint->Call(static_cast<transport::AmId>(type), transport::AsBytes(header),
                     std::move(payload), std::move(call));
  return std::make_unique<UcxOp>(this, type, std::move(pending), std::move(done),
                                 std::move(owned), out.size());
}

UcxKvStoreClient::UcxKvStoreClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxKvStoreClient::~UcxKvStoreClient() = default;

absl::StatusOr<std::unique_ptr<UcxKvStoreClient>> UcxKvStoreClient::Connect(
    const std::string& target, UcxClientOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->target = target;
  // Page tables of long sequences are large (128K tokens of a Llama-3-8B shape: 262144 page
  // ids, about 1 MiB); gRPC's default 4 MiB receive limit would cap the context.
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(256 << 20);
  impl->channel = impl->options.security.CreateChannel(target, channel_args);
  impl->stub = v1::KvStore::NewStub(impl->channel);

  grpc::ClientContext ctx;
  const absl::Duration wait = impl->options.connect_timeout > absl::ZeroDuration()
                                  ? impl->options.connect_timeout
                                  : impl->options.timeout;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + wait));
  ctx.set_wait_for_ready(true);  // the store may still be starting
  v1::GetDataPlaneInfoResponse info;
  KVR_RETURN_IF_ERROR(FromGrpc(impl->stub->GetDataPlaneInfo(&ctx, {}, &info),
                               absl::StrCat("kvr-store ", target, " GetDataPlaneInfo")));
  if (info.wire_version() < wire::kVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "kvr-store %s speaks wire version %d, this client needs %d", target,
        info.wire_version(), wire::kVersion));
  }
  transport::ContextOptions ctx_options;
  ctx_options.ucx_config = impl->options.ucx_config;
  KVR_ASSIGN_OR_RETURN(transport::Context context, transport::Context::Create(ctx_options));
  impl->context.emplace(std::move(context));
  transport::WorkerOptions worker_options;
  worker_options.name = impl->options.name;
  KVR_ASSIGN_OR_RETURN(transport::Worker worker,
                       transport::Worker::Create(*impl->context, worker_options));
  impl->worker.emplace(std::move(worker));
  KVR_ASSIGN_OR_RETURN(transport::Endpoint endpoint,
                       impl->worker->Connect(info.worker_address(), "kvr-store " + target));
  impl->endpoint.emplace(std::move(endpoint));
  impl->pool_base = info.pool_base();
  impl->pool_bytes = info.pool_bytes();
  impl->page_bytes = info.page_bytes();
  impl->local_socket = info.local_socket();
  impl->host_id = info.host_id();
  impl->pool_id = info.pool_id();
  impl->instance_id = info.instance_id();
  if (impl->options.rma_reads && !info.pool_rkey().empty()) {
    // RMA only pays where it is native; over TCP UCX emulates it at a fraction of AM speed.
    // The store hands out an rkey only when it runs with --rma-reads.
    absl::StatusOr<bool> native = impl->endpoint->HasNativeRma();
    if (native.ok() && *native) {
      KVR_ASSIGN_OR_RETURN(transport::RemoteKey rkey,
                           impl->endpoint->UnpackRkey(info.pool_rkey()));
      impl->rkey.emplace(std::move(rkey));
    }
  }
  return std::unique_ptr<UcxKvStoreClient>(new UcxKvStoreClient(std::move(impl)));
}

absl::Status UcxKvStoreClient::Health() const {
  absl::Status health = impl_->endpoint->health();
  return health.ok() ? health : impl_->Annotate(health);
}

std::string UcxKvStoreClient::instance_id() const { return impl_->instance_id; }

std::string UcxKvStoreClient::range_read_path() const { return impl_->rkey ? "rma" : "am"; }

absl::StatusOr<std::vector<std::string>> UcxKvStoreClient::DataPlaneTransports() const {
  return impl_->endpoint->Transports();
}

absl::StatusOr<CreateResult> UcxKvStoreClient::CreateSequence(const SequenceRef& ref,
                                                              const SequenceShape& shape,
                                                              uint64_t expected_tokens,
                                                              absl::Duration lease) {
  auto req = RequestFor<v1::CreateSequenceRequest>(ref);
  ToProto(shape, req.mutable_shape());
  req.set_expected_tokens(expected_tokens);
  req.set_lease_ms(absl::ToInt64Milliseconds(lease));
  v1::CreateSequenceResponse resp;
  KVR_RETURN_IF_ERROR(
      impl_->Call(&v1::KvStore::Stub::CreateSequence, "CreateSequence", req, &resp));
  return CreateResult{.tokens_per_page = resp.tokens_per_page(),
                      .reserved_bytes = resp.reserved_bytes()};
}

absl::StatusOr<ForkResult> UcxKvStoreClient::ForkSequence(const SequenceRef& child,
                                                          const SequenceRef& parent,
                                                          uint64_t rows, uint64_t expected_tokens,
                                                          absl::Duration lease) {
  if (lease < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lease must not be negative");
  }
  v1::ForkSequenceRequest req;
  req.set_child_sequence_id(child.id);
  req.set_child_capability(child.cap.ToBytes());
  req.set_parent_sequence_id(parent.id);
  req.set_parent_capability(parent.cap.ToBytes());
  req.set_rows(rows);
  req.set_expected_tokens(expected_tokens);
  req.set_lease_ms(absl::ToInt64Milliseconds(lease));
  v1::ForkSequenceResponse resp;
  KVR_RETURN_IF_ERROR(impl_->Call(&v1::KvStore::Stub::ForkSequence, "ForkSequence", req, &resp));
  return ForkResult{.tokens_per_page = resp.tokens_per_page(),
                    .reserved_bytes = resp.reserved_bytes(),
                    .rows = resp.rows(),
                    .shared_pages = resp.shared_pages()};
}

std::unique_ptr<KvStoreOp> UcxKvStoreClient::StartPutLayer(const LayerRows& rows) {
  const absl::Time deadline = impl_->Deadline();
  return impl_->Start(MessageType::kWrite, wire::EncodeWriteHeader(rows, deadline), nullptr,
                      {rows.k, rows.v}, {}, deadline);
}

namespace {

// An op that failed before anything was sent.
class FailedOp final : public KvStoreOp {
 public:
  explicit FailedOp(absl::Status status) : status_(std::move(status)) {}
  bool Done() const override { return true; }
  absl::StatusOr<uint64_t> Wait() override {
    if (waited_) return absl::FailedPreconditionError("KvStoreOp::Wait called twice");
    waited_ = true;
    return status_;
  }

 private:
  absl::Status status_;
  bool waited_ = false;
};

// An RMA gather in flight: the gets of its pieces as one transfer.
class RmaGatherOp final : public KvStoreOp {
 public:
  RmaGatherOp(UcxKvStoreClient::Impl* impl, transport::PendingTransfer transfer, uint64_t bytes)
      : impl_(impl), transfer_(std::move(transfer)), bytes_(bytes) {}
  ~RmaGatherOp() override {
    if (!waited_) (void)Wait();
  }
  bool Done() const override { return transfer_.state() == transport::OpState::kDone; }
  absl::StatusOr<uint64_t> Wait() override;

 private:
  UcxKvStoreClient::Impl* impl_;
  transport::PendingTransfer transfer_;
  uint64_t bytes_;
  bool waited_ = false;
};

}  // namespace

absl::StatusOr<uint64_t> RmaGatherOp::Wait() {
  if (waited_) return absl::FailedPreconditionError("KvStoreOp::Wait called twice");
  waited_ = true;
  // A get from a dead store may never complete; its in-flight state is owned by the transfer,
  // so giving up on it here needs nothing parked.
  KVR_RETURN_IF_ERROR(
      impl_->AwaitWhileAlive([this](absl::Duration poll) { return transfer_.WaitFor(poll); }));
  absl::Status st = transfer_.Wait();
  if (!st.ok()) return impl_->Annotate(st);
  return bytes_;
}

absl::Status UcxKvStoreClient::Impl::Extend(const GatherEntry& entry, uint64_t need,
                                            absl::Time deadline, Located& loc) {
  const uint64_t rows = need - loc.rows;
  const RangeEntry range{entry.sequence, entry.layer, entry.head, loc.rows, rows};
  KVR_ASSIGN_OR_RETURN(const std::vector<wire::SegmentWire> segments, Locate(range, deadline));
  uint64_t bytes = 0;
  for (const wire::SegmentWire& seg : segments) bytes += seg.bytes;
  if (bytes == 0 || bytes % rows != 0 || (loc.row_bytes != 0 && bytes / rows != loc.row_bytes)) {
    return absl::InternalError(
        absl::StrFormat("kvr-store %s located %d bytes for %d rows of sequence %d layer %d head %d",
                        target, bytes, rows, entry.sequence.id, entry.layer, entry.head));
  }
  const uint64_t row_bytes = bytes / rows;
  for (const wire::SegmentWire& seg : segments) {
    if (seg.bytes % row_bytes != 0) {
      return absl::InternalError(
          absl::StrFormat("kvr-store %s located a segment of %d bytes, not whole rows of %d",
                          target, seg.bytes, row_bytes));
    }
  }
  loc.row_bytes = row_bytes;
  uint64_t row = loc.rows;
  for (const wire::SegmentWire& seg : segments) {
    loc.first_row.push_back(row);
    loc.pool_offset.push_back(seg.pool_offset);
    row += seg.bytes / row_bytes;
  }
  loc.rows = need;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<transport::GetPiece>> UcxKvStoreClient::Impl::PlanGather(
    std::span<const GatherEntry> entries, std::span<uint8_t> out, absl::Time deadline) {
  std::vector<transport::GetPiece> pieces;
  size_t at = 0;
  absl::MutexLock lock(&located_mu);
  // A reader holds a bounded number of sequences; forget them all past this many heads.
  if (located.size() > (size_t{1} << 16)) located.clear();
  for (size_t e = 0; e < entries.size(); ++e) {
    const GatherEntry& entry = entries[e];
    if (entry.indices.empty()) continue;
    const LocatedKey key(entry.sequence.id, entry.layer, entry.head, entry.sequence.cap.bytes);
    Located& loc = located[key];
    const uint64_t need =
        uint64_t{*std::max_element(entry.indices.begin(), entry.indices.end())} + 1;
    if (need > loc.rows) {
      // Locate the rows not located yet (the store refuses rows it does not hold); `loc` takes
      // them only once they are whole rows, and any failure forgets the head.
      absl::Status located_ok = Extend(entry, need, deadline, loc);
      if (!located_ok.ok()) {
        located.erase(key);
        return located_ok;
      }
    }
    for (uint32_t index : entry.indices) {
      if (loc.row_bytes > out.size() - at) {
        return absl::InvalidArgumentError(
            absl::StrFormat("gather output buffer has %d bytes, the rows need more", out.size()));
      }
      // The run holding the row: the last whose first row is <= index.
      const size_t run =
          std::upper_bound(loc.first_row.begin(), loc.first_row.end(), uint64_t{index}) -
          loc.first_row.begin() - 1;
      const uint64_t remote =
          pool_base + loc.pool_offset[run] + (index - loc.first_row[run]) * loc.row_bytes;
      transport::GetPiece* last = pieces.empty() ? nullptr : &pieces.back();
      if (last != nullptr && last->remote_address + last->local.size() == remote &&
          last->local.data() + last->local.size() == out.data() + at) {
        last->local = {last->local.data(), last->local.size() + loc.row_bytes};  // coalesced
      } else {
        pieces.push_back({remote, out.subspan(at, loc.row_bytes)});
      }
      at += loc.row_bytes;
    }
  }
  if (at != out.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("gather output buffer has %d bytes, the rows need %d", out.size(), at));
  }
  return pieces;
}

std::unique_ptr<KvStoreOp> UcxKvStoreClient::StartGather(std::span<const GatherEntry> entries,
                                                         std::span<uint8_t> out) {
  const absl::Time deadline = impl_->Deadline();
  if (impl_->rkey) {
    // RMA: the rows' places once per (sequence, layer, head), then one batch of gets straight
    // from the store's pool, no store CPU in the copy.
    absl::StatusOr<std::vector<transport::GetPiece>> pieces =
        impl_->PlanGather(entries, out, deadline);
    if (!pieces.ok()) return std::make_unique<FailedOp>(pieces.status());
    return std::make_unique<RmaGatherOp>(
        impl_.get(), impl_->endpoint->Get(*pieces, *impl_->rkey, deadline), out.size());
  }
  wire::Encoded enc = wire::EncodeGather(entries, deadline);
  auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(enc.payload));
  std::vector<transport::ByteView> payload = {transport::ByteView(*owned)};
  return impl_->Start(MessageType::kGather, std::move(enc.header), std::move(owned),
                      std::move(payload), out, deadline);
}

absl::Status UcxKvStoreClient::RangeRead(std::span<const RangeEntry> ranges,
                                         std::span<uint8_t> out) {
  const absl::Time deadline = impl_->Deadline();
  if (!impl_->rkey) {
    wire::Encoded enc = wire::EncodeRange(MessageType::kRangeRead, ranges, deadline);
    auto owned = std::make_shared<const std::vector<uint8_t>>(std::move(enc.payload));
    std::vector<transport::ByteView> payload = {transport::ByteView(*owned)};
    return impl_->Start(MessageType::kRangeRead, std::move(enc.header), std::move(owned),
                        std::move(payload), out, deadline)
        ->Wait()
        .status();
  }
  // RMA: ask where each range lies (one small AM, which the store answers only for the
  // sequence's capability), then read the pages directly, every segment's get in one batch.
  // The rows are committed, hence immutable, and stay mapped while the sequence is held.
  size_t offset = 0;
  std::vector<transport::GetPiece> pieces;
  for (const RangeEntry& range : ranges) {
    KVR_ASSIGN_OR_RETURN(const std::vector<wire::SegmentWire> segments,
                         impl_->Locate(range, deadline));
    for (const wire::SegmentWire& seg : segments) {
      if (seg.bytes > out.size() - offset) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "range output buffer has %d bytes, the rows need more", out.size()));
      }
      pieces.push_back({impl_->pool_base + seg.pool_offset, out.subspan(offset, seg.bytes)});
      offset += seg.bytes;
    }
  }
  if (offset != out.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "range output buffer has %d bytes, the rows need %d", out.size(), offset));
  }
  return RmaGatherOp(impl_.get(), impl_->endpoint->Get(pieces, *impl_->rkey, deadline), out.size())
      .Wait()
      .status();
}

absl::Status UcxKvStoreClient::Release(const SequenceRef& ref, absl::Duration keep) {
  impl_->Forget(ref);
  auto req = RequestFor<v1::ReleaseRequest>(ref);
  req.set_keep_ms(absl::ToInt64Milliseconds(keep));
  v1::ReleaseResponse resp;
  return impl_->Call(&v1::KvStore::Stub::Release, "Release", req, &resp);
}

absl::Status UcxKvStoreClient::Lease(const SequenceRef& ref, absl::Duration lease) {
  auto req = RequestFor<v1::LeaseRequest>(ref);
  req.set_lease_ms(absl::ToInt64Milliseconds(lease));
  v1::LeaseResponse resp;
  return impl_->Call(&v1::KvStore::Stub::Lease, "Lease", req, &resp);
}

absl::StatusOr<SequenceInfo> UcxKvStoreClient::GetSequence(const SequenceRef& ref) {
  auto req = RequestFor<v1::GetSequenceRequest>(ref);
  v1::GetSequenceResponse resp;
  KVR_RETURN_IF_ERROR(impl_->Call(&v1::KvStore::Stub::GetSequence, "GetSequence", req, &resp));
  SequenceInfo info;
  KVR_ASSIGN_OR_RETURN(info.shape, FromProto(resp.shape()));
  info.committed_rows.assign(resp.committed_rows().begin(), resp.committed_rows().end());
  info.tokens_per_page = resp.tokens_per_page();
  info.pages = resp.pages();
  info.lease_expiry_unix_ms = resp.lease_expiry_unix_ms();
  info.released_kept = resp.released_kept();
  info.thinned_pages = resp.thinned_pages();
  // A store that does not thin leaves it 0: then every committed row is whole.
  info.intact_rows = resp.intact_rows();
  if (info.thinned_pages == 0) {
    info.intact_rows = ~uint64_t{0};
    for (uint64_t rows : info.committed_rows) info.intact_rows = std::min(info.intact_rows, rows);
  }
  return info;
}

absl::StatusOr<StoreStats> UcxKvStoreClient::Stats() {
  v1::StatsResponse resp;
  const v1::StatsRequest req;
  KVR_RETURN_IF_ERROR(impl_->Call(&v1::KvStore::Stub::Stats, "Stats", req, &resp));
  return FromProto(resp);
}

absl::StatusOr<PageTable> UcxKvStoreClient::ReservePageTable(const SequenceRef& ref,
                                                             uint64_t rows) {
  auto req = RequestFor<v1::ReservePageTableRequest>(ref);
  req.set_rows(rows);
  v1::ReservePageTableResponse resp;
  KVR_RETURN_IF_ERROR(
      impl_->Call(&v1::KvStore::Stub::ReservePageTable, "ReservePageTable", req, &resp));
  absl::StatusOr<PageTable> table = FromProto(resp);
  if (!table.ok()) return impl_->Annotate(table.status());
  if (table->page_bytes != impl_->page_bytes) {
    return impl_->Annotate(absl::InternalError(absl::StrFormat(
        "page table in pages of %d bytes, the pool has %d", table->page_bytes, impl_->page_bytes)));
  }
  return table;
}

absl::Status UcxKvStoreClient::PutAttachment(const SequenceRef& ref, uint32_t layer, uint64_t rows,
                                             std::span<const uint8_t> bytes) {
  auto req = RequestFor<v1::PutAttachmentRequest>(ref);
  req.set_layer(layer);
  req.set_rows(rows);
  req.set_data(bytes.data(), bytes.size());
  v1::PutAttachmentResponse resp;
  return impl_->Call(&v1::KvStore::Stub::PutAttachment, "PutAttachment", req, &resp);
}

absl::StatusOr<Attachment> UcxKvStoreClient::GetAttachment(const SequenceRef& ref, uint32_t layer) {
  auto req = RequestFor<v1::GetAttachmentRequest>(ref);
  req.set_layer(layer);
  v1::GetAttachmentResponse resp;
  KVR_RETURN_IF_ERROR(impl_->Call(&v1::KvStore::Stub::GetAttachment, "GetAttachment", req, &resp));
  Attachment out;
  out.rows = resp.rows();
  out.bytes.assign(resp.data().begin(), resp.data().end());
  return out;
}

absl::StatusOr<std::shared_ptr<const LocalPoolMapping>> UcxKvStoreClient::MapLocalPool() {
  absl::MutexLock lock(&impl_->local_pool_mu);
  if (impl_->local_pool != nullptr) return impl_->local_pool;
  const std::string& target = impl_->target;
  absl::StatusOr<std::string> own_host = ReadHostId();
  if (!own_host.ok()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("store %s: cannot tell whether it is on this host: %s", target,
                        own_host.status().message()));
  }
  if (impl_->host_id != *own_host) {
    return absl::FailedPreconditionError(
        absl::StrFormat("store %s is not on this host (its boot id '%s', ours '%s')", target,
                        impl_->host_id, *own_host));
  }
  if (impl_->local_socket.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "store %s offers no local socket (start it with --local-socket PATH)", target));
  }
  absl::StatusOr<ReceivedPool> received = ReceivePoolFd(impl_->local_socket, impl_->Deadline());
  if (!received.ok()) {
    return absl::Status(received.status().code(),
                        absl::StrCat("store ", target, ": ", received.status().message()));
  }
  // The fd is only needed until it is mapped.
  const int fd = received->fd;
  const LocalPoolHello& hello = received->hello;
  const std::string pool_id = absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(hello.pool_id), sizeof(hello.pool_id)));
  // Whoever serves the path must be the store this client talks to, with the pool it
  // announced; otherwise page ids would index someone else's memory.
  if (pool_id != impl_->pool_id || hello.page_bytes != impl_->page_bytes ||
      hello.pool_bytes < impl_->pool_bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrFormat(
        "store %s: the local socket %s hands over pool %s (%d bytes, pages of %d bytes), not "
        "the store's pool %s (%d bytes, pages of %d bytes)",
        target, impl_->local_socket, pool_id, hello.pool_bytes, hello.page_bytes, impl_->pool_id,
        impl_->pool_bytes, impl_->page_bytes));
  }
  absl::StatusOr<LocalPoolMapping> mapping =
      LocalPoolMapping::Map(fd, hello.pool_bytes, hello.page_bytes, pool_id);
  close(fd);
  if (!mapping.ok()) return impl_->Annotate(mapping.status());
  impl_->local_pool = std::make_shared<const LocalPoolMapping>(*std::move(mapping));
  return impl_->local_pool;
}

absl::StatusOr<std::string> UcxKvStoreClient::RawCall(uint16_t am_id,
                                                      std::span<const uint8_t> header,
                                                      std::span<const uint8_t> payload) {
  transport::CallOptions call;
  call.deadline = impl_->Deadline();
  KVR_ASSIGN_OR_RETURN(transport::Response resp,
                       impl_->endpoint->CallSync(am_id, header, {payload}, std::move(call)));
  return resp.header;
}

}  // namespace kvr::kv_store
