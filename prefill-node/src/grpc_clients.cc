#include "kvr/prefill_node/grpc_clients.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/proto/convert.h"

namespace kvr::prefill_node {
namespace {

namespace cv1 = ::kvr::cluster::v1;

using ::kvr::proto::FromGrpcStatus;

// One client-streaming call. The context, stub and response outlive the writer (members in
// declaration order are destroyed in reverse).
class GrpcHandoffSink final : public HandoffSink {
 public:
  GrpcHandoffSink(std::shared_ptr<grpc::Channel> channel, absl::Time deadline)
      : stub_(cv1::DecodeService::NewStub(std::move(channel))) {
    if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
    writer_ = stub_->Handoff(&context_, &response_);
  }
  ~GrpcHandoffSink() override {
    if (!finished_) {
      context_.TryCancel();
      writer_->Finish().ok();
    }
  }

  bool Write(const cv1::HandoffChunk& chunk) override { return writer_->Write(chunk); }

  absl::StatusOr<cv1::HandoffResponse> Finish() override {
    finished_ = true;
    writer_->WritesDone();
    grpc::Status s = writer_->Finish();
    if (!s.ok()) {
      absl::Status status = FromGrpcStatus(s);
      // D blames another node (the store it could not reach): pass that on.
      const auto& trailers = context_.GetServerTrailingMetadata();
      if (auto it = trailers.find("kvr-failed-node"); it != trailers.end()) {
        status.SetPayload("kvr-failed-node",
                          absl::Cord(absl::string_view(it->second.data(), it->second.size())));
      }
      return status;
    }
    return response_;
  }

 private:
  std::unique_ptr<cv1::DecodeService::Stub> stub_;
  grpc::ClientContext context_;
  cv1::HandoffResponse response_;
  std::unique_ptr<grpc::ClientWriter<cv1::HandoffChunk>> writer_;
  bool finished_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HandoffSink>> GrpcHandoffOpener::Open(const cv1::NodeRef& decode,
                                                                     absl::Time deadline) {
  const std::string& address = decode.endpoints().grpc_address();
  if (address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode node ", decode.node_id(), " has no gRPC address"));
  }
  std::shared_ptr<grpc::Channel> channel;
  {
    absl::MutexLock lock(&mu_);
    CachedChannel& c = channels_[address];
    // A decode node restarted on the same address (another instance) gets a fresh channel:
    // the old one may sit in reconnect backoff after the dead process refused it, failing
    // every handoff at once for up to gRPC's maximum backoff although the new node listens.
    if (c.channel == nullptr || c.instance_id != decode.instance_id()) {
      grpc::ChannelArguments args;
      // Summaries of long prompts exceed gRPC's default 4 MiB message limit on the way in;
      // outgoing messages are not limited by default, but say it for the reader.
      args.SetMaxSendMessageSize(-1);
      c.channel = security_.CreateChannel(address, args);
      c.instance_id = decode.instance_id();
    }
    channel = c.channel;
  }
  return std::make_unique<GrpcHandoffSink>(std::move(channel), deadline);
}

UcxStoreClients::UcxStoreClients(kv_store::UcxClientOptions options)
    : cache_(kv_store::UcxStoreClientCache(std::move(options))) {}

absl::StatusOr<std::shared_ptr<kv_store::KvStoreClient>> UcxStoreClients::Get(
    const cv1::NodeRef& store) {
  if (store.endpoints().grpc_address().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("store ", store.node_id(), " has no gRPC address"));
  }
  return cache_.Get(store.endpoints().grpc_address(), store.instance_id());
}

}  // namespace kvr::prefill_node
