#include "kvr/retrieval/sparse_attention.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/partial_attention.h"

namespace kvr::retrieval {

using kvr::model::AttentionRequest;
using kvr::model::AttentionShape;

absl::Status DenseAttention(const AttentionShape& shape, const AttentionRequest& request) {
  if (!request.kv.positions.empty()) {
    return absl::InvalidArgumentError("DenseAttention: KvView with explicit positions unsupported");
  }
  const int group = shape.n_heads / shape.n_kv_heads;
  const int hd = shape.head_dim;
  std::vector<float> scratch(request.kv.n_rows);
  for (int64_t i = 0; i < request.n_queries; ++i) {
    const int64_t n_visible = std::min(request.kv.n_rows, request.first_position + i + 1);
    for (int h = 0; h < shape.n_heads; ++h) {
      const int kvh = h / group;
      PartialAttentionInput in;
      in.q = request.q + (i * shape.n_heads + h) * hd;
      in.keys = request.kv.k + static_cast<int64_t>(kvh) * hd;
      in.values = request.kv.v + static_cast<int64_t>(kvh) * hd;
      in.row_stride = request.kv.row_stride;
      in.n_rows = n_visible;
      in.head_dim = hd;
      in.scale = shape.scale;
      AttendPartial(in, request.out + (i * shape.n_heads + h) * hd, scratch);
    }
  }
  return absl::OkStatus();
}

const char* FetchedRowFormatName(FetchedRowFormat format) {
  switch (format) {
    case FetchedRowFormat::kAsCached:
      return "cache";
    case FetchedRowFormat::kBf16:
      return "bf16";
    case FetchedRowFormat::kFp8E4m3:
      return "fp8";
  }
  return "?";
}

absl::StatusOr<FetchedRowFormat> ParseFetchedRowFormat(absl::string_view name) {
  for (FetchedRowFormat f :
       {FetchedRowFormat::kAsCached, FetchedRowFormat::kBf16, FetchedRowFormat::kFp8E4m3}) {
    if (name == FetchedRowFormatName(f)) return f;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("row format '", name, "': expected cache, bf16 or fp8"));
}

int64_t FetchedRowBytes(FetchedRowFormat format, int head_dim) {
  if (format == FetchedRowFormat::kFp8E4m3) {
    return static_cast<int64_t>(Fp8RowLayout{2, head_dim}.RowBytes());
  }
  return 4 * static_cast<int64_t>(head_dim);
}

namespace {

// Copies the selected rows' K and V of one KV head into [rows, head_dim] buffers as a reader of
// `format` rows would see them: fp8 with one scale per row for K and one for V (the K and V
// vectors of a store row [k | v], Fp8RowLayout{2, head_dim}), or bf16.
void GatherFetchedRows(FetchedRowFormat format, const kvr::model::KvView& kv, int kv_head,
                       int head_dim, std::span<const int64_t> rows, std::vector<float>* k,
                       std::vector<float>* v) {
  const size_t hd = static_cast<size_t>(head_dim);
  k->resize(rows.size() * hd);
  v->resize(rows.size() * hd);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t offset = rows[i] * kv.row_stride + static_cast<int64_t>(kv_head) * head_dim;
    float* ki = k->data() + i * hd;
    float* vi = v->data() + i * hd;
    std::copy(kv.k + offset, kv.k + offset + head_dim, ki);
    std::copy(kv.v + offset, kv.v + offset + head_dim, vi);
    if (format == FetchedRowFormat::kFp8E4m3) {
      RoundTripFp8(ki, hd);
      RoundTripFp8(vi, hd);
    } else if (format == FetchedRowFormat::kBf16) {
      for (size_t d = 0; d < hd; ++d) {
        ki[d] = Bf16ToFloat(FloatToBf16(ki[d]));
        vi[d] = Bf16ToFloat(FloatToBf16(vi[d]));
      }
    }
  }
}

}  // namespace

SparseAttention::SparseAttention(const MethodRegistry* registry, SparseAttentionOptions options)
    : registry_(registry), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<SparseAttention>> SparseAttention::Create(
    const MethodRegistry* registry, SparseAttentionOptions options) {
  if (registry == nullptr) return absl::InvalidArgumentError("SparseAttention: null registry");
  if (!registry->Has(options.method)) {
    std::string valid;
    for (const std::string& n : registry->Names())
      absl::StrAppend(&valid, valid.empty() ? "" : ", ", n);
    return absl::InvalidArgumentError(absl::StrCat("SparseAttention: unknown retrieval method '",
                                                   options.method, "'; valid methods: ", valid));
  }
  KVR_RETURN_IF_ERROR(options.params.Validate());
  if (options.dense_layers < 0 || options.max_prefill_queries < 0) {
    return absl::InvalidArgumentError(
        "SparseAttention: dense_layers and max_prefill_queries must be >= 0");
  }
  return std::unique_ptr<SparseAttention>(new SparseAttention(registry, std::move(options)));
}

