// kvr bench: the load generator. Streams requests to a controller's kvr.v1.Generation (gRPC)
// or to any OpenAI-compatible HTTP server (kvr-controller's included) at a constant or Poisson
// rate, or at each rate of a sweep, or in a closed loop of N concurrent requests, and reports
// throughput, goodput and latency distributions (tools/bench, kvr::loadgen) as text, as JSON
// in the layout of `vllm bench serve --save-result`, and as a PNG (tools/scripts/plot_bench.py),
// one of each per rate.

#include <unistd.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "commands.h"
#include "endpoint_flags.h"
#include "kvr/common/status.h"
#include "kvr/loadgen/backend.h"
#include "kvr/loadgen/dataset.h"
#include "kvr/loadgen/metrics.h"
#include "kvr/loadgen/progress.h"
#include "kvr/loadgen/report.h"
#include "kvr/loadgen/runner.h"
#include "kvr/model/gguf.h"
#include "kvr/model/loader.h"
#include "kvr/model/tokenizer.h"
#include "spawn.h"
#include "tls_options.h"

namespace kvr::tools {
namespace {

struct BenchFlags {
  EndpointFlags endpoint;
  bool chat = false;
  std::string model;
  std::string rates = "inf";  // --request-rate: a comma-separated list
  bool poisson = false;
  double burstiness = 1.0;
  uint64_t seed = 0;
  uint32_t concurrency = 0;
  uint32_t num_warmups = 0;
  uint64_t num_prompts = 100;
  double duration_s = 0;
  std::string dataset = "synthetic";
  std::string dataset_path;
  std::optional<uint32_t> sharegpt_output_len;
  uint32_t input_len = 1024;
  uint32_t input_len_range = 0;
  std::string tokenizer_model;
  uint32_t output_len = 128;
  bool ignore_eos = false;
  float temperature = 0.f;
  std::string method;
  std::optional<uint32_t> budget;
  std::optional<double> slo_ttft_ms;
  std::optional<double> slo_tpot_ms;
  double request_timeout_s = 600;
  std::string result_file;
  std::string plot;
  bool no_progress = false;
  bool num_prompts_given = false;
};

// "1,2.5,inf" -> {1, 2.5, inf}: each a positive number or "inf", as `vllm bench serve
// --request-rate` takes one.
absl::StatusOr<std::vector<double>> ParseRates(const std::string& list) {
  std::vector<double> rates;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    item = absl::StripAsciiWhitespace(item);
    double r = 0;
    if (item == "inf") {
      r = std::numeric_limits<double>::infinity();
    } else if (!absl::SimpleAtod(item, &r) || !(r > 0) || std::isinf(r)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rate/--request-rate: '", item, "' is not a positive number or inf (in '", list, "')"));
    }
    rates.push_back(r);
  }
  return rates;
}

std::string RateName(double rate) { return std::isinf(rate) ? "inf" : absl::StrFormat("%g", rate); }

// `path` for one rate of a sweep: "out.json" -> "out-rate-2.json"; unchanged for one rate.
std::string PerRatePath(const std::string& path, double rate, bool sweep) {
  if (!sweep || path.empty()) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() /
          absl::StrCat(p.stem().string(), "-rate-", RateName(rate), p.extension().string()))
      .string();
}

// The tokenizer of a GGUF file or a Hugging Face directory, to size generated prompts.
absl::StatusOr<model::Tokenizer> LoadTokenizer(const std::string& path) {
  if (std::filesystem::is_directory(path)) return model::Tokenizer::FromHuggingFaceDir(path);
  KVR_ASSIGN_OR_RETURN(model::GgufFile file, model::GgufFile::Open(path));
  KVR_ASSIGN_OR_RETURN(model::TokenizerSpec spec, model::TokenizerSpecFromGguf(file));
  return model::Tokenizer::FromGgufMetadata(spec);
}

std::string Now(const char* format) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), format, &tm);
  return buf;
}

