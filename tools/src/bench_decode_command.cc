// kvr bench decode: end-to-end decode throughput of the CUDA model runtime (issue 7 item 4):
// dense (`full`) sequences with their whole KV in HBM against sparse sequences (quest,
// clusterkv) that keep only summaries, the sink/window rows and a hot cache on the GPU and
// gather the selected rows from pinned host memory (cuda_model.h, "Sparse sequences").
//
//   kvr bench decode [--contexts 32768,131072] [--methods full,quest,clusterkv]
//                    [--batches 1,2,4,...] [--budget 1024] [--sink 16] [--window 256]
//                    [--hot-cache-rows 1024] [--steps 16] [--warmup 3] [--profile]
//                    [--json FILE]
//
// Llama-3-8B shape with random weights generated on the GPU; SYNTHETIC KV (random rows) filled
// by FillSequenceForBenchmark; all sparse sequences of a batch share one host KV (128 GiB of host
// memory holds ~7 Llama-3-8B sequences of 128K); clusterkv's summaries are a synthetic stand-in
// for k-means (cuda_model.h). Per (context, method, batch): tokens/s, p50/p99 time per output
// token (one step = one token of every sequence, wall clock around ForwardGreedy), GPU bytes per
// sequence; batches up to what GPU memory allows (dense: sequences added until the GPU is full;
// sparse: slots configured until it is). Then the best sparse / best dense ratio per context,
// and with --profile the per-step GPU time split and the bytes gathered from host per step
// against the pinned-host ceiling (--host-gbps, measured 51-55 GB/s on the lent H100).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "kvr/common/status.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"

namespace kvr::tools {
namespace {

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
  double host_gbps = 51.0;
  std::string json;
};

struct Row {
  int64_t context = 0;
  std::string method;
  int batch = 0;
  double tokens_per_s = 0, p50_ms = 0, p99_ms = 0, mean_ms = 0;
  int64_t gpu_bytes_per_seq = 0;
  bool profiled = false;
  model::CudaForwardProfile prof;
  double gathered_bytes_per_step = 0, hit_rate = 0;
};

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

class DecodeBench {
 public:
  DecodeBench(const DecodeBenchFlags& f, model::CudaModel& m) : f_(f), m_(m) {}

