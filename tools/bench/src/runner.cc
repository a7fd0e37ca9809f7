#include "kvr/loadgen/runner.h"

#include <chrono>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvr/common/status.h"

namespace kvr::loadgen {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// What the dispatcher and the backend's completion callbacks share: the in-flight count (the
// concurrency cap waits on it) and the progress counters. Thread-safe.
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

// Sends the requests of one run (measured or warm-up) and waits for all of them.
RunOutcome Dispatch(Backend& backend, const RunOptions& options,
                    const std::vector<Prompt>& prompts) {
  RunOutcome outcome;
  outcome.model = options.request.model;
  RunState state(options.on_progress);
  ArrivalSchedule schedule(options.arrival);
  // Each request writes its own result through a stable pointer while the dispatcher appends.
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
    const Clock::time_point now = Clock::now();
    if (now >= stop) break;
    const Prompt& prompt = prompts[i % prompts.size()];
    results.push_back(std::make_unique<RequestResult>());
    RequestResult* result = results.back().get();
    result->start_time_s = Seconds(now - start);
    state.Started();
    backend.Send(options.request, prompt, result, [result, &prompt, &state] {
      if (result->prompt_len == 0) result->prompt_len = prompt.approx_tokens;
      if (result->success && !prompt.passkey.empty()) {
        result->passkey_correct = PasskeyAnswered(prompt, result->generated_text);
      }
      state.Ended(result->success, Clock::now());  // last: the dispatcher may return after it
    });
  }
  const Clock::time_point last_end = state.WaitForAll();
  outcome.duration_s = results.empty() ? 0 : Seconds(last_end - start);
  outcome.results.reserve(results.size());
  for (auto& r : results) outcome.results.push_back(std::move(*r));
  return outcome;
}

}  // namespace

absl::StatusOr<RunOutcome> RunBenchmark(Backend& backend, const RunOptions& options,
                                        const std::vector<Prompt>& prompts) {
  if (prompts.empty()) return absl::InvalidArgumentError("no prompts to send");
  if (options.num_requests == 0 && options.duration_s <= 0) {
    return absl::InvalidArgumentError("give a number of requests or a duration");
  }
  if (options.request.timeout_s <= 0) {
    return absl::InvalidArgumentError("request timeout must be > 0");
  }
  if (options.request.model.empty()) {
    return absl::InvalidArgumentError("no model named (resolve it with the backend first)");
  }
  KVR_RETURN_IF_ERROR(ValidateArrivalOptions(options.arrival));
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (absl::Status s = backend.CheckPrompt(prompts[i]); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt ", i, ": ", s.message()));
    }
  }
  if (options.num_warmups > 0) {
    RunOptions warmup = options;
    warmup.arrival = ArrivalOptions{};
    warmup.num_requests = options.num_warmups;
    warmup.duration_s = 0;
    warmup.on_progress = nullptr;
    // Its results are dropped: warm-up failures show up again in the measured run if real.
    Dispatch(backend, warmup, prompts);
  }
  return Dispatch(backend, options, prompts);
}

}  // namespace kvr::loadgen
