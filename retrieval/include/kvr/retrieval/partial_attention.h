#pragma once
// Exact attention over a subset of rows, as partial results that merge by log-sum-exp.
//
// A partial result for one query head over a row set S is (o_S, lse_S) with
//   lse_S = log sum_{j in S} exp(s_j),  o_S = sum_{j in S} exp(s_j - lse_S) v_j,  s_j = scale q.k_j
// Two partials over disjoint sets merge into the partial over their union:
//   lse = logaddexp(lse_A, lse_B),  o = exp(lse_A - lse) o_A + exp(lse_B - lse) o_B
// which is exactly one softmax over A u B. The decode node merges its resident (sink + local)
// partial with the partial over fetched rows this way. An empty set is lse = -inf, o = 0.

#include <cstdint>
#include <span>

namespace kvr::retrieval {

// Partial attention of one query head over `n_rows` gathered rows.
// keys/values: row i at keys + rows[i] * row_stride (rows == empty -> row i is i).
struct PartialAttentionInput {
  const float* q = nullptr;       // [head_dim]
  const float* keys = nullptr;    // base of [n_rows_total, ..., head_dim] with this head's offset
  const float* values = nullptr;  // same layout as keys
  int64_t row_stride = 0;         // floats between rows
  std::span<const int64_t> rows;  // row indices to attend, or empty for [0, n_rows)
  int64_t n_rows = 0;             // used when `rows` is empty
  int head_dim = 0;
  float scale = 0.f;
};

// Writes o ([head_dim]) and returns lse. `scores_scratch` must hold the row count.
float AttendPartial(const PartialAttentionInput& in, float* out, std::span<float> scores_scratch);

// Merges partial (out_b, lse_b) into (out_a, lse_a) in place, for one head.
void MergeAttentionPartial(float* out_a, float* lse_a, const float* out_b, float lse_b,
                           int head_dim);

// Batched over n_heads: out_a [n_heads, head_dim], lse_a [n_heads] updated in place.
void MergeAttentionPartials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                            int n_heads, int head_dim);

}  // namespace kvr::retrieval
