#pragma once
// DecodeAttention: the decode node's `kvr::model::Attention`. Each sequence keeps only its
// sink rows and local window resident (a windowed KvCache, model/kv_cache.h) plus one
// retrieval index per layer; the rest of its KV lives in the KV store.
//
// Per layer, for the whole batch (one Attend call):
//   1. rows that slid out of each sequence's local window are appended to its index
//      (incremental summaries), so the index covers [0, local_begin);
//   2. per sequence and KV head, Select top-`budget` (GQA: the whole query group) among the
//      positions that are neither sink nor local (`full`: every such position);
//   3. the selected (sequence, layer, head, position) rows are looked up in the hot cache; ALL
//      misses of all sequences and heads go into ONE StartGather per store;
//   4. attention = one softmax over sink ∪ selected ∪ local, in position order, through the
//      model's one-pass kernel (CpuKernels::attend_rows: online softmax over the sinks, then
//      the selected rows, then the local window), per (request, KV head) over the thread pool.
// With quality_sample_rate > 0, after the attention a sampled fraction of (sequence, layer)
// also reads the keys of every candidate position from the store (one RangeRead for all KV
// heads), computes the exact oracle's top-budget and the softmax over [0, position], and
// reports recall and attention mass (DecodeObserver::OnQuality; retrieval/eval's definitions).
// Those reads are counted in NodeCounters::quality_*, not in the sequence's bytes_fetched.
// It also keeps each step's new K/V rows, which StartOffload appends to the store.
//
// Store rows are in the sequence's dtype (DecodeSequenceSetup::row_dtype, f32, bf16 or
// fp8_e4m3): fetched and sampled bf16 rows are widened to float32 (the attention and the hot
// cache work in f32) and fp8 rows decoded (DecodeFp8Row); generated rows are narrowed to bf16
// (round to nearest even) on their way to a bf16 or fp8 store (the store encodes fp8), and the
// byte counters count the bytes really moved (fp8 rows as stored: Fp8RowLayout).
//
// Same computation as kvr::retrieval::SparseAttention (single process), with the KV split
// between resident rows and the store. With `full` and f32 store rows, every row is attended
// in position order by the kernel DenseAttention runs, so the result equals single-process
// dense attention bit for bit (attend_rows does not depend on how rows are split into runs).
//
// Thread safety: one thread (the decode loop) calls everything.

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "kvr/decode/hot_cache.h"
#include "kvr/decode/observer.h"
#include "kvr/kv_store/client.h"
#include "kvr/model/attention.h"
#include "kvr/model/kv_cache.h"
#include "kvr/retrieval/index.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::decode {

// Per-sequence retrieval counters (they go into Completion.retrieval).
struct RetrievalCounters {
  int64_t selected_rows = 0;  // rows selected (all layers, heads and steps)
  int64_t rows_fetched = 0;   // rows pulled from the store
  int64_t bytes_fetched = 0;
  int64_t hot_cache_hits = 0;
  int64_t hot_cache_misses = 0;
  int64_t rows_offloaded = 0;  // generated rows appended to the store (per layer and head)

  void Add(const RetrievalCounters& o);
};

// Node-wide counters.
struct NodeCounters {
  RetrievalCounters retrieval;
  int64_t gathers = 0;       // StartGather calls
  int64_t attend_calls = 0;  // Attend calls (one per step and layer)
  // Sampled quality measurements (--quality-sample-rate): (step, sequence, layer) the coin
  // picked that selected among more candidates than the budget (`quality_selecting`) and
  // that had nothing to select (`quality_not_selecting`: at most `budget` candidates, `full`
  // or a null index; no recall is recorded for them), reported samples, rows/bytes read from
  // the store for them (not in `retrieval`), and samples dropped because a read failed.
  // quality_selecting = quality_samples + quality_failures.
  int64_t quality_selecting = 0;
  int64_t quality_not_selecting = 0;
  int64_t quality_samples = 0;
  int64_t quality_rows_fetched = 0;
  int64_t quality_bytes_fetched = 0;
  int64_t quality_failures = 0;
  // CUDA backend: sequences selected by a GPU lane (--gpu-lanes), and those a lane refused at
  // admission and the host selected instead.
  int64_t lane_sequences = 0;
  int64_t lane_fallbacks = 0;
  // CUDA backend, clusterkv: sequences whose prefill clusters were more than the node has room
  // for (a request budget below the node's), selected on the host.
  int64_t cluster_fallbacks = 0;
  // CUDA backend: sequences run densely, their KV in HBM (dense when it pays, and `full`).
  int64_t dense_sequences = 0;
};

struct DecodeSequenceSetup {
  std::string method;
  int64_t budget = 0;
  int64_t n_sink = 0;
  int64_t local_window = 0;
  // One index per layer, covering [0, prompt_tokens). A null entry selects every
  // non-resident position (`full` without summaries).
  std::vector<std::unique_ptr<retrieval::RetrievalIndex>> indexes;
  kv_store::KvStoreClient* store = nullptr;  // not owned; outlives the sequence
  kv_store::SequenceRef store_sequence;      // id and capability of the sequence in `store`
  // Element type of the store sequence's rows (its SequenceShape::dtype): f32, bf16 or
  // fp8_e4m3.
  kv_store::DType row_dtype = kv_store::DType::kF32;
  model::KvCache* cache = nullptr;  // windowed; not owned; drained of its evicted rows
};

