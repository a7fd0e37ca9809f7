// Rows of the GPU decode data path (gather, hot cache, decode attention) against the CPU
// reference (kvr::retrieval::AttendPartial + MergeAttentionPartial). Shapes: head_dim 64/128,
// GQA group 1/4/8, 1..70K rows ragged, batch 1..16; dtypes fp32/fp16/bf16 with a tolerance per
// dtype. Outputs are poisoned with NaN bytes before each kernel and checked finite after.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/fp8.h"
#include "kvr/common/gpu_testing.h"
#include "kvr/common/half.h"
#include "kvr/retrieval/cuda/decode_attention.cuh"
#include "kvr/retrieval/cuda/gather.cuh"
#include "kvr/retrieval/cuda/hot_cache.cuh"
#include "kvr/retrieval/partial_attention.h"
#include "parity.h"

namespace kvr::gpu_parity {
namespace {

using namespace kvr::retrieval;
using namespace kvr::retrieval::cuda;
using namespace kvr::cuda;  // DeviceBuffer, PinnedBuffer, CudaStream
using namespace kvr::cuda::testing;

template <typename T>
T ValueOrDie(absl::StatusOr<T> v) {
  if (!v.ok()) {
    ADD_FAILURE() << v.status();
    std::abort();
  }
  return *std::move(v);
}

// Host tensor in a row dtype, plus the same values as floats (the exact rounded values, which
// is what the reference computes on).
struct HostTensor {
  RowDType dtype = RowDType::kBf16;
  std::vector<uint8_t> bytes;
  std::vector<float> values;

  void Fill(size_t n, RowDType t, std::mt19937& rng, float lo, float hi) {
    dtype = t;
    const size_t es = RowDTypeSize(t);
    bytes.resize(n * es);
    values.resize(n);
    std::uniform_real_distribution<float> dist(lo, hi);
    for (size_t i = 0; i < n; ++i) {
      const float x = dist(rng);
      if (t == RowDType::kF32) {
        std::memcpy(&bytes[i * 4], &x, 4);
        values[i] = x;
      } else {
        const uint16_t h = t == RowDType::kF16 ? FloatToFp16(x) : FloatToBf16(x);
        std::memcpy(&bytes[i * 2], &h, 2);
        values[i] = t == RowDType::kF16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
      }
    }
  }
};

float ElementToFloat(const uint8_t* p, RowDType t) {
  if (t == RowDType::kF32) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == RowDType::kF16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
}

// The rows of each (b, h), rows [head_base[bh], head_base[bh] + n_rows[bh]) of `logical`, laid
// out as the KV store keeps them: in pages of page_rows consecutive rows (16 rows for even slots,
// 48 for odd ones: one size that is not a power of two), each slot's pages in a region of its
// own, in a random order, with unused pages between them.
struct PagedPool {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> region;     // [batch] byte offset of slot b's page 0
  std::vector<int32_t> page_rows;  // [batch]
  std::vector<int32_t> pages;      // [batch * n_kv_heads, max_pages]
  int max_pages = 0;
  int n_kv_heads = 0;
  size_t row_bytes = 0;

