// kvr bench decode: end-to-end decode throughput of the CUDA model runtime:
// dense (`full`) sequences with their whole KV in HBM against sparse sequences (quest,
// clusterkv) that keep only summaries, the sink/window rows and a hot cache on the GPU and
// gather the selected rows from pinned host memory (cuda_model.h, "Sparse sequences").
//
//   kvr bench decode [--contexts 32768,131072] [--methods full,quest,clusterkv]
//                    [--batches 1,2,4,...] [--budget 1024] [--sink 16] [--window 256]
//                    [--hot-cache-rows 1024] [--steps 16] [--warmup 3] [--profile]
//                    [--host-numa gpu[,far,unbound,thp,N,...+thp]] [--ceiling-mib 1024]
//                    [--ceiling-only] [--store HOST:PORT [--fetch]]
//                    [--replay TRACE,...] [--json FILE]
//
// Llama-3-8B shape with random weights generated on the GPU; SYNTHETIC KV (random rows) filled
// by FillSequenceForBenchmark; all sparse sequences of a batch share one host KV (128 GiB of host
// memory holds ~7 Llama-3-8B sequences of 128K); clusterkv's summaries are a synthetic stand-in
// for k-means (cuda_model.h). Per (context, method, batch): tokens/s, p50/p99 time per output
// token (one step = one token of every sequence, wall clock around ForwardGreedy), GPU bytes per
// sequence; batches up to what GPU memory allows (dense: sequences added until the GPU is full;
// sparse: slots configured until it is). Then the best sparse / best dense ratio per context,
// and with --profile the per-step GPU time split, the bytes gathered from host per step and
// where the timed steps' wall time went on the host (plan, queue, wait for the GPU, after).
//
// Same-run ceilings (before the rows): the GPU's PCI bus id and NUMA node, then per host KV
// placement (--host-numa: the GPU's node, the far node, cudaHostAlloc's unbound pages, or a node
// number, each optionally "+thp": transparent huge pages; "unbound" is always probed too) a pinned
// buffer of --ceiling-mib is placed and measured: cudaMemcpyAsync host -> device, a coalesced
// zero-copy read kernel and a zero-copy read of random 512-byte rows (the gather's shape). Each
// sparse row runs once per placement and prints its achieved gather GB/s as a fraction of that
// placement's zero-copy (coalesced) ceiling and its hot-cache hit rate; the closing analysis gives,
// per sparse row, the tok/s with the gather at the ceiling and the hit rate the 6x target would
// need at the ceiling.
//
// --store HOST:PORT (a kvr-store on this host started with --local-socket) adds the placement
// "store": the sparse rows are read in place from that store process's page pool, as a CUDA
// decode node reads them (the pool mapped read-only and registered with CUDA, a page table per
// slot): one store sequence of random bf16 rows per context, written through the store's API,
// shared by every slot of a batch (as the host KV is shared in the other placements).
// --fetch adds the placement "fetched": the same store sequence, read in place only at
// activation (the ring and the summaries), while every step's hot-cache misses are FETCHED
// through the store's data plane (UCX; one gather request per slot and layer, all of a layer's
// started before any is waited for, into pinned staging): the path of a decode node whose store
// is on another host (kvr-decode --gpu-row-source fetch). Its ceiling is the store's gather rate
// measured in the same run on the same sequence: as many concurrent gathers as the largest
// batch's slots, each of `budget` random rows of every KV head, best of --ceiling-repeats.
// --store-fp8 adds the placement "store:fp8": the same rows put to a second store sequence of
// the fp8 dtype (the store encodes them; Fp8RowLayout{2, head_dim}, checked against
// EncodeFp8Row for real documents), read in place with SparseDecodeOptions::row_format fp8: half
// the bytes a miss moves, and fp8 rows in the hot cache; with --fetch also "fetched:fp8", the
// fp8 rows' misses fetched through the store's data plane.
//
// --replay TRACE,...: selection traces that `kvr eval retrieval --trace-dir` recorded from a real
// model's free decoding (SmolLM2 at 8K). Each sparse method with a trace of its own runs again
// as METHOD:replayed: its GPU selector still runs (its cost stays in the step), then every
// slot's selection is replaced by the trace's (selection_replay.h: the trace nearest to this
// budget's share of the context, recorded layers and KV heads mapped onto the model's, each
// recorded position p standing for the budget / trace-budget rows from sink + (p - its sink)
// times that), so the hot cache
// and the gather see a real model's step-to-step reuse. Rows without the suffix are the
// synthetic lower bound (random keys: the selection moves every step).
//
// --model M --text FILE,... (with --store): a real model instead (rows METHOD:real): M's weights
// (RoPE-scaled with the llama3 rule past its trained context, --rope-factor), --documents
// disjoint slices of the tokenized corpus prefilled on the GPU per context (clusterkv's k-means
// built on the GPU as a CUDA prefill node builds it), their bf16 rows put to the store and
// checked read back from its pages; slot i decodes document i % documents from the context
// minus --doc-stride x (i / documents) tokens, fed the document's next token, then greedy;
// dense slots get the same documents' rows in HBM. Real weights, KV and selections.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/decode/store_row_fetcher.h"
#include "kvr/kv_store/client.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/all_methods.h"
#include "kvr/retrieval/clusterkv.h"
#include "kvr/retrieval/cuda/prefill_summaries.h"
#include "kvr/retrieval/cuda/sparse_decode.h"
#include "kvr/retrieval/model_shape.h"
#include "kvr/retrieval/prebuilt.h"
#include "selection_trace.h"

namespace kvr::tools {
namespace {

namespace rc = kvr::retrieval::cuda;

// The fp8 copy of a bench store sequence (--store-fp8) has the bf16 one's id with this bit set
// (the bench's ids stay below 2^48).
constexpr uint64_t kFp8SequenceBit = uint64_t{1} << 56;

struct DecodeBenchFlags {
  std::string shape = "llama3-8b";
  int layers = 0;
  std::vector<int64_t> contexts = {32768, 131072};
  std::vector<std::string> methods = {"full", "quest", "clusterkv"};
  std::vector<int> batches;  // empty: 1, 2, 4, ... up to the largest that fits, and that one
  int max_batch = 128;
  int budget = 1024;
  int sink = 16;
  int window = 256;
  int hot_cache_rows = 1024;
  int steps = 16;
  int warmup = 3;
  bool profile = false;
  double host_gbps = 51.0;  // the ceiling used when probes are off (--ceiling-mib 0) or failed
  std::vector<std::string> host_numa = {"gpu"};
  int ceiling_mib = 1024;
  int ceiling_repeats = 5;
  bool ceiling_only = false;
  std::string store;  // a same-host kvr-store: the "store" placement
  bool fetch = false;  // with store: the "fetched" placement
  bool store_rma = false;  // the store client reads by RMA gets where the store offers its rkey
  bool store_fp8 = false;  // with store: the "store:fp8" placement (the same rows, fp8 dtype)
  bool quest_fp32_bounds = false;   // quest's page bounds in fp32 instead of bf16
  std::vector<std::string> replay;  // selection traces (kvr eval retrieval --trace-dir)
  bool replay_scattered = false;    // also replay each trace with its rows scattered
  // A real model instead of the random-weight shape: its weights and tokenizer, documents of
  // the --text corpus prefilled on the GPU, their rows put to the --store.
  std::string model;
  std::vector<std::string> text;
  int documents = 4;
  int doc_stride = 61;     // slot i reads its document at context - doc_stride * (i / documents)
  double rope_factor = 0;  // 0: max context / the model's context, where that is above 1
  int prefill_chunk = 2048;
  std::string json;
};

// A host KV placement of the sparse rows: a NUMA node (-1: cudaHostAlloc, unbound) and what the
// probes measured there.
struct Placement {
  std::string label;  // "n0(gpu)", "n1(far)", "unbound", "n2", "thp", "n0(gpu)+thp"
  int node = -1;
  bool huge = false;   // transparent huge pages (SparseSequenceOptions::host_huge_pages)
  bool store = false;  // rows read in place from a kvr-store's pool (--store)
  bool fetch = false;  // with store: misses fetched through its data plane (--fetch)
  bool fp8 = false;    // with store: the same rows in an fp8 store sequence (--store-fp8)
  bool probed = false;
  rc::HostLinkProbe probe;
  double ceiling_gbps = 0;  // zero-copy coalesced read, or --host-gbps without a probe
};

struct Row {
  int64_t context = 0;
  std::string method;
  int batch = 0;
  const Placement* placement = nullptr;  // sparse rows
  double ceiling_gbps = 0;               // the placement's ceiling when the row ran
  double tokens_per_s = 0, p50_ms = 0, p99_ms = 0, mean_ms = 0;
  int64_t gpu_bytes_per_seq = 0;
  bool profiled = false;
  model::CudaForwardProfile prof;
  model::CudaForwardProfile host;  // the timed steps' host_* means (wall time on the host)
  double gathered_bytes_per_step = 0, hit_rate = 0;
  double selected_bytes_per_step = 0;  // hits included: what the step needs before the cache
  double GatherGbps() const {
    return prof.gather_ms > 0 ? gathered_bytes_per_step / (prof.gather_ms * 1e-3) / 1e9 : 0;
  }
};

// The trace of `method` whose share of its context (budget / prompt tokens) is nearest to the
// bench's (budget / context), or null.
const retrieval::eval::SelectionTrace* PickTrace(
    const std::vector<retrieval::eval::SelectionTrace>& traces, const std::string& method,
    int budget, int64_t context) {
  const retrieval::eval::SelectionTrace* best = nullptr;
  const double want = static_cast<double>(budget) / static_cast<double>(context);
  auto off = [&](const retrieval::eval::SelectionTrace& t) {
    return std::abs(std::log(static_cast<double>(t.budget) / t.prompt_tokens / want));
  };
  for (const auto& t : traces) {
    if (t.method == method && !t.steps.empty() && (best == nullptr || off(t) < off(*best))) {
      best = &t;
    }
  }
  return best;
}

// A recorded trace as the GPU replays it on this model: recorded layer l * L_trace / L for model
// layer l, recorded KV head h % H_trace for model head h, each recorded position standing for
// budget / trace budget rows (selection_replay.h).
std::shared_ptr<rc::SparseSelectionReplay> MakeReplay(const retrieval::eval::SelectionTrace& t,
                                                      const model::ModelConfig& c, int budget) {
  auto r = std::make_shared<rc::SparseSelectionReplay>();
  r->n_steps = static_cast<int>(t.steps.size());
  r->n_layers = c.n_layers;
  r->n_kv_heads = c.n_kv_heads;
  r->trace_budget = t.budget;
  r->run = std::max(1, static_cast<int>(std::lround(static_cast<double>(budget) / t.budget)));
  r->trace_begin = static_cast<int32_t>(t.CandidatesBegin());
  // The bench's slots share one store sequence: each replays other recorded heads.
  r->rotate_slots = true;
  const size_t heads = static_cast<size_t>(c.n_layers) * c.n_kv_heads;
  r->counts.assign(r->n_steps * heads, 0);
  r->ids.assign(r->n_steps * heads * t.budget, 0);
  for (int s = 0; s < r->n_steps; ++s) {
    const retrieval::eval::SelectionTrace::Step& step = t.steps[s];
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const int tl = static_cast<int>(int64_t{l} * t.n_layers / c.n_layers);
        const std::vector<int32_t>& ids =
            step.heads[static_cast<size_t>(tl) * t.n_kv_heads + h % t.n_kv_heads];
        const size_t at = s * heads + static_cast<size_t>(l) * c.n_kv_heads + h;
        r->counts[at] = static_cast<int32_t>(ids.size());
        std::copy(ids.begin(), ids.end(), r->ids.begin() + at * t.budget);
      }
    }
  }
  return r;
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

// --model: one document of the corpus, prefilled on the GPU and held by the store.
struct Document {
  int64_t first = 0;            // its first token's place in the corpus
  std::vector<int32_t> tokens;  // [context + 1]: the prompt and the token that follows it
  kv_store::SequenceRef id;
  kv_store::PageTable table;
  // --store-fp8: the same rows in a store sequence of the fp8 dtype (id 0: none).
  kv_store::SequenceRef fp8_id;
  kv_store::PageTable fp8_table;
  std::vector<retrieval::PrebuiltClusterKvData> clusters;  // per layer (clusterkv runs only)
};

class DecodeBench {
 public:
  DecodeBench(const DecodeBenchFlags& f, model::CudaModel& m, rc::SparseDecodeAttention& sp)
      : f_(f), m_(m), sp_(sp) {}

