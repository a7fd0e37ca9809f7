#pragma once
// Cancellation of one request, shared by the thread that serves it, the watcher that notices
// the client went away, Abort, and the downstream RPCs it must stop. Thread-safe.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvr::controller {

class CancellationToken {
 public:
  CancellationToken() = default;
  CancellationToken(const CancellationToken&) = delete;
  CancellationToken& operator=(const CancellationToken&) = delete;

  // Cancels with `reason` (a non-OK status, e.g. CANCELLED "client disconnected"); the first
  // reason wins. Runs the registered callbacks.
  void Cancel(absl::Status reason);
  bool IsCancelled() const;
  // OK while not cancelled.
  absl::Status reason() const;

  // Runs `fn` when the token is cancelled (at once if it already is) until the returned
  // registration is destroyed. Callbacks run under the token's lock: they must be short and
  // must not use the token (ClientContext::TryCancel is the intended use). Destroying the
  // registration waits for a running callback, so `fn` never outlives it.
  class Registration {
   public:
    Registration() = default;
    Registration(CancellationToken* token, uint64_t id) : token_(token), id_(id) {}
    Registration(Registration&& o) noexcept
        : token_(std::exchange(o.token_, nullptr)), id_(o.id_) {}
    Registration& operator=(Registration&&) = delete;
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    ~Registration();

   private:
    CancellationToken* token_ = nullptr;
    uint64_t id_ = 0;
  };
  [[nodiscard]] Registration OnCancel(std::function<void()> fn);

 private:
  mutable absl::Mutex mu_;
  absl::Status reason_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::function<void()>> callbacks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

// Requests in flight by id, for Abort and for refusing a duplicate client-supplied id.
// Thread-safe. Tokens are not owned: Remove() must run before a token is destroyed.
class InFlightRequests {
 public:
  // ALREADY_EXISTS when the id is in flight.
  [[nodiscard]] absl::Status Add(const std::string& request_id, CancellationToken* token);
  void Remove(const std::string& request_id);
  // Cancels the request with `reason`; false when no such request is in flight.
  bool Cancel(const std::string& request_id, absl::Status reason);
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, CancellationToken*> requests_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvr::controller
