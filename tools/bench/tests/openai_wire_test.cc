// Unit tests of the openai-* backends' wire (no HTTP): server-sent-event framing, reading
// chat and completion chunks into a RequestResult, refused requests, request bodies; the
// ShareGPT dataset parser; and the runner driving a fake Backend.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "kvr/loadgen/backend.h"
#include "kvr/loadgen/dataset.h"
#include "kvr/loadgen/openai_wire.h"
#include "kvr/loadgen/runner.h"
#include "nlohmann/json.hpp"

namespace kvr::loadgen {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

std::vector<std::string> FeedAll(SseParser& p, const std::vector<std::string>& pieces) {
  std::vector<std::string> events;
  for (const std::string& piece : pieces) {
    for (std::string& e : p.Feed(piece)) events.push_back(std::move(e));
  }
  return events;
}

TEST(SseParserTest, SplitsEventsOnBlankLines) {
  SseParser p;
  EXPECT_THAT(FeedAll(p, {"data: {\"a\":1}\n\ndata: [DONE]\n\n"}),
              ElementsAre("{\"a\":1}", "[DONE]"));
}

TEST(SseParserTest, BytesMaySplitAnywhereIncludingCrLf) {
  const std::string stream = "data: one\r\n\r\ndata:two\r\n\r\n";
  // Every split point of the stream gives the same events.
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    SseParser p;
    EXPECT_THAT(FeedAll(p, {stream.substr(0, cut), stream.substr(cut)}), ElementsAre("one", "two"))
        << "cut at " << cut;
  }
}

TEST(SseParserTest, CommentsOtherFieldsAndMultiLineData) {
  SseParser p;
  // ": keep-alive" is kvr's idle comment; "event:" and "id:" are ignored; two data lines join
  // with "\n"; an event with no data line yields nothing; "\r" alone ends a line too.
  EXPECT_THAT(FeedAll(p, {": keep-alive\n\n", "event: x\nid: 3\ndata: a\ndata: b\n\n",
                          "event: only\n\n", "data: c\r\r"}),
              ElementsAre("a\nb", "c"));
  // An unfinished event is held back until its blank line.
  EXPECT_TRUE(p.Feed("data: half").empty());
  EXPECT_THAT(p.Feed("\n\n"), ElementsAre("half"));
}

// A reader over a result, fed events at chosen times (milliseconds after the send).
struct ReaderHarness {
  explicit ReaderHarness(OpenAiEndpoint endpoint) : reader(endpoint, sent, &result) {}
  void At(int ms, const std::string& data) {
    reader.OnEvent(data, sent + std::chrono::milliseconds(ms));
  }
  void FinishAt(int ms) { reader.Finish(sent + std::chrono::milliseconds(ms)); }

  Clock::time_point sent = Clock::now();
  RequestResult result;
  OpenAiStreamReader reader;
};

std::string ChatChunk(const json& delta) {
  return json{{"object", "chat.completion.chunk"},
              {"choices", {{{"index", 0}, {"delta", delta}, {"finish_reason", nullptr}}}}}
      .dump();
}

TEST(OpenAiStreamReaderTest, ChatTtftAtFirstContentNotTheRoleChunk) {
  ReaderHarness h(OpenAiEndpoint::kChatCompletions);
  h.At(5, ChatChunk({{"role", "assistant"}, {"content", ""}}));  // opening role chunk
  h.At(20, ChatChunk({{"content", "Hello"}}));
  h.At(32, ChatChunk({{"content", " world"}}));
  h.At(33, ChatChunk(json::object()));  // final chunk: no content
  h.At(34, json{{"choices", json::array()},
                {"usage", {{"prompt_tokens", 17}, {"completion_tokens", 3}}},
                {"kvr",
                 {{"bytes_fetched", 4096},
                  {"hot_cache_hits", 6},
                  {"hot_cache_misses", 2},
                  {"timings", {{"time_to_first_token_s", 0.0125}}}}}}
               .dump());
  h.At(35, "[DONE]");
  h.FinishAt(36);
  const RequestResult& r = h.result;
  ASSERT_TRUE(r.success) << r.error_code << ": " << r.error;
  EXPECT_NEAR(r.ttft_s, 0.020, 1e-9);
  ASSERT_EQ(r.itl_s.size(), 1u);
  EXPECT_NEAR(r.itl_s[0], 0.012, 1e-9);
  EXPECT_NEAR(r.latency_s, 0.036, 1e-9);
  EXPECT_EQ(r.generated_text, "Hello world");
  EXPECT_EQ(r.prompt_len, 17u);
  EXPECT_EQ(r.output_len, 3u);  // the server's count, not the 2 text chunks
  EXPECT_EQ(r.bytes_fetched, 4096u);
  EXPECT_EQ(r.hot_cache_hits, 6u);
  EXPECT_EQ(r.hot_cache_misses, 2u);
  ASSERT_TRUE(r.server_ttft_s.has_value());
  EXPECT_DOUBLE_EQ(*r.server_ttft_s, 0.0125);
}

