#include "kvr/controller/request_runner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "kvr/controller/ids.h"
#include "kvr/controller/request_state.h"
#include "test_cluster.h"

namespace kvr::controller {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace kvr::controller::testing;

struct CancelCall {
  std::string node;
  uint64_t sequence_id;
  std::string reason;
};

class FakePrefill : public PrefillClient {
 public:
  using Behavior = std::function<absl::StatusOr<PrefillResult>(const PrefillCall&)>;
  absl::StatusOr<PrefillResult> Prefill(const NodeSnapshot& node, const PrefillCall& call,
                                        CancellationToken* cancel) override {
    calls.push_back({node.id, call});
    prompts_were_ids.push_back(std::holds_alternative<std::vector<uint32_t>>(call.params->prompt));
    bounds.push_back(call.params->prompt_tokens_bound);
    auto it = behavior.find(node.id);
    if (it != behavior.end()) return it->second(call);
    PrefillResult r;
    r.prompt_tokens = 5;
    r.first_token = 100;
    r.first_text = "t100";
    return r;
  }
  absl::Status Cancel(const NodeSnapshot& node, absl::string_view, uint64_t seq,
                      absl::string_view reason, absl::Time) override {
    cancels.push_back({node.id, seq, std::string(reason)});
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<uint32_t>> Tokenize(const NodeSnapshot& node, const GenerateParams&,
                                                 absl::Time) override {
    tokenize_calls.push_back(node.id);
    if (!tokenize) return absl::UnimplementedError("Tokenize");
    return tokenize(node.id);
  }
  std::map<std::string, Behavior> behavior;
  std::function<absl::StatusOr<std::vector<uint32_t>>(const std::string& node)> tokenize;
  std::vector<std::pair<std::string, PrefillCall>> calls;
  std::vector<bool> prompts_were_ids;
  std::vector<uint64_t> bounds;
  std::vector<std::string> tokenize_calls;
  std::vector<CancelCall> cancels;
};

class FakeDecode : public DecodeClient {
 public:
  absl::StatusOr<Completion> Stream(
      const NodeSnapshot& node, absl::string_view, uint64_t seq, absl::Time deadline,
      CancellationToken* cancel,
      absl::FunctionRef<absl::Status(const TokenChunk&)> on_chunk) override {
    stream_nodes.push_back(node.id);
    stream_deadlines.push_back(deadline);
    for (uint32_t i = 0; i < n_tokens; ++i) {
      if (i == fail_after) return fail_status;
      if (i == cancel_after) cancel->Cancel(absl::CancelledError("client disconnected"));
      if (cancel->IsCancelled()) return absl::CancelledError("call cancelled");
      TokenChunk c{{101 + i}, absl::StrCat("t", 101 + i)};
      if (absl::Status s = on_chunk(c); !s.ok()) return s;
    }
    Completion done;
    done.finish_reason = FinishReason::kLength;
    done.completion_tokens = n_tokens + 1;
    done.retrieval.bytes_fetched = 4096;
    return done;
  }
  absl::Status Cancel(const NodeSnapshot& node, absl::string_view, uint64_t seq,
                      absl::string_view reason, absl::Time) override {
    cancels.push_back({node.id, seq, std::string(reason)});
    return absl::OkStatus();
  }
  uint32_t n_tokens = 3;
  uint32_t fail_after = UINT32_MAX;
  uint32_t cancel_after = UINT32_MAX;
  absl::Status fail_status = absl::UnavailableError("Socket closed");
  std::vector<std::string> stream_nodes;
  std::vector<absl::Time> stream_deadlines;
  std::vector<CancelCall> cancels;
};

class RecordingSink : public ResponseSink {
 public:
  absl::Status Send(const GenerateEvent& e) override {
    if (events.size() >= fail_after) return absl::CancelledError("client disconnected");
    events.push_back(e);
    return absl::OkStatus();
  }
  std::vector<uint32_t> Tokens() const {
    std::vector<uint32_t> out;
    for (const auto& e : events)
      out.insert(out.end(), e.chunk.token_ids.begin(), e.chunk.token_ids.end());
    return out;
  }
  size_t fail_after = SIZE_MAX;
  std::vector<GenerateEvent> events;
};

class RequestRunnerTest : public ::testing::Test {
 protected:
  RequestRunnerTest() {
    p1_ = *membership_.Register(Prefill("p:1"));
    p2_ = *membership_.Register(Prefill("p:2"));
    d1_ = *membership_.Register(Decode("d:1"));
    d2_ = *membership_.Register(Decode("d:2"));
    s1_ = *membership_.Register(Store("s:1"));
    params_.request_id = "r1";
    params_.model = "smollm2";
    params_.prompt = std::string("hello");
    params_.prompt_tokens_bound = 5;
    params_.sampling.max_tokens = 4;
    params_.retrieval.method = "full";
    params_.retrieval.budget = 8;
  }
  absl::Status Run() { return runner_.Run(params_, clock_.Now(), deadline_, &cancel_, &sink_); }

