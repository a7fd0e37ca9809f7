#pragma once
// Settings of a kvr process, one mechanism for every binary (kvr-controller, kvr-store,
// kvr-prefill, kvr-decode and `kvr up`).
//
// A binary describes its settings once, as a SettingTable: per setting a snake_case name, a
// help text, a type (string, bool, integer, seconds, byte size, enum, list) and where it lives
// in the binary's config struct, whose default member values are the defaults. From the table
// come
//   - typed command-line options (CLI11): --chunk-tokens INT [512], --memory-bytes SIZE [4GiB];
//     --help shows the type and the default, --version the build, --print-config the effective
//     configuration (then the process exits);
//   - a YAML file, --config FILE, of top-level `name: value` pairs; an unknown name is refused,
//     naming the key and the file;
//   - environment variables KVR_<ROLE>_<NAME> (KVR_DECODE_BATCH_SLOTS), where the table has a
//     role; older spellings may be listed as aliases, read after the new name;
// with precedence flag > file > environment > default. A bad value is refused naming the
// setting and where it came from: "batch_slots (flag --batch-slots): '0' is not ...".
// Every source is text parsed by the same code, so "4GiB" means 2^32 bytes and "4GB" 4e9
// wherever it is written (kvr/common/byte_size.h).
//
// The effective configuration prints as YAML, one `name: value  # source` a line, so that it
// can be read back as a --config file.
//
// Thread safety: tables are immutable once built; the functions here keep no state.

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/tls.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvr::node {

enum class SettingType {
  kString,
  kBool,      // true/false, yes/no, on/off, 1/0; a bare flag means true
  kInteger,   // within [min, max]
  kSeconds,   // a non-negative number of seconds, fractions allowed
  kNumber,    // a real number within [min_number, max_number]
  kByteSize,  // kvr::ParseByteSize: 4096, 512MiB, 4GB
  kEnum,      // one of `choices`
  kList,      // strings: a flag given again adds one, YAML a sequence, env words split on spaces
};

// A parsed value. The alternative follows the type: std::string (kString, kEnum), bool,
// int64_t (kInteger), double (kSeconds, kNumber), uint64_t (kByteSize),
// std::vector<std::string> (kList).
using SettingValue =
    std::variant<std::string, bool, int64_t, double, uint64_t, std::vector<std::string>>;

// What a setting is, apart from where its value lives.
struct SettingSpec {
  std::string name;  // YAML key; flag --name-with-dashes; env <prefix><NAME IN CAPITALS>
  std::string help;
  SettingType type = SettingType::kString;
  // kString, kEnum: whether "" is a value; kSeconds, kByteSize: whether 0 is.
  bool allow_empty_or_zero = false;
  int64_t min = std::numeric_limits<int64_t>::min();  // kInteger
  int64_t max = std::numeric_limits<int64_t>::max();  // kInteger
  double min_number = 0;                              // kNumber
  double max_number = 1;                              // kNumber
  std::vector<std::string> choices;                   // kEnum
  // Printed as <redacted> (an API key).
  bool secret = false;
};

// A setting of `Config`: the spec, and how a parsed value is stored into a config (where checks
// that the type cannot express go) and read back for printing.
template <typename Config>
struct Setting {
  SettingSpec spec;
  std::function<absl::Status(Config&, const SettingValue&)> store;
  std::function<SettingValue(const Config&)> load;
};

template <typename Config>
struct SettingTable {
  std::string program;      // "kvr-decode": the --version line and error prefixes
  std::string description;  // the first line of --help
  // Environment prefix, "KVR_DECODE_"; empty: the environment is not read.
  std::string env_prefix;
  // Older prefixes still accepted, read only when the variable under env_prefix is unset.
  std::vector<std::string> legacy_env_prefixes;
  std::vector<Setting<Config>> settings;
  // Runs after every setting is stored: defaults that depend on other settings, and checks
  // across settings. Its error is reported as is.
  std::function<absl::Status(Config&)> finish;
};

// Flag values by setting name, in the order given (several only for kList).
using FlagValues = std::map<std::string, std::vector<std::string>>;
// Reads an environment variable; injected so that tests need not touch the process's.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
[[nodiscard]] EnvLookup ProcessEnvironment();
[[nodiscard]] EnvLookup NoEnvironment();

template <typename Config>
struct ResolvedConfig {
  Config config;
  // Per setting, in table order: "default", "flag", "file" or "env NAME" (the variable read).
  std::vector<std::string> sources;
};

// What a command line said, before resolution.
struct CommandLine {
  FlagValues flags;
  std::optional<std::string> config_file;
  bool print_config = false;
};

// The part of the mechanism that does not depend on the config type.
namespace settings_internal {

// The flag of a setting: "--batch-slots".
std::string FlagName(const std::string& name);
// Parses one setting's text (several items for kList). The message names the value, not the
// setting (the caller adds that and the source).
[[nodiscard]] absl::StatusOr<SettingValue> Parse(const SettingSpec& spec,
                                                 const std::vector<std::string>& items);
// The value as YAML text that Parse reads back as the same value.
std::string Format(const SettingSpec& spec, const SettingValue& value);

// The text of each setting (in `specs` order) from the first source that has it, or nullopt.
struct RawValue {
  std::vector<std::string> items;
  std::string source;  // "flag", "file" or "env NAME"
  std::string where;   // for errors: "flag --x", "config file PATH", "environment NAME"
};
[[nodiscard]] absl::StatusOr<std::vector<std::optional<RawValue>>> Collect(
    const std::vector<const SettingSpec*>& specs, const std::string& env_prefix,
    const std::vector<std::string>& legacy_env_prefixes, const FlagValues& flags,
    const std::optional<std::string>& config_file, const EnvLookup& env);

// Adds --config, --print-config and an option per spec (type name and `defaults[i]` shown in
// --help) to `app`; parsing fills `out`.
// The help footer names the environment variables when `env_prefix` is set.
void AddOptions(CLI::App* app, const std::vector<const SettingSpec*>& specs,
                const std::vector<std::string>& defaults, const std::string& env_prefix,
                CommandLine* out);
// Parses argv with a CLI::App made here (with --version); CANCELLED carries the text of
// --help / --version to print before exiting 0.
[[nodiscard]] absl::StatusOr<CommandLine> ParseArgs(const std::string& program,
                                                    const std::string& description,
                                                    const std::vector<const SettingSpec*>& specs,
                                                    const std::vector<std::string>& defaults,
                                                    const std::string& env_prefix, int argc,
                                                    const char* const* argv);
std::string EffectiveConfigText(const std::vector<const SettingSpec*>& specs,
                                const std::vector<std::string>& values,
                                const std::vector<std::string>& sources);

// Member access for the builders below: a pointer to member, or a callable Config& -> T&.
template <typename Config, typename Ref>
decltype(auto) Field(const Ref& ref, Config& c) {
  return std::invoke(ref, c);
}
template <typename Config, typename Ref>
auto FieldValue(const Ref& ref, const Config& c) {
  // Read only; callables are written for Config& so that one accessor serves both ways.
  return std::invoke(ref, const_cast<Config&>(c));
}

}  // namespace settings_internal

template <typename Config>
std::vector<const SettingSpec*> Specs(const SettingTable<Config>& table) {
  std::vector<const SettingSpec*> specs;
  for (const Setting<Config>& s : table.settings) specs.push_back(&s.spec);
  return specs;
}

// Each setting's value in `config` as printed (YAML text).
template <typename Config>
std::vector<std::string> FormatValues(const SettingTable<Config>& table, const Config& config) {
  std::vector<std::string> out;
  for (const Setting<Config>& s : table.settings) {
    out.push_back(settings_internal::Format(s.spec, s.load(config)));
  }
  return out;
}

// Merges flags, the file and the environment by precedence over the defaults of Config{} and
// parses every value. INVALID_ARGUMENT names the setting and the source of a bad value, an
// unknown key of the file with the file, or a file that cannot be read.
template <typename Config>
[[nodiscard]] absl::StatusOr<ResolvedConfig<Config>> Resolve(
    const SettingTable<Config>& table, const FlagValues& flags,
    const std::optional<std::string>& config_file, const EnvLookup& env) {
  absl::StatusOr<std::vector<std::optional<settings_internal::RawValue>>> raw =
      settings_internal::Collect(Specs(table), table.env_prefix, table.legacy_env_prefixes, flags,
                                 config_file, env);
  if (!raw.ok()) return raw.status();
  ResolvedConfig<Config> out;
  for (size_t i = 0; i < table.settings.size(); ++i) {
    const Setting<Config>& s = table.settings[i];
    const std::optional<settings_internal::RawValue>& r = (*raw)[i];
    if (!r) {
      out.sources.push_back("default");
      continue;
    }
    out.sources.push_back(r->source);
    absl::StatusOr<SettingValue> value = settings_internal::Parse(s.spec, r->items);
    absl::Status stored = value.ok() ? s.store(out.config, *value) : value.status();
    if (!stored.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.spec.name, " (", r->where, "): ", stored.message()));
    }
  }
  if (table.finish) {
    if (absl::Status s = table.finish(out.config); !s.ok()) return s;
  }
  return out;
}

