#include "kvr/decode/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/decode/text.h"
#include "spdlog/spdlog.h"

namespace kvr::decode {

// State of one sequence. Fields above `mu_`-guarded ones belong to the loop thread once the
// sequence is running (before that, to whoever holds it).
struct DecodeEngine::Sequence {
  explicit Sequence(model::Sampler s) : sampler(std::move(s)) {}

  Handoff meta;  // layers cleared after Prepare
  model::Sampler sampler;
  std::unique_ptr<BackendSequence> state;                // the backend's, until the sequence joins
  std::unique_ptr<kv_store::LeaseKeeper::Handle> lease;  // renews the store lease while here
  int32_t next_token = 0;
  int64_t generated = 1;  // the first token, sampled by the prefill node
  TextStream text;
  bool running = false;

  // Guarded by the engine's mu_.
  std::vector<int32_t> out_tokens;
  std::string out_text;
  bool finished = false;
  absl::Status error;
  CompletionInfo completion;
  bool cancelled = false;
  std::string cancel_reason;
  absl::Time finished_at;
  int64_t resident_bytes = 0;
};

DecodeEngine::DecodeEngine(std::unique_ptr<DecodeBackend> backend,
                           const model::Tokenizer* tokenizer, EngineOptions options,
                           DecodeObserver* observer)
    : backend_(std::move(backend)),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      observer_(observer != nullptr ? observer : &noop_observer_) {
  if (options_.store_lease > absl::ZeroDuration()) {
    lease_keeper_ = std::make_unique<kv_store::LeaseKeeper>(kv_store::LeaseKeeperOptions{
        .ttl = options_.store_lease, .period = options_.store_lease / 4});
  }
}

absl::StatusOr<std::unique_ptr<DecodeEngine>> DecodeEngine::Create(
    const model::Model* model, const model::Tokenizer* tokenizer,
    const retrieval::MethodRegistry* registry, EngineOptions options, DecodeObserver* observer) {
  if (model == nullptr || registry == nullptr) {
    return absl::InvalidArgumentError("DecodeEngine: model and registry are required");
  }
  if (options.hot_cache_bytes < 0 ||
      !(options.quality_sample_rate >= 0 && options.quality_sample_rate <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeEngine: hot_cache_bytes must be >= 0 and quality_sample_rate in "
                     "[0, 1] (got ",
                     options.quality_sample_rate, ")"));
  }
  std::unique_ptr<DecodeBackend> backend =
      MakeCpuDecodeBackend(model, registry,
                           {.hot_cache_bytes = options.hot_cache_bytes,
                            .quality_sample_rate = options.quality_sample_rate,
                            .method_assets = options.method_assets},
                           observer);
  return Create(std::move(backend), tokenizer, std::move(options), observer);
}

absl::StatusOr<std::unique_ptr<DecodeEngine>> DecodeEngine::Create(
    std::unique_ptr<DecodeBackend> backend, const model::Tokenizer* tokenizer,
    EngineOptions options, DecodeObserver* observer) {
  if (backend == nullptr) return absl::InvalidArgumentError("DecodeEngine: no backend");
  if (options.batch_slots <= 0 || options.max_waiting < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeEngine: batch_slots must be > 0 (got ", options.batch_slots,
                     ") and max_waiting >= 0 (got ", options.max_waiting, ")"));
  }
  return std::unique_ptr<DecodeEngine>(
      new DecodeEngine(std::move(backend), tokenizer, std::move(options), observer));
}

DecodeEngine::~DecodeEngine() {
  Stop();
  // Release whatever is left in the stores (no Stream will collect it).
  std::vector<Sequence*> left;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, seq] : sequences_) {
      if (!seq->finished) left.push_back(seq.get());
    }
  }
  for (Sequence* seq : left)
    End(*seq, absl::CancelledError("decode node shutting down"), "cancelled");
}

void DecodeEngine::Start() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = false;
  }
  thread_ = std::thread([this] { Loop(); });
}

void DecodeEngine::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void DecodeEngine::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (!Step()) {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      // Nothing to run: sleep until a handoff arrives (or a cancel / shutdown).
      if (waiting_.empty()) cv_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
    }
  }
}

