// kvr eval endpoint: the long-context task suite (tools/eval, kvr::eval_endpoint) through a
// cluster's public API (gRPC, or the OpenAI-compatible HTTP API: --backend openai-completions
// --base-url URL), for each retrieval method and budget asked, with `full` as the
// reference: a table on stdout, optionally JSON (--json), a PNG (--png) and a quality gate
// against recorded figures (--gate; with --results, on a result file written before).

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "endpoint_flags.h"
#include "kvr/common/paths.h"
#include "kvr/common/status.h"
#include "kvr/eval_endpoint/gate.h"
#include "kvr/eval_endpoint/suite.h"
#include "kvr/eval_endpoint/tasks.h"
#include "kvr/loadgen/backend.h"
#include "kvr/model/gguf.h"
#include "kvr/model/loader.h"
#include "kvr/model/tokenizer.h"
#include "spawn.h"
#include "tls_options.h"

namespace kvr::tools {
namespace {

namespace ee = eval_endpoint;

struct EvalEndpointFlags {
  EndpointFlags endpoint;
  std::string model;
  ee::SuiteOptions suite;
  std::string tokenizer_model;
  std::string corpus_dir = "/usr/share/common-licenses";
  std::string json;
  std::string png;
  std::string gate;
  std::string results;
  bool quiet = false;
};

absl::StatusOr<model::Tokenizer> LoadTokenizer(const std::string& path) {
  if (std::filesystem::is_directory(path)) return model::Tokenizer::FromHuggingFaceDir(path);
  KVR_ASSIGN_OR_RETURN(model::GgufFile file, model::GgufFile::Open(path));
  KVR_ASSIGN_OR_RETURN(model::TokenizerSpec spec, model::TokenizerSpecFromGguf(file));
  return model::Tokenizer::FromGgufMetadata(spec);
}

absl::StatusOr<nlohmann::json> ReadJson(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON"));
  return j;
}

// The interpreter of the plot script: $KVR_EVAL_PYTHON, else $KVR_TEST_PYTHON, else the venv
// scripts/python-env.sh makes (it has matplotlib), else python3 from PATH.
std::string PlotPython() {
  for (const char* name : {"KVR_EVAL_PYTHON", "KVR_TEST_PYTHON"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return v;
  }
  const std::string venv = CacheDir() + "/venv/bin/python";
  return access(venv.c_str(), X_OK) == 0 ? venv : "python3";
}

absl::Status Plot(const std::string& json_path, const std::string& png_path) {
  const char* env_script = std::getenv("KVR_EVAL_PLOT_SCRIPT");
  const std::string script = env_script != nullptr ? env_script : KVR_EVAL_PLOT_SCRIPT_DEFAULT;
  return RunAndWait({PlotPython(), script, json_path, png_path}, "--png");
}

absl::Status CheckGateOn(const ee::Gate& gate, const std::vector<ee::GroupResult>& groups) {
  const ee::GateOutcome outcome = ee::CheckGate(gate, groups);
  std::cout << outcome.report << std::flush;
  if (!outcome.passed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("quality gate failed: ", absl::StrJoin(outcome.failures, "; ")));
  }
  return absl::OkStatus();
}

absl::Status RunEvalEndpoint(EvalEndpointFlags& f) {
  std::optional<ee::Gate> gate;
  if (!f.gate.empty()) {
    KVR_ASSIGN_OR_RETURN(const nlohmann::json j, ReadJson(f.gate, "--gate"));
    KVR_ASSIGN_OR_RETURN(gate, ee::ParseGate(j));
  }
  if (!f.results.empty()) {  // the gate on a result file: nothing is sent
    KVR_ASSIGN_OR_RETURN(const nlohmann::json j, ReadJson(f.results, "--results"));
    KVR_ASSIGN_OR_RETURN(const std::vector<ee::GroupResult> groups, ee::GroupsFromJson(j));
    std::cout << ee::FormatTable(groups);
    return CheckGateOn(*gate, groups);
  }
  if (gate) {
    // The gate's recorded settings, so that its figures compare like with like.
    const uint32_t concurrency = f.suite.concurrency;
    const double timeout = f.suite.request_timeout_s;
    const uint32_t context = f.suite.context;
    f.suite = gate->run;
    f.suite.concurrency = concurrency;
    f.suite.request_timeout_s = timeout;
    f.suite.context = context;
    std::cerr << "kvr eval endpoint: the gate's settings: methods "
              << absl::StrJoin(f.suite.methods, ",") << ", budget " << f.suite.budgets[0]
              << ", length " << f.suite.lengths[0] << ", " << f.suite.samples
              << " samples per task, seed " << f.suite.seed << "\n";
  }

  const std::string tokenizer_path =
      f.tokenizer_model.empty() ? TestModelPath() : f.tokenizer_model;
  KVR_ASSIGN_OR_RETURN(const model::Tokenizer tokenizer, LoadTokenizer(tokenizer_path));
  const ee::TokenCounter counter = [&tokenizer](std::string_view text) -> absl::StatusOr<uint32_t> {
    KVR_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(text, {}));
    return static_cast<uint32_t>(ids.size());
  };
  const std::vector<std::string>& tasks = f.suite.tasks.empty() ? ee::TaskNames() : f.suite.tasks;
  std::vector<std::string> corpus, corpus_files;
  if (std::find(tasks.begin(), tasks.end(), "qa_licenses") != tasks.end()) {
    KVR_ASSIGN_OR_RETURN(corpus, ee::ReadCorpus(f.corpus_dir, &corpus_files));
  }
  KVR_ASSIGN_OR_RETURN(const std::vector<ee::Sample> samples,
                       ee::GenerateSamples(f.suite, counter, &corpus));