  // Steps `ids` (all dense or all sparse); fills row's timing fields.
  absl::Status Time(const std::vector<model::SequenceId>& ids, Row& row) {
    std::vector<int32_t> tokens(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      tokens[i] = static_cast<int32_t>((i * 7919 + 13) % m_.config().vocab);
    }
    std::vector<int32_t> next(ids.size());
    auto step = [&]() -> absl::Status {
      std::vector<model::CudaSequence> batch;
      for (size_t i = 0; i < ids.size(); ++i) batch.push_back({ids[i], std::span(&tokens[i], 1)});
      KVR_RETURN_IF_ERROR(m_.ForwardGreedy(batch, next));
      tokens = next;
      return absl::OkStatus();
    };
    for (int i = 0; i < f_.warmup; ++i) KVR_RETURN_IF_ERROR(step());
    std::vector<double> ms;
    for (int i = 0; i < f_.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      KVR_RETURN_IF_ERROR(step());
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    double sum = 0;
    for (double v : ms) sum += v;
    row.mean_ms = sum / ms.size();
    row.p50_ms = Percentile(ms, 0.5);
    row.p99_ms = Percentile(ms, 0.99);
    row.tokens_per_s = ids.size() / (row.mean_ms / 1e3);
    KVR_ASSIGN_OR_RETURN(row.gpu_bytes_per_seq, m_.SequenceDeviceBytes(ids[0]));
    if (f_.profile) {
      const model::SparseStats before = m_.sparse_stats();
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
      const model::SparseStats after = m_.sparse_stats();
      row.profiled = true;
      row.prof = sum_p;
      const int64_t selected = after.selected_rows - before.selected_rows;
      const int64_t hits = after.hot_cache_hits - before.hot_cache_hits;
      if (selected > 0) {
        row.hit_rate = static_cast<double>(hits) / selected;
        row.gathered_bytes_per_step =
            static_cast<double>(selected - hits) * after.row_bytes / kProfiled;
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
          for (model::SequenceId id : sub) {
            KVR_RETURN_IF_ERROR(m_.FillSequenceForBenchmark(id, context, 1));  // reset lengths
          }
          return Time(sub, row);
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

  absl::Status RunSparse(int64_t context, model::SparseMethod method, const std::string& name,
                         std::vector<Row>& rows) {
    const int64_t capacity = context + f_.warmup + f_.steps + 8;
    model::SparseAttentionOptions o;
    o.method = method;
    o.max_capacity = capacity;
    o.budget = f_.budget;
    o.n_sink = f_.sink;
    o.local_window = f_.window;
    o.hot_cache_rows = f_.hot_cache_rows;
    o.clusterkv_max_pending = 4 * (f_.warmup + f_.steps) + 64;
    // Largest slot count that fits (binary search on ConfigureSparse, which allocates it all).
    auto fits = [&](int slots) {
      o.slots = slots;
      return m_.ConfigureSparse(o).ok();
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
      KVR_RETURN_IF_ERROR(m_.ConfigureSparse(o));
      std::vector<model::SequenceId> ids;
      const absl::Status s = [&]() -> absl::Status {
        for (int i = 0; i < b; ++i) {
          const model::SequenceId id = 5000 + i;
          model::SparseSequenceOptions so;
          if (i > 0) so.share_host_kv_with = ids[0];
          KVR_RETURN_IF_ERROR(m_.AddSparseSequence(id, capacity, so));
          ids.push_back(id);
          KVR_RETURN_IF_ERROR(m_.FillSequenceForBenchmark(id, context, 1));
        }
        Row row{context, name, b};
        KVR_RETURN_IF_ERROR(Time(ids, row));
        Print(row);
        rows.push_back(row);
        return absl::OkStatus();
      }();
      for (model::SequenceId id : ids) KVR_RETURN_IF_ERROR(m_.ReleaseSequence(id));
      return s;
    };
    for (int b : Sweep(max_slots)) {
      absl::Status s = run_batch(b);
      if (!s.ok() && b == max_slots && b > 1) {
        std::printf("%6lldK  %-9s  %5d  failed (%s); one fewer\n",
                    static_cast<long long>(context / 1024), name.c_str(), b, s.ToString().c_str());
        s = run_batch(b - 1);
      }
      if (!s.ok()) {
        o.slots = 0;
        (void)m_.ConfigureSparse(o);
        return s;
      }
    }
    o.slots = 0;  // frees the GPU state for the next method
    return m_.ConfigureSparse(o);
  }

  std::vector<int> Sweep(int max) const {
    std::vector<int> out;
    if (!f_.batches.empty()) {
      for (int b : f_.batches) {
        if (b <= max) out.push_back(b);
      }
      return out;
    }
    for (int b = 1; b < max; b *= 2) out.push_back(b);
    out.push_back(max);
    return out;
  }

  void Print(const Row& r) const {
    std::printf("%6lldK  %-9s  %5d  %10.1f  %8.2f  %8.2f  %9.3f",
                static_cast<long long>(r.context / 1024), r.method.c_str(), r.batch, r.tokens_per_s,
                r.p50_ms, r.p99_ms, r.gpu_bytes_per_seq / double(1 << 30));
    if (r.profiled) {
      const double link_ms = r.gathered_bytes_per_step / (f_.host_gbps * 1e9) * 1e3;
      std::printf(
          "  | gpu %7.2f ms: gemm %6.2f  select %6.2f  gather %6.2f  attn %6.2f  other %5.2f"
          "  | host bytes/step %7.1f MiB (hits %.2f) = %6.2f ms at %.0f GB/s",
          r.prof.total_ms, r.prof.gemm_ms, r.prof.select_ms, r.prof.gather_ms, r.prof.attention_ms,
          r.prof.other_ms, r.gathered_bytes_per_step / (1 << 20), r.hit_rate, link_ms,
          f_.host_gbps);
    }
    std::printf("\n");
    std::fflush(stdout);
  }

 private:
  const DecodeBenchFlags& f_;
  model::CudaModel& m_;
};

absl::Status RunDecodeBench(const DecodeBenchFlags& f) {
  if (!model::CudaModelAvailable()) {
    return absl::FailedPreconditionError(
        "kvr bench decode needs a CUDA GPU: this build has no CUDA backend or no usable device "
        "(run it on the device machine: scripts/device/gpu-decode.sh)");
  }
  KVR_ASSIGN_OR_RETURN(model::ModelConfig config, model::DummyConfig(f.shape, f.layers));
  const int64_t max_ctx = *std::max_element(f.contexts.begin(), f.contexts.end());
  // Room for the decode steps past the longest context (128K is Llama-3's whole window).
  config.context_length =
      std::max<int64_t>(config.context_length, max_ctx + f.warmup + f.steps + 8);
  model::CudaModelOptions mo;
  mo.max_batch_tokens = f.max_batch;
  mo.max_sequences = f.max_batch;
  mo.max_logits_rows = 64;
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<model::CudaModel> m,
                       model::CreateCudaModelWithRandomWeights(config, 1, mo));
  std::printf(
      "kvr bench decode: %s shape (%d layers), RANDOM weights (%.2f GB bf16), SYNTHETIC KV "
      "(random rows; sparse sequences of a batch share one host KV), budget %d, sink %d, "
      "window %d, hot cache %d rows/head; clusterkv summaries: synthetic stand-in (runs of 80 "
      "tokens, mean key); %d steps after %d warm-up\n",
      f.shape.c_str(), config.n_layers, m->weight_bytes() / 1e9, f.budget, f.sink, f.window,
      f.hot_cache_rows, f.steps, f.warmup);
  std::printf("%7s  %-9s  %5s  %10s  %8s  %8s  %9s\n", "context", "method", "batch", "tokens/s",
              "p50 ms", "p99 ms", "GiB/seq");
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
    for (auto method : {model::SparseMethod::kQuest, model::SparseMethod::kClusterKv}) {
      model::SparseAttentionOptions o;
      o.method = method;
      o.slots = 2;
      o.max_capacity = 4096;
      o.budget = f.budget;
      o.n_sink = f.sink;
      o.local_window = f.window;
      o.hot_cache_rows = f.hot_cache_rows;
      KVR_RETURN_IF_ERROR(m->ConfigureSparse(o));
      KVR_RETURN_IF_ERROR(m->AddSparseSequence(900000, 4096, {}));
      KVR_RETURN_IF_ERROR(m->FillSequenceForBenchmark(900000, 3000, 7));
      const model::CudaSequence one{900000, std::span(&tok[0], 1)};
      m->set_profile(true);
      KVR_RETURN_IF_ERROR(m->ForwardGreedy(std::span(&one, 1), std::span(&next[0], 1)));
      m->set_profile(false);
      KVR_RETURN_IF_ERROR(m->ReleaseSequence(900000));
      o.slots = 0;
      KVR_RETURN_IF_ERROR(m->ConfigureSparse(o));
    }
  }
  DecodeBench bench(f, *m);
  std::vector<Row> rows;
  for (int64_t ctx : f.contexts) {
    for (const std::string& method : f.methods) {
      absl::Status s;
      if (method == "full") {
        s = bench.RunDense(ctx, rows);
      } else if (method == "quest") {
        s = bench.RunSparse(ctx, model::SparseMethod::kQuest, method, rows);
      } else if (method == "clusterkv") {
        s = bench.RunSparse(ctx, model::SparseMethod::kClusterKv, method, rows);
      } else {
        return absl::InvalidArgumentError(absl::StrCat("unknown method ", method));
      }
      if (!s.ok())
        std::printf("%6lldK  %-9s  error: %s\n", static_cast<long long>(ctx / 1024), method.c_str(),
                    s.ToString().c_str());
    }
  }
  std::printf("\nbest sparse / best dense tokens/s (target at 128K: >= 6x):\n");
  for (int64_t ctx : f.contexts) {
    const Row* dense = nullptr;
    const Row* sparse = nullptr;
    for (const Row& r : rows) {
      if (r.context != ctx) continue;
      const Row*& best = r.method == "full" ? dense : sparse;
      if (best == nullptr || r.tokens_per_s > best->tokens_per_s) best = &r;
    }
    if (dense != nullptr && sparse != nullptr) {
      std::printf("  %6lldK: %s b%d %.1f tok/s vs full b%d %.1f tok/s = %.2fx\n",
                  static_cast<long long>(ctx / 1024), sparse->method.c_str(), sparse->batch,
                  sparse->tokens_per_s, dense->batch, dense->tokens_per_s,
                  sparse->tokens_per_s / dense->tokens_per_s);
    }
  }
  if (!f.json.empty()) {
    std::ofstream out(f.json);
    out << "[\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << absl::StrFormat(
          "  {\"context\": %d, \"method\": \"%s\", \"batch\": %d, \"tokens_per_s\": %.3f, "
          "\"p50_ms\": %.4f, \"p99_ms\": %.4f, \"gpu_bytes_per_seq\": %d, \"gpu_ms\": %.4f, "
          "\"gemm_ms\": %.4f, \"select_ms\": %.4f, \"gather_ms\": %.4f, \"attention_ms\": %.4f, "
          "\"other_ms\": %.4f, \"host_bytes_per_step\": %.0f, \"hot_cache_hit_rate\": %.4f}%s\n",
          r.context, r.method, r.batch, r.tokens_per_s, r.p50_ms, r.p99_ms, r.gpu_bytes_per_seq,
          r.prof.total_ms, r.prof.gemm_ms, r.prof.select_ms, r.prof.gather_ms, r.prof.attention_ms,
          r.prof.other_ms, r.gathered_bytes_per_step, r.hit_rate, i + 1 < rows.size() ? "," : "");
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
  cmd->add_option("--host-gbps", f.host_gbps, "pinned host -> GPU ceiling (GB/s)")
      ->capture_default_str();
  cmd->add_option("--json", f.json, "write the rows as JSON");
  cmd->callback([flags] {
    const absl::Status s = RunDecodeBench(*flags);
    if (!s.ok()) {
      std::cerr << "kvr bench decode: " << s << "\n";
      throw CLI::RuntimeError(1);
    }
    // `kvr bench` itself (the load generator) must not run after its subcommand.
    throw CLI::Success();
  });
}

}  // namespace kvr::tools
