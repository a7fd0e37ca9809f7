#pragma once
// Hugging Face checkpoints: `*.safetensors` files and checkpoint directories (config.json plus
// either model.safetensors or model.safetensors.index.json with its shards).
//
// safetensors layout: u64 little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"k": "v"}}, then the data section; offsets are relative to its start.
// Shapes are PyTorch order (last dimension fastest), i.e. a Linear weight is [out, in].
//
// Thread safety: both classes are immutable after Open; const methods may be called
// concurrently. Spans returned by TensorData live as long as the owning object.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvr/common/mapped_file.h"
#include "nlohmann/json_fwd.hpp"

namespace kvr::model {

enum class SafetensorsDtype {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kU64,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,  // "F8_E4M3"
  kF8E5M2,  // "F8_E5M2"
};

// The on-disk spelling ("BF16", "F8_E4M3", ...).
absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype);
// InvalidArgument naming the string for an unknown dtype.
[[nodiscard]] absl::StatusOr<SafetensorsDtype> ParseSafetensorsDtype(absl::string_view name);
int64_t SafetensorsDtypeSize(SafetensorsDtype dtype);  // bytes per element

struct SafetensorsTensorInfo {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;  // PyTorch order, last dimension fastest
  uint64_t begin = 0;          // byte offsets within the data section, [begin, end)
  uint64_t end = 0;
  int64_t n_elements = 0;  // product of shape (1 for a scalar)
};

class SafetensorsFile {
 public:
  // Maps and validates `path`: header length within the file and below 100 MB, JSON well formed,
  // every tensor with a known dtype, non-negative shape, offsets inside the data section and
  // matching shape * dtype size. Errors name the file, the tensor and what was wrong.
  [[nodiscard]] static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return file_.path(); }
  // Sorted by data offset (file order).
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  // The "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool HasTensor(absl::string_view name) const { return index_.contains(name); }
  [[nodiscard]] absl::StatusOr<const SafetensorsTensorInfo*> FindTensor(
      absl::string_view name) const;
  [[nodiscard]] absl::StatusOr<std::span<const uint8_t>> TensorData(absl::string_view name) const;
  std::span<const uint8_t> TensorData(const SafetensorsTensorInfo& info) const {
    return {file_.data() + data_offset_ + info.begin, static_cast<size_t>(info.end - info.begin)};
  }
  // Converts any float or integer dtype (not bool/fp8) to float32, same element order.
  [[nodiscard]] absl::StatusOr<std::vector<float>> ToFloat32(absl::string_view name) const;
  [[nodiscard]] absl::Status ToFloat32Into(const SafetensorsTensorInfo& info,
                                           std::span<float> out) const;

 private:
  SafetensorsFile() = default;

  MappedFile file_;
  uint64_t data_offset_ = 0;  // 8 + header length
  std::vector<SafetensorsTensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face model directory.
class SafetensorsCheckpoint {
 public:
  // Opens `directory`: reads config.json (required), then model.safetensors.index.json when
  // present (its "weight_map" names the shard of every tensor; each listed tensor must exist in
  // its shard) or else model.safetensors. Errors name the file and what was wrong.
  [[nodiscard]] static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& directory);

  SafetensorsCheckpoint(SafetensorsCheckpoint&&) noexcept;
  SafetensorsCheckpoint& operator=(SafetensorsCheckpoint&&) noexcept;
  SafetensorsCheckpoint(const SafetensorsCheckpoint&) = delete;
  SafetensorsCheckpoint& operator=(const SafetensorsCheckpoint&) = delete;
  ~SafetensorsCheckpoint();

  const std::string& directory() const { return directory_; }
  // config.json as parsed JSON (include <nlohmann/json.hpp> to use it).
  const nlohmann::json& config() const { return *config_; }
  const std::vector<SafetensorsFile>& shards() const { return shards_; }

  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;
  bool HasTensor(absl::string_view name) const { return tensor_shard_.contains(name); }
  [[nodiscard]] absl::StatusOr<const SafetensorsTensorInfo*> FindTensor(
      absl::string_view name) const;
  [[nodiscard]] absl::StatusOr<std::span<const uint8_t>> TensorData(absl::string_view name) const;
  [[nodiscard]] absl::StatusOr<std::vector<float>> ToFloat32(absl::string_view name) const;
  // Same into caller memory (no intermediate copy); `out.size()` must equal n_elements.
  [[nodiscard]] absl::Status ToFloat32Into(absl::string_view name, std::span<float> out) const;

 private:
  SafetensorsCheckpoint();

  std::string directory_;
  std::unique_ptr<nlohmann::json> config_;
  std::vector<SafetensorsFile> shards_;
  absl::flat_hash_map<std::string, size_t> tensor_shard_;  // name -> index into shards_
};

// Reads and parses a JSON file (config.json, tokenizer.json, ...); errors name the file and the
// parse position.
[[nodiscard]] absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path);

}  // namespace kvr::model