absl::StatusOr<std::unique_ptr<DecodeEngine::Sequence>> DecodeEngine::Prepare(Handoff h) const {
  const model::ModelConfig& c = backend_->config();
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff of sequence ", h.sequence_id, ": ", parts...));
  };
  if (h.sequence_id == 0) return bad("sequence_id is 0");
  if (h.store_capability.IsNone()) return bad("no store capability (16 random bytes)");
  if (!options_.model_name.empty() && !h.model.empty() && h.model != options_.model_name) {
    return bad("model '", h.model, "' is not served here ('", options_.model_name, "')");
  }
  if (h.store == nullptr) return bad("no store");
  if (h.prompt_tokens <= 0) return bad("prompt_tokens must be > 0");
  const int64_t max_tokens = backend_->max_sequence_tokens();
  if (h.prompt_tokens + 1 > max_tokens) {
    return bad("prompt_tokens ", h.prompt_tokens, " leave no room in the context of ", max_tokens,
               max_tokens < c.context_length ? " (this node's sequence limit)" : "");
  }
  if (h.first_token < 0 || h.first_token >= c.vocab) {
    return bad("first_token ", h.first_token, " outside the vocabulary");
  }
  if (h.budget <= 0) return bad("retrieval.budget must be > 0");
  if (h.n_sink < 0 || h.local_window <= 0) {
    return bad("retrieval.n_sink must be >= 0 and retrieval.local_window > 0");
  }
  if (h.sampling.max_tokens < 2) return bad("sampling.max_tokens must be >= 2 for a handoff");
  if (static_cast<int>(h.layers.size()) != c.n_layers) {
    return bad(h.layers.size(), " layers, the model has ", c.n_layers);
  }
  model::SamplingOptions so;
  so.temperature = h.sampling.temperature;
  so.top_p = h.sampling.top_p;
  so.top_k = h.sampling.top_k;
  // The prefill node sampled the first token from a sampler seeded with `seed`; this one
  // continues with another stream of the same seed.
  so.seed = h.sampling.seed + 1;
  absl::StatusOr<model::Sampler> sampler = model::Sampler::Create(so);
  if (!sampler.ok()) return bad("sampling: ", sampler.status().message());

  auto seq = std::make_unique<Sequence>(std::move(*sampler));
  KVR_ASSIGN_OR_RETURN(seq->state, backend_->Prepare(h));
  seq->next_token = h.first_token;
  seq->text = TextStream(h.sampling.stop, h.text_so_far, h.pending_utf8);
  h.layers.clear();
  seq->meta = std::move(h);
  seq->resident_bytes = seq->state->resident_bytes();
  return seq;
}

absl::Status DecodeEngine::Admit(Handoff handoff) {
  const uint64_t id = handoff.sequence_id;
  {
    absl::MutexLock lock(&mu_);
    if (sequences_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already here"));
    }
    if (static_cast<int>(waiting_.size()) >= options_.max_waiting) {
      return absl::ResourceExhaustedError(
          absl::StrCat("decode node: ", waiting_.size(), " sequences already wait for a slot"));
    }
  }
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, Prepare(std::move(handoff)));
  absl::MutexLock lock(&mu_);
  if (sequences_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already here"));
  }
  if (lease_keeper_ != nullptr) {
    seq->lease = lease_keeper_->Keep(seq->meta.store, seq->meta.store_owner, seq->meta.store_ref());
  }
  resident_bytes_ += seq->resident_bytes;
  waiting_.push_back(seq.get());
  sequences_.emplace(id, std::move(seq));
  cv_.SignalAll();
  return absl::OkStatus();
}

bool DecodeEngine::Has(uint64_t sequence_id) const {
  absl::MutexLock lock(&mu_);
  return sequences_.contains(sequence_id);
}

bool DecodeEngine::Cancel(uint64_t sequence_id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return false;
  Sequence& seq = *it->second;
  if (seq.finished) {
    // Nothing runs any more; forget the uncollected output.
    sequences_.erase(it);
    return true;
  }
  seq.cancelled = true;
  seq.cancel_reason = reason;
  cv_.SignalAll();
  return true;
}

