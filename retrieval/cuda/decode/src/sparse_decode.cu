// The GPU sparse decode (sparse_decode.h): SparseDecodeAttention, the per-layer attention hook
// of a CudaModel whose sequences keep their past in host memory (a row source or an own host KV)
// and attend over sink + window + the rows a retrieval method selects.

#include "kvr/retrieval/cuda/sparse_decode.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/cuda/decode_attention.cuh"
#include "kvr/retrieval/cuda/gather.cuh"
#include "kvr/retrieval/cuda/hot_cache.cuh"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/index.h"
#include "lanes.cuh"
#include "sparse_kernels.cuh"

namespace kvr::retrieval::cuda {
namespace {

// The hot cache's and gather's name for a row source format.
PoolRowFormat PoolFormatOf(SparseRowFormat f) {
  return f == SparseRowFormat::kFp8E4m3 ? PoolRowFormat::kFp8E4m3 : PoolRowFormat::kAsDType;
}

using bf16 = sbf16;
using kvr::cuda::DeviceBuffer;
using kvr::cuda::PinnedBuffer;
using model::CudaStage;
using model::ModelConfig;

using kvr::cuda::Alloc;
using kvr::cuda::AllocPinned;

class SparseDecodeImpl final : public SparseDecodeAttention {
 public:
  explicit SparseDecodeImpl(model::CudaModel& model) : model_(model), config_(model.config()) {}
  ~SparseDecodeImpl() override {
    for (const auto& [host, region] : regions_) cudaHostUnregister(const_cast<void*>(host));
  }

  model::CudaModel& cuda_model() const override { return model_; }
  absl::Status Configure(const SparseDecodeOptions& options) override;
  absl::Status AddSequence(SequenceId id, int64_t capacity,
                           const SparseSequenceOptions& options) override;
  absl::Status ReleaseSequence(SequenceId id) override;
  absl::StatusOr<int64_t> SequenceLength(SequenceId id) const override;
  absl::StatusOr<int64_t> SequenceDeviceBytes(SequenceId id) const override;
  absl::Status FillSequenceForBenchmark(SequenceId id, int64_t n_tokens, uint64_t seed) override;
  absl::StatusOr<std::span<uint16_t>> HostKv(SequenceId id) override;
  absl::StatusOr<std::shared_ptr<SparseHostKvBuffer>> AcquireHostKv(int64_t capacity) override;
  absl::Status ActivateSequence(SequenceId id, int64_t n_tokens) override;
  absl::Status ActivateSequenceWithClusters(SequenceId id, int64_t n_tokens,
                                            std::span<const SparseClusterHead> heads) override;
  absl::Status Forward(std::span<const model::CudaSequence> batch, model::LogitsMode mode,
                       std::span<float> logits) override {
    return model_.ForwardWithAttention(*this, batch, mode, logits);
  }
  absl::Status ForwardGreedy(std::span<const model::CudaSequence> batch,
                             std::span<int32_t> next_tokens) override {
    return model_.ForwardGreedyWithAttention(*this, batch, next_tokens);
  }
  absl::StatusOr<std::span<const uint16_t>> NewRows(SequenceId id) const override;
  absl::StatusOr<const void*> RegisterHostRegion(const void* host, size_t bytes,
                                                 bool read_only) override;
  absl::Status UnregisterHostRegion(const void* host) override;
  SparseStats stats() const override;
  int64_t slot_device_bytes() const override {
    return sparse_ == nullptr ? 0 : sparse_->bytes / sparse_->opt.slots;
  }
  absl::StatusOr<SparseSequenceCounters> Counters(SequenceId id) const override;
  absl::Status SequenceFailure(SequenceId id) const override;
  void SnapshotLayerForTesting(int layer) override { snapshot_layer_ = layer; }
  const SparseLayerSnapshot& snapshot() const override { return snapshot_; }
  absl::StatusOr<std::span<const uint16_t>> HostKvForTesting(SequenceId id) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat("SparseDecode: no sparse sequence ", id));
    }
    if (it->second.host == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "SparseDecode: sparse sequence ", id, " reads its past from a row source (no host KV)"));
    }
    const HostKvBuffer<bf16>& b = it->second.host->buf;
    return std::span<const uint16_t>(reinterpret_cast<const uint16_t*>(b.data()), b.size());
  }

  // model::CudaAttention
  absl::StatusOr<model::CudaAttentionPlan> Plan(
      std::span<const model::CudaSequence> batch) override;
  absl::Status Begin(void* stream) override;
  absl::Status Attend(const model::CudaAttentionRequest& r, void* stream) override;
  absl::Status End(void* stream) override;
  void Finish(bool ok) override;

 private:
  // A sequence's full KV in mapped pinned host memory, [n_layers, n_kv_heads, capacity, 2,
  // head_dim] bf16. Kept (host_kvs_) for reuse by later sequences of the same capacity.
  struct HostKvImpl final : SparseHostKvBuffer {
    HostKvBuffer<bf16> buf;  // on SparseSequenceOptions::host_numa_node (-1: cudaHostAlloc)
    bf16* device = nullptr;  // the device-side address of buf
    int64_t capacity_tokens = 0;
    uint64_t filled_seed = 0;  // FillSequenceForBenchmark's seed + 1; 0: not filled
    std::span<uint16_t> rows() override {
      return {reinterpret_cast<uint16_t*>(buf.data()), buf.size()};
    }
    int64_t capacity() const override { return capacity_tokens; }
  };
  struct Sequence {
    int64_t capacity = 0;
    int64_t length = 0;
    // Slot in sparse_ and host KV (null: the past comes from a row source,
    // SparseSequenceOptions::rows, whose page tables are the slot's).
    int slot = -1;
    std::shared_ptr<HostKvImpl> host;
    bool new_rows_ready = false;  // row source: NewRows holds the last Forward's rows
    uint64_t source_key = 0;  // paged row source: a hash of where its rows are (0: none)
    int64_t sparse_steps = 0;     // Forwards taken part in
    uint64_t filled_seed = 0;     // as HostKvImpl, for this slot's ring and summaries
    // Selects on the host (SparseHostSelector) instead of with the GPU method; null: GPU.
    std::shared_ptr<SparseHostSelector> selector;
    // Selects with this GPU lane (SparseState::lanes; -1: none): its indexes until
    // ActivateSequence, then the tokens its lane state covers (this step's planned value in
    // lane_next until Finish).
    int lane = -1;
    std::vector<const RetrievalIndex*> lane_indexes;
    int64_t lane_indexed = 0, lane_next = 0;
    int budget = 0;  // SparseSequenceOptions::budget, or the configured budget
    // Fetches its rows (SparseSequenceOptions::fetch; null: reads them in place), the rows
    // fetched so far, and the first failed fetch (the sequence's output is void from then on).
    std::shared_ptr<SparseRowFetcher> fetch;
    int64_t fetched_rows = 0;
    absl::Status fetch_failure;
  };
  // One fetched sequence's part of a layer's fetch (FetchMissesAndFill): its rows at [first, first
  // + count) of the layer's positions / entries, per KV head with misses.
  struct FetchPending {
    Sequence* s = nullptr;
    size_t first = 0, count = 0;
    std::vector<SparseRowFetcher::Rows> heads;
  };
  // The GPU state shared by the sequences (Configure); layouts in sparse_kernels.cuh.
  struct SparseState {
    SparseDecodeOptions opt;
    int rcap = 0;
    int64_t pages = 0;
    int64_t bytes = 0;  // device bytes of everything below
    DeviceBuffer<bf16> resident;
    DeviceBuffer<float> bounds;      // quest, fp32 (quest_bf16_bounds false)
    DeviceBuffer<bf16> bounds_bf16;  // quest, bf16
    DeviceBuffer<bf16> centroids;
    DeviceBuffer<int32_t> n_clusters, offsets, members;
    std::vector<HotCache> hot;     // per layer
    DeviceBuffer<float> q_f32;     // [slots, q_dim]
    DeviceBuffer<int32_t> ids;     // [slots, n_kv, budget]
    DeviceBuffer<int32_t> counts;  // [slots, n_kv]
    DeviceBuffer<bf16> gathered;   // [slots, n_kv, budget, 2 d]
    DeviceBuffer<uint8_t> select_ws, attend_ws;
    size_t select_ws_bytes = 0, attend_ws_bytes = 0;
    DeviceBuffer<int32_t> meta;  // [3, slots]: cand begin, cand end, resident count
    PinnedBuffer<int32_t> h_meta;
    DeviceBuffer<int32_t> budgets;  // [slots]: each slot's budget (Sequence::budget)
    PinnedBuffer<int32_t> h_budgets;
    DeviceBuffer<SparseRow> rows;  // [slots]
    PinnedBuffer<SparseRow> h_rows;
    // Where each slot's rows are (kv_pool.h): slots [slots], pages [n_layers, slots, n_kv,
    // max_pages]; written per slot when a sequence takes it (h_slot_pages stages one slot).
    int max_pages = 0;
    DeviceBuffer<KvPoolSlot> pool_slots;
    PinnedBuffer<KvPoolSlot> h_pool_slots;
    DeviceBuffer<int32_t> pool_pages;
    PinnedBuffer<int32_t> h_slot_pages;  // [n_layers, n_kv, max_pages]
    // The step's new K/V rows, [slots, n_layers, 2, n_kv, head_dim], and their host copy (row
    // sources only: the caller appends them to the store).
    DeviceBuffer<bf16> new_rows;
    PinnedBuffer<bf16> h_new_rows;
    // Host selection (SparseHostSelector): the queries of the host-selected slots come back to
    // h_q [slots, q_dim]; their selections go up from h_ids [slots, n_kv, budget] and h_counts
    // [slots, n_kv].
    PinnedBuffer<float> h_q;
    PinnedBuffer<int32_t> h_ids, h_counts;
    // Fetched sequences (SparseRowFetcher): a layer's missed rows, fetched straight into mapped
    // pinned memory (up to [slots, n_kv, budget] rows, in fetch order), and per entry the staged
    // row that holds it (staged_index, written for the misses of fetched slots only); their
    // device addresses; allocated with the first such sequence. Each fetched slot's ids, counts
    // and hot-cache slots come back per layer.
    PinnedBuffer<uint8_t> staged;  // rows in the row format (pool_row_bytes each)
    PinnedBuffer<int32_t> staged_index;
    const uint8_t* staged_device = nullptr;
    const int32_t* staged_index_device = nullptr;
    PinnedBuffer<int32_t> h_fetch_ids, h_fetch_counts, h_slot_of;
    std::vector<int32_t> fetch_positions;
    std::vector<FetchPending> fetch_pending;  // per fetched sequence of the layer (reused)
    std::vector<int64_t> fetch_entries;  // the entry index of each fetched row
    std::vector<uint8_t> fetch_waits;    // per slot: whether its Fill waits for a fetch
    std::vector<std::unique_ptr<GpuLane>> lanes;  // SparseDecodeOptions::lanes, in order
    std::unique_ptr<ThreadPool> host_pool;        // host selectors (null: the calling thread)
    KvPoolView PoolView(int layer) const {
      return {pool_slots.data(), pool_pages.data() + int64_t{layer} * opt.slots * n_kv * max_pages,
              max_pages, n_kv};
    }
    // Replayed selections (SparseDecodeOptions::replay): counts [n_steps, n_layers, n_kv] and
    // ids [.., trace_budget] on the device.
    DeviceBuffer<int32_t> replay_counts, replay_ids;
    DeviceBuffer<unsigned long long> selected;  // [1]
    // Per slot since it was taken: rows selected [0, slots) and hot-cache hits [slots, 2 slots),
    // all layers; copied back at the end of every Forward (h_slot_counters).
    DeviceBuffer<unsigned long long> slot_counters;
    PinnedBuffer<unsigned long long> h_slot_counters;
    int64_t steps = 0;
    std::vector<std::optional<SequenceId>> owner;  // per slot
    SparseSummaryView View() {
      SparseSummaryView v;
      v.method = opt.method == SparseMethod::kQuest ? 0 : 1;
      v.slots = opt.slots;
      v.bounds = bounds.data();
      v.bounds_bf16 = bounds_bf16.data();
      v.bounds_slot_stride = pages * bounds_row();
      v.bounds_layer_stride = opt.slots * v.bounds_slot_stride;
      v.page_size = opt.quest_page_size;
      v.centroids = centroids.data();
      v.n_clusters = n_clusters.data();
      v.offsets = offsets.data();
      v.members = members.data();
      v.max_clusters = max_clusters;
      v.max_members = static_cast<int>(opt.max_capacity);
      return v;
    }
    int64_t bounds_row() const { return int64_t{n_kv} * 2 * head_dim; }
    int n_kv = 0, head_dim = 0, max_clusters = 0;
  };

  cudaStream_t stream() const { return static_cast<cudaStream_t>(model_.cuda_stream()); }
  [[nodiscard]] absl::Status Sync() const {
    return kvr::cuda::CudaStatus(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
  }
  // A free pooled host KV (use_count 1: only the pool holds it) or a new one; errors start with
  // `what` (the caller). Under host_kv_mu_.
  absl::StatusOr<std::shared_ptr<HostKvImpl>> PooledHostKv(int64_t capacity, int numa_node,
                                                           bool huge_pages, const char* what);
  // Copies `from`'s ring rows and summaries (HBM to HBM) into `to`'s slot and clears `to`'s hot
  // cache: a slot over the same rows as one already prepared. Synchronous.
  [[nodiscard]] absl::Status CopySlot(const Sequence& from, Sequence& to);
  // A sequence's slot prepared from its host KV's rows [0, n_tokens): ring rows and, with
  // `summaries`, the summaries (LaunchSparseFill), then its hot cache cleared; synchronous.
  [[nodiscard]] absl::Status FillSlotFromHostKv(Sequence& s, int64_t n_tokens, bool summaries);
  // Looks up a sequence whose host KV no other sequence shares (`what` names the caller).
  [[nodiscard]] absl::StatusOr<Sequence*> OwnSparseSequence(SequenceId id, const char* what);
  // OwnSparseSequence, still empty, and n_tokens in [1, capacity]: one that Activate* may fill.
  [[nodiscard]] absl::StatusOr<Sequence*> ActivatableSequence(SequenceId id, int64_t n_tokens,
                                                              const char* what);
  // Uploads slot `s.slot`'s page tables: its row source's pages, or its own host KV as pages of
  // min_page_rows rows. Synchronous.
  [[nodiscard]] absl::Status WriteSlotTables(const Sequence& s,
                                             const std::optional<SparseRowSource>& source);
  // The selections of this step's host-selected sequences (host_selected_) for `layer`: their
  // queries come back, each selector runs, the selections go up into the slots' ids / counts.
  [[nodiscard]] absl::Status HostSelect(int layer, cudaStream_t stream);
  // The misses of this step's fetched sequences (fetched_) for `layer`, after the hot cache's
  // Lookup, and the hot cache's Fill of every slot: their ids, counts and cache slots come back,
  // each sequence's fetcher reads its missed rows, which are staged at their entry index; the
  // slots that fetch nothing are filled at once and each fetched sequence's slot as soon as its
  // fetch is done, so the GPU copies one sequence's rows while the host waits for the next. A
  // sequence whose fetch fails keeps its failure (SequenceFailure) and attends zero rows from
  // then on; the step goes on for the others.
  [[nodiscard]] absl::Status FetchMissesAndFill(int layer, const KvPoolView& pool,
                                                cudaStream_t stream);
  // A fetched sequence's sink and window rows of [0, n_tokens), read through its fetcher into
  // its slot's ring; its hot cache cleared. Synchronous.
  [[nodiscard]] absl::Status FetchRing(Sequence& s, int64_t n_tokens);
  // The slot's ring (and with `summaries` the GPU method's summaries) from where its rows are.
  [[nodiscard]] absl::Status PrepareSlot(Sequence& s, int64_t n_tokens, bool summaries) {
    return s.fetch != nullptr && s.source_key == 0 ? FetchRing(s, n_tokens)
                                          : FillSlotFromHostKv(s, n_tokens, summaries);
  }
  // A fetched sequence activated from pages: from now on its misses come from the fetcher (a
  // null base in its slot's pool entry). Synchronous.
  [[nodiscard]] absl::Status FetchFromNowOn(const Sequence& s) {
    if (s.fetch == nullptr || s.source_key == 0) return absl::OkStatus();
    KvPoolSlot& slot = sparse_->h_pool_slots.data()[s.slot];
    slot.base = nullptr;
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sparse_->pool_slots.data() + s.slot, &slot,
                                             sizeof(slot), cudaMemcpyHostToDevice, stream()));
    return Sync();
  }

  model::CudaModel& model_;
  const ModelConfig& config_;
  std::unordered_map<SequenceId, Sequence> sequences_;
  std::unique_ptr<SparseState> sparse_;
  std::mutex host_kv_mu_;  // host_kvs_: AcquireHostKv runs on other threads
  std::vector<std::shared_ptr<HostKvImpl>> host_kvs_;
  // RegisterHostRegion: host address -> (bytes, device address).
  std::mutex regions_mu_;
  std::map<const void*, std::pair<size_t, const void*>> regions_;
  int snapshot_layer_ = -1;
  SparseLayerSnapshot snapshot_;
  std::vector<uint16_t> snapshot_attn_bits_;
  // Between Plan and Finish: the batch's sequences, the largest candidate range and whether
  // the step's new rows go back to the host (a sequence over a row source).
  std::vector<Sequence*> planned_;
  struct HostSelected {
    SequenceId id = 0;
    const Sequence* seq = nullptr;
    int64_t position = 0, cand_begin = 0, cand_end = 0;
  };
  std::vector<HostSelected> host_selected_;
  std::vector<Sequence*> fetched_;  // this step's sequences with a SparseRowFetcher
  int64_t max_candidates_ = 0;
  // This sparse state's number among every Configure of every SparseDecodeAttention in the
  // process: part of the graph key, so that no graph captured over another state's buffers (this
  // object's before a Configure, or another object's over the same model) is replayed.
  uint64_t generation_ = 0;
  // The longest candidate range quest's selection is launched for: max_candidates rounded up to
  // 4096 tokens (at most the capacity its workspace was sized for), so that a graph of the step
  // serves 4096 steps; chunks past a sequence's own range return at once.
  int64_t QuestCandidateBound(int64_t max_candidates) const {
    constexpr int64_t kStep = 4096;
    const int64_t up = (std::max<int64_t>(1, max_candidates) + kStep - 1) / kStep * kStep;
    return std::min<int64_t>(up, sparse_->opt.max_capacity);
  }
  // Bytes of one row as the row sources and fetchers hold it (SparseDecodeOptions::row_format).
  int64_t SourceRowBytes() const {
    return static_cast<int64_t>(
        PoolRowBytes(PoolFormatOf(sparse_->opt.row_format), RowDType::kBf16, config_.head_dim));
  }
  bool copy_new_rows_ = false;
};

