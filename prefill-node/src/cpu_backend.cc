// The CPU PrefillBackend: model::Model::Prefill with dense attention wrapped by HandoffAttention,
// which hands out each layer's rows and last queries as the layer's last chunk completes.

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/kv_cache.h"
#include "kvr/prefill_node/prefill_backend.h"

namespace kvr::prefill_node {
namespace {

// The KvCache the tasks' rows live in and the kept queries per layer.
struct CpuRows final : PrefillRows {
  explicit CpuRows(model::KvCache c, int n_layers) : cache(std::move(c)), queries(n_layers) {}
  model::KvCache cache;
  std::vector<std::vector<float>> queries;  // [n_layers][n, n_heads, head_dim]
};

// Dense prefill attention that, as each layer's last chunk completes, hands the layer's rows and
// last queries out. Also the place where `check` runs (once per layer and chunk), so a cancelled
// prefill stops within one layer.
class HandoffAttention final : public model::Attention {
 public:
  HandoffAttention(ThreadPool* pool, int64_t prompt_tokens, int64_t max_queries, CpuRows* rows,
                   const PrefillCall* call)
      : dense_(pool),
        prompt_tokens_(prompt_tokens),
        max_queries_(max_queries),
        rows_(rows),
        call_(call) {}

  absl::Status Attend(const model::AttentionShape& shape,
                      std::span<const model::AttentionRequest> batch) override {
    if (call_->check) KVR_RETURN_IF_ERROR(call_->check());
    KVR_RETURN_IF_ERROR(dense_.Attend(shape, batch));
    const int64_t q_row = int64_t{shape.n_heads} * shape.head_dim;
    for (const model::AttentionRequest& r : batch) {
      // Keep the last max_queries queries of the layer: what fits from this chunk, plus the
      // tail of the earlier ones when this chunk is shorter.
      std::vector<float>& kept = rows_->queries[r.layer];
      const int64_t take = std::min(r.n_queries, max_queries_);
      const int64_t keep_old =
          std::min<int64_t>(static_cast<int64_t>(kept.size()) / q_row, max_queries_ - take);
      kept.erase(kept.begin(), kept.end() - keep_old * q_row);
      kept.insert(kept.end(), r.q + (r.n_queries - take) * q_row, r.q + r.n_queries * q_row);
      const int64_t end = r.first_position + r.n_queries;
      if (end == prompt_tokens_) {
        // The layer is final: `kept` is not touched again, so the view stays valid.
        LayerTask task;
        task.layer = r.layer;
        task.kv = r.kv;
        task.queries = kept.data();
        task.n_queries = static_cast<int64_t>(kept.size()) / q_row;
        task.queries_first_position = end - task.n_queries;
        if (call_->on_layer) call_->on_layer(std::move(task));
      }
    }
    return absl::OkStatus();
  }

 private:
  model::DenseAttention dense_;
  int64_t prompt_tokens_;
  int64_t max_queries_;
  CpuRows* rows_;
  const PrefillCall* call_;
};

class CpuPrefillBackend final : public PrefillBackend {
 public:
  explicit CpuPrefillBackend(const model::Model* model) : model_(model) {}

  const model::ModelConfig& config() const override { return model_->config(); }
  std::string name() const override { return "cpu"; }
  bool SupportsPrefix() const override { return true; }
  // The model's prompt rows do not depend on the chunking as long as chunks start on a
  // multiple of the attention's query block (model.cc, DenseAttention).
  int64_t PrefixAlignment() const override { return model::DenseAttention::kDefaultQueryBlock; }

  absl::StatusOr<std::vector<float>> Prefill(const PrefillCall& call,
                                             std::unique_ptr<PrefillRows>* rows) override {
    const int64_t L = static_cast<int64_t>(call.ids.size());
    auto owned = std::make_unique<CpuRows>(model_->NewCache(model::KvDType::kF32),
                                           model_->config().n_layers);
    CpuRows* r = owned.get();
    *rows = std::move(owned);
    r->cache.Reserve(L);  // views handed out must not move
    const int64_t P = call.prefix_rows;
    if (P < 0 || P >= L || (P > 0 && !call.load_prefix)) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefill: prefix of ", P, " rows for a prompt of ", L, " tokens"));
    }
    if (P > 0) {
      // The cached rows go into the cache as if computed here; the model then continues at
      // position P.
      const model::ModelConfig& c = model_->config();
      const int64_t kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
      std::vector<float> k(static_cast<size_t>(P * kv_dim)), v(k.size());
      for (int layer = 0; layer < c.n_layers; ++layer) {
        if (call.check) KVR_RETURN_IF_ERROR(call.check());
        KVR_RETURN_IF_ERROR(call.load_prefix(layer, k, v));
        KVR_RETURN_IF_ERROR(r->cache.Append(layer, P, k.data(), v.data(), kv_dim));
      }
    }
    HandoffAttention attention(model_->pool(), L, call.max_queries, r, &call);
    return model_->Prefill(call.sequence, r->cache, call.ids.subspan(static_cast<size_t>(P)),
                           attention, call.chunk_tokens);
  }

 private:
  const model::Model* model_;
};

}  // namespace

std::unique_ptr<PrefillBackend> MakeCpuPrefillBackend(const model::Model* model) {
  return std::make_unique<CpuPrefillBackend>(model);
}

}  // namespace kvr::prefill_node
