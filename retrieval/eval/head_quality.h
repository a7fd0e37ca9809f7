#pragma once
// The per-query-head steps that the eval's measuring attentions share (MeasuringAttention of
// `kvr eval retrieval`, MaskedAttention of `--thin-keep`): one query head's dense logits, a
// weighted sum of value rows, and the quality of an attention's output against dense
// attention's.

#include <cstdint>
#include <span>

#include "kvr/model/attention.h"

namespace kvr::retrieval::eval {

// logits[t] = scale * q_h . k_t for t < logits.size(): query head `h` of `r` against the keys
// of its KV head in rows 0.. of r.kv (float rows).
void HeadLogits(const kvr::model::AttentionShape& shape, const kvr::model::AttentionRequest& r,
                int h, std::span<float> logits);

// out[d] = sum_t weights[t] * v_t[d] for d < head_dim: the values of KV head `kvh` in rows
// t < weights.size() of r.kv (float rows), weighted. out: [head_dim], overwritten.
void WeightedValues(const kvr::model::AttentionRequest& r, int kvh, int head_dim,
                    std::span<const float> weights, float* out);

// Sums over query-head samples of how close an attention came to dense attention.
struct HeadQuality {
  double mass = 0;       // dense softmax mass on the rows it attended to, each capped at 1
  double rel_error = 0;  // |out - dense| / |dense| of its output (0 where dense is 0)
  int64_t head_samples = 0;

  // Adds one query head: `mass`, and the error of `out` against `dense` (both [head_dim]).
  void Add(double head_mass, const float* out, std::span<const float> dense);
};

}  // namespace kvr::retrieval::eval
