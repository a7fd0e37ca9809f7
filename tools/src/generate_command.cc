// kvr generate: one prompt through the CPU runtime with dense attention, streaming the text;
// or, with --endpoint, through a kvr cluster's public Generation API (kvr up starts one).

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <CLI/CLI.hpp>

#include <random>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/common/tls.h"
#include "kvr/model/cpu_kernels.h"
#include "kvr/model/dense_attention.h"
#include "kvr/model/loader.h"
#include "kvr/model/sampler.h"
#include "kvr/proto/convert.h"
#include "kvr/v1/generation.grpc.pb.h"
#include "tls_options.h"

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
  std::string weights = "packed";
  std::string kv_dtype = "f16";
  bool show_ids = false;
  bool parse_special = false;
  int layers = 0;
  int64_t chunk = 512;
  bool ignore_eos = false;
  // Cluster mode (--endpoint).
  std::string endpoint;
  TlsConfig tls;
  std::string method;  // empty: the controller's default
  std::optional<uint32_t> budget, n_sink, local_window;
  std::vector<std::string> method_options;  // key=value
  std::vector<std::string> stop;
  uint32_t top_k = 0;
  double timeout_s = 600;
  int64_t passkey = 0;
  uint64_t passkey_seed = 0;
};

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// A passkey-retrieval prompt of about `tokens` tokens: filler text with a random 5-digit key at
// a random depth, then the question. `key` receives the passkey.
std::string PasskeyPrompt(int64_t tokens, uint64_t seed, std::string* key) {
  std::mt19937_64 rng(seed == 0 ? std::random_device{}() : seed);
  *key = std::to_string(10000 + rng() % 90000);
  const std::string filler =
      "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
      "again. ";
  // About 24 SmolLM2/GPT-2 tokens per filler line (the summary reports the real count).
  const int64_t lines = std::max<int64_t>(1, (tokens - 60) / 24);
  const int64_t at = static_cast<int64_t>(rng() % static_cast<uint64_t>(lines));
  std::string text =
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
      "it. I will quiz you about the important information there.\n";
  for (int64_t i = 0; i < lines; ++i) {
    if (i == at)
      absl::StrAppend(&text, "The pass key is ", *key, ". Remember it. ", *key,
                      " is the pass key.\n");
    text += filler;
  }
  absl::StrAppend(&text, "\nWhat is the pass key?");
  return text;
}

double Secs(const google::protobuf::Duration& d) { return d.seconds() + d.nanos() * 1e-9; }

