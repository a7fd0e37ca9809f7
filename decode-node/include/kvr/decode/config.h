#pragma once
// Configuration of kvr-decode: its table of settings for the node settings mechanism
// (kvr/node/settings.h), read from flags, a --config YAML file and KVR_DECODE_* environment
// variables, with precedence flag > file > env > default. Each setting has one name in three
// spellings: flag --batch-slots, YAML key batch_slots, environment variable
// KVR_DECODE_BATCH_SLOTS.

#include <cstdint>
#include <string>
#include <vector>

#include "kvr/common/tls.h"
#include "kvr/node/settings.h"

namespace kvr::decode {

struct DecodeConfig {
  std::string model = "smollm2-135m-instruct";  // path or known name (model/loader.h)
  std::string model_name;  // name the model is served under; empty: from `model`
  std::string controller = "127.0.0.1:50051";  // the controller's gRPC address
  std::string listen = "127.0.0.1:0";          // gRPC listen address (port 0: any free port)
  std::string advertise_host;  // host other nodes reach this one at; empty: the listen host
  std::string name = "kvr-decode";
  uint32_t batch_slots = 8;
  uint32_t max_waiting = 64;
  int64_t hot_cache_bytes = 256ll << 20;
  double gpu_hot_cache_fraction = 0;  // CudaDecodeBackendOptions::hot_cache_fraction
  int64_t memory_bytes = 4ll << 30;
  uint32_t threads = 0;  // compute threads; 0: all cores
  std::string log_level = "info";
  // Prometheus /metrics port on the listen host: 0 any free port (printed), -1 off.
  int32_t metrics_port = 0;
  // host:port of the plaintext health-only port (kvr/node/health.h); empty: none.
  std::string health_address;
  // Fraction of (step, sequence, layer) whose selection is compared with the exact oracle
  // (kvr_retrieval_recall / kvr_retrieval_attention_mass); 0 off. Each sample reads all the
  // candidate rows' keys from the store (README.md: cost).
  double quality_sample_rate = 0;
  // `kvr calibrate` codebook file for this model: offers method a2ats (empty: not offered).
  std::string a2ats_codebooks;
  // Where the forward pass runs: "cpu" (model::Model + DecodeAttention) or "cuda"
  // (model::CudaModel sparse sequences on GPU cuda_device; cuda_backend.h). A CUDA node runs ONE
  // GPU method, budget, sink and window for all its sequences (gpu_*): it selects gpu_method on
  // the GPU and every other method of its registry on the host, and refuses requests with a
  // bigger budget or another sink/window.
  std::string device = "cpu";
  uint32_t cuda_device = 0;
  std::string gpu_method = "quest";
  std::vector<std::string> gpu_lanes;  // methods also selected on the GPU (kGpuLaneMethods)
  // Where the GPU reads a sequence's rows: "in-place" (the store's pool mapped and read over
  // PCIe; needs a store on this host, so the controller places only such stores), "fetch" (the
  // missed rows fetched through the store's data plane, any store), "auto" (in place when the
  // store is on this host, else fetched).
  std::string gpu_row_source = "in-place";
  // --device cuda: the store dtype of the rows this node reads in place, "bf16" or "fp8" (its
  // prefill nodes' store_dtype): CudaDecodeBackendOptions::row_format.
  std::string gpu_row_format = "bf16";
  // Rows read from a store (fetched misses, prefixes) by RMA gets from its pool where the store
  // hands out its rkey (kvr-store --rma-reads) and the transport has native RMA: the store only
  // locates the rows, no store CPU in the copy. Off: every read is a request the store answers.
  bool store_rma_reads = false;
  uint32_t gpu_budget = 1024;  // selected tokens per KV head and step
  // The controller's defaults for requests that set none (controller/src/config.cc:
  // default_n_sink, default_local_window), so that `kvr up --device cuda` serves them as is.
  uint32_t gpu_n_sink = 64;
  uint32_t gpu_local_window = 512;
  // Most tokens (prompt + generated) per sequence: sizes each slot's pinned host KV and
  // summaries; 0: the model's context length.
  uint32_t gpu_max_context = 0;
  // Dense when it pays (CudaDecodeBackendOptions::dense_*): sequences of at most this many
  // tokens (prompt + max_tokens), and `full` requests, run densely with their KV in HBM, up to
  // gpu_dense_bytes together. Measured on the H100 with SmolLM2 at budget 1024: sparse is
  // 0.46x dense at 8K, 0.91x at 16K (before the last attention kernel change), 1.93x at 32K
  // (BENCHMARKS.md).
  uint32_t gpu_dense_max_tokens = 16384;
  int64_t gpu_dense_bytes = 2ll << 30;
  // Transport security of the gRPC port and of this process's channels (kvr/common/tls.h).
  TlsConfig tls;
};

const node::SettingTable<DecodeConfig>& DecodeSettings();

// The served model name: model_name, else `model` when it is a name, else the file stem.
std::string ServedModelName(const DecodeConfig& config);

}  // namespace kvr::decode