  ManualClock clock_;
  Membership membership_{&clock_, absl::Seconds(10)};
  Placement placement_{&membership_};
  FakePrefill prefill_;
  FakeDecode decode_;
  RequestRunner runner_{&membership_, &placement_, &prefill_,
                        &decode_,     &clock_,     RunnerOptions{.max_attempts = 3}};
  std::string p1_, p2_, d1_, d2_, s1_;
  GenerateParams params_;
  absl::Time deadline_ = clock_.Now() + absl::Seconds(30);
  CancellationToken cancel_;
  RecordingSink sink_;
};

TEST_F(RequestRunnerTest, RelaysFirstTokenThenDecodeStreamThenFinal) {
  ASSERT_TRUE(Run().ok());
  EXPECT_THAT(sink_.Tokens(), ElementsAre(100, 101, 102, 103));
  ASSERT_EQ(sink_.events.size(), 5u);
  EXPECT_EQ(sink_.events[0].chunk.text, "t100");
  EXPECT_EQ(sink_.events[3].completion_tokens, 4u);
  ASSERT_TRUE(sink_.events.back().final.has_value());
  const FinalReport& f = *sink_.events.back().final;
  EXPECT_EQ(f.completion.finish_reason, FinishReason::kLength);
  EXPECT_EQ(f.completion.completion_tokens, 4u);
  EXPECT_EQ(f.completion.prompt_tokens, 5u);
  EXPECT_EQ(f.completion.retrieval.bytes_fetched, 4096u);
  EXPECT_EQ(f.prefill_node, p1_);
  EXPECT_EQ(f.decode_node, d1_);
  EXPECT_EQ(f.store_node, s1_);
  EXPECT_EQ(f.attempts, 1u);
  ASSERT_EQ(prefill_.calls.size(), 1u);
  EXPECT_EQ(prefill_.calls[0].second.decode.id, d1_);
  EXPECT_EQ(prefill_.calls[0].second.store.id, s1_);
  EXPECT_TRUE(decode_.cancels.empty());
}

// Text and chat prompts are tokenized on a prefill node first: placement and the prefill call
// get the exact token ids, not the byte bound.
TEST_F(RequestRunnerTest, TextPromptIsTokenizedOnAPrefillNodeBeforePlacement) {
  prefill_.tokenize = [](const std::string&) -> absl::StatusOr<std::vector<uint32_t>> {
    return std::vector<uint32_t>{7, 8, 9};
  };
  ASSERT_TRUE(Run().ok());
  EXPECT_THAT(prefill_.tokenize_calls, ElementsAre(p1_));
  ASSERT_EQ(prefill_.calls.size(), 1u);
  EXPECT_TRUE(prefill_.prompts_were_ids[0]);
  EXPECT_EQ(prefill_.bounds[0], 3u);
  EXPECT_THAT(sink_.Tokens(), ElementsAre(100, 101, 102, 103));
}

TEST_F(RequestRunnerTest, PromptRefusedByTheTokenizerEndsTheRequestBeforePlacement) {
  prefill_.tokenize = [](const std::string&) -> absl::StatusOr<std::vector<uint32_t>> {
    return absl::InvalidArgumentError("prompt: 9000 tokens leave no room in the context");
  };
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("prompt: 9000 tokens"));
  EXPECT_TRUE(prefill_.calls.empty());
}

TEST_F(RequestRunnerTest, NoNodeCanTokenizeFallsBackToTheByteBound) {
  prefill_.tokenize = [](const std::string& node) -> absl::StatusOr<std::vector<uint32_t>> {
    return absl::UnavailableError(absl::StrCat(node, ": Connection refused"));
  };
  ASSERT_TRUE(Run().ok());
  EXPECT_THAT(prefill_.tokenize_calls, ElementsAre(p1_, p2_));
  ASSERT_EQ(prefill_.calls.size(), 1u);
  EXPECT_FALSE(prefill_.prompts_were_ids[0]);
  EXPECT_EQ(prefill_.bounds[0], 5u);
}

TEST_F(RequestRunnerTest, TokenIdPromptsAreNotTokenizedAgain) {
  params_.prompt = std::vector<uint32_t>{1, 2};
  params_.prompt_tokens_bound = 2;
  prefill_.tokenize = [](const std::string&) -> absl::StatusOr<std::vector<uint32_t>> {
    return std::vector<uint32_t>{7, 8, 9};
  };
  ASSERT_TRUE(Run().ok());
  EXPECT_TRUE(prefill_.tokenize_calls.empty());
  EXPECT_EQ(prefill_.bounds[0], 2u);
}

TEST_F(RequestRunnerTest, DeadlineIsPropagatedToEveryDownstreamCall) {
  ASSERT_TRUE(Run().ok());
  ASSERT_EQ(prefill_.calls.size(), 1u);
  EXPECT_EQ(prefill_.calls[0].second.deadline, deadline_);
  ASSERT_EQ(decode_.stream_deadlines.size(), 1u);
  EXPECT_EQ(decode_.stream_deadlines[0], deadline_);
}

// Sequence ids and capabilities are random per attempt: not consecutive, not derived from the
// request id or the clock, and a capability is 16 bytes that never repeat.
TEST_F(RequestRunnerTest, SequenceIdsAndCapabilitiesAreRandomPerAttempt) {
  // Every attempt collides, so each request makes max_attempts attempts, each with its own id.
  auto collide = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    return absl::AlreadyExistsError("taken");
  };
  prefill_.behavior[p1_] = collide;
  prefill_.behavior[p2_] = collide;
  for (int i = 0; i < 4; ++i) {
    sink_ = {};
    EXPECT_FALSE(Run().ok());
  }
  const int kRequests = static_cast<int>(prefill_.calls.size());
  ASSERT_GE(kRequests, 8);
  std::set<uint64_t> ids;
  std::set<std::string> caps;
  int increasing = 0;
  for (size_t i = 0; i < prefill_.calls.size(); ++i) {
    const PrefillCall& call = prefill_.calls[i].second;
    EXPECT_NE(call.sequence_id, 0u);
    ids.insert(call.sequence_id);
    EXPECT_EQ(call.sequence_capability.size(), 16u);
    caps.insert(call.sequence_capability);
    if (i > 0) {
      const uint64_t prev = prefill_.calls[i - 1].second.sequence_id;
      // A counter (or a clock) would make neighbours close; random ids are 2^63 apart on
      // average, and closer than 2^40 with probability ~2^-23.
      const uint64_t gap =
          call.sequence_id > prev ? call.sequence_id - prev : prev - call.sequence_id;
      EXPECT_GT(gap, uint64_t{1} << 40) << "sequence ids " << prev << " and " << call.sequence_id;
      if (call.sequence_id > prev) ++increasing;
    }
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(kRequests));
  EXPECT_EQ(caps.size(), static_cast<size_t>(kRequests));
  EXPECT_LT(increasing, kRequests - 1) << "sequence ids grow monotonically";
}

