#pragma once
// Little-endian byte writer/reader for the shipped index format (registry.h). The reader is
// bounds-checked: every Read* returns a Status naming the field, so corrupt or truncated bytes
// from the network become a clear error, never an out-of-bounds read.

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvr::retrieval {

// The format is little-endian and the writer/reader copy host bytes; kvr only targets
// little-endian hosts (x86-64, aarch64), so a big-endian port would fail here, loudly.
static_assert(std::endian::native == std::endian::little,
              "kvr index serialisation assumes a little-endian host");

class ByteWriter {
 public:
  template <typename T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void PutArray(std::span<const T> values) {
    static_assert(std::is_trivially_copyable_v<T>);
    Put<uint64_t>(values.size());
    const auto* p = reinterpret_cast<const uint8_t*>(values.data());
    bytes_.insert(bytes_.end(), p, p + values.size_bytes());
  }
  void PutString(std::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  void PutBytes(std::span<const uint8_t> b) { bytes_.insert(bytes_.end(), b.begin(), b.end()); }

  size_t size() const { return bytes_.size(); }
  std::vector<uint8_t>& bytes() { return bytes_; }
  std::vector<uint8_t> Take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}

  template <typename T>
  [[nodiscard]] absl::Status Get(std::string_view field, T* value) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (remaining() < sizeof(T)) return Truncated(field, sizeof(T));
    std::memcpy(value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return absl::OkStatus();
  }
  // Reads an array written by PutArray. `max_elements` guards against absurd lengths in corrupt
  // input before any allocation happens.
  template <typename T>
  [[nodiscard]] absl::Status GetArray(std::string_view field, std::vector<T>* values,
                                      uint64_t max_elements = UINT64_MAX) {
    static_assert(std::is_trivially_copyable_v<T>);
    uint64_t n = 0;
    if (absl::Status s = Get(field, &n); !s.ok()) return s;
    if (n > max_elements) {
      return absl::DataLossError(absl::StrCat("index bytes: field '", std::string(field), "' has ",
                                              n, " elements, more than the ", max_elements,
                                              " the header allows"));
    }
    if (n > remaining() / sizeof(T)) return Truncated(field, n * sizeof(T));
    values->resize(n);
    std::memcpy(values->data(), bytes_.data() + offset_, n * sizeof(T));
    offset_ += n * sizeof(T);
    return absl::OkStatus();
  }
  [[nodiscard]] absl::Status GetString(std::string_view field, std::string* s,
                                       uint32_t max_length = 1u << 16) {
    uint32_t n = 0;
    if (absl::Status st = Get(field, &n); !st.ok()) return st;
    if (n > max_length) {
      return absl::DataLossError(absl::StrCat("index bytes: field '", std::string(field),
                                              "' length ", n, " exceeds ", max_length));
    }
    if (n > remaining()) return Truncated(field, n);
    s->assign(reinterpret_cast<const char*>(bytes_.data() + offset_), n);
    offset_ += n;
    return absl::OkStatus();
  }
  // A sub-reader over the next `n` bytes (e.g. a length-prefixed payload).
  [[nodiscard]] absl::Status Sub(std::string_view field, uint64_t n, ByteReader* sub) {
    if (n > remaining()) return Truncated(field, n);
    *sub = ByteReader(bytes_.subspan(offset_, n));
    offset_ += n;
    return absl::OkStatus();
  }
  // DataLoss when bytes are left over (a payload longer than its method expects).
  [[nodiscard]] absl::Status ExpectEnd(std::string_view what) const {
    if (remaining() == 0) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat(
        "index bytes: ", remaining(), " unexpected trailing bytes after ", std::string(what)));
  }

  size_t remaining() const { return bytes_.size() - offset_; }
  size_t offset() const { return offset_; }

 private:
  absl::Status Truncated(std::string_view field, uint64_t need) const {
    return absl::DataLossError(absl::StrCat("index bytes truncated: field '", std::string(field),
                                            "' needs ", need, " bytes at offset ", offset_,
                                            ", only ", remaining(), " left"));
  }

  std::span<const uint8_t> bytes_;
  size_t offset_ = 0;
};

}  // namespace kvr::retrieval
