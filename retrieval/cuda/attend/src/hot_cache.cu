#include "kvr/retrieval/cuda/hot_cache.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>

#include "absl/strings/str_cat.h"
#include "kvr/common/status.h"

namespace kvr::retrieval::cuda {
namespace {

constexpr unsigned kHitPriority = 0xFFFFFFFFu;

__device__ __forceinline__ unsigned long long ClaimKey(uint32_t step, uint32_t priority) {
  return (static_cast<unsigned long long>(step) << 32) | priority;
}
// Misses compete below hits; the smaller id wins (any fixed order would do).
__device__ __forceinline__ uint32_t MissPriority(int32_t id) {
  return 0xFFFFFFFEu - static_cast<uint32_t>(id);
}

// The miss's rank among this step's misses of its set: fills[set] = (step mod 2^24) << 8 | count,
// restarted at the first miss of each step. Misses of one set then take different victims.
__device__ __forceinline__ int MissRank(unsigned* fill, uint32_t step) {
  const unsigned tag = step & 0xFFFFFFu;
  unsigned old = *fill;
  while (true) {
    const int rank = (old >> 8) == tag ? static_cast<int>(old & 0xFFu) : 0;
    const unsigned want = (tag << 8) | static_cast<unsigned>(min(rank + 1, 255));
    const unsigned prev = atomicCAS(fill, old, want);
    if (prev == old) return rank;
    old = prev;
  }
}

// One thread per selected entry [batch * n_kv_heads * budget]. Finds the id in its set; a hit
// records its slot (>= 0) and claims it with the top priority; the r-th miss of a set in this
// step picks the r-th least recently used way as its victim, bids for it and records
// -2 - victim. Local slot = set * ways + way.
__global__ void HotCacheLookupKernel(const int32_t* __restrict__ ids,
                                     const int32_t* __restrict__ counts,
                                     const int32_t* __restrict__ tags, uint32_t* stamps,
                                     unsigned long long* claims, unsigned* fills,
                                     int32_t* __restrict__ slot_of, unsigned long long* hits,
                                     unsigned long long* seq_hits, int budget, int n_kv_heads,
                                     int n_sets, int ways, int64_t total, uint32_t* step_state) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // This step's number: one more than the last completed step (written by the copy kernel of
  // the previous step); published in step_state[1] for this step's copy kernel. Each kernel
  // writes only the word the other one reads, so a captured graph can replay steps.
  const uint32_t step = step_state[0] + 1;
  if (t == 0) step_state[1] = step;
  bool hit = false;
  if (t < total) {
    const int64_t bh = t / budget;
    const int i = static_cast<int>(t - bh * budget);
    const int32_t id = ids[t];
    if (i < counts[bh] && id >= 0) {
      const int slots = n_sets * ways;
      const int set = id % n_sets;
      const int first = set * ways;
      const int64_t base = bh * slots;
      int found = -1;
      uint32_t st[8];  // compile-time indices only (unrolled), so it stays in registers
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        st[w] = UINT_MAX;
        if (w < ways) {
          if (tags[base + first + w] == id) found = first + w;
          st[w] = stamps[base + first + w];
        }
      }
      if (found < 0) {
        // r-th way in (stamp, way) order.
        const int r = MissRank(&fills[bh * n_sets + set], step) % ways;
        int victim = first;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
          int pos = 0;
#pragma unroll
          for (int u = 0; u < 8; ++u) pos += (st[u] < st[w] || (st[u] == st[w] && u < w));
          if (w < ways && pos == r) victim = first + w;
        }
        atomicMax(&claims[base + victim], ClaimKey(step, MissPriority(id)));
        slot_of[t] = -2 - victim;
      } else {
        hit = true;
        stamps[base + found] = step;
        atomicMax(&claims[base + found], ClaimKey(step, kHitPriority));
        slot_of[t] = found;
      }
    }
  }
  // Grid is whole warps, so every lane reaches the ballot.
  const unsigned mask = __ballot_sync(0xffffffffu, hit);
  if ((threadIdx.x % 32) == 0 && mask != 0)
    atomicAdd(hits, static_cast<unsigned long long>(__popc(mask)));
  // Per sequence slot: the lanes of one slot add their hits with one atomic (a warp usually
  // lies within one slot).
  const int64_t seq = t < total ? t / (int64_t{budget} * n_kv_heads) : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, seq);
  const unsigned peer_hits = __popc(peers & mask);
  if (seq >= 0 && peer_hits != 0 && (threadIdx.x % 32) == __ffs(peers) - 1) {
    atomicAdd(&seq_hits[seq], static_cast<unsigned long long>(peer_hits));
  }
}

