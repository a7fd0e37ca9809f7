// Host side of the GPU pariskv, ctkvr and a2ats selectors: the device layouts of CPU indexes,
// read from their payloads (the shipped bytes; retrieval/src/pariskv.cc, ctkvr.cc, a2ats.cc
// SerializePayload), so that what a prefill node ships can be uploaded as is.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/serialization.h"

namespace kvr::retrieval::cuda {
namespace {

absl::Status CheckMethod(const RetrievalIndex& index, std::string_view method, size_t b,
                         const IndexShape& shape) {
  if (index.method() != method) {
    return absl::InvalidArgumentError(absl::StrCat("layout of '", std::string(method), "': index ",
                                                   b, " is '", std::string(index.method()), "'"));
  }
  const IndexShape& s = index.shape();
  if (s.n_kv_heads != shape.n_kv_heads || s.n_heads != shape.n_heads ||
      s.head_dim != shape.head_dim || s.layer != shape.layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout of '", std::string(method), "': index ", b, " has another shape"));
  }
  return absl::OkStatus();
}

struct ParisHeader {
  uint32_t version = 0;
  int32_t m = 0, padded = 0;
  uint64_t seed = 0;
  std::vector<float> levels;
};

absl::Status ReadParisHeader(ByteReader& r, ParisHeader* h) {
  KVR_RETURN_IF_ERROR(r.Get("version", &h->version));
  KVR_RETURN_IF_ERROR(r.Get("subspace_dim", &h->m));
  KVR_RETURN_IF_ERROR(r.Get("padded_dim", &h->padded));
  KVR_RETURN_IF_ERROR(r.Get("seed", &h->seed));
  KVR_RETURN_IF_ERROR(r.GetArray("levels", &h->levels, 8));
  if (h->version != 1 || h->levels.size() != 8 || h->m < 2 || h->m > 8 || h->padded < h->m) {
    return absl::DataLossError("pariskv payload: unsupported version or corrupt header");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ParisKvCodec> ParisKvCodecFromIndex(const RetrievalIndex& index) {
  KVR_RETURN_IF_ERROR(CheckMethod(index, "pariskv", 0, index.shape()));
  ByteWriter w;
  KVR_RETURN_IF_ERROR(index.SerializePayload(w));
  ByteReader r(w.bytes());
  ParisHeader h;
  KVR_RETURN_IF_ERROR(ReadParisHeader(r, &h));
  ParisKvCodec c;
  c.head_dim = index.shape().head_dim;
  c.padded_dim = h.padded;
  c.subspace_dim = h.m;
  c.rotation_seed = h.seed;
  std::copy(h.levels.begin(), h.levels.end(), c.levels);
  return c;
}

absl::StatusOr<ParisKvHostLayout> ParisKvLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes) {
  ParisKvHostLayout out;
  if (indexes.empty()) return out;
  const IndexShape& shape = indexes[0]->shape();
  KVR_ASSIGN_OR_RETURN(out.codec, ParisKvCodecFromIndex(*indexes[0]));
  const int nkv = shape.n_kv_heads;
  const int pd = out.codec.padded_dim, m = out.codec.subspace_dim;
  const int n_sub = pd / m, n_cent = 1 << m;
  out.batch = static_cast<int>(indexes.size());
  out.n_kv_heads = nkv;
  for (const RetrievalIndex* index : indexes) {
    out.max_tokens = std::max(out.max_tokens, static_cast<int>(index->size()));
  }
  out.max_tokens = std::max(1, out.max_tokens);
  const size_t rows = static_cast<size_t>(out.batch) * nkv;
  out.codes.assign(rows * out.max_tokens * (pd / 2), 0);
  out.weights.assign(rows * out.max_tokens * n_sub, 0);
  out.counts.assign(rows * n_sub * n_cent, 0);
  out.n_tokens.assign(out.batch, 0);
  for (size_t b = 0; b < indexes.size(); ++b) {
    const RetrievalIndex& index = *indexes[b];
    KVR_RETURN_IF_ERROR(CheckMethod(index, "pariskv", b, shape));
    ByteWriter w;
    KVR_RETURN_IF_ERROR(index.SerializePayload(w));
    ByteReader r(w.bytes());
    ParisHeader h;
    KVR_RETURN_IF_ERROR(ReadParisHeader(r, &h));
    if (h.m != m || h.padded != pd || h.seed != out.codec.rotation_seed ||
        !std::equal(h.levels.begin(), h.levels.end(), out.codec.levels)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ParisKvLayoutFromIndexes: index ", b, " has another codec"));
    }
    const int64_t n = index.size();
    out.n_tokens[b] = static_cast<int32_t>(n);
    for (int hh = 0; hh < nkv; ++hh) {
      std::vector<uint8_t> codes;
      std::vector<uint16_t> weights;
      KVR_RETURN_IF_ERROR(r.GetArray("codes", &codes));
      KVR_RETURN_IF_ERROR(r.GetArray("weights", &weights));
      if (codes.size() != static_cast<size_t>(n) * (pd / 2) ||
          weights.size() != static_cast<size_t>(n) * n_sub) {
        return absl::DataLossError("ParisKvLayoutFromIndexes: payload sizes do not match");
      }
      const size_t row = b * nkv + hh;
      std::copy(codes.begin(), codes.end(), out.codes.begin() + row * out.max_tokens * (pd / 2));
      std::copy(weights.begin(), weights.end(),
                out.weights.begin() + row * out.max_tokens * n_sub);
      uint32_t* counts = out.counts.data() + row * n_sub * n_cent;
      for (int64_t t = 0; t < n; ++t) {
        const uint8_t* tc = codes.data() + t * (pd / 2);
        for (int sb = 0; sb < n_sub; ++sb) {
          const uint8_t* packed = tc + sb * (m / 2);
          uint32_t id = 0;
          for (int i = 0; i < m / 2; ++i) {
            const uint32_t byte = packed[i];
            id |= (((byte >> 3) & 1u) | ((byte >> 6) & 2u)) << (2 * i);
          }
          ++counts[sb * n_cent + id];
        }
      }
    }
  }
  return out;
}

absl::StatusOr<CtkvrHostLayout> CtkvrLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes) {
  CtkvrHostLayout out;
  if (indexes.empty()) return out;
  const IndexShape& shape = indexes[0]->shape();
  const int nkv = shape.n_kv_heads, hd = shape.head_dim, group = shape.group_size();
  struct Entry {
    std::vector<float> centroid;
    std::vector<int32_t> list;
  };
  std::vector<std::vector<std::vector<Entry>>> heads(indexes.size());  // [b][h][c]
  std::vector<std::vector<float>> keys(indexes.size());
  for (size_t b = 0; b < indexes.size(); ++b) {
    const RetrievalIndex& index = *indexes[b];
    KVR_RETURN_IF_ERROR(CheckMethod(index, "ctkvr", b, shape));
    ByteWriter w;
    KVR_RETURN_IF_ERROR(index.SerializePayload(w));
    ByteReader r(w.bytes());
    uint8_t gqa = 0;
    int64_t n_sink = 0, n_centroids = 0, rho = 0, n_recall = 0, fifo = 0, cursor = 0;
    KVR_RETURN_IF_ERROR(r.Get("gqa", &gqa));
    KVR_RETURN_IF_ERROR(r.Get("n_sink", &n_sink));
    KVR_RETURN_IF_ERROR(r.Get("C", &n_centroids));
    KVR_RETURN_IF_ERROR(r.Get("rho", &rho));
    KVR_RETURN_IF_ERROR(r.Get("C'", &n_recall));
    KVR_RETURN_IF_ERROR(r.Get("fifo", &fifo));
    KVR_RETURN_IF_ERROR(r.Get("cursor", &cursor));
    KVR_RETURN_IF_ERROR(r.GetArray("keys", &keys[b]));
    if (b == 0) out.n_recall = static_cast<int>(n_recall);
    if (n_recall != out.n_recall || n_recall < 1 || n_recall > 32) {
      return absl::InvalidArgumentError(
          absl::StrCat("CtkvrLayoutFromIndexes: C' must be in [1, 32] and equal over the batch; "
                       "index ",
                       b, " has ", n_recall));
    }
    heads[b].resize(nkv);
    for (int h = 0; h < nkv; ++h) {
      heads[b][h].resize(n_centroids);
      for (Entry& e : heads[b][h]) {
        std::vector<float> norms;
        float threshold = 0.f;
        KVR_RETURN_IF_ERROR(r.GetArray("centroid", &e.centroid));
        KVR_RETURN_IF_ERROR(r.GetArray("norms", &norms));
        KVR_RETURN_IF_ERROR(r.GetArray("list", &e.list));
        KVR_RETURN_IF_ERROR(r.Get("threshold", &threshold));
        out.max_list_length = std::max(out.max_list_length, static_cast<int>(e.list.size()));
      }
      int total = 0;
      for (const Entry& e : heads[b][h]) total += static_cast<int>(e.list.size());
      out.max_list_entries = std::max(out.max_list_entries, total);
    }
    out.max_centroids = std::max(out.max_centroids, static_cast<int>(n_centroids));
    out.max_tokens = std::max(out.max_tokens, static_cast<int>(index.size()));
  }
  out.batch = static_cast<int>(indexes.size());
  out.n_kv_heads = nkv;
  out.group = group;
  out.head_dim = hd;
  out.max_centroids = std::max(1, out.max_centroids);
  out.max_list_entries = std::max(1, out.max_list_entries);
  out.max_tokens = std::max(1, out.max_tokens);
  const size_t rows = static_cast<size_t>(out.batch) * nkv;
  const size_t cent = static_cast<size_t>(group) * hd;
  out.centroids.assign(rows * out.max_centroids * cent, 0.f);
  out.n_centroids.assign(rows, 0);
  out.list_offsets.assign(rows * (out.max_centroids + 1), 0);
  out.lists.assign(rows * out.max_list_entries, -1);
  const size_t key_row = static_cast<size_t>(nkv) * hd;
  out.keys.assign(static_cast<size_t>(out.batch) * out.max_tokens * key_row, 0.f);
  for (int b = 0; b < out.batch; ++b) {
    std::copy(keys[b].begin(), keys[b].end(),
              out.keys.begin() + static_cast<size_t>(b) * out.max_tokens * key_row);
    for (int h = 0; h < nkv; ++h) {
      const size_t row = static_cast<size_t>(b) * nkv + h;
      const auto& entries = heads[b][h];
      out.n_centroids[row] = static_cast<int32_t>(entries.size());
      int32_t* offsets = out.list_offsets.data() + row * (out.max_centroids + 1);
      int32_t pos = 0;
      for (size_t c = 0; c < entries.size(); ++c) {
        const Entry& e = entries[c];
        offsets[c] = pos;
        if (e.centroid.size() == cent) {
          std::copy(e.centroid.begin(), e.centroid.end(),
                    out.centroids.begin() + (row * out.max_centroids + c) * cent);
        }
        std::copy(e.list.begin(), e.list.end(),
                  out.lists.begin() + row * out.max_list_entries + pos);
        pos += static_cast<int32_t>(e.list.size());
      }
      for (size_t c = entries.size(); c <= static_cast<size_t>(out.max_centroids); ++c) {
        offsets[c] = pos;
      }
    }
  }
  return out;
}

absl::StatusOr<A2atsHostLayout> A2atsLayoutFromIndexes(
    std::span<const RetrievalIndex* const> indexes, const MethodAssets& assets) {
  A2atsHostLayout out;
  if (indexes.empty()) return out;
  const auto* books = dynamic_cast<const A2atsCodebooks*>(&assets);
  if (books == nullptr || assets.kind() != kA2atsCodebooksKind) {
    return absl::InvalidArgumentError("A2atsLayoutFromIndexes: assets are not A2atsCodebooks");
  }
  const IndexShape& shape = indexes[0]->shape();
  const int nkv = shape.n_kv_heads, hd = shape.head_dim;
  out.batch = static_cast<int>(indexes.size());
  out.n_kv_heads = nkv;
  out.head_dim = hd;
  out.rope = shape.rope;
  out.wrope_offset = books->params().wrope_offset;
  if (shape.layer < 0 || shape.layer >= books->model().n_layers ||
      books->model().n_kv_heads != nkv || books->model().head_dim != hd) {
    return absl::InvalidArgumentError("A2atsLayoutFromIndexes: codebooks of another shape");
  }
  out.codebook_size = books->head(shape.layer, 0).size;
  out.chol_inv.assign(static_cast<size_t>(nkv) * hd * hd, 0.f);
  out.codewords.resize(static_cast<size_t>(nkv) * out.codebook_size * hd);
  for (int h = 0; h < nkv; ++h) {
    const HeadCodebook& book = books->head(shape.layer, h);
    if (book.size != out.codebook_size || book.head_dim != hd ||
        book.chol.size() != static_cast<size_t>(hd) * hd ||
        book.codewords.size() != static_cast<size_t>(book.size) * hd) {
      return absl::InvalidArgumentError(
          "A2atsLayoutFromIndexes: codebooks of one layer must share one size");
    }
    // L^-1 by forward substitution in double, one column at a time (L X = I).
    std::vector<double> col(hd);
    float* inv = out.chol_inv.data() + static_cast<size_t>(h) * hd * hd;
    for (int c = 0; c < hd; ++c) {
      for (int i = 0; i < hd; ++i) {
        double s = i == c ? 1.0 : 0.0;
        for (int j = c; j < i; ++j) s -= static_cast<double>(book.chol[static_cast<size_t>(i) * hd + j]) * col[j];
        col[i] = i < c ? 0.0 : s / book.chol[static_cast<size_t>(i) * hd + i];
      }
      for (int i = c; i < hd; ++i) inv[static_cast<size_t>(i) * hd + c] = static_cast<float>(col[i]);
    }
    std::copy(book.codewords.begin(), book.codewords.end(),
              out.codewords.begin() + static_cast<size_t>(h) * out.codebook_size * hd);
  }
  for (const RetrievalIndex* index : indexes) {
    out.max_tokens = std::max(out.max_tokens, static_cast<int>(index->size()));
  }
  out.max_tokens = std::max(1, out.max_tokens);
  out.ids.assign(static_cast<size_t>(out.batch) * nkv * out.max_tokens, 0);
  out.n_tokens.assign(out.batch, 0);
  for (size_t b = 0; b < indexes.size(); ++b) {
    const RetrievalIndex& index = *indexes[b];
    KVR_RETURN_IF_ERROR(CheckMethod(index, "a2ats", b, shape));
    ByteWriter w;
    KVR_RETURN_IF_ERROR(index.SerializePayload(w));
    ByteReader r(w.bytes());
    uint32_t version = 0;
    uint64_t hash = 0;
    int32_t size = 0;
    KVR_RETURN_IF_ERROR(r.Get("version", &version));
    KVR_RETURN_IF_ERROR(r.Get("hash", &hash));
    KVR_RETURN_IF_ERROR(r.Get("codebook size", &size));
    if (hash != books->content_hash() || size != out.codebook_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("A2atsLayoutFromIndexes: index ", b, " was built with other codebooks"));
    }
    out.n_tokens[b] = static_cast<int32_t>(index.size());
    for (int h = 0; h < nkv; ++h) {
      std::vector<uint16_t> ids;
      KVR_RETURN_IF_ERROR(r.GetArray("ids", &ids));
      std::copy(ids.begin(), ids.end(),
                out.ids.begin() + (b * nkv + h) * static_cast<size_t>(out.max_tokens));
    }
  }
  return out;
}

}  // namespace kvr::retrieval::cuda