  void Make(const std::vector<uint8_t>& logical, const std::vector<int64_t>& head_base,
            const std::vector<int64_t>& n_rows, int batch, int n_kv, size_t row,
            std::mt19937& rng) {
    n_kv_heads = n_kv;
    row_bytes = row;
    page_rows.resize(batch);
    for (int b = 0; b < batch; ++b) page_rows[b] = b % 2 == 0 ? 16 : 48;
    int64_t most = 1;
    for (int64_t n : n_rows) most = std::max(most, n);
    max_pages = static_cast<int>((most + 15) / 16);
    pages.assign(static_cast<size_t>(batch) * n_kv * max_pages, -1);
    region.resize(batch);
    int64_t offset = 0;
    for (int b = 0; b < batch; ++b) {
      const int64_t pr = page_rows[b];
      const int64_t page_bytes = pr * static_cast<int64_t>(row);
      std::vector<std::pair<int, int>> owners;  // (head, page of the head)
      for (int h = 0; h < n_kv; ++h) {
        const int64_t n = n_rows[b * n_kv + h];
        for (int64_t p = 0; p < (n + pr - 1) / pr; ++p) owners.emplace_back(h, static_cast<int>(p));
      }
      const int64_t n_pages = static_cast<int64_t>(owners.size()) * 2 + 1;  // half of them unused
      std::vector<int32_t> perm(n_pages);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      region[b] = offset;
      bytes.resize(static_cast<size_t>(offset + n_pages * page_bytes), 0xAB);
      for (size_t i = 0; i < owners.size(); ++i) {
        const auto [h, p] = owners[i];
        const int64_t bh = int64_t{b} * n_kv + h;
        pages[bh * max_pages + p] = perm[i];
        const int64_t first = p * pr;
        const int64_t count = std::min(pr, n_rows[bh] - first);
        std::memcpy(bytes.data() + offset + perm[i] * page_bytes,
                    logical.data() + (head_base[bh] + first) * row, count * row);
      }
      offset += n_pages * page_bytes;
    }
  }
  // Slot descriptors for the pool copied to `base` (device-accessible).
  std::vector<KvPoolSlot> Slots(const void* base) const {
    std::vector<KvPoolSlot> out(region.size());
    for (size_t b = 0; b < region.size(); ++b) {
      out[b] = {static_cast<const uint8_t*>(base) + region[b],
                static_cast<int64_t>(page_rows[b] * row_bytes), page_rows[b], 0};
    }
    return out;
  }
};

struct Tolerance {
  float atol;
  float rtol;
};
Tolerance ToleranceFor(RowDType t) {
  switch (t) {
    case RowDType::kF32:
      return {2e-5f, 2e-4f};
    case RowDType::kF16:
      return {2e-3f, 2e-3f};
    default:
      return {8e-3f, 1e-2f};  // output rounded to bf16 (8-bit mantissa)
  }
}

std::string DTypeName(RowDType t) {
  return t == RowDType::kF32 ? "f32" : t == RowDType::kF16 ? "f16" : "bf16";
}

struct Case {
  RowDType dtype;
  int head_dim;
  int group;
  int batch;
  int n_kv_heads;
  int max_resident;  // resident rows per sequence in [0, max_resident], ragged
  int budget;        // selected rows per (b, h) in [0, budget], ragged, some full
  int max_pool;      // pool rows per (b, h) in [budget, max_pool], ragged
};

std::string CaseName(const Case& c) {
  return DTypeName(c.dtype) + "_d" + std::to_string(c.head_dim) + "_g" + std::to_string(c.group) +
         "_b" + std::to_string(c.batch) + "_kv" + std::to_string(c.n_kv_heads) + "_res" +
         std::to_string(c.max_resident) + "_k" + std::to_string(c.budget) + "_pool" +
         std::to_string(c.max_pool);
}

// Everything one case needs, on the host and the device.
struct Problem {
  Case c;
  int n_heads = 0;
  int row_elems = 0;
  std::vector<int64_t> head_base;        // [batch, n_kv_heads] first row in `pool`
  std::vector<int64_t> n_rows;           // [batch, n_kv_heads] rows in `pool`
  std::vector<int32_t> ids;              // [batch, n_kv_heads, budget], -1 padding
  std::vector<int32_t> counts;           // [batch, n_kv_heads]
  std::vector<int32_t> resident_counts;  // [batch]
  HostTensor pool;                       // [sum pool rows, 2 * d]
  HostTensor resident;                   // [batch, n_kv_heads, max(max_resident,1), 2 * d]
  HostTensor q;                          // [batch, n_heads, d]
  int resident_capacity = 0;
  int max_rows = 0;

