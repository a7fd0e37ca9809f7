#pragma once
// A GGUF (v2 and v3) reader over a read-only memory map.
//
// Metadata is parsed eagerly into `GgufValue`s (a few MB even for large vocabularies); tensor
// data stays in the mapping and is exposed as byte spans or dequantised on request. Every length
// and count read from the file is checked against the bytes that remain before anything is
// allocated, so corrupt or truncated files give an error naming what was wrong and the byte
// offset where it was found, never a crash or a huge allocation.
//
// Thread safety: a GgufFile is immutable after Open; const methods may be called concurrently.
// Lifetime: spans returned by TensorData point into the mapping and live as long as the
// GgufFile (moving the GgufFile keeps them valid: the mapping itself does not move).

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvr/common/mapped_file.h"
#include "kvr/model/tensor_types.h"

namespace kvr {
class ThreadPool;
}  // namespace kvr

namespace kvr::model {

// GGUF metadata value types, numbered as on disk (gguf.h `enum gguf_type`).
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

absl::string_view GgufValueTypeName(GgufValueType type);

class GgufValue;

// A GGUF array: all elements share `element_type`; arrays may nest.
struct GgufArray {
  GgufValueType element_type = GgufValueType::kUint8;
  std::vector<GgufValue> items;
};

// One metadata value. The alternative held matches type() exactly (no widening on parse).
class GgufValue {
 public:
  using Storage = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool,
                               std::string, GgufArray, uint64_t, int64_t, double>;

  GgufValue() = default;
  explicit GgufValue(Storage storage) : storage_(std::move(storage)) {}

  // The variant index equals the on-disk type id by construction.
  GgufValueType type() const { return static_cast<GgufValueType>(storage_.index()); }
  const Storage& storage() const { return storage_; }

  bool is_integer() const;  // any of the 8 integer types (not bool)
  bool is_float() const;    // f32 or f64
  bool is_string() const { return type() == GgufValueType::kString; }
  bool is_array() const { return type() == GgufValueType::kArray; }

  // Conversions with checks; errors name the actual type.
  [[nodiscard]] absl::StatusOr<int64_t> AsInt() const;    // any integer type; u64 > INT64_MAX fails
  [[nodiscard]] absl::StatusOr<double> AsDouble() const;  // f32, f64 or any integer type
  [[nodiscard]] absl::StatusOr<bool> AsBool() const;
  [[nodiscard]] absl::StatusOr<absl::string_view> AsString() const;
  [[nodiscard]] absl::StatusOr<const GgufArray*> AsArray() const;

 private:
  Storage storage_;
};

struct GgufTensorInfo {
  std::string name;
  // ggml order: dims[0] is the fastest-varying dimension (the row length). A PyTorch weight of
  // shape [out, in] appears here as {in, out}.
  std::vector<int64_t> dims;
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;     // from the start of the data section (aligned)
  uint64_t n_bytes = 0;    // size of the tensor's data
  int64_t n_elements = 0;  // product of dims
  int64_t row_length() const { return dims.empty() ? 1 : dims[0]; }
  int64_t n_rows() const { return dims.empty() || dims[0] == 0 ? 0 : n_elements / dims[0]; }
};

class GgufFile {
 public:
  // Maps and parses `path`. Errors: bad magic, unsupported version (only 2 and 3), truncated
  // header/metadata/tensor infos/data, absurd counts or lengths, unknown value or tensor types,
  // duplicate keys or tensor names, misaligned tensor data or tensor data beyond the end of the
  // file.
  [[nodiscard]] static absl::StatusOr<GgufFile> Open(const std::string& path);

  GgufFile(GgufFile&&) noexcept = default;
  GgufFile& operator=(GgufFile&&) noexcept = default;
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return file_.path(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }      // general.alignment, default 32
  uint64_t data_offset() const { return data_offset_; }  // file offset of the data section