// Runs `<python> <plot script> json png`. The script is $KVR_BENCH_PLOT_SCRIPT or the one in
// the source tree this binary was built from; the interpreter is $KVR_BENCH_PYTHON, else
// /usr/bin/python3 (Debian's, which has python3-matplotlib; a python3 earlier on PATH, e.g. a
// venv, may not), else python3 from PATH.
absl::Status Plot(const std::string& json_path, const std::string& png_path) {
  const char* env_script = std::getenv("KVR_BENCH_PLOT_SCRIPT");
  std::string script = env_script != nullptr ? env_script : KVR_BENCH_PLOT_SCRIPT_DEFAULT;
  const char* env_python = std::getenv("KVR_BENCH_PYTHON");
  std::string python = env_python != nullptr                   ? env_python
                       : access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3"
                                                               : "python3";
  return RunAndWait({python, script, json_path, png_path}, "--plot");
}

// Writes the JSON and the PNG of one rate's results.
absl::Status WriteOutputs(const loadgen::RunInfo& info, const loadgen::BenchmarkMetrics& metrics,
                          const loadgen::RunOutcome& outcome, const std::string& result_file,
                          const std::string& plot) {
  std::string json_path = result_file;
  bool temporary_json = false;
  if (json_path.empty() && !plot.empty()) {
    json_path = absl::StrCat(plot, ".json.tmp");
    temporary_json = true;
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << loadgen::ResultJson(info, metrics, outcome.results, outcome.duration_s).dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", json_path));
  }
  if (!plot.empty()) {
    absl::Status s = Plot(json_path, plot);
    if (temporary_json) std::filesystem::remove(json_path);
    KVR_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

absl::Status RunBench(const BenchFlags& f) {
  KVR_ASSIGN_OR_RETURN(const std::vector<double> rates, ParseRates(f.rates));
  KVR_ASSIGN_OR_RETURN(loadgen::BackendOptions backend_options, BackendOptionsOf(f.endpoint));
  if (backend_options.api_key.empty()) {
    // As `vllm bench serve` and the openai clients read it.
    if (const char* key = std::getenv("OPENAI_API_KEY"); key != nullptr) {
      backend_options.api_key = key;
    }
  }
  backend_options.chat = f.chat;

  loadgen::TokenCounter counter;
  std::optional<model::Tokenizer> tokenizer;
  if (!f.tokenizer_model.empty()) {
    KVR_ASSIGN_OR_RETURN(tokenizer, LoadTokenizer(f.tokenizer_model));
    counter = [&tokenizer](std::string_view text) -> absl::StatusOr<uint32_t> {
      KVR_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                           tokenizer->Encode(text, {.add_special = false}));
      return static_cast<uint32_t>(ids.size());
    };
  }
  const bool unbounded = f.duration_s > 0 && !f.num_prompts_given;
  // Generated and sampled datasets: one prompt per request, or a pool of 256 reused in turn
  // when the run is bounded by time only.
  const size_t n_prompts = unbounded ? 256 : f.num_prompts;
  const loadgen::GeneratedDatasetOptions gen{f.input_len, f.input_len_range, f.seed};
  std::vector<loadgen::Prompt> prompts;
  if (f.dataset == "synthetic") {
    KVR_ASSIGN_OR_RETURN(prompts, loadgen::SyntheticPrompts(n_prompts, gen, counter));
  } else if (f.dataset == "passkey") {
    KVR_ASSIGN_OR_RETURN(prompts, loadgen::PasskeyPrompts(n_prompts, gen, counter));
  } else if (f.dataset == "sharegpt") {
    loadgen::ShareGptOptions sharegpt;
    sharegpt.output_len = f.sharegpt_output_len;
    sharegpt.seed = f.seed;
    KVR_ASSIGN_OR_RETURN(prompts,
                         loadgen::LoadShareGpt(f.dataset_path, n_prompts, sharegpt, counter));
  } else {
    KVR_ASSIGN_OR_RETURN(prompts, loadgen::LoadJsonl(f.dataset_path, counter));
  }

  KVR_ASSIGN_OR_RETURN(std::unique_ptr<loadgen::Backend> backend,
                       loadgen::MakeBackend(backend_options));
  loadgen::RunOptions o;
  KVR_ASSIGN_OR_RETURN(o.request.model, backend->ResolveModel(f.model));
  o.request.output_len = f.output_len;
  o.request.ignore_eos = f.ignore_eos;
  o.request.temperature = f.temperature;
  o.request.method = f.method;
  o.request.budget = f.budget;
  o.request.timeout_s = f.request_timeout_s;
  o.max_concurrency = f.concurrency;
  o.num_requests = unbounded ? 0 : f.num_prompts;
  o.duration_s = f.duration_s;
  const bool sweep = rates.size() > 1;
  for (size_t k = 0; k < rates.size(); ++k) {
    const double rate = rates[k];
    o.arrival = {rate, f.poisson, f.burstiness, f.seed};
    // Warm-up requests go before the first rate only: the later ones find everything warm.
    o.num_warmups = k == 0 ? f.num_warmups : 0;
    std::optional<loadgen::ProgressBar> bar;
    if (!f.no_progress) {
      bar.emplace(o.num_requests, stderr,
                  std::chrono::milliseconds(isatty(STDERR_FILENO) ? 100 : 1000));
      o.on_progress = [&bar](uint64_t done, uint64_t failed) { bar->Update(done, failed); };
    } else {
      o.on_progress = nullptr;
    }
    KVR_ASSIGN_OR_RETURN(loadgen::RunOutcome outcome, loadgen::RunBenchmark(*backend, o, prompts));
    if (bar) bar->Finish();

    loadgen::SloOptions slo{f.slo_ttft_ms, f.slo_tpot_ms};
    const loadgen::BenchmarkMetrics metrics =
        loadgen::ComputeMetrics(outcome.results, outcome.duration_s, slo);
    loadgen::RunInfo info;
    info.date = Now("%Y%m%d-%H%M%S");
    info.backend = std::string(loadgen::BackendName(backend_options.kind));
    info.model_id = outcome.model;
    info.tokenizer_id = f.tokenizer_model;
    info.dataset = f.dataset;
    info.num_prompts = outcome.results.size();
    info.request_rate = rate;
    info.burstiness = f.burstiness;
    if (f.concurrency > 0) info.max_concurrency = f.concurrency;
    info.method = f.method;
    info.budget = f.budget;
    std::cout << loadgen::FormatReport(info, metrics, outcome.duration_s) << std::flush;
    KVR_RETURN_IF_ERROR(WriteOutputs(info, metrics, outcome,
                                     PerRatePath(f.result_file, rate, sweep),
                                     PerRatePath(f.plot, rate, sweep)));
  }
  return absl::OkStatus();
}

}  // namespace

