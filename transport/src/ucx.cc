// UCX data plane implementation. See kvr/transport/ucx.h for the threading and ownership
// model; the short version: one progress thread per worker owns every ucp_* call on that
// worker, other threads talk to it through `WorkerCore::Post`.

#include "kvr/transport/ucx.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <set>
#include <thread>

#include <ucp/api/ucp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace kvr::transport {
namespace internal {
namespace {

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

AddressPrefix LocalIdentity() {
  AddressPrefix p{};
  p.magic = kAddressMagic;
  p.pid = static_cast<uint32_t>(getpid());
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) == 0) p.pid_namespace = st.st_ino;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    size_t n = std::fread(p.boot_id, 1, kBootIdSize, f);
    (void)n;
    std::fclose(f);
  }
  return p;
}

bool SameHost(const AddressPrefix& a, const AddressPrefix& b) {
  return a.pid_namespace != 0 && a.pid_namespace == b.pid_namespace &&
         std::memcmp(a.boot_id, b.boot_id, kBootIdSize) == 0 && a.boot_id[0] != '\0';
}

absl::Status UcsError(ucs_status_t status, absl::string_view what) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case UCS_ERR_UNSUPPORTED:
      code = absl::StatusCode::kUnimplemented;
      break;
    case UCS_ERR_CANCELED:
      code = absl::StatusCode::kCancelled;
      break;
    case UCS_ERR_TIMED_OUT:
      code = absl::StatusCode::kDeadlineExceeded;
      break;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
      code = absl::StatusCode::kUnavailable;
      break;
    default:
      break;
  }
  return absl::Status(code, absl::StrCat(what, ": ", ucs_status_string(status)));
}

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

}  // namespace

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

  // Creates an endpoint to a kvr worker address (progress thread). Same-host peers get error
  // mode NONE plus a pidfd watch, others UCP_ERR_HANDLING_MODE_PEER (see AddressPrefix).
  // `mode`: -1 decides as described; 1 / 0 force mode PEER / NONE (a back-endpoint must
  // use its client's mode).
  absl::StatusOr<std::shared_ptr<EndpointState>> ConnectOnThread(absl::string_view address,
                                                                 std::string peer_name,
                                                                 int mode = -1) {
    if (stop_requested) {
      return absl::FailedPreconditionError(absl::StrCat("worker '", name, "' shut down"));
    }
    AddressPrefix peer{};
    if (address.size() <= sizeof(peer)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker address for peer '", peer_name, "' is too short (", address.size(), " bytes)"));
    }
    std::memcpy(&peer, address.data(), sizeof(peer));
    if (peer.magic != kAddressMagic) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker address for peer '", peer_name, "' is not a kvr worker address"));
    }
    auto state = std::make_shared<EndpointState>();
    state->core = this;
    state->peer_name = std::move(peer_name);
    const bool same_host = SameHost(peer, identity);
    state->peer_mode = mode == -1 ? !(same_host_pid_watch && same_host) : mode == 1;
    if (!state->peer_mode && same_host && peer.pid != identity.pid) {
      state->peer_pid = static_cast<int>(peer.pid);
      // glibc 2.36 declares pidfd_open but does not export it; use the system call.
      state->pid_fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(peer.pid), 0));
      if (state->pid_fd < 0) {
        return absl::UnavailableError(absl::StrCat("peer '", state->peer_name, "' (pid ", peer.pid,
                                                   ") is not running: ", std::strerror(errno)));
      }
    }
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data() + sizeof(peer));
    params.err_mode = state->peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = &WorkerCore::OnEndpointError;
    params.err_handler.arg = state.get();
    ucs_status_t st = ucp_ep_create(worker, &params, &state->ep);
    if (st != UCS_OK) {
      state->ep = nullptr;
      if (state->pid_fd >= 0) close(state->pid_fd);
      state->pid_fd = -1;
      return absl::UnavailableError(
          absl::StrCat("connect to peer '", state->peer_name, "': ", ucs_status_string(st)));
    }
    endpoints.emplace(state.get(), state);
    if (state->pid_fd >= 0) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = state->pid_fd;
      epoll_ctl(epoll_fd, EPOLL_CTL_ADD, state->pid_fd, &ev);
      pid_watches[state->pid_fd] = state.get();
    }
    return state;
  }

  // Client side: announces the endpoint's id and this worker's address to the server.
  void SendHello(EndpointState* state) {
    state->client_id = client_id_base + next_client_seq++;
    std::string* header = new std::string(sizeof(HelloPrefix), '\0');
    HelloPrefix hello{state->client_id, state->peer_mode ? 1u : 0u, 0};
    std::memcpy(header->data(), &hello, sizeof(hello));
    header->append(address);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = [](void* request, ucs_status_t, void* user_data) {
      ucp_request_free(request);
      delete static_cast<std::string*>(user_data);
    };
    param.user_data = header;
    ucs_status_ptr_t req =
        ucp_am_send_nbx(state->ep, kHelloAmId, header->data(), header->size(), nullptr, 0, &param);
    // Errors surface through the endpoint's error handler and the first call.
    if (req == nullptr || UCS_PTR_IS_ERR(req)) delete header;
  }

  // Server side: connects back to a client that said hello.
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void*, size_t,
                              const ucp_am_recv_param_t*) {
    auto* core = static_cast<WorkerCore*>(arg);
    if (header_length <= sizeof(HelloPrefix)) return UCS_OK;
    HelloPrefix hello;
    std::memcpy(&hello, header, sizeof(hello));
    if (core->clients.contains(hello.client_id)) return UCS_OK;
    absl::string_view address(static_cast<const char*>(header) + sizeof(hello),
                              header_length - sizeof(hello));
    absl::StatusOr<std::shared_ptr<EndpointState>> ep = core->ConnectOnThread(
        address, absl::StrCat("client ", hello.client_id), hello.peer_mode != 0 ? 1 : 0);
    if (!ep.ok()) return UCS_OK;  // its requests are dropped; its calls hit their deadline
    (*ep)->served_client_id = hello.client_id;
    core->clients.emplace(hello.client_id, std::move(*ep));
    return UCS_OK;
  }

  // Calls whose receive was abandoned; released after ucp_worker_destroy.
  std::vector<std::shared_ptr<CallState>> abandoned;

  ~WorkerCore() {
    if (epoll_fd >= 0) close(epoll_fd);
    if (event_fd >= 0) close(event_fd);
  }

  bool OnProgressThread() const { return std::this_thread::get_id() == thread_id; }

  // Enqueues `fn` for the progress thread. False once the worker has shut down.
  bool Post(std::function<void()> fn) {
    {
      absl::MutexLock lock(&queue_mu);
      if (!accepting) return false;
      queue.push_back(std::move(fn));
    }
    if (sleeping.load()) Wake();
    return true;
  }

  void Wake() {
    uint64_t one = 1;
    ssize_t n = write(event_fd, &one, sizeof(one));
    (void)n;  // EAGAIN means the counter is already non-zero: the thread wakes anyway
  }

  // Runs `fn` on the progress thread and waits for it (inline when already there).
  absl::Status RunSync(const std::function<void()>& fn) {
    if (OnProgressThread()) {
      fn();
      return absl::OkStatus();
    }
    absl::Notification done;
    if (!Post([&] {
          fn();
          done.Notify();
        })) {
      return absl::FailedPreconditionError(absl::StrCat("worker '", name, "' is shut down"));
    }
    done.WaitForNotification();
    return absl::OkStatus();
  }

  // ---- client calls ---------------------------------------------------------------------

  static void PublishCall(const std::shared_ptr<CallState>& call, absl::StatusOr<Response> result) {
    std::function<void()> on_done;
    {
      absl::MutexLock lock(&call->mu);
      call->result = std::move(result);
      call->done = true;
      on_done = std::move(call->on_done);
    }
    if (on_done) on_done();
  }

  // Sets the call's result unless it has one (first outcome wins: a deadline beats a late
  // reply, a reply beats a later endpoint error).
  void SetResult(CallState* call, absl::StatusOr<Response> result) {
    if (call->has_result) return;
    call->has_result = true;
    call->pending = std::move(result);
    MaybeFinish(call);
  }

  // Completes the call once it has a result and UCX holds none of the caller's memory.
  void MaybeFinish(CallState* call) {
    if (!call->has_result || call->send_in_flight || call->recv_in_flight) return;
    auto it = calls.find(call->id);
    if (it == calls.end()) return;
    std::shared_ptr<CallState> keep = std::move(it->second);
    calls.erase(it);
    deadlines.erase({keep->deadline, keep->id});
    if (keep->endpoint) keep->endpoint->call_ids.erase(keep->id);
    PublishCall(keep, std::move(keep->pending));
  }

  void StartCall(std::shared_ptr<CallState> call, std::shared_ptr<EndpointState> ep,
                 std::vector<ByteView> payload) {
    if (stop_requested) {
      PublishCall(call, absl::CancelledError(absl::StrCat("worker '", name, "' shut down")));
      return;
    }
    if (ep->closed || ep->ep == nullptr) {
      absl::Status health = ep->Health();
      PublishCall(call, !health.ok() ? health
                                     : absl::FailedPreconditionError(absl::StrCat(
                                           "endpoint to '", ep->peer_name, "' is closed")));
      return;
    }
    call->core = this;
    call->id = next_id++;
    call->endpoint = ep;
    RequestPrefix prefix{call->id, ep->client_id};
    std::memcpy(call->wire_header.data(), &prefix, sizeof(prefix));
    call->send.Set(payload);
    calls.emplace(call->id, call);
    deadlines.insert({call->deadline, call->id});
    ep->call_ids.insert(call->id);

    ucp_request_param_t param{};
    // No UCP_AM_SEND_FLAG_REPLY: the server answers over its own back-endpoint (see
    // IncomingState::reply_to), so UCX's reply endpoint is not needed.
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    param.cb.send = &WorkerCore::OnCallSent;
    param.user_data = call.get();
    param.datatype = call->send.datatype;
    ucs_status_ptr_t req =
        ucp_am_send_nbx(ep->ep, call->am_id, call->wire_header.data(), call->wire_header.size(),
                        call->send.buffer, call->send.count, &param);
    if (UCS_PTR_IS_ERR(req)) {
      SetResult(call.get(), FailureFor(*ep, UCS_PTR_STATUS(req), "send request"));
    } else if (req != nullptr) {
      call->send_in_flight = true;
    }
  }

  absl::Status FailureFor(const EndpointState& ep, ucs_status_t status, absl::string_view what) {
    absl::Status health = ep.Health();
    if (!health.ok()) return health;
    return UcsError(status,
                    absl::StrCat(what, " to peer '", ep.peer_name, "' (worker '", name, "')"));
  }

  static void OnCallSent(void* request, ucs_status_t status, void* user_data) {
    auto* call = static_cast<CallState*>(user_data);
    // MaybeFinish may drop the map's reference; keep the call alive through this callback.
    std::shared_ptr<CallState> keep = call->shared_from_this();
    WorkerCore* core = call->core;
    ucp_request_free(request);
    if (call->abandoned) return;
    call->send_in_flight = false;
    if (status != UCS_OK) {
      core->SetResult(call, core->FailureFor(*call->endpoint, status, "send request"));
    }
    core->MaybeFinish(call);
  }

  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    auto* core = static_cast<WorkerCore*>(arg);
    if (header_length < sizeof(ReplyPrefix)) return UCS_OK;  // not ours: drop
    ReplyPrefix prefix;
    std::memcpy(&prefix, header, sizeof(prefix));
    if (header_length < sizeof(ReplyPrefix) + prefix.message_size) return UCS_OK;
    auto it = core->calls.find(prefix.request_id);
    // Unknown id: a late reply to a call that already timed out or was cancelled. Returning
    // UCS_OK drops eager data and, for rendezvous, releases the sender's buffer.
    if (it == core->calls.end() || it->second->has_result) return UCS_OK;
    std::shared_ptr<CallState> keep = it->second;
    CallState* call = keep.get();
    const char* bytes = static_cast<const char*>(header);
    if (prefix.status_code != 0) {
      absl::string_view message(bytes + sizeof(ReplyPrefix), prefix.message_size);
      core->SetResult(
          call, absl::Status(static_cast<absl::StatusCode>(prefix.status_code),
                             absl::StrCat("peer '", call->endpoint->peer_name, "': ", message)));
      return UCS_OK;
    }
    Response response;
    response.header.assign(bytes + sizeof(ReplyPrefix) + prefix.message_size,
                           header_length - sizeof(ReplyPrefix) - prefix.message_size);
    response.payload_size = length;
    uint8_t* dest = nullptr;
    if (!call->reply_buffer.empty()) {
      if (length > call->reply_buffer.size()) {
        core->SetResult(
            call, absl::OutOfRangeError(absl::StrCat(
                      "reply payload of ", length, " bytes from peer '", call->endpoint->peer_name,
                      "' does not fit the ", call->reply_buffer.size(), "-byte reply buffer")));
        return UCS_OK;
      }
      dest = call->reply_buffer.data();
    } else {
      response.payload = Bytes::Uninitialized(length);
      dest = response.payload.data();
    }
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      if (length > 0) std::memcpy(dest, data, length);
      core->SetResult(call, std::move(response));
      return UCS_OK;
    }
    // Rendezvous: pull the payload straight into its destination (zero-copy on RDMA).
    call->recv_response = std::move(response);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &WorkerCore::OnReplyReceived;
    rp.user_data = call;
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(core->worker, data, dest, length, &rp);
    if (UCS_PTR_IS_ERR(req)) {
      core->SetResult(
          call, core->FailureFor(*call->endpoint, UCS_PTR_STATUS(req), "receive reply payload"));
    } else if (req == nullptr) {
      core->SetResult(call, std::move(call->recv_response));
    } else {
      call->recv_in_flight = true;
      call->recv_request = req;
    }
    return UCS_INPROGRESS;
  }

  static void OnReplyReceived(void* request, ucs_status_t status, size_t length, void* user_data) {
    auto* call = static_cast<CallState*>(user_data);
    std::shared_ptr<CallState> keep = call->shared_from_this();
    WorkerCore* core = call->core;
    ucp_request_free(request);
    if (call->abandoned) return;
    call->recv_in_flight = false;
    call->recv_request = nullptr;
    if (status != UCS_OK) {
      core->SetResult(call, core->FailureFor(*call->endpoint, status, "receive reply payload"));
    } else {
      core->SetResult(call, std::move(call->recv_response));
    }
    core->MaybeFinish(call);
  }

  // Fails every call still waiting on `ep` with `status` (their UCX sends, if any, are
  // completed by UCX with an error when the endpoint is closed).
  void FailEndpointCalls(EndpointState* ep, const absl::Status& status) {
    std::vector<uint64_t> ids(ep->call_ids.begin(), ep->call_ids.end());
    for (uint64_t id : ids) {
      auto it = calls.find(id);
      if (it == calls.end()) continue;
      std::shared_ptr<CallState> keep = it->second;
      SetResult(keep.get(), status);
    }
  }

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* state = static_cast<EndpointState*>(arg);
    state->core->FailEndpoint(
        state, absl::UnavailableError(absl::StrCat("peer '", state->peer_name,
                                                   "' failed: ", ucs_status_string(status))));
  }

  // Marks the endpoint failed, fails its calls and schedules the close.
  void FailEndpoint(EndpointState* state, absl::Status error) {
    {
      absl::MutexLock lock(&state->mu);
      if (state->health.ok()) state->health = error;
    }
    // `state` is kept alive by `endpoints` until the close completes.
    FailEndpointCalls(state, error);
    ScheduleClose(state);
  }

  // Same-host peers: a readable pidfd means the peer process exited.
  absl::flat_hash_map<int, EndpointState*> pid_watches;
  absl::Time next_pid_check;

  void CheckPidWatches(int timeout_ms, bool* woke_for_events) {
    epoll_event events[16];
    int n = epoll_wait(epoll_fd, events, 16, timeout_ms);
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == event_fd) {
        uint64_t count;
        ssize_t r = read(event_fd, &count, sizeof(count));
        (void)r;
        continue;
      }
      auto it = pid_watches.find(fd);
      if (it == pid_watches.end()) continue;
      EndpointState* state = it->second;
      FailEndpoint(state, absl::UnavailableError(absl::StrCat("peer '", state->peer_name, "' (pid ",
                                                              state->peer_pid, ") exited")));
    }
    if (woke_for_events != nullptr) *woke_for_events = n > 0;
  }

  void ScheduleClose(EndpointState* state) {
    auto it = endpoints.find(state);
    if (it == endpoints.end() || state->closed) return;
    state->closed = true;
    to_close.push_back(it->second);
  }

  // Closes endpoints scheduled by error handlers or handle destruction. Done outside UCX
  // callbacks. A failed endpoint is force-closed (flushing to a dead peer would never end).
  void ProcessCloses() {
    while (!to_close.empty()) {
      std::shared_ptr<EndpointState> state = std::move(to_close.back());
      to_close.pop_back();
      CloseNow(state.get());
    }
  }

  void CloseNow(EndpointState* state) {
    if (state->ep == nullptr) return;
    if (state->pid_fd >= 0) {
      epoll_ctl(epoll_fd, EPOLL_CTL_DEL, state->pid_fd, nullptr);
      pid_watches.erase(state->pid_fd);
      close(state->pid_fd);
      state->pid_fd = -1;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Force close where allowed (mode PEER, or the peer is dead): pending sends complete with
    // CANCELED at once instead of a destructor waiting on a slow or dead peer. UCX forbids
    // force-closing a mode-NONE endpoint to a live peer (undefined behaviour at the remote
    // side), so those flush; the close request is reaped asynchronously.
    param.flags = (state->peer_mode || !state->Health().ok()) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t req = ucp_ep_close_nbx(state->ep, &param);
    state->ep = nullptr;
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) close_requests.insert(req);
    if (!state->Health().ok()) AbandonReceives(state);
    if (state->served_client_id != 0) clients.erase(state->served_client_id);
    // Rkeys unpacked on this endpoint become unusable; destroy them now (ucp_rkey_destroy
    // must not outlive the endpoint's configuration).
    for (auto it = rkeys.begin(); it != rkeys.end();) {
      auto cur = it++;
      if ((*cur)->endpoint.get() == state) {
        if ((*cur)->rkey != nullptr) ucp_rkey_destroy((*cur)->rkey);
        (*cur)->rkey = nullptr;
        rkeys.erase(cur);
      }
    }
    endpoints.erase(state);
  }

  // A rendezvous receive from a peer that died may never complete in UCX 1.13 (seen over TCP
  // after the force close): such a call would never finish. Once the peer is known dead and
  // its endpoint force-closed nothing can write into the destination any more (TCP data
  // arrives only through the closed endpoint; cma reads from the dead process fail), so the
  // receive is cancelled and, if UCX still holds it, abandoned: the call completes with the
  // endpoint's error, and the CallState (with any transport-owned buffer) is parked until
  // the worker is destroyed, so a late completion callback touches only live memory.
  void AbandonReceives(EndpointState* state) {
    std::vector<uint64_t> ids(state->call_ids.begin(), state->call_ids.end());
    for (uint64_t id : ids) {
      auto it = calls.find(id);
      if (it == calls.end() || !it->second->recv_in_flight) continue;
      std::shared_ptr<CallState> call = it->second;
      ucp_request_cancel(worker, call->recv_request);  // may complete it synchronously
      if (!call->recv_in_flight) continue;
      call->abandoned = true;
      call->recv_request = nullptr;
      call->recv_in_flight = false;
      abandoned.push_back(call);
      SetResult(call.get(), state->Health());
      MaybeFinish(call.get());
    }
  }

  void ReapCloseRequests() {
    for (auto it = close_requests.begin(); it != close_requests.end();) {
      auto cur = it++;
      if (ucp_request_check_status(*cur) != UCS_INPROGRESS) {
        ucp_request_free(*cur);
        close_requests.erase(cur);
      }
    }
  }

  // ---- server side ----------------------------------------------------------------------

  static ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

  void Reply(std::unique_ptr<IncomingState> state, std::string wire_header,
             std::vector<ByteView> payload, std::function<void(absl::Status)> on_sent,
             Bytes owned_payload);

  // ---- progress loop --------------------------------------------------------------------

  void ExpireDeadlines(absl::Time now) {
    while (!deadlines.empty() && deadlines.begin()->first <= now) {
      auto [deadline, id] = *deadlines.begin();
      deadlines.erase(deadlines.begin());
      auto it = calls.find(id);
      if (it == calls.end()) continue;
      std::shared_ptr<CallState> call = it->second;
      // A reply whose payload is already streaming in is let finish: it beat the deadline.
      if (call->has_result || call->recv_in_flight) continue;
      SetResult(call.get(), absl::DeadlineExceededError(absl::StrCat(
                                "call (am ", call->am_id, ") to peer '", call->endpoint->peer_name,
                                "' from worker '", name, "' exceeded its deadline")));
    }
  }

  bool DrainQueue() {
    std::deque<std::function<void()>> batch;
    {
      absl::MutexLock lock(&queue_mu);
      batch.swap(queue);
    }
    for (auto& fn : batch) fn();
    return !batch.empty();
  }

  void Loop() {
    absl::Time last_activity = absl::Now();
    while (!stop_requested) {
      bool active = DrainQueue();
      while (ucp_worker_progress(worker) != 0) active = true;
      ProcessCloses();
      ReapCloseRequests();
      absl::Time now = absl::Now();
      ExpireDeadlines(now);
      // While busy the loop does not sleep in epoll; look at the pid watches every 1 ms.
      if (!pid_watches.empty() && now >= next_pid_check) {
        CheckPidWatches(0, nullptr);
        next_pid_check = now + absl::Milliseconds(1);
      }
      if (active) {
        last_activity = now;
        continue;
      }
      if (now - last_activity < spin) continue;
      // Idle: arm the worker and sleep until UCX, a command or the next deadline wakes us.
      sleeping.store(true);
      {
        absl::MutexLock lock(&queue_mu);
        if (!queue.empty()) {
          sleeping.store(false);
          continue;
        }
      }
      ucs_status_t armed = ucp_worker_arm(worker);
      if (armed == UCS_ERR_BUSY) {
        sleeping.store(false);
        continue;
      }
      int timeout_ms = -1;
      if (!deadlines.empty()) {
        absl::Duration left = deadlines.begin()->first - absl::Now();
        timeout_ms =
            left <= absl::ZeroDuration()
                ? 0
                : static_cast<int>(std::min<int64_t>(
                      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 60'000));
      }
      CheckPidWatches(timeout_ms, nullptr);
      sleeping.store(false);
      last_activity = absl::Now();
    }
    ShutdownOnThread();
  }

  void ShutdownOnThread() {
    {
      absl::MutexLock lock(&queue_mu);
      accepting = false;
    }
    DrainQueue();  // commands posted before `accepting` flipped see stop_requested
    absl::Status cancelled = absl::CancelledError(absl::StrCat("worker '", name, "' shut down"));
    std::vector<std::shared_ptr<EndpointState>> eps;
    for (auto& [raw, ep] : endpoints) eps.push_back(ep);
    for (auto& ep : eps) {
      FailEndpointCalls(ep.get(), cancelled);
      ep->closed = true;
      CloseNow(ep.get());
    }
    // Force-closing completes outstanding UCX requests with CANCELED; progress until the
    // callbacks ran so that no caller memory stays referenced. Bounded: a close that does
    // not finish within 2 s is abandoned (ucp_worker_destroy reclaims it).
    absl::Time give_up = absl::Now() + absl::Seconds(2);
    while ((!close_requests.empty() || !calls.empty()) && absl::Now() < give_up) {
      ucp_worker_progress(worker);
      ReapCloseRequests();
    }
    for (auto& [id, call] : calls) {
      // UCX may still complete these requests inside ucp_worker_destroy: keep the states.
      call->abandoned = true;
      abandoned.push_back(call);
      absl::StatusOr<Response> result = cancelled;
      PublishCall(call, std::move(result));
    }
    calls.clear();
    for (const auto& rkey : rkeys) {
      if (rkey->rkey != nullptr) ucp_rkey_destroy(rkey->rkey);
      rkey->rkey = nullptr;
    }
    rkeys.clear();
    for (void* req : close_requests) ucp_request_free(req);
    close_requests.clear();
    handlers.clear();
  }
};

IncomingState::~IncomingState() {
  if (!replied && core != nullptr && reply_to != nullptr) {
    // Dropped without a reply: answer INTERNAL so the caller does not wait for its deadline.
    auto self = std::make_unique<IncomingState>();
    self->core = core;
    self->reply_to = reply_to;
    self->request_id = request_id;
    self->replied = true;
    ReplyPrefix prefix{request_id, static_cast<int32_t>(absl::StatusCode::kInternal), 0};
    constexpr std::string_view kMessage = "request dropped by the handler without a reply";
    prefix.message_size = kMessage.size();
    std::string wire(sizeof(prefix), '\0');
    std::memcpy(wire.data(), &prefix, sizeof(prefix));
    wire.append(kMessage);
    std::shared_ptr<WorkerCore> c = core;
    auto moved = std::make_shared<std::unique_ptr<IncomingState>>(std::move(self));
    c->Post([c, moved, wire = std::move(wire)]() mutable {
      c->Reply(std::move(*moved), std::move(wire), {}, {}, Bytes());
    });
  }
  if (ucx_data != nullptr && core != nullptr) {
    void* data = ucx_data;
    WorkerCore* c = core.get();
    // Released on the progress thread, after the AM callback that handed it to us returned.
    // If the worker has shut down, ucp_worker_destroy has reclaimed it.
    core->Post([c, data] { ucp_am_data_release(c->worker, data); });
  }
}

void WorkerCore::Reply(std::unique_ptr<IncomingState> state, std::string wire_header,
                       std::vector<ByteView> payload, std::function<void(absl::Status)> on_sent,
                       Bytes owned_payload) {
  struct InFlight {
    WorkerCore* core;
    std::unique_ptr<IncomingState> request;  // keeps the request's payload alive
    std::string wire_header;
    Bytes owned;
    SendBuffer send;
    std::function<void(absl::Status)> on_sent;
  };
  auto* f = new InFlight{this, std::move(state),  std::move(wire_header), std::move(owned_payload),
                         {},   std::move(on_sent)};
  if (!f->owned.empty()) payload = {f->owned.view()};
  f->send.Set(payload);
  auto finish = [](InFlight* f, absl::Status status) {
    if (f->on_sent) f->on_sent(std::move(status));
    delete f;
  };
  if (stop_requested) {
    finish(f, absl::CancelledError(absl::StrCat("worker '", name, "' shut down")));
    return;
  }
  EndpointState* to = f->request->reply_to.get();
  if (to->ep == nullptr) {
    absl::Status health = to->Health();
    finish(f, !health.ok() ? health
                           : absl::UnavailableError(
                                 absl::StrCat("connection to ", to->peer_name, " is closed")));
    return;
  }
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    auto* f = static_cast<InFlight*>(user_data);
    ucp_request_free(request);
    absl::Status s = status == UCS_OK ? absl::OkStatus() : UcsError(status, "send reply");
    if (f->on_sent) f->on_sent(std::move(s));
    delete f;
  };
  param.user_data = f;
  param.datatype = f->send.datatype;
  ucs_status_ptr_t req =
      ucp_am_send_nbx(to->ep, kReplyAmId, f->wire_header.data(), f->wire_header.size(),
                      f->send.buffer, f->send.count, &param);
  if (UCS_PTR_IS_ERR(req)) {
    finish(f, UcsError(UCS_PTR_STATUS(req), "send reply"));
  } else if (req == nullptr) {
    finish(f, absl::OkStatus());
  }
}