// Cluster mode: one Generate stream, text to stdout, summary to stderr.
absl::Status RunRemote(const GenerateOptions& o) {
  std::string text = o.prompt;
  std::string passkey;
  if (o.passkey > 0) {
    text = PasskeyPrompt(o.passkey, o.passkey_seed, &passkey);
  } else if (!o.prompt_file.empty()) {
    std::ifstream in(o.prompt_file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read --prompt-file ", o.prompt_file));
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  if (text.empty()) {
    return absl::InvalidArgumentError("the prompt is empty (--prompt, --prompt-file or --passkey)");
  }
  kvr::v1::GenerateRequest request;
  request.set_model(o.model);
  if (o.chat) {
    kvr::v1::ChatMessage* m = request.mutable_chat()->add_messages();
    m->set_role("user");
    m->set_content(text);
  } else {
    request.set_prompt(text);
  }
  kvr::v1::SamplingParams* sp = request.mutable_sampling();
  sp->set_max_tokens(static_cast<uint32_t>(o.max_tokens));
  sp->set_temperature(o.temperature);
  if (o.top_p != 1.f) sp->set_top_p(o.top_p);
  sp->set_top_k(o.top_k);
  if (o.seed != 0) sp->set_seed(o.seed);
  sp->set_ignore_eos(o.ignore_eos);
  for (const std::string& s : o.stop) sp->add_stop(s);
  kvr::v1::RetrievalParams* rp = request.mutable_retrieval();
  rp->set_method(o.method);
  if (o.budget) rp->set_budget(*o.budget);
  if (o.n_sink) rp->set_n_sink(*o.n_sink);
  if (o.local_window) rp->set_local_window(*o.local_window);
  for (const std::string& kv : o.method_options) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--option ", kv, ": expected key=value"));
    }
    (*rp->mutable_options())[kv.substr(0, eq)] = kv.substr(eq + 1);
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  absl::StatusOr<GrpcSecurity> security = GrpcSecurity::Load(o.tls);
  if (!security.ok()) return security.status();
  auto stub = kvr::v1::Generation::NewStub(security->CreateChannel(o.endpoint, args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000)));
  const auto start = Clock::now();
  auto reader = stub->Generate(&ctx, request);
  kvr::v1::GenerateResponse msg;
  std::string answer;
  std::optional<kvr::v1::Completion> completion;
  double first_token_s = -1;
  while (reader->Read(&msg)) {
    if (first_token_s < 0 && msg.token_ids_size() > 0) first_token_s = Seconds(start);
    answer += msg.text();
    std::fwrite(msg.text().data(), 1, msg.text().size(), stdout);
    std::fflush(stdout);
    if (msg.has_completion()) completion = msg.completion();
  }
  std::fputc('\n', stdout);
  std::fflush(stdout);
  grpc::Status status = reader->Finish();
  if (!status.ok()) {
    return absl::Status(
        kvr::proto::FromGrpcStatus(status).code(),
        absl::StrCat("Generate on ", o.endpoint, ": ", status.error_message(),
                     status.error_code() == grpc::StatusCode::UNAVAILABLE && !security->enabled()
                         ? " (a TLS cluster, as kvr up starts by default, needs "
                           "--tls-ca: the CA kvr up printed)"
                         : ""));
  }
  if (!completion) return absl::InternalError("the stream ended without a completion message");
  const kvr::v1::Completion& c = *completion;
  const uint32_t generated = c.usage().completion_tokens();
  const uint32_t decoded = generated > 0 ? generated - 1 : 0;  // tokens after the first
  const double decode_s = Secs(c.timings().decode());
  const auto& r = c.retrieval();
  const uint64_t lookups = r.hot_cache_hits() + r.hot_cache_misses();
  std::cerr << absl::StrFormat(
      "--- summary (%s) ---\n"
      "prompt: %u tokens%s | TTFT %.2f s (prefill %.2f s, queue %.3f s)\n"
      "decode: %u tokens after the first, %.2f tok/s | finish %s\n"
      "retrieval: method %s, budget %u | %.1f KiB fetched per decoded token (%llu rows) | "
      "hot-cache hit rate %s\n"
      "nodes: prefill %s, decode %s, store %s, attempts %u\n",
      o.endpoint, c.usage().prompt_tokens(),
      c.usage().cached_tokens() > 0
          ? absl::StrFormat(" (%u reused from a cached prefix)", c.usage().cached_tokens())
          : std::string(),
      Secs(c.timings().time_to_first_token()),
      Secs(c.timings().prefill()), Secs(c.timings().queue()), decoded,
      decode_s > 0 ? decoded / decode_s : 0.0, kvr::v1::FinishReason_Name(c.finish_reason()),
      r.method(), r.budget(), decoded > 0 ? r.bytes_fetched() / 1024.0 / decoded : 0.0,
      static_cast<unsigned long long>(r.rows_fetched()),
      lookups > 0 ? absl::StrFormat("%.1f%%", 100.0 * r.hot_cache_hits() / lookups) : "n/a",
      c.prefill_node(), c.decode_node(), c.store_node(), c.attempts());
  if (!passkey.empty()) {
    const bool found = absl::StrContains(answer, passkey);
    std::cerr << "passkey " << passkey << ": " << (found ? "FOUND" : "NOT found")
              << " in the answer\n";
  }
  return absl::OkStatus();
}

