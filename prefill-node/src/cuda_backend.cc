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
    // The summaries the GPU builds for this call (read by AddSequence).
    KVR_ASSIGN_OR_RETURN(const model::PrefillSummaryOptions summaries, SummariesFor(call));
    KVR_RETURN_IF_ERROR(model_->SetPrefillSummaries(summaries));
    const bool build = summaries.method != model::PrefillSummaryMethod::kNone;
    KVR_RETURN_IF_ERROR(model_->AddSequence(id, L));
    *rows = std::make_unique<CudaRows>(model_.get(), id);
    model::KvExportOptions eo;
    eo.length = L;
    eo.max_queries = call.max_queries;
    if (call.on_layer) {
      // Runs on the CUDA callback thread, only during the Forward calls below.
      eo.on_layer = [&call](const model::KvExportLayer& x) {
        LayerTask task;
        task.layer = x.layer;
        task.kv = x.kv;
        task.k_bf16 = x.k_bf16;
        task.v_bf16 = x.v_bf16;
        task.queries = x.queries;
        task.n_queries = x.n_queries;
        task.queries_first_position = x.queries_first_position;
        task.summary = x.summary;
        call.on_layer(std::move(task));
      };
    }
    eo.summaries = build;
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
  // GPU summaries of the call's method with its parameters (kNone: the engine builds them).
  absl::StatusOr<model::PrefillSummaryOptions> SummariesFor(const PrefillCall& call) const {
    model::PrefillSummaryOptions o;
    if (!gpu_summaries_ || call.params == nullptr) return o;
    if (call.method == "quest") {
      o.method = model::PrefillSummaryMethod::kQuest;
    } else if (call.method == "clusterkv") {
      o.method = model::PrefillSummaryMethod::kClusterKv;
    } else {
      return o;
    }
    // clusterkv: the request's clusterkv.* options, as the CPU index's factory applies them
    // (quest's factory ignores them, so a quest request with a bad one is not refused here).
    const bool clusterkv = call.method == "clusterkv";
    KVR_ASSIGN_OR_RETURN(const retrieval::IndexParams p,
                         clusterkv ? retrieval::ApplyClusterKvOptions(*call.params)
                                   : absl::StatusOr<retrieval::IndexParams>(*call.params));
    // quest's build is ~50 us per layer: on the main stream it is done when the layer's export
    // starts. On the side stream it waited for SMs behind the prefill's kernels, and the export
    // (which waits for the build) with it: all layers then reached the worker at the end
    // (measured: +25% at 32K). clusterkv's k-means (ms per layer) keeps the side stream.
    o.side_stream = clusterkv;
    o.n_sink = p.n_sink;
    o.budget = p.budget;
    o.quest_page_size = retrieval::QuestPageSize(p);
    o.clusterkv_n_clusters = p.clusterkv.n_clusters;
    o.clusterkv_max_iterations = p.clusterkv.max_iterations;
    o.seed = p.seed;
    return o;
  }

  std::unique_ptr<model::CudaModel> model_;
  int device_;
  int64_t max_chunk_;
  bool gpu_summaries_;
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
