#pragma once
// DecodeEngine: the decode node's continuous-batching loop, independent of gRPC.
//
// Sequences arrive by Admit (a prefill node's handoff, converted to `Handoff`), wait for a
// batch slot, join the running batch between steps, and leave it between steps when they
// finish (EOS, stop string, max_tokens, context length), are cancelled, pass their deadline or
// fail. One thread (Start) drives the backend's forward pass over the running batch
// (backend.h: the CPU Model with DecodeAttention, or CudaModel sparse sequences); each step
// feeds every running sequence's last token and samples its next one.
//
// Output: the tokens and text a sequence generated are buffered (at most max_tokens) until a
// reader takes them with Next (the service's Stream); the final Next returns the completion.
//
// Thread safety: Admit, Next, Cancel and the load accessors may be called from any thread;
// the loop thread owns the model state of running sequences.

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/decode/backend.h"
#include "kvr/decode/decode_attention.h"
#include "kvr/decode/observer.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/lease_keeper.h"
#include "kvr/model/kv_cache.h"
#include "kvr/model/model.h"
#include "kvr/model/sampler.h"
#include "kvr/model/tokenizer.h"
#include "kvr/retrieval/registry.h"

namespace kvr::decode {

struct SamplingSettings {
  uint32_t max_tokens = 16;  // the first token (sampled by the prefill node) counts
  float temperature = 0.f;
  float top_p = 1.f;
  uint32_t top_k = 0;  // 0: off
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
};

// One layer of a handoff: summaries and sink/local rows [n, n_kv_heads, 2 * head_dim] f32.
struct HandoffLayerData {
  int layer = 0;
  std::string summaries;  // SerializeIndex bytes, or empty (`full` without summaries)
  std::string sink_kv;
  std::vector<int64_t> sink_positions;
  std::string local_kv;
  std::vector<int64_t> local_positions;
};

struct Handoff {
  std::string request_id;
  uint64_t sequence_id = 0;  // also the store's sequence id
  // The store sequence's capability (HandoffHeader.sequence_capability): every store call of
  // the sequence presents it. Never logged.
  kv_store::Capability store_capability;
  std::string model;
  SamplingSettings sampling;
  std::string method = "full";
  int64_t budget = 256;
  int64_t n_sink = 16;
  int64_t local_window = 256;
  std::map<std::string, std::string, std::less<>> options;  // method options
  kv_store::KvStoreClient* store = nullptr;
  // Keeps `store` alive while the sequence lives (the node's client cache may drop the client
  // meanwhile, when the store dies); null when the caller guarantees the lifetime itself.
  std::shared_ptr<kv_store::KvStoreClient> store_owner;
  absl::Time deadline = absl::InfiniteFuture();
  int64_t prompt_tokens = 0;
  int32_t first_token = 0;
  std::string text_so_far;
  std::string pending_utf8;
  // How long the store keeps the sequence after it ends well, for later requests that share
  // its prefix (HandoffHeader.retain); zero: released at once.
  absl::Duration retain;
  std::vector<HandoffLayerData> layers;

