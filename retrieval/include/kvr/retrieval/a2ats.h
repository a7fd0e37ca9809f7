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
// Summary bytes per token and KV head: 2 (the id). The codebooks (per model, not per sequence)
// are IndexParams::assets, an A2atsCodebooks; without them Make fails with FailedPrecondition.
// The payload records the codebooks' content hash: a decode node holding different codebooks
// refuses the ids instead of misreading them.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval {

class ByteReader;

inline constexpr std::string_view kA2atsMethodName = "a2ats";

[[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> MakeA2atsIndex(
    const IndexShape& shape, const IndexParams& params);
[[nodiscard]] absl::StatusOr<std::unique_ptr<RetrievalIndex>> DeserializeA2atsIndex(
    const IndexShape& shape, const IndexParams& params, int64_t size, ByteReader& payload);

}  // namespace kvr::retrieval
