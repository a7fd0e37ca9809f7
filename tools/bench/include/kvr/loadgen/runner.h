#pragma once
// Drives a run: sends the prompts through a Backend (backend.h) on an arrival schedule (open
// loop) and/or under a concurrency cap (closed loop), and records what each request measured.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/loadgen/backend.h"
#include "kvr/loadgen/dataset.h"
#include "kvr/loadgen/metrics.h"
#include "kvr/loadgen/schedule.h"

namespace kvr::loadgen {

struct RunOptions {
  // What each request asks for; `request.model` must be set (Backend::ResolveModel).
  RequestSpec request;
  ArrivalOptions arrival;
  // Most requests in flight; 0 = no cap. With an infinite rate this is a closed loop.
  uint32_t max_concurrency = 0;
  // Requests to send (prompts are reused in turn when fewer); 0 = until `duration_s`.
  uint64_t num_requests = 0;
  // Stop sending after this many seconds (requests in flight still finish); 0 = no limit.
  double duration_s = 0;
  // Requests sent (all at once, at most max_concurrency in flight) and awaited before the
  // measured run, and left out of its results, so that connections, server threads and
  // caches are warm (as `vllm bench serve --num-warmups`).
  uint32_t num_warmups = 0;
  // Called after each request ends (from a backend thread; serialised): done, failed so far.
  std::function<void(uint64_t done, uint64_t failed)> on_progress;
};

struct RunOutcome {
  std::string model;                   // the model the requests named
  std::vector<RequestResult> results;  // in the order the requests were sent
  double duration_s = 0;               // first send to last end
};

// Errors: InvalidArgument for bad options or a prompt the backend cannot send. Failed
// requests do not fail the run: they are in the results. A request's prompt_len is the
// server's count when it reported one, else the prompt's approx_tokens; passkey prompts are
// scored.
[[nodiscard]] absl::StatusOr<RunOutcome> RunBenchmark(Backend& backend, const RunOptions& options,
                                                      const std::vector<Prompt>& prompts);

}  // namespace kvr::loadgen
