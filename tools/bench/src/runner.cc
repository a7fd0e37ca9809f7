#include "kvr/loadgen/runner.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
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

// What the dispatcher and the gRPC callbacks share: the in-flight count (the concurrency cap
// waits on it) and the progress counters. Thread-safe.
class RunState {
 public:
  explicit RunState(std::function<void(uint64_t, uint64_t)> on_progress)
      : on_progress_(std::move(on_progress)) {}

  void Started() {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  void Ended(bool success, Clock::time_point end) {
    absl::MutexLock lock(&mu_);
    --in_flight_;
    ++done_;
    if (!success) ++failed_;
    if (end > last_end_) last_end_ = end;
    if (on_progress_) on_progress_(done_, failed_);
  }
  // Waits until fewer than `cap` requests are in flight, or `deadline` passes (false then).
  bool WaitForSlot(uint64_t cap, Clock::time_point deadline) {
    absl::MutexLock lock(&mu_);
    auto free = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ < cap; };
    const absl::Duration wait = absl::FromChrono(
        std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()));
    return mu_.AwaitWithTimeout(absl::Condition(&free), wait);
  }
  Clock::time_point WaitForAll() {
    absl::MutexLock lock(&mu_);
    auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    mu_.Await(absl::Condition(&idle));
    return last_end_;
  }

 private:
  absl::Mutex mu_;
  uint64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  Clock::time_point last_end_ ABSL_GUARDED_BY(mu_);
  std::function<void(uint64_t, uint64_t)> on_progress_;
};

// One Generate stream. Owns itself: created by the dispatcher, deleted in OnDone (the last
// reaction gRPC makes). Writes only its own RequestResult, which the dispatcher keeps alive
// until every call has ended.
class GenerateCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateCall(v1::Generation::Stub* stub, v1::GenerateRequest request, const Prompt* prompt,
               Clock::time_point run_start, double timeout_s, RequestResult* result,
               RunState* state)
      : stub_(stub),
        request_(std::move(request)),
        prompt_(prompt),
        run_start_(run_start),
        timeout_s_(timeout_s),
        result_(result),
        state_(state) {}

  void Start() {
    sent_ = Clock::now();
    result_->start_time_s = Seconds(sent_ - run_start_);
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
    r.prompt_len = prompt_->approx_tokens;
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
      if (!prompt_->passkey.empty())
        r.passkey_correct = PasskeyAnswered(*prompt_, r.generated_text);
    }
    RunState* state = state_;
    const bool success = r.success;
    delete this;
    state->Ended(success, end);  // last: the dispatcher may return once the count is 0
  }

 private:
  v1::Generation::Stub* const stub_;
  v1::GenerateRequest request_;
  const Prompt* const prompt_;
  const Clock::time_point run_start_;
  const double timeout_s_;
  RequestResult* const result_;
  RunState* const state_;
  grpc::ClientContext context_;
  v1::GenerateResponse response_;
  Clock::time_point sent_, last_token_;
  bool got_token_ = false;
  uint32_t tokens_seen_ = 0;
  bool has_completion_ = false;
  v1::Completion completion_;
};

v1::GenerateRequest BuildRequest(const RunOptions& o, const std::string& model,
                                 const Prompt& prompt) {
  v1::GenerateRequest request;
  request.set_model(model);
  if (!prompt.messages.empty()) {
    for (const ChatTurn& turn : prompt.messages) {
      v1::ChatMessage* m = request.mutable_chat()->add_messages();
      m->set_role(turn.role);
      m->set_content(turn.content);
    }
  } else {
    request.set_prompt(prompt.text);
  }
  v1::SamplingParams* s = request.mutable_sampling();
  s->set_max_tokens(prompt.max_tokens.value_or(o.output_len));
  s->set_temperature(o.temperature);
  s->set_ignore_eos(o.ignore_eos);
  if (!o.method.empty()) request.mutable_retrieval()->set_method(o.method);
  if (o.budget) request.mutable_retrieval()->set_budget(*o.budget);
  return request;
}

