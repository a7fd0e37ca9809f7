#pragma once
// StoreClients that answers every store with one KV store client (not owned; it must outlive
// this): the prefill engine's store seam where a test or benchmark runs one fake store.

#include <memory>

#include "kvr/prefill_node/prefill_engine.h"

namespace kvr::prefill_node {

class OneStore final : public StoreClients {
 public:
  explicit OneStore(kv_store::KvStoreClient* client) : client_(client) {}
  absl::StatusOr<std::shared_ptr<kv_store::KvStoreClient>> Get(
      const kvr::cluster::v1::NodeRef&) override {
    return std::shared_ptr<kv_store::KvStoreClient>(std::shared_ptr<void>(), client_);  // unowned
  }

 private:
  kv_store::KvStoreClient* client_;
};

}  // namespace kvr::prefill_node
