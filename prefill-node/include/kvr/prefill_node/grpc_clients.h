#pragma once
// The real implementations of the prefill engine's seams: a gRPC DecodeService.Handoff stream
// per request (channels cached per decode address and instance) and one UcxKvStoreClient per store address
// (connected again when the store died or restarted).
//
// Thread safety: both may be used from many request threads at once.

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kvr/kv_store/client_cache.h"
#include "kvr/prefill_node/prefill_engine.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace kvr::prefill_node {

class GrpcHandoffOpener final : public HandoffOpener {
 public:
  // Channels to decode nodes use `security` (kvr/common/tls.h; default plaintext).
  explicit GrpcHandoffOpener(GrpcSecurity security = {}) : security_(std::move(security)) {}
  absl::StatusOr<std::unique_ptr<HandoffSink>> Open(const kvr::cluster::v1::NodeRef& decode,
                                                    absl::Time deadline) override;

 private:
  struct CachedChannel {
    std::string instance_id;  // of the decode node the channel was made for
    std::shared_ptr<grpc::Channel> channel;
  };
  const GrpcSecurity security_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, CachedChannel> channels_ ABSL_GUARDED_BY(mu_);
};

// UcxKvStoreClients by store address through a kv_store::StoreClientCache: a client whose
// store died (its data-plane endpoint failed) or that is connected to another instance than
// the request's NodeRef names is dropped, and the request connects afresh.
class UcxStoreClients final : public StoreClients {
 public:
  explicit UcxStoreClients(kv_store::UcxClientOptions options = {});
  absl::StatusOr<std::shared_ptr<kv_store::KvStoreClient>> Get(
      const kvr::cluster::v1::NodeRef& store) override;

 private:
  kv_store::StoreClientCache cache_;
};

}  // namespace kvr::prefill_node
