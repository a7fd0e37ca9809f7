// The OpenAI-compatible API's conversions, without HTTP: request JSON -> kvr.v1 request, every
// refused field, status -> HTTP error, and events -> response JSON / server-sent events.

#include "kvr/controller/openai_api.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace kvr::controller::openai {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

absl::StatusOr<ParsedRequest> Parse(Endpoint endpoint, const json& body) {
  return ParseRequest(endpoint, body.dump());
}

json Completions(json extra = json::object()) {
  json body = {{"model", "m"}, {"prompt", "Hello"}};
  body.update(extra);
  return body;
}

json Chat(json extra = json::object()) {
  json body = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  body.update(extra);
  return body;
}

// The error a refused request gets, as the client sees it.
ApiError Refusal(Endpoint endpoint, const json& body) {
  absl::StatusOr<ParsedRequest> r = Parse(endpoint, body);
  EXPECT_FALSE(r.ok()) << body.dump();
  return ErrorFromStatus(r.ok() ? absl::OkStatus() : r.status(), endpoint);
}

TEST(OpenAiParse, CompletionsMapsSamplingAndRetrieval) {
  absl::StatusOr<ParsedRequest> r =
      Parse(Endpoint::kCompletions, Completions({{"max_tokens", 7},
                                                 {"temperature", 0},
                                                 {"top_p", 0.5},
                                                 {"top_k", 20},
                                                 {"seed", 42},
                                                 {"stop", {"\n", "END"}},
                                                 {"ignore_eos", true},
                                                 {"stream", true},
                                                 {"stream_options", {{"include_usage", true}}},
                                                 {"n", 1},
                                                 {"user", "someone"},
                                                 {"cache_salt", "tenant-7"},
                                                 {"kvr",
                                                  {{"method", "quest"},
                                                   {"budget", 256},
                                                   {"n_sink", 4},
                                                   {"local_window", 32},
                                                   {"resume_on_failure", true},
                                                   {"prefix_cache", false},
                                                   {"options", {{"page", "16"}}}}}}));
  ASSERT_TRUE(r.ok()) << r.status();
  const kvr::v1::GenerateRequest& g = r->request;
  EXPECT_EQ(g.model(), "m");
  EXPECT_EQ(g.prompt(), "Hello");
  EXPECT_EQ(g.sampling().max_tokens(), 7u);
  EXPECT_EQ(g.sampling().temperature(), 0.f);
  EXPECT_FLOAT_EQ(g.sampling().top_p(), 0.5f);
  EXPECT_EQ(g.sampling().top_k(), 20u);
  EXPECT_EQ(g.sampling().seed(), 42u);
  EXPECT_THAT(g.sampling().stop(), ::testing::ElementsAre("\n", "END"));
  EXPECT_TRUE(g.sampling().ignore_eos());
  EXPECT_EQ(g.retrieval().method(), "quest");
  EXPECT_EQ(g.retrieval().budget(), 256u);
  EXPECT_EQ(g.retrieval().n_sink(), 4u);
  EXPECT_EQ(g.retrieval().local_window(), 32u);
  EXPECT_EQ(g.retrieval().options().at("page"), "16");
  EXPECT_TRUE(g.resume_on_failure());
  EXPECT_EQ(g.cache_salt(), "tenant-7");
  ASSERT_TRUE(g.has_prefix_cache());
  EXPECT_FALSE(g.prefix_cache());
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
}

