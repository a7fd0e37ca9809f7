#include "kvr/kv_store/wire.h"

#include <cstring>
#include <type_traits>

#include "absl/strings/str_format.h"

namespace kvr::kv_store::wire {
namespace {

int64_t ToWireDeadline(absl::Time deadline) {
  return deadline == absl::InfiniteFuture() ? 0 : absl::ToUnixMicros(deadline);
}

template <typename T>
std::string AsString(const T& value) {
  static_assert(std::is_trivially_copyable_v<T>);
  return std::string(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <typename T>
absl::StatusOr<T> ReadStruct(std::span<const uint8_t> bytes, const char* what) {
  if (bytes.size() != sizeof(T)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "truncated or oversized %s: %d bytes, expected %d", what, bytes.size(), sizeof(T)));
  }
  T value;
  std::memcpy(&value, bytes.data(), sizeof(T));
  return value;
}

void PutCapability(const Capability& cap, uint8_t (&out)[Capability::kBytes]) {
  std::memcpy(out, cap.bytes.data(), Capability::kBytes);
}

Capability GetCapability(const uint8_t (&in)[Capability::kBytes]) {
  Capability cap;
  std::memcpy(cap.bytes.data(), in, Capability::kBytes);
  return cap;
}

const char* TypeName(MessageType type) {
  switch (type) {
    case MessageType::kWrite:
      return "write";
    case MessageType::kGather:
      return "gather";
    case MessageType::kRangeRead:
      return "range read";
    case MessageType::kLocateRange:
      return "locate range";
  }
  return "unknown";
}

absl::Status CheckPrefix(uint32_t magic, uint16_t version, uint16_t type, MessageType expected,
                         const char* what) {
  if (magic != kMagic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: bad magic 0x%08x (expected 0x%08x)", what, magic, kMagic));
  }
  if (version < kMinVersion || version > kVersion) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: wire version %d is not supported (this side speaks %d..%d)", what,
                        version, kMinVersion, kVersion));
  }
  if (type != static_cast<uint16_t>(expected)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: message type %d, expected %d (%s)",
                                                      what, type, static_cast<int>(expected),
                                                      TypeName(expected)));
  }
  return absl::OkStatus();
}

absl::Status CheckDeadline(const WireHeader& h, absl::Time now, MessageType type) {
  if (h.deadline_unix_us != 0 && absl::FromUnixMicros(h.deadline_unix_us) < now) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "%s request arrived %s after its deadline", TypeName(type),
        absl::FormatDuration(now - absl::FromUnixMicros(h.deadline_unix_us))));
  }
  return absl::OkStatus();
}

}  // namespace

std::string EncodeWriteHeader(const LayerRows& rows, absl::Time deadline) {
  WriteRequest req;
  req.header.type = static_cast<uint16_t>(MessageType::kWrite);
  req.header.deadline_unix_us = ToWireDeadline(deadline);
  req.sequence = rows.sequence.id;
  req.start_row = rows.start_row;
  req.layer = rows.layer;
  req.n_rows = rows.n_rows;
  PutCapability(rows.sequence.cap, req.capability);
  return AsString(req);
}

Encoded EncodeGather(std::span<const GatherEntry> entries, absl::Time deadline) {
  GatherRequest req;
  req.header.type = static_cast<uint16_t>(MessageType::kGather);
  req.header.deadline_unix_us = ToWireDeadline(deadline);
  req.n_entries = static_cast<uint32_t>(entries.size());
  for (const GatherEntry& e : entries) req.total_indices += e.indices.size();
  Encoded out;
  out.header = AsString(req);
  out.payload.resize(entries.size() * sizeof(GatherEntryWire) +
                     req.total_indices * sizeof(uint32_t));
  uint8_t* p = out.payload.data();
  for (const GatherEntry& e : entries) {
    GatherEntryWire w{.sequence = e.sequence.id,
                      .layer = e.layer,
                      .head = e.head,
                      .n_indices = static_cast<uint32_t>(e.indices.size())};
    PutCapability(e.sequence.cap, w.capability);
    std::memcpy(p, &w, sizeof(w));
    p += sizeof(w);
  }
  for (const GatherEntry& e : entries) {
    if (e.indices.empty()) continue;
    std::memcpy(p, e.indices.data(), e.indices.size_bytes());
    p += e.indices.size_bytes();
  }
  return out;
}

Encoded EncodeRange(MessageType type, std::span<const RangeEntry> ranges, absl::Time deadline) {
  RangeRequest req;
  req.header.type = static_cast<uint16_t>(type);
  req.header.deadline_unix_us = ToWireDeadline(deadline);
  req.n_entries = static_cast<uint32_t>(ranges.size());
  Encoded out;
  out.header = AsString(req);
  out.payload.resize(ranges.size() * sizeof(RangeEntryWire));
  uint8_t* p = out.payload.data();
  for (const RangeEntry& r : ranges) {
    RangeEntryWire w{.sequence = r.sequence.id,
                     .layer = r.layer,
                     .head = r.head,
                     .start = r.start,
                     .n_rows = r.n_rows};
    PutCapability(r.sequence.cap, w.capability);
    std::memcpy(p, &w, sizeof(w));
    p += sizeof(w);
  }
  return out;
}

std::string EncodeReply(MessageType type, uint64_t payload_bytes, uint64_t value) {
  ReplyHeader reply;
  reply.type = static_cast<uint16_t>(type);
  reply.payload_bytes = payload_bytes;
  reply.value = value;
  return AsString(reply);
}

