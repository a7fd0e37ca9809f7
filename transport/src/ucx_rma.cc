// RMA over the UCX data plane: memory registered once (MemoryRegion, packed rkeys), remote
// keys unpacked per endpoint, and gets.

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/transport/ucx.h"
#include "ucx_internal.h"

namespace kvr::transport {

using internal::ContextCore;
using internal::EndpointState;
using internal::RkeyState;
using internal::TransferState;
using internal::WorkerCore;

// ---------------------------------------------------------------------------------------------
// MemoryRegion

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
// PendingTransfer

PendingTransfer::PendingTransfer(std::shared_ptr<TransferState> state) : state_(std::move(state)) {}
PendingTransfer::PendingTransfer(PendingTransfer&&) noexcept = default;
PendingTransfer& PendingTransfer::operator=(PendingTransfer&&) noexcept = default;
PendingTransfer::~PendingTransfer() = default;

OpState PendingTransfer::state() const {
  if (state_ == nullptr) return OpState::kDone;
  absl::MutexLock lock(&state_->mu);
  return state_->done ? OpState::kDone : OpState::kInProgress;
}

bool PendingTransfer::WaitFor(absl::Duration timeout) {
  if (state_ == nullptr) return true;
  absl::MutexLock lock(&state_->mu);
  return state_->mu.AwaitWithTimeout(absl::Condition(&state_->done), timeout);
}

absl::Status PendingTransfer::Wait() {
  if (state_ == nullptr) return absl::FailedPreconditionError("empty PendingTransfer");
  absl::MutexLock lock(&state_->mu);
  state_->mu.Await(absl::Condition(&state_->done));
  return state_->result;
}

// ---------------------------------------------------------------------------------------------
// RemoteKey

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
  const GetPiece piece{remote_address, local};
  return Get(std::span(&piece, 1), rkey, deadline);
}

PendingTransfer Endpoint::Get(std::span<const GetPiece> pieces, const RemoteKey& rkey,
                              absl::Time deadline) {
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
  if (pieces.empty()) {
    transfer->Finish(absl::OkStatus());
    return PendingTransfer(std::move(transfer));
  }
  std::shared_ptr<WorkerCore> core = worker_;
  std::shared_ptr<EndpointState> state = state_;
  std::shared_ptr<RkeyState> key = rkey.state_;
  auto cmd = [core, state, key, transfer,
              pieces = std::vector<GetPiece>(pieces.begin(), pieces.end())] {
    if (core->stop_requested || state->ep == nullptr || key->rkey == nullptr) {
      absl::Status health = state->Health();
      transfer->Finish(!health.ok() ? health
                                    : absl::FailedPreconditionError(absl::StrCat(
                                          "endpoint to '", state->peer_name, "' is closed")));
      return;
    }
    // Completions run on this (the progress) thread, never while the gets are being issued:
    // `remaining` counts the pieces still out plus one for the issuing loop itself.
    struct Batch {
      std::shared_ptr<TransferState> transfer;
      std::shared_ptr<EndpointState> state;
      WorkerCore* core;
      size_t remaining;
      absl::Status first_failure;
      void Done(absl::Status st) {
        if (!st.ok() && first_failure.ok()) first_failure = std::move(st);
        if (--remaining == 0) {
          transfer->Finish(std::move(first_failure));
          delete this;
        }
      }
    };
    auto* batch = new Batch{transfer, state, core.get(), pieces.size() + 1, absl::OkStatus()};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = [](void* request, ucs_status_t status, void* user_data) {
      auto* batch = static_cast<Batch*>(user_data);
      ucp_request_free(request);
      batch->Done(status == UCS_OK ? absl::OkStatus()
                                   : batch->core->FailureFor(*batch->state, status, "RMA get"));
    };
    param.user_data = batch;
    for (const GetPiece& piece : pieces) {
      ucs_status_ptr_t req = ucp_get_nbx(state->ep, piece.local.data(), piece.local.size(),
                                         piece.remote_address, key->rkey, &param);
      if (UCS_PTR_IS_ERR(req)) {
        batch->Done(core->FailureFor(*state, UCS_PTR_STATUS(req), "RMA get"));
      } else if (req == nullptr) {
        batch->Done(absl::OkStatus());
      }
    }
    batch->Done(absl::OkStatus());  // the issuing loop's share
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

}  // namespace kvr::transport
