// a2ats: WRoPE query, codeword scoring, whole-codeword selection (selection.cuh), the CPU
// A2atsIndex::Select (retrieval/src/a2ats.cc) and HeadCodebook::Scores (codebook.cc).
//
//  1. A2atsQueryKernel, one CTA per row: re-rotation of each group head's query from its
//     position to the WRoPE offset b (ApplyRope: double angles, float rotation), then x = q L^-T
//     = L^-1 q with L^-1 precomputed on the host in double (A2atsLayoutFromIndexes): a
//     matrix-vector product instead of a 128-step dependent solve: [rows, group, head_dim].
//  2. A2atsScoreKernel, grid (codeword chunks, n_kv_heads, batch): scale * x . c^z for every
//     codeword and group head (the query x codebook table), [rows, group, L].
//  3. A2atsCountKernel, grid (token chunks, n_kv_heads, batch): selectable tokens per codeword
//     (shared-memory histogram of the uint16 ids), [rows, L].
//  4. A2atsRankKernel, one CTA per row: GQA aggregation per codeword (kSumSoftmax: each head's
//     softmax over the selectable tokens, log Z = logsumexp_c(s(c) + log count(c))), codewords
//     with tokens sorted by (score desc, id asc) (bitonic, shared memory), count prefix in rank
//     order: whole codewords while they fit, the next one is the boundary.
//  5. A2atsEmitKernel, one CTA per row: ordered compaction of the selectable tokens: every token
//     of a whole codeword, and the last `rest` tokens of the boundary codeword (the most recent).
// Scores go through L^-1 and a dot product summed in another order than OpenBLAS's strsv /
// sgemv, so near-equal codeword scores may order differently from the CPU
// (see the parity test). Bytes per step: the ids (2 per token and KV head) and the codebook
// (L x head_dim x 4 per KV head, shared by the batch).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kvr/common/cuda/cuda_util.h"
#include "kvr/common/status.h"
#include "kvr/retrieval/cuda/selection.cuh"
#include "quant_common.cuh"
#include "select_common.cuh"

