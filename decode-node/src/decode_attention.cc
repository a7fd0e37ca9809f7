#include "kvr/decode/decode_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/cpu_kernels.h"
#include "kvr/model/dense_attention.h"
#include "kvr/retrieval/ops.h"
#include "spdlog/spdlog.h"

namespace kvr::decode {

using model::AttentionRequest;
using model::AttentionShape;

void RetrievalCounters::Add(const RetrievalCounters& o) {
  selected_rows += o.selected_rows;
  rows_fetched += o.rows_fetched;
  bytes_fetched += o.bytes_fetched;
  hot_cache_hits += o.hot_cache_hits;
  hot_cache_misses += o.hot_cache_misses;
  rows_offloaded += o.rows_offloaded;
}

DecodeAttention::DecodeAttention(DecodeAttentionOptions options, DecodeObserver* observer,
                                 ThreadPool* pool)
    : options_(options),
      observer_(observer),
      pool_(pool),
      hot_cache_(options.hot_cache_bytes),
      quality_rng_(options.quality_seed),
      quality_coin_(std::clamp(options.quality_sample_rate, 0.0, 1.0)) {}

DecodeAttention::~DecodeAttention() { FinishOffload().IgnoreError(); }

absl::Status DecodeAttention::AddSequence(model::SequenceId id, DecodeSequenceSetup setup) {
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("DecodeAttention: sequence ", id, " exists"));
  }
  if (static_cast<int>(setup.indexes.size()) != options_.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("DecodeAttention: sequence ", id, " has ",
                                                   setup.indexes.size(), " indexes for ",
                                                   options_.n_layers, " layers"));
  }
  if (setup.cache == nullptr || !setup.cache->windowed() ||
      setup.cache->n_layers() != options_.n_layers ||
      setup.cache->n_kv_heads() != options_.n_kv_heads ||
      setup.cache->head_dim() != options_.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DecodeAttention: sequence ", id, " needs a windowed KvCache shaped for the model"));
  }
  if (setup.cache->n_sink() != setup.n_sink || setup.cache->local_window() != setup.local_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DecodeAttention: sequence ", id, ": the cache's sink/window (", setup.cache->n_sink(), "/",
        setup.cache->local_window(), ") differ from the retrieval params (", setup.n_sink, "/",
        setup.local_window, ")"));
  }
  if (setup.store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("DecodeAttention: sequence ", id, ": no store"));
  }
  if (setup.budget <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: sequence ", id, ": budget must be > 0"));
  }
  if (setup.row_dtype != kv_store::DType::kF32 && setup.row_dtype != kv_store::DType::kBf16 &&
      setup.row_dtype != kv_store::DType::kFp8E4m3) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: sequence ", id, ": store rows are ",
                     kv_store::DTypeName(setup.row_dtype), "; f32, bf16 or fp8_e4m3 needed"));
  }
  Sequence seq;
  seq.setup = std::move(setup);
  const size_t floats = static_cast<size_t>(options_.n_layers) * options_.n_kv_heads *
                        static_cast<size_t>(options_.head_dim);
  seq.new_k.resize(floats);
  seq.new_v.resize(floats);
  seq.has_new_rows.assign(options_.n_layers, false);
  sequences_.emplace(id, std::move(seq));
  ReportSummaryBytes(sequences_.at(id).setup.method);
  return absl::OkStatus();
}

