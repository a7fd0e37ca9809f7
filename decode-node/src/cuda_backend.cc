// The CUDA DecodeBackend (cuda_backend.h) and MakeDecodeBackend.

#include "kvr/decode/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/decode/handoff_indexes.h"
#include "kvr/decode/store_row_fetcher.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/cuda/sparse_decode.h"
#include "kvr/retrieval/prebuilt.h"
#include "kvr/retrieval/registry.h"
#include "spdlog/spdlog.h"

namespace kvr::decode {
namespace {

// The store dtype of the rows a node of these options reads (gpu_row_format).
kv_store::DType StoreRowDType(const CudaDecodeBackendOptions& o) {
  return o.row_format == "fp8" ? kv_store::DType::kFp8E4m3 : kv_store::DType::kBf16;
}

namespace rc = kvr::retrieval::cuda;

// The selection of a method this node has no GPU selector for: the method's CPU index of every
// layer (the prefill node's summaries, as shipped), fed the generated keys as they leave the
// local window, as the CPU decode path feeds them (DecodeAttention::Prepare). The GPU gathers
// and attends what it selects like any other selection.
class IndexSelector final : public rc::SparseHostSelector {
 public:
  IndexSelector(std::vector<std::unique_ptr<retrieval::RetrievalIndex>> indexes,
                const model::ModelConfig& c, std::string method, int64_t prompt_tokens,
                int64_t budget)
      : indexes_(std::move(indexes)),
        method_(std::move(method)),
        n_kv_(c.n_kv_heads),
        head_dim_(c.head_dim),
        budget_(budget),
        kept_(c.n_layers),
        kept_from_(c.n_layers, prompt_tokens) {}

  // The keys of the generated token at `position`: rows [n_layers, 2 (K, V), n_kv_heads,
  // head_dim] bf16 bits (SparseDecodeAttention::NewRows). Kept, per layer, until the layer's
  // index has taken them (they leave the window `local_window` steps later).
  void AddGenerated(int64_t position, std::span<const uint16_t> rows) {
    const int64_t row = int64_t{n_kv_} * head_dim_;
    for (size_t l = 0; l < kept_.size(); ++l) {
      if (indexes_[l] == nullptr) continue;  // full: no index to feed
      std::vector<float>& keys = kept_[l];
      if (kept_from_[l] + static_cast<int64_t>(keys.size()) / row != position) continue;
      const uint16_t* k = rows.data() + l * 2 * row;
      for (int64_t i = 0; i < row; ++i) keys.push_back(Bf16ToFloat(k[i]));
    }
  }

  absl::Status Select(int layer, int64_t position, std::span<const float> query,
                      int64_t cand_begin, int64_t cand_end, int budget, std::span<int32_t> ids,
                      std::span<int32_t> counts) override {
    retrieval::RetrievalIndex* index = indexes_[layer].get();
    if (index == nullptr) {  // full: every candidate
      const int64_t n = cand_end - cand_begin;
      if (n > budget) {
        return absl::FailedPreconditionError(
            absl::StrCat("method full selects all ", n, " candidates, more than the ", budget,
                         " rows a step gathers on this node (gpu_budget)"));
      }
      for (int h = 0; h < n_kv_; ++h) {
        counts[h] = static_cast<int32_t>(n);
        for (int64_t i = 0; i < n; ++i) ids[h * budget + i] = static_cast<int32_t>(cand_begin + i);
      }
      return absl::OkStatus();
    }
    // Rows that left the window join the index.
    const int64_t row = int64_t{n_kv_} * head_dim_;
    if (index->size() < cand_end) {
      std::vector<float>& keys = kept_[layer];
      const int64_t from = index->size() - kept_from_[layer];
      const int64_t n = cand_end - index->size();
      if (from < 0 || (from + n) * row > static_cast<int64_t>(keys.size())) {
        return absl::InternalError(absl::StrCat(
            "the index covers [0, ", index->size(), ") but the generated keys kept are [",
            kept_from_[layer], ", ", kept_from_[layer] + static_cast<int64_t>(keys.size()) / row,
            "), the window leaves at ", cand_end));
      }
      retrieval::AppendInput in;
      in.keys = {keys.data() + from * row, n, row};
      KVR_RETURN_IF_ERROR(index->Append(in));
      keys.erase(keys.begin(), keys.begin() + (from + n) * row);
      kept_from_[layer] += from + n;
    }
    retrieval::SelectRequest sel;
    sel.query = query.data();
    sel.query_position = position;
    sel.budget = std::min<int64_t>(budget_, budget);
    sel.n_sink = cand_begin;
    sel.local_begin = cand_end;
    KVR_RETURN_IF_ERROR(index->Select(sel, &selection_));
    if (static_cast<int>(selection_.per_head.size()) != n_kv_) {
      return absl::InternalError(absl::StrCat("method ", method_, " returned ",
                                              selection_.per_head.size(), " KV heads"));
    }
    for (int h = 0; h < n_kv_; ++h) {
      const std::vector<int64_t>& got = selection_.per_head[h];
      if (static_cast<int64_t>(got.size()) > budget) {
        return absl::InternalError(absl::StrCat("method ", method_, " selected ", got.size(),
                                                " rows, budget ", budget));
      }
      counts[h] = static_cast<int32_t>(got.size());
      for (size_t i = 0; i < got.size(); ++i) ids[h * budget + i] = static_cast<int32_t>(got[i]);
    }
    return absl::OkStatus();
  }

  int64_t MemoryBytes() const {
    int64_t bytes = 0;
    for (const auto& index : indexes_) bytes += index != nullptr ? index->MemoryBytes() : 0;
    return bytes;
  }