ucs_status_t WorkerCore::OnRequest(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  auto* entry = static_cast<HandlerEntry*>(arg);
  WorkerCore* core = entry->core;
  // Without our prefix, or from a client whose hello we do not know, there is nobody to
  // answer: drop (the caller's deadline ends its call). Hellos precede requests on an
  // endpoint and UCX delivers active messages of one endpoint in order.
  if (header_length < sizeof(RequestPrefix)) return UCS_OK;
  RequestPrefix prefix;
  std::memcpy(&prefix, header, sizeof(prefix));
  auto client = core->clients.find(prefix.client_id);
  if (client == core->clients.end()) return UCS_OK;
  auto state = std::make_unique<IncomingState>();
  state->core = core->shared_from_this();
  state->reply_to = client->second;
  state->request_id = prefix.request_id;
  state->am_id = entry->am_id;
  state->header.assign(static_cast<const char*>(header) + sizeof(prefix),
                       header_length - sizeof(prefix));

  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  std::span<uint8_t> dest;
  if (entry->options.payload_destination) {
    absl::StatusOr<std::span<uint8_t>> chosen =
        entry->options.payload_destination(AsBytes(state->header), length);
    if (!chosen.ok() || chosen->size() < length) {
      absl::Status error = !chosen.ok()
                               ? chosen.status()
                               : absl::InvalidArgumentError(absl::StrCat(
                                     "payload destination of ", chosen->size(),
                                     " bytes is smaller than the ", length, "-byte payload"));
      IncomingRequest request(std::move(state));
      (void)request.ReplyError(error);
      return UCS_OK;  // drops eager data / releases a rendezvous sender
    }
    dest = chosen->subspan(0, length);
  }

  if (!rndv) {
    ucs_status_t ret = UCS_OK;
    if (!dest.empty() || length == 0) {
      if (length > 0) std::memcpy(dest.data(), data, length);
      state->payload = ByteView(dest.data(), length);
    } else if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) {
      // Keep UCX's buffer (zero-copy); released when the request is destroyed.
      state->ucx_data = data;
      state->payload = ByteView(static_cast<const uint8_t*>(data), length);
      ret = UCS_INPROGRESS;
    } else {
      state->owned = Bytes::Copy(ByteView(static_cast<const uint8_t*>(data), length));
      state->payload = state->owned.view();
    }
    entry->handler(IncomingRequest(std::move(state)));
    return ret;
  }

  // Rendezvous: receive the payload first, then run the handler.
  if (dest.empty()) {
    state->owned = Bytes::Uninitialized(length);
    dest = state->owned.span();
  }
  state->payload = ByteView(dest.data(), length);
  struct Pending {
    HandlerEntry* entry;
    std::unique_ptr<IncomingState> state;
  };
  auto* pending = new Pending{entry, std::move(state)};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    auto* p = static_cast<Pending*>(user_data);
    ucp_request_free(request);
    IncomingRequest req(std::move(p->state));
    HandlerEntry* e = p->entry;
    delete p;
    if (status != UCS_OK) {
      (void)req.ReplyError(UcsError(status, "receive request payload"));
      return;
    }
    e->handler(std::move(req));
  };
  rp.user_data = pending;
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(core->worker, data, dest.data(), length, &rp);
  if (UCS_PTR_IS_ERR(req)) {
    IncomingRequest r(std::move(pending->state));
    delete pending;
    (void)r.ReplyError(UcsError(UCS_PTR_STATUS(req), "receive request payload"));
  } else if (req == nullptr) {
    IncomingRequest r(std::move(pending->state));
    delete pending;
    entry->handler(std::move(r));
  }
  return UCS_INPROGRESS;
}

}  // namespace internal