absl::Status DecodeAttention::Prepare(const AttentionShape& shape, const AttentionRequest& r,
                                      size_t request_index) {
  auto it = sequences_.find(r.sequence);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("DecodeAttention: unknown sequence ", r.sequence));
  }
  Sequence& seq = it->second;
  const DecodeSequenceSetup& setup = seq.setup;
  if (r.n_queries != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: sequence ", r.sequence, " brings ", r.n_queries,
                     " queries; a decode node runs one token per sequence and step"));
  }
  if (r.layer < 0 || r.layer >= options_.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: layer ", r.layer, " outside [0, ", options_.n_layers, ")"));
  }
  const int64_t p = r.first_position;
  const model::KvView& kv = r.kv;
  if (kv.n_rows == 0 || static_cast<int64_t>(kv.positions.size()) != kv.n_rows ||
      kv.positions.back() != p) {
    return absl::InternalError(absl::StrCat("DecodeAttention: sequence ", r.sequence, " layer ",
                                            r.layer,
                                            ": the resident rows do not end at the "
                                            "query's position ",
                                            p));
  }
  const int hd = shape.head_dim;
  const int64_t row = int64_t{shape.n_kv_heads} * hd;

  // 1. Rows that left the local window join the index (those it does not cover yet).
  retrieval::RetrievalIndex* index = setup.indexes[r.layer].get();
  const model::KvView ev = setup.cache->Evicted(r.layer);
  if (index != nullptr && ev.n_rows > 0) {
    int64_t begin = 0;
    while (begin < ev.n_rows && ev.positions[begin] < index->size()) ++begin;
    if (begin < ev.n_rows) {
      if (ev.positions[begin] != index->size() ||
          ev.positions[ev.n_rows - 1] != index->size() + (ev.n_rows - begin) - 1) {
        return absl::InternalError(
            absl::StrCat("DecodeAttention: sequence ", r.sequence, " layer ", r.layer,
                         ": rows leaving the "
                         "window start at position ",
                         ev.positions[begin], " but the index covers [0, ", index->size(), ")"));
      }
      retrieval::AppendInput in;
      in.keys = {ev.k + begin * ev.row_stride, ev.n_rows - begin, ev.row_stride};
      KVR_RETURN_IF_ERROR(index->Append(in));
    }
  }
  setup.cache->ClearEvicted(r.layer);

  // 2. Keep the new token's rows for the store.
  std::memcpy(seq.new_k.data() + r.layer * row, kv.k + (kv.n_rows - 1) * kv.row_stride,
              row * sizeof(float));
  std::memcpy(seq.new_v.data() + r.layer * row, kv.v + (kv.n_rows - 1) * kv.row_stride,
              row * sizeof(float));
  seq.has_new_rows[r.layer] = true;

  // 3. Selection among the positions that are neither sink nor local.
  const int64_t n_sink = std::min(setup.n_sink, p + 1);
  const int64_t local_begin = std::max(n_sink, p + 1 - setup.local_window);
  if (kv.n_rows != n_sink + (p + 1 - local_begin)) {
    return absl::InternalError(absl::StrCat("DecodeAttention: sequence ", r.sequence, " layer ",
                                            r.layer, " holds ", kv.n_rows,
                                            " resident rows at position ", p, ", expected ", n_sink,
                                            " sink + ", p + 1 - local_begin, " local"));
  }
  if (index != nullptr) {
    retrieval::SelectRequest sel;
    sel.query = r.q;
    sel.query_position = p;
    sel.budget = setup.budget;
    sel.n_sink = n_sink;
    sel.local_begin = local_begin;
    KVR_RETURN_IF_ERROR(index->Select(sel, &selection_));
    if (static_cast<int>(selection_.per_head.size()) != shape.n_kv_heads) {
      return absl::InternalError(absl::StrCat("DecodeAttention: method ", setup.method,
                                              " returned ", selection_.per_head.size(),
                                              " KV heads, expected ", shape.n_kv_heads));
    }
  } else {
    selection_.per_head.resize(shape.n_kv_heads);
    for (auto& ids : selection_.per_head) {
      ids.resize(static_cast<size_t>(local_begin - n_sink));
      std::iota(ids.begin(), ids.end(), n_sink);
    }
  }
  for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
    std::vector<int64_t>& ids = selection_.per_head[kvh];
    for (int64_t id : ids) {
      if (id < n_sink || id >= local_begin) {
        return absl::InternalError(
            absl::StrCat("DecodeAttention: method ", setup.method, " selected position ", id,
                         " outside the candidates [", n_sink, ", ", local_begin, ")"));
      }
    }
    seq.counters.selected_rows += static_cast<int64_t>(ids.size());
    node_.retrieval.selected_rows += static_cast<int64_t>(ids.size());
    HeadWork& w = work_.emplace_back();
    w.request = request_index;
    w.head = kvh;
    w.positions.swap(ids);
    w.sink_rows = n_sink;
  }
  return absl::OkStatus();
}

