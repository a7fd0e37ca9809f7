#include "kvr/model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/gguf.h"
#include "kvr/model/safetensors.h"

namespace kvr::model {

int64_t ModelWeights::allocated_bytes() const {
  auto bytes = [](const std::vector<float>& v) { return static_cast<int64_t>(v.size() * 4); };
  auto packed = [](const PackedMatrix& m) { return static_cast<int64_t>(m.bytes.size()); };
  int64_t total = bytes(token_embd) + bytes(output_norm) + bytes(output) +
                  packed(packed_token_embd) + packed(packed_output);
  for (const LayerWeights& l : layers) {
    total += bytes(l.attn_norm) + bytes(l.wqkv) + bytes(l.bqkv) + bytes(l.wo) + bytes(l.ffn_norm) +
             bytes(l.w_gate_up) + bytes(l.w_down) + packed(l.packed_wqkv) + packed(l.packed_wo) +
             packed(l.packed_w_gate_up) + packed(l.packed_w_down);
  }
  return total;
}

absl::Status ModelWeights::CheckShapes(const ModelConfig& c) const {
  auto check = [](const std::vector<float>& v, int64_t expected, absl::string_view what) {
    if (static_cast<int64_t>(v.size()) != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights: ", what, " has ", v.size(), " floats, expected ", expected));
    }
    return absl::OkStatus();
  };
  // A packed matrix must have the shape; a float vector must then be empty, and vice versa.
  auto check_matrix = [&](const std::vector<float>& v, const PackedMatrix& m, int64_t rows,
                          int64_t cols, const std::string& what) -> absl::Status {
    if (!packed()) {
      if (!m.empty()) return absl::InvalidArgumentError(absl::StrCat("weights: ", what, " is packed in float32 weights"));
      return check(v, rows * cols, what);
    }
    KVR_RETURN_IF_ERROR(check(v, 0, what));
    if (m.rows != rows || m.cols != cols) {
      return absl::InvalidArgumentError(absl::StrCat("weights: packed ", what, " is [", m.rows,
                                                     ", ", m.cols, "], expected [", rows, ", ",
                                                     cols, "]"));
    }
    return absl::OkStatus();
  };
  const int64_t h = c.hidden, qkv = c.q_dim() + 2 * c.kv_dim();
  KVR_RETURN_IF_ERROR(check_matrix(token_embd, packed_token_embd, c.vocab, h, "token_embd"));
  KVR_RETURN_IF_ERROR(check(output_norm, h, "output_norm"));
  if (c.tied_embeddings) {
    KVR_RETURN_IF_ERROR(check(output, 0, "output"));
    if (!packed_output.empty()) return absl::InvalidArgumentError("weights: packed output with tied embeddings");
  } else {
    KVR_RETURN_IF_ERROR(check_matrix(output, packed_output, c.vocab, h, "output"));
  }
  if (static_cast<int>(layers.size()) != c.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights: ", layers.size(), " layers, config has ", c.n_layers));
  }
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerWeights& l = layers[i];
    const std::string p = absl::StrCat("layer ", i, " ");
    KVR_RETURN_IF_ERROR(check(l.attn_norm, h, p + "attn_norm"));
    KVR_RETURN_IF_ERROR(check_matrix(l.wqkv, l.packed_wqkv, qkv, h, p + "wqkv"));
    KVR_RETURN_IF_ERROR(check(l.bqkv, c.qkv_bias ? qkv : 0, p + "bqkv"));
    KVR_RETURN_IF_ERROR(check_matrix(l.wo, l.packed_wo, h, c.q_dim(), p + "wo"));
    KVR_RETURN_IF_ERROR(check(l.ffn_norm, h, p + "ffn_norm"));
    KVR_RETURN_IF_ERROR(
        check_matrix(l.w_gate_up, l.packed_w_gate_up, 2 * int64_t{c.ffn}, h, p + "w_gate_up"));
    KVR_RETURN_IF_ERROR(check_matrix(l.w_down, l.packed_w_down, h, c.ffn, p + "w_down"));
  }
  return absl::OkStatus();
}

