#include "kvr/decode/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvr/common/byte_size.h"
#include "kvr/common/tls.h"

namespace kvr::decode {
namespace {

absl::Status BadValue(const std::string& value, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("'", value, "' is not ", what));
}

DecodeConfigField StringField(std::string name, std::string help, std::string DecodeConfig::*member,
                              bool allow_empty = false) {
  return {std::move(name), std::move(help),
          [member, allow_empty](DecodeConfig& c, const std::string& v) {
            if (v.empty() && !allow_empty) return absl::InvalidArgumentError("empty");
            c.*member = v;
            return absl::OkStatus();
          },
          [member](const DecodeConfig& c) { return c.*member; }};
}

template <typename T>
DecodeConfigField IntField(std::string name, std::string help, T DecodeConfig::*member,
                           bool allow_zero) {
  return {std::move(name), std::move(help),
          [member, allow_zero](DecodeConfig& c, const std::string& v) {
            T x;
            if (!absl::SimpleAtoi(v, &x) || x < 0 || (x == 0 && !allow_zero)) {
              return BadValue(v, allow_zero ? "a non-negative integer" : "a positive integer");
            }
            c.*member = x;
            return absl::OkStatus();
          },
          [member](const DecodeConfig& c) { return absl::StrCat(c.*member); }};
}

// A size in bytes, written as kvr::ParseByteSize reads it (4GiB, 4GB, 4096).
DecodeConfigField ByteSizeField(std::string name, std::string help,
                                int64_t DecodeConfig::*member, bool allow_zero) {
  return {std::move(name), std::move(help) + " (bytes; 512MiB, 4GB, ...)",
          [member, allow_zero](DecodeConfig& c, const std::string& v) {
            absl::StatusOr<uint64_t> x = ParseByteSize(v);
            if (!x.ok() || *x > static_cast<uint64_t>(INT64_MAX) || (*x == 0 && !allow_zero)) {
              return BadValue(v, allow_zero ? "a byte size (e.g. 512MiB, 4GB, 4096)"
                                            : "a positive byte size (e.g. 512MiB, 4GB, 4096)");
            }
            c.*member = static_cast<int64_t>(*x);
            return absl::OkStatus();
          },
          [member](const DecodeConfig& c) { return absl::StrCat(c.*member); }};
}

}  // namespace

