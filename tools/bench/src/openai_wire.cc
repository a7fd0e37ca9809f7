#include "kvr/loadgen/openai_wire.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvr::loadgen {
namespace {

using json = nlohmann::json;

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// The text a chunk carries: choices[0].delta.content (chat) or choices[0].text (completions);
// empty for the role-only opening chunk, the final chunk and the usage chunk (no choices).
// nullopt when the chunk's choices are not shaped as the endpoint's.
std::optional<std::string> ChunkText(const json& chunk, OpenAiEndpoint endpoint) {
  const auto choices = chunk.find("choices");
  if (choices == chunk.end() || choices->is_null()) return std::string();
  if (!choices->is_array()) return std::nullopt;
  if (choices->empty()) return std::string();
  const json& choice = (*choices)[0];
  if (!choice.is_object()) return std::nullopt;
  const json* text = nullptr;
  if (endpoint == OpenAiEndpoint::kChatCompletions) {
    const auto delta = choice.find("delta");
    if (delta == choice.end() || !delta->is_object()) return std::nullopt;
    const auto content = delta->find("content");
    if (content != delta->end()) text = &*content;
  } else {
    const auto t = choice.find("text");
    if (t != choice.end()) text = &*t;
  }
  if (text == nullptr || text->is_null()) return std::string();
  if (!text->is_string()) return std::nullopt;
  return text->get<std::string>();
}

uint64_t Counter(const json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_number_unsigned() ? it->get<uint64_t>() : 0;
}

std::string CodeNameOfHttpStatus(long status) {
  switch (status) {
    case 400:
      return "INVALID_ARGUMENT";
    case 401:
      return "UNAUTHENTICATED";
    case 403:
      return "PERMISSION_DENIED";
    case 404:
      return "NOT_FOUND";
    case 409:
      return "ALREADY_EXISTS";
    case 429:
      return "RESOURCE_EXHAUSTED";
    case 500:
      return "INTERNAL";
    case 501:
      return "UNIMPLEMENTED";
    case 503:
      return "UNAVAILABLE";
    case 504:
      return "DEADLINE_EXCEEDED";
    default:
      return absl::StrCat("HTTP_", status);
  }
}

// The message of OpenAI's error JSON ({"error": {"message": ...}}), if `j` is one.
std::optional<std::string> ErrorMessage(const json& j) {
  if (!j.is_object()) return std::nullopt;
  const auto error = j.find("error");
  if (error == j.end()) return std::nullopt;
  if (error->is_object()) {
    const auto message = error->find("message");
    if (message != error->end() && message->is_string()) return message->get<std::string>();
  }
  return error->dump();
}

}  // namespace

