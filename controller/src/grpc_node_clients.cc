#include "kvr/controller/grpc_node_clients.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "proto_convert.h"

namespace kvr::controller {

namespace cv1 = ::kvr::cluster::v1;

namespace {

// Adds the failed-node payload when the server named another node in its trailing metadata.
absl::Status WithFailedNode(absl::Status status, const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  auto it = trailers.find(std::string(kFailedNodeMetadataKey));
  if (it != trailers.end()) {
    status.SetPayload(kFailedNodePayloadUrl,
                      absl::Cord(absl::string_view(it->second.data(), it->second.size())));
  }
  return status;
}

void SetDeadline(grpc::ClientContext* ctx, absl::Time deadline) {
  if (deadline != absl::InfiniteFuture()) ctx->set_deadline(absl::ToChronoTime(deadline));
}

}  // namespace

std::shared_ptr<grpc::Channel> GrpcNodeClients::ChannelFor(const NodeSnapshot& node) {
  const std::string& address = node.registration.endpoints.grpc_address;
  absl::MutexLock lock(&mu_);
  CachedChannel& cached = channels_[address];
  // A node restarted on the same address (another instance) gets a fresh channel: the old one
  // may sit in reconnect backoff after the dead process refused it, failing every call at once
  // for up to gRPC's maximum backoff (120 s) although the new node listens.
  if (cached.channel == nullptr || cached.instance_id != node.registration.instance_id) {
    cached.channel = security_.CreateChannel(address);
    cached.instance_id = node.registration.instance_id;
  }
  return cached.channel;
}

absl::StatusOr<PrefillResult> GrpcNodeClients::Prefill(const NodeSnapshot& node,
                                                       const PrefillCall& call,
                                                       CancellationToken* cancel) {
  auto stub = cv1::PrefillService::NewStub(ChannelFor(node));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, call.deadline);
  CancellationToken::Registration on_cancel = cancel->OnCancel([&ctx] { ctx.TryCancel(); });
  cv1::PrefillResponse response;
  grpc::Status status = stub->Prefill(&ctx, ToPrefillRequest(call), &response);
  if (!status.ok()) return WithFailedNode(FromGrpcStatus(status), ctx);
  return FromProto(response);
}

absl::StatusOr<std::vector<uint32_t>> GrpcNodeClients::Tokenize(const NodeSnapshot& node,
                                                                const GenerateParams& params,
                                                                absl::Time deadline) {
  auto stub = cv1::PrefillService::NewStub(ChannelFor(node));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  const PrefillCall call{.params = &params, .deadline = deadline, .attempt = 1};
  cv1::TokenizeResponse response;
  grpc::Status status = stub->Tokenize(&ctx, ToPrefillRequest(call), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::vector<uint32_t>(response.token_ids().ids().begin(),
                               response.token_ids().ids().end());
}

absl::StatusOr<Completion> GrpcNodeClients::Stream(
    const NodeSnapshot& node, absl::string_view request_id, uint64_t sequence_id,
    absl::Time deadline, CancellationToken* cancel,
    absl::FunctionRef<absl::Status(const TokenChunk&)> on_chunk) {
  auto stub = cv1::DecodeService::NewStub(ChannelFor(node));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  CancellationToken::Registration on_cancel = cancel->OnCancel([&ctx] { ctx.TryCancel(); });
  cv1::StreamRequest request;
  request.set_request_id(std::string(request_id));
  request.set_sequence_id(sequence_id);
  std::unique_ptr<grpc::ClientReader<cv1::StreamResponse>> reader = stub->Stream(&ctx, request);
  cv1::StreamResponse message;
  std::optional<Completion> completion;
  absl::Status consumer_error;
  while (reader->Read(&message)) {
    if (message.token_ids_size() > 0 || !message.text().empty()) {
      TokenChunk chunk{{message.token_ids().begin(), message.token_ids().end()}, message.text()};
      consumer_error = on_chunk(chunk);
      if (!consumer_error.ok()) {
        ctx.TryCancel();
        break;
      }
    }
    if (message.has_completion()) completion = FromProto(message.completion());
  }
  grpc::Status status = reader->Finish();
  if (!consumer_error.ok()) return consumer_error;
  if (!status.ok()) return WithFailedNode(FromGrpcStatus(status), ctx);
  if (!completion) {
    return absl::InternalError(
        absl::StrCat("decode node ", node.id, " ended the stream without a final message"));
  }
  return *completion;
}

absl::Status GrpcNodeClients::Cancel(const NodeSnapshot& node, absl::string_view request_id,
                                     uint64_t sequence_id, absl::string_view reason,
                                     absl::Time deadline) {
  cv1::CancelRequest request;
  request.set_request_id(std::string(request_id));
  request.set_sequence_id(sequence_id);
  request.set_reason(std::string(reason));
  cv1::CancelResponse response;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, deadline);
  auto channel = ChannelFor(node);
  grpc::Status status;
  if (node.registration.role == NodeRole::kPrefill) {
    status = cv1::PrefillService::NewStub(channel)->Cancel(&ctx, request, &response);
  } else if (node.registration.role == NodeRole::kDecode) {
    status = cv1::DecodeService::NewStub(channel)->Cancel(&ctx, request, &response);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("node ", node.id, " is a store: no Cancel"));
  }
  return FromGrpcStatus(status);
}

}  // namespace kvr::controller
