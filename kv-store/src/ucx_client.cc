#include <cstring>
#include <optional>

#include "absl/strings/str_format.h"
#include "conversions.h"
#include "grpcpp/grpcpp.h"
#include "kvr/common/status.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/wire.h"
#include "kvr/store/v1/store.grpc.pb.h"
#include "kvr/transport/ucx.h"

namespace kvr::kv_store {

namespace v1 = ::kvr::store::v1;
using wire::MessageType;

struct UcxKvStoreClient::Impl {
  UcxClientOptions options;
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvStore::Stub> stub;
  // Destroyed in reverse: rkey and endpoint before the worker, the worker before the context.
  std::optional<transport::Context> context;
  std::optional<transport::Worker> worker;
  std::optional<transport::Endpoint> endpoint;
  std::optional<transport::RemoteKey> rkey;
  uint64_t pool_base = 0;

  absl::Time Deadline() const { return absl::Now() + options.timeout; }

  void Prepare(grpc::ClientContext& ctx) const {
    ctx.set_deadline(absl::ToChronoTime(Deadline()));
  }

  // One data-plane round trip; the reply payload lands in `out` (exactly its size).
  absl::StatusOr<wire::ReplyHeader> Call(MessageType type, std::string_view header,
                                         std::vector<transport::ByteView> payload,
                                         std::span<uint8_t> out, absl::Time deadline) {
    transport::CallOptions call;
    call.deadline = deadline;
    call.reply_buffer = out;
    absl::StatusOr<transport::Response> resp = endpoint->CallSync(
        static_cast<transport::AmId>(type), transport::AsBytes(header), std::move(payload),
        std::move(call));
    if (!resp.ok()) {
      return absl::Status(resp.status().code(),
                          absl::StrCat("kvr-store ", target, ": ", resp.status().message()));
    }
    KVR_ASSIGN_OR_RETURN(wire::ReplyHeader reply,
                         wire::ParseReply(transport::AsBytes(resp->header), type));
    if (reply.payload_bytes != out.size() || resp->payload_size != out.size()) {
      return absl::InternalError(absl::StrFormat(
          "kvr-store %s replied with %d payload bytes (header says %d), expected %d", target,
          resp->payload_size, reply.payload_bytes, out.size()));
    }
    return reply;
  }
};

UcxKvStoreClient::UcxKvStoreClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxKvStoreClient::~UcxKvStoreClient() = default;

absl::StatusOr<std::unique_ptr<UcxKvStoreClient>> UcxKvStoreClient::Connect(
    const std::string& target, UcxClientOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->target = target;
  impl->channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  impl->stub = v1::KvStore::NewStub(impl->channel);

  grpc::ClientContext ctx;
  impl->Prepare(ctx);
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
  if (impl->options.rma_range_reads) {
    // RMA only pays where it is native; over TCP UCX emulates it at a fraction of AM speed.
    absl::StatusOr<bool> native = impl->endpoint->HasNativeRma();
    if (native.ok() && *native) {
      KVR_ASSIGN_OR_RETURN(transport::RemoteKey rkey,
                           impl->endpoint->UnpackRkey(info.pool_rkey()));
      impl->rkey.emplace(std::move(rkey));
    }
  }
  return std::unique_ptr<UcxKvStoreClient>(new UcxKvStoreClient(std::move(impl)));
}

std::string UcxKvStoreClient::range_read_path() const { return impl_->rkey ? "rma" : "am"; }

absl::StatusOr<CreateResult> UcxKvStoreClient::CreateSequence(SequenceId id,
                                                              const SequenceShape& shape,
                                                              uint64_t expected_tokens,
                                                              absl::Duration lease) {
  v1::CreateSequenceRequest req;
  req.set_sequence_id(id);
  ToProto(shape, req.mutable_shape());
  req.set_expected_tokens(expected_tokens);
  req.set_lease_ms(absl::ToInt64Milliseconds(lease));
  v1::CreateSequenceResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(ctx);
  KVR_RETURN_IF_ERROR(FromGrpc(impl_->stub->CreateSequence(&ctx, req, &resp),
                               absl::StrCat("kvr-store ", impl_->target, " CreateSequence")));
  return CreateResult{.tokens_per_page = resp.tokens_per_page(),
                      .reserved_bytes = resp.reserved_bytes()};
}

absl::StatusOr<uint64_t> UcxKvStoreClient::PutLayer(const LayerRows& rows) {
  const absl::Time deadline = impl_->Deadline();
  std::string header = wire::EncodeWriteHeader(rows, deadline);
  KVR_ASSIGN_OR_RETURN(wire::ReplyHeader reply,
                       impl_->Call(MessageType::kWrite, header, {rows.k, rows.v}, {}, deadline));
  return reply.value;
}

absl::Status UcxKvStoreClient::Gather(std::span<const GatherEntry> entries,
                                      std::span<uint8_t> out) {
  const absl::Time deadline = impl_->Deadline();
  wire::Encoded enc = wire::EncodeGather(entries, deadline);
  return impl_->Call(MessageType::kGather, enc.header, {enc.payload}, out, deadline).status();
}

absl::Status UcxKvStoreClient::RangeRead(std::span<const RangeEntry> ranges,
                                         std::span<uint8_t> out) {
  const absl::Time deadline = impl_->Deadline();
  if (!impl_->rkey) {
    wire::Encoded enc = wire::EncodeRange(MessageType::kRangeRead, ranges, deadline);
    return impl_->Call(MessageType::kRangeRead, enc.header, {enc.payload}, out, deadline)
        .status();
  }
  // RMA: ask where each range lies (one small AM), then read the pages directly. The rows
  // are committed, hence immutable, and stay mapped while the sequence is held.
  size_t offset = 0;
  for (const RangeEntry& range : ranges) {
    wire::Encoded enc = wire::EncodeRange(MessageType::kLocateRange, {&range, 1}, deadline);
    transport::CallOptions call;
    call.deadline = deadline;
    absl::StatusOr<transport::Response> resp = impl_->endpoint->CallSync(
        static_cast<transport::AmId>(MessageType::kLocateRange), transport::AsBytes(enc.header),
        {enc.payload}, std::move(call));
    if (!resp.ok()) {
      return absl::Status(resp.status().code(), absl::StrCat("kvr-store ", impl_->target, ": ",
                                                             resp.status().message()));
    }
    KVR_ASSIGN_OR_RETURN(wire::ReplyHeader reply, wire::ParseReply(transport::AsBytes(resp->header),
                                                                   MessageType::kLocateRange));
    if (resp->payload.size() != reply.value * sizeof(wire::SegmentWire)) {
      return absl::InternalError("kvr-store sent a malformed segment list");
    }
    for (uint64_t i = 0; i < reply.value; ++i) {
      wire::SegmentWire seg;
      std::memcpy(&seg, resp->payload.data() + i * sizeof(seg), sizeof(seg));
      if (seg.bytes > out.size() - offset) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "range output buffer has %d bytes, the rows need more", out.size()));
      }
      absl::Status st = impl_->endpoint->GetSync(impl_->pool_base + seg.pool_offset,
                                                 *impl_->rkey, out.subspan(offset, seg.bytes),
                                                 deadline);
      if (!st.ok()) {
        return absl::Status(st.code(),
                            absl::StrCat("kvr-store ", impl_->target, ": ", st.message()));
      }
      offset += seg.bytes;
    }
  }
  if (offset != out.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "range output buffer has %d bytes, the rows need %d", out.size(), offset));
  }
  return absl::OkStatus();
}

