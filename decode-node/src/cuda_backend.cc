// The CUDA DecodeBackend (cuda_backend.h) and MakeDecodeBackend.

#include "kvr/decode/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/prebuilt.h"
#include "kvr/retrieval/registry.h"

namespace kvr::decode {
namespace {

// Between Prepare and Join: the sequence's rows, already pulled from the store into a host KV of
// the model's pool (or nothing, when too many sequences were loading: Join pulls them then).
struct CudaPending final : BackendSequence {
  explicit CudaPending(int64_t bytes) : bytes(bytes) {}
  int64_t resident_bytes() const override { return bytes; }
  int64_t bytes;
  std::shared_ptr<model::SparseHostKvBuffer> host;  // filled with rows [0, prompt_tokens)
  RetrievalCounters counters;                       // of that pull
  int64_t gathers = 0;
  std::atomic<int>* loading = nullptr;              // the backend's count, released here
  // clusterkv: the handed-off clusters of every layer (the prefill node's k-means).
  std::vector<retrieval::PrebuiltClusterKvData> clusters;
  ~CudaPending() override {
    if (loading != nullptr) --*loading;
  }
};

class CudaDecodeBackend final : public DecodeBackend {
 public:
  CudaDecodeBackend(std::unique_ptr<model::CudaModel> model, CudaDecodeBackendOptions options,
                    int64_t slot_bytes, int64_t summary_bytes)
      : model_(std::move(model)),
        options_(std::move(options)),
        slot_bytes_(slot_bytes),
        summary_bytes_(summary_bytes) {}

  const model::ModelConfig& config() const override { return model_->config(); }
  std::string name() const override { return absl::StrCat("cuda:", options_.device); }
  int64_t max_sequence_tokens() const override { return options_.max_context; }

  // Pulls the rows here, on the caller's thread (the handoff's), into a host KV of the model's
  // pool, so that Join (on the loop thread) only activates the sequence and the running batch
  // does not wait for the store. At most `slots` sequences hold a pulled host KV before joining
  // (pinned memory); beyond that the pull waits for Join, as before.
  absl::StatusOr<std::unique_ptr<BackendSequence>> Prepare(Handoff& h) const override {
    KVR_RETURN_IF_ERROR(CheckHandoffForCudaBackend(h, options_));
    auto pending = std::make_unique<CudaPending>(slot_bytes_);
    if (options_.method == "clusterkv") {
      // The clusters the GPU keeps come from the handoff (sink/local rows come from the store).
      const int n_layers = model_->config().n_layers;
      pending->clusters.resize(n_layers);
      std::vector<bool> seen(n_layers, false);
      for (const HandoffLayerData& layer : h.layers) {
        if (layer.layer < 0 || layer.layer >= n_layers || seen[layer.layer]) continue;
        absl::StatusOr<retrieval::PrebuiltClusterKvData> parsed = retrieval::ParsePrebuiltClusterKv(
            {reinterpret_cast<const uint8_t*>(layer.summaries.data()), layer.summaries.size()},
            *options_.registry);
        if (!parsed.ok()) {
          return absl::InvalidArgumentError(absl::StrCat("handoff of sequence ", h.sequence_id,
                                                         ": layers[", layer.layer,
                                                         "].summaries: ", parsed.status().message()));
        }
        if (parsed->size != h.prompt_tokens) {
          return absl::InvalidArgumentError(absl::StrCat(
              "handoff of sequence ", h.sequence_id, ": layers[", layer.layer, "].summaries cover ",
              parsed->size, " tokens, prompt_tokens is ", h.prompt_tokens));
        }
        pending->clusters[layer.layer] = *std::move(parsed);
        seen[layer.layer] = true;
      }
      for (int l = 0; l < n_layers; ++l) {
        if (!seen[l]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "handoff of sequence ", h.sequence_id, ": no clusterkv summaries for layer ", l));
        }
      }
    }
    if (++loading_ > options_.slots) {
      --loading_;
      return pending;
    }
    pending->loading = &loading_;
    KVR_ASSIGN_OR_RETURN(pending->host, model_->AcquireSparseHostKv(options_.max_context));
    absl::StatusOr<RetrievalCounters> pulled = Pull(h, pending->host->rows(), &pending->gathers);
    if (!pulled.ok()) return pulled.status();
    pending->counters = *pulled;
    return pending;
  }

