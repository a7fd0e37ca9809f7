#include "data_plane.h"

#include <cstring>
#include <memory>

#include "kvr/kv_store/wire.h"

namespace kvr::kv_store {
namespace {

using transport::Bytes;
using transport::IncomingRequest;
using wire::MessageType;

// A reply that cannot be sent means the client is gone; nothing is left to tell.
void Answer(IncomingRequest& req, const absl::Status& error) {
  (void)req.ReplyError(error);
}

void HandleWrite(PagedKvStore& store, IncomingRequest& req) {
  absl::StatusOr<LayerRows> rows = wire::ParseWrite(req.header(), req.payload(), absl::Now());
  if (!rows.ok()) return Answer(req, rows.status());
  absl::StatusOr<uint64_t> committed = store.Write(*rows);
  if (!committed.ok()) return Answer(req, committed.status());
  (void)req.Reply(transport::AsBytes(wire::EncodeReply(MessageType::kWrite, 0, *committed)));
}

void HandleGather(PagedKvStore& store, IncomingRequest& req) {
  absl::StatusOr<wire::ParsedGather> parsed =
      wire::ParseGather(req.header(), req.payload(), absl::Now());
  if (!parsed.ok()) return Answer(req, parsed.status());
  absl::StatusOr<uint64_t> bytes = store.GatherBytes(parsed->entries);
  if (!bytes.ok()) return Answer(req, bytes.status());
  Bytes out = Bytes::Uninitialized(*bytes);
  if (absl::Status st = store.Gather(parsed->entries, out.span()); !st.ok()) {
    return Answer(req, st);
  }
  (void)req.Reply(transport::AsBytes(wire::EncodeReply(MessageType::kGather, *bytes, 0)),
                  std::move(out));
}

void HandleRange(PagedKvStore& store, IncomingRequest& req) {
  absl::StatusOr<std::vector<RangeEntry>> ranges =
      wire::ParseRange(MessageType::kRangeRead, req.header(), req.payload(), absl::Now());
  if (!ranges.ok()) return Answer(req, ranges.status());
  absl::StatusOr<uint64_t> bytes = store.RangeBytes(*ranges);
  if (!bytes.ok()) return Answer(req, bytes.status());
  Bytes out = Bytes::Uninitialized(*bytes);
  if (absl::Status st = store.RangeRead(*ranges, out.span()); !st.ok()) return Answer(req, st);
  (void)req.Reply(transport::AsBytes(wire::EncodeReply(MessageType::kRangeRead, *bytes, 0)),
                  std::move(out));
}

void HandleLocate(PagedKvStore& store, IncomingRequest& req) {
  absl::StatusOr<std::vector<RangeEntry>> ranges =
      wire::ParseRange(MessageType::kLocateRange, req.header(), req.payload(), absl::Now());
  if (!ranges.ok()) return Answer(req, ranges.status());
  absl::StatusOr<std::vector<PagedKvStore::Segment>> segments = store.LocateRange((*ranges)[0]);
  if (!segments.ok()) return Answer(req, segments.status());
  Bytes out = Bytes::Uninitialized(segments->size() * sizeof(wire::SegmentWire));
  for (size_t i = 0; i < segments->size(); ++i) {
    wire::SegmentWire w{.pool_offset = (*segments)[i].pool_offset,
                        .bytes = (*segments)[i].bytes};
    std::memcpy(out.data() + i * sizeof(w), &w, sizeof(w));
  }
  const uint64_t n = segments->size();
  (void)req.Reply(
      transport::AsBytes(wire::EncodeReply(MessageType::kLocateRange, out.size(), n)),
      std::move(out));
}

}  // namespace

absl::Status RegisterDataPlaneHandlers(transport::Worker& worker, PagedKvStore& store,
                                       WorkQueue& queue) {
  using Fn = void (*)(PagedKvStore&, IncomingRequest&);
  const std::pair<MessageType, Fn> handlers[] = {{MessageType::kWrite, &HandleWrite},
                                                 {MessageType::kGather, &HandleGather},
                                                 {MessageType::kRangeRead, &HandleRange},
                                                 {MessageType::kLocateRange, &HandleLocate}};
  for (const auto& [type, fn] : handlers) {
    absl::Status st = worker.RegisterHandler(
        static_cast<transport::AmId>(type), [&store, &queue, fn](IncomingRequest request) {
          // Off the progress thread: a 16 MiB gather copy must not stall UCX progress.
          auto shared = std::make_shared<IncomingRequest>(std::move(request));
          if (!queue.Push([&store, fn, shared] { fn(store, *shared); })) {
            (void)shared->ReplyError(absl::UnavailableError("kvr-store is shutting down"));
          }
        });
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace kvr::kv_store