 private:
  std::vector<std::unique_ptr<retrieval::RetrievalIndex>> indexes_;  // per layer; null: full
  std::string method_;
  int n_kv_, head_dim_;
  int64_t budget_;  // the request's
  // Per layer: generated keys not yet in the index, fp32 [tokens, n_kv_heads, head_dim], the
  // first at position kept_from_[layer].
  std::vector<std::vector<float>> kept_;
  std::vector<int64_t> kept_from_;
  retrieval::Selection selection_;
};

// Between Prepare and Join: where the sequence's rows are in the store (its page table, read in
// place through the store's pool mapped into this process) and, for clusterkv, the handed-off
// clusters.
struct CudaPending final : BackendSequence {
  explicit CudaPending(int64_t bytes) : bytes(bytes) {}
  ~CudaPending() override {
    if (dense_room != nullptr) dense_room->fetch_sub(dense_bytes);  // never joined
  }
  int64_t resident_bytes() const override { return bytes; }
  int64_t bytes;
  int64_t capacity = 0;  // tokens the sequence may hold (prompt + max_tokens, capped)
  // Dense when it pays (dense_bytes > 0): the sequence runs densely, its KV in HBM, filled from
  // `table`'s pages at Join; dense_bytes of the node's dense room are reserved for it until it
  // leaves (given back here if it never joins).
  bool dense() const { return dense_bytes > 0; }
  kv_store::PageTable table;
  std::atomic<int64_t>* dense_room = nullptr;
  int64_t dense_bytes = 0;
  rc::SparseRowSource rows;
  std::shared_ptr<const kv_store::LocalPoolMapping> pool;  // keeps the mapping alive
  std::shared_ptr<rc::SparseRowFetcher> fetch;  // rows fetched instead (no page table)
  // clusterkv: the handed-off clusters of every layer (the prefill node's k-means).
  std::vector<retrieval::PrebuiltClusterKvData> clusters;
  // A method other than the node's GPU method: selected by a GPU lane built from its CPU
  // indexes (lane non-empty: `indexes` hold them until Join), else on the host by them.
  std::shared_ptr<IndexSelector> selector;
  std::string lane;
  std::vector<std::unique_ptr<retrieval::RetrievalIndex>> indexes;
  // clusterkv: the handed-off clusters were more than the node reserved room for (a request
  // budget below the node's asks the prefill for more): selected on the host instead.
  bool clusters_over_room = false;
};

// A running sequence: its store, the rows of the last step being appended there, and counters.
struct CudaRunning {
  kv_store::KvStoreClient* store = nullptr;
  std::shared_ptr<kv_store::KvStoreClient> store_owner;  // keeps `store` alive (may be null)
  kv_store::SequenceRef ref;  // the sequence in the store (id and capability)
  std::shared_ptr<const kv_store::LocalPoolMapping> pool;
  int64_t next_row = 0;  // store row of the next generated token
  // The last step's new rows, [n_layers, 2 (K, V), n_kv_heads, head_dim] bf16, and the puts
  // that read them (waited for before the buffer is reused).
  std::vector<uint16_t> rows;
  std::vector<std::unique_ptr<kv_store::KvStoreOp>> puts;
  int64_t rows_offloaded = 0;
  std::string method;                        // the request's retrieval method
  bool fetched = false;  // rows fetched through the store's data plane (not read in place)
  std::shared_ptr<IndexSelector> selector;  // null: the GPU method selects
  rc::SparseSequenceCounters seen;  // the GPU's counters as last reported to the observer
  absl::Status failure;             // first failed append, reported once through TakeFailures
};

class CudaDecodeBackend final : public DecodeBackend {
 public:
  CudaDecodeBackend(std::unique_ptr<model::CudaModel> model,
                    std::unique_ptr<rc::SparseDecodeAttention> sparse,
                    CudaDecodeBackendOptions options, int64_t slot_bytes, int64_t summary_bytes,
                    int64_t cluster_room, DecodeObserver* observer)
      : model_(std::move(model)),
        sparse_(std::move(sparse)),
        options_(std::move(options)),
        slot_bytes_(slot_bytes),
        fetch_staging_bytes_(
            int64_t{model_->config().n_kv_heads} * options_.budget *
            static_cast<int64_t>(kv_store::RowBytes(
                StoreRowDType(options_), static_cast<uint32_t>(model_->config().head_dim)))),
        summary_bytes_(summary_bytes),
        cluster_room_(cluster_room),
        observer_(observer != nullptr ? observer : &noop_) {}

  const model::ModelConfig& config() const override { return model_->config(); }
  std::string name() const override { return absl::StrCat("cuda:", options_.device); }
  int64_t max_sequence_tokens() const override { return options_.max_context; }

