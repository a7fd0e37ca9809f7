#include "kvr/controller/request_runner.h"

#include <algorithm>
#include <utility>
#include <variant>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvr/controller/ids.h"
#include "kvr/controller/request_state.h"
#include "spdlog/spdlog.h"

namespace kvr::controller {

std::optional<std::string> FailedNodeOf(const absl::Status& status) {
  auto payload = status.GetPayload(kFailedNodePayloadUrl);
  if (!payload) return std::nullopt;
  return std::string(*payload);
}

RequestRunner::RequestRunner(Membership* membership, Placement* placement, PrefillClient* prefill,
                             DecodeClient* decode, const Clock* clock, RunnerOptions options)
    : membership_(membership),
      placement_(placement),
      prefill_(prefill),
      decode_(decode),
      clock_(clock),
      options_(options) {}

void RequestRunner::CancelDownstream(const NodeSnapshot* prefill, const NodeSnapshot* decode,
                                     const GenerateParams& params, uint64_t sequence_id,
                                     absl::string_view reason) {
  const absl::Time deadline = clock_->Now() + options_.cancel_rpc_timeout;
  // Best effort: the node may be the one that died, or may have dropped the sequence itself.
  if (prefill != nullptr) {
    absl::Status s = prefill_->Cancel(*prefill, params.request_id, sequence_id, reason, deadline);
    if (!s.ok()) spdlog::debug("cancel on {}: {}", prefill->id, s.ToString());
  }
  if (decode != nullptr) {
    absl::Status s = decode_->Cancel(*decode, params.request_id, sequence_id, reason, deadline);
    if (!s.ok()) spdlog::debug("cancel on {}: {}", decode->id, s.ToString());
  }
}

namespace {
// Used when no observer is configured, so that the flow needs no null checks.
class NoObserver final : public RequestObserver {};
}  // namespace

absl::Status RequestRunner::Run(const GenerateParams& params, absl::Time arrival,
                                absl::Time deadline, CancellationToken* cancel,
                                ResponseSink* sink) {
  NoObserver none;
  RequestObserver& observer = options_.observer != nullptr ? *options_.observer : none;
  std::optional<FinalReport> report;
  std::optional<GenerateParams> tokenized;
  absl::Status status = TokenizeFirst(params, deadline, &tokenized);
  const GenerateParams& run_params = tokenized ? *tokenized : params;
  Progress progress;
  if (status.ok()) {
    status = RunAttempts(run_params, arrival, deadline, cancel, sink, observer, progress, report);
  }
  for (uint32_t resumes = 0;
       !status.ok() && progress.failed_after_tokens && params.resume_on_failure; ++resumes) {
    if (!std::holds_alternative<std::vector<uint32_t>>(run_params.prompt)) {
      status = absl::Status(status.code(), absl::StrCat(status.message(),
                                                        "; not resumed: no prefill node "
                                                        "tokenized the prompt for the controller"));
      break;
    }
    if (resumes >= options_.max_attempts) {
      status = absl::Status(
          status.code(),
          absl::StrCat(status.message(), "; not resumed again: ", resumes, " resumes already"));
      break;
    }
    spdlog::warn(
        "request {}: resuming after {} tokens: prefilling prompt + sent tokens on "
        "another placement",
        params.request_id, progress.sent.size());
    progress.failed_after_tokens = false;
    status = RunAttempts(ResumedParams(run_params, progress), arrival, deadline, cancel, sink,
                         observer, progress, report);
  }
  observer.OnEnd(params, status, status.ok() && report ? &*report : nullptr);
  return status;
}

GenerateParams RequestRunner::ResumedParams(const GenerateParams& params,
                                            const Progress& progress) {
  GenerateParams next = params;
  std::vector<uint32_t> context = std::get<std::vector<uint32_t>>(params.prompt);
  context.insert(context.end(), progress.sent.begin(), progress.sent.end());
  next.prompt_tokens_bound = context.size();
  next.prompt = std::move(context);
  const uint32_t sent = static_cast<uint32_t>(progress.sent.size());
  // Validation keeps prompt + max_tokens inside the context, so this one fits as well.
  next.sampling.max_tokens =
      params.sampling.max_tokens > sent ? params.sampling.max_tokens - sent : 0;
  return next;
}

absl::Status RequestRunner::TokenizeFirst(const GenerateParams& params, absl::Time deadline,
                                          std::optional<GenerateParams>* out) {
  if (std::holds_alternative<std::vector<uint32_t>>(params.prompt)) return absl::OkStatus();
  std::vector<NodeSnapshot> nodes;
  for (NodeSnapshot& n : membership_->LiveNodes(NodeRole::kPrefill)) {
    if (n.Serves(params.model)) nodes.push_back(std::move(n));
  }
  std::stable_sort(nodes.begin(), nodes.end(), [](const NodeSnapshot& a, const NodeSnapshot& b) {
    return a.effective_load.queued_prefill_tokens < b.effective_load.queued_prefill_tokens;
  });
  if (nodes.size() > static_cast<size_t>(std::max(options_.tokenize_tries, 0))) {
    nodes.resize(static_cast<size_t>(std::max(options_.tokenize_tries, 0)));
  }
  for (const NodeSnapshot& node : nodes) {
    const absl::Time call_deadline = std::min(deadline, clock_->Now() + options_.tokenize_timeout);
    absl::StatusOr<std::vector<uint32_t>> ids = prefill_->Tokenize(node, params, call_deadline);
    if (ids.ok()) {
      GenerateParams p = params;
      p.prompt_tokens_bound = ids->size();
      p.prompt = std::move(*ids);
      *out = std::move(p);
      return absl::OkStatus();
    }
    if (absl::IsInvalidArgument(ids.status())) return ids.status();
    if (clock_->Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("deadline: passed while tokenizing the prompt on ", node.id));
    }
    spdlog::debug("request {}: tokenize on {}: {}", params.request_id, node.id,
                  ids.status().ToString());
  }
  return absl::OkStatus();  // placement uses the byte bound; the prefill node tokenizes
}

