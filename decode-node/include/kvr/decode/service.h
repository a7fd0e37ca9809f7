#pragma once
// The gRPC shell of the decode node: DecodeService handlers convert
// protos to the engine's domain types and back; store clients come from a
// kv_store::StoreClientCache (one per store, reconnected when the store died or restarted).

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/decode/engine.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/client_cache.h"

namespace kvr::decode {

// The decode node's store clients: connected on first use from the store's gRPC address (the
// handoff names it), dropped and connected again when the store died or the handoff names
// another instance of it. Thread-safe.
using StoreClients = kv_store::StoreClientCache;

// Converts a handoff's chunks (header + layers) into the engine's Handoff.
[[nodiscard]] absl::StatusOr<Handoff> HandoffFromProto(
    const kvr::cluster::v1::HandoffHeader& header,
    std::vector<kvr::cluster::v1::HandoffLayer> layers, kv_store::KvStoreClient* store);

class DecodeServiceImpl final : public kvr::cluster::v1::DecodeService::Service {
 public:
  // `engine` and `stores` must outlive the service.
  DecodeServiceImpl(DecodeEngine* engine, StoreClients* stores);

  grpc::Status Handoff(grpc::ServerContext* context,
                       grpc::ServerReader<kvr::cluster::v1::HandoffChunk>* reader,
                       kvr::cluster::v1::HandoffResponse* response) override;
  grpc::Status Stream(grpc::ServerContext* context, const kvr::cluster::v1::StreamRequest* request,
                      grpc::ServerWriter<kvr::cluster::v1::StreamResponse>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* context, const kvr::cluster::v1::CancelRequest* request,
                      kvr::cluster::v1::CancelResponse* response) override;

  // The trailing-metadata key naming another node that failed (kvr.cluster.v1: the controller
  // marks that node failed rather than this one).
  static constexpr char kFailedNodeKey[] = "kvr-failed-node";

 private:
  // The store a handed-off sequence lives on, until its Stream ends: when the sequence fails
  // while that store's client is unhealthy, the failure is the store's, and Stream names it.
  struct SequenceStore {
    std::string node_id;
    std::shared_ptr<kv_store::KvStoreClient> client;
  };
  void Remember(uint64_t sequence_id, SequenceStore store);
  std::optional<SequenceStore> Forget(uint64_t sequence_id);

  DecodeEngine* engine_;
  StoreClients* stores_;
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, SequenceStore> sequence_stores_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvr::decode