absl::Status SparseDecodeImpl::Configure(const SparseDecodeOptions& o) {
  for (const auto& [id, seq] : sequences_) {
    return absl::FailedPreconditionError(
        absl::StrCat("Configure: sparse sequence ", id, " still exists"));
  }
  if (o.slots == 0) {  // frees the sparse state
    sparse_.reset();
    return absl::OkStatus();
  }
  const ModelConfig& c = config_;
  const bool quest = o.method == SparseMethod::kQuest;
  auto bad = [](auto... what) { return absl::InvalidArgumentError(absl::StrCat(what...)); };
  if (o.slots < 1 || o.slots > model_.options().max_sequences ||
      o.slots > model_.options().max_batch_tokens) {
    return bad("Configure: slots ", o.slots, " outside [1, min(max_sequences ",
               model_.options().max_sequences, ", max_batch_tokens ",
               model_.options().max_batch_tokens, ")]");
  }
  if (o.max_capacity < 1 || o.max_capacity > c.context_length) {
    return bad("Configure: max_capacity ", o.max_capacity, " outside [1, context length ",
               c.context_length, "]");
  }
  if (o.budget < 1 || o.budget > (quest ? kMaxBudget : 2048) ||
      (quest && (o.quest_page_size < 1 ||
                 (o.budget + o.quest_page_size - 1) / o.quest_page_size + 2 > 1024))) {
    return bad("Configure: budget ", o.budget, " (page size ", o.quest_page_size,
               ") outside the selector's limits (quest <= 4096 and budget/page + 2 <= 1024, "
               "clusterkv <= 2048)");
  }
  if (o.n_sink < 0 || o.local_window < 1 || o.hot_cache_rows < 0 ||
      o.clusterkv_tokens_per_cluster < 1 || o.clusterkv_max_pending < 0 ||
      o.clusterkv_prefill_clusters < 0) {
    return bad(
        "Configure: n_sink >= 0, local_window >= 1, hot_cache_rows >= 0, "
        "clusterkv_tokens_per_cluster >= 1, clusterkv_max_pending >= 0 and "
        "clusterkv_prefill_clusters >= 0 needed");
  }
  if (c.n_heads / c.n_kv_heads > 8) {
    return absl::UnimplementedError("Configure: sparse decode attention takes GQA groups <= 8");
  }
  const int ways = std::min(8, std::max(1, o.hot_cache_rows));
  if (o.hot_cache_rows > 0 && o.hot_cache_rows % ways != 0) {
    return bad("Configure: hot_cache_rows ", o.hot_cache_rows, " not a multiple of 8");
  }
  if (o.min_page_rows < 1) return bad("Configure: min_page_rows ", o.min_page_rows, " < 1");
  if (o.row_format == SparseRowFormat::kFp8E4m3 && (o.hot_cache_rows == 0 || !o.lanes.empty())) {
    return bad(
        "Configure: fp8 rows need a hot cache (hot_cache_rows > 0) and no lanes (the "
        "lanes read bf16 rows)");
  }
  for (const std::string& lane : o.lanes) {
    if (!IsGpuLaneMethod(lane) || std::count(o.lanes.begin(), o.lanes.end(), lane) > 1) {
      return bad("Configure: lane '", lane, "' unknown or listed twice (the GPU lanes: ",
                 GpuLaneMethodList(), ")");
    }
  }
  if (const SparseSelectionReplay* r = o.replay.get()) {
    const int64_t heads = int64_t{r->n_steps} * r->n_layers * r->n_kv_heads;
    if (r->n_steps < 1 || r->n_layers != c.n_layers || r->n_kv_heads != c.n_kv_heads ||
        r->trace_budget < 1 || r->run < 1 || r->counts.size() != static_cast<size_t>(heads) ||
        r->ids.size() != static_cast<size_t>(heads * r->trace_budget)) {
      return bad("Configure: replay of ", r->n_steps, " steps x ", r->n_layers, " layers x ",
                 r->n_kv_heads, " KV heads (budget ", r->trace_budget, ", run ", r->run,
                 ") does not match the model's ", c.n_layers, " layers and ", c.n_kv_heads,
                 " KV heads or its own array sizes");
    }
    for (int32_t n : r->counts) {
      if (n < 0 || n > r->trace_budget)
        return bad("Configure: replay count ", n, " outside [0, ", r->trace_budget, "]");
    }
  }
  sparse_.reset();
  auto st = std::make_unique<SparseState>();
  st->opt = o;
  st->n_kv = c.n_kv_heads;
  st->head_dim = c.head_dim;
  st->rcap = o.n_sink + o.local_window;
  const int64_t L = c.n_layers, S = o.slots, kv = c.n_kv_heads, d = c.head_dim;
  KVR_RETURN_IF_ERROR(Alloc(st->resident, L * S * kv * st->rcap * 2 * d));
  if (quest) {
    st->pages = (o.max_capacity + o.quest_page_size - 1) / o.quest_page_size;
    if (o.quest_bf16_bounds) {
      KVR_RETURN_IF_ERROR(Alloc(st->bounds_bf16, L * S * st->pages * st->bounds_row()));
    } else {
      KVR_RETURN_IF_ERROR(Alloc(st->bounds, L * S * st->pages * st->bounds_row()));
    }
  } else {
    // Room for the prefill's clusters (clusterkv_prefill_clusters, or at their most: the CPU
    // index's default at any budget, ClusterKvMaxDefaultClusters; at least the benchmark
    // stand-in's clusters of tokens_per_cluster) plus the pending singletons.
    const int64_t stand_in = (o.max_capacity + o.clusterkv_tokens_per_cluster - 1) /
                             o.clusterkv_tokens_per_cluster;
    const int64_t prefill_clusters = std::max<int64_t>(
        o.clusterkv_prefill_clusters > 0 ? o.clusterkv_prefill_clusters
                                         : ClusterKvMaxDefaultClusters(o.max_capacity),
        stand_in);
    st->max_clusters = static_cast<int>(
        std::min<int64_t>(o.max_capacity, prefill_clusters + o.clusterkv_max_pending));
    KVR_RETURN_IF_ERROR(Alloc(st->centroids, L * S * kv * st->max_clusters * d));
    KVR_RETURN_IF_ERROR(Alloc(st->n_clusters, L * S * kv));
    KVR_RETURN_IF_ERROR(Alloc(st->offsets, L * S * kv * (st->max_clusters + 1)));
    KVR_RETURN_IF_ERROR(Alloc(st->members, L * S * kv * o.max_capacity));
  }
  int64_t hot_bytes = 0;
  if (o.hot_cache_rows > 0) {
    HotCacheShape hs;
    hs.batch = o.slots;
    hs.n_kv_heads = c.n_kv_heads;
    hs.head_dim = c.head_dim;
    hs.dtype = RowDType::kBf16;
    hs.pool_format = PoolFormatOf(o.row_format);
    hs.n_sets = o.hot_cache_rows / ways;
    hs.ways = ways;
    hs.budget = o.budget;
    for (int l = 0; l < c.n_layers; ++l) {
      absl::StatusOr<HotCache> created = HotCache::Create(hs, stream());
      if (!created.ok()) {
        cudaGetLastError();  // as in Alloc
        return created.status();
      }
      HotCache h = *std::move(created);
      // Data plus tags, stamps, claims (4 + 4 + 8 bytes a slot) and slot_of.
      hot_bytes += static_cast<int64_t>(h.data_bytes()) + S * kv * o.hot_cache_rows * 16 +
                   S * kv * o.budget * 4;
      st->hot.push_back(std::move(h));
    }
  }
  KVR_RETURN_IF_ERROR(Alloc(st->q_f32, S * c.q_dim()));
  KVR_RETURN_IF_ERROR(Alloc(st->ids, S * kv * o.budget));
  KVR_RETURN_IF_ERROR(Alloc(st->counts, S * kv));
  KVR_RETURN_IF_ERROR(Alloc(st->gathered, S * kv * o.budget * 2 * d));
  KVR_RETURN_IF_ERROR(Alloc(st->meta, 3 * S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_meta, 3 * S));
  KVR_RETURN_IF_ERROR(Alloc(st->budgets, S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_budgets, S));
  KVR_RETURN_IF_ERROR(Alloc(st->rows, S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_rows, S));
  st->max_pages = static_cast<int>((o.max_capacity + o.min_page_rows - 1) / o.min_page_rows);
  KVR_RETURN_IF_ERROR(Alloc(st->pool_slots, S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_pool_slots, S));
  KVR_RETURN_IF_ERROR(Alloc(st->pool_pages, L * S * kv * st->max_pages));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_slot_pages, L * kv * st->max_pages));
  KVR_RETURN_IF_ERROR(Alloc(st->new_rows, S * L * 2 * kv * d));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_new_rows, S * L * 2 * kv * d));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_q, S * c.q_dim()));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_ids, S * kv * o.budget));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_counts, S * kv));
  if (const SparseSelectionReplay* r = o.replay.get()) {
    KVR_RETURN_IF_ERROR(Alloc(st->replay_counts, static_cast<int64_t>(r->counts.size())));
    KVR_RETURN_IF_ERROR(Alloc(st->replay_ids, static_cast<int64_t>(r->ids.size())));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->replay_counts.data(), r->counts.data(),
                                             st->replay_counts.bytes(), cudaMemcpyHostToDevice,
                                             stream()));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st->replay_ids.data(), r->ids.data(),
                                             st->replay_ids.bytes(), cudaMemcpyHostToDevice,
                                             stream()));
  }
  KVR_RETURN_IF_ERROR(Alloc(st->selected, 1));
  KVR_RETURN_IF_ERROR(Alloc(st->slot_counters, 2 * S));
  KVR_RETURN_IF_ERROR(AllocPinned(st->h_slot_counters, 2 * S));
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(st->slot_counters.data(), 0, st->slot_counters.bytes(), stream()));
  std::fill(st->h_slot_counters.data(), st->h_slot_counters.data() + 2 * S, 0ull);
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(st->selected.data(), 0, sizeof(unsigned long long), stream()));
  const SelectionOutput out{o.budget, st->ids.data(), st->counts.data()};
  const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  if (quest) {
    QuestSelectParams qp;
    qp.batch = o.slots;
    qp.n_heads = c.n_heads;
    qp.n_kv_heads = c.n_kv_heads;
    qp.head_dim = c.head_dim;
    qp.page_size = o.quest_page_size;
    qp.bounds_dtype = o.quest_bf16_bounds ? KeyDType::kBf16 : KeyDType::kF32;
    qp.scale = scale;
    qp.max_candidates = static_cast<int>(o.max_capacity);
    qp.out = out;
    st->select_ws_bytes = QuestSelectWorkspaceBytes(qp);
  } else {
    ClusterKvSelectParams cp;
    cp.batch = o.slots;
    cp.n_heads = c.n_heads;
    cp.n_kv_heads = c.n_kv_heads;
    cp.head_dim = c.head_dim;
    cp.scale = scale;
    cp.max_clusters = st->max_clusters;
    cp.max_members = static_cast<int>(o.max_capacity);
    cp.out = out;
    st->select_ws_bytes = ClusterKvSelectWorkspaceBytes(cp);
  }
  DecodeAttentionParams ap;
  ap.batch = o.slots;
  ap.n_heads = c.n_heads;
  ap.n_kv_heads = c.n_kv_heads;
  ap.head_dim = c.head_dim;
  ap.budget = o.budget;
  ap.resident_capacity = st->rcap;
  ap.max_rows = st->rcap + o.budget;
  st->attend_ws_bytes = DecodeAttentionWorkspaceBytes(ap);
  KVR_RETURN_IF_ERROR(Alloc(st->select_ws, static_cast<int64_t>(st->select_ws_bytes) + 256));
  KVR_RETURN_IF_ERROR(Alloc(st->attend_ws, static_cast<int64_t>(st->attend_ws_bytes) + 256));
  st->owner.resize(o.slots);
  if (o.host_select_threads < 0) {
    return bad("Configure: host_select_threads ", o.host_select_threads, " < 0");
  }
  if (o.host_select_threads != 1) {
    st->host_pool = std::make_unique<ThreadPool>(static_cast<size_t>(o.host_select_threads));
  }
  int64_t lane_bytes = 0;
  for (const std::string& lane : o.lanes) {
    KVR_ASSIGN_OR_RETURN(std::unique_ptr<GpuLane> created,
                         CreateGpuLane(lane, c, o.slots, o.max_capacity, o.budget, o.local_window,
                                       o.method_assets, stream()));
    lane_bytes += created->bytes();
    st->lanes.push_back(std::move(created));
  }
  st->bytes =
      static_cast<int64_t>(
          st->resident.bytes() + st->bounds.bytes() + st->bounds_bf16.bytes() +
          st->centroids.bytes() + st->n_clusters.bytes() + st->offsets.bytes() +
          st->members.bytes() + st->q_f32.bytes() + st->ids.bytes() + st->counts.bytes() +
          st->gathered.bytes() + st->select_ws.bytes() + st->attend_ws.bytes() + st->meta.bytes() +
          st->budgets.bytes() + st->rows.bytes() + st->pool_slots.bytes() + st->pool_pages.bytes() +
          st->new_rows.bytes() + st->replay_counts.bytes() + st->replay_ids.bytes()) +
      hot_bytes + lane_bytes;
  KVR_RETURN_IF_ERROR(Sync());
  sparse_ = std::move(st);
  // A graph captured before holds the buffers just freed: a new generation keys new graphs.
  static std::atomic<uint64_t> generations{0};
  generation_ = ++generations;
  return absl::OkStatus();
}

