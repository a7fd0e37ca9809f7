#include "kvr/node/settings.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <iostream>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvr/common/byte_size.h"
#include "kvr/common/version.h"

namespace kvr::node {

EnvLookup ProcessEnvironment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

EnvLookup NoEnvironment() {
  return [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
}

namespace settings_internal {
namespace {

absl::Status Bad(const std::string& text, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not ", what));
}

std::string IntegerRange(const SettingSpec& spec) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (spec.min == 1 && spec.max >= std::numeric_limits<int32_t>::max()) {
    return "a positive integer";
  }
  if (spec.min == 0 && spec.max >= std::numeric_limits<int32_t>::max()) {
    return "a non-negative integer";
  }
  if (spec.max == kMax) return absl::StrCat("an integer of at least ", spec.min);
  return absl::StrCat("an integer from ", spec.min, " to ", spec.max);
}

// The YAML text of one scalar, quoted where YAML needs it ("" for the empty string).
std::string YamlScalar(const std::string& text) {
  YAML::Emitter out;
  out << text;
  return out.c_str();
}

// A byte count in the unit that writes it exactly with the fewest digits (binary on a tie):
// 64KiB, 4GiB, 4GB, 4097.
std::string FormatBytes(uint64_t bytes) {
  if (bytes == 0) return "0";
  static constexpr const char* kBinary[] = {"", "KiB", "MiB", "GiB", "TiB", "PiB"};
  static constexpr const char* kDecimal[] = {"", "kB", "MB", "GB", "TB", "PB"};
  std::string best = absl::StrCat(bytes);
  for (const uint64_t base : {uint64_t{1000}, uint64_t{1024}}) {
    uint64_t unit = 1;
    for (int power = 1; power <= 5; ++power) {
      unit *= base;
      if (bytes % unit != 0) break;
      std::string text =
          absl::StrCat(bytes / unit, base == 1024 ? kBinary[power] : kDecimal[power]);
      const size_t digits = absl::StrCat(bytes / unit).size();
      const size_t best_digits = best.find_first_not_of("0123456789");
      if (digits <= (best_digits == std::string::npos ? best.size() : best_digits)) {
        best = std::move(text);
      }
    }
  }
  return best;
}

std::string TypeName(const SettingSpec& spec) {
  switch (spec.type) {
    case SettingType::kString:
      return "TEXT";
    case SettingType::kBool:
      return "BOOL";
    case SettingType::kInteger:
      return "INT";
    case SettingType::kSeconds:
      return "SECONDS";
    case SettingType::kNumber:
      return "NUMBER";
    case SettingType::kByteSize:
      return "BYTES";
    case SettingType::kEnum:
      return absl::StrJoin(spec.choices, "|");
    case SettingType::kList:
      return "TEXT (repeatable)";
  }
  return "TEXT";
}

constexpr char kFooter[] =
    "Types: BYTES is a byte size, 4096, 512MiB (x 1024^2) or 4GB (x 1000^3); SECONDS a number "
    "of seconds (fractions allowed); BOOL true/false (yes/no, on/off, 1/0; the bare flag means "
    "true). Every option is also a key of the --config YAML file (its name with underscores: "
    "--batch-slots is batch_slots)";

}  // namespace

std::string FlagName(const std::string& name) {
  std::string flag = "--" + name;
  for (char& c : flag) c = c == '_' ? '-' : c;
  return flag;
}

absl::StatusOr<SettingValue> Parse(const SettingSpec& spec, const std::vector<std::string>& items) {
  if (spec.type == SettingType::kList) return SettingValue(items);
  const std::string text = items.empty() ? std::string() : items.back();
  switch (spec.type) {
    case SettingType::kString:
      if (text.empty() && !spec.allow_empty_or_zero) {
        return absl::InvalidArgumentError("must not be empty");
      }
      return SettingValue(text);
    case SettingType::kEnum: {
      if (text.empty() && spec.allow_empty_or_zero) return SettingValue(text);
      for (const std::string& choice : spec.choices) {
        if (text == choice) return SettingValue(text);
      }
      return Bad(text, absl::StrCat("one of ", absl::StrJoin(spec.choices, ", ")));
    }
    case SettingType::kBool: {
      const std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
      if (v == "true" || v == "1" || v == "yes" || v == "on") return SettingValue(true);
      if (v == "false" || v == "0" || v == "no" || v == "off") return SettingValue(false);
      return Bad(text, "a boolean (true or false)");
    }
    case SettingType::kInteger: {
      int64_t v = 0;
      if (!absl::SimpleAtoi(text, &v) || v < spec.min || v > spec.max) {
        return Bad(text, IntegerRange(spec));
      }
      return SettingValue(v);
    }
    case SettingType::kSeconds: {
      absl::string_view number = absl::StripAsciiWhitespace(text);
      if (absl::EndsWith(number, "s")) number.remove_suffix(1);
      double v = 0;
      // !(v >= 0) also refuses NaN.
      if (!absl::SimpleAtod(number, &v) || !std::isfinite(v) || !(v >= 0) ||
          (v == 0 && !spec.allow_empty_or_zero)) {
        return Bad(text, spec.allow_empty_or_zero ? "a number of seconds (0 or more)"
                                                  : "a positive number of seconds");
      }
      return SettingValue(v);
    }
    case SettingType::kNumber: {
      double v = 0;
      // !(v >= min && v <= max) also refuses NaN.
      if (!absl::SimpleAtod(text, &v) || !(v >= spec.min_number && v <= spec.max_number)) {
        return Bad(text,
                   absl::StrCat("a number in [", spec.min_number, ", ", spec.max_number, "]"));
      }
      return SettingValue(v);
    }
    case SettingType::kByteSize: {
      absl::StatusOr<uint64_t> v = ParseByteSize(text);
      if (!v.ok()) return v.status();
      if (*v == 0 && !spec.allow_empty_or_zero) return Bad(text, "a positive byte size");
      return SettingValue(*v);
    }
    case SettingType::kList:
      break;
  }
  return absl::InternalError("unknown setting type");
}

std::string Format(const SettingSpec& spec, const SettingValue& value) {
  if (spec.secret) {
    return std::get<std::string>(value).empty() ? "\"\"" : "<redacted>";
  }
  switch (spec.type) {
    case SettingType::kString:
    case SettingType::kEnum:
      return YamlScalar(std::get<std::string>(value));
    case SettingType::kBool:
      return std::get<bool>(value) ? "true" : "false";
    case SettingType::kInteger:
      return absl::StrCat(std::get<int64_t>(value));
    case SettingType::kSeconds:
    case SettingType::kNumber: {
      // The shortest text that reads back as the same double (0.1, not 0.10000000000000001).
      char text[32];
      const std::to_chars_result end =
          std::to_chars(text, text + sizeof(text), std::get<double>(value));
      return std::string(text, end.ptr);
    }
    case SettingType::kByteSize:
      return FormatBytes(std::get<uint64_t>(value));
    case SettingType::kList: {
      YAML::Emitter out;
      out << YAML::Flow << std::get<std::vector<std::string>>(value);
      return out.c_str();
    }
  }
  return "";
}

absl::StatusOr<std::vector<std::optional<RawValue>>> Collect(
    const std::vector<const SettingSpec*>& specs, const std::string& env_prefix,
    const std::vector<std::string>& legacy_env_prefixes, const FlagValues& flags,
    const std::optional<std::string>& config_file, const EnvLookup& env) {
  auto find = [&](const std::string& name) -> const SettingSpec* {
    for (const SettingSpec* spec : specs) {
      if (spec->name == name) return spec;
    }
    return nullptr;
  };
  for (const auto& [name, values] : flags) {
    if (find(name) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown setting '", name, "'"));
    }
  }
  std::map<std::string, std::vector<std::string>> file;
  if (config_file) {
    const std::string& path = *config_file;
    YAML::Node root;
    try {
      root = YAML::LoadFile(path);
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": ", e.what()));
    }
    if (!root.IsNull() && !root.IsMap()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config file ", path, ": expected a map of setting: value"));
    }
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      const SettingSpec* spec = find(key);
      if (spec == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("config file ", path, ": unknown setting '", key, "'"));
      }
      std::vector<std::string>& items = file[key];
      const YAML::Node& v = kv.second;
      if (v.IsNull()) {
        if (spec->type != SettingType::kList) items.push_back("");
      } else if (v.IsScalar()) {
        items.push_back(v.Scalar());
      } else if (v.IsSequence() && spec->type == SettingType::kList) {
        for (const YAML::Node& item : v) {
          if (!item.IsScalar()) {
            return absl::InvalidArgumentError(
                absl::StrCat("config file ", path, ": ", key, ": expected a list of scalars"));
          }
          items.push_back(item.Scalar());
        }
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("config file ", path, ": ", key, ": expected a single value",
                         spec->type == SettingType::kList ? " or a list" : ""));
      }
    }
  }
  std::vector<std::optional<RawValue>> out(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const SettingSpec& spec = *specs[i];
    if (auto it = flags.find(spec.name); it != flags.end()) {
      out[i] = RawValue{it->second, "flag", "flag " + FlagName(spec.name)};
      continue;
    }
    if (auto it = file.find(spec.name); it != file.end()) {
      out[i] = RawValue{it->second, "file", absl::StrCat("config file ", *config_file)};
      continue;
    }
    if (env_prefix.empty()) continue;
    std::vector<std::string> prefixes = {env_prefix};
    prefixes.insert(prefixes.end(), legacy_env_prefixes.begin(), legacy_env_prefixes.end());
    for (const std::string& prefix : prefixes) {
      const std::string var = prefix + absl::AsciiStrToUpper(spec.name);
      std::optional<std::string> text = env(var);
      if (!text) continue;
      std::vector<std::string> items;
      if (spec.type == SettingType::kList) {
        items = absl::StrSplit(*text, absl::ByAnyChar(" \t\n"), absl::SkipEmpty());
      } else {
        items.push_back(*text);
      }
      out[i] = RawValue{std::move(items), "env " + var, "environment " + var};
      break;
    }
  }
  return out;
}

