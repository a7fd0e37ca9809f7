#pragma once
// Retrieval summaries kept with a cached prefix, so that a later request that reuses the
// prefix's rows extends the prefix's summaries through each method's Append instead of
// rebuilding them over the whole prompt.
//
// Where they live: with the sequence in the KV store, one attachment per layer
// (KvStoreClient::PutAttachment). The store checks the sequence's capability, counts the
// bytes against its capacity, frees them with the sequence, and ForkSequence hands a child
// the attachments that describe rows it shares. So any prefill node that forks the sequence
// finds them, under the same access rules as the rows they summarise.
//
// Which rows: a later request reuses the aligned prefix `want` (prefill_engine.cc: a multiple
// of the backend's PrefixAlignment within the committed rows), never the parent's whole
// prompt unless it ends on the alignment; and the controller's prefix cache offers a
// sequence's prompt tokens only. So a retained request snapshots each layer's index at
// snapshot_rows = floor(L / align) * align, the boundary its own conversation's next turn
// reuses, and then Appends its last partial block to get the handoff's summaries: the handoff
// index is the snapshot's index extended (in memory: a method whose bytes round a running
// state, as keydiff's float mean, may differ in the last bits from Deserialize(snapshot) +
// Append), and a next turn that reuses those rows gets Deserialize(snapshot) + Append(its new
// rows), as a decode node appends generated tokens to the index it received. A snapshot of fewer
// rows than reused is still exact for what it covers, so it is extended over the difference too;
// one of more rows than a fork shares is dropped by the store.
//
// When it cannot be used (no attachment, a store without attachments, another model, method
// or parameters, bytes that do not parse, an index of another size or shape), the engine
// rebuilds from the rows as without a snapshot and says why in its log: the decode node always
// gets summaries of exactly the prompt's rows, in the method's own byte format.
//
// Attachment bytes (little-endian; persisted while the store keeps the sequence, so
// versioned):
//   u32 magic 'K','V','R','S'   u16 version (kSnapshotFormatVersion)   u16 reserved 0
//   u32 key length, key bytes (SnapshotKey: model, shape, method and parameters)
//   u64 index length, the index as retrieval::SerializeIndex writes it (registry.h)

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvr/model/config.h"
#include "kvr/retrieval/index.h"
#include "kvr/retrieval/registry.h"

namespace kvr::prefill_node {

inline constexpr uint32_t kSnapshotMagic = 0x5352564bu;  // "KVRS"
inline constexpr uint16_t kSnapshotFormatVersion = 1;

// What a snapshot must have been built for to be extended: the served model (name and
// shape), the method and every request parameter that reaches the index (budget, sink,
// window, method options; a method may scale its summaries with the budget). Deterministic, so
// equal on every prefill node; compared as a string, never hashed with a per-process seed.
[[nodiscard]] std::string SnapshotKey(const std::string& model, const model::ModelConfig& config,
                                      const std::string& method,
                                      const retrieval::IndexParams& params);

// The attachment bytes of `index_bytes` (SerializeIndex output) under `key`.
[[nodiscard]] std::vector<uint8_t> FrameSnapshot(const std::string& key,
                                                 std::span<const uint8_t> index_bytes);

// The index a snapshot holds, checked: magic, version, key == `key`, the index parses for
// `shape` (DeserializeIndex with expected_shape), is of `method` and covers exactly `rows`
// tokens. Errors say which check failed (FAILED_PRECONDITION for a snapshot of something
// else, DATA_LOSS / INVALID_ARGUMENT for bytes that do not parse).
[[nodiscard]] absl::StatusOr<std::unique_ptr<retrieval::RetrievalIndex>> OpenSnapshot(
    std::span<const uint8_t> attachment, uint64_t rows, const std::string& key,
    const std::string& method, const retrieval::IndexShape& shape,
    const retrieval::MethodRegistry& registry, const retrieval::IndexParams& params);

// Appends positions [index.size(), end) of `keys` ([>= end, n_kv_heads, head_dim], RoPE
// applied) through the index's Append, with the queries of the positions that have one:
// `queries` holds the queries of positions [queries_first_position, ...) (the engine keeps the
// last prefill queries only), and positions before them are appended without.
[[nodiscard]] absl::Status AppendPositions(retrieval::RetrievalIndex& index,
                                           const retrieval::TokenTensor& keys, int64_t end,
                                           const retrieval::TokenTensor& queries,
                                           int64_t queries_first_position);

}  // namespace kvr::prefill_node
