#pragma once
// ParisKV (Qi et al., "ParisKV: Fast and Drift-Robust KV-Cache Retrieval for Long-Context LLMs"):
// data-independent summaries of every key, so appended (generated) keys never make a learned
// structure stale.
//
// Per key (section 4.1): normalise, rotate by a shared seeded SRHT (Hadamard of size
// P = next pow2 >= head_dim), split into B = P / m subspaces of m dims, and keep per subspace a
// 4-bit code per coordinate (1 sign + 3 magnitude bits; the sign bits double as the id of the
// nearest of the 2^m sign-pattern centroids) and one fp16 scale weight w_b = |k| r_b / alpha_b.
// Summary size per token and KV head: P/2 + 2B bytes (48 bytes for head_dim 64, against 256
// bytes of fp16 K+V).
//
// Per decode query (section 4.2.2):
//   1. Collision voting: in each subspace, rank the 2^m centroids by <q_b, centroid>; keys whose
//      centroid falls in the top-rho fraction of keys earn a multi-tier bonus (6 tiers: 6..1).
//      Bonuses are summed over subspaces (and over the query heads of the GQA group), and the
//      top beta fraction of tokens by that integer score become candidates.
//   2. Rerank: estimate <k, q> from the codes and weights (eq. 10) for each candidate and keep the
//      top `budget`, combining the group's heads as IndexParams::gqa says.
//
// Options (IndexParams::options, all optional; names of other methods' options, "<method>.x",
// are ignored, unknown "pariskv.*" names are an error):
//   pariskv.subspace_dim     m in {2, 4, 8}; default 8 (paper: m = 8, B = 16 at head_dim 128;
//                            at head_dim 64 that gives B = 8; m = 4 keeps B = 16 votes but with
//                            16-direction codebooks and measured 0.03 lower recall at 8K).
//   pariskv.tiers            bonus tiers in [1, 32]; default 6 (paper section 5.4).
//   pariskv.candidate_ratio  beta in (0, 1]; default: scheduled by context length (below).
//   pariskv.collision_ratio  rho in (0, 1]; default: scheduled (below).
//   pariskv.min_candidates_per_budget  C >= this * budget; default 16.
// Schedule (paper: beta typically 5-10%, "the required ratio decreases as KV grows"; Recall@100
// at beta = 0.10 rises from 61% at 5K to 84% at 100K tokens): beta = 0.10 up to 16K candidate
// tokens, falling log-linearly to 0.05 at 128K and staying there. Our 4K-8K contexts sit at the
// short end, where the paper's own numbers say a small beta loses recall, so C is also kept at
// least 16x the budget: the paper's pool is beta n against k = 100, i.e. 15-50x k at its 30K-100K
// contexts (where its Recall@100 is 80-84%), while beta = 0.10 at 8K with a 243-token budget is
// only 3.3x. Measured at 8K (BENCHMARKS.md): recall at budget 243 is 0.76 / 0.88 / 0.92 with C >=
// 4 / 8 / 16 x budget and 0.92 when every token is reranked (the limit of the 4-bit estimate);
// at budget 81, 0.80 / 0.80 / 0.85. At budgets above n / 16 the pool is every candidate. rho = min(1, T beta) with T tiers (2 beta for T = 1): rho >= beta as the
// paper requires; each tier then covers about beta * n keys (see ScheduleParisKv for the
// measurement behind it).

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

class ByteReader;

inline constexpr std::string_view kParisKvMethodName = "pariskv";

struct ParisKvOptions {
  int subspace_dim = 8;
  int tiers = 6;
  double candidate_ratio = 0;  // 0 = scheduled
  double collision_ratio = 0;  // 0 = scheduled
  int min_candidates_per_budget = 16;
};

// Parses the "pariskv.*" entries of `params.options` (see above).
[[nodiscard]] absl::StatusOr<ParisKvOptions> ParseParisKvOptions(const IndexParams& params);

// Candidate-set size C and collision ratio rho for `n_candidates` selectable tokens and a
// `budget` (C >= budget; C == n_candidates when the budget covers them all).
struct ParisKvSchedule {
  int64_t n_candidates = 0;    // C
  double collision_ratio = 0;  // rho
};
ParisKvSchedule ScheduleParisKv(const ParisKvOptions& options, int64_t n_selectable,
                                int64_t budget);

// Factory and deserializer with the signatures MethodRegistry expects.
[[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> MakeParisKvIndex(
    const IndexShape& shape, const IndexParams& params);
[[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> DeserializeParisKvIndex(
    const IndexShape& shape, const IndexParams& params, int64_t size, ByteReader& payload);

// The state of a `pariskv` index, read through its type rather than its serialised bytes: what
// the GPU selector uploads. Spans point into the index (valid while it lives and is not appended
// to). InvalidArgument for another method's index.
struct ParisKvState {
  int subspace_dim = 0, padded_dim = 0;
  uint64_t rotation_seed = 0;
  std::vector<float> levels;  // the magnitude levels (8)
  struct Head {
    std::span<const uint8_t> codes;     // [size, padded_dim / 2], two 4-bit codes per byte
    std::span<const uint16_t> weights;  // [size, padded_dim / subspace_dim] fp16
    std::span<const uint32_t> counts;   // [padded_dim / subspace_dim, 2^subspace_dim]
  };
  std::vector<Head> heads;  // [n_kv_heads]
};
[[nodiscard]] absl::StatusOr<ParisKvState> ParisKvStateOf(const RetrievalIndex& index);

// The bytes SerializeIndex writes for a pariskv index right after its Build over `size` tokens,
// from codes and weights encoded elsewhere (the GPU's ParisKvEncode with the codec of an index
// made for `shape` and `params`): per KV head `codes` [size, P / 2] and `weights` [size, B] as
// in ParisKvState. InvalidArgument naming the head and array whose size does not fit.
struct PrebuiltParisKvHead {
  std::span<const uint8_t> codes;
  std::span<const uint16_t> weights;
};
[[nodiscard]] absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltParisKv(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const PrebuiltParisKvHead> heads);

}  // namespace kvr::retrieval
