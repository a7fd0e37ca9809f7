#include "kvr/prefill_node/config.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/tls.h"

namespace kvr::prefill_node {
namespace {

absl::Status BadValue(const std::string& value, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("'", value, "' is not ", what));
}

PrefillConfigField StringField(std::string name, std::string help,
                               std::string PrefillConfig::*member, bool allow_empty = false) {
  return {std::move(name), std::move(help),
          [member, allow_empty](PrefillConfig& c, const std::string& v) {
            if (v.empty() && !allow_empty) return absl::InvalidArgumentError("empty");
            c.*member = v;
            return absl::OkStatus();
          },
          [member](const PrefillConfig& c) { return c.*member; }};
}

PrefillConfigField UintField(std::string name, std::string help, uint32_t PrefillConfig::*member,
                             bool allow_zero) {
  return {std::move(name), std::move(help),
          [member, allow_zero](PrefillConfig& c, const std::string& v) {
            uint32_t x;
            if (!absl::SimpleAtoi(v, &x) || (x == 0 && !allow_zero)) {
              return BadValue(v, allow_zero ? "a non-negative integer" : "a positive integer");
            }
            c.*member = x;
            return absl::OkStatus();
          },
          [member](const PrefillConfig& c) { return absl::StrCat(c.*member); }};
}

}  // namespace

const std::vector<PrefillConfigField>& PrefillConfigFields() {
  // Immutable after construction: a constant, not mutable global state.
  static const std::vector<PrefillConfigField>* const fields = new std::vector<PrefillConfigField>{
      StringField("listen", "gRPC listen address host:port (port 0: any free port)",
                  &PrefillConfig::listen),
      StringField("controller", "controller address host:port", &PrefillConfig::controller),
      StringField("model", "GGUF file, Hugging Face directory or known model name",
                  &PrefillConfig::model),
      StringField("model_name", "name the model is served under (default: from --model)",
                  &PrefillConfig::model_name, true),
      StringField("node_name", "node name for the controller's logs", &PrefillConfig::node_name,
                  true),
      StringField("a2ats_codebooks",
                  "codebook file from `kvr calibrate` for this model: needed for method a2ats "
                  "(empty: a2ats requests are refused)",
                  &PrefillConfig::a2ats_codebooks, true),
      {"device", "where the forward pass runs: cpu or cuda",
       [](PrefillConfig& c, const std::string& v) {
         if (v != "cpu" && v != "cuda") return BadValue(v, "cpu or cuda");
         c.device = v;
         return absl::OkStatus();
       },
       [](const PrefillConfig& c) { return c.device; }},
      {"store_dtype",
       "element type of the rows put to the KV store: f32 or bf16 (default: bf16 with "
       "--device cuda, f32 with --device cpu)",
       [](PrefillConfig& c, const std::string& v) {
         if (v != "f32" && v != "bf16") return BadValue(v, "f32 or bf16");
         c.store_dtype = v;
         return absl::OkStatus();
       },
       [](const PrefillConfig& c) { return c.store_dtype; }},
      UintField("cuda_device", "CUDA device ordinal for --device cuda", &PrefillConfig::cuda_device,
                true),
      {"gpu_summaries",
       "--device cuda: build quest and clusterkv summaries on the GPU (false: on the CPU)",
       [](PrefillConfig& c, const std::string& v) {
         if (v == "true" || v == "1") {
           c.gpu_summaries = true;
         } else if (v == "false" || v == "0") {
           c.gpu_summaries = false;
         } else {
           return BadValue(v, "true or false");
         }
         return absl::OkStatus();
       },
       [](const PrefillConfig& c) { return std::string(c.gpu_summaries ? "true" : "false"); }},
      UintField("threads", "model threads (0 = all cores)", &PrefillConfig::threads, true),
      UintField("chunk_tokens", "prompt tokens per forward chunk", &PrefillConfig::chunk_tokens,
                false),
      UintField("max_prefill_queries", "last prefill queries per layer given to the index",
                &PrefillConfig::max_prefill_queries, false),
      UintField("max_queued_prefill_tokens", "advertised queue limit in tokens (0 = none)",
                &PrefillConfig::max_queued_prefill_tokens, true),
      {"metrics_port", "Prometheus /metrics port (0: any free port, -1: off)",
       [](PrefillConfig& c, const std::string& v) {
         int32_t port;
         if (!absl::SimpleAtoi(v, &port) || port < -1 || port > 65535) {
           return BadValue(v, "a port number, 0 (any free port) or -1 (off)");
         }
         c.metrics_port = port;
         return absl::OkStatus();
       },
       [](const PrefillConfig& c) { return absl::StrCat(c.metrics_port); }},
      {"store_timeout_seconds", "budget of each KV-store call",
       [](PrefillConfig& c, const std::string& v) {
         double x;
         if (!absl::SimpleAtod(v, &x) || !std::isfinite(x) || x <= 0) {
           return BadValue(v, "a positive number of seconds");
         }
         c.store_timeout_seconds = x;
         return absl::OkStatus();
       },
       [](const PrefillConfig& c) { return absl::StrCat(c.store_timeout_seconds); }},
      {"log_level", "trace, debug, info, warn, error",
       [](PrefillConfig& c, const std::string& v) {
         for (const char* level : {"trace", "debug", "info", "warn", "error"}) {
           if (v == level) {
             c.log_level = v;
             return absl::OkStatus();
           }
         }
         return BadValue(v, "one of trace, debug, info, warn, error");
       },
       [](const PrefillConfig& c) { return c.log_level; }},
  };
  // Every binary's TLS settings, the same three (kvr/common/tls.h).
  static const std::vector<PrefillConfigField>* const with_tls =
      AppendTlsSettingFields(new std::vector<PrefillConfigField>(*fields), &PrefillConfig::tls);
  return *with_tls;
}