  void Make(const Case& cs, uint32_t seed) {
    c = cs;
    std::mt19937 rng(seed);
    n_heads = c.n_kv_heads * c.group;
    row_elems = 2 * c.head_dim;
    const int bh = c.batch * c.n_kv_heads;
    head_base.resize(bh);
    n_rows.resize(bh);
    counts.resize(bh);
    ids.assign(static_cast<size_t>(bh) * c.budget, -1);
    resident_counts.resize(c.batch);
    std::uniform_int_distribution<int> res_dist(0, c.max_resident);
    for (int b = 0; b < c.batch; ++b) resident_counts[b] = b == 0 ? c.max_resident : res_dist(rng);
    int64_t rows = 0;
    for (int i = 0; i < bh; ++i) {
      head_base[i] = rows;
      const int n_pool = std::uniform_int_distribution<int>(c.budget, c.max_pool)(rng);
      n_rows[i] = n_pool;
      rows += n_pool;
      // Ragged selections: the first head full, one head empty when there are several, the
      // rest random.
      int n_sel = std::uniform_int_distribution<int>(0, c.budget)(rng);
      if (i == 0) n_sel = c.budget;
      if (i == 1) n_sel = 0;
      counts[i] = n_sel;
      std::vector<int32_t> perm(n_pool);
      std::iota(perm.begin(), perm.end(), 0);
      for (int j = 0; j < n_sel; ++j) {  // partial Fisher-Yates: distinct random rows
        std::swap(perm[j], perm[std::uniform_int_distribution<int>(j, n_pool - 1)(rng)]);
        ids[static_cast<size_t>(i) * c.budget + j] = perm[j];
      }
    }
    pool.Fill(static_cast<size_t>(rows) * row_elems, c.dtype, rng, -1.f, 1.f);
    resident_capacity = std::max(c.max_resident, 1);
    resident.Fill(static_cast<size_t>(bh) * resident_capacity * row_elems, c.dtype, rng, -1.f, 1.f);
    // Queries large enough that the softmax is far from uniform (a real test of the max/rescale).
    q.Fill(static_cast<size_t>(c.batch) * n_heads * c.head_dim, c.dtype, rng, -2.f, 2.f);
    max_rows = c.max_resident + c.budget;
  }

