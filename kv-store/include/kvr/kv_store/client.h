#pragma once
// The KV store client used by prefill and decode nodes.
//
// KvStoreClient is the seam: UcxKvStoreClient talks to a kvr-store over
// gRPC (control) and UCX (data); FakeKvStoreClient runs the same store core in-process with
// the same semantics and errors, for unit tests of the nodes.
//
// Deadlines: every call runs under ClientOptions::timeout from the moment it starts; control
// RPCs carry it as the gRPC deadline, data-plane messages carry it in their wire header (the
// store refuses work past it) and the transport fails the call locally when it passes.
//
// Access: every call about a sequence names it by SequenceRef (id + capability), directly or
// through the `sequence` field of LayerRows, GatherEntry and RangeEntry; the store refuses a
// wrong capability exactly as an unknown id (PERMISSION_DENIED), see PagedKvStore.
//
// Thread safety: all methods of both implementations may be called concurrently.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvr/common/tls.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/types.h"

namespace kvr::kv_store {

// A started data-plane operation (an explicit "in progress" state), so that
// prefill can overlap a layer's put with the next layer's compute and decode can overlap a
// gather with other work. The caller's buffers (the rows of a put, the output of a gather)
// must stay valid until Wait() returned; destroying an unfinished op waits for it.
class KvStoreOp {
 public:
  virtual ~KvStoreOp() = default;
  // True once Wait() would not block.
  [[nodiscard]] virtual bool Done() const = 0;
  // Blocks until the op finished. Puts: the layer's committed rows; gathers: the bytes
  // received. Once only; later calls return FAILED_PRECONDITION.
  [[nodiscard]] virtual absl::StatusOr<uint64_t> Wait() = 0;
};

class KvStoreClient {
 public:
  virtual ~KvStoreClient() = default;

  // Starts a PutLayer / Gather (same contracts as below) and returns at once.
  [[nodiscard]] virtual std::unique_ptr<KvStoreOp> StartPutLayer(const LayerRows& rows) = 0;
  [[nodiscard]] virtual std::unique_ptr<KvStoreOp> StartGather(
      std::span<const GatherEntry> entries, std::span<uint8_t> out) = 0;

  // Registers a sequence guarded by `ref.cap` (the caller's fresh Capability::Generate());
  // see PagedKvStore::CreateSequence.
  [[nodiscard]] virtual absl::StatusOr<CreateResult> CreateSequence(const SequenceRef& ref,
                                                                    const SequenceShape& shape,
                                                                    uint64_t expected_tokens,
                                                                    absl::Duration lease) = 0;
  // Creates sequence `child` from the first rows of `parent` (prefix reuse): the child starts
  // with the parent's rows [0, min(rows, parent's committed rows)) in every (layer, kv head),
  // sharing the parent's full pages; see PagedKvStore::ForkSequence. `child.cap` is the
  // caller's fresh Capability::Generate(); `parent` must carry the parent's capability.
  [[nodiscard]] virtual absl::StatusOr<ForkResult> ForkSequence(const SequenceRef& child,
                                                                const SequenceRef& parent,
                                                                uint64_t rows,
                                                                uint64_t expected_tokens,
                                                                absl::Duration lease) = 0;
  // Writes rows for all heads of one layer (prefill's layer-wise put; rows.start_row =
  // LayerRows::kAtEnd appends, as decode does) and returns the layer's committed rows.
  [[nodiscard]] absl::StatusOr<uint64_t> PutLayer(const LayerRows& rows) {
    return StartPutLayer(rows)->Wait();
  }
  // PutLayer at the layer's current end.
  [[nodiscard]] absl::StatusOr<uint64_t> Append(LayerRows rows) {
    rows.start_row = LayerRows::kAtEnd;
    return PutLayer(rows);
  }
  // Rows by index for many (sequence, layer, head) in ONE request, into `out` in request
  // order: out = concat over entries of [n_indices, 2 * head_dim]. `out` must be exactly the
  // size of those rows (GatherBytes, from the shapes the caller created).
  [[nodiscard]] absl::Status Gather(std::span<const GatherEntry> entries,
                                    std::span<uint8_t> out) {
    return StartGather(entries, out)->Wait().status();
  }
  // Contiguous rows; out = concat over ranges of [n_rows, 2 * head_dim].
  [[nodiscard]] virtual absl::Status RangeRead(std::span<const RangeEntry> ranges,
                                               std::span<uint8_t> out) = 0;
  [[nodiscard]] virtual absl::Status Release(const SequenceRef& ref, absl::Duration keep) = 0;
  [[nodiscard]] virtual absl::Status Lease(const SequenceRef& ref, absl::Duration lease) = 0;
  [[nodiscard]] virtual absl::StatusOr<SequenceInfo> GetSequence(const SequenceRef& ref) = 0;
  [[nodiscard]] virtual absl::StatusOr<StoreStats> Stats() = 0;

