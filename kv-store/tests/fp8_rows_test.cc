// fp8 sequences (DType::kFp8E4m3): writes carry bf16 K and V, the store keeps one scaled fp8
// row per (token, kv head) in the layout of kvr/common/fp8.h, and every read returns those
// bytes unchanged: byte-exact against EncodeFp8Row of the same values. The decoding readers
// of the store (CopyLayerRows, KeyDiff thinning, StoredRowToFloats) see the decoded rows.

#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvr/common/fp8.h"
#include "kvr/common/half.h"
#include "kvr/kv_store/local_pool.h"
#include "kvr/kv_store/store.h"
#include "kvr/kv_store/test_pattern.h"
#include "store_test_util.h"

namespace kvr::kv_store::testing {
namespace {

using ::testing::HasSubstr;

// head_dim 64, as SmolLM2: 136-byte rows, 7 rows per 1 KiB page.
constexpr SequenceShape kShape{
    .n_layers = 2, .n_kv_heads = 3, .head_dim = 64, .dtype = DType::kFp8E4m3};
constexpr uint64_t kPageBytes = 1024;

// Value d of K (or V, `v`) of row r, head h, layer l: a spread of magnitudes and signs, with
// an outlier per vector so that the scales differ between vectors.
float Element(uint32_t l, uint32_t h, uint64_t r, uint32_t d, bool v) {
  const float base =
      std::sin(0.37f * static_cast<float>(d + 1) + 0.11f * static_cast<float>(r) +
               1.3f * static_cast<float>(h) + 2.1f * static_cast<float>(l) + (v ? 0.5f : 0.f));
  const float outlier = d == (r + h) % kShape.head_dim ? 3.f + static_cast<float>(r % 7) : 1.f;
  return base * outlier * (v ? 0.25f : 1.f);
}

// K and V of rows [start, start + n) of `layer`, bf16 [n, n_kv_heads, head_dim] each.
struct Bf16Rows {
  std::vector<uint16_t> k, v;
};
Bf16Rows MakeRows(const SequenceShape& shape, uint32_t layer, uint64_t start, uint32_t n) {
  Bf16Rows rows;
  const size_t count = size_t{n} * shape.n_kv_heads * shape.head_dim;
  rows.k.resize(count);
  rows.v.resize(count);
  for (uint32_t r = 0; r < n; ++r) {
    for (uint32_t h = 0; h < shape.n_kv_heads; ++h) {
      for (uint32_t d = 0; d < shape.head_dim; ++d) {
        const size_t at = (size_t{r} * shape.n_kv_heads + h) * shape.head_dim + d;
        rows.k[at] = FloatToBf16(Element(layer, h, start + r, d, false));
        rows.v[at] = FloatToBf16(Element(layer, h, start + r, d, true));
      }
    }
  }
  return rows;
}

template <typename T>
std::span<const uint8_t> Bytes(const std::vector<T>& x) {
  return {reinterpret_cast<const uint8_t*>(x.data()), x.size() * sizeof(T)};
}

absl::StatusOr<uint64_t> Write(PagedKvStore& store, SequenceId id, uint32_t layer, uint64_t start,
                               uint32_t n) {
  const Bf16Rows rows = MakeRows(kShape, layer, start, n);
  return store.Write({.sequence = TestRef(id),
                      .layer = layer,
                      .start_row = start,
                      .n_rows = n,
                      .k = Bytes(rows.k),
                      .v = Bytes(rows.v)});
}

// The fp8 row the store must hold for row r of (layer, head): EncodeFp8Row of the bf16 values
// widened (k then v).
std::vector<uint8_t> ExpectedRow(uint32_t layer, uint32_t head, uint64_t r) {
  std::vector<float> kv(2 * kShape.head_dim);
  for (uint32_t d = 0; d < kShape.head_dim; ++d) {
    kv[d] = Bf16ToFloat(FloatToBf16(Element(layer, head, r, d, false)));
    kv[kShape.head_dim + d] = Bf16ToFloat(FloatToBf16(Element(layer, head, r, d, true)));
  }
  std::vector<uint8_t> row(Fp8RowLayout{2, static_cast<int>(kShape.head_dim)}.RowBytes());
  EncodeFp8Row(Fp8RowLayout{2, static_cast<int>(kShape.head_dim)}, kv.data(), row.data());
  return row;
}

std::unique_ptr<PagedKvStore> MakeStore(uint64_t pages) {
  return MakeTestStore({.pool = {.capacity_bytes = pages * kPageBytes, .page_bytes = kPageBytes}});
}

TEST(Fp8RowsTest, DTypeAndRowSizes) {
  EXPECT_EQ(static_cast<int>(DType::kFp8E4m3), 4);
  EXPECT_EQ(*DTypeFromInt(4), DType::kFp8E4m3);
  EXPECT_EQ(DTypeName(DType::kFp8E4m3), "fp8_e4m3");
  const absl::StatusOr<DType> bad = DTypeFromInt(5);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("4=fp8_e4m3"));
  EXPECT_EQ(kShape.RowBytes(), 136u);
  SequenceShape wide = kShape;
  wide.head_dim = 128;
  EXPECT_EQ(wide.RowBytes(), 264u);
  for (uint32_t hd : {1u, 3u, 12u, 64u, 100u, 128u, 256u}) {
    const Fp8RowLayout layout{2, static_cast<int>(hd)};
    EXPECT_EQ(RowBytes(DType::kFp8E4m3, hd), layout.RowBytes()) << hd;
  }
  // Written as bf16: 2 bytes per element of K (or V), every head of a token.
  EXPECT_EQ(kShape.TokenHalfBytes(), 3u * 64u * 2u);
  EXPECT_EQ(WriteElementBytes(DType::kFp8E4m3), 2u);
  // The element-wise dtypes are unchanged.
  EXPECT_EQ(RowBytes(DType::kBf16, 64), 256u);
  EXPECT_EQ(RowBytes(DType::kF32, 64), 512u);
  EXPECT_EQ(RowBytes(DType::kF16, 8), 32u);
  EXPECT_TRUE(kShape.Validate().ok());
}

TEST(Fp8RowsTest, GatherAndRangeReturnTheEncodedRowsByteExact) {
  auto store = MakeStore(256);
  ASSERT_TRUE(store->CreateSequence(TestRef(7), kShape, 0, absl::ZeroDuration()).ok());
  auto info = store->GetSequence(TestRef(7));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens_per_page, kPageBytes / 136);
  // 50 rows per layer in uneven writes, crossing page boundaries (7 rows per page).
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_EQ(*Write(*store, 7, layer, 0, 13), 13u);
    ASSERT_EQ(*Write(*store, 7, layer, 13, 1), 14u);
    ASSERT_EQ(*Write(*store, 7, layer, 14, 36), 50u);
  }
  // Stored bytes: 136 per (row, head), not the bf16 bytes handed in.
  EXPECT_EQ(store->Stats().bytes_written, 2u * 50u * 3u * 136u);

  const std::vector<uint32_t> idx_a = {49, 0, 6, 7, 7, 31};
  const std::vector<uint32_t> idx_b = {1, 2, 3};
  const std::vector<GatherEntry> entries = {
      {.sequence = TestRef(7), .layer = 1, .head = 2, .indices = idx_a},
      {.sequence = TestRef(7), .layer = 0, .head = 0, .indices = idx_b}};
  auto bytes = store->GatherBytes(entries);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_EQ(*bytes, 9u * 136u);
  std::vector<uint8_t> out(*bytes);
  ASSERT_TRUE(store->Gather(entries, out).ok());
  const uint8_t* p = out.data();
  for (const GatherEntry& e : entries) {
    for (uint32_t i : e.indices) {
      EXPECT_EQ(std::vector<uint8_t>(p, p + 136), ExpectedRow(e.layer, e.head, i)) << "row " << i;
      p += 136;
    }
  }

  const std::vector<RangeEntry> ranges = {
      {.sequence = TestRef(7), .layer = 0, .head = 1, .start = 5, .n_rows = 40}};
  std::vector<uint8_t> range_out(*store->RangeBytes(ranges));
  ASSERT_EQ(range_out.size(), 40u * 136u);
  ASSERT_TRUE(store->RangeRead(ranges, range_out).ok());
  for (uint64_t r = 0; r < 40; ++r) {
    const uint8_t* row = range_out.data() + r * 136;
    EXPECT_EQ(std::vector<uint8_t>(row, row + 136), ExpectedRow(0, 1, 5 + r)) << "row " << 5 + r;
  }

  // StoredRowToFloats decodes exactly what DecodeFp8Row does, close to the written values.
  std::vector<float> got(2 * kShape.head_dim), want(2 * kShape.head_dim);
  StoredRowToFloats(DType::kFp8E4m3, kShape.head_dim, range_out.data(), got.data());
  DecodeFp8Row(Fp8RowLayout{2, 64}, range_out.data(), want.data());
  EXPECT_EQ(got, want);
  for (uint32_t d = 0; d < kShape.head_dim; ++d) {
    const float x = Element(0, 1, 5, d, false);
    EXPECT_NEAR(got[d], x, std::abs(x) / 16 + 1e-2f) << d;
  }
}