absl::Status SparseAttention::Attend(const AttentionShape& shape,
                                     std::span<const AttentionRequest> batch) {
  if (shape.n_heads <= 0 || shape.n_kv_heads <= 0 || shape.head_dim <= 0 ||
      shape.n_heads % shape.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("SparseAttention: bad shape: heads ",
                                                   shape.n_heads, "/", shape.n_kv_heads,
                                                   " head_dim ", shape.head_dim));
  }
  for (const AttentionRequest& r : batch) KVR_RETURN_IF_ERROR(AttendOne(shape, r));
  return absl::OkStatus();
}

void SparseAttention::RememberPrefillQueries(kvr::model::SequenceId sequence, int layer,
                                             int n_heads, int head_dim, const float* q, int64_t n,
                                             int64_t end_position) {
  SequenceState& state = sequences_[sequence];
  if (static_cast<int>(state.layers.size()) <= layer) state.layers.resize(layer + 1);
  LayerState& ls = state.layers[layer];
  const int64_t row = static_cast<int64_t>(n_heads) * head_dim;
  const int64_t keep = std::min(n, options_.max_prefill_queries);
  std::vector<float>& buf = ls.prefill_queries;
  if (ls.prefill_queries_end != end_position - n) buf.clear();  // not contiguous: restart
  buf.insert(buf.end(), q + (n - keep) * row, q + n * row);
  const int64_t have = static_cast<int64_t>(buf.size()) / row;
  if (have > options_.max_prefill_queries) {
    buf.erase(buf.begin(), buf.begin() + (have - options_.max_prefill_queries) * row);
  }
  ls.prefill_queries_end = end_position;
}

void SparseAttention::Release(kvr::model::SequenceId sequence) { sequences_.erase(sequence); }

RetrievalIndex* SparseAttention::FindIndex(kvr::model::SequenceId sequence, int layer) const {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end() || layer < 0 || layer >= static_cast<int>(it->second.layers.size())) {
    return nullptr;
  }
  return it->second.layers[layer].index.get();
}

int64_t SparseAttention::IndexBytes(kvr::model::SequenceId sequence) const {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return 0;
  int64_t bytes = 0;
  for (const auto& layer : it->second.layers) {
    if (layer.index) bytes += layer.index->MemoryBytes();
  }
  return bytes;
}

