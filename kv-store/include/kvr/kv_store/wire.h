#pragma once
// Binary framing of the store's UCX data-plane messages (active messages of kvr::transport).
//
// Every request is an active message whose *header* is a fixed little-endian struct starting
// with WireHeader, and whose *payload* carries the variable part (K/V bytes, entry tables,
// index lists). Successful replies carry a ReplyHeader and the rows as payload; failures are
// transport error replies (IncomingRequest::ReplyError) carrying the absl status code and a
// message naming what was wrong.
//
// Versioning: `version` is the sender's protocol version; a receiver refuses versions it does
// not know with FAILED_PRECONDITION. New fields go at the end of a struct under a new version.
// Version 2 added the sequence capability to every entry (and write); version 1 requests,
// which carry none, are refused (kMinVersion) rather than served without a check.
//
// Capabilities: every reference to a sequence carries its 16-byte Capability (types.h); the
// store checks it on every entry before reading or writing anything.
// All integers are little-endian; kvr builds only on little-endian hosts (static_assert), so
// encoding is a memcpy of these trivially copyable structs. Parsing never trusts a length:
// every size is checked against the bytes actually received before anything is read.

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvr/kv_store/types.h"

namespace kvr::kv_store::wire {

static_assert(std::endian::native == std::endian::little,
              "the kv-store wire format is little-endian and encoded by memcpy");

inline constexpr uint32_t kMagic = 0x5352564B;  // "KVRS"
inline constexpr uint16_t kVersion = 2;
inline constexpr uint16_t kMinVersion = 2;

// Active-message ids (kvr::transport::AmId) the store's data plane answers.
enum class MessageType : uint16_t {
  kWrite = 1,        // rows of all heads of one layer (prefill put, decode append)
  kGather = 2,       // rows by index for many (sequence, layer, head)
  kRangeRead = 3,    // contiguous rows for many (sequence, layer, head)
  kLocateRange = 4,  // pool offsets of a contiguous range, for RMA readers
};

struct WireHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t type = 0;  // MessageType
  // Absolute deadline (Unix microseconds); the store refuses work past it. 0: none.
  int64_t deadline_unix_us = 0;
};
static_assert(sizeof(WireHeader) == 16);

// Header of kWrite. Payload: k then v, each [n_rows, n_kv_heads, head_dim] of the sequence's
// dtype.
struct WriteRequest {
  WireHeader header;
  uint64_t sequence = 0;
  uint64_t start_row = 0;  // LayerRows::kAtEnd appends at the layer's end
  uint32_t layer = 0;
  uint32_t n_rows = 0;
  uint8_t capability[Capability::kBytes] = {};
};
static_assert(sizeof(WriteRequest) == 56);

// Header of kGather. Payload: GatherEntryWire[n_entries], then uint32 indices of all entries
// concatenated in entry order.
struct GatherRequest {
  WireHeader header;
  uint32_t n_entries = 0;
  uint32_t reserved = 0;
  uint64_t total_indices = 0;
};
static_assert(sizeof(GatherRequest) == 32);

struct GatherEntryWire {
  uint64_t sequence = 0;
  uint32_t layer = 0;
  uint32_t head = 0;
  uint32_t n_indices = 0;
  uint32_t reserved = 0;
  uint8_t capability[Capability::kBytes] = {};
};
static_assert(sizeof(GatherEntryWire) == 40);

// Header of kRangeRead and kLocateRange. Payload: RangeEntryWire[n_entries] (kLocateRange:
// exactly one).
struct RangeRequest {
  WireHeader header;
  uint32_t n_entries = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(RangeRequest) == 24);

struct RangeEntryWire {
  uint64_t sequence = 0;
  uint32_t layer = 0;
  uint32_t head = 0;
  uint64_t start = 0;
  uint64_t n_rows = 0;
  uint8_t capability[Capability::kBytes] = {};
};
static_assert(sizeof(RangeEntryWire) == 48);

// Header of every successful reply. kWrite: `value` = the layer's committed rows; kGather and
// kRangeRead: payload = the rows; kLocateRange: payload = SegmentWire[value].
struct ReplyHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t type = 0;  // the request's MessageType
  uint64_t payload_bytes = 0;
  uint64_t value = 0;
};
static_assert(sizeof(ReplyHeader) == 24);

struct SegmentWire {
  uint64_t pool_offset = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(SegmentWire) == 16);

// ---- Encoding (client side). Each returns {header bytes, payload bytes}.
struct Encoded {
  std::string header;
  std::vector<uint8_t> payload;
};
[[nodiscard]] std::string EncodeWriteHeader(const LayerRows& rows, absl::Time deadline);
[[nodiscard]] Encoded EncodeGather(std::span<const GatherEntry> entries, absl::Time deadline);
[[nodiscard]] Encoded EncodeRange(MessageType type, std::span<const RangeEntry> ranges,
                                  absl::Time deadline);
[[nodiscard]] std::string EncodeReply(MessageType type, uint64_t payload_bytes, uint64_t value);

// ---- Parsing (store side). Views point into the given bytes, which must outlive them.
// Checks magic, version, type, the deadline (DEADLINE_EXCEEDED when past) and every length.
[[nodiscard]] absl::StatusOr<WireHeader> ParseWireHeader(std::span<const uint8_t> header,
                                                         MessageType expected, absl::Time now);
[[nodiscard]] absl::StatusOr<LayerRows> ParseWrite(std::span<const uint8_t> header,
                                                   std::span<const uint8_t> payload,
                                                   absl::Time now);

// Gather entries parsed from a request; `indices` of each entry view `index_storage` or the
// payload itself when it is suitably aligned.
struct ParsedGather {
  std::vector<GatherEntry> entries;
  std::vector<uint32_t> index_storage;
};
[[nodiscard]] absl::StatusOr<ParsedGather> ParseGather(std::span<const uint8_t> header,
                                                       std::span<const uint8_t> payload,
                                                       absl::Time now);
[[nodiscard]] absl::StatusOr<std::vector<RangeEntry>> ParseRange(
    MessageType type, std::span<const uint8_t> header, std::span<const uint8_t> payload,
    absl::Time now);
// Client side: checks a reply header against the request it answers.
[[nodiscard]] absl::StatusOr<ReplyHeader> ParseReply(std::span<const uint8_t> header,
                                                     MessageType expected);

}  // namespace kvr::kv_store::wire
