// GPU retrieval summaries behind the model's per-layer build hook (prefill_summaries.h).

#include "kvr/retrieval/cuda/prefill_summaries.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/a2ats.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/ctkvr.h"
#include "kvr/retrieval/cuda/build.cuh"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/pariskv.h"
#include "kvr/retrieval/prebuilt.h"

namespace kvr::retrieval::cuda {
namespace {

using kvr::cuda::Alloc;
using kvr::cuda::AllocPinned;
using kvr::cuda::DeviceBuffer;
using kvr::cuda::PinnedBuffer;

enum class Method { kQuest, kClusterKv, kKeyDiff, kA2ats, kCtkvr, kParisKv };

std::optional<Method> Parse(std::string_view method) {
  if (method == "quest") return Method::kQuest;
  if (method == "clusterkv") return Method::kClusterKv;
  if (method == "keydiff") return Method::kKeyDiff;
  if (method == "a2ats") return Method::kA2ats;
  if (method == "ctkvr") return Method::kCtkvr;
  if (method == "pariskv") return Method::kParisKv;
  return std::nullopt;
}

// The node's a2ats codebooks on the device, every layer (the a2ats builders of one model share
// them; uploaded with the first a2ats sequence, again only for other codebooks).
struct A2atsDeviceBooks {
  uint64_t hash = 0;
  int size = 0;  // codewords per KV head, the same in every layer
  RopeParams rope;
  DeviceBuffer<float> chol;        // [n_layers, n_kv, d, d] L
  DeviceBuffer<float> codewords;   // [n_layers, n_kv, size, d] C^z
  DeviceBuffer<float> half_norms;  // [n_layers, n_kv, size]

  static absl::StatusOr<std::shared_ptr<A2atsDeviceBooks>> Upload(const model::ModelConfig& c,
                                                                  const A2atsCodebooks& books) {
    auto out = std::make_shared<A2atsDeviceBooks>();
    out->hash = books.content_hash();
    const int64_t nkv = c.n_kv_heads, d = c.head_dim;
    for (int l = 0; l < c.n_layers; ++l) {
      KVR_ASSIGN_OR_RETURN(const A2atsHostCodebooks h, A2atsLayerCodebooksFromHost(books, l));
      if (h.n_kv_heads != nkv || h.head_dim != d) {
        return absl::InvalidArgumentError(absl::StrCat("prefill summaries: a2ats codebooks of ",
                                                       h.n_kv_heads, " KV heads x ", h.head_dim,
                                                       ", the model has ", nkv, " x ", d));
      }
      if (l == 0) {
        out->size = h.size;
        out->rope = h.rope;
        KVR_RETURN_IF_ERROR(Alloc(out->chol, c.n_layers * nkv * d * d));
        KVR_RETURN_IF_ERROR(Alloc(out->codewords, c.n_layers * nkv * h.size * d));
        KVR_RETURN_IF_ERROR(Alloc(out->half_norms, c.n_layers * nkv * h.size));
      } else if (h.size != out->size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prefill summaries: a2ats codebooks of ", out->size, " codewords in layer 0 and ",
            h.size, " in layer ", l, " (the GPU build takes one size)"));
      }
      const int64_t size = out->size;
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpy(out->chol.data() + l * nkv * d * d, h.chol.data(),
                                          h.chol.size() * sizeof(float), cudaMemcpyHostToDevice));
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpy(out->codewords.data() + l * nkv * size * d,
                                          h.codewords.data(), h.codewords.size() * sizeof(float),
                                          cudaMemcpyHostToDevice));
      KVR_CUDA_RETURN_IF_ERROR(cudaMemcpy(out->half_norms.data() + l * nkv * size,
                                          h.half_norms.data(), h.half_norms.size() * sizeof(float),
                                          cudaMemcpyHostToDevice));
    }
    return out;
  }
};

// Scratch shared by the builders of one model (their builds never run at the same time).
struct Workspace {
  int device = 0;
  DeviceBuffer<uint8_t> bytes;
  // Grows to `n` bytes; only between Forwards (ForSequence), never while a build may run.
  absl::Status Reserve(size_t n) {
    if (n <= bytes.bytes()) return absl::OkStatus();
    bytes = DeviceBuffer<uint8_t>();
    return Alloc(bytes, static_cast<int64_t>(n));
  }
};

IndexShape ShapeOf(const model::ModelConfig& c, int layer) {
  IndexShape shape;
  shape.n_heads = c.n_heads;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  shape.n_layers = c.n_layers;
  shape.layer = layer;
  return shape;
}

