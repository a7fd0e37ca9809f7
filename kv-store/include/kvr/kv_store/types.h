#pragma once
// Domain types of the KV store, shared by the store core, the wire format, the services and
// the client library.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvr/common/fp8.h"

namespace kvr::kv_store {

// Chosen by the caller (the controller draws it at random for each attempt of a request). Ids
// are names, not secrets: knowing one grants nothing without the sequence's Capability.
using SequenceId = uint64_t;

// The secret that grants access to one sequence: 128 random bits fixed when the sequence is
// created. The store keeps it with the sequence and every operation on the sequence (control
// plane and data plane) must present it; a wrong or missing one is answered exactly like an
// unknown sequence id (PERMISSION_DENIED), so a caller without it cannot even tell whether the
// sequence exists. The all-zero value is "no capability": the store refuses to create a
// sequence with it, so it never matches. Never log a capability.
struct Capability {
  static constexpr size_t kBytes = 16;
  std::array<uint8_t, kBytes> bytes{};

  // 128 bits from the kernel's CSPRNG (kvr/common/secure_random.h); never all zero.
  [[nodiscard]] static Capability Generate();
  // Exactly kBytes bytes (as carried in protos); anything else is INVALID_ARGUMENT.
  [[nodiscard]] static absl::StatusOr<Capability> FromBytes(std::string_view bytes);
  // As FromBytes, but a malformed value becomes the all-zero capability, which matches no
  // sequence: for request handlers, so that a malformed capability gets the same answer as a
  // wrong one.
  [[nodiscard]] static Capability FromBytesOrNone(std::string_view bytes);
  [[nodiscard]] std::string ToBytes() const;
  [[nodiscard]] bool IsNone() const;
  // Constant time in the contents (no early exit), so that response timing does not reveal
  // how many leading bytes of a guess were right. Deliberately no operator==.
  [[nodiscard]] bool Matches(const Capability& other) const;
};

// What every store call about one sequence takes: its id and its capability.
struct SequenceRef {
  SequenceId id = 0;
  Capability cap;
};

// Element type of the stored rows; values match kvr.store.v1.DType and the wire format.
// kFp8E4m3: each stored row [k | v] of one (token, KV head) is one scaled fp8 row
// (kvr/common/fp8.h, Fp8RowLayout{2, head_dim}: k codes, v codes, k scale, v scale, zero pad;
// 136 bytes at head_dim 64, 264 at 128). Writers hand such a sequence bf16 K and V
// (WriteElementBytes) and the store encodes them; readers get the fp8 rows as stored.
enum class DType : uint8_t { kF32 = 1, kF16 = 2, kBf16 = 3, kFp8E4m3 = 4 };

// Bytes of one stored element: 4, 2, 2 and 1 (an fp8 code). An fp8 row also holds its scales,
// so a row's size comes from RowBytes, never from 2 * head_dim * DTypeSize.
[[nodiscard]] constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kFp8E4m3:
      return 1;
    default:
      return 2;
  }
}
// Bytes of one element of K or V as a writer hands them to the store (LayerRows): the stored
// element for f32, f16 and bf16; bf16 (2) for fp8, which the store encodes.
[[nodiscard]] constexpr size_t WriteElementBytes(DType dtype) {
  return dtype == DType::kF32 ? 4 : 2;
}
// Bytes of one stored row [k | v] of one (token, KV head).
[[nodiscard]] inline size_t RowBytes(DType dtype, uint32_t head_dim) {
  if (dtype == DType::kFp8E4m3) return Fp8RowLayout{2, static_cast<int>(head_dim)}.RowBytes();
  return 2 * size_t{head_dim} * DTypeSize(dtype);
}
[[nodiscard]] absl::StatusOr<DType> DTypeFromInt(uint32_t value);
[[nodiscard]] std::string DTypeName(DType dtype);

// One stored row [k | v] (RowBytes(dtype, head_dim) bytes, any alignment) as floats, K into
// `k` and V into `v` (head_dim each; v null: the keys only): exact for f32, f16 and bf16; fp8
// rows decoded (DecodeFp8Row's values). The second form writes [k | v] to `dst`.
void StoredRowToFloats(DType dtype, uint32_t head_dim, const uint8_t* row, float* k, float* v);
inline void StoredRowToFloats(DType dtype, uint32_t head_dim, const uint8_t* row, float* dst) {
  StoredRowToFloats(dtype, head_dim, row, dst, dst + head_dim);
}

// Shape of one sequence's KV: per (layer, kv_head) an append-only array of rows [k | v].
struct SequenceShape {
  uint32_t n_layers = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kF16;