absl::Status SparseDecodeImpl::AddSequence(SequenceId id, int64_t capacity,
                                           const SparseSequenceOptions& options) {
  if (sparse_ == nullptr) {
    return absl::FailedPreconditionError("AddSequence: Configure first");
  }
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("SparseDecode: sequence ", id, " already exists"));
  }
  if (capacity < 1 || capacity > sparse_->opt.max_capacity) {
    return absl::InvalidArgumentError(absl::StrCat("AddSequence: capacity ", capacity,
                                                   " outside [1, max_capacity ",
                                                   sparse_->opt.max_capacity, "]"));
  }
  if (options.budget < 0 || options.budget > sparse_->opt.budget) {
    return absl::InvalidArgumentError(absl::StrCat("AddSequence: budget ",
                                                   options.budget, " outside [0, budget ",
                                                   sparse_->opt.budget, "]"));
  }
  if (!options.lane.empty() &&
      (std::none_of(sparse_->lanes.begin(), sparse_->lanes.end(),
                    [&](const auto& l) { return l->method() == options.lane; }) ||
       options.selector != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AddSequence: lane '", options.lane, "' is not configured (SparseDecodeOptions::lanes)",
        options.selector != nullptr ? " or comes with a host selector" : ""));
  }
  int slot = -1;
  for (int i = 0; i < sparse_->opt.slots && slot < 0; ++i) {
    if (!sparse_->owner[i].has_value()) slot = i;
  }
  if (slot < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("AddSequence: all ", sparse_->opt.slots, " sparse slots are taken"));
  }
  const ModelConfig& c = config_;
  std::shared_ptr<HostKvImpl> host;
  if (options.fetch != nullptr) {
    if (!options.lane.empty() || sparse_->hot.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AddSequence: fetched rows (SparseSequenceOptions::fetch) need a hot cache "
          "(hot_cache_rows > 0) and exclude a lane",
          sparse_->hot.empty() ? "; this configuration has no hot cache" : ""));
    }
    if (sparse_->staged.size() == 0) {
      const int64_t n = int64_t{sparse_->opt.slots} * c.n_kv_heads * sparse_->opt.budget;
      KVR_ASSIGN_OR_RETURN(sparse_->staged,
                           PinnedBuffer<uint8_t>::Create(static_cast<size_t>(n * SourceRowBytes()),
                                                         cudaHostAllocMapped));
      KVR_ASSIGN_OR_RETURN(uint8_t * device, sparse_->staged.device_pointer());
      sparse_->staged_device = device;
      KVR_ASSIGN_OR_RETURN(sparse_->staged_index,
                           PinnedBuffer<int32_t>::Create(static_cast<size_t>(n),
                                                         cudaHostAllocMapped));
      KVR_ASSIGN_OR_RETURN(int32_t * index_device, sparse_->staged_index.device_pointer());
      sparse_->staged_index_device = index_device;
      KVR_RETURN_IF_ERROR(AllocPinned(sparse_->h_fetch_ids, n));
      KVR_RETURN_IF_ERROR(AllocPinned(sparse_->h_slot_of, n));
      KVR_RETURN_IF_ERROR(
          AllocPinned(sparse_->h_fetch_counts, int64_t{sparse_->opt.slots} * c.n_kv_heads));
    }
  }
  const bool fp8_rows = sparse_->opt.row_format == SparseRowFormat::kFp8E4m3;
  if (fp8_rows && !options.rows.has_value() && options.fetch == nullptr) {
    return absl::InvalidArgumentError(
        "AddSequence: this configuration reads fp8 rows (SparseDecodeOptions::row_format), so "
        "every sequence needs a row source of fp8 pages or a fetcher of fp8 rows "
        "(SparseSequenceOptions::rows or fetch)");
  }
  if (options.rows.has_value()) {
    const SparseRowSource& r = *options.rows;
    const int64_t row_bytes = SourceRowBytes();
    auto bad = [&](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat("AddSequence: row source: ", parts...));
    };
    if (r.base == nullptr) return bad("no base address");
    if (r.page_rows < sparse_->opt.min_page_rows) {
      return bad("pages of ", r.page_rows, " rows, fewer than min_page_rows ",
                 sparse_->opt.min_page_rows);
    }
    if (r.page_bytes < int64_t{r.page_rows} * row_bytes || r.page_bytes % 16 != 0) {
      return bad("page_bytes ", r.page_bytes, " hold no ", r.page_rows, " rows of ", row_bytes,
                 " bytes at 16-byte alignment");
    }
    if (int64_t{r.pages_per_head} * r.page_rows < capacity ||
        r.pages_per_head > sparse_->max_pages) {
      return bad(r.pages_per_head, " pages of ", r.page_rows, " rows per head for capacity ",
                 capacity, " (at most ", sparse_->max_pages, " pages)");
    }
    if (static_cast<int64_t>(r.pages.size()) !=
        int64_t{c.n_layers} * c.n_kv_heads * r.pages_per_head) {
      return bad(r.pages.size(), " page ids, expected ", c.n_layers, " layers x ", c.n_kv_heads,
                 " heads x ", r.pages_per_head);
    }
    for (int32_t page : r.pages) {
      if (page < 0) return bad("negative page id ", page);
    }
  } else if (options.fetch != nullptr) {
    // No pages: the ring comes through the fetcher at activation.
  } else if (options.share_host_kv_with.has_value()) {
    auto it = sequences_.find(*options.share_host_kv_with);
    if (it == sequences_.end() || it->second.capacity != capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("AddSequence: share_host_kv_with ", *options.share_host_kv_with,
                       " is no sparse sequence of capacity ", capacity));
    }
    host = it->second.host;
  } else if (options.host_kv != nullptr) {
    host = std::dynamic_pointer_cast<HostKvImpl>(options.host_kv);
    if (host == nullptr || host->capacity_tokens != capacity) {
      return absl::InvalidArgumentError(
          absl::StrCat("AddSequence: host_kv is not this one's (AcquireHostKv) or "
                       "not of capacity ",
                       capacity));
    }
    for (const auto& [other_id, other] : sequences_) {
      if (other.host == host) {
        return absl::FailedPreconditionError(
            absl::StrCat("AddSequence: host_kv is in use by sequence ", other_id));
      }
    }
  } else {
    std::lock_guard<std::mutex> lock(host_kv_mu_);
    KVR_ASSIGN_OR_RETURN(host, PooledHostKv(capacity, options.host_numa_node,
                                            options.host_huge_pages, "AddSequence"));
  }
  for (HotCache& h : sparse_->hot) KVR_RETURN_IF_ERROR(h.ResetSlot(slot, stream()));
  for (int64_t i : {int64_t{slot}, int64_t{sparse_->opt.slots} + slot}) {
    KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sparse_->slot_counters.data() + i, 0,
                                             sizeof(unsigned long long), stream()));
    sparse_->h_slot_counters.data()[i] = 0;
  }
  KVR_RETURN_IF_ERROR(
      LaunchSparseClearSlot(sparse_->View(), slot, c.n_layers, c.n_kv_heads, stream()));
  KVR_RETURN_IF_ERROR(Sync());
  Sequence s;
  s.capacity = capacity;
  s.slot = slot;
  s.host = std::move(host);
  s.selector = options.selector;
  for (size_t i = 0; i < sparse_->lanes.size(); ++i) {
    if (sparse_->lanes[i]->method() == options.lane) s.lane = static_cast<int>(i);
  }
  s.lane_indexes = options.lane_indexes;
  s.budget = options.budget > 0 ? options.budget : sparse_->opt.budget;
  s.fetch = options.fetch;
  if (options.rows.has_value()) {
    const SparseRowSource& r = *options.rows;
    s.source_key = absl::HashOf(reinterpret_cast<uintptr_t>(r.base), r.page_bytes, r.page_rows,
                                r.pages_per_head, r.pages) |
                   1;
  }
  KVR_RETURN_IF_ERROR(WriteSlotTables(s, options.rows));
  sequences_.emplace(id, std::move(s));
  sparse_->owner[slot] = id;
  return absl::OkStatus();
}