// The codec of the pariskv index a CPU prefill would make for `config` and `params` (one rotation
// per model, shared by every layer); InvalidArgument when the GPU encode does not take it.
absl::StatusOr<ParisKvCodec> ParisKvCodecFor(const model::ModelConfig& config,
                                             const IndexParams& params) {
  KVR_ASSIGN_OR_RETURN(const std::unique_ptr<RetrievalIndex> index,
                       MakeParisKvIndex(ShapeOf(config, 0), params));
  KVR_ASSIGN_OR_RETURN(const ParisKvCodec codec, ParisKvCodecFromIndex(*index));
  KVR_RETURN_IF_ERROR(ParisKvCodecSupported(codec));
  return codec;
}

class Builder final : public PrefillSummaryBuilder {
 public:
  Builder(const model::ModelConfig& config, Method method, PrefillSummaryOptions options,
          int64_t capacity, std::shared_ptr<Workspace> ws,
          std::shared_ptr<const A2atsDeviceBooks> books)
      : c_(config),
        method_(method),
        opt_(std::move(options)),
        capacity_(capacity),
        ws_(std::move(ws)),
        books_(std::move(books)) {}

  // Sizes the outputs for the capacity and reserves them (and the shared scratch).
  absl::Status Init() {
    const int64_t nkv = c_.n_kv_heads, d = c_.head_dim, L = c_.n_layers;
    const IndexParams& p = opt_.params;
    size_t ws = 0;
    switch (method_) {
      case Method::kQuest:
        layer_f32_ = (capacity_ + p.quest.page_size - 1) / p.quest.page_size * nkv * 2 * d;
        break;
      case Method::kKeyDiff: {
        // [n_kv, capacity] scores, then [n_kv, head_dim] mean keys.
        layer_f32_ = nkv * capacity_ + nkv * d;
        ws = KeyDiffBuildWorkspaceBytes(KeyDiffParams(nullptr, 0, nullptr));
        break;
      }
      case Method::kClusterKv: {
        const int64_t cap = capacity_;
        KVR_ASSIGN_OR_RETURN(const ClusterKvBuildPlan plan,
                             MakeClusterKvBuildPlan(ShapeOf(c_, 0), p, std::span(&cap, 1)));
        max_clusters_ = plan.max_clusters;
        max_points_ = plan.max_points;
        layer_f32_ = nkv * max_clusters_ * d;
        layer_i32_ = nkv + nkv * (max_clusters_ + 1) + nkv * max_points_;
        plan_stride_ = 1 + 2 * nkv + nkv * max_clusters_;
        ws = ClusterKvBuildWorkspaceBytes(ClusterKvParams(0, nullptr));
        break;
      }
      case Method::kA2ats:
        // [n_kv, capacity] u16 codeword ids, two to an int32.
        layer_i32_ = (nkv * capacity_ + 1) / 2;
        ws = A2atsQuantiseWorkspaceBytes(A2atsParams(0, nullptr, capacity_));
        break;
      case Method::kCtkvr: {
        // The plan at the capacity bounds every length's: C = min(2048, L / 16, queries) and
        // rho (clipped to the listable keys) only grow with L.
        KVR_ASSIGN_OR_RETURN(ctkvr_params_, ApplyCtkvrOptions(p));
        const int64_t cap = capacity_, nq = std::max<int64_t>(1, opt_.max_queries);
        KVR_ASSIGN_OR_RETURN(const CtkvrBuildPlan plan,
                             MakeCtkvrBuildPlan(ShapeOf(c_, 0), ctkvr_params_, std::span(&cap, 1),
                                                std::span(&nq, 1)));
        max_centroids_ = plan.max_centroids;
        max_list_length_ = plan.max_list_length;
        max_listable_ = plan.max_listable;
        const int64_t group = c_.n_heads / c_.n_kv_heads, C = max_centroids_;
        // centroids [n_kv, C, group, d], norms [n_kv, C, group], thresholds [n_kv, C].
        layer_f32_ = nkv * C * group * d + nkv * C * group + nkv * C;
        // n_centroids [n_kv], list_offsets [n_kv, C + 1], lists [n_kv, C * rho].
        layer_i32_ = nkv + nkv * (C + 1) + nkv * C * max_list_length_;
        plan_stride_ = 5;  // the per-sequence plan rows (CtkvrBuildPlan::per_seq, batch 1)
        ws = CtkvrBuildWorkspaceBytes(CtkvrParams(0, nullptr, nullptr));
        break;
      }
      case Method::kParisKv: {
        // codes [n_kv, capacity, P / 2] bytes, then weights [n_kv, capacity, B] fp16, in int32s.
        KVR_ASSIGN_OR_RETURN(paris_codec_, ParisKvCodecFor(c_, p));
        const int64_t code_bytes = nkv * capacity_ * (paris_codec_.padded_dim / 2);
        const int64_t weight_bytes = nkv * capacity_ * ParisSubspaces() * 2;
        layer_i32_ = (code_bytes + weight_bytes + 3) / 4;
        break;
      }
    }
    KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(ws_->device));
    KVR_RETURN_IF_ERROR(Alloc(f32_, std::max<int64_t>(1, L * layer_f32_)));
    KVR_RETURN_IF_ERROR(Alloc(i32_, std::max<int64_t>(1, L * layer_i32_)));
    KVR_RETURN_IF_ERROR(Alloc(meta_, 1 + L * plan_stride_));
    KVR_RETURN_IF_ERROR(AllocPinned(h_meta_, 1 + L * plan_stride_));
    // Poisoned (NaN floats, -1 ints) until a build writes them.
    KVR_CUDA_RETURN_IF_ERROR(cudaMemset(f32_.data(), 0xFF, f32_.bytes()));
    KVR_CUDA_RETURN_IF_ERROR(cudaMemset(i32_.data(), 0xFF, i32_.bytes()));
    return ws_->Reserve(ws);
  }

  std::string_view method() const override {
    switch (method_) {
      case Method::kQuest:
        return "quest";
      case Method::kClusterKv:
        return "clusterkv";
      case Method::kKeyDiff:
        return "keydiff";
      case Method::kA2ats:
        return "a2ats";
      case Method::kCtkvr:
        return "ctkvr";
      case Method::kParisKv:
        return "pariskv";
    }
    return "";
  }

  bool wants_queries() const override { return method_ == Method::kCtkvr; }

  bool side_stream() const override {
    return opt_.side_stream.value_or(method_ == Method::kClusterKv || method_ == Method::kCtkvr);
  }

  // The built length (and clusterkv's per-layer host plans) into the metadata, uploaded on the
  // model's stream ahead of the layers.
  absl::Status Prepare(int64_t length, void* stream) override {
    if (length < 1 || length > capacity_) {
      return absl::InvalidArgumentError(absl::StrCat("prefill summaries: build over ", length,
                                                     " tokens, capacity ", capacity_));
    }
    int32_t* h = h_meta_.data();
    h[0] = static_cast<int32_t>(length);
    if (method_ == Method::kClusterKv) {
      const int nkv = c_.n_kv_heads, K = max_clusters_;
      for (int l = 0; l < c_.n_layers; ++l) {
        KVR_ASSIGN_OR_RETURN(
            const ClusterKvBuildPlan plan,
            MakeClusterKvBuildPlan(ShapeOf(c_, l), opt_.params, std::span(&length, 1)));
        if (plan.max_clusters > K || plan.max_points > max_points_) {
          return absl::InternalError("prefill summaries: plan larger than at the capacity");
        }
        int32_t* m = h + 1 + l * plan_stride_;
        m[0] = plan.first_token[0];
        std::copy(plan.n_points.begin(), plan.n_points.end(), m + 1);
        std::copy(plan.n_init.begin(), plan.n_init.end(), m + 1 + nkv);
        int32_t* init = m + 1 + 2 * nkv;
        std::fill(init, init + int64_t{nkv} * K, -1);
        for (int r = 0; r < nkv; ++r) {
          std::copy_n(plan.init_points.begin() + int64_t{r} * plan.max_clusters,
                      plan.max_clusters, init + int64_t{r} * K);
        }
      }
    }
    KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(meta_.data(), h,
                                             (1 + c_.n_layers * plan_stride_) * sizeof(int32_t),
                                             cudaMemcpyHostToDevice,
                                             static_cast<cudaStream_t>(stream)));
    return absl::OkStatus();
  }

  absl::Status Build(const model::CudaLayerKeys& k, void* stream_ptr) override {
    const auto stream = static_cast<cudaStream_t>(stream_ptr);
    KeyView keys;
    keys.data = k.keys;
    keys.dtype = KeyDType::kBf16;
    keys.token_stride = k.token_stride;
    keys.head_stride = c_.head_dim;
    keys.batch_stride = 0;
    float* f32 = f32_.data() + k.layer * layer_f32_;
    switch (method_) {
      case Method::kQuest: {
        QuestBoundsParams p;
        p.batch = 1;
        p.n_kv_heads = c_.n_kv_heads;
        p.head_dim = c_.head_dim;
        p.page_size = opt_.params.quest.page_size;
        p.keys = keys;
        p.seq_len = meta_.data();
        p.max_tokens = static_cast<int>(k.length);
        p.bounds = f32;
        p.bounds_batch_stride = layer_f32_;
        return QuestPageBounds(p, stream);
      }
      case Method::kKeyDiff: {
        KeyDiffBuildParams p = KeyDiffParams(&keys, k.length, f32);
        p.means = f32 + int64_t{c_.n_kv_heads} * capacity_;
        return KeyDiffBuild(p, stream);
      }
      case Method::kClusterKv: {
        ClusterKvBuildParams p = ClusterKvParams(k.layer, &keys);
        return ClusterKvBuild(p, stream);
      }
      case Method::kA2ats:
        return A2atsQuantise(A2atsParams(k.layer, &keys, k.length), stream);
      case Method::kCtkvr: {
        if (k.queries == nullptr || k.n_queries < 1) {
          return absl::FailedPreconditionError(
              "prefill summaries: ctkvr's build needs the prefill's queries (an export with "
              "max_queries > 0)");
        }
        if (k.layer == 0 || ctkvr_plan_.per_seq.empty()) {
          // The plan for this length and the queries there are (the same for every layer),
          // uploaded on the build stream ahead of the layers' builds.
          const int64_t len = k.length, nq = k.n_queries;
          KVR_ASSIGN_OR_RETURN(ctkvr_plan_,
                               MakeCtkvrBuildPlan(ShapeOf(c_, 0), ctkvr_params_, std::span(&len, 1),
                                                  std::span(&nq, 1)));
          if (ctkvr_plan_.max_centroids > max_centroids_ ||
              ctkvr_plan_.max_list_length > max_list_length_ ||
              ctkvr_plan_.max_listable > max_listable_) {
            return absl::InternalError("prefill summaries: ctkvr plan larger than at the capacity");
          }
          std::copy(ctkvr_plan_.per_seq.begin(), ctkvr_plan_.per_seq.end(), h_meta_.data() + 1);
          KVR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(meta_.data() + 1, h_meta_.data() + 1,
                                                   5 * sizeof(int32_t), cudaMemcpyHostToDevice,
                                                   stream));
        }
        KeyView queries;
        queries.data = k.queries;
        queries.dtype = KeyDType::kF32;
        queries.token_stride = int64_t{c_.n_heads} * c_.head_dim;
        queries.head_stride = c_.head_dim;
        return CtkvrBuild(CtkvrParams(k.layer, &keys, &queries), stream);
      }
      case Method::kParisKv: {
        ParisKvEncodeParams p;
        p.n_tokens = static_cast<int>(k.length);
        p.n_kv_heads = c_.n_kv_heads;
        p.codec = paris_codec_;
        p.keys = keys;  // the layer's bf16 cache, as every builder reads it
        p.first = 0;
        auto* bytes = reinterpret_cast<uint8_t*>(i32_.data() + k.layer * layer_i32_);
        p.codes = bytes;
        p.codes_head_stride = capacity_ * (paris_codec_.padded_dim / 2);
        p.weights = reinterpret_cast<uint16_t*>(bytes + ParisWeightsOffset());
        p.weights_head_stride = capacity_ * ParisSubspaces();
        return ParisKvEncode(p, stream);
      }
    }
    return absl::OkStatus();
  }

  model::CudaLayerOutput Output(int layer, int64_t length) const override {
    model::CudaLayerOutput out;
    out.f32 = f32_.data() + layer * layer_f32_;
    out.n_f32 = layer_f32_;
    if (method_ == Method::kQuest) {
      // Only the pages of `length` tokens.
      out.n_f32 = (std::min(length, capacity_) + opt_.params.quest.page_size - 1) /
                  opt_.params.quest.page_size * int64_t{c_.n_kv_heads} * 2 * c_.head_dim;
    }
    if (layer_i32_ > 0) {
      out.i32 = i32_.data() + layer * layer_i32_;
      out.n_i32 = layer_i32_;
    }
    return out;
  }

  absl::StatusOr<std::vector<uint8_t>> Serialize(const IndexShape& shape,
                                                 const model::KvExportLayer& layer) const override {
    const model::CudaBuiltLayer& s = layer.built;
    if (s.length < 1 || s.length > capacity_) {
      return absl::InternalError(absl::StrCat("prefill summaries: an export over ", s.length,
                                              " tokens, capacity ", capacity_));
    }
    switch (method_) {
      case Method::kQuest:
        return SerializePrebuiltQuest(shape, opt_.params, s.length,
                                      {s.f32, static_cast<size_t>(s.n_f32)});
      case Method::kClusterKv: {
        const int nkv = shape.n_kv_heads, hd = shape.head_dim, K = max_clusters_;
        const int64_t need = nkv + int64_t{nkv} * (K + 1) + int64_t{nkv} * max_points_;
        if (s.n_i32 < need || s.n_f32 < int64_t{nkv} * K * hd) {
          return absl::InternalError("clusterkv summary smaller than its layout");
        }
        const int32_t* n_clusters = s.i32;
        const int32_t* offsets = s.i32 + nkv;
        const int32_t* members = offsets + int64_t{nkv} * (K + 1);
        std::vector<PrebuiltClusterKvHead> heads(nkv);
        for (int h = 0; h < nkv; ++h) {
          const int64_t nc = n_clusters[h];
          if (nc < 0 || nc > K) {
            return absl::InternalError(
                absl::StrCat("clusterkv head ", h, ": ", nc, " clusters, at most ", K));
          }
          const int32_t* off = offsets + int64_t{h} * (K + 1);
          const int64_t n_members = off[nc];
          if (n_members < 0 || n_members > max_points_) {
            return absl::InternalError(absl::StrCat("clusterkv head ", h, ": ", n_members,
                                                    " members, at most ", max_points_));
          }
          heads[h].centroids = {s.f32 + int64_t{h} * K * hd, static_cast<size_t>(nc * hd)};
          heads[h].offsets = {off, static_cast<size_t>(nc + 1)};
          heads[h].ids = {members + int64_t{h} * max_points_, static_cast<size_t>(n_members)};
        }
        return SerializePrebuiltClusterKv(shape, opt_.params, s.length, heads);
      }
      case Method::kKeyDiff: {
        const int nkv = shape.n_kv_heads, hd = shape.head_dim;
        if (s.n_f32 < int64_t{nkv} * (capacity_ + hd)) {
          return absl::InternalError("keydiff summary smaller than its layout");
        }
        std::vector<PrebuiltKeyDiffHead> heads(nkv);
        for (int h = 0; h < nkv; ++h) {
          heads[h].scores = {s.f32 + int64_t{h} * capacity_, static_cast<size_t>(s.length)};
          heads[h].mean = {s.f32 + int64_t{nkv} * capacity_ + int64_t{h} * hd,
                           static_cast<size_t>(hd)};
        }
        return SerializePrebuiltKeyDiff(shape, opt_.params, s.length, heads);
      }
      case Method::kA2ats: {
        const int nkv = shape.n_kv_heads;
        if (s.n_i32 < layer_i32_)
          return absl::InternalError("a2ats summary smaller than its layout");
        const auto* ids = reinterpret_cast<const uint16_t*>(s.i32);
        std::vector<std::span<const uint16_t>> heads(nkv);
        for (int h = 0; h < nkv; ++h) {
          heads[h] = {ids + int64_t{h} * capacity_, static_cast<size_t>(s.length)};
        }
        return SerializePrebuiltA2ats(shape, opt_.params, s.length, heads);
      }
      case Method::kCtkvr:
        return SerializeCtkvr(shape, layer);
      case Method::kParisKv: {
        if (s.n_i32 < layer_i32_) {
          return absl::InternalError("pariskv summary smaller than its layout");
        }
        const auto* bytes = reinterpret_cast<const uint8_t*>(s.i32);
        const auto* weights = reinterpret_cast<const uint16_t*>(bytes + ParisWeightsOffset());
        const int64_t code_row = paris_codec_.padded_dim / 2, n_sub = ParisSubspaces();
        std::vector<PrebuiltParisKvHead> heads(shape.n_kv_heads);
        for (int h = 0; h < shape.n_kv_heads; ++h) {
          heads[h].codes = {bytes + h * capacity_ * code_row,
                            static_cast<size_t>(s.length * code_row)};
          heads[h].weights = {weights + h * capacity_ * n_sub,
                              static_cast<size_t>(s.length * n_sub)};
        }
        return SerializePrebuiltParisKv(shape, opt_.params, s.length, heads);
      }
    }
    return absl::UnimplementedError(
        absl::StrCat("prefill summaries: ", std::string(method()), " builds are not shipped"));
  }

  absl::StatusOr<Arrays> CopyBackForTesting() const override {
    Arrays a;
    a.f32.resize(f32_.size());
    a.i32.resize(i32_.size());
    KVR_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(a.f32.data(), f32_.data(), f32_.bytes(), cudaMemcpyDeviceToHost));
    KVR_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(a.i32.data(), i32_.data(), i32_.bytes(), cudaMemcpyDeviceToHost));
    return a;
  }

 private:
  // pariskv: B, and where the weights start in a layer's bytes (after every head's codes).
  int64_t ParisSubspaces() const { return paris_codec_.padded_dim / paris_codec_.subspace_dim; }
  int64_t ParisWeightsOffset() const {
    return int64_t{c_.n_kv_heads} * capacity_ * (paris_codec_.padded_dim / 2);
  }

  // CTKVR's launch parameters for `layer` (keys null: for the workspace size only).
  CtkvrBuildParams CtkvrParams(int layer, const KeyView* keys, const KeyView* queries) const {
    const int64_t nkv = c_.n_kv_heads, C = max_centroids_, group = c_.n_heads / c_.n_kv_heads;
    CtkvrBuildParams p;
    p.batch = 1;
    p.n_heads = c_.n_heads;
    p.n_kv_heads = c_.n_kv_heads;
    p.head_dim = c_.head_dim;
    p.scale = 1.f / std::sqrt(static_cast<float>(c_.head_dim));
    p.max_centroids = max_centroids_;
    p.max_list_length = max_list_length_;
    p.max_listable = max_listable_;
    if (keys != nullptr) {
      float* f32 = f32_.data() + layer * layer_f32_;
      int32_t* i32 = i32_.data() + layer * layer_i32_;
      p.keys = *keys;
      p.queries = *queries;
      p.per_seq = meta_.data() + 1;
      p.centroids = f32;
      p.norms = f32 + nkv * C * group * c_.head_dim;
      p.thresholds = p.norms + nkv * C * group;
      p.n_centroids = i32;
      p.list_offsets = i32 + nkv;
      p.lists = i32 + nkv + nkv * (C + 1);
      p.workspace = ws_->bytes.data();
      p.workspace_bytes = ws_->bytes.bytes();
    }
    return p;
  }

  // The CPU index's bytes from a layer's ctkvr build and the layer's keys (the index keeps a
  // copy of them for its rerank).
  absl::StatusOr<std::vector<uint8_t>> SerializeCtkvr(const IndexShape& shape,
                                                      const model::KvExportLayer& layer) const {
    const model::CudaBuiltLayer& s = layer.built;
    const int64_t nkv = shape.n_kv_heads, d = shape.head_dim, group = shape.group_size();
    const int64_t C = max_centroids_, L = s.length, row = nkv * d;
    if (s.n_f32 < layer_f32_ || s.n_i32 < layer_i32_ || ctkvr_plan_.per_seq.size() != 5) {
      return absl::InternalError("ctkvr summary smaller than its layout");
    }
    std::vector<float> keys(static_cast<size_t>(L * row));
    for (int64_t t = 0; t < L; ++t) {
      if (layer.k_bf16 != nullptr) {
        Bf16BytesToFloats(layer.k_bf16 + t * row, static_cast<size_t>(row), keys.data() + t * row);
      } else if (layer.kv.k != nullptr) {
        std::copy_n(layer.kv.k + t * layer.kv.row_stride, row, keys.data() + t * row);
      } else {
        return absl::InternalError("ctkvr summary: the export holds no keys");
      }
    }
    const std::vector<int32_t>& ps = ctkvr_plan_.per_seq;  // [5, 1]
    CtkvrState st;
    st.gqa = ctkvr_params_.gqa;
    st.n_sink = ps[0];
    const int64_t listable = ps[1];
    st.n_centroids = ps[2];
    st.rho = std::max<int32_t>(1, ps[3]);
    st.n_recall = ctkvr_plan_.n_recall;
    st.fifo_size = std::min<int64_t>(ctkvr_params_.ctkvr.fifo_size, st.n_centroids);
    st.keys = keys;
    if (listable <= 0) {
      // The CPU index's rho then is clipped to 1 and its entries are empty.
      st.rho = 1;
    }
    const float* cent = s.f32;
    const float* norms = cent + nkv * C * group * d;
    const float* thr = norms + nkv * C * group;
    const int32_t* offsets = s.i32 + nkv;
    const int32_t* lists = offsets + nkv * (C + 1);
    st.heads.resize(nkv);
    for (int64_t h = 0; h < nkv; ++h) {
      for (int64_t i = 0; i < st.n_centroids; ++i) {
        CtkvrState::Entry& e = st.heads[h].emplace_back();
        if (listable <= 0) continue;  // Entry{}: no centroid, no list, threshold 0
        const int64_t at = h * C + i;
        const int32_t* off = offsets + h * (C + 1);
        e.centroid = {cent + at * group * d, static_cast<size_t>(group * d)};
        e.norms = {norms + at * group, static_cast<size_t>(group)};
        e.list = {lists + h * C * max_list_length_ + off[i],
                  static_cast<size_t>(off[i + 1] - off[i])};
        e.threshold = thr[at];
      }
    }
    return SerializePrebuiltCtkvr(shape, opt_.params, L, st);
  }

  // KeyDiff's launch parameters (keys null: for the workspace size only).
  KeyDiffBuildParams KeyDiffParams(const KeyView* keys, int64_t length, float* scores) const {
    KeyDiffBuildParams p;
    p.batch = 1;
    p.n_kv_heads = c_.n_kv_heads;
    p.head_dim = c_.head_dim;
    p.max_tokens = static_cast<int>(keys != nullptr ? length : capacity_);
    p.score_stride = capacity_;
    if (keys != nullptr) {
      p.keys = *keys;
      p.seq_len = meta_.data();
      p.scores = scores;
      p.workspace = ws_->bytes.data();
      p.workspace_bytes = ws_->bytes.bytes();
    }
    return p;
  }

  // A2ATS's launch parameters for `layer` over `length` tokens (keys null: for the workspace
  // size only).
  A2atsQuantiseParams A2atsParams(int layer, const KeyView* keys, int64_t length) const {
    const int64_t nkv = c_.n_kv_heads, d = c_.head_dim;
    A2atsQuantiseParams p;
    p.batch = 1;
    p.n_kv_heads = c_.n_kv_heads;
    p.head_dim = c_.head_dim;
    p.max_tokens = static_cast<int>(length);
    p.rope = books_->rope;
    p.codebook_size = books_->size;
    p.id_stride = capacity_;
    if (keys != nullptr) {
      p.keys = *keys;
      p.seq_len = meta_.data();
      p.chol = books_->chol.data() + layer * nkv * d * d;
      p.codewords = books_->codewords.data() + layer * nkv * books_->size * d;
      p.half_norms = books_->half_norms.data() + layer * nkv * books_->size;
      p.ids = reinterpret_cast<uint16_t*>(i32_.data() + layer * layer_i32_);
      p.workspace = ws_->bytes.data();
      p.workspace_bytes = ws_->bytes.bytes();
    }
    return p;
  }

  // ClusterKV's launch parameters for `layer` (keys null: for the workspace size only).
  ClusterKvBuildParams ClusterKvParams(int layer, const KeyView* keys) const {
    const int nkv = c_.n_kv_heads, K = max_clusters_;
    ClusterKvBuildParams p;
    p.batch = 1;
    p.n_kv_heads = nkv;
    p.head_dim = c_.head_dim;
    p.max_points = max_points_;
    p.max_clusters = K;
    p.max_iterations = opt_.params.clusterkv.max_iterations;
    if (keys != nullptr) {
      const int32_t* m = meta_.data() + 1 + layer * plan_stride_;
      int32_t* i32 = i32_.data() + layer * layer_i32_;
      p.keys = *keys;
      p.first_token = m;
      p.n_points = m + 1;
      p.n_init = m + 1 + nkv;
      p.init_points = m + 1 + 2 * nkv;
      p.centroids = f32_.data() + layer * layer_f32_;
      p.n_clusters = i32;
      p.offsets = i32 + nkv;
      p.members = i32 + nkv + int64_t{nkv} * (K + 1);
      p.workspace = ws_->bytes.data();
      p.workspace_bytes = ws_->bytes.bytes();
    }
    return p;
  }

  model::ModelConfig c_;
  Method method_;
  PrefillSummaryOptions opt_;
  int64_t capacity_;
  std::shared_ptr<Workspace> ws_;
  std::shared_ptr<const A2atsDeviceBooks> books_;  // a2ats only
  int max_clusters_ = 1, max_points_ = 1;  // clusterkv: the plan's at the capacity
  // ctkvr: its options applied, the plan's sizes at the capacity (the layout's strides) and the
  // plan of the build (made with the first layer's build, read by Serialize afterwards).
  IndexParams ctkvr_params_;
  int max_centroids_ = 1, max_list_length_ = 1, max_listable_ = 1;
  CtkvrBuildPlan ctkvr_plan_;
  ParisKvCodec paris_codec_;               // pariskv: the CPU index's for the model and params
  int64_t layer_f32_ = 0, layer_i32_ = 0;  // per-layer sizes of f32_ / i32_
  DeviceBuffer<float> f32_;
  DeviceBuffer<int32_t> i32_;
  // Build metadata: [0] the length built over; clusterkv: then per layer, plan_stride_ ints:
  // first_token [1], n_points [n_kv], n_init [n_kv], init_points [n_kv, max_clusters].
  int64_t plan_stride_ = 0;
  PinnedBuffer<int32_t> h_meta_;
  DeviceBuffer<int32_t> meta_;
};

