// Active-message RPC over the UCX data plane: a client's calls (send, reply, rendezvous
// receive into the caller's buffer, deadlines) and a server's requests and replies.

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvr/transport/ucx.h"
#include "ucx_internal.h"

namespace kvr::transport {
namespace internal {

void WorkerCore::PublishCall(const std::shared_ptr<CallState>& call,
                             absl::StatusOr<Response> result) {
  std::function<void()> on_done;
  {
    absl::MutexLock lock(&call->mu);
    call->result = std::move(result);
    call->done = true;
    on_done = std::move(call->on_done);
  }
  if (on_done) on_done();
}

void WorkerCore::SetResult(CallState* call, absl::StatusOr<Response> result) {
  if (call->has_result) return;
  call->has_result = true;
  call->pending = std::move(result);
  MaybeFinish(call);
}

void WorkerCore::MaybeFinish(CallState* call) {
  if (!call->has_result || call->send_in_flight || call->recv_in_flight) return;
  auto it = calls.find(call->id);
  if (it == calls.end()) return;
  std::shared_ptr<CallState> keep = std::move(it->second);
  calls.erase(it);
  deadlines.erase({keep->deadline, keep->id});
  if (keep->endpoint) keep->endpoint->call_ids.erase(keep->id);
  PublishCall(keep, std::move(keep->pending));
}

void WorkerCore::StartCall(std::shared_ptr<CallState> call, std::shared_ptr<EndpointState> ep,
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

absl::Status WorkerCore::FailureFor(const EndpointState& ep, ucs_status_t status,
                                    absl::string_view what) {
  absl::Status health = ep.Health();
  if (!health.ok()) return health;
  return UcsError(status,
                  absl::StrCat(what, " to peer '", ep.peer_name, "' (worker '", name, "')"));
}

void WorkerCore::OnCallSent(void* request, ucs_status_t status, void* user_data) {
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

ucs_status_t WorkerCore::OnReply(void* arg, const void* header, size_t header_length, void* data,
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

void WorkerCore::OnReplyReceived(void* request, ucs_status_t status, size_t length,
                                 void* user_data) {
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

void WorkerCore::FailEndpointCalls(EndpointState* ep, const absl::Status& status) {
  std::vector<uint64_t> ids(ep->call_ids.begin(), ep->call_ids.end());
  for (uint64_t id : ids) {
    auto it = calls.find(id);
    if (it == calls.end()) continue;
    std::shared_ptr<CallState> keep = it->second;
    SetResult(keep.get(), status);
  }
}

std::string ReplyWireHeader(uint64_t request_id, const absl::Status& status, ByteView header) {
  ReplyPrefix prefix{request_id, static_cast<int32_t>(status.code()),
                     static_cast<uint32_t>(status.message().size())};
  std::string wire(sizeof(prefix), '\0');
  std::memcpy(wire.data(), &prefix, sizeof(prefix));
  wire.append(status.message().data(), status.message().size());
  wire.append(reinterpret_cast<const char*>(header.data()), header.size());
  return wire;
}

IncomingState::~IncomingState() {
  if (!replied && core != nullptr && reply_to != nullptr) {
    // Dropped without a reply: answer INTERNAL so the caller does not wait for its deadline.
    auto self = std::make_unique<IncomingState>();
    self->core = core;
    self->reply_to = reply_to;
    self->request_id = request_id;
    self->replied = true;
    std::string wire = ReplyWireHeader(
        request_id, absl::InternalError("request dropped by the handler without a reply"),
        ByteView());
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
using internal::EndpointState;
using internal::IncomingState;
using internal::WorkerCore;

// ---------------------------------------------------------------------------------------------
// PendingCall

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
// Runs a reply's command at once on the progress thread (a handler replying inline), else
// posts it; FAILED_PRECONDITION once the worker has shut down.
absl::Status RunOrPost(WorkerCore& core, std::function<void()> cmd) {
  if (core.OnProgressThread()) {
    cmd();
    return absl::OkStatus();
  }
  if (!core.Post(std::move(cmd))) {
    return absl::FailedPreconditionError(absl::StrCat("worker '", core.name, "' is shut down"));
  }
  return absl::OkStatus();
}

// What every Reply* of an IncomingRequest does once the request is known unanswered: marks it
// replied, takes its state and has the worker send `status` and `header` with the payload (the
// views, or the owned bytes). The command is copied into a std::function: what it owns it holds
// through shared pointers.
absl::Status SendReply(std::unique_ptr<IncomingState>& state, const absl::Status& status,
                       ByteView header, std::vector<ByteView> payload,
                       std::function<void(absl::Status)> on_sent, Bytes owned_payload) {
  state->replied = true;
  std::string wire = internal::ReplyWireHeader(state->request_id, status, header);
  std::shared_ptr<WorkerCore> core = state->core;
  auto moved = std::make_shared<std::unique_ptr<IncomingState>>(std::move(state));
  auto owned = std::make_shared<Bytes>(std::move(owned_payload));
  auto cmd = [core, moved, owned, wire = std::move(wire), payload = std::move(payload),
              on_sent = std::move(on_sent)]() mutable {
    core->Reply(std::move(*moved), std::move(wire), std::move(payload), std::move(on_sent),
                std::move(*owned));
  };
  return RunOrPost(*core, std::move(cmd));
}

absl::Status AlreadyReplied() {
  return absl::FailedPreconditionError("request already replied to");
}
}  // namespace

absl::Status IncomingRequest::Reply(ByteView header, std::vector<ByteView> payload,
                                    std::function<void(absl::Status)> on_sent) {
  if (state_ == nullptr || state_->replied) return AlreadyReplied();
  return SendReply(state_, absl::OkStatus(), header, std::move(payload), std::move(on_sent),
                   Bytes());
}

absl::Status IncomingRequest::Reply(ByteView header, Bytes payload) {
  if (state_ == nullptr || state_->replied) return AlreadyReplied();
  return SendReply(state_, absl::OkStatus(), header, {}, {}, std::move(payload));
}

absl::Status IncomingRequest::ReplyError(const absl::Status& error) {
  if (state_ == nullptr || state_->replied) return AlreadyReplied();
  return SendReply(
      state_, error.ok() ? absl::InternalError("handler replied with an OK error status") : error,
      ByteView(), {}, {}, Bytes());
}

// ---------------------------------------------------------------------------------------------
// Endpoint

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

// ---------------------------------------------------------------------------------------------
// Worker

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