// As above, flags given by name as single values (tests and callers without a command line).
template <typename Config>
[[nodiscard]] absl::StatusOr<ResolvedConfig<Config>> Resolve(
    const SettingTable<Config>& table, const std::map<std::string, std::string>& flags,
    const std::optional<std::string>& config_file, const EnvLookup& env) {
  FlagValues values;
  for (const auto& [name, value] : flags) values[name] = {value};
  return Resolve(table, values, config_file, env);
}

// The config alone, for callers that print no sources (tests).
template <typename Config>
[[nodiscard]] absl::StatusOr<Config> ResolveConfig(const SettingTable<Config>& table,
                                                   const std::map<std::string, std::string>& flags,
                                                   const std::optional<std::string>& config_file,
                                                   const EnvLookup& env) {
  absl::StatusOr<ResolvedConfig<Config>> r = Resolve(table, flags, config_file, env);
  if (!r.ok()) return r.status();
  return std::move(r->config);
}

// The effective configuration, valid YAML: a `name: value  # source` line per setting
// (sources left out when `resolved` has none).
template <typename Config>
std::string FormatConfig(const SettingTable<Config>& table, const ResolvedConfig<Config>& r) {
  return settings_internal::EffectiveConfigText(Specs(table), FormatValues(table, r.config),
                                                r.sources);
}
template <typename Config>
std::string FormatConfig(const SettingTable<Config>& table, const Config& config) {
  return settings_internal::EffectiveConfigText(Specs(table), FormatValues(table, config), {});
}

