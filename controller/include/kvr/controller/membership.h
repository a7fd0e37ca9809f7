#pragma once
// Cluster membership: which nodes are alive, what they can hold and how loaded they are.
//
// Every node holds a lease that Register and each Heartbeat renew; a node whose lease lapsed
// is gone (expiry is evaluated lazily on every read, so no background thread is needed). A
// node that an RPC proved dead is dropped at once with MarkFailed; it comes back by
// registering again. Thread-safe.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/controller/clock.h"
#include "kvr/controller/types.h"

namespace kvr::controller {

// What placement added to a node since its last load report. Heartbeats replace the node's
// load with its own report, which from then on includes this work, so pending load is reset
// by each heartbeat rather than subtracted when requests end.
struct PendingLoad {
  uint64_t prefill_tokens = 0;
  uint32_t sequences = 0;
  uint64_t memory_bytes = 0;
};

// A model as the live nodes describe it: the smallest context length any of them reported and
// the retrieval methods every decode node serving it supports.
struct ModelSummary {
  ModelInfo info;
  uint32_t prefill_nodes = 0;
  uint32_t decode_nodes = 0;
};

// How close a model is to being served, for telling "not yet" from "no such model".
struct ModelPresence {
  // Live nodes that registered the model.
  uint32_t prefill_nodes = 0;
  uint32_t decode_nodes = 0;
  // Some node registered it since the controller started (live or not).
  bool ever_registered = false;
  // Some model, this one or another, has a live prefill AND decode node.
  bool any_model_served = false;
};

class Membership {
 public:
  // `clock` must outlive the membership.
  Membership(const Clock* clock, absl::Duration lease);

  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Adds a node and returns its id (a new one at every registration). INVALID_ARGUMENT when the
  // registration is malformed (no gRPC address, a prefill/decode node without models, a
  // decode node without batch slots, a store without memory or UCX address, a model without a
  // context length).
  //
  // One process per address: a live entry with the same gRPC address is removed (its ids go
  // into `replaced` when given). That is a node restarted on its address (a new instance id)
  // or one whose registration the controller forgot and that registers again; either way the
  // old entry is gone, and work placed on it (for a store: its sequences) is lost and fails
  // on its own. Without this the old entry of a restarted store stayed placeable until its
  // lease ran out, with requests sent to an address whose process no longer holds it.
  // PERMISSION_DENIED, and nothing replaced, when that entry was registered with an identity
  // (NodeRegistration::identity) other than this registration's: a certificate for one node
  // cannot evict another by claiming its address (it may once that node's lease lapsed).
  [[nodiscard]] absl::StatusOr<std::string> Register(NodeRegistration registration,
                                                     std::vector<std::string>* replaced = nullptr);

  // Renews the lease, stores the load and returns the new lease expiry. NOT_FOUND when the id
  // is unknown or its lease already lapsed (the node must register again). `caller`: the
  // identity the caller proved when identities are checked (std::nullopt: not checked);
  // PERMISSION_DENIED, naming both, when it is not the one the node registered with.
  [[nodiscard]] absl::StatusOr<absl::Time> Heartbeat(
      absl::string_view node_id, const NodeLoad& load,
      std::optional<absl::string_view> caller = std::nullopt);

  // NOT_FOUND when unknown; PERMISSION_DENIED as Heartbeat.
  [[nodiscard]] absl::Status Deregister(absl::string_view node_id,
                                        std::optional<absl::string_view> caller = std::nullopt);

  // Drops a node that failed an RPC; no-op when it is already gone.
  void MarkFailed(absl::string_view node_id);

  // Adds work placed on a node to its effective load until its next heartbeat.
  void AddPending(absl::string_view node_id, const PendingLoad& pending);

  // Live nodes of `role` (all roles when unset), in registration order.
  std::vector<NodeSnapshot> LiveNodes(std::optional<NodeRole> role = std::nullopt) const;
  std::optional<NodeSnapshot> Find(absl::string_view node_id) const;

  // Models served by live prefill AND decode nodes (only those can run a request), by name.
  std::vector<ModelSummary> Models() const;
  std::optional<ModelSummary> FindModel(absl::string_view name) const;
  [[nodiscard]] ModelPresence Presence(absl::string_view model) const;

  absl::Duration lease() const { return lease_; }

 private:
  struct Entry {
    NodeSnapshot snapshot;
    NodeLoad reported;
    PendingLoad pending;
  };
  // Removes entries whose lease lapsed. Called under the lock by every accessor.
  void ExpireLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static NodeLoad Effective(const NodeLoad& reported, const PendingLoad& pending);

  const Clock* clock_;
  const absl::Duration lease_;
  mutable absl::Mutex mu_;
  // Keyed by serial so that iteration is registration order. Mutable: lazy expiry in const
  // readers removes entries, which does not change the observable membership.
  mutable absl::btree_map<uint64_t, Entry> nodes_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;
  // Every model name a node registered since construction.
  absl::flat_hash_set<std::string> seen_models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvr::controller