std::string OpenAiRequestBody(OpenAiEndpoint endpoint, const RequestSpec& spec,
                              const Prompt& prompt) {
  json body = {{"model", spec.model}};
  const uint32_t max_tokens = prompt.max_tokens.value_or(spec.output_len);
  if (endpoint == OpenAiEndpoint::kChatCompletions) {
    json messages = json::array();
    if (prompt.messages.empty()) {
      messages.push_back({{"role", "user"}, {"content", prompt.text}});
    } else {
      for (const ChatTurn& turn : prompt.messages) {
        messages.push_back({{"role", turn.role}, {"content", turn.content}});
      }
    }
    body["messages"] = std::move(messages);
    body["max_completion_tokens"] = max_tokens;
  } else {
    body["prompt"] = prompt.text;
    body["max_tokens"] = max_tokens;
  }
  body["temperature"] = spec.temperature;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  if (spec.ignore_eos) body["ignore_eos"] = true;
  if (!spec.method.empty() || spec.budget || spec.n_sink || spec.local_window) {
    json kvr = json::object();
    if (!spec.method.empty()) kvr["method"] = spec.method;
    if (spec.budget) kvr["budget"] = *spec.budget;
    if (spec.n_sink) kvr["n_sink"] = *spec.n_sink;
    if (spec.local_window) kvr["local_window"] = *spec.local_window;
    body["kvr"] = std::move(kvr);
  }
  // Invalid UTF-8 in a dataset's text is replaced rather than thrown.
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::vector<std::string> SseParser::Feed(std::string_view bytes) {
  std::vector<std::string> events;
  for (const char c : bytes) {
    if (c == '\n' && after_cr_) {
      after_cr_ = false;  // the "\n" of "\r\n": the line already ended at "\r"
      continue;
    }
    after_cr_ = c == '\r';
    if (c == '\r' || c == '\n') {
      EndLine(events);
    } else {
      line_ += c;
    }
  }
  return events;
}

void SseParser::EndLine(std::vector<std::string>& events) {
  if (line_.empty()) {  // a blank line dispatches the event
    if (has_data_) events.push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  const std::string_view line = line_;
  const size_t colon = line.find(':');
  // A line without a colon is a field with an empty value; a leading colon is a comment.
  const std::string_view field = line.substr(0, colon);
  if (field == "data") {
    std::string_view value =
        colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (has_data_) data_ += '\n';
    data_.append(value);
    has_data_ = true;
  }
  line_.clear();
}

OpenAiStreamReader::OpenAiStreamReader(OpenAiEndpoint endpoint, Clock::time_point sent,
                                       RequestResult* result)
    : endpoint_(endpoint), sent_(sent), result_(result) {}

void OpenAiStreamReader::Fail(std::string code, std::string message) {
  failed_ = true;
  result_->error_code = std::move(code);
  result_->error = std::move(message);
}

void OpenAiStreamReader::OnEvent(std::string_view data, Clock::time_point now) {
  if (done_ || failed_) return;
  if (data == "[DONE]") {
    done_ = true;
    return;
  }
  const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (chunk.is_discarded() || !chunk.is_object()) {
    return Fail("INTERNAL", absl::StrCat("the stream sent data that is not a JSON object: ",
                                         std::string(data.substr(0, 200))));
  }
  if (std::optional<std::string> message = ErrorMessage(chunk)) {
    return Fail("STREAM_ERROR", absl::StrCat("error event in the stream: ", *message));
  }
  const std::optional<std::string> text = ChunkText(chunk, endpoint_);
  if (!text) {
    return Fail("INTERNAL", absl::StrCat("a chunk's choices are not shaped as ",
                                         endpoint_ == OpenAiEndpoint::kChatCompletions
                                             ? "chat.completion.chunk (choices[0].delta.content)"
                                             : "text_completion (choices[0].text)",
                                         ": ", std::string(data.substr(0, 200))));
  }
  if (!text->empty()) {
    if (!got_text_) {
      result_->ttft_s = Seconds(now - sent_);
      got_text_ = true;
    } else {
      result_->itl_s.push_back(Seconds(now - last_text_));
    }
    last_text_ = now;
    ++text_chunks_;
    result_->generated_text += *text;
  }
  if (const auto usage = chunk.find("usage"); usage != chunk.end() && usage->is_object()) {
    if (const uint64_t p = Counter(*usage, "prompt_tokens"); p > 0) {
      result_->prompt_len = static_cast<uint32_t>(p);
    }
    if (usage->contains("completion_tokens")) {
      completion_tokens_ = static_cast<uint32_t>(Counter(*usage, "completion_tokens"));
    }
  }
  if (const auto kvr = chunk.find("kvr"); kvr != chunk.end() && kvr->is_object()) {
    // The final chunk and the usage chunk both carry it: the last one read wins.
    result_->bytes_fetched = Counter(*kvr, "bytes_fetched");
    result_->bytes_shipped = Counter(*kvr, "bytes_shipped");
    result_->hot_cache_hits = Counter(*kvr, "hot_cache_hits");
    result_->hot_cache_misses = Counter(*kvr, "hot_cache_misses");
    if (const auto timings = kvr->find("timings"); timings != kvr->end() && timings->is_object()) {
      const auto ttft = timings->find("time_to_first_token_s");
      if (ttft != timings->end() && ttft->is_number()) result_->server_ttft_s = ttft->get<double>();
    }
  }
}

void OpenAiStreamReader::Finish(Clock::time_point end) {
  result_->latency_s = Seconds(end - sent_);
  if (failed_) return;
  if (!done_) {
    Fail("INTERNAL", "the stream ended without \"data: [DONE]\"");
    return;
  }
  result_->success = true;
  result_->output_len = completion_tokens_.value_or(text_chunks_);
}

void HttpErrorToResult(long status, std::string_view body, RequestResult* result) {
  result->success = false;
  result->error_code = CodeNameOfHttpStatus(status);
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  std::optional<std::string> message;
  if (!j.is_discarded()) message = ErrorMessage(j);
  result->error =
      absl::StrCat("HTTP ", status, ": ", message ? *message : std::string(body.substr(0, 200)));
}

}  // namespace kvr::loadgen