  KVR_ASSIGN_OR_RETURN(const loadgen::BackendOptions backend_options, BackendOptionsOf(f.endpoint));
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<loadgen::Backend> backend,
                       loadgen::MakeBackend(backend_options));
  KVR_ASSIGN_OR_RETURN(const std::string model, backend->ResolveModel(f.model));
  std::cerr << "kvr eval endpoint: " << samples.size() << " prompts (" << tasks.size()
            << " tasks) to " << f.endpoint.address() << " over " << f.endpoint.backend << " ("
            << model << ")\n";
  KVR_ASSIGN_OR_RETURN(
      const ee::SuiteReport report,
      ee::RunSuite(*backend, model, f.suite, samples, [&f](const std::string& line) {
        if (!f.quiet) std::cerr << "kvr eval endpoint: " << line << std::endl;
      }));
  std::cout << ee::FormatTable(report.groups) << std::flush;

  std::string json_path = f.json;
  const bool temporary_json = json_path.empty() && !f.png.empty();
  if (temporary_json) json_path = absl::StrCat(f.png, ".json.tmp");
  if (!json_path.empty()) {
    const nlohmann::json extra = {{"backend", f.endpoint.backend},
                                  {"target", f.endpoint.address()},
                                  {"tokenizer", tokenizer_path},
                                  {"corpus_dir", f.corpus_dir},
                                  {"corpus_files", corpus_files}};
    std::ofstream out(json_path);
    out << ee::ToJson(f.suite, report, extra).dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", json_path));
  }
  if (!f.png.empty()) {
    const absl::Status s = Plot(json_path, f.png);
    if (temporary_json) std::filesystem::remove(json_path);
    KVR_RETURN_IF_ERROR(s);
  }
  if (gate) return CheckGateOn(*gate, report.groups);
  return absl::OkStatus();
}

}  // namespace