  // The store's client, its pool mapped and registered with CUDA (once), and the random-row
  // probe over the whole pool.
  absl::Status ConnectStore() {
    if (store_ == nullptr) {
      KVR_ASSIGN_OR_RETURN(
          store_, kv_store::UcxKvStoreClient::Connect(f_.store, {.timeout = absl::Seconds(60),
                                                                 .name = "kvr-bench-decode",
                                                                 .rma_reads = f_.store_rma}));
      std::printf("store: reads by %s\n", store_->range_read_path() == "rma"
                                              ? "RMA gets from the store's pool"
                                              : "requests the store answers (active messages)");
      KVR_ASSIGN_OR_RETURN(pool_, store_->MapLocalPool());
      KVR_ASSIGN_OR_RETURN(pool_device_, sp_.RegisterHostRegion(pool_->base(), pool_->bytes(),
                                                                /*read_only=*/true));
      // The gather's shape over the store's whole pool (a real pool is far larger than the
      // probes' pinned buffer, and address translation is what scattered rows pay for).
      const int64_t sample = std::min<int64_t>(pool_->bytes(), int64_t{1} << 30);
      absl::StatusOr<double> pool_rows =
          rc::MeasureMappedRows(pool_->base(), pool_device_, pool_->bytes(), sample, 5);
      if (pool_rows.ok()) {
        std::printf(
            "store pool: random 512-B rows spread over the whole %.1f GiB pool, %.0f MiB "
            "read, best of 5: %.1f GB/s\n",
            static_cast<double>(pool_->bytes()) / (1 << 30),
            static_cast<double>(sample) / (1 << 20), *pool_rows);
      } else {
        std::printf("store pool: random-row probe failed: %s\n",
                    pool_rows.status().ToString().c_str());
      }
    }
    return absl::OkStatus();
  }

