#include "data_plane.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kvr/kv_store/wire.h"

namespace kvr::kv_store {
namespace {

using transport::Bytes;
using transport::IncomingRequest;
using wire::MessageType;

// A reply that cannot be sent means the client is gone; nothing is left to tell.
void Answer(IncomingRequest& req, const absl::Status& error) { (void)req.ReplyError(error); }

void HandleWrite(PagedKvStore& store, ReplyBufferPool&, IncomingRequest& req) {
  absl::StatusOr<LayerRows> rows = wire::ParseWrite(req.header(), req.payload(), absl::Now());
  if (!rows.ok()) return Answer(req, rows.status());
  absl::StatusOr<uint64_t> committed = store.Write(*rows);
  if (!committed.ok()) return Answer(req, committed.status());
  (void)req.Reply(transport::AsBytes(wire::EncodeReply(MessageType::kWrite, 0, *committed)));
}

// Sends `buffer` as the reply payload; the buffer goes back to its pool once UCX is done
// with it (or at once if the reply cannot be sent).
void ReplyWithBuffer(IncomingRequest& req, MessageType type,
                     std::shared_ptr<ReplyBufferPool::Buffer> buffer) {
  const std::span<uint8_t> rows = buffer->span();
  (void)req.Reply(transport::AsBytes(wire::EncodeReply(type, rows.size(), 0)),
                  {transport::ByteView(rows)}, [buffer](absl::Status) {});
}

void HandleGather(PagedKvStore& store, ReplyBufferPool& buffers, IncomingRequest& req) {
  absl::StatusOr<wire::ParsedGather> parsed =
      wire::ParseGather(req.header(), req.payload(), absl::Now());
  if (!parsed.ok()) return Answer(req, parsed.status());
  absl::StatusOr<uint64_t> bytes = store.GatherBytes(parsed->entries);
  if (!bytes.ok()) return Answer(req, bytes.status());
  absl::StatusOr<std::shared_ptr<ReplyBufferPool::Buffer>> out = buffers.Acquire(*bytes);
  if (!out.ok()) return Answer(req, out.status());
  if (absl::Status st = store.Gather(parsed->entries, (*out)->span()); !st.ok()) {
    return Answer(req, st);
  }
  ReplyWithBuffer(req, MessageType::kGather, *std::move(out));
}

void HandleRange(PagedKvStore& store, ReplyBufferPool& buffers, IncomingRequest& req) {
  absl::StatusOr<std::vector<RangeEntry>> ranges =
      wire::ParseRange(MessageType::kRangeRead, req.header(), req.payload(), absl::Now());
  if (!ranges.ok()) return Answer(req, ranges.status());
  absl::StatusOr<uint64_t> bytes = store.RangeBytes(*ranges);
  if (!bytes.ok()) return Answer(req, bytes.status());
  absl::StatusOr<std::shared_ptr<ReplyBufferPool::Buffer>> out = buffers.Acquire(*bytes);
  if (!out.ok()) return Answer(req, out.status());
  if (absl::Status st = store.RangeRead(*ranges, (*out)->span()); !st.ok()) {
    return Answer(req, st);
  }
  ReplyWithBuffer(req, MessageType::kRangeRead, *std::move(out));
}

void HandleLocate(PagedKvStore& store, ReplyBufferPool&, IncomingRequest& req) {
  absl::StatusOr<std::vector<RangeEntry>> ranges =
      wire::ParseRange(MessageType::kLocateRange, req.header(), req.payload(), absl::Now());
  if (!ranges.ok()) return Answer(req, ranges.status());
  absl::StatusOr<std::vector<PagedKvStore::Segment>> segments = store.LocateRange((*ranges)[0]);
  if (!segments.ok()) return Answer(req, segments.status());
  Bytes out = Bytes::Uninitialized(segments->size() * sizeof(wire::SegmentWire));
  for (size_t i = 0; i < segments->size(); ++i) {
    wire::SegmentWire w{.pool_offset = (*segments)[i].pool_offset, .bytes = (*segments)[i].bytes};
    std::memcpy(out.data() + i * sizeof(w), &w, sizeof(w));
  }
  const uint64_t n = segments->size();
  (void)req.Reply(transport::AsBytes(wire::EncodeReply(MessageType::kLocateRange, out.size(), n)),
                  std::move(out));
}

void HandleLocateOff(PagedKvStore&, ReplyBufferPool&, IncomingRequest& req) {
  Answer(req, absl::FailedPreconditionError(
                  "this store serves no RMA reads (start it with --rma-reads); use range reads"));
}

}  // namespace

absl::StatusOr<std::shared_ptr<ReplyBufferPool::Buffer>> ReplyBufferPool::Acquire(size_t size) {
  if (size > limits_.max_reply_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a reply of ", size, " bytes exceeds the store's max_reply_bytes ",
                     limits_.max_reply_bytes, "; ask for fewer rows per request"));
  }
  Idle chosen;
  {
    absl::MutexLock lock(&mu_);
    if (outstanding_ + size > limits_.max_outstanding_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the store is busy: ", outstanding_, " bytes of replies in flight, a reply of ", size,
          " would pass max_outstanding_reply_bytes ", limits_.max_outstanding_bytes, "; retry"));
    }
    outstanding_ += size;
    // Smallest idle buffer that fits.
    size_t best = idle_.size();
    for (size_t i = 0; i < idle_.size(); ++i) {
      if (idle_[i].capacity >= size &&
          (best == idle_.size() || idle_[i].capacity < idle_[best].capacity)) {
        best = i;
      }
    }
    if (best != idle_.size()) {
      chosen = std::move(idle_[best]);
      idle_.erase(idle_.begin() + static_cast<ptrdiff_t>(best));
    }
  }
  if (chosen.data == nullptr) {
    chosen.capacity = std::max<size_t>(size, 1);
    chosen.data = std::make_unique_for_overwrite<uint8_t[]>(chosen.capacity);
  }
  return std::make_shared<Buffer>(this, std::move(chosen.data), chosen.capacity, size);
}