absl::Status DecodeAttention::Attend(const AttentionShape& shape,
                                     std::span<const AttentionRequest> batch) {
  if (shape.n_kv_heads != options_.n_kv_heads || shape.head_dim != options_.head_dim ||
      shape.n_heads % shape.n_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeAttention: shape heads ", shape.n_heads, "/", shape.n_kv_heads,
                     " head_dim ", shape.head_dim, " does not match the node's model"));
  }
  ++node_.attend_calls;
  const int hd = shape.head_dim;
  const int64_t row_floats = 2 * int64_t{hd};  // one row [k | v] as attended (and hot-cached)
  const int64_t row_f32_bytes = row_floats * static_cast<int64_t>(sizeof(float));
  work_.clear();
  for (size_t i = 0; i < batch.size(); ++i) KVR_RETURN_IF_ERROR(Prepare(shape, batch[i], i));
  size_t total = 0;
  for (HeadWork& w : work_) {
    w.rows_offset = total;
    total += w.positions.size() * static_cast<size_t>(row_floats);
  }
  rows_.resize(total);

  // Hot cache first; the misses of every sequence and head go into one gather per store.
  struct StoreBatch {
    std::vector<kv_store::GatherEntry> entries;
    std::vector<kv_store::DType> dtypes;  // [entries] each entry's sequence's row dtype
    std::vector<std::vector<uint32_t>> indices;
    std::vector<std::pair<size_t, std::vector<size_t>>> slots;  // (work, selected slots)
    std::vector<uint8_t> out;
    std::unique_ptr<kv_store::KvStoreOp> op;
  };
  absl::flat_hash_map<kv_store::KvStoreClient*, StoreBatch> stores;
  int64_t hits = 0, misses = 0;
  absl::flat_hash_map<std::string_view, RetrievalReport> by_method;  // for the observer
  for (size_t wi = 0; wi < work_.size(); ++wi) {
    HeadWork& w = work_[wi];
    const AttentionRequest& r = batch[w.request];
    Sequence& seq = sequences_.at(r.sequence);
    std::vector<uint32_t> miss_positions;
    std::vector<size_t> miss_slots;
    for (size_t j = 0; j < w.positions.size(); ++j) {
      const RowKey key{r.sequence, static_cast<uint32_t>(r.layer), static_cast<uint32_t>(w.head),
                       w.positions[j]};
      if (const float* cached = hot_cache_.Find(key)) {
        std::memcpy(rows_.data() + w.rows_offset + j * row_floats, cached, row_f32_bytes);
        ++seq.counters.hot_cache_hits;
        ++by_method[seq.setup.method].hot_cache_hits;
        ++hits;
      } else {
        miss_positions.push_back(static_cast<uint32_t>(w.positions[j]));
        miss_slots.push_back(j);
        ++seq.counters.hot_cache_misses;
        ++by_method[seq.setup.method].hot_cache_misses;
        ++misses;
      }
    }
    if (miss_positions.empty()) continue;
    StoreBatch& sb = stores[seq.setup.store];
    sb.indices.push_back(std::move(miss_positions));
    sb.slots.emplace_back(wi, std::move(miss_slots));
    sb.entries.push_back({seq.setup.store_sequence,
                          static_cast<uint32_t>(r.layer),
                          static_cast<uint32_t>(w.head),
                          {}});
    sb.dtypes.push_back(seq.setup.row_dtype);
  }
  node_.retrieval.hot_cache_hits += hits;
  node_.retrieval.hot_cache_misses += misses;
  const auto t0 = std::chrono::steady_clock::now();
  // The reply holds each entry's rows in its sequence's dtype (sequences of one store may
  // differ).
  const auto head_dim = static_cast<uint32_t>(hd);
  auto store_row_bytes = [head_dim](kv_store::DType dtype) {
    return static_cast<int64_t>(kv_store::RowBytes(dtype, head_dim));
  };
  for (auto& [store, sb] : stores) {
    size_t bytes = 0;
    for (size_t e = 0; e < sb.entries.size(); ++e) {
      sb.entries[e].indices = sb.indices[e];
      bytes += sb.indices[e].size() * static_cast<size_t>(store_row_bytes(sb.dtypes[e]));
    }
    sb.out.resize(bytes);
    sb.op = store->StartGather(sb.entries, sb.out);
    ++node_.gathers;
  }
  absl::Status failed;
  for (auto& [store, sb] : stores) {
    absl::StatusOr<uint64_t> got = sb.op->Wait();
    if (!got.ok() && failed.ok()) {
      size_t n_rows = 0;
      for (const std::vector<uint32_t>& ids : sb.indices) n_rows += ids.size();
      failed = absl::Status(
          got.status().code(),
          absl::StrCat("gather of ", n_rows, " rows from the KV store: ", got.status().message()));
    }
  }
  KVR_RETURN_IF_ERROR(failed);
  for (auto& [store, sb] : stores) {
    const uint8_t* src = sb.out.data();
    int64_t n_rows = 0;
    for (size_t e = 0; e < sb.slots.size(); ++e) {
      HeadWork& w = work_[sb.slots[e].first];
      const AttentionRequest& r = batch[w.request];
      Sequence& seq = sequences_.at(r.sequence);
      const kv_store::DType dtype = sb.dtypes[e];
      const int64_t row_bytes = store_row_bytes(dtype);
      for (size_t j : sb.slots[e].second) {
        float* dst = rows_.data() + w.rows_offset + j * row_floats;
        kv_store::StoredRowToFloats(dtype, head_dim, src, dst);
        hot_cache_.Insert({r.sequence, static_cast<uint32_t>(r.layer),
                           static_cast<uint32_t>(w.head), w.positions[j]},
                          dst, row_floats);
        src += row_bytes;
        ++n_rows;
        ++seq.counters.rows_fetched;
        seq.counters.bytes_fetched += row_bytes;
        ++node_.retrieval.rows_fetched;
        node_.retrieval.bytes_fetched += row_bytes;
        RetrievalReport& m = by_method[seq.setup.method];
        ++m.rows_fetched;
        m.bytes_fetched += row_bytes;
      }
    }
    if (observer_ != nullptr) {
      observer_->OnFetch(
          {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), n_rows,
           static_cast<int64_t>(sb.out.size())});
    }
  }

  if (observer_ != nullptr) {
    observer_->OnHotCache(hits, misses);
    for (const auto& [method, report] : by_method) observer_->OnRetrieval(method, report);
  }

  // One softmax per query head over sinks, selected rows and the local window, in position
  // order (the selected positions lie between the sinks and the window and are ascending).
  const int group = shape.n_heads / shape.n_kv_heads;
  const model::CpuKernels& kernels = model::BestCpuKernels();
  auto attend = [&](size_t begin, size_t end) {
    std::vector<float> state(static_cast<size_t>(group) * (hd + 2));
    float* m = state.data();
    float* l = m + group;
    float* acc = l + group;
    for (size_t wi = begin; wi < end; ++wi) {
      const HeadWork& w = work_[wi];
      const AttentionRequest& r = batch[w.request];
      std::fill_n(m, group, -std::numeric_limits<float>::infinity());
      std::fill(l, state.data() + state.size(), 0.f);
      const int64_t offset = int64_t{w.head} * group * hd;
      const float* q = r.q + offset;
      kernels.attend_rows(q, group, hd, shape.scale,
                          model::KvRowsForHead(r.kv, w.head, hd, 0, w.sink_rows), m, l, acc);
      const float* fetched = rows_.data() + w.rows_offset;
      kernels.attend_rows(q, group, hd, shape.scale,
                          {fetched, fetched + hd, static_cast<int64_t>(w.positions.size()),
                           row_floats, false},
                          m, l, acc);
      kernels.attend_rows(
          q, group, hd, shape.scale,
          model::KvRowsForHead(r.kv, w.head, hd, w.sink_rows, r.kv.n_rows - w.sink_rows), m, l,
          acc);
      model::FinishAttention(group, hd, l, acc, r.out + offset);
    }
  };
  if (pool_ != nullptr) {
    pool_->ParallelFor(work_.size(), attend);
  } else {
    attend(0, work_.size());
  }
  if (options_.quality_sample_rate > 0) SampleQuality(shape, batch);
  return absl::OkStatus();
}