namespace {

// The code of a request given up after its node failures: UNAVAILABLE (trying again later may
// succeed), except when the last node refused the request itself (INVALID_ARGUMENT: e.g. a
// decode node whose settings cannot take it; FAILED_PRECONDITION: e.g. a store it cannot read):
// that refusal is the client's answer, and retrying it unchanged will not help.
absl::StatusCode GiveUpCode(const absl::Status& last_failure) {
  if (absl::IsInvalidArgument(last_failure) || absl::IsFailedPrecondition(last_failure)) {
    return last_failure.code();
  }
  return absl::StatusCode::kUnavailable;
}

}  // namespace

absl::Status RequestRunner::RunAttempts(const GenerateParams& params, absl::Time arrival,
                                        absl::Time deadline, CancellationToken* cancel,
                                        ResponseSink* sink, RequestObserver& observer,
                                        Progress& progress,
                                        std::optional<FinalReport>& final_report) {
  RequestStateMachine state(options_.max_attempts);
  absl::flat_hash_set<std::string>& excluded = progress.excluded;
  absl::Status last_failure;
  // A resumed run continues a stream: its first token is the client's next one.
  const bool resumed = !progress.sent.empty();
  // Prefix reuse needs the prompt's token ids (text and chat prompts: tokenized first).
  const auto* prompt_ids = std::get_if<std::vector<uint32_t>>(&params.prompt);
  PrefixCache* prefixes =
      options_.prefix_cache != nullptr && params.prefix_cache && prompt_ids != nullptr
          ? options_.prefix_cache
          : nullptr;
  // Records a sequence that ended well by its prompt. Only the prompt's rows are offered for
  // reuse, not those of the generated tokens: the prefill node computed them exactly as a cold
  // prefill of the same tokens would, while a decode step's rows depend on the method's
  // selection (a sparse method attends to fewer rows) and, on the CPU runtime, on its 8-bit
  // activations. A conversation's next turn thus reuses everything but the last answer.
  const auto remember = [&](const NodeSnapshot& store, uint64_t sequence_id,
                            const std::string& capability) {
    if (prefixes == nullptr) return;
    std::vector<uint32_t> tokens = *prompt_ids;
    const absl::Time now = clock_->Now();
    // Forgotten a little before the store drops the sequence.
    prefixes->Insert(params.model, params.cache_salt, store.id, sequence_id, capability,
                     std::move(tokens), now + options_.prefix_retain * 0.9, now);
  };

  // Ends the request well: `last` (its token counts set) carries `report` as the final event.
  const auto finish = [&](GenerateEvent last, FinalReport report) {
    last.final = report;
    final_report = std::move(report);
    state.Finish();
    return sink->Send(last);
  };

  while (true) {
    if (cancel->IsCancelled()) {
      state.Cancel();
      return cancel->reason();
    }
    if (clock_->Now() >= deadline) {
      state.Fail();
      return absl::DeadlineExceededError(absl::StrCat(
          "deadline: passed before prefill could start",
          last_failure.ok() ? "" : absl::StrCat(" (last failure: ", last_failure.message(), ")")));
    }
    if (absl::Status s = state.BeginAttempt(); !s.ok()) return s;
    if (resumed && params.sampling.max_tokens == 0) {
      // The node died after the last token the request may have: what it owed is the end.
      FinalReport report;
      report.queue = progress.queue;
      report.time_to_first_token = progress.time_to_first_token;
      report.attempts = progress.attempts;
      report.completion.finish_reason = FinishReason::kLength;
      report.completion.prompt_tokens = progress.prompt_tokens;
      report.completion.completion_tokens = static_cast<uint32_t>(progress.sent.size());
      GenerateEvent last;
      last.prompt_tokens = progress.prompt_tokens;
      last.completion_tokens = report.completion.completion_tokens;
      return finish(std::move(last), std::move(report));
    }

    std::optional<PrefixMatch> prefix;
    if (prefixes != nullptr) {
      prefix = prefixes->Lookup(params.model, params.cache_salt, *prompt_ids, clock_->Now());
    }
    PlacementRequest preq{params.model, params.retrieval.method, params.prompt_tokens_bound,
                          params.sampling.max_tokens, excluded,
                          prefix ? prefix->store_id : std::string()};
    absl::StatusOr<PlacementDecision> placed = placement_->Place(preq);
    if (!placed.ok()) {
      state.Fail();
      if (!last_failure.ok()) {
        // The cluster had room before a node failed; report the failure, not the symptom.
        return absl::Status(
            GiveUpCode(last_failure),
            absl::StrCat("no healthy node left to retry on after attempt ", state.attempts() - 1,
                         " failed (", last_failure.message(), "): ", placed.status().message()));
      }
      if (absl::IsNotFound(placed.status())) {
        return absl::UnavailableError(placed.status().message());
      }
      return placed.status();
    }
    const PlacementDecision& where = *placed;
    // Random, so that neither the request id nor an earlier sequence tells anyone this one;
    // the store serves it only with the capability, which goes to P and D alone.
    const uint64_t sequence_id = NewSequenceId();
    const absl::Time prefill_start = clock_->Now();
    spdlog::debug("request {} attempt {}: prefill {} decode {} store {} (sequence {})",
                  params.request_id, state.attempts(), where.prefill.id, where.decode.id,
                  where.store.id, sequence_id);

    observer.OnAttempt(params, where, state.attempts());
    PrefillCall call{&params,     sequence_id, NewSequenceCapability(), where.decode,
                     where.store, deadline,    state.attempts()};
    if (prefix && prefix->store_id == where.store.id) call.prefix = *prefix;
    if (prefixes != nullptr) call.retain = options_.prefix_retain;
    absl::StatusOr<PrefillResult> prefilled = prefill_->Prefill(where.prefill, call, cancel);
    if (!prefilled.ok()) {
      const absl::Status& err = prefilled.status();
      if (cancel->IsCancelled()) {
        state.Cancel();
        CancelDownstream(&where.prefill, &where.decode, params, sequence_id,
                         cancel->reason().message());
        return cancel->reason();
      }
      if (absl::IsAlreadyExists(err)) {
        // The store already holds this sequence id: no node failed. Retry at once with a
        // fresh id (the next attempt draws one) on whatever placement picks.
        last_failure = err;
        spdlog::info("request {}: sequence id collision in store {}; retrying with a new id",
                     params.request_id, where.store.id);
        if (state.OnNodeFailure() == RequestStateMachine::FailureAction::kRetry) continue;
        return absl::UnavailableError(
            absl::StrCat("request failed after ", state.attempts(), " attempts: ", err.message()));
      }
      // A node named as refusing the request (a decode node whose settings cannot take it)
      // is avoided like a failed one; other INVALID_ARGUMENTs are the client's to fix.
      const bool refused_by_node =
          (absl::IsInvalidArgument(err) || absl::IsFailedPrecondition(err)) &&
          FailedNodeOf(err).has_value();
      if (!IsNodeFailure(err) && !refused_by_node) {
        state.Fail();
        CancelDownstream(&where.prefill, &where.decode, params, sequence_id, err.message());
        if (absl::IsDeadlineExceeded(err)) {
          return absl::DeadlineExceededError(
              absl::StrCat("deadline: passed during prefill on ", where.prefill.id));
        }
        return err;  // e.g. INVALID_ARGUMENT from tokenization: the client's to fix.
      }
      const std::string failed = FailedNodeOf(err).value_or(where.prefill.id);
      excluded.insert(failed);
      // An unreachable node (UNAVAILABLE: connection refused or reset, the process is gone)
      // leaves the cluster until it registers again. Any other failure (busy, an internal
      // error on one sequence) only makes this request avoid the node: one bad request must
      // not take a healthy node out for everyone.
      if (absl::IsUnavailable(err)) membership_->MarkFailed(failed);
      // D may hold a partial handoff of this sequence.
      CancelDownstream(nullptr, failed == where.decode.id ? nullptr : &where.decode, params,
                       sequence_id, "prefill attempt failed");
      observer.OnNodeFailure(params, failed, err);
      last_failure =
          absl::Status(err.code(), absl::StrCat("prefill on ", where.prefill.id, " failed at node ",
                                                failed, ": ", err.message()));
      spdlog::warn("request {}: {}", params.request_id, std::string(last_failure.message()));
      if (state.OnNodeFailure() == RequestStateMachine::FailureAction::kRetry) continue;
      return absl::Status(GiveUpCode(last_failure),
                          absl::StrCat("request failed after ", state.attempts(),
                                       " attempts: ", last_failure.message()));
    }

    // First token: from here on the run cannot be retried (only resumed).
    const PrefillResult& first = *prefilled;
    // The prefill node found the cached sequence gone (evicted, its store restarted) and
    // computed the prompt cold: the entry is stale.
    if (call.prefix.tokens > 0 && first.cached_tokens == 0) {
      prefixes->Forget(call.prefix.sequence_id);
    }
    const absl::Time first_token_time = clock_->Now();
    if (!resumed) {
      progress.prompt_tokens = first.prompt_tokens;
      progress.queue = prefill_start - arrival;
      progress.time_to_first_token = first_token_time - arrival;
    }
    FinalReport report;
    report.queue = progress.queue;
    report.time_to_first_token = progress.time_to_first_token;
    report.prefill = first.prefill_time;
    report.prefill_node = where.prefill.id;
    report.decode_node = where.decode.id;
    report.store_node = where.store.id;
    report.attempts = progress.attempts + state.attempts();

    GenerateEvent event;
    event.chunk.token_ids = {first.first_token};
    event.chunk.text = first.first_text;
    progress.sent.push_back(first.first_token);
    event.prompt_tokens = progress.prompt_tokens;
    event.completion_tokens = static_cast<uint32_t>(progress.sent.size());
    (void)state.OnTokensSent(1);
    if (resumed) {
      observer.OnTokens(params, 1);
    } else {
      observer.OnFirstToken(params, report.queue, report.time_to_first_token);
    }
    if (absl::Status s = sink->Send(event); !s.ok()) {
      state.Cancel();
      CancelDownstream(nullptr, &where.decode, params, sequence_id, "client disconnected");
      return s;
    }

    if (first.finish_reason != FinishReason::kUnspecified) {
      report.completion.finish_reason = first.finish_reason;
      report.completion.matched_stop = first.matched_stop;
      report.completion.prompt_tokens = progress.prompt_tokens;
      report.completion.completion_tokens = static_cast<uint32_t>(progress.sent.size());
      report.completion.retrieval.bytes_shipped = first.kv_bytes_shipped;
      report.completion.cached_tokens = first.cached_tokens;
      report.decode = clock_->Now() - first_token_time;
      remember(where.store, sequence_id, call.sequence_capability);
      GenerateEvent last;
      last.prompt_tokens = progress.prompt_tokens;
      last.completion_tokens = report.completion.completion_tokens;
      return finish(std::move(last), std::move(report));
    }

    absl::Status sink_status;
    absl::StatusOr<Completion> done =
        decode_->Stream(where.decode, params.request_id, sequence_id, deadline, cancel,
                        [&](const TokenChunk& chunk) -> absl::Status {
                          GenerateEvent e;
                          e.chunk = chunk;
                          (void)state.OnTokensSent(static_cast<uint32_t>(chunk.token_ids.size()));
                          progress.sent.insert(progress.sent.end(), chunk.token_ids.begin(),
                                               chunk.token_ids.end());
                          e.completion_tokens = static_cast<uint32_t>(progress.sent.size());
                          e.prompt_tokens = progress.prompt_tokens;
                          observer.OnTokens(params, static_cast<uint32_t>(chunk.token_ids.size()));
                          sink_status = sink->Send(e);
                          return sink_status;
                        });
    if (!done.ok()) {
      if (cancel->IsCancelled() || !sink_status.ok()) {
        state.Cancel();
        const absl::Status why = cancel->IsCancelled() ? cancel->reason() : sink_status;
        CancelDownstream(nullptr, &where.decode, params, sequence_id, why.message());
        return why;
      }
      const absl::Status& err = done.status();
      if (absl::IsDeadlineExceeded(err)) {
        state.Fail();
        CancelDownstream(nullptr, &where.decode, params, sequence_id, "deadline exceeded");
        return absl::DeadlineExceededError(
            absl::StrCat("deadline: passed after ", state.tokens_sent(), " tokens were streamed"));
      }
      (void)state.OnNodeFailure();  // always kFail: tokens were sent
      // D names the node that failed when it is not itself (its store died under the
      // sequence): that one leaves the cluster, and D, which is fine, stays.
      const std::string failed = FailedNodeOf(err).value_or(where.decode.id);
      excluded.insert(failed);
      progress.failed_after_tokens = IsNodeFailure(err);
      progress.attempts += state.attempts();
      observer.OnNodeFailure(params, failed, err);
      if (absl::IsUnavailable(err)) membership_->MarkFailed(failed);
      CancelDownstream(nullptr, &where.decode, params, sequence_id, "decode failed");
      const std::string message =
          failed == where.decode.id
              ? absl::StrCat("decode node ", where.decode.id, " (",
                             where.decode.registration.endpoints.grpc_address, ") failed after ",
                             progress.sent.size(),
                             " tokens were streamed; not retried because tokens were already "
                             "sent: ",
                             err.message())
              : absl::StrCat("node ", failed, " failed while decode node ", where.decode.id,
                             " streamed; not retried because ", progress.sent.size(),
                             " tokens were already sent: ", err.message());
      spdlog::warn("request {}: {}", params.request_id, message);
      return absl::UnavailableError(message);
    }

    report.completion = *done;
    // The client's prompt: a resumed run's prompt also holds the tokens sent before it.
    if (resumed || report.completion.prompt_tokens == 0) {
      report.completion.prompt_tokens = progress.prompt_tokens;
    }
    report.completion.retrieval.bytes_shipped += first.kv_bytes_shipped;
    report.completion.cached_tokens = first.cached_tokens;
    report.decode = clock_->Now() - first_token_time;
    remember(where.store, sequence_id, call.sequence_capability);
    GenerateEvent last;
    last.prompt_tokens = report.completion.prompt_tokens;
    const uint32_t sent_before = static_cast<uint32_t>(progress.sent.size()) - state.tokens_sent();
    last.completion_tokens = std::max(sent_before + report.completion.completion_tokens,
                                      static_cast<uint32_t>(progress.sent.size()));
    report.completion.completion_tokens = last.completion_tokens;
    return finish(std::move(last), std::move(report));
  }
}

}  // namespace kvr::controller
