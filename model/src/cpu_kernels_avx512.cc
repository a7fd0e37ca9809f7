// AVX-512 (F, BW, VL) + VNNI kernels: the AVX2 code with vpdpbusd for the u8 x s8 dot products
// (compiled with those target flags: model/runtime.cmake).
#define KVR_KERNEL_NS avx512
#define KVR_KERNEL_VNNI 1
#include "cpu_kernels_x86.inc"
