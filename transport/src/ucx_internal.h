#pragma once
// The UCX data plane's internals, shared by its source files:
//   ucx_worker.cc     the context, the worker and its progress loop (command queue, sleep and
//                     wake-up, deadlines, shut-down);
//   ucx_endpoint.cc   endpoints: connect, hello, failure and close;
//   ucx_pid_watch.cc  the death of a same-host peer, seen through its pidfd;
//   ucx_rpc.cc        active-message calls, requests and replies;
//   ucx_rma.cc        registered memory, remote keys and RMA gets.
// The threading and ownership model is in kvr/transport/ucx.h; in short, one progress thread
// per worker owns every ucp_* call on that worker, other threads talk to it through
// `WorkerCore::Post`.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/transport/ucx.h"

namespace kvr::transport::internal {

// Reply messages travel on this AM id; user ids are 1..kMaxUserAmId.
constexpr AmId kReplyAmId = 0;
// First message on every endpoint: the client's id and worker address, so that the server
// answers over an endpoint it owns (see OnHello).
constexpr AmId kHelloAmId = kMaxUserAmId + 1;

// Prefix of every request's AM header (then the user header follows).
struct RequestPrefix {
  uint64_t request_id;
  uint64_t client_id;  // the sending endpoint's id from its hello
};
// Header of a hello: then the client's worker address.
struct HelloPrefix {
  uint64_t client_id;
  // The client endpoint's error mode; the back-endpoint must use the same one, because UCX
  // cannot wire up two endpoints of different error modes between the same two workers.
  uint32_t peer_mode;
  uint32_t reserved;
};
// Prefix of every reply's AM header: then `message_size` bytes of error message, then the
// user header.
struct ReplyPrefix {
  uint64_t request_id;
  int32_t status_code;
  uint32_t message_size;
};
// The AM header of the reply to `request_id`: the prefix, `status`'s message, `header`.
std::string ReplyWireHeader(uint64_t request_id, const absl::Status& status, ByteView header);

// Worker addresses are prefixed with the identity of the process that owns the worker:
// UCX 1.13's shared-memory transports (posix, sysv) cannot run with
// UCP_ERR_HANDLING_MODE_PEER, so for a peer on the same kernel (same boot id and pid
// namespace) we connect in mode NONE, which lets UCX pick shared memory, and detect the
// peer's death exactly and at once with a pidfd instead. Remote peers use mode PEER.
constexpr uint32_t kAddressMagic = 0x4b565241;  // "KVRA"
constexpr size_t kBootIdSize = 36;
struct AddressPrefix {
  uint32_t magic;
  uint32_t pid;
  uint64_t pid_namespace;
  char boot_id[kBootIdSize];
};

// This process's identity, the prefix of its workers' addresses.
AddressPrefix LocalIdentity();
// Whether two identities are processes of one kernel and pid namespace.
bool SameHost(const AddressPrefix& a, const AddressPrefix& b);

// A UCX status as an absl::Status of the nearest code, prefixed with `what`.
absl::Status UcsError(ucs_status_t status, absl::string_view what);

// The UCX datatype + buffer pair describing a scatter list. For one segment the contiguous
// datatype avoids UCX's iov path (which disables some zero-copy protocols).
struct SendBuffer {
  std::vector<ucp_dt_iov_t> iov;
  const void* buffer = nullptr;
  size_t count = 0;
  ucp_datatype_t datatype = ucp_dt_make_contig(1);

  void Set(const std::vector<ByteView>& segments) {
    iov.clear();
    for (ByteView s : segments) {
      if (!s.empty()) iov.push_back({const_cast<uint8_t*>(s.data()), s.size()});
    }
    if (iov.empty()) {
      buffer = nullptr;
      count = 0;
    } else if (iov.size() == 1) {
      buffer = iov[0].buffer;
      count = iov[0].length;
    } else {
      buffer = iov.data();
      count = iov.size();
      datatype = ucp_dt_make_iov();
    }
  }
};

struct ContextCore {
  ucp_context_h context = nullptr;
  ~ContextCore() {
    if (context != nullptr) ucp_cleanup(context);
  }
};

struct EndpointState {
  WorkerCore* core = nullptr;  // the worker owning this endpoint (outlives it)
  std::string peer_name;
  // Progress-thread-only.
  ucp_ep_h ep = nullptr;
  bool closed = false;
  bool peer_mode = false;         // UCP_ERR_HANDLING_MODE_PEER (else NONE + pid watch)
  uint64_t client_id = 0;         // client side: the id announced in the hello
  uint64_t served_client_id = 0;  // server side: the client this back-endpoint answers
  int pid_fd = -1;                // pidfd of a same-host peer process, watched in epoll
  int peer_pid = 0;
  absl::flat_hash_set<uint64_t> call_ids;

