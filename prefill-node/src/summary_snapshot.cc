#include "kvr/prefill_node/summary_snapshot.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/serialization.h"

namespace kvr::prefill_node {

std::string SnapshotKey(const std::string& model, const model::ModelConfig& config,
                        const std::string& method, const retrieval::IndexParams& params) {
  std::string key =
      absl::StrCat("model=", model, ";layers=", config.n_layers, ";heads=", config.n_heads,
                   ";kv_heads=", config.n_kv_heads, ";head_dim=", config.head_dim,
                   ";rope_theta=", config.rope_theta, ";method=", method, ";budget=", params.budget,
                   ";n_sink=", params.n_sink, ";local_window=", params.local_window,
                   ";gqa=", static_cast<int>(params.gqa), ";seed=", params.seed);
  // std::map: sorted, so the same options give the same key on every node.
  for (const auto& [name, value] : params.options) {
    absl::StrAppend(&key, ";option:", name, "=", value);
  }
  return key;
}

std::vector<uint8_t> FrameSnapshot(const std::string& key, std::span<const uint8_t> index_bytes) {
  retrieval::ByteWriter w;
  w.Put<uint32_t>(kSnapshotMagic);
  w.Put<uint16_t>(kSnapshotFormatVersion);
  w.Put<uint16_t>(0);
  w.PutString(key);
  w.Put<uint64_t>(index_bytes.size());
  w.PutBytes(index_bytes);
  return w.Take();
}

absl::StatusOr<std::unique_ptr<retrieval::RetrievalIndex>> OpenSnapshot(
    std::span<const uint8_t> attachment, uint64_t rows, const std::string& key,
    const std::string& method, const retrieval::IndexShape& shape,
    const retrieval::MethodRegistry& registry, const retrieval::IndexParams& params) {
  retrieval::ByteReader r(attachment);
  uint32_t magic = 0;
  uint16_t version = 0, reserved = 0;
  KVR_RETURN_IF_ERROR(r.Get("snapshot magic", &magic));
  if (magic != kSnapshotMagic) {
    return absl::FailedPreconditionError("snapshot magic: not a summary snapshot");
  }
  KVR_RETURN_IF_ERROR(r.Get("snapshot version", &version));
  KVR_RETURN_IF_ERROR(r.Get("snapshot reserved", &reserved));
  if (version != kSnapshotFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot version ", version, ", this node reads ", kSnapshotFormatVersion));
  }
  std::string stored_key;
  KVR_RETURN_IF_ERROR(r.GetString("snapshot key", &stored_key));
  if (stored_key != key) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot key: built for '", stored_key, "', this request is '", key, "'"));
  }
  uint64_t n = 0;
  KVR_RETURN_IF_ERROR(r.Get("snapshot index length", &n));
  // The index's bytes are the rest of the attachment, exactly.
  if (n != r.remaining()) {
    return absl::DataLossError(absl::StrCat("snapshot index: ", n, " bytes announced, ",
                                            r.remaining(), " in the attachment"));
  }
  KVR_ASSIGN_OR_RETURN(
      std::unique_ptr<retrieval::RetrievalIndex> index,
      retrieval::DeserializeIndex(attachment.subspan(r.offset()), registry, params, &shape));
  if (index->method() != method) {
    return absl::FailedPreconditionError(absl::StrCat(
        "snapshot method: '", std::string(index->method()), "', this request's is '", method, "'"));
  }
  if (index->size() != static_cast<int64_t>(rows)) {
    return absl::FailedPreconditionError(absl::StrCat("snapshot size: the index covers ",
                                                      index->size(), " tokens, the attachment ",
                                                      rows, " rows"));
  }
  return index;
}

absl::Status AppendPositions(retrieval::RetrievalIndex& index, const retrieval::TokenTensor& keys,
                             int64_t end, const retrieval::TokenTensor& queries,
                             int64_t queries_first_position) {
  const int64_t queries_end = queries_first_position + queries.n_tokens;
  for (int64_t at = index.size(); at < end;) {
    retrieval::AppendInput in;
    int64_t to = end;
    if (queries.n_tokens > 0 && at >= queries_first_position && at < queries_end) {
      to = std::min(end, queries_end);
      in.queries = {queries.data + (at - queries_first_position) * queries.row_stride, to - at,
                    queries.row_stride};
    } else if (queries.n_tokens > 0 && at < queries_first_position) {
      to = std::min(end, queries_first_position);
    }
    in.keys = {keys.data + at * keys.row_stride, to - at, keys.row_stride};
    KVR_RETURN_IF_ERROR(index.Append(in));
    if (index.size() != to) {
      return absl::InternalError(absl::StrCat("Append of positions [", at, ", ", to,
                                              ") left the index at ", index.size(), " tokens"));
    }
    at = to;
  }
  return absl::OkStatus();
}

}  // namespace kvr::prefill_node