// ALREADY_EXISTS from P (the random id is taken in the store) is retried with a fresh id and
// capability, without blaming any node.
TEST_F(RequestRunnerTest, SequenceIdCollisionRetriesWithAFreshId) {
  int calls = 0;
  prefill_.behavior[p1_] = [&](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    if (++calls == 1) return absl::AlreadyExistsError("sequence 5 already exists");
    return PrefillResult{.prompt_tokens = 5, .first_token = 100, .first_text = "a"};
  };
  ASSERT_TRUE(Run().ok());
  ASSERT_EQ(prefill_.calls.size(), 2u);
  EXPECT_NE(prefill_.calls[0].second.sequence_id, prefill_.calls[1].second.sequence_id);
  EXPECT_NE(prefill_.calls[0].second.sequence_capability,
            prefill_.calls[1].second.sequence_capability);
  EXPECT_TRUE(membership_.Find(p1_).has_value());
  EXPECT_TRUE(membership_.Find(s1_).has_value());
}

TEST(IdsTest, RequestIdsAre128RandomBitsWithoutSharedStructure) {
  constexpr int kIds = 256;
  std::vector<std::string> ids;
  for (int i = 0; i < kIds; ++i) ids.push_back(NewRequestId());
  std::set<std::string> distinct(ids.begin(), ids.end());
  EXPECT_EQ(distinct.size(), ids.size());
  std::set<std::string> first_bytes;
  int increasing = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(ids[i].size(), 32u) << ids[i];
    EXPECT_EQ(ids[i].find_first_not_of("0123456789abcdef"), std::string::npos) << ids[i];
    first_bytes.insert(ids[i].substr(0, 2));
    if (i > 0) {
      if (ids[i] > ids[i - 1]) ++increasing;
      // Neighbours share a prefix of 2+ hex digits with probability 1/256: a counter or clock
      // in the id would make them share many.
      size_t common = 0;
      while (common < 32 && ids[i][common] == ids[i - 1][common]) ++common;
      EXPECT_LT(common, 8u) << ids[i - 1] << " / " << ids[i];
    }
  }
  // 256 ids spread over many leading bytes (a time or counter prefix would give one or two),
  // and their order is not their issue order.
  EXPECT_GT(first_bytes.size(), 64u);
  EXPECT_GT(increasing, kIds / 4);
  EXPECT_LT(increasing, 3 * kIds / 4);
}

TEST(IdsTest, SequenceIdsAndCapabilitiesAreIndependentOfRequestIds) {
  std::set<uint64_t> seqs;
  for (int i = 0; i < 64; ++i) {
    const std::string request = NewRequestId();
    const uint64_t seq = NewSequenceId();
    // No half of the request id is the sequence id.
    EXPECT_NE(request.substr(0, 16), absl::StrFormat("%016x", seq));
    EXPECT_NE(request.substr(16), absl::StrFormat("%016x", seq));
    seqs.insert(seq);
    const std::string cap = NewSequenceCapability();
    EXPECT_EQ(cap.size(), kSequenceCapabilityBytes);
    EXPECT_NE(cap, std::string(kSequenceCapabilityBytes, '\0'));
  }
  EXPECT_EQ(seqs.size(), 64u);
}

TEST_F(RequestRunnerTest, PrefillNodeDeathBeforeAnyTokenRetriesOnAnotherNode) {
  prefill_.behavior[p1_] = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    return absl::UnavailableError("Connection refused");
  };
  ASSERT_TRUE(Run().ok());
  ASSERT_EQ(prefill_.calls.size(), 2u);
  EXPECT_EQ(prefill_.calls[0].first, p1_);
  EXPECT_EQ(prefill_.calls[1].first, p2_);
  EXPECT_EQ(prefill_.calls[1].second.attempt, 2u);
  EXPECT_NE(prefill_.calls[0].second.sequence_id, prefill_.calls[1].second.sequence_id);
  EXPECT_THAT(sink_.Tokens(), ElementsAre(100, 101, 102, 103));
  EXPECT_EQ(sink_.events.back().final->attempts, 2u);
  EXPECT_FALSE(membership_.Find(p1_).has_value()) << "a dead node leaves the cluster";
}

