#include "kvr/model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "kvr/common/half.h"
#include "kvr/common/status.h"

namespace kvr::model {
namespace {

// The reference implementation (safetensors' Rust crate) refuses headers above 100 MB; so do
// we, which also bounds what a corrupt length can make us parse.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

template <typename T>
void Convert(const uint8_t* src, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    dst[i] = static_cast<float>(v);
  }
}

void ConvertF32(const uint8_t* src, size_t n, float* dst) {
  if (n > 0) std::memcpy(dst, src, n * sizeof(float));
}

struct DtypeEntry {
  SafetensorsDtype dtype;
  absl::string_view name;
  int64_t size;
  // Widens n elements at src (any alignment) to float32; null: not supported.
  void (*to_float)(const uint8_t* src, size_t n, float* dst);
};

constexpr DtypeEntry kDtypes[] = {
    {SafetensorsDtype::kBool, "BOOL", 1, nullptr},
    {SafetensorsDtype::kU8, "U8", 1, Convert<uint8_t>},
    {SafetensorsDtype::kI8, "I8", 1, Convert<int8_t>},
    {SafetensorsDtype::kU16, "U16", 2, Convert<uint16_t>},
    {SafetensorsDtype::kI16, "I16", 2, Convert<int16_t>},
    {SafetensorsDtype::kU32, "U32", 4, Convert<uint32_t>},
    {SafetensorsDtype::kI32, "I32", 4, Convert<int32_t>},
    {SafetensorsDtype::kU64, "U64", 8, Convert<uint64_t>},
    {SafetensorsDtype::kI64, "I64", 8, Convert<int64_t>},
    {SafetensorsDtype::kF16, "F16", 2,
     [](const uint8_t* src, size_t n, float* dst) { Fp16BytesToFloats(src, n, dst); }},
    {SafetensorsDtype::kBF16, "BF16", 2,
     [](const uint8_t* src, size_t n, float* dst) { Bf16BytesToFloats(src, n, dst); }},
    {SafetensorsDtype::kF32, "F32", 4, ConvertF32},
    {SafetensorsDtype::kF64, "F64", 8, Convert<double>},
    {SafetensorsDtype::kF8E4M3, "F8_E4M3", 1, nullptr},
    {SafetensorsDtype::kF8E5M2, "F8_E5M2", 1, nullptr},
};

// Row i is enumerator i, and every enumerator (up to the last, kF8E5M2) has its row: a new
// dtype without one fails to compile instead of reading another's.
constexpr bool InEnumeratorOrder() {
  for (size_t i = 0; i < std::size(kDtypes); ++i) {
    if (static_cast<size_t>(kDtypes[i].dtype) != i) return false;
  }
  return std::size(kDtypes) == static_cast<size_t>(SafetensorsDtype::kF8E5M2) + 1;
}
static_assert(InEnumeratorOrder(), "kDtypes: one row per SafetensorsDtype, in enumerator order");

const DtypeEntry& Entry(SafetensorsDtype dtype) { return kDtypes[static_cast<size_t>(dtype)]; }

}  // namespace

absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype) { return Entry(dtype).name; }

int64_t SafetensorsDtypeSize(SafetensorsDtype dtype) { return Entry(dtype).size; }

absl::StatusOr<SafetensorsDtype> ParseSafetensorsDtype(absl::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.name == name) return e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype '", name, "'"));
}

absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path) {
  KVR_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  const char* begin = reinterpret_cast<const char*>(file.data());
  try {
    // Exceptions stay inside this function (CONVENTIONS.md 3): nlohmann's parse_error carries
    // the byte position, which the non-throwing overload would lose.
    return nlohmann::json::parse(begin, begin + file.size());
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("invalid JSON in '", path, "': ", e.what()));
  }
}

