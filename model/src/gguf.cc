#include "kvr/model/gguf.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "absl/numeric/int128.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/common/thread_pool.h"
#include "kvr/model/dequant.h"

namespace kvr::model {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kMaxDims = 4;             // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;            // nested arrays; guards the parser's recursion
constexpr uint64_t kDefaultAlignment = 32;   // GGUF_DEFAULT_ALIGNMENT

// Smallest on-disk size of one value of `type`; used to reject counts that cannot fit in the
// bytes that remain before allocating anything for them.
uint64_t MinValueBytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kString:  // u64 length
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kArray:  // u32 type + u64 count
      return 12;
  }
  return 1;
}

std::string U128ToString(absl::uint128 v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

}  // namespace

absl::string_view GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
      return "u8";
    case GgufValueType::kInt8:
      return "i8";
    case GgufValueType::kUint16:
      return "u16";
    case GgufValueType::kInt16:
      return "i16";
    case GgufValueType::kUint32:
      return "u32";
    case GgufValueType::kInt32:
      return "i32";
    case GgufValueType::kFloat32:
      return "f32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "u64";
    case GgufValueType::kInt64:
      return "i64";
    case GgufValueType::kFloat64:
      return "f64";
  }
  return "unknown";
}

// ---- GgufValue --------------------------------------------------------------------------

bool GgufValue::is_integer() const {
  switch (type()) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

bool GgufValue::is_float() const {
  return type() == GgufValueType::kFloat32 || type() == GgufValueType::kFloat64;
}

absl::StatusOr<int64_t> GgufValue::AsInt() const {
  return std::visit(
      [this](const auto& v) -> absl::StatusOr<int64_t> {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, uint64_t>) {
          if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            return absl::OutOfRangeError(absl::StrCat("u64 value ", v, " does not fit int64"));
          }
          return static_cast<int64_t>(v);
        } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
          return static_cast<int64_t>(v);
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("expected an integer, found ", GgufValueTypeName(type())));
        }
      },
      storage_);
}

absl::StatusOr<double> GgufValue::AsDouble() const {
  return std::visit(
      [this](const auto& v) -> absl::StatusOr<double> {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
          return static_cast<double>(v);
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("expected a number, found ", GgufValueTypeName(type())));
        }
      },
      storage_);
}

absl::StatusOr<bool> GgufValue::AsBool() const {
  if (const bool* b = std::get_if<bool>(&storage_)) return *b;
  return absl::InvalidArgumentError(
      absl::StrCat("expected bool, found ", GgufValueTypeName(type())));
}

absl::StatusOr<absl::string_view> GgufValue::AsString() const {
  if (const std::string* s = std::get_if<std::string>(&storage_)) return absl::string_view(*s);
  return absl::InvalidArgumentError(
      absl::StrCat("expected string, found ", GgufValueTypeName(type())));
}

absl::StatusOr<const GgufArray*> GgufValue::AsArray() const {
  if (const GgufArray* a = std::get_if<GgufArray>(&storage_)) return a;
  return absl::InvalidArgumentError(
      absl::StrCat("expected array, found ", GgufValueTypeName(type())));
}

// ---- parser -----------------------------------------------------------------------------

// Reads the file front to back with bounds checks on every read. Errors carry the file path
// and the byte offset of the item being read.
class GgufParser {
 public:
  explicit GgufParser(GgufFile& out)
      : out_(out), data_(out.file_.data()), size_(out.file_.size()) {}

