// kvr-decode: the decode node. Serves kvr.cluster.v1.DecodeService (the logic lives in
// DecodeEngine; service.cc is the gRPC shell), grpc.health.v1.Health and server reflection;
// registers with the controller and heartbeats its load until SIGTERM/SIGINT, then
// deregisters.

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/common/metrics.h"
#include "kvr/common/thread_pool.h"
#include "kvr/common/tls.h"
#include "kvr/decode/config.h"
#include "kvr/decode/cuda_backend.h"
#include "kvr/decode/engine.h"
#include "kvr/decode/metrics_observer.h"
#include "kvr/decode/service.h"
#include "kvr/kv_store/types.h"
#include "kvr/model/loader.h"
#include "kvr/node/run.h"
#include "kvr/node/serving_model.h"
#include "kvr/node/worker.h"
#include "kvr/retrieval/model_shape.h"
#include "spdlog/spdlog.h"

namespace kvr::decode {
namespace {

namespace cv1 = ::kvr::cluster::v1;

// Summary bytes per context token of each method (all layers and KV heads), measured on one
// layer's index over random keys/queries of `tokens` tokens: what the controller reserves per
// token on this node. Methods that cannot be built without extra assets (A2ATS codebooks) are
// left out (and so not offered).
std::vector<std::pair<std::string, double>> MeasureSummaryBytes(
    const model::ModelConfig& c, const retrieval::MethodRegistry& registry, int64_t tokens,
    const std::shared_ptr<const retrieval::MethodAssets>& assets) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> keys(tokens * c.n_kv_heads * c.head_dim),
      queries(512 * c.n_heads * c.head_dim);
  for (float& x : keys) x = nd(rng);
  for (float& x : queries) x = nd(rng);
  std::vector<std::pair<std::string, double>> out;
  for (const std::string& method : registry.Names()) {
    const retrieval::IndexShape shape = retrieval::IndexShapeOf(c, 0);
    retrieval::IndexParams params;
    params.assets = assets;
    auto index = registry.Make(method, shape, params);
    absl::Status built = index.status();
    if (index.ok()) {
      retrieval::BuildInput in;
      in.keys = {keys.data(), tokens, int64_t{c.n_kv_heads} * c.head_dim};
      in.queries = {queries.data(), 512, int64_t{c.n_heads} * c.head_dim};
      in.queries_first_position = tokens - 512;
      built = (*index)->Build(in);
    }
    if (!built.ok()) {
      spdlog::warn("method {} not offered: {}", method, built.ToString());
      continue;
    }
    out.emplace_back(method, static_cast<double>((*index)->MemoryBytes()) * c.n_layers / tokens);
  }
  return out;
}

int Serve(const DecodeConfig& config) {
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  node::ShutdownSignals signals;  // before any thread starts

  ThreadPool pool(config.threads);
  int exit_code = 0;
  std::optional<node::ServingModel> serving = node::LoadServingModelOrExit(
      "kvr-decode", config.model, config.device, config.a2ats_codebooks, &pool, &exit_code);
  if (!serving) return exit_code;
  const model::LoadedModel& loaded = serving->loaded;
  const std::shared_ptr<const retrieval::MethodAssets>& a2ats_assets = serving->a2ats_assets;
  const model::ModelConfig& mc = loaded.model->config();
  const std::string served = ServedModelName(config);
  spdlog::info("serving {} as '{}' ({} layers, {}/{} heads, context {})", loaded.source, served,
               mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.context_length);
  auto methods = MeasureSummaryBytes(mc, serving->methods, 2048, a2ats_assets);
  if (config.device == "cuda" &&
      std::none_of(methods.begin(), methods.end(),
                   [&](const auto& m) { return m.first == config.gpu_method; })) {
    // A CUDA node selects gpu_method on the GPU and the other methods on the host: it offers
    // them all, but gpu_method must be one of them.
    std::cerr << "kvr-decode: gpu_method '" << config.gpu_method << "' cannot be offered\n";
    return 2;
  }

  const std::optional<GrpcSecurity> security = node::LoadSecurityOrReport("kvr-decode", config.tls);
  if (!security) return 2;
  spdlog::info("gRPC: {}", security->Describe());
  kv_store::UcxClientOptions store_options;
  store_options.name = "kvr-decode";
  store_options.security = *security;
  store_options.rma_reads = config.store_rma_reads;
  // A handoff naming a store that just died must not wait for it to come back.
  store_options.connect_timeout = absl::Seconds(2);
  StoreClients stores = kv_store::UcxStoreClientCache(std::move(store_options));
  // Metrics (kvr/common/metrics.h): declared before the engine, which reports to them.
  const std::string listen_host = node::HostOf(config.listen);
  absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> metrics_server =
      node::StartMetricsServer(config.listen, config.metrics_port, "decode", config.name);
  if (!metrics_server.ok()) {
    std::cerr << "kvr-decode: " << metrics_server.status() << "\n";
    return 1;
  }
  if ((*metrics_server)->serving()) {
    node::PrintLine(
        absl::StrCat("kvr-decode metrics on ", listen_host, ":", (*metrics_server)->port()));
  }
  metrics::DecodeMetrics decode_metrics((*metrics_server)->registry());
  DecodeMetricsObserver metrics_observer(&decode_metrics, served);
  // The forward pass's backend (--device): with cuda the weights go to the GPU once, here, so
  // that a node that cannot use its GPU fails at start rather than on its first request.
  absl::StatusOr<std::unique_ptr<DecodeBackend>> backend = MakeDecodeBackend(
      config, loaded.model.get(), &serving->methods, a2ats_assets, &metrics_observer);
  if (!backend.ok()) {
    std::cerr << "kvr-decode: " << backend.status().message() << "\n";
    return 2;
  }
  spdlog::info("decode backend {}", (*backend)->name());
  absl::StatusOr<std::unique_ptr<DecodeEngine>> engine =
      DecodeEngine::Create(*std::move(backend), loaded.tokenizer ? &*loaded.tokenizer : nullptr,
                           EngineOptions{.model_name = served,
                                         .batch_slots = static_cast<int>(config.batch_slots),
                                         .max_waiting = static_cast<int>(config.max_waiting),
                                         // hot_cache_bytes, quality_sample_rate, method_assets: the
                                         // backend's (MakeDecodeBackend above), not the engine's.
                                         .memory_bytes = config.memory_bytes},
                           &metrics_observer);
  if (!engine.ok()) {
    std::cerr << "kvr-decode: " << engine.status() << "\n";
    return 1;
  }
  (*engine)->Start();
  DecodeServiceImpl service(engine->get(), &stores);

  absl::StatusOr<node::WorkerServer> worker =
      node::StartWorkerServer({.program = "kvr-decode",
                               .listen = config.listen,
                               .advertise_host = config.advertise_host,
                               .security = *security,
                               .service = &service,
                               .health_address = config.health_address});
  if (!worker.ok()) return node::ReportStartFailure("kvr-decode", worker.status());

  cv1::RegisterRequest registration = node::WorkerRegistration(
      cv1::NODE_ROLE_DECODE,
      config.name.empty() ? absl::StrCat("kvr-decode-", getpid()) : config.name, worker->address,
      (*metrics_server)->port());
  // Read in place, a CUDA node's rows must be in a store of its host; fetched, any store will do.
  registration.set_needs_local_store(config.device == "cuda" &&
                                     config.gpu_row_source == "in-place");
  cv1::Capacity* capacity = registration.mutable_capacity();
  capacity->set_memory_bytes(static_cast<uint64_t>(config.memory_bytes));
  capacity->set_batch_slots(config.batch_slots);
  cv1::ModelInfo* info = capacity->add_models();
  info->set_name(served);
  info->set_context_length(static_cast<uint32_t>(mc.context_length));
  // Store bytes per token in the row dtype this node reads: on cuda its gpu_row_format (bf16,
  // what a cuda prefill node writes by default, or fp8), f32 on cpu. The rows of a sequence are
  // in whatever dtype its prefill node chose; the CPU path reads every dtype.
  const kv_store::DType row_dtype = config.device != "cuda"          ? kv_store::DType::kF32
                                    : config.gpu_row_format == "fp8" ? kv_store::DType::kFp8E4m3
                                                                     : kv_store::DType::kBf16;
  info->set_kv_bytes_per_token(static_cast<uint64_t>(mc.n_layers) * mc.n_kv_heads *
                               kv_store::RowBytes(row_dtype, static_cast<uint32_t>(mc.head_dim)));
  for (const auto& [name, bytes] : methods) {
    cv1::RetrievalMethodInfo* m = info->add_retrieval_methods();
    m->set_name(name);
    m->set_summary_bytes_per_token(bytes);
    spdlog::info("method {}: {:.1f} summary bytes per token", name, bytes);
  }
  node::ServeUntilSignal(
      "kvr-decode", signals, *worker->server,
      {.controller = config.controller,
       .registration = std::move(registration),
       .load =
           [engine = engine->get()] {
             cv1::NodeLoad load;
             load.set_running_sequences(static_cast<uint32_t>(engine->running_sequences()));
             load.set_free_memory_bytes(static_cast<uint64_t>(engine->free_memory_bytes()));
             return load;
           },
       .security = *security});
  engine->reset();  // stops the loop, releases what is left in the stores
  return 0;
}

}  // namespace
}  // namespace kvr::decode

int main(int argc, char** argv) {
  return kvr::node::ServeMain(kvr::decode::DecodeSettings(), argc, argv, &kvr::decode::Serve);
}