absl::StatusOr<SparseSequenceCounters> SparseDecodeImpl::Counters(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("Counters: no sparse sequence ", id));
  }
  const int slot = it->second.slot;
  const unsigned long long* h = sparse_->h_slot_counters.data();
  SparseSequenceCounters out;
  out.steps = it->second.sparse_steps;
  out.selected_rows = static_cast<int64_t>(h[slot]);
  out.hot_cache_hits = static_cast<int64_t>(h[sparse_->opt.slots + slot]);
  out.fetched_rows = it->second.fetched_rows;
  return out;
}

absl::Status SparseDecodeImpl::SequenceFailure(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("SequenceFailure: no sparse sequence ", id));
  }
  const absl::Status& f = it->second.fetch_failure;
  if (f.ok()) return f;
  return absl::Status(f.code(), absl::StrCat("sequence ", id, ": fetching its rows: ", f.message()));
}

absl::Status SparseDecodeImpl::WriteSlotTables(const Sequence& s,
                                               const std::optional<SparseRowSource>& source) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  const int64_t L = c.n_layers, S = sp.opt.slots, kv = c.n_kv_heads, P = sp.max_pages;
  int32_t* pages = sp.h_slot_pages.data();
  std::fill(pages, pages + L * kv * P, 0);
  KvPoolSlot& slot = sp.h_pool_slots.data()[s.slot];
  if (s.fetch != nullptr && !source.has_value()) {
    // No pages: a null base sends the hot cache's misses of this slot to the staged rows.
    slot = {nullptr, 4 * int64_t{c.head_dim}, sp.opt.min_page_rows, 0};
  } else if (source.has_value()) {
    slot = {source->base, source->page_bytes, source->page_rows, 0};
    for (int64_t lh = 0; lh < L * kv; ++lh) {
      std::copy_n(source->pages.data() + lh * source->pages_per_head, source->pages_per_head,
                  pages + lh * P);
    }
  } else {
    // The own host KV [n_layers, n_kv, capacity, row]: page_bytes = one row, so a page index is
    // the row index of the page's first row.
    const int32_t pr = sp.opt.min_page_rows;
    slot = {s.host->device, 4 * int64_t{c.head_dim}, pr, 0};
    for (int64_t lh = 0; lh < L * kv; ++lh) {
      for (int64_t p = 0; p * pr < s.capacity; ++p) {
        pages[lh * P + p] = static_cast<int32_t>(lh * s.capacity + p * pr);
      }
    }
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.pool_slots.data() + s.slot, &slot, sizeof(slot),
                                           cudaMemcpyHostToDevice, stream()));
  for (int64_t l = 0; l < L; ++l) {
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.pool_pages.data() + (l * S + s.slot) * kv * P,
                                             pages + l * kv * P, kv * P * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, stream()));
  }
  return Sync();
}

absl::StatusOr<std::span<const uint16_t>> SparseDecodeImpl::NewRows(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("NewRows: no sparse sequence ", id));
  }
  const Sequence& s = it->second;
  if (s.host != nullptr || !s.new_rows_ready) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NewRows: sequence ", id,
        s.host != nullptr ? " has its own host KV (no row source)" : " has run no Forward"));
  }
  const ModelConfig& c = config_;
  const int64_t n = int64_t{c.n_layers} * 2 * c.n_kv_heads * c.head_dim;
  return std::span<const uint16_t>(
      reinterpret_cast<const uint16_t*>(sparse_->h_new_rows.data()) + s.slot * n, n);
}

absl::StatusOr<const void*> SparseDecodeImpl::RegisterHostRegion(const void* host, size_t bytes,
                                                                 bool read_only) {
  if (host == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("RegisterHostRegion: empty region");
  }
  std::lock_guard<std::mutex> lock(regions_mu_);
  if (auto it = regions_.find(host); it != regions_.end()) {
    if (it->second.first < bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("RegisterHostRegion: the region is registered "
                       "with ",
                       it->second.first, " bytes, not ", bytes));
    }
    return it->second.second;
  }
  // This thread may never have used the device.
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(model_.options().device));
  unsigned flags = cudaHostRegisterMapped | cudaHostRegisterPortable;
  if (read_only) {
    int ro = 0;
    if (cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported,
                               model_.options().device) == cudaSuccess &&
        ro != 0) {
      flags |= cudaHostRegisterReadOnly;
    }
  }
  if (const cudaError_t e = cudaHostRegister(const_cast<void*>(host), bytes, flags);
      e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("RegisterHostRegion: cudaHostRegister of ",
                                                      bytes, " bytes: ", cudaGetErrorString(e)));
  }
  void* device = nullptr;
  if (const cudaError_t e = cudaHostGetDevicePointer(&device, const_cast<void*>(host), 0);
      e != cudaSuccess) {
    cudaHostUnregister(const_cast<void*>(host));
    return absl::InternalError(
        absl::StrCat("RegisterHostRegion: cudaHostGetDevicePointer: ", cudaGetErrorString(e)));
  }
  regions_.emplace(host, std::make_pair(bytes, static_cast<const void*>(device)));
  return static_cast<const void*>(device);
}

