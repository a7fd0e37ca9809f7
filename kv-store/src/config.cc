#include "kvr/kv_store/config.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdlib>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvr/common/byte_size.h"
#include "kvr/common/version.h"
#include "kvr/common/tls.h"
#include "yaml-cpp/yaml.h"

namespace kvr::kv_store {

EnvLookup ProcessEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

namespace {

absl::StatusOr<bool> ParseBool(const std::string& key, const std::string& text) {
  std::string v = absl::AsciiStrToLower(text);
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  return absl::InvalidArgumentError(absl::StrFormat("%s: '%s' is not a boolean", key, text));
}

absl::StatusOr<uint64_t> ParseUint(const std::string& key, const std::string& text) {
  uint64_t v = 0;
  if (!absl::SimpleAtoi(text, &v)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: '%s' is not a non-negative integer", key, text));
  }
  return v;
}

}  // namespace

absl::StatusOr<StoreConfig> ParseStoreConfig(int argc, const char* const* argv,
                                             const EnvLookup& env) {
  // Every field is read as text from the first source that has it and parsed once, so all
  // sources accept the same syntax (e.g. "4GiB").
  CLI::App app{"kvr-store: CPU-memory KV cache store (gRPC control, UCX data plane)"};
  app.set_version_flag("--version", VersionLine("kvr-store"));
  std::string config_path;
  app.add_option("--config", config_path, "YAML file with any of the options below");
  struct Field {
    std::string key;
    std::string help;
    std::string flag_value;
    CLI::Option* option = nullptr;
  };
  std::vector<Field> fields = {
      {"listen", "gRPC listen address host:port (port 0: any free port)"},
      {"capacity_bytes", "page pool size, e.g. 4GiB (4 x 1024^3) or 4GB (4 x 1000^3)"},
      {"page_bytes",
       "bytes per page; a page holds page_bytes / (2*head_dim*dtype size) rows of one "
       "(sequence, layer, kv head): 64KiB = 256 tokens at head_dim 64 f16"},
      {"evict_expired",
       "evict sequences whose lease expired: when space runs short and by a periodic sweep "
       "(bool); off: leases are reported in stats but nothing is dropped"},
      {"evict_cached",
       "evict released-and-kept (cached for reuse) sequences, least recently used first, when "
       "space runs short, after expired ones and before refusing (bool); never a live one"},
      {"huge_pages", "try huge pages for the pool (bool)"},
      {"data_plane_threads", "threads serving UCX data-plane requests"},
      {"sweep_interval_ms", "how often expired leases are swept (with evict_expired)"},
      {"name", "name in logs and peers' error messages"},
      {"metrics_port", "Prometheus /metrics port (0: any free port, -1: off)"},
      {"controller",
       "controller host:port to register with as a STORE node and heartbeat to (empty: do not "
       "register)"},
      {"advertise_address",
       "host:port the controller and nodes reach this store at (default: listen address, a "
       "0.0.0.0 host replaced by this hostname's address or 127.0.0.1)"},
      {"local_socket",
       "Unix socket path (created 0600) on which the page pool's memfd is handed to processes "
       "on this host for zero-copy reads; every sequence in the pool is readable through it "
       "(empty: off)"},
      {"max_reply_bytes",
       "largest reply to one gather or range read, e.g. 512MiB (bigger requests are refused: "
       "split them)"},
      {"max_outstanding_reply_bytes",
       "most reply memory being filled or sent at once, e.g. 2GiB (past it requests are "
       "refused as busy)"},
      {"rma_reads",
       "register the page pool with UCX and hand its rkey to every client for RMA range "
       "reads (bool); the rkey reads the whole pool past every sequence capability, so only "
       "on a trusted data-plane network; off: range reads go through checked messages"},
      {"tls_ca", kTlsCaHelp},
      {"tls_cert", kTlsCertHelp},
      {"tls_key", kTlsKeyHelp},
  };
  for (Field& f : fields) {
    std::string flag = "--" + f.key;
    for (char& c : flag) c = c == '_' ? '-' : c;
    f.option = app.add_option(flag, f.flag_value, f.help);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return absl::CancelledError(app.help());
  } catch (const CLI::CallForVersion& e) {
    return absl::CancelledError(absl::StrCat(e.what(), "\n"));
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(absl::StrCat("kvr-store: ", e.what()));
  }

  YAML::Node file;
  if (!config_path.empty()) {
    try {
      file = YAML::LoadFile(config_path);
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrFormat("--config %s: %s", config_path, e.what()));
    }
    if (!file.IsMap() && !file.IsNull()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--config %s: expected a mapping of option: value", config_path));
    }
    for (const auto& item : file) {
      const std::string key = item.first.as<std::string>();
      bool known = false;
      for (const Field& f : fields) known = known || f.key == key;
      if (!known) {
        return absl::InvalidArgumentError(
            absl::StrFormat("--config %s: unknown option '%s'", config_path, key));
      }
    }
  }

