#pragma once
// The identifiers the controller hands out, all drawn from the kernel's CSPRNG
// (kvr/common/secure_random.h) so that none can be guessed from another:
//
// - request ids go to clients: 128 random bits as 32 hex digits; they carry no time, counter
//   or node, so a client learns nothing about the cluster or other requests from its own;
// - store sequence ids (one per attempt) name a request's KV in a store: 64 random bits,
//   drawn independently of the request id;
// - the sequence capability (one per attempt) is the 16-byte secret that the store demands on
//   every operation of that sequence (kvr::kv_store::Capability); it goes only to the prefill
//   and decode nodes of the attempt (PrefillRequest / HandoffHeader.sequence_capability).
//
// Thread safety: every function may be called from any thread.

#include <cstdint>
#include <string>

namespace kvr::controller {

inline constexpr size_t kRequestIdBytes = 16;
inline constexpr size_t kSequenceCapabilityBytes = 16;

// 32 lowercase hex digits.
[[nodiscard]] std::string NewRequestId();
// Never 0 (the decode node refuses sequence id 0).
[[nodiscard]] uint64_t NewSequenceId();
// kSequenceCapabilityBytes random bytes, never all zero (the store refuses that value).
[[nodiscard]] std::string NewSequenceCapability();

}  // namespace kvr::controller