  // The "store" placement's rows for `context`: one store sequence of random bf16 rows covering
  // `capacity` tokens (rows [0, context) written), its pages mapped and registered.
  absl::Status PrepareStoreRows(int64_t context, int64_t capacity) {
    KVR_RETURN_IF_ERROR(ConnectStore());
    KVR_RETURN_IF_ERROR(ReleaseStoreRows());
    const model::ModelConfig& c = m_.config();
    kv_store::SequenceShape shape{static_cast<uint32_t>(c.n_layers),
                                  static_cast<uint32_t>(c.n_kv_heads),
                                  static_cast<uint32_t>(c.head_dim), kv_store::DType::kBf16};
    const kv_store::SequenceRef id{0x6b7672000000ull + static_cast<uint64_t>(context),
                                   kv_store::Capability::Generate()};
    KVR_RETURN_IF_ERROR(
        store_->CreateSequence(id, shape, static_cast<uint64_t>(capacity), absl::ZeroDuration())
            .status());
    store_sequence_ = id;
    if (f_.store_fp8) {
      shape.dtype = kv_store::DType::kFp8E4m3;
      const kv_store::SequenceRef fp8_id{id.id | kFp8SequenceBit, kv_store::Capability::Generate()};
      KVR_RETURN_IF_ERROR(
          store_
              ->CreateSequence(fp8_id, shape, static_cast<uint64_t>(capacity), absl::ZeroDuration())
              .status());
      store_fp8_sequence_ = fp8_id;
    }
    // Random rows: one 64 MiB buffer of bf16 values in [-1, 1), each chunk put from another
    // offset of it (the values' distribution is what the synthetic bench needs, not novelty).
    const size_t half = size_t{2} * c.n_kv_heads * c.head_dim;  // bytes of K (or V), one token
    constexpr int64_t kChunk = 2048;
    if (random_.empty()) {
      random_.resize((size_t{64} << 20) / 2);
      uint64_t x = 0x9E3779B97F4A7C15ull;
      for (uint16_t& v : random_) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const float f = static_cast<float>((x >> 40) & 0xFFFFFF) / float(1 << 23) - 1.f;
        uint32_t u;
        std::memcpy(&u, &f, 4);
        v = static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    const auto* bytes = reinterpret_cast<const uint8_t*>(random_.data());
    const size_t span = random_.size() * 2 - 2 * kChunk * half;
    // The fp8 sequence (--store-fp8) gets the same bf16 rows; the store encodes them.
    for (const kv_store::SequenceRef& to : {id, store_fp8_sequence_}) {
      if (to.id == 0) continue;
      for (int l = 0; l < c.n_layers; ++l) {
        for (int64_t t = 0; t < context; t += kChunk) {
          const int64_t n = std::min(kChunk, context - t);
          const size_t off = ((static_cast<size_t>(l) * 7919 + t / kChunk * 104729) * 64) % span;
          kv_store::LayerRows rows;
          rows.sequence = to;
          rows.layer = static_cast<uint32_t>(l);
          rows.start_row = static_cast<uint64_t>(t);
          rows.n_rows = static_cast<uint32_t>(n);
          rows.k = {bytes + off, n * half};
          rows.v = {bytes + off + n * half, n * half};
          KVR_RETURN_IF_ERROR(store_->PutLayer(rows).status());
        }
      }
    }
    const double fill_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    KVR_ASSIGN_OR_RETURN(kv_store::PageTable table,
                         store_->ReservePageTable(id, static_cast<uint64_t>(capacity)));
    std::printf(
        "store: sequence of %lld tokens written in %.1f s (%.1f GB/s); %u rows per %llu-B "
        "page, %zu pages\n",
        static_cast<long long>(context), fill_s, 2.0 * half * context * c.n_layers / fill_s / 1e9,
        table.tokens_per_page, static_cast<unsigned long long>(table.page_bytes),
        table.pages.size());
    rows_ = SourceOf(table);
    if (store_fp8_sequence_.id != 0) {
      KVR_ASSIGN_OR_RETURN(
          kv_store::PageTable fp8_table,
          store_->ReservePageTable(store_fp8_sequence_, static_cast<uint64_t>(capacity)));
      rows_fp8_ = SourceOf(fp8_table);
    }
    return absl::OkStatus();
  }

  // The GPU's view of a store sequence's pages (the pool registered by ConnectStore).
  rc::SparseRowSource SourceOf(const kv_store::PageTable& table) const {
    rc::SparseRowSource src;
    src.base = pool_device_;
    src.page_bytes = static_cast<int64_t>(table.page_bytes);
    src.page_rows = static_cast<int32_t>(table.tokens_per_page);
    src.pages_per_head = static_cast<int32_t>(table.pages_per_head);
    src.pages.assign(table.pages.begin(), table.pages.end());
    return src;
  }

  // --model: the corpus (tokens) the documents are cut from, and the registry that parses the
  // GPU-built clusters.
  void SetCorpus(std::vector<int32_t> corpus, const retrieval::MethodRegistry* registry) {
    corpus_ = std::move(corpus);
    registry_ = registry;
  }
  bool real() const { return !f_.model.empty(); }

  // --model: `documents` disjoint slices of the corpus, each of `context` tokens, prefilled on
  // the GPU (a dense sequence exporting its bf16 rows, and with `clusters` its clusterkv
  // k-means built on the GPU as a CUDA prefill node builds it), the rows put to one store
  // sequence of `capacity` tokens per document, the clusters parsed as a decode node parses the
  // shipped bytes. Rows read back from the store's pages are checked against the prefill's.
  absl::Status PrepareDocuments(int64_t context, int64_t capacity, bool clusters) {
    KVR_RETURN_IF_ERROR(ConnectStore());
    KVR_RETURN_IF_ERROR(ReleaseDocuments());
    const model::ModelConfig& c = m_.config();
    const int64_t span = static_cast<int64_t>(corpus_.size()) / f_.documents;
    if (span < context + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--text: the corpus has ", corpus_.size(), " tokens; ", f_.documents,
                       " disjoint documents of ", context + 1, " tokens need ",
                       (context + 1) * f_.documents, " (more text, or fewer --documents)"));
    }
    const int64_t shortest = SlotLength(f_.max_batch - 1, context);
    if (shortest < f_.sink + f_.window + f_.budget) {
      return absl::InvalidArgumentError(
          absl::StrCat("--doc-stride ", f_.doc_stride, ": the last slot's context ", shortest,
                       " leaves nothing to select at budget ", f_.budget));
    }
    if (clusters && builders_ == nullptr) {
      KVR_ASSIGN_OR_RETURN(builders_, rc::PrefillSummaryBuilders::Create(c, 0));
    }
    const kv_store::SequenceShape shape{static_cast<uint32_t>(c.n_layers),
                                        static_cast<uint32_t>(c.n_kv_heads),
                                        static_cast<uint32_t>(c.head_dim), kv_store::DType::kBf16};
    const int64_t kv_dim = int64_t{c.n_kv_heads} * c.head_dim;
    max_clusters_ = 0;
    for (int d = 0; d < f_.documents; ++d) {
      Document doc;
      doc.first = d * span;
      doc.tokens.assign(corpus_.begin() + doc.first, corpus_.begin() + doc.first + context + 1);
      doc.id = {0x6b7673000000ull + static_cast<uint64_t>(context) * 64 + d,
                kv_store::Capability::Generate()};
      KVR_RETURN_IF_ERROR(
          store_
              ->CreateSequence(doc.id, shape, static_cast<uint64_t>(capacity), absl::ZeroDuration())
              .status());
      if (f_.store_fp8) {
        kv_store::SequenceShape fp8_shape = shape;
        fp8_shape.dtype = kv_store::DType::kFp8E4m3;
        doc.fp8_id = {doc.id.id | kFp8SequenceBit, kv_store::Capability::Generate()};
        const absl::Status created =
            store_
                ->CreateSequence(doc.fp8_id, fp8_shape, static_cast<uint64_t>(capacity),
                                 absl::ZeroDuration())
                .status();
        if (!created.ok()) {
          (void)store_->Release(doc.id, absl::ZeroDuration());
          return created;
        }
      }
      docs_.push_back(doc);  // released with the others from here on
      std::unique_ptr<rc::PrefillSummaryBuilder> builder;
      if (clusters) {
        rc::PrefillSummaryOptions o;
        o.method = "clusterkv";
        o.max_queries = 0;
        retrieval::IndexParams params;
        params.budget = f_.budget;
        params.n_sink = f_.sink;
        KVR_ASSIGN_OR_RETURN(o.params, retrieval::ApplyClusterKvOptions(params));
        KVR_ASSIGN_OR_RETURN(builder, builders_->ForSequence(o, context));
      }
      const rc::PrefillSummaryBuilder* summaries = builder.get();
      const model::SequenceId mid = 800000 + d;
      KVR_RETURN_IF_ERROR(m_.AddSequence(mid, context, std::move(builder)));
      std::vector<model::KvExportLayer> layers(c.n_layers);
      std::mutex mu;
      model::KvExportOptions eo;
      eo.length = context;
      eo.max_queries = 0;
      eo.built = clusters;
      eo.bf16_rows = true;
      // On the CUDA callback thread: the views stay valid until EndKvExport.
      eo.on_layer = [&](const model::KvExportLayer& x) {
        std::lock_guard<std::mutex> lock(mu);
        layers[x.layer] = x;
      };
      double prefill_s = 0, put_s = 0;
      const absl::Status st = [&]() -> absl::Status {
        KVR_RETURN_IF_ERROR(m_.BeginKvExport(mid, eo));
        std::vector<float> logits(c.vocab);
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t begin = 0; begin < context; begin += f_.prefill_chunk) {
          const int64_t n = std::min<int64_t>(f_.prefill_chunk, context - begin);
          const model::CudaSequence seq{mid, std::span(doc.tokens).subspan(begin, n),
                                        clusters && begin + n == context};
          KVR_RETURN_IF_ERROR(m_.Forward(std::span(&seq, 1), model::LogitsMode::kLast, logits));
        }
        const auto t1 = std::chrono::steady_clock::now();
        prefill_s = std::chrono::duration<double>(t1 - t0).count();
        std::lock_guard<std::mutex> lock(mu);
        constexpr int64_t kChunk = 2048;
        for (int l = 0; l < c.n_layers; ++l) {
          const model::KvExportLayer& x = layers[l];
          if (x.k_bf16 == nullptr || x.v_bf16 == nullptr) {
            return absl::InternalError(absl::StrCat("prefill export: no rows for layer ", l));
          }
          // The fp8 sequence (--store-fp8) gets the same bf16 rows; the store encodes them.
          for (const kv_store::SequenceRef& to : {doc.id, doc.fp8_id}) {
            for (int64_t t = 0; to.id != 0 && t < context; t += kChunk) {
              const int64_t n = std::min(kChunk, context - t);
              kv_store::LayerRows rows;
              rows.sequence = to;
              rows.layer = static_cast<uint32_t>(l);
              rows.start_row = static_cast<uint64_t>(t);
              rows.n_rows = static_cast<uint32_t>(n);
              rows.k = {reinterpret_cast<const uint8_t*>(x.k_bf16 + t * kv_dim),
                        static_cast<size_t>(n * kv_dim * 2)};
              rows.v = {reinterpret_cast<const uint8_t*>(x.v_bf16 + t * kv_dim),
                        static_cast<size_t>(n * kv_dim * 2)};
              KVR_RETURN_IF_ERROR(store_->PutLayer(rows).status());
            }
          }
          if (clusters) {
            KVR_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes,
                                 summaries->Serialize(retrieval::IndexShapeOf(c, l), x));
            KVR_ASSIGN_OR_RETURN(retrieval::PrebuiltClusterKvData parsed,
                                 retrieval::ParsePrebuiltClusterKv(bytes, *registry_));
            for (const std::vector<float>& centroids : parsed.centroids) {
              max_clusters_ = std::max<int64_t>(
                  max_clusters_, static_cast<int64_t>(centroids.size()) / c.head_dim);
            }
            docs_.back().clusters.push_back(std::move(parsed));
          }
        }
        KVR_ASSIGN_OR_RETURN(docs_.back().table,
                             store_->ReservePageTable(doc.id, static_cast<uint64_t>(capacity)));
        if (doc.fp8_id.id != 0) {
          KVR_ASSIGN_OR_RETURN(
              docs_.back().fp8_table,
              store_->ReservePageTable(doc.fp8_id, static_cast<uint64_t>(capacity)));
        }
        // The rows as the GPU will read them: the store's pages against the prefill's export.
        for (int l = 0; l < c.n_layers; ++l) {
          for (int h = 0; h < c.n_kv_heads; ++h) {
            for (int64_t t : {int64_t{0}, context / 3, context - 1}) {
              const uint8_t* row = pool_->Row(docs_.back().table, l, h, t);
              const size_t bytes = size_t{2} * c.head_dim;
              const uint16_t* k = layers[l].k_bf16 + t * kv_dim + h * c.head_dim;
              const uint16_t* v = layers[l].v_bf16 + t * kv_dim + h * c.head_dim;
              if (std::memcmp(row, k, bytes) != 0 || std::memcmp(row + bytes, v, bytes) != 0) {
                return absl::DataLossError(absl::StrCat("document ", d, ": row ", t, " of layer ",
                                                        l, " head ", h,
                                                        " differs in the store's pages"));
              }
              if (doc.fp8_id.id == 0) continue;
              // The fp8 sequence's row: EncodeFp8Row of the same values.
              const Fp8RowLayout layout{2, c.head_dim};
              std::vector<float> values(2 * c.head_dim);
              for (int i = 0; i < c.head_dim; ++i) {
                values[i] = Bf16ToFloat(k[i]);
                values[c.head_dim + i] = Bf16ToFloat(v[i]);
              }
              std::vector<uint8_t> want(layout.RowBytes());
              EncodeFp8Row(layout, values.data(), want.data());
              if (std::memcmp(pool_->Row(docs_.back().fp8_table, l, h, t), want.data(),
                              want.size()) != 0) {
                return absl::DataLossError(absl::StrCat("document ", d, ": fp8 row ", t,
                                                        " of layer ", l, " head ", h,
                                                        " is not the encoded bf16 row"));
              }
            }
          }
        }
        put_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        return absl::OkStatus();
      }();
      (void)m_.EndKvExport(mid);
      KVR_RETURN_IF_ERROR(m_.ReleaseSequence(mid));
      KVR_RETURN_IF_ERROR(st);
      std::printf(
          "%6lldK  document %d: corpus tokens [%lld, %lld) prefilled on the GPU in %.2f s "
          "(%.0f tok/s)%s, %.2f GB of bf16 rows%s put to the store and checked in %.1f s\n",
          static_cast<long long>(context / 1024), d, static_cast<long long>(doc.first),
          static_cast<long long>(doc.first + context), prefill_s, context / prefill_s,
          clusters ? " with clusterkv's k-means" : "",
          2.0 * kv_dim * 2 * context * c.n_layers / 1e9,
          doc.fp8_id.id != 0 ? " (and again as fp8 rows)" : "", put_s);
      std::fflush(stdout);
    }
    if (clusters) {
      std::printf(
          "%6lldK  clusterkv: k-means clusters of the GPU prefill build, up to %lld per head\n",
          static_cast<long long>(context / 1024), static_cast<long long>(max_clusters_));
    }
    return absl::OkStatus();
  }

  absl::Status ReleaseDocuments() {
    absl::Status first;
    for (const Document& doc : docs_) {
      first.Update(store_->Release(doc.id, absl::ZeroDuration()));
      if (doc.fp8_id.id != 0) first.Update(store_->Release(doc.fp8_id, absl::ZeroDuration()));
    }
    docs_.clear();
    return first;
  }

  // --model: slot i reads document i % documents at context - doc_stride * (i / documents)
  // tokens (neighbouring slots of one document at other positions, so that no two slots take
  // the same steps).
  const Document& SlotDocument(int i) const { return docs_[i % docs_.size()]; }
  int64_t SlotLength(int i, int64_t context) const {
    return context - int64_t{f_.doc_stride} * (i / f_.documents);
  }

  // The store's gather rate on the current sequence (the "fetched" placement's ceiling): `n`
  // concurrent gathers, each of `budget` random rows of every KV head of one layer (a slot's
  // per-layer fetch when nothing hits), into pinned host memory; best of `repeats` after one
  // untimed run. GB/s of row bytes.
  absl::StatusOr<double> MeasureFetchCeiling(int64_t context, int n, int repeats) {
    if (store_ == nullptr || store_sequence_.id == 0) {
      return absl::FailedPreconditionError("no store sequence");
    }
    const model::ModelConfig& c = m_.config();
    const size_t row = size_t{4} * c.head_dim;
    const size_t per = size_t{static_cast<size_t>(f_.budget)} * c.n_kv_heads;
    std::vector<uint32_t> idx(per * n);
    uint64_t x = 0x2545F4914F6CDD1Dull;
    for (uint32_t& v : idx) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      v = static_cast<uint32_t>(x % static_cast<uint64_t>(context));
    }
    std::vector<std::vector<kv_store::GatherEntry>> entries(n);
    for (int r = 0; r < n; ++r) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        entries[r].push_back({store_sequence_, static_cast<uint32_t>(r % c.n_layers),
                              static_cast<uint32_t>(h),
                              std::span<const uint32_t>(idx.data() + (r * c.n_kv_heads + h) *
                                                                         size_t(f_.budget),
                                                        static_cast<size_t>(f_.budget))});
      }
    }
    std::vector<uint8_t> out(per * n * row);
    double best = 0;
    for (int rep = 0; rep <= repeats; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::unique_ptr<kv_store::KvStoreOp>> ops;
      for (int r = 0; r < n; ++r) {
        ops.push_back(store_->StartGather(entries[r], {out.data() + r * per * row, per * row}));
      }
      for (auto& op : ops) KVR_RETURN_IF_ERROR(op->Wait().status());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) best = std::max(best, static_cast<double>(out.size()) / s / 1e9);
    }
    return best;
  }

  absl::Status ReleaseStoreRows() {
    rows_.reset();
    rows_fp8_.reset();
    absl::Status first;
    for (kv_store::SequenceRef* seq : {&store_sequence_, &store_fp8_sequence_}) {
      if (store_ == nullptr || seq->id == 0) continue;
      first.Update(store_->Release(std::exchange(*seq, {}), absl::ZeroDuration()));
    }
    return first;
  }

  // Steps `ids` (the model's dense sequences, or with `sparse` the sparse decode's); fills row's
  // timing fields.
  // `first`: each sequence's first token (a document's next token); empty: arbitrary ones.
  absl::Status Time(const std::vector<model::SequenceId>& ids, Row& row, bool sparse,
                    std::span<const int32_t> first = {}) {
    std::vector<int32_t> tokens(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      tokens[i] = first.size() == ids.size()
                      ? first[i]
                      : static_cast<int32_t>((i * 7919 + 13) % m_.config().vocab);
    }
    std::vector<int32_t> next(ids.size());
    auto step = [&]() -> absl::Status {
      std::vector<model::CudaSequence> batch;
      for (size_t i = 0; i < ids.size(); ++i) batch.push_back({ids[i], std::span(&tokens[i], 1)});
      KVR_RETURN_IF_ERROR(sparse ? sp_.ForwardGreedy(batch, next) : m_.ForwardGreedy(batch, next));
      tokens = next;
      return absl::OkStatus();
    };
    for (int i = 0; i < f_.warmup; ++i) KVR_RETURN_IF_ERROR(step());
    std::vector<double> ms;
    row.host = {};
    for (int i = 0; i < f_.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      KVR_RETURN_IF_ERROR(step());
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      // Where the timed step's wall time went on the host (CudaForwardProfile's host_* fields).
      const model::CudaForwardProfile p = m_.last_profile();
      row.host.host_before_ms += p.host_before_ms / f_.steps;
      row.host.host_queue_ms += p.host_queue_ms / f_.steps;
      row.host.host_wait_ms += p.host_wait_ms / f_.steps;
      row.host.host_after_ms += p.host_after_ms / f_.steps;
    }
    double sum = 0;
    for (double v : ms) sum += v;
    row.mean_ms = sum / ms.size();
    row.p50_ms = Percentile(ms, 0.5);
    row.p99_ms = Percentile(ms, 0.99);
    row.tokens_per_s = ids.size() / (row.mean_ms / 1e3);
    KVR_ASSIGN_OR_RETURN(row.gpu_bytes_per_seq,
                         sparse ? sp_.SequenceDeviceBytes(ids[0]) : m_.SequenceDeviceBytes(ids[0]));
    if (f_.profile) {
      const rc::SparseStats before = sp_.stats();
      m_.set_profile(true);
      model::CudaForwardProfile sum_p;
      constexpr int kProfiled = 3;
      for (int i = 0; i < kProfiled; ++i) {
        const absl::Status s = step();
        if (!s.ok()) {
          m_.set_profile(false);
          return s;
        }
        const model::CudaForwardProfile p = m_.last_profile();
        sum_p.total_ms += p.total_ms / kProfiled;
        sum_p.gemm_ms += p.gemm_ms / kProfiled;
        sum_p.attention_ms += p.attention_ms / kProfiled;
        sum_p.other_ms += p.other_ms / kProfiled;
        sum_p.select_ms += p.select_ms / kProfiled;
        sum_p.gather_ms += p.gather_ms / kProfiled;
      }
      m_.set_profile(false);
      const rc::SparseStats after = sp_.stats();
      row.profiled = true;
      row.prof = sum_p;
      const int64_t selected = after.selected_rows - before.selected_rows;
      const int64_t hits = after.hot_cache_hits - before.hot_cache_hits;
      if (selected > 0) {
        row.hit_rate = static_cast<double>(hits) / selected;
        row.gathered_bytes_per_step =
            static_cast<double>(selected - hits) * after.row_bytes / kProfiled;
        row.selected_bytes_per_step = static_cast<double>(selected) * after.row_bytes / kProfiled;
      }
    }
    return absl::OkStatus();
  }

  // Dense: as many sequences as fit (up to max_batch), then each batch of the sweep.
  absl::Status RunDense(int64_t context, std::vector<Row>& rows) {
    const int64_t capacity = context + f_.warmup + f_.steps + 8;
    std::vector<model::SequenceId> ids;
    for (int i = 0; i < f_.max_batch; ++i) {
      const model::SequenceId id = 1000 + i;
      const absl::Status s = m_.AddSequence(id, capacity);
      if (absl::IsResourceExhausted(s)) break;
      KVR_RETURN_IF_ERROR(s);
      ids.push_back(id);
    }
    if (ids.empty()) return absl::ResourceExhaustedError("no dense sequence fits");
    const absl::Status s = [&]() -> absl::Status {
      for (int b : Sweep(static_cast<int>(ids.size()))) {
        Row row{context, "full", b};
        auto once = [&](int n) -> absl::Status {
          row.batch = n;
          const std::vector<model::SequenceId> sub(ids.begin(), ids.begin() + n);
          std::vector<int32_t> first;
          for (int i = 0; i < n; ++i) {
            if (!real()) {
              KVR_RETURN_IF_ERROR(m_.FillSequenceForBenchmark(sub[i], context, 1));  // lengths
              continue;
            }
            // A document's rows from the store (a new sequence: rows cannot be taken back).
            KVR_RETURN_IF_ERROR(m_.ReleaseSequence(sub[i]));
            KVR_RETURN_IF_ERROR(m_.AddSequence(sub[i], capacity));
            const Document& doc = SlotDocument(i);
            const int64_t len = SlotLength(i, context);
            KVR_RETURN_IF_ERROR(m_.AppendRows(
                sub[i], len, [&](int layer, std::span<uint16_t> k, std::span<uint16_t> v) {
                  return pool_->CopyLayerRows(doc.table, static_cast<uint32_t>(layer),
                                              static_cast<uint64_t>(len), std::as_writable_bytes(k),
                                              std::as_writable_bytes(v));
                }));
            first.push_back(doc.tokens[len]);
          }
          return Time(sub, row, /*sparse=*/false, first);
        };
        absl::Status t = once(b);
        // The GPU filled to the last sequence may leave cuBLAS no room: one fewer.
        if (!t.ok() && b == static_cast<int>(ids.size()) && b > 1) {
          std::printf("%6lldK  full       %5d  failed (%s); one fewer\n",
                      static_cast<long long>(context / 1024), b, t.ToString().c_str());
          t = once(b - 1);
        }
        KVR_RETURN_IF_ERROR(t);
        Print(row);
        rows.push_back(row);
      }
      return absl::OkStatus();
    }();
    for (model::SequenceId id : ids) KVR_RETURN_IF_ERROR(m_.ReleaseSequence(id));
    return s;
  }

  absl::Status RunSparse(int64_t context, rc::SparseMethod method, const std::string& name,
                         const Placement& placement, std::vector<Row>& rows,
                         std::shared_ptr<const rc::SparseSelectionReplay> replay = nullptr) {
    const int64_t capacity = context + f_.warmup + f_.steps + 8;
    rc::SparseDecodeOptions o;
    o.method = method;
    o.max_capacity = capacity;
    o.budget = f_.budget;
    o.n_sink = f_.sink;
    o.local_window = f_.window;
    o.hot_cache_rows = f_.hot_cache_rows;
    o.quest_bf16_bounds = !f_.quest_fp32_bounds;
    o.row_format = placement.fp8 ? rc::SparseRowFormat::kFp8E4m3 : rc::SparseRowFormat::kBf16;
    o.clusterkv_max_pending = 4 * (f_.warmup + f_.steps) + 64;
    if (method == rc::SparseMethod::kClusterKv) {
      // The stand-in's clusters as many as the prefill's k-means would make with the CPU
      // index's defaults at this context and budget (ClusterKvPrefillClusters), and room for
      // those only.
      retrieval::IndexParams params;
      params.budget = f_.budget;
      const int64_t points = std::max<int64_t>(1, context - f_.sink);
      KVR_ASSIGN_OR_RETURN(const int64_t clusters,
                           retrieval::ClusterKvPrefillClusters(points, context, params));
      o.clusterkv_tokens_per_cluster = static_cast<int>((points + clusters - 1) / clusters);
      o.clusterkv_prefill_clusters =
          (capacity + o.clusterkv_tokens_per_cluster - 1) / o.clusterkv_tokens_per_cluster;
      if (real()) {
        o.clusterkv_prefill_clusters = max_clusters_;  // the documents' own k-means
      } else {
        std::printf(
            "%6lldK  %s: stand-in of %lld clusters of %d tokens (the default k-means at "
            "budget %d)\n",
            static_cast<long long>(context / 1024), name.c_str(), static_cast<long long>(clusters),
            o.clusterkv_tokens_per_cluster, f_.budget);
      }
    }
    o.replay = std::move(replay);
    // Largest slot count that fits (binary search on ConfigureSparse, which allocates it all).
    auto fits = [&](int slots) {
      o.slots = slots;
      return sp_.Configure(o).ok();
    };
    int lo = 0, hi = f_.max_batch;
    if (fits(hi)) {
      lo = hi;
    } else {
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        (fits(mid) ? lo : hi) = mid;
      }
    }
    if (lo == 0) return absl::ResourceExhaustedError(absl::StrCat(name, ": no slot fits"));
    const int max_slots = lo;
    auto run_batch = [&](int b) -> absl::Status {
      o.slots = b;
      KVR_RETURN_IF_ERROR(sp_.Configure(o));
      std::vector<model::SequenceId> ids;
      std::vector<int32_t> first;  // --model: each slot's next document token
      const absl::Status s = [&]() -> absl::Status {
        for (int i = 0; i < b; ++i) {
          const model::SequenceId id = 5000 + i;
          rc::SparseSequenceOptions so;
          if (placement.store) {
            const std::optional<rc::SparseRowSource>& own = placement.fp8 ? rows_fp8_ : rows_;
            if (real()) {
              const Document& doc = SlotDocument(i);
              so.rows = SourceOf(placement.fp8 ? doc.fp8_table : doc.table);
            } else if (own.has_value()) {
              so.rows = *own;
            } else {
              return absl::FailedPreconditionError("no store rows");
            }
            if (placement.fetch) {
              kv_store::SequenceRef from = real() ? SlotDocument(i).id : store_sequence_;
              if (placement.fp8) from = real() ? SlotDocument(i).fp8_id : store_fp8_sequence_;
              so.fetch = std::make_shared<decode::StoreRowFetcher>(store_.get(), nullptr, from);
            }
          } else {
            if (i > 0) so.share_host_kv_with = ids[0];
            so.host_numa_node = placement.node;
            so.host_huge_pages = placement.huge;
          }
          KVR_RETURN_IF_ERROR(sp_.AddSequence(id, capacity, so));
          ids.push_back(id);
          if (real()) {
            // The document's real rows and, for clusterkv, its k-means clusters.
            const Document& doc = SlotDocument(i);
            const int64_t len = SlotLength(i, context);
            first.push_back(doc.tokens[len]);
            if (method == rc::SparseMethod::kClusterKv) {
              std::vector<rc::SparseClusterHead> heads;
              for (const retrieval::PrebuiltClusterKvData& layer : doc.clusters) {
                for (size_t h = 0; h < layer.ids.size(); ++h) {
                  heads.push_back({layer.centroids[h], layer.offsets[h], layer.ids[h]});
                }
              }
              KVR_RETURN_IF_ERROR(sp_.ActivateSequenceWithClusters(id, len, heads));
            } else {
              KVR_RETURN_IF_ERROR(sp_.ActivateSequence(id, len));
            }
            continue;
          }
          KVR_RETURN_IF_ERROR(placement.store ? sp_.ActivateSequence(id, context)
                                              : sp_.FillSequenceForBenchmark(id, context, 1));
        }
        Row row{context, name, b, &placement};
        row.ceiling_gbps = placement.ceiling_gbps;  // "fetched": measured per context
        KVR_RETURN_IF_ERROR(Time(ids, row, /*sparse=*/true, first));
        Print(row);
        rows.push_back(row);
        return absl::OkStatus();
      }();
      for (model::SequenceId id : ids) KVR_RETURN_IF_ERROR(sp_.ReleaseSequence(id));
      return s;
    };
    for (int b : Sweep(max_slots)) {
      absl::Status s = run_batch(b);
      if (!s.ok() && b == max_slots && b > 1) {
        std::printf("%6lldK  %-16s  %5d  failed (%s); one fewer\n",
                    static_cast<long long>(context / 1024), name.c_str(), b, s.ToString().c_str());
        s = run_batch(b - 1);
      }
      if (!s.ok()) {
        o.slots = 0;
        (void)sp_.Configure(o);
        return s;
      }
    }
    o.slots = 0;  // frees the GPU state for the next method
    return sp_.Configure(o);
  }

  std::vector<int> Sweep(int max) const {
    std::vector<int> out;
    if (!f_.batches.empty()) {
      // A batch above what fits runs as the largest that fits.
      for (int b : f_.batches) {
        const int c = std::min(b, max);
        if (c > 0 && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
      }
      return out;
    }
    for (int b = 1; b < max; b *= 2) out.push_back(b);
    out.push_back(max);
    return out;
  }

  void Print(const Row& r) const {
    std::printf("%6lldK  %-16s  %-11s  %5d  %10.1f  %8.2f  %8.2f  %9.3f",
                static_cast<long long>(r.context / 1024), r.method.c_str(),
                r.placement != nullptr ? r.placement->label.c_str() : "-", r.batch, r.tokens_per_s,
                r.p50_ms, r.p99_ms, r.gpu_bytes_per_seq / double(1 << 30));
    if (r.profiled) {
      std::printf(
          "  | gpu %7.2f ms: gemm %6.2f  select %6.2f  gather %6.2f  attn %6.2f  other %5.2f",
          r.prof.total_ms, r.prof.gemm_ms, r.prof.select_ms, r.prof.gather_ms, r.prof.attention_ms,
          r.prof.other_ms);
      std::printf("  | wall: plan %.2f queue %.2f wait %.2f after %.2f ms", r.host.host_before_ms,
                  r.host.host_queue_ms, r.host.host_wait_ms, r.host.host_after_ms);
      if (r.placement != nullptr) {
        std::printf("  | host %7.1f MiB/step, hits %.2f | gather %5.1f GB/s = %.2f of %.1f",
                    r.gathered_bytes_per_step / (1 << 20), r.hit_rate, r.GatherGbps(),
                    r.GatherGbps() / r.ceiling_gbps, r.ceiling_gbps);
      }
    }
    std::printf("\n");
    std::fflush(stdout);
  }

 private:
  const DecodeBenchFlags& f_;
  model::CudaModel& m_;
  rc::SparseDecodeAttention& sp_;  // the model's sparse decode (its attention hook)
  // --store: the client, its mapped pool (registered with CUDA at pool_device_) and the rows of
  // the current context.
  std::unique_ptr<kv_store::UcxKvStoreClient> store_;
  std::shared_ptr<const kv_store::LocalPoolMapping> pool_;
  const void* pool_device_ = nullptr;
  kv_store::SequenceRef store_sequence_;
  kv_store::SequenceRef store_fp8_sequence_;  // --store-fp8
  std::optional<rc::SparseRowSource> rows_, rows_fp8_;
  std::vector<uint16_t> random_;
  // --model: the corpus, the documents of the current context and what built them.
  std::vector<int32_t> corpus_;
  const retrieval::MethodRegistry* registry_ = nullptr;
  std::unique_ptr<rc::PrefillSummaryBuilders> builders_;
  std::vector<Document> docs_;
  int64_t max_clusters_ = 0;  // clusters in the largest head of the current documents
};

