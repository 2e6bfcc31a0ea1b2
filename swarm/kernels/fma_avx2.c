/* fma_kernels.h for x86-64 CPUs with AVX2 and FMA (dot's 8 lanes of one column in one ymm register). */
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#endif
#define SWARM_ISA_AVX2
#include "fma_kernels.h"
SWARM_DEFINE_ISA(avx2, 0)
#ifdef __clang__
#pragma clang attribute pop
#endif
#endif