TEST(Fp8RowsTest, AWriteOfTheWrongSizeNamesTheDtypeAndTheBf16ItTakes) {
  auto store = MakeStore(64);
  ASSERT_TRUE(store->CreateSequence(TestRef(1), kShape, 0, absl::ZeroDuration()).ok());
  // f32 K and V (4 bytes per element) for an fp8 sequence, which takes bf16.
  std::vector<float> k(2 * kShape.n_kv_heads * kShape.head_dim, 1.f), v(k);
  absl::StatusOr<uint64_t> st = store->Write({.sequence = TestRef(1),
                                              .layer = 0,
                                              .start_row = 0,
                                              .n_rows = 2,
                                              .k = Bytes(k),
                                              .v = Bytes(v)});
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(st.status())) << st.status();
  EXPECT_THAT(st.status().message(), HasSubstr("fp8_e4m3"));
  EXPECT_THAT(st.status().message(), HasSubstr("bf16"));
  EXPECT_THAT(st.status().message(), HasSubstr("need 768 bytes each"));
  EXPECT_EQ(store->GetSequence(TestRef(1))->committed_rows[0], 0u);  // nothing written
}

TEST(Fp8RowsTest, CopyLayerRowsDecodesToBf16) {
  auto store = MakeStore(256);
  ASSERT_TRUE(store->CreateSequence(TestRef(3), kShape, 0, absl::ZeroDuration()).ok());
  for (uint32_t layer = 0; layer < kShape.n_layers; ++layer) {
    ASSERT_TRUE(Write(*store, 3, layer, 0, 30).ok());
  }
  auto table = store->ReservePageTable(TestRef(3), 30);
  ASSERT_TRUE(table.ok()) << table.status();
  auto mapping = LocalPoolMapping::Map(store->pool().fd(), store->pool().mapped_bytes(), kPageBytes,
                                       store->pool().pool_id());
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  // The mapped pool holds the fp8 rows as stored.
  const uint8_t* mapped = mapping->Row(*table, 1, 2, 17);
  EXPECT_EQ(std::vector<uint8_t>(mapped, mapped + 136), ExpectedRow(1, 2, 17));

  constexpr uint64_t kRows = 30;
  const size_t token = kShape.TokenHalfBytes();  // bf16, every head
  const uint32_t hd = kShape.head_dim;
  std::vector<uint16_t> k(kRows * token / 2), v(k.size());
  ASSERT_TRUE(mapping
                  ->CopyLayerRows(*table, 1, kRows, std::as_writable_bytes(std::span(k)),
                                  std::as_writable_bytes(std::span(v)))
                  .ok());
  std::vector<float> decoded(2 * hd);
  for (uint64_t r = 0; r < kRows; ++r) {
    for (uint32_t h = 0; h < kShape.n_kv_heads; ++h) {
      const std::vector<uint8_t> row = ExpectedRow(1, h, r);
      DecodeFp8Row(Fp8RowLayout{2, static_cast<int>(hd)}, row.data(), decoded.data());
      for (uint32_t d = 0; d < hd; ++d) {
        const size_t at = (r * kShape.n_kv_heads + h) * hd + d;
        ASSERT_EQ(k[at], FloatToBf16(decoded[d])) << r << " " << h << " " << d;
        ASSERT_EQ(v[at], FloatToBf16(decoded[hd + d])) << r << " " << h << " " << d;
      }
    }
  }
  // Spans sized for the stored fp8 bytes (not bf16) are refused.
  std::vector<uint8_t> small(kRows * kShape.n_kv_heads * 68);
  EXPECT_EQ(mapping
                ->CopyLayerRows(*table, 1, kRows, std::as_writable_bytes(std::span(small)),
                                std::as_writable_bytes(std::span(small)))
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// KeyDiff thinning of an fp8 sequence ranks pages by the decoded keys: the same pages go as
// for f32 rows of the same keys (thinning_test.cc's layout). fp8 rows of head_dim 12 are 32
// bytes, 4 rows per 128-byte page.
TEST(Fp8RowsTest, KeyDiffThinningReadsTheDecodedKeys) {
  constexpr SequenceShape shape{
      .n_layers = 1, .n_kv_heads = 2, .head_dim = 12, .dtype = DType::kFp8E4m3};
  ASSERT_EQ(shape.RowBytes(), 32u);
  constexpr uint64_t kThinPage = 128;
  auto store = MakeTestStore(
      {.pool = {.capacity_bytes = 20 * kThinPage, .page_bytes = kThinPage, .try_huge_pages = false},
       .evict_cached = true,
       .cached_eviction = CachedEviction::kThin,
       .thin_keep_fraction = 0.5,
       .thin_policy = {.sink_rows = 4, .recent_rows = 4}});
  ASSERT_NE(store, nullptr);
  // Keys along x, except in each head's two distinctive pages (head 0: pages 2 and 5; head 1:
  // pages 1 and 6), along y or z.
  auto key = [](uint32_t h, uint64_t r) -> std::array<float, 3> {
    const uint64_t page = r / 4;
    if (page == (h == 0 ? 2u : 1u)) return {0, 1, 0};
    if (page == (h == 0 ? 5u : 6u)) return {0, 0, 1};
    return {1, 0, 0};
  };
  constexpr uint32_t kRows = 32;  // 8 pages per head
  std::vector<uint16_t> k(size_t{kRows} * 2 * 12), v(k.size());
  for (uint32_t r = 0; r < kRows; ++r) {
    for (uint32_t h = 0; h < 2; ++h) {
      for (uint32_t d = 0; d < 12; ++d) {
        const size_t at = (size_t{r} * 2 + h) * 12 + d;
        k[at] = FloatToBf16(d < 3 ? key(h, r)[d] : 0.f);
        v[at] = FloatToBf16(static_cast<float>(r * 10 + h) + static_cast<float>(d) / 8);
      }
    }
  }
  ASSERT_TRUE(store->CreateSequence(TestRef(1), shape, 0, absl::ZeroDuration()).ok());
  ASSERT_TRUE(store
                  ->Write({.sequence = TestRef(1),
                           .layer = 0,
                           .start_row = 0,
                           .n_rows = kRows,
                           .k = Bytes(k),
                           .v = Bytes(v)})
                  .ok());
  ASSERT_TRUE(store->Release(TestRef(1), absl::Hours(1)).ok());
  ASSERT_EQ(store->pool().free_pages(), 4u);
  // 8 pages for a new sequence: 4 short, so the cached one is thinned (8 pages freed).
  ASSERT_TRUE(store->CreateSequence(TestRef(2), shape, 16, absl::ZeroDuration()).ok());
  auto info = store->GetSequence(TestRef(1));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->thinned_pages, 8u);
  EXPECT_EQ(store->Stats().evictions_thinned, 1u);
  // Kept: head 0 pages 0, 2, 5, 7; head 1 pages 0, 1, 6, 7 (the sinks, the distinctive pages,
  // the recent rows); their rows read back as written. The others are holes.
  auto read = [&](uint32_t h, uint64_t page) {
    const RangeEntry range{
        .sequence = TestRef(1), .layer = 0, .head = h, .start = page * 4, .n_rows = 4};
    std::vector<uint8_t> out(4 * 32);
    return store->RangeRead({&range, 1}, out);
  };
  for (uint64_t page : {0, 2, 5, 7}) EXPECT_TRUE(read(0, page).ok()) << "head 0 page " << page;
  for (uint64_t page : {0, 1, 6, 7}) EXPECT_TRUE(read(1, page).ok()) << "head 1 page " << page;
  for (uint64_t page : {1, 3, 4, 6}) {
    EXPECT_TRUE(absl::IsFailedPrecondition(read(0, page))) << "head 0 page " << page;
  }
  for (uint64_t page : {2, 3, 4, 5}) {
    EXPECT_TRUE(absl::IsFailedPrecondition(read(1, page))) << "head 1 page " << page;
  }
}

}  // namespace
}  // namespace kvr::kv_store::testing
