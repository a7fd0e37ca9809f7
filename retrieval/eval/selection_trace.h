#pragma once
// Selection traces: what a retrieval method selected at every step of a free greedy decoding,
// per layer and KV head, as `kvr eval retrieval --trace-dir` records them on a real model.
// `kvr bench decode --replay` replays them on the GPU decode path
// (kvr/retrieval/cuda/selection_replay.h), so that its hot cache sees a real model's
// step-to-step reuse.
//
// File format (little-endian): "KVRSELT1"; u32 length + bytes of the method name; i32 n_layers,
// n_kv_heads, budget, n_sink, local_window; i64 prompt_tokens; u32 n_steps; then per step: i64
// position (of the decoded token; candidates are [n_sink, position + 1 - local_window)) and per
// (layer, KV head), layer-major: u32 count, count x i32 ids (ascending).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvr::retrieval::eval {

struct SelectionTrace {
  std::string method;
  int32_t n_layers = 0, n_kv_heads = 0, budget = 0, n_sink = 0, local_window = 0;
  int64_t prompt_tokens = 0;
  struct Step {
    int64_t position = 0;
    std::vector<std::vector<int32_t>> heads;  // [layer * n_kv_heads + kv head]: ascending ids
  };
  std::vector<Step> steps;

  // The step's candidates [begin, end) as the evaluator's selection saw them.
  int64_t CandidatesBegin() const { return n_sink; }
  int64_t CandidatesEnd(const Step& s) const {
    const int64_t end = s.position + 1 - local_window;
    return end > n_sink ? end : n_sink;
  }
};

[[nodiscard]] absl::Status WriteSelectionTrace(const std::string& path, const SelectionTrace& t);
// InvalidArgument naming the file and what is wrong (magic, truncation, counts above the
// budget, ids outside [0, position) or not ascending).
[[nodiscard]] absl::StatusOr<SelectionTrace> ReadSelectionTrace(const std::string& path);

}  // namespace kvr::retrieval::eval
