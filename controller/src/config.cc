#include "kvr/controller/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/tls.h"

namespace kvr::controller {
namespace {

absl::Status BadValue(const std::string& value, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("'", value, "' is not ", what));
}

ConfigField StringField(std::string name, std::string help, std::string ControllerConfig::*member) {
  return {std::move(name), std::move(help),
          [member](ControllerConfig& c, const std::string& v) {
            if (v.empty()) return absl::InvalidArgumentError("empty");
            c.*member = v;
            return absl::OkStatus();
          },
          [member](const ControllerConfig& c) { return c.*member; }};
}

template <typename Get>
ConfigField UintField(std::string name, std::string help, Get get) {
  return {std::move(name), std::move(help),
          [get](ControllerConfig& c, const std::string& v) {
            uint32_t x;
            if (!absl::SimpleAtoi(v, &x) || x == 0) return BadValue(v, "a positive integer");
            get(c) = x;
            return absl::OkStatus();
          },
          [get](const ControllerConfig& c) {
            return absl::StrCat(get(const_cast<ControllerConfig&>(c)));
          }};
}

ConfigField SecondsField(std::string name, std::string help, double ControllerConfig::*member) {
  return {std::move(name), std::move(help),
          [member](ControllerConfig& c, const std::string& v) {
            double x;
            if (!absl::SimpleAtod(v, &x) || !std::isfinite(x) || x <= 0) {
              return BadValue(v, "a positive number of seconds");
            }
            c.*member = x;
            return absl::OkStatus();
          },
          [member](const ControllerConfig& c) { return absl::StrCat(c.*member); }};
}

}  // namespace

const std::vector<ConfigField>& ControllerConfigFields() {
  // Immutable after construction; a function-local static is a constant, not mutable state.
  static const std::vector<ConfigField>* const fields = new std::vector<ConfigField>{
      StringField("listen", "gRPC listen address host:port (port 0: any free port)",
                  &ControllerConfig::listen),
      SecondsField("lease_seconds", "node lease: a node silent this long leaves the cluster",
                   &ControllerConfig::lease_seconds),
      SecondsField("default_timeout_seconds", "deadline of requests whose client set none",
                   &ControllerConfig::default_timeout_seconds),
      SecondsField("shutdown_grace_seconds",
                   "on SIGTERM, how long running requests may finish before they are cancelled",
                   &ControllerConfig::shutdown_grace_seconds),
      UintField("max_in_flight", "most requests in flight before RESOURCE_EXHAUSTED",
                [](ControllerConfig& c) -> uint32_t& { return c.max_in_flight; }),
      UintField("max_attempts", "attempts per request when nodes fail before the first token",
                [](ControllerConfig& c) -> uint32_t& { return c.max_attempts; }),
      {"prefix_cache_seconds",
       "how long a store keeps a finished request's KV for requests sharing its prefix (0: off)",
       [](ControllerConfig& c, const std::string& v) {
         double x;
         if (!absl::SimpleAtod(v, &x) || !std::isfinite(x) || x < 0) {
           return BadValue(v, "a number of seconds, 0 for off");
         }
         c.prefix_cache_seconds = x;
         return absl::OkStatus();
       },
       [](const ControllerConfig& c) { return absl::StrCat(c.prefix_cache_seconds); }},
      UintField("prefix_cache_entries", "most cached prefixes the controller remembers",
                [](ControllerConfig& c) -> uint32_t& { return c.prefix_cache_entries; }),
      UintField("default_max_tokens", "max_tokens of requests that set none",
                [](ControllerConfig& c) -> uint32_t& { return c.defaults.max_tokens; }),
      {"default_method", "retrieval method of requests that set none",
       [](ControllerConfig& c, const std::string& v) {
         if (v.empty()) return absl::InvalidArgumentError("empty");
         c.defaults.method = v;
         return absl::OkStatus();
       },
       [](const ControllerConfig& c) { return c.defaults.method; }},
      UintField("default_budget", "retrieval budget (top-k) of requests that set none",
                [](ControllerConfig& c) -> uint32_t& { return c.defaults.budget; }),
      UintField("default_n_sink", "sink tokens of requests that set none",
                [](ControllerConfig& c) -> uint32_t& { return c.defaults.n_sink; }),
      UintField("default_local_window", "local window of requests that set none",
                [](ControllerConfig& c) -> uint32_t& { return c.defaults.local_window; }),
      {"log_level", "trace, debug, info, warn, error",
       [](ControllerConfig& c, const std::string& v) {
         static constexpr const char* kLevels[] = {"trace", "debug", "info", "warn", "error"};
         for (const char* level : kLevels) {
           if (v == level) {
             c.log_level = v;
             return absl::OkStatus();
           }
         }
         return BadValue(v, "one of trace, debug, info, warn, error");
       },
       [](const ControllerConfig& c) { return c.log_level; }},
      {"metrics_port", "Prometheus /metrics port (0: any free port, -1: off)",
       [](ControllerConfig& c, const std::string& v) {
         int32_t port;
         if (!absl::SimpleAtoi(v, &port) || port < -1 || port > 65535) {
           return BadValue(v, "a port number, 0 (any free port) or -1 (off)");
         }
         c.metrics_port = port;
         return absl::OkStatus();
       },
       [](const ControllerConfig& c) { return absl::StrCat(c.metrics_port); }},
      {"http_listen",
       "OpenAI-compatible HTTP API address host:port (port 0: any free port; empty or -1: off)",
       [](ControllerConfig& c, const std::string& v) {
         if (v.empty() || v == "-1") {
           c.http_listen.clear();
           return absl::OkStatus();
         }
         const size_t colon = v.rfind(':');
         uint32_t port;
         if (colon == std::string::npos || colon == 0 ||
             !absl::SimpleAtoi(v.substr(colon + 1), &port) || port > 65535) {
           return BadValue(v, "host:port, empty or -1 (off)");
         }
         c.http_listen = v;
         return absl::OkStatus();
       },
       [](const ControllerConfig& c) {
         return c.http_listen.empty() ? std::string("-1") : c.http_listen;
       }},
      {"api_key", "API key the HTTP API requires as 'Authorization: Bearer <key>' (empty: none)",
       [](ControllerConfig& c, const std::string& v) {
         c.api_key = v;
         return absl::OkStatus();
       },
       // The key itself never reaches logs.
       [](const ControllerConfig& c) {
         return c.api_key.empty() ? std::string("\"\"") : std::string("<redacted>");
       }},
  };
  // Every binary's TLS settings, the same three (kvr/common/tls.h).
  static const std::vector<ConfigField>* const with_tls =
      AppendTlsSettingFields(new std::vector<ConfigField>(*fields), &ControllerConfig::tls);
  return *with_tls;
}

