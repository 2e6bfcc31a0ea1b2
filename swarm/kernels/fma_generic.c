/* fma_kernels.h in plain C, one lane at a time: the arithmetic as fma.c states it, on any CPU (slow; the
 * reference the vector paths are checked against, and the path of a CPU that has none of them). */
#define SWARM_ISA_GENERIC
#include "fma_kernels.h"
SWARM_DEFINE_ISA(generic, 0)
