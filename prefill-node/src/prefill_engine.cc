#include "kvr/prefill_node/prefill_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <numeric>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/hash/hash.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/model/sampler.h"
#include "kvr/prefill_node/summary_snapshot.h"
#include "kvr/retrieval/index.h"
#include "kvr/retrieval/model_shape.h"
#include "spdlog/spdlog.h"

namespace kvr::prefill_node {
namespace {

namespace cv1 = ::kvr::cluster::v1;

constexpr char kFailedNodePayload[] = "kvr-failed-node";

// An error of another node (D or S): UNAVAILABLE (the controller retries elsewhere), with the
// node id as payload for the trailing metadata; or the node that node named in turn (D names
// the store when it cannot reach it).
absl::Status NodeFailure(const cv1::NodeRef& node, const char* role, const absl::Status& cause) {
  // A node that refused this request (INVALID_ARGUMENT, FAILED_PRECONDITION: e.g. a decode
  // node whose settings cannot take it) keeps its code, so that the controller tries another
  // node and, when none takes it, gives the client the refusal; anything else is the node's
  // failure (UNAVAILABLE).
  const absl::StatusCode code =
      absl::IsInvalidArgument(cause) || absl::IsFailedPrecondition(cause)
          ? cause.code()
          : absl::StatusCode::kUnavailable;
  absl::Status s(code, absl::StrCat(role, " ", node.node_id(), " (",
                                    node.endpoints().grpc_address(), "): ", cause.ToString()));
  const auto named = cause.GetPayload(kFailedNodePayload);
  s.SetPayload(kFailedNodePayload, named ? *named : absl::Cord(node.node_id()));
  return s;
}

// PackRows of a layer task's rows, f32 or bf16 (widened, exact).
void PackTaskRows(const LayerTask& task, int n_kv_heads, int head_dim,
                  std::span<const int64_t> positions, std::string* out) {
  if (task.k_bf16 == nullptr) {
    PackRows(task.kv, n_kv_heads, head_dim, positions, out);
    return;
  }
  const int64_t kv_dim = int64_t{n_kv_heads} * head_dim;
  out->resize(positions.size() * n_kv_heads * 2 * size_t(head_dim) * sizeof(float));
  auto* dst = reinterpret_cast<float*>(out->data());
  for (int64_t p : positions) {
    for (int h = 0; h < n_kv_heads; ++h) {
      for (const uint16_t* rows : {task.k_bf16, task.v_bf16}) {
        Bf16BytesToFloats(rows + p * kv_dim + int64_t{h} * head_dim, size_t(head_dim), dst);
        dst += head_dim;
      }
    }
  }
}

// Builds indexes, packs sink/local rows and starts store puts on its own threads (layers are
// independent: up to `threads` of them at once), so that the model's next layers compute
// meanwhile. Owns the put operations and the packing buffers they read; the tasks' rows belong
// to the backend's PrefillRows, which outlive Close().
class LayerWorker {
 public:
  struct Context {
    const model::ModelConfig* config = nullptr;
    const retrieval::MethodRegistry* registry = nullptr;
    const retrieval::IndexParams* params = nullptr;
    std::string method;
    kv_store::KvStoreClient* store = nullptr;
    kv_store::DType store_dtype = kv_store::DType::kF32;  // f32, bf16 or fp8_e4m3
    kv_store::SequenceRef sequence;
    int64_t prompt_tokens = 0;
    // Rows [0, first_row) are already in the store (forked from a cached prefix): only the
    // rest is put.
    int64_t first_row = 0;
    // Summary snapshots (summary_snapshot.h). With first_row > 0 and `extend`, each layer's
    // index is first sought in the sequence's attachment (inherited from the cached prefix by
    // the fork) and extended; snapshot_rows > 0 (a multiple of the reuse alignment, <=
    // prompt_tokens): the layer's index at that many tokens is put as the sequence's attachment,
    // for a later request that reuses this one. snapshot_key names what the snapshots are built
    // for.
    bool extend = true;
    int64_t snapshot_rows = 0;
    std::string snapshot_key;
    PrefillObserver* observer = nullptr;
    int threads = 1;
  };

  // How the layers' summaries came about (read after Close).
  struct SummaryStats {
    int extended = 0;            // from the prefix's snapshot, extended by Append
    int rebuilt = 0;             // built from the rows although a prefix was reused
    std::string rebuild_reason;  // why, for the first layer rebuilt
    int snapshots_put = 0;
    std::string snapshot_error;  // the first failure to keep a snapshot (the request goes on)
  };

  explicit LayerWorker(Context ctx) : ctx_(std::move(ctx)), layers_(ctx_.config->n_layers) {
    const int n = std::clamp(ctx_.threads, 1, std::max(1, ctx_.config->n_layers));
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~LayerWorker() { Close().IgnoreError(); }

  // Thread-safe and non-blocking beyond a mutex (the CUDA backend calls it from a CUDA thread).
  void Push(LayerTask task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }

  // The first error so far (the compute loop stops early on it).
  absl::Status error() {
    absl::MutexLock lock(&mu_);
    return error_;
  }

  // Stops accepting tasks, finishes the queued ones and waits for every put. Idempotent.
  absl::Status Close() {
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
    }
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    for (auto& op : puts_) {
      absl::StatusOr<uint64_t> rows = op->Wait();
      if (!rows.ok()) {
        absl::MutexLock lock(&mu_);
        if (error_.ok()) error_ = rows.status();
      }
    }
    puts_.clear();
    absl::MutexLock lock(&mu_);
    return error_;
  }

  std::vector<std::optional<cv1::HandoffLayer>>& layers() { return layers_; }
  uint64_t kv_bytes() const { return kv_bytes_; }
  SummaryStats summary_stats() {
    absl::MutexLock lock(&out_mu_);
    return summary_stats_;
  }