absl::StatusOr<std::string> ResolveModel(v1::Generation::Stub& stub, const RunOptions& o) {
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(10));
  v1::ListModelsResponse models;
  const grpc::Status s = stub.ListModels(&ctx, {}, &models);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("ListModels on ", o.target, " failed: ", s.error_message()));
  }
  std::vector<std::string> names;
  for (const v1::ModelCard& card : models.models()) names.push_back(card.name());
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat(o.target, " serves no model (no nodes registered?)"));
  }
  if (o.model.empty()) return names.front();
  for (const std::string& n : names) {
    if (n == o.model) return n;
  }
  return absl::NotFoundError(absl::StrCat("model ", o.model, " is not served by ", o.target,
                                          " (serves: ", absl::StrJoin(names, ", "), ")"));
}

// Sends the requests of one run (measured or warm-up) and waits for all of them.
RunOutcome Dispatch(v1::Generation::Stub& stub, const RunOptions& options,
                    const std::vector<Prompt>& prompts);

}  // namespace

absl::StatusOr<RunOutcome> RunBenchmark(const RunOptions& options,
                                        const std::vector<Prompt>& prompts) {
  if (prompts.empty()) return absl::InvalidArgumentError("no prompts to send");
  if (options.num_requests == 0 && options.duration_s <= 0) {
    return absl::InvalidArgumentError("give a number of requests or a duration");
  }
  if (options.request_timeout_s <= 0) {
    return absl::InvalidArgumentError("request timeout must be > 0");
  }
  if (absl::Status s = ValidateArrivalOptions(options.arrival); !s.ok()) return s;

  auto channel = grpc::CreateChannel(options.target, grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::Generation::Stub> stub = v1::Generation::NewStub(channel);
  auto model = ResolveModel(*stub, options);
  if (!model.ok()) return model.status();
  RunOptions run = options;
  run.model = *model;
  if (options.num_warmups > 0) {
    RunOptions warmup = run;
    warmup.arrival = ArrivalOptions{};
    warmup.num_requests = options.num_warmups;
    warmup.duration_s = 0;
    warmup.on_progress = nullptr;
    // Its results are dropped: warm-up failures show up again in the measured run if real.
    Dispatch(*stub, warmup, prompts);
  }
  return Dispatch(*stub, run, prompts);
}

namespace {

RunOutcome Dispatch(v1::Generation::Stub& stub_ref, const RunOptions& options,
                    const std::vector<Prompt>& prompts) {
  v1::Generation::Stub* const stub = &stub_ref;
  RunOutcome outcome;
  outcome.model = options.model;
  RunState state(options.on_progress);
  ArrivalSchedule schedule(options.arrival);
  // Each call writes its own result through a stable pointer while the dispatcher appends.
  std::vector<std::unique_ptr<RequestResult>> results;
  const Clock::time_point start = Clock::now();
  const Clock::time_point stop =
      options.duration_s > 0 ? start + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options.duration_s))
                             : Clock::time_point::max();
  for (uint64_t i = 0; options.num_requests == 0 || i < options.num_requests; ++i) {
    const double offset = schedule.Next();
    const Clock::time_point when =
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(offset));
    if (when >= stop) break;
    std::this_thread::sleep_until(when);
    if (options.max_concurrency > 0 && !state.WaitForSlot(options.max_concurrency, stop)) break;
    if (Clock::now() >= stop) break;
    const Prompt& prompt = prompts[i % prompts.size()];
    results.push_back(std::make_unique<RequestResult>());
    state.Started();
    auto* call = new GenerateCall(stub, BuildRequest(options, outcome.model, prompt), &prompt,
                                  start, options.request_timeout_s, results.back().get(), &state);
    call->Start();
  }
  const Clock::time_point last_end = state.WaitForAll();
  outcome.duration_s = results.empty() ? 0 : Seconds(last_end - start);
  outcome.results.reserve(results.size());
  for (auto& r : results) outcome.results.push_back(std::move(*r));
  return outcome;
}

}  // namespace

}  // namespace kvr::loadgen