absl::Status SparseDecodeImpl::UnregisterHostRegion(const void* host) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  auto it = regions_.find(host);
  if (it == regions_.end()) {
    return absl::NotFoundError("UnregisterHostRegion: the region is not registered");
  }
  regions_.erase(it);
  KVR_CUDA_RETURN_IF_ERROR(cudaHostUnregister(const_cast<void*>(host)));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SparseDecodeImpl::HostKvImpl>> SparseDecodeImpl::PooledHostKv(
    int64_t capacity, int numa_node, bool huge_pages, const char* what) {
  for (const auto& h : host_kvs_) {
    if (h.use_count() == 1 && h->capacity_tokens == capacity && h->buf.numa_node() == numa_node &&
        h->buf.huge_pages() == huge_pages) {
      return h;
    }
  }
  const ModelConfig& c = config_;
  auto host = std::make_shared<HostKvImpl>();
  host->capacity_tokens = capacity;
  const int64_t n = int64_t{c.n_layers} * c.kv_dim() * 2 * capacity;
  absl::StatusOr<HostKvBuffer<bf16>> buf =
      HostKvBuffer<bf16>::Create(static_cast<size_t>(n), numa_node, huge_pages);
  if (!buf.ok()) {
    cudaGetLastError();  // as in Alloc
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": pinning ", n * 2, " bytes of host KV: ", buf.status().message()));
  }
  host->buf = *std::move(buf);
  KVR_ASSIGN_OR_RETURN(host->device, host->buf.device_pointer());
  host_kvs_.push_back(host);
  return host;
}

absl::StatusOr<std::shared_ptr<SparseHostKvBuffer>> SparseDecodeImpl::AcquireHostKv(
    int64_t capacity) {
  if (capacity < 1 || capacity > config_.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("AcquireHostKv: capacity ", capacity,
                                                   " outside [1, ", config_.context_length, "]"));
  }
  // This thread may never have used the device: the mapped pointer needs it current.
  KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(model_.options().device));
  std::lock_guard<std::mutex> lock(host_kv_mu_);
  KVR_ASSIGN_OR_RETURN(std::shared_ptr<HostKvImpl> host,
                       PooledHostKv(capacity, -1, false, "AcquireHostKv"));
  host->filled_seed = 0;  // the caller writes it
  return std::shared_ptr<SparseHostKvBuffer>(std::move(host));
}

absl::StatusOr<int64_t> SparseDecodeImpl::SequenceDeviceBytes(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end())
    return absl::NotFoundError(absl::StrCat("SparseDecode: no sequence ", id));
  return sparse_->bytes / sparse_->opt.slots;
}

SparseStats SparseDecodeImpl::stats() const {
  SparseStats st;
  if (sparse_ == nullptr) return st;
  st.steps = sparse_->steps;
  st.row_bytes = SourceRowBytes();
  unsigned long long v = 0;
  if (cudaMemcpy(&v, sparse_->selected.data(), sizeof(v), cudaMemcpyDeviceToHost) == cudaSuccess) {
    st.selected_rows = static_cast<int64_t>(v);
  }
  for (const HotCache& h : sparse_->hot) {
    if (cudaMemcpy(&v, h.hits(), sizeof(v), cudaMemcpyDeviceToHost) == cudaSuccess) {
      st.hot_cache_hits += static_cast<int64_t>(v);
    }
  }
  return st;
}

absl::Status SparseDecodeImpl::Attend(const model::CudaAttentionRequest& r, void* stream_ptr) {
  cudaStream_t st = static_cast<cudaStream_t>(stream_ptr);
  const int layer = r.layer;
  const int64_t max_candidates = max_candidates_;
  auto mark = [&](CudaStage stage) { return r.mark ? r.mark(stage) : absl::OkStatus(); };
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  const SparseDecodeOptions& o = sp.opt;
  const int S = o.slots;
  const int64_t kv = c.n_kv_heads, d = c.head_dim;
  const int64_t resident_layer = int64_t{S} * kv * sp.rcap * 2 * d;
  KVR_RETURN_IF_ERROR(mark(CudaStage::kOther));
  SparseRopeParams rp;
  rp.qkv = r.qkv;
  rp.bias = r.qkv_bias;
  rp.inv_freq = r.inv_freq;
  rp.rows = sp.rows.data();
  rp.q = static_cast<bf16*>(r.q);
  rp.q_f32 = sp.q_f32.data();
  rp.resident = sp.resident.data();
  rp.resident_layer_stride = resident_layer;
  rp.rcap = sp.rcap;
  rp.n_sink = o.n_sink;
  rp.window = o.local_window;
  rp.sum = sp.View();
  rp.new_rows = sp.new_rows.data();
  rp.n_layers = c.n_layers;
  rp.slots = S;
  rp.n_heads = c.n_heads;
  rp.n_kv_heads = c.n_kv_heads;
  rp.head_dim = c.head_dim;
  rp.layer = layer;
  KVR_RETURN_IF_ERROR(LaunchSparseRope(rp, st));

  KVR_RETURN_IF_ERROR(mark(CudaStage::kSelect));
  const SelectionOutput out{o.budget, sp.ids.data(), sp.counts.data()};
  const CandidateRanges cand{sp.meta.data(), sp.meta.data() + S};
  const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  if (o.method == SparseMethod::kQuest) {
    const SparseSummaryView v = sp.View();
    QuestSelectParams qp;
    qp.batch = S;
    qp.n_heads = c.n_heads;
    qp.n_kv_heads = c.n_kv_heads;
    qp.head_dim = c.head_dim;
    qp.page_size = o.quest_page_size;
    qp.scale = scale;
    qp.query = sp.q_f32.data();
    if (v.bounds_bf16 != nullptr) {
      qp.bounds = v.bounds_bf16 + layer * v.bounds_layer_stride;
      qp.bounds_dtype = KeyDType::kBf16;
    } else {
      qp.bounds = v.bounds + layer * v.bounds_layer_stride;
    }
    qp.bounds_batch_stride = v.bounds_slot_stride;
    qp.cand = cand;
    qp.max_candidates = static_cast<int>(QuestCandidateBound(max_candidates));
    qp.out = out;
    qp.budgets = sp.budgets.data();
    qp.workspace = sp.select_ws.data();
    qp.workspace_bytes = sp.select_ws_bytes;
    KVR_RETURN_IF_ERROR(QuestSelect(qp, st));
  } else {
    const int64_t heads_before = int64_t{layer} * S * kv;
    ClusterKvSelectParams cp;
    cp.batch = S;
    cp.n_heads = c.n_heads;
    cp.n_kv_heads = c.n_kv_heads;
    cp.head_dim = c.head_dim;
    cp.scale = scale;
    cp.query = sp.q_f32.data();
    cp.centroids = sp.centroids.data() + heads_before * sp.max_clusters * d;
    cp.centroid_dtype = KeyDType::kBf16;
    cp.n_clusters = sp.n_clusters.data() + heads_before;
    cp.offsets = sp.offsets.data() + heads_before * (sp.max_clusters + 1);
    cp.members = sp.members.data() + heads_before * o.max_capacity;
    cp.max_clusters = sp.max_clusters;
    cp.max_members = static_cast<int>(o.max_capacity);
    cp.cand = cand;
    cp.out = out;
    cp.budgets = sp.budgets.data();
    cp.workspace = sp.select_ws.data();
    cp.workspace_bytes = sp.select_ws_bytes;
    KVR_RETURN_IF_ERROR(ClusterKvSelect(cp, st));
  }
  for (auto& lane : sp.lanes) {
    if (lane->empty()) continue;
    KVR_RETURN_IF_ERROR(lane->Select(layer, sp.q_f32.data(), sp.PoolView(layer),
                                     static_cast<int>(std::max<int64_t>(1, max_candidates)), out,
                                     st));
  }
  if (!host_selected_.empty()) KVR_RETURN_IF_ERROR(HostSelect(layer, st));
  if (const SparseSelectionReplay* r = o.replay.get()) {
    const int step = static_cast<int>(sp.steps % r->n_steps);
    const int64_t step_heads = int64_t{r->n_layers} * r->n_kv_heads;
    ReplaySelectParams p;
    p.counts = sp.replay_counts.data() + step * step_heads;
    p.ids = sp.replay_ids.data() + step * step_heads * r->trace_budget;
    p.trace_budget = r->trace_budget;
    p.run = r->run;
    p.layer = layer;
    p.slots = S;
    p.n_kv_heads = static_cast<int>(kv);
    p.budget = o.budget;
    p.trace_begin = r->trace_begin;
    p.scatter = r->scatter;
    p.rotate_slots = r->rotate_slots;
    p.n_layers = r->n_layers;
    p.cand_begin = cand.begin;
    p.cand_end = cand.end;
    p.budgets = sp.budgets.data();
    p.out_ids = sp.ids.data();
    p.out_counts = sp.counts.data();
    KVR_RETURN_IF_ERROR(LaunchReplaySelect(p, st));
  }
  if (r.profile) {
    KVR_RETURN_IF_ERROR(
        LaunchSumCounts(sp.counts.data(), static_cast<int>(S * kv), sp.selected.data(), st));
  }
  KVR_RETURN_IF_ERROR(LaunchSumCountsPerSlot(sp.counts.data(), S, static_cast<int>(kv),
                                             sp.slot_counters.data(), st));

  KVR_RETURN_IF_ERROR(mark(CudaStage::kGather));
  const KvPoolView pool = sp.PoolView(layer);
  if (!sp.hot.empty() && !fetched_.empty()) {
    KVR_RETURN_IF_ERROR(
        sp.hot[layer].Lookup(sp.ids.data(), sp.counts.data(), st, sp.slot_counters.data() + S));
    KVR_RETURN_IF_ERROR(FetchMissesAndFill(layer, pool, st));
  } else if (!sp.hot.empty()) {
    KVR_RETURN_IF_ERROR(sp.hot[layer].Gather(pool, sp.ids.data(), sp.counts.data(),
                                             sp.gathered.data(), st, sp.slot_counters.data() + S));
  } else {
    GatherParams gp;
    gp.batch = S;
    gp.n_kv_heads = c.n_kv_heads;
    gp.budget = o.budget;
    gp.head_dim = c.head_dim;
    gp.dtype = RowDType::kBf16;
    gp.pool = pool;
    gp.ids = sp.ids.data();
    gp.counts = sp.counts.data();
    gp.out = sp.gathered.data();
    KVR_RETURN_IF_ERROR(GatherRows(gp, st));
  }

  KVR_RETURN_IF_ERROR(mark(CudaStage::kAttention));
  DecodeAttentionParams ap;
  ap.batch = S;
  ap.n_heads = c.n_heads;
  ap.n_kv_heads = c.n_kv_heads;
  ap.head_dim = c.head_dim;
  ap.dtype = RowDType::kBf16;
  ap.scale = scale;
  ap.q = r.q;
  ap.resident = sp.resident.data() + layer * resident_layer;
  ap.resident_capacity = sp.rcap;
  ap.resident_counts = sp.meta.data() + 2 * S;
  ap.budget = o.budget;
  ap.counts = sp.counts.data();
  ap.gathered = sp.gathered.data();
  ap.max_rows = sp.rcap + o.budget;
  ap.out = r.out;
  ap.workspace = sp.attend_ws.data();
  ap.workspace_bytes = sp.attend_ws_bytes;
  KVR_RETURN_IF_ERROR(DecodeAttention(ap, st));
  if (layer == snapshot_layer_) {  // tests: copied back to pageable memory (synchronous)
    SparseLayerSnapshot& s = snapshot_;
    s.layer = layer;
    s.q.resize(sp.q_f32.size());
    s.ids.resize(sp.ids.size());
    s.counts.resize(sp.counts.size());
    snapshot_attn_bits_.resize(static_cast<size_t>(S) * c.q_dim());
    KVR_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(s.q.data(), sp.q_f32.data(), sp.q_f32.bytes(), cudaMemcpyDeviceToHost, st));
    KVR_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(s.ids.data(), sp.ids.data(), sp.ids.bytes(), cudaMemcpyDeviceToHost, st));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.counts.data(), sp.counts.data(), sp.counts.bytes(),
                                             cudaMemcpyDeviceToHost, st));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(snapshot_attn_bits_.data(), r.out,
                                             snapshot_attn_bits_.size() * sizeof(uint16_t),
                                             cudaMemcpyDeviceToHost, st));
    KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
    s.attn.resize(snapshot_attn_bits_.size());
    for (size_t i = 0; i < s.attn.size(); ++i) {
      const uint32_t u = uint32_t{snapshot_attn_bits_[i]} << 16;
      std::memcpy(&s.attn[i], &u, sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status SparseDecodeImpl::HostSelect(int layer, cudaStream_t st) {
  SparseState& sp = *sparse_;
  const int64_t qd = config_.q_dim(), kv = config_.n_kv_heads, B = sp.opt.budget;
  for (const HostSelected& h : host_selected_) {
    const int64_t slot = h.seq->slot;
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.h_q.data() + slot * qd, sp.q_f32.data() + slot * qd,
                                             qd * sizeof(float), cudaMemcpyDeviceToHost, st));
  }
  KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  // The selectors, one sequence per task (each selector is its sequence's own).
  std::vector<absl::Status> results(host_selected_.size());
  auto run = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const HostSelected& h = host_selected_[i];
      const int64_t slot = h.seq->slot;
      int32_t* ids = sp.h_ids.data() + slot * kv * B;
      int32_t* counts = sp.h_counts.data() + slot * kv;
      std::fill(ids, ids + kv * B, -1);
      std::fill(counts, counts + kv, 0);
      results[i] = h.seq->selector->Select(
          layer, h.position, {sp.h_q.data() + slot * qd, static_cast<size_t>(qd)}, h.cand_begin,
          h.cand_end, static_cast<int>(B), {ids, static_cast<size_t>(kv * B)},
          {counts, static_cast<size_t>(kv)});
    }
  };
  if (sp.host_pool != nullptr && host_selected_.size() > 1) {
    sp.host_pool->ParallelFor(host_selected_.size(), run);
  } else {
    run(0, host_selected_.size());
  }
  for (size_t i = 0; i < host_selected_.size(); ++i) {
    const HostSelected& h = host_selected_[i];
    const int64_t slot = h.seq->slot;
    int32_t* ids = sp.h_ids.data() + slot * kv * B;
    int32_t* counts = sp.h_counts.data() + slot * kv;
    auto fail = [&](auto&&... parts) {
      return absl::InternalError(absl::StrCat("sequence ", h.id, " layer ", layer,
                                              ": host selection: ", parts...));
    };
    if (const absl::Status& s = results[i]; !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("sequence ", h.id, " layer ", layer,
                                                 ": host selection: ", s.message()));
    }
    // The selection contract of the gather / attention: ascending, distinct, in range.
    for (int64_t hh = 0; hh < kv; ++hh) {
      const int32_t n = counts[hh];
      if (n < 0 || n > B) return fail("KV head ", hh, " selected ", n, " rows, budget ", B);
      int32_t* head = ids + hh * B;
      std::sort(head, head + n);
      for (int32_t i = 0; i < n; ++i) {
        if (head[i] < h.cand_begin || head[i] >= h.cand_end || (i > 0 && head[i] == head[i - 1])) {
          return fail("KV head ", hh, " selected position ", head[i], " (twice, or outside [",
                      h.cand_begin, ", ", h.cand_end, "))");
        }
      }
    }
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.ids.data() + slot * kv * B, ids,
                                             kv * B * sizeof(int32_t), cudaMemcpyHostToDevice, st));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.counts.data() + slot * kv, counts,
                                             kv * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  }
  return absl::OkStatus();
}

