#pragma once
// Byte sizes as people write them, parsed one way by every kvr binary (flags, YAML, environment).

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvr {

// Parses a whole number of bytes with an optional unit, white space allowed around both:
//   none or B                        bytes
//   kB, MB, GB, TB, PB (or k, M, G, T, P)   powers of 1000: "4GB" = 4,000,000,000
//   KiB, MiB, GiB, TiB, PiB (or Ki .. Pi)   powers of 1024: "4GiB" = 4,294,967,296
// Units are case-insensitive ("4gib" = "4GiB"; the bare letters follow Kubernetes quantities).
// INVALID_ARGUMENT for anything else (no number, a fraction, an unknown unit) or a size past
// 64 bits, naming the text.
[[nodiscard]] absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

}  // namespace kvr
