/* fma_kernels.h for x86-64 CPUs with AVX-512F and AVX-512BW (dot's 8 lanes of two columns in one zmm register). */
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx2,fma,f16c")
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))), apply_to = function)
#endif
#define SWARM_ISA_AVX512
#include "fma_kernels.h"
extern __attribute__((visibility("hidden"))) const swarm_isa swarm_isa_avx2;
SWARM_DEFINE_ISA(avx512, &swarm_isa_avx2)
#ifdef __clang__
#pragma clang attribute pop
#endif
#endif
