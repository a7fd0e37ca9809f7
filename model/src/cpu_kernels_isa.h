#pragma once
// The entry points of each instruction set's kernel translation unit (cpu_kernels.cc gathers
// them into CpuKernels tables). Each namespace is compiled with its own target flags; call
// into avx2:: or avx512:: only after checking the CPU (cpu_kernels.cc does).

#include <cstdint>

#include "kvr/model/cpu_kernels.h"

#define KVR_DECLARE_CPU_KERNELS(ns)                                                              \
  namespace ns {                                                                                 \
  void QuantizeActivations(const float* x, int64_t n, ActivationBlock* y);                       \
  void GemvBlocks(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, \
                  const ActivationBlock* a, int64_t m, float* y, int64_t ldy);                   \
  void GemvBlocksF32(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows,         \
                     int64_t k, const float* a, int64_t m, float* y, int64_t ldy);               \
  void DequantizeRows(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows,        \
                      int64_t k, float* out);                                                    \
  void AttendRows(const float* q, int n_heads, int d, float scale, const AttentionRows& rows,    \
                  float* m, float* l, float* acc);                                               \
  void GemvFloats(GgmlType type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, \
                  const float* a, int64_t m, float* y, int64_t ldy);                             \
  void SoftmaxPrefix(float* s, int64_t visible, int64_t n);                                      \
  }

namespace kvr::model {
KVR_DECLARE_CPU_KERNELS(generic)
KVR_DECLARE_CPU_KERNELS(avx2)
KVR_DECLARE_CPU_KERNELS(avx512)
}  // namespace kvr::model

#undef KVR_DECLARE_CPU_KERNELS
