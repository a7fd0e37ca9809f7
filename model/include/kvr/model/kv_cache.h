#pragma once
// The KV cache of one sequence, keys with RoPE applied, rows float32 or (dense mode) IEEE half
// (KvDType::kF16: half the bytes that a decode step reads; the model rounds K and V to half
// before they reach any cache, model.h). Two modes:
//
// - dense (the constructor): for every layer, K and V rows of every token seen so far. What
//   DenseAttention attends over and what `kvr generate` keeps.
// - windowed (KvCache::Windowed): what a decode node keeps resident. Per layer only the sink
//   rows (positions [0, n_sink)) and a sliding local window of the most recent `local_window`
//   positions; rows that slide out of the window move to an "evicted" buffer that the owner
//   drains (the decode node appends them to its retrieval index; their KV lives in the store).
//   n_tokens() still counts every token of the sequence, so the model's positions stay right;
//   View() carries explicit positions (KvView::positions). Rows can start past a gap
//   (AppendAt): a decode node seeds the cache with the sinks and the local window that the
//   prefill node handed off.
//
// Thread safety: none; one sequence is advanced by one forward pass at a time.
// Lifetime: views returned by View()/Evicted() are invalidated by the next Append/AppendAt/
// ClearEvicted on that layer (the storage may move).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvr/model/attention.h"

namespace kvr::model {

// Element type of a cache's stored rows.
enum class KvDType { kF32, kF16 };

// "f32", "f16".
const char* KvDTypeName(KvDType dtype);
// "f32" / "float32", "f16" / "float16"; InvalidArgument otherwise.
[[nodiscard]] absl::StatusOr<KvDType> ParseKvDType(absl::string_view name);

class KvCache {
 public:
  // A dense cache (see above) storing rows as `dtype`; Append takes float rows either way
  // (kF16 rounds them to nearest even).
  KvCache(int n_layers, int n_kv_heads, int head_dim, KvDType dtype = KvDType::kF32);

  // A windowed cache (see above), float32. n_sink >= 0, local_window >= 1.
  static KvCache Windowed(int n_layers, int n_kv_heads, int head_dim, int64_t n_sink,
                          int64_t local_window);

  KvCache(KvCache&&) noexcept = default;
  KvCache& operator=(KvCache&&) noexcept = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  int n_layers() const { return static_cast<int>(layers_.size()); }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int64_t row_floats() const { return int64_t{n_kv_heads_} * head_dim_; }
  KvDType dtype() const { return dtype_; }

  bool windowed() const { return windowed_; }
  int64_t n_sink() const { return n_sink_; }              // windowed mode only
  int64_t local_window() const { return local_window_; }  // windowed mode only

  // Tokens of the sequence at `layer` (layers fill one after another during a forward pass).
  // Windowed mode: every token seen, resident or not.
  int64_t n_tokens(int layer) const { return layers_[layer].n_tokens; }
  // Rows held in memory at `layer` (== n_tokens(layer) in dense mode).
  int64_t resident_rows(int layer) const;
  // Tokens held at the last layer: the sequence length once a forward pass has finished.
  int64_t n_tokens() const { return layers_.empty() ? 0 : layers_.back().n_tokens; }
  // Rows allocated at `layer` (grows geometrically).
  int64_t capacity(int layer) const { return layers_[layer].capacity; }

  // Grows every layer to hold at least `n_tokens` rows without reallocating later.
  void Reserve(int64_t n_tokens);

  // Appends `n` rows to `layer` at positions n_tokens(layer) ... `k` and `v` point at row 0
  // of [n, n_kv_heads, head_dim] tensors whose consecutive rows are `src_stride` floats apart
  // (>= row_floats()). Windowed mode: rows past the window's end slide the oldest local rows
  // out into the evicted buffer.
  [[nodiscard]] absl::Status Append(int layer, int64_t n, const float* k, const float* v,
                                    int64_t src_stride);
  // Windowed mode only: appends rows at positions first_position ... (first_position >=
  // n_tokens(layer); the positions in between are not resident and are not reported as
  // evicted). n_tokens(layer) becomes first_position + n.
  [[nodiscard]] absl::Status AppendAt(int layer, int64_t first_position, int64_t n, const float* k,
                                      const float* v, int64_t src_stride);

  // The resident rows of `layer`: dense mode positions 0 .. n_tokens(layer) - 1 (no explicit
  // positions); windowed mode the sinks then the local window, ascending, with positions.
  KvView View(int layer) const;

  // Windowed mode: rows that slid out of the local window since the last ClearEvicted, in
  // position order, with positions (empty view in dense mode).
  KvView Evicted(int layer) const;
  void ClearEvicted(int layer);

  // Drops every row (keeps the allocation).
  void Clear();

  // Bytes allocated.
  int64_t allocated_bytes() const;

 private:
  struct Layer {
    std::vector<float> k;            // [capacity, n_kv_heads, head_dim] (kF32)
    std::vector<float> v;            // [capacity, n_kv_heads, head_dim] (kF32)
    std::vector<uint16_t> k16, v16;  // the same as half (kF16)
    int64_t n_tokens = 0;
    int64_t capacity = 0;
    // Windowed mode. Resident rows are rows [first, first + rows) of k/v: the sinks, then the
    // local window. When local rows slide out, the sinks are moved up over them (sinks are
    // few), so the resident rows stay contiguous; the dead rows before `first` are reclaimed
    // when the buffer is full.
    int64_t first = 0;
    int64_t rows = 0;
    int64_t sinks = 0;                       // resident sink rows (the first `sinks` resident rows)
    std::vector<int64_t> positions;          // [capacity], position of each buffer row
    std::vector<float> evicted_k;            // [n_evicted, n_kv_heads, head_dim]
    std::vector<float> evicted_v;            // [n_evicted, n_kv_heads, head_dim]
    std::vector<int64_t> evicted_positions;  // [n_evicted]
  };
  void Grow(Layer& layer, int64_t min_capacity);
  [[nodiscard]] absl::Status CheckRows(const char* what, int layer, int64_t n, const float* k,
                                       const float* v, int64_t src_stride) const;
  void WindowedAppendRow(Layer& layer, int64_t position, const float* k, const float* v);

  int n_kv_heads_;
  int head_dim_;
  KvDType dtype_ = KvDType::kF32;
  std::vector<Layer> layers_;
  bool windowed_ = false;
  int64_t n_sink_ = 0;
  int64_t local_window_ = 0;
};

}  // namespace kvr::model
