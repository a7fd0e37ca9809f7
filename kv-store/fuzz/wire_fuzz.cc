// libFuzzer target: the store's data-plane message parsers (wire.h) on arbitrary header and
// payload bytes, as any UCX peer can send them. The first input byte picks the message type
// and the second the header length; the rest is header then payload.
// Checked beyond "no crash": what a parser accepted lies inside the bytes it was given, and
// encoding the parsed request again and parsing that gives the same request.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "absl/time/time.h"
#include "kvr/kv_store/wire.h"

namespace wire = ::kvr::kv_store::wire;
using ::kvr::kv_store::GatherEntry;
using ::kvr::kv_store::RangeEntry;

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

bool Same(const kvr::kv_store::SequenceRef& a, const kvr::kv_store::SequenceRef& b) {
  return a.id == b.id && a.cap.bytes == b.cap.bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t type = data[0];
  const size_t header_len = std::min<size_t>(data[1], size - 2);
  const std::span<const uint8_t> header(data + 2, header_len);
  const std::span<const uint8_t> payload(data + 2 + header_len, size - 2 - header_len);
  // Before every deadline a request may carry except "already past" ones (1 us after 1970).
  const absl::Time now = absl::FromUnixMicros(1);
  const absl::Time deadline = absl::FromUnixSeconds(4102444800);  // 2100
  auto inside = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    return n == 0 || (b >= payload.data() && b + n <= payload.data() + payload.size());
  };
  switch (type % 5) {
    case 0: {
      auto rows = wire::ParseWrite(header, payload, now);
      if (rows.ok()) {
        Check(inside(rows->k.data(), rows->k.size()) && inside(rows->v.data(), rows->v.size()));
        Check(rows->k.size() + rows->v.size() <= payload.size());
        const std::string again = wire::EncodeWriteHeader(*rows, deadline);
        auto reparsed = wire::ParseWrite(
            {reinterpret_cast<const uint8_t*>(again.data()), again.size()}, payload, now);
        Check(reparsed.ok() && Same(reparsed->sequence, rows->sequence) &&
              reparsed->layer == rows->layer && reparsed->n_rows == rows->n_rows &&
              reparsed->start_row == rows->start_row);
      }
      break;
    }
    case 1: {
      auto gather = wire::ParseGather(header, payload, now);
      if (gather.ok()) {
        for (const GatherEntry& e : gather->entries) {
          const auto* idx = reinterpret_cast<const uint8_t*>(e.indices.data());
          const auto* storage = reinterpret_cast<const uint8_t*>(gather->index_storage.data());
          const size_t bytes = e.indices.size() * sizeof(uint32_t);
          Check(inside(idx, bytes) ||
                (idx >= storage &&
                 idx + bytes <= storage + gather->index_storage.size() * sizeof(uint32_t)));
        }
        wire::Encoded again = wire::EncodeGather(gather->entries, deadline);
        auto reparsed = wire::ParseGather(
            {reinterpret_cast<const uint8_t*>(again.header.data()), again.header.size()},
            again.payload, now);
        Check(reparsed.ok() && reparsed->entries.size() == gather->entries.size());
        for (size_t i = 0; i < gather->entries.size(); ++i) {
          const GatherEntry& a = gather->entries[i];
          const GatherEntry& b = reparsed->entries[i];
          Check(Same(a.sequence, b.sequence) && a.layer == b.layer && a.head == b.head &&
                std::equal(a.indices.begin(), a.indices.end(), b.indices.begin(),
                           b.indices.end()));
        }
      }
      break;
    }
    case 2:
    case 3: {
      const wire::MessageType t =
          type % 5 == 2 ? wire::MessageType::kRangeRead : wire::MessageType::kLocateRange;
      auto ranges = wire::ParseRange(t, header, payload, now);
      if (ranges.ok()) {
        Check(ranges->size() * sizeof(wire::RangeEntryWire) <= payload.size());
        wire::Encoded again = wire::EncodeRange(t, *ranges, deadline);
        auto reparsed = wire::ParseRange(
            t, {reinterpret_cast<const uint8_t*>(again.header.data()), again.header.size()},
            again.payload, now);
        Check(reparsed.ok() && reparsed->size() == ranges->size());
        for (size_t i = 0; i < ranges->size(); ++i) {
          const RangeEntry& a = (*ranges)[i];
          const RangeEntry& b = (*reparsed)[i];
          Check(Same(a.sequence, b.sequence) && a.layer == b.layer && a.head == b.head &&
                a.start == b.start && a.n_rows == b.n_rows);
        }
      }
      break;
    }
    case 4: {
      (void)wire::ParseReply(header, static_cast<wire::MessageType>(1 + (type / 5) % 4));
      break;
    }
  }
  return 0;
}
