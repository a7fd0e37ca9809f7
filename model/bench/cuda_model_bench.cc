// Benchmark of the CUDA model (cuda_model.h) with random bf16 weights generated on the GPU:
// prefill throughput of one sequence, and decode step time of a batch of sequences at a given
// context (caches filled with random rows), with the GPU time split into GEMM / attention /
// other, and each figure set against its roofline: the GEMMs against the bf16 dense peak, the
// decode step against the bytes it must read (weights + KV) at the HBM bandwidth.
//
//   cuda_model_bench --shape llama3-8b --prefill 2048,8192 --batch 1,8,32 --context 4096
//
// Prefill with retrieval summaries built on the GPU: prefill_summaries_bench
// (retrieval/cuda/summaries/bench).
//
// Peaks default to the H100 SXM datasheet (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvr/model/cuda_model.h"
#include "kvr/model/dummy.h"

namespace kvr::model {
namespace {

struct Flags {
  std::string shape = "llama3-8b";
  int layers = 0;
  std::vector<int64_t> prefill = {2048, 8192};
  std::vector<int> batch = {1, 8, 32};
  int64_t context = 4096;
  int steps = 20;
  int warmup = 3;
  double peak_tflops = 989;
  double peak_tbps = 3.35;
};

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void Fail(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

int Run(const Flags& f) {
  auto config = DummyConfig(f.shape, f.layers);
  Fail(config.status(), "config");
  const ModelConfig& c = *config;
  CudaModelOptions options;
  options.max_batch_tokens =
      std::max<int64_t>(*std::max_element(f.prefill.begin(), f.prefill.end()),
                        *std::max_element(f.batch.begin(), f.batch.end()));
  options.max_sequences = *std::max_element(f.batch.begin(), f.batch.end());
  options.profile = true;
  auto model_or = CreateCudaModelWithRandomWeights(c, 1, options);
  Fail(model_or.status(), "CreateCudaModelWithRandomWeights");
  CudaModel& model = **model_or;

  // Per token: 2 flops per weight of every projection (the embedding is a gather).
  const double h = c.hidden, q = c.q_dim(), kv = c.kv_dim(), ffn = c.ffn;
  const double layer_params = h * (q + 2 * kv) + q * h + 2 * ffn * h + ffn * h;
  const double matmul_params = layer_params * c.n_layers;
  const double out_params = static_cast<double>(c.vocab) * h;
  const double embd_bytes = static_cast<double>(c.vocab) * h * 2;
  std::printf("shape %s: %d layers, %.2f GB of bf16 weights on the GPU\n", f.shape.c_str(),
              c.n_layers, model.weight_bytes() / 1e9);

  std::printf("\nprefill (one sequence, logits of the last token)\n");
  std::printf("%7s %10s %11s %9s %9s %9s %11s %11s %10s\n", "tokens", "time_ms", "tokens/s",
              "gemm_ms", "attn_ms", "other_ms", "gemm_TF/s", "attn_TF/s", "pred_ms");
  SequenceId next_id = 1;
  for (int64_t t : f.prefill) {
    const std::vector<int32_t> tokens(t, 1000);
    std::vector<float> logits(c.vocab);
    double best = 1e30;
    CudaForwardProfile prof;
    for (int rep = 0; rep < 3; ++rep) {  // rep 0 warms up cuBLAS heuristics and caches
      const SequenceId id = next_id++;
      Fail(model.AddSequence(id, t), "AddSequence");
      const CudaSequence s{id, tokens};
      const auto t0 = std::chrono::steady_clock::now();
      Fail(model.Forward(std::span(&s, 1), LogitsMode::kLast, logits), "Forward");
      const double sec = Seconds(t0, std::chrono::steady_clock::now());
      if (rep > 0 && sec < best) {
        best = sec;
        prof = model.last_profile();
      }
      Fail(model.ReleaseSequence(id), "ReleaseSequence");
    }
    const double gemm_flops = 2 * matmul_params * t + 2 * out_params;
    const double attn_flops = 2.0 * t * t * c.head_dim * c.n_heads * c.n_layers;  // causal
    // Prediction: GEMMs at the bf16 peak plus attention at half of it.
    const double pred_ms =
        (gemm_flops / (f.peak_tflops * 1e12) + attn_flops / (0.5 * f.peak_tflops * 1e12)) * 1e3;
    std::printf("%7lld %10.1f %11.0f %9.1f %9.1f %9.1f %11.0f %11.0f %10.1f\n",
                static_cast<long long>(t), best * 1e3, t / best, prof.gemm_ms, prof.attention_ms,
                prof.other_ms, gemm_flops / (prof.gemm_ms * 1e-3) / 1e12,
                attn_flops / (prof.attention_ms * 1e-3) / 1e12, pred_ms);
  }

  std::printf("\ndecode (one token per sequence, context %lld, argmax on the GPU)\n",
              static_cast<long long>(f.context));
  std::printf("%6s %10s %10s %9s %9s %9s %9s %10s %10s %9s %10s\n", "batch", "step_ms",
              "graph_ms", "graph_x", "gemm_ms", "attn_ms", "other_ms", "GB_read", "GB/s",
              "of_peak", "pred_ms");
  for (int b : f.batch) {
    std::vector<SequenceId> ids;
    for (int i = 0; i < b; ++i) {
      const SequenceId id = next_id++;
      Fail(model.AddSequence(id, f.context + 3 * (f.warmup + f.steps) + 1), "AddSequence");
      Fail(model.FillSequenceForBenchmark(id, f.context, id), "FillSequenceForBenchmark");
      ids.push_back(id);
    }
    std::vector<int32_t> tokens(b, 1000), next(b);
    std::vector<CudaSequence> batch(b);
    // Step time without profiling (events cost host time per kernel), then the split of the
    // GPU time over as many profiled steps.
    // step_ms: launch by launch; graph_ms: the same steps as CUDA graph replays (one capture
    // per split count, in the warm-up); then the profiled steps (never graphed).
    double total = 0, graph_total = 0;
    CudaForwardProfile sum;
    for (int pass = 0; pass < 3; ++pass) {
      const bool profiled = pass == 2, graphs = pass == 1;
      model.set_profile(profiled);
      model.set_cuda_graphs(graphs);
      for (int step = 0; step < f.warmup + f.steps; ++step) {
        for (int i = 0; i < b; ++i) batch[i] = {ids[i], std::span(&tokens[i], 1)};
        const auto t0 = std::chrono::steady_clock::now();
        Fail(model.ForwardGreedy(batch, next), "ForwardGreedy");
        const double sec = Seconds(t0, std::chrono::steady_clock::now());
        tokens = next;
        if (step < f.warmup) continue;
        if (pass == 0) total += sec;
        if (graphs) graph_total += sec;
        const CudaForwardProfile p = model.last_profile();
        sum.gemm_ms += p.gemm_ms;
        sum.attention_ms += p.attention_ms;
        sum.other_ms += p.other_ms;
      }
    }
    model.set_cuda_graphs(true);
    const double step_s = total / f.steps;
    const double graph_s = graph_total / f.steps;
    const double kv_bytes =
        static_cast<double>(b) * (f.context + f.warmup + f.steps) * c.n_layers * 2 * c.kv_dim() * 2;
    const double bytes = model.weight_bytes() - embd_bytes * (c.tied_embeddings ? 0 : 1) + kv_bytes;
    const double pred_ms = bytes / (f.peak_tbps * 1e12) * 1e3;
    std::printf("%6d %10.2f %10.2f %8.2fx %9.2f %9.2f %9.2f %10.2f %10.0f %8.0f%% %10.2f\n", b,
                step_s * 1e3, graph_s * 1e3, step_s / graph_s, sum.gemm_ms / f.steps,
                sum.attention_ms / f.steps, sum.other_ms / f.steps, bytes / 1e9,
                bytes / step_s / 1e9, 100 * bytes / step_s / (f.peak_tbps * 1e12), pred_ms);
    for (SequenceId id : ids) Fail(model.ReleaseSequence(id), "ReleaseSequence");
  }
  return 0;
}

}  // namespace
}  // namespace kvr::model

int main(int argc, char** argv) {
  kvr::model::Flags f;
  CLI::App app{"CUDA model runtime benchmark (random bf16 weights)"};
  app.add_option("--shape", f.shape, "dummy shape (dummy.h)");
  app.add_option("--layers", f.layers, "override the shape's layer count (0: all)");
  app.add_option("--prefill", f.prefill, "prompt lengths to time")->delimiter(',');
  app.add_option("--batch", f.batch, "decode batch sizes to time")->delimiter(',');
  app.add_option("--context", f.context, "tokens in each decoding sequence's cache");
  app.add_option("--steps", f.steps, "timed decode steps");
  app.add_option("--warmup", f.warmup, "untimed decode steps first");
  app.add_option("--peak-tflops", f.peak_tflops, "bf16 dense peak for the roofline");
  app.add_option("--peak-tbps", f.peak_tbps, "HBM bandwidth for the roofline, TB/s");
  CLI11_PARSE(app, argc, argv);
  return kvr::model::Run(f);
}