TEST(OpenAiStreamReaderTest, CompletionsWithoutUsageCountTextChunks) {
  ReaderHarness h(OpenAiEndpoint::kCompletions);
  h.At(10, R"({"choices":[{"index":0,"text":"a"}],"usage":null})");
  h.At(11, R"({"choices":[{"index":0,"text":""}]})");
  h.At(15, R"({"choices":[{"index":0,"text":"b"}]})");
  h.At(16, "[DONE]");
  h.FinishAt(16);
  ASSERT_TRUE(h.result.success);
  EXPECT_NEAR(h.result.ttft_s, 0.010, 1e-9);
  EXPECT_EQ(h.result.output_len, 2u);
  EXPECT_EQ(h.result.prompt_len, 0u);  // not reported: the runner fills in its estimate
  EXPECT_FALSE(h.result.server_ttft_s.has_value());  // no "kvr" object: not a kvr server
  EXPECT_EQ(h.result.generated_text, "ab");
}

TEST(OpenAiStreamReaderTest, ErrorsFailTheRequest) {
  {
    ReaderHarness h(OpenAiEndpoint::kChatCompletions);
    h.At(1, ChatChunk({{"content", "x"}}));
    h.At(2, R"({"error":{"message":"deadline exceeded","type":"timeout"}})");
    h.FinishAt(3);  // no [DONE] after an error event
    EXPECT_FALSE(h.result.success);
    EXPECT_EQ(h.result.error_code, "STREAM_ERROR");
    EXPECT_THAT(h.result.error, HasSubstr("deadline exceeded"));
  }
  {
    ReaderHarness h(OpenAiEndpoint::kChatCompletions);
    h.At(1, ChatChunk({{"content", "x"}}));
    h.FinishAt(2);  // the connection closed before [DONE]
    EXPECT_FALSE(h.result.success);
    EXPECT_THAT(h.result.error, HasSubstr("[DONE]"));
  }
  {
    ReaderHarness h(OpenAiEndpoint::kChatCompletions);
    h.At(1, "not json");
    h.At(2, "[DONE]");
    h.FinishAt(2);
    EXPECT_FALSE(h.result.success);
    EXPECT_THAT(h.result.error, HasSubstr("not a JSON object"));
  }
  {
    // A completions chunk read as chat: the shape is named.
    ReaderHarness h(OpenAiEndpoint::kChatCompletions);
    h.At(1, R"({"choices":[{"index":0,"text":"a"}]})");
    h.At(2, "[DONE]");
    h.FinishAt(2);
    EXPECT_FALSE(h.result.success);
    EXPECT_THAT(h.result.error, HasSubstr("delta.content"));
  }
}

TEST(HttpErrorTest, StatusMapsToACodeAndTheMessageIsKept) {
  RequestResult r;
  HttpErrorToResult(429, R"({"error":{"message":"too many requests in flight","type":"x"}})", &r);
  EXPECT_FALSE(r.success);
  EXPECT_EQ(r.error_code, "RESOURCE_EXHAUSTED");
  EXPECT_EQ(r.error, "HTTP 429: too many requests in flight");
  HttpErrorToResult(502, "<html>bad gateway</html>", &r);
  EXPECT_EQ(r.error_code, "HTTP_502");
  EXPECT_EQ(r.error, "HTTP 502: <html>bad gateway</html>");
  HttpErrorToResult(404, R"({"error":{"message":"no such model"}})", &r);
  EXPECT_EQ(r.error_code, "NOT_FOUND");
}

