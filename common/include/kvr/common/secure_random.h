#pragma once
// Random bytes from the kernel's CSPRNG (getrandom(2)), for values that must not be guessable:
// request ids, store sequence ids and the capabilities that guard a sequence's KV.
//
// Why not absl::BitGen or std::mt19937: their output is predictable from a few samples or
// from their seed, and these values are the only thing standing between one client's data
// and another's. getrandom(2) with flags 0 blocks only until the kernel's pool is initialised
// at boot and never fails on a supported kernel (kvr needs Linux 5.1+ for its sealed memfd
// anyway); should it fail, the process aborts rather than hand out a guessable id.
//
// Thread safety: every function may be called from any thread.

#include <cstdint>
#include <span>
#include <string>

namespace kvr {

// Fills `out` with bytes from getrandom(2); aborts if the kernel cannot provide them.
void SecureRandomBytes(std::span<uint8_t> out);

// A uniformly random 64-bit value from SecureRandomBytes.
[[nodiscard]] uint64_t SecureRandomU64();

// `n_bytes` random bytes as 2 * n_bytes lowercase hex digits.
[[nodiscard]] std::string SecureRandomHex(size_t n_bytes);

}  // namespace kvr
