// Host side of the GPU pariskv, ctkvr and a2ats selectors: the device layouts of CPU indexes,
// read through the indexes' typed state (ParisKvStateOf, CtkvrStateOf, A2atsStateOf), not
// their serialised payloads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/a2ats.h"
#include "kvr/retrieval/codebook.h"
#include "kvr/retrieval/ctkvr.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "kvr/retrieval/pariskv.h"

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

}  // namespace

absl::StatusOr<ParisKvCodec> ParisKvCodecFromIndex(const RetrievalIndex& index) {
  KVR_RETURN_IF_ERROR(CheckMethod(index, "pariskv", 0, index.shape()));
  KVR_ASSIGN_OR_RETURN(const ParisKvState st, ParisKvStateOf(index));
  if (st.levels.size() != 8) {
    return absl::InternalError(absl::StrCat("pariskv: ", st.levels.size(), " levels, not 8"));
  }
  ParisKvCodec c;
  c.head_dim = index.shape().head_dim;
  c.padded_dim = st.padded_dim;
  c.subspace_dim = st.subspace_dim;
  c.rotation_seed = st.rotation_seed;
  std::copy(st.levels.begin(), st.levels.end(), c.levels);
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
    KVR_ASSIGN_OR_RETURN(const ParisKvState st, ParisKvStateOf(index));
    if (st.subspace_dim != m || st.padded_dim != pd ||
        st.rotation_seed != out.codec.rotation_seed ||
        !std::equal(st.levels.begin(), st.levels.end(), out.codec.levels)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ParisKvLayoutFromIndexes: index ", b, " has another codec"));
    }
    const int64_t n = index.size();
    out.n_tokens[b] = static_cast<int32_t>(n);
    for (int hh = 0; hh < nkv; ++hh) {
      const ParisKvState::Head& h = st.heads[hh];
      if (h.codes.size() != static_cast<size_t>(n) * (pd / 2) ||
          h.weights.size() != static_cast<size_t>(n) * n_sub ||
          h.counts.size() != static_cast<size_t>(n_sub) * n_cent) {
        return absl::InternalError("ParisKvLayoutFromIndexes: state sizes do not match");
      }
      const size_t row = b * nkv + hh;
      std::copy(h.codes.begin(), h.codes.end(),
                out.codes.begin() + row * out.max_tokens * (pd / 2));
      std::copy(h.weights.begin(), h.weights.end(),
                out.weights.begin() + row * out.max_tokens * n_sub);
      std::copy(h.counts.begin(), h.counts.end(), out.counts.begin() + row * n_sub * n_cent);
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
  std::vector<CtkvrState> states;
  for (size_t b = 0; b < indexes.size(); ++b) {
    const RetrievalIndex& index = *indexes[b];
    KVR_RETURN_IF_ERROR(CheckMethod(index, "ctkvr", b, shape));
    KVR_ASSIGN_OR_RETURN(CtkvrState st, CtkvrStateOf(index));
    if (b == 0) out.n_recall = static_cast<int>(st.n_recall);
    if (st.n_recall != out.n_recall || st.n_recall < 1 || st.n_recall > 32) {
      return absl::InvalidArgumentError(
          absl::StrCat("CtkvrLayoutFromIndexes: C' must be in [1, 32] and equal over the batch; "
                       "index ",
                       b, " has ", st.n_recall));
    }
    for (const auto& entries : st.heads) {
      int total = 0;
      for (const CtkvrState::Entry& e : entries) {
        out.max_list_length = std::max(out.max_list_length, static_cast<int>(e.list.size()));
        total += static_cast<int>(e.list.size());
      }
      out.max_list_entries = std::max(out.max_list_entries, total);
    }
    out.max_centroids = std::max(out.max_centroids, static_cast<int>(st.n_centroids));
    out.max_tokens = std::max(out.max_tokens, static_cast<int>(index.size()));
    states.push_back(std::move(st));
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
    const CtkvrState& st = states[b];
    std::copy(st.keys.begin(), st.keys.end(),
              out.keys.begin() + static_cast<size_t>(b) * out.max_tokens * key_row);
    for (int h = 0; h < nkv; ++h) {
      const size_t row = static_cast<size_t>(b) * nkv + h;
      const auto& entries = st.heads[h];
      out.n_centroids[row] = static_cast<int32_t>(entries.size());
      int32_t* offsets = out.list_offsets.data() + row * (out.max_centroids + 1);
      int32_t pos = 0;
      for (size_t c = 0; c < entries.size(); ++c) {
        const CtkvrState::Entry& e = entries[c];
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
    KVR_ASSIGN_OR_RETURN(const A2atsState st, A2atsStateOf(index));
    if (st.codebook_hash != books->content_hash() || st.codebook_size != out.codebook_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("A2atsLayoutFromIndexes: index ", b, " was built with other codebooks"));
    }
    out.n_tokens[b] = static_cast<int32_t>(index.size());
    for (int h = 0; h < nkv; ++h) {
      if (st.ids[h].size() != static_cast<size_t>(index.size())) {
        return absl::InternalError("A2atsLayoutFromIndexes: state sizes do not match");
      }
      std::copy(st.ids[h].begin(), st.ids[h].end(),
                out.ids.begin() + (b * nkv + h) * static_cast<size_t>(out.max_tokens));
    }
  }
  return out;
}

}  // namespace kvr::retrieval::cuda
