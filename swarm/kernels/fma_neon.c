/* fma_kernels.h for aarch64 CPUs (Advanced SIMD, always present there: dot's 8 lanes in two q registers). */
#if defined(__aarch64__)
#define SWARM_ISA_NEON
#include "fma_kernels.h"
SWARM_DEFINE_ISA(neon, 0)
#endif