TEST_F(RequestRunnerTest, FailureNamedByPrefillExcludesThatNodeInstead) {
  prefill_.behavior[p1_] = [&](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    absl::Status s = absl::UnavailableError("handoff failed");
    s.SetPayload(kFailedNodePayloadUrl, absl::Cord(d1_));
    return s;
  };
  ASSERT_TRUE(Run().ok());
  ASSERT_EQ(prefill_.calls.size(), 2u);
  // The second attempt may use p1 again (still healthy) but not d1.
  EXPECT_EQ(prefill_.calls[1].second.decode.id, d2_);
  EXPECT_TRUE(membership_.Find(p1_).has_value());
  EXPECT_FALSE(membership_.Find(d1_).has_value());
}

TEST_F(RequestRunnerTest, GivesUpAfterMaxAttempts) {
  auto fail = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    return absl::InternalError("boom");
  };
  prefill_.behavior[p1_] = fail;
  prefill_.behavior[p2_] = fail;
  const std::string p3 = *membership_.Register(Prefill("p:3"));
  const std::string p4 = *membership_.Register(Prefill("p:4"));
  prefill_.behavior[p3] = fail;
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("after 3 attempts"));
  EXPECT_EQ(prefill_.calls.size(), 3u);
  EXPECT_TRUE(sink_.events.empty());
}

TEST_F(RequestRunnerTest, NoHealthyNodeLeftIsUnavailableNamingTheFailure) {
  auto fail = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    return absl::UnavailableError("Connection refused");
  };
  prefill_.behavior[p1_] = fail;
  prefill_.behavior[p2_] = fail;
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no healthy node left"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("Connection refused"));
}

// A decode node that refuses the handoff as not fitting it (INVALID_ARGUMENT naming the field)
// makes the request try another; when none is left, the client gets that refusal's code and
// message, not UNAVAILABLE (retrying the same request would be refused again). Nodes stay.
TEST_F(RequestRunnerTest, RefusalsByEveryNodeEndWithTheRefusalNotUnavailable) {
  auto refuse = [&](const PrefillCall& call) -> absl::StatusOr<PrefillResult> {
    absl::Status s = absl::InvalidArgumentError(
        "handoff: retrieval.method 'full' attends every row: more than gpu_budget 1024");
    s.SetPayload(kFailedNodePayloadUrl, absl::Cord(call.decode.id));
    return s;
  };
  prefill_.behavior[p1_] = refuse;
  prefill_.behavior[p2_] = refuse;
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("gpu_budget 1024"));
  EXPECT_EQ(prefill_.calls.size(), 2u) << "the other decode node was tried";
  EXPECT_TRUE(membership_.Find(d1_).has_value() && membership_.Find(d2_).has_value());
}

TEST_F(RequestRunnerTest, DecodeDeathAfterTokensEndsTheStreamWithoutRetry) {
  decode_.fail_after = 1;  // one token from D, then it dies
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("decode node " + d1_));
  EXPECT_THAT(std::string(s.message()), HasSubstr("after 2 tokens were streamed"));
  EXPECT_THAT(sink_.Tokens(), ElementsAre(100, 101));
  EXPECT_EQ(prefill_.calls.size(), 1u);
  EXPECT_FALSE(membership_.Find(d1_).has_value());
}

// D's store died under the sequence: D names the store, which leaves the cluster; D stays.
TEST_F(RequestRunnerTest, StoreDeathNamedByDecodeDropsTheStoreNotTheDecodeNode) {
  decode_.fail_after = 1;
  decode_.fail_status = absl::UnavailableError("sequence 7: its KV store failed");
  decode_.fail_status.SetPayload(kFailedNodePayloadUrl, absl::Cord(s1_));
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("node " + s1_ + " failed"));
  EXPECT_TRUE(membership_.Find(d1_).has_value()) << "the decode node is fine";
  EXPECT_FALSE(membership_.Find(s1_).has_value());
}

// A deterministic "model" for resume tests: the next token is a function of the whole context
// (prompt and every token before it), so a run that loses or repeats a token, or continues
// from a wrong context, produces other tokens from there on.
uint32_t NextToken(const std::vector<uint32_t>& context) {
  uint64_t h = 1469598103934665603ull;
  for (uint32_t t : context) h = (h ^ t) * 1099511628211ull;
  return 200 + static_cast<uint32_t>(h % 1000);
}