// One thread per 16-byte chunk of each selected row: hits copy from the cache (HBM), misses read
// the pool (mapped host memory: the only bytes that cross the link) or, for a slot whose pool
// base is null, staged row staged_index[e], and, when they won their victim's claim, also write
// the row into the cache and retag the slot.
__global__ void HotCacheCopyKernel(
    KvPoolView pool, const uint4* __restrict__ staged, const int32_t* __restrict__ staged_index,
    const int32_t* __restrict__ ids, const int32_t* __restrict__ counts,
    const int32_t* __restrict__ slot_of, int32_t* tags, uint32_t* stamps,
    const unsigned long long* claims, uint4* cache, uint4* __restrict__ out, int budget, int slots,
    int chunks_per_row, int64_t first_chunk, int64_t end_chunk, uint32_t* step_state) {
  const int64_t t = first_chunk + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t step = step_state[1];
  // Completed once this kernel (or the last of a split Fill) is; the next lookup reads it.
  if (t == first_chunk) step_state[0] = step;
  if (t >= end_chunk) return;
  const int64_t e = t / chunks_per_row;  // selected entry
  const int chunk = static_cast<int>(t - e * chunks_per_row);
  const int64_t bh = e / budget;
  const int i = static_cast<int>(e - bh * budget);
  if (i >= counts[bh]) return;
  const int32_t id = ids[e];
  if (id < 0) return;
  const int s = slot_of[e];
  uint4* cache_bh = cache + bh * slots * chunks_per_row;
  if (s >= 0) {
    out[e * chunks_per_row + chunk] = cache_bh[static_cast<int64_t>(s) * chunks_per_row + chunk];
    return;
  }
  const int victim = -2 - s;
  uint4 x;
  if (staged != nullptr && pool.slots[bh / pool.n_kv_heads].base == nullptr) {
    const int32_t row = staged_index[e];
    if (row < 0) return;  // the caller staged no row for this miss: nothing to read
    x = staged[static_cast<int64_t>(row) * chunks_per_row + chunk];
  } else {
    x = static_cast<const uint4*>(KvPoolRow(pool, bh, id, size_t{16} * chunks_per_row))[chunk];
  }
  out[e * chunks_per_row + chunk] = x;
  if (claims[bh * slots + victim] == ClaimKey(step, MissPriority(id))) {
    cache_bh[static_cast<int64_t>(victim) * chunks_per_row + chunk] = x;
    if (chunk == 0) {
      tags[bh * slots + victim] = id;
      stamps[bh * slots + victim] = step;
    }
  }
}