  // On the handoff's thread: checks the handoff and the store's sequence, reserves the store
  // pages of every row the sequence will hold and maps the store's pool (once per store), so
  // that Join only uploads page tables and summaries. No row is copied.
  absl::StatusOr<std::unique_ptr<BackendSequence>> Prepare(Handoff& h) const override {
    KVR_RETURN_IF_ERROR(CheckHandoffForCudaBackend(h, options_));
    auto pending = std::make_unique<CudaPending>(slot_bytes_);
    const model::ModelConfig& c = model_->config();
    // Where the rows are read: the store's pool in place (mapped, same host), else fetched.
    bool fetch = options_.row_source == "fetch";
    if (!fetch) {
      absl::StatusOr<std::shared_ptr<const kv_store::LocalPoolMapping>> pool =
          h.store->MapLocalPool();
      if (pool.ok()) {
        pending->pool = *std::move(pool);
      } else if (options_.row_source == "auto" &&
                 pool.status().code() == absl::StatusCode::kFailedPrecondition) {
        fetch = true;  // another host, or a store without a local socket
      } else {
        return pool.status();
      }
    }
    pending->capacity = std::min<int64_t>(
        options_.max_context, h.prompt_tokens + std::max<int64_t>(1, h.sampling.max_tokens));
    // Dense when it pays (short sequences, and `full`), while the dense room lasts.
    if (!fetch && (h.method == "full" || pending->capacity <= options_.dense_max_tokens)) {
      ReserveDenseRoom(*pending);
    }
    // `full` with more rows than one step gathers (the admission check's rule) runs densely
    // or not at all: its rows may turn out fetched (row source auto, a store on another host),
    // or the dense room may be taken.
    if (h.method == "full" && !pending->dense() &&
        pending->capacity - h.n_sink - h.local_window > options_.budget) {
      if (fetch) {
        return absl::InvalidArgumentError(absl::StrCat(
            "handoff of sequence ", h.sequence_id, ": retrieval.method 'full' attends ",
            pending->capacity - h.n_sink - h.local_window,
            " rows beyond the sink and window, more than gpu_budget ", options_.budget,
            ", and its rows are fetched from a store on another host, which never runs densely"));
      }
      return absl::ResourceExhaustedError(
          absl::StrCat("handoff of sequence ", h.sequence_id,
                       ": retrieval.method 'full' runs densely here, and the KV of the sequences "
                       "already dense fills gpu_dense_bytes ",
                       options_.dense_bytes, " (retry later)"));
    }
    // A fetched sequence's selector must read no rows: quest's GPU summaries and the lanes read
    // keys from the store's pages, so those methods are selected on the host by their index.
    bool on_host =
        !pending->dense() && (h.method != options_.method || (fetch && options_.method == "quest"));
    if (!pending->dense() && !on_host && options_.method == "clusterkv") {
      KVR_ASSIGN_OR_RETURN(pending->clusters, ParseClusters(h));
      size_t most = 0;
      for (const retrieval::PrebuiltClusterKvData& layer : pending->clusters) {
        for (const std::vector<int32_t>& offsets : layer.offsets) {
          most = std::max(most, offsets.empty() ? size_t{0} : offsets.size() - 1);
        }
      }
      if (static_cast<int64_t>(most) > cluster_room_) {
        spdlog::info(
            "sequence {}: {} clusters in a head, room for {} (budget {} below the "
            "node's {}): selected on the host",
            h.sequence_id, most, cluster_room_, h.budget, options_.budget);
        pending->clusters.clear();
        pending->clusters_over_room = on_host = true;
      }
    }
    if (on_host) {
      KVR_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<retrieval::RetrievalIndex>> indexes,
                           IndexesFromHandoff(h, c, *options_.registry, options_.method_assets));
      // A GPU lane takes the method at the request's budget with its default options.
      if (!fetch && h.options.empty() &&
          std::find(options_.lanes.begin(), options_.lanes.end(), h.method) !=
              options_.lanes.end()) {
        pending->lane = h.method;
        pending->indexes = std::move(indexes);
      } else {
        pending->selector = std::make_shared<IndexSelector>(std::move(indexes), c, h.method,
                                                            h.prompt_tokens, h.budget);
        pending->bytes += pending->selector->MemoryBytes();
      }
    }
    const uint64_t id = h.sequence_id;
    auto refuse = [&](auto&&... parts) {
      return absl::FailedPreconditionError(
          absl::StrCat("handoff of sequence ", id, ": store sequence ", parts...));
    };
    KVR_ASSIGN_OR_RETURN(kv_store::SequenceInfo info, h.store->GetSequence(h.store_ref()));
    const kv_store::SequenceShape& s = info.shape;
    if (s.n_layers != static_cast<uint32_t>(c.n_layers) ||
        s.n_kv_heads != static_cast<uint32_t>(c.n_kv_heads) ||
        s.head_dim != static_cast<uint32_t>(c.head_dim)) {
      return refuse("shape ", s.n_layers, "x", s.n_kv_heads, "x", s.head_dim, ", the model is ",
                    c.n_layers, "x", c.n_kv_heads, "x", c.head_dim);
    }
    const kv_store::DType want = StoreRowDType(options_);
    if (s.dtype != want) {
      return refuse("rows are ", kv_store::DTypeName(s.dtype), "; this CUDA decode node reads ",
                    kv_store::DTypeName(want), " rows (gpu_row_format ", options_.row_format,
                    "; the prefill nodes' store_dtype must match)");
    }
    for (int l = 0; l < c.n_layers; ++l) {
      if (static_cast<int64_t>(info.committed_rows[l]) < h.prompt_tokens) {
        return refuse("layer ", l, " holds ", info.committed_rows[l], " rows, prompt_tokens is ",
                      h.prompt_tokens);
      }
    }
    if (fetch) {
      pending->fetch = std::make_shared<StoreRowFetcher>(h.store, h.store_owner, h.store_ref());
      pending->bytes += fetch_staging_bytes_;
      return pending;
    }
    KVR_ASSIGN_OR_RETURN(
        kv_store::PageTable table,
        h.store->ReservePageTable(h.store_ref(), static_cast<uint64_t>(pending->capacity)));
    if (pending->dense()) {
      pending->table = table;  // Join fills the dense KV from these pages
      pending->bytes = pending->dense_bytes;
    }
    KVR_ASSIGN_OR_RETURN(const void* base, Register(*pending->pool));
    const size_t row_bytes = s.RowBytes();
    if (table.tokens_per_page == 0 || table.page_bytes != pending->pool->page_bytes() ||
        table.tokens_per_page * row_bytes > table.page_bytes ||
        table.pages.size() != size_t{table.pages_per_head} * c.n_layers * c.n_kv_heads ||
        int64_t{table.pages_per_head} * table.tokens_per_page < pending->capacity) {
      return absl::InternalError(absl::StrCat("store sequence ", id, ": inconsistent page table (",
                                              table.pages.size(), " pages of ",
                                              table.tokens_per_page, " rows)"));
    }
    const uint64_t pool_pages = pending->pool->bytes() / table.page_bytes;
    rc::SparseRowSource& rows = pending->rows;
    rows.base = base;
    rows.page_bytes = static_cast<int64_t>(table.page_bytes);
    rows.page_rows = static_cast<int32_t>(table.tokens_per_page);
    rows.pages_per_head = static_cast<int32_t>(table.pages_per_head);
    rows.pages.reserve(table.pages.size());
    for (kv_store::PageId page : table.pages) {
      if (page >= pool_pages || page > static_cast<uint64_t>(INT32_MAX)) {
        return absl::InternalError(absl::StrCat("store sequence ", id, ": page ", page,
                                                " outside the mapped pool of ", pool_pages));
      }
      rows.pages.push_back(static_cast<int32_t>(page));
    }
    return pending;
  }