  // Bytes of one stored [k | v] row: 2 * head_dim elements, or one fp8 row with its scales.
  [[nodiscard]] size_t RowBytes() const { return kv_store::RowBytes(dtype, head_dim); }
  // Bytes of K (or of V) for one token of one layer, all kv heads, as written (LayerRows):
  // bf16 for an fp8 sequence. Stored rows are RowBytes() each.
  [[nodiscard]] size_t TokenHalfBytes() const {
    return size_t{n_kv_heads} * head_dim * WriteElementBytes(dtype);
  }
  // Rejects zero or absurd dimensions with a message naming the field.
  [[nodiscard]] absl::Status Validate() const;
  bool operator==(const SequenceShape&) const = default;
};

// Rows of one (sequence, layer, kv_head) picked by index; the unit of a gather request.
struct GatherEntry {
  SequenceRef sequence;
  uint32_t layer = 0;
  uint32_t head = 0;
  std::span<const uint32_t> indices;  // [n_indices] row indices, any order, repeats allowed
};

// A contiguous run of rows [start, start + n_rows) of one (sequence, layer, kv_head).
struct RangeEntry {
  SequenceRef sequence;
  uint32_t layer = 0;
  uint32_t head = 0;
  uint64_t start = 0;
  uint64_t n_rows = 0;
};

// Rows for all kv heads of one layer, as a model produces them.
struct LayerRows {
  SequenceRef sequence;
  uint32_t layer = 0;
  // Row index of the first row. Rows are append-only, so it must equal the layer's current
  // length; kAtEnd appends wherever the layer currently ends (decode).
  uint64_t start_row = 0;
  uint32_t n_rows = 0;
  // K and V in the sequence's dtype, except for an fp8 sequence (DType::kFp8E4m3): bf16, which
  // the store encodes into one fp8 row per (token, KV head) (EncodeFp8Row of the widened
  // values, k and v scaled separately). Each SequenceShape::TokenHalfBytes() per row.
  std::span<const uint8_t> k;  // [n_rows, n_kv_heads, head_dim]
  std::span<const uint8_t> v;  // [n_rows, n_kv_heads, head_dim]
  static constexpr uint64_t kAtEnd = ~uint64_t{0};
};

struct StoreStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t page_bytes = 0;
  uint64_t total_pages = 0;
  uint64_t free_pages = 0;
  uint64_t sequences = 0;
  uint64_t evictions = 0;  // evictions_expired + evictions_cached_lru
  uint64_t expired_sequences = 0;
  std::string page_backing;
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  // Sequences evicted because their lease expired (evict_expired), and released-and-kept
  // ones evicted least recently used first (evict_cached); monotonic.
  uint64_t evictions_expired = 0;
  uint64_t evictions_cached_lru = 0;
  // Pages held by more than one sequence (ForkSequence), now.
  uint64_t shared_pages = 0;
  // ForkSequence calls that created a sequence, and the rows per (layer, kv head) they
  // started their children with (summed); monotonic.
  uint64_t forks = 0;
  uint64_t forked_rows = 0;
  // Released-and-kept sequences (cached for reuse, counted in `sequences`), and the bytes of
  // the pages only they hold: what evicting every one of them would free (with evict_cached;
  // 0 without). Capacity for new work is capacity_bytes - used_bytes + cached_bytes.
  uint64_t cached_sequences = 0;
  uint64_t cached_bytes = 0;
  // Cached sequences thinned (StoreOptions::cached_eviction = kThin) and the pages that freed;
  // monotonic. Not part of `evictions`, which counts whole sequences.
  uint64_t evictions_thinned = 0;
  uint64_t thinned_pages = 0;
};

// A small opaque blob kept with one layer of a sequence, describing its rows [0, rows) (a
// prefill node keeps the layer's retrieval summaries there so that a later request forked
// from the sequence can extend them instead of rebuilding them). The store does not look
// inside `bytes`; it uses `rows` only to decide what a fork keeps (PagedKvStore::PutAttachment).
struct Attachment {
  uint64_t rows = 0;
  std::vector<uint8_t> bytes;
};

// Largest attachment the store takes: well inside the control channel's 64 MiB messages.
inline constexpr uint64_t kMaxAttachmentBytes = uint64_t{32} << 20;

// What a reader may see of a sequence.
struct SequenceInfo {
  SequenceShape shape;
  std::vector<uint64_t> committed_rows;  // [n_layers]
  uint32_t tokens_per_page = 0;
  uint64_t pages = 0;
  int64_t lease_expiry_unix_ms = 0;  // 0: no expiry
  bool released_kept = false;
  // Pages thinning dropped (0: the sequence is whole), and then the rows [0, intact_rows)
  // stored whole in every (layer, kv head): a fork may take no more. Without holes,
  // intact_rows is the fewest committed rows of any layer.
  uint64_t thinned_pages = 0;
  uint64_t intact_rows = 0;
};

}  // namespace kvr::kv_store
