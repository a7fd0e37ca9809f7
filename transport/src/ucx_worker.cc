// The UCX context, the worker and its progress loop: the one thread per worker that owns every
// ucp_* call on it, fed by a command queue, asleep in epoll when idle (ucx_internal.h).

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "kvr/transport/ucx.h"
#include "ucx_internal.h"

namespace kvr::transport {
namespace internal {

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

WorkerCore::~WorkerCore() {
  if (epoll_fd >= 0) close(epoll_fd);
  if (event_fd >= 0) close(event_fd);
}

bool WorkerCore::Post(std::function<void()> fn) {
  {
    absl::MutexLock lock(&queue_mu);
    if (!accepting) return false;
    queue.push_back(std::move(fn));
  }
  if (sleeping.load()) Wake();
  return true;
}

void WorkerCore::Wake() {
  uint64_t one = 1;
  ssize_t n = write(event_fd, &one, sizeof(one));
  (void)n;  // EAGAIN means the counter is already non-zero: the thread wakes anyway
}

absl::Status WorkerCore::RunSync(const std::function<void()>& fn) {
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

void WorkerCore::ExpireDeadlines(absl::Time now) {
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

bool WorkerCore::DrainQueue() {
  std::deque<std::function<void()>> batch;
  {
    absl::MutexLock lock(&queue_mu);
    batch.swap(queue);
  }
  for (auto& fn : batch) fn();
  return !batch.empty();
}

void WorkerCore::Loop() {
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

void WorkerCore::ShutdownOnThread() {
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

}  // namespace internal

using internal::ContextCore;
using internal::WorkerCore;

// ---------------------------------------------------------------------------------------------
// Context

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

}  // namespace kvr::transport