absl::Status UcxKvStoreClient::Release(SequenceId id, absl::Duration keep) {
  v1::ReleaseRequest req;
  req.set_sequence_id(id);
  req.set_keep_ms(absl::ToInt64Milliseconds(keep));
  v1::ReleaseResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(ctx);
  return FromGrpc(impl_->stub->Release(&ctx, req, &resp),
                  absl::StrCat("kvr-store ", impl_->target, " Release"));
}

absl::Status UcxKvStoreClient::Lease(SequenceId id, absl::Duration lease) {
  v1::LeaseRequest req;
  req.set_sequence_id(id);
  req.set_lease_ms(absl::ToInt64Milliseconds(lease));
  v1::LeaseResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(ctx);
  return FromGrpc(impl_->stub->Lease(&ctx, req, &resp),
                  absl::StrCat("kvr-store ", impl_->target, " Lease"));
}

absl::StatusOr<SequenceInfo> UcxKvStoreClient::GetSequence(SequenceId id) {
  v1::GetSequenceRequest req;
  req.set_sequence_id(id);
  v1::GetSequenceResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(ctx);
  KVR_RETURN_IF_ERROR(FromGrpc(impl_->stub->GetSequence(&ctx, req, &resp),
                               absl::StrCat("kvr-store ", impl_->target, " GetSequence")));
  SequenceInfo info;
  KVR_ASSIGN_OR_RETURN(info.shape, FromProto(resp.shape()));
  info.committed_rows.assign(resp.committed_rows().begin(), resp.committed_rows().end());
  info.tokens_per_page = resp.tokens_per_page();
  info.pages = resp.pages();
  info.lease_expiry_unix_ms = resp.lease_expiry_unix_ms();
  info.released_kept = resp.released_kept();
  return info;
}

absl::StatusOr<StoreStats> UcxKvStoreClient::Stats() {
  v1::StatsResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(ctx);
  KVR_RETURN_IF_ERROR(FromGrpc(impl_->stub->Stats(&ctx, {}, &resp),
                               absl::StrCat("kvr-store ", impl_->target, " Stats")));
  return FromProto(resp);
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