struct DecodeAttentionOptions {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int64_t hot_cache_bytes = 64 << 20;
  // Probability that one (step, sequence, layer) is compared with the exact oracle; 0 off.
  double quality_sample_rate = 0;
  uint64_t quality_seed = 0x6b7672;  // the sampling RNG's seed (deterministic tests)
};

class DecodeAttention final : public model::Attention {
 public:
  // `observer` and `pool` may be null (single-threaded attention); both must outlive this
  // object. The pool is the model's: Attend runs between the model's parallel sections.
  DecodeAttention(DecodeAttentionOptions options, DecodeObserver* observer,
                  ThreadPool* pool = nullptr);
  ~DecodeAttention() override;

  // InvalidArgument when the setup does not fit the model (layers, cache shape) or its
  // row_dtype is not f32, bf16 or fp8_e4m3 (naming it); AlreadyExists when the id is taken.
  [[nodiscard]] absl::Status AddSequence(model::SequenceId id, DecodeSequenceSetup setup);

  [[nodiscard]] absl::Status Attend(const model::AttentionShape& shape,
                                    std::span<const model::AttentionRequest> batch) override;

  // Appends the rows of the last step's new tokens (every sequence of the step, every layer)
  // to their stores, asynchronously. FinishOffload waits for them; call it before the next
  // step (the store appends at its end, so a layer's puts must not overlap) and before a
  // sequence is released in the store.
  // StartOffload first waits for the previous step's puts (FinishOffload).
  void StartOffload();
  [[nodiscard]] absl::Status FinishOffload();
  // Sequences whose puts failed since the last call (the engine ends them with the error).
  absl::flat_hash_map<model::SequenceId, absl::Status> TakeOffloadFailures();

  // Drops the sequence's indexes, pending rows and hot-cache rows (does not touch the store).
  void Release(model::SequenceId id) override;

  bool Has(model::SequenceId id) const { return sequences_.contains(id); }
  RetrievalCounters counters(model::SequenceId id) const;
  const NodeCounters& node_counters() const { return node_; }
  // Summary bytes held for the sequence / for every sequence.
  int64_t SummaryBytes(model::SequenceId id) const;
  int64_t TotalSummaryBytes() const;
  const HotCache& hot_cache() const { return hot_cache_; }

 private:
  struct Sequence {
    DecodeSequenceSetup setup;
    RetrievalCounters counters;
    // The step's new rows: [n_layers, n_kv_heads, head_dim] each, valid when has_new_rows.
    std::vector<float> new_k, new_v;
    std::vector<bool> has_new_rows;  // [n_layers]
  };
  // Per (request, KV head) work of one Attend call.
  struct HeadWork {
    size_t request = 0;
    int head = 0;
    std::vector<int64_t> positions;  // selected, ascending
    int64_t sink_rows = 0;           // resident rows before the selected positions
    size_t rows_offset = 0;          // into rows_ (floats)
  };
  struct PendingPut {
    model::SequenceId sequence = 0;
    std::unique_ptr<kv_store::KvStoreOp> op;
    std::vector<uint8_t> k, v;  // the op's buffers, in the sequence's row dtype
  };

  void ReportSummaryBytes(const std::string& method);
  // The sampled oracle comparison of the batch's requests (after Attend computed them; the
  // selections are still in work_). A failed store read drops the sample with a warning: it
  // never fails the step.
  void SampleQuality(const model::AttentionShape& shape,
                     std::span<const model::AttentionRequest> batch);
  [[nodiscard]] absl::Status Prepare(const model::AttentionShape& shape,
                                     const model::AttentionRequest& request, size_t index);

  DecodeAttentionOptions options_;
  DecodeObserver* observer_;
  ThreadPool* pool_;
  HotCache hot_cache_;
  absl::flat_hash_map<model::SequenceId, Sequence> sequences_;
  NodeCounters node_;
  std::vector<PendingPut> pending_;
  absl::flat_hash_map<model::SequenceId, absl::Status> offload_failures_;
  // Scratch reused across calls.
  retrieval::Selection selection_;
  std::vector<HeadWork> work_;
  std::vector<float> rows_;  // [selected rows, 2 * head_dim]: the selected rows of every HeadWork
  std::vector<float> scores_;  // quality sampling's scores
  std::mt19937_64 quality_rng_;
  std::bernoulli_distribution quality_coin_;
  std::vector<float> quality_rows_;    // [n_kv_heads, candidates, 2 * head_dim]
  std::vector<uint8_t> quality_stored_;  // the same rows as read, when they are bf16 or fp8
  std::vector<float> quality_probs_;   // [candidates] one query head's probabilities
  std::vector<float> quality_agg_;     // [candidates] the group's summed, renormalised probs
  std::vector<char> quality_truth_;    // [candidates] in the oracle's top-budget
};

}  // namespace kvr::decode
