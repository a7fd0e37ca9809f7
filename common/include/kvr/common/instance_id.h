#pragma once
// Process instance ids: a random id drawn once when a node process starts, so that peers can
// tell a restarted process on the same address from the one they knew (its state, e.g. a
// store's sequences, did not survive).

#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"

namespace kvr {

// 128 random bits as 32 hex digits. Not a secret; unique enough that two processes never draw
// the same one.
[[nodiscard]] inline std::string NewInstanceId() {
  std::random_device device;
  const uint64_t hi = (uint64_t{device()} << 32) ^ device();
  const uint64_t lo = (uint64_t{device()} << 32) ^ device();
  return absl::StrFormat("%016x%016x", hi, lo);
}

// This machine's identity for "same host": the content of /proc/sys/kernel/random/boot_id (a
// random UUID per boot, shared by every process, container and network namespace of one
// kernel), trimmed; "" when it cannot be read.
[[nodiscard]] inline std::string HostId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::stringstream text;
  text << in.rdbuf();
  return std::string(absl::StripAsciiWhitespace(text.str()));
}

}  // namespace kvr
