#pragma once
// Where `kvr bench` sends its requests. A Backend turns one prompt into one streamed request
// and records what it measured; the runner (runner.h) decides when to send. Backends:
//   kvr-grpc            kvr.v1.Generation/Generate on one channel (gRPC callback API);
//   openai-chat         POST {base_url}/chat/completions, streamed (server-sent events);
//   openai-completions  POST {base_url}/completions, streamed;
// the OpenAI ones work against kvr-controller's HTTP API and any OpenAI-compatible server
// (vLLM, SGLang, ...), through libcurl's multi interface on one thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/common/tls.h"
#include "kvr/loadgen/dataset.h"
#include "kvr/loadgen/metrics.h"

namespace kvr::loadgen {

enum class BackendKind { kKvrGrpc, kOpenAiChat, kOpenAiCompletions };

// "kvr-grpc" | "openai-chat" | "openai-completions"; InvalidArgument naming the choices.
[[nodiscard]] absl::StatusOr<BackendKind> ParseBackendKind(std::string_view name);
std::string_view BackendName(BackendKind kind);

struct BackendOptions {
  BackendKind kind = BackendKind::kKvrGrpc;
  std::string target;    // kvr-grpc: host:port of kvr-controller
  // kvr-grpc: the channel's TLS (kvr/common/tls.h); empty: plaintext. openai-*: with an
  // https:// base URL, the CA that verifies the server (empty: the system's CAs) and a client
  // certificate to present.
  TlsConfig tls;
  std::string base_url;  // openai-*: the API root, e.g. http://127.0.0.1:8000/v1
  std::string api_key;   // openai-*: sent as "Authorization: Bearer KEY"; empty: no header
  // kvr-grpc: send a text prompt as one user chat message (the server applies the model's
  // chat template), as openai-chat does; else as a raw prompt, as openai-completions does.
  bool chat = false;
};

// What every request of a run asks for besides its prompt.
struct RequestSpec {
  std::string model;
  uint32_t output_len = 128;  // max tokens, unless the prompt carries its own
  bool ignore_eos = false;
  float temperature = 0.f;
  std::string method;  // kvr retrieval method (openai-*: the "kvr" extension field); empty: none
  std::optional<uint32_t> budget;
  // Sink tokens and local window of the retrieval (RetrievalParams); unset: the server's.
  std::optional<uint32_t> n_sink;
  std::optional<uint32_t> local_window;
  double timeout_s = 600;  // each request's deadline, from when it is sent
};

class Backend {
 public:
  using Clock = std::chrono::steady_clock;

  virtual ~Backend() = default;

  // The model requests will name: `wanted` when the server lists it, else (with `wanted`
  // empty) the first one listed. Unavailable when the server does not answer, NotFound when
  // it does not serve the model.
  [[nodiscard]] virtual absl::StatusOr<std::string> ResolveModel(const std::string& wanted) = 0;

  // InvalidArgument when this backend cannot send `prompt` (a completions endpoint has no
  // place for chat messages).
  [[nodiscard]] virtual absl::Status CheckPrompt(const Prompt& prompt) const = 0;

  // Sends one request and returns at once. Fills `*result` (success or the error, ttft_s,
  // itl_s, latency_s, generated_text, token counts the server reported, kvr counters; not
  // start_time_s) and then calls `on_done` exactly once, from any thread. `prompt` and
  // `result` must stay alive until then; the backend must outlive every request it sent.
  virtual void Send(const RequestSpec& spec, const Prompt& prompt, RequestResult* result,
                    std::function<void()> on_done) = 0;
};

// The backend `options.kind` names. InvalidArgument for options it cannot use (no target, a
// base URL that is not http(s)://...). Connects lazily: a server that is not there shows up in
// ResolveModel.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options);

// The two kinds, for MakeBackend (grpc_backend.cc, openai_backend.cc).
[[nodiscard]] std::unique_ptr<Backend> MakeGrpcBackend(const std::string& target, bool chat,
                                                       GrpcSecurity security = {});
[[nodiscard]] absl::StatusOr<std::unique_ptr<Backend>> MakeOpenAiBackend(
    const BackendOptions& options);

}  // namespace kvr::loadgen