  absl::Status Join(const Handoff& h, std::unique_ptr<BackendSequence> state) override {
    const uint64_t id = h.sequence_id;
    auto* pending = dynamic_cast<CudaPending*>(state.get());
    if (pending == nullptr) return absl::InternalError("CUDA decode: Join without Prepare");
    if (pending->dense()) return JoinDense(h, *pending);
    rc::SparseSequenceOptions so;
    if (pending->fetch != nullptr) {
      so.fetch = pending->fetch;
    } else {
      so.rows = pending->rows;
    }
    so.selector = pending->selector;
    so.lane = pending->lane;
    so.budget = static_cast<int>(h.budget);
    for (const auto& index : pending->indexes) so.lane_indexes.push_back(index.get());
    // Takes a slot and prepares it (ring rows, and the summaries, clusters or lane state);
    // the slot is given back if that fails.
    auto activate = [&]() -> absl::Status {
      KVR_RETURN_IF_ERROR(sparse_->AddSequence(id, pending->capacity, so));
      absl::Status st;
      if (!pending->clusters.empty()) {
        std::vector<rc::SparseClusterHead> heads;
        for (const retrieval::PrebuiltClusterKvData& layer : pending->clusters) {
          for (size_t hh = 0; hh < layer.ids.size(); ++hh) {
            heads.push_back({layer.centroids[hh], layer.offsets[hh], layer.ids[hh]});
          }
        }
        st = sparse_->ActivateSequenceWithClusters(id, h.prompt_tokens, heads);
      } else {
        st = sparse_->ActivateSequence(id, h.prompt_tokens);
      }
      if (!st.ok()) sparse_->ReleaseSequence(id).IgnoreError();
      return st;
    };
    absl::Status activated = activate();
    if (!pending->lane.empty() && activated.code() == absl::StatusCode::kInvalidArgument) {
      // The lane cannot take this sequence (another codec): select it on the host instead.
      spdlog::warn("sequence {}: GPU lane {}: {}; selecting on the host", id, pending->lane,
                   std::string(activated.message()));
      pending->selector =
          std::make_shared<IndexSelector>(std::move(pending->indexes), model_->config(),
                                          h.method, h.prompt_tokens, h.budget);
      so.selector = pending->selector;
      so.lane.clear();
      so.lane_indexes.clear();
      ++node_.lane_fallbacks;
      activated = activate();
    }
    pending->indexes.clear();  // the lane's GPU state is built from them: they may go
    KVR_RETURN_IF_ERROR(activated);
    if (!so.lane.empty()) ++node_.lane_sequences;
    if (pending->clusters_over_room) ++node_.cluster_fallbacks;
    CudaRunning run;
    run.store = h.store;
    run.store_owner = h.store_owner;
    run.ref = h.store_ref();
    run.pool = std::move(pending->pool);
    run.next_row = h.prompt_tokens;
    run.method = h.method;
    run.fetched = pending->fetch != nullptr;
    run.selector = std::move(pending->selector);
    running_.emplace(id, std::move(run));
    ReportSummaryBytes();
    return absl::OkStatus();
  }

  absl::Status Step(std::span<const uint64_t> ids, std::span<const int32_t> tokens,
                    std::span<float> logits) override {
    return RunStep(ids, tokens,
                   [&] { return sparse_->Forward(batch_, model::LogitsMode::kLast, logits); });
  }
  // The argmax on the GPU (and, for a batch of quest or clusterkv sequences on the GPU method,
  // the whole step as one CUDA graph: CudaAttentionPlan::graph_key).
  bool HasStepGreedy() const override { return true; }
  absl::Status StepGreedy(std::span<const uint64_t> ids, std::span<const int32_t> tokens,
                          std::span<int32_t> next) override {
    return RunStep(ids, tokens, [&] { return sparse_->ForwardGreedy(batch_, next); });
  }

  // One step over `ids` by `forward` (a Forward over batch_), then the new rows to the store.
  template <typename F>
  absl::Status RunStep(std::span<const uint64_t> ids, std::span<const int32_t> tokens,
                       F&& forward) {
    batch_.clear();
    for (size_t b = 0; b < ids.size(); ++b) batch_.push_back({ids[b], tokens.subspan(b, 1)});
    KVR_RETURN_IF_ERROR(forward());
    node_.attend_calls += model_->config().n_layers;
    for (uint64_t id : ids) AppendNewRows(id);
    ReportStep(ids);
    return absl::OkStatus();
  }

  absl::flat_hash_map<uint64_t, absl::Status> TakeFailures() override {
    absl::flat_hash_map<uint64_t, absl::Status> out;
    for (auto& [id, run] : running_) {
      if (run.failure.ok() && run.fetched) {
        if (absl::Status f = sparse_->SequenceFailure(id); !f.ok() && !absl::IsNotFound(f)) {
          run.failure = std::move(f);
        }
      }
      if (!run.failure.ok()) out.emplace(id, std::exchange(run.failure, absl::OkStatus()));
    }
    return out;
  }

