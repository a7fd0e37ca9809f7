#pragma once
// The OpenAI-compatible HTTP wire of `kvr bench`'s openai-* backends, without the I/O: the
// request body (OpenAiRequestBody), the server-sent-event framing of the response (SseParser),
// the chunks' meaning (OpenAiStreamReader) and the error of a refused request
// (HttpErrorToResult). The HTTP backend (openai_backend.cc, libcurl) feeds them the bytes it
// receives; the unit tests feed them text.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvr/loadgen/backend.h"
#include "kvr/loadgen/dataset.h"
#include "kvr/loadgen/metrics.h"

namespace kvr::loadgen {

// Splits a byte stream into server-sent events (the WHATWG event-stream format): lines end in
// "\n", "\r\n" or "\r"; the "data:" lines of an event (one space after the colon dropped) are
// joined with "\n"; a blank line dispatches the event. Comments (":keep-alive") and the other
// fields (event, id, retry) are ignored, and an event without data lines yields nothing. Bytes
// may be split anywhere between calls. Not thread-safe: one per response.
class SseParser {
 public:
  // Takes the next `bytes` of the stream; returns the data of every event they completed.
  std::vector<std::string> Feed(std::string_view bytes);

 private:
  void EndLine(std::vector<std::string>& events);

  std::string line_;       // the current, unfinished line
  std::string data_;       // the data of the event being read
  bool has_data_ = false;  // a data line was seen (the data may still be empty)
  bool after_cr_ = false;  // the last byte was "\r": a "\n" right after it ends nothing
};

enum class OpenAiEndpoint { kChatCompletions, kCompletions };

// The JSON body of one streamed request, as `vllm bench serve` sends it: "model", then
//   chat:        "messages" (the prompt's, or one user message holding its text),
//                "max_completion_tokens";
//   completions: "prompt" (the prompt's text; chat messages are the caller's error: see
//                Backend::CheckPrompt), "max_tokens";
// then "temperature", "stream": true, "stream_options": {"include_usage": true}; "ignore_eos"
// (vLLM's extension) only when set and "kvr": {"method", "budget", "n_sink", "local_window"}
// (kvr's) only when given, so that a plain OpenAI server sees no field it does not know unless
// the run asks for one.
std::string OpenAiRequestBody(OpenAiEndpoint endpoint, const RequestSpec& spec,
                              const Prompt& prompt);

// Interprets the data of one streamed response (OpenAI's chat.completion.chunk or
// text_completion objects, then "[DONE]"), filling a RequestResult:
//   TTFT   at the first chunk whose text is not empty (chat: choices[0].delta.content;
//          completions: choices[0].text), so the chat stream's opening role-only chunk and
//          the usage chunk do not count;
//   ITL    gaps between such chunks; generated_text their concatenation;
//   tokens usage.prompt_tokens / usage.completion_tokens (stream_options.include_usage);
//          without usage, the output is counted as one token per text chunk;
//   kvr    the retrieval counters and timings.time_to_first_token_s of a top-level "kvr"
//          object (kvr's extension), if any.
// An {"error": {...}} event or data that is not a chunk fails the request. Not thread-safe.
class OpenAiStreamReader {
 public:
  using Clock = std::chrono::steady_clock;

  // `result` is not owned and must outlive the reader; `sent` is when the request went out.
  OpenAiStreamReader(OpenAiEndpoint endpoint, Clock::time_point sent, RequestResult* result);

  // One event's data, received at `now`. Events after "[DONE]" or an error are ignored.
  void OnEvent(std::string_view data, Clock::time_point now);

  // The response ended at `end`: sets latency_s, and success when "[DONE]" came and no error
  // did (else error_code/error say why).
  void Finish(Clock::time_point end);

 private:
  void Fail(std::string code, std::string message);

  const OpenAiEndpoint endpoint_;
  const Clock::time_point sent_;
  RequestResult* const result_;
  Clock::time_point last_text_;
  bool got_text_ = false;
  bool done_ = false;
  bool failed_ = false;
  uint32_t text_chunks_ = 0;
  std::optional<uint32_t> completion_tokens_;
};

// A response with HTTP status `status` other than 200: result->error_code is the canonical
// status-code name the status stands for (400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403
// PERMISSION_DENIED, 404 NOT_FOUND, 409 ALREADY_EXISTS, 429 RESOURCE_EXHAUSTED, 500 INTERNAL,
// 501 UNIMPLEMENTED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED; any other "HTTP_<status>"), so
// that error counts read the same as the gRPC backend's; result->error is "HTTP <status>: "
// and the error JSON's message, or the start of the body when it is not OpenAI's error JSON.
void HttpErrorToResult(long status, std::string_view body, RequestResult* result);

}  // namespace kvr::loadgen
