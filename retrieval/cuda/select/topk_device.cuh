#pragma once
// Device-side building block of every selector: the top-k of one row of scores by radix select,
// written in ascending index order (see topk.cu for the algorithm). Private to
// kvr::retrieval_cuda_select (included by its .cu files only).

#include <cuda_runtime.h>

#include <cstdint>

namespace kvr::retrieval::cuda::internal {

inline constexpr int kTopKBins = 2048;  // 11-bit digits

struct TopKShared {
  int hist[kTopKBins];
  int warp_gt[32];  // compaction: per-warp counts, then their exclusive prefix
  int warp_eq[32];
  int digit;      // selected digit of the current pass
  int remaining;  // scores still to take among those matching the prefix
};

// Order-preserving map float -> uint32 (larger float, larger key). NaN -> 0, which is treated as
// "not a candidate" (no finite or infinite float maps to 0).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  if (f != f) return 0u;
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ int WarpInclusiveScan(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Top-`budget` of a row of n scores, by the whole CTA (kThreads threads, a multiple of 32,
// <= 1024). `load4(j)` returns the float4 of scores [4j, 4j + 4) with NaN beyond n (NaN is never
// chosen). Writes ids[j] = map_id(i) for the chosen i in ascending i, then -1 up to `budget`, and
// *count (when not null). load4 is called 5 times per element group: it must be cheap and
// deterministic.
template <int kThreads, typename Load4, typename MapId>
__device__ void RowTopKLoad4(Load4 load4, int n, MapId map_id, int budget, int32_t* ids,
                             int32_t* count, TopKShared& s) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  n = n > 0 ? n : 0;
  if (n == 0) {
    // Nothing to rank (e.g. a row a second pass skips): the empty result without the three
    // histogram passes (768 such rows took 66 us on the H100, 2,047-score rows 116 us).
    for (int j = tid; j < budget; j += kThreads) ids[j] = -1;
    if (tid == 0 && count != nullptr) *count = 0;
    return;
  }
  const int n4 = (n + 3) / 4;

  // Three passes: digits of 11, 11 and 10 bits, most significant first.
  uint32_t prefix = 0, prefix_mask = 0;
  if (tid == 0) s.remaining = budget;
  int valid = 0;  // non-NaN scores (from pass 0)
  constexpr int kShift[3] = {21, 10, 0};
  constexpr int kBits[3] = {11, 11, 10};
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    for (int i = tid; i < kTopKBins; i += kThreads) s.hist[i] = 0;
    __syncthreads();
    const int shift = kShift[pass];
    const uint32_t digit_mask = (1u << kBits[pass]) - 1u;
    // Strided, coalesced 16-byte loads, kLoads of them in flight per thread; the loop bound is
    // uniform per warp (ballots below).
    constexpr int kLoads = 4;
    for (int base = 0; base < n4; base += kThreads * kLoads) {
      float4 v[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int j = base + u * kThreads + tid;
        v[u] = j < n4 ? load4(j) : make_float4(NAN, NAN, NAN, NAN);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const float vals[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t key = OrderedKey(vals[e]);
          const bool match = key != 0u && (key & prefix_mask) == prefix;
          const uint32_t digit = (key >> shift) & digit_mask;
          if (pass == 0) {
            // Scores of one row share few high digits: lanes with the same digit add once.
            const unsigned active = __ballot_sync(0xffffffffu, match);
            if (match) {
              const unsigned same = __match_any_sync(active, digit);
              if (lane == __ffs(same) - 1) atomicAdd(&s.hist[digit], __popc(same));
            }
          } else if (match) {
            atomicAdd(&s.hist[digit], 1);  // few scores still match the prefix
          }
        }
      }
    }
    __syncthreads();
    if (pass == 0) {
      // Count valid scores once: the sum of pass 0's histogram (every warp computes it).
      int c = 0;
      for (int i = lane; i < kTopKBins; i += 32) c += s.hist[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
      valid = c;
    }
    // Warp 0 finds the digit d with  sum(hist[> d]) < remaining <= sum(hist[>= d]).
    if (warp == 0) {
      int need = s.remaining;
      if (pass == 0 && need > valid) need = valid;
      __syncwarp();  // every lane has read s.remaining before one of them rewrites it
      constexpr int kPerLane = kTopKBins / 32;  // 64 bins per lane, lane 0 holds the top bins
      const int hi = kTopKBins - 1 - lane * kPerLane;
      int sum = 0;
      for (int j = 0; j < kPerLane; ++j) sum += s.hist[hi - j];
      const int incl = WarpInclusiveScan(sum, lane);
      const int excl = incl - sum;
      if (need > 0 && excl < need && incl >= need) {
        int acc = excl;
        for (int j = 0; j < kPerLane; ++j) {
          const int h = s.hist[hi - j];
          if (acc + h >= need) {
            s.digit = hi - j;
            s.remaining = need - acc;
            break;
          }
          acc += h;
        }
      }
      if (need <= 0 && lane == 0) {
        s.digit = 0;
        s.remaining = 0;
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s.digit) << shift;
    prefix_mask |= digit_mask << shift;
    __syncthreads();  // s.digit is rewritten by the next pass
  }
  const int k = budget < valid ? budget : valid;
  const uint32_t threshold = prefix;  // exact key of the k-th largest (if k > 0)
  const int take_eq = s.remaining;    // ties == threshold to take, lowest index first

  // Ordered compaction. Warp w owns the contiguous float4 range [w * seg, (w + 1) * seg): count
  // its > T and == T scores, scan the counts over the warps, then each warp writes its range in
  // order with warp-level scans only (no block barrier inside the loops).
  const int seg = (n4 + kWarps - 1) / kWarps;
  const int w_begin = min(n4, warp * seg), w_end = min(n4, (warp + 1) * seg);
  int gt_count = 0, eq_count = 0;
  if (k > 0) {
    for (int j = w_begin + lane; j < w_end; j += 32) {
      const float4 v = load4(j);
      const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t key = OrderedKey(vals[e]);
        gt_count += key != 0u && key > threshold;
        eq_count += key != 0u && key == threshold;
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    gt_count += __shfl_xor_sync(0xffffffffu, gt_count, o);
    eq_count += __shfl_xor_sync(0xffffffffu, eq_count, o);
  }
  if (lane == 0) {
    s.warp_gt[warp] = gt_count;
    s.warp_eq[warp] = eq_count;
  }
  __syncthreads();
  if (warp == 0) {
    const int g = lane < kWarps ? s.warp_gt[lane] : 0;
    const int e = lane < kWarps ? s.warp_eq[lane] : 0;
    const int gi = WarpInclusiveScan(g, lane), ei = WarpInclusiveScan(e, lane);
    if (lane < kWarps) {
      s.warp_gt[lane] = gi - g;
      s.warp_eq[lane] = ei - e;
    }
  }
  __syncthreads();
  if (k > 0) {
    int eq_before = s.warp_eq[warp];
    int taken_before = s.warp_gt[warp] + min(eq_before, take_eq);
    for (int j0 = w_begin; j0 < w_end && taken_before < k; j0 += 32) {
      const int j = j0 + lane;
      float4 v = make_float4(NAN, NAN, NAN, NAN);
      if (j < w_end) v = load4(j);
      const float vals[4] = {v.x, v.y, v.z, v.w};
      bool gt[4], eq[4];
      int ce = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t key = OrderedKey(vals[e]);
        gt[e] = key != 0u && key > threshold;
        eq[e] = key != 0u && key == threshold;
        ce += eq[e];
      }
      const int ce_incl = WarpInclusiveScan(ce, lane);
      int eq_rank = eq_before + ce_incl - ce;
      bool take[4];
      int ct = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        take[e] = gt[e] || (eq[e] && eq_rank < take_eq);
        eq_rank += eq[e];
        ct += take[e];
      }
      const int ct_incl = WarpInclusiveScan(ct, lane);
      int pos = taken_before + ct_incl - ct;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (take[e]) {
          if (pos < k) ids[pos] = map_id(4 * j + e);
          ++pos;
        }
      }
      eq_before += __shfl_sync(0xffffffffu, ce_incl, 31);
      taken_before += __shfl_sync(0xffffffffu, ct_incl, 31);
    }
  }
  for (int j = k + tid; j < budget; j += kThreads) ids[j] = -1;
  if (tid == 0 && count != nullptr) *count = k;
}

// Top-k of `scores[0, n)` (device memory). 16-byte loads when `scores` is 16-byte aligned.
template <int kThreads>
__device__ void RowTopK(const float* scores, int n, int id_offset, int budget, int32_t* ids,
                        int32_t* count, TopKShared& s) {
  if ((reinterpret_cast<uintptr_t>(scores) & 15u) == 0) {
    RowTopKLoad4<kThreads>(
        [scores, n](int j) {
          if (4 * j + 3 < n) return __ldg(reinterpret_cast<const float4*>(scores) + j);
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) v[e] = 4 * j + e < n ? scores[4 * j + e] : NAN;
          return make_float4(v[0], v[1], v[2], v[3]);
        },
        n, [id_offset](int i) { return id_offset + i; }, budget, ids, count, s);
  } else {
    RowTopKLoad4<kThreads>(
        [scores, n](int j) {
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) v[e] = 4 * j + e < n ? scores[4 * j + e] : NAN;
          return make_float4(v[0], v[1], v[2], v[3]);
        },
        n, [id_offset](int i) { return id_offset + i; }, budget, ids, count, s);
  }
}

}  // namespace kvr::retrieval::cuda::internal