  // A layer's attachment, a small opaque blob kept with the sequence (types.h, Attachment; see
  // PagedKvStore::PutAttachment for the rules: capability, capacity, fork). Over the control
  // channel. A client or store without them answers UNIMPLEMENTED: callers treat attachments
  // as an optimisation and go on without.
  [[nodiscard]] virtual absl::Status PutAttachment(const SequenceRef& ref, uint32_t layer,
                                                   uint64_t rows, std::span<const uint8_t> bytes) {
    return absl::UnimplementedError("this store client keeps no attachments");
  }
  // NOT_FOUND when the layer has none.
  [[nodiscard]] virtual absl::StatusOr<Attachment> GetAttachment(const SequenceRef& ref,
                                                                 uint32_t layer) {
    return absl::UnimplementedError("this store client keeps no attachments");
  }

  // Zero-copy reads on the same host (local_pool.h). Makes sure pages exist for rows [0, rows)
  // of every (layer, head) of the sequence (allocating all-or-nothing; RESOURCE_EXHAUSTED names
  // the shortfall), and returns its page table; see PagedKvStore::ReservePageTable. Rows
  // appended later (Write/PutLayer at kAtEnd) land in exactly these pages. Valid only while
  // the sequence is not released: its pages then return to the pool and are reused.
  [[nodiscard]] virtual absl::StatusOr<PageTable> ReservePageTable(const SequenceRef& ref,
                                                                   uint64_t rows) = 0;
  // The store's pool mapped read-only in this process; FAILED_PRECONDITION "store <target> is
  // not on this host" (host_id differs) or "... offers no local socket", UNAVAILABLE when the
  // socket cannot be reached. Mapped once per client and shared, so many sequences use one
  // mapping; the mapping outlives the client if a holder keeps it.
  [[nodiscard]] virtual absl::StatusOr<std::shared_ptr<const LocalPoolMapping>> MapLocalPool() = 0;
  // OK while the connection works; UNAVAILABLE naming the store once the transport saw it die
  // (the data-plane endpoint failed). Such a client never recovers, even when a new store
  // comes up at the same address: drop it and connect again (StoreClientCache does).
  [[nodiscard]] virtual absl::Status Health() const { return absl::OkStatus(); }
  // The instance id of the store process this client is connected to (GetDataPlaneInfo);
  // "" when unknown.
  [[nodiscard]] virtual std::string instance_id() const { return ""; }
};

// Bytes of the reply to a gather of `entries` given each entry's row size.
[[nodiscard]] inline uint64_t GatherBytes(std::span<const GatherEntry> entries,
                                          size_t row_bytes) {
  uint64_t n = 0;
  for (const GatherEntry& e : entries) n += e.indices.size();
  return n * row_bytes;
}

// In-process fake over a real PagedKvStore (so semantics cannot drift). Can be told to fail
// every call with a given status, to test callers' error paths.
class FakeKvStoreClient final : public KvStoreClient {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<FakeKvStoreClient>> Create(
      StoreOptions options);

  absl::StatusOr<CreateResult> CreateSequence(const SequenceRef& ref, const SequenceShape& shape,
                                              uint64_t expected_tokens,
                                              absl::Duration lease) override;
  absl::StatusOr<ForkResult> ForkSequence(const SequenceRef& child, const SequenceRef& parent,
                                          uint64_t rows, uint64_t expected_tokens,
                                          absl::Duration lease) override;
  // Runs the operation at once; the returned op is already done.
  std::unique_ptr<KvStoreOp> StartPutLayer(const LayerRows& rows) override;
  std::unique_ptr<KvStoreOp> StartGather(std::span<const GatherEntry> entries,
                                         std::span<uint8_t> out) override;
  absl::Status RangeRead(std::span<const RangeEntry> ranges, std::span<uint8_t> out) override;
  absl::Status Release(const SequenceRef& ref, absl::Duration keep) override;
  absl::Status Lease(const SequenceRef& ref, absl::Duration lease) override;
  absl::StatusOr<SequenceInfo> GetSequence(const SequenceRef& ref) override;
  absl::StatusOr<StoreStats> Stats() override;
  absl::StatusOr<PageTable> ReservePageTable(const SequenceRef& ref, uint64_t rows) override;
  absl::Status PutAttachment(const SequenceRef& ref, uint32_t layer, uint64_t rows,
                             std::span<const uint8_t> bytes) override;
  absl::StatusOr<Attachment> GetAttachment(const SequenceRef& ref, uint32_t layer) override;
  // Maps the fake's own in-process pool a second time, read-only, through the pool's memfd:
  // the same pages at another address, exactly what a decode node on the store's host gets.
  // So code written against MapLocalPool runs unchanged on the fake.
  absl::StatusOr<std::shared_ptr<const LocalPoolMapping>> MapLocalPool() override;

  // Every later call fails with `status` (OK restores normal service).
  void InjectFailure(absl::Status status);
  PagedKvStore& store() { return *store_; }

 private:
  explicit FakeKvStoreClient(std::unique_ptr<PagedKvStore> store) : store_(std::move(store)) {}
  absl::Status Injected() const;

