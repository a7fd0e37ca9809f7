#include "kvr/controller/cancellation.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvr::controller {

void CancellationToken::Cancel(absl::Status reason) {
  absl::MutexLock lock(&mu_);
  if (!reason_.ok()) return;
  reason_ = reason.ok() ? absl::CancelledError("cancelled") : std::move(reason);
  for (auto& [id, fn] : callbacks_) fn();
}

bool CancellationToken::IsCancelled() const {
  absl::MutexLock lock(&mu_);
  return !reason_.ok();
}

absl::Status CancellationToken::reason() const {
  absl::MutexLock lock(&mu_);
  return reason_;
}

CancellationToken::Registration CancellationToken::OnCancel(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  if (!reason_.ok()) {
    fn();
    return Registration();
  }
  const uint64_t id = next_id_++;
  callbacks_.emplace(id, std::move(fn));
  return Registration(this, id);
}

CancellationToken::Registration::~Registration() {
  if (token_ == nullptr) return;
  absl::MutexLock lock(&token_->mu_);
  token_->callbacks_.erase(id_);
}

absl::Status InFlightRequests::Add(const std::string& request_id, CancellationToken* token) {
  absl::MutexLock lock(&mu_);
  if (!requests_.emplace(request_id, token).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("request_id: '", request_id, "' is already in flight"));
  }
  return absl::OkStatus();
}

void InFlightRequests::Remove(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  requests_.erase(request_id);
}

bool InFlightRequests::Cancel(const std::string& request_id, absl::Status reason) {
  absl::MutexLock lock(&mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  it->second->Cancel(std::move(reason));
  return true;
}

size_t InFlightRequests::size() const {
  absl::MutexLock lock(&mu_);
  return requests_.size();
}

}  // namespace kvr::controller