 private:
  void Loop() {
    while (true) {
      LayerTask task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](LayerWorker* w) { return !w->tasks_.empty() || w->closed_; }, this));
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
        if (!error_.ok()) continue;  // drain: the request has failed
      }
      absl::Status s = Process(task);
      if (!s.ok()) {
        absl::MutexLock lock(&mu_);
        if (error_.ok()) error_ = s;
      }
    }
  }

  absl::Status Process(const LayerTask& task) {
    const model::ModelConfig& c = *ctx_.config;
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t L = ctx_.prompt_tokens;
    const int64_t kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
    if (task.kv.n_rows != L) {
      return absl::InternalError(absl::StrCat("layer ", task.layer, ": ", task.kv.n_rows,
                                              " rows after prefill, expected ", L));
    }

    // 1. The retrieval index over all prompt positions [0, L).
    const retrieval::IndexShape shape = retrieval::IndexShapeOf(c, task.layer);
    std::vector<uint8_t> bytes;
    std::vector<uint8_t> snapshot;  // the index at ctx_.snapshot_rows tokens, when kept
    if (task.summary) {
      // Built by the backend (on the GPU, over every row): only serialised here. It is the
      // snapshot too when the prompt ends on the alignment; otherwise none is kept (the CPU
      // index at the aligned boundary would cost a second build).
      absl::StatusOr<std::vector<uint8_t>> built = task.summary(shape);
      if (!built.ok()) {
        return absl::InternalError(
            absl::StrCat("retrieval (method '", ctx_.method, "', layer ", task.layer,
                         ", built by the backend): ", built.status().message()));
      }
      bytes = *std::move(built);
      if (ctx_.snapshot_rows == L) snapshot = FrameSnapshot(ctx_.snapshot_key, bytes);
      if (ctx_.first_row > 0) NoteRebuilt("summaries built by the backend");
    } else {
      KVR_RETURN_IF_ERROR(CpuSummaries(task, shape, &bytes, &snapshot));
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (!snapshot.empty()) KeepSnapshot(task.layer, snapshot);

    // 2. Sink and local-window rows for D.
    cv1::HandoffLayer layer;
    layer.set_layer(static_cast<uint32_t>(task.layer));
    layer.set_summaries(bytes.data(), bytes.size());
    const int64_t n_sink = std::min<int64_t>(ctx_.params->n_sink, L);
    const int64_t n_local = std::min<int64_t>(ctx_.params->local_window, L - n_sink);
    std::vector<int64_t> positions(n_sink);
    std::iota(positions.begin(), positions.end(), 0);
    PackTaskRows(task, c.n_kv_heads, c.head_dim, positions, layer.mutable_sink_kv());
    for (int64_t p : positions) layer.add_sink_positions(static_cast<uint32_t>(p));
    positions.resize(n_local);
    std::iota(positions.begin(), positions.end(), L - n_local);
    PackTaskRows(task, c.n_kv_heads, c.head_dim, positions, layer.mutable_local_kv());
    for (int64_t p : positions) layer.add_local_positions(static_cast<uint32_t>(p));

    // 3. Every row not yet there to the store, asynchronously, in the dtype the store takes
    // (f32 or bf16; bf16 for an fp8 sequence, which the store encodes). Rows go as they lie
    // when they are in that dtype at the row width (f32 from KvCache's layout, bf16 exported
    // by the backend); otherwise they are packed (narrowed or widened) into a buffer the put
    // reads.
    const int64_t first = ctx_.first_row;
    kv_store::LayerRows rows;
    rows.sequence = ctx_.sequence;
    rows.layer = static_cast<uint32_t>(task.layer);
    rows.start_row = static_cast<uint64_t>(first);
    rows.n_rows = static_cast<uint32_t>(L - first);
    const bool bf16 = ctx_.store_dtype != kv_store::DType::kF32;
    const size_t elem_bytes = kv_store::WriteElementBytes(ctx_.store_dtype);
    const size_t row_bytes = static_cast<size_t>(kv_dim) * elem_bytes;
    const size_t half_bytes = static_cast<size_t>(L - first) * row_bytes;
    const bool rows_bf16 = task.k_bf16 != nullptr;
    if (bf16 && rows_bf16) {
      rows.k = {reinterpret_cast<const uint8_t*>(task.k_bf16 + first * kv_dim), half_bytes};
      rows.v = {reinterpret_cast<const uint8_t*>(task.v_bf16 + first * kv_dim), half_bytes};
    } else if (!bf16 && !rows_bf16 && task.kv.row_stride == kv_dim) {
      rows.k = {reinterpret_cast<const uint8_t*>(task.kv.k + first * kv_dim), half_bytes};
      rows.v = {reinterpret_cast<const uint8_t*>(task.kv.v + first * kv_dim), half_bytes};
    } else {
      std::vector<uint8_t>* packed = nullptr;
      {
        absl::MutexLock lock(&out_mu_);
        packed = &packed_.emplace_back(2 * half_bytes);  // deque: stable addresses
      }
      // Destination row i holds prompt row first + i.
      uint8_t* k_dst = packed->data();
      uint8_t* v_dst = packed->data() + half_bytes;
      for (int64_t r = first; r < L && rows_bf16; ++r) {  // bf16 rows into an f32 store: widened
        Bf16BytesToFloats(task.k_bf16 + r * kv_dim, static_cast<size_t>(kv_dim),
                          reinterpret_cast<float*>(k_dst + (r - first) * row_bytes));
        Bf16BytesToFloats(task.v_bf16 + r * kv_dim, static_cast<size_t>(kv_dim),
                          reinterpret_cast<float*>(v_dst + (r - first) * row_bytes));
      }
      for (int64_t r = first; r < L && !rows_bf16; ++r) {
        const float* k = task.kv.k + r * task.kv.row_stride;
        const float* v = task.kv.v + r * task.kv.row_stride;
        if (bf16) {
          FloatsToBf16Bytes(k, static_cast<size_t>(kv_dim), k_dst + (r - first) * row_bytes);
          FloatsToBf16Bytes(v, static_cast<size_t>(kv_dim), v_dst + (r - first) * row_bytes);
        } else {
          std::memcpy(k_dst + (r - first) * row_bytes, k, row_bytes);
          std::memcpy(v_dst + (r - first) * row_bytes, v, row_bytes);
        }
      }
      rows.k = {packed->data(), half_bytes};
      rows.v = {packed->data() + half_bytes, half_bytes};
    }
    std::unique_ptr<kv_store::KvStoreOp> put = ctx_.store->StartPutLayer(rows);
    {
      absl::MutexLock lock(&out_mu_);
      puts_.push_back(std::move(put));
      kv_bytes_ += 2 * half_bytes;
    }

    if (ctx_.observer != nullptr) {
      ctx_.observer->OnLayerReady(task.layer, absl::FromChrono(t1 - t0), bytes.size(),
                                  2 * half_bytes);
    }
    layers_[task.layer] = std::move(layer);
    return absl::OkStatus();
  }

  // The layer's index on the CPU, serialised into `handoff` (all L prompt tokens) and, when
  // ctx_.snapshot_rows > 0, into `snapshot` (its first snapshot_rows tokens). From the
  // prefix's snapshot extended by Append when there is a usable one; otherwise built from the
  // rows (Build over the snapshot's rows, then Append of the rest, so that the handoff's index
  // is the snapshot's extended, as on the reuse path).
  absl::Status CpuSummaries(const LayerTask& task, const retrieval::IndexShape& shape,
                            std::vector<uint8_t>* handoff, std::vector<uint8_t>* snapshot) {
    const model::ModelConfig& c = *ctx_.config;
    const int64_t L = ctx_.prompt_tokens;
    const int64_t kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
    std::vector<float> widened;  // bf16 rows: the keys as floats (exact), for the CPU index
    retrieval::TokenTensor keys;
    if (task.k_bf16 != nullptr) {
      widened.resize(static_cast<size_t>(L * kv_dim));
      Bf16BytesToFloats(task.k_bf16, widened.size(), widened.data());
      keys = {widened.data(), L, kv_dim};
    } else {
      keys = {task.kv.k, L, task.kv.row_stride};
    }
    const retrieval::TokenTensor queries{task.queries, task.n_queries,
                                         int64_t{c.n_heads} * c.head_dim};
    const int64_t S = ctx_.snapshot_rows;
    // Appends up to `end`, snapshotting on the way when the index passes S.
    auto finish = [&](retrieval::RetrievalIndex& index, bool with_snapshot) -> absl::Status {
      if (with_snapshot && S > 0 && index.size() <= S) {
        KVR_RETURN_IF_ERROR(AppendPositions(index, keys, S, queries, task.queries_first_position));
        KVR_ASSIGN_OR_RETURN(std::vector<uint8_t> at_s, retrieval::SerializeIndex(index));
        *snapshot = FrameSnapshot(ctx_.snapshot_key, at_s);
        if (S == L) {
          *handoff = std::move(at_s);
          return absl::OkStatus();
        }
      }
      KVR_RETURN_IF_ERROR(AppendPositions(index, keys, L, queries, task.queries_first_position));
      KVR_ASSIGN_OR_RETURN(*handoff, retrieval::SerializeIndex(index));
      return absl::OkStatus();
    };

    if (ctx_.first_row > 0 && !ctx_.extend) {
      NoteRebuilt("extend_summaries is off");
    } else if (ctx_.first_row > 0) {
      absl::Status extended = [&]() -> absl::Status {
        KVR_ASSIGN_OR_RETURN(
            kv_store::Attachment attachment,
            ctx_.store->GetAttachment(ctx_.sequence, static_cast<uint32_t>(task.layer)));
        if (attachment.rows == 0 || attachment.rows > static_cast<uint64_t>(ctx_.first_row)) {
          return absl::FailedPreconditionError(
              absl::StrCat("snapshot of ", attachment.rows, " rows, ", ctx_.first_row, " reused"));
        }
        KVR_ASSIGN_OR_RETURN(std::unique_ptr<retrieval::RetrievalIndex> index,
                             OpenSnapshot(attachment.bytes, attachment.rows, ctx_.snapshot_key,
                                          ctx_.method, shape, *ctx_.registry, *ctx_.params));
        return finish(*index, /*with_snapshot=*/true);
      }();
      if (extended.ok()) {
        absl::MutexLock lock(&out_mu_);
        ++summary_stats_.extended;
        return absl::OkStatus();
      }
      snapshot->clear();
      NoteRebuilt(extended.ToString());
    }

    auto build = [&](int64_t rows) -> absl::StatusOr<std::unique_ptr<retrieval::RetrievalIndex>> {
      absl::StatusOr<std::unique_ptr<retrieval::RetrievalIndex>> index =
          ctx_.registry->Make(ctx_.method, shape, *ctx_.params);
      if (!index.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("retrieval.method '", ctx_.method, "': ", index.status().message()));
      }
      retrieval::BuildInput in;
      in.keys = {keys.data, rows, keys.row_stride};
      // Every kept query, also those of positions past `rows` when the index is built over the
      // snapshot's rows only: they are this prompt's queries over keys that include the built
      // ones, and a method that takes prefill queries (the last ones it needs, as ctkvr's
      // centroids) then gets the same ones as a Build over every row.
      in.queries = queries;
      in.queries_first_position = task.queries_first_position;
      if (absl::Status s = (*index)->Build(in); !s.ok()) {
        // Build checks the method's context-dependent parameters (e.g. CTKVR's C): a request
        // error, not a node failure.
        return absl::InvalidArgumentError(absl::StrCat(
            "retrieval (method '", ctx_.method, "', layer ", task.layer, "): ", s.message()));
      }
      return index;
    };
    if (S > 0 && S < L) {
      // Built over the snapshot's rows and extended. A method whose Build refuses the shorter
      // prefix (a parameter that needs more rows than it has) gets the whole prompt's Build
      // and keeps no snapshot.
      absl::StatusOr<std::unique_ptr<retrieval::RetrievalIndex>> index = build(S);
      if (index.ok() && finish(**index, /*with_snapshot=*/true).ok()) return absl::OkStatus();
      snapshot->clear();
      NoteSnapshotError(absl::StrCat("no snapshot at ", S, " rows: ",
                                     index.ok() ? "append failed" : index.status().ToString()));
    }
    // `full` and `streaming` hold no summary: their payload is empty but the header (method,
    // shape, token count) is still shipped, so D can deserialize every method the same way.
    KVR_ASSIGN_OR_RETURN(std::unique_ptr<retrieval::RetrievalIndex> index, build(L));
    KVR_RETURN_IF_ERROR(finish(*index, /*with_snapshot=*/S == L));
    return absl::OkStatus();
  }

  // Puts the layer's snapshot as the sequence's attachment. A failure (a store without
  // attachments, one that is full, a snapshot past kMaxAttachmentBytes) costs the next request
  // a rebuild, not this one its answer: noted and logged, not returned.
  void KeepSnapshot(int layer, const std::vector<uint8_t>& frame) {
    absl::Status st;
    if (frame.size() > kv_store::kMaxAttachmentBytes) {
      st = absl::ResourceExhaustedError(
          absl::StrCat("snapshot of ", frame.size(), " bytes, more than an attachment holds"));
    } else {
      st = ctx_.store->PutAttachment(ctx_.sequence, static_cast<uint32_t>(layer),
                                     static_cast<uint64_t>(ctx_.snapshot_rows), frame);
    }
    if (!st.ok()) {
      NoteSnapshotError(st.ToString());
      return;
    }
    absl::MutexLock lock(&out_mu_);
    ++summary_stats_.snapshots_put;
  }
  void NoteRebuilt(std::string reason) {
    absl::MutexLock lock(&out_mu_);
    if (summary_stats_.rebuilt++ == 0) summary_stats_.rebuild_reason = std::move(reason);
  }
  void NoteSnapshotError(std::string error) {
    absl::MutexLock lock(&out_mu_);
    if (summary_stats_.snapshot_error.empty()) summary_stats_.snapshot_error = std::move(error);
  }

  Context ctx_;
  absl::Mutex mu_;
  std::deque<LayerTask> tasks_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  // Worker-thread state (read by others only after join). layers_[l] is written by the one
  // thread that processes layer l; the rest under out_mu_.
  std::vector<std::optional<cv1::HandoffLayer>> layers_;
  absl::Mutex out_mu_;
  std::vector<std::unique_ptr<kv_store::KvStoreOp>> puts_;
  std::deque<std::vector<uint8_t>> packed_;  // buffers of puts whose rows needed packing
  uint64_t kv_bytes_ = 0;
  SummaryStats summary_stats_ ABSL_GUARDED_BY(out_mu_);
  std::vector<std::thread> threads_;  // started in the constructor body, after the above
};