absl::Status SparseDecodeImpl::FetchMissesAndFill(int layer, const KvPoolView& pool,
                                                  cudaStream_t st) {
  SparseState& sp = *sparse_;
  HotCache& hot = sp.hot[layer];
  auto fill = [&](int first_slot, int n_slots) {
    return hot.Fill(pool, sp.ids.data(), sp.counts.data(), sp.gathered.data(), st, sp.staged_device,
                    sp.staged_index_device, first_slot, n_slots);
  };
  const int64_t kv = config_.n_kv_heads, B = sp.opt.budget, row = SourceRowBytes();
  const int32_t* slot_of = sp.hot[layer].slot_of();
  // The ids, cache slots and counts of the slots from the first fetched one to the last: three
  // copies, however many sequences are fetched.
  int lo = sp.opt.slots, hi = -1;
  for (const Sequence* s : fetched_) {
    lo = std::min(lo, s->slot);
    hi = std::max(hi, s->slot);
  }
  {
    const int64_t e0 = int64_t{lo} * kv * B, n = int64_t{hi - lo + 1} * kv * B;
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.h_fetch_ids.data() + e0, sp.ids.data() + e0,
                                             n * sizeof(int32_t), cudaMemcpyDeviceToHost, st));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.h_slot_of.data() + e0, slot_of + e0,
                                             n * sizeof(int32_t), cudaMemcpyDeviceToHost, st));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        sp.h_fetch_counts.data() + lo * kv, sp.counts.data() + lo * kv,
        int64_t{hi - lo + 1} * kv * sizeof(int32_t), cudaMemcpyDeviceToHost, st));
  }
  // Also orders this layer's staging after the previous layer's Fill, which read it.
  KVR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  // Every fetched sequence's misses, in (sequence, head, entry) order, each sequence's fetch
  // started as soon as its list is made (the store works while the host makes the next), all
  // started before any is waited for; straight into the staging, each sequence's rows after the
  // previous one's.
  uint8_t* staged = sp.staged.data();
  int32_t* staged_index = sp.staged_index.data();
  std::vector<int32_t>& positions = sp.fetch_positions;
  std::vector<int64_t>& entries = sp.fetch_entries;
  positions.clear();
  entries.clear();
  // At most budget rows per (slot, head): reserved, so the spans taken below stay valid.
  positions.reserve(static_cast<size_t>(sp.opt.slots * kv * B));
  entries.reserve(static_cast<size_t>(sp.opt.slots * kv * B));
  std::vector<FetchPending>& pending = sp.fetch_pending;
  pending.resize(fetched_.size());
  for (size_t f = 0; f < fetched_.size(); ++f) {
    Sequence* s = fetched_[f];
    FetchPending& p = pending[f];
    p.s = s;
    p.first = positions.size();
    p.heads.clear();
    for (int64_t h = 0; h < kv; ++h) {
      const int64_t e0 = (int64_t{s->slot} * kv + h) * B;
      const size_t head_first = positions.size();
      const int32_t n = sp.h_fetch_counts.data()[s->slot * kv + h];
      for (int32_t i = 0; i < n && i < B; ++i) {
        if (sp.h_slot_of.data()[e0 + i] >= 0 || sp.h_fetch_ids.data()[e0 + i] < 0) continue;
        positions.push_back(sp.h_fetch_ids.data()[e0 + i]);
        entries.push_back(e0 + i);
      }
      if (positions.size() > head_first) {
        p.heads.push_back({layer, static_cast<int>(h),
                           {positions.data() + head_first, positions.size() - head_first}});
      }
    }
    p.count = positions.size() - p.first;
    for (size_t i = p.first; i < entries.size(); ++i) {
      staged_index[entries[i]] = static_cast<int32_t>(i);
    }
    if (p.count == 0 || !s->fetch_failure.ok()) continue;
    s->fetch_failure =
        s->fetch->Start(p.heads, {staged + p.first * row, p.count * static_cast<size_t>(row)});
  }
  // While the fetches run: the slots that wait for none (sequences read in place, free slots),
  // in runs of consecutive slots.
  const int S = sp.opt.slots;
  std::vector<uint8_t>& waits = sp.fetch_waits;
  waits.assign(S, 0);
  for (const FetchPending& p : pending) waits[p.s->slot] = p.count > 0;
  for (int b = 0; b < S;) {
    if (waits[b]) {
      ++b;
      continue;
    }
    int e = b;
    while (e < S && !waits[e]) ++e;
    KVR_RETURN_IF_ERROR(fill(b, e - b));
    b = e;
  }
  for (FetchPending& p : pending) {
    if (p.count == 0) continue;
    Sequence& s = *p.s;
    const bool started = s.fetch_failure.ok();
    if (started) s.fetch_failure = s.fetch->Wait();
    if (s.fetch_failure.ok()) {
      s.fetched_rows += static_cast<int64_t>(p.count);
    } else {  // void output from now on; the caller ends the sequence
      std::memset(staged + p.first * row, 0, p.count * row * sizeof(uint16_t));
    }
    KVR_RETURN_IF_ERROR(fill(s.slot, 1));
  }
  return absl::OkStatus();
}