// Prefill and decode over NextToken: prefill answers the prompt's next token and hands the
// sequence (its context and tokens left) to decode, which streams the rest one token per
// chunk. `die_after[node]` chunks into a sequence, that decode node dies (UNAVAILABLE; with
// `store_dies`, naming the sequence's store as the node that failed); `deaths_left` deaths in
// all.
class ContextModel final : public DecodeClient {
 public:
  absl::StatusOr<PrefillResult> Prefill(const PrefillCall& call) {
    const std::vector<uint32_t> prompt = std::get<std::vector<uint32_t>>(call.params->prompt);
    prompts.push_back(prompt);
    max_tokens.push_back(call.params->sampling.max_tokens);
    Sequence& seq = sequences[call.sequence_id];
    seq.context = prompt;
    seq.store = call.store.id;
    PrefillResult r;
    r.prompt_tokens = static_cast<uint32_t>(prompt.size());
    r.first_token = NextToken(seq.context);
    seq.context.push_back(r.first_token);
    seq.left = call.params->sampling.max_tokens - 1;
    if (seq.left == 0) r.finish_reason = FinishReason::kLength;
    return r;
  }
  absl::StatusOr<Completion> Stream(
      const NodeSnapshot& node, absl::string_view, uint64_t seq_id, absl::Time, CancellationToken*,
      absl::FunctionRef<absl::Status(const TokenChunk&)> on_chunk) override {
    decode_nodes.push_back(node.id);
    Sequence& seq = sequences.at(seq_id);
    const uint32_t n = seq.left;
    for (uint32_t i = 0; i <= n; ++i) {
      if (auto it = die_after.find(node.id);
          it != die_after.end() && it->second == i && deaths_left > 0) {
        die_after.erase(it);
        --deaths_left;
        absl::Status died = absl::UnavailableError("Socket closed");
        if (store_dies) {
          died = absl::UnavailableError("its KV store failed");
          died.SetPayload(kFailedNodePayloadUrl, absl::Cord(seq.store));
          dead_stores.push_back(seq.store);
        }
        return died;
      }
      if (i == n) break;
      const uint32_t t = NextToken(seq.context);
      seq.context.push_back(t);
      --seq.left;
      if (absl::Status s = on_chunk(TokenChunk{{t}, ""}); !s.ok()) return s;
    }
    Completion done;
    done.finish_reason = FinishReason::kLength;
    done.prompt_tokens = 0;
    done.completion_tokens = n + 1;
    return done;
  }
  absl::Status Cancel(const NodeSnapshot&, absl::string_view, uint64_t, absl::string_view,
                      absl::Time) override {
    return absl::OkStatus();
  }

  struct Sequence {
    std::vector<uint32_t> context;
    uint32_t left = 0;
    std::string store;
  };
  std::map<uint64_t, Sequence> sequences;
  std::map<std::string, uint32_t> die_after;
  bool store_dies = false;
  int deaths_left = 1;
  std::vector<std::string> dead_stores;
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<uint32_t> max_tokens;
  std::vector<std::string> decode_nodes;
};

class ResumeTest : public RequestRunnerTest {
 protected:
  ResumeTest() {
    for (const std::string& p : {p1_, p2_}) {
      prefill_.behavior[p] = [this](const PrefillCall& call) { return model_.Prefill(call); };
    }
    params_.prompt = std::vector<uint32_t>{11, 12, 13};
    params_.prompt_tokens_bound = 3;
    params_.sampling.max_tokens = 8;
  }
  // A run on a fresh sink; returns its status.
  absl::Status RunOn(RecordingSink* sink) {
    return runner_.Run(params_, clock_.Now(), deadline_, &cancel_, sink);
  }
  ContextModel model_;
  RequestRunner runner_{&membership_, &placement_, &prefill_,
                        &model_,      &clock_,     RunnerOptions{.max_attempts = 3}};
};

// The decode node dies after 3 of its tokens (4 streamed with the first): with
// resume_on_failure the stream goes on from another placement and equals the fault-free run
// token for token; usage counts the client's prompt and every token once.
TEST_F(ResumeTest, DecodeDeathMidStreamResumesWithoutRepeatingOrLosingTokens) {
  params_.resume_on_failure = true;
  RecordingSink reference;
  ASSERT_TRUE(RunOn(&reference).ok());
  const std::vector<uint32_t> expected = reference.Tokens();
  ASSERT_EQ(expected.size(), 8u);

  model_ = ContextModel();
  model_.die_after[d1_] = 3;  // whichever the request is placed on; one death in all
  model_.die_after[d2_] = 3;
  RecordingSink resumed;
  const absl::Status s = RunOn(&resumed);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resumed.Tokens(), expected);
  // The second prefill got prompt + the 4 tokens sent, and 4 tokens to go, away from the
  // dead node.
  ASSERT_EQ(model_.prompts.size(), 2u);
  std::vector<uint32_t> context = {11, 12, 13};
  context.insert(context.end(), expected.begin(), expected.begin() + 4);
  EXPECT_EQ(model_.prompts[1], context);
  EXPECT_EQ(model_.max_tokens[1], 4u);
  ASSERT_EQ(model_.decode_nodes.size(), 2u);
  const std::string dead = model_.decode_nodes[0];
  EXPECT_NE(model_.decode_nodes[1], dead);
  EXPECT_FALSE(membership_.Find(dead).has_value()) << "the dead decode node left the cluster";
  uint32_t counted = 0;
  for (const GenerateEvent& e : resumed.events) {
    counted += static_cast<uint32_t>(e.chunk.token_ids.size());
    EXPECT_EQ(e.completion_tokens, counted) << "usage counts each token once, in order";
    EXPECT_EQ(e.prompt_tokens, 3u) << "the client's prompt, not the resumed one";
  }
  ASSERT_TRUE(resumed.events.back().final.has_value());
  const FinalReport& f = *resumed.events.back().final;
  EXPECT_EQ(f.completion.completion_tokens, 8u);
  EXPECT_EQ(f.completion.prompt_tokens, 3u);
  EXPECT_EQ(f.completion.finish_reason, FinishReason::kLength);
  EXPECT_EQ(f.decode_node, model_.decode_nodes[1]);
  EXPECT_EQ(f.attempts, 2u);
}