void UnpermuteRopeRows(float* w, int n_head, int head_dim, int64_t in) {
  UnpermuteRopeRowBytes(reinterpret_cast<uint8_t*>(w), n_head, head_dim,
                        in * static_cast<int64_t>(sizeof(float)));
}

void UnpermuteRopeRowBytes(uint8_t* w, int n_head, int head_dim, int64_t row_bytes) {
  // GGUF row h*d + 2i + j came from HF row h*d + j*d/2 + i.
  const int half = head_dim / 2;
  std::vector<uint8_t> head(static_cast<size_t>(head_dim * row_bytes));
  for (int h = 0; h < n_head; ++h) {
    uint8_t* base = w + int64_t{h} * head_dim * row_bytes;
    std::memcpy(head.data(), base, head.size());
    for (int i = 0; i < half; ++i) {
      for (int j = 0; j < 2; ++j) {
        std::memcpy(base + (int64_t{j} * half + i) * row_bytes, head.data() + (2 * i + j) * row_bytes,
                    static_cast<size_t>(row_bytes));
      }
    }
  }
}

namespace {

// A source of named float32 tensors with PyTorch shapes.
using TensorReader = std::function<absl::Status(
    const std::string& name, std::span<const int64_t> shape, std::span<float> out)>;

struct TensorNames {
  std::string embd, out_norm, output;
  std::function<std::string(int, absl::string_view)> layer;  // (layer, role) -> name
};

// A checkpoint format's tensor name suffix of each per-layer role of LoadAll.
using LayerRoleNames = std::pair<absl::string_view, absl::string_view>[12];

// (layer, role) -> "<prefix><layer>.<the role's suffix in `roles`>" (the role itself when
// `roles` lacks it). `roles` must outlive the function.
std::function<std::string(int, absl::string_view)> LayerNames(absl::string_view prefix,
                                                              const LayerRoleNames& roles) {
  return [prefix, &roles](int i, absl::string_view role) {
    for (const auto& [r, suffix] : roles) {
      if (r == role) return absl::StrCat(prefix, i, ".", suffix);
    }
    return absl::StrCat(prefix, i, ".", role);
  };
}

// Layer `layer`'s fused Q/K/V bias [q + 2 kv] into l.bqkv when the architecture has one.
absl::Status ReadQkvBias(const ModelConfig& c, const TensorNames& names, int layer,
                         const TensorReader& read, bool unpermute_qk, LayerWeights& l) {
  if (!c.qkv_bias) return absl::OkStatus();
  const int64_t q = c.q_dim(), kv = c.kv_dim();
  auto span_of = [&l](int64_t offset, int64_t count) {
    return std::span<float>(l.bqkv.data() + offset, static_cast<size_t>(count));
  };
  l.bqkv.resize(static_cast<size_t>(q + 2 * kv));
  KVR_RETURN_IF_ERROR(read(names.layer(layer, "bq"), std::vector<int64_t>{q}, span_of(0, q)));
  KVR_RETURN_IF_ERROR(read(names.layer(layer, "bk"), std::vector<int64_t>{kv}, span_of(q, kv)));
  KVR_RETURN_IF_ERROR(
      read(names.layer(layer, "bv"), std::vector<int64_t>{kv}, span_of(q + kv, kv)));
  if (unpermute_qk) {
    UnpermuteRopeRows(l.bqkv.data(), c.n_heads, c.head_dim, 1);
    UnpermuteRopeRows(l.bqkv.data() + q, c.n_kv_heads, c.head_dim, 1);
  }
  return absl::OkStatus();
}

// Reads every tensor through `read` into the fused layout. `unpermute_qk`: undo llama.cpp's
// Q/K row permutation.
absl::StatusOr<ModelWeights> LoadAll(const ModelConfig& c, const TensorNames& names,
                                     const TensorReader& read, bool unpermute_qk) {
  ModelWeights w;
  const int64_t h = c.hidden, q = c.q_dim(), kv = c.kv_dim(), f = c.ffn;
  w.token_embd.resize(static_cast<size_t>(c.vocab * h));
  KVR_RETURN_IF_ERROR(read(names.embd, std::vector<int64_t>{c.vocab, h}, w.token_embd));
  w.output_norm.resize(h);
  KVR_RETURN_IF_ERROR(read(names.out_norm, std::vector<int64_t>{h}, w.output_norm));
  if (!c.tied_embeddings) {
    w.output.resize(static_cast<size_t>(c.vocab * h));
    KVR_RETURN_IF_ERROR(read(names.output, std::vector<int64_t>{c.vocab, h}, w.output));
  }
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    auto n = [&](absl::string_view role) { return names.layer(i, role); };
    auto span_of = [](std::vector<float>& v, int64_t offset, int64_t count) {
      return std::span<float>(v.data() + offset, static_cast<size_t>(count));
    };
    l.attn_norm.resize(h);
    KVR_RETURN_IF_ERROR(read(n("attn_norm"), std::vector<int64_t>{h}, l.attn_norm));
    l.wqkv.resize(static_cast<size_t>((q + 2 * kv) * h));
    KVR_RETURN_IF_ERROR(read(n("wq"), std::vector<int64_t>{q, h}, span_of(l.wqkv, 0, q * h)));
    KVR_RETURN_IF_ERROR(read(n("wk"), std::vector<int64_t>{kv, h}, span_of(l.wqkv, q * h, kv * h)));
    KVR_RETURN_IF_ERROR(
        read(n("wv"), std::vector<int64_t>{kv, h}, span_of(l.wqkv, (q + kv) * h, kv * h)));
    if (unpermute_qk) {
      UnpermuteRopeRows(l.wqkv.data(), c.n_heads, c.head_dim, h);
      UnpermuteRopeRows(l.wqkv.data() + q * h, c.n_kv_heads, c.head_dim, h);
    }
    KVR_RETURN_IF_ERROR(ReadQkvBias(c, names, i, read, unpermute_qk, l));
    l.wo.resize(static_cast<size_t>(h * q));
    KVR_RETURN_IF_ERROR(read(n("wo"), std::vector<int64_t>{h, q}, l.wo));
    l.ffn_norm.resize(h);
    KVR_RETURN_IF_ERROR(read(n("ffn_norm"), std::vector<int64_t>{h}, l.ffn_norm));
    l.w_gate_up.resize(static_cast<size_t>(2 * f * h));
    KVR_RETURN_IF_ERROR(
        read(n("w_gate"), std::vector<int64_t>{f, h}, span_of(l.w_gate_up, 0, f * h)));
    KVR_RETURN_IF_ERROR(
        read(n("w_up"), std::vector<int64_t>{f, h}, span_of(l.w_gate_up, f * h, f * h)));
    l.w_down.resize(static_cast<size_t>(h * f));
    KVR_RETURN_IF_ERROR(read(n("w_down"), std::vector<int64_t>{h, f}, l.w_down));
  }
  KVR_RETURN_IF_ERROR(w.CheckShapes(c));
  return w;
}

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// One part of a fused packed matrix: a GGUF tensor of `rows` rows, RoPE-permuted with
// `rope_heads` heads when that is > 0.
struct PackedPart {
  std::string name;
  int64_t rows = 0;
  int rope_heads = 0;
};