absl::Status SparseDecodeImpl::FetchRing(Sequence& s, int64_t n_tokens) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  // row: bf16 values of a ring row; fetched: bytes of a fetched (store) row.
  const int64_t kv = c.n_kv_heads, row = 2 * int64_t{c.head_dim}, S = sp.opt.slots;
  const int64_t fetched_row = SourceRowBytes();
  const bool fp8 = sp.opt.row_format == SparseRowFormat::kFp8E4m3;
  const int64_t sink = std::min<int64_t>(sp.opt.n_sink, n_tokens);
  const int64_t base = std::max<int64_t>(sp.opt.n_sink, n_tokens - sp.opt.local_window);
  std::vector<int32_t> positions;
  for (int64_t p = 0; p < sink; ++p) positions.push_back(static_cast<int32_t>(p));
  for (int64_t p = base; p < n_tokens; ++p) positions.push_back(static_cast<int32_t>(p));
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<SparseRowFetcher::Rows> rows;
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < kv; ++h) rows.push_back({l, h, positions});
  }
  std::vector<uint8_t> fetched(static_cast<size_t>(c.n_layers * kv * n * fetched_row));
  KVR_RETURN_IF_ERROR(s.fetch->Start(rows, fetched));
  KVR_RETURN_IF_ERROR(s.fetch->Wait());
  s.fetched_rows += c.n_layers * kv * n;
  // Into the ring's order (sparse_kernels.cuh: token p at p below n_sink, else at n_sink +
  // (p - n_sink) % window), one (layer, head) at a time.
  std::vector<uint16_t> ring(static_cast<size_t>(sp.rcap * row), 0);
  std::vector<float> decoded(static_cast<size_t>(row));
  for (int l = 0; l < c.n_layers; ++l) {
    for (int64_t h = 0; h < kv; ++h) {
      const uint8_t* src = fetched.data() + (l * kv + h) * n * fetched_row;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = positions[i];
        const int64_t r = p < sp.opt.n_sink ? p : sp.opt.n_sink + (p - sp.opt.n_sink) % sp.opt.local_window;
        if (fp8) {
          // As the GPU decodes an fp8 row (HotCache, SparseFill): code x scale, rounded to bf16.
          DecodeFp8Row(Fp8RowLayout{2, c.head_dim}, src + i * fetched_row, decoded.data());
          for (int64_t j = 0; j < row; ++j) ring[r * row + j] = FloatToBf16(decoded[j]);
        } else {
          std::memcpy(ring.data() + r * row, src + i * fetched_row, fetched_row);
        }
      }
      bf16* dst = sp.resident.data() + ((int64_t{l} * S + s.slot) * kv + h) * sp.rcap * row;
      // Pageable source: staged when the call returns, so `ring` may be reused at once.
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, ring.data(), ring.size() * sizeof(uint16_t),
                                               cudaMemcpyHostToDevice, stream()));
    }
  }
  for (HotCache& h : sp.hot) KVR_RETURN_IF_ERROR(h.ResetSlot(s.slot, stream()));
  return Sync();
}

absl::Status SparseDecodeImpl::CopySlot(const Sequence& from, Sequence& to) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  const int64_t kv = c.n_kv_heads, d = c.head_dim, S = sp.opt.slots;
  auto copy = [&](auto* base, int64_t per_slot) -> absl::Status {
    for (int64_t l = 0; l < c.n_layers; ++l) {
      auto* layer = base + l * S * per_slot;
      KVR_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(layer + to.slot * per_slot, layer + from.slot * per_slot,
                          per_slot * sizeof(*base), cudaMemcpyDeviceToDevice, stream()));
    }
    return absl::OkStatus();
  };
  KVR_RETURN_IF_ERROR(copy(sp.resident.data(), kv * sp.rcap * 2 * d));
  if (sp.opt.method == SparseMethod::kQuest) {
    if (sp.bounds_bf16.size() > 0) {
      KVR_RETURN_IF_ERROR(copy(sp.bounds_bf16.data(), sp.pages * sp.bounds_row()));
    } else {
      KVR_RETURN_IF_ERROR(copy(sp.bounds.data(), sp.pages * sp.bounds_row()));
    }
  } else {
    KVR_RETURN_IF_ERROR(copy(sp.centroids.data(), kv * sp.max_clusters * d));
    KVR_RETURN_IF_ERROR(copy(sp.n_clusters.data(), kv));
    KVR_RETURN_IF_ERROR(copy(sp.offsets.data(), kv * (sp.max_clusters + 1)));
    KVR_RETURN_IF_ERROR(copy(sp.members.data(), kv * sp.opt.max_capacity));
  }
  for (HotCache& h : sp.hot) KVR_RETURN_IF_ERROR(h.ResetSlot(to.slot, stream()));
  return Sync();
}

absl::Status SparseDecodeImpl::FillSlotFromHostKv(Sequence& s, int64_t n_tokens, bool summaries) {
  SparseState& sp = *sparse_;
  const ModelConfig& c = config_;
  SparseFillParams fp;
  fp.pool = sp.PoolView(0);
  fp.pages_layer_stride = int64_t{sp.opt.slots} * c.n_kv_heads * sp.max_pages;
  fp.length = n_tokens;
  fp.slot = s.slot;
  fp.resident = sp.resident.data();
  fp.resident_layer_stride = int64_t{sp.opt.slots} * c.n_kv_heads * sp.rcap * 2 * c.head_dim;
  fp.rcap = sp.rcap;
  fp.n_sink = sp.opt.n_sink;
  fp.window = sp.opt.local_window;
  fp.sum = sp.View();
  fp.tokens_per_cluster = sp.opt.clusterkv_tokens_per_cluster;
  fp.n_layers = c.n_layers;
  fp.n_kv_heads = c.n_kv_heads;
  fp.head_dim = c.head_dim;
  fp.fp8_rows = sp.opt.row_format == SparseRowFormat::kFp8E4m3;  // then every source is paged
  fp.summaries = summaries;
  KVR_RETURN_IF_ERROR(LaunchSparseFill(fp, stream()));
  for (HotCache& h : sp.hot) KVR_RETURN_IF_ERROR(h.ResetSlot(s.slot, stream()));
  return Sync();
}

absl::StatusOr<SparseDecodeImpl::Sequence*> SparseDecodeImpl::OwnSparseSequence(SequenceId id,
                                                                                const char* what) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat(what, ": no sequence ", id));
  }
  Sequence& s = it->second;
  for (const auto& [oid, o] : sequences_) {
    if (oid != id && s.host != nullptr && o.host == s.host) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": sequence ", id,
                                                        " shares its host KV with sequence ", oid,
                                                        " (benchmarks only)"));
    }
  }
  return &s;
}

absl::StatusOr<std::span<uint16_t>> SparseDecodeImpl::HostKv(SequenceId id) {
  KVR_ASSIGN_OR_RETURN(Sequence * s, OwnSparseSequence(id, "HostKv"));
  if (s->host == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("HostKv: sequence ", id, " reads its past from a row source (no host KV)"));
  }
  // The caller overwrites it: no longer FillSequenceForBenchmark's random rows.
  s->host->filled_seed = 0;
  s->filled_seed = 0;
  return s->host->rows();
}

absl::StatusOr<SparseDecodeImpl::Sequence*> SparseDecodeImpl::ActivatableSequence(
    SequenceId id, int64_t n_tokens, const char* what) {
  KVR_ASSIGN_OR_RETURN(Sequence * s, OwnSparseSequence(id, what));
  if (s->length != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": sequence ", id, " already holds ", s->length, " tokens"));
  }
  if (n_tokens < 1 || n_tokens > s->capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": n_tokens ", n_tokens, " outside [1, capacity ", s->capacity, "]"));
  }
  if (s->host != nullptr) s->host->filled_seed = 0;
  s->filled_seed = 0;
  return s;
}

absl::Status SparseDecodeImpl::ActivateSequence(SequenceId id, int64_t n_tokens) {
  KVR_ASSIGN_OR_RETURN(Sequence * s, ActivatableSequence(id, n_tokens, "ActivateSequence"));
  // Another slot over the same row source, activated at the same length, holds the same ring
  // and summaries (benchmarks run many slots over one store sequence): copy them.
  const Sequence* twin = nullptr;
  for (const auto& [oid, o] : sequences_) {
    if (oid != id && s->source_key != 0 && o.source_key == s->source_key && o.length == n_tokens &&
        o.sparse_steps == 0 && s->lane < 0 && o.lane < 0) {
      twin = &o;
      break;
    }
  }
  if (twin != nullptr) {
    KVR_RETURN_IF_ERROR(CopySlot(*twin, *s));
    KVR_RETURN_IF_ERROR(FetchFromNowOn(*s));
    s->length = n_tokens;
    return absl::OkStatus();
  }
  if (s->lane >= 0) {
    KVR_RETURN_IF_ERROR(sparse_->lanes[s->lane]->Activate(s->slot, s->lane_indexes, n_tokens,
                                                          s->capacity, stream()));
    s->lane_indexes.clear();
    s->lane_indexed = n_tokens;
  }
  if (s->fetch != nullptr && s->source_key == 0 && s->selector == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ActivateSequence: sequence ", id,
        " fetches its rows, so the GPU method cannot build its summaries from them: give it a "
        "host selector, or clusterkv's clusters (ActivateSequenceWithClusters)"));
  }
  // A host-selected or lane sequence needs no summaries of the configured method: ring rows only.
  KVR_RETURN_IF_ERROR(
      PrepareSlot(*s, n_tokens, /*summaries=*/s->selector == nullptr && s->lane < 0));
  KVR_RETURN_IF_ERROR(FetchFromNowOn(*s));
  s->length = n_tokens;
  return absl::OkStatus();
}

absl::Status SparseDecodeImpl::ActivateSequenceWithClusters(
    SequenceId id, int64_t n_tokens, std::span<const SparseClusterHead> heads) {
  const ModelConfig& c = config_;
  if (sparse_ == nullptr || sparse_->opt.method != SparseMethod::kClusterKv) {
    return absl::InvalidArgumentError(
        "ActivateSequenceWithClusters: the sparse configuration is not clusterkv");
  }
  const int64_t kv = c.n_kv_heads, d = c.head_dim;
  if (static_cast<int64_t>(heads.size()) != int64_t{c.n_layers} * kv) {
    return absl::InvalidArgumentError(absl::StrCat("ActivateSequenceWithClusters: ", heads.size(),
                                                   " heads, expected ", c.n_layers, " layers x ",
                                                   kv));
  }
  KVR_ASSIGN_OR_RETURN(Sequence * sq,
                       ActivatableSequence(id, n_tokens, "ActivateSequenceWithClusters"));
  Sequence& s = *sq;
  SparseState& sp = *sparse_;
  const int K = sp.max_clusters;
  const int64_t M = sp.opt.max_capacity;
  const int64_t lo = sp.opt.n_sink, hi = n_tokens - sp.opt.local_window;  // clustered: [lo, hi)
  std::vector<bf16> cent(static_cast<size_t>(kv * K * d));
  std::vector<int32_t> count(kv), off(static_cast<size_t>(kv * (K + 1))), mem(kv * M);
  const int64_t S = sp.opt.slots;
  auto fail = [&](auto&&... parts) {  // s.length stays 0: not activated
    return absl::InvalidArgumentError(absl::StrCat("ActivateSequenceWithClusters: ", parts...));
  };
  for (int l = 0; l < c.n_layers; ++l) {
    std::fill(cent.begin(), cent.end(), __float2bfloat16(0.f));
    std::fill(mem.begin(), mem.end(), -1);
    for (int64_t h = 0; h < kv; ++h) {
      const SparseClusterHead& in = heads[l * kv + h];
      const int64_t nc_in = static_cast<int64_t>(in.offsets.size()) - 1;
      if (nc_in < 0 || static_cast<int64_t>(in.centroids.size()) != nc_in * d ||
          in.offsets.back() != static_cast<int32_t>(in.ids.size())) {
        return fail("layer ", l, " head ", h, ": inconsistent centroids / offsets / ids");
      }
      int32_t nc = 0, n = 0;
      int32_t* o = off.data() + h * (K + 1);
      o[0] = 0;
      for (int64_t cl = 0; cl < nc_in; ++cl) {
        const int32_t before = n;
        for (int32_t j = in.offsets[cl]; j < in.offsets[cl + 1]; ++j) {
          const int32_t t = in.ids[j];
          if (t < lo || t >= hi) continue;
          if (n >= M) return fail("layer ", l, " head ", h, ": more members than ", M);
          mem[h * M + n++] = t;
        }
        if (n == before) continue;  // empty after the window's tokens left it
        if (nc >= K) return fail("layer ", l, " head ", h, ": more than ", K, " clusters");
        std::transform(in.centroids.data() + cl * d, in.centroids.data() + (cl + 1) * d,
                       cent.data() + (h * K + nc) * d, [](float x) { return __float2bfloat16(x); });
        o[++nc] = n;
      }
      for (int cl = nc + 1; cl <= K; ++cl) o[cl] = n;
      count[h] = nc;
    }
    const int64_t base = (int64_t{l} * S + s.slot) * kv;
    auto h2d = [&](auto* dst, const auto& src) {
      return cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(src[0]), cudaMemcpyHostToDevice,
                             stream());
    };
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.centroids.data() + base * K * d, cent));
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.n_clusters.data() + base, count));
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.offsets.data() + base * (K + 1), off));
    // Pageable sources: each copy has staged them when it returns, so the next layer may reuse
    // the host arrays without a synchronize.
    KVR_CUDA_RETURN_IF_ERROR(h2d(sp.members.data() + base * M, mem));
  }
  // The ring rows only: the synthetic clustering LaunchSparseFill would build (reading every
  // key over PCIe) is what the real clusters above replace. Synchronous.
  KVR_RETURN_IF_ERROR(PrepareSlot(s, n_tokens, /*summaries=*/false));
  KVR_RETURN_IF_ERROR(FetchFromNowOn(s));
  s.length = n_tokens;
  return absl::OkStatus();
}