  absl::Status Parse() {
    uint32_t magic = 0;
    KVR_RETURN_IF_ERROR(ReadPod(&magic, "magic"));
    if (magic != kGgufMagic) {
      char m[4];
      std::memcpy(m, &magic, 4);
      return Error(0, absl::StrCat("bad magic: expected \"GGUF\", found bytes ",
                                   absl::CEscape(absl::string_view(m, 4))));
    }
    uint32_t version = 0;
    KVR_RETURN_IF_ERROR(ReadPod(&version, "version"));
    if (version != 2 && version != 3) {
      // A big-endian file (gguf-py's --bigendian) shows its version byte-swapped.
      if (version == 0x02000000u || version == 0x03000000u) {
        return Error(4, "big-endian GGUF files are not supported");
      }
      return Error(4, absl::StrCat("unsupported GGUF version ", version, " (supported: 2 and 3)"));
    }
    out_.version_ = version;

    uint64_t n_tensors = 0, n_kv = 0;
    KVR_RETURN_IF_ERROR(ReadPod(&n_tensors, "tensor count"));
    KVR_RETURN_IF_ERROR(ReadPod(&n_kv, "metadata key/value count"));
    // Each key/value takes at least 8 (key length) + 4 (type) + 1 bytes; each tensor info at
    // least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
    if (n_kv > Remaining() / 13) {
      return Error(16, absl::StrCat("metadata key/value count ", n_kv, " cannot fit in the file's ",
                                    size_, " bytes"));
    }
    if (n_tensors > Remaining() / 24) {
      return Error(8, absl::StrCat("tensor count ", n_tensors, " cannot fit in the file's ", size_,
                                   " bytes"));
    }

    out_.metadata_.reserve(n_kv);
    for (uint64_t i = 0; i < n_kv; ++i) {
      const uint64_t key_pos = pos_;
      std::string key;
      KVR_RETURN_IF_ERROR(ReadString(&key, absl::StrCat("key of metadata entry ", i)));
      uint32_t type_id = 0;
      KVR_RETURN_IF_ERROR(ReadPod(&type_id, absl::StrCat("type of metadata key '", key, "'")));
      GgufValue value;
      KVR_RETURN_IF_ERROR(ReadValue(type_id, key, 0, &value));
      if (!out_.metadata_index_.emplace(key, out_.metadata_.size()).second) {
        return Error(key_pos, absl::StrCat("duplicate metadata key '", key, "'"));
      }
      out_.metadata_.emplace_back(std::move(key), std::move(value));
    }

    out_.alignment_ = kDefaultAlignment;
    if (auto it = out_.metadata_index_.find("general.alignment");
        it != out_.metadata_index_.end()) {
      auto a = out_.metadata_[it->second].second.AsInt();
      if (!a.ok() || *a <= 0 || (*a & (*a - 1)) != 0) {
        return Error(0, "general.alignment must be a positive power-of-two integer");
      }
      out_.alignment_ = static_cast<uint64_t>(*a);
    }

    out_.tensors_.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) {
      KVR_RETURN_IF_ERROR(ReadTensorInfo(i));
    }

