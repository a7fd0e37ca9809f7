#include "kvr/kv_store/client_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvr::kv_store {

ReconnectReason ShouldReconnect(const absl::Status& health, absl::string_view connected,
                                absl::string_view wanted) {
  if (!health.ok()) return ReconnectReason::kUnhealthy;
  if (!wanted.empty() && !connected.empty() && connected != wanted) {
    return ReconnectReason::kReplaced;
  }
  return ReconnectReason::kKeep;
}

absl::string_view ReconnectReasonName(ReconnectReason reason) {
  switch (reason) {
    case ReconnectReason::kKeep:
      return "keep";
    case ReconnectReason::kUnhealthy:
      return "the store died";
    case ReconnectReason::kReplaced:
      return "the store restarted";
  }
  return "unknown";
}

absl::StatusOr<std::shared_ptr<KvStoreClient>> StoreClientCache::Get(
    const std::string& address, absl::string_view instance_id) {
  if (address.empty()) return absl::InvalidArgumentError("store: no gRPC address");
  absl::MutexLock lock(&mu_);
  if (auto it = clients_.find(address); it != clients_.end()) {
    const absl::Status health = it->second->Health();
    const std::string connected = it->second->instance_id();
    const ReconnectReason why = ShouldReconnect(health, connected, instance_id);
    if (why == ReconnectReason::kKeep) return it->second;
    if (on_drop_) {
      on_drop_(address, why == ReconnectReason::kUnhealthy
                            ? absl::StrCat(ReconnectReasonName(why), ": ", health.message())
                            : absl::StrCat(ReconnectReasonName(why), ": connected to instance ",
                                           connected, ", expected ", instance_id));
    }
    clients_.erase(it);
  }
  absl::StatusOr<std::shared_ptr<KvStoreClient>> client = connect_(address);
  if (!client.ok()) {
    return absl::UnavailableError(
        absl::StrCat("connecting to the KV store at ", address, ": ", client.status().message()));
  }
  ++connects_;
  std::shared_ptr<KvStoreClient> fresh = std::move(*client);
  clients_[address] = fresh;
  const std::string connected = fresh->instance_id();
  if (ShouldReconnect(absl::OkStatus(), connected, instance_id) == ReconnectReason::kReplaced) {
    return absl::UnavailableError(absl::StrCat(
        "the KV store at ", address, " is instance ", connected, ", not the expected ", instance_id,
        ": that store restarted or was replaced, and its sequences are gone"));
  }
  return fresh;
}

uint64_t StoreClientCache::connects() const {
  absl::MutexLock lock(&mu_);
  return connects_;
}

StoreClientCache UcxStoreClientCache(UcxClientOptions options) {
  return StoreClientCache(
      [options](const std::string& address) -> absl::StatusOr<std::shared_ptr<KvStoreClient>> {
        UcxClientOptions o = options;
        o.name = absl::StrCat(options.name, "->", address);
        absl::StatusOr<std::unique_ptr<UcxKvStoreClient>> client =
            UcxKvStoreClient::Connect(address, o);
        if (!client.ok()) return client.status();
        // How rows are read matters to an operator who asked for RMA (it needs the store's
        // --rma-reads and a transport with native RMA): say which path the client took.
        spdlog::info("connected to the KV store at {} (instance {}; rows read by {})", address,
                     (*client)->instance_id(),
                     (*client)->range_read_path() == "rma" ? "RMA gets" : "store requests");
        return std::shared_ptr<KvStoreClient>(std::move(*client));
      },
      [](const std::string& address, const std::string& why) {
        spdlog::warn("KV store at {}: {}; connecting again", address, why);
      });
}

}  // namespace kvr::kv_store
