#include "kvr/retrieval/registry.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/serialization.h"
#include "method_util.h"

namespace kvr::retrieval {

absl::Status MethodRegistry::Register(std::string name, std::string description, Factory factory,
                                      Deserializer deserializer) {
  if (name.empty()) return absl::InvalidArgumentError("retrieval registry: empty method name");
  if (!factory || !deserializer) {
    return absl::InvalidArgumentError(
        absl::StrCat("retrieval registry: method '", name, "' needs a factory and a deserializer"));
  }
  if (Has(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("retrieval registry: method '", name, "' is already registered"));
  }
  entries_.push_back(
      {std::move(name), std::move(description), std::move(factory), std::move(deserializer)});
  return absl::OkStatus();
}

bool MethodRegistry::Has(std::string_view method) const {
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.name == method; });
}

std::vector<std::string> MethodRegistry::Names() const {
  std::vector<std::string> names;
  for (const Entry& e : entries_) names.push_back(e.name);
  std::sort(names.begin(), names.end());
  return names;
}

std::string MethodRegistry::Describe() const {
  std::string out;
  for (const Entry& e : entries_) absl::StrAppend(&out, e.name, ": ", e.description, "\n");
  return out;
}

absl::StatusOr<std::unique_ptr<RetrievalIndex>> MethodRegistry::Make(
    std::string_view method, const IndexShape& shape, const IndexParams& params) const {
  for (const Entry& e : entries_) {
    if (e.name != method) continue;
    KVR_RETURN_IF_ERROR(shape.Validate());
    KVR_RETURN_IF_ERROR(params.Validate());
    return e.factory(shape, params);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown retrieval method '", std::string(method),
                   "'; valid methods: ", absl::StrJoin(Names(), ", ")));
}

absl::StatusOr<const MethodRegistry::Deserializer*> MethodRegistry::FindDeserializer(
    std::string_view method) const {
  for (const Entry& e : entries_) {
    if (e.name == method) return &e.deserializer;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("index bytes name retrieval method '", std::string(method),
                   "', which this registry lacks; valid methods: ", absl::StrJoin(Names(), ", ")));
}

absl::StatusOr<std::vector<uint8_t>> SerializeIndex(const RetrievalIndex& index) {
  ByteWriter w;
  const IndexShape& s = index.shape();
  w.Put<uint32_t>(kIndexMagic);
  w.Put<uint16_t>(kIndexFormatVersion);
  w.Put<uint16_t>(0);
  w.PutString(index.method());
  w.Put<int32_t>(s.n_heads);
  w.Put<int32_t>(s.n_kv_heads);
  w.Put<int32_t>(s.head_dim);
  w.Put<int32_t>(s.layer);
  w.Put<int32_t>(s.n_layers);
  internal::PutRope(w, s.rope);
  w.Put<int64_t>(index.size());
  // The payload is written in place after its length, which is patched once known (no second
  // buffer and copy: summaries are MBs per layer on the prefill node's hot path).
  const size_t length_at = w.size();
  w.Put<uint64_t>(0);
  KVR_RETURN_IF_ERROR(index.SerializePayload(w));
  const uint64_t length = w.size() - length_at - sizeof(uint64_t);
  std::memcpy(w.bytes().data() + length_at, &length, sizeof(length));
  return w.Take();
}

absl::StatusOr<std::unique_ptr<RetrievalIndex>> DeserializeIndex(std::span<const uint8_t> bytes,
                                                                 const MethodRegistry& registry,
                                                                 const IndexParams& params,
                                                                 const IndexShape* expected_shape) {
  ByteReader r(bytes);
  uint32_t magic = 0;
  KVR_RETURN_IF_ERROR(r.Get("magic", &magic));
  if (magic != kIndexMagic) {
    return absl::InvalidArgumentError(absl::StrCat("index bytes: bad magic 0x", absl::Hex(magic),
                                                   " (expected 'KVRI'); not a kvr index"));
  }
  uint16_t version = 0, reserved = 0;
  KVR_RETURN_IF_ERROR(r.Get("version", &version));
  if (version != kIndexFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat("index bytes: format version ", version,
                                                   " is not supported (this build reads ",
                                                   kIndexFormatVersion, ")"));
  }
  KVR_RETURN_IF_ERROR(r.Get("reserved", &reserved));
  std::string method;
  KVR_RETURN_IF_ERROR(r.GetString("method", &method, 64));
  IndexShape shape;
  KVR_RETURN_IF_ERROR(r.Get("n_heads", &shape.n_heads));
  KVR_RETURN_IF_ERROR(r.Get("n_kv_heads", &shape.n_kv_heads));
  KVR_RETURN_IF_ERROR(r.Get("head_dim", &shape.head_dim));
  KVR_RETURN_IF_ERROR(r.Get("layer", &shape.layer));
  KVR_RETURN_IF_ERROR(r.Get("n_layers", &shape.n_layers));
  KVR_RETURN_IF_ERROR(internal::GetRope(r, "index bytes", &shape.rope));
  if (absl::Status s = shape.Validate(); !s.ok()) {
    return absl::DataLossError(absl::StrCat("index bytes: corrupt shape: ", s.message()));
  }
  if (shape.head_dim > 4096 || shape.n_heads > 4096) {
    return absl::DataLossError("index bytes: implausible shape (head_dim or n_heads > 4096)");
  }
  if (expected_shape != nullptr) {
    const IndexShape& e = *expected_shape;
    if (e.n_heads != shape.n_heads || e.n_kv_heads != shape.n_kv_heads ||
        e.head_dim != shape.head_dim || e.layer != shape.layer ||
        (e.n_layers != 0 && shape.n_layers != 0 && e.n_layers != shape.n_layers)) {
      return absl::InvalidArgumentError(
          absl::StrCat("index bytes are for another model or layer: got heads ", shape.n_heads, "/",
                       shape.n_kv_heads, " head_dim ", shape.head_dim, " layer ", shape.layer, "/",
                       shape.n_layers, ", expected ", e.n_heads, "/", e.n_kv_heads, " head_dim ",
                       e.head_dim, " layer ", e.layer, "/", e.n_layers));
    }
  }
  int64_t size = 0;
  KVR_RETURN_IF_ERROR(r.Get("size", &size));
  if (size < 0) return absl::DataLossError(absl::StrCat("index bytes: negative size ", size));
  uint64_t payload_len = 0;
  KVR_RETURN_IF_ERROR(r.Get("payload length", &payload_len));
  ByteReader payload({});
  KVR_RETURN_IF_ERROR(r.Sub("payload", payload_len, &payload));
  KVR_RETURN_IF_ERROR(r.ExpectEnd("the payload"));
  KVR_ASSIGN_OR_RETURN(const MethodRegistry::Deserializer* deserialize,
                       registry.FindDeserializer(method));
  KVR_ASSIGN_OR_RETURN(std::unique_ptr<RetrievalIndex> index,
                       (*deserialize)(shape, params, size, payload));
  KVR_RETURN_IF_ERROR(payload.ExpectEnd(absl::StrCat("the ", method, " payload")));
  if (index->size() != size) {
    return absl::DataLossError(absl::StrCat("index bytes: header says ", size, " tokens, the ",
                                            method, " payload holds ", index->size()));
  }
  return index;
}

}  // namespace kvr::retrieval