// Reads `parts` (each [rows, cols]) into one packed matrix: their bytes as stored when they
// share a type the kernels take, otherwise dequantised and requantised to Q8_0.
absl::StatusOr<PackedMatrix> ReadPacked(const GgufFile& file, const std::vector<PackedPart>& parts,
                                        int64_t cols, int head_dim, const TensorReader& read) {
  int64_t rows = 0;
  bool same_type = true;
  GgmlType type = GgmlType::kF32;
  for (size_t i = 0; i < parts.size(); ++i) {
    KVR_ASSIGN_OR_RETURN(const GgufTensorInfo* info, file.FindTensor(parts[i].name));
    if (i == 0) type = info->type;
    same_type = same_type && info->type == type;
    rows += parts[i].rows;
  }
  const bool direct = same_type && (IsBlockKernelType(type) || IsFloatKernelType(type));
  if (direct) {
    KVR_ASSIGN_OR_RETURN(PackedMatrix m, NewPackedMatrix(type, rows, cols));
    int64_t row = 0;
    for (const PackedPart& part : parts) {
      KVR_ASSIGN_OR_RETURN(const GgufTensorInfo* info, file.FindTensor(part.name));
      const std::vector<int64_t> expected = {cols, part.rows};
      if (info->dims != expected) {
        return absl::InvalidArgumentError(absl::StrCat("GGUF tensor '", part.name, "' has dims ",
                                                       ShapeString(info->dims), ", the config needs ",
                                                       ShapeString(expected), " (ggml order)"));
      }
      const std::span<const uint8_t> data = file.TensorData(*info);
      if (static_cast<int64_t>(data.size()) != part.rows * m.row_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("GGUF tensor '", part.name, "' has ",
                                                       data.size(), " bytes, expected ",
                                                       part.rows * m.row_bytes));
      }
      uint8_t* dst = m.bytes.data() + row * m.row_bytes;
      std::memcpy(dst, data.data(), data.size());
      if (part.rope_heads > 0) UnpermuteRopeRowBytes(dst, part.rope_heads, head_dim, m.row_bytes);
      row += part.rows;
    }
    return m;
  }
  // Requantise through float32 (the float reader checks shapes and undoes the permutation).
  std::vector<float> values(static_cast<size_t>(rows * cols));
  int64_t row = 0;
  for (const PackedPart& part : parts) {
    float* dst = values.data() + row * cols;
    KVR_RETURN_IF_ERROR(read(part.name, std::vector<int64_t>{part.rows, cols},
                             std::span<float>(dst, static_cast<size_t>(part.rows * cols))));
    if (part.rope_heads > 0) UnpermuteRopeRows(dst, part.rope_heads, head_dim, cols);
    row += part.rows;
  }
  return QuantizeMatrix(cols % 32 == 0 ? GgmlType::kQ8_0 : GgmlType::kF32, values.data(), rows,
                        cols);
}