absl::StatusOr<StreamChunk> DecodeEngine::Next(uint64_t sequence_id, absl::Time wait_until) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto it = sequences_.find(sequence_id);
    return it == sequences_.end() || it->second->finished || !it->second->out_tokens.empty() ||
           !it->second->out_text.empty();
  };
  while (!ready()) {
    if (cv_.WaitWithDeadline(&mu_, wait_until)) break;
  }
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence ", sequence_id, " is not on this node"));
  }
  Sequence& seq = *it->second;
  StreamChunk chunk;
  chunk.tokens = std::move(seq.out_tokens);
  chunk.text = std::move(seq.out_text);
  seq.out_tokens.clear();
  seq.out_text.clear();
  if (seq.finished) {
    absl::Status error = seq.error;
    chunk.completion = seq.completion;
    sequences_.erase(it);
    if (!error.ok()) return error;
  }
  return chunk;
}

void DecodeEngine::End(Sequence& seq, absl::Status status, const char* outcome) {
  const uint64_t id = seq.meta.sequence_id;
  if (seq.running) {
    seq.completion.retrieval = backend_->Leave(id);
    seq.running = false;
    running_.erase(std::remove(running_.begin(), running_.end(), &seq), running_.end());
  }
  // A sequence that never joined still holds what the backend prepared (the CUDA backend's
  // pinned host KV and its place among the pre-pulled ones): free it now, not when a reader
  // collects the outcome (up to unclaimed_ttl later).
  seq.state.reset();
  seq.lease.reset();
  // A sequence that ended well stays readable for retain (a later request may start from its
  // rows); any other ending frees it.
  if (absl::Status s = seq.meta.store->Release(
          seq.meta.store_ref(), status.ok() ? seq.meta.retain : absl::ZeroDuration());
      !s.ok()) {
    spdlog::warn("sequence {}: releasing it in the store: {}", id, s.ToString());
  }
  observer_->OnSequenceEnd(outcome, seq.generated);
  absl::MutexLock lock(&mu_);
  seq.finished = true;
  seq.finished_at = absl::Now();
  seq.error = std::move(status);
  seq.completion.prompt_tokens = seq.meta.prompt_tokens;
  seq.completion.completion_tokens = seq.generated;
  seq.completion.method = seq.meta.method;
  seq.completion.budget = seq.meta.budget;
  resident_bytes_ -= seq.resident_bytes;
  node_counters_ = backend_->node_counters();
  cv_.SignalAll();
}

bool DecodeEngine::Accept(Sequence& seq, int32_t token) {
  ++seq.generated;
  const SamplingSettings& s = seq.meta.sampling;
  FinishReason reason = FinishReason::kNone;
  std::string text;
  std::string matched;
  if (!s.ignore_eos && tokenizer_ != nullptr && tokenizer_->IsEndOfGeneration(token)) {
    reason = FinishReason::kEos;  // the end token and its text are not returned
  } else {
    std::string bytes;
    if (tokenizer_ != nullptr) {
      absl::StatusOr<std::string> b = tokenizer_->TokenBytes(token);
      if (b.ok()) bytes = std::move(*b);
    }
    if (seq.text.Push(bytes, &text, &matched)) reason = FinishReason::kStopString;
  }
  if (reason == FinishReason::kNone &&
      (seq.generated >= s.max_tokens ||
       seq.meta.prompt_tokens + seq.generated >= backend_->max_sequence_tokens())) {
    reason = FinishReason::kLength;
  }
  if (reason == FinishReason::kLength || reason == FinishReason::kEos) text += seq.text.Flush();
  seq.next_token = token;
  absl::MutexLock lock(&mu_);
  if (reason != FinishReason::kEos) seq.out_tokens.push_back(token);
  seq.out_text += text;
  seq.completion.reason = reason;
  seq.completion.matched_stop = matched;
  cv_.SignalAll();
  return reason != FinishReason::kNone;
}