const std::vector<DecodeConfigField>& DecodeConfigFields() {
  // Immutable after construction: a constant, not mutable global state.
  static const std::vector<DecodeConfigField>* const fields = new std::vector<DecodeConfigField>{
      StringField("model", "model path (.gguf, HF dir) or known name", &DecodeConfig::model),
      StringField("model_name", "name the model is served under (default: from model)",
                  &DecodeConfig::model_name, /*allow_empty=*/true),
      StringField("controller", "controller gRPC address host:port", &DecodeConfig::controller),
      StringField("listen", "gRPC listen address host:port (port 0: any free port)",
                  &DecodeConfig::listen),
      StringField("advertise_host", "host other nodes use to reach this one (default: listen host)",
                  &DecodeConfig::advertise_host, /*allow_empty=*/true),
      StringField("name", "node name in the controller's logs", &DecodeConfig::name),
      StringField("a2ats_codebooks",
                  "codebook file from `kvr calibrate` for this model: offers method a2ats "
                  "(empty: a2ats not offered)",
                  &DecodeConfig::a2ats_codebooks, /*allow_empty=*/true),
      {"device", "where the forward pass runs: cpu or cuda",
       [](DecodeConfig& c, const std::string& v) {
         if (v != "cpu" && v != "cuda") return BadValue(v, "cpu or cuda");
         c.device = v;
         return absl::OkStatus();
       },
       [](const DecodeConfig& c) { return c.device; }},
      IntField("cuda_device", "CUDA device ordinal for --device cuda", &DecodeConfig::cuda_device,
               true),
      {"gpu_method",
       "--device cuda: the retrieval method selected with GPU summaries (quest or clusterkv); "
       "other methods run in GPU lanes (gpu_lanes) or are selected on the host",
       [](DecodeConfig& c, const std::string& v) {
         // clusterkv uploads the handed-off clusters (the prefill node's k-means).
         if (v != "quest" && v != "clusterkv") {
           return BadValue(v, "quest or clusterkv (the methods of a CUDA decode node)");
         }
         c.gpu_method = v;
         return absl::OkStatus();
       },
       [](const DecodeConfig& c) { return c.gpu_method; }},
      {"gpu_lanes",
       "--device cuda: methods also selected on the GPU, from their handed-off indexes "
       "(comma-separated: exact, pariskv; empty: none; pariskv holds codes for batch_slots x "
       "gpu_max_context tokens)",
       [](DecodeConfig& c, const std::string& v) {
         std::vector<std::string> lanes;
         for (absl::string_view lane : absl::StrSplit(v, ',', absl::SkipEmpty())) {
           if (lane != "exact" && lane != "pariskv") {
             return BadValue(std::string(lane), "exact or pariskv (the GPU lanes)");
           }
           lanes.emplace_back(lane);
         }
         c.gpu_lanes = std::move(lanes);
         return absl::OkStatus();
       },
       [](const DecodeConfig& c) { return absl::StrJoin(c.gpu_lanes, ","); }},
      {"gpu_row_source",
       "--device cuda: where the GPU reads a sequence's rows: in-place (the store's pages, "
       "mapped; the store must run on this host), fetch (the missed rows over the store's data "
       "plane; any store) or auto (in place when possible, else fetched)",
       [](DecodeConfig& c, const std::string& v) {
         if (v != "in-place" && v != "fetch" && v != "auto") {
           return BadValue(v, "in-place, fetch or auto");
         }
         c.gpu_row_source = v;
         return absl::OkStatus();
       },
       [](const DecodeConfig& c) { return c.gpu_row_source; }},
      IntField("gpu_budget", "--device cuda: selected tokens per KV head and step (<= 4096)",
               &DecodeConfig::gpu_budget, false),
      IntField("gpu_n_sink", "--device cuda: sink tokens of every sequence",
               &DecodeConfig::gpu_n_sink, true),
      IntField("gpu_local_window", "--device cuda: local window of every sequence",
               &DecodeConfig::gpu_local_window, false),
      IntField("gpu_max_context",
               "--device cuda: most tokens per sequence (pinned host KV per slot; 0: the model's "
               "context length)",
               &DecodeConfig::gpu_max_context, true),
      IntField("batch_slots", "most sequences in the running batch", &DecodeConfig::batch_slots,
               false),
      IntField("max_waiting", "most sequences waiting for a slot", &DecodeConfig::max_waiting,
               true),
      ByteSizeField("hot_cache_bytes", "fetched KV rows kept for later steps (0: off)",
                    &DecodeConfig::hot_cache_bytes, true),
      ByteSizeField("memory_bytes", "memory offered for summaries and resident KV",
                    &DecodeConfig::memory_bytes, false),
      IntField("threads", "compute threads (0: all cores)", &DecodeConfig::threads, true),
      {"metrics_port", "Prometheus /metrics port (0: any free port, -1: off)",
       [](DecodeConfig& c, const std::string& v) {
         int32_t port;
         if (!absl::SimpleAtoi(v, &port) || port < -1 || port > 65535) {
           return BadValue(v, "a port number, 0 (any free port) or -1 (off)");
         }
         c.metrics_port = port;
         return absl::OkStatus();
       },
       [](const DecodeConfig& c) { return absl::StrCat(c.metrics_port); }},
      {"quality_sample_rate",
       "fraction (0..1) of decode steps per sequence and layer whose selection is compared "
       "with the exact oracle (recall, attention mass metrics); 0: off",
       [](DecodeConfig& c, const std::string& v) {
         double rate;
         // !(rate >= 0 && rate <= 1) also refuses NaN.
         if (!absl::SimpleAtod(v, &rate) || !(rate >= 0 && rate <= 1)) {
           return BadValue(v, "a fraction in [0, 1]");
         }
         c.quality_sample_rate = rate;
         return absl::OkStatus();
       },
       [](const DecodeConfig& c) { return absl::StrCat(c.quality_sample_rate); }},
      {"log_level", "trace, debug, info, warn, error",
       [](DecodeConfig& c, const std::string& v) {
         for (const char* level : {"trace", "debug", "info", "warn", "error"}) {
           if (v == level) {
             c.log_level = v;
             return absl::OkStatus();
           }
         }
         return BadValue(v, "one of trace, debug, info, warn, error");
       },
       [](const DecodeConfig& c) { return c.log_level; }},
  };
  // Every binary's TLS settings, the same three (kvr/common/tls.h).
  static const std::vector<DecodeConfigField>* const with_tls =
      AppendTlsSettingFields(new std::vector<DecodeConfigField>(*fields), &DecodeConfig::tls);
  return *with_tls;
}

absl::StatusOr<DecodeConfig> ResolveDecodeConfig(
    const DecodeConfigValues& flags, const std::optional<std::string>& config_file,
    const std::function<std::optional<std::string>(const std::string&)>& getenv) {
  DecodeConfigValues file;
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
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      bool known = false;
      for (const DecodeConfigField& f : DecodeConfigFields()) known |= f.name == key;
      if (!known || !kv.second.IsScalar()) {
        return absl::InvalidArgumentError(
            absl::StrCat("config file ", *config_file, ": ",
                         known ? "expected a scalar for " : "unknown setting ", "'", key, "'"));
      }
      file[key] = kv.second.as<std::string>();
    }
  }
  DecodeConfig config;
  for (const DecodeConfigField& f : DecodeConfigFields()) {
    std::optional<std::string> value;
    std::string source;
    const std::string env_name = absl::StrCat("KVR_DECODE_", absl::AsciiStrToUpper(f.name));
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

std::string ServedModelName(const DecodeConfig& config) {
  if (!config.model_name.empty()) return config.model_name;
  if (config.model.find('/') == std::string::npos) return config.model;
  std::filesystem::path p(config.model);
  if (p.filename().empty()) p = p.parent_path();
  return p.stem().string();
}

std::string FormatDecodeConfig(const DecodeConfig& config) {
  std::string out;
  for (const DecodeConfigField& f : DecodeConfigFields()) {
    absl::StrAppend(&out, f.name, ": ", f.get(config), "\n");
  }
  return out;
}

}  // namespace kvr::decode