  RetrievalCounters Leave(uint64_t id) override {
    RetrievalCounters c;
    if (auto it = dense_.find(id); it != dense_.end()) {
      model_->ReleaseSequence(id).IgnoreError();
      dense_room_.fetch_sub(it->second);
      dense_.erase(it);
      return c;
    }
    if (auto it = running_.find(id); it != running_.end()) {
      WaitPuts(id, it->second);
      c.rows_offloaded = it->second.rows_offloaded;
      if (absl::StatusOr<rc::SparseSequenceCounters> sc = sparse_->Counters(id); sc.ok()) {
        const int64_t row_bytes = StoredRowBytes();
        c.selected_rows = sc->selected_rows;
        c.hot_cache_hits = sc->hot_cache_hits;
        c.hot_cache_misses = sc->selected_rows - sc->hot_cache_hits;
        // Read in place: the misses crossed the link; fetched: what the store sent (the misses
        // and, at activation, the sink and window rows).
        c.rows_fetched = it->second.fetched ? sc->fetched_rows : c.hot_cache_misses;
        c.bytes_fetched = c.rows_fetched * row_bytes;
      }
      node_.retrieval.Add(c);
      running_.erase(it);
      ReportSummaryBytes();
    }
    sparse_->ReleaseSequence(id).IgnoreError();  // NotFound only: nothing to free
    return c;
  }
  NodeCounters node_counters() const override { return node_; }
  int64_t SummaryBytes(uint64_t id) const override {
    return running_.contains(id) ? summary_bytes_ : 0;
  }

 private:
  // The step's retrieval work from the GPU's per-slot counters (as of this Forward): hot-cache
  // hits and misses, rows and bytes that crossed the link (the misses), rows appended.
  void ReportStep(std::span<const uint64_t> ids) {
    // Rows cross the link as the store keeps them; they go to the store as bf16 (the store
    // encodes an fp8 sequence's rows).
    const int64_t row_bytes = StoredRowBytes();
    const int64_t put_row_bytes = 4 * int64_t{model_->config().head_dim};
    absl::flat_hash_map<std::string_view, RetrievalReport>& by_method = step_reports_;
    by_method.clear();  // keys point into running_'s methods: valid for this call only
    int64_t appended = 0, hits_all = 0, misses_all = 0;
    for (uint64_t id : ids) {
      auto it = running_.find(id);
      if (it == running_.end()) continue;
      absl::StatusOr<rc::SparseSequenceCounters> now = sparse_->Counters(id);
      if (!now.ok()) continue;
      CudaRunning& run = it->second;
      const int64_t selected = now->selected_rows - run.seen.selected_rows;
      const int64_t hits = now->hot_cache_hits - run.seen.hot_cache_hits;
      RetrievalReport& r = by_method[run.method];
      r.hot_cache_hits += hits;
      r.hot_cache_misses += selected - hits;
      r.rows_fetched += run.fetched ? now->fetched_rows - run.seen.fetched_rows : selected - hits;
      r.bytes_fetched = r.rows_fetched * row_bytes;
      hits_all += hits;
      misses_all += selected - hits;
      run.seen = *now;
      appended += run.failure.ok() ? 1 : 0;
    }
    observer_->OnHotCache(hits_all, misses_all);
    for (const auto& [method, r] : by_method) observer_->OnRetrieval(method, r);
    const model::ModelConfig& c = model_->config();
    observer_->OnOffload(appended * c.n_layers * c.n_kv_heads * put_row_bytes);
  }
  void ReportSummaryBytes() {
    const int64_t bytes = summary_bytes_ * static_cast<int64_t>(running_.size());
    observer_->OnMethodSummaryBytes(options_.method, bytes);
    observer_->OnSummaryBytes(bytes);
  }

