#pragma once
// The controller's view of its prefill and decode nodes: two interfaces (real gRPC clients in
// grpc_node_clients.h, fakes in the tests), so that the request flow is tested without
// processes.
//
// Every call takes the request's absolute deadline, which becomes the downstream RPC's
// deadline, and a CancellationToken whose cancellation aborts the call in flight.

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvr/controller/cancellation.h"
#include "kvr/controller/prefix_cache.h"
#include "kvr/controller/types.h"

namespace kvr::controller {

// An error from a node may name another node as the one that failed (P could not reach D or
// S): the node id is carried as this payload of the absl::Status.
inline constexpr absl::string_view kFailedNodePayloadUrl = "type.kvr.dev/kvr.failed_node";
// The trailing-metadata key through which nodes report it over gRPC.
inline constexpr absl::string_view kFailedNodeMetadataKey = "kvr-failed-node";

struct PrefillCall {
  const GenerateParams* params = nullptr;
  // Fresh for every attempt (ids.h): the store sequence's id and its capability, which P and
  // then D present on every store call of the sequence.
  uint64_t sequence_id = 0;
  std::string sequence_capability;
  NodeSnapshot decode;
  NodeSnapshot store;
  absl::Time deadline = absl::InfiniteFuture();
  uint32_t attempt = 1;
  // A cached prefix of the prompt in `store` (PrefixCache); tokens == 0: none.
  PrefixMatch prefix;
  // How long the store keeps the sequence after the request ends well; zero: freed at once.
  absl::Duration retain;
};

struct PrefillResult {
  uint32_t prompt_tokens = 0;
  uint32_t first_token = 0;
  std::string first_text;
  // kUnspecified: decoding continues on D. Otherwise the first token ended the request.
  FinishReason finish_reason = FinishReason::kUnspecified;
  std::string matched_stop;
  absl::Duration prefill_time;
  uint64_t kv_bytes_shipped = 0;
  uint64_t handoff_bytes = 0;
  uint32_t cached_tokens = 0;
};

class PrefillClient {
 public:
  virtual ~PrefillClient() = default;
  [[nodiscard]] virtual absl::StatusOr<PrefillResult> Prefill(const NodeSnapshot& node,
                                                              const PrefillCall& call,
                                                              CancellationToken* cancel) = 0;
  // Best effort: tells the node to drop the sequence.
  [[nodiscard]] virtual absl::Status Cancel(const NodeSnapshot& node, absl::string_view request_id,
                                            uint64_t sequence_id, absl::string_view reason,
                                            absl::Time deadline) = 0;
  // The prompt of `params` (text or chat) as the node's tokenizer encodes it for Prefill.
  // INVALID_ARGUMENT is the prompt's fault (e.g. over the context); other errors the node's.
  // The default (clients that cannot tokenize) answers UNIMPLEMENTED.
  [[nodiscard]] virtual absl::StatusOr<std::vector<uint32_t>> Tokenize(
      const NodeSnapshot& node, const GenerateParams& params, absl::Time deadline) {
    return absl::UnimplementedError("Tokenize");
  }
};

class DecodeClient {
 public:
  virtual ~DecodeClient() = default;
  // Streams the sequence's tokens after the first: `on_chunk` gets each message's new tokens;
  // when it returns an error (the client went away) the call is cancelled and that error
  // returned. On success returns the final message's completion. A failure that the node
  // blames on another node (its store died) carries that node's id as the
  // kFailedNodePayloadUrl payload, as Prefill's do.
  [[nodiscard]] virtual absl::StatusOr<Completion> Stream(
      const NodeSnapshot& node, absl::string_view request_id, uint64_t sequence_id,
      absl::Time deadline, CancellationToken* cancel,
      absl::FunctionRef<absl::Status(const TokenChunk&)> on_chunk) = 0;
  [[nodiscard]] virtual absl::Status Cancel(const NodeSnapshot& node, absl::string_view request_id,
                                            uint64_t sequence_id, absl::string_view reason,
                                            absl::Time deadline) = 0;
};

}  // namespace kvr::controller