// The store under the sequence dies (the decode node names it): resumed on the other store.
TEST_F(ResumeTest, StoreDeathMidStreamResumesOnAnotherStore) {
  ASSERT_TRUE(membership_.Register(Store("s:2")).ok());
  params_.resume_on_failure = true;
  RecordingSink reference;
  ASSERT_TRUE(RunOn(&reference).ok());
  model_ = ContextModel();
  model_.die_after[d1_] = 2;
  model_.die_after[d2_] = 2;
  model_.store_dies = true;
  RecordingSink resumed;
  const absl::Status s = RunOn(&resumed);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resumed.Tokens(), reference.Tokens());
  ASSERT_EQ(model_.dead_stores.size(), 1u) << "one death: the resume went to the other store";
  EXPECT_FALSE(membership_.Find(model_.dead_stores[0]).has_value());
  ASSERT_TRUE(resumed.events.back().final.has_value());
  EXPECT_NE(resumed.events.back().final->store_node, model_.dead_stores[0]);
}

// Without the flag the stream ends UNAVAILABLE after the tokens it sent, as before.
TEST_F(ResumeTest, WithoutTheFlagADeathMidStreamEndsTheRequest) {
  model_.die_after[d1_] = 3;
  model_.die_after[d2_] = 3;
  RecordingSink sink;
  const absl::Status s = RunOn(&sink);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_EQ(sink.Tokens().size(), 4u);
  EXPECT_EQ(model_.prompts.size(), 1u);
}

// A node dying right after the last token the request may have: the resume sends the end.
TEST_F(ResumeTest, DeathAfterTheLastTokenFinishesTheStream) {
  params_.resume_on_failure = true;
  model_.die_after[d1_] = 7;  // all 8 tokens were sent, then the stream failed
  model_.die_after[d2_] = 7;
  RecordingSink sink;
  const absl::Status s = RunOn(&sink);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(sink.Tokens().size(), 8u);
  EXPECT_EQ(model_.prompts.size(), 1u) << "nothing left to prefill";
  ASSERT_TRUE(sink.events.back().final.has_value());
  EXPECT_EQ(sink.events.back().final->completion.completion_tokens, 8u);
}

// Prefix reuse: the runner records every request that ends well and sends the next request
// that starts with its tokens to the same store, with the cached sequence as its prefix.
class PrefixReuseTest : public RequestRunnerTest {
 protected:
  PrefixReuseTest() {
    s2_ = *membership_.Register(Store("s:2"));
    for (const std::string& p : {p1_, p2_}) {
      prefill_.behavior[p] = [this](const PrefillCall& call) -> absl::StatusOr<PrefillResult> {
        PrefillResult r;
        r.prompt_tokens =
            static_cast<uint32_t>(std::get<std::vector<uint32_t>>(call.params->prompt).size());
        r.first_token = 100;
        r.cached_tokens = prefix_gone_ ? 0 : call.prefix.tokens;
        return r;
      };
    }
    params_.prompt = Document();
    params_.prompt_tokens_bound = 20;
  }
  // 20 tokens: five blocks of 4.
  static std::vector<uint32_t> Document() {
    std::vector<uint32_t> d;
    for (uint32_t i = 0; i < 20; ++i) d.push_back(1000 + i);
    return d;
  }
  absl::Status RunPrompt(std::vector<uint32_t> prompt) {
    params_.prompt_tokens_bound = prompt.size();
    params_.prompt = std::move(prompt);
    sink_.events.clear();
    return Run();
  }
  const PrefillCall& LastCall() const { return prefill_.calls.back().second; }

  PrefixCache cache_{{.block_tokens = 4, .max_entries = 16}};
  RequestRunner runner_{&membership_, &placement_, &prefill_, &decode_, &clock_,
                        RunnerOptions{.max_attempts = 3,
                                      .prefix_cache = &cache_,
                                      .prefix_retain = absl::Minutes(2)}};
  std::string s2_;
  bool prefix_gone_ = false;

  absl::Status Run() { return runner_.Run(params_, clock_.Now(), deadline_, &cancel_, &sink_); }
};

TEST_F(PrefixReuseTest, TheNextTurnStartsFromTheFirstTurnsSequenceOnItsStore) {
  ASSERT_TRUE(Run().ok());
  const PrefillCall first = LastCall();
  EXPECT_EQ(first.prefix.tokens, 0u);
  EXPECT_EQ(first.retain, absl::Minutes(2));
  // Turn 1 streamed 100, 101, 102, 103. Turn 2 resends all of it and asks more: the prompt
  // of turn 1 is reused (not the answer, whose rows a decode step computed).
  std::vector<uint32_t> turn2 = Document();
  turn2.insert(turn2.end(), {100, 101, 102, 103, 7, 8});
  ASSERT_TRUE(RunPrompt(turn2).ok());
  const PrefillCall& second = LastCall();
  EXPECT_EQ(second.prefix.sequence_id, first.sequence_id);
  EXPECT_EQ(second.prefix.capability, first.sequence_capability);
  EXPECT_EQ(second.prefix.store_id, first.store.id);
  EXPECT_EQ(second.prefix.tokens, 20u);
  // The placement went to the prefix's store although the rotation would pick the other.
  EXPECT_EQ(second.store.id, first.store.id);
  ASSERT_TRUE(sink_.events.back().final.has_value());
  EXPECT_EQ(sink_.events.back().final->completion.cached_tokens, 20u);
  // Turn 3 resends turn 2 and more: turn 2's whole prompt is reused.
  std::vector<uint32_t> turn3 = turn2;
  turn3.insert(turn3.end(), {100, 9});
  const uint64_t turn2_sequence = LastCall().sequence_id;
  ASSERT_TRUE(RunPrompt(turn3).ok());
  EXPECT_EQ(LastCall().prefix.sequence_id, turn2_sequence);
  EXPECT_EQ(LastCall().prefix.tokens, static_cast<uint32_t>(turn2.size()));
}

