#include "kvr/kv_store/lease_keeper.h"

#include <utility>
#include <vector>

#include "spdlog/spdlog.h"

namespace kvr::kv_store {

LeaseKeeper::LeaseKeeper(LeaseKeeperOptions options)
    : options_(options), thread_([this] { Run(); }) {}

LeaseKeeper::~LeaseKeeper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

LeaseKeeper::Handle::~Handle() { keeper_->Drop(key_); }

std::unique_ptr<LeaseKeeper::Handle> LeaseKeeper::Keep(KvStoreClient* store,
                                                       std::shared_ptr<KvStoreClient> owner,
                                                       const SequenceRef& ref) {
  absl::MutexLock lock(&mu_);
  const uint64_t key = next_key_++;
  kept_.emplace(key, Kept{store, std::move(owner), ref});
  return std::make_unique<Handle>(this, key);
}

void LeaseKeeper::Drop(uint64_t key) {
  absl::MutexLock lock(&mu_);
  kept_.erase(key);
}

void LeaseKeeper::Run() {
  absl::MutexLock lock(&mu_);
  while (true) {
    const absl::Time wake = absl::Now() + options_.period;
    auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; };
    if (mu_.AwaitWithDeadline(absl::Condition(&stopping), wake)) return;
    // Renew outside the lock (each is an RPC); a handle dropped meanwhile only costs one
    // renewal of a sequence its holder is releasing.
    std::vector<Kept> batch;
    batch.reserve(kept_.size());
    for (const auto& [key, kept] : kept_) batch.push_back(kept);
    renewals_ += batch.size();
    mu_.Unlock();
    for (const Kept& k : batch) {
      if (absl::Status s = k.store->Lease(k.ref, options_.ttl); !s.ok()) {
        spdlog::debug("renewing the lease of store sequence {}: {}", k.ref.id, s.ToString());
      }
    }
    mu_.Lock();
  }
}

}  // namespace kvr::kv_store