absl::StatusOr<ModelWeights> LoadPackedGguf(const GgufFile& file, const ModelConfig& c,
                                            const TensorNames& names, const TensorReader& read,
                                            bool unpermute_qk) {
  ModelWeights w;
  const int64_t h = c.hidden, q = c.q_dim(), kv = c.kv_dim(), f = c.ffn;
  const int q_heads = unpermute_qk ? c.n_heads : 0, k_heads = unpermute_qk ? c.n_kv_heads : 0;
  KVR_ASSIGN_OR_RETURN(w.packed_token_embd, ReadPacked(file, {{names.embd, c.vocab}}, h, c.head_dim, read));
  w.output_norm.resize(h);
  KVR_RETURN_IF_ERROR(read(names.out_norm, std::vector<int64_t>{h}, w.output_norm));
  if (!c.tied_embeddings) {
    KVR_ASSIGN_OR_RETURN(w.packed_output, ReadPacked(file, {{names.output, c.vocab}}, h, c.head_dim, read));
  }
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    auto n = [&](absl::string_view role) { return names.layer(i, role); };
    l.attn_norm.resize(h);
    KVR_RETURN_IF_ERROR(read(n("attn_norm"), std::vector<int64_t>{h}, l.attn_norm));
    KVR_ASSIGN_OR_RETURN(l.packed_wqkv, ReadPacked(file, {{n("wq"), q, q_heads}, {n("wk"), kv, k_heads}, {n("wv"), kv}},
                                                   h, c.head_dim, read));
    KVR_RETURN_IF_ERROR(ReadQkvBias(c, names, i, read, unpermute_qk, l));
    KVR_ASSIGN_OR_RETURN(l.packed_wo, ReadPacked(file, {{n("wo"), h}}, q, c.head_dim, read));
    l.ffn_norm.resize(h);
    KVR_RETURN_IF_ERROR(read(n("ffn_norm"), std::vector<int64_t>{h}, l.ffn_norm));
    KVR_ASSIGN_OR_RETURN(l.packed_w_gate_up,
                         ReadPacked(file, {{n("w_gate"), f}, {n("w_up"), f}}, h, c.head_dim, read));
    KVR_ASSIGN_OR_RETURN(l.packed_w_down, ReadPacked(file, {{n("w_down"), h}}, f, c.head_dim, read));
  }
  KVR_RETURN_IF_ERROR(w.CheckShapes(c));
  return w;
}

}  // namespace

