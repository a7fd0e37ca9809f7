#pragma once
// The gRPC shell of the decode node (CONVENTIONS.md 2): DecodeService handlers convert
// protos to the engine's domain types and back; StoreClients connects to stores lazily.

#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/decode/engine.h"
#include "kvr/kv_store/client.h"

namespace kvr::decode {

// One client per store, connected on first use from the store's gRPC address (the handoff
// names it). Thread-safe.
class StoreClients {
 public:
  using Connector = std::function<absl::StatusOr<std::unique_ptr<kv_store::KvStoreClient>>(
      const std::string& grpc_address)>;
  explicit StoreClients(Connector connect) : connect_(std::move(connect)) {}
  // The client for `grpc_address`; clients live as long as this object.
  [[nodiscard]] absl::StatusOr<kv_store::KvStoreClient*> Get(const std::string& grpc_address);

 private:
  Connector connect_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<kv_store::KvStoreClient>> clients_
      ABSL_GUARDED_BY(mu_);
};

// Converts a handoff's chunks (header + layers) into the engine's Handoff.
[[nodiscard]] absl::StatusOr<Handoff> HandoffFromProto(
    const kvr::cluster::v1::HandoffHeader& header,
    std::vector<kvr::cluster::v1::HandoffLayer> layers, kv_store::KvStoreClient* store);

class DecodeServiceImpl final : public kvr::cluster::v1::DecodeService::Service {
 public:
  // `engine` and `stores` must outlive the service. `node_id` (set once registered) goes into
  // completions.
  DecodeServiceImpl(DecodeEngine* engine, StoreClients* stores);

  grpc::Status Handoff(grpc::ServerContext* context,
                       grpc::ServerReader<kvr::cluster::v1::HandoffChunk>* reader,
                       kvr::cluster::v1::HandoffResponse* response) override;
  grpc::Status Stream(grpc::ServerContext* context, const kvr::cluster::v1::StreamRequest* request,
                      grpc::ServerWriter<kvr::cluster::v1::StreamResponse>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* context, const kvr::cluster::v1::CancelRequest* request,
                      kvr::cluster::v1::CancelResponse* response) override;

 private:
  DecodeEngine* engine_;
  StoreClients* stores_;
};

}  // namespace kvr::decode