  mutable absl::Mutex mu;
  absl::Status health ABSL_GUARDED_BY(mu);

  absl::Status Health() const {
    absl::MutexLock lock(&mu);
    return health;
  }
};

struct CallState : std::enable_shared_from_this<CallState> {
  // Written at submission, then read-only.
  const WorkerCore* owner = nullptr;  // the worker the call runs on (outlives the call's use)
  AmId am_id = 0;
  std::span<uint8_t> reply_buffer;
  std::function<void()> on_done;

  // Progress-thread-only.
  WorkerCore* core = nullptr;
  std::shared_ptr<EndpointState> endpoint;
  uint64_t id = 0;
  absl::Time deadline;
  std::string wire_header;  // RequestPrefix + user header; lives until the send completes
  SendBuffer send;
  bool send_in_flight = false;
  bool recv_in_flight = false;
  void* recv_request = nullptr;  // the rendezvous receive while recv_in_flight
  // Set when the call was completed while UCX still held one of its requests (see
  // AbandonReceives and shutdown): late UCX callbacks then only free their request.
  bool abandoned = false;
  // The reply being received by rendezvous. Kept apart from `pending` so that an error that
  // beats the receive (deadline, endpoint failure) never frees a buffer UCX is writing.
  Response recv_response;
  bool has_result = false;
  absl::StatusOr<Response> pending = absl::UnknownError("no result");

  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  bool taken ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<Response> result ABSL_GUARDED_BY(mu) = absl::UnknownError("no result");
};

struct TransferState {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status result ABSL_GUARDED_BY(mu);

  void Finish(absl::Status status) {
    absl::MutexLock lock(&mu);
    result = std::move(status);
    done = true;
  }
};

struct RkeyState {
  ucp_rkey_h rkey = nullptr;  // progress-thread-only
  std::shared_ptr<EndpointState> endpoint;
};

// One received request, owned by IncomingRequest (or by an in-flight reply once replied).
struct IncomingState {
  std::shared_ptr<WorkerCore> core;
  // The server's own endpoint back to the client. Why not UCX's reply_ep: UCX 1.13 destroys
  // that internal endpoint when the client disconnects, and a reply sent on it later (an
  // asynchronous handler) crashed in ucp_am_send_nbx. An endpoint we own fails cleanly.
  std::shared_ptr<EndpointState> reply_to;
  uint64_t request_id = 0;
  AmId am_id = 0;
  std::string header;
  ByteView payload;
  void* ucx_data = nullptr;  // persistent eager data to ucp_am_data_release
  Bytes owned;               // rendezvous data received into a transport buffer
  bool replied = false;
  ~IncomingState();
};

struct HandlerEntry {
  WorkerCore* core = nullptr;
  AmId am_id = 0;
  RequestHandler handler;
  HandlerOptions options;
};
struct WorkerCore : std::enable_shared_from_this<WorkerCore> {
  std::shared_ptr<ContextCore> context;
  std::string name;
  absl::Duration spin;
  bool same_host_pid_watch = true;
  ucp_worker_h worker = nullptr;
  std::string address;  // AddressPrefix + ucp address
  AddressPrefix identity{};
  int ucx_fd = -1;
  int event_fd = -1;
  int epoll_fd = -1;
  std::thread thread;
  std::thread::id thread_id;

  // Command queue from other threads.
  absl::Mutex queue_mu;
  std::deque<std::function<void()>> queue ABSL_GUARDED_BY(queue_mu);
  bool accepting ABSL_GUARDED_BY(queue_mu) = true;
  std::atomic<bool> sleeping{false};
  bool stop_requested = false;  // progress-thread-only

  // Progress-thread-only bookkeeping.
  uint64_t next_id = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<CallState>> calls;
  std::set<std::pair<absl::Time, uint64_t>> deadlines;
  absl::flat_hash_map<EndpointState*, std::shared_ptr<EndpointState>> endpoints;
  absl::flat_hash_set<std::shared_ptr<RkeyState>> rkeys;
  absl::flat_hash_map<AmId, std::unique_ptr<HandlerEntry>> handlers;
  std::vector<std::shared_ptr<EndpointState>> to_close;
  absl::flat_hash_set<void*> close_requests;
  // Server side: endpoints back to the clients that said hello, by client id.
  absl::flat_hash_map<uint64_t, std::shared_ptr<EndpointState>> clients;
  uint64_t client_id_base = 0;  // random per worker; endpoint ids are base + counter
  uint64_t next_client_seq = 1;
  // Calls whose receive was abandoned; released after ucp_worker_destroy.
  std::vector<std::shared_ptr<CallState>> abandoned;
  // Same-host peers: a readable pidfd means the peer process exited.
  absl::flat_hash_map<int, EndpointState*> pid_watches;
  absl::Time next_pid_check;