  [[nodiscard]] kv_store::SequenceRef store_ref() const { return {sequence_id, store_capability}; }
};

enum class FinishReason { kNone, kEos, kStopString, kLength };

struct CompletionInfo {
  FinishReason reason = FinishReason::kNone;
  std::string matched_stop;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // the first token included
  std::string method;
  int64_t budget = 0;
  RetrievalCounters retrieval;
};

// What Next returns: tokens/text since the previous call; `completion` on the last one.
struct StreamChunk {
  std::vector<int32_t> tokens;
  std::string text;
  std::optional<CompletionInfo> completion;
};

struct EngineOptions {
  std::string model_name;  // handoffs for another model are refused
  int batch_slots = 8;     // most sequences per step
  int max_waiting = 64;    // most sequences waiting for a slot
  // The CPU backend's (Create with a model); a backend passed to Create has its own.
  int64_t hot_cache_bytes = 64 << 20;
  int64_t memory_bytes = 1ll << 30;  // summary + resident KV memory offered to the controller
  // Fraction of (step, sequence, layer) compared with the exact oracle (DecodeAttention).
  double quality_sample_rate = 0;
  // Method assets (A2ATS codebooks) the handed-off indexes are deserialised with; may be null.
  std::shared_ptr<const retrieval::MethodAssets> method_assets;
  // A finished sequence whose output no Stream collected is dropped after this long.
  absl::Duration unclaimed_ttl = absl::Seconds(60);
  // While a sequence is here (waiting or running) its store lease is kept at this length and
  // renewed (kv_store::LeaseKeeper): if this node dies, a store that evicts expired sequences
  // frees them within it. Zero: leases are left as the prefill node set them.
  absl::Duration store_lease = absl::Seconds(8);
};

class DecodeEngine {
 public:
  // The CPU backend over `model` (MakeCpuDecodeBackend with the options' hot_cache_bytes,
  // quality_sample_rate and method_assets). `model`, `registry` and `observer` must outlive the
  // engine; `tokenizer` and `observer` may be null (no text, no stop strings / no reports).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<DecodeEngine>> Create(
      const model::Model* model, const model::Tokenizer* tokenizer,
      const retrieval::MethodRegistry* registry, EngineOptions options,
      DecodeObserver* observer = nullptr);
  // Any backend (owned).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<DecodeEngine>> Create(
      std::unique_ptr<DecodeBackend> backend, const model::Tokenizer* tokenizer,
      EngineOptions options, DecodeObserver* observer = nullptr);
  ~DecodeEngine();  // stops the loop; releases every sequence in its store

  // Starts / stops the loop thread. Without Start, tests drive the loop with Step().
  void Start();
  void Stop();

  // Checks the handoff and queues the sequence. InvalidArgument names what is wrong;
  // AlreadyExists for a known sequence id; ResourceExhausted when the waiting queue is full.
  [[nodiscard]] absl::Status Admit(Handoff handoff);

  // Output of the sequence since the previous call, waiting until there is some or
  // `wait_until` passes (then an empty chunk). After the chunk carrying the completion (or an
  // error status) the sequence is forgotten. NotFound: no such sequence (no handoff arrived,
  // or it was already collected). Errors: the sequence's failure (Cancelled, DeadlineExceeded,
  // or the decode error).
  [[nodiscard]] absl::StatusOr<StreamChunk> Next(uint64_t sequence_id, absl::Time wait_until);
  // True while the engine holds the sequence (waiting, running or finished but not collected).
  bool Has(uint64_t sequence_id) const;
  // Drops the sequence within one step (slot, hot-cache rows, store sequence). False when the
  // engine holds nothing for it.
  bool Cancel(uint64_t sequence_id, const std::string& reason);

  // One loop iteration: drops ended sequences, admits waiting ones, runs one step. Returns
  // false when there was nothing to run. For tests (and the loop thread).
  bool Step();

  // Summary bytes of a running sequence. Loop thread only (or while the loop is not started).
  int64_t SummaryBytes(uint64_t sequence_id) const { return backend_->SummaryBytes(sequence_id); }

  int running_sequences() const;  // running + waiting
  int64_t free_memory_bytes() const;
  NodeCounters node_counters() const;
  const EngineOptions& options() const { return options_; }

 private:
  struct Sequence;
  DecodeEngine(std::unique_ptr<DecodeBackend> backend, const model::Tokenizer* tokenizer,
               EngineOptions options, DecodeObserver* observer);
  [[nodiscard]] absl::StatusOr<std::unique_ptr<Sequence>> Prepare(Handoff handoff) const;
  // Loop thread: ends a sequence (releases its attention state and store sequence) and
  // publishes the outcome.
  void End(Sequence& seq, absl::Status status, const char* outcome) ABSL_LOCKS_EXCLUDED(mu_);
  // Loop thread: handles a sampled token; true when the sequence finished.
  bool Accept(Sequence& seq, int32_t token);
  void Loop();

  std::unique_ptr<DecodeBackend> backend_;  // loop thread only (Prepare: any thread)
  std::unique_ptr<kv_store::LeaseKeeper> lease_keeper_;  // null when store_lease is zero
  const model::Tokenizer* tokenizer_;
  EngineOptions options_;
  DecodeObserver* observer_;
  NoopObserver noop_observer_;
  std::vector<Sequence*> running_;  // loop thread only
  // Loop thread only, reused every step: the running sequences' ids and tokens [batch] and the
  // step's logits [batch, vocab].
  std::vector<uint64_t> step_ids_;
  std::vector<int32_t> step_tokens_;
  std::vector<float> logits_;
  std::vector<int32_t> greedy_next_;  // a greedy step's tokens (DecodeBackend::StepGreedy)

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(mu_);
  std::deque<Sequence*> waiting_ ABSL_GUARDED_BY(mu_);
  int64_t resident_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  NodeCounters node_counters_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvr::decode