void ReplyBufferPool::Return(std::unique_ptr<uint8_t[]> data, size_t capacity, size_t size) {
  absl::MutexLock lock(&mu_);
  outstanding_ -= size;
  if (data == nullptr || capacity > max_kept_bytes_) return;
  if (idle_.size() >= max_buffers_) {
    // Drop the smallest: big buffers are the expensive ones to fault in again.
    auto smallest = std::min_element(idle_.begin(), idle_.end(), [](const Idle& a, const Idle& b) {
      return a.capacity < b.capacity;
    });
    if (smallest == idle_.end() || smallest->capacity >= capacity) return;
    idle_.erase(smallest);
  }
  idle_.push_back({std::move(data), capacity});
}

absl::Status RegisterDataPlaneHandlers(transport::Worker& worker, PagedKvStore& store,
                                       WorkQueue& queue, ReplyBufferPool& buffers, bool rma_reads) {
  using Fn = void (*)(PagedKvStore&, ReplyBufferPool&, IncomingRequest&);
  const std::pair<MessageType, Fn> handlers[] = {
      {MessageType::kWrite, &HandleWrite},
      {MessageType::kGather, &HandleGather},
      {MessageType::kRangeRead, &HandleRange},
      {MessageType::kLocateRange, rma_reads ? &HandleLocate : &HandleLocateOff}};
  // Not a structured binding: clang before 16 cannot capture one in a lambda.
  for (const auto& handler : handlers) {
    const Fn fn = handler.second;
    absl::Status st = worker.RegisterHandler(
        static_cast<transport::AmId>(handler.first),
        [&store, &queue, &buffers, fn](IncomingRequest request) {
          // Off the progress thread: a 16 MiB gather copy must not stall UCX progress.
          auto shared = std::make_shared<IncomingRequest>(std::move(request));
          if (!queue.Push([&store, &buffers, fn, shared] { fn(store, buffers, *shared); })) {
            (void)shared->ReplyError(absl::UnavailableError("kvr-store is shutting down"));
          }
        });
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace kvr::kv_store
