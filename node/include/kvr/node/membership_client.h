#pragma once
// MembershipClient: a node's side of kvr.cluster.v1.Membership (Register, Heartbeat,
// Deregister), shared by kvr-store, kvr-prefill and kvr-decode so the loop is written once.
//
// What it does, on one background thread started by the constructor:
//   - Register (retrying with exponential backoff while the controller is unreachable or
//     refuses; a failure is logged once per change of state, not once per try),
//   - Heartbeat at the interval the controller returned, with load from the provider,
//   - Register again when a heartbeat gets NOT_FOUND (the controller restarted or the lease
//     ran out),
//   - Deregister in Stop() / the destructor (graceful leave).
// Every RPC carries a deadline (Options::rpc_timeout).
//
// Thread safety: node_id(), WaitRegistered() and Stop() may be called from any thread. The
// load provider runs on the client's thread (and never after Stop() returns): it must be
// thread-safe with respect to whatever it reads.

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/common/tls.h"

namespace kvr::node {

// The grpc.health.v1 service name of a prefill or decode node's readiness: SERVING while the
// node is registered and the controller holds at least one live store ("model loaded and store
// reachable": the Kubernetes readinessProbe asks for it). The overall service "" is SERVING
// once the model is loaded (startup and liveness probes).
inline constexpr char kReadinessService[] = "kvr.ready";

class MembershipClient {
 public:
  struct Options {
    // host:port of the controller's gRPC server.
    std::string controller;
    // Role, name, endpoints, capacity and protocol version; `load` is overwritten by the
    // provider's value at every Register. An empty `instance_id` is filled with a random one
    // (kvr::NewInstanceId), the same for every Register of this client: the controller then
    // knows a re-registration of this process from a new process on the same address.
    kvr::cluster::v1::RegisterRequest registration;
    // Current load, for Register and every Heartbeat. Null: an empty NodeLoad.
    std::function<kvr::cluster::v1::NodeLoad()> load;
    // Transport security of the channel to the controller (kvr/common/tls.h): with TLS the
    // node presents its certificate, which the controller requires of every member.
    GrpcSecurity security;
    // Deadline of each Register/Heartbeat/Deregister call.
    absl::Duration rpc_timeout = absl::Seconds(2);
    // Register retry backoff: doubles from initial to max while registration fails.
    absl::Duration initial_backoff = absl::Milliseconds(200);
    absl::Duration max_backoff = absl::Seconds(5);
    // Called on the client's thread after every successful Register (e.g. to print the
    // "registered <id>" line launchers read). May be null.
    std::function<void(const std::string& node_id)> on_registered;
    // Called on the client's thread after every successful Register and Heartbeat with the
    // number of STORE nodes the controller holds alive, and with 0 when the registration is
    // lost (NOT_FOUND) or in Stop() (on Stop()'s caller's thread). Prefill and decode nodes
    // derive readiness from it: kReadinessService below. May be null.
    std::function<void(uint32_t live_stores)> on_cluster_view;
  };

  // Starts the background thread; returns at once (registration happens asynchronously).
  explicit MembershipClient(Options options);
  ~MembershipClient();  // Stop()
  MembershipClient(const MembershipClient&) = delete;
  MembershipClient& operator=(const MembershipClient&) = delete;

  // The id the controller assigned; "" while not registered (before the first Register
  // succeeded, after NOT_FOUND until the next one, and after Stop()).
  [[nodiscard]] std::string node_id() const;
  // True once registered (now or within `timeout`); false on timeout or after Stop().
  [[nodiscard]] bool WaitRegistered(absl::Duration timeout) const;
  // Stops the thread and Deregisters (if registered). Idempotent.
  void Stop();

 private:
  void Loop();
  bool Register();  // on the loop thread
  kvr::cluster::v1::NodeLoad Load() const;
  // Logs a failed call at warn when the state changes (first failure, or a different error
  // after a success), so that an unreachable controller does not flood the log.
  void NoteFailure(const std::string& what, const std::string& error);
  void NoteSuccess(const std::string& what);

  const Options options_;
  std::unique_ptr<kvr::cluster::v1::Membership::Stub> stub_;
  absl::Notification stop_;
  mutable absl::Mutex mu_;
  std::string node_id_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration interval_ = absl::Seconds(1);  // loop thread only
  std::string last_error_;                      // loop thread only; "" = last call succeeded
  absl::Mutex stop_mu_;                         // serializes Stop()
  std::thread thread_;                          // last: started after everything above
};

}  // namespace kvr::node