  StoreConfig config;
  for (const Field& f : fields) {
    std::optional<std::string> text;
    std::string source = "default";
    if (f.option->count() > 0) {
      text = f.flag_value;
      source = "flag";
    } else if (file.IsMap() && file[f.key]) {
      text = file[f.key].as<std::string>();
      source = "file";
    } else if (std::string var = "KVR_STORE_" + absl::AsciiStrToUpper(f.key);
               (text = env(var)).has_value()) {
      source = "env";
    }
    config.sources.emplace_back(f.key, source);
    if (!text) continue;
    const std::string& k = f.key;
    auto fail = [&](const absl::Status& st) {
      return absl::InvalidArgumentError(absl::StrFormat("%s (from %s)", st.message(), source));
    };
    if (k == "listen") {
      config.listen = *text;
    } else if (k == "name") {
      config.name = *text;
    } else if (k == "controller") {
      config.controller = *text;
    } else if (k == "local_socket") {
      config.local_socket = *text;
    } else if (k == "tls_ca" || k == "tls_cert" || k == "tls_key") {
      (k == "tls_ca" ? config.tls.ca_file
                     : (k == "tls_cert" ? config.tls.cert_file : config.tls.key_file)) = *text;
    } else if (k == "advertise_address") {
      if (!text->empty() && text->rfind(':') == std::string::npos) {
        return fail(absl::InvalidArgumentError(
            absl::StrFormat("advertise_address: '%s' is not host:port", *text)));
      }
      config.advertise_address = *text;
    } else if (k == "capacity_bytes" || k == "page_bytes" || k == "max_reply_bytes" ||
               k == "max_outstanding_reply_bytes") {
      absl::StatusOr<uint64_t> v = kvr::ParseByteSize(*text);
      if (!v.ok())
        return fail(absl::InvalidArgumentError(absl::StrCat(k, ": ", v.status().message())));
      if (*v == 0 && k != "capacity_bytes" && k != "page_bytes") {
        return fail(absl::InvalidArgumentError(absl::StrCat(k, ": must be above 0")));
      }
      (k == "capacity_bytes"    ? config.capacity_bytes
       : k == "page_bytes"      ? config.page_bytes
       : k == "max_reply_bytes" ? config.max_reply_bytes
                                : config.max_outstanding_reply_bytes) = *v;
    } else if (k == "metrics_port") {
      int64_t port = 0;
      if (!absl::SimpleAtoi(*text, &port) || port < -1 || port > 65535) {
        return fail(absl::InvalidArgumentError(absl::StrFormat(
            "metrics_port: '%s' is not a port, 0 (any free port) or -1 (off)", *text)));
      }
      config.metrics_port = port;
    } else if (k == "evict_expired" || k == "evict_cached" || k == "huge_pages" ||
               k == "rma_reads") {
      absl::StatusOr<bool> v = ParseBool(k, *text);
      if (!v.ok()) return fail(v.status());
      (k == "evict_expired"  ? config.evict_expired
       : k == "evict_cached" ? config.evict_cached
       : k == "huge_pages"   ? config.huge_pages
                             : config.rma_reads) = *v;
    } else {
      absl::StatusOr<uint64_t> v = ParseUint(k, *text);
      if (!v.ok()) return fail(v.status());
      (k == "data_plane_threads" ? config.data_plane_threads : config.sweep_interval_ms) = *v;
    }
  }
  if (config.data_plane_threads == 0) {
    return absl::InvalidArgumentError("data_plane_threads must be at least 1");
  }
  return config;
}

StoreServerOptions StoreConfig::ToServerOptions() const {
  StoreServerOptions options;
  options.listen = listen;
  options.name = name;
  options.store.pool = {
      .capacity_bytes = capacity_bytes, .page_bytes = page_bytes, .try_huge_pages = huge_pages};
  options.store.evict_expired = evict_expired;
  options.store.evict_cached = evict_cached;
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

std::string StoreConfig::Describe() const {
  auto source = [this](const std::string& key) {
    for (const auto& [k, s] : sources) {
      if (k == key) return s;
    }
    return std::string("default");
  };
  std::string out;
  auto line = [&](const std::string& key, const std::string& value) {
    absl::StrAppendFormat(&out, "  %s: %s  # %s\n", key, value, source(key));
  };
  line("listen", listen);
  line("capacity_bytes", absl::StrCat(capacity_bytes));
  line("page_bytes", absl::StrCat(page_bytes));
  line("evict_expired", evict_expired ? "true" : "false");
  line("evict_cached", evict_cached ? "true" : "false");
  line("huge_pages", huge_pages ? "true" : "false");
  line("data_plane_threads", absl::StrCat(data_plane_threads));
  line("sweep_interval_ms", absl::StrCat(sweep_interval_ms));
  line("name", name);
  line("metrics_port", absl::StrCat(metrics_port));
  line("controller", controller.empty() ? "(none: not registered)" : controller);
  line("advertise_address", advertise_address.empty() ? "(from listen)" : advertise_address);
  line("local_socket", local_socket.empty() ? "(off)" : local_socket);
  line("rma_reads", rma_reads ? "true" : "false");
  line("tls_ca", tls.ca_file.empty() ? "(off)" : tls.ca_file);
  line("tls_cert", tls.cert_file.empty() ? "(off)" : tls.cert_file);
  line("tls_key", tls.key_file.empty() ? "(off)" : tls.key_file);
  line("max_reply_bytes", absl::StrCat(max_reply_bytes));
  line("max_outstanding_reply_bytes", absl::StrCat(max_outstanding_reply_bytes));
  return out;
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