// Adds the table's options, --config and --print-config to `app` (a subcommand such as
// `kvr up`); after app parses, Resolve(table, out->flags, out->config_file, env).
template <typename Config>
void AddSettingOptions(CLI::App* app, const SettingTable<Config>& table, CommandLine* out) {
  settings_internal::AddOptions(app, Specs(table), FormatValues(table, Config{}), table.env_prefix,
                                out);
}

// Parses a process's argv and resolves its config. CANCELLED carries the text to print for
// --help / --version (exit 0).
template <typename Config>
[[nodiscard]] absl::StatusOr<ResolvedConfig<Config>> ParseCommandLine(
    const SettingTable<Config>& table, int argc, const char* const* argv, const EnvLookup& env,
    bool* print_config = nullptr) {
  absl::StatusOr<CommandLine> line =
      settings_internal::ParseArgs(table.program, table.description, Specs(table),
                                   FormatValues(table, Config{}), table.env_prefix, argc, argv);
  if (!line.ok()) return line.status();
  if (print_config != nullptr) *print_config = line->print_config;
  return Resolve(table, line->flags, line->config_file, env);
}

// The start of a node's main(): parses argv against the process environment, prints the
// effective config to stdout ("# <program> effective config" and the lines) and returns the
// config. Returns nullopt with `*exit_code` set when the process should exit instead: 0 after
// --help, --version or --print-config, 2 after an error (printed to stderr).
template <typename Config>
std::optional<Config> LoadConfigOrExit(const SettingTable<Config>& table, int argc,
                                       const char* const* argv, int* exit_code);

// A node's whole main(): LoadConfigOrExit, then `serve` with the config; returns the exit
// status.
template <typename Config>
int ServeMain(const SettingTable<Config>& table, int argc, const char* const* argv,
              int (*serve)(const Config&)) {
  int exit_code = 0;
  std::optional<Config> config = LoadConfigOrExit(table, argc, argv, &exit_code);
  return config ? serve(*config) : exit_code;
}

