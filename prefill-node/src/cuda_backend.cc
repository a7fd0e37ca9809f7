// The CUDA PrefillBackend (prefill_cuda_backend.h) and MakePrefillBackend.

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/prefill_node/prefill_cuda_backend.h"

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
  CudaPrefillBackend(std::unique_ptr<model::CudaModel> model, int device, int64_t max_chunk)
      : model_(std::move(model)), device_(device), max_chunk_(max_chunk) {}

  const model::ModelConfig& config() const override { return model_->config(); }
  std::string name() const override { return absl::StrCat("cuda:", device_); }

  absl::StatusOr<std::vector<float>> Prefill(const PrefillCall& call,
                                             std::unique_ptr<PrefillRows>* rows) override {
    const int64_t L = static_cast<int64_t>(call.ids.size());
    if (L < 1 || call.chunk_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA prefill: ", L, " tokens in chunks of ", call.chunk_tokens));
    }
    // The model's own ids: the engine's sequence ids are the cluster's, unique per request but
    // not guaranteed to be unused here.
    const model::SequenceId id = next_id_++;
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
        task.queries = x.queries;
        task.n_queries = x.n_queries;
        task.queries_first_position = x.queries_first_position;
        call.on_layer(std::move(task));
      };
    }
    KVR_RETURN_IF_ERROR(model_->BeginKvExport(id, eo));
    std::vector<float> logits(model_->config().vocab);
    const int64_t chunk = std::min(call.chunk_tokens, max_chunk_);
    for (int64_t begin = 0; begin < L; begin += chunk) {
      if (call.check) KVR_RETURN_IF_ERROR(call.check());
      const model::CudaSequence s{id, call.ids.subspan(begin, std::min(chunk, L - begin))};
      KVR_RETURN_IF_ERROR(model_->Forward(std::span(&s, 1), model::LogitsMode::kLast, logits));
    }
    return logits;
  }

 private:
  std::unique_ptr<model::CudaModel> model_;
  int device_;
  int64_t max_chunk_;
  model::SequenceId next_id_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillBackend>> CreateCudaPrefillBackend(
    std::unique_ptr<model::CudaModel> model, int device, int64_t max_chunk_tokens) {
  if (model == nullptr || max_chunk_tokens < 1) {
    return absl::InvalidArgumentError("CreateCudaPrefillBackend: no model or max_chunk_tokens < 1");
  }
  return std::make_unique<CudaPrefillBackend>(std::move(model), device, max_chunk_tokens);
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
  return CreateCudaPrefillBackend(*std::move(gpu), o.device, config.chunk_tokens);
}

}  // namespace kvr::prefill_node
