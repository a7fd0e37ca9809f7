#include "store_config.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvr::kv_store {

namespace {

node::Setting<StoreConfig> AdvertiseAddressSetting() {
  using Config = StoreConfig;
  node::Setting<Config> advertise = node::StringSetting<Config>(
      "advertise_address",
      "host:port the controller and nodes reach this store at (empty: the listen address, a "
      "0.0.0.0 host replaced by this hostname's address or 127.0.0.1)",
      &Config::advertise_address, /*allow_empty=*/true);
  advertise.store = [](Config& c, const node::SettingValue& value) {
    const std::string& v = std::get<std::string>(value);
    if (!v.empty() && v.rfind(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrFormat("'%s' is not host:port", v));
    }
    c.advertise_address = v;
    return absl::OkStatus();
  };
  return advertise;
}

}  // namespace

const node::SettingTable<StoreConfig>& StoreSettings() {
  using Config = StoreConfig;
  using node::BoolSetting;
  using node::ByteSizeSetting;
  using node::IntegerSetting;
  using node::StringSetting;
  // Immutable after construction; a function-local static is a constant, not mutable state.
  static const node::SettingTable<Config>* const table = [] {
    auto* t = new node::SettingTable<Config>{
        .program = "kvr-store",
        .description = "kvr-store: CPU-memory KV cache store (gRPC control, UCX data plane)",
        .env_prefix = "KVR_STORE_",
        .settings =
            {
                node::ListenSetting<Config>(&Config::listen),
                // 0 is left to the store to refuse, with its reason.
                ByteSizeSetting<Config>("capacity_bytes", "page pool size", &Config::capacity_bytes,
                                        /*allow_zero=*/true),
                ByteSizeSetting<Config>(
                    "page_bytes",
                    "bytes per page; a page holds page_bytes / (2*head_dim*dtype size) rows of one "
                    "(sequence, layer, kv head) (an fp8 row: 2*head_dim + 8 bytes, to a multiple "
                    "of 8): 64KiB = 256 tokens at head_dim 64 f16",
                    &Config::page_bytes, /*allow_zero=*/true),
                BoolSetting<Config>(
                    "evict_expired",
                    "evict sequences whose lease expired: when space runs short and by a periodic "
                    "sweep; off: leases are reported in stats but nothing is dropped",
                    &Config::evict_expired),
                BoolSetting<Config>(
                    "evict_cached",
                    "evict released-and-kept (cached for reuse) sequences, least recently used "
                    "first, when space runs short, after expired ones and before refusing; never a "
                    "live one",
                    &Config::evict_cached),
                node::EnumSetting<Config>(
                    "cached_eviction",
                    "how cached sequences give way (with evict_cached): lru drops whole ones, "
                    "least recently used first; thin first drops, from the least recently used "
                    "on, each one's pages whose keys are least distinctive (KeyDiff score), "
                    "keeping thin_keep_fraction of every (layer, kv head), the sinks, the recent "
                    "rows and the summaries; then whole ones LRU",
                    &Config::cached_eviction, {"lru", "thin"}),
                node::NumberSetting<Config>(
                    "thin_keep_fraction",
                    "with cached_eviction thin: the fraction of every (layer, kv head)'s pages "
                    "a thinned sequence keeps",
                    &Config::thin_keep_fraction, 0.0, 1.0),
                BoolSetting<Config>("huge_pages", "try huge pages for the pool",
                                    &Config::huge_pages),
                IntegerSetting<Config>("data_plane_threads",
                                       "threads serving UCX data-plane requests",
                                       &Config::data_plane_threads, 1),
                IntegerSetting<Config>("sweep_interval_ms",
                                       "how often expired leases are swept (with evict_expired), "
                                       "in milliseconds",
                                       &Config::sweep_interval_ms, 0),
                StringSetting<Config>("name",
                                      "name in logs, peers' error messages and its registration "
                                      "(with TLS, the kvr://node/<name> its certificate carries)",
                                      &Config::name),
                node::MetricsPortSetting<Config>(&Config::metrics_port),
                node::HealthAddressSetting<Config>(&Config::health_address),
                StringSetting<Config>("controller",
                                      "controller host:port to register with as a STORE node and "
                                      "heartbeat to (empty: do not register)",
                                      &Config::controller, /*allow_empty=*/true),
                AdvertiseAddressSetting(),
                StringSetting<Config>(
                    "local_socket",
                    "Unix socket path (created 0600) on which the page pool's memfd is handed to "
                    "processes on this host for zero-copy reads; every sequence in the pool is "
                    "readable through it (empty: off)",
                    &Config::local_socket, /*allow_empty=*/true),
                ByteSizeSetting<Config>(
                    "max_reply_bytes",
                    "largest reply to one gather or range read (bigger requests "
                    "are refused: split them)",
                    &Config::max_reply_bytes),
                ByteSizeSetting<Config>("max_outstanding_reply_bytes",
                                        "most reply memory being filled or sent at once (past it "
                                        "requests are refused as busy)",
                                        &Config::max_outstanding_reply_bytes),
                BoolSetting<Config>(
                    "rma_reads",
                    "register the page pool with UCX and hand its rkey to every client for RMA "
                    "range reads; the rkey reads the whole pool past every sequence capability, so "
                    "only on a trusted data-plane network; off: range reads go through checked "
                    "messages",
                    &Config::rma_reads),
            },
    };
    for (node::Setting<Config>& s : node::TlsSettings<Config>(&Config::tls)) {
      t->settings.push_back(std::move(s));
    }
    return t;
  }();
  return *table;
}

StoreServerOptions StoreConfig::ToServerOptions() const {
  StoreServerOptions options;
  options.listen = listen;
  options.name = name;
  options.store.pool = {
      .capacity_bytes = capacity_bytes, .page_bytes = page_bytes, .try_huge_pages = huge_pages};
  options.store.evict_expired = evict_expired;
  options.store.evict_cached = evict_cached;
  options.store.cached_eviction =
      cached_eviction == "thin" ? CachedEviction::kThin : CachedEviction::kLru;
  options.store.thin_keep_fraction = thin_keep_fraction;
  options.data_plane_threads = data_plane_threads;
  options.sweep_interval = absl::Milliseconds(static_cast<int64_t>(sweep_interval_ms));
  options.metrics_port = static_cast<int>(metrics_port);
  options.local_socket = local_socket;
  options.rma_reads = rma_reads;
  options.max_reply_bytes = max_reply_bytes;
  options.max_outstanding_reply_bytes = max_outstanding_reply_bytes;
  options.tls = tls;
  return options;
}

std::string StoreConfig::AdvertisedAddress(int bound_port) const {
  if (!advertise_address.empty()) return advertise_address;
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "*") {
    host = "127.0.0.1";
    // The address this machine's hostname resolves to (the pod IP on Kubernetes), if any.
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0) {
      addrinfo hints{};
      hints.ai_family = AF_INET;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* found = nullptr;
      if (getaddrinfo(name, nullptr, &hints, &found) == 0 && found != nullptr) {
        char text[INET_ADDRSTRLEN] = {};
        const auto* in = reinterpret_cast<const sockaddr_in*>(found->ai_addr);
        if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) host = text;
        freeaddrinfo(found);
      }
    }
  }
  return absl::StrCat(host, ":", bound_port);
}

}  // namespace kvr::kv_store
