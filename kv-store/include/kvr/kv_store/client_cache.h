#pragma once
// StoreClientCache: the KV store clients of a prefill or decode node, one per store address,
// shared by the node's requests; it notices when the store behind an address died or was
// replaced and then connects afresh.
//
// A cached client is dropped, and the next Get connects again, when
//  - its Health() is not OK: the transport saw the store process die. Such a connection never
//    recovers, even once a new store listens on the same address (the UCX endpoint still
//    points at the dead process's worker);
//  - the caller names the store instance it expects (the controller's NodeRef.instance_id) and
//    the client is connected to another one: the store restarted on the same address.
// Why not reconnect on any error: a store that is alive answers many errors (NOT_FOUND for a
// sequence, RESOURCE_EXHAUSTED) on a connection that is fine.
//
// Lifetime: Get hands out shared ownership, so dropping a client never destroys it under a
// request still using it; that request fails on its own (UNAVAILABLE from the transport) and
// the client goes away with its last user.
//
// Thread safety: all methods may be called concurrently. Connecting holds the cache's lock, so
// concurrent requests for one store open one connection, not one each.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvr/kv_store/client.h"

namespace kvr::kv_store {

enum class ReconnectReason {
  kKeep,       // the cached client is fine for this caller
  kUnhealthy,  // the transport saw the store die
  kReplaced,   // another store instance than the caller expects
};

// What to do with a cached client whose Health() is `health` and that is connected to store
// instance `connected`, for a caller that expects instance `wanted` ("" = whichever store
// listens at the address). An empty `connected` (a store that does not report its instance)
// is never called replaced.
[[nodiscard]] ReconnectReason ShouldReconnect(const absl::Status& health,
                                              absl::string_view connected,
                                              absl::string_view wanted);
[[nodiscard]] absl::string_view ReconnectReasonName(ReconnectReason reason);

class StoreClientCache {
 public:
  // Opens a client to the store whose gRPC address is `address`.
  using Connector =
      std::function<absl::StatusOr<std::shared_ptr<KvStoreClient>>(const std::string& address)>;
  // Told (under the cache's lock; keep it short) when a cached client is dropped, with the
  // address and why ("the store died: ..." / "the store restarted: ..."). For logs; may be
  // null.
  using DropObserver = std::function<void(const std::string& address, const std::string& why)>;

  explicit StoreClientCache(Connector connect, DropObserver on_drop = nullptr)
      : connect_(std::move(connect)), on_drop_(std::move(on_drop)) {}
  StoreClientCache(const StoreClientCache&) = delete;
  StoreClientCache& operator=(const StoreClientCache&) = delete;

  // The client for the store at `address` (connecting when none is cached or the cached one
  // must go, see above). `instance_id` is the store instance the caller expects, "" for any.
  // Errors, all UNAVAILABLE (the store is the failed node): connecting failed; or the store
  // at `address` is another instance than `instance_id`, i.e. the store the caller was told
  // about is gone (the new client stays cached for callers that name the new instance).
  [[nodiscard]] absl::StatusOr<std::shared_ptr<KvStoreClient>> Get(
      const std::string& address, absl::string_view instance_id = "");

  // Connections opened so far (tests, logs).
  [[nodiscard]] uint64_t connects() const;

 private:
  const Connector connect_;
  const DropObserver on_drop_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<KvStoreClient>> clients_ ABSL_GUARDED_BY(mu_);
  uint64_t connects_ ABSL_GUARDED_BY(mu_) = 0;
};

// The cache of a node's UcxKvStoreClients: each connects with `options`, named
// "<options.name>-><store address>"; connections and dropped clients are logged.
[[nodiscard]] StoreClientCache UcxStoreClientCache(UcxClientOptions options);

}  // namespace kvr::kv_store