  absl::Status Join(const Handoff& h, std::unique_ptr<BackendSequence> state) override {
    const uint64_t id = h.sequence_id;
    auto* pending = dynamic_cast<CudaPending*>(state.get());
    model::SparseSequenceOptions so;
    if (pending != nullptr) so.host_kv = pending->host;
    KVR_RETURN_IF_ERROR(model_->AddSparseSequence(id, options_.max_context, so));
    absl::StatusOr<RetrievalCounters> loaded = [&]() -> absl::StatusOr<RetrievalCounters> {
      RetrievalCounters counters;
      if (so.host_kv != nullptr) {
        counters = pending->counters;
        node_.gathers += pending->gathers;
      } else {
        KVR_ASSIGN_OR_RETURN(std::span<uint16_t> host, model_->SparseHostKv(id));
        int64_t gathers = 0;
        KVR_ASSIGN_OR_RETURN(counters, Pull(h, host, &gathers));
        node_.gathers += gathers;
      }
      if (pending != nullptr && !pending->clusters.empty()) {
        std::vector<model::CudaModel::SparseClusterHead> heads;
        for (const retrieval::PrebuiltClusterKvData& layer : pending->clusters) {
          for (size_t hh = 0; hh < layer.ids.size(); ++hh) {
            heads.push_back({layer.centroids[hh], layer.offsets[hh], layer.ids[hh]});
          }
        }
        KVR_RETURN_IF_ERROR(
            model_->ActivateSparseSequenceWithClusters(id, h.prompt_tokens, heads));
      } else {
        KVR_RETURN_IF_ERROR(model_->ActivateSparseSequence(id, h.prompt_tokens));
      }
      return counters;
    }();
    if (!loaded.ok()) {
      model_->ReleaseSequence(id).IgnoreError();
      return loaded.status();
    }
    node_.retrieval.Add(*loaded);
    running_.emplace(id, *loaded);
    return absl::OkStatus();
  }

  absl::Status Step(std::span<const uint64_t> ids, std::span<const int32_t> tokens,
                    std::span<float> logits) override {
    batch_.clear();
    for (size_t b = 0; b < ids.size(); ++b) batch_.push_back({ids[b], tokens.subspan(b, 1)});
    KVR_RETURN_IF_ERROR(model_->Forward(batch_, model::LogitsMode::kLast, logits));
    node_.attend_calls += model_->config().n_layers;
    return absl::OkStatus();
  }

  RetrievalCounters Leave(uint64_t id) override {
    RetrievalCounters c;
    if (auto it = running_.find(id); it != running_.end()) {
      c = it->second;
      running_.erase(it);
    }
    model_->ReleaseSequence(id).IgnoreError();  // NotFound only: nothing to free
    return c;
  }
  NodeCounters node_counters() const override { return node_; }
  int64_t SummaryBytes(uint64_t id) const override {
    return running_.contains(id) ? summary_bytes_ : 0;
  }

 private:
  // Rows [0, prompt_tokens) of every (layer, KV head) from the store into `host` (a host KV of
  // capacity max_context). Any thread: touches no backend or model state.
  absl::StatusOr<RetrievalCounters> Pull(const Handoff& h, std::span<uint16_t> host,
                                         int64_t* gathers) const {
    const model::ModelConfig& c = model_->config();
    const uint64_t id = h.sequence_id;
    const int64_t L = h.prompt_tokens, cap = options_.max_context;
    const int kv = c.n_kv_heads, d = c.head_dim;
    auto bad = [&](auto&&... parts) {
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA decode: store sequence ", id, ": ", parts...));
    };
    KVR_ASSIGN_OR_RETURN(kv_store::SequenceInfo info, h.store->GetSequence(h.store_ref()));
    const kv_store::SequenceShape& s = info.shape;
    if (s.n_layers != static_cast<uint32_t>(c.n_layers) ||
        s.n_kv_heads != static_cast<uint32_t>(kv) || s.head_dim != static_cast<uint32_t>(d)) {
      return bad("shape ", s.n_layers, "x", s.n_kv_heads, "x", s.head_dim, ", the model is ",
                 c.n_layers, "x", kv, "x", d);
    }
    if (s.dtype != kv_store::DType::kF32 && s.dtype != kv_store::DType::kBf16) {
      return bad("rows are ", kv_store::DTypeName(s.dtype), "; f32 or bf16 needed");
    }
    for (int l = 0; l < c.n_layers; ++l) {
      if (static_cast<int64_t>(info.committed_rows[l]) < L) {
        return bad("layer ", l, " holds ", info.committed_rows[l], " rows, prompt_tokens ", L);
      }
    }
    if (static_cast<int64_t>(host.size()) != int64_t{c.n_layers} * kv * cap * 2 * d) {
      return absl::InternalError("CUDA decode: host KV of the wrong size");
    }
    const size_t row_bytes = s.RowBytes();
    std::vector<uint8_t> staging;
    const int64_t chunk =
        std::max<int64_t>(1, options_.staging_bytes / static_cast<int64_t>(kv * row_bytes));
    RetrievalCounters counters;
    std::vector<kv_store::RangeEntry> ranges(kv);
    for (int l = 0; l < c.n_layers; ++l) {
      for (int64_t t0 = 0; t0 < L; t0 += chunk) {
        const int64_t n = std::min(chunk, L - t0);
        for (int hh = 0; hh < kv; ++hh) {
          ranges[hh] = {h.store_ref(), static_cast<uint32_t>(l), static_cast<uint32_t>(hh),
                        static_cast<uint64_t>(t0), static_cast<uint64_t>(n)};
        }
        staging.resize(static_cast<size_t>(kv * n) * row_bytes);
        KVR_RETURN_IF_ERROR(h.store->RangeRead(ranges, std::span(staging)));
        ++*gathers;
        // staging [kv, n, 2 d] -> host KV [layer, kv, cap, 2 d] bf16.
        for (int hh = 0; hh < kv; ++hh) {
          uint16_t* dst = host.data() + ((int64_t{l} * kv + hh) * cap + t0) * 2 * d;
          const uint8_t* src = staging.data() + static_cast<size_t>(hh * n) * row_bytes;
          if (s.dtype == kv_store::DType::kBf16) {
            std::memcpy(dst, src, static_cast<size_t>(n) * row_bytes);
          } else {
            const float* f = reinterpret_cast<const float*>(src);
            for (int64_t i = 0; i < n * 2 * d; ++i) dst[i] = FloatToBf16(f[i]);
          }
        }
        counters.rows_fetched += n * kv;
        counters.bytes_fetched += static_cast<int64_t>(kv * n * row_bytes);
      }
    }
    return counters;
  }