absl::StatusOr<ModelWeights> LoadGgufWeights(const GgufFile& file, const ModelConfig& config,
                                             ThreadPool* pool, WeightStorage storage) {
  TensorNames names;
  names.embd = "token_embd.weight";
  names.out_norm = "output_norm.weight";
  names.output = "output.weight";
  static constexpr LayerRoleNames kRoles = {{"attn_norm", "attn_norm.weight"},
                                            {"wq", "attn_q.weight"},
                                            {"wk", "attn_k.weight"},
                                            {"wv", "attn_v.weight"},
                                            {"bq", "attn_q.bias"},
                                            {"bk", "attn_k.bias"},
                                            {"bv", "attn_v.bias"},
                                            {"wo", "attn_output.weight"},
                                            {"ffn_norm", "ffn_norm.weight"},
                                            {"w_gate", "ffn_gate.weight"},
                                            {"w_up", "ffn_up.weight"},
                                            {"w_down", "ffn_down.weight"}};
  names.layer = LayerNames("blk.", kRoles);
  TensorReader read = [&](const std::string& name, std::span<const int64_t> shape,
                          std::span<float> out) -> absl::Status {
    KVR_ASSIGN_OR_RETURN(const GgufTensorInfo* info, file.FindTensor(name));
    // ggml dims are PyTorch's reversed.
    std::vector<int64_t> expected(shape.rbegin(), shape.rend());
    if (info->dims != expected) {
      return absl::InvalidArgumentError(absl::StrCat("GGUF tensor '", name, "' has dims ",
                                                     ShapeString(info->dims), ", the config needs ",
                                                     ShapeString(expected), " (ggml order)"));
    }
    return file.DequantizeTensorInto(*info, out, pool);
  };
  const bool permuted =
      config.arch == Architecture::kLlama || config.arch == Architecture::kMistral;
  if (storage == WeightStorage::kFloat32) return LoadAll(config, names, read, permuted);
  return LoadPackedGguf(file, config, names, read, permuted);
}

