#include "kvr/controller/membership.h"

#include <algorithm>
#include <utility>

#include "absl/container/btree_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvr::controller {

absl::string_view NodeRoleName(NodeRole role) {
  switch (role) {
    case NodeRole::kPrefill:
      return "prefill";
    case NodeRole::kDecode:
      return "decode";
    case NodeRole::kStore:
      return "store";
  }
  return "unknown";
}

bool NodeSnapshot::Serves(absl::string_view model) const {
  return std::any_of(registration.capacity.models.begin(), registration.capacity.models.end(),
                     [&](const ModelInfo& m) { return m.name == model; });
}

namespace {

absl::Status ValidateRegistration(const NodeRegistration& r) {
  const absl::string_view role = NodeRoleName(r.role);
  if (r.endpoints.grpc_address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("endpoints.grpc_address: empty for a ", role, " node"));
  }
  if (r.role == NodeRole::kStore) {
    if (r.capacity.memory_bytes == 0) {
      return absl::InvalidArgumentError("capacity.memory_bytes: a store must have memory");
    }
    if (r.endpoints.ucx_worker_address.empty()) {
      return absl::InvalidArgumentError(
          "endpoints.ucx_worker_address: a store must publish its UCX worker address");
    }
    return absl::OkStatus();
  }
  if (r.capacity.models.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity.models: a ", role, " node must serve at least one model"));
  }
  for (const ModelInfo& m : r.capacity.models) {
    if (m.name.empty()) return absl::InvalidArgumentError("capacity.models.name: empty");
    if (m.context_length == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("capacity.models.context_length: 0 for model '", m.name, "'"));
    }
    if (r.role == NodeRole::kDecode && m.retrieval_methods.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "capacity.models.retrieval_methods: none for model '", m.name, "' on a decode node"));
    }
  }
  if (r.role == NodeRole::kDecode && r.capacity.batch_slots == 0) {
    return absl::InvalidArgumentError("capacity.batch_slots: 0 on a decode node");
  }
  return absl::OkStatus();
}

}  // namespace

Membership::Membership(const Clock* clock, absl::Duration lease) : clock_(clock), lease_(lease) {}

NodeLoad Membership::Effective(const NodeLoad& reported, const PendingLoad& pending) {
  NodeLoad out = reported;
  out.queued_prefill_tokens += pending.prefill_tokens;
  out.running_sequences += pending.sequences;
  out.free_memory_bytes -= std::min(out.free_memory_bytes, pending.memory_bytes);
  return out;
}

void Membership::ExpireLocked() const {
  const absl::Time now = clock_->Now();
  absl::erase_if(nodes_, [&](const auto& kv) { return kv.second.snapshot.lease_expiry <= now; });
}

absl::StatusOr<std::string> Membership::Register(NodeRegistration registration,
                                                 std::vector<std::string>* replaced) {
  if (absl::Status s = ValidateRegistration(registration); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  for (const auto& [serial, e] : nodes_) {
    const NodeRegistration& old = e.snapshot.registration;
    if (old.endpoints.grpc_address == registration.endpoints.grpc_address &&
        !old.identity.empty() && old.identity != registration.identity) {
      return absl::PermissionDeniedError(absl::StrCat(
          "endpoints.grpc_address: '", old.endpoints.grpc_address, "' is node ", e.snapshot.id,
          " of identity '", old.identity, "'; the certificate of '", registration.identity,
          "' cannot replace it (it may once that node's lease lapsed)"));
    }
  }
  absl::erase_if(nodes_, [&](const auto& kv) {
    if (kv.second.snapshot.registration.endpoints.grpc_address !=
        registration.endpoints.grpc_address) {
      return false;
    }
    if (replaced != nullptr) replaced->push_back(kv.second.snapshot.id);
    return true;
  });
  for (const ModelInfo& m : registration.capacity.models) seen_models_.insert(m.name);
  const uint64_t serial = next_serial_++;
  Entry entry;
  entry.snapshot.id = absl::StrCat(NodeRoleName(registration.role), "-", serial);
  entry.snapshot.serial = serial;
  entry.reported = registration.load;
  entry.snapshot.effective_load = registration.load;
  entry.snapshot.registration = std::move(registration);
  entry.snapshot.lease_expiry = clock_->Now() + lease_;
  std::string id = entry.snapshot.id;
  nodes_.emplace(serial, std::move(entry));
  return id;
}

namespace {
template <typename Map>
auto FindById(Map& nodes, absl::string_view id) {
  return std::find_if(nodes.begin(), nodes.end(),
                      [&](const auto& kv) { return kv.second.snapshot.id == id; });
}

// PERMISSION_DENIED unless `caller` (when checked) is the identity `node` registered with.
absl::Status CheckCaller(const NodeSnapshot& node, std::optional<absl::string_view> caller) {
  if (!caller.has_value() || *caller == node.registration.identity) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("node_id: '", node.id, "' belongs to the certificate of node '",
                   node.registration.identity, "', not to this peer's ('", *caller, "')"));
}
}  // namespace