// ---- SafetensorsFile --------------------------------------------------------------------

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  KVR_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors '", path, "': ", what));
  };
  const uint64_t size = mapped.size();
  if (size < 8) {
    return error(
        absl::StrCat("truncated: ", size, " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, mapped.data(), sizeof(header_len));
  if (header_len > size - 8) {
    return error(absl::StrCat("truncated: header length ", header_len, " exceeds the ", size - 8,
                              " bytes after the length field"));
  }
  if (header_len > kMaxHeaderBytes) {
    return error(absl::StrCat("header length ", header_len, " exceeds the ", kMaxHeaderBytes,
                              "-byte limit"));
  }
  const char* header = reinterpret_cast<const char*>(mapped.data() + 8);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header, header + header_len);
  } catch (const nlohmann::json::exception& e) {
    return error(absl::StrCat("corrupt JSON header: ", e.what()));
  }
  if (!json.is_object()) return error("the JSON header is not an object");

  SafetensorsFile file;
  file.data_offset_ = 8 + header_len;
  const uint64_t data_size = size - file.data_offset_;
  for (const auto& [name, entry] : json.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return error("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          return error(absl::StrCat("__metadata__ value of '", k, "' is not a string"));
        file.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    // A named copy: clang before 16 cannot capture a structured binding in a lambda.
    const std::string& tensor_name = name;
    auto tensor_error = [&](absl::string_view what) {
      return error(absl::StrCat("tensor '", tensor_name, "': ", what));
    };
    if (!entry.is_object()) return tensor_error("entry is not an object");
    const auto dtype_it = entry.find("dtype");
    const auto shape_it = entry.find("shape");
    const auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string()) {
      return tensor_error("missing or non-string \"dtype\"");
    }
    if (shape_it == entry.end() || !shape_it->is_array()) {
      return tensor_error("missing or non-array \"shape\"");
    }
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
      return tensor_error("\"data_offsets\" must be two non-negative integers");
    }
    SafetensorsTensorInfo info;
    info.name = name;
    auto dtype = ParseSafetensorsDtype(dtype_it->get<std::string>());
    if (!dtype.ok()) return tensor_error(dtype.status().message());
    info.dtype = *dtype;
    int64_t n = 1;
    for (const auto& d : *shape_it) {
      if (!d.is_number_unsigned())
        return tensor_error("shape entries must be non-negative integers");
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          (dim != 0 && static_cast<uint64_t>(n) >
                           static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim)) {
        return tensor_error("element count overflows int64");
      }
      n *= static_cast<int64_t>(dim);
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    info.n_elements = n;
    info.begin = (*offsets_it)[0].get<uint64_t>();
    info.end = (*offsets_it)[1].get<uint64_t>();
    if (info.begin > info.end || info.end > data_size) {
      return tensor_error(absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                                       ") fall outside the data section of ", data_size,
                                       " bytes (file truncated?)"));
    }
    const uint64_t elem = static_cast<uint64_t>(SafetensorsDtypeSize(info.dtype));
    if (static_cast<uint64_t>(n) > std::numeric_limits<uint64_t>::max() / elem ||
        static_cast<uint64_t>(n) * elem != info.end - info.begin) {
      return tensor_error(absl::StrCat("shape holds ", n, " ", SafetensorsDtypeName(info.dtype),
                                       " elements but data_offsets span ", info.end - info.begin,
                                       " bytes"));
    }
    file.tensors_.push_back(std::move(info));
  }
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const SafetensorsTensorInfo& a, const SafetensorsTensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
            });
  for (size_t i = 0; i < file.tensors_.size(); ++i) {
    if (i > 0 && file.tensors_[i].begin < file.tensors_[i - 1].end) {
      return error(absl::StrCat("tensors '", file.tensors_[i - 1].name, "' and '",
                                file.tensors_[i].name, "' overlap"));
    }
    file.index_.emplace(file.tensors_[i].name, i);
  }
  file.file_ = std::move(mapped);
  return file;
}

absl::StatusOr<const SafetensorsTensorInfo*> SafetensorsFile::FindTensor(
    absl::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(
        absl::StrCat("safetensors '", path(), "' has no tensor '", name, "'"));
  }
  return &tensors_[it->second];
}

absl::StatusOr<std::span<const uint8_t>> SafetensorsFile::TensorData(absl::string_view name) const {
  KVR_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, FindTensor(name));
  return TensorData(*info);
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ToFloat32(absl::string_view name) const {
  KVR_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, FindTensor(name));
  std::vector<float> out(static_cast<size_t>(info->n_elements));
  KVR_RETURN_IF_ERROR(ToFloat32Into(*info, out));
  return out;
}

absl::Status SafetensorsFile::ToFloat32Into(const SafetensorsTensorInfo& info,
                                            std::span<float> out) const {
  if (out.size() != static_cast<size_t>(info.n_elements)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", info.name, "' has ", info.n_elements,
                                                   " elements but the output has ", out.size()));
  }
  const auto to_float = Entry(info.dtype).to_float;
  if (to_float != nullptr) {
    to_float(TensorData(info).data(), out.size(), out.data());
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrCat("tensor '", info.name, "': conversion of ",
                                               SafetensorsDtypeName(info.dtype),
                                               " to float32 is not supported"));
}

// ---- SafetensorsCheckpoint --------------------------------------------------------------