// --host-numa entries -> placements (deduplicated by node), with a line saying what each became.
absl::StatusOr<std::vector<Placement>> ResolvePlacements(const DecodeBenchFlags& f,
                                                         const rc::HostTopology& topo) {
  std::vector<Placement> out;
  bool huge = false;
  auto add = [&](std::string label, int node) {
    if (huge) label = label == "unbound" ? "thp" : label + "+thp";
    for (const Placement& p : out) {
      if (p.node == node && p.huge == huge) return;
    }
    out.push_back(Placement{std::move(label), node, huge});
  };
  for (std::string want : f.host_numa) {
    // "<placement>+thp" or "thp" (= unbound+thp): the same, backed by transparent huge pages.
    huge = false;
    if (want == "thp") want = "unbound+thp";
    if (want.size() > 4 && want.compare(want.size() - 4, 4, "+thp") == 0) {
      huge = true;
      want.resize(want.size() - 4);
    }
    if (want == "gpu") {
      if (topo.gpu_numa_node >= 0) {
        add(absl::StrCat("n", topo.gpu_numa_node, "(gpu)"), topo.gpu_numa_node);
      } else {
        std::printf("host-numa gpu: the host reports no NUMA node for the GPU: unbound\n");
        add("unbound", -1);
      }
    } else if (want == "far") {
      int far = -1;
      for (int n : topo.memory_nodes) {
        if (n != topo.gpu_numa_node && topo.gpu_numa_node >= 0) {
          far = n;
          break;
        }
      }
      if (far < 0) {
        std::printf("host-numa far: no memory node other than the GPU's (%d): skipped\n",
                    topo.gpu_numa_node);
      } else {
        add(absl::StrCat("n", far, "(far)"), far);
      }
    } else if (want == "unbound") {
      add("unbound", -1);
    } else if (want == "none") {
      continue;  // only the store's placements (--store)
    } else {
      int node = -1;
      if (!absl::SimpleAtoi(want, &node) || node < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--host-numa: gpu, far, unbound, none or a node number, not '", want, "'"));
      }
      add(absl::StrCat("n", node), node);
    }
  }
  if (!f.store.empty()) {
    Placement store{"store", -1, false};
    store.store = true;
    out.push_back(store);
    if (f.store_fp8) {
      Placement fp8{"store:fp8", -1, false};
      fp8.store = fp8.fp8 = true;
      out.push_back(fp8);
    }
    if (f.fetch) {
      Placement fetched{"fetched", -1, false};
      fetched.store = fetched.fetch = true;
      out.push_back(fetched);
      if (f.store_fp8) {
        Placement fp8{"fetched:fp8", -1, false};
        fp8.store = fp8.fetch = fp8.fp8 = true;
        out.push_back(fp8);
      }
    }
  } else if (f.fetch || f.store_fp8) {
    return absl::InvalidArgumentError(
        "--fetch and --store-fp8 need --store (the kvr-store to read from)");
  }
  if (out.empty()) return absl::InvalidArgumentError("--host-numa: no placement left to run");
  return out;
}

