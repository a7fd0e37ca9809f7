#pragma once
// Stand-ins for the prefill engine's seams that its tests and the GPU prefill bench share: one
// store for every store ref, and a backend that forwards to another (to watch its calls).

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvr/prefill_node/prefill_backend.h"
#include "kvr/prefill_node/prefill_engine.h"

namespace kvr::prefill_node {

// StoreClients that answers every store with one KV store client (not owned; it must outlive
// this).

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

// A PrefillBackend that forwards every call to `inner`; subclasses override Prefill to watch or
// wrap the calls.
class ForwardingBackend : public PrefillBackend {
 public:
  explicit ForwardingBackend(std::unique_ptr<PrefillBackend> inner) : inner_(std::move(inner)) {}
  const model::ModelConfig& config() const override { return inner_->config(); }
  std::string name() const override { return inner_->name(); }
  bool SupportsPrefix() const override { return inner_->SupportsPrefix(); }
  int64_t PrefixAlignment() const override { return inner_->PrefixAlignment(); }
  int64_t ChunkTokens(int64_t requested) const override { return inner_->ChunkTokens(requested); }
  absl::StatusOr<std::vector<float>> Prefill(const PrefillCall& call,
                                             std::unique_ptr<PrefillRows>* rows) override {
    return inner_->Prefill(call, rows);
  }

 private:
  std::unique_ptr<PrefillBackend> inner_;
};

}  // namespace kvr::prefill_node
