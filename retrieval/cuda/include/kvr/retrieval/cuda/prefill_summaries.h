#pragma once
// Retrieval summaries built on the GPU while a CUDA prefill runs: the model's per-layer build
// hook (model::CudaLayerBuilder, cuda_model.h) implemented with the kernels of build.cuh. The
// model schedules the builds (layer-pipelined, on a side stream where the builder asks for it)
// and exports their arrays beside the rows; this file knows what they are.
//
//   quest      bounds [ceil(length / page_size), n_kv_heads, 2, head_dim] fp32 (f32)
//   clusterkv  centroids [n_kv_heads, max_clusters, head_dim] fp32 (f32); n_clusters
//              [n_kv_heads], offsets [n_kv_heads, max_clusters + 1], members [n_kv_heads,
//              max_points] int32, concatenated (i32); max_clusters / max_points are the build
//              plan's at the sequence's capacity; the host plan (C0, initial points: the CPU
//              index's, MakeClusterKvBuildPlan) is made in Prepare for the built length
//   keydiff    scores [n_kv_heads, capacity] fp32, then the mean keys [n_kv_heads, head_dim] (f32)
//   a2ats      codeword ids [n_kv_heads, capacity] u16, two to an int32 (i32)
//   ctkvr      centroids [n_kv_heads, C, group, head_dim], their norms [n_kv_heads, C, group]
//              and the insertion thresholds [n_kv_heads, C] fp32 (f32); n_centroids
//              [n_kv_heads], list_offsets [n_kv_heads, C + 1], lists [n_kv_heads, C * rho]
//              int32 (i32), C and rho the plan's at the capacity; built from the keys and the
//              export's queries, which the model keeps on the device for it (wants_queries)
//   pariskv    codes [n_kv_heads, capacity, P / 2] bytes, then weights [n_kv_heads, capacity,
//              B] fp16, as bytes in the i32 array (ParisKvEncode over the bf16 keys, with the
//              codec of the CPU index for the model and params)
//
// Every build serialises to the bytes SerializeIndex writes for the CPU index in the same state
// (prebuilt.h, ctkvr.h), so a decode node cannot tell it from a CPU build.
//
// This header has no CUDA types: in a build without nvcc the target still exists and Create
// answers Unimplemented, so the prefill node links it unconditionally.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/model/config.h"
#include "kvr/model/cuda_model.h"
#include "kvr/retrieval/index.h"

namespace kvr::retrieval::cuda {

struct PrefillSummaryOptions {
  std::string method;  // quest, clusterkv, keydiff, a2ats, ctkvr or pariskv
  // The prefill's last queries the model keeps per layer (KvExportOptions::max_queries): ctkvr's
  // C is at most this many, as on the CPU path.
  int64_t max_queries = 512;
  // n_sink, budget, seed, quest.page_size, clusterkv.{n_clusters, max_iterations}, with the
  // clusterkv.* request options already applied (ApplyClusterKvOptions), as the CPU index's
  // factory applies them.
  IndexParams params;
  // Whether the builds leave the model's main stream; default: clusterkv (milliseconds of
  // k-means per layer) yes, quest and keydiff (tens of microseconds) no. On the side stream
  // quest's build waited for SMs behind the prefill's kernels and its export with it, so every
  // layer reached the prefill node's workers at the end (measured: +25% at 32K).
  std::optional<bool> side_stream;
};

// One sequence's builder (what model::CudaModel::AddSequence takes).
class PrefillSummaryBuilder : public model::CudaLayerBuilder {
 public:
  virtual std::string_view method() const = 0;
  // The bytes SerializeIndex writes for the CPU index in the state of one layer's build, from
  // the layer as a KV export handed it out (its build's arrays, and its keys for ctkvr, whose
  // index keeps a copy); `shape` is that layer's. InvalidArgument / Internal naming what does
  // not fit the layout.
  [[nodiscard]] virtual absl::StatusOr<std::vector<uint8_t>> Serialize(
      const IndexShape& shape, const model::KvExportLayer& layer) const = 0;
  // For tests: every layer's arrays copied back whole (synchronous; poisoned with NaN / -1
  // until a build writes them).
  struct Arrays {
    std::vector<float> f32;    // [n_layers, per-layer floats at the capacity]
    std::vector<int32_t> i32;  // [n_layers, per-layer ints]
  };
  [[nodiscard]] virtual absl::StatusOr<Arrays> CopyBackForTesting() const = 0;
};

// The builders of one model: owns the device scratch its builders share (a model runs the
// builds of a Forward one after another on one stream). Must outlive its builders' builds.
class PrefillSummaryBuilders {
 public:
  // Whether a request for `method` with `params` on a model of `config` gets a GPU build that
  // ships (Serialize): quest, clusterkv, keydiff, ctkvr; pariskv where the GPU encode takes its
  // codec (head_dim 64 or 128, head_dim / subspace_dim <= 32); a2ats when params carry the
  // codebooks (assets) and no a2ats.rerank (its summary keeps the keys). Otherwise the CPU
  // index builds it (and refuses what it must).
  static bool Ships(const model::ModelConfig& config, std::string_view method,
                    const IndexParams& params);
  // `config`: the model's. Unimplemented without CUDA.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PrefillSummaryBuilders>> Create(
      const model::ModelConfig& config, int device);
  virtual ~PrefillSummaryBuilders() = default;
  // A builder for a sequence of `capacity` tokens: reserves its outputs on the GPU.
  // InvalidArgument for a method without a builder or bad parameters (naming them);
  // ResourceExhausted when the GPU is full.
  [[nodiscard]] virtual absl::StatusOr<std::unique_ptr<PrefillSummaryBuilder>> ForSequence(
      const PrefillSummaryOptions& options, int64_t capacity) = 0;
};

}  // namespace kvr::retrieval::cuda
