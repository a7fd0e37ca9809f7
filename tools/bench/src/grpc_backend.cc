// The kvr-grpc backend: kvr.v1.Generation/Generate on one channel with the gRPC callback API
// (one ClientReadReactor per request, no thread per request).

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/loadgen/backend.h"
#include "kvr/v1/generation.grpc.pb.h"

namespace kvr::loadgen {
namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = ::kvr::v1;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::chrono::system_clock::time_point DeadlineIn(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::duration<double>(seconds));
}

// One Generate stream. Owns itself: created by Send, deleted in OnDone (the last reaction
// gRPC makes). Writes only its own RequestResult, which the runner keeps alive until on_done.
class GenerateCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateCall(v1::Generation::Stub* stub, v1::GenerateRequest request, double timeout_s,
               RequestResult* result, std::function<void()> on_done)
      : stub_(stub),
        request_(std::move(request)),
        timeout_s_(timeout_s),
        result_(result),
        on_done_(std::move(on_done)) {}

  void Start() {
    sent_ = Clock::now();
    context_.set_deadline(DeadlineIn(timeout_s_));
    stub_->async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    const Clock::time_point now = Clock::now();
    // A message may carry token ids with no text (UTF-8 held back) or, with skip_token_ids,
    // text alone: either is a token arrival.
    if (response_.token_ids_size() > 0 || !response_.text().empty()) {
      if (!got_token_) {
        result_->ttft_s = Seconds(now - sent_);
        got_token_ = true;
      } else {
        result_->itl_s.push_back(Seconds(now - last_token_));
      }
      last_token_ = now;
      tokens_seen_ += static_cast<uint32_t>(response_.token_ids_size());
      result_->generated_text += response_.text();
    }
    if (response_.has_completion()) {
      completion_ = response_.completion();
      has_completion_ = true;
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    const Clock::time_point end = Clock::now();
    RequestResult& r = *result_;
    r.latency_s = Seconds(end - sent_);
    if (!status.ok()) {
      r.error_code = absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()));
      r.error = status.error_message();
    } else if (!has_completion_) {
      r.error_code = "INTERNAL";
      r.error = "the stream ended without a completion message";
    } else {
      r.success = true;
      const v1::Completion& c = completion_;
      r.output_len =
          c.usage().completion_tokens() > 0 ? c.usage().completion_tokens() : tokens_seen_;
      if (c.usage().prompt_tokens() > 0) r.prompt_len = c.usage().prompt_tokens();
      r.bytes_fetched = c.retrieval().bytes_fetched();
      r.bytes_shipped = c.retrieval().bytes_shipped();
      r.hot_cache_hits = c.retrieval().hot_cache_hits();
      r.hot_cache_misses = c.retrieval().hot_cache_misses();
      if (c.has_timings() && c.timings().has_time_to_first_token()) {
        const google::protobuf::Duration& d = c.timings().time_to_first_token();
        r.server_ttft_s = static_cast<double>(d.seconds()) + d.nanos() * 1e-9;
      }
    }
    std::function<void()> on_done = std::move(on_done_);
    delete this;
    on_done();  // last: the runner may return once every request has ended
  }

 private:
  v1::Generation::Stub* const stub_;
  v1::GenerateRequest request_;
  const double timeout_s_;
  RequestResult* const result_;
  std::function<void()> on_done_;
  grpc::ClientContext context_;
  v1::GenerateResponse response_;
  Clock::time_point sent_, last_token_;
  bool got_token_ = false;
  uint32_t tokens_seen_ = 0;
  bool has_completion_ = false;
  v1::Completion completion_;
};

class GrpcBackend final : public Backend {
 public:
  GrpcBackend(std::string target, bool chat, const GrpcSecurity& security)
      : target_(std::move(target)),
        chat_(chat),
        stub_(v1::Generation::NewStub(security.CreateChannel(target_))) {}

  absl::StatusOr<std::string> ResolveModel(const std::string& wanted) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(10));
    v1::ListModelsResponse models;
    const grpc::Status s = stub_->ListModels(&ctx, {}, &models);
    if (!s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("ListModels on ", target_, " failed: ", s.error_message()));
    }
    std::vector<std::string> names;
    for (const v1::ModelCard& card : models.models()) names.push_back(card.name());
    if (names.empty()) {
      return absl::NotFoundError(absl::StrCat(target_, " serves no model (no nodes registered?)"));
    }
    if (wanted.empty()) return names.front();
    for (const std::string& n : names) {
      if (n == wanted) return n;
    }
    return absl::NotFoundError(absl::StrCat("model ", wanted, " is not served by ", target_,
                                            " (serves: ", absl::StrJoin(names, ", "), ")"));
  }

  absl::Status CheckPrompt(const Prompt&) const override { return absl::OkStatus(); }

  void Send(const RequestSpec& spec, const Prompt& prompt, RequestResult* result,
            std::function<void()> on_done) override {
    auto* call = new GenerateCall(stub_.get(), BuildRequest(spec, prompt), spec.timeout_s, result,
                                  std::move(on_done));
    call->Start();
  }

 private:
  v1::GenerateRequest BuildRequest(const RequestSpec& spec, const Prompt& prompt) const {
    v1::GenerateRequest request;
    request.set_model(spec.model);
    if (!prompt.messages.empty()) {
      for (const ChatTurn& turn : prompt.messages) {
        v1::ChatMessage* m = request.mutable_chat()->add_messages();
        m->set_role(turn.role);
        m->set_content(turn.content);
      }
    } else if (chat_) {
      v1::ChatMessage* m = request.mutable_chat()->add_messages();
      m->set_role("user");
      m->set_content(prompt.text);
    } else {
      request.set_prompt(prompt.text);
    }
    v1::SamplingParams* s = request.mutable_sampling();
    s->set_max_tokens(prompt.max_tokens.value_or(spec.output_len));
    s->set_temperature(spec.temperature);
    s->set_ignore_eos(spec.ignore_eos);
    if (!spec.method.empty()) request.mutable_retrieval()->set_method(spec.method);
    if (spec.budget) request.mutable_retrieval()->set_budget(*spec.budget);
    if (spec.n_sink) request.mutable_retrieval()->set_n_sink(*spec.n_sink);
    if (spec.local_window) request.mutable_retrieval()->set_local_window(*spec.local_window);
    return request;
  }

  const std::string target_;
  const bool chat_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

}  // namespace

std::unique_ptr<Backend> MakeGrpcBackend(const std::string& target, bool chat,
                                         GrpcSecurity security) {
  return std::make_unique<GrpcBackend>(target, chat, security);
}

}  // namespace kvr::loadgen
