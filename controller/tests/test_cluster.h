#pragma once
// Registrations of small clusters for the controller's unit tests.

#include <string>

#include "kvr/controller/types.h"

namespace kvr::controller::testing {

inline ModelInfo TestModel(uint32_t context = 8192) {
  return ModelInfo{
      "smollm2", context, /*kv_bytes_per_token=*/1000, {{"full", 10.0}, {"clusterkv", 2.0}}};
}

inline NodeRegistration Prefill(std::string address, uint64_t queued = 0) {
  NodeRegistration r;
  r.role = NodeRole::kPrefill;
  r.endpoints.grpc_address = std::move(address);
  r.capacity.models = {TestModel()};
  r.capacity.models[0].retrieval_methods.clear();
  r.load.queued_prefill_tokens = queued;
  return r;
}

inline NodeRegistration Decode(std::string address, uint32_t slots = 4,
                               uint64_t free_bytes = 1 << 30) {
  NodeRegistration r;
  r.role = NodeRole::kDecode;
  r.endpoints.grpc_address = std::move(address);
  r.capacity.models = {TestModel()};
  r.capacity.batch_slots = slots;
  r.capacity.memory_bytes = free_bytes;
  r.load.free_memory_bytes = free_bytes;
  return r;
}

inline NodeRegistration Store(std::string address, uint64_t free_bytes = 1ull << 32) {
  NodeRegistration r;
  r.role = NodeRole::kStore;
  r.endpoints.grpc_address = std::move(address);
  r.endpoints.ucx_worker_address = "ucx-addr";
  r.capacity.memory_bytes = free_bytes;
  r.load.free_memory_bytes = free_bytes;
  return r;
}

}  // namespace kvr::controller::testing