SafetensorsCheckpoint::SafetensorsCheckpoint() = default;
SafetensorsCheckpoint::SafetensorsCheckpoint(SafetensorsCheckpoint&&) noexcept = default;
SafetensorsCheckpoint& SafetensorsCheckpoint::operator=(SafetensorsCheckpoint&&) noexcept = default;
SafetensorsCheckpoint::~SafetensorsCheckpoint() = default;

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& directory) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(directory, ec)) {
    return absl::NotFoundError(absl::StrCat("'", directory, "' is not a directory"));
  }
  const fs::path dir(directory);
  SafetensorsCheckpoint ckpt;
  ckpt.directory_ = directory;
  KVR_ASSIGN_OR_RETURN(nlohmann::json config, ReadJsonFile((dir / "config.json").string()));
  if (!config.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", (dir / "config.json").string(), "' is not a JSON object"));
  }
  ckpt.config_ = std::make_unique<nlohmann::json>(std::move(config));

  const fs::path index_path = dir / "model.safetensors.index.json";
  const fs::path single_path = dir / "model.safetensors";
  if (fs::exists(index_path, ec)) {
    const std::string index_name = index_path.string();
    KVR_ASSIGN_OR_RETURN(nlohmann::json index, ReadJsonFile(index_name));
    const auto map_it = index.is_object() ? index.find("weight_map") : index.end();
    if (map_it == index.end() || !map_it->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", index_name, "' has no \"weight_map\" object"));
    }
    // Shards in sorted order so that shards() is deterministic.
    std::set<std::string> shard_names;
    for (const auto& [tensor, shard] : map_it->items()) {
      if (!shard.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", index_name, "': weight_map entry '", tensor, "' is not a string"));
      }
      const std::string s = shard.get<std::string>();
      const fs::path p(s);
      // Shards live in the checkpoint directory; refuse paths that would escape it.
      if (s.empty() || p.is_absolute() || s.find("..") != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("'", index_name, "': weight_map entry '",
                                                       tensor, "' names an invalid shard '", s,
                                                       "'"));
      }
      shard_names.insert(s);
    }
    absl::flat_hash_map<std::string, size_t> shard_index;
    for (const std::string& s : shard_names) {
      KVR_ASSIGN_OR_RETURN(SafetensorsFile shard, SafetensorsFile::Open((dir / s).string()));
      shard_index.emplace(s, ckpt.shards_.size());
      ckpt.shards_.push_back(std::move(shard));
    }
    for (const auto& [tensor, shard] : map_it->items()) {
      const size_t i = shard_index.at(shard.get<std::string>());
      if (!ckpt.shards_[i].HasTensor(tensor)) {
        return absl::InvalidArgumentError(absl::StrCat("'", index_name, "' maps tensor '", tensor,
                                                       "' to '", shard.get<std::string>(),
                                                       "', which does not contain it"));
      }
      ckpt.tensor_shard_.emplace(tensor, i);
    }
  } else if (fs::exists(single_path, ec)) {
    KVR_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(single_path.string()));
    for (const SafetensorsTensorInfo& t : file.tensors()) ckpt.tensor_shard_.emplace(t.name, 0);
    ckpt.shards_.push_back(std::move(file));
  } else {
    return absl::NotFoundError(absl::StrCat("'", directory,
                                            "' has neither model.safetensors nor "
                                            "model.safetensors.index.json"));
  }
  return ckpt;
}

std::vector<std::string> SafetensorsCheckpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensor_shard_.size());
  for (const auto& [name, shard] : tensor_shard_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<const SafetensorsTensorInfo*> SafetensorsCheckpoint::FindTensor(
    absl::string_view name) const {
  auto it = tensor_shard_.find(name);
  if (it == tensor_shard_.end()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint '", directory_, "' has no tensor '", name, "'"));
  }
  return shards_[it->second].FindTensor(name);
}

absl::StatusOr<std::span<const uint8_t>> SafetensorsCheckpoint::TensorData(
    absl::string_view name) const {
  KVR_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, FindTensor(name));
  return shards_[tensor_shard_.find(name)->second].TensorData(*info);
}

absl::StatusOr<std::vector<float>> SafetensorsCheckpoint::ToFloat32(absl::string_view name) const {
  KVR_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, FindTensor(name));
  return shards_[tensor_shard_.find(name)->second].ToFloat32(info->name);
}

absl::Status SafetensorsCheckpoint::ToFloat32Into(absl::string_view name,
                                                  std::span<float> out) const {
  KVR_ASSIGN_OR_RETURN(const SafetensorsTensorInfo* info, FindTensor(name));
  return shards_[tensor_shard_.find(name)->second].ToFloat32Into(*info, out);
}

}  // namespace kvr::model