  // Reference: per (b, query head) the partial over resident rows merged with the partial over
  // selected rows; out [batch, n_heads, d], lse [batch, n_heads].
  void Reference(std::vector<float>* out, std::vector<float>* lse) const {
    const int d = c.head_dim;
    out->assign(static_cast<size_t>(c.batch) * n_heads * d, 0.f);
    lse->assign(static_cast<size_t>(c.batch) * n_heads, 0.f);
    std::vector<float> scratch(std::max(resident_capacity, c.budget));
    std::vector<float> o2(d);
    std::vector<int64_t> rows;
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    for (int b = 0; b < c.batch; ++b) {
      for (int qh = 0; qh < n_heads; ++qh) {
        const int h = qh / c.group;
        const int64_t bh = static_cast<int64_t>(b) * c.n_kv_heads + h;
        const float* qv = q.values.data() + (static_cast<int64_t>(b) * n_heads + qh) * d;
        float* o = out->data() + (static_cast<int64_t>(b) * n_heads + qh) * d;
        const float* res = resident.values.data() + bh * resident_capacity * row_elems;
        PartialAttentionInput a{.q = qv,
                                .keys = res,
                                .values = res + d,
                                .row_stride = row_elems,
                                .n_rows = resident_counts[b],
                                .head_dim = d,
                                .scale = scale};
        float l1 = AttendPartial(a, o, scratch);
        rows.assign(ids.begin() + bh * c.budget, ids.begin() + bh * c.budget + counts[bh]);
        const float* base = pool.values.data() + head_base[bh] * row_elems;
        PartialAttentionInput s{.q = qv,
                                .keys = base,
                                .values = base + d,
                                .row_stride = row_elems,
                                .rows = rows,
                                .n_rows = 0,
                                .head_dim = d,
                                .scale = scale};
        if (!rows.empty()) {
          const float l2 = AttendPartial(s, o2.data(), scratch);
          MergeAttentionPartial(o, &l1, o2.data(), l2, d);
        }
        (*lse)[b * n_heads + qh] = l1;
      }
    }
  }
};

enum class Source { kGathered, kFusedHbm, kFusedHost };

void GatherAndAttendRow(const Case& param) {
  Problem pr;
  pr.Make(param, 1234u + param.head_dim * 7 + param.batch);
  const Case& c = pr.c;
  const int d = c.head_dim;
  const size_t es = RowDTypeSize(c.dtype);
  const size_t row_bytes = RowBytes(c.dtype, d);
  const int bh = c.batch * c.n_kv_heads;

  auto stream = ValueOrDie(CudaStream::Create());
  // The pool as the store pages it, in HBM and in mapped host memory.
  std::mt19937 page_rng(99);
  PagedPool paged;
  paged.Make(pr.pool.bytes, pr.head_base, pr.n_rows, c.batch, c.n_kv_heads, row_bytes, page_rng);
  auto d_pool = Upload(paged.bytes);
  auto h_pool = ValueOrDie(PinnedBuffer<uint8_t>::Create(paged.bytes.size(), cudaHostAllocMapped));
  std::memcpy(h_pool.data(), paged.bytes.data(), paged.bytes.size());
  uint8_t* h_pool_dev = ValueOrDie(h_pool.device_pointer());
  auto d_pages = Upload(paged.pages);
  auto d_slots_hbm = Upload(paged.Slots(d_pool.data()));
  auto d_slots_host = Upload(paged.Slots(h_pool_dev));
  const KvPoolView hbm_view{d_slots_hbm.data(), d_pages.data(), paged.max_pages, c.n_kv_heads};
  const KvPoolView host_view{d_slots_host.data(), d_pages.data(), paged.max_pages, c.n_kv_heads};
  auto d_ids = Upload(pr.ids);
  auto d_counts = Upload(pr.counts);
  auto d_res_counts = Upload(pr.resident_counts);
  auto d_resident = Upload(pr.resident.bytes);
  auto d_q = Upload(pr.q.bytes);

  // Gather from HBM and from mapped host memory: the valid rows must be the pool rows, bit for
  // bit; padding slots stay as poisoned.
  const size_t gathered_bytes = static_cast<size_t>(bh) * c.budget * row_bytes;
  auto d_gathered = ValueOrDie(DeviceBuffer<uint8_t>::Create(gathered_bytes));
  for (const KvPoolView& src : {hbm_view, host_view}) {
    ASSERT_EQ(cudaMemset(d_gathered.data(), 0xFF, gathered_bytes), cudaSuccess);
    GatherParams g{.batch = c.batch,
                   .n_kv_heads = c.n_kv_heads,
                   .budget = c.budget,
                   .head_dim = d,
                   .dtype = c.dtype,
                   .pool = src,
                   .ids = d_ids.data(),
                   .counts = d_counts.data(),
                   .out = d_gathered.data()};
    ASSERT_OK(GatherRows(g, stream.get()));
    ASSERT_OK(stream.Synchronize());
    const std::vector<uint8_t> got = Download(d_gathered, gathered_bytes);
    int64_t rows_checked = 0;
    for (int i = 0; i < bh; ++i) {
      for (int j = 0; j < c.budget; ++j) {
        const uint8_t* g_row = got.data() + (static_cast<size_t>(i) * c.budget + j) * row_bytes;
        if (j < pr.counts[i]) {
          const uint8_t* want =
              pr.pool.bytes.data() + (pr.head_base[i] + pr.ids[i * c.budget + j]) * row_bytes;
          ASSERT_EQ(std::memcmp(g_row, want, row_bytes), 0) << "head " << i << " slot " << j;
          ++rows_checked;
        } else {
          ASSERT_TRUE(std::all_of(g_row, g_row + row_bytes, [](uint8_t x) { return x == 0xFF; }))
              << "padding slot written: head " << i << " slot " << j;
        }
      }
    }
    // Every compared row passed the ASSERTs above; the row fails when none was compared.
    ExpectAtLeast(std::string("GatherRows from ") + (src.slots == hbm_view.slots ? "HBM" : "host") +
                      ": rows bit-equal, padding untouched",
                  static_cast<double>(rows_checked), 1);
  }

  std::vector<float> want_out, want_lse;
  pr.Reference(&want_out, &want_lse);
  const Tolerance tol = ToleranceFor(c.dtype);
  const size_t n_out = static_cast<size_t>(c.batch) * pr.n_heads * d;
  auto d_out = ValueOrDie(DeviceBuffer<uint8_t>::Create(n_out * es));
  auto d_lse = ValueOrDie(DeviceBuffer<float>::Create(static_cast<size_t>(c.batch) * pr.n_heads));

  for (Source src : {Source::kGathered, Source::kFusedHbm, Source::kFusedHost}) {
    DecodeAttentionParams p{.batch = c.batch,
                            .n_heads = pr.n_heads,
                            .n_kv_heads = c.n_kv_heads,
                            .head_dim = d,
                            .dtype = c.dtype,
                            .scale = 1.f / std::sqrt(static_cast<float>(d)),
                            .q = d_q.data(),
                            .resident = d_resident.data(),
                            .resident_capacity = pr.resident_capacity,
                            .resident_counts = d_res_counts.data(),
                            .budget = c.budget,
                            .counts = d_counts.data(),
                            .max_rows = pr.max_rows,
                            .out = d_out.data(),
                            .lse = d_lse.data()};
    if (src == Source::kGathered) {
      p.gathered = d_gathered.data();
    } else {
      p.pool = src == Source::kFusedHbm ? hbm_view : host_view;
      p.ids = d_ids.data();
    }
    auto ws = ValueOrDie(DeviceBuffer<uint8_t>::Create(DecodeAttentionWorkspaceBytes(p)));
    p.workspace = ws.data();
    p.workspace_bytes = ws.bytes();
    ASSERT_EQ(cudaMemset(d_out.data(), 0xFF, d_out.bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_lse.data(), 0xFF, d_lse.bytes()), cudaSuccess);
    ASSERT_OK(DecodeAttention(p, stream.get()));
    ASSERT_OK(stream.Synchronize());
    const std::vector<uint8_t> out_bytes = Download(d_out, n_out * es);
    const std::vector<float> lse = Download(d_lse, static_cast<size_t>(c.batch) * pr.n_heads);
    double max_err = 0, max_lse_err = 0;
    for (size_t i = 0; i < n_out; ++i) {
      const float got = ElementToFloat(out_bytes.data() + i * es, c.dtype);
      ASSERT_TRUE(std::isfinite(got)) << "source " << int(src) << " out[" << i << "] = " << got;
      const float want = want_out[i];
      max_err = std::max<double>(max_err, std::abs(got - want));
      ASSERT_LE(std::abs(got - want), tol.atol + tol.rtol * std::abs(want))
          << "source " << int(src) << " out[" << i << "] (b " << i / (pr.n_heads * d) << ", qh "
          << (i / d) % pr.n_heads << ", d " << i % d << ")";
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      const float want = want_lse[i];
      if (std::isinf(want)) {
        ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "lse[" << i << "] = " << lse[i];
      } else {
        ASSERT_TRUE(std::isfinite(lse[i])) << "lse[" << i << "] = " << lse[i];
        ASSERT_NEAR(lse[i], want, 1e-4f + 1e-5f * std::abs(want)) << "lse[" << i << "]";
        max_lse_err = std::max<double>(max_lse_err, std::abs(lse[i] - want));
      }
    }
    const std::string from = src == Source::kGathered   ? "gathered"
                             : src == Source::kFusedHbm ? "fused HBM"
                                                        : "fused host";
    char bound[64];
    std::snprintf(bound, sizeof(bound), "%g + %g |ref|", tol.atol, tol.rtol);
    RecordMeasure("DecodeAttention " + from + ": max |out - ref|", max_err, bound, true);
    RecordMeasure("DecodeAttention " + from + ": max |lse - ref|", max_lse_err, "1e-4 + 1e-5 |ref|",
                  true);
  }
}

// Several decode steps through the hot cache with overlapping selections: every step's output
// must equal the pool rows; once the selection stops changing the cache must serve it. Also in
// two halves (Lookup, then Fill) with one slot's pool unreadable (a null base: a store on
// another host): its misses are staged by the host from what Lookup reports, and exactly those
// are staged.
// With fp8 pool rows (PoolRowFormat::kFp8E4m3, dtype bf16) the pool holds EncodeFp8Row's rows
// and every output row must be DecodeFp8Row's values rounded to bf16, bit for bit.
void HotCacheRow(bool staged_slot, RowDType dtype, bool fp8) {
  {
    const int batch = 3, n_kv = 4, d = 64, budget = 128, n_pool = 2000;
    const PoolRowFormat format = fp8 ? PoolRowFormat::kFp8E4m3 : PoolRowFormat::kAsDType;
    const size_t row_bytes = PoolRowBytes(format, dtype, d);  // pool, staged and cache rows
    const size_t out_row_bytes = RowBytes(dtype, d);
    const int bh = batch * n_kv;
    std::mt19937 rng(7);
    HostTensor pool;
    pool.Fill(static_cast<size_t>(bh) * n_pool * 2 * d, dtype, rng, -1.f, 1.f);
    // What each pool row must come out as.
    std::vector<uint8_t> want_rows = pool.bytes;
    if (fp8) {
      const Fp8RowLayout layout{2, d};
      std::vector<float> decoded(2 * d);
      pool.bytes.assign(static_cast<size_t>(bh) * n_pool * row_bytes, 0);
      for (size_t r = 0; r < static_cast<size_t>(bh) * n_pool; ++r) {
        // Per-row magnitudes from 2^-6 to 2^6, so the scales differ from row to row.
        const float mag = std::ldexp(1.f, static_cast<int>(r % 13) - 6);
        std::vector<float> x(pool.values.begin() + r * 2 * d,
                             pool.values.begin() + (r + 1) * 2 * d);
        for (float& v : x) v *= mag;
        EncodeFp8Row(layout, x.data(), pool.bytes.data() + r * row_bytes);
        DecodeFp8Row(layout, pool.bytes.data() + r * row_bytes, decoded.data());
        for (int i = 0; i < 2 * d; ++i) {
          const uint16_t b = FloatToBf16(decoded[i]);
          std::memcpy(want_rows.data() + r * out_row_bytes + 2 * i, &b, 2);
        }
      }
    }
    std::vector<int64_t> head_base(bh), n_rows(bh, n_pool);
    for (int i = 0; i < bh; ++i) head_base[i] = static_cast<int64_t>(i) * n_pool;
    PagedPool paged;
    paged.Make(pool.bytes, head_base, n_rows, batch, n_kv, row_bytes, rng);
    auto stream = ValueOrDie(CudaStream::Create());
    auto h_pool =
        ValueOrDie(PinnedBuffer<uint8_t>::Create(paged.bytes.size(), cudaHostAllocMapped));
    std::memcpy(h_pool.data(), paged.bytes.data(), paged.bytes.size());
    auto d_pages = Upload(paged.pages);
    std::vector<KvPoolSlot> slots = paged.Slots(ValueOrDie(h_pool.device_pointer()));
    constexpr int kStagedSlot = 2;
    if (staged_slot) slots[kStagedSlot].base = nullptr;
    auto d_slots = Upload(slots);
    const KvPoolView view{d_slots.data(), d_pages.data(), paged.max_pages, n_kv};
    auto staged = ValueOrDie(PinnedBuffer<uint8_t>::Create(
        static_cast<size_t>(bh) * budget * row_bytes, cudaHostAllocMapped));
    auto staged_index = ValueOrDie(
        PinnedBuffer<int32_t>::Create(static_cast<size_t>(bh) * budget, cudaHostAllocMapped));
    int64_t staged_rows = 0, staged_slot_hits = 0;
    auto cache = ValueOrDie(HotCache::Create({.batch = batch,
                                              .n_kv_heads = n_kv,
                                              .head_dim = d,
                                              .dtype = dtype,
                                              .pool_format = format,
                                              .n_sets = 64,
                                              .ways = 4,
                                              .budget = budget},
                                             stream.get()));
    auto d_ids = ValueOrDie(DeviceBuffer<int32_t>::Create(static_cast<size_t>(bh) * budget));
    auto d_out =
        ValueOrDie(DeviceBuffer<uint8_t>::Create(static_cast<size_t>(bh) * budget * out_row_bytes));
    std::vector<int32_t> counts(bh);
    for (int i = 0; i < bh; ++i) counts[i] = i == 1 ? 0 : budget - (i % 5);
    auto d_counts = Upload(counts);
    std::vector<int32_t> ids(static_cast<size_t>(bh) * budget, -1);
    std::vector<std::vector<int32_t>> current(bh);
    for (int i = 0; i < bh; ++i) {  // step 0 selection: distinct random rows
      std::vector<int32_t> perm(n_pool);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      current[i].assign(perm.begin(), perm.begin() + budget);
    }
    const int kSteps = 8;
    unsigned long long prev_hits = 0;
    int64_t rows_checked = 0;
    for (int step = 0; step < kSteps; ++step) {
      // Steps 1..3 replace a quarter of each selection with rows not selected; later steps
      // repeat the selection, so the cache must converge to serving it.
      if (step >= 1 && step <= 3) {
        for (int i = 0; i < bh; ++i) {
          std::vector<char> used(n_pool, 0);
          for (int32_t x : current[i]) used[x] = 1;
          for (int j = 0; j < budget / 4; ++j) {
            int32_t x;
            do x = std::uniform_int_distribution<int>(0, n_pool - 1)(rng);
            while (used[x]);
            used[x] = 1;
            current[i][std::uniform_int_distribution<int>(0, budget - 1)(rng)] = x;
          }
          // Replacing an entry may leave its old id selected elsewhere: keep entries distinct.
          std::sort(current[i].begin(), current[i].end());
          current[i].erase(std::unique(current[i].begin(), current[i].end()), current[i].end());
          while (static_cast<int>(current[i].size()) < budget) {
            int32_t x = std::uniform_int_distribution<int>(0, n_pool - 1)(rng);
            if (!std::binary_search(current[i].begin(), current[i].end(), x)) {
              current[i].insert(std::lower_bound(current[i].begin(), current[i].end(), x), x);
            }
          }
          std::shuffle(current[i].begin(), current[i].end(), rng);
        }
      }
      for (int i = 0; i < bh; ++i) {
        for (int j = 0; j < budget; ++j) ids[i * budget + j] = j < counts[i] ? current[i][j] : -1;
      }
      ASSERT_EQ(cudaMemcpy(d_ids.data(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemset(d_out.data(), 0xFF, d_out.bytes()), cudaSuccess);
      if (!staged_slot) {
        ASSERT_OK(cache.Gather(view, d_ids.data(), d_counts.data(), d_out.data(), stream.get()));
      } else {
        ASSERT_OK(cache.Lookup(d_ids.data(), d_counts.data(), stream.get()));
        ASSERT_OK(stream.Synchronize());  // the stream does not wait on the legacy one
        std::vector<int32_t> slot_of(static_cast<size_t>(bh) * budget);
        ASSERT_EQ(
            cudaMemcpy(slot_of.data(), cache.slot_of(), slot_of.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
        std::memset(staged.data(), 0xFF, staged.bytes());
        std::fill_n(staged_index.data(), staged_index.size(), -1);
        int32_t next = 0;  // compact: the misses in reverse entry order, to test the index
        for (int h = n_kv - 1; h >= 0; --h) {
          const int i = kStagedSlot * n_kv + h;
          for (int j = counts[i] - 1; j >= 0; --j) {
            const size_t e = static_cast<size_t>(i) * budget + j;
            if (slot_of[e] >= 0) {
              ++staged_slot_hits;
              continue;
            }
            staged_index.data()[e] = next;
            std::memcpy(staged.data() + static_cast<size_t>(next++) * row_bytes,
                        pool.bytes.data() + (head_base[i] + ids[e]) * row_bytes, row_bytes);
            ++staged_rows;
          }
        }
        // Split as a decode step splits it: the slots before and after the staged one first,
        // the staged slot last (odd steps: one Fill of every slot).
        const void* staged_rows_dev = ValueOrDie(staged.device_pointer());
        const int32_t* staged_index_dev = ValueOrDie(staged_index.device_pointer());
        auto fill = [&](int first, int n) {
          return cache.Fill(view, d_ids.data(), d_counts.data(), d_out.data(), stream.get(),
                            staged_rows_dev, staged_index_dev, first, n);
        };
        if (step % 2 == 0) {
          ASSERT_OK(fill(0, kStagedSlot));
          ASSERT_OK(fill(kStagedSlot + 1, -1));
          ASSERT_OK(fill(kStagedSlot, 1));
        } else {
          ASSERT_OK(fill(0, -1));
        }
        EXPECT_EQ(fill(kStagedSlot, batch).code(), absl::StatusCode::kInvalidArgument);
      }
      ASSERT_OK(stream.Synchronize());
      const std::vector<uint8_t> got = Download(d_out, d_out.bytes());
      for (int i = 0; i < bh; ++i) {
        for (int j = 0; j < counts[i]; ++j) {
          const uint8_t* want =
              want_rows.data() + (head_base[i] + ids[i * budget + j]) * out_row_bytes;
          ASSERT_EQ(std::memcmp(got.data() + (static_cast<size_t>(i) * budget + j) * out_row_bytes,
                                want, out_row_bytes),
                    0)
              << "step " << step << " head " << i << " slot " << j;
          ++rows_checked;
        }
      }
      unsigned long long hits = 0;
      ASSERT_EQ(cudaMemcpy(&hits, cache.hits(), sizeof(hits), cudaMemcpyDeviceToHost), cudaSuccess);
      const unsigned long long step_hits = hits - prev_hits;
      prev_hits = hits;
      const long long selected = std::accumulate(counts.begin(), counts.end(), 0LL);
      if (step == 0) {
        EXPECT_EQ(step_hits, 0u) << "cold cache cannot hit";
      }
      if (step == kSteps - 1) {
        EXPECT_GE(static_cast<double>(step_hits), 0.95 * selected)
            << "repeated selection mostly served from the cache (capacity 2x budget)";
        RecordMeasure("last step hit rate", static_cast<double>(step_hits) / selected, ">= 0.95",
                      static_cast<double>(step_hits) >= 0.95 * selected);
      }
      EXPECT_LE(step_hits, static_cast<unsigned long long>(selected));
      // The per-slot counters split the same hits by sequence slot.
      std::vector<unsigned long long> per_slot(batch);
      ASSERT_EQ(cudaMemcpy(per_slot.data(), cache.slot_hits(), batch * sizeof(per_slot[0]),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(std::accumulate(per_slot.begin(), per_slot.end(), 0ULL), hits);
      if (step == kSteps - 1) {
        for (int b = 0; b < batch; ++b) EXPECT_GT(per_slot[b], 0u) << "slot " << b;
      }
      if (staged_slot) {
        // The host staged every selected row of the slot that the cache did not hold.
        const long long slot_selected = std::accumulate(
            counts.begin() + kStagedSlot * n_kv, counts.begin() + (kStagedSlot + 1) * n_kv, 0LL);
        EXPECT_EQ(static_cast<long long>(per_slot[kStagedSlot]), staged_slot_hits);
        EXPECT_EQ(staged_rows + staged_slot_hits, slot_selected * (step + 1));
      }
    }
    ExpectAtLeast("rows bit-equal to the pool, 8 steps", static_cast<double>(rows_checked), 1);
  }
}

TEST(AttendContract, DecodeAttentionAndGatherRejectBadShapes) {
  DecodeAttentionParams p{.batch = 1, .n_heads = 12, .n_kv_heads = 1, .head_dim = 128};
  EXPECT_EQ(DecodeAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.n_heads = 8;
  p.head_dim = 96;
  EXPECT_EQ(DecodeAttention(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  GatherParams g{.batch = 1, .n_kv_heads = 1, .budget = 1, .head_dim = 128};
  EXPECT_EQ(GatherRows(g, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace

std::vector<ParityRow> AttendRows() {
  const Case cases[] = {// Llama-3-8B layer shape at a small budget.
                        Case{RowDType::kBf16, 128, 4, 4, 8, 512, 256, 4096},
                        Case{RowDType::kF16, 128, 4, 2, 8, 96, 1024, 8192},
                        Case{RowDType::kF32, 128, 1, 3, 4, 64, 300, 1000},
                        // SmolLM2-like head_dim 64, group 3 is not a sweep point; 1/4/8 are.
                        Case{RowDType::kBf16, 64, 8, 16, 2, 128, 64, 512},
                        Case{RowDType::kF16, 64, 1, 5, 3, 33, 17, 200},
                        Case{RowDType::kF32, 64, 4, 2, 2, 1, 1, 1},
                        // A big batch whose (b, h) pairs alone fill the GPU (SmolLM2's 3 KV heads
                        // x 96): split by rows (DecodeAttentionSplits' cap), 1,296 rows each.
                        Case{RowDType::kBf16, 64, 3, 96, 3, 272, 1024, 2048},
                        // Long: 70K rows per (b, h), dense-like (resident) and selected.
                        Case{RowDType::kBf16, 128, 8, 1, 1, 70000, 2048, 70000},
                        Case{RowDType::kF32, 64, 8, 2, 1, 20000, 50000, 70000}};
  std::vector<ParityRow> rows;
  for (const Case& c : cases) {
    rows.push_back({"GatherRows+DecodeAttention", CaseName(c),
                    "pool rows; AttendPartial + MergeAttentionPartial",
                    "gather bit-equal; out atol + rtol per dtype, lse 1e-4",
                    [c] { GatherAndAttendRow(c); }});
  }
  for (bool staged_slot : {false, true}) {
    for (RowDType dtype : {RowDType::kBf16, RowDType::kF32}) {
      rows.push_back({"HotCache",
                      std::string(staged_slot ? "slot 2 staged" : "all slots in the pool") + " " +
                          DTypeName(dtype) + " b3 kv4 d64 k128 8 steps",
                      "pool rows", "bit-equal; hits 0 cold, >= 95% once repeated",
                      [staged_slot, dtype] { HotCacheRow(staged_slot, dtype, false); }});
    }
    rows.push_back({"HotCache",
                    std::string(staged_slot ? "slot 2 staged" : "all slots in the pool") +
                        " fp8 rows -> bf16 b3 kv4 d64 k128 8 steps",
                    "DecodeFp8Row, rounded to bf16", "bit-equal; hits 0 cold, >= 95% once repeated",
                    [staged_slot] { HotCacheRow(staged_slot, RowDType::kBf16, true); }});
  }
  return rows;
}

}  // namespace kvr::gpu_parity