  absl::StatusOr<std::vector<retrieval::PrebuiltClusterKvData>> ParseClusters(
      const Handoff& h) const {
    const int n_layers = model_->config().n_layers;
    std::vector<retrieval::PrebuiltClusterKvData> clusters(n_layers);
    std::vector<bool> seen(n_layers, false);
    for (const HandoffLayerData& layer : h.layers) {
      if (layer.layer < 0 || layer.layer >= n_layers || seen[layer.layer]) continue;
      absl::StatusOr<retrieval::PrebuiltClusterKvData> parsed = retrieval::ParsePrebuiltClusterKv(
          {reinterpret_cast<const uint8_t*>(layer.summaries.data()), layer.summaries.size()},
          *options_.registry);
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("handoff of sequence ", h.sequence_id,
                                                       ": layers[", layer.layer,
                                                       "].summaries: ", parsed.status().message()));
      }
      if (parsed->size != h.prompt_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "handoff of sequence ", h.sequence_id, ": layers[", layer.layer, "].summaries cover ",
            parsed->size, " tokens, prompt_tokens is ", h.prompt_tokens));
      }
      clusters[layer.layer] = *std::move(parsed);
      seen[layer.layer] = true;
    }
    for (int l = 0; l < n_layers; ++l) {
      if (!seen[l]) {
        return absl::InvalidArgumentError(absl::StrCat("handoff of sequence ", h.sequence_id,
                                                       ": no clusterkv summaries for layer ", l));
      }
    }
    return clusters;
  }

  // Reserves the dense room for `p`'s KV (any thread), unless it would exceed dense_bytes: then
  // `p` stays sparse.
  void ReserveDenseRoom(CudaPending& p) const {
    const int64_t need = p.capacity * options_.dense_bytes_per_token;
    if (need <= 0) return;
    int64_t used = dense_room_.load();
    do {
      if (used + need > options_.dense_bytes) return;
    } while (!dense_room_.compare_exchange_weak(used, used + need));
    p.dense_room = &dense_room_;
    p.dense_bytes = need;
  }

  // A dense sequence: the model's own, its prompt's rows copied from the store's pages into its
  // device KV (bf16 as the store holds them, keys with RoPE), then stepped beside the sparse
  // sequences (CudaModel::ForwardWithAttention's mixed batch).
  absl::Status JoinDense(const Handoff& h, CudaPending& pending) {
    const uint64_t id = h.sequence_id;
    KVR_RETURN_IF_ERROR(model_->AddSequence(id, pending.capacity));
    const absl::Status filled = model_->AppendRows(
        id, h.prompt_tokens, [&](int layer, std::span<uint16_t> k, std::span<uint16_t> v) {
          return pending.pool->CopyLayerRows(pending.table, static_cast<uint32_t>(layer),
                                             static_cast<uint64_t>(h.prompt_tokens),
                                             std::as_writable_bytes(k), std::as_writable_bytes(v));
        });
    if (!filled.ok()) {
      model_->ReleaseSequence(id).IgnoreError();
      return filled;
    }
    dense_.emplace(id, std::exchange(pending.dense_bytes, 0));
    pending.dense_room = nullptr;  // the room is the running sequence's now
    ++node_.dense_sequences;
    return absl::OkStatus();
  }

  // The pool's device address, registering it with CUDA the first time (any thread).
  absl::StatusOr<const void*> Register(const kv_store::LocalPoolMapping& pool) const {
    absl::MutexLock lock(&pools_mu_);
    if (auto it = pools_.find(pool.base()); it != pools_.end()) return it->second;
    KVR_ASSIGN_OR_RETURN(const void* device, sparse_->RegisterHostRegion(pool.base(), pool.bytes(),
                                                                         /*read_only=*/true));
    pools_.emplace(pool.base(), device);
    return device;
  }

  void WaitPuts(uint64_t id, CudaRunning& run) {
    for (std::unique_ptr<kv_store::KvStoreOp>& op : run.puts) {
      absl::StatusOr<uint64_t> done = op->Wait();
      if (!done.ok() && run.failure.ok()) {
        run.failure = absl::UnavailableError(absl::StrCat(
            "sequence ", id,
            ": appending its generated rows to the store failed: ", done.status().message()));
      }
    }
    run.puts.clear();
  }

  // The step's new rows of sequence `id` go to the store at their position (one put per layer,
  // asynchronous). The previous step's puts are waited for first: a row leaves the local window
  // `local_window` steps after it was made, long after its put finished, so the GPU never reads
  // a store row before it is there.
  void AppendNewRows(uint64_t id) {
    auto it = running_.find(id);
    if (it == running_.end()) return;
    CudaRunning& run = it->second;
    WaitPuts(id, run);
    if (!run.failure.ok()) return;
    absl::StatusOr<std::span<const uint16_t>> fresh = sparse_->NewRows(id);
    if (!fresh.ok()) {
      run.failure = fresh.status();
      return;
    }
    run.rows.assign(fresh->begin(), fresh->end());
    if (run.selector != nullptr) run.selector->AddGenerated(run.next_row, run.rows);
    const model::ModelConfig& c = model_->config();
    const size_t half = size_t{2} * c.n_kv_heads * c.head_dim;  // bytes of K (or V), one layer
    for (int l = 0; l < c.n_layers; ++l) {
      const auto* layer = reinterpret_cast<const uint8_t*>(run.rows.data()) + l * 2 * half;
      kv_store::LayerRows rows;
      rows.sequence = run.ref;
      rows.layer = static_cast<uint32_t>(l);
      rows.start_row = static_cast<uint64_t>(run.next_row);
      rows.n_rows = 1;
      rows.k = {layer, half};
      rows.v = {layer + half, half};
      run.puts.push_back(run.store->StartPutLayer(rows));
    }
    ++run.next_row;
    run.rows_offloaded += int64_t{c.n_layers} * c.n_kv_heads;
  }

  // Bytes of one store row of the dtype this node reads (gpu_row_format).
  int64_t StoredRowBytes() const {
    return static_cast<int64_t>(kv_store::RowBytes(
        StoreRowDType(options_), static_cast<uint32_t>(model_->config().head_dim)));
  }

  std::unique_ptr<model::CudaModel> model_;
  // The model's sparse decode (its attention hook): the running sequences. Declared after
  // model_, so that it goes first (it refers to the model).
  std::unique_ptr<rc::SparseDecodeAttention> sparse_;
  CudaDecodeBackendOptions options_;
  int64_t slot_bytes_;
  // Pinned host memory a fetched sequence's slot stages its missed rows in (budget rows per KV
  // head, bf16 [K | V]).
  int64_t fetch_staging_bytes_;
  int64_t summary_bytes_;
  // clusterkv: prefill clusters per (layer, KV head) the GPU state has room for.
  int64_t cluster_room_;
  absl::flat_hash_map<uint64_t, CudaRunning> running_;
  NodeCounters node_;
  NoopObserver noop_;
  DecodeObserver* observer_;  // not owned; noop_ when none was given
  std::vector<model::CudaSequence> batch_;
  // ReportStep's per-method sums, kept so that a step allocates nothing once warm.
  absl::flat_hash_map<std::string_view, RetrievalReport> step_reports_;
  // The sequences run densely (the model's own; not in running_: no summaries, no appends to
  // the store, no GPU counters) and the HBM each reserved; their sum is in dense_room_, which
  // Prepare reserves from on any thread.
  absl::flat_hash_map<uint64_t, int64_t> dense_;
  mutable std::atomic<int64_t> dense_room_{0};
  // Store pools registered with CUDA: host base -> device base (Prepare runs on any thread).
  mutable absl::Mutex pools_mu_;
  mutable absl::flat_hash_map<const void*, const void*> pools_ ABSL_GUARDED_BY(pools_mu_);
};

}  // namespace

