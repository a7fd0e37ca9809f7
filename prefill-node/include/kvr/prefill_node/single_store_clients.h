#pragma once
// SingleStoreClients: the StoreClients of the engine's tests and benchmarks, one client for
// every store a request names (UcxStoreClients connects to each).

#include <memory>

#include "absl/status/statusor.h"
#include "kvr/cluster/v1/cluster.pb.h"
#include "kvr/kv_store/client.h"
#include "kvr/prefill_node/prefill_engine.h"

namespace kvr::prefill_node {

// Hands out `client` (unowned; it must outlive every use) whatever store is asked for.
class SingleStoreClients final : public StoreClients {
 public:
  explicit SingleStoreClients(kv_store::KvStoreClient* client) : client_(client) {}
  absl::StatusOr<std::shared_ptr<kv_store::KvStoreClient>> Get(
      const kvr::cluster::v1::NodeRef&) override {
    // An aliasing pointer that owns nothing.
    return std::shared_ptr<kv_store::KvStoreClient>(std::shared_ptr<void>(), client_);
  }

 private:
  kv_store::KvStoreClient* client_;
};

}  // namespace kvr::prefill_node
