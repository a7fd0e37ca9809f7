// Unit tests of kvr::eval_endpoint: every task's generator (deterministic per seed, its answer
// in the haystack at the depth asked, the prompt fitted to the length with the SmolLM2
// tokenizer), the scoring rules, and the suite over a fake Backend (scores, agreement with
// full, aggregation, the JSON), and the quality gate (each rule that fails it, the checked-in
// file).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvr/common/paths.h"
#include "kvr/eval_endpoint/gate.h"
#include "kvr/eval_endpoint/suite.h"
#include "kvr/eval_endpoint/tasks.h"
#include "kvr/model/gguf.h"
#include "kvr/model/loader.h"
#include "kvr/model/tokenizer.h"

namespace kvr::eval_endpoint {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Lines of a licence-like text, so that the tests do not depend on the machine's files.
const std::vector<std::string>& Corpus() {
  static const std::vector<std::string> lines = [] {
    std::vector<std::string> l;
    for (int i = 0; i < 400; ++i) {
      l.push_back("Section " + std::to_string(i) +
                  ". Permission is hereby granted to copy and distribute this work, provided "
                  "that the notice is kept intact.");
    }
    return l;
  }();
  return lines;
}

// The SmolLM2 tokenizer, BOS included where the model adds one (as the server counts).
TokenCounter SmolCounter() {
  static const model::Tokenizer* tokenizer = [] {
    auto file = model::GgufFile::Open(TestModelPath());
    if (!file.ok()) return static_cast<model::Tokenizer*>(nullptr);
    auto spec = model::TokenizerSpecFromGguf(*file);
    if (!spec.ok()) return static_cast<model::Tokenizer*>(nullptr);
    auto t = model::Tokenizer::FromGgufMetadata(*spec);
    return t.ok() ? new model::Tokenizer(std::move(*t)) : nullptr;
  }();
  if (tokenizer == nullptr) return nullptr;
  return [](std::string_view text) -> absl::StatusOr<uint32_t> {
    auto ids = tokenizer->Encode(text, {});
    if (!ids.ok()) return ids.status();
    return static_cast<uint32_t>(ids->size());
  };
}

// Whitespace-separated words: quick and tokenizer-free.
absl::StatusOr<uint32_t> WordCount(std::string_view text) {
  return static_cast<uint32_t>(
      std::vector<absl::string_view>(
          absl::StrSplit(absl::string_view(text.data(), text.size()), ' ', absl::SkipWhitespace()))
          .size());
}

Sample Make(const std::string& task, uint32_t tokens, uint64_t seed, uint32_t index,
            const TokenCounter& counter = WordCount) {
  auto s = GenerateSample({task, tokens, seed, index, &Corpus()}, counter);
  EXPECT_TRUE(s.ok()) << task << ": " << s.status();
  return s.ok() ? *s : Sample{};
}

TEST(EvalTasksTest, EveryTaskIsDeterministicPerSeedAndDiffersAcrossSeeds) {
  for (const std::string& task : TaskNames()) {
    SCOPED_TRACE(task);
    const Sample a = Make(task, 600, 7, 0);
    const Sample b = Make(task, 600, 7, 0);
    EXPECT_EQ(a.prompt, b.prompt);
    EXPECT_EQ(a.answers, b.answers);
    EXPECT_NE(Make(task, 600, 8, 0).prompt, a.prompt);
    EXPECT_NE(Make(task, 600, 7, 1).prompt, a.prompt);
    EXPECT_EQ(a.task, task);
    EXPECT_FALSE(a.answers.empty());
  }
}

TEST(EvalTasksTest, PromptsFitTheLengthInModelTokens) {
  const TokenCounter counter = SmolCounter();
  ASSERT_TRUE(counter) << "no tokenizer at " << TestModelPath() << " (scripts/fetch-model.sh)";
  for (const std::string& task : TaskNames()) {
    for (uint32_t length : {512u, 2048u}) {
      SCOPED_TRACE(task + " at " + std::to_string(length));
      const Sample s = Make(task, length, 3, 0, counter);
      EXPECT_EQ(*counter(s.prompt), s.prompt_tokens);
      EXPECT_LE(s.prompt_tokens, length);
      // Fitted, not just under: within one haystack unit (a list item, a licence line).
      EXPECT_GE(s.prompt_tokens + 40, length);
    }
  }
}

// The whole answer, written as the model writes it (": a, b, c, d."), fits the tokens each task
// lets the model generate, in the served model's tokens: a budget too small cuts a multi-part
// answer short and caps the task's score below 1 for every method alike.
TEST(EvalTasksTest, TheWholeAnswerFitsMaxTokensInModelTokens) {
  const TokenCounter counter = SmolCounter();
  ASSERT_TRUE(counter) << "no tokenizer at " << TestModelPath() << " (scripts/fetch-model.sh)";
  for (const std::string& task : TaskNames()) {
    for (uint32_t index = 0; index < 4; ++index) {
      SCOPED_TRACE(task + " sample " + std::to_string(index));
      const Sample s = Make(task, 400, 21, index, counter);
      ASSERT_FALSE(s.answers.empty());
      const std::string written = absl::StrCat(": ", absl::StrJoin(s.answers, ", "), ".");
      const absl::StatusOr<uint32_t> tokens = counter(written);
      ASSERT_TRUE(tokens.ok()) << tokens.status();
      EXPECT_LE(*tokens, s.max_tokens) << written;
    }
  }
}

TEST(EvalTasksTest, TheAnswerIsInTheHaystackAtTheDepthAsked) {
  for (const std::string task :
       {"niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "qa_licenses"}) {
    for (uint32_t index = 0; index < 5; ++index) {
      SCOPED_TRACE(task + " sample " + std::to_string(index));
      const Sample s = Make(task, 1500, 11, index);
      ASSERT_FALSE(s.needles.empty());
      const double span = static_cast<double>(s.haystack_end - s.haystack_begin);
      for (const Needle& n : s.needles) {
        ASSERT_EQ(s.prompt.substr(n.offset, n.text.size()), n.text);
        ASSERT_GE(n.offset, s.haystack_begin);
        ASSERT_LE(n.offset + n.text.size(), s.haystack_end);
        const double depth = static_cast<double>(n.offset - s.haystack_begin) / span;
        EXPECT_NEAR(depth, n.depth, 0.05) << n.text;
      }
      // Every part of the answer is in a needle, and only the haystack holds it (the question
      // does not give it away).
      for (const std::string& a : s.answers) {
        bool in_needle = false;
        for (const Needle& n : s.needles) in_needle |= n.text.find(a) != std::string::npos;
        EXPECT_TRUE(in_needle) << a;
        EXPECT_EQ(s.prompt.find(a, s.haystack_end), std::string::npos) << a;
      }
    }
  }
  // niah_single and qa_licenses cycle through depths: the first five samples cover 0.1..0.9.
  std::vector<double> depths;
  for (uint32_t i = 0; i < 5; ++i)
    depths.push_back(Make("niah_single", 800, 1, i).needles[0].depth);
  EXPECT_THAT(depths, ::testing::UnorderedElementsAre(0.1, 0.3, 0.5, 0.7, 0.9));
  // The pass key has 6 or 7 digits.
  for (uint32_t i = 0; i < 20; ++i) {
    const std::string key = Make("niah_single", 300, i, 0).answers[0];
    EXPECT_GE(key.size(), 6u);
    EXPECT_LE(key.size(), 7u);
  }
}

TEST(EvalTasksTest, VariableTrackingAsksForTheWholeChainOfTheValue) {
  const Sample s = Make("variable_tracking", 800, 5, 0);
  ASSERT_EQ(s.answers.size(), 5u);
  // The chain: the first name is assigned the value asked for, each next one the one before.
  const std::string tail = s.prompt.substr(s.haystack_end);
  const size_t at = tail.find("the value ");
  ASSERT_NE(at, std::string::npos);
  const std::string value = tail.substr(at + 10, 5);
  EXPECT_THAT(s.prompt, HasSubstr("VAR " + s.answers[0] + " = " + value + "."));
  for (size_t i = 1; i < s.answers.size(); ++i) {
    EXPECT_THAT(s.prompt, HasSubstr("VAR " + s.answers[i] + " = VAR " + s.answers[i - 1] + "."));
  }
}

TEST(EvalTasksTest, CommonWordIsTheMostFrequentByFar) {
  for (uint32_t length : {300u, 3000u}) {
    const Sample s = Make("common_words", length, 9, 0);
    std::map<std::string, int> count;
    for (absl::string_view line :
         absl::StrSplit(s.prompt.substr(s.haystack_begin, s.haystack_end - s.haystack_begin), ' ',
                        absl::SkipWhitespace())) {
      if (!line.empty() && !std::isdigit(static_cast<unsigned char>(line[0])))
        ++count[std::string(line)];
    }
    int most_other = 0;
    for (const auto& [w, c] : count) {
      if (w != s.answers[0]) most_other = std::max(most_other, c);
    }
    EXPECT_GE(count[s.answers[0]], 2 * most_other + 2) << "length " << length;
  }
}

TEST(EvalTasksTest, ImpossibleLengthsAndUnknownTasksAreRefused) {
  auto s = GenerateSample({"niah_single", 10, 0, 0, nullptr}, WordCount);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("longer length"));
  EXPECT_EQ(GenerateSample({"nope", 500, 0, 0, nullptr}, WordCount).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GenerateSample({"qa_licenses", 500, 0, 0, nullptr}, WordCount).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(EvalScoreTest, NumbersAndNamesAreWholeWords) {
  Sample s;
  s.answers = {"1234567"};
  EXPECT_EQ(Score(s, " 1234567. Remember it."), 1);
  EXPECT_EQ(Score(s, "1234567"), 1);
  EXPECT_EQ(Score(s, " 12345678"), 0);  // a longer number is not the key
  EXPECT_EQ(Score(s, " 123456"), 0);
  EXPECT_EQ(Score(s, ""), 0);
  s.answers = {"1111111", "2222222", "3333333", "4444444"};
  EXPECT_DOUBLE_EQ(Score(s, ": 2222222, 4444444 and 9999999."), 0.5);
  s.answers = {"QWERT", "ASDFG"};
  EXPECT_EQ(Score(s, " qwert, ASDFG."), 1);
  EXPECT_DOUBLE_EQ(Score(s, " QWERTY ASDFG"), 0.5);
}

TEST(EvalScoreTest, CommonWordCountsTheFirstListedWordOnly) {
  Sample s;
  s.answers = {"apple"};
  s.candidates = {"river", "candle", "apple"};
  EXPECT_EQ(Score(s, " \"apple\"."), 1);
  EXPECT_EQ(Score(s, " Apple, then river"), 1);
  EXPECT_EQ(Score(s, " river, apple, candle"), 0);  // listing every word earns nothing
  EXPECT_EQ(Score(s, " the word"), 0);
  EXPECT_EQ(NormalizeAnswer("  a \n b\t"), "a b");
}

// Answers each prompt with what the test put in `answers` for (method, prompt), after a
// short delay on a thread of its own; counts requests in flight.
class FakeBackend final : public loadgen::Backend {
 public:
  ~FakeBackend() override {
    for (std::thread& t : threads_) t.join();
  }
  absl::StatusOr<std::string> ResolveModel(const std::string& wanted) override { return "fake"; }
  absl::Status CheckPrompt(const loadgen::Prompt&) const override { return absl::OkStatus(); }
  void Send(const loadgen::RequestSpec& spec, const loadgen::Prompt& prompt,
            loadgen::RequestResult* result, std::function<void()> on_done) override {
    seen_.push_back(
        {spec.method, spec.budget.value_or(0), spec.temperature, prompt.max_tokens.value_or(0)});
    const auto it = answers.find(spec.method + "|" + prompt.text);
    threads_.emplace_back([this, result, on_done = std::move(on_done),
                           answer = it == answers.end() ? std::string("?") : it->second] {
      {
        std::lock_guard<std::mutex> lock(mu_);
        max_in_flight = std::max(max_in_flight, ++in_flight_);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      result->success = answer != "FAIL";
      if (!result->success) result->error_code = "UNAVAILABLE";
      result->generated_text = result->success ? answer : "";
      result->prompt_len = 100;
      result->output_len = 3;
      result->ttft_s = 0.010;
      result->latency_s = 0.030;
      {
        std::lock_guard<std::mutex> lock(mu_);
        --in_flight_;
      }
      on_done();
    });
  }

  struct Seen {
    std::string method;
    uint32_t budget;
    float temperature;
    uint32_t max_tokens;
  };
  std::map<std::string, std::string> answers;  // "method|prompt" -> answer
  std::vector<Seen> seen_;
  int max_in_flight = 0;

 private:
  std::mutex mu_;
  int in_flight_ = 0;
  std::vector<std::thread> threads_;
};

TEST(EvalSuiteTest, ScoresAgreementAndAggregatesOverAFakeBackend) {
  SuiteOptions o;
  o.tasks = {"niah_single", "niah_multivalue"};
  o.methods = {"exact", "streaming"};
  o.budgets = {64};
  o.lengths = {400};
  o.samples = 2;
  o.concurrency = 2;
  auto samples = GenerateSamples(o, WordCount, nullptr);
  ASSERT_TRUE(samples.ok()) << samples.status();
  ASSERT_EQ(samples->size(), 4u);
  FakeBackend backend;
  for (const Sample& s : *samples) {
    const std::string right = " " + absl::StrJoin(s.answers, ", ") + ".";
    backend.answers["full|" + s.prompt] = right;
    // exact: right, in other words on multivalue (scores 1, disagrees with full).
    backend.answers["exact|" + s.prompt] =
        s.task == "niah_single" ? right : " " + absl::StrJoin(s.answers, " and ");
    // streaming: wrong on sample 0, failed on sample 1.
    backend.answers["streaming|" + s.prompt] = s.index == 0 ? " 42" : "FAIL";
  }
  auto report = RunSuite(backend, "fake", o, *samples, nullptr);
  ASSERT_TRUE(report.ok()) << report.status();
  // full first, then each method at each budget; greedy, each task's max_tokens.
  ASSERT_EQ(backend.seen_.size(), 12u);
  EXPECT_EQ(backend.seen_[0].method, "full");
  EXPECT_EQ(backend.seen_[0].budget, 0u);
  EXPECT_EQ(backend.seen_[4].method, "exact");
  EXPECT_EQ(backend.seen_[4].budget, 64u);
  for (const auto& seen : backend.seen_) {
    EXPECT_EQ(seen.temperature, 0.f);
    EXPECT_GT(seen.max_tokens, 0u);
  }
  EXPECT_LE(backend.max_in_flight, 2);

  std::map<std::string, GroupResult> g;
  for (const GroupResult& r : report->groups) g[r.task + "/" + r.method] = r;
  ASSERT_EQ(g.size(), 6u);
  EXPECT_EQ(g["niah_single/full"].accuracy, 1);
  EXPECT_EQ(g["niah_single/full"].agreement, 1);
  EXPECT_EQ(g["niah_multivalue/full"].agreement, 1);
  EXPECT_EQ(g["niah_single/exact"].agreement, 1);
  EXPECT_EQ(g["niah_multivalue/exact"].accuracy, 1);
  EXPECT_EQ(g["niah_multivalue/exact"].agreement, 0);
  EXPECT_EQ(g["niah_single/streaming"].accuracy, 0);
  EXPECT_EQ(g["niah_single/streaming"].agreement, 0);
  EXPECT_EQ(g["niah_single/streaming"].failed, 1u);
  EXPECT_EQ(g["niah_single/streaming"].budget, 64u);
  EXPECT_NEAR(g["niah_single/full"].mean_ttft_ms, 10, 1e-9);
  EXPECT_NEAR(g["niah_single/full"].tokens_per_s, 2 / 0.020, 1e-6);
  EXPECT_EQ(g["niah_single/full"].mean_prompt_tokens, 100);

  const std::string table = FormatTable(report->groups);
  EXPECT_THAT(table, HasSubstr("niah_multivalue"));
  EXPECT_THAT(table, HasSubstr("agree_full"));
  const nlohmann::json j = ToJson(o, *report, {{"target", "x:1"}});
  EXPECT_EQ(j["config"]["target"], "x:1");
  EXPECT_EQ(j["config"]["seed"], 0);
  EXPECT_EQ(j["groups"].size(), 6u);
  EXPECT_EQ(j["samples"].size(), 12u);
  EXPECT_TRUE(j["samples"][0].contains("expected"));
}

TEST(EvalSuiteTest, AFullRequestThatFailedLeavesAgreementUnknown) {
  std::vector<Sample> samples(1);
  samples[0].task = "niah_single";
  samples[0].target_tokens = 100;
  samples[0].answers = {"123456"};
  std::vector<SampleResult> results(2);
  results[0] = {.task = "niah_single", .length = 100, .method = "full", .success = false};
  results[1] = {.task = "niah_single",
                .length = 100,
                .method = "exact",
                .budget = 8,
                .success = true,
                .answer = " 123456"};
  ScoreResults(samples, results);
  EXPECT_EQ(results[0].score, 0);
  EXPECT_EQ(results[1].score, 1);
  EXPECT_FALSE(results[1].agrees_with_full.has_value());
  const std::vector<GroupResult> groups = Aggregate(results);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_FALSE(groups[1].agreement.has_value());
  EXPECT_THAT(FormatTable(groups), Not(HasSubstr("nan")));
}

TEST(EvalSuiteTest, RunsPutFullFirstAndNeedBudgets) {
  SuiteOptions o;
  o.methods = {"exact", "full", "quest"};
  o.budgets = {32, 128};
  auto runs = Runs(o);
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(runs->size(), 5u);
  EXPECT_EQ((*runs)[0], std::make_pair(std::string("full"), 0u));
  EXPECT_EQ((*runs)[1], std::make_pair(std::string("exact"), 32u));
  o.budgets.clear();
  EXPECT_EQ(Runs(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.methods = {"full"};
  EXPECT_TRUE(Runs(o).ok());
}

TEST(EvalCorpusTest, ReadsEachFileOnceInNameOrder) {
  const std::string dir = ::testing::TempDir() + "/eval_corpus_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/B") << "second file\n\n  line two  \n";
    std::ofstream(dir + "/A") << "first file\n";
  }
  std::filesystem::create_symlink(dir + "/A", dir + "/C");
  std::vector<std::string> names;
  auto lines = ReadCorpus(dir, &names);
  ASSERT_TRUE(lines.ok()) << lines.status();
  EXPECT_EQ(*lines, (std::vector<std::string>{"first file", "second file", "line two"}));
  EXPECT_EQ(names, (std::vector<std::string>{"A", "B"}));
  std::filesystem::remove_all(dir);
  EXPECT_EQ(ReadCorpus(dir).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvr::eval_endpoint

// ---- The quality gate (gate.h) ----

namespace kvr::eval_endpoint {
namespace {

GroupResult G(const std::string& task, const std::string& method, uint32_t budget, double acc) {
  GroupResult g;
  g.task = task;
  g.length = 768;
  g.method = method;
  g.budget = budget;
  g.accuracy = acc;
  return g;
}

Gate TestGate() {
  Gate gate;
  gate.run.lengths = {768};
  gate.run.budgets = {64};
  gate.accuracy = {{"full", 0.5}, {"exact", 0.5}, {"streaming", 0.1}, {"quest", 0.4}};
  return gate;
}

// Two tasks per method; the method's accuracy is their mean.
std::vector<GroupResult> Groups(double full, double exact, double streaming, double quest) {
  std::vector<GroupResult> g;
  for (const std::string task : {"a", "b"}) {
    g.push_back(G(task, "full", 0, full));
    g.push_back(G(task, "exact", 64, exact));
    g.push_back(G(task, "streaming", 64, streaming));
    g.push_back(G(task, "quest", 64, quest));
  }
  g.push_back(G("a", "quest", 128, 0.0));  // another budget: not the gate's
  return g;
}

TEST(EvalGateTest, TheRecordedFiguresPass) {
  const GateOutcome o = CheckGate(TestGate(), Groups(0.5, 0.5, 0.1, 0.4));
  EXPECT_TRUE(o.passed()) << o.report;
  EXPECT_DOUBLE_EQ(o.accuracy.at("quest"), 0.4);
  EXPECT_THAT(o.report, HasSubstr("gate: pass"));
  // Within the tolerance (5 points) and the exact margin (2 points).
  EXPECT_TRUE(CheckGate(TestGate(), Groups(0.5, 0.485, 0.1, 0.36)).passed());
}

TEST(EvalGateTest, AMethodBelowStreamingFails) {
  Gate gate = TestGate();
  gate.accuracy["quest"] = 0.05;  // its record would allow it: the floor does not
  const GateOutcome o = CheckGate(gate, Groups(0.5, 0.5, 0.1, 0.05));
  ASSERT_FALSE(o.passed());
  EXPECT_THAT(o.report, HasSubstr("quest: accuracy 5.0 is below streaming's 10.0"));
}

TEST(EvalGateTest, ExactMoreThanTwoPointsUnderFullFails) {
  Gate gate = TestGate();
  gate.accuracy["exact"] = 0.47;
  const GateOutcome o = CheckGate(gate, Groups(0.5, 0.47, 0.1, 0.4));
  ASSERT_EQ(o.failures.size(), 1u) << o.report;
  EXPECT_THAT(o.failures[0], HasSubstr("exact: accuracy 47.0 is more than 2.0 points under"));
}

TEST(EvalGateTest, MoreThanFivePointsUnderTheRecordFails) {
  const GateOutcome o = CheckGate(TestGate(), Groups(0.5, 0.5, 0.1, 0.34));
  ASSERT_EQ(o.failures.size(), 1u) << o.report;
  EXPECT_THAT(o.failures[0], HasSubstr("quest: accuracy 34.0 is more than 5.0 points under"));
}

TEST(EvalGateTest, AMethodWithoutResultsFails) {
  std::vector<GroupResult> groups = Groups(0.5, 0.5, 0.1, 0.4);
  std::erase_if(groups, [](const GroupResult& g) { return g.method == "exact"; });
  const GateOutcome o = CheckGate(TestGate(), groups);
  ASSERT_FALSE(o.passed());
  EXPECT_THAT(o.report, HasSubstr("exact: no result at length 768 budget 64"));
}

// The checked-in gate parses, names every task, and its own figures pass it.
TEST(EvalGateTest, TheCheckedInGateFileParses) {
  const char* source = std::getenv("KVR_SOURCE_DIR");
  ASSERT_NE(source, nullptr);
  std::ifstream in(std::string(source) + "/tools/eval/gate/smollm2-135m-768.json");
  ASSERT_TRUE(in);
  auto gate = ParseGate(nlohmann::json::parse(in));
  ASSERT_TRUE(gate.ok()) << gate.status();
  EXPECT_EQ(gate->run.tasks, TaskNames());
  EXPECT_EQ(gate->run.lengths, std::vector<uint32_t>{768});
  EXPECT_EQ(gate->run.methods[0], "full");
  EXPECT_TRUE(gate->run.local_window.has_value());
  std::vector<GroupResult> groups;
  for (const auto& [method, acc] : gate->accuracy) {
    for (const std::string& task : gate->run.tasks) {
      groups.push_back(G(task, method, method == "full" ? 0 : gate->run.budgets[0], acc));
    }
  }
  EXPECT_TRUE(CheckGate(*gate, groups).passed());
}

TEST(EvalGateTest, BadFilesAreRefusedNamingTheField) {
  auto bad = ParseGate(nlohmann::json::parse(R"({"run": {"length": 768, "samples": 2},
                                                  "accuracy": {"full": 0.5}})"));
  EXPECT_THAT(bad.status().message(), HasSubstr("run.budget"));
  bad = ParseGate(nlohmann::json::parse(R"({"run": {"length": 768, "budget": 64, "samples": 2},
                                             "accuracy": {"full": 1.5}})"));
  EXPECT_THAT(bad.status().message(), HasSubstr("accuracy.full"));
  EXPECT_FALSE(GroupsFromJson(nlohmann::json::parse(R"({"groups": []})")).ok());
  EXPECT_FALSE(GroupsFromJson(nlohmann::json::parse(
                                  R"({"groups": [{"task": 1, "length": 1, "method": "x",
                                                  "budget": 0, "accuracy": 0}]})"))
                   .ok());
}

// What ToJson writes, GroupsFromJson reads back (the gate on a result file).
TEST(EvalGateTest, ResultJsonRoundTrips) {
  SuiteReport report;
  report.model = "m";
  report.groups = {G("a", "exact", 64, 0.25)};
  report.groups[0].agreement = 0.5;
  auto back = GroupsFromJson(ToJson(SuiteOptions{}, report, nullptr));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 1u);
  EXPECT_EQ((*back)[0].method, "exact");
  EXPECT_EQ((*back)[0].budget, 64u);
  EXPECT_EQ((*back)[0].length, 768u);
  EXPECT_DOUBLE_EQ((*back)[0].accuracy, 0.25);
  EXPECT_EQ((*back)[0].agreement, 0.5);
}

}  // namespace
}  // namespace kvr::eval_endpoint