absl::Status CheckHandoffForCudaBackend(const Handoff& h, const CudaDecodeBackendOptions& o) {
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff of sequence ", h.sequence_id, ": ", parts...));
  };
  if (h.method != o.method && (o.registry == nullptr || !o.registry->Has(h.method))) {
    return bad("retrieval.method '", h.method, "' is not supported here (this node selects '",
               o.method, "' on the GPU: gpu_method; other methods of its registry on the host)");
  }
  if (h.budget > o.budget) {
    return bad("retrieval.budget ", h.budget, " is above this node's gpu_budget ", o.budget);
  }
  if (h.n_sink != o.n_sink) {
    return bad("retrieval.n_sink ", h.n_sink, " differs from this node's gpu_n_sink ", o.n_sink);
  }
  if (h.local_window != o.local_window) {
    return bad("retrieval.local_window ", h.local_window,
               " differs from this node's gpu_local_window ", o.local_window);
  }
  if (o.max_context > 0 && h.prompt_tokens + 1 > o.max_context) {
    return bad("prompt_tokens ", h.prompt_tokens, " leave no room in this node's gpu_max_context ",
               o.max_context);
  }
  if (h.method == "full") {
    // Every candidate of the last step: capacity - sink - window rows, gathered at once, or
    // the whole KV in HBM (dense).
    int64_t capacity = h.prompt_tokens + std::max<int64_t>(1, h.sampling.max_tokens);
    if (o.max_context > 0) capacity = std::min(capacity, o.max_context);
    const int64_t rows = capacity - h.n_sink - h.local_window;
    const bool dense = o.row_source != "fetch" && o.dense_bytes_per_token > 0 &&
                       capacity * o.dense_bytes_per_token <= o.dense_bytes;
    if (rows > o.budget && !dense) {
      return bad("retrieval.method 'full' attends every row: up to ", rows,
                 " rows beyond the sink and window (prompt_tokens ", h.prompt_tokens,
                 " + max_tokens ", h.sampling.max_tokens,
                 "), more than the rows one step gathers on this node (gpu_budget ", o.budget,
                 "), and its KV of ", capacity * o.dense_bytes_per_token,
                 " bytes does not fit gpu_dense_bytes ", o.dense_bytes,
                 o.row_source == "fetch" ? " (and rows fetched never run densely)" : "");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DecodeBackend>> CreateCudaDecodeBackend(
    std::unique_ptr<model::CudaModel> model, const CudaDecodeBackendOptions& options,
    DecodeObserver* observer) {
  if (model == nullptr) return absl::InvalidArgumentError("CreateCudaDecodeBackend: no model");
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<rc::SparseDecodeAttention> sparse,
                       rc::CreateSparseDecodeAttention(*model));
  return CreateCudaDecodeBackend(std::move(model), std::move(sparse), options, observer);
}

absl::StatusOr<std::unique_ptr<DecodeBackend>> CreateCudaDecodeBackend(
    std::unique_ptr<model::CudaModel> model, std::unique_ptr<rc::SparseDecodeAttention> sparse,
    const CudaDecodeBackendOptions& options, DecodeObserver* observer) {
  if (model == nullptr) return absl::InvalidArgumentError("CreateCudaDecodeBackend: no model");
  if (sparse == nullptr || &sparse->cuda_model() != model.get()) {
    return absl::InvalidArgumentError(
        "CreateCudaDecodeBackend: no sparse decode, or one over another model");
  }
  const model::ModelConfig& c = model->config();
  CudaDecodeBackendOptions o = options;
  if (o.max_context == 0) o.max_context = c.context_length;
  o.dense_bytes_per_token = int64_t{c.n_layers} * c.n_kv_heads * c.head_dim * 2 * 2;
  if ((o.dense_bytes > 0 || o.dense_max_tokens > 0) &&
      model->options().max_batch_tokens < 2 * int64_t{o.slots}) {
    // A mixed batch runs the dense rows beside every sparse slot's.
    spdlog::warn("dense sequences off: the model's max_batch_tokens {} is below 2 x {} slots",
                 model->options().max_batch_tokens, o.slots);
    o.dense_bytes = o.dense_max_tokens = 0;
  }
  if (o.max_context < 2 || o.max_context > c.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("gpu_max_context ", o.max_context,
                                                   " outside [2, the model's context length ",
                                                   c.context_length, "]"));
  }
  if (o.method != "quest" && o.method != "clusterkv") {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_method '", o.method, "': a CUDA decode node runs quest or clusterkv"));
  }
  const bool fp8 = o.row_format == "fp8";
  if (o.row_format != "bf16" && !fp8) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_row_format '", o.row_format, "': bf16 or fp8"));
  }
  if (fp8 && !o.lanes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_row_format fp8: the GPU lanes read bf16 rows; this node has ",
                     o.lanes.size(), " gpu_lanes (use none, or gpu_row_format bf16)"));
  }
  if (o.method == "clusterkv" && (o.registry == nullptr || !o.registry->Has("clusterkv"))) {
    return absl::InvalidArgumentError(
        "gpu_method 'clusterkv': no method registry with clusterkv to parse the handed-off "
        "summaries with");
  }
  rc::SparseDecodeOptions so;
  so.method = o.method == "quest" ? rc::SparseMethod::kQuest : rc::SparseMethod::kClusterKv;
  so.slots = o.slots;
  so.max_capacity = o.max_context;
  so.budget = o.budget;
  so.n_sink = o.n_sink;
  so.local_window = o.local_window;
  so.min_page_rows = o.min_page_rows;
  so.row_format = fp8 ? rc::SparseRowFormat::kFp8E4m3 : rc::SparseRowFormat::kBf16;
  so.lanes = o.lanes;
  so.method_assets = o.method_assets;
  // clusterkv: room for the clusters the prefill makes at the node's budget with the default
  // options (ClusterKvPrefillClusters: at 128K and budget 1024, L/64; a sequence with more, from
  // a smaller request budget or its own options, is selected on the host). Room for every
  // budget's (L/8) would take 1 GiB of bf16 centroids per Llama-3-8B sequence of 128K.
  retrieval::IndexParams at_budget;
  at_budget.budget = o.budget;
  const int64_t clusters =
      retrieval::ClusterKvPrefillClusters(o.max_context, o.max_context, at_budget).value_or(1);
  if (o.method == "clusterkv") so.clusterkv_prefill_clusters = clusters;
  // What Configure then has room for: at least as many as its benchmark stand-in's clusters.
  const int64_t cluster_room =
      std::max(clusters, (o.max_context + so.clusterkv_tokens_per_cluster - 1) /
                             so.clusterkv_tokens_per_cluster);
  // The hot cache's rows per (slot, layer, KV head) from the byte budget (rows of the store
  // dtype: the cache keeps fp8 rows as read),
  // a multiple of 8 (its ways), at most 4096.
  const int64_t row_bytes = static_cast<int64_t>(kv_store::RowBytes(StoreRowDType(o), c.head_dim));
  const int64_t per_row = int64_t{o.slots} * c.n_layers * c.n_kv_heads * row_bytes;
  int64_t rows = std::min<int64_t>(4096, o.hot_cache_bytes / std::max<int64_t>(1, per_row));
  so.hot_cache_rows = static_cast<int>(rows / 8 * 8);
  auto configure = [&]() -> absl::Status {
    if (absl::Status s = sparse->Configure(so); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("device cuda (gpu_budget ", o.budget, ", gpu_n_sink ", o.n_sink,
                                 ", gpu_local_window ", o.local_window, ", batch_slots ", o.slots,
                                 ", gpu_max_context ", o.max_context, ", hot cache ",
                                 so.hot_cache_rows, " rows): ", s.message()));
    }
    return absl::OkStatus();
  };
  KVR_RETURN_IF_ERROR(configure());
  if (o.hot_cache_fraction > 0) {
    // Everything else is allocated now: grow the hot cache by the fraction of what is free,
    // up to a whole sequence's rows (a cache larger than the sequence holds nothing more).
    KVR_ASSIGN_OR_RETURN(const int64_t free, model->FreeDeviceBytes());
    const int64_t extra = static_cast<int64_t>(o.hot_cache_fraction * static_cast<double>(free));
    const int64_t more = extra / std::max<int64_t>(1, per_row) / 8 * 8;
    const int64_t want = std::min<int64_t>(o.max_context / 8 * 8, so.hot_cache_rows + more);
    if (want > so.hot_cache_rows) {
      so.hot_cache_rows = static_cast<int>(want);
      KVR_RETURN_IF_ERROR(configure());
    }
    spdlog::info("hot cache: {} rows per (slot, layer, KV head), {:.1f} MiB ({} of the {:.2f} "
                 "GiB free after the weights and the sparse state)",
                 so.hot_cache_rows, static_cast<double>(so.hot_cache_rows * per_row) / (1 << 20),
                 o.hot_cache_fraction, static_cast<double>(free) / (1 << 30));
  }
  // One slot's device bytes (its share of the sparse state): what a running sequence holds. Its
  // past stays in the store; the node pins no host memory per sequence.
  const int64_t slot_bytes = sparse->slot_device_bytes();
  const int64_t pages = (o.max_context + so.quest_page_size - 1) / so.quest_page_size;
  // quest: page bounds; clusterkv: room for the prefill's clusters and the pending singletons
  // (centroids and offsets) and one member id per token.
  const int64_t summary_bytes =
      o.method == "quest"
          ? pages * c.n_layers * c.n_kv_heads * 2 * c.head_dim * 2  // bf16 bounds
          : int64_t{c.n_layers} * c.n_kv_heads *
                ((cluster_room + so.clusterkv_max_pending + 1) * (int64_t{c.head_dim} * 4 + 4) +
                 o.max_context * 4);
  return std::make_unique<CudaDecodeBackend>(std::move(model), std::move(sparse), o, slot_bytes,
                                             summary_bytes, cluster_room, observer);
}

