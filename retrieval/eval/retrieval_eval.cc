#include "retrieval_eval.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "hot_cache_sim.h"
#include "kvr/common/status.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/all_methods.h"
#include "kvr/retrieval/model_shape.h"
#include "kvr/retrieval/ops.h"
#include "kvr/retrieval/sparse_attention.h"
#include "selection_trace.h"
#include "thinned_prefix.h"
#ifdef KVR_RETRIEVAL_HAVE_QUANT
#include "kvr/retrieval/codebook.h"
#endif

namespace kvr::retrieval::eval {
namespace {

using kvr::model::AttentionRequest;
using kvr::model::AttentionShape;
using kvr::model::KvCache;
using kvr::model::SequenceId;
using Clock = std::chrono::steady_clock;

// Default natural text: license texts every Debian system ships (plain text; /usr/share/info is
// gzip-compressed, pass such files decompressed through --text-file).
const char* const kDefaultTexts[] = {
    "/usr/share/common-licenses/GPL-3",    "/usr/share/common-licenses/GFDL-1.3",
    "/usr/share/common-licenses/LGPL-3",   "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/GPL-2",    "/usr/share/common-licenses/MPL-2.0",
    "/usr/share/common-licenses/LGPL-2.1", "/usr/share/common-licenses/Artistic",
};

absl::StatusOr<std::string> ReadText(const std::vector<std::string>& files) {
  std::string text;
  std::vector<std::string> paths = files;
  if (paths.empty()) paths.assign(std::begin(kDefaultTexts), std::end(kDefaultTexts));
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      if (files.empty()) continue;  // a default text this system lacks
      return absl::NotFoundError(absl::StrCat("cannot read text file ", path));
    }
    std::stringstream ss;
    ss << in.rdbuf();
    absl::StrAppend(&text, ss.str(), "\n\n");
  }
  if (text.empty()) return absl::NotFoundError("no text to evaluate on (pass --text-file)");
  return text;
}

// A passkey prompt of about `context` tokens: filler sentences with the key at a random depth,
// ending with the question; the continuation is the key.
struct PasskeyPrompt {
  std::string prompt;
  std::string answer;
};
PasskeyPrompt MakePasskey(uint64_t seed, int64_t filler_sentences, double depth) {
  std::mt19937_64 rng(seed);
  const int key = 10000 + static_cast<int>(rng() % 90000);
  const std::string filler =
      "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
      "again. ";
  std::string text =
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
      "it. I will quiz you about the important information there.\n";
  const int64_t at = static_cast<int64_t>(depth * static_cast<double>(filler_sentences));
  for (int64_t i = 0; i < filler_sentences; ++i) {
    if (i == at)
      absl::StrAppend(&text, "The pass key is ", key, ". Remember it. ", key,
                      " is the pass key.\n");
    text += filler;
  }
  absl::StrAppend(&text, "\nWhat is the pass key? The pass key is");
  return {text, absl::StrCat(" ", key)};
}

struct Accum : HeadQuality {
  double recall_hit = 0, recall_total = 0;
};

// Wraps SparseAttention for the evaluated sequences: after each decode call it recomputes dense
// attention over the same KV and the oracle's selection, and accumulates the metrics.
class MeasuringAttention final : public kvr::model::Attention {
 public:
  struct Entry {
    SparseAttention* sparse = nullptr;
    Accum* accum = nullptr;
    int64_t budget = 0;
    HotCacheSim* hot = nullptr;  // replays the selections of decode calls when set
    SelectionTrace* trace = nullptr;  // records the selections of decode calls when set
  };
  // measure = false: only dispatches to each sequence's SparseAttention (free decoding).
  MeasuringAttention(std::map<SequenceId, Entry> entries, int64_t n_sink, int64_t local_window,
                     bool measure = true)
      : entries_(std::move(entries)),
        n_sink_(n_sink),
        local_window_(local_window),
        measure_(measure) {}

