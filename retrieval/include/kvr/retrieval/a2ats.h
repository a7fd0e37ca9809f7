#pragma once
// A2ATS retrieval index (He et al., section 4): one codeword id (u16) per token and KV head,
// against the shared query-aware codebooks of kvr/retrieval/codebook.h.
//
//   Build/Append: un-rotate each key to pre-RoPE (WRoPE keys carry no position) and assign it
//                 to the codeword nearest in the H-metric: argmin_c |k L - c^z|^2.
//   Select:       re-rotate each query head of the group from its position to the fixed offset b
//                 (WRoPE), score every codeword once (L dot products, not n), give each token
//                 its codeword's score and keep the top budget. Tokens inside the WRoPE window w
//                 are the local window, which the caller attends exactly (w <= local window).
//
// GQA (IndexParams::gqa): kSumSoftmax sums each head's softmax over the selectable tokens, which
// is exact over the quantised scores because a codeword's probability mass is its count times
// exp(score): log Z_h = logsumexp_c (s_h(c) + log count(c)). kMaxLogit / kSumLogit as named.
// Ties inside the last codeword that fits are broken toward the most recent tokens (nearer tokens
// tend to draw more attention, and the order is deterministic).
//
// Option a2ats.rerank = R (IndexParams::options, 0 = off, the default): the codeword ranking
// keeps R x budget tokens and their exact scores q.k pick the budget (the paper fetches the
// selected keys anyway; this reads R times as many). Measured at 8K, budget 243, 8K-token
// calibration (BENCHMARKS.md): recall 0.23 / 0.33 / 0.47 / 0.65 at R = 0 / 2 / 4 / 8. Off by
// default: the paper has no rerank, and R x budget key reads per step are the traffic the 2-byte
// summary exists to avoid. Codebooks from 24K calibration tokens with 2048 codewords instead of
// 8K with 1024 moved recall by +0.005 (0.225 -> 0.230): not the limit here either. The CPU index then keeps a copy of the keys
// (not counted in MemoryBytes, as for ctkvr: they are read where the KV lives) and the payload is
// version 2, with R and the keys.
//
// Summary bytes per token and KV head: 2 (the id). The codebooks (per model, not per sequence)
// are IndexParams::assets, an A2atsCodebooks; without them Make fails with FailedPrecondition.
// The payload records the codebooks' content hash: a decode node holding different codebooks
// refuses the ids instead of misreading them.
//
// Measured (2026-11-22, SmolLM2-135M Q4_1, 2048-token coreutils manual, `kvr eval retrieval`,
// budgets 64/128/256): recall vs exact 0.21/0.27/0.37, attention mass 0.82/0.85/0.88 (exact
// 0.89/0.92/0.95, streaming 0.70), with codebooks from 4-8K tokens of license text. Neither
// 1024 instead of 256 codewords nor b = 256 instead of 1024 moved recall by more than 0.01, so
// the limit is not codebook resolution or the offset. Likely causes (not yet isolated): one
// codeword id per token cannot order tokens inside a codeword, and the part of a 64-dim head's
// score carried by fast-rotating RoPE pairs is lost when WRoPE fixes the offset. The paper's setting (d = 128, theta 5e5, 80K calibration
// tokens of varied text, 4096 codewords at 16K-96K contexts) is kinder on all three counts.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

class ByteReader;

inline constexpr std::string_view kA2atsMethodName = "a2ats";

[[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> MakeA2atsIndex(
    const IndexShape& shape, const IndexParams& params);
[[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> DeserializeA2atsIndex(
    const IndexShape& shape, const IndexParams& params, int64_t size, ByteReader& payload);

// The state of an `a2ats` index, read through its type rather than its serialised bytes: what
// the GPU selector uploads beside the codebooks. Spans point into the index (valid while it
// lives and is not appended to). InvalidArgument for another method's index.
struct A2atsState {
  uint64_t codebook_hash = 0;  // A2atsCodebooks::content_hash of the codebooks it was built with
  int codebook_size = 0;       // codewords per KV head of its layer
  std::vector<std::span<const uint16_t>> ids;  // [n_kv_heads][size] codeword id per token
};
[[nodiscard]] absl::StatusOr<A2atsState> A2atsStateOf(const RetrievalIndex& index);

// The a2ats.rerank option of `params` (0 when absent); InvalidArgument for a bad value or an
// unknown a2ats.* option.
[[nodiscard]] absl::StatusOr<int> A2atsRerank(const IndexParams& params);

// The bytes SerializeIndex writes for an a2ats index right after its Build over `size` tokens,
// from codeword ids assigned elsewhere (the GPU's A2atsQuantise): `ids` [n_kv_heads][size], each
// below the codebook size of params.assets' codebooks for shape.layer. Without a2ats.rerank
// only (the rerank payload carries the keys): InvalidArgument when it is set.
[[nodiscard]] absl::StatusOr<std::vector<uint8_t>> SerializePrebuiltA2ats(
    const IndexShape& shape, const IndexParams& params, int64_t size,
    std::span<const std::span<const uint16_t>> ids);

}  // namespace kvr::retrieval
