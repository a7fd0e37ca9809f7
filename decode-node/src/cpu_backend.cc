// The CPU DecodeBackend (backend.h): model::Model::Forward through DecodeAttention.

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/decode/backend.h"
#include "kvr/decode/engine.h"
#include "kvr/decode/handoff_indexes.h"
#include "kvr/model/kv_cache.h"

namespace kvr::decode {
namespace {

struct CpuSequence final : BackendSequence {
  explicit CpuSequence(model::KvCache c) : cache(std::move(c)) {}
  int64_t resident_bytes() const override { return bytes; }

  model::KvCache cache;  // windowed: sink + local rows
  std::vector<std::unique_ptr<retrieval::RetrievalIndex>> indexes;  // moved to attention_
  kv_store::DType row_dtype = kv_store::DType::kF32;                // of the store sequence's rows
  int64_t bytes = 0;
};

class CpuDecodeBackend final : public DecodeBackend {
 public:
  CpuDecodeBackend(const model::Model* model, const retrieval::MethodRegistry* registry,
                   CpuDecodeBackendOptions options, DecodeObserver* observer)
      : model_(model),
        registry_(registry),
        options_(std::move(options)),
        attention_({.n_layers = model->config().n_layers,
                    .n_kv_heads = model->config().n_kv_heads,
                    .head_dim = model->config().head_dim,
                    .hot_cache_bytes = options_.hot_cache_bytes,
                    .quality_sample_rate = options_.quality_sample_rate},
                   observer, model->pool()) {}

  const model::ModelConfig& config() const override { return model_->config(); }
  std::string name() const override { return "cpu"; }
  int64_t max_sequence_tokens() const override { return model_->config().context_length; }

  absl::StatusOr<std::unique_ptr<BackendSequence>> Prepare(Handoff& h) const override;

  absl::Status Join(const Handoff& h, std::unique_ptr<BackendSequence> state) override {
    auto* seq = static_cast<CpuSequence*>(state.get());
    DecodeSequenceSetup setup;
    setup.method = h.method;
    setup.budget = h.budget;
    setup.n_sink = h.n_sink;
    setup.local_window = h.local_window;
    setup.indexes = std::move(seq->indexes);
    setup.store = h.store;
    setup.store_sequence = h.store_ref();
    setup.row_dtype = seq->row_dtype;
    setup.cache = &seq->cache;
    KVR_RETURN_IF_ERROR(attention_.AddSequence(h.sequence_id, std::move(setup)));
    running_.emplace(h.sequence_id, std::unique_ptr<CpuSequence>(seq));
    state.release();
    return absl::OkStatus();
  }

  absl::Status Step(std::span<const uint64_t> ids, std::span<const int32_t> tokens,
                    std::span<float> logits) override {
    std::vector<model::ForwardSequence> batch;
    batch.reserve(ids.size());
    for (size_t b = 0; b < ids.size(); ++b) {
      auto it = running_.find(ids[b]);
      if (it == running_.end()) {
        return absl::InternalError(absl::StrCat("CPU decode backend: no sequence ", ids[b]));
      }
      batch.push_back({ids[b], &it->second->cache, tokens.subspan(b, 1)});
    }
    return model_->Forward(batch, attention_, model::LogitsMode::kLast, logits);
  }

  void AfterStep() override { attention_.StartOffload(); }
  absl::flat_hash_map<uint64_t, absl::Status> TakeFailures() override {
    absl::flat_hash_map<uint64_t, absl::Status> out;
    for (auto& [id, status] : attention_.TakeOffloadFailures()) out.emplace(id, std::move(status));
    return out;
  }

  RetrievalCounters Leave(uint64_t id) override {
    // This sequence's rows of the last step must be in the store before it is released there.
    attention_.FinishOffload().IgnoreError();
    RetrievalCounters c = attention_.counters(id);
    attention_.Release(id);
    running_.erase(id);
    return c;
  }
  NodeCounters node_counters() const override { return attention_.node_counters(); }
  int64_t SummaryBytes(uint64_t id) const override { return attention_.SummaryBytes(id); }

