// kvr calibrate: builds the A2ATS query-aware codebooks of a model from sample text
// (docs/codebook-format.md). Runs the text through the CPU runtime, records every layer's
// queries and keys through the attention seam (no runtime changes), then builds one codebook per
// (layer, KV head): Cholesky of the WRoPE query second moment, k-means++ and Lloyd in the
// whitened space.

#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/loader.h"
#include "kvr/retrieval/codebook.h"

namespace kvr::tools {
namespace {

struct CalibrateOptions {
  std::string model = "smollm2-135m-instruct";
  std::string load_format = "auto";
  std::vector<std::string> texts;
  std::string out;
  int64_t max_tokens = 16384;
  int64_t sequence_tokens = 4096;
  int64_t prefill_chunk = 512;
  int threads = 0;
  retrieval::CodebookParams codebook;
};

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Token sequences of at most `sequence_tokens` each, from the files in order, `max_tokens` in
// all. Long files become several sequences (positions restart at 0 in each, as in serving).
absl::StatusOr<std::vector<std::vector<int32_t>>> Sequences(const CalibrateOptions& o,
                                                            const model::LoadedModel& loaded) {
  std::vector<std::vector<int32_t>> out;
  int64_t total = 0;
  for (const std::string& path : o.texts) {
    if (total >= o.max_tokens) break;
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read --text ", path));
    std::stringstream buffer;
    buffer << in.rdbuf();
    const std::string text = buffer.str();
    std::vector<int32_t> ids;
    if (loaded.tokenizer) {
      KVR_ASSIGN_OR_RETURN(ids, loaded.tokenizer->Encode(text));
    } else {
      // Dummy weights have no tokenizer; bytes modulo the vocabulary drive the forward pass.
      for (unsigned char ch : text) ids.push_back(ch % loaded.model->config().vocab);
    }
    for (size_t begin = 0; begin < ids.size() && total < o.max_tokens;) {
      const int64_t n = std::min<int64_t>(
          {o.sequence_tokens, o.max_tokens - total, static_cast<int64_t>(ids.size() - begin)});
      out.emplace_back(ids.begin() + begin, ids.begin() + begin + n);
      begin += n;
      total += n;
    }
  }
  if (total == 0) return absl::InvalidArgumentError("the --text files hold no tokens");
  return out;
}

absl::Status RunCalibrate(const CalibrateOptions& o) {
  if (o.texts.empty()) return absl::InvalidArgumentError("give at least one --text FILE");
  if (o.out.empty()) return absl::InvalidArgumentError("--out is required");
  if (o.max_tokens < 1 || o.sequence_tokens < 1 || o.prefill_chunk < 1) {
    return absl::InvalidArgumentError(
        "--max-tokens, --sequence-tokens and --prefill-chunk must be >= 1");
  }
  KVR_RETURN_IF_ERROR(o.codebook.Validate());
  KVR_ASSIGN_OR_RETURN(model::LoadFormat format, model::ParseLoadFormat(o.load_format));
  ThreadPool pool(o.threads > 0 ? static_cast<size_t>(o.threads) : 0);
  // Effective configuration first.
  std::cerr << absl::StrFormat(
      "kvr calibrate: model %s, texts %d, max tokens %d in sequences of %d, codebook size %d, "
      "WRoPE b %d (w %d), iterations %d, keys kept per head %d, ridge %g, threads %d -> %s\n",
      o.model, static_cast<int>(o.texts.size()), o.max_tokens, o.sequence_tokens,
      o.codebook.codebook_size, o.codebook.wrope_offset, o.codebook.wrope_window,
      o.codebook.max_iterations, o.codebook.max_keys_per_head, o.codebook.ridge,
      static_cast<int>(pool.size()), o.out);

  model::LoadOptions load_options;
  load_options.format = format;
  KVR_ASSIGN_OR_RETURN(model::LoadedModel loaded, model::LoadModel(o.model, load_options, &pool));
  KVR_ASSIGN_OR_RETURN(retrieval::ModelFingerprint fingerprint,
                       retrieval::FingerprintOf(*loaded.model));
  KVR_ASSIGN_OR_RETURN(auto sequences, Sequences(o, loaded));
  int64_t n_tokens = 0;
  for (const auto& s : sequences) n_tokens += static_cast<int64_t>(s.size());

  KVR_ASSIGN_OR_RETURN(retrieval::CalibrationSamples samples,
                       retrieval::CalibrationSamples::Create(fingerprint, o.codebook));
  const auto run_start = Clock::now();
  KVR_RETURN_IF_ERROR(
      retrieval::CollectCalibrationSamples(*loaded.model, sequences, samples, o.prefill_chunk));
  const double run_s = Seconds(run_start);
  std::cerr << absl::StrFormat("ran %d tokens in %d sequences through %s in %.1f s\n", n_tokens,
                               static_cast<int>(sequences.size()), loaded.source, run_s);

  const auto build_start = Clock::now();
  KVR_ASSIGN_OR_RETURN(auto books, retrieval::BuildCodebooks(samples, &pool));
  const double build_s = Seconds(build_start);
  KVR_RETURN_IF_ERROR(books->Save(o.out));
  const int64_t file_bytes = static_cast<int64_t>(books->Serialize().size());
  std::cerr << absl::StrFormat(
      "built %d codebooks (%d layers x %d KV heads, %d codewords of dim %d) in %.1f s\n",
      fingerprint.n_layers * fingerprint.n_kv_heads, fingerprint.n_layers, fingerprint.n_kv_heads,
      books->head(0, 0).size, fingerprint.head_dim, build_s);
  std::cout << absl::StrFormat("wrote %s: %.1f MiB, model '%s' hash %016x, content hash %016x\n",
                               o.out, file_bytes / 1048576.0, fingerprint.model_name,
                               fingerprint.model_hash, books->content_hash());
  return absl::OkStatus();
}

}  // namespace

void AddCalibrateCommand(CLI::App& app) {
  auto options = std::make_shared<CalibrateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate", "build A2ATS query-aware codebooks for a model from sample text");
  cmd->add_option("--model", options->model,
                  "GGUF file, Hugging Face directory or a known name (smollm2-135m-instruct)")
      ->capture_default_str();
  cmd->add_option("--load-format", options->load_format, "auto|gguf|hf|dummy")
      ->check(CLI::IsMember({"auto", "gguf", "hf", "dummy"}))
      ->capture_default_str();
  cmd->add_option("--text", options->texts,
                  "sample text file(s) (e.g. /usr/share/common-licenses/*)")
      ->required()
      ->expected(1, -1);
  cmd->add_option("--out", options->out, "codebook file to write (.kvrcb)")->required();
  cmd->add_option("--max-tokens", options->max_tokens, "calibration tokens in all")
      ->capture_default_str();
  cmd->add_option("--sequence-tokens", options->sequence_tokens,
                  "tokens per sequence (positions restart in each)")
      ->capture_default_str();
  cmd->add_option("--prefill-chunk", options->prefill_chunk, "prefill chunk in tokens")
      ->capture_default_str();
  cmd->add_option("--codebook-size", options->codebook.codebook_size,
                  "codewords per (layer, KV head), <= 65536")
      ->capture_default_str();
  cmd->add_option("--wrope-offset", options->codebook.wrope_offset,
                  "WRoPE fixed relative position b")
      ->capture_default_str();
  cmd->add_option("--wrope-window", options->codebook.wrope_window,
                  "WRoPE window w (recorded; kvr's local window covers it)")
      ->capture_default_str();
  cmd->add_option("--iterations", options->codebook.max_iterations, "Lloyd iterations")
      ->capture_default_str();
  cmd->add_option("--max-keys-per-head", options->codebook.max_keys_per_head,
                  "keys kept per (layer, KV head) for k-means (reservoir sample)")
      ->capture_default_str();
  cmd->add_option("--ridge", options->codebook.ridge,
                  "relative ridge added to the query second moment")
      ->capture_default_str();
  cmd->add_option("--seed", options->codebook.seed, "k-means++ / sampling seed")
      ->capture_default_str();
  cmd->add_option("--threads", options->threads, "worker threads (0 = all cores)")
      ->capture_default_str();
  cmd->callback([options] { ExitIfError("calibrate", RunCalibrate(*options)); });
}

}  // namespace kvr::tools