// Topology line and the link probes of every placement (and of "unbound", the reference).
absl::Status ProbeCeilings(const DecodeBenchFlags& f, const rc::HostTopology& topo,
                           std::vector<Placement>& placements) {
  std::string nodes;
  for (int n : topo.memory_nodes) absl::StrAppend(&nodes, nodes.empty() ? "" : ",", n);
  std::printf("host: GPU %s on NUMA node %d; NUMA nodes with memory: %s\n",
              topo.gpu_pci_bus_id.c_str(), topo.gpu_numa_node, nodes.empty() ? "?" : nodes.c_str());
  for (Placement& p : placements) p.ceiling_gbps = f.host_gbps;
  if (f.ceiling_mib <= 0) {
    std::printf("link probes off (--ceiling-mib 0): gather fractions against --host-gbps %.1f\n",
                f.host_gbps);
    return absl::OkStatus();
  }
  std::vector<Placement> probes;
  for (const Placement& p : placements) {
    if (!p.store) probes.push_back(p);
  }
  if (std::none_of(probes.begin(), probes.end(),
                   [](const Placement& p) { return p.node < 0 && !p.huge; })) {
    probes.push_back(Placement{"unbound", -1});
  }
  std::printf(
      "host -> GPU link ceilings, measured now: a %d MiB pinned buffer per placement, best of %d "
      "after 1 untimed run, each copy checked against the host buffer\n",
      f.ceiling_mib, f.ceiling_repeats);
  std::printf("  %-12s  %-13s  %13s  %10s  %15s  %24s  %25s\n", "placement", "placed by",
              "pages on node", "huge pages", "H2D memcpy GB/s", "zero-copy coalesced GB/s",
              "zero-copy 512-B rows GB/s");
  for (Placement& p : probes) {
    absl::StatusOr<rc::HostLinkProbe> r =
        rc::MeasureHostLink(0, p.node, p.huge, int64_t{f.ceiling_mib} << 20, f.ceiling_repeats);
    if (!r.ok()) {
      std::printf("  %-10s  probe failed: %s\n", p.label.c_str(), r.status().ToString().c_str());
      continue;
    }
    p.probed = true;
    p.probe = *r;
    p.ceiling_gbps = r->zero_copy_read_gbps;
    const std::string on =
        r->on_node_fraction < 0 ? "-" : absl::StrFormat("%.3f", r->on_node_fraction);
    const std::string huge = r->huge_fraction < 0 ? "-" : absl::StrFormat("%.3f", r->huge_fraction);
    std::printf("  %-12s  %-13s  %13s  %10s  %15.1f  %24.1f  %25.1f\n", p.label.c_str(),
                r->how.c_str(), on.c_str(), huge.c_str(), r->h2d_copy_gbps, r->zero_copy_read_gbps,
                r->zero_copy_rows_gbps);
    for (Placement& q : placements) {
      if (q.fetch) {
        continue;  // its ceiling is the store's gather rate, measured with its rows
      } else if (q.store) {
        // The store's pool is host memory placed by the store process; its ceiling is the
        // link's, as the unbound buffer measures it.
        if (p.node < 0 && !p.huge) {
          q.probed = true;
          q.probe = p.probe;
          q.ceiling_gbps = p.ceiling_gbps;
        }
      } else if (q.node == p.node && q.huge == p.huge) {
        q = p;
      }
    }
  }
  std::fflush(stdout);
  return absl::OkStatus();
}