// Where the prompt field lives in the request, for error messages.
const char* PromptField(const Prompt& prompt) {
  if (std::holds_alternative<TokenPrompt>(prompt)) return "token_ids";
  if (std::holds_alternative<ChatPrompt>(prompt)) return "chat";
  return "prompt";
}

}  // namespace

size_t HandoffRowBytes(const model::ModelConfig& config) {
  return size_t{2} * config.n_kv_heads * config.head_dim * sizeof(float);
}

void PackRows(const model::KvView& view, int n_kv_heads, int head_dim,
              std::span<const int64_t> positions, std::string* out) {
  const size_t head_bytes = size_t(head_dim) * sizeof(float);
  out->resize(positions.size() * n_kv_heads * 2 * head_bytes);
  char* dst = out->data();
  for (int64_t p : positions) {
    for (int h = 0; h < n_kv_heads; ++h) {
      std::memcpy(dst, view.k + p * view.row_stride + int64_t{h} * head_dim, head_bytes);
      dst += head_bytes;
      std::memcpy(dst, view.v + p * view.row_stride + int64_t{h} * head_dim, head_bytes);
      dst += head_bytes;
    }
  }
}

PrefillEngine::PrefillEngine(const model::Model* model, const model::Tokenizer* tokenizer,
                             const retrieval::MethodRegistry* registry, StoreClients* stores,
                             HandoffOpener* handoff, EngineOptions options)
    : PrefillEngine(MakeCpuPrefillBackend(model), tokenizer, registry, stores, handoff,
                    std::move(options)) {}

