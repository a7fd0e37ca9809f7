#include "kvr/model/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"

namespace kvr::model {

const char* KvDTypeName(KvDType dtype) { return dtype == KvDType::kF16 ? "f16" : "f32"; }

absl::StatusOr<KvDType> ParseKvDType(absl::string_view name) {
  if (name == "f32" || name == "float32") return KvDType::kF32;
  if (name == "f16" || name == "float16") return KvDType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("KV cache dtype '", name, "': expected f32 or f16"));
}

KvCache::KvCache(int n_layers, int n_kv_heads, int head_dim, KvDType dtype)
    : n_kv_heads_(n_kv_heads), head_dim_(head_dim), dtype_(dtype), layers_(n_layers) {}

KvCache KvCache::Windowed(int n_layers, int n_kv_heads, int head_dim, int64_t n_sink,
                          int64_t local_window) {
  KvCache cache(n_layers, n_kv_heads, head_dim, KvDType::kF32);
  cache.windowed_ = true;
  cache.n_sink_ = std::max<int64_t>(0, n_sink);
  cache.local_window_ = std::max<int64_t>(1, local_window);
  return cache;
}

int64_t KvCache::resident_rows(int layer) const {
  return windowed_ ? layers_[layer].rows : layers_[layer].n_tokens;
}

void KvCache::Grow(Layer& layer, int64_t min_capacity) {
  if (min_capacity <= layer.capacity) return;
  // Geometric growth keeps appends amortised O(1) per token.
  const int64_t capacity = std::max<int64_t>({min_capacity, 2 * layer.capacity, 16});
  const size_t floats = static_cast<size_t>(capacity * row_floats());
  if (dtype_ == KvDType::kF16) {
    layer.k16.resize(floats);
    layer.v16.resize(floats);
  } else {
    layer.k.resize(floats);
    layer.v.resize(floats);
  }
  if (windowed_) layer.positions.resize(static_cast<size_t>(capacity));
  layer.capacity = capacity;
}

void KvCache::Reserve(int64_t n_tokens) {
  // A windowed cache never holds more than its sinks and window (plus slack for compaction).
  if (windowed_) n_tokens = std::min(n_tokens, 2 * (n_sink_ + local_window_) + 16);
  for (Layer& layer : layers_) Grow(layer, n_tokens);
}

absl::Status KvCache::CheckRows(const char* what, int layer, int64_t n, const float* k,
                                const float* v, int64_t src_stride) const {
  if (layer < 0 || layer >= n_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCache::", what, ": layer ", layer, " outside [0, ", n_layers(), ")"));
  }
  if (n < 0 || (n > 0 && (k == nullptr || v == nullptr)) || src_stride < row_floats()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvCache::", what, ": bad rows (n = ", n, ", src_stride = ", src_stride,
                     ", row = ", row_floats(), " floats, k/v ", k && v ? "set" : "null", ")"));
  }
  return absl::OkStatus();
}

void KvCache::WindowedAppendRow(Layer& l, int64_t position, const float* k, const float* v) {
  const int64_t row = row_floats();
  const size_t row_bytes = static_cast<size_t>(row) * sizeof(float);
  auto move_rows = [&](int64_t from, int64_t to, int64_t count) {
    std::memmove(l.k.data() + to * row, l.k.data() + from * row, count * row_bytes);
    std::memmove(l.v.data() + to * row, l.v.data() + from * row, count * row_bytes);
    std::memmove(l.positions.data() + to, l.positions.data() + from, count * sizeof(int64_t));
  };
  if (l.first + l.rows == l.capacity) {
    if (l.first > 0) {  // reclaim the dead rows before the resident ones
      move_rows(l.first, 0, l.rows);
      l.first = 0;
    } else {
      Grow(l, std::max<int64_t>(2 * (n_sink_ + local_window_) + 16, l.rows + 1));
    }
  }
  const int64_t at = l.first + l.rows;
  std::memcpy(l.k.data() + at * row, k, row_bytes);
  std::memcpy(l.v.data() + at * row, v, row_bytes);
  l.positions[at] = position;
  ++l.rows;
  if (position < n_sink_) ++l.sinks;
  while (l.rows - l.sinks > local_window_) {
    // The oldest local row leaves: keep a copy for the owner, then move the sinks up over it.
    const int64_t out = l.first + l.sinks;
    l.evicted_k.insert(l.evicted_k.end(), l.k.data() + out * row, l.k.data() + (out + 1) * row);
    l.evicted_v.insert(l.evicted_v.end(), l.v.data() + out * row, l.v.data() + (out + 1) * row);
    l.evicted_positions.push_back(l.positions[out]);
    if (l.sinks > 0) move_rows(l.first, l.first + 1, l.sinks);
    ++l.first;
    --l.rows;
  }
}

