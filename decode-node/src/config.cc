#include "kvr/decode/config.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvr/retrieval/cuda/sparse_decode.h"

namespace kvr::decode {
namespace {

using Config = DecodeConfig;

// gpu_lanes: a comma-separated list of the GPU lanes (empty: none).
node::Setting<Config> GpuLanesSetting() {
  return {node::SettingSpec{.name = "gpu_lanes",
                            .help = "--device cuda: methods also selected on the GPU, from their "
                                    "handed-off indexes (comma-separated: exact, pariskv, "
                                    "keydiff, a2ats, ctkvr; empty: none; pariskv, keydiff and "
                                    "a2ats hold state for batch_slots x gpu_max_context tokens, "
                                    "ctkvr its qcIVF per sequence)",
                            .type = node::SettingType::kString,
                            .allow_empty_or_zero = true},
          [](Config& c, const node::SettingValue& value) {
            std::vector<std::string> lanes;
            for (absl::string_view lane :
                 absl::StrSplit(std::get<std::string>(value), ',', absl::SkipEmpty())) {
              if (!retrieval::cuda::IsGpuLaneMethod(std::string_view(lane.data(), lane.size()))) {
                return absl::InvalidArgumentError(
                    absl::StrCat("'", lane, "' is not a GPU lane (",
                                 retrieval::cuda::GpuLaneMethodList(), ")"));
              }
              lanes.emplace_back(lane);
            }
            c.gpu_lanes = std::move(lanes);
            return absl::OkStatus();
          },
          [](const Config& c) { return node::SettingValue(absl::StrJoin(c.gpu_lanes, ",")); }};
}

}  // namespace

const node::SettingTable<DecodeConfig>& DecodeSettings() {
  using node::ByteSizeSetting;
  using node::EnumSetting;
  using node::IntegerSetting;
  using node::StringSetting;
  // Immutable after construction; a function-local static is a constant, not mutable state.
  static const node::SettingTable<Config>* const table = [] {
    auto* t = new node::SettingTable<Config>{
        .program = "kvr-decode",
        .description = "kvr-decode: decode node (continuous batching over retrieved KV)",
        .env_prefix = "KVR_DECODE_",
        .settings =
            {
                StringSetting<Config>("model", "model path (.gguf, HF dir) or known name",
                                      &Config::model),
                StringSetting<Config>("model_name",
                                      "name the model is served under (empty: from model)",
                                      &Config::model_name, /*allow_empty=*/true),
                StringSetting<Config>("controller", "controller gRPC address host:port",
                                      &Config::controller),
                node::ListenSetting<Config>(&Config::listen),
                StringSetting<Config>("advertise_host",
                                      "host other nodes use to reach this one (empty: the listen "
                                      "host)",
                                      &Config::advertise_host, /*allow_empty=*/true),
                StringSetting<Config>("name",
                                      "node name it registers with (the controller's logs; with "
                                      "TLS, the kvr://node/<name> its certificate carries)",
                                      &Config::name),
                StringSetting<Config>("a2ats_codebooks",
                                      "codebook file from `kvr calibrate` for this model: offers "
                                      "method a2ats (empty: a2ats not offered)",
                                      &Config::a2ats_codebooks, /*allow_empty=*/true),
                EnumSetting<Config>("device", "where the forward pass runs", &Config::device,
                                    {"cpu", "cuda"}),
                IntegerSetting<Config>("cuda_device", "CUDA device ordinal for --device cuda",
                                       &Config::cuda_device, 0),
                // clusterkv uploads the handed-off clusters (the prefill node's k-means).
                EnumSetting<Config>("gpu_method",
                                    "--device cuda: the retrieval method selected with GPU "
                                    "summaries; other methods run in GPU lanes (gpu_lanes) or are "
                                    "selected on the host",
                                    &Config::gpu_method, {"quest", "clusterkv"}),
                GpuLanesSetting(),
                EnumSetting<Config>(
                    "gpu_row_source",
                    "--device cuda: where the GPU reads a sequence's rows: in-place (the store's "
                    "pages, mapped; the store must run on this host), fetch (the missed rows over "
                    "the store's data plane; any store) or auto (in place when possible, else "
                    "fetched)",
                    &Config::gpu_row_source, {"in-place", "fetch", "auto"}),
                EnumSetting<Config>(
                    "gpu_row_format",
                    "--device cuda: the store dtype of the rows read in place (the prefill "
                    "nodes' store_dtype): bf16, or fp8 (half the bytes per row over the link or "
                    "the network and in the hot cache, a small quality cost; no gpu_lanes)",
                    &Config::gpu_row_format, {"bf16", "fp8"}),
                node::BoolSetting<Config>(
                    "store_rma_reads",
                    "read rows from a store by RMA gets from its pool where it offers its rkey "
                    "(kvr-store --rma-reads) and the transport has native RMA (shared memory, "
                    "RDMA): the store only locates them; the rkey reads the whole pool, so only "
                    "among trusted nodes",
                    &Config::store_rma_reads),
                IntegerSetting<Config>(
                    "gpu_budget", "--device cuda: selected tokens per KV head and step (<= 4096)",
                    &Config::gpu_budget, 1),
                IntegerSetting<Config>("gpu_n_sink", "--device cuda: sink tokens of every sequence",
                                       &Config::gpu_n_sink, 0),
                IntegerSetting<Config>("gpu_local_window",
                                       "--device cuda: local window of every sequence",
                                       &Config::gpu_local_window, 1),
                IntegerSetting<Config>(
                    "gpu_max_context",
                    "--device cuda: most tokens per sequence (pinned host KV per "
                    "slot; 0: the model's context length)",
                    &Config::gpu_max_context, 0),
                IntegerSetting<Config>(
                    "gpu_dense_max_tokens",
                    "--device cuda: sequences of at most this many tokens (prompt + max_tokens) "
                    "run densely, their KV in HBM, where sparse decoding would not be faster "
                    "(0: only method full runs densely)",
                    &Config::gpu_dense_max_tokens, 0),
                ByteSizeSetting<Config>("gpu_dense_bytes",
                                        "--device cuda: HBM for the KV of the sequences run "
                                        "densely, together (0: none run densely)",
                                        &Config::gpu_dense_bytes, /*allow_zero=*/true),
                IntegerSetting<Config>("batch_slots", "most sequences in the running batch",
                                       &Config::batch_slots, 1),
                IntegerSetting<Config>("max_waiting", "most sequences waiting for a slot",
                                       &Config::max_waiting, 0),
                ByteSizeSetting<Config>("hot_cache_bytes",
                                        "fetched KV rows kept for later steps (0: off)",
                                        &Config::hot_cache_bytes, /*allow_zero=*/true),
                node::NumberSetting<Config>(
                    "gpu_hot_cache_fraction",
                    "--device cuda: fraction (0..1) of the GPU memory still free after the "
                    "weights and the sparse state that the hot cache also takes (up to "
                    "gpu_max_context rows per slot, layer and KV head; 0: hot_cache_bytes only; "
                    "leave room for other processes on the same GPU)",
                    &Config::gpu_hot_cache_fraction, 0, 1),
                ByteSizeSetting<Config>("memory_bytes",
                                        "memory offered for summaries and resident KV",
                                        &Config::memory_bytes),
                IntegerSetting<Config>("threads", "compute threads (0: all cores)",
                                       &Config::threads, 0),
                node::MetricsPortSetting<Config>(&Config::metrics_port),
                node::HealthAddressSetting<Config>(&Config::health_address),
                node::NumberSetting<Config>(
                    "quality_sample_rate",
                    "fraction (0..1) of decode steps per sequence and layer whose selection is "
                    "compared with the exact oracle (recall, attention mass metrics); 0: off",
                    &Config::quality_sample_rate, 0, 1),
                node::LogLevelSetting<Config>(&Config::log_level),
            },
    };
    for (node::Setting<Config>& s : node::TlsSettings<Config>(&Config::tls)) {
      t->settings.push_back(std::move(s));
    }
    return t;
  }();
  return *table;
}

std::string ServedModelName(const DecodeConfig& config) {
  if (!config.model_name.empty()) return config.model_name;
  if (config.model.find('/') == std::string::npos) return config.model;
  std::filesystem::path p(config.model);
  if (p.filename().empty()) p = p.parent_path();
  return p.stem().string();
}

}  // namespace kvr::decode
