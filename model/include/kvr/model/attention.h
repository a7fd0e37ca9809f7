#pragma once
// The attention seam of the model runtime.
//
// The forward pass computes Q, K and V for every layer, applies RoPE, stores K/V through a
// KvCache, and then hands the attention step to an `Attention` implementation together with a
// view of the KV rows the query may attend to. Dense attention (model/) attends to every row;
// sparse attention (retrieval/) selects rows through a retrieval index; the decode node's
// attention (decode-node/) sees only its resident rows (sinks + local window) and fetches the
// rest from the KV store. All of them implement this one interface.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "kvr/common/half.h"

namespace kvr::model {

// Identifies a running sequence inside one process (prefill or decode node, or `kvr generate`).
using SequenceId = uint64_t;

struct AttentionShape {
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // KV heads; n_heads % n_kv_heads == 0 (GQA group = n_heads / n_kv_heads)
  int head_dim = 0;
  float scale = 0.f;   // softmax scale, normally 1/sqrt(head_dim)
};

// The KV rows of one sequence and layer that are resident where the attention runs.
// Row r holds the key and value of token position `positions[r]`, or of position r when
// `positions` is empty (the common case: a dense cache holding positions [0, n_rows)).
// Keys have RoPE applied. Rows are float32 (k, v), or IEEE half (k_f16, v_f16, set instead of
// k and v) when the cache stores half (KvCache with KvDType::kF16). Implementations that take
// only float rows widen them (AsFloatView below).
struct KvView {
  const float* k = nullptr;  // [n_rows, n_kv_heads, head_dim], consecutive rows `row_stride` apart
  const float* v = nullptr;  // [n_rows, n_kv_heads, head_dim], same strides as k
  int64_t n_rows = 0;
  int64_t row_stride = 0;              // elements between row r and r+1 (>= n_kv_heads * head_dim)
  std::span<const int64_t> positions;  // [n_rows] or empty
  // Tokens in the sequence so far at this layer, including the queries' own tokens. May exceed
  // n_rows when some rows live elsewhere (a KV store).
  int64_t total_tokens = 0;
  // The rows in half, set instead of k and v when the cache stores half; same layout.
  const uint16_t* k_f16 = nullptr;
  const uint16_t* v_f16 = nullptr;
};

// `view` with float32 rows: itself when it has them, else its half rows widened into `scratch`
// (the rows [0, n_rows), same strides). For consumers that read float rows directly.
inline KvView AsFloatView(const KvView& view, std::vector<float>* scratch) {
  if (view.k != nullptr || view.k_f16 == nullptr || view.n_rows == 0) return view;
  const size_t n = static_cast<size_t>(view.n_rows * view.row_stride);
  scratch->resize(2 * n);
  for (size_t i = 0; i < n; ++i) (*scratch)[i] = Fp16ToFloat(view.k_f16[i]);
  for (size_t i = 0; i < n; ++i) (*scratch)[n + i] = Fp16ToFloat(view.v_f16[i]);
  KvView out = view;
  out.k = scratch->data();
  out.v = scratch->data() + n;
  out.k_f16 = out.v_f16 = nullptr;
  return out;
}

// One sequence's share of an attention call.
struct AttentionRequest {
  SequenceId sequence = 0;
  int layer = 0;
  // Queries are the tokens at positions first_position .. first_position + n_queries - 1.
  // Causal: query i attends to positions <= first_position + i.
  int64_t first_position = 0;
  int64_t n_queries = 0;
  const float* q = nullptr;  // [n_queries, n_heads, head_dim], RoPE applied
  KvView kv;
  float* out = nullptr;      // [n_queries, n_heads, head_dim]
};

// Computes softmax(q k^T * scale) v for a batch of sequences at one layer. Prefill calls it with
// one sequence and many queries; a decode step calls it once per layer with every running
// sequence and one query each, so that an implementation can batch its work (and its fetches)
// across sequences.
class Attention {
 public:
  virtual ~Attention() = default;
  [[nodiscard]] virtual absl::Status Attend(const AttentionShape& shape,
                                            std::span<const AttentionRequest> batch) = 0;
  // The sequence has finished; drop any per-sequence state (indexes, caches).
  virtual void Release(SequenceId sequence) {}
};

}  // namespace kvr::model
