#include "kvr/model/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvr::model {

KvCache::KvCache(int n_layers, int n_kv_heads, int head_dim)
    : n_kv_heads_(n_kv_heads), head_dim_(head_dim), layers_(n_layers) {}

void KvCache::Grow(Layer& layer, int64_t min_capacity) {
  if (min_capacity <= layer.capacity) return;
  // Geometric growth keeps appends amortised O(1) per token.
  const int64_t capacity = std::max<int64_t>({min_capacity, 2 * layer.capacity, 16});
  const size_t floats = static_cast<size_t>(capacity * row_floats());
  layer.k.resize(floats);
  layer.v.resize(floats);
  layer.capacity = capacity;
}

void KvCache::Reserve(int64_t n_tokens) {
  for (Layer& layer : layers_) Grow(layer, n_tokens);
}

absl::Status KvCache::Append(int layer, int64_t n, const float* k, const float* v,
                             int64_t src_stride) {
  if (layer < 0 || layer >= n_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCache::Append: layer ", layer, " outside [0, ", n_layers(), ")"));
  }
  if (n < 0 || (n > 0 && (k == nullptr || v == nullptr)) || src_stride < row_floats()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCache::Append: bad rows (n = ", n, ", src_stride = ", src_stride,
                     ", row = ", row_floats(), " floats, k/v ", k && v ? "set" : "null", ")"));
  }
  Layer& l = layers_[layer];
  Grow(l, l.n_tokens + n);
  const int64_t row = row_floats();
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(l.k.data() + (l.n_tokens + i) * row, k + i * src_stride, row * sizeof(float));
    std::memcpy(l.v.data() + (l.n_tokens + i) * row, v + i * src_stride, row * sizeof(float));
  }
  l.n_tokens += n;
  return absl::OkStatus();
}

KvView KvCache::View(int layer) const {
  const Layer& l = layers_[layer];
  KvView view;
  view.k = l.k.data();
  view.v = l.v.data();
  view.n_rows = l.n_tokens;
  view.row_stride = row_floats();
  view.total_tokens = l.n_tokens;
  return view;
}

void KvCache::Clear() {
  for (Layer& layer : layers_) layer.n_tokens = 0;
}

int64_t KvCache::allocated_bytes() const {
  int64_t bytes = 0;
  for (const Layer& layer : layers_) {
    bytes += static_cast<int64_t>((layer.k.size() + layer.v.size()) * sizeof(float));
  }
  return bytes;
}

}  // namespace kvr::model