namespace settings_internal {
// Prints the outcome of ParseCommandLine for LoadConfigOrExit; returns whether to go on.
bool Report(const std::string& program, const absl::Status& status, const std::string& effective,
            bool print_config, int* exit_code);
}  // namespace settings_internal

template <typename Config>
std::optional<Config> LoadConfigOrExit(const SettingTable<Config>& table, int argc,
                                       const char* const* argv, int* exit_code) {
  bool print_config = false;
  absl::StatusOr<ResolvedConfig<Config>> r =
      ParseCommandLine(table, argc, argv, ProcessEnvironment(), &print_config);
  const std::string effective = r.ok() ? FormatConfig(table, *r) : std::string();
  if (!settings_internal::Report(table.program, r.status(), effective, print_config, exit_code)) {
    return std::nullopt;
  }
  return std::move(r->config);
}

// Builders of table rows. `ref` is a pointer to a member of Config (&Config::listen) or a
// callable Config& -> T& for nested members ([](Config& c) -> auto& { return c.tls.ca_file; }).

template <typename Config, typename Ref>
Setting<Config> StringSetting(std::string name, std::string help, Ref ref,
                              bool allow_empty = false) {
  return {SettingSpec{.name = std::move(name),
                      .help = std::move(help),
                      .type = SettingType::kString,
                      .allow_empty_or_zero = allow_empty},
          [ref](Config& c, const SettingValue& v) {
            settings_internal::Field(ref, c) = std::get<std::string>(v);
            return absl::OkStatus();
          },
          [ref](const Config& c) {
            return SettingValue(std::string(settings_internal::FieldValue(ref, c)));
          }};
}

template <typename Config, typename Ref>
Setting<Config> EnumSetting(std::string name, std::string help, Ref ref,
                            std::vector<std::string> choices, bool allow_empty = false) {
  Setting<Config> s = StringSetting<Config>(std::move(name), std::move(help), ref, allow_empty);
  s.spec.type = SettingType::kEnum;
  s.spec.choices = std::move(choices);
  return s;
}

template <typename Config, typename Ref>
Setting<Config> BoolSetting(std::string name, std::string help, Ref ref) {
  return {
      SettingSpec{.name = std::move(name), .help = std::move(help), .type = SettingType::kBool},
      [ref](Config& c, const SettingValue& v) {
        settings_internal::Field(ref, c) = std::get<bool>(v);
        return absl::OkStatus();
      },
      [ref](const Config& c) { return SettingValue(bool(settings_internal::FieldValue(ref, c))); }};
}

// An integer in [min, max] (max defaults to the largest value of the member's type).
template <typename Config, typename Ref>
Setting<Config> IntegerSetting(std::string name, std::string help, Ref ref, int64_t min,
                               std::optional<int64_t> max = std::nullopt) {
  using T = std::remove_cvref_t<decltype(settings_internal::Field(ref, std::declval<Config&>()))>;
  constexpr int64_t kTypeMax = std::numeric_limits<T>::max() > std::numeric_limits<int64_t>::max()
                                   ? std::numeric_limits<int64_t>::max()
                                   : static_cast<int64_t>(std::numeric_limits<T>::max());
  return {SettingSpec{.name = std::move(name),
                      .help = std::move(help),
                      .type = SettingType::kInteger,
                      .min = min,
                      .max = max.value_or(kTypeMax)},
          [ref](Config& c, const SettingValue& v) {
            settings_internal::Field(ref, c) = static_cast<T>(std::get<int64_t>(v));
            return absl::OkStatus();
          },
          [ref](const Config& c) {
            return SettingValue(static_cast<int64_t>(settings_internal::FieldValue(ref, c)));
          }};
}

template <typename Config, typename Ref>
Setting<Config> SecondsSetting(std::string name, std::string help, Ref ref,
                               bool allow_zero = false) {
  return {SettingSpec{.name = std::move(name),
                      .help = std::move(help),
                      .type = SettingType::kSeconds,
                      .allow_empty_or_zero = allow_zero},
          [ref](Config& c, const SettingValue& v) {
            settings_internal::Field(ref, c) = std::get<double>(v);
            return absl::OkStatus();
          },
          [ref](const Config& c) {
            return SettingValue(static_cast<double>(settings_internal::FieldValue(ref, c)));
          }};
}