// Per sparse row: the gather against its ceiling, the step with the gather at the ceiling, and
// the hot-cache hit rate the 6x target needs at the ceiling (the rest of the step as measured).
void PrintCeilingAnalysis(const DecodeBenchFlags& f, const std::vector<Row>& rows) {
  std::printf(
      "\nceiling analysis (profiled sparse rows; ceiling = zero-copy coalesced GB/s of the row's "
      "host KV placement, measured above; 'at ceiling' = the measured step with its gather time "
      "replaced by host bytes / ceiling; '6x needs' = the hit rate at which host bytes / ceiling "
      "+ the measured non-gather time give 6x the best dense tok/s of that context; lookups "
      "stay in the gather time, so the needed rates are slight underestimates):\n");
  std::printf("%7s  %-16s  %-11s  %5s  %9s  %9s  %5s  %5s  %9s  %10s  %16s  %15s\n", "context",
              "method", "host KV", "batch", "tok/s", "gather GB/s", "frac", "hits", "MiB/token",
              "link tok/s", "at ceiling tok/s", "6x needs hits");
  for (int64_t ctx : f.contexts) {
    double dense_best = 0;
    for (const Row& r : rows) {
      if (r.context == ctx && r.method == "full") dense_best = std::max(dense_best, r.tokens_per_s);
    }
    const Row* best_at_ceiling = nullptr;
    double best_at_ceiling_tps = 0;
    for (const Row& r : rows) {
      if (r.context != ctx || r.placement == nullptr || !r.profiled) continue;
      const double ceiling = r.ceiling_gbps * 1e9;  // bytes/s
      const double per_token = r.gathered_bytes_per_step / r.batch;
      const double link_tps = per_token > 0 ? ceiling / per_token : 0;
      const double non_gather_s = std::max(0.0, r.mean_ms - r.prof.gather_ms) * 1e-3;
      const double at_ceiling_tps = r.batch / (non_gather_s + r.gathered_bytes_per_step / ceiling);
      std::string needs = "-";
      if (dense_best > 0) {
        const double link_budget_s = r.batch / (6 * dense_best) - non_gather_s;
        if (link_budget_s <= 0) {
          needs = absl::StrFormat("none (%.0fms)", non_gather_s * 1e3);
        } else if (r.selected_bytes_per_step > 0) {
          needs = absl::StrFormat(
              "%.3f", std::max(0.0, 1 - link_budget_s * ceiling / r.selected_bytes_per_step));
        }
      }
      std::printf(
          "%6lldK  %-16s  %-11s  %5d  %9.1f  %11.1f  %5.2f  %5.2f  %9.1f  %10.1f  %16.1f  %15s\n",
          static_cast<long long>(ctx / 1024), r.method.c_str(), r.placement->label.c_str(), r.batch,
          r.tokens_per_s, r.GatherGbps(), r.GatherGbps() * 1e9 / ceiling, r.hit_rate,
          per_token / (1 << 20), link_tps, at_ceiling_tps, needs.c_str());
      if (at_ceiling_tps > best_at_ceiling_tps) {
        best_at_ceiling_tps = at_ceiling_tps;
        best_at_ceiling = &r;
      }
    }
    if (best_at_ceiling != nullptr && dense_best > 0) {
      const Row& r = *best_at_ceiling;
      const double ceiling = r.ceiling_gbps * 1e9;
      const double non_gather_s = std::max(0.0, r.mean_ms - r.prof.gather_ms) * 1e-3;
      const double link_budget_s = r.batch / (6 * dense_best) - non_gather_s;
      std::printf(
          "  %6lldK ceiling-bound: %s %s b%d at its %.1f GB/s ceiling = %.1f tok/s = %.2fx dense "
          "(%.1f tok/s; measured %.1f tok/s = %.2fx); 6x (%.1f tok/s) needs hot-cache hits >= "
          "%s at that ceiling (this row saw %.2f)\n",
          static_cast<long long>(ctx / 1024), r.method.c_str(), r.placement->label.c_str(), r.batch,
          ceiling / 1e9, best_at_ceiling_tps, best_at_ceiling_tps / dense_best, dense_best,
          r.tokens_per_s, r.tokens_per_s / dense_best, 6 * dense_best,
          link_budget_s <= 0
              ? "(unreachable: the non-gather time alone is over the budget)"
              : absl::StrFormat(
                    "%.3f", std::max(0.0, 1 - link_budget_s * ceiling / r.selected_bytes_per_step))
                    .c_str(),
          r.hit_rate);
      // The synthetic stand-ins select runs of consecutive rows (clusterkv: 80, quest: 16);
      // real k-means clusters scatter their members: the random-row probe is their ceiling.
      if (r.placement->probed && r.placement->probe.zero_copy_rows_gbps > 0) {
        const double rows_bps = r.placement->probe.zero_copy_rows_gbps * 1e9;
        const double tps = r.batch / (non_gather_s + r.gathered_bytes_per_step / rows_bps);
        const double budget_s = r.batch / (6 * dense_best) - non_gather_s;
        std::printf(
            "  %6lldK with scattered rows (random 512-B rows at %.1f GB/s, this placement's "
            "probe): "
            "%.1f tok/s = %.2fx dense; 6x needs hits >= %s\n",
            static_cast<long long>(ctx / 1024), rows_bps / 1e9, tps, tps / dense_best,
            budget_s <= 0
                ? "(unreachable)"
                : absl::StrFormat(
                      "%.3f", std::max(0.0, 1 - budget_s * rows_bps / r.selected_bytes_per_step))
                      .c_str());
      }
    }
  }
}

