// kvr generate: one prompt through the CPU runtime with dense attention, streaming the text.

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "commands.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"

namespace kvr::tools {
namespace {

struct GenerateOptions {
  std::string model = "smollm2-135m-instruct";
  std::string prompt;
  std::string prompt_file;
  int64_t prompt_tokens = 0;
  bool chat = false;
  int max_tokens = 128;
  float temperature = 0.f;
  float top_p = 1.f;
  uint64_t seed = 0;
  int threads = 0;
  std::string load_format = "auto";
  int layers = 0;
  int64_t chunk = 512;
  bool ignore_eos = false;
};

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The prompt's token ids. Dummy models have no tokenizer: their prompt is its bytes (mod the
// vocabulary), which is enough to drive the forward pass for timing.
absl::StatusOr<std::vector<int32_t>> PromptTokens(const GenerateOptions& o,
                                                  const model::LoadedModel& loaded) {
  std::string text = o.prompt;
  if (!o.prompt_file.empty()) {
    std::ifstream in(o.prompt_file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read --prompt-file ", o.prompt_file));
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  if (text.empty())
    return absl::InvalidArgumentError("the prompt is empty (--prompt or --prompt-file)");
  std::vector<int32_t> ids;
  const int vocab = loaded.model->config().vocab;
  if (!loaded.tokenizer) {
    for (unsigned char ch : text) ids.push_back(static_cast<int32_t>(ch % vocab));
  } else if (o.chat) {
    const model::ChatMessage message{"user", text};
    KVR_ASSIGN_OR_RETURN(std::string rendered,
                         loaded.tokenizer->ApplyChatTemplate(std::span(&message, 1), true));
    KVR_ASSIGN_OR_RETURN(
        ids, loaded.tokenizer->Encode(rendered, {.add_special = false, .parse_special = true}));
  } else {
    KVR_ASSIGN_OR_RETURN(ids, loaded.tokenizer->Encode(text));
  }
  if (ids.empty()) return absl::InvalidArgumentError("the prompt encodes to no tokens");
  if (o.prompt_tokens > 0) {
    // Repeat (or cut) the prompt to exactly --prompt-tokens tokens, for benchmarks.
    std::vector<int32_t> sized;
    sized.reserve(o.prompt_tokens);
    while (static_cast<int64_t>(sized.size()) < o.prompt_tokens) {
      sized.push_back(ids[sized.size() % ids.size()]);
    }
    ids = std::move(sized);
  }
  return ids;
}

absl::Status RunGenerate(const GenerateOptions& o) {
  KVR_ASSIGN_OR_RETURN(model::LoadFormat format, model::ParseLoadFormat(o.load_format));
  KVR_ASSIGN_OR_RETURN(model::Sampler sampler,
                       model::Sampler::Create({o.temperature, o.top_p, o.seed}));
  if (o.max_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  ThreadPool pool(o.threads > 0 ? static_cast<size_t>(o.threads) : 0);

  const auto load_start = Clock::now();
  model::LoadOptions load_options;
  load_options.format = format;
  load_options.dummy_seed = o.seed;
  load_options.dummy_layers = o.layers;
  KVR_ASSIGN_OR_RETURN(model::LoadedModel loaded, model::LoadModel(o.model, load_options, &pool));
  const model::Model& m = *loaded.model;
  const model::ModelConfig& c = m.config();
  std::cerr << absl::StrFormat(
      "loaded %s (%s, %d layers, hidden %d, %d/%d heads, vocab %d, %.0f MiB float32) in %.2f s "
      "on %d threads\n",
      loaded.source, model::ArchitectureName(c.arch), c.n_layers, c.hidden, c.n_heads, c.n_kv_heads,
      c.vocab, m.weights().allocated_bytes() / 1048576.0, Seconds(load_start),
      static_cast<int>(pool.size()));

  KVR_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, PromptTokens(o, loaded));
  model::DenseAttention attention(&pool);
  model::KvCache cache = m.NewCache();
  // One allocation for the whole run instead of regrowing (and copying) during decode.
  cache.Reserve(
      std::min<int64_t>(c.context_length, static_cast<int64_t>(prompt.size()) + o.max_tokens));
  const model::SequenceId id = 1;

  const auto prefill_start = Clock::now();
  KVR_ASSIGN_OR_RETURN(std::vector<float> logits, m.Prefill(id, cache, prompt, attention, o.chunk));
  const double prefill_s = Seconds(prefill_start);

  std::optional<model::TokenStreamDecoder> decoder;
  if (loaded.tokenizer) decoder.emplace(*loaded.tokenizer);
  auto emit = [&](int32_t token) -> absl::Status {
    if (decoder) {
      KVR_ASSIGN_OR_RETURN(std::string piece, decoder->Push(token));
      std::fwrite(piece.data(), 1, piece.size(), stdout);
    } else {
      std::fprintf(stdout, "[%d]", token);
    }
    std::fflush(stdout);
    return absl::OkStatus();
  };

  int generated = 0;
  double decode_s = 0.0;
  const auto decode_start = Clock::now();
  while (generated < o.max_tokens) {
    KVR_ASSIGN_OR_RETURN(int32_t token, sampler.Sample(logits));
    ++generated;
    if (!o.ignore_eos && loaded.tokenizer && loaded.tokenizer->IsEndOfGeneration(token)) break;
    KVR_RETURN_IF_ERROR(emit(token));
    if (generated == o.max_tokens || cache.n_tokens() >= c.context_length) break;
    const model::ForwardSequence step{id, &cache, std::span(&token, 1)};
    KVR_RETURN_IF_ERROR(
        m.Forward(std::span(&step, 1), attention, model::LogitsMode::kLast, logits));
  }
  decode_s = Seconds(decode_start);
  if (decoder) {
    const std::string rest = decoder->Flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
  }
  std::fputc('\n', stdout);
  std::fflush(stdout);
  // Decode throughput counts the forward passes of the decode loop: one per token after the
  // first (the first token's logits come from the prefill).
  const int decode_steps = std::max(0, generated - 1);
  std::cerr << absl::StrFormat("prompt: %d tokens, %.1f tok/s | decode: %d tokens, %.1f tok/s\n",
                               static_cast<int>(prompt.size()),
                               prompt.size() / std::max(prefill_s, 1e-9), generated,
                               decode_steps / std::max(decode_s, 1e-9));
  return absl::OkStatus();
}

}  // namespace

void AddGenerateCommand(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a prompt on the CPU");
  cmd->add_option("--model", options->model,
                  "GGUF file, Hugging Face directory, a known name (smollm2-135m-instruct), or "
                  "with --load-format dummy a shape (smollm2-135m, qwen2-0.5b, llama3-8b, tiny)")
      ->capture_default_str();
  cmd->add_option("--prompt", options->prompt, "prompt text");
  cmd->add_option("--prompt-file", options->prompt_file, "read the prompt from this file");
  cmd->add_option("--prompt-tokens", options->prompt_tokens,
                  "repeat or cut the encoded prompt to exactly N tokens (benchmarks)");
  cmd->add_flag("--chat", options->chat, "wrap the prompt in the model's chat template");
  cmd->add_option("--max-tokens", options->max_tokens, "tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", options->temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", options->top_p, "nucleus sampling mass")->capture_default_str();
  cmd->add_option("--seed", options->seed, "sampling (and dummy weight) seed")
      ->capture_default_str();
  cmd->add_option("--threads", options->threads, "worker threads (0 = all cores)")
      ->capture_default_str();
  cmd->add_option("--load-format", options->load_format, "auto|gguf|hf|dummy")
      ->check(CLI::IsMember({"auto", "gguf", "hf", "dummy"}))
      ->capture_default_str();
  cmd->add_option("--layers", options->layers,
                  "dummy only: override the shape's layer count (llama3-8b's 32 float32 layers "
                  "need 30 GiB)");
  cmd->add_option("--prefill-chunk", options->chunk, "prefill chunk in tokens")
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", options->ignore_eos, "keep going past end-of-generation tokens");
  cmd->callback([options] {
    const absl::Status status = RunGenerate(*options);
    if (!status.ok()) {
      std::cerr << "kvr generate: " << status << "\n";
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace kvr::tools