  std::unique_ptr<PagedKvStore> store_;
  mutable absl::Mutex mu_;
  absl::Status injected_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const LocalPoolMapping> local_pool_ ABSL_GUARDED_BY(mu_);
};

struct UcxClientOptions {
  // Budget of every call (gRPC deadline / data-plane deadline).
  absl::Duration timeout = absl::Seconds(10);
  // How long Connect waits for the store to answer (it waits for a store that is still
  // starting); zero: `timeout`. Nodes that reconnect after their store died keep it short, so
  // that a request placed on a store that is gone fails UNAVAILABLE instead of waiting.
  absl::Duration connect_timeout = absl::ZeroDuration();
  // Names this client in the store's errors and logs.
  std::string name = "kvr-store-client";
  // UCX configuration overrides for this client's context (see transport::ContextOptions);
  // empty: UCX_* environment.
  std::vector<std::pair<std::string, std::string>> ucx_config;
  // Range reads and gathers by RMA gets when the endpoint has native RMA (shared memory, RDMA)
  // and the store hands out its pool's rkey (kvr-store --rma-reads): the store only locates
  // the rows (checking the capability) and the client reads them from its pool, no store CPU
  // in the copy; a gather locates each (sequence, layer, head)'s rows once and batches its
  // gets. Otherwise, and always when false, by an active-message request answered with the
  // rows. Off by default: the rkey reads the whole pool past every capability check
  // (kv-store/README.md).
  bool rma_reads = false;
  // The gRPC control channel's transport security (kvr/common/tls.h); default plaintext.
  GrpcSecurity security;
};

// Real client: gRPC control channel + one UCX worker/endpoint to the store's data plane.
class UcxKvStoreClient final : public KvStoreClient {
 public:
  // `target` is the store's gRPC address ("host:port"). Fetches the store's worker address
  // and pool rkey over gRPC and connects the UCX endpoint.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<UcxKvStoreClient>> Connect(
      const std::string& target, UcxClientOptions options = {});
  ~UcxKvStoreClient() override;

  absl::StatusOr<CreateResult> CreateSequence(const SequenceRef& ref, const SequenceShape& shape,
                                              uint64_t expected_tokens,
                                              absl::Duration lease) override;
  // Over gRPC (ForkSequence), under the client's timeout.
  absl::StatusOr<ForkResult> ForkSequence(const SequenceRef& child, const SequenceRef& parent,
                                          uint64_t rows, uint64_t expected_tokens,
                                          absl::Duration lease) override;
  std::unique_ptr<KvStoreOp> StartPutLayer(const LayerRows& rows) override;
  std::unique_ptr<KvStoreOp> StartGather(std::span<const GatherEntry> entries,
                                         std::span<uint8_t> out) override;
  absl::Status RangeRead(std::span<const RangeEntry> ranges, std::span<uint8_t> out) override;
  absl::Status Release(const SequenceRef& ref, absl::Duration keep) override;
  absl::Status Lease(const SequenceRef& ref, absl::Duration lease) override;
  absl::StatusOr<SequenceInfo> GetSequence(const SequenceRef& ref) override;
  absl::StatusOr<StoreStats> Stats() override;
  // Over gRPC (ReservePageTable), under the client's timeout.
  absl::StatusOr<PageTable> ReservePageTable(const SequenceRef& ref, uint64_t rows) override;
  // Over gRPC (PutAttachment / GetAttachment), under the client's timeout.
  absl::Status PutAttachment(const SequenceRef& ref, uint32_t layer, uint64_t rows,
                             std::span<const uint8_t> bytes) override;
  absl::StatusOr<Attachment> GetAttachment(const SequenceRef& ref, uint32_t layer) override;
  // Checks that the store runs on this host (GetDataPlaneInfo's host_id equals this machine's
  // /proc/sys/kernel/random/boot_id), receives the pool's fd over the store's local socket
  // (within the client's timeout), checks that it is the pool the store announced (pool id,
  // page size, bytes) and maps it read-only. The first success is cached; failures are not.
  absl::StatusOr<std::shared_ptr<const LocalPoolMapping>> MapLocalPool() override;
  // The data-plane endpoint's health (transport::Endpoint::health).
  absl::Status Health() const override;
  std::string instance_id() const override;

  // Sends a raw data-plane message (for tests of the store's handling of malformed input):
  // returns the reply header or the store's error.
  [[nodiscard]] absl::StatusOr<std::string> RawCall(uint16_t am_id, std::span<const uint8_t> header,
                                                    std::span<const uint8_t> payload);
  // Opaque; named here (not private) so that the implementation's op type can refer to it.
  struct Impl;

  // "rma" when range reads use RMA get on this connection, "am" otherwise.
  [[nodiscard]] std::string range_read_path() const;
  // The UCX transports of the data-plane endpoint ("tcp/kvc123", "cma/memory", ...).
  [[nodiscard]] absl::StatusOr<std::vector<std::string>> DataPlaneTransports() const;

 private:
  explicit UcxKvStoreClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvr::kv_store
