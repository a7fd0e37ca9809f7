#pragma once
// Configuration of kvr-prefill: its table of settings for the node settings mechanism
// (kvr/node/settings.h), read from flags, a --config YAML file and KVR_PREFILL_* environment
// variables, with precedence flag > file > env > default. Each setting has one name in three
// spellings: flag --chunk-tokens, YAML key chunk_tokens, environment variable
// KVR_PREFILL_CHUNK_TOKENS.

#include <cstdint>
#include <string>

#include "kvr/common/tls.h"
#include "kvr/kv_store/types.h"
#include "kvr/node/settings.h"

namespace kvr::prefill_node {

struct PrefillConfig {
  // host:port of the gRPC server; port 0 picks a free port (printed at start).
  std::string listen = "127.0.0.1:0";
  // The controller's host:port (Membership).
  std::string controller = "127.0.0.1:50051";
  // GGUF file, Hugging Face directory or known name (model/loader.h).
  std::string model = "smollm2-135m-instruct";
  // Name the model is served under (GenerateRequest.model); empty: the --model value when it is
  // a name, else the file or folder name without extension.
  std::string model_name;
  // Name in the controller's logs; empty: kvr-prefill-<pid>.
  std::string node_name;
  uint32_t threads = 0;  // model threads, 0 = all cores
  uint32_t chunk_tokens = 512;
  uint32_t max_prefill_queries = 512;
  // Most prompt tokens queued or running before the controller stops placing here (0 = no
  // limit), advertised in Capacity.max_queued_prefill_tokens.
  uint32_t max_queued_prefill_tokens = 0;
  double store_timeout_seconds = 30;
  std::string log_level = "info";
  // Prometheus /metrics port on the listen host: 0 any free port (printed), -1 off.
  int32_t metrics_port = 0;
  // host:port of the plaintext health-only port (kvr/node/health.h); empty: none.
  std::string health_address;
  // Where the forward pass runs: "cpu" (model::Model) or "cuda" (model::CudaModel on GPU
  // cuda_device; the weights are loaded on the host, then uploaded once as bf16).
  std::string device = "cpu";
  // Element type of the rows put to the KV store: "f32", "bf16" or "fp8". Unset, it follows the
  // device (the table's finish step fills it in): bf16 on cuda (the GPU model's KV is bf16, so
  // nothing is lost and the rows are half the bytes), f32 on cpu (the CPU model runs in f32).
  // "fp8" (kv_store::DType::kFp8E4m3): the node puts bf16 rows and the store encodes them as
  // scaled e4m3 rows (kvr/common/fp8.h), 136 bytes per (token, KV head) at head_dim 64 instead
  // of 256 in bf16: half the store's memory and the decode's fetched bytes, for a small quality
  // cost (BENCHMARKS.md, "fp8 rows: quality cost against bf16").
  std::string store_dtype;
  uint32_t cuda_device = 0;
  // --device cuda: build quest and clusterkv summaries on the GPU during prefill (layer by
  // layer, on a second stream) and ship them as the CPU index's bytes; false: every method's
  // index is built on the CPU from the exported rows (as --device cpu does).
  bool gpu_summaries = true;
  // Keep retained requests' retrieval summaries with their store sequence and extend a reused
  // prefix's by Append (summary_snapshot.h); false: rebuild them over the whole prompt.
  bool extend_summaries = true;
  // `kvr calibrate` codebook file for this model: needed to build method a2ats's summaries
  // (empty: a2ats requests fail with INVALID_ARGUMENT naming the missing codebooks).
  std::string a2ats_codebooks;
  // Transport security of the gRPC port and of this process's channels (kvr/common/tls.h).
  TlsConfig tls;
};

const node::SettingTable<PrefillConfig>& PrefillSettings();

// The store row dtype of a resolved config (PrefillConfig::store_dtype).
[[nodiscard]] kv_store::DType StoreDType(const PrefillConfig& config);

// The served model name for `config` (see PrefillConfig::model_name).
std::string ServedModelName(const PrefillConfig& config);

}  // namespace kvr::prefill_node
