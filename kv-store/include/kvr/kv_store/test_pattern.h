#pragma once
// Deterministic KV contents for tests: every byte of row `row` of (sequence, layer, head) is a
// function of those coordinates, so a reader can check any row it gets without knowing what
// else was written. Used by unit tests, integration tests and benchmarks alike.

#include <cstdint>
#include <vector>

#include "kvr/kv_store/types.h"

namespace kvr::kv_store::testing {

// A capability derived from the id, for tests that name sequences by small numbers. Real
// callers use Capability::Generate(): this one is guessable by design.
inline Capability TestCapability(SequenceId id) {
  Capability cap;
  for (size_t i = 0; i < Capability::kBytes; ++i) {
    cap.bytes[i] = static_cast<uint8_t>((id * 0x9E3779B97F4A7C15ull) >> (8 * (i % 8))) ^
                   static_cast<uint8_t>(0xA5 + i);
  }
  return cap;
}
inline SequenceRef TestRef(SequenceId id) { return {id, TestCapability(id)}; }

inline uint8_t PatternByte(SequenceId seq, uint32_t layer, uint32_t head, uint64_t row,
                           size_t byte) {
  uint64_t x = seq * 0x9E3779B97F4A7C15ull ^ (uint64_t{layer} << 40) ^ (uint64_t{head} << 32) ^
               (row * 0xBF58476D1CE4E5B9ull) ^ (byte * 0x94D049BB133111EBull);
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD39ull;
  return static_cast<uint8_t>(x >> 56);
}

// K and V of rows [start, start + n) of one layer, each [n, n_kv_heads, head_dim], such that the
// stored row [k | v] of head h equals ExpectedRow(...).
struct PatternRows {
  std::vector<uint8_t> k;
  std::vector<uint8_t> v;
};
inline PatternRows MakePatternRows(const SequenceShape& shape, SequenceId seq, uint32_t layer,
                                   uint64_t start, uint32_t n) {
  const size_t head_bytes = size_t{shape.head_dim} * WriteElementBytes(shape.dtype);
  PatternRows rows;
  rows.k.resize(size_t{n} * shape.n_kv_heads * head_bytes);
  rows.v.resize(rows.k.size());
  for (uint32_t r = 0; r < n; ++r) {
    for (uint32_t h = 0; h < shape.n_kv_heads; ++h) {
      const size_t base = (size_t{r} * shape.n_kv_heads + h) * head_bytes;
      for (size_t b = 0; b < head_bytes; ++b) {
        rows.k[base + b] = PatternByte(seq, layer, h, start + r, b);
        rows.v[base + b] = PatternByte(seq, layer, h, start + r, head_bytes + b);
      }
    }
  }
  return rows;
}

// Rows [start, start + n) of `layer` of sequence `seq` (TestRef) holding the pattern of
// sequence `pattern`, pointing into `*keep`, which must outlive them.
inline LayerRows PatternLayerRows(const SequenceShape& shape, SequenceId seq, uint32_t layer,
                                  uint64_t start, uint32_t n, SequenceId pattern,
                                  PatternRows* keep) {
  *keep = MakePatternRows(shape, pattern, layer, start, n);
  return {.sequence = TestRef(seq),
          .layer = layer,
          .start_row = start,
          .n_rows = n,
          .k = keep->k,
          .v = keep->v};
}

// Writes PatternLayerRows(...) through `store.Write` (a PagedKvStore, or anything with its
// Write).
template <typename Store>
auto WritePatternRows(Store& store, const SequenceShape& shape, SequenceId seq, uint32_t layer,
                      uint64_t start, uint32_t n, SequenceId pattern) {
  PatternRows keep;
  return store.Write(PatternLayerRows(shape, seq, layer, start, n, pattern, &keep));
}

// Puts PatternLayerRows(...) of sequence `seq`'s own pattern through `client.PutLayer` (a
// KvStoreClient, or anything with its PutLayer).
template <typename Client>
auto PutPatternRows(Client& client, const SequenceShape& shape, SequenceId seq, uint32_t layer,
                    uint64_t start, uint32_t n) {
  PatternRows keep;
  return client.PutLayer(PatternLayerRows(shape, seq, layer, start, n, seq, &keep));
}

// True when `row` (RowBytes() long) is row `row_index` of (seq, layer, head) as written by
// MakePatternRows. For the dtypes stored as written (f32, f16, bf16): an fp8 sequence encodes
// what it is given, so its rows are not the pattern's bytes.
inline bool RowMatches(const SequenceShape& shape, SequenceId seq, uint32_t layer, uint32_t head,
                       uint64_t row_index, const uint8_t* row) {
  const size_t n = shape.RowBytes();
  for (size_t b = 0; b < n; ++b) {
    if (row[b] != PatternByte(seq, layer, head, row_index, b)) return false;
  }
  return true;
}

}  // namespace kvr::kv_store::testing