absl::StatusOr<WireHeader> ParseWireHeader(std::span<const uint8_t> header, MessageType expected,
                                           absl::Time now) {
  if (header.size() < sizeof(WireHeader)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "truncated %s header: %d bytes, need at least %d", TypeName(expected), header.size(),
        sizeof(WireHeader)));
  }
  WireHeader h;
  std::memcpy(&h, header.data(), sizeof(h));
  if (absl::Status st = CheckPrefix(h.magic, h.version, h.type, expected, TypeName(expected));
      !st.ok()) {
    return st;
  }
  if (absl::Status st = CheckDeadline(h, now, expected); !st.ok()) return st;
  return h;
}

absl::StatusOr<LayerRows> ParseWrite(std::span<const uint8_t> header,
                                     std::span<const uint8_t> payload, absl::Time now) {
  if (auto h = ParseWireHeader(header, MessageType::kWrite, now); !h.ok()) return h.status();
  auto req = ReadStruct<WriteRequest>(header, "write header");
  if (!req.ok()) return req.status();
  if (req->n_rows == 0) return absl::InvalidArgumentError("write of 0 rows");
  if (payload.size() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "write payload of %d bytes cannot be k and v of equal size", payload.size()));
  }
  // The per-row size is checked against the sequence's shape by the store.
  const size_t half = payload.size() / 2;
  LayerRows rows;
  rows.sequence = {req->sequence, GetCapability(req->capability)};
  rows.layer = req->layer;
  rows.start_row = req->start_row;
  rows.n_rows = req->n_rows;
  rows.k = payload.subspan(0, half);
  rows.v = payload.subspan(half, half);
  return rows;
}

absl::StatusOr<ParsedGather> ParseGather(std::span<const uint8_t> header,
                                         std::span<const uint8_t> payload, absl::Time now) {
  if (auto h = ParseWireHeader(header, MessageType::kGather, now); !h.ok()) return h.status();
  auto req = ReadStruct<GatherRequest>(header, "gather header");
  if (!req.ok()) return req.status();
  const uint64_t table_bytes = uint64_t{req->n_entries} * sizeof(GatherEntryWire);
  if (req->total_indices > (payload.size() / sizeof(uint32_t)) ||
      table_bytes + req->total_indices * sizeof(uint32_t) != payload.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "gather payload has %d bytes; %d entries and %d indices need %d", payload.size(),
        req->n_entries, req->total_indices,
        table_bytes + std::min<uint64_t>(req->total_indices, payload.size()) * sizeof(uint32_t)));
  }
  ParsedGather parsed;
  parsed.entries.resize(req->n_entries);
  std::span<const uint8_t> index_bytes = payload.subspan(table_bytes);
  const bool aligned = reinterpret_cast<uintptr_t>(index_bytes.data()) % alignof(uint32_t) == 0;
  const uint32_t* indices = reinterpret_cast<const uint32_t*>(index_bytes.data());
  if (!aligned) {
    parsed.index_storage.resize(req->total_indices);
    if (!index_bytes.empty()) {
      std::memcpy(parsed.index_storage.data(), index_bytes.data(), index_bytes.size());
    }
    indices = parsed.index_storage.data();
  }
  uint64_t next = 0;
  for (uint32_t i = 0; i < req->n_entries; ++i) {
    GatherEntryWire w;
    std::memcpy(&w, payload.data() + i * sizeof(GatherEntryWire), sizeof(w));
    if (w.n_indices > req->total_indices - next) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "gather entry %d claims %d indices but only %d of the request's %d remain", i,
          w.n_indices, req->total_indices - next, req->total_indices));
    }
    parsed.entries[i] = {.sequence = {w.sequence, GetCapability(w.capability)},
                         .layer = w.layer,
                         .head = w.head,
                         .indices = std::span<const uint32_t>(indices + next, w.n_indices)};
    next += w.n_indices;
  }
  if (next != req->total_indices) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "gather entries hold %d indices but the header says %d", next, req->total_indices));
  }
  return parsed;
}

absl::StatusOr<std::vector<RangeEntry>> ParseRange(MessageType type,
                                                   std::span<const uint8_t> header,
                                                   std::span<const uint8_t> payload,
                                                   absl::Time now) {
  if (auto h = ParseWireHeader(header, type, now); !h.ok()) return h.status();
  auto req = ReadStruct<RangeRequest>(header, "range header");
  if (!req.ok()) return req.status();
  if (uint64_t{req->n_entries} * sizeof(RangeEntryWire) != payload.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s payload has %d bytes; %d entries need %d", TypeName(type), payload.size(),
        req->n_entries, uint64_t{req->n_entries} * sizeof(RangeEntryWire)));
  }
  if (type == MessageType::kLocateRange && req->n_entries != 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("locate range takes exactly 1 entry, got %d", req->n_entries));
  }
  std::vector<RangeEntry> ranges(req->n_entries);
  for (uint32_t i = 0; i < req->n_entries; ++i) {
    RangeEntryWire w;
    std::memcpy(&w, payload.data() + i * sizeof(RangeEntryWire), sizeof(w));
    ranges[i] = {.sequence = {w.sequence, GetCapability(w.capability)},
                 .layer = w.layer,
                 .head = w.head,
                 .start = w.start,
                 .n_rows = w.n_rows};
  }
  return ranges;
}

absl::StatusOr<ReplyHeader> ParseReply(std::span<const uint8_t> header, MessageType expected) {
  auto reply = ReadStruct<ReplyHeader>(header, "reply header");
  if (!reply.ok()) return reply.status();
  if (absl::Status st =
          CheckPrefix(reply->magic, reply->version, reply->type, expected, "reply");
      !st.ok()) {
    return st;
  }
  return reply;
}

}  // namespace kvr::kv_store::wire