TEST(OpenAiRequestBodyTest, ChatAndCompletionsBodies) {
  RequestSpec spec;
  spec.model = "m";
  spec.output_len = 7;
  Prompt text;
  text.text = "hi";
  const json chat = json::parse(OpenAiRequestBody(OpenAiEndpoint::kChatCompletions, spec, text));
  EXPECT_EQ(chat["messages"], json::parse(R"([{"role":"user","content":"hi"}])"));
  EXPECT_EQ(chat["max_completion_tokens"], 7);
  EXPECT_EQ(chat["stream"], true);
  EXPECT_EQ(chat["stream_options"]["include_usage"], true);
  // No extension fields unless asked for: a plain OpenAI server would refuse them.
  EXPECT_FALSE(chat.contains("ignore_eos"));
  EXPECT_FALSE(chat.contains("kvr"));

  spec.ignore_eos = true;
  spec.method = "quest";
  spec.budget = 256;
  text.max_tokens = 3;
  const json completion = json::parse(OpenAiRequestBody(OpenAiEndpoint::kCompletions, spec, text));
  EXPECT_EQ(completion["prompt"], "hi");
  EXPECT_EQ(completion["max_tokens"], 3);  // the prompt's own length wins
  EXPECT_EQ(completion["ignore_eos"], true);
  EXPECT_EQ(completion["kvr"], json::parse(R"({"method":"quest","budget":256})"));
  EXPECT_FALSE(completion.contains("messages"));

  // Sink and local window travel in the same extension (kvr eval endpoint sets them).
  spec.n_sink = 16;
  spec.local_window = 128;
  const json windowed = json::parse(OpenAiRequestBody(OpenAiEndpoint::kCompletions, spec, text));
  EXPECT_EQ(windowed["kvr"],
            json::parse(R"({"method":"quest","budget":256,"n_sink":16,"local_window":128})"));
}

std::string ShareGpt(const std::vector<json>& entries) { return json(entries).dump(); }

json Turn(const std::string& from, const std::string& value) {
  json turn = json::object();
  turn["from"] = from;
  turn["value"] = value;
  return turn;
}

json Conversation(const std::string& human, const std::string& gpt) {
  json entry = json::object();
  entry["id"] = "x";
  entry["conversations"] = json::array({Turn("human", human), Turn("gpt", gpt)});
  return entry;
}

TEST(ShareGptTest, FirstTurnIsThePromptAndTheReplySetsMaxTokens) {
  const std::string text = ShareGpt({Conversation("one two three four five", "a b c d e f")});
  auto prompts = ParseShareGpt(text, "sg.json", 10, {});
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  ASSERT_EQ(prompts->size(), 1u);
  EXPECT_EQ((*prompts)[0].text, "one two three four five");
  EXPECT_TRUE((*prompts)[0].messages.empty());
  EXPECT_EQ((*prompts)[0].approx_tokens, 5u);
  EXPECT_EQ((*prompts)[0].max_tokens, 6u);
  // A fixed output length replaces the reply's.
  ShareGptOptions fixed;
  fixed.output_len = 32;
  auto with_fixed = ParseShareGpt(text, "sg.json", 10, fixed);
  ASSERT_TRUE(with_fixed.ok()) << with_fixed.status();
  EXPECT_EQ((*with_fixed)[0].max_tokens, 32u);
}

TEST(ShareGptTest, SkipsAsVllmDoesAndSamplesBySeed) {
  std::vector<json> entries;
  json one_turn = json::object();
  one_turn["conversations"] = json::array({Turn("human", "only one turn here")});
  entries.push_back(one_turn);
  entries.push_back(Conversation("too short", "a b c d e"));    // prompt < 4 tokens
  entries.push_back(Conversation("a fine prompt here", "ok"));  // reply < 4 tokens
  for (int i = 0; i < 20; ++i) {
    entries.push_back(Conversation("prompt number " + std::to_string(i) + " is here",
                                   "the reply has five words"));
  }
  const std::string text = ShareGpt(entries);
  auto all = ParseShareGpt(text, "sg.json", 100, {});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 20u);
  ShareGptOptions limits;
  limits.max_total_len = 9;  // 5-word prompts + 5-word replies are 10
  EXPECT_FALSE(ParseShareGpt(text, "sg.json", 100, limits).ok());
  // With a fixed output length, short replies are no longer skipped.
  ShareGptOptions fixed;
  fixed.output_len = 8;
  auto with_fixed = ParseShareGpt(text, "sg.json", 100, fixed);
  ASSERT_TRUE(with_fixed.ok()) << with_fixed.status();
  EXPECT_EQ(with_fixed->size(), 21u);
  // A sample: max_prompts of them, the same for the same seed, another for another seed.
  auto texts = [&](uint64_t seed) {
    ShareGptOptions o;
    o.seed = seed;
    std::vector<std::string> out;
    auto sample = ParseShareGpt(text, "sg.json", 5, o);
    EXPECT_TRUE(sample.ok()) << sample.status();
    if (sample.ok()) {
      for (const Prompt& p : *sample) out.push_back(p.text);
    }
    return out;
  };
  EXPECT_EQ(texts(1).size(), 5u);
  EXPECT_EQ(texts(1), texts(1));
  EXPECT_NE(texts(1), texts(2));
}