void DecodeAttention::SampleQuality(const AttentionShape& shape,
                                    std::span<const AttentionRequest> batch) {
  const int hd = shape.head_dim;
  const int n_kv = shape.n_kv_heads;
  const int group = shape.n_heads / n_kv;
  const int64_t row_floats = 2 * int64_t{hd};
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!quality_coin_(quality_rng_)) continue;
    const AttentionRequest& r = batch[i];
    const DecodeSequenceSetup& setup = sequences_.at(r.sequence).setup;
    const int64_t p = r.first_position;
    const int64_t n_sink = std::min(setup.n_sink, p + 1);
    const int64_t local_begin = std::max(n_sink, p + 1 - setup.local_window);
    const int64_t nc = local_begin - n_sink;  // candidates [n_sink, local_begin)
    // Only steps that chose are measured: with at most `budget` candidates every one is
    // selected, and `full` (or a null index) attends them all, so recall and mass would read 1
    // by definition. Such steps read nothing and record no recall; both kinds are counted
    // (OnQualitySampled) so that a dashboard tells "perfect" from "nothing to select".
    const bool selecting =
        nc > setup.budget && setup.method != "full" && setup.indexes[r.layer] != nullptr;
    if (observer_ != nullptr) observer_->OnQualitySampled(setup.method, selecting);
    if (!selecting) {
      ++node_.quality_not_selecting;
      continue;
    }
    ++node_.quality_selecting;
    // The keys of every candidate of every KV head, in one request.
    std::vector<kv_store::RangeEntry> ranges;
    for (int kvh = 0; kvh < n_kv; ++kvh) {
      ranges.push_back({setup.store_sequence, static_cast<uint32_t>(r.layer),
                        static_cast<uint32_t>(kvh), static_cast<uint64_t>(n_sink),
                        static_cast<uint64_t>(nc)});
    }
    // f32 rows are read in place; bf16 and fp8 rows into a byte buffer, then widened.
    const bool widen = setup.row_dtype != kv_store::DType::kF32;
    const size_t stored_row_bytes = kv_store::RowBytes(setup.row_dtype, static_cast<uint32_t>(hd));
    quality_rows_.resize(static_cast<size_t>(n_kv * nc * row_floats));
    std::span<uint8_t> out(reinterpret_cast<uint8_t*>(quality_rows_.data()),
                           quality_rows_.size() * sizeof(float));
    if (widen) {
      quality_stored_.resize(static_cast<size_t>(n_kv * nc) * stored_row_bytes);
      out = std::span(quality_stored_);
    }
    if (absl::Status s = setup.store->RangeRead(ranges, out); !s.ok()) {
      ++node_.quality_failures;
      spdlog::warn("quality sample of sequence {} layer {} dropped: range read of {} rows: {}",
                   r.sequence, r.layer, n_kv * nc, s.ToString());
      continue;
    }
    for (int64_t i = 0; widen && i < n_kv * nc; ++i) {
      kv_store::StoredRowToFloats(setup.row_dtype, static_cast<uint32_t>(hd),
                                  out.data() + i * stored_row_bytes,
                                  quality_rows_.data() + i * row_floats);
    }
    node_.quality_rows_fetched += n_kv * nc;
    node_.quality_bytes_fetched += static_cast<int64_t>(out.size());

    double hits = 0, truth_total = 0, mass_sum = 0;
    quality_probs_.resize(static_cast<size_t>(nc));
    for (int kvh = 0; kvh < n_kv; ++kvh) {
      // Selected positions of this (request, KV head): Prepare pushed n_kv_heads HeadWork per
      // request, in order.
      const std::vector<int64_t>& picked = work_[i * n_kv + kvh].positions;
      const float* cand = quality_rows_.data() + kvh * nc * row_floats;  // [nc, 2 * hd], keys
      quality_agg_.assign(static_cast<size_t>(nc), 0.f);
      for (int g = 0; g < group; ++g) {
        const float* q = r.q + static_cast<int64_t>(kvh * group + g) * hd;
        // One softmax over [0, p]: the resident rows (sink ∪ local) and the candidates.
        float m = -std::numeric_limits<float>::infinity();
        std::vector<float>& res = scores_;
        res.resize(static_cast<size_t>(r.kv.n_rows));
        for (int64_t t = 0; t < r.kv.n_rows; ++t) {
          res[t] = shape.scale * retrieval::Dot(q, r.kv.k + t * r.kv.row_stride + kvh * hd, hd);
          m = std::max(m, res[t]);
        }
        for (int64_t c = 0; c < nc; ++c) {
          quality_probs_[c] = shape.scale * retrieval::Dot(q, cand + c * row_floats, hd);
          m = std::max(m, quality_probs_[c]);
        }
        double z = 0, resident = 0, candidates = 0;
        for (int64_t t = 0; t < r.kv.n_rows; ++t) resident += std::exp(double{res[t]} - m);
        for (int64_t c = 0; c < nc; ++c) {
          quality_probs_[c] = static_cast<float>(std::exp(double{quality_probs_[c]} - m));
          candidates += quality_probs_[c];
        }
        z = resident + candidates;
        double mass = resident;
        for (int64_t id : picked) mass += quality_probs_[id - n_sink];
        mass_sum += std::min(1.0, mass / z);
        // The oracle ranks by the group's probabilities, each renormalised over the candidates.
        const float inv = candidates > 0 ? static_cast<float>(1.0 / candidates) : 0.f;
        for (int64_t c = 0; c < nc; ++c) quality_agg_[c] += quality_probs_[c] * inv;
      }
      quality_truth_.assign(static_cast<size_t>(nc), 0);
      const std::vector<int64_t> top = retrieval::TopKIndices(quality_agg_, setup.budget);
      for (int64_t c : top) quality_truth_[c] = 1;
      for (int64_t id : picked) hits += quality_truth_[id - n_sink];
      truth_total += static_cast<double>(top.size());
    }
    const double recall = truth_total > 0 ? hits / truth_total : 1.0;
    const double mass = mass_sum / shape.n_heads;
    ++node_.quality_samples;
    if (observer_ != nullptr) observer_->OnQuality(setup.method, recall, mass);
  }
}

