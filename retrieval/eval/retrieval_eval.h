#pragma once
// `kvr eval retrieval`: how close each retrieval method comes to full attention on a real
// model's KV.
//
// For every context length: the prompt (natural text, or a generated passkey prompt) is
// prefilled once with dense attention; then every (method, budget) runs the same teacher-forced
// continuation as its own sequence (batched over budgets, so the dense layers read the weights
// once per step), with SparseAttention doing the decode attention. At every decode step and
// layer the evaluator also computes dense attention over the same KV and the exact oracle's
// selection, and records:
//   recall@k       |selected ∩ oracle top-k| / |oracle top-k| (per KV head, same candidates)
//   mass           softmax mass of the attended rows (sink ∪ local ∪ selected), per query head
//   rel_error      |o_sparse - o_dense| / |o_dense| of the attention output, per query head
//   nll / delta    mean -log p(next true token), and its difference to the dense run
//   agreement      fraction of steps whose argmax equals the dense run's argmax (teacher-forced
//                  on the same prefix: one flipped token does not cascade into the next ones)
//   free_agreement free (greedy, not teacher-forced) decoding of `free_tokens` tokens from the
//                  same prefill: fraction of positions whose token equals dense greedy decoding's
//                  (after a divergence the texts differ, so this is the cascaded measure)
//   free_prefix    tokens of that free decoding equal to dense's before the first difference
//   hot_hit_rate   the GPU decode path's hot cache replayed on that free decoding's selections
//                  (hot_cache_rows per layer and KV head, 8-way sets, LRU per step; cold at
//                  the first step): the share of selected rows that would not cross the link
//   step_overlap   share of a step's selected rows that the previous step selected too
//   bytes/token/head   summary bytes (RetrievalIndex::MemoryBytes) per token per KV head,
//                      against K+V bytes per token per head (fp16: 4 * head_dim)
//   select_us      time in RetrievalIndex::Select per (layer, decode step), all KV heads
// With several --row-format values every (method, budget) also runs once per format: the rows a
// decode step fetches from the store (the selected rows; not the resident sinks and local
// window, not the keys the summaries are built from) as the cache holds them ("cache"), rounded
// to bf16, or through fp8 e4m3 with a scale per (row, KV head) (kvr/common/fp8.h). Every
// metric still compares with dense attention over the cache's rows, so a format's cost is its
// row's difference to the "cache" (or "bf16") row of the same method and budget; and two direct
// comparisons with the run of the first format listed (same method and budget):
//   base_agreement       teacher-forced steps whose argmax equals that run's
//   base_free_agreement  freely decoded tokens equal to that run's, position by position
// Passkey prompts additionally report whether the teacher-forced argmax reproduces every token
// of the key (passkey_ok).
// With thin_keep, every prompt also runs thinned-prefix rows (thinned_prefix.h): per kept
// fraction, the prompt's rows thinned at page granularity as the KV store thins a cached
// prefix (method "thin-kd", and "thin-rnd" for a random choice of as many pages with
// thin_random), then the same teacher-forced and free continuations with dense attention over
// the kept rows. Such a row's budget is its mean kept prompt rows per (layer, KV head),
// kept_fraction their share, mass the dense softmax mass on the kept rows, rel_error the
// output's error against dense attention over every row, intact_rows the rows before the first
// hole of any (layer, KV head) (what the prefill node reuses of such a prefix); recall does
// not apply (-1).

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr
namespace kvr::model {
struct LoadedModel;
}  // namespace kvr::model

namespace kvr::retrieval::eval {

struct EvalOptions {
  std::vector<int64_t> contexts = {2048};  // prefill lengths
  std::vector<int64_t> budgets = {64, 128, 256, 512};
  // Registered names, or "name:opt=v[,opt=v]" variants (options for that row only, on top of
  // method_options; the row is labelled with the whole spec). Empty: every registered method.
  std::vector<std::string> methods;
  int64_t steps = 64;                // teacher-forced decode steps
  int64_t free_tokens = 128;         // greedy tokens decoded freely per run; 0: no free decoding
  int64_t hot_cache_rows = 0;        // replayed hot cache per (layer, KV head); 0: the budget
  // When set: every free decoding's selections are written to
  // <trace_dir>/<prompt>_<context>_<method>_<budget>.kvrsel (selection_trace.h), for
  // `kvr bench decode --replay`.
  std::string trace_dir;
  int64_t n_sink = 16;
  int64_t local_window = 128;
  std::vector<std::string> text_files;  // natural text; empty: license texts
  bool passkey = false;                 // also run a passkey prompt per context
  std::string a2ats_codebooks;          // codebook file for a2ats ("" skips a2ats)
  std::map<std::string, std::string, std::less<>> method_options;  // IndexParams::options
  uint64_t seed = 7;
  int64_t prefill_chunk = 512;
  // Formats of the fetched rows, each run beside the others: "cache", "bf16", "fp8".
  std::vector<std::string> row_formats = {"cache"};
  // Thinned-prefix runs: kept fractions of every (layer, KV head)'s prompt pages (empty: none).
  std::vector<double> thin_keep;
  int64_t thin_page_rows = 128;  // rows per store page (64 KiB of SmolLM2's f32 rows)
  bool thin_random = false;      // also a random choice of as many pages (a control)
};

struct EvalRow {
  std::string prompt;  // "text" or "passkey"
  int64_t context = 0;
  std::string method;
  int64_t budget = 0;
  std::string row_format = "cache";  // of the fetched rows (EvalOptions::row_formats)
  double fetched_row_bytes = 0;      // one fetched [k | v] row of one KV head in that format
  int64_t steps = 0;
  double recall = 0, mass = 0, rel_error = 0;
  double nll = 0, nll_delta = 0, agreement = 0;
  double summary_bytes_per_token_head = 0;
  double kv_bytes_per_token_head = 0;  // fp16 K+V
  double select_us = 0;
  double build_s = 0;   // total Build/Append seconds over all layers
  int passkey_ok = -1;  // -1: not a passkey prompt
  int64_t free_tokens = 0;      // tokens decoded freely (0: not run)
  double free_agreement = 0;    // fraction equal to dense greedy, position by position
  int64_t free_prefix = 0;      // equal tokens before the first difference
  int64_t hot_cache_rows = 0;   // as EvalOptions (0: the budget)
  double hot_hit_rate = 0;      // free decoding's selections through the replayed hot cache
  double step_overlap = 0;      // free decoding: selected rows also selected the step before
  // Against the run with the first EvalOptions::row_formats entry (1 for that run itself).
  double base_agreement = 1;
  double base_free_agreement = 1;
  double kept_fraction = -1;  // thinned-prefix rows: share of prompt rows kept (-1: not one)
  int64_t intact_rows = -1;   // thinned-prefix rows: rows before the first hole of any head
};

using Progress = std::function<void(const std::string&)>;

// Runs the evaluation on `loaded` (which must have a tokenizer).
[[nodiscard]] absl::StatusOr<std::vector<EvalRow>> RunRetrievalEval(
    const EvalOptions& options, const kvr::model::LoadedModel& loaded, ThreadPool* pool,
    const Progress& progress);

// A fixed-width table, one row per (prompt, context, method, budget).
std::string FormatTable(const std::vector<EvalRow>& rows);
// JSON document {"options": ..., "rows": [...]}.
std::string ToJson(const EvalOptions& options, const std::vector<EvalRow>& rows);

}  // namespace kvr::retrieval::eval