absl::Status SparseDecodeImpl::ReleaseSequence(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("SparseDecode: no sequence ", id));
  }
  if (sparse_ != nullptr) sparse_->owner[it->second.slot].reset();
  sequences_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> SparseDecodeImpl::SequenceLength(SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("SparseDecode: no sequence ", id));
  }
  return it->second.length;
}

absl::Status SparseDecodeImpl::FillSequenceForBenchmark(SequenceId id, int64_t n_tokens,
                                                        uint64_t seed) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("SparseDecode: no sequence ", id));
  }
  Sequence& s = it->second;
  if (n_tokens < 0 || n_tokens > s.capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("FillSequenceForBenchmark: ", n_tokens, " tokens, capacity ", s.capacity));
  }
  if (s.host == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("FillSequenceForBenchmark: sequence ", id,
                                                      " reads its past from a row source"));
  }
  HostKvImpl& host = *s.host;
  if (host.filled_seed != seed + 1) {
    KVR_RETURN_IF_ERROR(
        model_.FillRandomBf16(host.device, static_cast<int64_t>(host.buf.size()), seed));
    host.filled_seed = seed + 1;
  }
  // Another slot on the same host KV filled alike: copy its ring and summaries (HBM to HBM)
  // instead of reading the host KV again.
  const Sequence* twin = nullptr;
  for (const auto& [oid, o] : sequences_) {
    if (oid != id && o.host == s.host && o.filled_seed == seed + 1 && o.length == n_tokens) {
      twin = &o;
      break;
    }
  }
  if (twin != nullptr) {
    KVR_RETURN_IF_ERROR(CopySlot(*twin, s));
  } else {
    KVR_RETURN_IF_ERROR(FillSlotFromHostKv(s, n_tokens, /*summaries=*/true));
  }
  s.filled_seed = seed + 1;
  s.length = n_tokens;
  return absl::OkStatus();
}

absl::StatusOr<model::CudaAttentionPlan> SparseDecodeImpl::Plan(
    std::span<const model::CudaSequence> batch) {
  if (sparse_ == nullptr) {
    return absl::FailedPreconditionError("SparseDecode: Forward before Configure");
  }
  const ModelConfig& c = config_;
  std::vector<Sequence*> seqs(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    const model::CudaSequence& in = batch[b];
    auto it = sequences_.find(in.id);
    if (it == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat("CudaModel::Forward: no sequence ", in.id));
    }
    const Sequence& s = it->second;
    if (in.tokens.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("CudaModel::Forward: sparse sequence ", in.id, " has ", in.tokens.size(),
                       " tokens; sparse sequences take one token per Forward"));
    }
    const int64_t length = s.length + 1;
    if (length > s.capacity || length > c.context_length) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", in.id, " would be ", length, " tokens (", s.length,
                       " cached + 1 new), more than its capacity of ", s.capacity,
                       " or the context length of ", c.context_length));
    }
    seqs[b] = &it->second;
  }
  // The batch's rows are the slots: every layer runs over all of them (empty ones masked).
  SparseState& sp = *sparse_;
  const SparseDecodeOptions& o = sp.opt;
  const int S = o.slots;
  model::CudaAttentionPlan plan;
  plan.n_rows = S;
  plan.rows.resize(batch.size());
  for (int r = 0; r < S; ++r) {
    sp.h_rows.data()[r] = SparseRow{};
    sp.h_meta.data()[r] = sp.h_meta.data()[S + r] = sp.h_meta.data()[2 * S + r] = 0;
    sp.h_budgets.data()[r] = 0;
  }
  max_candidates_ = 0;
  copy_new_rows_ = false;
  host_selected_.clear();
  fetched_.clear();
  for (auto& lane : sp.lanes) lane->Clear();
  for (size_t b = 0; b < batch.size(); ++b) {
    const Sequence& q = *seqs[b];
    const int r = q.slot;
    const int64_t len = q.length + 1;  // with the new token
    const int64_t local_begin = std::max<int64_t>(o.n_sink, len - o.local_window);
    plan.rows[b] = r;
    sp.h_budgets.data()[r] = q.budget;
    sp.h_rows.data()[r] =
        SparseRow{q.host != nullptr ? q.host->device : nullptr, q.capacity, q.length, 1};
    sp.h_meta.data()[r] = o.n_sink;
    sp.h_meta.data()[S + r] = static_cast<int32_t>(local_begin);
    sp.h_meta.data()[2 * S + r] = static_cast<int32_t>(std::min<int64_t>(o.n_sink, len) +
                                                       std::max<int64_t>(0, len - local_begin));
    if (q.lane >= 0) {
      // The configured selector sees no candidates; the lane selects over [n_sink, local_begin)
      // and first takes in the token that just left the window (pariskv: its codes), once the
      // prompt's are behind.
      sp.h_meta.data()[S + r] = o.n_sink;
      const int64_t left = local_begin - 1;
      const bool encode = left >= o.n_sink && left >= q.lane_indexed;
      seqs[b]->lane_next = encode ? left + 1 : q.lane_indexed;
      sp.lanes[q.lane]->Add(r, o.n_sink, static_cast<int32_t>(local_begin),
                            static_cast<int32_t>(seqs[b]->lane_next), encode ? left : -1, q.budget,
                            len - 1);
      max_candidates_ = std::max(max_candidates_, local_begin - o.n_sink);
    } else if (q.selector != nullptr) {
      // The GPU selector sees no candidates (it selects nothing for this slot); the host
      // selector gets the range as the CPU decode path computes it.
      sp.h_meta.data()[S + r] = o.n_sink;
      const int64_t sink = std::min<int64_t>(o.n_sink, len);
      host_selected_.push_back({batch[b].id, &q, len - 1, sink,
                                std::max<int64_t>(sink, len - o.local_window)});
    } else {
      max_candidates_ = std::max(max_candidates_, local_begin - o.n_sink);
    }
    // Sequences reading their past from a row source get the step's new rows back in host
    // memory.
    copy_new_rows_ |= q.host == nullptr;
    if (q.fetch != nullptr) fetched_.push_back(seqs[b]);
  }
  // A CUDA graph of the step (CudaAttentionPlan::graph_key) when its launches and their arguments
  // depend on nothing that changes between steps but End's copy of the new rows and, for quest,
  // the bound of the candidate ranges its grid covers (QuestCandidateBound: it moves every 4096
  // tokens, not every step); clusterkv's selection reads its ranges and cluster counts on the
  // device and its grid follows max_clusters. Lanes, host selectors and fetches do host work
  // between launches, a replay picks its step on the host and a test snapshot copies back in the
  // middle of a layer: those steps are launched one by one.
  const bool lanes_idle =
      std::all_of(sp.lanes.begin(), sp.lanes.end(), [](const auto& lane) { return lane->empty(); });
  if (lanes_idle && host_selected_.empty() && fetched_.empty() && o.replay == nullptr &&
      snapshot_layer_ < 0) {
    const uint64_t bound = o.method == SparseMethod::kQuest
                               ? static_cast<uint64_t>(QuestCandidateBound(max_candidates_))
                               : 0;
    // Bits: generation | quest's bound (< 2^30 tokens) | End's copy of the new rows.
    if (bound < (uint64_t{1} << 30)) {
      plan.graph_key = generation_ << 31 | bound << 1 | (copy_new_rows_ ? 1 : 0);
    }
  }
  planned_ = std::move(seqs);
  return plan;
}

absl::Status SparseDecodeImpl::Begin(void* stream_ptr) {
  cudaStream_t st = static_cast<cudaStream_t>(stream_ptr);
  SparseState& sp = *sparse_;
  const int64_t n_rows = sp.opt.slots;
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.rows.data(), sp.h_rows.data(),
                                           n_rows * sizeof(SparseRow), cudaMemcpyHostToDevice, st));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      sp.meta.data(), sp.h_meta.data(), 3 * n_rows * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.budgets.data(), sp.h_budgets.data(),
                                           n_rows * sizeof(int32_t), cudaMemcpyHostToDevice, st));
  for (auto& lane : sp.lanes) KVR_RETURN_IF_ERROR(lane->Begin(st));
  return absl::OkStatus();
}

absl::Status SparseDecodeImpl::End(void* stream_ptr) {
  cudaStream_t st = static_cast<cudaStream_t>(stream_ptr);
  const SparseState& sp = *sparse_;
  KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.h_slot_counters.data(), sp.slot_counters.data(),
                                           sp.slot_counters.bytes(), cudaMemcpyDeviceToHost, st));
  if (copy_new_rows_) {
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sp.h_new_rows.data(), sp.new_rows.data(),
                                             sp.new_rows.bytes(), cudaMemcpyDeviceToHost, st));
  }
  return absl::OkStatus();
}

void SparseDecodeImpl::Finish(bool ok) {
  if (ok) {
    for (Sequence* s : planned_) {
      ++s->length;
      if (s->lane >= 0) s->lane_indexed = s->lane_next;
      s->new_rows_ready = s->host == nullptr;
      ++s->sparse_steps;
    }
    ++sparse_->steps;
  }
  planned_.clear();
  host_selected_.clear();
  fetched_.clear();
  max_candidates_ = 0;
  copy_new_rows_ = false;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SparseDecodeAttention>> CreateSparseDecodeAttention(
    model::CudaModel& model) {
  return std::make_unique<SparseDecodeImpl>(model);
}

}  // namespace kvr::retrieval::cuda
