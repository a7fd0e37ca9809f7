#pragma once
// The prefill node's request logic, free of gRPC server code: tokenize a
// prompt, run it through the model layer by layer, and per layer (as soon as the layer's last
// prefill chunk ran) build and serialise its retrieval index, cut out the sink and local-window
// rows for the decode node and start the put of all its K/V rows to the KV store, overlapped with
// the next layers' compute. Then sample the first token and hand header + layers to the decode
// node (or finish the request when the first token already ends it).
//
// The two remote parties are seams with fakes: the KV store is a
// kv_store::KvStoreClient (FakeKvStoreClient in tests) found through a StoreClients lookup, and
// the decode node is a HandoffSink opened through a HandoffOpener (a gRPC client-streaming
// DecodeService.Handoff call in kvr-prefill, a recorder in tests).
//
// Handoff order: the proto wants the header (which carries the first token) before any layer,
// and the first token exists only after the last layer ran; so serialised layers are kept until
// the first token is sampled and then written in one go. The store puts (the bulk of the bytes)
// do overlap with compute.
//
// The forward pass runs on a PrefillBackend (prefill_backend.h): the CPU Model or a CudaModel;
// the engine only sees per-layer float32 rows and queries (LayerTask), and puts the rows to the
// store in EngineOptions::store_dtype.
//
// Thread safety: Run may be called from many threads; the backend is used by one request at a
// time (the CPU model shares one thread pool, a CudaModel one stream), the others wait (their
// prompt tokens count as queued). Cancel may be called from any thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/cluster/v1/cluster.pb.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/lease_keeper.h"
#include "kvr/model/model.h"
#include "kvr/model/tokenizer.h"
#include "kvr/prefill_node/prefill_backend.h"
#include "kvr/retrieval/registry.h"

namespace kvr::prefill_node {

// A request's prompt, in one of the three forms of kvr.v1.GenerateRequest.
struct TextPrompt {
  std::string text;  // tokenized with the model's BOS handling
};
struct TokenPrompt {
  std::vector<int32_t> ids;  // used as is
};
struct ChatPrompt {
  std::vector<model::ChatMessage> messages;  // rendered with the model's chat template
};
using Prompt = std::variant<TextPrompt, TokenPrompt, ChatPrompt>;

// One Prefill call in domain terms. The proto messages kept here (sampling, retrieval, node
// references) are forwarded unchanged into the handoff header, so they stay protos.
struct PrefillJob {
  std::string request_id;
  uint64_t sequence_id = 0;
  // Chosen by the controller for this attempt: the store sequence is created with it, every
  // put presents it, and the handoff passes it to the decode node. Never logged.
  kv_store::Capability store_capability;
  std::string model;  // the served model name (forwarded to D)
  Prompt prompt;
  kvr::v1::SamplingParams sampling;    // controller defaults applied (max_tokens set)
  kvr::v1::RetrievalParams retrieval;  // controller defaults applied (method, budget, ...)
  kvr::cluster::v1::NodeRef decode;
  kvr::cluster::v1::NodeRef store;
  absl::Time deadline = absl::InfiniteFuture();
  google::protobuf::Timestamp deadline_proto;  // as received, forwarded to D
  // A sequence in `store` that holds the rows of the prompt's first prefix_tokens tokens
  // (PrefillRequest.prefix); prefix_tokens == 0: none. The new sequence is forked from it and
  // only the rest of the prompt is computed; if it is gone or shorter, what it lacks is
  // computed.
  kv_store::SequenceRef prefix;
  uint32_t prefix_tokens = 0;
  // How long the store keeps the sequence after the request ends well (passed to D).
  absl::Duration retain;
  google::protobuf::Duration retain_proto;