void DecodeAttention::StartOffload() {
  FinishOffload().IgnoreError();  // callers that care call FinishOffload first
  const int64_t row = int64_t{options_.n_kv_heads} * options_.head_dim;
  int64_t bytes = 0;
  for (auto& [id, seq] : sequences_) {
    const kv_store::DType dtype = seq.setup.row_dtype;
    // As written: bf16 also for an fp8 sequence, which the store encodes.
    const size_t row_bytes = static_cast<size_t>(row) * kv_store::WriteElementBytes(dtype);
    for (int layer = 0; layer < options_.n_layers; ++layer) {
      if (!seq.has_new_rows[layer]) continue;
      seq.has_new_rows[layer] = false;
      PendingPut& put = pending_.emplace_back();
      put.sequence = id;
      put.k.resize(row_bytes);
      put.v.resize(row_bytes);
      const float* k = seq.new_k.data() + layer * row;
      const float* v = seq.new_v.data() + layer * row;
      if (dtype != kv_store::DType::kF32) {
        FloatsToBf16Bytes(k, static_cast<size_t>(row), put.k.data());
        FloatsToBf16Bytes(v, static_cast<size_t>(row), put.v.data());
      } else {
        std::memcpy(put.k.data(), k, row_bytes);
        std::memcpy(put.v.data(), v, row_bytes);
      }
      kv_store::LayerRows rows;
      rows.sequence = seq.setup.store_sequence;
      rows.layer = static_cast<uint32_t>(layer);
      rows.start_row = kv_store::LayerRows::kAtEnd;
      rows.n_rows = 1;
      rows.k = put.k;
      rows.v = put.v;
      put.op = seq.setup.store->StartPutLayer(rows);
      seq.counters.rows_offloaded += options_.n_kv_heads;
      node_.retrieval.rows_offloaded += options_.n_kv_heads;
      bytes += static_cast<int64_t>(put.k.size() + put.v.size());
    }
  }
  if (observer_ != nullptr && bytes > 0) observer_->OnOffload(bytes);
}

