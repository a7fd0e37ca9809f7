#pragma once
// Domain types of the controller: what the gRPC layer converts protos into.
// Plain structs, no proto types, so that the logic classes and their tests stay free of gRPC.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvr::controller {

enum class NodeRole { kPrefill, kDecode, kStore };
absl::string_view NodeRoleName(NodeRole role);

struct RetrievalMethodInfo {
  std::string name;
  // Decode-node summary memory per context token (all layers and KV heads).
  double summary_bytes_per_token = 0;
};

struct ModelInfo {
  std::string name;
  uint32_t context_length = 0;
  // Store memory per token (all layers, K and V).
  uint64_t kv_bytes_per_token = 0;
  std::vector<RetrievalMethodInfo> retrieval_methods;
};

struct NodeEndpoints {
  std::string grpc_address;
  std::string ucx_worker_address;  // opaque bytes
  uint32_t metrics_port = 0;
};

struct NodeCapacity {
  uint64_t memory_bytes = 0;
  uint32_t batch_slots = 0;
  uint64_t max_queued_prefill_tokens = 0;  // 0 = no limit
  std::vector<ModelInfo> models;
};

struct NodeLoad {
  uint64_t queued_prefill_tokens = 0;
  uint32_t running_sequences = 0;
  uint64_t free_memory_bytes = 0;
};

struct NodeRegistration {
  NodeRole role = NodeRole::kPrefill;
  std::string name;
  // Random per node process (RegisterRequest.instance_id); "" when the node does not say.
  std::string instance_id;
  // RegisterRequest.host_id / needs_local_store: a decode node with needs_local_store is placed
  // only with a store of its host_id.
  std::string host_id;
  bool needs_local_store = false;
  NodeEndpoints endpoints;
  NodeCapacity capacity;
  NodeLoad load;
  // The node name the registering peer's certificate proved (kvr::PeerNodeIdentity), when the
  // controller checks node identities; "" when it does not. Heartbeats and deregistrations of
  // the node, and a registration that would replace it, must prove the same name.
  std::string identity;
};

// A copy of one live node's state, taken under the membership lock.
struct NodeSnapshot {
  std::string id;
  // Registration order; breaks placement ties deterministically.
  uint64_t serial = 0;
  NodeRegistration registration;
  // Load as last reported plus what the controller placed on the node since that report.
  NodeLoad effective_load;
  absl::Time lease_expiry;

  bool Serves(absl::string_view model) const;
};

struct ChatMessage {
  std::string role;
  std::string content;
};

// The prompt in one of its three forms.
using Prompt = std::variant<std::string, std::vector<uint32_t>, std::vector<ChatMessage>>;

struct SamplingParams {
  uint32_t max_tokens = 0;
  float temperature = 0;
  float top_p = 1;
  uint32_t top_k = 0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;
};

struct RetrievalParams {
  std::string method;
  uint32_t budget = 0;
  uint32_t n_sink = 0;
  uint32_t local_window = 0;
  std::map<std::string, std::string> options;
};

struct StreamOptions {
  bool skip_text = false;
  bool skip_token_ids = false;
  bool continuous_usage = false;
};

// A validated Generate request with every default applied.
struct GenerateParams {
  std::string request_id;
  std::string model;
  Prompt prompt;
  // Upper bound of the prompt's length in tokens: exact for token ids; for text, its UTF-8
  // byte count (byte-level BPE never makes more tokens than bytes) capped at the context
  // length. RequestRunner first has a prefill node tokenize text and chat prompts
  // (PrefillClient::Tokenize), which makes it exact; the byte bound is the fallback.
  uint64_t prompt_tokens_bound = 0;
  SamplingParams sampling;
  RetrievalParams retrieval;
  StreamOptions stream;
  // Re-prefill prompt + sent tokens elsewhere when a node dies mid-stream (GenerateRequest).
  bool resume_on_failure = false;
  // Prefix reuse scope (GenerateRequest.cache_salt) and whether this request takes part.
  std::string cache_salt;
  bool prefix_cache = true;
};

enum class FinishReason { kUnspecified, kEos, kStopString, kLength };

struct TokenChunk {
  std::vector<uint32_t> token_ids;
  std::string text;
};

struct RetrievalStats {
  uint64_t bytes_fetched = 0;
  uint64_t rows_fetched = 0;
  uint64_t hot_cache_hits = 0;
  uint64_t hot_cache_misses = 0;
  uint64_t bytes_shipped = 0;
};

// How a sequence ended, as the node that finished it reports.
struct Completion {
  FinishReason finish_reason = FinishReason::kUnspecified;
  std::string matched_stop;
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  // Prompt tokens whose KV was reused from a cached prefix.
  uint32_t cached_tokens = 0;
  RetrievalStats retrieval;
};

}  // namespace kvr::controller
