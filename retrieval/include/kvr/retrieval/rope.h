#pragma once
// Rotary position embedding on single head vectors, matching the runtime's convention
// (IndexShape::rope). Used by methods that need position-free keys (A2ATS: un-rotate a stored
// key with position -p, rotate a query to the fixed offset b) and by tests.

#include <cstdint>
#include <span>

#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

// Rotates `v` ([head_dim]) in place by angle position * theta^(-2i/rotary_dim) for pair i.
// A negative `position` applies the inverse rotation (un-rotates a vector rotated by -position).
// Angles are computed in double so that un-rotating at positions ~1e5 stays within float eps.
void ApplyRope(std::span<float> v, double position, const RopeParams& rope);

}  // namespace kvr::retrieval