// Eight e4m3 codes (byte i of `codes` is element i) times `scale`, as eight bf16 (element i in
// bytes [2i, 2i + 2)): e4m3 -> half is exact, the product is fp32, the bf16 rounding to nearest
// even, as DecodeFp8 followed by a bf16 rounding on the host.
__device__ __forceinline__ uint4 DecodeFp8x8(uint2 codes, float scale) {
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
  const uint32_t w[2] = {codes.x, codes.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>((w[i / 2] >> (16 * (i % 2))) & 0xFFFFu);
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
    o[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return out;
}

// HotCacheCopyKernel for fp8 rows (PoolRowFormat::kFp8E4m3): one thread per 8 codes of each
// selected row (head_dim / 4 a row) reads them and their vector's scale from the cache, the
// pool or the staged rows, and writes the 8 decoded bf16 values (16 bytes) to `out`. A miss that
// won its victim's claim stores the codes (and, from the row's first thread, both scales) in
// the cache: the cache keeps fp8 rows.
__global__ void HotCacheCopyFp8Kernel(
    KvPoolView pool, const uint8_t* __restrict__ staged, const int32_t* __restrict__ staged_index,
    const int32_t* __restrict__ ids, const int32_t* __restrict__ counts,
    const int32_t* __restrict__ slot_of, int32_t* tags, uint32_t* stamps,
    const unsigned long long* claims, uint8_t* cache, uint4* __restrict__ out, int budget,
    int slots, int head_dim, int64_t first_chunk, int64_t end_chunk, uint32_t* step_state) {
  const int64_t t = first_chunk + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint32_t step = step_state[1];
  if (t == first_chunk) step_state[0] = step;  // as HotCacheCopyKernel
  if (t >= end_chunk) return;
  const int chunks_per_row = head_dim / 4;
  const int64_t row_bytes = 2 * int64_t{head_dim} + 2 * sizeof(float);
  const int64_t e = t / chunks_per_row;
  const int chunk = static_cast<int>(t - e * chunks_per_row);
  const int64_t bh = e / budget;
  const int i = static_cast<int>(e - bh * budget);
  if (i >= counts[bh]) return;
  const int32_t id = ids[e];
  if (id < 0) return;
  const int s = slot_of[e];
  uint8_t* cache_bh = cache + bh * slots * row_bytes;
  const uint8_t* src;
  if (s >= 0) {
    src = cache_bh + s * row_bytes;
  } else if (staged != nullptr && pool.slots[bh / pool.n_kv_heads].base == nullptr) {
    const int32_t row = staged_index[e];
    if (row < 0) return;
    src = staged + row * row_bytes;
  } else {
    src = static_cast<const uint8_t*>(KvPoolRow(pool, bh, id, static_cast<size_t>(row_bytes)));
  }
  const uint2 codes = reinterpret_cast<const uint2*>(src)[chunk];
  const float2 scales = *reinterpret_cast<const float2*>(src + 2 * head_dim);
  out[e * chunks_per_row + chunk] =
      DecodeFp8x8(codes, chunk < chunks_per_row / 2 ? scales.x : scales.y);
  if (s >= 0) return;
  const int victim = -2 - s;
  if (claims[bh * slots + victim] == ClaimKey(step, MissPriority(id))) {
    uint8_t* dst = cache_bh + victim * row_bytes;
    reinterpret_cast<uint2*>(dst)[chunk] = codes;
    if (chunk == 0) {
      *reinterpret_cast<float2*>(dst + 2 * head_dim) = scales;
      tags[bh * slots + victim] = id;
      stamps[bh * slots + victim] = step;
    }
  }
}

}  // namespace

absl::StatusOr<HotCache> HotCache::Create(const HotCacheShape& shape, cudaStream_t stream) {
  if (shape.batch <= 0 || shape.n_kv_heads <= 0 || shape.n_sets <= 0 || shape.ways <= 0 ||
      shape.ways > 8 || shape.budget <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HotCache: need batch, n_kv_heads, n_sets, budget > 0 and ways in 1..8; got batch=",
        shape.batch, " n_kv_heads=", shape.n_kv_heads, " n_sets=", shape.n_sets,
        " ways=", shape.ways, " budget=", shape.budget));
  }
  if (shape.head_dim != 64 && shape.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("HotCache: head_dim must be 64 or 128, got ", shape.head_dim));
  }
  if (shape.pool_format == PoolRowFormat::kFp8E4m3 && shape.dtype != RowDType::kBf16) {
    return absl::InvalidArgumentError("HotCache: fp8 pool rows decode to bf16 only");
  }
  HotCache c;
  c.shape_ = shape;
  const size_t heads = static_cast<size_t>(shape.batch) * shape.n_kv_heads;
  const size_t slots = heads * shape.n_sets * shape.ways;
  using kvr::cuda::DeviceBuffer;
  auto tags = DeviceBuffer<int32_t>::Create(slots);
  if (!tags.ok()) return tags.status();
  auto stamps = DeviceBuffer<uint32_t>::Create(slots);
  if (!stamps.ok()) return stamps.status();
  auto claims = DeviceBuffer<unsigned long long>::Create(slots);
  if (!claims.ok()) return claims.status();
  auto slot_of = DeviceBuffer<int32_t>::Create(heads * shape.budget);
  if (!slot_of.ok()) return slot_of.status();
  auto data = DeviceBuffer<uint8_t>::Create(slots * c.row_bytes());
  if (!data.ok()) return data.status();
  auto fills = DeviceBuffer<unsigned>::Create(heads * shape.n_sets);
  if (!fills.ok()) return fills.status();
  auto steps = DeviceBuffer<uint32_t>::Create(2);
  if (!steps.ok()) return steps.status();
  auto counters = DeviceBuffer<unsigned long long>::Create(1 + shape.batch);
  if (!counters.ok()) return counters.status();
  c.tags_ = *std::move(tags);
  c.stamps_ = *std::move(stamps);
  c.claims_ = *std::move(claims);
  c.slot_of_ = *std::move(slot_of);
  c.data_ = *std::move(data);
  c.fills_ = *std::move(fills);
  c.steps_ = *std::move(steps);
  c.counters_ = *std::move(counters);
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.tags_.data(), 0xFF, c.tags_.bytes(), stream));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.stamps_.data(), 0, c.stamps_.bytes(), stream));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.claims_.data(), 0, c.claims_.bytes(), stream));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.fills_.data(), 0, c.fills_.bytes(), stream));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.steps_.data(), 0, c.steps_.bytes(), stream));
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.counters_.data(), 0, c.counters_.bytes(), stream));
  return c;
}

absl::Status HotCache::ResetSlot(int b, cudaStream_t stream) {
  if (b < 0 || b >= shape_.batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("HotCache::ResetSlot: slot ", b, " not in [0, ", shape_.batch, ")"));
  }
  const size_t per_seq = static_cast<size_t>(shape_.n_kv_heads) * slots_per_head();
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(tags_.data() + b * per_seq, 0xFF, per_seq * sizeof(int32_t), stream));
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(stamps_.data() + b * per_seq, 0, per_seq * sizeof(uint32_t), stream));
  KVR_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(counters_.data() + 1 + b, 0, sizeof(unsigned long long), stream));
  return absl::OkStatus();
}

