#pragma once
// Drives one Generate request through the cluster: admission is done by the caller; this
// places the request, runs prefill, relays the first token and the decode node's stream to a
// ResponseSink, and applies the retry rule of RequestStateMachine when a node fails. Every
// attempt gets a fresh random store sequence id and capability (ids.h); an id the store
// already holds (ALREADY_EXISTS from P, a 2^-64 event) is retried with a fresh one on the same
// nodes, counting as an attempt. A request with resume_on_failure whose node dies after tokens
// were streamed is run again ("resumed"): its prompt plus the tokens already sent are
// prefilled on a new placement (the failed node excluded) and the stream goes on from the next
// token, at most max_attempts times per request. Plain class over the node-client interfaces;
// the gRPC service is a thin shell around it.

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvr/controller/cancellation.h"
#include "kvr/controller/clock.h"
#include "kvr/controller/membership.h"
#include "kvr/controller/node_clients.h"
#include "kvr/controller/placement.h"
#include "kvr/controller/prefix_cache.h"
#include "kvr/controller/types.h"

namespace kvr::controller {

struct FinalReport;

// Hooks on a request's life, for metrics and tracing (MetricsObserver, metrics_observer.h,
// implements them for Prometheus). Called on the request's own thread, so implementations must be
// thread-safe across requests; they must not block. Every hook has an empty default.
class RequestObserver {
 public:
  virtual ~RequestObserver() = default;
  // Refused before running (validation, admission, duplicate id): `status` says why.
  virtual void OnRejected(const absl::Status& status) {}
  // An attempt was placed on nodes (attempt 1, 2, ...).
  virtual void OnAttempt(const GenerateParams& params, const PlacementDecision& placement,
                         uint32_t attempt) {}
  // A node failed during an attempt (whether or not the request is retried).
  virtual void OnNodeFailure(const GenerateParams& params, absl::string_view node_id,
                             const absl::Status& error) {}
  // The first token reached the client.
  virtual void OnFirstToken(const GenerateParams& params, absl::Duration queue,
                            absl::Duration time_to_first_token) {}
  // More tokens reached the client.
  virtual void OnTokens(const GenerateParams& params, uint32_t n) {}
  // The request ended: OK with its report, or the error that ended the stream (report null).
  virtual void OnEnd(const GenerateParams& params, const absl::Status& outcome,
                     const FinalReport* report) {}
};

struct RunnerOptions {
  // Attempts per request (1 = no retry).
  uint32_t max_attempts = 3;
  // Deadline of the best-effort Cancel RPCs sent when a request ends early. Its own, because
  // the request's deadline may be the reason it ended.
  absl::Duration cancel_rpc_timeout = absl::Seconds(1);
  // Text and chat prompts are tokenized on a prefill node before placement (exact admission);
  // each Tokenize call gets at most this long (and never past the request's deadline), and at
  // most this many prefill nodes are tried before falling back to the prompt's byte bound.
  absl::Duration tokenize_timeout = absl::Seconds(30);
  int tokenize_tries = 2;
  // Not owned; may be null.
  RequestObserver* observer = nullptr;
  // Prefix reuse (not owned; null: off). A request whose prompt the controller knows as token
  // ids looks up its longest cached prefix, prefers the store that holds it and sends it to
  // the prefill node; a request that ends well is recorded by its prompt (the rows a prefill
  // computed), and its store keeps the sequence for prefix_retain.
  PrefixCache* prefix_cache = nullptr;
  absl::Duration prefix_retain = absl::Minutes(5);
};

// What the client sees at the end of a successful request.
struct FinalReport {
  Completion completion;
  absl::Duration queue;
  absl::Duration time_to_first_token;
  absl::Duration decode;
  absl::Duration prefill;
  std::string prefill_node;
  std::string decode_node;
  std::string store_node;
  uint32_t attempts = 0;
};

// One message to the client: new tokens, or (last) the final report.
struct GenerateEvent {
  TokenChunk chunk;
  // Completion tokens sent so far, this message's included.
  uint32_t completion_tokens = 0;
  uint32_t prompt_tokens = 0;
  std::optional<FinalReport> final;
};

class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  // An error means the client is gone; the runner then cancels downstream.
  [[nodiscard]] virtual absl::Status Send(const GenerateEvent& event) = 0;
};

class RequestRunner {
 public:
  // All pointers must outlive the runner.
  RequestRunner(Membership* membership, Placement* placement, PrefillClient* prefill,
                DecodeClient* decode, const Clock* clock, RunnerOptions options);

  // Runs `params` to completion. `arrival` is when the controller received the request;
  // `deadline` the client's (absolute). Returns OK after the final event was sent; otherwise
  // the status that ends the client's stream (CANCELLED with cancel's reason when cancelled).
  [[nodiscard]] absl::Status Run(const GenerateParams& params, absl::Time arrival,
                                 absl::Time deadline, CancellationToken* cancel,
                                 ResponseSink* sink);

 private:
  // For a text or chat prompt: its token ids from a prefill node serving the model (least
  // queued first). OK with `*out` = params with the ids as prompt and the exact bound;
  // INVALID_ARGUMENT / DEADLINE_EXCEEDED end the request; any other outcome (no node could
  // tokenize) leaves `*out` unset, and the request goes on with the byte bound.
  absl::Status TokenizeFirst(const GenerateParams& params, absl::Time deadline,
                             std::optional<GenerateParams>* out);
  // What a request streamed over its runs (the first, then one per resume).
  struct Progress {
    // Token ids the client received, in order.
    std::vector<uint32_t> sent;
    // The client's prompt, as the first prefill counted it.
    uint32_t prompt_tokens = 0;
    // Placements tried by the runs before the current one.
    uint32_t attempts = 0;
    // Of the first run: the client's queue and time to first token.
    absl::Duration queue;
    absl::Duration time_to_first_token;
    // Nodes that failed this request; placement avoids them.
    absl::flat_hash_set<std::string> excluded;
    // Set by a run that ended because a node failed after tokens were sent (what a resume
    // recovers from); false for every other ending.
    bool failed_after_tokens = false;
  };
  // One run: placement, prefill and decode with retries until the first token, then the
  // stream. Without the OnEnd hook.
  absl::Status RunAttempts(const GenerateParams& params, absl::Time arrival, absl::Time deadline,
                           CancellationToken* cancel, ResponseSink* sink, RequestObserver& observer,
                           Progress& progress, std::optional<FinalReport>& report);
  // `params` of the run that continues after `progress`: the prompt's token ids followed by
  // the tokens sent, and max_tokens less those.
  static GenerateParams ResumedParams(const GenerateParams& params, const Progress& progress);
  void CancelDownstream(const NodeSnapshot* prefill, const NodeSnapshot* decode,
                        const GenerateParams& params, uint64_t sequence_id,
                        absl::string_view reason);

  Membership* membership_;
  Placement* placement_;
  PrefillClient* prefill_;
  DecodeClient* decode_;
  const Clock* clock_;
  const RunnerOptions options_;
};

// The node an error names through kFailedNodePayloadUrl, if any.
std::optional<std::string> FailedNodeOf(const absl::Status& status);

}  // namespace kvr::controller