 private:
  const model::Model* model_;
  const retrieval::MethodRegistry* registry_;
  CpuDecodeBackendOptions options_;
  DecodeAttention attention_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<CpuSequence>> running_;
};

absl::StatusOr<std::unique_ptr<BackendSequence>> CpuDecodeBackend::Prepare(Handoff& h) const {
  const model::ModelConfig& c = model_->config();
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff of sequence ", h.sequence_id, ": ", parts...));
  };
  absl::StatusOr<std::vector<std::unique_ptr<retrieval::RetrievalIndex>>> indexes =
      IndexesFromHandoff(h, c, *registry_, options_.method_assets);
  if (!indexes.ok()) return indexes.status();
  // The store sequence's shape says the dtype its rows are fetched and appended in (the
  // prefill node's store_dtype).
  absl::StatusOr<kv_store::SequenceInfo> info = h.store->GetSequence(h.store_ref());
  if (!info.ok()) {
    return absl::Status(info.status().code(),
                        absl::StrCat("handoff of sequence ", h.sequence_id,
                                     ": store sequence: ", info.status().message()));
  }
  const kv_store::SequenceShape& store_shape = info->shape;
  if (store_shape.n_layers != static_cast<uint32_t>(c.n_layers) ||
      store_shape.n_kv_heads != static_cast<uint32_t>(c.n_kv_heads) ||
      store_shape.head_dim != static_cast<uint32_t>(c.head_dim)) {
    return bad("store sequence shape ", store_shape.n_layers, "x", store_shape.n_kv_heads, "x",
               store_shape.head_dim, ", the model is ", c.n_layers, "x", c.n_kv_heads, "x",
               c.head_dim);
  }
  if (store_shape.dtype != kv_store::DType::kF32 && store_shape.dtype != kv_store::DType::kBf16 &&
      store_shape.dtype != kv_store::DType::kFp8E4m3) {
    return bad("store rows are ", kv_store::DTypeName(store_shape.dtype),
               "; f32, bf16 or fp8_e4m3 needed");
  }
  auto seq = std::make_unique<CpuSequence>(
      model::KvCache::Windowed(c.n_layers, c.n_kv_heads, c.head_dim, h.n_sink, h.local_window));
  seq->row_dtype = store_shape.dtype;
  seq->indexes = *std::move(indexes);
  const int64_t row = int64_t{c.n_kv_heads} * c.head_dim;
  const size_t packed_row_bytes = static_cast<size_t>(2 * row) * sizeof(float);
  std::vector<bool> seen(c.n_layers, false);
  std::vector<float> k, v;
  for (HandoffLayerData& layer : h.layers) {
    if (layer.layer < 0 || layer.layer >= c.n_layers || seen[layer.layer]) {
      return bad("layer ", layer.layer, " is out of range or sent twice");
    }
    seen[layer.layer] = true;
    // Rows: sink then local, each run of consecutive positions.
    for (int part = 0; part < 2; ++part) {
      const std::string& bytes = part == 0 ? layer.sink_kv : layer.local_kv;
      const std::vector<int64_t>& pos = part == 0 ? layer.sink_positions : layer.local_positions;
      if (bytes.size() != pos.size() * packed_row_bytes) {
        return bad("layer ", layer.layer, ": ", part == 0 ? "sink" : "local", " rows hold ",
                   bytes.size(), " bytes for ", pos.size(), " positions of ", packed_row_bytes,
                   " bytes");
      }
      if (pos.empty()) continue;
      for (size_t i = 1; i < pos.size(); ++i) {
        if (pos[i] != pos[0] + static_cast<int64_t>(i)) {
          return bad("layer ", layer.layer, ": positions are not consecutive");
        }
      }
      // [n, n_kv_heads, 2 * head_dim] -> K and V [n, n_kv_heads, head_dim].
      const size_t n = pos.size();
      k.resize(n * row);
      v.resize(n * row);
      const float* src = reinterpret_cast<const float*>(bytes.data());
      for (size_t r = 0; r < n; ++r) {
        for (int hh = 0; hh < c.n_kv_heads; ++hh) {
          const float* kv = src + (r * c.n_kv_heads + hh) * 2 * c.head_dim;
          std::memcpy(&k[r * row + hh * c.head_dim], kv, c.head_dim * sizeof(float));
          std::memcpy(&v[r * row + hh * c.head_dim], kv + c.head_dim, c.head_dim * sizeof(float));
        }
      }
      if (pos[0] < seq->cache.n_tokens(layer.layer)) {
        return bad("layer ", layer.layer, ": positions overlap or go backwards");
      }
      KVR_RETURN_IF_ERROR(seq->cache.AppendAt(layer.layer, pos[0], static_cast<int64_t>(n),
                                              k.data(), v.data(), row));
    }
    seq->cache.ClearEvicted(layer.layer);
    const int64_t n_sink = std::min(h.n_sink, h.prompt_tokens);
    const int64_t n_local = std::min(h.local_window, h.prompt_tokens - n_sink);
    if (seq->cache.n_tokens(layer.layer) != h.prompt_tokens ||
        seq->cache.resident_rows(layer.layer) != n_sink + n_local) {
      return bad("layer ", layer.layer, ": sink/local rows cover ",
                 seq->cache.resident_rows(layer.layer), " positions ending at ",
                 seq->cache.n_tokens(layer.layer), "; expected ", n_sink, " sink + ", n_local,
                 " local rows ending at prompt_tokens ", h.prompt_tokens);
    }
  }
  seq->bytes = seq->cache.allocated_bytes();
  for (const auto& index : seq->indexes) {
    if (index) seq->bytes += index->MemoryBytes();
  }
  return seq;
}

}  // namespace

std::unique_ptr<DecodeBackend> MakeCpuDecodeBackend(const model::Model* model,
                                                    const retrieval::MethodRegistry* registry,
                                                    CpuDecodeBackendOptions options,
                                                    DecodeObserver* observer) {
  return std::make_unique<CpuDecodeBackend>(model, registry, std::move(options), observer);
}

}  // namespace kvr::decode
