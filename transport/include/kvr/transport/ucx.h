#pragma once
// The UCX (UCP) data plane: RAII owners for the UCX context, workers, endpoints, registered
// memory and remote keys; an active-message request/reply RPC; RMA get of contiguous ranges.
//
// Ownership and destruction order (safe by construction, whatever order the caller drops
// things in):
//   Context  <-shared-  Worker  <-shared-  Endpoint / RemoteKey / IncomingRequest
//   Context  <-shared-  MemoryRegion
// Every object keeps the thing it depends on alive through a shared internal core, so a UCX
// context is finalised only after its last worker and memory region, and a worker after its
// last endpoint. `Worker::Shutdown()` (also run by ~Worker) closes every endpoint, fails every
// pending call with CANCELLED and stops the progress thread; handles that outlive it answer
// FAILED_PRECONDITION.
//
// Threading: each Worker owns one progress thread, and that thread is the only one that ever
// touches the ucp_worker (created with UCS_THREAD_MODE_SINGLE). Public methods may be called
// from any thread: they enqueue a command on a mutex-protected queue and wake the thread
// through an eventfd. Why funnel instead of UCS_THREAD_MODE_MULTI: UCX's multi-thread mode
// takes a worker-wide lock on every call anyway, and a single owner thread makes request
// bookkeeping (ids, deadlines, endpoint failure fan-out) lock-free inside the loop.
//
// Progress: the thread polls `ucp_worker_progress` while there is work and for
// `WorkerOptions::spin` after the last event (low latency under load), then arms the worker
// (`ucp_worker_arm`) and sleeps in epoll on UCX's event fd plus the command eventfd, with a
// timeout set by the nearest call deadline. An idle node burns no CPU.
//
// Transport choice is UCX's: UCX_TLS / UCX_NET_DEVICES in the environment, or
// `ContextOptions::ucx_config` overrides (tests use these to pick tcp vs shared memory in
// one process). `Endpoint::Transports()` says what UCX picked so callers can prefer AM
// gathers when RMA would be emulated (TCP).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvr/transport/bytes.h"

namespace kvr::transport {

namespace internal {
struct ContextCore;
struct WorkerCore;
struct EndpointState;
struct CallState;
struct TransferState;
struct RkeyState;
struct IncomingState;
}  // namespace internal

// Active-message ids available to applications: 1..kMaxUserAmId. Id 0 is reserved for
// replies.
using AmId = uint16_t;
inline constexpr AmId kMaxUserAmId = 255;

// The explicit state of an asynchronous operation (NIXL's NIXL_IN_PROG).
enum class OpState { kInProgress, kDone };

// ---------------------------------------------------------------------------------------------
// Context and registered memory.

struct ContextOptions {
  // UCX configuration entries applied on top of the UCX_* environment, without the "UCX_"
  // prefix, e.g. {{"TLS", "tcp"}} or {{"TLS", "sm,self"}}. Empty: the environment decides.
  std::vector<std::pair<std::string, std::string>> ucx_config;
};

class MemoryRegion;

// ucp_context with AM + RMA + WAKEUP features. Move-only; cheap to move.
class Context {
 public:
  [[nodiscard]] static absl::StatusOr<Context> Create(const ContextOptions& options = {});

  Context(Context&&) noexcept;
  Context& operator=(Context&&) noexcept;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context();

  // Registers caller-owned memory with UCX once (`ucp_mem_map`), for RMA access by peers and
  // zero-copy sends/receives. The caller keeps `buffer` alive as long as the region.
  [[nodiscard]] absl::StatusOr<MemoryRegion> Register(std::span<uint8_t> buffer) const;
  // Lets UCX allocate and register `bytes` bytes (UCP_MEM_MAP_ALLOCATE); freed with the
  // region.
  [[nodiscard]] absl::StatusOr<MemoryRegion> Allocate(size_t bytes) const;

 private:
  friend class Worker;
  explicit Context(std::shared_ptr<internal::ContextCore> core);
  std::shared_ptr<internal::ContextCore> core_;
};

// A ucp_mem_h: memory registered once (per pool). Move-only; unmapped on destruction.
class MemoryRegion {
 public:
  MemoryRegion(MemoryRegion&&) noexcept;
  MemoryRegion& operator=(MemoryRegion&&) noexcept;
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ~MemoryRegion();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<uint8_t> span() const { return {data_, size_}; }
  // The address peers pass to `Endpoint::Get` is `data()` + offset, as a uint64_t.
  uint64_t address() const { return reinterpret_cast<uint64_t>(data_); }