void AddOptions(CLI::App* app, const std::vector<const SettingSpec*>& specs,
                const std::vector<std::string>& defaults, const std::string& env_prefix,
                CommandLine* out) {
  app->add_option(
         "--config",
         [out](const CLI::results_t& r) {
           out->config_file = r.back();
           return true;
         },
         "YAML file of `setting: value` lines, keys as below without the dashes (precedence: "
         "flag > file > environment > default)")
      ->type_name("FILE");
  app->add_flag_callback(
      "--print-config", [out] { out->print_config = true; },
      "print the effective configuration (YAML, each line's source in a comment) and exit");
  for (size_t i = 0; i < specs.size(); ++i) {
    const SettingSpec& spec = *specs[i];
    CLI::Option* option = app->add_option(
        FlagName(spec.name),
        [out, name = spec.name, type = spec.type](const CLI::results_t& r) {
          std::vector<std::string>& values = out->flags[name];
          if (type == SettingType::kBool && (r.empty() || r.back().empty())) {
            values = {"true"};
          } else if (type == SettingType::kList) {
            values.insert(values.end(), r.begin(), r.end());
          } else {
            values = {r.empty() ? std::string() : r.back()};
          }
          return true;
        },
        spec.help);
    if (spec.type == SettingType::kBool) {
      // CLI11 gives a bare option the default string as its value: the default is shown in
      // the type name instead, so that a bare --flag means true.
      option->type_name(absl::StrCat(TypeName(spec), "=", defaults[i]));
    } else {
      option->type_name(TypeName(spec));
      if (spec.type != SettingType::kList || defaults[i] != "[]") option->default_str(defaults[i]);
    }
    if (spec.type == SettingType::kBool) {
      option->expected(0, 1);
    } else if (spec.type == SettingType::kList) {
      option->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    } else {
      option->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
  }
  std::string footer = kFooter;
  if (!env_prefix.empty() && !specs.empty()) {
    absl::StrAppend(&footer, ", and an environment variable ", env_prefix, "<NAME IN CAPITALS> (",
                    FlagName(specs.front()->name), " is ", env_prefix,
                    absl::AsciiStrToUpper(specs.front()->name), ")");
  }
  app->footer(footer + ".");
  // Room for the longest options (--max-outstanding-reply-bytes BYTES=2GiB) beside their help.
  app->get_formatter()->column_width(44);
}

absl::StatusOr<CommandLine> ParseArgs(const std::string& program, const std::string& description,
                                      const std::vector<const SettingSpec*>& specs,
                                      const std::vector<std::string>& defaults,
                                      const std::string& env_prefix, int argc,
                                      const char* const* argv) {
  CLI::App app{description, program};
  app.set_version_flag("--version", VersionLine(program));
  CommandLine line;
  AddOptions(&app, specs, defaults, env_prefix, &line);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return absl::CancelledError(app.help());
  } catch (const CLI::CallForAllHelp&) {
    return absl::CancelledError(app.help("", CLI::AppFormatMode::All));
  } catch (const CLI::CallForVersion& e) {
    return absl::CancelledError(absl::StrCat(e.what(), "\n"));
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  return line;
}

std::string EffectiveConfigText(const std::vector<const SettingSpec*>& specs,
                                const std::vector<std::string>& values,
                                const std::vector<std::string>& sources) {
  std::string out;
  for (size_t i = 0; i < specs.size(); ++i) {
    absl::StrAppend(&out, specs[i]->name, ": ", values[i]);
    if (i < sources.size()) absl::StrAppend(&out, "  # ", sources[i]);
    out += "\n";
  }
  return out;
}

bool Report(const std::string& program, const absl::Status& status, const std::string& effective,
            bool print_config, int* exit_code) {
  if (absl::IsCancelled(status)) {  // --help, --version
    std::cout << status.message() << std::flush;
    *exit_code = 0;
    return false;
  }
  if (!status.ok()) {
    std::cerr << program << ": " << status.message() << "\n";
    *exit_code = 2;
    return false;
  }
  std::cout << "# " << program << " effective config\n" << effective << std::flush;
  if (print_config) {
    *exit_code = 0;
    return false;
  }
  return true;
}

}  // namespace settings_internal
}  // namespace kvr::node