  [[nodiscard]] kv_store::SequenceRef store_ref() const { return {sequence_id, store_capability}; }
};

struct PrefillResult {
  uint32_t prompt_tokens = 0;
  std::string method;  // the retrieval method whose summaries were built ("full" when unset)
  int32_t first_token = 0;
  std::string first_text;
  // FINISH_REASON_UNSPECIFIED unless the first token ended the request (then no handoff).
  kvr::v1::FinishReason finish_reason = kvr::v1::FINISH_REASON_UNSPECIFIED;
  std::string matched_stop;
  absl::Duration prefill_time;
  // K/V bytes put to the store (in EngineOptions::store_dtype; bf16 for an fp8 store)
  uint64_t kv_bytes_shipped = 0;
  uint64_t handoff_bytes = 0;     // serialized handoff chunks (header + layers)
  uint32_t cached_tokens = 0;     // prompt tokens whose rows came from PrefillJob::prefix
  // With a reused prefix: layers whose retrieval summaries were the prefix's snapshot
  // extended by Append, and layers whose summaries were built from the rows instead (no
  // usable snapshot; summary_snapshot.h).
  uint32_t summary_layers_extended = 0;
  uint32_t summary_layers_rebuilt = 0;
};

// The client side of one DecodeService.Handoff stream. Write is called from one thread.
class HandoffSink {
 public:
  virtual ~HandoffSink() = default;
  // False when the stream broke (Finish then tells why).
  [[nodiscard]] virtual bool Write(const kvr::cluster::v1::HandoffChunk& chunk) = 0;
  // Half-closes the stream and returns the decode node's answer. When D blames another node
  // (the store it could not reach), the error carries that node's id as payload
  // "kvr-failed-node", which the engine reports instead of D's.
  [[nodiscard]] virtual absl::StatusOr<kvr::cluster::v1::HandoffResponse> Finish() = 0;
};

class HandoffOpener {
 public:
  virtual ~HandoffOpener() = default;
  // Opens a Handoff stream to `decode` under `deadline`.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<HandoffSink>> Open(
      const kvr::cluster::v1::NodeRef& decode, absl::Time deadline) = 0;
};

// Store clients by node: kvr-prefill keeps one UcxKvStoreClient per store address, and
// connects again when that store died or `store` names another instance of it.
class StoreClients {
 public:
  virtual ~StoreClients() = default;
  // The client for `store` (connecting on first use); the caller shares its ownership for as
  // long as it uses it. Errors are the store's failures (UNAVAILABLE: it cannot be reached,
  // or it is not the instance `store` names).
  [[nodiscard]] virtual absl::StatusOr<std::shared_ptr<kv_store::KvStoreClient>> Get(
      const kvr::cluster::v1::NodeRef& store) = 0;
};

// Hooks for metrics (the metrics helper plugs prometheus-cpp in here). All no-ops by default;
// called from request threads, concurrently: implementations must be thread-safe.
class PrefillObserver {
 public:
  virtual ~PrefillObserver() = default;
  // The prompt was tokenized and the request waits for (or gets) the model.
  virtual void OnQueued(uint32_t prompt_tokens) {}
  // One layer's summaries were built and its rows' put started.
  virtual void OnLayerReady(int layer, absl::Duration index_build, uint64_t summary_bytes,
                            uint64_t kv_bytes) {}
  // The request ended: OK with its result, or the error.
  virtual void OnFinished(const absl::Status& status, const PrefillResult* result,
                          absl::Duration total) {}
};

struct EngineOptions {
  // Prompt tokens per forward chunk (as `kvr generate`'s --prefill-chunk).
  int64_t chunk_tokens = 512;
  // The last N prefill queries per layer go into the index's Build (CTKVR needs them).
  int64_t max_prefill_queries = 512;
  // Lease of a new store sequence beyond the request's deadline. No request outlives its
  // deadline, and the decode node releases the sequence when it ends; the lease bounds the
  // leftovers of a node that died (a store started with evict_expired drops them).
  absl::Duration store_lease_margin = absl::Seconds(5);
  // While the node works on a sequence its store lease is at most this long and renewed
  // (kv_store::LeaseKeeper), so a node that dies leaves orphans for at most this long in a
  // store that evicts expired sequences; the decode node keeps renewing it after the handoff.
  // Zero: the lease runs to the deadline + store_lease_margin, unrenewed.
  absl::Duration store_lease = absl::Seconds(8);
  // Threads that build layers' indexes, pack their rows and start their puts (layers are
  // independent); 0: min(8, hardware threads).
  int layer_threads = 0;
  // Element type of the rows put to the store (the sequence is created with it): kF32 as the
  // model computes them, kBf16 rounded to nearest even (exact for a model whose KV is bf16,
  // half the bytes), or kFp8E4m3: the rows are put as bf16 and the store encodes them to
  // scaled fp8 rows (kvr/common/fp8.h; about a quarter of f32's bytes), and a reused prefix is
  // read back decoded. Any other dtype fails every request with INVALID_ARGUMENT. The
  // handoff's sink/local rows are float32 either way.
  kv_store::DType store_dtype = kv_store::DType::kF32;
  // Retrieval summaries of a reused prefix: kept with retained sequences and extended by
  // Append (summary_snapshot.h); false: rebuilt over the whole prompt, nothing kept.
  bool extend_summaries = true;
  // Method assets (A2ATS codebooks) for the indexes; may be null.
  std::shared_ptr<const retrieval::MethodAssets> method_assets;
  // Not owned; may be null.
  PrefillObserver* observer = nullptr;
};