  // The packed remote key a peer needs (`Endpoint::UnpackRkey`) to read this region with RMA.
  // Send it to peers over the control plane (gRPC) next to `address()` and `size()`.
  [[nodiscard]] absl::StatusOr<std::string> PackRkey() const;

 private:
  friend class Context;
  MemoryRegion(std::shared_ptr<internal::ContextCore> core, void* memh, uint8_t* data, size_t size);
  std::shared_ptr<internal::ContextCore> core_;
  void* memh_ = nullptr;  // ucp_mem_h
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Asynchronous results.

struct Response {
  // The reply header (small, always copied).
  std::string header;
  // The reply payload when the call did not provide `CallOptions::reply_buffer`; empty
  // otherwise.
  Bytes payload;
  // Payload bytes received (into `payload`, or into the caller's reply buffer).
  size_t payload_size = 0;
};

// The handle of an outstanding `Endpoint::Call`. Move-only. Thread-safe: one thread may Wait
// while others poll `state()`.
//
// Lifetime rule: the request header is copied at submission, but the request payload
// segments and the caller's reply buffer are used by UCX in place and must stay valid until
// `state()` is kDone. A call is done when it has a result *and* UCX no longer references the
// caller's memory; a deadline that passes while the request is still being sent or the reply
// is being received into the caller's buffer is reported once that transfer ends (the
// endpoint error handler bounds this when the peer dies).
class PendingCall {
 public:
  PendingCall() = default;
  PendingCall(PendingCall&&) noexcept;
  PendingCall& operator=(PendingCall&&) noexcept;
  PendingCall(const PendingCall&) = delete;
  PendingCall& operator=(const PendingCall&) = delete;
  // Dropping an unfinished call is safe: its late reply is discarded (but the payload /
  // reply-buffer lifetime rule above still applies).
  ~PendingCall();

  [[nodiscard]] OpState state() const;
  // Blocks until done and returns the result (once; later calls return FAILED_PRECONDITION).
  // Never block on the progress thread (in a handler or on_done hook): Wait() there on an
  // unfinished call returns FAILED_PRECONDITION instead of deadlocking.
  [[nodiscard]] absl::StatusOr<Response> Wait();

 private:
  friend class Endpoint;
  explicit PendingCall(std::shared_ptr<internal::CallState> state);
  std::shared_ptr<internal::CallState> state_;
};

// The handle of an outstanding RMA transfer (`Endpoint::Get`). Same lifetime rule as
// PendingCall for the local buffer.
class PendingTransfer {
 public:
  PendingTransfer() = default;
  PendingTransfer(PendingTransfer&&) noexcept;
  PendingTransfer& operator=(PendingTransfer&&) noexcept;
  PendingTransfer(const PendingTransfer&) = delete;
  PendingTransfer& operator=(const PendingTransfer&) = delete;
  ~PendingTransfer();

  [[nodiscard]] OpState state() const;
  [[nodiscard]] absl::Status Wait();
  // Waits at most `timeout`; true once the transfer is done (then Wait returns at once).
  [[nodiscard]] bool WaitFor(absl::Duration timeout);

 private:
  friend class Endpoint;
  explicit PendingTransfer(std::shared_ptr<internal::TransferState> state);
  std::shared_ptr<internal::TransferState> state_;
};

// ---------------------------------------------------------------------------------------------
// Server side of the active-message RPC.

// One received request. Move-only. The handler may reply inline (on the progress thread) or
// move the request to another thread and reply later; `Reply*` are thread-safe. Replies go
// over the server's own endpoint back to the client (not UCX's reply_ep, which UCX 1.13
// frees when the client disconnects): a reply to a client that died fails cleanly, with
// UNAVAILABLE in `on_sent`. Header and
// payload views stay valid until the request is destroyed (UCX's persistent eager data, or
// the buffer the rendezvous payload was received into).
//
// A request destroyed without a reply answers the caller with INTERNAL ("request dropped
// by the handler"), so a client never waits for its deadline because of a server bug.
class IncomingRequest {
 public:
  IncomingRequest(IncomingRequest&&) noexcept;
  IncomingRequest& operator=(IncomingRequest&&) noexcept;
  IncomingRequest(const IncomingRequest&) = delete;
  IncomingRequest& operator=(const IncomingRequest&) = delete;
  ~IncomingRequest();

  AmId am_id() const;
  ByteView header() const;
  ByteView payload() const;

