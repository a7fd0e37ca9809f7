#pragma once
// LeaseKeeper: keeps the store leases of the sequences a node is working on short and renewed,
// so that the sequences of a node that dies are released by their stores within one lease, not
// at the request's deadline (minutes at long context). A node creates its sequences with (or
// sets) a lease of `ttl`, calls Keep while it holds one, and drops the returned handle when it
// releases the sequence; one thread renews every kept sequence every `period` (Lease(ref,
// ttl)). A store that evicts expired sequences (kvr-store --evict-expired) then frees the
// orphans of a dead node within ttl (+ its sweep interval).
//
// A failed renewal is logged and retried at the next period: the sequence may be gone
// (released, or its store restarted), which the node learns from its own calls.
//
// Thread safety: Keep and the handles may be used from any thread. The clients passed to Keep
// must outlive their handles (a handle holds the client's shared_ptr when one is given).

#include <cstdint>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/kv_store/client.h"

namespace kvr::kv_store {

struct LeaseKeeperOptions {
  absl::Duration ttl = absl::Seconds(10);
  absl::Duration period = absl::Milliseconds(2500);  // < ttl: renewals happen well before expiry
};

class LeaseKeeper {
 public:
  explicit LeaseKeeper(LeaseKeeperOptions options = {});
  ~LeaseKeeper();  // stops the thread; kept sequences are no longer renewed
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  // Renews `ref` in `store` until the handle is destroyed. `owner` (may be null) keeps `store`
  // alive meanwhile.
  class Handle {
   public:
    Handle(LeaseKeeper* keeper, uint64_t key) : keeper_(keeper), key_(key) {}
    ~Handle();
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;

   private:
    LeaseKeeper* keeper_;
    uint64_t key_;
  };
  [[nodiscard]] std::unique_ptr<Handle> Keep(KvStoreClient* store,
                                             std::shared_ptr<KvStoreClient> owner,
                                             const SequenceRef& ref);

  const LeaseKeeperOptions& options() const { return options_; }
  // Renewals sent so far (successful or not), for tests.
  uint64_t renewals() const {
    absl::MutexLock lock(&mu_);
    return renewals_;
  }

 private:
  struct Kept {
    KvStoreClient* store = nullptr;
    std::shared_ptr<KvStoreClient> owner;
    SequenceRef ref;
  };
  void Run();
  void Drop(uint64_t key);

  const LeaseKeeperOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Kept> kept_ ABSL_GUARDED_BY(mu_);
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t renewals_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started last
};

}  // namespace kvr::kv_store