absl::Status KvCache::AppendAt(int layer, int64_t first_position, int64_t n, const float* k,
                               const float* v, int64_t src_stride) {
  KVR_RETURN_IF_ERROR(CheckRows("AppendAt", layer, n, k, v, src_stride));
  if (!windowed_) {
    return absl::FailedPreconditionError("KvCache::AppendAt: only a windowed cache has gaps");
  }
  Layer& l = layers_[layer];
  if (first_position < l.n_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("KvCache::AppendAt: position ", first_position,
                                                   " is before the end (", l.n_tokens,
                                                   ") of layer ", layer));
  }
  if (l.capacity == 0) Grow(l, 2 * (n_sink_ + local_window_) + 16);
  for (int64_t i = 0; i < n; ++i) {
    WindowedAppendRow(l, first_position + i, k + i * src_stride, v + i * src_stride);
  }
  l.n_tokens = first_position + n;
  return absl::OkStatus();
}

absl::Status KvCache::Append(int layer, int64_t n, const float* k, const float* v,
                             int64_t src_stride) {
  KVR_RETURN_IF_ERROR(CheckRows("Append", layer, n, k, v, src_stride));
  if (windowed_) return AppendAt(layer, layers_[layer].n_tokens, n, k, v, src_stride);
  Layer& l = layers_[layer];
  Grow(l, l.n_tokens + n);
  const int64_t row = row_floats();
  for (int64_t i = 0; i < n; ++i) {
    if (dtype_ == KvDType::kF16) {
      uint16_t* kd = l.k16.data() + (l.n_tokens + i) * row;
      uint16_t* vd = l.v16.data() + (l.n_tokens + i) * row;
      for (int64_t j = 0; j < row; ++j) {
        kd[j] = FloatToFp16(k[i * src_stride + j]);
        vd[j] = FloatToFp16(v[i * src_stride + j]);
      }
      continue;
    }
    std::memcpy(l.k.data() + (l.n_tokens + i) * row, k + i * src_stride, row * sizeof(float));
    std::memcpy(l.v.data() + (l.n_tokens + i) * row, v + i * src_stride, row * sizeof(float));
  }
  l.n_tokens += n;
  return absl::OkStatus();
}

KvView KvCache::View(int layer) const {
  const Layer& l = layers_[layer];
  KvView view;
  if (windowed_) {
    const int64_t row = row_floats();
    view.k = l.k.data() + l.first * row;
    view.v = l.v.data() + l.first * row;
    view.n_rows = l.rows;
    view.row_stride = row;
    view.positions = std::span<const int64_t>(l.positions.data() + l.first, l.rows);
    view.total_tokens = l.n_tokens;
    return view;
  }
  if (dtype_ == KvDType::kF16) {
    view.k_f16 = l.k16.data();
    view.v_f16 = l.v16.data();
  } else {
    view.k = l.k.data();
    view.v = l.v.data();
  }
  view.n_rows = l.n_tokens;
  view.row_stride = row_floats();
  view.total_tokens = l.n_tokens;
  return view;
}

KvView KvCache::Evicted(int layer) const {
  const Layer& l = layers_[layer];
  KvView view;
  view.k = l.evicted_k.data();
  view.v = l.evicted_v.data();
  view.n_rows = static_cast<int64_t>(l.evicted_positions.size());
  view.row_stride = row_floats();
  view.positions = l.evicted_positions;
  view.total_tokens = l.n_tokens;
  return view;
}

void KvCache::ClearEvicted(int layer) {
  Layer& l = layers_[layer];
  l.evicted_k.clear();
  l.evicted_v.clear();
  l.evicted_positions.clear();
}

void KvCache::Clear() {
  for (int i = 0; i < n_layers(); ++i) {
    Layer& layer = layers_[i];
    layer.n_tokens = 0;
    layer.first = layer.rows = layer.sinks = 0;
    ClearEvicted(i);
  }
}

int64_t KvCache::allocated_bytes() const {
  int64_t bytes = 0;
  for (const Layer& layer : layers_) {
    bytes += static_cast<int64_t>((layer.k.size() + layer.v.size()) * sizeof(float) +
                                  (layer.k16.size() + layer.v16.size()) * sizeof(uint16_t) +
                                  layer.positions.size() * sizeof(int64_t));
  }
  return bytes;
}

}  // namespace kvr::model
