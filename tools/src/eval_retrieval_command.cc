// kvr eval retrieval: every retrieval method and budget against dense attention on a real model
// (retrieval/eval/retrieval_eval.h says what is measured and how).

#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "commands.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/loader.h"
#include "retrieval_eval.h"

namespace kvr::tools {
namespace {

struct EvalRetrievalFlags {
  std::string model = "smollm2-135m-instruct";
  retrieval::eval::EvalOptions eval;
  std::vector<std::string> options;  // method options "name=value"
  std::string json;
  int threads = 0;
  std::string weights = "packed";
};

absl::Status RunEvalRetrieval(EvalRetrievalFlags& f) {
  for (const std::string& kv : f.options) {
    std::vector<std::string> parts = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (parts.size() != 2 || parts[0].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--option wants name=value, got '", kv, "'"));
    }
    f.eval.method_options[parts[0]] = parts[1];
  }
  ThreadPool pool(f.threads > 0 ? static_cast<size_t>(f.threads) : 0);
  model::LoadOptions load_options;
  absl::StatusOr<model::WeightStorage> storage = model::ParseWeightStorage(f.weights);
  if (!storage.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--weights: ", storage.status().message()));
  }
  load_options.weights = *storage;
  KVR_ASSIGN_OR_RETURN(model::LoadedModel loaded, model::LoadModel(f.model, load_options, &pool));
  KVR_ASSIGN_OR_RETURN(
      std::vector<retrieval::eval::EvalRow> rows,
      retrieval::eval::RunRetrievalEval(f.eval, loaded, &pool, [](const std::string& line) {
        std::cerr << "[eval] " << line << std::endl;
      }));
  std::cout << retrieval::eval::FormatTable(rows);
  if (!f.json.empty()) {
    std::ofstream out(f.json);
    if (!out) return absl::NotFoundError(absl::StrCat("cannot write --json ", f.json));
    out << retrieval::eval::ToJson(f.eval, rows) << "\n";
  }
  return absl::OkStatus();
}

}  // namespace

void AddEvalCommand(CLI::App& app) {
  CLI::App* eval = app.add_subcommand("eval", "quality evaluations");
  eval->require_subcommand(1);
  auto flags = std::make_shared<EvalRetrievalFlags>();
  CLI::App* cmd =
      eval->add_subcommand("retrieval",
                           "retrieval methods vs dense attention: recall, mass, output error, NLL, "
                           "agreement, summary bytes, selection time");
  cmd->add_option("--model", flags->model, "GGUF/HF path or known name")->capture_default_str();
  cmd->add_option("--weights", flags->weights,
                  "GGUF weight storage: packed (the file's formats, 8-bit activations in decode; "
                  "the fast path) or float32 (dequantised at load; the exact reference)")
      ->capture_default_str();
  cmd->add_option("--context", flags->eval.contexts, "prefill lengths in tokens")
      ->capture_default_str();
  cmd->add_option("--budget", flags->eval.budgets, "tokens per KV head")->capture_default_str();
  cmd->add_option("--method", flags->eval.methods,
                  "methods (default: all registered); NAME:OPT=V[,OPT=V] runs NAME with those "
                  "options (an ablation sharing the dense prefill)");
  cmd->add_option("--steps", flags->eval.steps, "teacher-forced decode steps")
      ->capture_default_str();
  cmd->add_option("--free-tokens", flags->eval.free_tokens,
                  "greedy tokens decoded freely per run, compared with dense greedy (0: off)")
      ->capture_default_str();
  cmd->add_option("--hot-cache-rows", flags->eval.hot_cache_rows,
                  "rows per layer and KV head of the GPU hot cache replayed on the free "
                  "decoding's selections (0: the budget)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--trace-dir", flags->eval.trace_dir,
                  "write every free decoding's selections into this folder "
                  "(<prompt>_<context>_<method>_<budget>.kvrsel), for kvr bench decode --replay")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--sink", flags->eval.n_sink, "sink tokens")->capture_default_str();
  cmd->add_option("--local", flags->eval.local_window, "local window tokens")
      ->capture_default_str();
  cmd->add_option("--text-file", flags->eval.text_files,
                  "natural text (default: /usr/share/common-licenses texts)");
  cmd->add_flag("--passkey", flags->eval.passkey, "also run a generated passkey prompt");
  cmd->add_option("--a2ats-codebooks", flags->eval.a2ats_codebooks,
                  "codebook file from `kvr calibrate` (a2ats is skipped without it)");
  cmd->add_option("--row-format", flags->eval.row_formats,
                  "formats of the rows a decode step fetches from the store, each run beside "
                  "the others: cache (as the KV cache holds them), bf16, fp8 (e4m3, a float "
                  "scale per row and KV head)")
      ->capture_default_str();
  cmd->add_option("--thin-keep", flags->eval.thin_keep,
                  "also run the prompt thinned as the KV store thins a cached prefix "
                  "(cached_eviction: thin), keeping these fractions of every layer and KV "
                  "head's pages, then attending over the kept rows (rows thin-kd)")
      ->delimiter(',');
  cmd->add_option("--thin-page-rows", flags->eval.thin_page_rows,
                  "rows per store page for --thin-keep (64 KiB pages of f32 rows: 128 for "
                  "head_dim 64)")
      ->capture_default_str();
  cmd->add_flag("--thin-random", flags->eval.thin_random,
                "with --thin-keep, also drop as many pages at random (rows thin-rnd, a control)");
  cmd->add_option("--option", flags->options, "method option name=value (repeatable)");
  cmd->add_option("--json", flags->json, "write the rows as JSON here");
  cmd->add_option("--threads", flags->threads, "worker threads (0 = all cores)");
  cmd->add_option("--prefill-chunk", flags->eval.prefill_chunk, "prefill chunk in tokens")
      ->capture_default_str();
  AddEvalEndpointCommand(*eval);
  cmd->callback([flags] { ExitIfError("eval retrieval", RunEvalRetrieval(*flags)); });
}

}  // namespace kvr::tools
