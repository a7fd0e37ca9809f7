#pragma once
// GgufBuilder: GGUF files written byte by byte, for the tests that read them (the GGUF reader's,
// the config's, the weights formats').

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kvr/model/gguf.h"

namespace kvr::model::gguf_test {

// Writes `bytes` to the file `path` (replacing it).
inline void WriteBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// Appends little-endian GGUF pieces to a byte buffer.
class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) { Header(0x46554747u, version); }
  GgufBuilder(uint32_t magic, uint32_t version) { Header(magic, version); }

  std::vector<uint8_t>& bytes() { return bytes_; }
  size_t size() const { return bytes_.size(); }

  template <typename T>
  GgufBuilder& Pod(T v) {
    return Raw(&v, sizeof(T));
  }
  GgufBuilder& Str(const std::string& s) {
    Pod<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  // Counts are patched in place so that tests can write them first and lie if they want.
  GgufBuilder& Counts(uint64_t n_tensors, uint64_t n_kv) {
    return Pod<uint64_t>(n_tensors).Pod<uint64_t>(n_kv);
  }
  template <typename T>
  GgufBuilder& Kv(const std::string& key, GgufValueType type, T v) {
    Str(key).Pod<uint32_t>(static_cast<uint32_t>(type));
    return Pod<T>(v);
  }
  GgufBuilder& KvStr(const std::string& key, const std::string& v) {
    Str(key).Pod<uint32_t>(static_cast<uint32_t>(GgufValueType::kString));
    return Str(v);
  }
  GgufBuilder& TensorInfo(const std::string& name, std::vector<int64_t> dims, uint32_t type,
                          uint64_t offset) {
    Str(name).Pod<uint32_t>(static_cast<uint32_t>(dims.size()));
    for (int64_t d : dims) Pod<int64_t>(d);
    return Pod<uint32_t>(type).Pod<uint64_t>(offset);
  }
  GgufBuilder& Align(size_t alignment) {
    while (bytes_.size() % alignment != 0) bytes_.push_back(0);
    return *this;
  }
  GgufBuilder& Raw(const void* data, size_t n) {
    // resize + memcpy rather than insert: GCC 12 warns falsely (-Wstringop-overflow) about
    // inserting into an empty vector.
    const size_t old = bytes_.size();
    bytes_.resize(old + n);
    if (n > 0) std::memcpy(bytes_.data() + old, data, n);
    return *this;
  }
  // Writes the bytes to the file `path` (replacing it).
  void WriteTo(const std::string& path) const { WriteBytes(path, bytes_); }

 private:
  void Header(uint32_t magic, uint32_t version) { Pod<uint32_t>(magic).Pod<uint32_t>(version); }
  std::vector<uint8_t> bytes_;
};

}  // namespace kvr::model::gguf_test