  std::unique_ptr<model::CudaModel> model_;
  CudaDecodeBackendOptions options_;
  int64_t slot_bytes_;
  int64_t summary_bytes_;
  absl::flat_hash_map<uint64_t, RetrievalCounters> running_;
  NodeCounters node_;
  std::vector<model::CudaSequence> batch_;
  // Sequences whose rows Prepare pulled (or is pulling) and that have not joined yet.
  mutable std::atomic<int> loading_{0};
};

}  // namespace

absl::Status CheckHandoffForCudaBackend(const Handoff& h, const CudaDecodeBackendOptions& o) {
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff of sequence ", h.sequence_id, ": ", parts...));
  };
  if (h.method != o.method) {
    return bad("retrieval.method '", h.method, "' is not this node's (a CUDA decode node runs '",
               o.method, "' only: gpu_method)");
  }
  if (h.budget > o.budget) {
    return bad("retrieval.budget ", h.budget, " is above this node's gpu_budget ", o.budget);
  }
  if (h.n_sink != o.n_sink) {
    return bad("retrieval.n_sink ", h.n_sink, " differs from this node's gpu_n_sink ", o.n_sink);
  }
  if (h.local_window != o.local_window) {
    return bad("retrieval.local_window ", h.local_window,
               " differs from this node's gpu_local_window ", o.local_window);
  }
  if (o.max_context > 0 && h.prompt_tokens + 1 > o.max_context) {
    return bad("prompt_tokens ", h.prompt_tokens, " leave no room in this node's gpu_max_context ",
               o.max_context);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DecodeBackend>> CreateCudaDecodeBackend(
    std::unique_ptr<model::CudaModel> model, const CudaDecodeBackendOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("CreateCudaDecodeBackend: no model");
  const model::ModelConfig& c = model->config();
  CudaDecodeBackendOptions o = options;
  if (o.max_context == 0) o.max_context = c.context_length;
  if (o.max_context < 2 || o.max_context > c.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("gpu_max_context ", o.max_context,
                                                   " outside [2, the model's context length ",
                                                   c.context_length, "]"));
  }
  if (o.method != "quest" && o.method != "clusterkv") {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu_method '", o.method, "': a CUDA decode node runs quest or clusterkv"));
  }
  if (o.method == "clusterkv" && (o.registry == nullptr || !o.registry->Has("clusterkv"))) {
    return absl::InvalidArgumentError(
        "gpu_method 'clusterkv': no method registry with clusterkv to parse the handed-off "
        "summaries with");
  }
  model::SparseAttentionOptions so;
  so.method = o.method == "quest" ? model::SparseMethod::kQuest : model::SparseMethod::kClusterKv;
  so.slots = o.slots;
  so.max_capacity = o.max_context;
  so.budget = o.budget;
  so.n_sink = o.n_sink;
  so.local_window = o.local_window;
  // The hot cache's rows per (slot, layer, KV head) from the byte budget (bf16 [K | V] rows),
  // a multiple of 8 (its ways), at most 4096.
  const int64_t per_row = int64_t{o.slots} * c.n_layers * c.n_kv_heads * 2 * c.head_dim * 2;
  int64_t rows = std::min<int64_t>(4096, o.hot_cache_bytes / std::max<int64_t>(1, per_row));
  so.hot_cache_rows = static_cast<int>(rows / 8 * 8);
  if (absl::Status s = model->ConfigureSparse(so); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("device cuda (gpu_budget ", o.budget, ", gpu_n_sink ",
                                               o.n_sink, ", gpu_local_window ", o.local_window,
                                               ", batch_slots ", o.slots, ", gpu_max_context ",
                                               o.max_context, "): ", s.message()));
  }
  // One slot's device bytes, from a probe sequence (which also pins the first host KV: later
  // sequences of the same capacity reuse the pinned buffers).
  constexpr model::SequenceId kProbe = ~model::SequenceId{0};
  KVR_RETURN_IF_ERROR(model->AddSparseSequence(kProbe, o.max_context, {}));
  absl::StatusOr<int64_t> slot_bytes = model->SequenceDeviceBytes(kProbe);
  KVR_RETURN_IF_ERROR(model->ReleaseSequence(kProbe));
  if (!slot_bytes.ok()) return slot_bytes.status();
  const int64_t pages = (o.max_context + so.quest_page_size - 1) / so.quest_page_size;
  // quest: page bounds; clusterkv: ~L/80 centroids + offsets and one member id per token.
  const int64_t summary_bytes =
      o.method == "quest"
          ? pages * c.n_layers * c.n_kv_heads * 2 * c.head_dim * 4
          : int64_t{c.n_layers} * c.n_kv_heads *
                ((o.max_context / 80 + 1) * (int64_t{c.head_dim} * 4 + 4) + o.max_context * 4);
  return std::make_unique<CudaDecodeBackend>(std::move(model), o, *slot_bytes, summary_bytes);
}