void AddEvalEndpointCommand(CLI::App& eval) {
  auto flags = std::make_shared<EvalEndpointFlags>();
  EvalEndpointFlags& f = *flags;
  f.suite.methods = {"full", "exact", "streaming", "quest"};
  f.suite.budgets = {128};
  f.suite.lengths = {1024, 4096};
  f.suite.concurrency = 2;
  CLI::App* cmd = eval.add_subcommand(
      "endpoint",
      "long-context tasks (needles, variable tracking, common words, QA over licence texts) "
      "through a cluster's gRPC or HTTP API: accuracy and agreement with full per method and "
      "budget");
  cmd->add_option("--backend", f.endpoint.backend,
                  "kvr-grpc (--target) or the OpenAI-compatible HTTP API: openai-completions "
                  "(the prompt as text, as over gRPC) or openai-chat (--base-url)")
      ->check(CLI::IsMember({"kvr-grpc", "openai-completions", "openai-chat"}))
      ->capture_default_str();
  cmd->add_option("--target", f.endpoint.target, "kvr-grpc: controller address host:port")
      ->capture_default_str();
  cmd->add_option("--base-url", f.endpoint.base_url,
                  "openai-*: the API root, e.g. http://127.0.0.1:8000/v1");
  cmd->add_option("--api-key", f.endpoint.api_key, "openai-*: sent as Authorization: Bearer KEY");
  AddTlsOptions(cmd, &f.endpoint.tls);
  cmd->add_option("--model", f.model, "model name (default: the first one the server lists)");
  cmd->add_option("--methods", f.suite.methods, "retrieval methods; full is always run first")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--budgets", f.suite.budgets,
                  "budgets (tokens per KV head) of every method but full")
      ->delimiter(',')
      ->check(CLI::Range(1u, 1u << 30))
      ->capture_default_str();
  cmd->add_option("--lengths", f.suite.lengths, "prompt lengths in tokens")
      ->delimiter(',')
      ->check(CLI::Range(16u, 1u << 24))
      ->capture_default_str();
  cmd->add_option("--tasks", f.suite.tasks,
                  absl::StrCat("tasks (default: all: ", absl::StrJoin(ee::TaskNames(), ","), ")"))
      ->delimiter(',')
      ->check(CLI::IsMember(ee::TaskNames()));
  cmd->add_option("--samples", f.suite.samples, "samples per task and length")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  cmd->add_option("--seed", f.suite.seed, "seed of every generated sample")->capture_default_str();
  cmd->add_option("--concurrency", f.suite.concurrency, "requests in flight per method and budget")
      ->check(CLI::Range(1u, 1024u))
      ->capture_default_str();
  cmd->add_option("--sink", f.suite.n_sink, "sink tokens of every request (default: the server's)");
  cmd->add_option("--local", f.suite.local_window,
                  "local window of every request (default: the server's)");
  cmd->add_option("--context", f.suite.context,
                  "the model's context: a prompt is at most this minus its answer's tokens")
      ->check(CLI::Range(64u, 1u << 24))
      ->capture_default_str();
  cmd->add_option("--tokenizer-model", f.tokenizer_model,
                  "GGUF file or Hugging Face dir whose tokenizer fits prompts to the lengths "
                  "(default: the SmolLM2 test model, $KVR_TEST_MODEL)")
      ->check(CLI::ExistingPath);
  cmd->add_option("--corpus-dir", f.corpus_dir, "qa_licenses: the texts to hide the fact in")
      ->capture_default_str();
  cmd->add_option("--request-timeout", f.suite.request_timeout_s, "per-request deadline (s)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--json", f.json, "write the settings, groups and every answer as JSON");
  cmd->add_option("--png", f.png, "write a PNG of accuracy per task, method and budget");
  cmd->add_option("--gate", f.gate,
                  "check the run against recorded figures (tools/eval/gate/*.json; its settings "
                  "replace methods, budgets, lengths, tasks, samples, seed, sink and local)")
      ->check(CLI::ExistingFile);
  CLI::Option* results =
      cmd->add_option("--results", f.results,
                      "with --gate: check this result file (--json of an earlier run) instead "
                      "of running")
          ->check(CLI::ExistingFile);
  cmd->add_flag("--quiet", f.quiet, "no progress lines on stderr");
  cmd->callback([flags, results] {
    if (results->count() > 0 && flags->gate.empty()) {
      throw CLI::ValidationError("--results", "is only used with --gate");
    }
    // A failed quality gate (FAILED_PRECONDITION) exits 2, any other error 1.
    const absl::Status s = RunEvalEndpoint(*flags);
    ExitIfError("eval endpoint", s, s.code() == absl::StatusCode::kFailedPrecondition ? 2 : 1);
  });
}

}  // namespace kvr::tools