void AddBenchCommand(CLI::App& app) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "load-test kvr (gRPC kvr.v1.Generation) or any OpenAI-compatible HTTP server and report "
      "latencies");
  BenchFlags& f = *flags;
  cmd->add_option("--backend", f.endpoint.backend,
                  "kvr-grpc (--target) | openai-chat | openai-completions (--base-url)")
      ->check(CLI::IsMember({"kvr-grpc", "openai-chat", "openai-completions"}))
      ->capture_default_str();
  CLI::Option* target =
      cmd->add_option("--target", f.endpoint.target, "kvr-grpc: controller address host:port")
          ->capture_default_str();
  CLI::Option* base_url = cmd->add_option("--base-url", f.endpoint.base_url,
                                          "openai-*: the API root, e.g. http://127.0.0.1:8000/v1");
  AddTlsOptions(cmd, &f.endpoint.tls);
  cmd->add_option("--api-key", f.endpoint.api_key,
                  "openai-*: sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)");
  cmd->add_flag("--chat", f.chat,
                "kvr-grpc: send text prompts as one user chat message (as openai-chat does)");
  cmd->add_option("--model", f.model, "model name (default: the first one the server lists)");
  CLI::Option* rate =
      cmd->add_option(
             "--rate,--request-rate", f.rates,
             "requests per second, or a comma-separated sweep (1,2,4,inf): one result per rate")
          ->capture_default_str();
  cmd->add_flag("--poisson", f.poisson, "Poisson arrivals (seeded) instead of a constant rate")
      ->needs(rate);
  cmd->add_option("--burstiness", f.burstiness,
                  "gamma shape of Poisson gaps (1 = Poisson; < 1 burstier)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", f.seed, "seed of arrivals, generated prompts and the ShareGPT sample");
  cmd->add_option("--concurrency", f.concurrency,
                  "most requests in flight; alone: a closed loop of N requests")
      ->check(CLI::Range(1u, 1u << 20));
  CLI::Option* num = cmd->add_option("--num-prompts", f.num_prompts, "requests to send")
                         ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32))
                         ->capture_default_str();
  cmd->add_option("--num-warmups", f.num_warmups,
                  "requests sent and awaited first, left out of the results");
  cmd->add_option("--duration", f.duration_s,
                  "stop sending after this many seconds (without --num-prompts: send until then)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--dataset", f.dataset, "synthetic | passkey | jsonl | sharegpt")
      ->check(CLI::IsMember({"synthetic", "passkey", "jsonl", "sharegpt"}))
      ->capture_default_str();
  cmd->add_option("--dataset-path", f.dataset_path,
                  "jsonl: one {\"prompt\"|\"messages\", \"max_tokens\"?} per line; sharegpt: "
                  "the JSON array of {\"conversations\": [...]} vllm bench reads")
      ->check(CLI::ExistingFile);
  cmd->add_option("--sharegpt-output-len", f.sharegpt_output_len,
                  "sharegpt: max tokens of every request (default: the reply's length)")
      ->check(CLI::Range(1u, 1u << 24));
  cmd->add_option("--input-len", f.input_len, "prompt tokens (synthetic, passkey)")
      ->check(CLI::Range(1u, 1u << 24))
      ->capture_default_str();
  cmd->add_option("--input-len-range", f.input_len_range,
                  "prompt lengths are uniform in input-len +- this");
  cmd->add_option("--tokenizer-model", f.tokenizer_model,
                  "GGUF file or Hugging Face dir whose tokenizer sizes the prompts (else: words)")
      ->check(CLI::ExistingPath);
  cmd->add_option("--output-len", f.output_len, "max tokens to generate per request")
      ->check(CLI::Range(1u, 1u << 24))
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", f.ignore_eos, "generate output-len tokens even past EOS");
  cmd->add_option("--temperature", f.temperature, "sampling temperature (0 = greedy)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--method", f.method, "retrieval method (default: the controller's)");
  cmd->add_option("--budget", f.budget, "retrieval budget, tokens per KV head")
      ->check(CLI::Range(1u, 1u << 30));
  cmd->add_option("--slo-ttft-ms", f.slo_ttft_ms, "TTFT SLO for goodput (ms)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--slo-tpot-ms", f.slo_tpot_ms, "TPOT SLO for goodput (ms)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--request-timeout", f.request_timeout_s, "per-request deadline (s)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--result-file", f.result_file,
                  "write the results as JSON (vllm layout); a sweep writes F-rate-R.json per rate");
  cmd->add_option("--plot", f.plot, "write a PNG latency plot (a sweep: F-rate-R.png per rate)");
  cmd->add_flag("--no-progress", f.no_progress, "no progress bar on stderr");
  cmd->callback([flags, num, target, base_url] {
    flags->num_prompts_given = num->count() > 0;
    const bool file_dataset = flags->dataset == "jsonl" || flags->dataset == "sharegpt";
    if (file_dataset && flags->dataset_path.empty()) {
      throw CLI::ValidationError("--dataset-path", "is required with --dataset " + flags->dataset);
    }
    if (!file_dataset && !flags->dataset_path.empty()) {
      throw CLI::ValidationError("--dataset-path", "is only used with --dataset jsonl|sharegpt");
    }
    if (flags->sharegpt_output_len && flags->dataset != "sharegpt") {
      throw CLI::ValidationError("--sharegpt-output-len", "is only used with --dataset sharegpt");
    }
    const bool grpc = flags->endpoint.backend == "kvr-grpc";
    if (grpc && base_url->count() > 0) {
      throw CLI::ValidationError("--base-url",
                                 "is for --backend openai-chat|openai-completions; kvr-grpc "
                                 "takes --target");
    }
    if (!grpc && target->count() > 0) {
      throw CLI::ValidationError("--target", "is for --backend kvr-grpc; openai-* take --base-url");
    }
    if (!grpc && flags->endpoint.base_url.empty()) {
      throw CLI::ValidationError("--base-url", "is required with --backend " +
                                                   flags->endpoint.backend +
                                                   " (e.g. http://127.0.0.1:8000/v1)");
    }
    if (!grpc && flags->chat) {
      throw CLI::ValidationError("--chat",
                                 "is for --backend kvr-grpc (openai-chat always sends "
                                 "chat messages)");
    }
    ExitIfError("bench", RunBench(*flags));
  });
}

}  // namespace kvr::tools
