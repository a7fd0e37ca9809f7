#include "kvr/controller/config.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvr::controller {
namespace {

using Config = ControllerConfig;

// http_listen: host:port, or empty / "-1" for no HTTP server (stored as empty).
node::Setting<Config> HttpListenSetting() {
  node::Setting<Config> s = node::StringSetting<Config>(
      "http_listen",
      "OpenAI-compatible HTTP API address host:port (port 0: any free port; empty or -1: off)",
      &Config::http_listen, /*allow_empty=*/true);
  s.store = [](Config& c, const node::SettingValue& value) {
    const std::string& v = std::get<std::string>(value);
    if (v.empty() || v == "-1") {
      c.http_listen.clear();
      return absl::OkStatus();
    }
    const size_t colon = v.rfind(':');
    uint32_t port;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(v.substr(colon + 1), &port) ||
        port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("'", v, "' is not host:port, empty or -1"));
    }
    c.http_listen = v;
    return absl::OkStatus();
  };
  return s;
}

}  // namespace

const node::SettingTable<ControllerConfig>& ControllerSettings() {
  // Immutable after construction; a function-local static is a constant, not mutable state.
  static const node::SettingTable<Config>* const table = [] {
    using node::IntegerSetting;
    using node::SecondsSetting;
    using node::StringSetting;
    auto* t = new node::SettingTable<Config>{
        .program = "kvr-controller",
        .description = "kvr-controller: membership, placement and the public Generation API",
        .env_prefix = "KVR_CONTROLLER_",
        // The controller's settings were read from KVR_<NAME> before every binary had its
        // role in the prefix; deployments that set them keep working.
        .legacy_env_prefixes = {"KVR_"},
        .settings =
            {
                node::ListenSetting<Config>(&Config::listen),
                SecondsSetting<Config>("lease_seconds",
                                       "node lease: a node silent this long leaves the cluster",
                                       &Config::lease_seconds),
                SecondsSetting<Config>("default_timeout_seconds",
                                       "deadline of requests whose client set none",
                                       &Config::default_timeout_seconds),
                SecondsSetting<Config>(
                    "shutdown_grace_seconds",
                    "on SIGTERM, how long running requests may finish before they are cancelled",
                    &Config::shutdown_grace_seconds),
                IntegerSetting<Config>("max_in_flight",
                                       "most requests in flight before RESOURCE_EXHAUSTED",
                                       &Config::max_in_flight, 1),
                IntegerSetting<Config>(
                    "max_attempts", "attempts per request when nodes fail before the first token",
                    &Config::max_attempts, 1),
                SecondsSetting<Config>(
                    "prefix_cache_seconds",
                    "how long a store keeps a finished request's KV for requests "
                    "sharing its prefix (0: off)",
                    &Config::prefix_cache_seconds, /*allow_zero=*/true),
                IntegerSetting<Config>("prefix_cache_entries",
                                       "most cached prefixes the controller remembers",
                                       &Config::prefix_cache_entries, 1),
                IntegerSetting<Config>(
                    "default_max_tokens", "max_tokens of requests that set none",
                    [](Config& c) -> uint32_t& { return c.defaults.max_tokens; }, 1),
                StringSetting<Config>("default_method",
                                      "retrieval method of requests that set none",
                                      [](Config& c) -> std::string& { return c.defaults.method; }),
                IntegerSetting<Config>(
                    "default_budget", "retrieval budget (top-k) of requests that set none",
                    [](Config& c) -> uint32_t& { return c.defaults.budget; }, 1),
                IntegerSetting<Config>(
                    "default_n_sink", "sink tokens of requests that set none",
                    [](Config& c) -> uint32_t& { return c.defaults.n_sink; }, 1),
                IntegerSetting<Config>(
                    "default_local_window", "local window of requests that set none",
                    [](Config& c) -> uint32_t& { return c.defaults.local_window; }, 1),
                node::LogLevelSetting<Config>(&Config::log_level),
                node::MetricsPortSetting<Config>(&Config::metrics_port),
                node::HealthAddressSetting<Config>(&Config::health_address),
                HttpListenSetting(),
            },
    };
    node::Setting<Config> api_key = StringSetting<Config>(
        "api_key", "API key the HTTP API requires as 'Authorization: Bearer <key>' (empty: none)",
        &Config::api_key, /*allow_empty=*/true);
    // The key itself never reaches logs.
    api_key.spec.secret = true;
    t->settings.push_back(std::move(api_key));
    t->settings.push_back(StringSetting<Config>(
        "http_tls_cert",
        "PEM certificate (chain) of the HTTP API: with http_tls_key it serves HTTPS (both "
        "empty: plaintext HTTP)",
        &Config::http_tls_cert, /*allow_empty=*/true));
    t->settings.push_back(StringSetting<Config>("http_tls_key", "PEM private key of http_tls_cert",
                                                &Config::http_tls_key, /*allow_empty=*/true));
    t->settings.push_back(StringSetting<Config>(
        "http_tls_client_ca",
        "PEM CA that HTTPS clients' certificates must chain to (empty: clients need none)",
        &Config::http_tls_client_ca, /*allow_empty=*/true));
    for (node::Setting<Config>& s : node::TlsSettings<Config>(&Config::tls)) {
      t->settings.push_back(std::move(s));
    }
    t->settings.push_back(node::BoolSetting<Config>(
        "require_node_identity",
        "with TLS: a member's certificate must name its node (URI subjectAltName "
        "kvr://node/<name>), which registers only under that name and alone renews or removes "
        "its node id (false: any certificate of the CA may register under any name)",
        &Config::require_node_identity));
    return t;
  }();
  return *table;
}

}  // namespace kvr::controller