absl::StatusOr<std::unique_ptr<DecodeBackend>> MakeDecodeBackend(
    const DecodeConfig& config, const model::Model* model,
    const retrieval::MethodRegistry* registry,
    std::shared_ptr<const retrieval::MethodAssets> assets, DecodeObserver* observer) {
  if (model == nullptr || registry == nullptr) {
    return absl::InvalidArgumentError("MakeDecodeBackend: model and registry are required");
  }
  if (config.device == "cpu") {
    return MakeCpuDecodeBackend(model, registry,
                                {.hot_cache_bytes = config.hot_cache_bytes,
                                 .quality_sample_rate = config.quality_sample_rate,
                                 .method_assets = std::move(assets)},
                                observer);
  }
  if (config.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device: '", config.device, "' is not cpu or cuda"));
  }
  const std::string setting =
      absl::StrCat("device cuda (--device cuda --cuda-device ", config.cuda_device, ")");
  if (config.quality_sample_rate > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quality_sample_rate ", config.quality_sample_rate,
        ": not supported with --device cuda (the GPU's selection is not compared with the "
        "oracle); use 0"));
  }
  if (!model::CudaModelAvailable()) {
    return absl::FailedPreconditionError(absl::StrCat(
        setting,
        ": this build of kvr has no CUDA or this machine no usable GPU; use --device cpu"));
  }
  model::CudaModelOptions mo;
  mo.device = static_cast<int>(config.cuda_device);
  // A mixed batch: the dense sequences' rows beside every sparse slot's.
  mo.max_batch_tokens = 2 * int64_t{config.batch_slots};
  mo.max_sequences = static_cast<int>(config.batch_slots);
  mo.max_logits_rows = config.batch_slots;
  absl::StatusOr<std::unique_ptr<model::CudaModel>> gpu =
      model::CreateCudaModel(model->config(), model->weights(), mo);
  if (!gpu.ok()) {
    return absl::Status(gpu.status().code(), absl::StrCat(setting, ": ", gpu.status().message()));
  }
  CudaDecodeBackendOptions o;
  o.device = mo.device;
  o.slots = static_cast<int>(config.batch_slots);
  o.method = config.gpu_method;
  o.lanes = config.gpu_lanes;
  o.row_source = config.gpu_row_source;
  o.row_format = config.gpu_row_format;
  o.budget = static_cast<int>(config.gpu_budget);
  o.n_sink = static_cast<int>(config.gpu_n_sink);
  o.local_window = static_cast<int>(config.gpu_local_window);
  o.max_context = config.gpu_max_context;
  o.hot_cache_bytes = config.hot_cache_bytes;
  o.hot_cache_fraction = config.gpu_hot_cache_fraction;
  o.dense_max_tokens = config.gpu_dense_max_tokens;
  o.dense_bytes = config.gpu_dense_bytes;
  o.registry = registry;
  o.method_assets = std::move(assets);
  return CreateCudaDecodeBackend(*std::move(gpu), o, observer);
}

}  // namespace kvr::decode