absl::Status DecodeAttention::FinishOffload() {
  absl::Status first;
  for (PendingPut& put : pending_) {
    absl::StatusOr<uint64_t> done = put.op->Wait();
    if (!done.ok()) {
      offload_failures_[put.sequence] = done.status();
      if (first.ok()) {
        first =
            absl::Status(done.status().code(),
                         absl::StrCat("append of sequence ", put.sequence,
                                      "'s new rows to the KV store: ", done.status().message()));
      }
    }
  }
  pending_.clear();
  return first;
}

absl::flat_hash_map<model::SequenceId, absl::Status> DecodeAttention::TakeOffloadFailures() {
  return std::exchange(offload_failures_, {});
}

void DecodeAttention::Release(model::SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  const std::string method = it->second.setup.method;
  sequences_.erase(it);
  hot_cache_.DropSequence(id);
  ReportSummaryBytes(method);
}

void DecodeAttention::ReportSummaryBytes(const std::string& method) {
  if (observer_ == nullptr) return;
  int64_t bytes = 0;
  for (const auto& [id, seq] : sequences_) {
    if (seq.setup.method == method) bytes += SummaryBytes(id);
  }
  observer_->OnMethodSummaryBytes(method, bytes);
  observer_->OnSummaryBytes(TotalSummaryBytes());
}

RetrievalCounters DecodeAttention::counters(model::SequenceId id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? RetrievalCounters{} : it->second.counters;
}

int64_t DecodeAttention::SummaryBytes(model::SequenceId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return 0;
  int64_t bytes = 0;
  for (const auto& index : it->second.setup.indexes) {
    if (index) bytes += index->MemoryBytes();
  }
  return bytes;
}

int64_t DecodeAttention::TotalSummaryBytes() const {
  int64_t bytes = 0;
  for (const auto& [id, seq] : sequences_) bytes += SummaryBytes(id);
  return bytes;
}

}  // namespace kvr::decode