PrefillEngine::PrefillEngine(std::unique_ptr<PrefillBackend> backend,
                             const model::Tokenizer* tokenizer,
                             const retrieval::MethodRegistry* registry, StoreClients* stores,
                             HandoffOpener* handoff, EngineOptions options)
    : backend_(std::move(backend)),
      tokenizer_(tokenizer),
      registry_(registry),
      stores_(stores),
      handoff_(handoff),
      options_(std::move(options)) {
  if (options_.store_lease > absl::ZeroDuration()) {
    lease_keeper_ = std::make_unique<kv_store::LeaseKeeper>(kv_store::LeaseKeeperOptions{
        .ttl = options_.store_lease, .period = options_.store_lease / 4});
  }
}

std::string PrefillEngine::FailedNodeOf(const absl::Status& status) {
  auto node = status.GetPayload(kFailedNodePayload);
  return node ? std::string(*node) : std::string();
}

absl::StatusOr<std::vector<int32_t>> PrefillEngine::Tokenize(const Prompt& prompt) const {
  const char* field = PromptField(prompt);
  std::vector<int32_t> ids;
  if (const auto* tokens = std::get_if<TokenPrompt>(&prompt)) {
    ids = tokens->ids;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= backend_->config().vocab) {
        return absl::InvalidArgumentError(absl::StrCat("token_ids: id ", ids[i], " at index ", i,
                                                       " is outside the vocabulary of ",
                                                       backend_->config().vocab));
      }
    }
  } else if (tokenizer_ == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": this model has no tokenizer; send token_ids"));
  } else if (const auto* text = std::get_if<TextPrompt>(&prompt)) {
    if (text->text.empty()) return absl::InvalidArgumentError("prompt: empty");
    absl::StatusOr<std::vector<int32_t>> encoded = tokenizer_->Encode(text->text);
    if (!encoded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt: ", encoded.status().message()));
    }
    ids = std::move(*encoded);
  } else {
    const auto& chat = std::get<ChatPrompt>(prompt);
    if (chat.messages.empty()) return absl::InvalidArgumentError("chat.messages: empty");
    absl::StatusOr<std::string> rendered = tokenizer_->ApplyChatTemplate(chat.messages, true);
    if (!rendered.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("chat: ", rendered.status().message()));
    }
    absl::StatusOr<std::vector<int32_t>> encoded =
        tokenizer_->Encode(*rendered, {.add_special = false, .parse_special = true});
    if (!encoded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("chat: ", encoded.status().message()));
    }
    ids = std::move(*encoded);
  }
  if (ids.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": encodes to no tokens"));
  const int64_t context = backend_->config().context_length;
  if (context > 0 && static_cast<int64_t>(ids.size()) >= context) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", ids.size(), " tokens leave no room in the model's context of ",
                     context, " tokens"));
  }
  return ids;
}

