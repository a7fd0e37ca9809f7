// kvr bench: the load generator. Streams requests to a controller's kvr.v1.Generation at a
// constant or Poisson rate, or in a closed loop of N concurrent requests, and reports
// throughput, goodput and latency distributions (tools/bench, kvr::loadgen) as text, as JSON
// in the layout of `vllm bench serve --save-result`, and as a PNG (tools/scripts/plot_bench.py).

#include <spawn.h>
#include <sys/wait.h>
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
#include "absl/strings/str_cat.h"
#include "commands.h"
#include "kvr/common/status.h"
#include "kvr/loadgen/dataset.h"
#include "kvr/loadgen/metrics.h"
#include "kvr/loadgen/progress.h"
#include "kvr/loadgen/report.h"
#include "kvr/loadgen/runner.h"
#include "kvr/model/gguf.h"
#include "kvr/model/loader.h"
#include "kvr/model/tokenizer.h"

extern char** environ;

namespace kvr::tools {
namespace {

struct BenchFlags {
  std::string target = "127.0.0.1:50051";
  std::string model;
  double rate = std::numeric_limits<double>::infinity();
  bool poisson = false;
  double burstiness = 1.0;
  uint64_t seed = 0;
  uint32_t concurrency = 0;
  uint32_t num_warmups = 0;
  uint64_t num_prompts = 100;
  double duration_s = 0;
  std::string dataset = "synthetic";
  std::string dataset_path;
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
  std::vector<std::string> argv = {python, script, json_path, png_path};
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, python.c_str(), nullptr, nullptr, args.data(), environ) != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", python, " for --plot"));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat("--plot: ", script, " failed (status ", status, ")"));
  }
  return absl::OkStatus();
}

absl::Status RunBench(const BenchFlags& f) {
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
  // Generated datasets: one prompt per request, or a pool of 256 reused in turn when the run
  // is bounded by time only.
  const size_t n_prompts = unbounded ? 256 : f.num_prompts;
  const loadgen::GeneratedDatasetOptions gen{f.input_len, f.input_len_range, f.seed};
  std::vector<loadgen::Prompt> prompts;
  if (f.dataset == "synthetic") {
    KVR_ASSIGN_OR_RETURN(prompts, loadgen::SyntheticPrompts(n_prompts, gen, counter));
  } else if (f.dataset == "passkey") {
    KVR_ASSIGN_OR_RETURN(prompts, loadgen::PasskeyPrompts(n_prompts, gen, counter));
  } else {
    KVR_ASSIGN_OR_RETURN(prompts, loadgen::LoadJsonl(f.dataset_path, counter));
  }

  loadgen::RunOptions o;
  o.target = f.target;
  o.model = f.model;
  o.arrival = {f.rate, f.poisson, f.burstiness, f.seed};
  o.max_concurrency = f.concurrency;
  o.num_warmups = f.num_warmups;
  o.num_requests = unbounded ? 0 : f.num_prompts;
  o.duration_s = f.duration_s;
  o.output_len = f.output_len;
  o.ignore_eos = f.ignore_eos;
  o.temperature = f.temperature;
  o.method = f.method;
  o.budget = f.budget;
  o.request_timeout_s = f.request_timeout_s;
  std::optional<loadgen::ProgressBar> bar;
  if (!f.no_progress) {
    bar.emplace(o.num_requests, stderr,
                std::chrono::milliseconds(isatty(STDERR_FILENO) ? 100 : 1000));
    o.on_progress = [&bar](uint64_t done, uint64_t failed) { bar->Update(done, failed); };
  }
  KVR_ASSIGN_OR_RETURN(loadgen::RunOutcome outcome, loadgen::RunBenchmark(o, prompts));
  if (bar) bar->Finish();

  loadgen::SloOptions slo{f.slo_ttft_ms, f.slo_tpot_ms};
  const loadgen::BenchmarkMetrics metrics =
      loadgen::ComputeMetrics(outcome.results, outcome.duration_s, slo);
  loadgen::RunInfo info;
  info.date = Now("%Y%m%d-%H%M%S");
  info.model_id = outcome.model;
  info.tokenizer_id = f.tokenizer_model;
  info.dataset = f.dataset;
  info.num_prompts = outcome.results.size();
  info.request_rate = f.rate;
  info.burstiness = f.burstiness;
  if (f.concurrency > 0) info.max_concurrency = f.concurrency;
  info.method = f.method;
  info.budget = f.budget;
  std::cout << loadgen::FormatReport(info, metrics, outcome.duration_s) << std::flush;

  std::string json_path = f.result_file;
  bool temporary_json = false;
  if (json_path.empty() && !f.plot.empty()) {
    json_path = absl::StrCat(f.plot, ".json.tmp");
    temporary_json = true;
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << loadgen::ResultJson(info, metrics, outcome.results, outcome.duration_s).dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", json_path));
  }
  if (!f.plot.empty()) {
    absl::Status s = Plot(json_path, f.plot);
    if (temporary_json) std::filesystem::remove(json_path);
    KVR_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

}  // namespace

void AddBenchCommand(CLI::App& app) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = app.add_subcommand(
      "bench", "load-test a kvr controller over gRPC (kvr.v1.Generation) and report latencies");
  BenchFlags& f = *flags;
  cmd->add_option("--target", f.target, "controller address host:port")->capture_default_str();
  cmd->add_option("--model", f.model, "model name (default: the first one ListModels names)");
  CLI::Option* rate = cmd->add_option("--rate", f.rate, "requests per second (default: inf)")
                          ->check(CLI::PositiveNumber);
  cmd->add_flag("--poisson", f.poisson, "Poisson arrivals (seeded) instead of a constant rate")
      ->needs(rate);
  cmd->add_option("--burstiness", f.burstiness,
                  "gamma shape of Poisson gaps (1 = Poisson; < 1 burstier)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", f.seed, "seed of arrivals and generated prompts");
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
  cmd->add_option("--dataset", f.dataset, "synthetic | passkey | jsonl")
      ->check(CLI::IsMember({"synthetic", "passkey", "jsonl"}))
      ->capture_default_str();
  cmd->add_option("--dataset-path", f.dataset_path,
                  "JSONL file: one {\"prompt\"|\"messages\", \"max_tokens\"?} per line")
      ->check(CLI::ExistingFile);
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
  cmd->add_option("--result-file", f.result_file, "write the results as JSON (vllm layout)");
  cmd->add_option("--plot", f.plot, "write a PNG latency plot");
  cmd->add_flag("--no-progress", f.no_progress, "no progress bar on stderr");
  cmd->callback([flags, num] {
    flags->num_prompts_given = num->count() > 0;
    if (flags->dataset == "jsonl" && flags->dataset_path.empty()) {
      throw CLI::ValidationError("--dataset-path", "is required with --dataset jsonl");
    }
    if (flags->dataset != "jsonl" && !flags->dataset_path.empty()) {
      throw CLI::ValidationError("--dataset-path", "is only used with --dataset jsonl");
    }
    if (absl::Status s = RunBench(*flags); !s.ok()) {
      std::cerr << "kvr bench: " << s << "\n";
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace kvr::tools