bool DecodeEngine::Step() {
  // 1. Sequences that leave before the step: cancelled or past their deadline.
  std::vector<std::pair<Sequence*, absl::Status>> leaving;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    auto check = [&](Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (seq->cancelled) {
        leaving.emplace_back(
            seq, absl::CancelledError(absl::StrCat("sequence ", seq->meta.sequence_id,
                                                   " cancelled: ", seq->cancel_reason)));
        return true;
      }
      if (now >= seq->meta.deadline) {
        leaving.emplace_back(seq, absl::DeadlineExceededError(absl::StrCat(
                                      "sequence ", seq->meta.sequence_id, " passed its deadline")));
        return true;
      }
      return false;
    };
    for (Sequence* seq : running_) check(seq);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      it = check(*it) ? waiting_.erase(it) : std::next(it);
    }
    // Forget finished sequences that nobody collected.
    for (auto it = sequences_.begin(); it != sequences_.end();) {
      auto next = std::next(it);
      if (it->second->finished && now - it->second->finished_at > options_.unclaimed_ttl) {
        sequences_.erase(it);
      }
      it = next;
    }
  }
  for (auto& [seq, status] : leaving) {
    End(*seq, status, absl::IsCancelled(status) ? "cancelled" : "deadline");
  }

  // 2. Waiting sequences join while slots are free.
  while (static_cast<int>(running_.size()) < options_.batch_slots) {
    Sequence* seq = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (waiting_.empty()) break;
      seq = waiting_.front();
      waiting_.pop_front();
    }
    if (absl::Status s = backend_->Join(seq->meta, std::move(seq->state)); !s.ok()) {
      End(*seq, s, "error");
      continue;
    }
    seq->running = true;
    running_.push_back(seq);
  }
  if (running_.empty()) return false;

  // 3. One step over the batch.
  const auto t0 = std::chrono::steady_clock::now();
  const int vocab = backend_->config().vocab;
  step_ids_.clear();
  step_tokens_.clear();
  for (Sequence* seq : running_) {
    step_ids_.push_back(seq->meta.sequence_id);
    step_tokens_.push_back(seq->next_token);
  }
  // Every sequence greedy and a backend that picks on the device: tokens, not logits, come back.
  const bool greedy =
      backend_->HasStepGreedy() && std::all_of(running_.begin(), running_.end(),
                                               [](Sequence* s) { return s->sampler.greedy(); });
  // [batch, vocab], reused: a fresh 0.5 MiB per sequence (128K vocabularies) costs page faults
  // and zeroing every step.
  logits_.resize(greedy ? 0 : step_ids_.size() * vocab);
  greedy_next_.assign(greedy ? step_ids_.size() : 0, -1);
  const std::span<const float> logits(logits_);
  absl::Status forward = greedy ? backend_->StepGreedy(step_ids_, step_tokens_, greedy_next_)
                                : backend_->Step(step_ids_, step_tokens_, logits_);
  backend_->AfterStep();
  std::vector<Sequence*> step(running_.begin(), running_.end());
  if (!forward.ok()) {
    spdlog::error("decode step of {} sequences failed: {}", step.size(), forward.ToString());
    for (Sequence* seq : step) End(*seq, forward, "error");
    return true;
  }
  std::vector<Sequence*> done;
  for (size_t b = 0; b < step.size(); ++b) {
    Sequence* seq = step[b];
    absl::StatusOr<int32_t> token =
        greedy ? model::Sampler::GreedyPick(greedy_next_[b])
               : seq->sampler.Sample(std::span<const float>(logits.data() + b * vocab, vocab));
    if (!token.ok()) {
      End(*seq, token.status(), "error");
      continue;
    }
    if (Accept(*seq, *token)) done.push_back(seq);
  }
  const int batch_size = static_cast<int>(step.size());
  for (Sequence* seq : done) {
    const FinishReason r = seq->completion.reason;
    End(*seq, absl::OkStatus(),
        r == FinishReason::kEos          ? "eos"
        : r == FinishReason::kStopString ? "stop"
                                         : "length");
  }
  for (auto& [id, status] : backend_->TakeFailures()) {
    for (Sequence* seq : std::vector<Sequence*>(running_)) {
      if (seq->meta.sequence_id == id) End(*seq, status, "error");
    }
  }
  StepReport report;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report.batch_size = batch_size;
  report.tokens = batch_size;
  {
    absl::MutexLock lock(&mu_);
    report.waiting = static_cast<int>(waiting_.size());
    node_counters_ = backend_->node_counters();
  }
  observer_->OnStep(report);
  return true;
}

int DecodeEngine::running_sequences() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, seq] : sequences_) n += seq->finished ? 0 : 1;
  return n;
}

int64_t DecodeEngine::free_memory_bytes() const {
  absl::MutexLock lock(&mu_);
  return std::max<int64_t>(0, options_.memory_bytes - resident_bytes_);
}

NodeCounters DecodeEngine::node_counters() const {
  absl::MutexLock lock(&mu_);
  return node_counters_;
}

}  // namespace kvr::decode