TEST_F(PrefixReuseTest, APrefixTheStoreNoLongerHasIsForgotten) {
  ASSERT_TRUE(Run().ok());
  std::vector<uint32_t> again = Document();
  again.push_back(5);
  prefix_gone_ = true;  // the prefill node finds the sequence gone and computes it all
  ASSERT_TRUE(RunPrompt(again).ok());
  EXPECT_GT(LastCall().prefix.tokens, 0u);
  EXPECT_EQ(sink_.events.back().final->completion.cached_tokens, 0u);
  // That request's own sequence is now the cached one (it ended well); the gone one is not
  // offered again.
  const uint64_t gone = prefill_.calls[0].second.sequence_id;
  const uint64_t second = LastCall().sequence_id;
  ASSERT_TRUE(RunPrompt(again).ok());
  EXPECT_NE(LastCall().prefix.sequence_id, gone);
  EXPECT_EQ(LastCall().prefix.sequence_id, second);
}

TEST_F(PrefixReuseTest, ScopedBySaltAndSkippedWhenTheRequestOptsOut) {
  params_.cache_salt = "tenant-a";
  ASSERT_TRUE(Run().ok());
  std::vector<uint32_t> again = Document();
  again.push_back(5);
  params_.cache_salt = "tenant-b";
  ASSERT_TRUE(RunPrompt(again).ok());
  EXPECT_EQ(LastCall().prefix.tokens, 0u);
  params_.cache_salt = "tenant-a";
  params_.prefix_cache = false;
  ASSERT_TRUE(RunPrompt(again).ok());
  EXPECT_EQ(LastCall().prefix.tokens, 0u);
  EXPECT_EQ(LastCall().retain, absl::ZeroDuration());
  params_.prefix_cache = true;
  ASSERT_TRUE(RunPrompt(again).ok());
  EXPECT_EQ(LastCall().prefix.tokens, 20u);
}

TEST_F(PrefixReuseTest, FailedRequestsAreNotRecorded) {
  decode_.fail_after = 1;
  EXPECT_FALSE(Run().ok());
  decode_.fail_after = UINT32_MAX;
  std::vector<uint32_t> again = Document();
  again.push_back(5);
  ASSERT_TRUE(RunPrompt(again).ok());
  EXPECT_EQ(LastCall().prefix.tokens, 0u);
}

TEST_F(RequestRunnerTest, OnlyUnreachableNodesLeaveTheCluster) {
  prefill_.behavior[p1_] = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    return absl::ResourceExhaustedError("prefill queue full");
  };
  ASSERT_TRUE(Run().ok());
  EXPECT_EQ(prefill_.calls.size(), 2u);
  EXPECT_EQ(prefill_.calls[1].first, p2_);
  EXPECT_TRUE(membership_.Find(p1_).has_value()) << "a busy node stays";

  decode_.fail_after = 0;
  decode_.fail_status = absl::NotFoundError("sequence: no handoff");
  EXPECT_FALSE(Run().ok());
  EXPECT_TRUE(membership_.Find(d1_).has_value() && membership_.Find(d2_).has_value());
}

TEST_F(RequestRunnerTest, InvalidArgumentFromPrefillIsFinal) {
  prefill_.behavior[p1_] = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    return absl::InvalidArgumentError("prompt: 9000 tokens exceed the context of 8192");
  };
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("prompt:"));
  EXPECT_EQ(prefill_.calls.size(), 1u);
  EXPECT_TRUE(membership_.Find(p1_).has_value());
}

TEST_F(RequestRunnerTest, ClientCancellationCancelsTheDecodeNode) {
  decode_.cancel_after = 1;
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ(s.message(), "client disconnected");
  ASSERT_EQ(decode_.cancels.size(), 1u);
  EXPECT_EQ(decode_.cancels[0].node, d1_);
  EXPECT_EQ(decode_.cancels[0].sequence_id, prefill_.calls[0].second.sequence_id);
  EXPECT_TRUE(membership_.Find(d1_).has_value()) << "a cancelled request is no node failure";
}

TEST_F(RequestRunnerTest, ClientGoneOnWriteCancelsTheDecodeNode) {
  sink_.fail_after = 2;
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  ASSERT_EQ(decode_.cancels.size(), 1u);
  EXPECT_EQ(decode_.cancels[0].node, d1_);
}

TEST_F(RequestRunnerTest, CancelledDuringPrefillCancelsBothNodes) {
  prefill_.behavior[p1_] = [&](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    cancel_.Cancel(absl::CancelledError("aborted"));
    return absl::CancelledError("call cancelled");
  };
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ(s.message(), "aborted");
  ASSERT_EQ(prefill_.cancels.size(), 1u);
  ASSERT_EQ(decode_.cancels.size(), 1u);
  EXPECT_EQ(prefill_.calls.size(), 1u) << "no retry after cancellation";
}

TEST_F(RequestRunnerTest, PastDeadlineFailsBeforeCallingNodes) {
  deadline_ = clock_.Now();
  absl::Status s = Run();
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_TRUE(prefill_.calls.empty());
}