  absl::Status Attend(const AttentionShape& shape,
                      std::span<const AttentionRequest> batch) override {
    for (const AttentionRequest& r : batch) {
      auto it = entries_.find(r.sequence);
      if (it == entries_.end()) {
        return absl::InternalError(absl::StrCat("eval: unknown sequence ", r.sequence));
      }
      KVR_RETURN_IF_ERROR(it->second.sparse->Attend(shape, {&r, 1}));
      if (measure_ && r.n_queries == 1) Measure(shape, r, it->second);
      if (it->second.trace != nullptr && r.n_queries == 1) {
        SelectionTrace& t = *it->second.trace;
        if (r.layer == 0) {
          t.steps.emplace_back();
          t.steps.back().position = r.first_position;
          t.steps.back().heads.resize(static_cast<size_t>(t.n_layers) * t.n_kv_heads);
        }
        const Selection& sel = it->second.sparse->last_selection();
        for (int kvh = 0; kvh < static_cast<int>(sel.per_head.size()) && !t.steps.empty(); ++kvh) {
          std::vector<int32_t>& ids =
              t.steps.back().heads[static_cast<size_t>(r.layer) * t.n_kv_heads + kvh];
          ids.assign(sel.per_head[kvh].begin(), sel.per_head[kvh].end());
          std::sort(ids.begin(), ids.end());
        }
      }
      if (it->second.hot != nullptr && r.n_queries == 1) {
        const Selection& sel = it->second.sparse->last_selection();
        for (int kvh = 0; kvh < static_cast<int>(sel.per_head.size()); ++kvh) {
          it->second.hot->Step(r.layer, kvh, sel.per_head[kvh]);
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  void Measure(const AttentionShape& shape, const AttentionRequest& r, const Entry& e) {
    const int hd = shape.head_dim;
    const int group = shape.n_heads / shape.n_kv_heads;
    const int64_t p = r.first_position;
    const int64_t n = p + 1;
    const int64_t n_sink = std::min(n_sink_, n);
    const int64_t local_begin = std::max(n_sink, n - local_window_);
    const Selection& sel = e.sparse->last_selection();
    probs_.resize(static_cast<size_t>(shape.n_heads) * n);
    for (int h = 0; h < shape.n_heads; ++h) {
      const std::span<float> pr(probs_.data() + static_cast<int64_t>(h) * n,
                                static_cast<size_t>(n));
      HeadLogits(shape, r, h, pr);
      SoftmaxInPlace(pr);
    }
    for (int kvh = 0; kvh < shape.n_kv_heads; ++kvh) {
      const std::vector<int64_t>& picked = sel.per_head[kvh];
      // Oracle: top-budget candidates by the group's summed probability, each head's softmax
      // taken over the candidates (IndexParams::gqa's default; what `exact` selects).
      const int64_t nc = std::max<int64_t>(0, local_begin - n_sink);
      if (nc > 0) {
        agg_.assign(nc, 0.f);
        for (int g = 0; g < group; ++g) {
          const float* pr = probs_.data() + static_cast<int64_t>(kvh * group + g) * n;
          double z = 0;
          for (int64_t i = 0; i < nc; ++i) z += pr[n_sink + i];
          const float inv = z > 0 ? static_cast<float>(1.0 / z) : 0.f;
          for (int64_t i = 0; i < nc; ++i) agg_[i] += pr[n_sink + i] * inv;
        }
        std::vector<int64_t> top = TopKIndices(agg_, e.budget);
        std::set<int64_t> truth;
        for (int64_t i : top) truth.insert(n_sink + i);
        for (int64_t id : picked) e.accum->recall_hit += truth.count(id);
        e.accum->recall_total += static_cast<double>(truth.size());
      }
      for (int g = 0; g < group; ++g) {
        const int h = kvh * group + g;
        const float* pr = probs_.data() + static_cast<int64_t>(h) * n;
        double mass = 0;
        for (int64_t t = 0; t < n_sink; ++t) mass += pr[t];
        for (int64_t t = local_begin; t < n; ++t) mass += pr[t];
        for (int64_t id : picked) mass += pr[id];
        // Dense output from the probabilities; the sparse output is what SparseAttention wrote.
        dense_.resize(hd);
        WeightedValues(r, kvh, hd, {pr, static_cast<size_t>(n)}, dense_.data());
        e.accum->Add(mass, r.out + static_cast<int64_t>(h) * hd, dense_);
      }
    }
  }

  std::map<SequenceId, Entry> entries_;
  int64_t n_sink_, local_window_;
  bool measure_;
  std::vector<float> probs_, agg_, dense_;
};

// Forwards to the runtime's dense attention and keeps the last prefill queries of every layer,
// which are handed to each SparseAttention (CTKVR builds from them).
class RecordingDense final : public kvr::model::Attention {
 public:
  RecordingDense(ThreadPool* pool, int n_layers, int64_t keep)
      : dense_(pool), keep_(keep), queries_(n_layers), ends_(n_layers, 0) {}
  absl::Status Attend(const AttentionShape& shape,
                      std::span<const AttentionRequest> batch) override {
    for (const AttentionRequest& r : batch) {
      if (r.n_queries > 1 && r.layer < static_cast<int>(queries_.size())) {
        const int64_t row = static_cast<int64_t>(shape.n_heads) * shape.head_dim;
        row_ = row;
        auto& buf = queries_[r.layer];
        const int64_t take = std::min(r.n_queries, keep_);
        buf.insert(buf.end(), r.q + (r.n_queries - take) * row, r.q + r.n_queries * row);
        const int64_t have = static_cast<int64_t>(buf.size()) / row;
        if (have > keep_) buf.erase(buf.begin(), buf.begin() + (have - keep_) * row);
        ends_[r.layer] = r.first_position + r.n_queries;
      }
    }
    return dense_.Attend(shape, batch);
  }
  void HandTo(SparseAttention& sparse, SequenceId id, const AttentionShape& shape) const {
    for (size_t l = 0; l < queries_.size(); ++l) {
      if (queries_[l].empty()) continue;
      sparse.RememberPrefillQueries(id, static_cast<int>(l), shape.n_heads, shape.head_dim,
                                    queries_[l].data(),
                                    static_cast<int64_t>(queries_[l].size()) / row_, ends_[l]);
    }
  }

 private:
  kvr::model::DenseAttention dense_;
  int64_t keep_;
  int64_t row_ = 1;
  std::vector<std::vector<float>> queries_;
  std::vector<int64_t> ends_;
};

absl::StatusOr<KvCache> CopyCache(const kvr::model::Model& model, const KvCache& src,
                                  int64_t reserve) {
  KvCache dst = model.NewCache(kvr::model::KvDType::kF32);
  dst.Reserve(reserve);
  for (int l = 0; l < src.n_layers(); ++l) {
    const kvr::model::KvView v = src.View(l);
    KVR_RETURN_IF_ERROR(dst.Append(l, v.n_rows, v.k, v.v, v.row_stride));
  }
  return dst;
}

double Nll(std::span<const float> logits, int32_t target) {
  float m = -std::numeric_limits<float>::infinity();
  for (float x : logits) m = std::max(m, x);
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x - m));
  return std::log(sum) + m - logits[target];
}

int32_t Argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// One --method entry: a registered name, plus options for that entry only ("name:opt=v,...").
struct MethodVariant {
  std::string name;
  std::map<std::string, std::string, std::less<>> options;
};

absl::StatusOr<MethodVariant> ParseMethodVariant(const std::string& spec) {
  MethodVariant v;
  const size_t colon = spec.find(':');
  v.name = spec.substr(0, colon);
  if (colon == std::string::npos) return v;
  for (absl::string_view kv : absl::StrSplit(spec.substr(colon + 1), ',', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("method '", spec, "': expected name:option=value[,option=value]"));
    }
    v.options[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
  }
  return v;
}

struct PromptCase {
  std::string name;
  std::vector<int32_t> prompt;        // prefill tokens
  std::vector<int32_t> continuation;  // teacher-forced tokens (first predicted by the prefill)
};

// What a batch of runs decoded teacher-forced: every run fed pc.continuation, one step a batch.
struct TeacherForced {
  std::vector<double> nll;                   // [run] summed over the steps
  std::vector<int64_t> agree;                // [run] steps whose argmax is the dense reference's
  std::vector<int64_t> passkey_tokens_ok;    // [run] steps whose argmax is the continuation's
  std::vector<std::vector<int32_t>> argmax;  // [run][step]
};

// Decodes pc.continuation teacher-forced on every cache of `caches` (sequence id = run + 1) in
// one batch per step through `attention`, scoring each run against the dense `ref_argmax`.
absl::StatusOr<TeacherForced> DecodeTeacherForced(const kvr::model::Model& model,
                                                  kvr::model::Attention& attention,
                                                  std::vector<KvCache>& caches,
                                                  const PromptCase& pc,
                                                  const std::vector<int32_t>& ref_argmax) {
  const int vocab = model.config().vocab;
  const size_t nr = caches.size();
  const int64_t steps = static_cast<int64_t>(pc.continuation.size()) - 1;
  TeacherForced out{std::vector<double>(nr, 0.0), std::vector<int64_t>(nr, 0),
                    std::vector<int64_t>(nr, 0), std::vector<std::vector<int32_t>>(nr)};
  std::vector<float> logits(nr * vocab);
  for (int64_t t = 1; t <= steps; ++t) {
    const int32_t token = pc.continuation[t - 1];
    std::vector<kvr::model::ForwardSequence> batch;
    for (size_t run = 0; run < nr; ++run) batch.push_back({run + 1, &caches[run], {&token, 1}});
    KVR_RETURN_IF_ERROR(model.Forward(batch, attention, kvr::model::LogitsMode::kLast, logits));
    for (size_t run = 0; run < nr; ++run) {
      std::span<const float> lg(logits.data() + run * vocab, vocab);
      out.nll[run] += Nll(lg, pc.continuation[t]);
      const int32_t am = Argmax(lg);
      out.agree[run] += am == ref_argmax[t - 1];
      out.argmax[run].push_back(am);
      out.passkey_tokens_ok[run] += am == pc.continuation[t];
    }
  }
  return out;
}

// What a batch of runs decoded freely (greedy), from the prefill's token ref_free[0].
struct FreeDecoded {
  std::vector<int64_t> equal;                // [run] positions equal to the dense greedy tokens
  std::vector<int64_t> prefix;               // [run] equal positions before the first difference
  std::vector<std::vector<int32_t>> tokens;  // [run][position]
};

// Greedy decoding of ref_free.size() tokens on every cache of `caches` (sequence id = run + 1)
// in one batch per step, each run compared position by position with the dense `ref_free`.
absl::StatusOr<FreeDecoded> DecodeFree(const kvr::model::Model& model,
                                       kvr::model::Attention& attention,
                                       std::vector<KvCache>& caches,
                                       const std::vector<int32_t>& ref_free) {
  const int vocab = model.config().vocab;
  const size_t nr = caches.size();
  const auto n_free = static_cast<int64_t>(ref_free.size());
  // The prefill's token is common to all runs.
  FreeDecoded out{std::vector<int64_t>(nr, 1), std::vector<int64_t>(nr, 1),
                  std::vector<std::vector<int32_t>>(nr, std::vector<int32_t>{ref_free[0]})};
  std::vector<float> logits(nr * vocab);
  std::vector<int32_t> last(nr, ref_free[0]);
  std::vector<bool> diverged(nr, false);
  for (int64_t i = 1; i < n_free; ++i) {
    std::vector<kvr::model::ForwardSequence> batch;
    for (size_t run = 0; run < nr; ++run) batch.push_back({run + 1, &caches[run], {&last[run], 1}});
    KVR_RETURN_IF_ERROR(model.Forward(batch, attention, kvr::model::LogitsMode::kLast, logits));
    for (size_t run = 0; run < nr; ++run) {
      last[run] = Argmax({logits.data() + run * vocab, static_cast<size_t>(vocab)});
      out.tokens[run].push_back(last[run]);
      const bool same = last[run] == ref_free[i];
      out.equal[run] += same;
      if (!same) diverged[run] = true;
      if (!diverged[run]) ++out.prefix[run];
    }
  }
  return out;
}

// The decode metrics that method and thinned-prefix rows share, of run `run`; `fd` is null
// when no free decoding ran (n_free == 0).
void FillDecodeMetrics(const PromptCase& pc, const std::vector<double>& ref_nll,
                       const TeacherForced& tf, const FreeDecoded* fd, int64_t n_free, size_t run,
                       EvalRow& row) {
  const int64_t steps = static_cast<int64_t>(pc.continuation.size()) - 1;
  double ref_total = 0;
  for (double x : ref_nll) ref_total += x;
  row.steps = steps;
  row.nll = tf.nll[run] / static_cast<double>(steps);
  row.nll_delta = (tf.nll[run] - ref_total) / static_cast<double>(steps);
  row.agreement = static_cast<double>(tf.agree[run]) / static_cast<double>(steps);
  if (pc.name == "passkey") row.passkey_ok = tf.passkey_tokens_ok[run] == steps ? 1 : 0;
  row.free_tokens = n_free;
  if (fd != nullptr) {
    row.free_agreement = static_cast<double>(fd->equal[run]) / static_cast<double>(n_free);
    row.free_prefix = fd->prefix[run];
  }
}

// Thinned-prefix rows of one prompt (EvalOptions::thin_keep): one run per (kept fraction,
// order), batched as the methods' runs are, each on its own copy of the dense prefill's cache;
// the same teacher-forced and free continuations as the methods', compared with the same dense
// references.
absl::Status RunThinned(const EvalOptions& options, const kvr::model::Model& model,
                        const KvCache& prefilled, const PromptCase& pc, int64_t total,
                        const std::vector<double>& ref_nll, const std::vector<int32_t>& ref_argmax,
                        const std::vector<int32_t>& ref_free, std::vector<EvalRow>& rows) {
  const kvr::model::ModelConfig& cfg = model.config();
  const auto n_prompt = static_cast<int64_t>(pc.prompt.size());
  const int64_t n_free = options.free_tokens;
  struct Run {
    double keep;
    ThinOrder order;
    ThinMask mask;
  };
  std::vector<Run> runs;
  for (double keep : options.thin_keep) {
    for (ThinOrder order : {ThinOrder::kKeyDiff, ThinOrder::kRandom}) {
      if (order == ThinOrder::kRandom && !options.thin_random) continue;
      // The store's sinks and recent rows (KeyDiffPagePolicy's defaults, as StoreOptions').
      runs.push_back({keep, order,
                      MakeThinMask(prefilled, cfg.n_kv_heads, cfg.head_dim, n_prompt,
                                   static_cast<uint64_t>(options.thin_page_rows), keep,
                                   KeyDiffPagePolicy{}, order, options.seed + runs.size())});
    }
  }
  const size_t nr = runs.size();
  // Teacher-forced.
  std::vector<KvCache> caches;
  std::vector<MaskedAttention::Accum> accums(nr);
  std::map<SequenceId, MaskedAttention::Entry> entries;
  for (size_t run = 0; run < nr; ++run) {
    KVR_ASSIGN_OR_RETURN(KvCache c, CopyCache(model, prefilled, total));
    caches.push_back(std::move(c));
    entries[run + 1] = {&runs[run].mask, &accums[run]};
  }
  MaskedAttention attention(std::move(entries));
  KVR_ASSIGN_OR_RETURN(TeacherForced tf,
                       DecodeTeacherForced(model, attention, caches, pc, ref_argmax));
  // Free greedy decoding from the same thinned prefill.
  std::optional<FreeDecoded> free_decoded;
  if (n_free > 0) {
    std::vector<KvCache> fcaches;
    std::map<SequenceId, MaskedAttention::Entry> fentries;
    for (size_t run = 0; run < nr; ++run) {
      KVR_ASSIGN_OR_RETURN(KvCache c, CopyCache(model, prefilled, total));
      fcaches.push_back(std::move(c));
      fentries[run + 1] = {&runs[run].mask, nullptr};
    }
    MaskedAttention fattention(std::move(fentries));
    KVR_ASSIGN_OR_RETURN(free_decoded, DecodeFree(model, fattention, fcaches, ref_free));
  }
  for (size_t run = 0; run < nr; ++run) {
    EvalRow row;
    row.prompt = pc.name;
    row.context = n_prompt;
    row.method = runs[run].order == ThinOrder::kKeyDiff ? "thin-kd" : "thin-rnd";
    row.kept_fraction = runs[run].mask.kept_fraction;
    row.intact_rows = runs[run].mask.intact_rows;
    row.budget =
        static_cast<int64_t>(std::llround(row.kept_fraction * static_cast<double>(n_prompt)));
    row.recall = -1;
    const MaskedAttention::Accum& a = accums[run];
    row.mass = a.head_samples > 0 ? a.mass / static_cast<double>(a.head_samples) : 0;
    row.rel_error = a.head_samples > 0 ? a.rel_error / static_cast<double>(a.head_samples) : 0;
    row.kv_bytes_per_token_head = 4.0 * cfg.head_dim;
    FillDecodeMetrics(pc, ref_nll, tf, free_decoded ? &*free_decoded : nullptr, n_free, run, row);
    rows.push_back(row);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<EvalRow>> RunRetrievalEval(const EvalOptions& options,
                                                      const kvr::model::LoadedModel& loaded,
                                                      ThreadPool* pool, const Progress& progress) {
  if (!loaded.tokenizer) return absl::InvalidArgumentError("eval retrieval needs a tokenizer");
  if (options.steps < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  if (options.free_tokens < 0) return absl::InvalidArgumentError("--free-tokens must be >= 0");
  for (int64_t b : options.budgets) {
    if (b <= 0) return absl::InvalidArgumentError(absl::StrCat("budget must be > 0, got ", b));
  }
  if (options.row_formats.empty()) {
    return absl::InvalidArgumentError("--row-format: name at least one of cache, bf16, fp8");
  }
  for (double keep : options.thin_keep) {
    if (!(keep >= 0 && keep <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat("--thin-keep must be in [0, 1], got ", keep));
    }
  }
  if (!options.thin_keep.empty() && options.thin_page_rows < 1) {
    return absl::InvalidArgumentError("--thin-page-rows must be >= 1");
  }
  std::vector<FetchedRowFormat> formats;
  for (const std::string& name : options.row_formats) {
    absl::StatusOr<FetchedRowFormat> f = ParseFetchedRowFormat(name);
    if (!f.ok())
      return absl::InvalidArgumentError(absl::StrCat("--row-format: ", f.status().message()));
    formats.push_back(*f);
  }
  const kvr::model::Model& model = *loaded.model;
  const kvr::model::ModelConfig& cfg = model.config();
  KVR_ASSIGN_OR_RETURN(MethodRegistry registry, AllMethods());
  std::vector<std::string> methods = options.methods;
  if (methods.empty()) methods = registry.Names();
  // "name" or "name:opt=v,opt=v" (a variant: the options apply to that row only; the label is
  // the whole spec), so that ablations share one dense prefill.
  std::map<std::string, MethodVariant> variants;
  for (const std::string& m : methods) {
    KVR_ASSIGN_OR_RETURN(MethodVariant v, ParseMethodVariant(m));
    if (!registry.Has(v.name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown method '", v.name, "'; valid: ",
                                                     absl::StrJoin(registry.Names(), ", ")));
    }
    variants[m] = std::move(v);
  }
  IndexParams base;
  base.n_sink = options.n_sink;
  base.local_window = options.local_window;
  base.options = options.method_options;
  base.pool = nullptr;
  RopeParams rope = RuntimeRope(cfg);
  std::shared_ptr<const MethodAssets> a2ats_assets;
#ifdef KVR_RETRIEVAL_HAVE_QUANT
  if (!options.a2ats_codebooks.empty()) {
    KVR_ASSIGN_OR_RETURN(ModelFingerprint fp, FingerprintOf(model));
    KVR_ASSIGN_OR_RETURN(a2ats_assets, A2atsCodebooks::Load(options.a2ats_codebooks, &fp));
    KVR_ASSIGN_OR_RETURN(rope, RopeParamsOf(cfg));
  }
#endif
  if (a2ats_assets == nullptr) {
    const auto it = std::remove_if(methods.begin(), methods.end(), [&](const std::string& m) {
      return variants[m].name == "a2ats";
    });
    if (it != methods.end()) {
      methods.erase(it, methods.end());
      if (progress)
        progress("skipping a2ats: no --a2ats-codebooks file (make one with kvr calibrate)");
    }
  }
  const AttentionShape shape{cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             1.f / std::sqrt(static_cast<float>(cfg.head_dim))};

  KVR_ASSIGN_OR_RETURN(std::string text, ReadText(options.text_files));
  KVR_ASSIGN_OR_RETURN(std::vector<int32_t> text_ids, loaded.tokenizer->Encode(text));

  // Fail before any prefill (minutes at 8K) when a run cannot fit the model's positions.
  for (int64_t context : options.contexts) {
    if (context < 1) return absl::InvalidArgumentError(absl::StrCat("--context must be >= 1"));
    const int64_t decode = std::max(options.steps, options.free_tokens);
    if (cfg.context_length > 0 && context + decode + 1 > cfg.context_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--context ", context, " + max(--steps, --free-tokens) ", decode, " + 1 exceeds the "
          "model's ", cfg.context_length, "-token context; use --context <= ",
          cfg.context_length - decode - 1));
    }
  }
  std::vector<EvalRow> rows;
  for (int64_t context : options.contexts) {
    std::vector<PromptCase> cases;
    if (static_cast<int64_t>(text_ids.size()) < context + options.steps + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("the text has ", text_ids.size(), " tokens, context ", context, " + ",
                       options.steps, " steps needs more: pass longer --text-file(s)"));
    }
    cases.push_back({"text",
                     {text_ids.begin(), text_ids.begin() + context},
                     {text_ids.begin() + context, text_ids.begin() + context + options.steps + 1}});
    if (options.passkey) {
      // Size the filler so that the prompt is close to `context` tokens.
      PasskeyPrompt probe = MakePasskey(options.seed, 100, 0.5);
      KVR_ASSIGN_OR_RETURN(std::vector<int32_t> probe_ids, loaded.tokenizer->Encode(probe.prompt));
      const double per_sentence = static_cast<double>(probe_ids.size()) / 100.0;
      const int64_t sentences =
          std::max<int64_t>(1, static_cast<int64_t>(context / per_sentence) - 2);
      PasskeyPrompt pk = MakePasskey(options.seed + context, sentences, 0.35);
      KVR_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, loaded.tokenizer->Encode(pk.prompt));
      KVR_ASSIGN_OR_RETURN(std::vector<int32_t> answer,
                           loaded.tokenizer->Encode(pk.answer, {.add_special = false}));
      cases.push_back({"passkey", std::move(prompt), std::move(answer)});
    }
    for (const PromptCase& pc : cases) {
      const int64_t n_prompt = static_cast<int64_t>(pc.prompt.size());
      const int64_t steps = static_cast<int64_t>(pc.continuation.size()) - 1;
      const int64_t n_free = options.free_tokens;
      const int64_t total = n_prompt + std::max(steps, n_free) + 1;
      if (progress) {
        progress(absl::StrCat(pc.name, " context ", n_prompt, ": dense prefill"));
      }
      // Dense prefill, once; its logits predict continuation[0] for every method alike.
      KvCache prefilled = model.NewCache(kvr::model::KvDType::kF32);
      prefilled.Reserve(total);
      RecordingDense recorder(pool, cfg.n_layers, 512);
      const auto t_prefill = Clock::now();
      KVR_ASSIGN_OR_RETURN(std::vector<float> first_logits,
                           model.Prefill(0, prefilled, pc.prompt, recorder, options.prefill_chunk));
      if (progress) {
        progress(absl::StrFormat("prefill %d tokens in %.1f s", n_prompt,
                                 std::chrono::duration<double>(Clock::now() - t_prefill).count()));
      }
      // Dense reference continuation.
      std::vector<double> ref_nll;
      std::vector<int32_t> ref_argmax;
      {
        KVR_ASSIGN_OR_RETURN(KvCache cache, CopyCache(model, prefilled, total));
        kvr::model::DenseAttention dense(pool);
        std::vector<float> logits(cfg.vocab);
        for (int64_t t = 1; t <= steps; ++t) {
          const int32_t token = pc.continuation[t - 1];
          kvr::model::ForwardSequence seq{0, &cache, {&token, 1}};
          KVR_RETURN_IF_ERROR(
              model.Forward({&seq, 1}, dense, kvr::model::LogitsMode::kLast, logits));
          ref_nll.push_back(Nll(logits, pc.continuation[t]));
          ref_argmax.push_back(Argmax(logits));
        }
      }
      // Dense free (greedy) reference: free[0] is the prefill's argmax, each next token the
      // argmax after feeding the previous one.
      std::vector<int32_t> ref_free;
      if (n_free > 0) {
        KVR_ASSIGN_OR_RETURN(KvCache cache, CopyCache(model, prefilled, total));
        kvr::model::DenseAttention dense(pool);
        std::vector<float> logits(cfg.vocab);
        ref_free.push_back(Argmax(first_logits));
        while (static_cast<int64_t>(ref_free.size()) < n_free) {
          const int32_t token = ref_free.back();
          kvr::model::ForwardSequence seq{0, &cache, {&token, 1}};
          KVR_RETURN_IF_ERROR(
              model.Forward({&seq, 1}, dense, kvr::model::LogitsMode::kLast, logits));
          ref_free.push_back(Argmax(logits));
        }
      }
      for (const std::string& method : methods) {
        const auto t_method = Clock::now();
        // One run per (budget, row format): its SparseAttention and its copy of the prefilled
        // cache, sequence id = run index + 1, run = budget index * formats + format index.
        const size_t nf = formats.size();
        const size_t nr = options.budgets.size() * nf;
        auto make_runs =
            [&](std::vector<std::unique_ptr<SparseAttention>>& sparse, std::vector<KvCache>& caches,
                std::vector<Accum>& accums,
                std::map<SequenceId, MeasuringAttention::Entry>& entries) -> absl::Status {
          for (size_t run = 0; run < nr; ++run) {
            const size_t b = run / nf;
            const MethodVariant& variant = variants.at(method);
            SparseAttentionOptions so;
            so.method = variant.name;
            so.params = base;
            for (const auto& [k, v] : variant.options) so.params.options[k] = v;
            so.params.budget = options.budgets[b];
            so.fetched_rows = formats[run % nf];
            if (variant.name == "a2ats") so.params.assets = a2ats_assets;
            so.rope = rope;
            so.n_layers = cfg.n_layers;
            KVR_ASSIGN_OR_RETURN(std::unique_ptr<SparseAttention> sa,
                                 SparseAttention::Create(&registry, so));
            const SequenceId id = run + 1;
            recorder.HandTo(*sa, id, shape);
            entries[id] = {sa.get(), &accums[run], options.budgets[b]};
            sparse.push_back(std::move(sa));
            KVR_ASSIGN_OR_RETURN(KvCache c, CopyCache(model, prefilled, total));
            caches.push_back(std::move(c));
          }
          return absl::OkStatus();
        };
        std::vector<std::unique_ptr<SparseAttention>> sparse;
        std::vector<Accum> accums(nr);
        std::vector<KvCache> caches;
        std::map<SequenceId, MeasuringAttention::Entry> entries;
        KVR_RETURN_IF_ERROR(make_runs(sparse, caches, accums, entries));
        MeasuringAttention attention(std::move(entries), options.n_sink, options.local_window);
        absl::StatusOr<TeacherForced> tf =
            DecodeTeacherForced(model, attention, caches, pc, ref_argmax);
        if (!tf.ok()) {
          return absl::Status(tf.status().code(),
                              absl::StrCat("method ", method, ": ", tf.status().message()));
        }
        // Free greedy decoding with fresh indexes and caches (no measuring: only the tokens).
        std::vector<double> free_hot_hit(nr, 0.0), free_overlap(nr, 0.0);
        std::optional<FreeDecoded> free_decoded;
        if (n_free > 0) {
          std::vector<std::unique_ptr<SparseAttention>> fsparse;
          std::vector<KvCache> fcaches;
          std::vector<Accum> faccums(nr);
          std::map<SequenceId, MeasuringAttention::Entry> fentries;
          KVR_RETURN_IF_ERROR(make_runs(fsparse, fcaches, faccums, fentries));
          std::vector<std::unique_ptr<HotCacheSim>> hot;
          for (auto& [id, e] : fentries) {
            const int64_t rows = options.hot_cache_rows > 0 ? options.hot_cache_rows : e.budget;
            hot.push_back(std::make_unique<HotCacheSim>((rows + 7) / 8 * 8));
            e.hot = hot.back().get();
          }
          std::vector<SelectionTrace> traces;
          if (!options.trace_dir.empty()) {
            traces.resize(fentries.size());
            size_t i = 0;
            for (auto& [id, e] : fentries) {
              SelectionTrace& t = traces[i++];
              t.method = method;
              t.n_layers = cfg.n_layers;
              t.n_kv_heads = cfg.n_kv_heads;
              t.budget = static_cast<int32_t>(e.budget);
              t.n_sink = static_cast<int32_t>(options.n_sink);
              t.local_window = static_cast<int32_t>(options.local_window);
              t.prompt_tokens = n_prompt;
              e.trace = &t;
            }
          }
          MeasuringAttention fattention(std::move(fentries), options.n_sink,
                                        options.local_window, /*measure=*/false);
          absl::StatusOr<FreeDecoded> decoded = DecodeFree(model, fattention, fcaches, ref_free);
          if (!decoded.ok()) {
            return absl::Status(
                decoded.status().code(),
                absl::StrCat("method ", method, " (free): ", decoded.status().message()));
          }
          free_decoded = *std::move(decoded);
          for (size_t run = 0; run < nr; ++run) {
            free_hot_hit[run] = hot[run]->hit_rate();
            free_overlap[run] = hot[run]->overlap();
          }
          for (size_t run = 0; run < traces.size(); run += nf) {
            std::string name = absl::StrCat(pc.name, "_", n_prompt, "_", method, "_",
                                            options.budgets[run / nf], ".kvrsel");
            for (char& ch : name) {
              if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '_') ch = '-';
            }
            const std::string path = absl::StrCat(options.trace_dir, "/", name);
            // A method that attends more than the budget (full) has nothing to replay.
            bool over = false;
            for (const SelectionTrace::Step& step : traces[run].steps) {
              for (const auto& ids : step.heads) over |= std::ssize(ids) > traces[run].budget;
            }
            if (over) continue;
            KVR_RETURN_IF_ERROR(WriteSelectionTrace(path, traces[run]));
            if (progress) {
              progress(absl::StrCat("selection trace: ", path, " (", traces[run].steps.size(),
                                    " steps)"));
            }
          }
        }
        // Context bytes: every layer's index over (prompt + steps) tokens.
        const double index_tokens = static_cast<double>(n_prompt + steps);
        for (size_t run = 0; run < nr; ++run) {
          EvalRow row;
          row.prompt = pc.name;
          row.context = n_prompt;
          row.method = method;
          row.budget = options.budgets[run / nf];
          row.row_format = FetchedRowFormatName(formats[run % nf]);
          row.fetched_row_bytes =
              static_cast<double>(FetchedRowBytes(formats[run % nf], cfg.head_dim));
          const Accum& a = accums[run];
          row.recall = a.recall_total > 0 ? a.recall_hit / a.recall_total : 1.0;
          row.mass = a.head_samples > 0 ? a.mass / a.head_samples : 0;
          row.rel_error = a.head_samples > 0 ? a.rel_error / a.head_samples : 0;
          const SparseAttention& sa = *sparse[run];
          row.summary_bytes_per_token_head = static_cast<double>(sa.IndexBytes(run + 1)) /
                                             (index_tokens * cfg.n_layers * cfg.n_kv_heads);
          row.kv_bytes_per_token_head = 4.0 * cfg.head_dim;  // fp16 K + V
          row.select_us = sa.stats().decode_calls > 0
                              ? 1e6 * sa.stats().select_seconds / sa.stats().decode_calls
                              : 0;
          row.build_s = sa.stats().build_seconds;
          FillDecodeMetrics(pc, ref_nll, *tf, free_decoded ? &*free_decoded : nullptr, n_free, run,
                            row);
          row.hot_cache_rows = options.hot_cache_rows;
          row.hot_hit_rate = free_hot_hit[run];
          row.step_overlap = free_overlap[run];
          // The same method and budget with the first format: run - run % nf.
          const size_t base_run = run - run % nf;
          auto share_equal = [](const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
            int64_t equal = 0;
            for (size_t i = 0; i < a.size(); ++i) equal += a[i] == b[i];
            return a.empty() ? 1.0 : static_cast<double>(equal) / static_cast<double>(a.size());
          };
          row.base_agreement = share_equal(tf->argmax[run], tf->argmax[base_run]);
          if (free_decoded) {
            row.base_free_agreement =
                share_equal(free_decoded->tokens[run], free_decoded->tokens[base_run]);
          }
          rows.push_back(row);
        }
        if (progress) {
          progress(absl::StrFormat("%s context %d: %s done in %.1f s", pc.name, n_prompt, method,
                                   std::chrono::duration<double>(Clock::now() - t_method).count()));
        }
      }
      if (!options.thin_keep.empty()) {
        const auto t_thin = Clock::now();
        KVR_RETURN_IF_ERROR(
            RunThinned(options, model, prefilled, pc, total, ref_nll, ref_argmax, ref_free, rows));
        if (progress) {
          progress(absl::StrFormat("%s context %d: thinned prefixes done in %.1f s", pc.name,
                                   n_prompt,
                                   std::chrono::duration<double>(Clock::now() - t_thin).count()));
        }
      }
    }
  }
  return rows;
}