// The prompt's token ids. Dummy models have no tokenizer: their prompt is its bytes (mod the
// vocabulary), which is enough to drive the forward pass for timing.
absl::StatusOr<std::vector<int32_t>> PromptTokens(const GenerateOptions& o,
                                                  const model::LoadedModel& loaded) {
  std::string text = o.prompt;
  std::string passkey;
  if (o.passkey > 0) text = PasskeyPrompt(o.passkey, o.passkey_seed, &passkey);
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
    KVR_ASSIGN_OR_RETURN(ids, loaded.tokenizer->Encode(text, {.parse_special = o.parse_special}));
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
  if (!o.endpoint.empty()) return RunRemote(o);
  KVR_ASSIGN_OR_RETURN(model::LoadFormat format, model::ParseLoadFormat(o.load_format));
  KVR_ASSIGN_OR_RETURN(model::WeightStorage storage, model::ParseWeightStorage(o.weights));
  KVR_ASSIGN_OR_RETURN(model::KvDType kv_dtype, model::ParseKvDType(o.kv_dtype));
  KVR_ASSIGN_OR_RETURN(model::Sampler sampler,
                       model::Sampler::Create({.temperature = o.temperature,
                                               .top_p = o.top_p,
                                               .seed = o.seed,
                                               .top_k = o.top_k}));
  if (o.max_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  ThreadPool pool(o.threads > 0 ? static_cast<size_t>(o.threads) : 0);

  const auto load_start = Clock::now();
  model::LoadOptions load_options;
  load_options.format = format;
  load_options.dummy_seed = o.seed;
  load_options.dummy_layers = o.layers;
  load_options.weights = storage;
  load_options.kv_dtype = kv_dtype;
  KVR_ASSIGN_OR_RETURN(model::LoadedModel loaded, model::LoadModel(o.model, load_options, &pool));
  const model::Model& m = *loaded.model;
  const model::ModelConfig& c = m.config();
  std::cerr << absl::StrFormat(
      "loaded %s (%s, %d layers, hidden %d, %d/%d heads, vocab %d, %.0f MiB of %s weights) in "
      "%.2f s on %d threads (%s kernels)\n",
      loaded.source, model::ArchitectureName(c.arch), c.n_layers, c.hidden, c.n_heads, c.n_kv_heads,
      c.vocab, m.weights().allocated_bytes() / 1048576.0,
      m.weights().packed() ? "packed" : "float32", Seconds(load_start),
      static_cast<int>(pool.size()), model::CpuIsaName(model::BestCpuKernels().isa));

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

  std::vector<int32_t> generated_ids;
  int generated = 0;
  double decode_s = 0.0;
  const auto decode_start = Clock::now();
  while (generated < o.max_tokens) {
    KVR_ASSIGN_OR_RETURN(int32_t token, sampler.Sample(logits));
    ++generated;
    generated_ids.push_back(token);
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
  if (o.show_ids) {
    std::cerr << "prompt ids: " << absl::StrJoin(prompt, " ") << "\n"
              << "generated ids: " << absl::StrJoin(generated_ids, " ") << "\n";
  }
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
  cmd->add_option("--weights", options->weights,
                  "GGUF weight storage: packed (the file's formats, 8-bit activations in decode; "
                  "the fast path) or float32 (dequantised at load; the exact reference)")
      ->check(CLI::IsMember({"packed", "float32"}))
      ->capture_default_str();
  cmd->add_option("--kv-dtype", options->kv_dtype,
                  "local: KV cache precision, f16 (half the bytes a decode step reads; what the "
                  "nodes use) or f32 (the exact reference)")
      ->check(CLI::IsMember({"f16", "f32"}))
      ->capture_default_str();
  cmd->add_flag("--parse-special", options->parse_special,
                "raw prompts: recognise special tokens written in the text (e.g. <|im_start|>) "
                "instead of splitting them as plain text (chat prompts always do)");
  cmd->add_flag("--show-ids", options->show_ids,
                "print the prompt's and the generated token ids to stderr");
  cmd->add_option("--layers", options->layers,
                  "dummy only: override the shape's layer count (llama3-8b's 32 float32 layers "
                  "need 30 GiB)");
  cmd->add_option("--prefill-chunk", options->chunk, "prefill chunk in tokens")
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", options->ignore_eos, "keep going past end-of-generation tokens");
  // Cluster mode.
  cmd->add_option("--endpoint", options->endpoint,
                  "host:port of a kvr cluster (kvr up); --model is then the served model name");
  AddTlsOptions(cmd, &options->tls);
  cmd->add_option("--method", options->method,
                  "endpoint: retrieval method (full, exact, quest, streaming, clusterkv, ctkvr, "
                  "keydiff, pariskv, a2ats); default: the controller's");
  cmd->add_option("--budget", options->budget, "endpoint: rows per KV head and step (top-k)");
  cmd->add_option("--n-sink", options->n_sink, "endpoint: sink tokens always attended");
  cmd->add_option("--local-window", options->local_window,
                  "endpoint: most recent tokens always attended");
  cmd->add_option("--option", options->method_options, "endpoint: method option key=value");
  cmd->add_option("--stop", options->stop, "endpoint: stop string (repeatable)");
  cmd->add_option("--top-k", options->top_k, "keep the k most likely tokens (0 = off)");
  cmd->add_option("--timeout", options->timeout_s, "endpoint: request deadline in seconds")
      ->capture_default_str();
  cmd->add_option("--passkey", options->passkey,
                  "build a passkey-retrieval prompt of about N tokens (filler text with a random "
                  "5-digit key); the summary says whether the answer contains the key");
  cmd->add_option("--passkey-seed", options->passkey_seed,
                  "seed of the passkey prompt (0: random)");
  cmd->callback([options] { ExitIfError("generate", RunGenerate(*options)); });
}

}  // namespace kvr::tools
