#pragma once
// Matrix-vector kernels on ggml weight formats for the CPU decode path, one implementation per
// instruction set (generic C++, AVX2+FMA+F16C, AVX-512 with VNNI), chosen at run time from
// cpuid so that one binary runs on any x86-64 and uses what the CPU has.
//
// Block formats (Q4_0, Q4_1, Q8_0) are multiplied against activations quantised on the fly to
// 8 bits in blocks of 32 (ActivationBlock), as ggml does with its q8_0 / q8_1 activations: the
// inner products are exact integer sums, scaled once per block. Float formats (F32, F16,
// BF16) are multiplied against float32 activations.
//
// The ISA-specific implementations live in their own translation units compiled with their
// own target flags (model/runtime.cmake); nothing here needs those flags.

#include <cstdint>
#include <vector>

#include "kvr/model/tensor_types.h"

namespace kvr::model {

constexpr int64_t kActivationBlockSize = 32;

// 32 activations as int8 with one float scale: x[i] ~ d * qs[i]. `sum` is the sum of qs, which
// lets the Q4_0 offset and the Q4_1 minimum be applied once per block.
struct ActivationBlock {
  float d;
  int32_t sum;
  int8_t qs[kActivationBlockSize];
};
static_assert(sizeof(ActivationBlock) == 40);

// K/V rows for CpuKernels::attend_rows: row r of K starts at element r * row_stride of `k`,
// row r of V likewise of `v`; d elements are used from each. Elements are float32, or IEEE
// half (the f16 KV cache) when `f16`.
struct AttentionRows {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t n_rows = 0;
  int64_t row_stride = 0;  // elements
  bool f16 = false;
};

// out[h] = acc[h] / l[h] for the state attend_rows left ([n_heads, d]); zeros where no row was
// attended (l == 0). Every caller of attend_rows finishes through this one function, so that
// two paths over the same rows agree bit for bit.
inline void FinishAttention(int n_heads, int d, const float* l, const float* acc, float* out) {
  for (int h = 0; h < n_heads; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    for (int i = 0; i < d; ++i) out[int64_t{h} * d + i] = acc[int64_t{h} * d + i] * inv;
  }
}

enum class CpuIsa { kGeneric, kAvx2, kAvx512 };

// "generic", "avx2", "avx512".
const char* CpuIsaName(CpuIsa isa);

struct CpuKernels {
  CpuIsa isa = CpuIsa::kGeneric;

  // Quantises x[0..n) (n % 32 == 0) to n / 32 blocks: d = max|x| / 127, qs = round(x / d).
  void (*quantize_activations)(const float* x, int64_t n, ActivationBlock* y) = nullptr;

  // Block weights (Q4_0, Q4_1, Q8_0): for r in [0, n_rows) and j in [0, m),
  //   y[j * ldy + r] = dot(weight row r, activation row j)
  // `w` holds n_rows rows of k elements, `row_bytes` apart; `a` holds m rows of k / 32 blocks.
  void (*gemv_blocks)(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows,
                      int64_t k, const ActivationBlock* a, int64_t m, float* y,
                      int64_t ldy) = nullptr;

  // Block weights against float activations `a` [m, k] (each block decoded to floats in
  // registers, no activation rounding): slower than gemv_blocks, used where the result picks
  // tokens (the output projection).
  void (*gemv_blocks_f32)(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows,
                          int64_t k, const float* a, int64_t m, float* y, int64_t ldy) = nullptr;

  // Rows of any kernel type decoded to float32, bit-exact with DequantizeRow: out[r * k + i].
  // For prefill, which multiplies dequantised tiles of the weights with SGEMM.
  void (*dequantize_rows)(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows,
                          int64_t k, float* out) = nullptr;

  // One decode token's attention over a run of K/V rows, as online softmax: folds the rows
  // into the running state (m, l, acc) of `n_heads` query heads that share these rows, so that
  // a cache can be attended in several runs (a decode node's sinks, fetched rows and local
  // window) with FinishAttention at the end. Per head and row, in row order:
  //   s = scale * (q[h] . k[r]);  if s > m[h]: acc[h], l[h] *= exp(m[h] - s), m[h] = s
  //   p = exp(s - m[h]);  l[h] += p;  acc[h] += p * v[r]
  // The arithmetic of each (head, row) depends only on q, the row and the state before it,
  // never on how the rows are split into runs, how many heads are passed together or which
  // thread runs them: attending rows [0, n) in one call or in consecutive runs gives the same
  // bits. q: [n_heads, d]; m, l: [n_heads] (start at -inf and 0); acc: [n_heads, d] (zeros).
  void (*attend_rows)(const float* q, int n_heads, int d, float scale, const AttentionRows& rows,
                      float* m, float* l, float* acc) = nullptr;

  // Float weights (F32, F16, BF16) against float activations `a` [m, k]; same output layout.
  void (*gemv_floats)(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows,
                      int64_t k, const float* a, int64_t m, float* y, int64_t ldy) = nullptr;

  // One query row's softmax over the scores of its visible keys, in place (prefill attention,
  // between its two GEMMs): for r < visible, s[r] = exp(s[r] - max) / sum, where max and sum
  // run over s[0, visible); s[r] = 0 for visible <= r < n. 1 <= visible <= n. For finite
  // scores (what the GEMM gives finite inputs); NaN is not propagated by the SIMD kernels.
  void (*softmax_prefix)(float* s, int64_t visible, int64_t n) = nullptr;
};

// True for the weight types the kernels take directly.
bool IsBlockKernelType(GgmlType type);  // Q4_0, Q4_1, Q8_0
bool IsFloatKernelType(GgmlType type);  // F32, F16, BF16

// The kernels of `isa`, or nullptr when this binary was built without them or the CPU lacks
// the instructions.
const CpuKernels* CpuKernelsFor(CpuIsa isa);

// Every ISA usable here, generic first.
std::vector<CpuIsa> AvailableCpuIsas();

// The widest usable ISA; the environment variable KVR_CPU_ISA=generic|avx2|avx512 caps it (for
// comparisons and for reproducing a result of a smaller machine). Read once.
const CpuKernels& BestCpuKernels();

}  // namespace kvr::model
