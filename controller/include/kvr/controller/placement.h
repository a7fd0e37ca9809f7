#pragma once
// Placement: picks the prefill node (P), decode node (D) and store (S) of one request attempt,
// and refuses with RESOURCE_EXHAUSTED, naming the resource, when no node can take it.
//
//   P: serves the model, has room in its prefill queue; least queued prefill tokens wins.
//   D: serves the model and method, has a free batch slot and free summary memory for
//      (prompt + max_tokens) tokens; most free slots, then most free memory, wins.
//   S: has free bytes for the full KV of (prompt + max_tokens) tokens; fewest sequences (the
//      store heartbeats how many it holds), then most free bytes, wins; stores still equal
//      take turns (round robin in registration order, after the store picked last); a store
//      holding a cached prefix of the prompt (PlacementRequest::preferred_store) goes first.
// Other ties go to the node that registered first, so equal clusters place identically.
// A successful placement adds the request to the chosen nodes' pending load (Membership), so
// that requests placed between two heartbeats spread out instead of piling on one node.

#include <cstdint>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/types.h"

namespace kvr::controller {

struct PlacementRequest {
  std::string model;
  std::string method;
  // Upper bound of the prompt length (GenerateParams::prompt_tokens_bound).
  uint64_t prompt_tokens = 0;
  uint32_t max_tokens = 0;
  // Nodes this attempt must avoid (they failed an earlier attempt of the same request).
  absl::flat_hash_set<std::string> excluded;
  // A store that holds a cached prefix of the prompt (PrefixCache): chosen over the ranking
  // below whenever it may take the request.
  std::string preferred_store;
};

struct PlacementDecision {
  NodeSnapshot prefill;
  NodeSnapshot decode;
  NodeSnapshot store;
  // What was reserved: store bytes on S, summary bytes on D.
  uint64_t kv_bytes = 0;
  uint64_t summary_bytes = 0;
};

class Placement {
 public:
  // `membership` must outlive the placement.
  explicit Placement(Membership* membership) : membership_(membership) {}

  // NOT_FOUND when no live node serves the model (validation normally catches that first);
  // RESOURCE_EXHAUSTED naming the resource when nodes exist but none has room.
  [[nodiscard]] absl::StatusOr<PlacementDecision> Place(const PlacementRequest& request);

 private:
  Membership* membership_;
  // Serializes choose-and-reserve so that two concurrent requests cannot both take the last
  // slot of a node.
  absl::Mutex mu_;
  // Registration serial of the store picked last: the round robin among equal stores resumes
  // after it.
  uint64_t last_store_serial_ ABSL_GUARDED_BY(mu_) = 0;
};

// Controller-wide cap on requests in flight (placed or running). Admit() hands out a ticket
// that gives its place back when destroyed. Thread-safe.
class Admission {
 public:
  explicit Admission(uint32_t max_in_flight) : max_in_flight_(max_in_flight) {}

  class Ticket {
   public:
    Ticket() = default;
    explicit Ticket(Admission* owner) : owner_(owner) {}
    Ticket(Ticket&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)) {}
    Ticket& operator=(Ticket&& other) noexcept {
      if (this != &other) {
        Release();
        owner_ = std::exchange(other.owner_, nullptr);
      }
      return *this;
    }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() { Release(); }

   private:
    void Release();
    Admission* owner_ = nullptr;
  };

  // RESOURCE_EXHAUSTED ("requests in flight: ...") when max_in_flight requests are running.
  [[nodiscard]] absl::StatusOr<Ticket> Admit();
  uint32_t in_flight() const;

 private:
  const uint32_t max_in_flight_;
  mutable absl::Mutex mu_;
  uint32_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvr::controller
