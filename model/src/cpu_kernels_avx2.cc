// AVX2 + FMA + F16C kernels (compiled with those target flags: model/runtime.cmake).
#define KVR_KERNEL_NS avx2
#define KVR_KERNEL_VNNI 0
#include "cpu_kernels_x86.inc"
