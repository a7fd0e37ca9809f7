#pragma once
// Replayed selections for benchmarks (SparseDecodeOptions::replay): what a real model's
// retrieval method selected at each step of a free decoding (recorded by `kvr eval retrieval
// --trace-dir` on SmolLM2), mapped onto a longer context and a larger model's layers and KV
// heads, so that the hot cache and the gather of a synthetic-weight benchmark see a real
// model's step-to-step reuse instead of random selections.
//
// The mapping of one (step, layer, KV head): each recorded position p (ascending, at or after
// the recorded candidates' begin) becomes the run of `run` consecutive rows starting at
// begin + (p - trace_begin) * run of the replaying slot's candidates [begin, end), pushed past
// the previous run's end so that ids stay distinct and ascending, cut at `end` and at the
// slot's budget. The scale is fixed (not the ratio of the two candidate ranges, which moves
// every step and would shift every run by several rows a step, destroying the reuse being
// replayed). A recording at budget b of context c replays budget b * run at context ~c * run:
// the same share of the context, each selected token standing for `run` neighbours (which makes
// the replayed selections runs of rows, as quest's pages are).
//
// Plain C++ (no CUDA types): ReplayHeadIds is the CPU reference of the replay kernel, which the
// GPU tests compare with it.

#include <cstdint>
#include <vector>

namespace kvr::retrieval::cuda {

// A recording, already mapped to the replaying model's layers and KV heads (the caller picks
// which recorded layer and head stands for each).
struct SparseSelectionReplay {
  int n_steps = 0;
  int n_layers = 0;      // the replaying model's
  int n_kv_heads = 0;    // the replaying model's
  int trace_budget = 0;  // ids per (step, layer, head) at most
  int run = 1;           // rows replayed per recorded position
  int32_t trace_begin = 0;  // the recorded candidates' first position (the recording's sinks)
  // 0: each recorded position stands for `run` consecutive rows. > 0: for the `run` rows
  // begin + rel + k * scatter (k < run, rel = p - trace_begin < scatter): as many rows, each in
  // another part of the context, so that the fetched rows lie one by one across the store's
  // pages (a real model's clusters) instead of in runs. Same reuse either way.
  int32_t scatter = 0;
  // Slot s replays the recording of model layer (l + s) mod n_layers and KV head
  // (h + s) mod n_kv_heads for (l, h): a batch's sequences select different rows, as real
  // sequences do (a benchmark's slots may share one store sequence, where identical selections
  // would also share every row's address translation).
  bool rotate_slots = false;
  // [n_steps, n_layers, n_kv_heads]: recorded ids per head; [.., trace_budget]: the ids,
  // ascending.
  std::vector<int32_t> counts;
  std::vector<int32_t> ids;
};

// Writes the replayed ids of one (step, layer, head) for candidates [begin, end) and `budget`
// ids at most; returns how many. `recorded` holds `n` ascending positions. scatter > 0: see
// SparseSelectionReplay::scatter (k-major, so ascending; positions at or past trace_begin +
// scatter are left out).
inline int ReplayHeadIds(const int32_t* recorded, int n, int32_t trace_begin, int run,
                         int32_t begin, int32_t end, int budget, int32_t* out,
                         int32_t scatter = 0) {
  if (end <= begin || run < 1) return 0;
  int written = 0;
  if (scatter > 0) {
    for (int k = 0; k < run; ++k) {
      for (int i = 0; i < n && written < budget; ++i) {
        const int64_t rel = recorded[i] > trace_begin ? recorded[i] - trace_begin : 0;
        const int64_t t = begin + rel + int64_t{k} * scatter;
        if (rel >= scatter || t >= end) break;
        out[written++] = static_cast<int32_t>(t);
      }
    }
    return written;
  }
  int64_t next = begin;  // the first id the next run may take
  for (int i = 0; i < n && written < budget; ++i) {
    const int64_t rel = recorded[i] > trace_begin ? recorded[i] - trace_begin : 0;
    int64_t start = begin + rel * run;
    if (start < next) start = next;
    if (start >= end) break;
    for (int64_t t = start; t < start + run && t < end && written < budget; ++t) {
      out[written++] = static_cast<int32_t>(t);
    }
    next = start + run;
  }
  return written;
}

}  // namespace kvr::retrieval::cuda