  // ---- metadata -------------------------------------------------------------------------
  // Entries in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  bool Has(absl::string_view key) const { return metadata_index_.contains(key); }
  // NotFound naming the key when absent.
  [[nodiscard]] absl::StatusOr<const GgufValue*> Get(absl::string_view key) const;
  [[nodiscard]] absl::StatusOr<absl::string_view> GetString(absl::string_view key) const;
  [[nodiscard]] absl::StatusOr<int64_t> GetInt(absl::string_view key) const;   // any integer type
  [[nodiscard]] absl::StatusOr<double> GetFloat(absl::string_view key) const;  // f32/f64/integer
  [[nodiscard]] absl::StatusOr<bool> GetBool(absl::string_view key) const;
  [[nodiscard]] absl::StatusOr<std::vector<std::string>> GetStringArray(
      absl::string_view key) const;
  // An array of numbers converted to T (integral or floating). Integral T fails on a
  // non-integer element or one out of T's range; floating T accepts any numeric element.
  template <typename T>
  [[nodiscard]] absl::StatusOr<std::vector<T>> GetArray(absl::string_view key) const;

  // ---- tensors --------------------------------------------------------------------------
  // In file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  bool HasTensor(absl::string_view name) const { return tensor_index_.contains(name); }
  // NotFound naming the tensor when absent.
  [[nodiscard]] absl::StatusOr<const GgufTensorInfo*> FindTensor(absl::string_view name) const;
  // The tensor's raw bytes (quantised blocks as stored).
  [[nodiscard]] absl::StatusOr<std::span<const uint8_t>> TensorData(absl::string_view name) const;
  std::span<const uint8_t> TensorData(const GgufTensorInfo& info) const {
    return {file_.data() + data_offset_ + info.offset, static_cast<size_t>(info.n_bytes)};
  }
  // The tensor as float32, row-major with dims[0] fastest: [n_rows, row_length].
  // With a pool, rows are dequantised in parallel.
  [[nodiscard]] absl::StatusOr<std::vector<float>> DequantizeTensor(
      absl::string_view name, ThreadPool* pool = nullptr) const;
  // Same into caller memory; `out.size()` must equal n_elements.
  [[nodiscard]] absl::Status DequantizeTensorInto(const GgufTensorInfo& info, std::span<float> out,
                                                  ThreadPool* pool = nullptr) const;

 private:
  GgufFile() = default;
  friend class GgufParser;

  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  absl::flat_hash_map<std::string, size_t> metadata_index_;
  std::vector<GgufTensorInfo> tensors_;
  absl::flat_hash_map<std::string, size_t> tensor_index_;
};

template <typename T>
absl::StatusOr<std::vector<T>> GgufFile::GetArray(absl::string_view key) const {
  static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>,
                "GetArray<T> needs a numeric T");
  auto value = Get(key);
  if (!value.ok()) return value.status();
  auto array = (*value)->AsArray();
  if (!array.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF key '", key, "': ", array.status().message()));
  }
  std::vector<T> out;
  out.reserve((*array)->items.size());
  for (size_t i = 0; i < (*array)->items.size(); ++i) {
    const GgufValue& item = (*array)->items[i];
    if constexpr (std::is_same_v<T, uint64_t>) {
      // u64 values above INT64_MAX do not survive AsInt(); take them as they are.
      if (const auto* u = std::get_if<uint64_t>(&item.storage())) {
        out.push_back(*u);
        continue;
      }
    }
    if constexpr (std::is_integral_v<T>) {
      auto v = item.AsInt();
      if (!v.ok() || *v < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
          (*v > 0 &&
           static_cast<uint64_t>(*v) > static_cast<uint64_t>(std::numeric_limits<T>::max()))) {
        return absl::InvalidArgumentError(
            absl::StrCat("GGUF key '", key, "' element ", i, " (", GgufValueTypeName(item.type()),
                         ") is not an integer that fits the requested type"));
      }
      out.push_back(static_cast<T>(*v));
    } else {
      auto v = item.AsDouble();
      if (!v.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("GGUF key '", key, "' element ", i, " (",
                                                       GgufValueTypeName(item.type()),
                                                       ") is not a number"));
      }
      out.push_back(static_cast<T>(*v));
    }
  }
  return out;
}

}  // namespace kvr::model
