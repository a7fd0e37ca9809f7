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
  int warp_a[32];
  int warp_b[32];
  int digit;       // selected digit of the current pass
  int remaining;   // scores still to take among those matching the prefix
  int total;       // running count (compaction)
  int eq_seen;     // ties with T seen so far (compaction)
  int chunk_take;  // taken in the current chunk (compaction)
};

// Order-preserving map float -> uint32 (larger float, larger key). NaN -> 0, which is treated as
// "not a candidate" (no finite or infinite float maps to 0).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  if (f != f) return 0u;
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Top-`budget` of scores load(i), i in [0, n), for ONE row, by the whole CTA (kThreads threads,
// a multiple of 32, <= 1024). Writes ids[j] = id_offset + i for the chosen i, ascending, then -1
// up to `budget`, and *count. `load` must be cheap and deterministic (called ~4 times per i).
template <int kThreads, typename Load>
__device__ void RowTopKLoad(Load load, int n, int id_offset, int budget, int32_t* ids,
                            int32_t* count, TopKShared& s) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  n = n > 0 ? n : 0;

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
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + tid;
      bool match = false;
      uint32_t digit = 0;
      if (i < n) {
        const uint32_t key = OrderedKey(load(i));
        match = key != 0u && (key & prefix_mask) == prefix;
        digit = (key >> shift) & digit_mask;
      }
      const unsigned active = __ballot_sync(0xffffffffu, match);
      if (match) {
        // Lanes with the same digit add once (scores of a row share few high digits).
        const unsigned same = __match_any_sync(active, digit);
        if (lane == __ffs(same) - 1) atomicAdd(&s.hist[digit], __popc(same));
      }
    }
    __syncthreads();
    if (pass == 0) {
      // Count valid scores once: the sum of pass 0's histogram (every warp computes it, so no
      // extra barrier is needed).
      int c = 0;
      for (int i = lane; i < kTopKBins; i += 32) c += s.hist[i];
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
      int incl = sum;  // inclusive scan from lane 0 (highest bins) upward
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
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
      if (need <= 0 && lane == 0) s.digit = 0;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s.digit) << shift;
    prefix_mask |= digit_mask << shift;
    __syncthreads();  // s.digit is rewritten by the next pass
  }
  const int k = budget < valid ? budget : valid;
  const uint32_t threshold = prefix;  // exact key of the k-th largest (if k > 0)
  const int take_eq = s.remaining;    // ties == threshold to take, lowest index first

  // Ordered compaction.
  if (tid == 0) {
    s.total = 0;
    s.eq_seen = 0;
  }
  __syncthreads();
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int base = 0; base < n && k > 0; base += kThreads) {
    if (s.total >= k) break;  // uniform: read after the barrier that ended the last chunk
    const int i = base + tid;
    uint32_t key = 0;
    if (i < n) key = OrderedKey(load(i));
    const bool gt = key != 0u && key > threshold;
    const bool eq = key != 0u && key == threshold;
    const unsigned eq_ball = __ballot_sync(0xffffffffu, eq);
    if (lane == 0) s.warp_a[warp] = __popc(eq_ball);
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the warps' tie counts
      int v = lane < kWarps ? s.warp_a[lane] : 0;
      int incl = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      if (lane < kWarps) s.warp_a[lane] = incl - v;
    }
    __syncthreads();
    const int eq_rank = s.eq_seen + s.warp_a[warp] + __popc(eq_ball & lt_mask);
    const bool take = gt || (eq && eq_rank < take_eq);
    const unsigned take_ball = __ballot_sync(0xffffffffu, take);
    if (lane == 0) s.warp_b[warp] = __popc(take_ball);
    __syncthreads();
    if (warp == 0) {
      int v = lane < kWarps ? s.warp_b[lane] : 0;
      int incl = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      if (lane < kWarps) s.warp_b[lane] = incl - v;
      if (lane == 31) s.chunk_take = incl;
    }
    __syncthreads();
    if (take) {
      const int pos = s.total + s.warp_b[warp] + __popc(take_ball & lt_mask);
      if (pos < k) ids[pos] = id_offset + i;
    }
    __syncthreads();  // every thread has read s.total before it moves on
    if (tid == 0) s.total += s.chunk_take;
    if (lane == 0) atomicAdd(&s.eq_seen, __popc(eq_ball));
    __syncthreads();
  }
  for (int j = k + tid; j < budget; j += kThreads) ids[j] = -1;
  if (tid == 0) *count = k;
}

template <int kThreads>
__device__ void RowTopK(const float* scores, int n, int id_offset, int budget, int32_t* ids,
                        int32_t* count, TopKShared& s) {
  RowTopKLoad<kThreads>([scores](int i) { return scores[i]; }, n, id_offset, budget, ids, count, s);
}

}  // namespace kvr::retrieval::cuda::internal