TEST(ShareGptTest, ErrorsNameTheFileTheEntryAndTheProblem) {
  auto error = [](const std::string& text) {
    auto r = ParseShareGpt(text, "sg.json", 10, {});
    EXPECT_FALSE(r.ok()) << text;
    return std::string(r.status().message());
  };
  EXPECT_THAT(error("{not json"), HasSubstr("sg.json: not valid JSON"));
  EXPECT_THAT(error(R"({"conversations": []})"), HasSubstr("expected a JSON array"));
  EXPECT_THAT(error(R"([{"conversations": []}, 5])"), HasSubstr("entry 1: expected an object"));
  EXPECT_THAT(error(R"([{"messages": []}])"), HasSubstr("entry 0: needs a \"conversations\""));
  EXPECT_THAT(error(R"([{"conversations": [{"from": "human", "value": 3}, {"value": "x"}]}])"),
              HasSubstr("entry 0: conversations[0] needs a string \"value\""));
  EXPECT_THAT(error("[]"), HasSubstr("no conversation of 0"));
  EXPECT_EQ(LoadShareGpt("/nonexistent/sg.json", 10, {}).status().code(),
            absl::StatusCode::kNotFound);
}

// A Backend that answers every request on its own thread after a short delay: "ok <text>"
// as the generated text, or refuses prompts with chat messages.
class FakeBackend final : public Backend {
 public:
  ~FakeBackend() override {
    for (std::thread& t : threads_) t.join();
  }
  absl::StatusOr<std::string> ResolveModel(const std::string& wanted) override {
    return wanted.empty() ? "fake" : wanted;
  }
  absl::Status CheckPrompt(const Prompt& prompt) const override {
    return prompt.messages.empty() ? absl::OkStatus()
                                   : absl::InvalidArgumentError("no chat messages here");
  }
  void Send(const RequestSpec& spec, const Prompt& prompt, RequestResult* result,
            std::function<void()> on_done) override {
    threads_.emplace_back([result, text = prompt.text, on_done = std::move(on_done)] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      result->success = true;
      result->ttft_s = 0.001;
      result->latency_s = 0.002;
      result->output_len = 1;
      result->generated_text = "ok " + text;
      on_done();
    });
  }

 private:
  std::vector<std::thread> threads_;
};

TEST(RunnerTest, DrivesABackendAndFillsWhatItLeftOut) {
  FakeBackend backend;
  std::vector<Prompt> prompts(2);
  prompts[0].text = "The pass key is 12345";
  prompts[0].passkey = "12345";
  prompts[0].approx_tokens = 5;
  prompts[1].text = "plain";
  prompts[1].approx_tokens = 1;
  RunOptions o;
  o.request.model = "fake";
  o.num_requests = 5;
  o.arrival.rate = 1000;
  auto outcome = RunBenchmark(backend, o, prompts);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  ASSERT_EQ(outcome->results.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const RequestResult& r = outcome->results[i];
    EXPECT_TRUE(r.success);
    EXPECT_EQ(r.prompt_len, prompts[i % 2].approx_tokens) << i;
    EXPECT_EQ(r.passkey_correct.has_value(), i % 2 == 0) << i;
    if (r.passkey_correct) {
      EXPECT_TRUE(*r.passkey_correct);
    }
  }
  EXPECT_GT(outcome->results[4].start_time_s, outcome->results[0].start_time_s);

  // A prompt the backend cannot send fails the run before anything is sent.
  prompts[1].messages.push_back({"user", "hi"});
  auto refused = RunBenchmark(backend, o, prompts);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("prompt 1: no chat messages here"));
}

TEST(BackendTest, KindsParseAndBadOptionsAreRefused) {
  EXPECT_EQ(*ParseBackendKind("openai-chat"), BackendKind::kOpenAiChat);
  EXPECT_THAT(ParseBackendKind("vllm").status().message(), HasSubstr("kvr-grpc, openai-chat"));
  BackendOptions o;
  o.kind = BackendKind::kOpenAiCompletions;
  EXPECT_THAT(MakeBackend(o).status().message(), HasSubstr("needs a base URL"));
  o.base_url = "127.0.0.1:8000/v1";
  EXPECT_THAT(MakeBackend(o).status().message(), HasSubstr("must start with http://"));
  o.base_url = "http://127.0.0.1:1/v1";
  auto backend = MakeBackend(o);
  ASSERT_TRUE(backend.ok());
  // Nothing listens on port 1: the model lookup says where it tried.
  auto model = (*backend)->ResolveModel("");
  EXPECT_EQ(model.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(model.status().message(), HasSubstr("http://127.0.0.1:1/v1/models"));
  Prompt chat;
  chat.messages.push_back({"user", "hi"});
  EXPECT_THAT((*backend)->CheckPrompt(chat).message(), HasSubstr("use --backend openai-chat"));
}

}  // namespace
}  // namespace kvr::loadgen