class PrefillEngine {
 public:
  // Every pointer must outlive the engine. `tokenizer` may be null (token-id prompts only).
  // The CPU backend over `model`.
  PrefillEngine(const model::Model* model, const model::Tokenizer* tokenizer,
                const retrieval::MethodRegistry* registry, StoreClients* stores,
                HandoffOpener* handoff, EngineOptions options);
  // Any backend (MakeCpuPrefillBackend, CreateCudaPrefillBackend, a fake), owned by the engine.
  PrefillEngine(std::unique_ptr<PrefillBackend> backend, const model::Tokenizer* tokenizer,
                const retrieval::MethodRegistry* registry, StoreClients* stores,
                HandoffOpener* handoff, EngineOptions options);

  const PrefillBackend& backend() const { return *backend_; }

  // Runs one request. Errors: INVALID_ARGUMENT naming the field (prompt, token_ids, chat,
  // retrieval.method, ...), CANCELLED (Cancel or `client_gone`), DEADLINE_EXCEEDED, and
  // UNAVAILABLE for failures of D or S, whose node id FailedNodeOf(status) returns (the service
  // puts it in the trailing metadata "kvr-failed-node" so that the controller's retry avoids
  // that node). The store sequence is released on every error.
  [[nodiscard]] absl::StatusOr<PrefillResult> Run(const PrefillJob& job,
                                                  const std::function<bool()>& client_gone = {});

  // Cancels the running or queued request with this id; false when there is none.
  bool Cancel(const std::string& request_id);

  // Prompt tokens of requests queued or running (NodeLoad.queued_prefill_tokens).
  uint64_t queued_prompt_tokens() const { return queued_tokens_.load(); }

  // The node (D or S) that an error of Run belongs to, carried as a status payload; empty when
  // the failure is this node's own.
  static std::string FailedNodeOf(const absl::Status& status);

  // Tokenizes `prompt` as Run does (exposed for tests and `kvr generate` parity).
  [[nodiscard]] absl::StatusOr<std::vector<int32_t>> Tokenize(const Prompt& prompt) const;

 private:
  struct Running {
    std::atomic<bool> cancelled{false};
  };
  absl::StatusOr<PrefillResult> RunLocked(const PrefillJob& job, const std::vector<int32_t>& ids,
                                          Running& running, const std::function<bool()>& gone);

  std::unique_ptr<PrefillBackend> backend_;
  const model::Tokenizer* tokenizer_;
  const retrieval::MethodRegistry* registry_;
  StoreClients* stores_;
  std::unique_ptr<kv_store::LeaseKeeper> lease_keeper_;  // null when store_lease is zero
  HandoffOpener* handoff_;
  EngineOptions options_;

  absl::Mutex model_mu_;  // one request on the backend at a time
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Running>> running_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> queued_tokens_{0};
};

// Bytes of one handoff row: [n_kv_heads, 2 * head_dim] f32, [k | v] per head.
[[nodiscard]] size_t HandoffRowBytes(const model::ModelConfig& config);

// Copies rows `positions` of a dense layer view into handoff rows (see HandoffRowBytes).
void PackRows(const model::KvView& view, int n_kv_heads, int head_dim,
              std::span<const int64_t> positions, std::string* out);

}  // namespace kvr::prefill_node