absl::StatusOr<absl::Time> Membership::Heartbeat(absl::string_view node_id, const NodeLoad& load,
                                                 std::optional<absl::string_view> caller) {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  auto it = FindById(nodes_, node_id);
  if (it == nodes_.end()) {
    return absl::NotFoundError(
        absl::StrCat("node_id: '", node_id, "' is not registered (unknown or lease expired)"));
  }
  if (absl::Status s = CheckCaller(it->second.snapshot, caller); !s.ok()) return s;
  Entry& e = it->second;
  e.reported = load;
  e.pending = {};
  e.snapshot.effective_load = load;
  e.snapshot.lease_expiry = clock_->Now() + lease_;
  return e.snapshot.lease_expiry;
}

absl::Status Membership::Deregister(absl::string_view node_id,
                                    std::optional<absl::string_view> caller) {
  absl::MutexLock lock(&mu_);
  auto it = FindById(nodes_, node_id);
  if (it == nodes_.end()) {
    return absl::NotFoundError(absl::StrCat("node_id: '", node_id, "' is not registered"));
  }
  if (absl::Status s = CheckCaller(it->second.snapshot, caller); !s.ok()) return s;
  nodes_.erase(it);
  return absl::OkStatus();
}

void Membership::MarkFailed(absl::string_view node_id) {
  absl::MutexLock lock(&mu_);
  auto it = FindById(nodes_, node_id);
  if (it != nodes_.end()) nodes_.erase(it);
}

void Membership::AddPending(absl::string_view node_id, const PendingLoad& pending) {
  absl::MutexLock lock(&mu_);
  auto it = FindById(nodes_, node_id);
  if (it == nodes_.end()) return;
  Entry& e = it->second;
  e.pending.prefill_tokens += pending.prefill_tokens;
  e.pending.sequences += pending.sequences;
  e.pending.memory_bytes += pending.memory_bytes;
  e.snapshot.effective_load = Effective(e.reported, e.pending);
}

std::vector<NodeSnapshot> Membership::LiveNodes(std::optional<NodeRole> role) const {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  std::vector<NodeSnapshot> out;
  for (const auto& [serial, e] : nodes_) {
    if (!role || e.snapshot.registration.role == *role) out.push_back(e.snapshot);
  }
  return out;
}

std::optional<NodeSnapshot> Membership::Find(absl::string_view node_id) const {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  auto it = FindById(nodes_, node_id);
  if (it == nodes_.end()) return std::nullopt;
  return it->second.snapshot;
}

std::vector<ModelSummary> Membership::Models() const {
  absl::btree_map<std::string, ModelSummary> by_name;
  for (const NodeSnapshot& n : LiveNodes()) {
    const NodeRole role = n.registration.role;
    if (role == NodeRole::kStore) continue;
    for (const ModelInfo& m : n.registration.capacity.models) {
      auto [it, inserted] = by_name.try_emplace(m.name);
      ModelSummary& s = it->second;
      if (inserted) {
        s.info.name = m.name;
        s.info.context_length = m.context_length;
        s.info.kv_bytes_per_token = m.kv_bytes_per_token;
      }
      // Nodes may disagree (a rolling upgrade); the request must fit all of them.
      s.info.context_length = std::min(s.info.context_length, m.context_length);
      s.info.kv_bytes_per_token = std::max(s.info.kv_bytes_per_token, m.kv_bytes_per_token);
      if (role == NodeRole::kPrefill) {
        ++s.prefill_nodes;
        continue;
      }
      if (s.decode_nodes++ == 0) {
        s.info.retrieval_methods = m.retrieval_methods;
      } else {
        // Keep the methods every decode node supports, at the largest per-token size.
        std::vector<RetrievalMethodInfo> common;
        for (const RetrievalMethodInfo& have : s.info.retrieval_methods) {
          for (const RetrievalMethodInfo& other : m.retrieval_methods) {
            if (other.name == have.name) {
              common.push_back({have.name, std::max(have.summary_bytes_per_token,
                                                    other.summary_bytes_per_token)});
            }
          }
        }
        s.info.retrieval_methods = std::move(common);
      }
    }
  }
  std::vector<ModelSummary> out;
  for (auto& [name, s] : by_name) {
    if (s.prefill_nodes > 0 && s.decode_nodes > 0) out.push_back(std::move(s));
  }
  return out;
}

std::optional<ModelSummary> Membership::FindModel(absl::string_view name) const {
  for (ModelSummary& s : Models()) {
    if (s.info.name == name) return std::move(s);
  }
  return std::nullopt;
}

ModelPresence Membership::Presence(absl::string_view model) const {
  ModelPresence p;
  p.any_model_served = !Models().empty();
  for (const NodeSnapshot& n : LiveNodes()) {
    if (!n.Serves(model)) continue;
    if (n.registration.role == NodeRole::kPrefill) ++p.prefill_nodes;
    if (n.registration.role == NodeRole::kDecode) ++p.decode_nodes;
  }
  absl::MutexLock lock(&mu_);
  p.ever_registered = seen_models_.contains(model);
  return p;
}

}  // namespace kvr::controller
