#include "kvr/controller/validation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_cluster.h"

namespace kvr::controller {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class ValidationTest : public ::testing::Test {
 protected:
  ValidationTest() {
    ModelSummary m;
    m.info = testing::TestModel(/*context=*/100);
    m.prefill_nodes = m.decode_nodes = 1;
    models_.push_back(m);
    good_.set_model("smollm2");
    good_.set_prompt("hello");
  }
  absl::StatusOr<GenerateParams> Parse(const kvr::v1::GenerateRequest& r) {
    return ParseGenerateRequest(r, models_, defaults_);
  }
  // Expects INVALID_ARGUMENT whose message starts with `field`.
  void ExpectInvalid(const kvr::v1::GenerateRequest& r, absl::string_view field) {
    auto s = Parse(r).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), StartsWith(std::string(field) + ":")) << s;
  }

  std::vector<ModelSummary> models_;
  RequestDefaults defaults_{
      .max_tokens = 16, .method = "full", .budget = 64, .n_sink = 4, .local_window = 8};
  kvr::v1::GenerateRequest good_;
};

TEST_F(ValidationTest, AppliesDefaults) {
  auto p = Parse(good_);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->model, "smollm2");
  EXPECT_EQ(std::get<std::string>(p->prompt), "hello");
  EXPECT_EQ(p->prompt_tokens_bound, 5u);
  EXPECT_EQ(p->sampling.max_tokens, 16u);
  EXPECT_EQ(p->sampling.top_p, 1.0f);
  EXPECT_EQ(p->retrieval.method, "full");
  EXPECT_EQ(p->retrieval.budget, 64u);
  EXPECT_EQ(p->retrieval.n_sink, 4u);
  EXPECT_EQ(p->retrieval.local_window, 8u);
  EXPECT_FALSE(p->resume_on_failure);
}

