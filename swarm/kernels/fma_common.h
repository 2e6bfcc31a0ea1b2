/* What fma.c shares with the per-ISA kernel files: the thread pool's entry point and the table of
 * one instruction set's kernels (see fma_kernels.h). */
#ifndef SWARM_FMA_COMMON_H
#define SWARM_FMA_COMMON_H

#include <stdint.h>

typedef void (*swarm_task_fn)(const void *ctx, int64_t i);

/* Run fn(ctx, i) for i < ntasks on up to `threads` threads (the caller being one of them). */
__attribute__((visibility("hidden"))) void swarm_parallel_for(int threads, swarm_task_fn fn, const void *ctx,
                                                              int64_t ntasks);

/* One block-format weight of a swarm_qlinear_many call: out (M, N), row stride ldo = x w^T + bias (N or NULL),
 * w N rows of ldw bytes in block format fmt (swarm_qlinear's numbers). */
typedef struct {
    int32_t fmt;
    const uint8_t *w;
    int64_t N, ldw;
    const float *bias;
    float *out;
    int64_t ldo;
} swarm_qpart;
#define SWARM_QPARTS_MAX 4

typedef struct swarm_isa {
    const char *name;
    void (*linear)(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N, int64_t ldw,
                   const float *bias, float *out, int64_t ldo, int threads);
    int (*linear_bf16)(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                        int64_t ldw, const float *bias, float *out, int64_t ldo, int threads);
    int (*attention)(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const float *k,
                     const float *v, int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale,
                     float *out, int threads);
    int (*attention_bf16)(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const uint16_t *k,
                          const uint16_t *v, int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale,
                          float *out, int threads);
    void (*rmsnorm)(const float *x, int64_t N, int64_t D, const float *w, float eps, float *out);
    void (*silu)(const float *x, int64_t n, float *out);
    int (*qlinear_many)(const swarm_qpart *parts, int nparts, const float *x, int64_t M, int64_t K, int64_t ldx,
                        int threads);
    /* where the GEMM of a single row (a decode step) runs faster in another ISA of the library (the same
     * bits by construction): AVX-512's column pairs cost a shuffle per load that one row cannot share */
    const struct swarm_isa *one_row;
} swarm_isa;

/* fma.c's public entry points (through the ISA in use) and fp8.c's, for the kernels built from them (fma_layer.c). */
void swarm_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N, int64_t ldw,
                  const float *bias, float *out, int64_t ldo, int threads);
int swarm_linear_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N, int64_t ldw,
                       const float *bias, float *out, int64_t ldo, int threads);
int swarm_attention(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const float *k, const float *v,
                    int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale, float *out, int threads);
int swarm_attention_bf16(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const uint16_t *k,
                         const uint16_t *v, int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale,
                         float *out, int threads);
int swarm_qlinear(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                  int64_t ldw, const float *bias, float *out, int64_t ldo, int threads);
int swarm_qlinear_many(const swarm_qpart *parts, int nparts, const float *x, int64_t M, int64_t K, int64_t ldx,
                       int threads);
int swarm_fp8_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w8, int64_t N, int64_t ldw,
                     const float *scale, int64_t lds, int64_t bn, int64_t bk, const float *bias, float *out,
                     int64_t ldo, int bf16, int threads);
/* the name of the ISA the entry points run now ("avx512", "avx2", "neon", "generic") */
const char *swarm_isa_in_use(void);
void swarm_rmsnorm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *out);
void swarm_silu(const float *x, int64_t n, float *out);

#endif