using internal::CallState;
using internal::ContextCore;
using internal::EndpointState;
using internal::IncomingState;
using internal::RkeyState;
using internal::TransferState;
using internal::WorkerCore;

// ---------------------------------------------------------------------------------------------
// Context / MemoryRegion

absl::StatusOr<Context> Context::Create(const ContextOptions& options) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return internal::UcsError(st, "ucp_config_read");
  for (const auto& [key, value] : options.ucx_config) {
    st = ucp_config_modify(config, key.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return internal::UcsError(st, absl::StrCat("UCX config ", key, "=", value));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  auto core = std::make_shared<ContextCore>();
  st = ucp_init(&params, config, &core->context);
  ucp_config_release(config);
  if (st != UCS_OK) {
    core->context = nullptr;
    return internal::UcsError(st, "ucp_init");
  }
  return Context(std::move(core));
}

Context::Context(std::shared_ptr<ContextCore> core) : core_(std::move(core)) {}
Context::Context(Context&&) noexcept = default;
Context& Context::operator=(Context&&) noexcept = default;
Context::~Context() = default;

absl::StatusOr<MemoryRegion> Context::Register(std::span<uint8_t> buffer) const {
  if (core_ == nullptr) return absl::FailedPreconditionError("moved-from Context");
  if (buffer.empty()) return absl::InvalidArgumentError("cannot register an empty buffer");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = buffer.data();
  params.length = buffer.size();
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(core_->context, &params, &memh);
  if (st != UCS_OK) {
    return internal::UcsError(st, absl::StrCat("ucp_mem_map of ", buffer.size(), " bytes"));
  }
  return MemoryRegion(core_, memh, buffer.data(), buffer.size());
}

absl::StatusOr<MemoryRegion> Context::Allocate(size_t bytes) const {
  if (core_ == nullptr) return absl::FailedPreconditionError("moved-from Context");
  if (bytes == 0) return absl::InvalidArgumentError("cannot allocate an empty region");
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(core_->context, &params, &memh);
  if (st != UCS_OK) {
    return internal::UcsError(st, absl::StrCat("ucp_mem_map(ALLOCATE) of ", bytes, " bytes"));
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  st = ucp_mem_query(memh, &attr);
  if (st != UCS_OK) {
    ucp_mem_unmap(core_->context, memh);
    return internal::UcsError(st, "ucp_mem_query");
  }
  return MemoryRegion(core_, memh, static_cast<uint8_t*>(attr.address), bytes);
}

MemoryRegion::MemoryRegion(std::shared_ptr<ContextCore> core, void* memh, uint8_t* data,
                           size_t size)
    : core_(std::move(core)), memh_(memh), data_(data), size_(size) {}

MemoryRegion::MemoryRegion(MemoryRegion&& other) noexcept
    : core_(std::move(other.core_)),
      memh_(std::exchange(other.memh_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MemoryRegion& MemoryRegion::operator=(MemoryRegion&& other) noexcept {
  if (this != &other) {
    if (memh_ != nullptr) ucp_mem_unmap(core_->context, static_cast<ucp_mem_h>(memh_));
    core_ = std::move(other.core_);
    memh_ = std::exchange(other.memh_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MemoryRegion::~MemoryRegion() {
  if (memh_ != nullptr) ucp_mem_unmap(core_->context, static_cast<ucp_mem_h>(memh_));
}

absl::StatusOr<std::string> MemoryRegion::PackRkey() const {
  if (memh_ == nullptr) return absl::FailedPreconditionError("moved-from MemoryRegion");
  void* buffer = nullptr;
  size_t size = 0;
  ucs_status_t st = ucp_rkey_pack(core_->context, static_cast<ucp_mem_h>(memh_), &buffer, &size);
  if (st != UCS_OK) return internal::UcsError(st, "ucp_rkey_pack");
  std::string packed(static_cast<const char*>(buffer), size);
  ucp_rkey_buffer_release(buffer);
  return packed;
}

// ---------------------------------------------------------------------------------------------
// PendingCall / PendingTransfer

PendingCall::PendingCall(std::shared_ptr<CallState> state) : state_(std::move(state)) {}
PendingCall::PendingCall(PendingCall&&) noexcept = default;
PendingCall& PendingCall::operator=(PendingCall&&) noexcept = default;
PendingCall::~PendingCall() = default;

OpState PendingCall::state() const {
  if (state_ == nullptr) return OpState::kDone;
  absl::MutexLock lock(&state_->mu);
  return state_->done ? OpState::kDone : OpState::kInProgress;
}

absl::StatusOr<Response> PendingCall::Wait() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty PendingCall");
  if (state_->owner != nullptr && state_->owner->OnProgressThread() &&
      state() == OpState::kInProgress) {
    // The progress thread would wait for itself.
    return absl::FailedPreconditionError(
        "PendingCall::Wait() called on the worker's progress thread (from a handler or "
        "on_done hook) would deadlock; reply asynchronously instead");
  }
  absl::MutexLock lock(&state_->mu);
  state_->mu.Await(absl::Condition(&state_->done));
  if (state_->taken) return absl::FailedPreconditionError("PendingCall result already taken");
  state_->taken = true;
  return std::move(state_->result);
}

PendingTransfer::PendingTransfer(std::shared_ptr<TransferState> state) : state_(std::move(state)) {}
PendingTransfer::PendingTransfer(PendingTransfer&&) noexcept = default;
PendingTransfer& PendingTransfer::operator=(PendingTransfer&&) noexcept = default;
PendingTransfer::~PendingTransfer() = default;

OpState PendingTransfer::state() const {
  if (state_ == nullptr) return OpState::kDone;
  absl::MutexLock lock(&state_->mu);
  return state_->done ? OpState::kDone : OpState::kInProgress;
}

absl::Status PendingTransfer::Wait() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty PendingTransfer");
  absl::MutexLock lock(&state_->mu);
  state_->mu.Await(absl::Condition(&state_->done));
  return state_->result;
}

// ---------------------------------------------------------------------------------------------
// IncomingRequest

IncomingRequest::IncomingRequest(std::unique_ptr<IncomingState> state) : state_(std::move(state)) {}
IncomingRequest::IncomingRequest(IncomingRequest&&) noexcept = default;
IncomingRequest& IncomingRequest::operator=(IncomingRequest&&) noexcept = default;
IncomingRequest::~IncomingRequest() = default;

AmId IncomingRequest::am_id() const { return state_ ? state_->am_id : 0; }
ByteView IncomingRequest::header() const { return state_ ? AsBytes(state_->header) : ByteView(); }
ByteView IncomingRequest::payload() const { return state_ ? state_->payload : ByteView(); }

namespace {
std::string ReplyWireHeader(uint64_t request_id, const absl::Status& status, ByteView header) {
  internal::ReplyPrefix prefix{request_id, static_cast<int32_t>(status.code()),
                               static_cast<uint32_t>(status.message().size())};
  std::string wire(sizeof(prefix), '\0');
  std::memcpy(wire.data(), &prefix, sizeof(prefix));
  wire.append(status.message().data(), status.message().size());
  wire.append(reinterpret_cast<const char*>(header.data()), header.size());
  return wire;
}
}  // namespace

absl::Status IncomingRequest::Reply(ByteView header, std::vector<ByteView> payload,
                                    std::function<void(absl::Status)> on_sent) {
  if (state_ == nullptr || state_->replied) {
    return absl::FailedPreconditionError("request already replied to");
  }
  state_->replied = true;
  std::string wire = ReplyWireHeader(state_->request_id, absl::OkStatus(), header);
  std::shared_ptr<WorkerCore> core = state_->core;
  auto moved = std::make_shared<std::unique_ptr<IncomingState>>(std::move(state_));
  auto cmd = [core, moved, wire = std::move(wire), payload = std::move(payload),
              on_sent]() mutable {
    core->Reply(std::move(*moved), std::move(wire), std::move(payload), std::move(on_sent),
                Bytes());
  };
  if (core->OnProgressThread()) {
    cmd();
    return absl::OkStatus();
  }
  if (!core->Post(std::move(cmd))) {
    return absl::FailedPreconditionError(absl::StrCat("worker '", core->name, "' is shut down"));
  }
  return absl::OkStatus();
}

absl::Status IncomingRequest::Reply(ByteView header, Bytes payload) {
  if (state_ == nullptr || state_->replied) {
    return absl::FailedPreconditionError("request already replied to");
  }
  state_->replied = true;
  std::string wire = ReplyWireHeader(state_->request_id, absl::OkStatus(), header);
  std::shared_ptr<WorkerCore> core = state_->core;
  auto moved = std::make_shared<std::unique_ptr<IncomingState>>(std::move(state_));
  auto owned = std::make_shared<Bytes>(std::move(payload));
  auto cmd = [core, moved, owned, wire = std::move(wire)]() mutable {
    core->Reply(std::move(*moved), std::move(wire), {}, {}, std::move(*owned));
  };
  if (core->OnProgressThread()) {
    cmd();
    return absl::OkStatus();
  }
  if (!core->Post(std::move(cmd))) {
    return absl::FailedPreconditionError(absl::StrCat("worker '", core->name, "' is shut down"));
  }
  return absl::OkStatus();
}

absl::Status IncomingRequest::ReplyError(const absl::Status& error) {
  if (state_ == nullptr || state_->replied) {
    return absl::FailedPreconditionError("request already replied to");
  }
  absl::Status status =
      error.ok() ? absl::InternalError("handler replied with an OK error status") : error;
  state_->replied = true;
  std::string wire = ReplyWireHeader(state_->request_id, status, ByteView());
  std::shared_ptr<WorkerCore> core = state_->core;
  auto moved = std::make_shared<std::unique_ptr<IncomingState>>(std::move(state_));
  auto cmd = [core, moved, wire = std::move(wire)]() mutable {
    core->Reply(std::move(*moved), std::move(wire), {}, {}, Bytes());
  };
  if (core->OnProgressThread()) {
    cmd();
    return absl::OkStatus();
  }
  if (!core->Post(std::move(cmd))) {
    return absl::FailedPreconditionError(absl::StrCat("worker '", core->name, "' is shut down"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Endpoint

Endpoint::Endpoint(std::shared_ptr<WorkerCore> worker, std::shared_ptr<EndpointState> state)
    : worker_(std::move(worker)), state_(std::move(state)) {}
Endpoint::Endpoint(Endpoint&&) noexcept = default;
Endpoint& Endpoint::operator=(Endpoint&& other) noexcept {
  if (this != &other) {
    this->~Endpoint();
    new (this) Endpoint(std::move(other));
  }
  return *this;
}

Endpoint::~Endpoint() {
  if (state_ == nullptr) return;
  std::shared_ptr<WorkerCore> core = worker_;
  std::shared_ptr<EndpointState> state = state_;
  core->Post([core, state] {
    if (state->closed) return;
    core->FailEndpointCalls(
        state.get(), absl::CancelledError(
                         absl::StrCat("endpoint to '", state->peer_name, "' closed by its owner")));
    core->ScheduleClose(state.get());
  });
}

const std::string& Endpoint::peer_name() const { return state_->peer_name; }

absl::Status Endpoint::health() const {
  if (state_ == nullptr) return absl::FailedPreconditionError("moved-from Endpoint");
  return state_->Health();
}

PendingCall Endpoint::Call(AmId am_id, ByteView header, std::vector<ByteView> payload,
                           CallOptions options) {
  auto call = std::make_shared<CallState>();
  call->owner = worker_.get();
  call->am_id = am_id;
  call->reply_buffer = options.reply_buffer;
  call->on_done = std::move(options.on_done);
  call->deadline = options.deadline;
  if (state_ == nullptr) {
    WorkerCore::PublishCall(call, absl::FailedPreconditionError("moved-from Endpoint"));
    return PendingCall(std::move(call));
  }
  if (am_id == 0 || am_id > kMaxUserAmId) {
    WorkerCore::PublishCall(
        call, absl::InvalidArgumentError(
                  absl::StrCat("active-message id ", am_id, " is outside 1..", kMaxUserAmId)));
    return PendingCall(std::move(call));
  }
  call->wire_header.resize(sizeof(internal::RequestPrefix));
  call->wire_header.append(reinterpret_cast<const char*>(header.data()), header.size());
  std::shared_ptr<WorkerCore> core = worker_;
  std::shared_ptr<EndpointState> state = state_;
  auto cmd = [core, state, call, payload = std::move(payload)]() mutable {
    core->StartCall(call, state, std::move(payload));
  };
  if (core->OnProgressThread()) {
    cmd();
  } else if (!core->Post(std::move(cmd))) {
    WorkerCore::PublishCall(
        call, absl::CancelledError(absl::StrCat("worker '", core->name, "' shut down")));
  }
  return PendingCall(std::move(call));
}

absl::StatusOr<Response> Endpoint::CallSync(AmId am_id, ByteView header,
                                            std::vector<ByteView> payload, CallOptions options) {
  return Call(am_id, header, std::move(payload), std::move(options)).Wait();
}

absl::StatusOr<RemoteKey> Endpoint::UnpackRkey(std::string_view packed) {
  if (state_ == nullptr) return absl::FailedPreconditionError("moved-from Endpoint");
  if (packed.empty()) return absl::InvalidArgumentError("empty packed rkey");
  auto rkey = std::make_shared<RkeyState>();
  rkey->endpoint = state_;
  absl::Status result;
  std::shared_ptr<WorkerCore> core = worker_;
  absl::Status run = core->RunSync([&] {
    if (state_->ep == nullptr) {
      result = state_->Health().ok() ? absl::FailedPreconditionError(absl::StrCat(
                                           "endpoint to '", state_->peer_name, "' is closed"))
                                     : state_->Health();
      return;
    }
    ucs_status_t st = ucp_ep_rkey_unpack(state_->ep, packed.data(), &rkey->rkey);
    if (st != UCS_OK) {
      result =
          internal::UcsError(st, absl::StrCat("unpack rkey from peer '", state_->peer_name, "'"));
      return;
    }
    core->rkeys.insert(rkey);
  });
  if (!run.ok()) return run;
  if (!result.ok()) return result;
  return RemoteKey(core, std::move(rkey));
}

PendingTransfer Endpoint::Get(uint64_t remote_address, const RemoteKey& rkey,
                              std::span<uint8_t> local, absl::Time deadline) {
  auto transfer = std::make_shared<TransferState>();
  if (state_ == nullptr || rkey.state_ == nullptr) {
    transfer->Finish(absl::FailedPreconditionError("moved-from Endpoint or RemoteKey"));
    return PendingTransfer(std::move(transfer));
  }
  if (rkey.state_->endpoint != state_) {
    transfer->Finish(absl::InvalidArgumentError(absl::StrCat(
        "remote key was unpacked for another endpoint than the one to '", state_->peer_name, "'")));
    return PendingTransfer(std::move(transfer));
  }
  std::shared_ptr<WorkerCore> core = worker_;
  std::shared_ptr<EndpointState> state = state_;
  std::shared_ptr<RkeyState> key = rkey.state_;
  auto cmd = [core, state, key, transfer, remote_address, local] {
    if (core->stop_requested || state->ep == nullptr || key->rkey == nullptr) {
      absl::Status health = state->Health();
      transfer->Finish(!health.ok() ? health
                                    : absl::FailedPreconditionError(absl::StrCat(
                                          "endpoint to '", state->peer_name, "' is closed")));
      return;
    }
    struct Ctx {
      std::shared_ptr<TransferState> transfer;
      std::shared_ptr<EndpointState> state;
      WorkerCore* core;
    };
    auto* ctx = new Ctx{transfer, state, core.get()};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
      auto* ctx = static_cast<Ctx*>(user_data);
      ucp_request_free(request);
      ctx->transfer->Finish(status == UCS_OK
                                ? absl::OkStatus()
                                : ctx->core->FailureFor(*ctx->state, status, "RMA get"));
      delete ctx;
    };
    param.user_data = ctx;
    ucs_status_ptr_t req =
        ucp_get_nbx(state->ep, local.data(), local.size(), remote_address, key->rkey, &param);
    if (UCS_PTR_IS_ERR(req)) {
      transfer->Finish(core->FailureFor(*state, UCS_PTR_STATUS(req), "RMA get"));
      delete ctx;
    } else if (req == nullptr) {
      transfer->Finish(absl::OkStatus());
      delete ctx;
    }
  };
  (void)deadline;  // see the header: a get ends when UCX releases the buffer
  if (core->OnProgressThread()) {
    cmd();
  } else if (!core->Post(std::move(cmd))) {
    transfer->Finish(absl::CancelledError(absl::StrCat("worker '", core->name, "' shut down")));
  }
  return PendingTransfer(std::move(transfer));
}

absl::Status Endpoint::GetSync(uint64_t remote_address, const RemoteKey& rkey,
                               std::span<uint8_t> local, absl::Time deadline) {
  return Get(remote_address, rkey, local, deadline).Wait();
}

absl::StatusOr<std::vector<std::string>> Endpoint::Transports() const {
  if (state_ == nullptr) return absl::FailedPreconditionError("moved-from Endpoint");
  std::string text;
  absl::Status result;
  absl::Status run = worker_->RunSync([&] {
    if (state_->ep == nullptr) {
      result = absl::FailedPreconditionError(
          absl::StrCat("endpoint to '", state_->peer_name, "' is closed"));
      return;
    }
    char* buf = nullptr;
    size_t size = 0;
    FILE* stream = open_memstream(&buf, &size);
    if (stream == nullptr) {
      result = absl::InternalError("open_memstream failed");
      return;
    }
    ucp_ep_print_info(state_->ep, stream);
    fclose(stream);
    text.assign(buf, size);
    free(buf);
  });
  if (!run.ok()) return run;
  if (!result.ok()) return result;
  // Lines look like "#   lane[0]:  3:posix/memory.0 md[2]   -> md[2]/posix ... am ...".
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    size_t lane = line.find("lane[");
    if (lane == absl::string_view::npos) continue;
    size_t colon = line.find(':', lane);
    if (colon == absl::string_view::npos) continue;
    absl::string_view rest = line.substr(colon + 1);
    size_t start = rest.find(':');
    if (start == absl::string_view::npos) continue;
    rest = rest.substr(start + 1);
    size_t end = rest.find_first_of(" \t");
    absl::string_view tl = rest.substr(0, end);
    size_t dot = tl.rfind('.');
    if (dot != absl::string_view::npos) tl = tl.substr(0, dot);
    std::string entry(tl);
    if (std::find(out.begin(), out.end(), entry) == out.end()) out.push_back(entry);
  }
  return out;
}

absl::StatusOr<bool> Endpoint::HasNativeRma() const {
  absl::StatusOr<std::vector<std::string>> tls = Transports();
  if (!tls.ok()) return tls.status();
  for (const std::string& tl : *tls) {
    if (tl.rfind("tcp/", 0) != 0) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// RemoteKey

RemoteKey::RemoteKey(std::shared_ptr<WorkerCore> worker, std::shared_ptr<RkeyState> state)
    : worker_(std::move(worker)), state_(std::move(state)) {}
RemoteKey::RemoteKey(RemoteKey&&) noexcept = default;
RemoteKey& RemoteKey::operator=(RemoteKey&& other) noexcept {
  if (this != &other) {
    this->~RemoteKey();
    new (this) RemoteKey(std::move(other));
  }
  return *this;
}
RemoteKey::~RemoteKey() {
  if (state_ == nullptr) return;
  std::shared_ptr<WorkerCore> core = worker_;
  std::shared_ptr<RkeyState> state = state_;
  core->Post([core, state] {
    if (state->rkey != nullptr) ucp_rkey_destroy(state->rkey);
    state->rkey = nullptr;
    core->rkeys.erase(state);
  });
}

// ---------------------------------------------------------------------------------------------
// Worker

absl::StatusOr<Worker> Worker::Create(const Context& context, WorkerOptions options) {
  if (context.core_ == nullptr) return absl::FailedPreconditionError("moved-from Context");
  auto core = std::make_shared<WorkerCore>();
  core->context = context.core_;
  core->name = options.name;
  core->spin = options.spin;
  core->same_host_pid_watch = options.same_host_pid_watch;
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucs_status_t st = ucp_worker_create(core->context->context, &params, &core->worker);
  if (st != UCS_OK) {
    return internal::UcsError(st, absl::StrCat("ucp_worker_create for '", options.name, "'"));
  }
  // From here on the worker must be destroyed on failure.
  auto fail = [&](absl::Status s) {
    ucp_worker_destroy(core->worker);
    core->worker = nullptr;
    return s;
  };
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  st = ucp_worker_get_address(core->worker, &address, &address_length);
  if (st != UCS_OK) return fail(internal::UcsError(st, "ucp_worker_get_address"));
  internal::AddressPrefix identity = internal::LocalIdentity();
  core->identity = identity;
  core->address.assign(reinterpret_cast<const char*>(&identity), sizeof(identity));
  core->address.append(reinterpret_cast<const char*>(address), address_length);
  ucp_worker_release_address(core->worker, address);
  st = ucp_worker_get_efd(core->worker, &core->ucx_fd);
  if (st != UCS_OK) return fail(internal::UcsError(st, "ucp_worker_get_efd"));
  core->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  core->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (core->event_fd < 0 || core->epoll_fd < 0) {
    return fail(absl::InternalError(absl::StrCat("eventfd/epoll: ", std::strerror(errno))));
  }
  for (int fd : {core->ucx_fd, core->event_fd}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(core->epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return fail(absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno))));
    }
  }
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = internal::kReplyAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = &WorkerCore::OnReply;
  hp.arg = core.get();
  st = ucp_worker_set_am_recv_handler(core->worker, &hp);
  if (st != UCS_OK) return fail(internal::UcsError(st, "set reply AM handler"));
  hp.id = internal::kHelloAmId;
  hp.cb = &WorkerCore::OnHello;
  st = ucp_worker_set_am_recv_handler(core->worker, &hp);
  if (st != UCS_OK) return fail(internal::UcsError(st, "set hello AM handler"));
  // Every user id gets a handler from the start: a message for an id nobody registered is
  // answered UNIMPLEMENTED instead of silently dropped (the caller would wait for its
  // deadline). It also works around UCX 1.13 reading an uninitialised slot of its handler
  // array for an unregistered id below the highest registered one (crash seen under ASan).
  for (AmId id = 1; id <= kMaxUserAmId; ++id) {
    auto entry = std::make_unique<internal::HandlerEntry>();
    entry->core = core.get();
    entry->am_id = id;
    entry->handler = [id](IncomingRequest request) {
      (void)request.ReplyError(absl::UnimplementedError(
          absl::StrCat("no handler is registered for active-message id ", id)));
    };
    hp.id = id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    hp.cb = &WorkerCore::OnRequest;
    hp.arg = entry.get();
    st = ucp_worker_set_am_recv_handler(core->worker, &hp);
    if (st != UCS_OK) return fail(internal::UcsError(st, "set default AM handler"));
    core->handlers[id] = std::move(entry);
  }
  std::random_device random;
  core->client_id_base = (uint64_t{random()} << 32 | random()) & ~uint64_t{0xFFFFFFFF};

  WorkerCore* raw = core.get();
  absl::Notification started;
  core->thread = std::thread([raw, &started] {
    raw->thread_id = std::this_thread::get_id();
    started.Notify();
    raw->Loop();
  });
  started.WaitForNotification();
  return Worker(std::move(core));
}

Worker::Worker(std::shared_ptr<WorkerCore> core) : core_(std::move(core)) {}
Worker::Worker(Worker&&) noexcept = default;
Worker& Worker::operator=(Worker&& other) noexcept {
  if (this != &other) {
    Shutdown();
    core_ = std::move(other.core_);
  }
  return *this;
}
Worker::~Worker() { Shutdown(); }

const std::string& Worker::name() const { return core_->name; }
const std::string& Worker::address() const { return core_->address; }

void Worker::Shutdown() {
  if (core_ == nullptr || !core_->thread.joinable()) return;
  WorkerCore* raw = core_.get();
  if (!core_->Post([raw] { raw->stop_requested = true; })) return;
  core_->Wake();
  core_->thread.join();
  ucp_worker_destroy(core_->worker);
  core_->worker = nullptr;
  core_->abandoned.clear();
}

absl::StatusOr<Endpoint> Worker::Connect(std::string_view peer_address, std::string peer_name) {
  if (core_ == nullptr) return absl::FailedPreconditionError("moved-from Worker");
  if (peer_address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty worker address for peer '", peer_name, "'"));
  }
  absl::StatusOr<std::shared_ptr<EndpointState>> state = absl::FailedPreconditionError("not run");
  WorkerCore* core = core_.get();
  absl::Status run = core_->RunSync([&] {
    state = core->ConnectOnThread(absl::string_view(peer_address.data(), peer_address.size()),
                                  std::move(peer_name));
    if (state.ok()) core->SendHello(state->get());
  });
  if (!run.ok()) return run;
  if (!state.ok()) return state.status();
  return Endpoint(core_, std::move(*state));
}

absl::Status Worker::RegisterHandler(AmId am_id, RequestHandler handler, HandlerOptions options) {
  if (core_ == nullptr) return absl::FailedPreconditionError("moved-from Worker");
  if (am_id == 0 || am_id > kMaxUserAmId) {
    return absl::InvalidArgumentError(
        absl::StrCat("active-message id ", am_id, " is outside 1..", kMaxUserAmId));
  }
  if (!handler) return absl::InvalidArgumentError("empty request handler");
  auto entry = std::make_unique<internal::HandlerEntry>();
  entry->core = core_.get();
  entry->am_id = am_id;
  entry->handler = std::move(handler);
  entry->options = std::move(options);
  absl::Status result;
  WorkerCore* core = core_.get();
  absl::Status run = core_->RunSync([&] {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = am_id;
    // Persistent data: eager payloads stay in UCX's receive buffer (no copy) until the
    // IncomingRequest is destroyed.
    hp.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    hp.cb = &WorkerCore::OnRequest;
    hp.arg = entry.get();
    ucs_status_t st = ucp_worker_set_am_recv_handler(core->worker, &hp);
    if (st != UCS_OK) {
      result = internal::UcsError(st, absl::StrCat("register AM handler ", am_id));
      return;
    }
    core->handlers[am_id] = std::move(entry);
  });
  if (!run.ok()) return run;
  return result;
}

}  // namespace kvr::transport
