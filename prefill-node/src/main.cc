// kvr-prefill: the prefill node. Serves kvr.cluster.v1.PrefillService (the logic lives in
// PrefillEngine; this file is the gRPC shell), grpc.health.v1.Health and server reflection;
// registers with the controller and heartbeats until SIGTERM/SIGINT, then deregisters.

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvr/cluster/v1/cluster.grpc.pb.h"
#include "kvr/common/metrics.h"
#include "kvr/common/thread_pool.h"
#include "kvr/common/tls.h"
#include "kvr/model/loader.h"
#include "kvr/node/run.h"
#include "kvr/node/serving_model.h"
#include "kvr/node/worker.h"
#include "kvr/prefill_node/config.h"
#include "kvr/prefill_node/grpc_clients.h"
#include "kvr/prefill_node/metrics_observer.h"
#include "kvr/prefill_node/prefill_cuda_backend.h"
#include "kvr/prefill_node/prefill_engine.h"
#include "kvr/proto/convert.h"
#include "spdlog/spdlog.h"

namespace kvr::prefill_node {
namespace {

namespace cv1 = ::kvr::cluster::v1;

using ::kvr::proto::TimeOf;
using ::kvr::proto::ToGrpcStatus;

// Proto -> PrefillJob -> engine -> proto.
class PrefillServiceImpl final : public cv1::PrefillService::Service {
 public:
  explicit PrefillServiceImpl(PrefillEngine* engine) : engine_(engine) {}

  // The request's prompt; false when no input is set.
  static bool PromptOf(const cv1::PrefillRequest& request, Prompt* out) {
    switch (request.input_case()) {
      case cv1::PrefillRequest::kPrompt:
        *out = TextPrompt{request.prompt()};
        return true;
      case cv1::PrefillRequest::kTokenIds:
        *out = TokenPrompt{{request.token_ids().ids().begin(), request.token_ids().ids().end()}};
        return true;
      case cv1::PrefillRequest::kChat: {
        ChatPrompt chat;
        for (const auto& m : request.chat().messages())
          chat.messages.push_back({m.role(), m.content()});
        *out = std::move(chat);
        return true;
      }
      default:
        return false;
    }
  }

  grpc::Status Tokenize(grpc::ServerContext*, const cv1::PrefillRequest* request,
                        cv1::TokenizeResponse* response) override {
    Prompt prompt;
    if (!PromptOf(*request, &prompt)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt: no input set");
    }
    absl::StatusOr<std::vector<int32_t>> ids = engine_->Tokenize(prompt);
    if (!ids.ok()) return ToGrpcStatus(ids.status());
    response->mutable_token_ids()->mutable_ids()->Add(ids->begin(), ids->end());
    return grpc::Status::OK;
  }

