// Endpoints of the UCX data plane: kvr worker addresses and the identity that prefixes them,
// connecting (the client's hello, the server's back-endpoint), failure and close.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvr/transport/ucx.h"
#include "ucx_internal.h"

namespace kvr::transport {
namespace internal {

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

absl::StatusOr<std::shared_ptr<EndpointState>> WorkerCore::ConnectOnThread(
    absl::string_view address, std::string peer_name, int mode) {
  if (stop_requested) {
    return absl::FailedPreconditionError(absl::StrCat("worker '", name, "' shut down"));
  }
  AddressPrefix peer{};
  if (address.size() <= sizeof(peer)) {
    return absl::InvalidArgumentError(absl::StrCat("worker address for peer '", peer_name,
                                                   "' is too short (", address.size(), " bytes)"));
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
    absl::Status watch = OpenPidWatch(state.get(), peer.pid);
    if (!watch.ok()) return watch;
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
  ArmPidWatch(state.get());
  return state;
}

void WorkerCore::SendHello(EndpointState* state) {
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

ucs_status_t WorkerCore::OnHello(void* arg, const void* header, size_t header_length, void*, size_t,
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

void WorkerCore::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* state = static_cast<EndpointState*>(arg);
  state->core->FailEndpoint(
      state, absl::UnavailableError(absl::StrCat("peer '", state->peer_name,
                                                 "' failed: ", ucs_status_string(status))));
}

void WorkerCore::FailEndpoint(EndpointState* state, absl::Status error) {
  {
    absl::MutexLock lock(&state->mu);
    if (state->health.ok()) state->health = error;
  }
  // `state` is kept alive by `endpoints` until the close completes.
  FailEndpointCalls(state, error);
  ScheduleClose(state);
}

void WorkerCore::ScheduleClose(EndpointState* state) {
  auto it = endpoints.find(state);
  if (it == endpoints.end() || state->closed) return;
  state->closed = true;
  to_close.push_back(it->second);
}

void WorkerCore::ProcessCloses() {
  while (!to_close.empty()) {
    std::shared_ptr<EndpointState> state = std::move(to_close.back());
    to_close.pop_back();
    CloseNow(state.get());
  }
}

void WorkerCore::CloseNow(EndpointState* state) {
  if (state->ep == nullptr) return;
  ClosePidWatch(state);
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

void WorkerCore::AbandonReceives(EndpointState* state) {
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

void WorkerCore::ReapCloseRequests() {
  for (auto it = close_requests.begin(); it != close_requests.end();) {
    auto cur = it++;
    if (ucp_request_check_status(*cur) != UCS_INPROGRESS) {
      ucp_request_free(*cur);
      close_requests.erase(cur);
    }
  }
}

}  // namespace internal

using internal::EndpointState;
using internal::WorkerCore;

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
// Worker

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

}  // namespace kvr::transport
