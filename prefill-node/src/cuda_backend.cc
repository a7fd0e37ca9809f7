// The CUDA PrefillBackend (prefill_cuda_backend.h) and MakePrefillBackend.

#include <algorithm>
#include <atomic>
#include <memory>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/prefill_node/prefill_cuda_backend.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/cuda/prefill_summaries.h"

namespace kvr::prefill_node {
namespace {

// The request's GPU sequence and its export; released when the engine is done with the rows.
class CudaRows final : public PrefillRows {
 public:
  CudaRows(model::CudaModel* model, model::SequenceId id) : model_(model), id_(id) {}
  ~CudaRows() override {
    // ReleaseSequence ends the export too; errors cannot be reported from here and leave
    // nothing behind but the sequence's cache, which the next Prefill does not reuse.
    model_->ReleaseSequence(id_).IgnoreError();
  }

 private:
  model::CudaModel* model_;
  model::SequenceId id_;
};

class CudaPrefillBackend final : public PrefillBackend {
 public:
  CudaPrefillBackend(std::unique_ptr<model::CudaModel> model, int device, int64_t max_chunk,
                     bool gpu_summaries)
      : model_(std::move(model)),
        device_(device),
        max_chunk_(max_chunk),
        gpu_summaries_(gpu_summaries) {}

  const model::ModelConfig& config() const override { return model_->config(); }
  std::string name() const override { return absl::StrCat("cuda:", device_); }
  bool SupportsPrefix() const override { return true; }
  // Chunks are capped to the model's activations (max_batch_tokens).
  int64_t ChunkTokens(int64_t requested) const override { return std::min(requested, max_chunk_); }

  absl::StatusOr<std::vector<float>> Prefill(const PrefillCall& call,
                                             std::unique_ptr<PrefillRows>* rows) override {
    const int64_t L = static_cast<int64_t>(call.ids.size());
    if (L < 1 || call.chunk_tokens < 1 || call.prefix_rows < 0 || call.prefix_rows >= L) {
      return absl::InvalidArgumentError(absl::StrCat("CUDA prefill: ", L, " tokens in chunks of ",
                                                     call.chunk_tokens, ", prefix of ",
                                                     call.prefix_rows, " rows"));
    }
    // The model's own ids: the engine's sequence ids are the cluster's, unique per request but
    // not guaranteed to be unused here.
    const model::SequenceId id = next_id_++;
    // The summaries the GPU builds for this call, if any (the sequence owns the builder; the
    // layer tasks' serialisers point into it until `rows` releases the sequence).
    KVR_ASSIGN_OR_RETURN(std::unique_ptr<retrieval::cuda::PrefillSummaryBuilder> builder,
                         BuilderFor(call, L));
    const retrieval::cuda::PrefillSummaryBuilder* summaries = builder.get();
    const bool build = summaries != nullptr;
    KVR_RETURN_IF_ERROR(model_->AddSequence(id, L, std::move(builder)));
    *rows = std::make_unique<CudaRows>(model_.get(), id);
    model::KvExportOptions eo;
    eo.length = L;
    eo.max_queries = call.max_queries;
    if (call.on_layer) {
      // Runs on the CUDA callback thread, only during the Forward calls below.
      eo.on_layer = [&call, summaries](const model::KvExportLayer& x) {
        LayerTask task;
        task.layer = x.layer;
        task.kv = x.kv;
        task.k_bf16 = x.k_bf16;
        task.v_bf16 = x.v_bf16;
        task.queries = x.queries;
        task.n_queries = x.n_queries;
        task.queries_first_position = x.queries_first_position;
        if (summaries != nullptr && x.built.length > 0) {
          // The view's pointers stay valid until the export ends (the rows outlive the task).
          task.summary = [summaries, x](const retrieval::IndexShape& shape) {
            return summaries->Serialize(shape, x);
          };
        }
        call.on_layer(std::move(task));
      };
    }
    eo.built = build;
    eo.bf16_rows = call.bf16_rows;
    KVR_RETURN_IF_ERROR(model_->BeginKvExport(id, eo));
    const int64_t P = call.prefix_rows;
    if (P > 0) {
      // The reused rows go into the device cache (and the export: the layer tasks cover
      // [0, L)) as bf16, what the cache holds; the chunks below continue at position P.
      if (!call.load_prefix_bf16) {
        return absl::InvalidArgumentError("CUDA prefill: a prefix without load_prefix_bf16");
      }
      KVR_RETURN_IF_ERROR(model_->AppendRows(
          id, P, [&call](int layer, std::span<uint16_t> k, std::span<uint16_t> v) {
            if (call.check) KVR_RETURN_IF_ERROR(call.check());
            return call.load_prefix_bf16(layer, k, v);
          }));
    }
    std::vector<float> logits(model_->config().vocab);
    const int64_t chunk = ChunkTokens(call.chunk_tokens);
    for (int64_t begin = P; begin < L; begin += chunk) {
      if (call.check) KVR_RETURN_IF_ERROR(call.check());
      const int64_t n = std::min(chunk, L - begin);
      // The chunk that completes the prompt builds the summaries over all of it.
      const model::CudaSequence s{id, call.ids.subspan(begin, n), build && begin + n == L};
      KVR_RETURN_IF_ERROR(model_->Forward(std::span(&s, 1), model::LogitsMode::kLast, logits));
    }
    return logits;
  }