std::string FormatTable(const std::vector<EvalRow>& rows) {
  std::set<std::string> formats;
  for (const EvalRow& r : rows) formats.insert(r.row_format);
  const bool several_formats = formats.size() > 1;
  const bool any_thin =
      std::any_of(rows.begin(), rows.end(), [](const EvalRow& r) { return r.kept_fraction >= 0; });
  std::string out = absl::StrFormat(
      "%-8s %6s %-10s %6s %-5s %7s %7s %8s %8s %8s %7s %11s %6s %6s %9s %9s %6s", "prompt", "ctx",
      "method", "budget", "rows", "recall", "mass", "relerr", "nll", "dNLL", "agree", "free(pfx)",
      "hot", "ovl", "B/tok/hd", "select_us", "pass");
  if (several_formats) absl::StrAppendFormat(&out, " %13s", "vs1st tf/free");
  out += any_thin ? absl::StrFormat(" %6s %6s\n", "kept", "whole") : "\n";
  for (const EvalRow& r : rows) {
    const std::string free =
        r.free_tokens > 0 ? absl::StrFormat("%.3f(%d)", r.free_agreement, r.free_prefix) : "-";
    // Thinned-prefix rows select nothing: no hot cache, no overlap.
    const bool selects = r.free_tokens > 1 && r.kept_fraction < 0;
    const std::string hot = selects ? absl::StrFormat("%.3f", r.hot_hit_rate) : "-";
    const std::string ovl = selects ? absl::StrFormat("%.3f", r.step_overlap) : "-";
    const std::string recall = r.recall >= 0 ? absl::StrFormat("%.3f", r.recall) : "-";
    absl::StrAppendFormat(
        &out,
        "%-8s %6d %-10s %6d %-5s %7s %7.3f %8.4f %8.4f %+8.4f %7.3f %11s %6s %6s %9.2f %9.1f "
        "%6s",
        r.prompt, r.context, r.method, r.budget, r.row_format, recall, r.mass, r.rel_error, r.nll,
        r.nll_delta, r.agreement, free, hot, ovl, r.summary_bytes_per_token_head, r.select_us,
        r.passkey_ok < 0 ? "-" : (r.passkey_ok ? "yes" : "no"));
    if (several_formats) {
      absl::StrAppendFormat(&out, " %6.3f/%6.3f", r.base_agreement, r.base_free_agreement);
    }
    out += !any_thin             ? "\n"
           : r.kept_fraction < 0 ? absl::StrFormat(" %6s %6s\n", "-", "-")
                                 : absl::StrFormat(" %6.3f %6d\n", r.kept_fraction, r.intact_rows);
  }
  if (!rows.empty()) {
    absl::StrAppendFormat(&out, "(K+V per token per head: %.0f B in fp16",
                          rows.front().kv_bytes_per_token_head);
    std::map<std::string, double> row_bytes;
    for (const EvalRow& r : rows) row_bytes[r.row_format] = r.fetched_row_bytes;
    for (const auto& [format, bytes] : row_bytes) {
      absl::StrAppendFormat(&out, "; rows %s: the selected rows %s, %.0f B per fetched row", format,
                            format == "cache"  ? "as the cache holds them"
                            : format == "bf16" ? "rounded to bf16"
                                               : "through fp8 e4m3 with a scale per row and head",
                            bytes);
    }
    if (several_formats) {
      absl::StrAppendFormat(&out,
                            "; vs1st tf/free: teacher-forced argmax and free greedy tokens equal "
                            "to the same method and budget's with rows %s",
                            rows.front().row_format);
    }
    if (any_thin) {
      absl::StrAppendFormat(&out,
                            "; thin-kd: the prompt's rows thinned at page granularity as the KV "
                            "store thins a cached prefix (KeyDiff, least distinctive pages "
                            "first), thin-rnd: as many pages at random, both then attending "
                            "densely over the kept rows; their budget is the mean kept prompt "
                            "rows per layer and KV head, kept their share, whole the rows before "
                            "the first dropped one of any layer and KV head (what a prefill "
                            "reuses of such a prefix), mass the dense attention's mass on the "
                            "kept rows");
    }
    if (rows.front().free_tokens > 0) {
      absl::StrAppendFormat(&out,
                            "; free(pfx): agreement of %d freely decoded greedy tokens with "
                            "dense greedy, and the common prefix length; hot: hit rate of the "
                            "GPU decode path's hot cache (%s rows per layer and KV head, 8-way "
                            "LRU) replayed on that decoding's selections; ovl: share of each "
                            "step's selected rows that the previous step selected too",
                            rows.front().free_tokens, rows.front().hot_cache_rows > 0
                                ? absl::StrCat(rows.front().hot_cache_rows) : "budget");
    }
    out += ")\n";
  }
  return out;
}

