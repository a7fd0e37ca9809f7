#include "kvr/retrieval/rope.h"

#include <cmath>

namespace kvr::retrieval {

void ApplyRope(std::span<float> v, double position, const RopeParams& rope) {
  if (rope.style == RopeStyle::kNone || position == 0.0) return;
  const int head_dim = static_cast<int>(v.size());
  const int rot = rope.rotary_dim > 0 ? rope.rotary_dim : head_dim;
  const int half = rot / 2;
  for (int i = 0; i < half; ++i) {
    const double freq = std::pow(static_cast<double>(rope.theta), -2.0 * i / rot);
    const double angle = position * freq;
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    const int a = rope.style == RopeStyle::kAdjacentPairs ? 2 * i : i;
    const int b = rope.style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + half;
    const float x = v[a], y = v[b];
    v[a] = x * c - y * s;
    v[b] = x * s + y * c;
  }
}

}  // namespace kvr::retrieval