// A real number in [min, max] (a fraction: 0, 1).
template <typename Config, typename Ref>
Setting<Config> NumberSetting(std::string name, std::string help, Ref ref, double min, double max) {
  Setting<Config> s = SecondsSetting<Config>(std::move(name), std::move(help), ref);
  s.spec.type = SettingType::kNumber;
  s.spec.min_number = min;
  s.spec.max_number = max;
  return s;
}

template <typename Config, typename Ref>
Setting<Config> ByteSizeSetting(std::string name, std::string help, Ref ref,
                                bool allow_zero = false) {
  using T = std::remove_cvref_t<decltype(settings_internal::Field(ref, std::declval<Config&>()))>;
  return {SettingSpec{.name = std::move(name),
                      .help = std::move(help),
                      .type = SettingType::kByteSize,
                      .allow_empty_or_zero = allow_zero},
          [ref](Config& c, const SettingValue& v) {
            const uint64_t bytes = std::get<uint64_t>(v);
            if (bytes > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
              return absl::InvalidArgumentError("too large");
            }
            settings_internal::Field(ref, c) = static_cast<T>(bytes);
            return absl::OkStatus();
          },
          [ref](const Config& c) {
            return SettingValue(static_cast<uint64_t>(settings_internal::FieldValue(ref, c)));
          }};
}

template <typename Config, typename Ref>
Setting<Config> ListSetting(std::string name, std::string help, Ref ref) {
  return {SettingSpec{.name = std::move(name), .help = std::move(help), .type = SettingType::kList},
          [ref](Config& c, const SettingValue& v) {
            settings_internal::Field(ref, c) = std::get<std::vector<std::string>>(v);
            return absl::OkStatus();
          },
          [ref](const Config& c) {
            return SettingValue(std::vector<std::string>(settings_internal::FieldValue(ref, c)));
          }};
}

// Settings every node has, the same way in each.
template <typename Config, typename Ref>
Setting<Config> ListenSetting(Ref ref) {
  return StringSetting<Config>("listen", "gRPC listen address host:port (port 0: any free port)",
                               ref);
}
template <typename Config, typename Ref>
Setting<Config> LogLevelSetting(Ref ref) {
  return EnumSetting<Config>("log_level", "log verbosity", ref,
                             {"trace", "debug", "info", "warn", "error"});
}
template <typename Config, typename Ref>
Setting<Config> MetricsPortSetting(Ref ref) {
  return IntegerSetting<Config>("metrics_port",
                                "Prometheus /metrics port on the listen host (0: any free port, "
                                "printed at start; -1: off)",
                                ref, -1, 65535);
}

template <typename Config, typename Ref>
Setting<Config> HealthAddressSetting(Ref ref) {
  return StringSetting<Config>(
      "health_address",
      "host:port of a plaintext port that serves only grpc.health.v1.Health, with the main "
      "port's statuses, for probes that cannot present a client certificate (Kubernetes gRPC "
      "probes); empty: none",
      ref, /*allow_empty=*/true);
}

// tls_ca, tls_cert, tls_key and tls_server_name (kvr/common/tls.h), stored in the TlsConfig at
// `tls`.
template <typename Config, typename Ref>
std::vector<Setting<Config>> TlsSettings(Ref tls) {
  auto file = [tls](std::string TlsConfig::*member) {
    return [tls, member](Config& c) -> std::string& {
      return settings_internal::Field(tls, c).*member;
    };
  };
  return {StringSetting<Config>("tls_ca", kTlsCaHelp, file(&TlsConfig::ca_file), true),
          StringSetting<Config>("tls_cert", kTlsCertHelp, file(&TlsConfig::cert_file), true),
          StringSetting<Config>("tls_key", kTlsKeyHelp, file(&TlsConfig::key_file), true),
          StringSetting<Config>("tls_server_name", kTlsServerNameHelp,
                                file(&TlsConfig::server_name), true)};
}

}  // namespace kvr::node