std::string ToJson(const EvalOptions& options, const std::vector<EvalRow>& rows) {
  nlohmann::json j;
  j["options"] = {{"contexts", options.contexts},
                  {"budgets", options.budgets},
                  {"methods", options.methods},
                  {"steps", options.steps},
                  {"free_tokens", options.free_tokens},
                  {"hot_cache_rows", options.hot_cache_rows},
                  {"n_sink", options.n_sink},
                  {"local_window", options.local_window},
                  {"text_files", options.text_files},
                  {"passkey", options.passkey},
                  {"row_formats", options.row_formats},
                  {"thin_keep", options.thin_keep},
                  {"thin_page_rows", options.thin_page_rows},
                  {"thin_random", options.thin_random}};
  j["rows"] = nlohmann::json::array();
  for (const EvalRow& r : rows) {
    j["rows"].push_back({{"prompt", r.prompt},
                         {"context", r.context},
                         {"method", r.method},
                         {"budget", r.budget},
                         {"row_format", r.row_format},
                         {"fetched_row_bytes", r.fetched_row_bytes},
                         {"steps", r.steps},
                         {"recall", r.recall},
                         {"mass", r.mass},
                         {"rel_error", r.rel_error},
                         {"nll", r.nll},
                         {"nll_delta", r.nll_delta},
                         {"agreement", r.agreement},
                         {"summary_bytes_per_token_head", r.summary_bytes_per_token_head},
                         {"kv_bytes_per_token_head", r.kv_bytes_per_token_head},
                         {"select_us", r.select_us},
                         {"build_s", r.build_s},
                         {"passkey_ok", r.passkey_ok},
                         {"free_tokens", r.free_tokens},
                         {"free_agreement", r.free_agreement},
                         {"free_prefix", r.free_prefix},
                         {"hot_hit_rate", r.hot_hit_rate},
                         {"step_overlap", r.step_overlap},
                         {"base_agreement", r.base_agreement},
                         {"base_free_agreement", r.base_free_agreement},
                         {"kept_fraction", r.kept_fraction},
                         {"intact_rows", r.intact_rows}});
  }
  return j.dump(2);
}

}  // namespace kvr::retrieval::eval
