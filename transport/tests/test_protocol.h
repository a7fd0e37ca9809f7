#pragma once
// The small protocol spoken between transport tests and transport_test_server.

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvr::transport::testing {

// Active-message ids served by the test server.
inline constexpr uint16_t kEcho = 1;          // reply header = request header, payload = payload
inline constexpr uint16_t kDelayEcho = 2;     // header = uint32 delay_ms; echoes after the delay
inline constexpr uint16_t kHang = 3;          // never replies (keeps the request)
inline constexpr uint16_t kFail = 4;          // replies NOT_FOUND with a message
inline constexpr uint16_t kRegionInfo = 5;    // reply header = RegionInfo + packed rkey
inline constexpr uint16_t kRead = 6;          // header = ReadRequest; payload = region bytes
inline constexpr uint16_t kReplyThenDie = 7;  // header = uint32 delay_us; replies with the
                                              // whole region, SIGKILLs itself after delay_us

// The test server's registered region: kRegionBytes filled with PatternByte(offset, kSeed).
inline constexpr size_t kRegionBytes = size_t{16} << 20;
inline constexpr uint32_t kRegionSeed = 7;

struct ReadRequest {
  uint64_t offset;
  uint64_t length;
};

struct RegionInfo {
  uint64_t address;
  uint64_t size;
};

// A position-dependent pattern: a misplaced or stale byte shows up as a mismatch.
inline uint8_t PatternByte(size_t i, uint32_t seed) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t{seed} << 32);
  x ^= x >> 29;
  return static_cast<uint8_t>(x ^ (x >> 17));
}

inline void FillPattern(std::span<uint8_t> out, uint32_t seed, size_t base = 0) {
  for (size_t i = 0; i < out.size(); ++i) out[i] = PatternByte(base + i, seed);
}

}  // namespace kvr::transport::testing
