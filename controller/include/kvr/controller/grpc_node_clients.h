#pragma once
// gRPC implementations of PrefillClient and DecodeClient. One channel per node address,
// created on first use and kept (gRPC channels reconnect by themselves) until another
// instance of the node registers at that address. Thread-safe.

#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kvr/common/tls.h"
#include "kvr/controller/node_clients.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace kvr::controller {

class GrpcNodeClients final : public PrefillClient, public DecodeClient {
 public:
  // Channels to the nodes use `security` (kvr/common/tls.h; default plaintext).
  explicit GrpcNodeClients(GrpcSecurity security = {}) : security_(std::move(security)) {}
  GrpcNodeClients(const GrpcNodeClients&) = delete;
  GrpcNodeClients& operator=(const GrpcNodeClients&) = delete;

  absl::StatusOr<PrefillResult> Prefill(const NodeSnapshot& node, const PrefillCall& call,
                                        CancellationToken* cancel) override;
  absl::StatusOr<std::vector<uint32_t>> Tokenize(const NodeSnapshot& node,
                                                 const GenerateParams& params,
                                                 absl::Time deadline) override;
  absl::StatusOr<Completion> Stream(
      const NodeSnapshot& node, absl::string_view request_id, uint64_t sequence_id,
      absl::Time deadline, CancellationToken* cancel,
      absl::FunctionRef<absl::Status(const TokenChunk&)> on_chunk) override;
  // Cancel is both PrefillClient's and DecodeClient's: the node's role picks the service.
  absl::Status Cancel(const NodeSnapshot& node, absl::string_view request_id, uint64_t sequence_id,
                      absl::string_view reason, absl::Time deadline) override;

 private:
  // The node's channel, created afresh when another instance registered at its address.
  std::shared_ptr<grpc::Channel> ChannelFor(const NodeSnapshot& node);

  struct CachedChannel {
    std::string instance_id;
    std::shared_ptr<grpc::Channel> channel;
  };
  const GrpcSecurity security_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, CachedChannel> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvr::controller
