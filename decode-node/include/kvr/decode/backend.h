#pragma once
// The decode node's model backend seam: DecodeEngine keeps the request logic
// (admission, batching, sampling, stop strings, streaming, metrics, store release) and hands the
// per-sequence model state and the forward pass of each step to a DecodeBackend:
// - the CPU backend (MakeCpuDecodeBackend): model::Model::Forward through DecodeAttention
//   (windowed resident KV, the handed-off retrieval indexes, rows fetched from the store per
//   step, generated rows appended to the store);
// - the CUDA backend (cuda_backend.h): model::CudaModel sparse sequences, whose full KV is
//   pulled from the store into pinned host memory at join.
//
// Thread safety: Prepare may run on any thread (Admit) and concurrently with the loop thread;
// every other method is called by the engine's loop thread only.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/decode/decode_attention.h"
#include "kvr/decode/observer.h"
#include "kvr/model/config.h"
#include "kvr/model/model.h"
#include "kvr/retrieval/registry.h"

namespace kvr::decode {

struct Handoff;

// A backend's state of one sequence between Prepare and Join (owned by the engine meanwhile).
class BackendSequence {
 public:
  virtual ~BackendSequence() = default;
  // Node memory the sequence holds once running (what the controller's free memory counts).
  virtual int64_t resident_bytes() const = 0;
};

class DecodeBackend {
 public:
  virtual ~DecodeBackend() = default;
  virtual const model::ModelConfig& config() const = 0;
  // "cpu" or "cuda:<device>", for logs.
  virtual std::string name() const = 0;
  // Most tokens a sequence may hold, prompt and generated (the model's context or less): the
  // engine refuses longer prompts and ends a sequence there with FinishReason::kLength.
  virtual int64_t max_sequence_tokens() const = 0;

  // The backend's checks of a handoff the engine has checked already (ids, model, store,
  // prompt length, first token, sampling, layer count) and the sequence's state; may consume
  // h.layers. InvalidArgument starting "handoff of sequence <id>: " names the field.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<BackendSequence>> Prepare(
      Handoff& h) const = 0;
  // The sequence joins the running batch (`h` is the handoff without its layers).
  [[nodiscard]] virtual absl::Status Join(const Handoff& h,
                                          std::unique_ptr<BackendSequence> state) = 0;
  // One decode step: sequence ids[b] takes tokens[b]; logits [batch, vocab].
  [[nodiscard]] virtual absl::Status Step(std::span<const uint64_t> ids,
                                          std::span<const int32_t> tokens,
                                          std::span<float> logits) = 0;
  // A backend that picks greedy tokens where the logits are (the GPU) says so here; the engine
  // then runs a step whose every sequence samples greedily as StepGreedy, and no logits cross
  // to the host ([batch, vocab] floats: 50 MB a step at batch 256 and a 49K vocabulary).
  virtual bool HasStepGreedy() const { return false; }
  // The same step as Step, with next[b] = the argmax of sequence b's logits (the lowest id among
  // ties, as model::ArgMax; negative when no logit is finite) instead of the logits.
  [[nodiscard]] virtual absl::Status StepGreedy(std::span<const uint64_t> /*ids*/,
                                                std::span<const int32_t> /*tokens*/,
                                                std::span<int32_t> /*next*/) {
    return absl::UnimplementedError("this decode backend has no greedy step");
  }
  // After the step's tokens were sampled (the CPU backend starts appending the step's rows to
  // the store); then the sequences whose background work failed since the last call.
  virtual void AfterStep() {}
  virtual absl::flat_hash_map<uint64_t, absl::Status> TakeFailures() { return {}; }
  // The running sequence leaves (its backend state is dropped; the store is not touched).
  // Returns its counters.
  virtual RetrievalCounters Leave(uint64_t id) = 0;
  virtual NodeCounters node_counters() const = 0;
  // Summary bytes held for a running sequence (0 when unknown).
  virtual int64_t SummaryBytes(uint64_t id) const = 0;
};

struct CpuDecodeBackendOptions {
  int64_t hot_cache_bytes = 64 << 20;
  double quality_sample_rate = 0;
  // Method assets (A2ATS codebooks) the handed-off indexes are deserialised with; may be null.
  std::shared_ptr<const retrieval::MethodAssets> method_assets;
};

// The CPU backend: `model`, `registry` and `observer` (may be null) must outlive it.
[[nodiscard]] std::unique_ptr<DecodeBackend> MakeCpuDecodeBackend(
    const model::Model* model, const retrieval::MethodRegistry* registry,
    CpuDecodeBackendOptions options, DecodeObserver* observer);

}  // namespace kvr::decode