TEST_F(ValidationTest, KeepsExplicitValues) {
  kvr::v1::GenerateRequest r = good_;
  r.mutable_token_ids()->add_ids(1);
  r.mutable_token_ids()->add_ids(2);
  r.mutable_sampling()->set_max_tokens(3);
  r.mutable_sampling()->set_temperature(0.7f);
  r.mutable_sampling()->set_seed(9);
  r.mutable_sampling()->add_stop("\n");
  r.mutable_retrieval()->set_method("clusterkv");
  r.mutable_retrieval()->set_budget(7);
  (*r.mutable_retrieval()->mutable_options())["n_clusters"] = "40";
  r.set_request_id("my-req.1");
  r.set_resume_on_failure(true);
  auto p = Parse(r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(std::get<std::vector<uint32_t>>(p->prompt), (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(p->prompt_tokens_bound, 2u);
  EXPECT_EQ(p->sampling.max_tokens, 3u);
  EXPECT_EQ(p->sampling.seed, 9u);
  EXPECT_EQ(p->retrieval.method, "clusterkv");
  EXPECT_EQ(p->retrieval.budget, 7u);
  EXPECT_EQ(p->retrieval.options.at("n_clusters"), "40");
  EXPECT_EQ(p->request_id, "my-req.1");
  EXPECT_TRUE(p->resume_on_failure);
}

TEST_F(ValidationTest, UnknownModel) {
  kvr::v1::GenerateRequest r = good_;
  r.set_model("llama");
  ExpectInvalid(r, "model");
  EXPECT_THAT(std::string(Parse(r).status().message()), HasSubstr("served: [smollm2]"));
  r.set_model("");
  ExpectInvalid(r, "model");
}

// Before nodes (re-)registered, "unknown model" is UNAVAILABLE (retry), never INVALID_ARGUMENT.
TEST(CheckModelAvailableTest, NotYetIsUnavailableNeverSeenIsLeftToValidation) {
  // A controller that just (re)started: nothing registered yet.
  absl::Status s = CheckModelAvailable("smollm2", {});
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no model is served yet"));
  EXPECT_TRUE(absl::IsUnavailable(CheckModelAvailable("no-such-model", {})));
  // Half of the pair is back.
  s = CheckModelAvailable(
      "smollm2",
      {.prefill_nodes = 1, .decode_nodes = 0, .ever_registered = true, .any_model_served = false});
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("1 prefill, 0 decode"));
  // Another model is served; this one was registered once and its nodes are gone.
  s = CheckModelAvailable("smollm2", {.ever_registered = true, .any_model_served = true});
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  // Served: fine.
  EXPECT_TRUE(CheckModelAvailable("smollm2", {.prefill_nodes = 1,
                                              .decode_nodes = 2,
                                              .ever_registered = true,
                                              .any_model_served = true})
                  .ok());
  // Others are served and no node ever registered this name: ParseGenerateRequest's
  // INVALID_ARGUMENT stands. An empty name is the request's fault too.
  EXPECT_TRUE(CheckModelAvailable("no-such-model", {.any_model_served = true}).ok());
  EXPECT_TRUE(CheckModelAvailable("", {}).ok());
}

TEST_F(ValidationTest, EmptyPrompts) {
  kvr::v1::GenerateRequest r = good_;
  r.set_prompt("");
  ExpectInvalid(r, "prompt");
  r.clear_input();
  ExpectInvalid(r, "prompt");
  r.mutable_token_ids();
  ExpectInvalid(r, "token_ids");
  r.mutable_chat();
  ExpectInvalid(r, "chat.messages");
  auto* m = r.mutable_chat()->add_messages();
  m->set_role("user");
  ExpectInvalid(r, "chat.messages");  // no content anywhere
  m->set_content("hi");
  EXPECT_TRUE(Parse(r).ok());
  r.mutable_chat()->add_messages()->set_content("x");
  ExpectInvalid(r, "chat.messages[1].role");
}

TEST_F(ValidationTest, PromptOverTheContextLimit) {
  kvr::v1::GenerateRequest r = good_;
  for (int i = 0; i < 100; ++i) r.mutable_token_ids()->add_ids(i);
  ExpectInvalid(r, "token_ids");
  EXPECT_THAT(std::string(Parse(r).status().message()), HasSubstr("context of 100 tokens"));
  // 90 prompt tokens + explicit 20 do not fit; a default max_tokens is clamped instead.
  r.mutable_token_ids()->mutable_ids()->Truncate(90);
  r.mutable_sampling()->set_max_tokens(20);
  ExpectInvalid(r, "sampling.max_tokens");
  r.mutable_sampling()->clear_max_tokens();
  defaults_.max_tokens = 50;
  auto p = Parse(r);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->sampling.max_tokens, 10u);
}

TEST_F(ValidationTest, BudgetZeroAndUnknownMethod) {
  kvr::v1::GenerateRequest r = good_;
  r.mutable_retrieval()->set_budget(0);
  ExpectInvalid(r, "retrieval.budget");
  r.mutable_retrieval()->clear_budget();
  r.mutable_retrieval()->set_method("magic");
  ExpectInvalid(r, "retrieval.method");
  EXPECT_THAT(std::string(Parse(r).status().message()), HasSubstr("supported: [full, clusterkv]"));
}

TEST_F(ValidationTest, SamplingAndOtherFields) {
  kvr::v1::GenerateRequest r = good_;
  r.mutable_sampling()->set_temperature(-1);
  ExpectInvalid(r, "sampling.temperature");
  r = good_;
  r.mutable_sampling()->set_top_p(0);
  ExpectInvalid(r, "sampling.top_p");
  r = good_;
  r.mutable_sampling()->set_max_tokens(0);
  ExpectInvalid(r, "sampling.max_tokens");
  r = good_;
  r.mutable_sampling()->add_stop("");
  ExpectInvalid(r, "sampling.stop[0]");
  r = good_;
  r.set_request_id("has space");
  ExpectInvalid(r, "request_id");
  r = good_;
  r.mutable_retrieval()->set_local_window(0);
  ExpectInvalid(r, "retrieval.local_window");
  r = good_;
  r.mutable_stream_options()->set_skip_text(true);
  r.mutable_stream_options()->set_skip_token_ids(true);
  ExpectInvalid(r, "stream_options");
}

}  // namespace
}  // namespace kvr::controller