absl::Status RunDecodeBench(const DecodeBenchFlags& f) {
  if (!model::CudaModelAvailable()) {
    return absl::FailedPreconditionError(
        "kvr bench decode needs a CUDA GPU: this build has no CUDA backend or no usable device "
        "(run it on the device machine: scripts/device/gpu-decode.sh)");
  }
  KVR_ASSIGN_OR_RETURN(rc::HostTopology topo, rc::GetHostTopology(0));
  KVR_ASSIGN_OR_RETURN(std::vector<Placement> placements, ResolvePlacements(f, topo));
  KVR_RETURN_IF_ERROR(ProbeCeilings(f, topo, placements));
  if (f.ceiling_only) return absl::OkStatus();
  const int64_t max_ctx = *std::max_element(f.contexts.begin(), f.contexts.end());
  const bool real = !f.model.empty();
  model::CudaModelOptions mo;
  mo.max_batch_tokens = real ? std::max(f.max_batch, f.prefill_chunk) : f.max_batch;
  mo.max_sequences = f.max_batch;
  mo.max_logits_rows = 64;
  std::unique_ptr<model::CudaModel> m;
  retrieval::MethodRegistry registry;
  std::vector<int32_t> corpus;
  std::string rope;  // --model: the RoPE scaling applied, for the header
  if (real) {
    // A real model: float32 weights as the CUDA backend uploads them, the tokenizer for the
    // corpus, and Llama 3.1-style RoPE scaling (the model config's llama3 rope_type) where the
    // contexts exceed the trained context: one factor for the whole run, as Llama 3.1 uses one
    // factor (8) at every length.
    if (f.store.empty()) {
      return absl::InvalidArgumentError(
          "--model needs --store: the documents' rows live in the kvr-store, as on a decode node");
    }
    if (!f.replay.empty()) {
      return absl::InvalidArgumentError("--model and --replay: a real model selects for itself");
    }
    if (f.text.empty()) return absl::InvalidArgumentError("--model needs --text (the corpus)");
    KVR_ASSIGN_OR_RETURN(
        model::LoadedModel loaded,
        model::LoadModel(f.model, {.weights = model::WeightStorage::kFloat32}, nullptr));
    if (!loaded.tokenizer.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("--model ", f.model, ": no tokenizer"));
    }
    model::ModelConfig config = loaded.model->config();
    const int64_t trained = config.has_llama3_scaling
                                ? config.llama3_scaling.original_context_length
                                : config.context_length;
    const double factor =
        f.rope_factor > 0 ? f.rope_factor : std::max(1.0, static_cast<double>(max_ctx) / trained);
    if (factor > 1.0) {
      if (config.has_llama3_scaling || !config.rope_freq_factors.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("--model ", f.model,
                                                       " already has RoPE scaling; its context is ",
                                                       config.context_length));
      }
      config.has_llama3_scaling = true;
      config.llama3_scaling = {.factor = static_cast<float>(factor),
                               .low_freq_factor = 1.f,
                               .high_freq_factor = 4.f,
                               .original_context_length = trained};
    }
    rope = factor > 1.0
               ? absl::StrFormat("llama3 RoPE scaling x%.2f from %lld (theta %.0f)", factor,
                                 static_cast<long long>(trained), config.rope_theta)
               : "no RoPE scaling";
    config.context_length =
        std::max<int64_t>(config.context_length, max_ctx + f.warmup + f.steps + 8);
    KVR_ASSIGN_OR_RETURN(m, model::CreateCudaModel(config, loaded.model->weights(), mo));
    const auto t0 = std::chrono::steady_clock::now();
    for (const std::string& path : f.text) {
      std::ifstream in(path, std::ios::binary);
      if (!in) return absl::NotFoundError(absl::StrCat("--text ", path, ": cannot read"));
      const std::string text((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      KVR_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                           loaded.tokenizer->Encode(text, {.add_special = false}));
      corpus.insert(corpus.end(), ids.begin(), ids.end());
    }
    std::printf("corpus: %zu tokens from %zu files, tokenized in %.1f s\n", corpus.size(),
                f.text.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    KVR_ASSIGN_OR_RETURN(registry, retrieval::AllMethods());
  } else {
    KVR_ASSIGN_OR_RETURN(model::ModelConfig config, model::DummyConfig(f.shape, f.layers));
    // Room for the decode steps past the longest context (128K is Llama-3's whole window).
    config.context_length =
        std::max<int64_t>(config.context_length, max_ctx + f.warmup + f.steps + 8);
    KVR_ASSIGN_OR_RETURN(m, model::CreateCudaModelWithRandomWeights(config, 1, mo));
  }
  const model::ModelConfig& config = m->config();
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<rc::SparseDecodeAttention> sp,
                       rc::CreateSparseDecodeAttention(*m));
  if (real) {
    std::printf(
        "kvr bench decode: REAL model %s (%d layers, %d KV heads x %d, %.2f GB bf16 weights), "
        "%s; REAL KV: %d documents of the corpus prefilled on this GPU, their rows in the store; "
        "slot i decodes document i %% %d from its context minus %d x (i / %d) tokens, fed the "
        "document's next token; REAL selections (clusterkv: the GPU prefill's k-means); budget "
        "%d, sink %d, window %d, hot cache %d rows/head; %d steps after %d warm-up\n",
        f.model.c_str(), config.n_layers, config.n_kv_heads, config.head_dim,
        m->weight_bytes() / 1e9, rope.c_str(), f.documents, f.documents, f.doc_stride, f.documents,
        f.budget, f.sink, f.window, f.hot_cache_rows, f.steps, f.warmup);
  } else {
    std::printf(
        "kvr bench decode: %s shape (%d layers), RANDOM weights (%.2f GB bf16), SYNTHETIC KV "
        "(random rows; sparse sequences of a batch share one host KV), budget %d, sink %d, "
        "window %d, hot cache %d rows/head; clusterkv summaries: synthetic stand-in (runs of "
        "consecutive tokens, mean key, as many as the default k-means); %d steps after %d "
        "warm-up; sparse rows once per host KV placement\n",
        f.shape.c_str(), config.n_layers, m->weight_bytes() / 1e9, f.budget, f.sink, f.window,
        f.hot_cache_rows, f.steps, f.warmup);
  }
  std::printf("%7s  %-16s  %-11s  %5s  %10s  %8s  %8s  %9s\n", "context", "method", "host KV",
              "batch", "tokens/s", "p50 ms", "p99 ms", "GiB/seq");
  // Warm-up before the GPU is filled: loads every kernel module (CUDA loads them lazily, which
  // needs free memory) and sizes cuBLAS's workspace at the largest batch.
  {
    std::vector<model::CudaSequence> batch;
    std::vector<int32_t> tok(f.max_batch, 1), next(f.max_batch);
    for (int i = 0; i < f.max_batch; ++i) {
      KVR_RETURN_IF_ERROR(m->AddSequence(900000 + i, 8));
      batch.push_back({model::SequenceId(900000 + i), std::span(&tok[i], 1)});
    }
    KVR_RETURN_IF_ERROR(m->ForwardGreedy(batch, next));
    for (int i = 0; i < f.max_batch; ++i) KVR_RETURN_IF_ERROR(m->ReleaseSequence(900000 + i));
    for (auto method : {rc::SparseMethod::kQuest, rc::SparseMethod::kClusterKv}) {
      rc::SparseDecodeOptions o;
      o.method = method;
      o.slots = 2;
      o.max_capacity = 4096;
      o.budget = f.budget;
      o.n_sink = f.sink;
      o.local_window = f.window;
      o.hot_cache_rows = f.hot_cache_rows;
      KVR_RETURN_IF_ERROR(sp->Configure(o));
      KVR_RETURN_IF_ERROR(sp->AddSequence(900000, 4096, {}));
      KVR_RETURN_IF_ERROR(sp->FillSequenceForBenchmark(900000, 3000, 7));
      const model::CudaSequence one{900000, std::span(&tok[0], 1)};
      m->set_profile(true);
      KVR_RETURN_IF_ERROR(sp->ForwardGreedy(std::span(&one, 1), std::span(&next[0], 1)));
      m->set_profile(false);
      KVR_RETURN_IF_ERROR(sp->ReleaseSequence(900000));
      o.slots = 0;
      KVR_RETURN_IF_ERROR(sp->Configure(o));
    }
  }
  std::vector<retrieval::eval::SelectionTrace> traces;
  for (const std::string& path : f.replay) {
    KVR_ASSIGN_OR_RETURN(retrieval::eval::SelectionTrace t,
                         retrieval::eval::ReadSelectionTrace(path));
    std::printf(
        "replay: %s: %s, %zu steps of budget %d over %lld tokens (%d layers x %d KV "
        "heads)\n",
        path.c_str(), t.method.c_str(), t.steps.size(), t.budget,
        static_cast<long long>(t.prompt_tokens), t.n_layers, t.n_kv_heads);
    traces.push_back(std::move(t));
  }
  DecodeBench bench(f, *m, *sp);
  bench.SetCorpus(std::move(corpus), &registry);
  std::vector<Row> rows;
  for (int64_t ctx : f.contexts) {
    const bool want_store =
        !f.store.empty() && std::any_of(f.methods.begin(), f.methods.end(),
                                        [](const std::string& m) { return m != "full"; });
    if (real) {
      const bool clusters =
          std::find(f.methods.begin(), f.methods.end(), "clusterkv") != f.methods.end();
      const absl::Status s = bench.PrepareDocuments(ctx, ctx + f.warmup + f.steps + 8, clusters);
      if (!s.ok()) {
        std::printf("%6lldK  documents: error: %s\n", static_cast<long long>(ctx / 1024),
                    s.ToString().c_str());
        continue;
      }
    } else if (want_store) {
      const absl::Status s = bench.PrepareStoreRows(ctx, ctx + f.warmup + f.steps + 8);
      if (!s.ok()) {
        std::printf("%6lldK  store rows: error: %s\n", static_cast<long long>(ctx / 1024),
                    s.ToString().c_str());
      }
      for (Placement& p : placements) {
        if (!s.ok() || !p.fetch) continue;
        const int n = f.batches.empty() ? f.max_batch
                                        : *std::max_element(f.batches.begin(), f.batches.end());
        const int repeats = std::max(f.ceiling_repeats, 20);  // cheap: ~64 MiB a run
        absl::StatusOr<double> gbps = bench.MeasureFetchCeiling(ctx, n, repeats);
        if (!gbps.ok()) {
          std::printf("%6lldK  fetch ceiling: error: %s\n", static_cast<long long>(ctx / 1024),
                      gbps.status().ToString().c_str());
          continue;
        }
        p.probed = true;
        p.ceiling_gbps = *gbps;
        std::printf("%6lldK  fetch ceiling (store gathers, %d concurrent x %d rows x %d KV heads, "
                    "best of %d): %.2f GB/s\n",
                    static_cast<long long>(ctx / 1024), n, f.budget, m->config().n_kv_heads,
                    repeats, *gbps);
      }
    }
    for (const std::string& method : f.methods) {
      if (method != "full" && method != "quest" && method != "clusterkv") {
        return absl::InvalidArgumentError(absl::StrCat("unknown method ", method));
      }
      for (const Placement& placement : placements) {
        // One row of the table (an error is printed in its place, and the sweep goes on).
        auto report = [&](const std::string& name, const absl::Status& s) {
          if (s.ok()) return;
          std::printf("%6lldK  %-16s  %-11s  error: %s\n", static_cast<long long>(ctx / 1024),
                      name.c_str(), method == "full" ? "-" : placement.label.c_str(),
                      s.ToString().c_str());
        };
        if (method == "full") {
          report(method, bench.RunDense(ctx, rows));
          break;  // the dense KV is in HBM: one run
        }
        const rc::SparseMethod sparse =
            method == "quest" ? rc::SparseMethod::kQuest : rc::SparseMethod::kClusterKv;
        auto run = [&](const std::string& name,
                       std::shared_ptr<const rc::SparseSelectionReplay> replay) {
          report(name, bench.RunSparse(ctx, sparse, name, placement, rows, std::move(replay)));
        };
        run(real ? method + ":real" : method, nullptr);
        const retrieval::eval::SelectionTrace* t = PickTrace(traces, method, f.budget, ctx);
        if (t == nullptr) continue;
        const std::shared_ptr<rc::SparseSelectionReplay> replay =
            MakeReplay(*t, m->config(), f.budget);
        std::printf(
            "%6lldK  %s:replayed: trace of budget %d over %lld tokens, each position "
            "%d rows\n",
            static_cast<long long>(ctx / 1024), method.c_str(), t->budget,
            static_cast<long long>(t->prompt_tokens), replay->run);
        run(method + ":replayed", replay);
        if (!f.replay_scattered) continue;
        // The same selections with each position's rows spread one by one over the context.
        auto scattered = std::make_shared<rc::SparseSelectionReplay>(*replay);
        scattered->scatter = static_cast<int32_t>(t->prompt_tokens - t->CandidatesBegin());
        run(method + ":scattered", scattered);
      }
    }
  }
  KVR_RETURN_IF_ERROR(bench.ReleaseStoreRows());
  KVR_RETURN_IF_ERROR(bench.ReleaseDocuments());
  std::printf(
      "\nbest sparse / best dense tokens/s (targets: >= 6x at 128K, >= 1.5x at 32K; "
      "synthetic selections are the lower bound, replayed ones a real model's reuse, real ones "
      "a real model's weights, KV and selections):\n");
  // Which locality a row's selections have, from its name's suffix.
  auto locality = [](const std::string& method) -> std::string_view {
    if (absl::EndsWith(method, ":replayed") || absl::EndsWith(method, ":scattered")) {
      return "replayed";
    }
    return absl::EndsWith(method, ":real") ? "real" : "synthetic";
  };
  for (int64_t ctx : f.contexts) {
    for (const std::string_view kind : {"synthetic", "replayed", "real"}) {
      const Row* dense = nullptr;
      const Row* sparse = nullptr;
      for (const Row& r : rows) {
        if (r.context != ctx) continue;
        if (r.method != "full" && locality(r.method) != kind) continue;
        const Row*& best = r.method == "full" ? dense : sparse;
        if (best == nullptr || r.tokens_per_s > best->tokens_per_s) best = &r;
      }
      if (dense != nullptr && sparse != nullptr) {
        std::printf(
            "  %6lldK %-9s: %s (host KV %s) b%d %.1f tok/s vs full b%d %.1f tok/s = "
            "%.2fx\n",
            static_cast<long long>(ctx / 1024), std::string(kind).c_str(), sparse->method.c_str(),
            sparse->placement->label.c_str(), sparse->batch, sparse->tokens_per_s, dense->batch,
            dense->tokens_per_s, sparse->tokens_per_s / dense->tokens_per_s);
      }
    }
  }
  if (f.profile) PrintCeilingAnalysis(f, rows);
  if (!f.json.empty()) {
    std::ofstream out(f.json);
    out << "[\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << absl::StrFormat(
          "  {\"context\": %d, \"method\": \"%s\", \"batch\": %d, \"tokens_per_s\": %.3f, "
          "\"p50_ms\": %.4f, \"p99_ms\": %.4f, \"gpu_bytes_per_seq\": %d, \"gpu_ms\": %.4f, "
          "\"gemm_ms\": %.4f, \"select_ms\": %.4f, \"gather_ms\": %.4f, \"attention_ms\": %.4f, "
          "\"other_ms\": %.4f, \"host_bytes_per_step\": %.0f, \"hot_cache_hit_rate\": %.4f, "
          "\"selected_bytes_per_step\": %.0f, \"host_numa_node\": %d, \"gather_gbps\": %.3f, "
          "\"ceiling_gbps\": %.3f}%s\n",
          r.context, r.method, r.batch, r.tokens_per_s, r.p50_ms, r.p99_ms, r.gpu_bytes_per_seq,
          r.prof.total_ms, r.prof.gemm_ms, r.prof.select_ms, r.prof.gather_ms, r.prof.attention_ms,
          r.prof.other_ms, r.gathered_bytes_per_step, r.hit_rate, r.selected_bytes_per_step,
          r.placement != nullptr ? r.placement->node : -1, r.GatherGbps(),
          r.placement != nullptr ? r.ceiling_gbps : 0.0, i + 1 < rows.size() ? "," : "");
    }
    out << "]\n";
    if (!out) return absl::InternalError(absl::StrCat("writing ", f.json));
  }
  return absl::OkStatus();
}

}  // namespace