bool PrefillEngine::Cancel(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  auto it = running_.find(request_id);
  if (it == running_.end()) return false;
  it->second->cancelled = true;
  return true;
}

absl::StatusOr<PrefillResult> PrefillEngine::Run(const PrefillJob& job,
                                                 const std::function<bool()>& client_gone) {
  const auto start = std::chrono::steady_clock::now();
  auto finish = [&](absl::StatusOr<PrefillResult> r) {
    if (options_.observer != nullptr) {
      options_.observer->OnFinished(r.status(), r.ok() ? &*r : nullptr,
                                    absl::FromChrono(std::chrono::steady_clock::now() - start));
    }
    return r;
  };
  absl::StatusOr<std::vector<int32_t>> ids = Tokenize(job.prompt);
  if (!ids.ok()) return finish(ids.status());

  auto running = std::make_shared<Running>();
  {
    absl::MutexLock lock(&mu_);
    running_[job.request_id] = running;
  }
  const uint64_t n = ids->size();
  queued_tokens_ += n;
  if (options_.observer != nullptr) options_.observer->OnQueued(static_cast<uint32_t>(n));
  absl::StatusOr<PrefillResult> result;
  {
    absl::MutexLock model_lock(&model_mu_);
    result = RunLocked(job, *ids, *running, client_gone);
  }
  queued_tokens_ -= n;
  {
    absl::MutexLock lock(&mu_);
    auto it = running_.find(job.request_id);
    if (it != running_.end() && it->second == running) running_.erase(it);
  }
  return finish(std::move(result));
}