TEST(OpenAiParse, DefaultsFollowOpenAi) {
  absl::StatusOr<ParsedRequest> r = Parse(Endpoint::kCompletions, Completions());
  ASSERT_TRUE(r.ok()) << r.status();
  // OpenAI's temperature defaults to 1; max_tokens and retrieval to the controller's defaults.
  EXPECT_EQ(r->request.sampling().temperature(), 1.f);
  EXPECT_FALSE(r->request.sampling().has_max_tokens());
  EXPECT_FALSE(r->request.sampling().has_top_p());
  EXPECT_FALSE(r->request.sampling().has_seed());
  EXPECT_TRUE(r->request.retrieval().method().empty());
  EXPECT_FALSE(r->stream);
  // null is absent.
  r = Parse(Endpoint::kCompletions, Completions({{"max_tokens", nullptr}, {"n", nullptr}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->request.sampling().has_max_tokens());
  // vLLM's top_k -1 is "off".
  r = Parse(Endpoint::kCompletions, Completions({{"top_k", -1}, {"stop", "x"}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request.sampling().top_k(), 0u);
  EXPECT_THAT(r->request.sampling().stop(), ::testing::ElementsAre("x"));
}

TEST(OpenAiParse, PromptForms) {
  absl::StatusOr<ParsedRequest> r =
      Parse(Endpoint::kCompletions, Completions({{"prompt", {1, 2, 3}}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->request.token_ids().ids(), ::testing::ElementsAre(1u, 2u, 3u));
  r = Parse(Endpoint::kCompletions, Completions({{"prompt", {"one"}}}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->request.prompt(), "one");
  for (const json& bad : {json{"a", "b"}, json{{1, 2}, {3}}, json(5), json{1, "x"}}) {
    const ApiError e = Refusal(Endpoint::kCompletions, Completions({{"prompt", bad}}));
    EXPECT_EQ(e.http_status, 400) << bad.dump();
    EXPECT_EQ(e.param, "prompt") << bad.dump();
  }
  EXPECT_EQ(Refusal(Endpoint::kCompletions, {{"model", "m"}}).param, "prompt");
}

TEST(OpenAiParse, ChatMessages) {
  absl::StatusOr<ParsedRequest> r = Parse(
      Endpoint::kChatCompletions,
      Chat({{"messages",
             {{{"role", "system"}, {"content", "Be brief."}},
              {{"role", "user"},
               {"content",
                {{{"type", "text"}, {"text", "Hi "}}, {{"type", "text"}, {"text", "there"}}}}},
              {{"role", "assistant"}, {"content", "Hello"}}}},
            {"max_completion_tokens", 9}}));
  ASSERT_TRUE(r.ok()) << r.status();
  const auto& m = r->request.chat().messages();
  ASSERT_EQ(m.size(), 3);
  EXPECT_EQ(m[0].role(), "system");
  EXPECT_EQ(m[1].content(), "Hi there");
  EXPECT_EQ(m[2].role(), "assistant");
  EXPECT_EQ(r->request.sampling().max_tokens(), 9u);

  ApiError e = Refusal(Endpoint::kChatCompletions,
                       Chat({{"messages", {{{"role", "tool"}, {"content", "x"}}}}}));
  EXPECT_EQ(e.param, "messages[0].role");
  e = Refusal(Endpoint::kChatCompletions,
              Chat({{"messages",
                     {{{"role", "user"},
                       {"content", {{{"type", "image_url"}, {"image_url", {{"url", "x"}}}}}}}}}}));
  EXPECT_EQ(e.param, "messages[0].content[0].type");
  EXPECT_EQ(e.code, "unsupported_parameter");
  e = Refusal(Endpoint::kChatCompletions,
              Chat({{"messages", {{{"role", "user"}, {"content", "x"}, {"name", "bob"}}}}}));
  EXPECT_EQ(e.param, "messages[0].name");
  e = Refusal(Endpoint::kChatCompletions, Chat({{"max_tokens", 3}, {"max_completion_tokens", 4}}));
  EXPECT_EQ(e.param, "max_completion_tokens");
  EXPECT_EQ(Refusal(Endpoint::kChatCompletions, {{"model", "m"}}).param, "messages");
}

// Every field kvr cannot honour is refused, naming it, unless it holds its "off" value.
TEST(OpenAiParse, RefusesUnsupportedFieldsByName) {
  struct Case {
    Endpoint endpoint;
    const char* field;
    json refused;
    json accepted;  // null: no accepted value but absence
  };
  const std::vector<Case> cases = {
      {Endpoint::kCompletions, "n", 2, 1},
      {Endpoint::kChatCompletions, "n", 3, 1},
      {Endpoint::kCompletions, "best_of", 2, 1},
      {Endpoint::kCompletions, "logprobs", 5, 0},
      {Endpoint::kChatCompletions, "logprobs", true, false},
      {Endpoint::kChatCompletions, "top_logprobs", 2, 0},
      {Endpoint::kCompletions, "echo", true, false},
      {Endpoint::kCompletions, "suffix", "end", ""},
      {Endpoint::kCompletions, "logit_bias", {{"50256", -100}}, json::object()},
      {Endpoint::kChatCompletions, "logit_bias", {{"1", 5}}, json::object()},
      {Endpoint::kCompletions, "presence_penalty", 0.5, 0},
      {Endpoint::kChatCompletions, "frequency_penalty", 1, 0},
      {Endpoint::kChatCompletions,
       "tools",
       {{{"type", "function"}, {"function", {{"name", "f"}}}}},
       nullptr},
      {Endpoint::kChatCompletions, "tool_choice", "auto", nullptr},
      {Endpoint::kChatCompletions, "parallel_tool_calls", true, nullptr},
      {Endpoint::kChatCompletions, "functions", {{{"name", "f"}}}, nullptr},
      {Endpoint::kChatCompletions, "function_call", "auto", nullptr},
      {Endpoint::kChatCompletions,
       "response_format",
       {{"type", "json_object"}},
       {{"type", "text"}}},
  };
  for (const Case& c : cases) {
    const json base = c.endpoint == Endpoint::kCompletions ? Completions() : Chat();
    json body = base;
    body[c.field] = c.refused;
    const ApiError e = Refusal(c.endpoint, body);
    EXPECT_EQ(e.http_status, 400) << c.field;
    EXPECT_EQ(e.type, "invalid_request_error") << c.field;
    EXPECT_EQ(e.param, c.field);
    EXPECT_EQ(e.code, "unsupported_parameter") << c.field;
    EXPECT_THAT(e.message, HasSubstr(c.field));
    if (!c.accepted.is_null()) {
      body[c.field] = c.accepted;
      EXPECT_TRUE(Parse(c.endpoint, body).ok()) << c.field << " = " << c.accepted.dump();
    }
  }
  // Fields of the other endpoint are unknown here.
  EXPECT_EQ(Refusal(Endpoint::kCompletions, Completions({{"tools", json::array()}})).code,
            "unknown_parameter");
  EXPECT_EQ(Refusal(Endpoint::kChatCompletions, Chat({{"echo", false}})).param, "echo");
}

TEST(OpenAiParse, RefusesUnknownAndMalformed) {
  ApiError e = Refusal(Endpoint::kCompletions, Completions({{"frobnicate", 1}}));
  EXPECT_EQ(e.param, "frobnicate");
  EXPECT_EQ(e.code, "unknown_parameter");
  e = Refusal(Endpoint::kCompletions, Completions({{"kvr", {{"budgett", 5}}}}));
  EXPECT_EQ(e.param, "kvr.budgett");
  e = Refusal(Endpoint::kCompletions, Completions({{"kvr", {{"budget", "many"}}}}));
  EXPECT_EQ(e.param, "kvr.budget");
  e = Refusal(Endpoint::kCompletions, Completions({{"kvr", {{"resume_on_failure", 1}}}}));
  EXPECT_EQ(e.param, "kvr.resume_on_failure");
  e = Refusal(Endpoint::kCompletions, Completions({{"stream_options", {{"include_usage", true}}}}));
  EXPECT_EQ(e.param, "stream_options");
  e = Refusal(Endpoint::kCompletions, Completions({{"max_tokens", "ten"}}));
  EXPECT_EQ(e.param, "max_tokens");
  e = Refusal(Endpoint::kCompletions, Completions({{"max_tokens", -1}}));
  EXPECT_EQ(e.param, "max_tokens");
  e = Refusal(Endpoint::kCompletions, Completions({{"temperature", "hot"}}));
  EXPECT_EQ(e.param, "temperature");
  e = Refusal(Endpoint::kCompletions, Completions({{"seed", -3}}));
  EXPECT_EQ(e.param, "seed");
  e = Refusal(Endpoint::kCompletions, Completions({{"stop", {1}}}));
  EXPECT_EQ(e.param, "stop");
  e = Refusal(Endpoint::kCompletions, Completions({{"stream", "yes"}}));
  EXPECT_EQ(e.param, "stream");
  e = Refusal(Endpoint::kCompletions, {{"prompt", "x"}});
  EXPECT_EQ(e.param, "model");
  // Not JSON, or not an object: 400, no exception.
  for (const char* body : {"", "{", "[1,2]", "{\"model\": }", "\xff\xfe"}) {
    absl::StatusOr<ParsedRequest> r = ParseRequest(Endpoint::kCompletions, body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(ErrorFromStatus(r.status(), Endpoint::kCompletions).http_status, 400);
  }
}

TEST(OpenAiErrors, EveryStatusMapsToItsHttpStatus) {
  struct Case {
    absl::Status status;
    int http;
    const char* type;
  };
  const std::vector<Case> cases = {
      {absl::InvalidArgumentError("sampling.top_p: must be in (0, 1]"), 400,
       "invalid_request_error"},
      {absl::UnauthenticatedError("incorrect API key"), 401, "invalid_request_error"},
      {absl::NotFoundError("model: no such model"), 404, "invalid_request_error"},
      {absl::AlreadyExistsError("request id in flight"), 409, "invalid_request_error"},
      {absl::ResourceExhaustedError("decode batch slots: all 1 full"), 429, "rate_limit_error"},
      {absl::CancelledError("client disconnected"), 499, "cancelled"},
      {absl::UnavailableError("no model is served yet"), 503, "service_unavailable"},
      {absl::DeadlineExceededError("deadline"), 504, "timeout"},
      {absl::InternalError("bug"), 500, "server_error"},
      {absl::UnknownError("?"), 500, "server_error"},
  };
  for (const Case& c : cases) {
    const ApiError e = ErrorFromStatus(c.status, Endpoint::kCompletions);
    EXPECT_EQ(e.http_status, c.http) << c.status;
    EXPECT_EQ(e.type, c.type) << c.status;
    EXPECT_EQ(e.message, c.status.message());
    EXPECT_EQ(e.retry_after_seconds, c.http == 429 ? 1 : 0) << c.status;
  }
  EXPECT_EQ(ErrorFromStatus(absl::UnauthenticatedError("x"), Endpoint::kCompletions).code,
            "invalid_api_key");
  EXPECT_EQ(ErrorFromStatus(absl::NotFoundError("model: x"), Endpoint::kCompletions).code,
            "model_not_found");
}

TEST(OpenAiErrors, KvrFieldPathsBecomeOpenAiParams) {
  const auto param = [](const char* message, Endpoint e = Endpoint::kCompletions) {
    return ErrorFromStatus(absl::InvalidArgumentError(message), e).param;
  };
  EXPECT_EQ(param("sampling.max_tokens: 9000 leaves no room"), "max_tokens");
  EXPECT_EQ(param("retrieval.budget: must be at least 1"), "kvr.budget");
  EXPECT_EQ(param("retrieval.method: unknown method 'x'"), "kvr.method");
  EXPECT_EQ(param("token_ids: 9000 prompt tokens leave no room"), "prompt");
  EXPECT_EQ(param("prompt: too long", Endpoint::kChatCompletions), "messages");
  EXPECT_EQ(param("chat.messages[1].role: empty", Endpoint::kChatCompletions), "messages[1].role");
  EXPECT_EQ(param("model: unknown model 'x'"), "model");
  EXPECT_EQ(param("no field here"), "");
}

TEST(OpenAiErrors, ErrorBodyIsOpenAisShape) {
  const json body = json::parse(ErrorBody(
      ErrorFromStatus(absl::InvalidArgumentError("n: not supported"), Endpoint::kCompletions)));
  EXPECT_EQ(body["error"]["message"], "n: not supported");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["param"], "n");
  EXPECT_TRUE(body["error"]["code"].is_null());
}

TEST(OpenAiAuth, BearerKey) {
  EXPECT_TRUE(CheckApiKey("", nullptr).ok());
  EXPECT_TRUE(CheckApiKey("", "Bearer whatever").ok());
  EXPECT_TRUE(CheckApiKey("sk-1", "Bearer sk-1").ok());
  EXPECT_EQ(CheckApiKey("sk-1", nullptr).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckApiKey("sk-1", "Bearer sk-2").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckApiKey("sk-1", "Bearer sk-11").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckApiKey("sk-1", "Bearer ").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckApiKey("sk-1", "sk-1").code(), absl::StatusCode::kUnauthenticated);
}

TEST(OpenAiModels, NotFoundOnlyForANameNoNodeRegistered) {
  EXPECT_EQ(CheckModelFound("x", {.ever_registered = false, .any_model_served = true}).code(),
            absl::StatusCode::kNotFound);
  // Nothing served yet (start-up): the Generate path's UNAVAILABLE, not 404.
  EXPECT_TRUE(CheckModelFound("x", {.ever_registered = false, .any_model_served = false}).ok());
  EXPECT_TRUE(CheckModelFound("x", {.ever_registered = true, .any_model_served = true}).ok());
  const json list = json::parse(ModelsBody({ModelSummary{
      .info = {.name = "m", .context_length = 8192, .retrieval_methods = {{"full", 0}}},
      .prefill_nodes = 1,
      .decode_nodes = 2}}));
  EXPECT_EQ(list["object"], "list");
  EXPECT_EQ(list["data"][0]["id"], "m");
  EXPECT_EQ(list["data"][0]["object"], "model");
  EXPECT_EQ(list["data"][0]["max_model_len"], 8192);
  EXPECT_EQ(list["data"][0]["kvr"]["decode_nodes"], 2);
}

GenerateParams Params() {
  GenerateParams p;
  p.request_id = "abc";
  p.model = "m";
  p.retrieval.method = "quest";
  p.retrieval.budget = 64;
  return p;
}

GenerateEvent Tokens(std::string text, uint32_t n) {
  GenerateEvent e;
  e.chunk.text = std::move(text);
  e.chunk.token_ids = {1};
  e.completion_tokens = n;
  e.prompt_tokens = 5;
  return e;
}

GenerateEvent Final(std::string text, FinishReason reason) {
  GenerateEvent e = Tokens(std::move(text), 3);
  FinalReport r;
  r.completion.finish_reason = reason;
  r.completion.prompt_tokens = 5;
  r.completion.completion_tokens = 3;
  r.completion.cached_tokens = 2;
  r.decode_node = "d1";
  r.attempts = 1;
  e.final = r;
  return e;
}

// The JSON payloads of "data: ..." events ("[DONE]" as the string).
std::vector<json> Events(const std::string& sse) {
  std::vector<json> out;
  for (absl::string_view block : absl::StrSplit(sse, "\n\n", absl::SkipEmpty())) {
    EXPECT_TRUE(absl::ConsumePrefix(&block, "data: ")) << block;
    out.push_back(block == "[DONE]" ? json("[DONE]") : json::parse(block));
  }
  return out;
}

TEST(OpenAiResponse, ChatStreamWithUsage) {
  ParsedRequest req;
  req.endpoint = Endpoint::kChatCompletions;
  req.stream = true;
  req.include_usage = true;
  ResponseBuilder b(req, Params(), 1700000000);
  std::vector<json> ev = Events(b.StreamEvents(Tokens("Hel", 1)));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(ev[0]["id"], "chatcmpl-abc");
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(ev[0]["usage"].is_null());
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["content"], "Hel");
  EXPECT_TRUE(ev[1]["choices"][0]["finish_reason"].is_null());
  // Held-back text (an incomplete UTF-8 sequence) makes no chunk.
  EXPECT_TRUE(b.StreamEvents(Tokens("", 2)).empty());
  ev = Events(b.StreamEvents(Final("lo", FinishReason::kEos)));
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["content"], "lo");
  EXPECT_EQ(ev[1]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(ev[1]["kvr"]["method"], "quest");
  EXPECT_EQ(ev[1]["kvr"]["budget"], 64);
  EXPECT_EQ(ev[1]["kvr"]["decode_node"], "d1");
  EXPECT_TRUE(ev[2]["choices"].empty());
  EXPECT_EQ(ev[2]["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(ev[2]["usage"]["completion_tokens"], 3);
  EXPECT_EQ(ev[2]["usage"]["total_tokens"], 8);
  EXPECT_EQ(ev[2]["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
  EXPECT_EQ(ev[3], "[DONE]");
}

TEST(OpenAiResponse, CompletionsStreamWithoutUsage) {
  ParsedRequest req;
  req.stream = true;
  ResponseBuilder b(req, Params(), 1);
  std::vector<json> ev = Events(b.StreamEvents(Tokens("a", 1)));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["object"], "text_completion");
  EXPECT_EQ(ev[0]["choices"][0]["text"], "a");
  EXPECT_FALSE(ev[0].contains("usage"));
  ev = Events(b.StreamEvents(Final("", FinishReason::kLength)));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(ev[1], "[DONE]");
  const std::vector<json> err = Events(ResponseBuilder::StreamError(
      ErrorFromStatus(absl::UnavailableError("decode node failed"), Endpoint::kCompletions)));
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0]["error"]["message"], "decode node failed");
}

TEST(OpenAiResponse, WholeBodies) {
  ParsedRequest req;
  req.endpoint = Endpoint::kChatCompletions;
  ResponseBuilder chat(req, Params(), 7);
  chat.Add(Tokens("Hi", 1));
  chat.Add(Final(" you", FinishReason::kStopString));
  json body = json::parse(chat.Body());
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["created"], 7);
  EXPECT_EQ(body["model"], "m");
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "Hi you");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["usage"]["total_tokens"], 8);
  EXPECT_EQ(body["kvr"]["request_id"], "abc");

  req.endpoint = Endpoint::kCompletions;
  ResponseBuilder text(req, Params(), 7);
  text.Add(Final("x", FinishReason::kLength));
  body = json::parse(text.Body());
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["id"], "cmpl-abc");
  EXPECT_EQ(body["choices"][0]["text"], "x");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
}

}  // namespace
}  // namespace kvr::controller::openai
