#include "kvr/retrieval/sparse_attention.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
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

SparseAttention::SparseAttention(const MethodRegistry* registry, SparseAttentionOptions options)
    : registry_(registry), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<SparseAttention>> SparseAttention::Create(
    const MethodRegistry* registry, SparseAttentionOptions options) {
  return absl::UnimplementedError("SparseAttention: not implemented yet");
}

absl::Status SparseAttention::Attend(const AttentionShape& shape,
                                     std::span<const AttentionRequest> batch) {
  return absl::UnimplementedError("SparseAttention: not implemented yet");
}

void SparseAttention::Release(kvr::model::SequenceId sequence) { sequences_.erase(sequence); }

RetrievalIndex* SparseAttention::FindIndex(kvr::model::SequenceId sequence, int layer) const {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end() || layer < 0 ||
      layer >= static_cast<int>(it->second.layers.size())) {
    return nullptr;
  }
  return it->second.layers[layer].get();
}

int64_t SparseAttention::IndexBytes(kvr::model::SequenceId sequence) const {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return 0;
  int64_t bytes = 0;
  for (const auto& index : it->second.layers) {
    if (index) bytes += index->MemoryBytes();
  }
  return bytes;
}

absl::Status SparseAttention::AttendOne(const AttentionShape& shape,
                                        const AttentionRequest& request) {
  return absl::UnimplementedError("SparseAttention: not implemented yet");
}

}  // namespace kvr::retrieval
