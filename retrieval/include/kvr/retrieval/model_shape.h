#pragma once
// The retrieval index shape of a model's layer, as every node and tool that builds or reads a
// model's indexes derives it from the model's config.

#include "kvr/model/config.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// Layer `layer` of a model with config `c`: its heads and layers, and the runtime's RoPE
// (Hugging Face rotate-half for every architecture) with the config's theta.
[[nodiscard]] inline IndexShape IndexShapeOf(const model::ModelConfig& c, int layer) {
  IndexShape shape;
  shape.n_heads = c.n_heads;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  shape.layer = layer;
  shape.n_layers = c.n_layers;
  shape.rope = {RopeStyle::kHalfSplit, c.rope_theta, 0};
  return shape;
}

}  // namespace kvr::retrieval