absl::StatusOr<ModelWeights> LoadHfWeights(const SafetensorsCheckpoint& checkpoint,
                                           const ModelConfig& config, ThreadPool* pool) {
  TensorNames names;
  names.embd = "model.embed_tokens.weight";
  names.out_norm = "model.norm.weight";
  names.output = "lm_head.weight";
  static constexpr LayerRoleNames kRoles = {{"attn_norm", "input_layernorm.weight"},
                                            {"wq", "self_attn.q_proj.weight"},
                                            {"wk", "self_attn.k_proj.weight"},
                                            {"wv", "self_attn.v_proj.weight"},
                                            {"bq", "self_attn.q_proj.bias"},
                                            {"bk", "self_attn.k_proj.bias"},
                                            {"bv", "self_attn.v_proj.bias"},
                                            {"wo", "self_attn.o_proj.weight"},
                                            {"ffn_norm", "post_attention_layernorm.weight"},
                                            {"w_gate", "mlp.gate_proj.weight"},
                                            {"w_up", "mlp.up_proj.weight"},
                                            {"w_down", "mlp.down_proj.weight"}};
  names.layer = LayerNames("model.layers.", kRoles);
  TensorReader read = [&](const std::string& name, std::span<const int64_t> shape,
                          std::span<float> out) -> absl::Status {
    KVR_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, checkpoint.FindTensor(name));
    if (!std::equal(info->shape.begin(), info->shape.end(), shape.begin(), shape.end())) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors tensor '", name, "' has shape ",
                                                     ShapeString(info->shape),
                                                     ", the config needs ", ShapeString(shape)));
    }
    KVR_ASSIGN_OR_RETURN(std::vector<float> values, checkpoint.ToFloat32(name));
    std::copy(values.begin(), values.end(), out.begin());
    return absl::OkStatus();
  };
  // With tied embeddings any stored lm_head.weight is a copy of the embedding and is ignored.
  return LoadAll(config, names, read, /*unpermute_qk=*/false);
}

namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills `v` with uniform values of standard deviation `stddev`. The stream of chunk c depends
// only on (seed, c), so the result does not depend on the thread count.
void FillUniform(std::vector<float>& v, float stddev, uint64_t seed, ThreadPool* pool) {
  constexpr size_t kChunk = 1 << 16;
  const float half_width = stddev * std::sqrt(3.f);
  const size_t n_chunks = (v.size() + kChunk - 1) / kChunk;
  auto fill = [&](size_t begin, size_t end) {
    for (size_t c = begin; c < end; ++c) {
      uint64_t state = seed ^ (c * 0xd1b54a32d192ed03ull);
      const size_t stop = std::min(v.size(), (c + 1) * kChunk);
      for (size_t i = c * kChunk; i < stop; ++i) {
        const float u = static_cast<float>(SplitMix64(state) >> 40) * (1.f / 16777216.f);
        v[i] = (2.f * u - 1.f) * half_width;
      }
    }
  };
  if (pool != nullptr) {
    pool->ParallelFor(n_chunks, fill);
  } else {
    fill(0, n_chunks);
  }
}

}  // namespace

absl::StatusOr<ModelWeights> RandomWeights(const ModelConfig& c, uint64_t seed, ThreadPool* pool) {
  KVR_RETURN_IF_ERROR(c.Validate());
  ModelWeights w;
  const int64_t h = c.hidden, q = c.q_dim(), kv = c.kv_dim(), f = c.ffn;
  uint64_t stream = seed;
  auto random = [&](int64_t n, float stddev) {
    std::vector<float> v(static_cast<size_t>(n));
    FillUniform(v, stddev, SplitMix64(stream), pool);
    return v;
  };
  const float in_h = 1.f / std::sqrt(static_cast<float>(h));
  w.token_embd = random(int64_t{c.vocab} * h, 1.f);
  w.output_norm.assign(h, 1.f);
  if (!c.tied_embeddings) w.output = random(int64_t{c.vocab} * h, in_h);
  w.layers.resize(c.n_layers);
  for (LayerWeights& l : w.layers) {
    l.attn_norm.assign(h, 1.f);
    l.wqkv = random((q + 2 * kv) * h, in_h);
    if (c.qkv_bias) l.bqkv = random(q + 2 * kv, 0.1f);
    l.wo = random(h * q, 1.f / std::sqrt(static_cast<float>(q)));
    l.ffn_norm.assign(h, 1.f);
    l.w_gate_up = random(2 * f * h, in_h);
    l.w_down = random(h * f, 1.f / std::sqrt(static_cast<float>(f)));
  }
  KVR_RETURN_IF_ERROR(w.CheckShapes(c));
  return w;
}

}  // namespace kvr::model
