#include "kvr/decode/local_handoff.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/model_shape.h"

namespace kvr::decode {

absl::StatusOr<Handoff> MakeLocalHandoff(const model::Model& model, const model::KvCache& cache,
                                         const retrieval::MethodRegistry& registry,
                                         kv_store::KvStoreClient& store,
                                         const LocalHandoffOptions& o) {
  const model::ModelConfig& c = model.config();
  const int64_t L = cache.n_tokens();
  if (L <= 0 || cache.windowed()) {
    return absl::InvalidArgumentError("MakeLocalHandoff: needs a dense cache after prefill");
  }
  if (o.store_dtype != kv_store::DType::kF32 && o.store_dtype != kv_store::DType::kBf16 &&
      o.store_dtype != kv_store::DType::kFp8E4m3) {
    return absl::InvalidArgumentError(absl::StrCat("MakeLocalHandoff: store_dtype ",
                                                   kv_store::DTypeName(o.store_dtype),
                                                   ": f32, bf16 or fp8_e4m3"));
  }
  const kv_store::SequenceShape shape{static_cast<uint32_t>(c.n_layers),
                                      static_cast<uint32_t>(c.n_kv_heads),
                                      static_cast<uint32_t>(c.head_dim), o.store_dtype};
  // A fresh capability, as the controller would draw for a real request.
  const kv_store::SequenceRef ref{o.sequence_id, kv_store::Capability::Generate()};
  KVR_RETURN_IF_ERROR(store
                          .CreateSequence(ref, shape,
                                          static_cast<uint64_t>(L) + o.sampling.max_tokens,
                                          absl::ZeroDuration())
                          .status());
  Handoff h;
  h.request_id = absl::StrCat("local-", o.sequence_id);
  h.sequence_id = o.sequence_id;
  h.store_capability = ref.cap;
  h.sampling = o.sampling;
  h.method = o.method;
  h.budget = o.params.budget;
  h.n_sink = o.params.n_sink;
  h.local_window = o.params.local_window;
  h.options = o.params.options;
  h.store = &store;
  h.prompt_tokens = L;
  h.first_token = o.first_token;
  const int64_t row = int64_t{c.n_kv_heads} * c.head_dim;
  const int64_t n_sink = std::min(o.params.n_sink, L);
  const int64_t n_local = std::min(o.params.local_window, L - n_sink);
  for (int layer = 0; layer < c.n_layers; ++layer) {
    std::vector<float> widened;
    const model::KvView kv = model::AsFloatView(cache.View(layer), &widened);
    // Rows to the store, packed [L, n_kv_heads, head_dim] for K and for V, as it takes them:
    // f32, or bf16 (for a bf16 sequence, or an fp8 one, whose store encodes them).
    const size_t row_bytes = static_cast<size_t>(row) * kv_store::WriteElementBytes(o.store_dtype);
    std::vector<uint8_t> k(L * row_bytes), v(L * row_bytes);
    for (int64_t t = 0; t < L; ++t) {
      if (o.store_dtype != kv_store::DType::kF32) {
        FloatsToBf16Bytes(kv.k + t * kv.row_stride, static_cast<size_t>(row), &k[t * row_bytes]);
        FloatsToBf16Bytes(kv.v + t * kv.row_stride, static_cast<size_t>(row), &v[t * row_bytes]);
      } else {
        std::memcpy(&k[t * row_bytes], kv.k + t * kv.row_stride, row_bytes);
        std::memcpy(&v[t * row_bytes], kv.v + t * kv.row_stride, row_bytes);
      }
    }
    kv_store::LayerRows rows;
    rows.sequence = ref;
    rows.layer = static_cast<uint32_t>(layer);
    rows.start_row = 0;
    rows.n_rows = static_cast<uint32_t>(L);
    rows.k = k;
    rows.v = v;
    KVR_RETURN_IF_ERROR(store.PutLayer(rows).status());

    HandoffLayerData& out = h.layers.emplace_back();
    out.layer = layer;
    if (!(o.method == "full" && o.empty_full_summaries)) {
      const retrieval::IndexShape ishape = retrieval::IndexShapeOf(c, layer);
      KVR_ASSIGN_OR_RETURN(std::unique_ptr<retrieval::RetrievalIndex> index,
                           registry.Make(o.method, ishape, o.params));
      retrieval::BuildInput in;
      in.keys = {kv.k, L, kv.row_stride};
      if (static_cast<size_t>(layer) < o.queries.size() && !o.queries[layer].empty()) {
        const int64_t q_row = int64_t{c.n_heads} * c.head_dim;
        const int64_t n_q = static_cast<int64_t>(o.queries[layer].size()) / q_row;
        if (n_q * q_row != static_cast<int64_t>(o.queries[layer].size()) || n_q > L) {
          return absl::InvalidArgumentError(absl::StrCat("MakeLocalHandoff: layer ", layer,
                                                         " queries: ", o.queries[layer].size(),
                                                         " floats for rows of ", q_row));
        }
        in.queries = {o.queries[layer].data(), n_q, q_row};
        in.queries_first_position = L - n_q;
      }
      KVR_RETURN_IF_ERROR(index->Build(in));
      KVR_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, retrieval::SerializeIndex(*index));
      out.summaries.assign(bytes.begin(), bytes.end());
    }
    auto pack = [&](int64_t first, int64_t n, std::string* bytes, std::vector<int64_t>* pos) {
      bytes->resize(static_cast<size_t>(n * 2 * row) * sizeof(float));
      float* dst = reinterpret_cast<float*>(bytes->data());
      for (int64_t t = first; t < first + n; ++t) {
        pos->push_back(t);
        for (int hh = 0; hh < c.n_kv_heads; ++hh) {
          std::memcpy(dst, kv.k + t * kv.row_stride + hh * c.head_dim, c.head_dim * sizeof(float));
          std::memcpy(dst + c.head_dim, kv.v + t * kv.row_stride + hh * c.head_dim,
                      c.head_dim * sizeof(float));
          dst += 2 * c.head_dim;
        }
      }
    };
    pack(0, n_sink, &out.sink_kv, &out.sink_positions);
    pack(L - n_local, n_local, &out.local_kv, &out.local_positions);
  }
  return h;
}

}  // namespace kvr::decode