namespace kvr::retrieval::cuda {
namespace {

using internal::AlignUp;
using internal::kMaxGroup;
using internal::RowLd;

constexpr int kMaxCodebook = 8192;
constexpr int kRankThreads = 1024;
constexpr int kCountChunk = 4096;
constexpr int kScoreCodewords = 32;  // codewords per CTA of the scoring kernel

struct Args {
  int n_kv_heads, group, head_dim, size, budget;
  float scale;
  GqaAggregation gqa;
  int rope_style, rotary_dim;
  float theta;
  int64_t wrope_offset;
  const float* chol_inv;
  const float* codewords;
  const float* query;
  const int64_t* query_position;
  const uint16_t* ids;
  const int32_t* n_tokens;
  int max_tokens;
  CandidateRanges cand;
  float* qz;       // [rows, group, head_dim]
  float* cw;       // [rows, group, ldl]
  int ldl;
  int32_t* counts;  // [rows, size]
  uint8_t* take;    // [rows, size]
  int32_t* info;    // [rows, 2]: boundary codeword's selectable tokens, tokens taken from it
  SelectionOutput out;
};

__device__ __forceinline__ void RowRange(const Args& a, int b, int& lo, int& n_sel) {
  lo = max(0, a.cand.begin[b]);
  const int hi = min(a.cand.end[b], a.n_tokens[b]);
  n_sel = max(0, hi - lo);
}

// One CTA per row: L^-1 of the KV head in shared memory (rows padded to d + 1 floats: threads
// reading one column hit distinct banks), the WRoPE re-rotation of every group head, then
// x = L^-1 q (a triangular matrix-vector product instead of the CPU's sequential solve).
static __global__ void __launch_bounds__(256) A2atsQueryKernel(Args a) {
  const int row = blockIdx.x;
  const int b = row / a.n_kv_heads, h = row % a.n_kv_heads;
  const int d = a.head_dim, group = a.group;
  extern __shared__ float sm[];
  float* linv = sm;                          // [d, d + 1]
  float* xs = sm + d * (d + 1);              // [group, d]
  const float* src = a.chol_inv + static_cast<int64_t>(h) * d * d;
  for (int e = threadIdx.x; e < d * d; e += blockDim.x) linv[(e / d) * (d + 1) + e % d] = src[e];
  const float* q = a.query + static_cast<int64_t>(row) * group * d;
  for (int e = threadIdx.x; e < group * d; e += blockDim.x) xs[e] = q[e];
  __syncthreads();
  const double rerotate =
      static_cast<double>(a.wrope_offset) - static_cast<double>(a.query_position[b]);
  if (a.rope_style != 0 && rerotate != 0.0) {
    const int rot = a.rotary_dim > 0 ? a.rotary_dim : d;
    const int half = rot / 2;
    for (int e = threadIdx.x; e < group * half; e += blockDim.x) {
      const int g = e / half, i = e % half;
      const double freq = pow(static_cast<double>(a.theta), -2.0 * i / rot);
      const double angle = rerotate * freq;
      const float c = static_cast<float>(cos(angle));
      const float s = static_cast<float>(sin(angle));
      const int ia = g * d + (a.rope_style == 1 ? 2 * i : i);
      const int ib = g * d + (a.rope_style == 1 ? 2 * i + 1 : i + half);
      const float xa = xs[ia], yb = xs[ib];
      xs[ia] = __fsub_rn(__fmul_rn(xa, c), __fmul_rn(yb, s));
      xs[ib] = __fadd_rn(__fmul_rn(xa, s), __fmul_rn(yb, c));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < group * d; e += blockDim.x) {
    const int g = e / d, i = e % d;
    const float* lr = linv + i * (d + 1);
    const float* x = xs + g * d;
    float s = 0.f;
    for (int j = 0; j <= i; ++j) s = fmaf(lr[j], x[j], s);
    a.qz[static_cast<int64_t>(row) * group * d + e] = s;
  }
}

static __global__ void __launch_bounds__(256) A2atsScoreKernel(Args a) {
  const int b = blockIdx.z, h = blockIdx.y, row = b * a.n_kv_heads + h;
  const int d = a.head_dim, group = a.group;
  __shared__ float x[kMaxGroup * 128];
  for (int i = threadIdx.x; i < group * d; i += blockDim.x) {
    x[i] = a.qz[static_cast<int64_t>(row) * group * d + i];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c_end = min(a.size, static_cast<int>(blockIdx.x + 1) * kScoreCodewords);
  for (int c = blockIdx.x * kScoreCodewords + warp; c < c_end; c += 8) {
    const float* cz = a.codewords + (static_cast<int64_t>(h) * a.size + c) * d;
    float k[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) k[e] = lane + 32 * e < d ? cz[lane + 32 * e] : 0.f;
    for (int g = 0; g < group; ++g) {
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (lane + 32 * e < d) s = fmaf(x[g * d + lane + 32 * e], k[e], s);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) a.cw[(static_cast<int64_t>(row) * group + g) * a.ldl + c] = s * a.scale;
    }
  }
}

static __global__ void __launch_bounds__(256) A2atsCountKernel(Args a) {
  const int b = blockIdx.z, h = blockIdx.y, row = b * a.n_kv_heads + h;
  int lo = 0, n_sel = 0;
  RowRange(a, b, lo, n_sel);
  const int begin = blockIdx.x * kCountChunk;
  if (begin >= n_sel) return;
  const int end = min(n_sel, begin + kCountChunk);
  extern __shared__ int hist[];  // [size]
  for (int i = threadIdx.x; i < a.size; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const uint16_t* ids = a.ids + static_cast<int64_t>(row) * a.max_tokens + lo;
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int c = ids[i];
    if (c < a.size) atomicAdd(&hist[c], 1);
  }
  __syncthreads();
  int32_t* g = a.counts + static_cast<int64_t>(row) * a.size;
  for (int i = threadIdx.x; i < a.size; i += blockDim.x) {
    if (hist[i] != 0) atomicAdd(&g[i], hist[i]);
  }
}

template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) r = op(r, scratch[w]);
  return r;
}

static __global__ void __launch_bounds__(kRankThreads) A2atsRankKernel(Args a, int sort_size) {
  const int row = blockIdx.x;
  const int L = a.size;
  extern __shared__ unsigned char smem_raw[];
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem_raw);  // [sort_size]
  float* agg = reinterpret_cast<float*>(keys + sort_size);  // [L]
  int* cnt = reinterpret_cast<int*>(agg + L);               // [L]
  __shared__ float f_scratch[32];
  __shared__ double d_scratch[32];
  __shared__ int s_warp[32];
  __shared__ int s_boundary[2];
  const int32_t* gcnt = a.counts + static_cast<int64_t>(row) * L;
  uint8_t* take = a.take + static_cast<int64_t>(row) * L;
  for (int c = threadIdx.x; c < L; c += blockDim.x) {
    cnt[c] = gcnt[c];
    agg[c] = a.gqa == GqaAggregation::kMaxLogit ? -INFINITY : 0.f;
    take[c] = 0;
  }
  if (threadIdx.x == 0) {
    s_boundary[0] = 0;
    s_boundary[1] = 0;
  }
  __syncthreads();
  for (int g = 0; g < a.group; ++g) {
    const float* s = a.cw + (static_cast<int64_t>(row) * a.group + g) * a.ldl;
    if (a.gqa == GqaAggregation::kSumSoftmax) {
      float mx = -INFINITY;
      for (int c = threadIdx.x; c < L; c += blockDim.x) {
        if (cnt[c] > 0) mx = fmaxf(mx, s[c]);
      }
      mx = BlockReduce(mx, [](float x, float y) { return fmaxf(x, y); }, f_scratch);
      double z = 0;
      for (int c = threadIdx.x; c < L; c += blockDim.x) {
        if (cnt[c] > 0) z += static_cast<double>(cnt[c]) * static_cast<double>(expf(s[c] - mx));
      }
      z = BlockReduce(z, [](double x, double y) { return x + y; }, d_scratch);
      const float log_z = mx + static_cast<float>(log(z));
      for (int c = threadIdx.x; c < L; c += blockDim.x) agg[c] += expf(s[c] - log_z);
    } else if (a.gqa == GqaAggregation::kMaxLogit) {
      for (int c = threadIdx.x; c < L; c += blockDim.x) agg[c] = agg[c] < s[c] ? s[c] : agg[c];
    } else {
      for (int c = threadIdx.x; c < L; c += blockDim.x) agg[c] = agg[c] + s[c];
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < sort_size; c += blockDim.x) {
    keys[c] = (c < L && cnt[c] > 0) ? internal::DescendingKey(agg[c], c) : ~0ull;
  }
  __syncthreads();
  for (int k = 2; k <= sort_size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < sort_size; i += blockDim.x) {
        const int l = i ^ j;
        if (l > i) {
          const uint64_t x = keys[i], y = keys[l];
          const bool up = (i & k) == 0;
          if ((x > y) == up) {
            keys[i] = y;
            keys[l] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  // Count prefix in rank order: thread t owns ranks [t * per, (t + 1) * per).
  const int per = (sort_size + kRankThreads - 1) / kRankThreads;
  const int first = threadIdx.x * per;
  int local = 0;
  for (int e = 0; e < per; ++e) {
    const int r = first + e;
    if (r < sort_size && keys[r] != ~0ull) local += cnt[static_cast<uint32_t>(keys[r])];
  }
  int prefix = internal::BlockExclusiveScanInt(local, s_warp);
  for (int e = 0; e < per; ++e) {
    const int r = first + e;
    if (r >= sort_size || keys[r] == ~0ull) break;
    const int c = static_cast<int>(static_cast<uint32_t>(keys[r]));
    const int n = cnt[c];
    if (prefix + n <= a.budget) {
      take[c] = 2;
    } else if (prefix < a.budget) {
      take[c] = 1;
      s_boundary[0] = n;
      s_boundary[1] = a.budget - prefix;
    }
    prefix += n;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a.info[2 * row] = s_boundary[0];
    a.info[2 * row + 1] = s_boundary[1];
  }
}

static __global__ void __launch_bounds__(kRankThreads) A2atsEmitKernel(Args a) {
  const int row = blockIdx.x;
  const int b = row / a.n_kv_heads;
  int lo = 0, n_sel = 0;
  RowRange(a, b, lo, n_sel);
  __shared__ internal::CompactShared cs;
  const uint16_t* ids = a.ids + static_cast<int64_t>(row) * a.max_tokens + lo;
  const uint8_t* take = a.take + static_cast<int64_t>(row) * a.size;
  const int nb = a.info[2 * row], rest = a.info[2 * row + 1];
  const int budget = a.out.budget;
  const int L = a.size;
  int32_t* out = a.out.ids + static_cast<int64_t>(row) * budget;
  const int n = internal::OrderedCompact<kRankThreads>(
      n_sel,
      [ids, take, L](int i) {
        const int c = ids[i];
        const int t = c < L ? take[c] : 0;
        return t == 2 ? 1 : (t == 1 ? 2 : 0);
      },
      nb - rest, nb,
      [out, lo, budget](int pos, int i) {
        if (pos < budget) out[pos] = lo + i;
      },
      cs);
  const int count = min(n, budget);
  for (int j = count + threadIdx.x; j < budget; j += blockDim.x) out[j] = -1;
  if (threadIdx.x == 0) a.out.counts[row] = count;
}

int Group(const A2atsSelectParams& p) { return p.n_kv_heads > 0 ? p.n_heads / p.n_kv_heads : 0; }

int SortSize(int n) {
  int s = 1;
  while (s < n) s <<= 1;
  return s;
}

struct Workspace {
  float* qz = nullptr;
  float* cw = nullptr;
  int ldl = 0;
  int32_t* counts = nullptr;
  size_t counts_bytes = 0;
  uint8_t* take = nullptr;
  int32_t* info = nullptr;
  size_t bytes = 0;
};

Workspace Carve(const A2atsSelectParams& p, char* base) {
  const size_t rows = static_cast<size_t>(p.batch) * p.n_kv_heads;
  const size_t group = Group(p);
  Workspace w;
  internal::Carver carve(base);
  const size_t L = std::max(1, p.codebook_size);
  w.qz = carve.Take<float>(rows * group * std::max(1, p.head_dim));
  w.ldl = RowLd(static_cast<int>(L));
  w.cw = carve.Take<float>(rows * group * w.ldl);
  w.counts_bytes = rows * L * sizeof(int32_t);
  w.counts = reinterpret_cast<int32_t*>(carve.TakeBytes(w.counts_bytes));
  w.take = carve.Take<uint8_t>(rows * L);
  w.info = carve.Take<int32_t>(rows * 2);
  w.bytes = carve.used();
  return w;
}

}  // namespace

size_t A2atsSelectWorkspaceBytes(const A2atsSelectParams& p) { return Carve(p, nullptr).bytes; }

absl::Status A2atsSelect(const A2atsSelectParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.n_kv_heads <= 0 || p.n_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      Group(p) > kMaxGroup) {
    return absl::InvalidArgumentError(absl::StrCat(
        "A2atsSelect: need n_heads a multiple of n_kv_heads with a group of at most ", kMaxGroup,
        "; got ", p.n_heads, " / ", p.n_kv_heads));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("A2atsSelect: head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (p.codebook_size < 1 || p.codebook_size > kMaxCodebook) {
    return absl::InvalidArgumentError(absl::StrCat("A2atsSelect: codebook_size must be in [1, ",
                                                   kMaxCodebook, "], got ", p.codebook_size));
  }
  if (p.out.budget < 1 || p.out.budget > kMaxBudget) {
    return absl::InvalidArgumentError(
        absl::StrCat("A2atsSelect: budget must be in [1, ", kMaxBudget, "], got ", p.out.budget));
  }
  if (p.rope.style != RopeStyle::kNone &&
      (p.rope.rotary_dim < 0 || p.rope.rotary_dim > p.head_dim || p.rope.rotary_dim % 2 != 0)) {
    return absl::InvalidArgumentError("A2atsSelect: rotary_dim must be even and <= head_dim");
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.chol_inv == nullptr || p.codewords == nullptr || p.query == nullptr ||
      p.query_position == nullptr || p.ids == nullptr || p.n_tokens == nullptr ||
      p.cand.begin == nullptr || p.cand.end == nullptr || p.out.ids == nullptr ||
      p.out.counts == nullptr) {
    return absl::InvalidArgumentError(
        "A2atsSelect: null codebooks, query, positions, ids, candidates or output");
  }
  const Workspace w = Carve(p, static_cast<char*>(p.workspace));
  if (p.workspace == nullptr || p.workspace_bytes < w.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("A2atsSelect: workspace of ", p.workspace_bytes, " bytes, need ", w.bytes));
  }
  const int group = Group(p);
  const int rows = p.batch * p.n_kv_heads;
  Args a;
  a.n_kv_heads = p.n_kv_heads;
  a.group = group;
  a.head_dim = p.head_dim;
  a.size = p.codebook_size;
  a.budget = p.out.budget;
  a.scale = p.scale;
  a.gqa = p.gqa;
  a.rope_style = static_cast<int>(p.rope.style);
  a.rotary_dim = p.rope.rotary_dim;
  a.theta = p.rope.theta;
  a.wrope_offset = p.wrope_offset;
  a.chol_inv = p.chol_inv;
  a.codewords = p.codewords;
  a.query = p.query;
  a.query_position = p.query_position;
  a.ids = p.ids;
  a.n_tokens = p.n_tokens;
  a.max_tokens = p.max_tokens;
  a.cand = p.cand;
  a.qz = w.qz;
  a.cw = w.cw;
  a.ldl = w.ldl;
  a.counts = w.counts;
  a.take = w.take;
  a.info = w.info;
  a.out = p.out;
  KVR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(w.counts, 0, w.counts_bytes, stream));
  const size_t query_smem =
      (static_cast<size_t>(p.head_dim) * (p.head_dim + 1) + static_cast<size_t>(group) * p.head_dim) *
      sizeof(float);
  KVR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      A2atsQueryKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(query_smem)));
  A2atsQueryKernel<<<rows, 256, query_smem, stream>>>(a);
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  A2atsScoreKernel<<<dim3((p.codebook_size + kScoreCodewords - 1) / kScoreCodewords, p.n_kv_heads,
                          p.batch),
                     256, 0, stream>>>(a);
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int n_chunks = std::max(1, (p.max_candidates + kCountChunk - 1) / kCountChunk);
  const size_t count_smem = static_cast<size_t>(p.codebook_size) * sizeof(int);
  KVR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      A2atsCountKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(count_smem)));
  A2atsCountKernel<<<dim3(n_chunks, p.n_kv_heads, p.batch), 256, count_smem, stream>>>(a);
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int sort_size = SortSize(p.codebook_size);
  const size_t rank_smem = static_cast<size_t>(sort_size) * sizeof(uint64_t) +
                           static_cast<size_t>(p.codebook_size) * (sizeof(float) + sizeof(int));
  KVR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      A2atsRankKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(rank_smem)));
  A2atsRankKernel<<<rows, kRankThreads, rank_smem, stream>>>(a, sort_size);
  KVR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  A2atsEmitKernel<<<rows, kRankThreads, 0, stream>>>(a);
  return kvr::cuda::LastLaunchStatus("A2atsEmitKernel");
}

}  // namespace kvr::retrieval::cuda
