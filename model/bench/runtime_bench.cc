// CPU runtime throughput: prefill of a long prompt and batched decode on top of it, with the
// achieved GFLOP/s and weight-streaming GB/s next to ceilings measured on the same machine
// (an SGEMM on every thread; a parallel read of a large buffer).
//
//   model_runtime_bench [--model PATH|smollm2-135m-instruct] [--load-format dummy --model SHAPE]
//                       [--prompt-tokens 2048] [--decode-steps 32] [--batch 1] [--threads 0]
//                       [--weights packed|float32] [--kv-dtype f16|f32] [--no-ceilings]
//                       (--help says what each does)
//
// Process CPU time over wall time x threads is printed as "cpu use": well under 100% means
// other processes shared the cores and the figures are pessimistic.

#include <cblas.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/str_format.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/cpu_kernels.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double CpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// SGEMM GFLOP/s with every pool thread running its own 512^3 product (OpenBLAS single-threaded).
double SgemmCeiling(kvr::ThreadPool& pool) {
  const int n = 512, reps = 8;
  const size_t threads = pool.size();
  std::vector<std::vector<float>> a(threads, std::vector<float>(n * n, 0.5f)),
      c(threads, std::vector<float>(n * n));
  const auto start = Clock::now();
  pool.ParallelFor(
      threads,
      [&](size_t b, size_t e) {
        for (size_t t = b; t < e; ++t) {
          for (int r = 0; r < reps; ++r) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.f, a[t].data(), n,
                        a[t].data(), n, 0.f, c[t].data(), n);
          }
        }
      },
      1);
  return 2.0 * n * n * n * reps * threads / Since(start) / 1e9;
}