    // The data section starts at the next multiple of the alignment.
    const uint64_t data_offset = (pos_ + out_.alignment_ - 1) / out_.alignment_ * out_.alignment_;
    if (n_tensors > 0 && data_offset > size_) {
      return Error(pos_, absl::StrCat("truncated GGUF: data section would start at byte ",
                                      data_offset, " but file has ", size_, " bytes"));
    }
    out_.data_offset_ = data_offset;
    for (const GgufTensorInfo& t : out_.tensors_) {
      const absl::uint128 begin = absl::uint128(data_offset) + t.offset;
      const absl::uint128 end = begin + t.n_bytes;
      if (end > size_) {
        return Error(size_, absl::StrCat("truncated GGUF: tensor '", t.name, "' data ends at byte ",
                                         U128ToString(end), " but file has ", size_, " bytes"));
      }
    }
    return absl::OkStatus();
  }

 private:
  uint64_t Remaining() const { return size_ - pos_; }

  absl::Status Error(uint64_t at, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF '", out_.file_.path(), "' at byte ", at, ": ", what));
  }

  absl::Status Truncated(uint64_t need, absl::string_view what) const {
    return Error(pos_,
                 absl::StrCat("truncated GGUF: reading ", what, " needs ", need, " bytes but only ",
                              Remaining(), " remain (file has ", size_, " bytes)"));
  }

  template <typename T>
  absl::Status ReadPod(T* v, absl::string_view what) {
    if (Remaining() < sizeof(T)) return Truncated(sizeof(T), what);
    std::memcpy(v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }

  absl::Status ReadString(std::string* s, absl::string_view what) {
    uint64_t len = 0;
    KVR_RETURN_IF_ERROR(ReadPod(&len, absl::StrCat("length of ", what)));
    if (len > Remaining()) {
      return Error(pos_ - 8, absl::StrCat("truncated GGUF: ", what, " has length ", len,
                                          " but only ", Remaining(), " bytes remain"));
    }
    s->assign(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return absl::OkStatus();
  }

  absl::Status ReadValue(uint32_t type_id, const std::string& key, int depth, GgufValue* out) {
    if (type_id > static_cast<uint32_t>(GgufValueType::kFloat64)) {
      return Error(pos_ - 4,
                   absl::StrCat("unknown metadata value type ", type_id, " for key '", key, "'"));
    }
    const auto type = static_cast<GgufValueType>(type_id);
    const std::string what = absl::StrCat("value of metadata key '", key, "'");
    switch (type) {
      case GgufValueType::kUint8:
        return ReadScalar<uint8_t>(what, out);
      case GgufValueType::kInt8:
        return ReadScalar<int8_t>(what, out);
      case GgufValueType::kUint16:
        return ReadScalar<uint16_t>(what, out);
      case GgufValueType::kInt16:
        return ReadScalar<int16_t>(what, out);
      case GgufValueType::kUint32:
        return ReadScalar<uint32_t>(what, out);
      case GgufValueType::kInt32:
        return ReadScalar<int32_t>(what, out);
      case GgufValueType::kFloat32:
        return ReadScalar<float>(what, out);
      case GgufValueType::kUint64:
        return ReadScalar<uint64_t>(what, out);
      case GgufValueType::kInt64:
        return ReadScalar<int64_t>(what, out);
      case GgufValueType::kFloat64:
        return ReadScalar<double>(what, out);
      case GgufValueType::kBool: {
        uint8_t b = 0;
        KVR_RETURN_IF_ERROR(ReadPod(&b, what));
        if (b > 1) return Error(pos_ - 1, absl::StrCat("bool ", what, " is ", int{b}, ", not 0/1"));
        *out = GgufValue(GgufValue::Storage(std::in_place_type<bool>, b != 0));
        return absl::OkStatus();
      }
      case GgufValueType::kString: {
        std::string s;
        KVR_RETURN_IF_ERROR(ReadString(&s, what));
        *out = GgufValue(GgufValue::Storage(std::in_place_type<std::string>, std::move(s)));
        return absl::OkStatus();
      }
      case GgufValueType::kArray: {
        if (depth >= kMaxArrayDepth) {
          return Error(pos_, absl::StrCat("arrays nested deeper than ", kMaxArrayDepth,
                                          " levels in key '", key, "'"));
        }
        const uint64_t array_pos = pos_;
        uint32_t elem_type = 0;
        uint64_t count = 0;
        KVR_RETURN_IF_ERROR(ReadPod(&elem_type, absl::StrCat("element type of array '", key, "'")));
        KVR_RETURN_IF_ERROR(ReadPod(&count, absl::StrCat("length of array '", key, "'")));
        if (elem_type > static_cast<uint32_t>(GgufValueType::kFloat64)) {
          return Error(array_pos,
                       absl::StrCat("unknown element type ", elem_type, " of array '", key, "'"));
        }
        const uint64_t min_bytes = MinValueBytes(static_cast<GgufValueType>(elem_type));
        if (count > Remaining() / min_bytes) {
          return Error(
              array_pos + 4,
              absl::StrCat("truncated GGUF or corrupt array length: array '", key, "' claims ",
                           count, " elements of type ",
                           GgufValueTypeName(static_cast<GgufValueType>(elem_type)), " (at least ",
                           min_bytes, " bytes each) but only ", Remaining(), " bytes remain"));
        }
        GgufArray array;
        array.element_type = static_cast<GgufValueType>(elem_type);
        array.items.resize(static_cast<size_t>(count));
        for (GgufValue& item : array.items) {
          KVR_RETURN_IF_ERROR(ReadValue(elem_type, key, depth + 1, &item));
        }
        *out = GgufValue(GgufValue::Storage(std::in_place_type<GgufArray>, std::move(array)));
        return absl::OkStatus();
      }
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status ReadScalar(absl::string_view what, GgufValue* out) {
    T v{};
    KVR_RETURN_IF_ERROR(ReadPod(&v, what));
    *out = GgufValue(GgufValue::Storage(std::in_place_type<T>, v));
    return absl::OkStatus();
  }

  absl::Status ReadTensorInfo(uint64_t index) {
    const uint64_t info_pos = pos_;
    GgufTensorInfo t;
    KVR_RETURN_IF_ERROR(ReadString(&t.name, absl::StrCat("name of tensor ", index)));
    const std::string what = absl::StrCat("tensor '", t.name, "'");
    uint32_t n_dims = 0;
    KVR_RETURN_IF_ERROR(ReadPod(&n_dims, absl::StrCat("dimension count of ", what)));
    if (n_dims > kMaxDims) {
      return Error(pos_ - 4,
                   absl::StrCat(what, " has ", n_dims, " dimensions (at most ", kMaxDims, ")"));
    }
    t.dims.resize(n_dims);
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      int64_t dim = 0;
      KVR_RETURN_IF_ERROR(ReadPod(&dim, absl::StrCat("dimension ", d, " of ", what)));
      if (dim < 0) {
        return Error(pos_ - 8, absl::StrCat(what, " has negative dimension ", d, ": ", dim));
      }
      if (dim != 0 && n_elements > std::numeric_limits<int64_t>::max() / dim) {
        return Error(pos_ - 8, absl::StrCat(what, " has an element count that overflows int64"));
      }
      n_elements *= dim;
      t.dims[d] = dim;
    }
    t.n_elements = n_elements;
    uint32_t type_id = 0;
    KVR_RETURN_IF_ERROR(ReadPod(&type_id, absl::StrCat("type of ", what)));
    auto traits = GetGgmlTypeTraits(type_id);
    if (!traits.ok()) {
      return Error(pos_ - 4, absl::StrCat(what, " has unknown tensor type id ", type_id));
    }
    t.type = static_cast<GgmlType>(type_id);
    if (t.row_length() % traits->block_size != 0) {
      return Error(pos_ - 4,
                   absl::StrCat(what, " row length ", t.row_length(), " is not a multiple of the ",
                                traits->name, " block size ", traits->block_size));
    }
    KVR_RETURN_IF_ERROR(ReadPod(&t.offset, absl::StrCat("data offset of ", what)));
    if (t.offset % out_.alignment_ != 0) {
      return Error(pos_ - 8, absl::StrCat(what, " data offset ", t.offset,
                                          " is not a multiple of the alignment ", out_.alignment_));
    }
    // n_bytes = n_elements / block_size * type_size; whether it fits the file is checked once
    // the data section's start is known (Parse), in 128-bit arithmetic so nothing overflows.
    const absl::uint128 n_bytes =
        absl::uint128(static_cast<uint64_t>(n_elements / traits->block_size)) *
        static_cast<uint64_t>(traits->type_size);
    if (n_bytes > std::numeric_limits<uint64_t>::max()) {
      return Error(info_pos, absl::StrCat(what, " has an absurd size (", n_elements, " ",
                                          traits->name, " elements)"));
    }
    t.n_bytes = static_cast<uint64_t>(n_bytes);
    if (!out_.tensor_index_.emplace(t.name, out_.tensors_.size()).second) {
      return Error(info_pos, absl::StrCat("duplicate tensor name '", t.name, "'"));
    }
    out_.tensors_.push_back(std::move(t));
    return absl::OkStatus();
  }

  GgufFile& out_;
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

// ---- GgufFile ---------------------------------------------------------------------------

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  KVR_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  GgufFile file;
  file.file_ = std::move(mapped);
  GgufParser parser(file);
  KVR_RETURN_IF_ERROR(parser.Parse());
  return file;
}

absl::StatusOr<const GgufValue*> GgufFile::Get(absl::string_view key) const {
  auto it = metadata_index_.find(key);
  if (it == metadata_index_.end()) {
    return absl::NotFoundError(absl::StrCat("GGUF '", path(), "' has no metadata key '", key, "'"));
  }
  return &metadata_[it->second].second;
}

namespace {
absl::Status KeyError(const std::string& path, absl::string_view key, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("GGUF '", path, "' key '", key, "': ", s.message()));
}
}  // namespace

absl::StatusOr<absl::string_view> GgufFile::GetString(absl::string_view key) const {
  KVR_ASSIGN_OR_RETURN(const GgufValue* v, Get(key));
  auto r = v->AsString();
  if (!r.ok()) return KeyError(path(), key, r.status());
  return r;
}

absl::StatusOr<int64_t> GgufFile::GetInt(absl::string_view key) const {
  KVR_ASSIGN_OR_RETURN(const GgufValue* v, Get(key));
  auto r = v->AsInt();
  if (!r.ok()) return KeyError(path(), key, r.status());
  return r;
}

absl::StatusOr<double> GgufFile::GetFloat(absl::string_view key) const {
  KVR_ASSIGN_OR_RETURN(const GgufValue* v, Get(key));
  auto r = v->AsDouble();
  if (!r.ok()) return KeyError(path(), key, r.status());
  return r;
}

absl::StatusOr<bool> GgufFile::GetBool(absl::string_view key) const {
  KVR_ASSIGN_OR_RETURN(const GgufValue* v, Get(key));
  auto r = v->AsBool();
  if (!r.ok()) return KeyError(path(), key, r.status());
  return r;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(absl::string_view key) const {
  KVR_ASSIGN_OR_RETURN(const GgufValue* v, Get(key));
  auto array = v->AsArray();
  if (!array.ok()) return KeyError(path(), key, array.status());
  if ((*array)->element_type != GgufValueType::kString) {
    return KeyError(
        path(), key,
        absl::InvalidArgumentError(absl::StrCat("expected an array of strings, found an array of ",
                                                GgufValueTypeName((*array)->element_type))));
  }
  std::vector<std::string> out;
  out.reserve((*array)->items.size());
  for (const GgufValue& item : (*array)->items) {
    out.push_back(std::get<std::string>(item.storage()));
  }
  return out;
}

absl::StatusOr<const GgufTensorInfo*> GgufFile::FindTensor(absl::string_view name) const {
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) {
    return absl::NotFoundError(absl::StrCat("GGUF '", path(), "' has no tensor '", name, "'"));
  }
  return &tensors_[it->second];
}

absl::StatusOr<std::span<const uint8_t>> GgufFile::TensorData(absl::string_view name) const {
  KVR_ASSIGN_OR_RETURN(const GgufTensorInfo* info, FindTensor(name));
  return TensorData(*info);
}

absl::StatusOr<std::vector<float>> GgufFile::DequantizeTensor(absl::string_view name,
                                                              ThreadPool* pool) const {
  KVR_ASSIGN_OR_RETURN(const GgufTensorInfo* info, FindTensor(name));
  std::vector<float> out(static_cast<size_t>(info->n_elements));
  KVR_RETURN_IF_ERROR(DequantizeTensorInto(*info, out, pool));
  return out;
}

absl::Status GgufFile::DequantizeTensorInto(const GgufTensorInfo& info, std::span<float> out,
                                            ThreadPool* pool) const {
  if (out.size() != static_cast<size_t>(info.n_elements)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", info.name, "' has ", info.n_elements,
                                                   " elements but the output has ", out.size()));
  }
  KVR_ASSIGN_OR_RETURN(GgmlTypeTraits traits, GetGgmlTypeTraits(info.type));
  const uint8_t* src = TensorData(info).data();
  const int64_t row = info.row_length();
  const int64_t n_rows = info.n_rows();
  if (n_rows == 0) return absl::OkStatus();
  const uint64_t row_bytes =
      static_cast<uint64_t>(row / traits.block_size) * static_cast<uint64_t>(traits.type_size);
  auto status_or_annotate = [&](absl::Status s) {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat("tensor '", info.name, "': ", s.message()));
  };
  if (pool == nullptr || pool->size() <= 1 || info.n_elements < (1 << 16)) {
    // Rows are contiguous, so the whole tensor is one long row.
    return status_or_annotate(DequantizeRow(info.type, src, info.n_elements, out.data()));
  }
  // Only the type can fail, and it is the same for every row: check it once up front.
  KVR_RETURN_IF_ERROR(status_or_annotate(DequantizeRow(info.type, src, row, out.data())));
  const size_t min_rows =
      static_cast<size_t>(std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1)));
  pool->ParallelFor(
      static_cast<size_t>(n_rows),
      [&](size_t begin, size_t end) {
        const int64_t n = static_cast<int64_t>(end - begin) * row;
        // Cannot fail: the type and the block multiple were checked above.
        (void)DequantizeRow(info.type, src + begin * row_bytes, n,
                            out.data() + static_cast<int64_t>(begin) * row);
      },
      min_rows);
  return absl::OkStatus();
}

}  // namespace kvr::model