  ~WorkerCore();

  // ---- progress loop (ucx_worker.cc) ----------------------------------------------------

  bool OnProgressThread() const { return std::this_thread::get_id() == thread_id; }
  // Enqueues `fn` for the progress thread. False once the worker has shut down.
  bool Post(std::function<void()> fn);
  void Wake();
  // Runs `fn` on the progress thread and waits for it (inline when already there).
  absl::Status RunSync(const std::function<void()>& fn);
  void ExpireDeadlines(absl::Time now);
  bool DrainQueue();
  void Loop();
  void ShutdownOnThread();

  // ---- endpoints (ucx_endpoint.cc) ------------------------------------------------------

  // Creates an endpoint to a kvr worker address (progress thread). Same-host peers get error
  // mode NONE plus a pidfd watch, others UCP_ERR_HANDLING_MODE_PEER (see AddressPrefix).
  // `mode`: -1 decides as described; 1 / 0 force mode PEER / NONE (a back-endpoint must
  // use its client's mode).
  absl::StatusOr<std::shared_ptr<EndpointState>> ConnectOnThread(absl::string_view address,
                                                                 std::string peer_name,
                                                                 int mode = -1);
  // Client side: announces the endpoint's id and this worker's address to the server.
  void SendHello(EndpointState* state);
  // Server side: connects back to a client that said hello.
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void*, size_t,
                              const ucp_am_recv_param_t*);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  // Marks the endpoint failed, fails its calls and schedules the close.
  void FailEndpoint(EndpointState* state, absl::Status error);
  void ScheduleClose(EndpointState* state);
  // Closes endpoints scheduled by error handlers or handle destruction. Done outside UCX
  // callbacks. A failed endpoint is force-closed (flushing to a dead peer would never end).
  void ProcessCloses();
  void CloseNow(EndpointState* state);
  // A rendezvous receive from a peer that died may never complete in UCX 1.13 (seen over TCP
  // after the force close): such a call would never finish. Once the peer is known dead and
  // its endpoint force-closed nothing can write into the destination any more (TCP data
  // arrives only through the closed endpoint; cma reads from the dead process fail), so the
  // receive is cancelled and, if UCX still holds it, abandoned: the call completes with the
  // endpoint's error, and the CallState (with any transport-owned buffer) is parked until
  // the worker is destroyed, so a late completion callback touches only live memory.
  void AbandonReceives(EndpointState* state);
  void ReapCloseRequests();

  // ---- same-host peers' pidfds (ucx_pid_watch.cc) ----------------------------------------

  // Opens a pidfd on the peer process `pid` into state->pid_fd; UNAVAILABLE when it is not
  // running.
  absl::Status OpenPidWatch(EndpointState* state, uint32_t pid);
  // Watches state->pid_fd (if open) in the progress loop's epoll set.
  void ArmPidWatch(EndpointState* state);
  // Stops watching and closes state->pid_fd (if open).
  void ClosePidWatch(EndpointState* state);
  // Fails the endpoints whose peer exited; waits up to `timeout_ms` in epoll (-1: until
  // something happens), which also wakes the loop for UCX and posted commands.
  void CheckPidWatches(int timeout_ms, bool* woke_for_events);

  // ---- active-message calls (ucx_rpc.cc) ------------------------------------------------

  static void PublishCall(const std::shared_ptr<CallState>& call, absl::StatusOr<Response> result);
  // Sets the call's result unless it has one (first outcome wins: a deadline beats a late
  // reply, a reply beats a later endpoint error).
  void SetResult(CallState* call, absl::StatusOr<Response> result);
  // Completes the call once it has a result and UCX holds none of the caller's memory.
  void MaybeFinish(CallState* call);
  void StartCall(std::shared_ptr<CallState> call, std::shared_ptr<EndpointState> ep,
                 std::vector<ByteView> payload);
  absl::Status FailureFor(const EndpointState& ep, ucs_status_t status, absl::string_view what);
  static void OnCallSent(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static void OnReplyReceived(void* request, ucs_status_t status, size_t length, void* user_data);
  // Fails every call still waiting on `ep` with `status` (their UCX sends, if any, are
  // completed by UCX with an error when the endpoint is closed).
  void FailEndpointCalls(EndpointState* ep, const absl::Status& status);

  // ---- server side (ucx_rpc.cc) ---------------------------------------------------------

  static ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  void Reply(std::unique_ptr<IncomingState> state, std::string wire_header,
             std::vector<ByteView> payload, std::function<void(absl::Status)> on_sent,
             Bytes owned_payload);
};

}  // namespace kvr::transport::internal
