#pragma once
// The dense, growable KV cache of one sequence: for every layer, K and V rows of every token
// seen so far, float32, keys with RoPE applied. What DenseAttention attends over and what
// `kvr generate` keeps; the decode node replaces it with sinks + local window + the KV store.
//
// Thread safety: none; one sequence is advanced by one forward pass at a time.
// Lifetime: views returned by View() are invalidated by the next Append to that layer (the
// storage may move when it grows).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvr/model/attention.h"

namespace kvr::model {

class KvCache {
 public:
  KvCache(int n_layers, int n_kv_heads, int head_dim);

  KvCache(KvCache&&) noexcept = default;
  KvCache& operator=(KvCache&&) noexcept = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  int n_layers() const { return static_cast<int>(layers_.size()); }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int64_t row_floats() const { return int64_t{n_kv_heads_} * head_dim_; }

  // Tokens held at `layer` (layers fill one after another during a forward pass).
  int64_t n_tokens(int layer) const { return layers_[layer].n_tokens; }
  // Tokens held at the last layer: the sequence length once a forward pass has finished.
  int64_t n_tokens() const { return layers_.empty() ? 0 : layers_.back().n_tokens; }
  // Rows allocated at `layer` (grows geometrically).
  int64_t capacity(int layer) const { return layers_[layer].capacity; }

  // Grows every layer to hold at least `n_tokens` rows without reallocating later.
  void Reserve(int64_t n_tokens);

  // Appends `n` rows to `layer`. `k` and `v` point at row 0 of [n, n_kv_heads, head_dim]
  // tensors whose consecutive rows are `src_stride` floats apart (>= row_floats()).
  [[nodiscard]] absl::Status Append(int layer, int64_t n, const float* k, const float* v,
                                    int64_t src_stride);

  // All rows of `layer` (positions 0 .. n_tokens(layer) - 1).
  KvView View(int layer) const;

  // Drops every row (keeps the allocation).
  void Clear();

  // Bytes allocated.
  int64_t allocated_bytes() const;

 private:
  struct Layer {
    std::vector<float> k;  // [capacity, n_kv_heads, head_dim]
    std::vector<float> v;  // [capacity, n_kv_heads, head_dim]
    int64_t n_tokens = 0;
    int64_t capacity = 0;
  };
  void Grow(Layer& layer, int64_t min_capacity);

  int n_kv_heads_;
  int head_dim_;
  std::vector<Layer> layers_;
};

}  // namespace kvr::model
