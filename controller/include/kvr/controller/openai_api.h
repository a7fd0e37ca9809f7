#pragma once
// The OpenAI-compatible HTTP API as plain conversions, without HTTP (the cpp-httplib shell is
// http_server.h): request JSON of /v1/completions and /v1/chat/completions -> kvr.v1
// GenerateRequest, the request's events -> OpenAI response JSON (whole or as server-sent
// events), absl::Status -> OpenAI error JSON and HTTP status, and the /v1/models list.
//
// Fields kvr cannot honour (n > 1, logprobs, tools, response_format, ...) are refused with
// INVALID_ARGUMENT naming the field, never ignored. kvr's retrieval settings travel in the
// extension object "kvr" ({"method", "budget", "n_sink", "local_window", "options"}), and the
// response reports what the request ran with in a top-level "kvr" object.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/request_runner.h"
#include "kvr/controller/types.h"
#include "kvr/v1/generation.pb.h"

namespace kvr::controller::openai {

enum class Endpoint { kCompletions, kChatCompletions };

// One OpenAI error response: {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int http_status = 500;
  std::string type;
  std::string message;
  std::string param;  // "" is written as null
  std::string code;   // "" is written as null
  // > 0: sent as the Retry-After header (429).
  int retry_after_seconds = 0;
};

// The error for a status from the parser or the Generate path:
//   INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, ALREADY_EXISTS 409,
//   RESOURCE_EXHAUSTED 429 (Retry-After: 1), CANCELLED 499, UNAVAILABLE 503,
//   DEADLINE_EXCEEDED 504, anything else 500.
// `param` is the OpenAI name of the field the message starts with ("sampling.top_p: ..." ->
// "top_p", "retrieval.budget: ..." -> "kvr.budget").
ApiError ErrorFromStatus(const absl::Status& status, Endpoint endpoint);
std::string ErrorBody(const ApiError& error);

// A request converted to kvr's.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  kvr::v1::GenerateRequest request;
  bool stream = false;
  // stream_options.include_usage: a last chunk with `usage` (and every other with usage null).
  bool include_usage = false;
};

// Parses a request body. INVALID_ARGUMENT starting with the OpenAI field name for malformed
// JSON, wrong types, unsupported and unknown fields. Never throws.
[[nodiscard]] absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, absl::string_view body);

// NOT_FOUND (404 model_not_found) for a model no node ever registered while others are
// served; OK otherwise (a model not served yet is the Generate path's UNAVAILABLE).
[[nodiscard]] absl::Status CheckModelFound(absl::string_view model, const ModelPresence& presence);

// UNAUTHENTICATED unless `authorization` (the Authorization header; null when absent) is
// "Bearer <api_key>". Always OK when `api_key` is empty (no key configured).
[[nodiscard]] absl::Status CheckApiKey(absl::string_view api_key, const char* authorization);

// GET /v1/models.
std::string ModelsBody(const std::vector<ModelSummary>& models);

// Builds the response of one request from its events. Not thread-safe (one per request).
class ResponseBuilder {
 public:
  // `params` is the validated request (its id and model name the response; copied);
  // `created` the Unix time in seconds. `request` must outlive the builder.
  ResponseBuilder(const ParsedRequest& request, const GenerateParams& params, int64_t created);

  // Streaming: the server-sent events of one event ("data: {json}\n\n" each; after the final
  // event also the usage chunk when asked for, and "data: [DONE]\n\n"). May be empty (no text
  // yet: an incomplete UTF-8 sequence).
  std::string StreamEvents(const GenerateEvent& event);
  // An error after the stream started: one "data: {"error": ...}" event.
  static std::string StreamError(const ApiError& error);

  // Non-streaming: collects the events; Body() after the final one.
  void Add(const GenerateEvent& event);
  std::string Body() const;

 private:
  std::string Chunk(const std::string& text, const GenerateEvent* final_event, bool first) const;

  const ParsedRequest& request_;
  const std::string request_id_;
  const std::string model_;
  const RetrievalParams retrieval_;
  const int64_t created_;
  bool role_sent_ = false;
  std::string text_;
  std::optional<GenerateEvent> final_;
};

}  // namespace kvr::controller::openai