absl::StatusOr<PrefillResult> PrefillEngine::RunLocked(const PrefillJob& job,
                                                       const std::vector<int32_t>& ids,
                                                       Running& running,
                                                       const std::function<bool()>& gone) {
  const model::ModelConfig& c = backend_->config();
  const int64_t L = static_cast<int64_t>(ids.size());
  if (options_.store_dtype != kv_store::DType::kF32 &&
      options_.store_dtype != kv_store::DType::kBf16 &&
      options_.store_dtype != kv_store::DType::kFp8E4m3) {
    return absl::InvalidArgumentError(absl::StrCat("store_dtype ",
                                                   kv_store::DTypeName(options_.store_dtype),
                                                   ": this node puts f32, bf16 or fp8_e4m3 rows"));
  }
  auto check = [&]() -> absl::Status {
    if (running.cancelled || (gone && gone())) {
      return absl::CancelledError(absl::StrCat("request ", job.request_id, " cancelled"));
    }
    if (absl::Now() > job.deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("request ", job.request_id, ": deadline passed during prefill"));
    }
    return absl::OkStatus();
  };
  KVR_RETURN_IF_ERROR(check());

  // Request parameters (the controller applied its defaults; check anyway: a bad value is the
  // request's fault, not this node's).
  const kvr::v1::RetrievalParams& rp = job.retrieval;
  if (rp.method().empty()) return absl::InvalidArgumentError("retrieval.method: empty");
  if (!registry_->Has(rp.method())) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval.method: unknown method '", rp.method(), "'"));
  }
  retrieval::IndexParams params;
  if (rp.has_budget()) params.budget = rp.budget();
  if (rp.has_n_sink()) params.n_sink = rp.n_sink();
  if (rp.has_local_window()) params.local_window = rp.local_window();
  for (const auto& [k, v] : rp.options()) params.options[k] = v;
  params.assets = options_.method_assets;
  if (absl::Status s = params.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("retrieval: ", s.message()));
  }
  const kvr::v1::SamplingParams& sp = job.sampling;
  const uint32_t max_tokens = sp.has_max_tokens() ? sp.max_tokens() : 1;
  model::SamplingOptions so;
  so.temperature = sp.temperature();
  so.top_p = sp.has_top_p() ? sp.top_p() : 1.f;
  so.top_k = sp.top_k();
  // Unset seed: one per request (stable for a request id, so a retry samples the same way).
  so.seed = sp.has_seed() ? sp.seed() : absl::HashOf(job.request_id);
  absl::StatusOr<model::Sampler> sampler = model::Sampler::Create(so);
  if (!sampler.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: ", sampler.status().message()));
  }

  // The store sequence: created before compute so that a full or dead store fails fast.
  // Held for the whole request: the client cache may drop the client meanwhile (the store
  // died), and the layer worker's puts still use it.
  absl::StatusOr<std::shared_ptr<kv_store::KvStoreClient>> store = stores_->Get(job.store);
  if (!store.ok()) return NodeFailure(job.store, "store", store.status());
  kv_store::SequenceShape shape{static_cast<uint32_t>(c.n_layers),
                                static_cast<uint32_t>(c.n_kv_heads),
                                static_cast<uint32_t>(c.head_dim), options_.store_dtype};
  uint64_t expected = static_cast<uint64_t>(L) + max_tokens;
  if (c.context_length > 0) expected = std::min<uint64_t>(expected, c.context_length);
  absl::Duration lease =
      (job.deadline == absl::InfiniteFuture() ? absl::Minutes(10) : job.deadline - absl::Now()) +
      options_.store_lease_margin;
  if (lease_keeper_ != nullptr) lease = std::min(lease, options_.store_lease);
  // A cached prefix: the new sequence is forked from it (the store shares its pages) and only
  // the rest of the prompt is computed. Gone (evicted, the store restarted), shorter or of
  // another shape: whatever it lacks is computed, so the answer never depends on the cache.
  int64_t reused = 0;
  bool created = false;
  // The reused rows end on the backend's alignment and within what the cached sequence holds
  // in every layer: from such a boundary the rest comes out bit for bit as a cold prefill
  // computes it, and so does the answer (the cached rows came from a prefill too, and a cached
  // prompt's last partial block is rounded away). Rows a few ulps off would be enough to flip
  // a near-tied greedy choice. A backend without a finer alignment (CUDA) reuses whole chunks
  // of the length it really computes in (it may cap chunk_tokens): then the computed chunks
  // are a cold prefill's.
  const int64_t align =
      std::max<int64_t>(1, backend_->PrefixAlignment() > 0
                               ? backend_->PrefixAlignment()
                               : backend_->ChunkTokens(options_.chunk_tokens));
  if (job.prefix_tokens > 0 && backend_->SupportsPrefix() && L > align) {
    uint64_t want = std::min<uint64_t>(job.prefix_tokens, static_cast<uint64_t>(L - 1));
    absl::StatusOr<kv_store::SequenceInfo> parent = (*store)->GetSequence(job.prefix);
    if (parent.ok() && !(parent->shape == shape)) {
      parent = absl::FailedPreconditionError("the cached sequence has another shape");
    }
    if (parent.ok()) {
      for (uint64_t rows : parent->committed_rows) want = std::min(want, rows);
      // A thinned prefix (the store dropped some of its pages) is reused only up to its first
      // hole; the rest is computed as in a cold prefill, on every backend, so no attention
      // ever runs over a hole as if it were a row.
      want = std::min(want, parent->intact_rows);
      want -= want % static_cast<uint64_t>(align);
      if (want == 0) {
        parent = absl::FailedPreconditionError(absl::StrCat(
            "less than one aligned block cached (", job.prefix_tokens, " prompt tokens matched",
            parent->thinned_pages > 0
                ? absl::StrCat(", thinned: rows [0, ", parent->intact_rows, ") whole")
                : "",
            ")"));
      }
    }
    absl::StatusOr<kv_store::ForkResult> forked =
        parent.ok() ? (*store)->ForkSequence(job.store_ref(), job.prefix, want, expected, lease)
                    : absl::StatusOr<kv_store::ForkResult>(parent.status());
    if (forked.ok() && forked->rows != want) {
      // Committed rows only grow, so this is a store fault; the child is not usable as is.
      (*store)->Release(job.store_ref(), absl::ZeroDuration()).IgnoreError();
      return NodeFailure(job.store, "store",
                         absl::InternalError(absl::StrCat("fork gave ", forked->rows,
                                                          " rows, asked ", want)));
    }
    if (forked.ok()) {
      created = true;
      reused = static_cast<int64_t>(forked->rows);
    } else if (absl::IsAlreadyExists(forked.status())) {
      return forked.status();
    } else if (absl::IsUnavailable(forked.status()) ||
               absl::IsDeadlineExceeded(forked.status())) {
      return NodeFailure(job.store, "store", forked.status());
    } else {
      spdlog::info("request {}: cached prefix not reused ({}); prefilling all {} tokens",
                   job.request_id, forked.status().ToString(), L);
    }
  }
  if (!created) {
    if (absl::StatusOr<kv_store::CreateResult> made =
            (*store)->CreateSequence(job.store_ref(), shape, expected, lease);
        !made.ok()) {
      // Sequence ids are random: a taken one is a collision, not a store failure. The
      // controller retries with a fresh id.
      if (absl::IsAlreadyExists(made.status())) return made.status();
      return NodeFailure(job.store, "store", made.status());
    }
  }
  // Renewed until this request is done with it (past the handoff, when the decode node keeps
  // it: their renewals overlap).
  std::unique_ptr<kv_store::LeaseKeeper::Handle> kept;
  if (lease_keeper_ != nullptr) kept = lease_keeper_->Keep(store->get(), *store, job.store_ref());
  bool handed_off = false;
  // Kept for later requests sharing the prefix only when the first token ended the request
  // well; a failed prefill's rows are freed.
  bool ended_well = false;
  absl::Cleanup release = [&] {
    if (handed_off) return;  // D owns the sequence now and releases it
    (*store)
        ->Release(job.store_ref(), ended_well ? job.retain : absl::ZeroDuration())
        .IgnoreError();
  };

  // A sequence kept for later requests keeps its layers' summaries at the last aligned
  // boundary of its prompt, where a later request that shares the whole prompt forks it
  // (summary_snapshot.h).
  const int64_t snapshot_rows =
      options_.extend_summaries && job.retain > absl::ZeroDuration() && backend_->SupportsPrefix()
          ? L / align * align
          : 0;

  // Prefill with per-layer handoff work. `rows` (the memory the layer tasks point into) is
  // declared before the worker, so it also outlives the worker on every early return.
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<PrefillRows> rows;
  const int threads = options_.layer_threads > 0
                          ? options_.layer_threads
                          : static_cast<int>(std::min<unsigned>(
                                8, std::max(1u, std::thread::hardware_concurrency())));
  LayerWorker worker({.config = &c,
                      .registry = registry_,
                      .params = &params,
                      .method = rp.method(),
                      .store = store->get(),
                      .store_dtype = options_.store_dtype,
                      .sequence = job.store_ref(),
                      .prompt_tokens = L,
                      .first_row = reused,
                      .extend = options_.extend_summaries,
                      .snapshot_rows = snapshot_rows,
                      .snapshot_key = SnapshotKey(job.model, c, rp.method(), params),
                      .observer = options_.observer,
                      .threads = threads});
  PrefillCall call;
  call.sequence = job.sequence_id;
  call.ids = ids;
  call.chunk_tokens = options_.chunk_tokens;
  call.max_queries = options_.max_prefill_queries;
  call.bf16_rows = options_.store_dtype != kv_store::DType::kF32;  // an fp8 store takes bf16
  call.prefix_rows = reused;
  // One layer of the reused rows at a time, read from the new sequence (its first rows are
  // the cached ones) and laid out as the model's cache holds them: float rows (CPU backend) or
  // bf16 bits (CUDA backend), each [reused, n_kv_heads * head_dim]. A layer's read and re-layout
  // are split into pieces of (head, rows) on `threads` threads: the memory copies of one thread
  // were the whole cost of a long prefix (4 GB for 30K rows of Llama-3-8B: ~2.6 s on one
  // thread; the GPU computes those rows in less).
  const size_t row_bytes = shape.RowBytes();
  const int64_t kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
  const int hd = c.head_dim;
  const int64_t per_head =
      std::max<int64_t>(1, (threads + c.n_kv_heads - 1) / c.n_kv_heads);  // row pieces per head
  const int64_t piece_rows = std::max<int64_t>(1, (reused + per_head - 1) / per_head);
  std::vector<uint8_t> prefix_buffer(static_cast<size_t>(reused) * shape.n_kv_heads * row_bytes);
  // The same pieces for every layer: rows [r0, r1) of KV head `head`.
  struct Piece {
    int head;
    int64_t r0, r1;
  };
  std::vector<Piece> pieces;
  for (int h = 0; h < c.n_kv_heads && reused > 0; ++h) {
    for (int64_t r0 = 0; r0 < reused; r0 += piece_rows) {
      pieces.push_back({h, r0, std::min(reused, r0 + piece_rows)});
    }
  }
  // Reads every piece of `layer` into the buffer ([head][row][k | v]) and calls
  // lay(h, r, stored row) for each row.
  auto load_layer = [&](int layer, const auto& lay) -> absl::Status {
    if (pieces.empty()) return absl::OkStatus();
    std::vector<absl::Status> status(pieces.size());
    auto run = [&](size_t i) {
      const Piece& p = pieces[i];
      uint8_t* at =
          prefix_buffer.data() + (static_cast<size_t>(p.head) * reused + p.r0) * row_bytes;
      const kv_store::RangeEntry range{job.store_ref(), static_cast<uint32_t>(layer),
                                       static_cast<uint32_t>(p.head), static_cast<uint64_t>(p.r0),
                                       static_cast<uint64_t>(p.r1 - p.r0)};
      status[i] = (*store)->RangeRead(std::span(&range, 1),
                                      std::span(at, static_cast<size_t>(p.r1 - p.r0) * row_bytes));
      if (!status[i].ok()) return;
      for (int64_t r = p.r0; r < p.r1; ++r) lay(p.head, r, at + (r - p.r0) * row_bytes);
    };
    std::vector<std::thread> helpers;
    for (size_t i = 1; i < pieces.size(); ++i) helpers.emplace_back(run, i);
    run(0);
    for (std::thread& t : helpers) t.join();
    for (const absl::Status& st : status) {
      if (!st.ok()) return NodeFailure(job.store, "store", st);
    }
    return absl::OkStatus();
  };
  call.load_prefix = [&](int layer, std::span<float> k, std::span<float> v) -> absl::Status {
    return load_layer(layer, [&](int h, int64_t r, const uint8_t* src) {
      kv_store::StoredRowToFloats(shape.dtype, static_cast<uint32_t>(hd), src,
                                  k.data() + r * kv_dim + int64_t{h} * hd,
                                  v.data() + r * kv_dim + int64_t{h} * hd);
    });
  };
  call.load_prefix_bf16 = [&](int layer, std::span<uint16_t> k,
                              std::span<uint16_t> v) -> absl::Status {
    return load_layer(layer, [&](int h, int64_t r, const uint8_t* src) {
      uint16_t* kd = k.data() + r * kv_dim + int64_t{h} * hd;
      uint16_t* vd = v.data() + r * kv_dim + int64_t{h} * hd;
      if (shape.dtype == kv_store::DType::kBf16) {
        std::memcpy(kd, src, static_cast<size_t>(hd) * sizeof(uint16_t));
        std::memcpy(vd, src + static_cast<size_t>(hd) * sizeof(uint16_t),
                    static_cast<size_t>(hd) * sizeof(uint16_t));
      } else {
        // Widened (exact for f32 rows that are widened bf16, a CUDA prefill's; fp8 rows
        // decoded), then rounded to bf16 to nearest even: an fp8 code * scale may need more
        // bits than bf16 has.
        thread_local std::vector<float> widened;
        widened.resize(2 * static_cast<size_t>(hd));
        kv_store::StoredRowToFloats(shape.dtype, static_cast<uint32_t>(hd), src, widened.data());
        FloatsToBf16Bytes(widened.data(), static_cast<size_t>(hd), kd);
        FloatsToBf16Bytes(widened.data() + hd, static_cast<size_t>(hd), vd);
      }
    });
  };
  call.method = rp.method();
  call.params = &params;
  call.on_layer = [&worker](LayerTask&& task) { worker.Push(std::move(task)); };
  // Cancellation, the deadline, and the worker's first error (a failed build or put stops the
  // compute early).
  call.check = [&]() -> absl::Status {
    KVR_RETURN_IF_ERROR(check());
    return worker.error();
  };
  absl::StatusOr<std::vector<float>> logits = backend_->Prefill(call, &rows);
  // Waits for the index builds and the store puts whatever happened.
  absl::Status worker_status = worker.Close();
  if (!logits.ok()) {
    // The worker's error is the cause when it stopped the compute.
    if (!worker_status.ok()) logits = worker_status;
    return logits.status();
  }
  if (!worker_status.ok()) {
    if (absl::IsInvalidArgument(worker_status)) return worker_status;
    return NodeFailure(job.store, "store", worker_status);
  }
  KVR_RETURN_IF_ERROR(check());

  PrefillResult result;
  result.prompt_tokens = static_cast<uint32_t>(L);
  result.method = rp.method().empty() ? "full" : rp.method();
  result.prefill_time = absl::FromChrono(std::chrono::steady_clock::now() - t0);
  result.kv_bytes_shipped = worker.kv_bytes();
  result.cached_tokens = static_cast<uint32_t>(reused);
  const LayerWorker::SummaryStats summaries = worker.summary_stats();
  result.summary_layers_extended = static_cast<uint32_t>(summaries.extended);
  result.summary_layers_rebuilt = static_cast<uint32_t>(summaries.rebuilt);
  if (summaries.rebuilt > 0 && options_.extend_summaries) {
    spdlog::info("request {}: {} of {} layers' summaries rebuilt over the reused prefix ({})",
                 job.request_id, summaries.rebuilt, c.n_layers, summaries.rebuild_reason);
  }
  if (!summaries.snapshot_error.empty()) {
    spdlog::info("request {}: summaries kept for reuse in {} of {} layers ({})", job.request_id,
                 summaries.snapshots_put, c.n_layers, summaries.snapshot_error);
  }

  // The first token and its text.
  KVR_ASSIGN_OR_RETURN(int32_t first, sampler->Sample(*logits));
  result.first_token = first;
  std::string pending;
  if (tokenizer_ != nullptr) {
    model::TokenStreamDecoder decoder(*tokenizer_);
    KVR_ASSIGN_OR_RETURN(result.first_text, decoder.Push(first));
    KVR_ASSIGN_OR_RETURN(std::string raw, tokenizer_->TokenBytes(first));
    // Bytes of an incomplete UTF-8 character the decoder held back.
    if (raw.size() > result.first_text.size() &&
        raw.compare(0, result.first_text.size(), result.first_text) == 0) {
      pending = raw.substr(result.first_text.size());
    }
    if (!sp.ignore_eos() && tokenizer_->IsEndOfGeneration(first)) {
      result.finish_reason = kvr::v1::FINISH_REASON_EOS;
      result.first_text.clear();  // the end token's text is not returned (as kvr generate)
    }
  }
  if (result.finish_reason == kvr::v1::FINISH_REASON_UNSPECIFIED) {
    for (const std::string& stop : sp.stop()) {
      const size_t at = result.first_text.find(stop);
      if (!stop.empty() && at != std::string::npos) {
        result.finish_reason = kvr::v1::FINISH_REASON_STOP_STRING;
        result.matched_stop = stop;
        result.first_text.resize(at);
        break;
      }
    }
  }
  if (result.finish_reason == kvr::v1::FINISH_REASON_UNSPECIFIED &&
      (max_tokens <= 1 || (c.context_length > 0 && L + 1 >= c.context_length))) {
    result.finish_reason = kvr::v1::FINISH_REASON_LENGTH;
  }
  if (result.finish_reason != kvr::v1::FINISH_REASON_UNSPECIFIED) {
    ended_well = true;
    return result;  // no handoff
  }

  // The handoff: header, then every layer.
  absl::StatusOr<std::unique_ptr<HandoffSink>> sink = handoff_->Open(job.decode, job.deadline);
  if (!sink.ok()) return NodeFailure(job.decode, "decode node", sink.status());
  cv1::HandoffChunk chunk;
  cv1::HandoffHeader* h = chunk.mutable_header();
  h->set_request_id(job.request_id);
  h->set_sequence_id(job.sequence_id);
  h->set_sequence_capability(job.store_capability.ToBytes());
  h->set_model(job.model);
  *h->mutable_sampling() = job.sampling;
  *h->mutable_retrieval() = job.retrieval;
  *h->mutable_store() = job.store;
  *h->mutable_deadline() = job.deadline_proto;
  h->set_prompt_tokens(static_cast<uint32_t>(L));
  h->set_first_token(static_cast<uint32_t>(first));
  h->set_n_layers(static_cast<uint32_t>(c.n_layers));
  h->set_text_so_far(result.first_text);
  h->set_pending_utf8(pending);
  if (job.retain > absl::ZeroDuration()) *h->mutable_retain() = job.retain_proto;
  bool ok = (*sink)->Write(chunk);
  result.handoff_bytes += chunk.ByteSizeLong();
  for (auto& layer : worker.layers()) {
    if (!ok) break;
    if (!layer) return absl::InternalError("prefill finished but a layer's handoff is missing");
    cv1::HandoffChunk lc;
    *lc.mutable_layer() = std::move(*layer);
    ok = (*sink)->Write(lc);
    result.handoff_bytes += lc.ByteSizeLong();
  }
  absl::StatusOr<cv1::HandoffResponse> response = (*sink)->Finish();
  if (!response.ok()) return NodeFailure(job.decode, "decode node", response.status());
  if (!ok || !response->accepted()) {
    return NodeFailure(job.decode, "decode node", absl::UnavailableError("handoff not accepted"));
  }
  handed_off = true;
  return result;
}

}  // namespace kvr::prefill_node