absl::StatusOr<PrefillConfig> ResolvePrefillConfig(
    const ConfigValues& flags, const std::optional<std::string>& config_file,
    const std::function<std::optional<std::string>(const std::string&)>& getenv) {
  ConfigValues file;
  if (config_file) {
    YAML::Node root;
    try {
      root = YAML::LoadFile(*config_file);
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", *config_file, ": ", e.what()));
    }
    if (!root.IsNull() && !root.IsMap()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config file ", *config_file, ": expected a map of setting: value"));
    }
    if (root.IsMap()) {
      for (const auto& kv : root) {
        const std::string key = kv.first.as<std::string>();
        bool known = false;
        for (const PrefillConfigField& f : PrefillConfigFields()) known |= f.name == key;
        if (!known || !kv.second.IsScalar()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "config file ", *config_file, ": ",
              known ? "expected a scalar value for '" : "unknown setting '", key, "'"));
        }
        file[key] = kv.second.as<std::string>();
      }
    }
  }
  PrefillConfig config;
  for (const PrefillConfigField& f : PrefillConfigFields()) {
    std::optional<std::string> value;
    std::string source;
    if (auto it = flags.find(f.name); it != flags.end()) {
      value = it->second;
      source = absl::StrCat("flag --", f.name);
    } else if (auto it = file.find(f.name); it != file.end()) {
      value = it->second;
      source = absl::StrCat("config file key ", f.name);
    } else {
      const std::string env = absl::StrCat("KVR_PREFILL_", absl::AsciiStrToUpper(f.name));
      value = getenv(env);
      source = absl::StrCat("environment variable ", env);
    }
    if (!value) continue;
    if (absl::Status s = f.set(config, *value); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(f.name, " (", source, "): ", s.message()));
    }
  }
  // The model's KV dtype unless told otherwise (so the effective config shows the choice).
  if (config.store_dtype.empty()) config.store_dtype = config.device == "cuda" ? "bf16" : "f32";
  return config;
}

std::string FormatPrefillConfig(const PrefillConfig& config) {
  std::string out;
  for (const PrefillConfigField& f : PrefillConfigFields()) {
    absl::StrAppend(&out, f.name, ": \"", f.get(config), "\"\n");
  }
  return out;
}

kv_store::DType StoreDType(const PrefillConfig& config) {
  return config.store_dtype == "bf16" ? kv_store::DType::kBf16 : kv_store::DType::kF32;
}

std::string ServedModelName(const PrefillConfig& config) {
  if (!config.model_name.empty()) return config.model_name;
  if (config.model.find('/') == std::string::npos) return config.model;
  std::filesystem::path p(config.model);
  if (p.filename().empty()) p = p.parent_path();
  return p.stem().string();
}

}  // namespace kvr::prefill_node