  // Replies with `header` (copied) and the scatter list `payload`, sent as one message:
  // eager when small, rendezvous (zero-copy on RDMA) when large. The segments must stay
  // valid until `on_sent` runs (on the progress thread; keep it short) with the send's
  // outcome. Exactly one Reply*/ReplyError per request; a second returns FAILED_PRECONDITION.
  [[nodiscard]] absl::Status Reply(ByteView header, std::vector<ByteView> payload,
                                   std::function<void(absl::Status)> on_sent);
  // Replies with an owned payload, released once sent.
  [[nodiscard]] absl::Status Reply(ByteView header, Bytes payload = {});
  // Replies with an error: the caller's call completes with this status (code and message).
  [[nodiscard]] absl::Status ReplyError(const absl::Status& error);

 private:
  friend struct internal::WorkerCore;
  explicit IncomingRequest(std::unique_ptr<internal::IncomingState> state);
  std::unique_ptr<internal::IncomingState> state_;
};

using RequestHandler = std::function<void(IncomingRequest request)>;

struct HandlerOptions {
  // Optional: chooses where a request's payload lands, given its header and length (e.g. the
  // store's pool pages for a layer write, so rendezvous data goes straight there). Runs on
  // the progress thread. An error is replied to the caller and the handler is not called.
  // Unset: the transport keeps eager data in place and allocates a buffer for rendezvous.
  std::function<absl::StatusOr<std::span<uint8_t>>(ByteView header, size_t length)>
      payload_destination;
};

// ---------------------------------------------------------------------------------------------
// Client side.

struct CallOptions {
  absl::Time deadline = absl::InfiniteFuture();
  // When non-empty, the reply payload is received here (rendezvous replies land directly,
  // zero-copy on RDMA) instead of a transport-allocated buffer. A reply larger than the
  // buffer fails the call with OUT_OF_RANGE naming both sizes.
  std::span<uint8_t> reply_buffer;
  // Optional completion hook, run on the progress thread once the call is done (keep it
  // short; typically it signals another thread which then calls Wait()).
  std::function<void()> on_done;
};

class RemoteKey;

// One piece of a batched RMA get (Endpoint::Get): `local.size()` bytes at the peer's
// `remote_address`.
struct GetPiece {
  uint64_t remote_address = 0;
  std::span<uint8_t> local;
};

// A connection to a peer worker (ucp_ep with UCP_ERR_HANDLING_MODE_PEER: a dead peer fails
// requests instead of hanging them). Move-only; closed on destruction (pending calls on it
// complete with CANCELLED). Thread-safe.
class Endpoint {
 public:
  Endpoint(Endpoint&&) noexcept;
  Endpoint& operator=(Endpoint&&) noexcept;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ~Endpoint();

  const std::string& peer_name() const;

  // OK while the endpoint works; UNAVAILABLE naming the peer once UCX reported it failed.
  [[nodiscard]] absl::Status health() const;

  // Sends an active message `am_id` with `header` (copied) and the scatter list `payload`
  // (used in place; see PendingCall's lifetime rule) and returns at once. The peer's handler
  // replies; the reply is matched by a request id. Errors: DEADLINE_EXCEEDED when the
  // deadline passes first (a late reply is dropped), UNAVAILABLE naming the peer when the
  // endpoint fails, the handler's status for ReplyError, INVALID_ARGUMENT for a bad am_id.
  [[nodiscard]] PendingCall Call(AmId am_id, ByteView header, std::vector<ByteView> payload,
                                 CallOptions options = {});
  // Blocking convenience: Call(...).Wait().
  [[nodiscard]] absl::StatusOr<Response> CallSync(AmId am_id, ByteView header,
                                                  std::vector<ByteView> payload,
                                                  CallOptions options = {});

  // Unpacks a peer's packed rkey (MemoryRegion::PackRkey) for RMA on this endpoint.
  [[nodiscard]] absl::StatusOr<RemoteKey> UnpackRkey(std::string_view packed);

  // RMA get of `local.size()` contiguous bytes at the peer's `remote_address` into `local`.
  // The remote range must lie in the region `rkey` was packed from. Over TCP UCX emulates
  // RMA in software (slow): check `HasNativeRma()`.
  // `deadline` is NOT enforced yet: UCX 1.13 cannot cancel an RMA request, and `local` must
  // stay untouched until UCX releases it, so a get ends when the transfer completes or the
  // endpoint fails (peer death is detected as for calls). Gets are single transfers that do
  // not wait on the peer's application, so they cannot stall on a live peer.
  [[nodiscard]] PendingTransfer Get(uint64_t remote_address, const RemoteKey& rkey,
                                    std::span<uint8_t> local,
                                    absl::Time deadline = absl::InfiniteFuture());
  [[nodiscard]] absl::Status GetSync(uint64_t remote_address, const RemoteKey& rkey,
                                     std::span<uint8_t> local,
                                     absl::Time deadline = absl::InfiniteFuture());
  // Gets of many pieces under one rkey as ONE transfer (one hand-off to the progress thread,
  // every get issued before any completion is awaited): done when every piece is, with the
  // first failure as its result. The pieces are copied; their local buffers follow the rule
  // above.
  [[nodiscard]] PendingTransfer Get(std::span<const GetPiece> pieces, const RemoteKey& rkey,
                                    absl::Time deadline = absl::InfiniteFuture());