  grpc::Status Prefill(grpc::ServerContext* context, const cv1::PrefillRequest* request,
                       cv1::PrefillResponse* response) override {
    PrefillJob job;
    job.request_id = request->request_id();
    job.sequence_id = request->sequence_id();
    absl::StatusOr<kv_store::Capability> cap =
        kv_store::Capability::FromBytes(request->sequence_capability());
    if (!cap.ok() || cap->IsNone()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "sequence_capability: must be 16 random bytes, not all zero");
    }
    job.store_capability = *cap;
    job.model = request->model();
    if (!PromptOf(*request, &job.prompt)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt: no input set");
    }
    job.sampling = request->sampling();
    job.retrieval = request->retrieval();
    job.decode = request->decode();
    job.store = request->store();
    job.deadline_proto = request->deadline();
    job.deadline = std::min(TimeOf(request->deadline()), absl::FromChrono(context->deadline()));
    if (request->has_prefix() && request->prefix().tokens() > 0) {
      absl::StatusOr<kv_store::Capability> prefix_cap =
          kv_store::Capability::FromBytes(request->prefix().capability());
      if (!prefix_cap.ok() || prefix_cap->IsNone()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "prefix.capability: must be 16 random bytes, not all zero");
      }
      job.prefix = {request->prefix().sequence_id(), *prefix_cap};
      job.prefix_tokens = request->prefix().tokens();
    }
    job.retain_proto = request->retain();
    job.retain = ::kvr::proto::FromProto(request->retain());
    if (job.retain < absl::ZeroDuration() || job.retain > absl::Hours(24 * 7)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "retain: must be between 0 and 7 days");
    }
    spdlog::info("prefill {} seq {} attempt {} -> D {} S {}", job.request_id, job.sequence_id,
                 request->attempt(), job.decode.node_id(), job.store.node_id());
    absl::StatusOr<PrefillResult> r =
        engine_->Run(job, [context] { return context->IsCancelled(); });
    if (!r.ok()) {
      const std::string failed = PrefillEngine::FailedNodeOf(r.status());
      if (!failed.empty()) context->AddTrailingMetadata("kvr-failed-node", failed);
      spdlog::warn("prefill {} failed: {}", job.request_id, r.status().ToString());
      return ToGrpcStatus(r.status());
    }
    response->set_prompt_tokens(r->prompt_tokens);
    response->set_first_token(static_cast<uint32_t>(r->first_token));
    response->set_first_text(r->first_text);
    response->set_finish_reason(r->finish_reason);
    response->set_matched_stop(r->matched_stop);
    cv1::PrefillStats* stats = response->mutable_stats();
    const absl::Duration t = r->prefill_time;
    const int64_t ns = absl::ToInt64Nanoseconds(t);
    stats->mutable_prefill_time()->set_seconds(ns / 1'000'000'000);
    stats->mutable_prefill_time()->set_nanos(static_cast<int32_t>(ns % 1'000'000'000));
    stats->set_kv_bytes_shipped(r->kv_bytes_shipped);
    stats->set_handoff_bytes(r->handoff_bytes);
    response->set_cached_tokens(r->cached_tokens);
    spdlog::info("prefill {} done: {} tokens ({} reused) in {}, first token {}", job.request_id,
                 r->prompt_tokens, r->cached_tokens, absl::FormatDuration(t), r->first_token);
    return grpc::Status::OK;
  }

  grpc::Status Cancel(grpc::ServerContext*, const cv1::CancelRequest* request,
                      cv1::CancelResponse* response) override {
    response->set_found(engine_->Cancel(request->request_id()));
    spdlog::info("cancel {} ({}): found {}", request->request_id(), request->reason(),
                 response->found());
    return grpc::Status::OK;
  }

 private:
  PrefillEngine* engine_;
};

int Serve(const PrefillConfig& config) {
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  node::ShutdownSignals signals;  // before any thread starts

  ThreadPool pool(config.threads);
  int exit_code = 0;
  std::optional<node::ServingModel> serving = node::LoadServingModelOrExit(
      "kvr-prefill", config.model, config.device, config.a2ats_codebooks, &pool, &exit_code);
  if (!serving) return exit_code;
  const model::LoadedModel& loaded = serving->loaded;
  // The forward pass's backend (--device): the weights go to the GPU once, here, so that a node
  // that cannot use its GPU fails at start rather than on its first request.
  absl::StatusOr<std::unique_ptr<PrefillBackend>> backend =
      MakePrefillBackend(config, loaded.model.get());
  if (!backend.ok()) {
    std::cerr << "kvr-prefill: " << backend.status().message() << "\n";
    return 2;
  }
  const model::ModelConfig& mc = loaded.model->config();
  const std::string served = ServedModelName(config);
  spdlog::info("serving {} as '{}' ({} layers, {}/{} heads, context {}) on {}", loaded.source,
               served, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.context_length,
               (*backend)->name());

  const std::optional<GrpcSecurity> security =
      node::LoadSecurityOrReport("kvr-prefill", config.tls);
  if (!security) return 2;
  spdlog::info("gRPC: {}", security->Describe());
  kv_store::UcxClientOptions store_options;
  store_options.security = *security;
  store_options.timeout = absl::Seconds(config.store_timeout_seconds);
  store_options.name = "kvr-prefill";
  // A request placed on a store that just died must not wait for it to come back.
  store_options.connect_timeout = absl::Seconds(2);
  UcxStoreClients stores(store_options);
  GrpcHandoffOpener handoff(*security);
  // Metrics: declared before the engine, which reports to them.
  const std::string node_name =
      config.node_name.empty() ? absl::StrCat("kvr-prefill-", getpid()) : config.node_name;
  absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> metrics_server =
      node::StartMetricsServer(config.listen, config.metrics_port, "prefill", node_name);
  if (!metrics_server.ok()) {
    std::cerr << "kvr-prefill: " << metrics_server.status() << "\n";
    return 1;
  }
  metrics::PrefillMetrics prefill_metrics((*metrics_server)->registry());
  PrefillMetricsObserver metrics_observer(&prefill_metrics, served);
  PrefillEngine engine(*std::move(backend), loaded.tokenizer ? &*loaded.tokenizer : nullptr,
                       &serving->methods, &stores, &handoff,
                       EngineOptions{.chunk_tokens = config.chunk_tokens,
                                     .max_prefill_queries = config.max_prefill_queries,
                                     .store_dtype = StoreDType(config),
                                     .extend_summaries = config.extend_summaries,
                                     .method_assets = serving->a2ats_assets,
                                     .observer = &metrics_observer});
  PrefillServiceImpl service(&engine);

  if ((*metrics_server)->serving()) {
    // A wildcard address is not reachable as such; on one machine loopback is.
    node::PrintLine(absl::StrCat("kvr-prefill metrics on ",
                                 node::ReachableHost(node::HostOf(config.listen)), ":",
                                 (*metrics_server)->port()));
  }
  absl::StatusOr<node::WorkerServer> worker =
      node::StartWorkerServer({.program = "kvr-prefill",
                               .listen = config.listen,
                               .security = *security,
                               .service = &service,
                               .health_address = config.health_address});
  if (!worker.ok()) return node::ReportStartFailure("kvr-prefill", worker.status());

  cv1::RegisterRequest registration = node::WorkerRegistration(
      cv1::NODE_ROLE_PREFILL, node_name, worker->address, (*metrics_server)->port());
  cv1::Capacity* capacity = registration.mutable_capacity();
  capacity->set_max_queued_prefill_tokens(config.max_queued_prefill_tokens);
  cv1::ModelInfo* info = capacity->add_models();
  info->set_name(served);
  info->set_context_length(static_cast<uint32_t>(mc.context_length));
  // What the store holds per token: K and V of every layer, in the store row dtype (an fp8 row
  // with its scales).
  info->set_kv_bytes_per_token(
      static_cast<uint64_t>(mc.n_layers) * mc.n_kv_heads *
      kv_store::RowBytes(StoreDType(config), static_cast<uint32_t>(mc.head_dim)));
  node::ServeUntilSignal("kvr-prefill", signals, *worker->server,
                         {.controller = config.controller,
                          .registration = std::move(registration),
                          .load =
                              [&engine] {
                                cv1::NodeLoad load;
                                load.set_queued_prefill_tokens(engine.queued_prompt_tokens());
                                return load;
                              },
                          .security = *security});
  return 0;
}

}  // namespace
}  // namespace kvr::prefill_node

int main(int argc, char** argv) {
  return kvr::node::ServeMain(kvr::prefill_node::PrefillSettings(), argc, argv,
                              &kvr::prefill_node::Serve);
}
