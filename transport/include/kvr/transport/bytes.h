#pragma once
// Byte containers used across the transport API.
//
// `Bytes` is an owned, move-only, *uninitialised* byte buffer: replies of many MiB land in
// it straight from UCX, so zero-filling it first (as std::vector<uint8_t> would) costs a full
// extra pass over memory for nothing.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>

namespace kvr::transport {

// A read-only view of bytes; the unit of scatter/gather lists (iovecs).
using ByteView = std::span<const uint8_t>;

// Views a string's bytes (headers are often built as std::string).
inline ByteView AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

class Bytes {
 public:
  Bytes() = default;
  // `size` bytes of uninitialised memory.
  static Bytes Uninitialized(size_t size) {
    Bytes b;
    if (size > 0) b.data_ = std::make_unique_for_overwrite<uint8_t[]>(size);
    b.size_ = size;
    return b;
  }
  static Bytes Copy(ByteView src) {
    Bytes b = Uninitialized(src.size());
    if (!src.empty()) std::memcpy(b.data_.get(), src.data(), src.size());
    return b;
  }

  Bytes(Bytes&& other) noexcept : data_(std::move(other.data_)), size_(other.size_) {
    other.size_ = 0;
  }
  Bytes& operator=(Bytes&& other) noexcept {
    data_ = std::move(other.data_);
    size_ = other.size_;
    other.size_ = 0;
    return *this;
  }
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;

  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<uint8_t> span() { return {data_.get(), size_}; }
  ByteView view() const { return {data_.get(), size_}; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
};

}  // namespace kvr::transport