 private:
  // The GPU builder of the call's summaries over `capacity` tokens; null when the engine
  // builds them (no builder that ships for the method, or gpu_summaries off).
  absl::StatusOr<std::unique_ptr<retrieval::cuda::PrefillSummaryBuilder>> BuilderFor(
      const PrefillCall& call, int64_t capacity) {
    namespace rc = retrieval::cuda;
    if (!gpu_summaries_ || call.params == nullptr ||
        !rc::PrefillSummaryBuilders::Ships(config(), call.method, *call.params)) {
      return nullptr;
    }
    if (builders_ == nullptr) {
      KVR_ASSIGN_OR_RETURN(builders_, rc::PrefillSummaryBuilders::Create(config(), device_));
    }
    rc::PrefillSummaryOptions o;
    o.method = call.method;
    o.max_queries = call.max_queries;
    // clusterkv: the request's clusterkv.* options, as the CPU index's factory applies them
    // (quest's factory ignores them, so a quest request with a bad one is not refused here).
    KVR_ASSIGN_OR_RETURN(o.params, call.method == "clusterkv"
                                       ? retrieval::ApplyClusterKvOptions(*call.params)
                                       : absl::StatusOr<retrieval::IndexParams>(*call.params));
    // quest.page_size 0: scaled to the budget, as the CPU index does.
    o.params.quest.page_size = retrieval::QuestPageSize(o.params);
    return builders_->ForSequence(o, capacity);
  }

  std::unique_ptr<model::CudaModel> model_;
  int device_;
  int64_t max_chunk_;
  bool gpu_summaries_;
  // The GPU summary builders (and their shared scratch), made for the first call that wants one.
  std::unique_ptr<retrieval::cuda::PrefillSummaryBuilders> builders_;
  model::SequenceId next_id_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillBackend>> CreateCudaPrefillBackend(
    std::unique_ptr<model::CudaModel> model, int device, int64_t max_chunk_tokens,
    bool gpu_summaries) {
  if (model == nullptr || max_chunk_tokens < 1) {
    return absl::InvalidArgumentError("CreateCudaPrefillBackend: no model or max_chunk_tokens < 1");
  }
  return std::make_unique<CudaPrefillBackend>(std::move(model), device, max_chunk_tokens,
                                              gpu_summaries);
}

absl::StatusOr<std::unique_ptr<PrefillBackend>> MakePrefillBackend(const PrefillConfig& config,
                                                                   const model::Model* model) {
  if (config.device == "cpu") return MakeCpuPrefillBackend(model);
  if (config.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device: '", config.device, "' is not cpu or cuda"));
  }
  const std::string setting =
      absl::StrCat("device cuda (--device cuda --cuda-device ", config.cuda_device, ")");
  if (!model::CudaModelAvailable()) {
    return absl::FailedPreconditionError(absl::StrCat(
        setting,
        ": this build of kvr has no CUDA or this machine no usable GPU; use --device cpu"));
  }
  model::CudaModelOptions o;
  o.device = static_cast<int>(config.cuda_device);
  o.max_batch_tokens = config.chunk_tokens;
  o.max_sequences = 1;
  o.max_logits_rows = 1;
  absl::StatusOr<std::unique_ptr<model::CudaModel>> gpu =
      model::CreateCudaModel(model->config(), model->weights(), o);
  if (!gpu.ok()) {
    return absl::Status(gpu.status().code(), absl::StrCat(setting, ": ", gpu.status().message()));
  }
  return CreateCudaPrefillBackend(*std::move(gpu), o.device, config.chunk_tokens,
                                  config.gpu_summaries);
}

}  // namespace kvr::prefill_node
