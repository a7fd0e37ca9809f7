#include "kvr/model/cpu_kernels.h"

#include <cstdlib>
#include <cstring>

#include "cpu_kernels_isa.h"

namespace kvr::model {
namespace {

#define KVR_KERNEL_TABLE(ns, isa_value)                                                            \
  CpuKernels {                                                                                     \
    isa_value, &ns::QuantizeActivations, &ns::GemvBlocks, &ns::GemvBlocksF32, &ns::DequantizeRows, \
        &ns::AttendRows, &ns::GemvFloats, &ns::SoftmaxPrefix                                       \
  }

bool CpuHas(CpuIsa isa) {
#if !defined(KVR_X86_KERNELS)
  return isa == CpuIsa::kGeneric;  // the SIMD translation units are x86-only
#else
  switch (isa) {
    case CpuIsa::kGeneric:
      return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx512:
      return CpuHas(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni");
  }
  return false;
#endif
}

}  // namespace

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric:
      return "generic";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool IsBlockKernelType(GgmlType type) {
  return type == GgmlType::kQ4_0 || type == GgmlType::kQ4_1 || type == GgmlType::kQ8_0;
}

bool IsFloatKernelType(GgmlType type) {
  return type == GgmlType::kF32 || type == GgmlType::kF16 || type == GgmlType::kBF16;
}

const CpuKernels* CpuKernelsFor(CpuIsa isa) {
  static const CpuKernels kGeneric = KVR_KERNEL_TABLE(generic, CpuIsa::kGeneric);
  if (!CpuHas(isa)) return nullptr;
#if defined(KVR_X86_KERNELS)
  static const CpuKernels kAvx2 = KVR_KERNEL_TABLE(avx2, CpuIsa::kAvx2);
  static const CpuKernels kAvx512 = KVR_KERNEL_TABLE(avx512, CpuIsa::kAvx512);
  if (isa == CpuIsa::kAvx2) return &kAvx2;
  if (isa == CpuIsa::kAvx512) return &kAvx512;
#endif
  return isa == CpuIsa::kGeneric ? &kGeneric : nullptr;
}

std::vector<CpuIsa> AvailableCpuIsas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (CpuKernelsFor(isa) != nullptr) isas.push_back(isa);
  }
  return isas;
}

const CpuKernels& BestCpuKernels() {
  // Immutable after the first call (a function-local static, not mutable global state).
  static const CpuKernels* const best = [] {
    const char* cap = std::getenv("KVR_CPU_ISA");
    const CpuKernels* chosen = CpuKernelsFor(CpuIsa::kGeneric);
    for (CpuIsa isa : AvailableCpuIsas()) {
      chosen = CpuKernelsFor(isa);
      if (cap != nullptr && std::strcmp(cap, CpuIsaName(isa)) == 0) break;
    }
    return chosen;
  }();
  return *best;
}

}  // namespace kvr::model