  // The UCX transports this endpoint's lanes use, as "transport/device" strings (e.g.
  // "tcp/lo", "posix/memory", "cma/memory"), from ucp_ep_print_info.
  [[nodiscard]] absl::StatusOr<std::vector<std::string>> Transports() const;
  // True when RMA get runs on a native transport (shared memory, cma, RDMA), false when UCX
  // emulates it over active messages (TCP).
  [[nodiscard]] absl::StatusOr<bool> HasNativeRma() const;

 private:
  friend class Worker;
  friend class RemoteKey;
  Endpoint(std::shared_ptr<internal::WorkerCore> worker,
           std::shared_ptr<internal::EndpointState> state);
  std::shared_ptr<internal::WorkerCore> worker_;
  std::shared_ptr<internal::EndpointState> state_;
};

// A peer's memory key unpacked for one endpoint (ucp_rkey_h). Move-only; destroyed on the
// progress thread.
class RemoteKey {
 public:
  RemoteKey(RemoteKey&&) noexcept;
  RemoteKey& operator=(RemoteKey&&) noexcept;
  RemoteKey(const RemoteKey&) = delete;
  RemoteKey& operator=(const RemoteKey&) = delete;
  ~RemoteKey();

 private:
  friend class Endpoint;
  RemoteKey(std::shared_ptr<internal::WorkerCore> worker,
            std::shared_ptr<internal::RkeyState> state);
  std::shared_ptr<internal::WorkerCore> worker_;
  std::shared_ptr<internal::RkeyState> state_;
};

// ---------------------------------------------------------------------------------------------
// Worker.

struct WorkerOptions {
  // Used in log lines and error messages ("worker 'store-0'").
  std::string name = "kvr";
  // How long the progress thread keeps polling after its last event before it sleeps on the
  // event fd. Longer = lower latency under bursty load, more CPU when idle-ish.
  absl::Duration spin = absl::Microseconds(50);
  // How a dead peer is detected. true (default): a peer on the same kernel (same boot id and
  // pid namespace, learnt from its worker address) is connected in UCX error mode NONE and
  // its process is watched through a pidfd, while remote peers use UCP_ERR_HANDLING_MODE_PEER.
  // Why: UCX 1.13's shared-memory transports refuse mode PEER, so mode PEER everywhere would
  // silently push same-host traffic onto TCP. false: mode PEER for every peer (UCX's own
  // detection; what a cross-host peer gets), which on one host means TCP only.
  // Servers answer over their own endpoint back to each client (created from the client's
  // hello, in the client's error mode), so two processes that also connect to each other
  // directly must use the same setting: UCX refuses endpoints of different error modes
  // between one pair of workers.
  bool same_host_pid_watch = true;
};

// A ucp_worker plus its progress thread. Move-only. Thread-safe.
class Worker {
 public:
  [[nodiscard]] static absl::StatusOr<Worker> Create(const Context& context,
                                                     WorkerOptions options = {});

  Worker(Worker&&) noexcept;
  Worker& operator=(Worker&&) noexcept;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker();

  const std::string& name() const;
  // The worker address blob (ucp_worker_get_address) that peers pass to Connect; exchange it
  // over the control plane.
  const std::string& address() const;

  // Connects to a peer worker by its address. `peer_name` names the peer in errors.
  [[nodiscard]] absl::StatusOr<Endpoint> Connect(std::string_view peer_address,
                                                 std::string peer_name);

  // Installs the handler for active messages `am_id` (1..kMaxUserAmId); replaces an earlier
  // one (register handlers before peers send: replacing a handler while one of its
  // rendezvous requests is being received is not supported). Ids without a handler answer
  // UNIMPLEMENTED. Handlers run on the progress thread: keep them short and never block
  // (hand work to a pool and reply from there).
  [[nodiscard]] absl::Status RegisterHandler(AmId am_id, RequestHandler handler,
                                             HandlerOptions options = {});

  // Closes every endpoint, fails pending calls with CANCELLED, stops the progress thread and
  // destroys the ucp_worker. Idempotent; the destructor calls it.
  void Shutdown();

 private:
  explicit Worker(std::shared_ptr<internal::WorkerCore> core);
  std::shared_ptr<internal::WorkerCore> core_;
};

}  // namespace kvr::transport