absl::StatusOr<std::unique_ptr<DecodeBackend>> MakeDecodeBackend(
    const DecodeConfig& config, const model::Model* model,
    const retrieval::MethodRegistry* registry,
    std::shared_ptr<const retrieval::MethodAssets> assets, DecodeObserver* observer) {
  if (model == nullptr || registry == nullptr) {
    return absl::InvalidArgumentError("MakeDecodeBackend: model and registry are required");
  }
  if (config.device == "cpu") {
    return MakeCpuDecodeBackend(model, registry,
                                {.hot_cache_bytes = config.hot_cache_bytes,
                                 .quality_sample_rate = config.quality_sample_rate,
                                 .method_assets = std::move(assets)},
                                observer);
  }
  if (config.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device: '", config.device, "' is not cpu or cuda"));
  }
  const std::string setting =
      absl::StrCat("device cuda (--device cuda --cuda-device ", config.cuda_device, ")");
  if (config.quality_sample_rate > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quality_sample_rate ", config.quality_sample_rate,
        ": not supported with --device cuda (the GPU's selection is not compared with the "
        "oracle); use 0"));
  }
  if (!model::CudaModelAvailable()) {
    return absl::FailedPreconditionError(absl::StrCat(
        setting,
        ": this build of kvr has no CUDA or this machine no usable GPU; use --device cpu"));
  }
  model::CudaModelOptions mo;
  mo.device = static_cast<int>(config.cuda_device);
  mo.max_batch_tokens = config.batch_slots;
  mo.max_sequences = static_cast<int>(config.batch_slots);
  mo.max_logits_rows = config.batch_slots;
  absl::StatusOr<std::unique_ptr<model::CudaModel>> gpu =
      model::CreateCudaModel(model->config(), model->weights(), mo);
  if (!gpu.ok()) {
    return absl::Status(gpu.status().code(), absl::StrCat(setting, ": ", gpu.status().message()));
  }
  CudaDecodeBackendOptions o;
  o.device = mo.device;
  o.slots = static_cast<int>(config.batch_slots);
  o.method = config.gpu_method;
  o.budget = static_cast<int>(config.gpu_budget);
  o.n_sink = static_cast<int>(config.gpu_n_sink);
  o.local_window = static_cast<int>(config.gpu_local_window);
  o.max_context = config.gpu_max_context;
  o.hot_cache_bytes = config.hot_cache_bytes;
  o.registry = registry;
  return CreateCudaDecodeBackend(*std::move(gpu), o);
}

}  // namespace kvr::decode
