#pragma once
// The retrieval index shape of a model's layer, as every node and tool that builds or reads a
// model's indexes derives it from the model's config.

#include "kvr/model/config.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// The runtime's RoPE as the indexes describe it: Hugging Face rotate-half pairs for every
// architecture, the config's theta, every dimension rotated. (Frequency scaling is not in it:
// RopeParams has no field for it; the keys the indexes see are rotated already.)
[[nodiscard]] inline RopeParams RuntimeRope(const model::ModelConfig& c) {
  return {RopeStyle::kHalfSplit, c.rope_theta, 0};
}

// Layer `layer` of a model with config `c`: its heads and layers, and the runtime's RoPE.
[[nodiscard]] inline IndexShape IndexShapeOf(const model::ModelConfig& c, int layer) {
  IndexShape shape;
  shape.n_heads = c.n_heads;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  shape.layer = layer;
  shape.n_layers = c.n_layers;
  shape.rope = RuntimeRope(c);
  return shape;
}

}  // namespace kvr::retrieval
