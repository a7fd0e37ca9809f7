#include "kvr/prefill_node/config.h"

#include <filesystem>

namespace kvr::prefill_node {

const node::SettingTable<PrefillConfig>& PrefillSettings() {
  using Config = PrefillConfig;
  using node::IntegerSetting;
  using node::StringSetting;
  // Immutable after construction; a function-local static is a constant, not mutable state.
  static const node::SettingTable<Config>* const table = [] {
    auto* t = new node::SettingTable<Config>{
        .program = "kvr-prefill",
        .description = "kvr-prefill: prefill node (prompt -> KV store + decode-node handoff)",
        .env_prefix = "KVR_PREFILL_",
        .settings =
            {
                node::ListenSetting<Config>(&Config::listen),
                StringSetting<Config>("controller", "controller address host:port",
                                      &Config::controller),
                StringSetting<Config>("model",
                                      "GGUF file, Hugging Face directory or known model name",
                                      &Config::model),
                StringSetting<Config>("model_name",
                                      "name the model is served under (empty: from --model)",
                                      &Config::model_name, /*allow_empty=*/true),
                StringSetting<Config>(
                    "node_name",
                    "node name it registers with (the controller's logs; with TLS, the "
                    "kvr://node/<name> its certificate carries; empty: kvr-prefill-PID)",
                    &Config::node_name, /*allow_empty=*/true),
                StringSetting<Config>(
                    "a2ats_codebooks",
                    "codebook file from `kvr calibrate` for this model: needed for "
                    "method a2ats (empty: a2ats requests are refused)",
                    &Config::a2ats_codebooks, /*allow_empty=*/true),
                node::EnumSetting<Config>("device", "where the forward pass runs", &Config::device,
                                          {"cpu", "cuda"}),
                node::EnumSetting<Config>(
                    "store_dtype",
                    "element type of the rows put to the KV store (empty: bf16 "
                    "with --device cuda, f32 with --device cpu); fp8: scaled e4m3 rows "
                    "the store encodes from bf16, about half a bf16 row's bytes in the "
                    "store and on every fetch, at a small quality cost (BENCHMARKS.md, "
                    "\"fp8 rows: quality cost against bf16\")",
                    &Config::store_dtype, {"f32", "bf16", "fp8"},
                    /*allow_empty=*/true),
                IntegerSetting<Config>("cuda_device", "CUDA device ordinal for --device cuda",
                                       &Config::cuda_device, 0),
                node::BoolSetting<Config>("gpu_summaries",
                                          "--device cuda: build quest and clusterkv summaries on "
                                          "the GPU (false: on the CPU)",
                                          &Config::gpu_summaries),
                node::BoolSetting<Config>("extend_summaries",
                                          "keep retained requests' retrieval summaries in the "
                                          "store and extend a reused prefix's by Append (false: "
                                          "rebuild them over the whole prompt)",
                                          &Config::extend_summaries),
                IntegerSetting<Config>("threads", "model threads (0: all cores)", &Config::threads,
                                       0),
                IntegerSetting<Config>("chunk_tokens", "prompt tokens per forward chunk",
                                       &Config::chunk_tokens, 1),
                IntegerSetting<Config>("max_prefill_queries",
                                       "last prefill queries per layer given to the index",
                                       &Config::max_prefill_queries, 1),
                IntegerSetting<Config>("max_queued_prefill_tokens",
                                       "advertised queue limit in tokens (0: none)",
                                       &Config::max_queued_prefill_tokens, 0),
                node::MetricsPortSetting<Config>(&Config::metrics_port),
                node::HealthAddressSetting<Config>(&Config::health_address),
                node::SecondsSetting<Config>("store_timeout_seconds",
                                             "budget of each KV-store call",
                                             &Config::store_timeout_seconds),
                node::LogLevelSetting<Config>(&Config::log_level),
            },
        // The model's KV dtype unless told otherwise (so the effective config shows the choice).
        .finish =
            [](Config& c) {
              if (c.store_dtype.empty()) c.store_dtype = c.device == "cuda" ? "bf16" : "f32";
              return absl::OkStatus();
            },
    };
    for (node::Setting<Config>& s : node::TlsSettings<Config>(&Config::tls)) {
      t->settings.push_back(std::move(s));
    }
    return t;
  }();
  return *table;
}

kv_store::DType StoreDType(const PrefillConfig& config) {
  if (config.store_dtype == "bf16") return kv_store::DType::kBf16;
  if (config.store_dtype == "fp8") return kv_store::DType::kFp8E4m3;
  return kv_store::DType::kF32;
}

std::string ServedModelName(const PrefillConfig& config) {
  if (!config.model_name.empty()) return config.model_name;
  if (config.model.find('/') == std::string::npos) return config.model;
  std::filesystem::path p(config.model);
  if (p.filename().empty()) p = p.parent_path();
  return p.stem().string();
}

}  // namespace kvr::prefill_node