class Builders final : public PrefillSummaryBuilders {
 public:
  Builders(const model::ModelConfig& config, int device)
      : c_(config), ws_(std::make_shared<Workspace>()) {
    ws_->device = device;
  }

  absl::StatusOr<std::unique_ptr<PrefillSummaryBuilder>> ForSequence(
      const PrefillSummaryOptions& o, int64_t capacity) override {
    const std::optional<Method> method = Parse(o.method);
    if (!method) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefill summaries: no GPU builder for method '", o.method,
                       "' (quest, clusterkv, keydiff, a2ats, ctkvr, pariskv)"));
    }
    const IndexParams& p = o.params;
    if (capacity < 1 || p.n_sink < 0 || p.budget < 1 || p.quest.page_size < 1 ||
        p.clusterkv.n_clusters < 0 || p.clusterkv.max_iterations < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefill summaries: capacity ", capacity, ", n_sink ", p.n_sink, ", budget ", p.budget,
          ", quest.page_size ", p.quest.page_size, ", clusterkv n_clusters ",
          p.clusterkv.n_clusters, " / max_iterations ", p.clusterkv.max_iterations));
    }
    std::shared_ptr<const A2atsDeviceBooks> books;
    if (*method == Method::kA2ats) {
      KVR_ASSIGN_OR_RETURN(books, A2atsBooks(p));
    }
    auto b = std::make_unique<Builder>(c_, *method, o, capacity, ws_, std::move(books));
    KVR_RETURN_IF_ERROR(b->Init());
    return b;
  }

 private:
  // params.assets' codebooks on the device (uploaded when they are not the ones already there).
  absl::StatusOr<std::shared_ptr<const A2atsDeviceBooks>> A2atsBooks(const IndexParams& p) {
    const auto* books = dynamic_cast<const A2atsCodebooks*>(p.assets.get());
    if (books == nullptr) {
      return absl::FailedPreconditionError(
          "prefill summaries: a2ats needs the node's codebooks (IndexParams::assets)");
    }
    KVR_ASSIGN_OR_RETURN(const int rerank, A2atsRerank(p));
    if (rerank > 0) {
      return absl::InvalidArgumentError(
          "prefill summaries: a2ats.rerank keeps the keys in the summary: built on the CPU");
    }
    if (a2ats_ == nullptr || a2ats_->hash != books->content_hash()) {
      KVR_CUDA_RETURN_IF_ERROR(cudaSetDevice(ws_->device));
      KVR_ASSIGN_OR_RETURN(a2ats_, A2atsDeviceBooks::Upload(c_, *books));
    }
    return std::shared_ptr<const A2atsDeviceBooks>(a2ats_);
  }

  model::ModelConfig c_;
  std::shared_ptr<Workspace> ws_;
  std::shared_ptr<A2atsDeviceBooks> a2ats_;
};

}  // namespace

bool PrefillSummaryBuilders::Ships(const model::ModelConfig& config, std::string_view method,
                                   const IndexParams& params) {
  if (method == "pariskv") return ParisKvCodecFor(config, params).ok();
  if (method == "a2ats") {
    const absl::StatusOr<int> rerank = A2atsRerank(params);
    return params.assets != nullptr && rerank.ok() && *rerank == 0;
  }
  return method == "quest" || method == "clusterkv" || method == "keydiff" || method == "ctkvr";
}

absl::StatusOr<std::unique_ptr<PrefillSummaryBuilders>> PrefillSummaryBuilders::Create(
    const model::ModelConfig& config, int device) {
  KVR_RETURN_IF_ERROR(config.Validate());
  return std::make_unique<Builders>(config, device);
}

}  // namespace kvr::retrieval::cuda