TEST_F(RequestRunnerTest, FirstTokenThatFinishesSkipsDecode) {
  prefill_.behavior[p1_] = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    PrefillResult r;
    r.prompt_tokens = 5;
    r.first_token = 2;
    r.finish_reason = FinishReason::kEos;
    return r;
  };
  ASSERT_TRUE(Run().ok());
  EXPECT_TRUE(decode_.stream_nodes.empty());
  EXPECT_EQ(sink_.events.back().final->completion.finish_reason, FinishReason::kEos);
  EXPECT_EQ(sink_.events.back().final->completion.completion_tokens, 1u);
}

class RecordingObserver : public RequestObserver {
 public:
  void OnAttempt(const GenerateParams&, const PlacementDecision& p, uint32_t attempt) override {
    events.push_back(absl::StrCat("attempt ", attempt, " ", p.prefill.id));
  }
  void OnNodeFailure(const GenerateParams&, absl::string_view node,
                     const absl::Status& e) override {
    events.push_back(absl::StrCat("failure ", node, " ", absl::StatusCodeToString(e.code())));
  }
  void OnFirstToken(const GenerateParams&, absl::Duration, absl::Duration) override {
    events.push_back("first-token");
  }
  void OnTokens(const GenerateParams&, uint32_t n) override { tokens += n; }
  void OnEnd(const GenerateParams&, const absl::Status& s, const FinalReport* report) override {
    events.push_back(absl::StrCat("end ", absl::StatusCodeToString(s.code()),
                                  report != nullptr ? " report" : ""));
  }
  std::vector<std::string> events;
  uint32_t tokens = 0;
};

TEST_F(RequestRunnerTest, ObserverSeesTheRequestsLife) {
  RecordingObserver observer;
  RequestRunner runner(&membership_, &placement_, &prefill_, &decode_, &clock_,
                       RunnerOptions{.max_attempts = 3, .observer = &observer});
  prefill_.behavior[p1_] = [](const PrefillCall&) -> absl::StatusOr<PrefillResult> {
    return absl::UnavailableError("Connection refused");
  };
  ASSERT_TRUE(runner.Run(params_, clock_.Now(), deadline_, &cancel_, &sink_).ok());
  EXPECT_THAT(observer.events, ElementsAre("attempt 1 " + p1_, "failure " + p1_ + " UNAVAILABLE",
                                           "attempt 2 " + p2_, "first-token", "end OK report"));
  EXPECT_EQ(observer.tokens, 3u);

  decode_.fail_after = 0;
  observer.events.clear();
  EXPECT_FALSE(runner.Run(params_, clock_.Now(), deadline_, &cancel_, &sink_).ok());
  EXPECT_THAT(observer.events, ElementsAre("attempt 1 " + p2_, "first-token",
                                           "failure " + d1_ + " UNAVAILABLE", "end UNAVAILABLE"));
}

TEST(RequestStateMachineTest, RetryOnlyBeforeTheFirstToken) {
  RequestStateMachine m(2);
  ASSERT_TRUE(m.BeginAttempt().ok());
  EXPECT_EQ(m.OnNodeFailure(), RequestStateMachine::FailureAction::kRetry);
  EXPECT_EQ(m.phase(), RequestPhase::kQueued);
  ASSERT_TRUE(m.BeginAttempt().ok());
  ASSERT_TRUE(m.OnTokensSent(1).ok());
  EXPECT_EQ(m.phase(), RequestPhase::kStreaming);
  EXPECT_EQ(m.OnNodeFailure(), RequestStateMachine::FailureAction::kFail);
  EXPECT_EQ(m.phase(), RequestPhase::kFailed);
  EXPECT_FALSE(m.BeginAttempt().ok());
  EXPECT_FALSE(m.OnTokensSent(1).ok());
}

TEST(RequestStateMachineTest, AttemptsAreBounded) {
  RequestStateMachine m(1);
  ASSERT_TRUE(m.BeginAttempt().ok());
  EXPECT_EQ(m.OnNodeFailure(), RequestStateMachine::FailureAction::kFail);
  EXPECT_TRUE(IsNodeFailure(absl::UnavailableError("")));
  EXPECT_FALSE(IsNodeFailure(absl::InvalidArgumentError("")));
  EXPECT_FALSE(IsNodeFailure(absl::DeadlineExceededError("")));
}

TEST(CancellationTest, CallbacksRunOnceAndRegistrationsUnregister) {
  CancellationToken token;
  int a = 0, b = 0;
  auto ra = token.OnCancel([&] { ++a; });
  {
    auto rb = token.OnCancel([&] { ++b; });
  }
  token.Cancel(absl::CancelledError("first"));
  token.Cancel(absl::CancelledError("second"));
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 0);
  EXPECT_EQ(token.reason().message(), "first");
  int c = 0;
  auto rc = token.OnCancel([&] { ++c; });
  EXPECT_EQ(c, 1) << "registering on a cancelled token runs at once";
}

TEST(InFlightRequestsTest, DuplicateIdsAndAbort) {
  InFlightRequests inflight;
  CancellationToken t;
  ASSERT_TRUE(inflight.Add("a", &t).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(inflight.Add("a", &t)));
  EXPECT_FALSE(inflight.Cancel("b", absl::CancelledError("x")));
  EXPECT_TRUE(inflight.Cancel("a", absl::CancelledError("aborted")));
  EXPECT_TRUE(t.IsCancelled());
  inflight.Remove("a");
  EXPECT_EQ(inflight.size(), 0u);
}

}  // namespace
}  // namespace kvr::controller