absl::StatusOr<ConfigValues> ReadConfigFile(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": ", e.what()));
  }
  ConfigValues values;
  if (root.IsNull()) return values;
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config file ", path, ": expected a map of setting: value"));
  }
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    if (!kv.second.IsScalar()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config file ", path, ": ", key, ": expected a scalar value"));
    }
    values[key] = kv.second.as<std::string>();
  }
  return values;
}

absl::StatusOr<ControllerConfig> ResolveControllerConfig(
    const ConfigValues& flags, const std::optional<std::string>& config_file,
    const std::function<std::optional<std::string>(const std::string&)>& getenv) {
  ConfigValues file;
  if (config_file) {
    absl::StatusOr<ConfigValues> read = ReadConfigFile(*config_file);
    if (!read.ok()) return read.status();
    file = std::move(*read);
    for (const auto& [key, value] : file) {
      bool known = false;
      for (const ConfigField& f : ControllerConfigFields()) known |= f.name == key;
      if (!known) {
        return absl::InvalidArgumentError(
            absl::StrCat("config file ", *config_file, ": unknown setting '", key, "'"));
      }
    }
  }
  ControllerConfig config;
  for (const ConfigField& f : ControllerConfigFields()) {
    std::optional<std::string> value;
    std::string source;
    const std::string env_name = absl::StrCat("KVR_", absl::AsciiStrToUpper(f.name));
    if (auto it = flags.find(f.name); it != flags.end()) {
      value = it->second;
      source = "flag --" + f.name;
      std::replace(source.begin(), source.end(), '_', '-');
    } else if (auto it = file.find(f.name); it != file.end()) {
      value = it->second;
      source = absl::StrCat("config file ", *config_file);
    } else if (std::optional<std::string> env = getenv(env_name)) {
      value = *env;
      source = "environment " + env_name;
    }
    if (!value) continue;
    if (absl::Status s = f.set(config, *value); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(f.name, " (", source, "): ", s.message()));
    }
  }
  return config;
}

std::string FormatConfig(const ControllerConfig& config) {
  std::string out;
  for (const ConfigField& f : ControllerConfigFields()) {
    absl::StrAppend(&out, f.name, ": ", f.get(config), "\n");
  }
  return out;
}

}  // namespace kvr::controller