absl::Status SparseAttention::AttendOne(const AttentionShape& shape,
                                        const AttentionRequest& half_or_float) {
  // Half rows (a KvDType::kF16 cache) are widened to float32 for this call: the index and the
  // partial attention read float rows. A float32 cache (Model::NewCache(KvDType::kF32)) of
  // the same values avoids the copy.
  std::vector<float> widened;
  AttentionRequest request = half_or_float;
  request.kv = kvr::model::AsFloatView(half_or_float.kv, &widened);
  if (!request.kv.positions.empty()) {
    return absl::UnimplementedError(
        "SparseAttention: KvView rows with explicit positions (a partial cache) are not "
        "supported; it needs the dense cache of a single process");
  }
  if (request.n_queries <= 0) return absl::OkStatus();
  const int hd = shape.head_dim;
  const int64_t end = request.first_position + request.n_queries;  // tokens visible to the last q
  if (request.kv.n_rows < end) {
    return absl::InvalidArgumentError(absl::StrCat("SparseAttention: KvView holds ",
                                                   request.kv.n_rows, " rows, queries need ", end));
  }
  const bool sparse_layer = request.layer >= options_.dense_layers;
  SequenceState& state = sequences_[request.sequence];
  if (request.layer < 0 || (options_.n_layers > 0 && request.layer >= options_.n_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("SparseAttention: layer ", request.layer,
                                                   " outside [0, ", options_.n_layers, ")"));
  }
  if (static_cast<int>(state.layers.size()) <= request.layer)
    state.layers.resize(request.layer + 1);
  LayerState& layer = state.layers[request.layer];
  std::unique_ptr<RetrievalIndex>& index = layer.index;

  if (request.n_queries > 1 || !sparse_layer) {
    // Prefill (or a dense layer): dense attention; remember the last prefill queries.
    if (sparse_layer && request.n_queries > 1 && options_.keep_prefill_queries &&
        index == nullptr) {
      RememberPrefillQueries(request.sequence, request.layer, shape.n_heads, hd, request.q,
                             request.n_queries, end);
    }
    return DenseAttention(shape, request);
  }

  // Decode step: bring the index up to [0, p).
  const int64_t index_end = request.first_position;
  auto keys_range = [&](int64_t begin, int64_t stop) {
    TokenTensor t;
    t.data = request.kv.k + begin * request.kv.row_stride;
    t.n_tokens = stop - begin;
    t.row_stride = request.kv.row_stride;
    return t;
  };
  {
    const auto t0 = std::chrono::steady_clock::now();
    if (index == nullptr) {
      IndexShape ishape;
      ishape.n_heads = shape.n_heads;
      ishape.n_kv_heads = shape.n_kv_heads;
      ishape.head_dim = hd;
      ishape.layer = request.layer;
      ishape.n_layers = options_.n_layers;
      ishape.rope = options_.rope;
      KVR_ASSIGN_OR_RETURN(index, registry_->Make(options_.method, ishape, options_.params));
      BuildInput in;
      in.keys = keys_range(0, index_end);
      const int64_t row = static_cast<int64_t>(shape.n_heads) * hd;
      const int64_t nq = static_cast<int64_t>(layer.prefill_queries.size()) / row;
      if (nq > 0 && layer.prefill_queries_end <= index_end) {
        in.queries.data = layer.prefill_queries.data();
        in.queries.n_tokens = nq;
        in.queries.row_stride = row;
        in.queries_first_position = layer.prefill_queries_end - nq;
      }
      absl::Status built = index->Build(in);
      layer.prefill_queries = {};  // the index has what it needs
      if (!built.ok()) {
        index.reset();
        return absl::Status(built.code(), absl::StrCat("SparseAttention layer ", request.layer,
                                                       ": ", built.message()));
      }
    } else if (index->size() < index_end) {
      AppendInput in;
      in.keys = keys_range(index->size(), index_end);
      KVR_RETURN_IF_ERROR(index->Append(in));
    }
    stats_.build_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // Decode: one query at position p over sinks [0, n_sink), the local window [local_begin, p]
  // and the selected tokens in between.
  const int64_t p = request.first_position;
  const int64_t n_sink = std::min(options_.params.n_sink, p + 1);
  const int64_t local_begin = std::max(n_sink, p + 1 - options_.params.local_window);
  SelectRequest sel;
  sel.query = request.q;
  sel.query_position = p;
  sel.budget = options_.params.budget;
  sel.n_sink = n_sink;
  sel.local_begin = local_begin;
  const auto t0 = std::chrono::steady_clock::now();
  KVR_RETURN_IF_ERROR(index->Select(sel, &selection_));
  stats_.select_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (static_cast<int>(selection_.per_head.size()) != shape.n_kv_heads) {
    return absl::InternalError(absl::StrCat("SparseAttention: method ", options_.method,
                                            " returned ", selection_.per_head.size(),
                                            " KV heads, expected ", shape.n_kv_heads));
  }
  rows_.clear();  // resident rows: sinks then the local window
  for (int64_t t = 0; t < n_sink; ++t) rows_.push_back(t);
  for (int64_t t = local_begin; t <= p; ++t) rows_.push_back(t);
  const int group = shape.n_heads / shape.n_kv_heads;
  scores_.resize(std::max<size_t>(rows_.size(), 1));
  partial_out_.resize(hd);
  ++stats_.decode_calls;
  for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
    const std::vector<int64_t>& picked = selection_.per_head[kvh];
    for (int64_t id : picked) {
      if (id < n_sink || id >= local_begin) {
        return absl::InternalError(absl::StrCat("SparseAttention: method ", options_.method,
                                                " selected token ", id,
                                                " inside the sink/local range"));
      }
    }
    stats_.selected_rows += static_cast<int64_t>(picked.size());
    stats_.attended_rows += static_cast<int64_t>(picked.size() + rows_.size());
    if (scores_.size() < picked.size()) scores_.resize(picked.size());
    const bool convert = options_.fetched_rows != FetchedRowFormat::kAsCached && !picked.empty();
    if (convert) {
      GatherFetchedRows(options_.fetched_rows, request.kv, kvh, hd, picked, &fetched_k_,
                        &fetched_v_);
    }
    for (int g = 0; g < group; ++g) {
      const int h = kvh * group + g;
      PartialAttentionInput in;
      in.q = request.q + static_cast<int64_t>(h) * hd;
      in.keys = request.kv.k + static_cast<int64_t>(kvh) * hd;
      in.values = request.kv.v + static_cast<int64_t>(kvh) * hd;
      in.row_stride = request.kv.row_stride;
      in.head_dim = hd;
      in.scale = shape.scale;
      in.rows = rows_;
      float* out = request.out + static_cast<int64_t>(h) * hd;
      float lse = AttendPartial(in, out, scores_);
      if (convert) {
        in.keys = fetched_k_.data();
        in.values = fetched_v_.data();
        in.row_stride = hd;
        in.rows = {};
        in.n_rows = static_cast<int64_t>(picked.size());
      } else {
        in.rows = picked;
      }
      if (!picked.empty()) {
        const float lse_b = AttendPartial(in, partial_out_.data(), scores_);
        MergeAttentionPartial(out, &lse, partial_out_.data(), lse_b, hd);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvr::retrieval