void AddBenchDecodeCommand(CLI::App& app) {
  CLI::App* bench = app.get_subcommand("bench");
  auto flags = std::make_shared<DecodeBenchFlags>();
  DecodeBenchFlags& f = *flags;
  CLI::App* cmd = bench->add_subcommand(
      "decode", "GPU decode throughput of the CUDA model runtime: dense vs sparse (needs a GPU)");
  cmd->add_option("--shape", f.shape, "dummy model shape")->capture_default_str();
  cmd->add_option("--layers", f.layers, "layers (0: the shape's)");
  cmd->add_option("--contexts", f.contexts, "context lengths")->delimiter(',');
  cmd->add_option("--methods", f.methods, "full, quest, clusterkv")->delimiter(',');
  cmd->add_option("--batches", f.batches,
                  "batch sizes (default: 1, 2, 4, ... and the largest "
                  "that fits)")
      ->delimiter(',');
  cmd->add_option("--max-batch", f.max_batch, "largest batch tried")->capture_default_str();
  cmd->add_option("--budget", f.budget, "selected tokens per KV head")->capture_default_str();
  cmd->add_option("--sink", f.sink, "sink tokens")->capture_default_str();
  cmd->add_option("--window", f.window, "local window tokens")->capture_default_str();
  cmd->add_option("--hot-cache-rows", f.hot_cache_rows, "hot-cache rows per KV head and layer")
      ->capture_default_str();
  cmd->add_option("--steps", f.steps, "timed decode steps")->capture_default_str();
  cmd->add_option("--warmup", f.warmup, "warm-up steps")->capture_default_str();
  cmd->add_flag("--profile", f.profile, "per-step GPU time split and host bytes gathered");
  cmd->add_option("--host-gbps", f.host_gbps,
                  "pinned host -> GPU ceiling (GB/s) used only without link probes")
      ->capture_default_str();
  cmd->add_option("--host-numa", f.host_numa,
                  "host KV placements of the sparse rows: gpu (the GPU's NUMA node), far, unbound "
                  "(cudaHostAlloc), a node number; '+thp' on any (or 'thp' = unbound+thp): "
                  "backed by transparent huge pages; none: only the --store placements")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--ceiling-mib", f.ceiling_mib,
                  "pinned buffer of the link probes per placement (0: no probes)")
      ->capture_default_str();
  cmd->add_option("--ceiling-repeats", f.ceiling_repeats, "timed runs per probe (best kept)")
      ->capture_default_str();
  cmd->add_flag("--ceiling-only", f.ceiling_only,
                "print the topology and link ceilings, then stop");
  cmd->add_option("--store", f.store,
                  "a kvr-store on this host (started with --local-socket): adds the placement "
                  "'store', rows read in place from its page pool as a CUDA decode node does");
  cmd->add_flag("--fetch", f.fetch,
                "with --store: adds the placement 'fetched', the misses fetched through the "
                "store's data plane (UCX) as for a store on another host, against the store's "
                "gather rate measured in the same run");
  cmd->add_flag("--store-fp8", f.store_fp8,
                "with --store: adds the placement 'store:fp8' (and with --fetch 'fetched:fp8'), "
                "the same rows in a store sequence of the fp8 dtype (e4m3 codes, a float scale "
                "per K and per V: 136 B a row at head_dim 64 against 256), read in place (or "
                "fetched) and kept fp8 in the hot cache");
  cmd->add_flag("--quest-fp32-bounds", f.quest_fp32_bounds,
                "quest's page bounds in fp32 (the sparse decode's default: bf16, rounded outward)");
  cmd->add_flag("--store-rma", f.store_rma,
                "with --store: the store client reads rows (the 'fetched' placement's misses and "
                "its ceiling) by RMA gets from the store's pool, where the store offers its rkey "
                "(kvr-store --rma-reads true) and the transport has native RMA");
  cmd->add_option("--replay", f.replay,
                  "selection traces (kvr eval retrieval --trace-dir): each sparse method with a "
                  "trace of its own also runs as METHOD:replayed, its selections replaced by the "
                  "trace's (the one nearest to budget / context; positions scaled to the context)")
      ->delimiter(',')
      ->check(CLI::ExistingFile);
  cmd->add_flag("--replay-scattered", f.replay_scattered,
                "with --replay: also run METHOD:scattered, the same replayed selections with each "
                "recorded position's rows spread one by one over the context instead of a run "
                "(the fetch pattern of clusters whose members lie anywhere)");
  cmd->add_option("--model", f.model,
                  "a real model (GGUF file or Hugging Face folder) instead of --shape's random "
                  "weights: documents of --text prefilled on the GPU, their rows in --store, real "
                  "selections (rows METHOD:real)");
  cmd->add_option("--text", f.text, "with --model: the corpus the documents are cut from")
      ->delimiter(',')
      ->check(CLI::ExistingFile);
  cmd->add_option("--documents", f.documents,
                  "with --model: disjoint documents per context (slot i reads document i % N)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--doc-stride", f.doc_stride,
                  "with --model: slot i starts at the context minus this x (i / documents) tokens")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--rope-factor", f.rope_factor,
                  "with --model: llama3 RoPE scaling factor (0: the longest context over the "
                  "model's trained context, where above 1)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1024.0));
  cmd->add_option("--prefill-chunk", f.prefill_chunk, "with --model: prefill chunk, tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--json", f.json, "write the rows as JSON");
  cmd->callback([flags] {
    ExitIfError("bench decode", RunDecodeBench(*flags));
    // `kvr bench` itself (the load generator) must not run after its subcommand.
    throw CLI::Success();
  });
}

}  // namespace kvr::tools