absl::Status HotCache::Lookup(const int32_t* ids, const int32_t* counts, cudaStream_t stream,
                              unsigned long long* slot_hits) {
  if (!ids || !counts) return absl::InvalidArgumentError("HotCache::Lookup: null ids or counts");
  const int64_t entries = static_cast<int64_t>(shape_.batch) * shape_.n_kv_heads * shape_.budget;
  constexpr int kThreads = 256;
  HotCacheLookupKernel<<<static_cast<unsigned>((entries + kThreads - 1) / kThreads), kThreads, 0,
                         stream>>>(
      ids, counts, tags_.data(), stamps_.data(), claims_.data(), fills_.data(), slot_of_.data(),
      counters_.data(), slot_hits != nullptr ? slot_hits : counters_.data() + 1, shape_.budget,
      shape_.n_kv_heads, shape_.n_sets, shape_.ways, entries, steps_.data());
  return kvr::cuda::LastLaunchStatus("HotCacheLookupKernel");
}

absl::Status HotCache::Fill(const KvPoolView& pool, const int32_t* ids, const int32_t* counts,
                            void* out, cudaStream_t stream, const void* staged,
                            const int32_t* staged_index, int first_slot, int n_slots) {
  if (!KvPoolViewSet(pool) || !ids || !counts || !out) {
    return absl::InvalidArgumentError("HotCache::Fill: null pool tables, ids, counts or out");
  }
  if ((staged == nullptr) != (staged_index == nullptr)) {
    return absl::InvalidArgumentError("HotCache::Fill: staged rows without their index, or back");
  }
  if (pool.n_kv_heads != shape_.n_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("HotCache::Fill: pool.n_kv_heads ",
                                                   pool.n_kv_heads, " != ", shape_.n_kv_heads));
  }
  if (n_slots < 0) n_slots = shape_.batch - first_slot;
  if (first_slot < 0 || n_slots < 0 || first_slot + n_slots > shape_.batch) {
    return absl::InvalidArgumentError(absl::StrCat("HotCache::Fill: slots [", first_slot, ", ",
                                                   first_slot + n_slots, ") not in [0, ",
                                                   shape_.batch, "]"));
  }
  if (n_slots == 0) return absl::OkStatus();
  const int64_t per_slot = int64_t{shape_.n_kv_heads} * shape_.budget;
  constexpr int kThreads = 256;
  // Threads per row: one per 16 bytes of a row (8 codes of an fp8 row, 16 bytes of its output).
  const int chunks_per_row = static_cast<int>(RowBytes(shape_.dtype, shape_.head_dim) / 16);
  const int64_t first = first_slot * per_slot * chunks_per_row;
  const int64_t chunks = n_slots * per_slot * chunks_per_row;
  const unsigned blocks = static_cast<unsigned>((chunks + kThreads - 1) / kThreads);
  if (shape_.pool_format == PoolRowFormat::kFp8E4m3) {
    HotCacheCopyFp8Kernel<<<blocks, kThreads, 0, stream>>>(
        pool, static_cast<const uint8_t*>(staged), staged_index, ids, counts, slot_of_.data(),
        tags_.data(), stamps_.data(), claims_.data(), data_.data(), static_cast<uint4*>(out),
        shape_.budget, slots_per_head(), shape_.head_dim, first, first + chunks, steps_.data());
    return kvr::cuda::LastLaunchStatus("HotCacheCopyFp8Kernel");
  }
  HotCacheCopyKernel<<<blocks, kThreads, 0, stream>>>(
      pool, static_cast<const uint4*>(staged), staged_index, ids, counts, slot_of_.data(),
      tags_.data(), stamps_.data(), claims_.data(), reinterpret_cast<uint4*>(data_.data()),
      static_cast<uint4*>(out), shape_.budget, slots_per_head(), chunks_per_row, first,
      first + chunks, steps_.data());
  return kvr::cuda::LastLaunchStatus("HotCacheCopyKernel");
}

absl::Status HotCache::Gather(const KvPoolView& pool, const int32_t* ids, const int32_t* counts,
                              void* out, cudaStream_t stream, unsigned long long* slot_hits) {
  if (!KvPoolViewSet(pool) || !ids || !counts || !out) {
    return absl::InvalidArgumentError("HotCache::Gather: null pool tables, ids, counts or out");
  }
  if (pool.n_kv_heads != shape_.n_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("HotCache::Gather: pool.n_kv_heads ",
                                                   pool.n_kv_heads, " != ", shape_.n_kv_heads));
  }
  KVR_RETURN_IF_ERROR(Lookup(ids, counts, stream, slot_hits));
  return Fill(pool, ids, counts, out, stream, nullptr, nullptr);
}

}  // namespace kvr::retrieval::cuda