// GB/s of a parallel sum over 512 MiB (larger than any cache, like the weights).
double ReadCeiling(kvr::ThreadPool& pool) {
  std::vector<float> buffer(128 << 20, 1.f);
  std::vector<double> sums(pool.size() * 16);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto start = Clock::now();
    const size_t parts = pool.size();
    pool.ParallelFor(
        parts,
        [&](size_t b, size_t e) {
          for (size_t p = b; p < e; ++p) {
            const size_t chunk = buffer.size() / parts;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
            const float* x = buffer.data() + p * chunk;
            for (size_t i = 0; i + 8 <= chunk; i += 8) {
              s0 += x[i], s1 += x[i + 1], s2 += x[i + 2], s3 += x[i + 3];
              s4 += x[i + 4], s5 += x[i + 5], s6 += x[i + 6], s7 += x[i + 7];
            }
            sums[p * 16] = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
          }
        },
        1);
    best = std::max(best, buffer.size() * 4.0 / Since(start) / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvr CPU runtime benchmark: prefill of a synthetic prompt of --prompt-tokens tokens, then "
      "--decode-steps greedy decode steps on top of it (so decode is measured at context "
      "--prompt-tokens, any length up to the model's context), with achieved GFLOP/s and GB/s "
      "next to ceilings measured on the same threads"};
  std::string model_name = "smollm2-135m-instruct", format_name = "auto";
  int64_t prompt_tokens = 2048;
  int decode_steps = 32, batch = 1, threads = 0, layers = 0;
  bool ceilings = true;
  app.add_option("--model", model_name,
                 "GGUF file, Hugging Face directory, known name, or with --load-format dummy a "
                 "shape name (smollm2-135m, qwen2-0.5b, llama3-8b, tiny)")
      ->capture_default_str();
  app.add_option("--load-format", format_name, "auto|gguf|hf|dummy")->capture_default_str();
  app.add_option("--layers", layers, "dummy weights only: override the shape's layer count");
  app.add_option("--prompt-tokens", prompt_tokens,
                 "prompt length: prefill size and the context at which decode is measured")
      ->capture_default_str();
  app.add_option("--decode-steps", decode_steps, "decode steps timed after the prefill")
      ->capture_default_str();
  app.add_option("--batch", batch,
                 "sequences decoded together (each prefilled with the same prompt first)")
      ->capture_default_str();
  app.add_option("--threads", threads, "pool threads (0 = all cores)")->capture_default_str();
  std::string storage_name = "packed";
  app.add_option("--weights", storage_name,
                 "GGUF weight storage: packed (the file's formats, gemv kernels) or float32 "
                 "(dequantised at load, SGEMM/SGEMV)")
      ->capture_default_str();
  std::string kv_dtype_name = "f16";
  app.add_option("--kv-dtype", kv_dtype_name,
                 "KV cache precision: f16 (half the bytes per decode step) or f32 (the exact "
                 "float32 reference)")
      ->capture_default_str();
  app.add_flag("--ceilings,!--no-ceilings", ceilings,
               "measure the SGEMM and memory-read ceilings first (about a second)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto format = kvr::model::ParseLoadFormat(format_name);
  if (!format.ok()) return std::fprintf(stderr, "%s\n", format.status().ToString().c_str()), 2;
  kvr::ThreadPool pool(threads > 0 ? threads : 0);
  kvr::model::LoadOptions options;
  options.format = *format;
  options.dummy_layers = layers;
  auto storage = kvr::model::ParseWeightStorage(storage_name);
  if (!storage.ok()) return std::fprintf(stderr, "%s\n", storage.status().ToString().c_str()), 2;
  options.weights = *storage;
  auto kv_dtype = kvr::model::ParseKvDType(kv_dtype_name);
  if (!kv_dtype.ok()) return std::fprintf(stderr, "%s\n", kv_dtype.status().ToString().c_str()), 2;
  options.kv_dtype = *kv_dtype;
  auto loaded = kvr::model::LoadModel(model_name, options, &pool);
  if (!loaded.ok()) return std::fprintf(stderr, "%s\n", loaded.status().ToString().c_str()), 1;
  const kvr::model::Model& model = *loaded->model;
  const auto& c = model.config();

  const double gemm_ceiling = ceilings ? SgemmCeiling(pool) : 0;
  const double read_ceiling = ceilings ? ReadCeiling(pool) : 0;
  std::printf(
      "%s (%s weights, %.1f MiB, %s kernels, %s KV) on %zu threads: sgemm ceiling "
      "%.1f GFLOP/s, read ceiling %.1f GB/s\n",
      loaded->source.c_str(), model.weights().packed() ? "packed" : "float32",
      model.weights().allocated_bytes() / 1048576.0,
      kvr::model::CpuIsaName(kvr::model::BestCpuKernels().isa),
      kvr::model::KvDTypeName(model.kv_dtype()), pool.size(), gemm_ceiling, read_ceiling);

  // Prefill: the same synthetic prompt for every sequence (ids spread over the vocabulary).
  std::vector<int32_t> prompt(prompt_tokens);
  for (int64_t i = 0; i < prompt_tokens; ++i)
    prompt[i] = static_cast<int32_t>((i * 7919 + 13) % c.vocab);
  kvr::model::DenseAttention attention(&pool);
  std::vector<kvr::model::KvCache> caches;
  for (int b = 0; b < batch; ++b) {
    caches.push_back(model.NewCache());
    caches.back().Reserve(prompt_tokens + decode_steps + 1);
  }
  double cpu0 = CpuSeconds();
  auto start = Clock::now();
  auto logits = model.Prefill(0, caches[0], prompt, attention);
  const double prefill_s = Since(start);
  const double prefill_cpu = CpuSeconds() - cpu0;
  if (!logits.ok()) return std::fprintf(stderr, "%s\n", logits.status().ToString().c_str()), 1;
  // FLOPs: 2 per weight per token in the layers, the output projection once per chunk (last
  // token), and causal attention (QK^T and PV: 2 * 2 * n_heads * head_dim per (query, key)).
  const int64_t embed = int64_t{c.vocab} * c.hidden * (c.tied_embeddings ? 1 : 2);
  const double layer_params = static_cast<double>(c.ParameterCount() - embed);
  const double n = static_cast<double>(prompt_tokens);
  const double flops = 2 * layer_params * n + 4.0 * c.n_heads * c.head_dim * n * n / 2 * c.n_layers;
  std::printf(
      "prefill: %lld tokens in %.2f s = %.1f tok/s, %.1f GFLOP/s (%.0f%% of the sgemm "
      "ceiling), cpu use %.0f%%\n",
      static_cast<long long>(prompt_tokens), prefill_s, n / prefill_s, flops / prefill_s / 1e9,
      gemm_ceiling > 0 ? 100 * flops / prefill_s / 1e9 / gemm_ceiling : 0.0, 100 * prefill_cpu / (prefill_s * pool.size()));
  for (int b = 1; b < batch; ++b) {
    if (!model.Prefill(b, caches[b], prompt, attention).ok()) return 1;
  }

  // Decode: `batch` sequences, one token each per step.
  std::vector<int32_t> next(batch, kvr::model::ArgMax(*logits));
  std::vector<float> step_logits(static_cast<size_t>(batch) * c.vocab);
  cpu0 = CpuSeconds();
  start = Clock::now();
  for (int step = 0; step < decode_steps; ++step) {
    std::vector<kvr::model::ForwardSequence> seqs;
    for (int b = 0; b < batch; ++b)
      seqs.push_back({static_cast<uint64_t>(b), &caches[b], std::span(&next[b], 1)});
    if (!model.Forward(seqs, attention, kvr::model::LogitsMode::kLast, step_logits).ok()) return 1;
    for (int b = 0; b < batch; ++b) {
      next[b] = kvr::model::ArgMax(
          std::span(step_logits).subspan(static_cast<size_t>(b) * c.vocab, c.vocab));
    }
  }
  const double decode_s = Since(start);
  const double decode_cpu = CpuSeconds() - cpu0;
  // Bytes streamed per step: every weight once plus each sequence's K and V.
  const double kv_elem_bytes = model.kv_dtype() == kvr::model::KvDType::kF16 ? 2 : 4;
  const double kv_bytes =
      2.0 * c.n_layers * c.kv_dim() * kv_elem_bytes * (prompt_tokens + decode_steps / 2.0) * batch;
  const double step_bytes = static_cast<double>(model.weights().allocated_bytes()) + kv_bytes;
  std::printf(
      "decode: batch %d at context %lld, %d steps in %.2f s = %.1f tok/s (%.1f steps/s), "
      "%.1f GB/s of weights+KV (%.0f%% of the read ceiling), cpu use %.0f%%\n",
      batch, static_cast<long long>(prompt_tokens), decode_steps, decode_s,
      batch * decode_steps / decode_s, decode_steps / decode_s,
      step_bytes * decode_steps / decode_s / 1e9,
      read_ceiling > 0 ? 100 * step_bytes * decode_steps / decode_s / 1e9 / read_ceiling : 0.0,
      100 * decode_cpu / (decode_s * pool.size()));
  return 0;
}
