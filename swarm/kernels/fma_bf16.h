/* The bfloat16 GEMM of swarm's CPU arithmetic (fma.c states it: SWARM_BF16_ARITHMETIC), included by
 * fma_kernels.h once per instruction set.
 *
 * out[m, n] = dot2(bf16(x[m]), w[n], K) (+ bias[n]), every operation flushing to zero (x86's DAZ and FTZ:
 * a subnormal input reads as zero, a result tiny after rounding becomes a zero of its sign):
 *   bf16(x): float32 -> bfloat16, round half to even, a subnormal to a zero of its sign, NaN quiet;
 *   dot2(a, b, K): K padded with +0 to a multiple of 16; 8 lanes, lane l accumulating from +0, for
 *     each block i of 16, a[16i + 2l + 1] * b[16i + 2l + 1] then a[16i + 2l] * b[16i + 2l], each by one
 *     FMA; then dot's tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); then + bias.
 * A bfloat16 product is exact in float32, so each step is one rounding: the bits of AVX512-BF16's
 * vdpbf16ps (Intel SDM: "FP32 FMA with DAZ in, FTZ out and RNE rounding", the odd element first),
 * which the AVX-512 path uses where the CPU has it (SWARM_BF16DP=0 turns it off). Elsewhere the same
 * FMAs run on the widened halves of each pair: under MXCSR's FTZ and DAZ on x86, under FPCR.FZ on
 * aarch64 (whose flush decides tininess before rounding: a call that raised FPSR's underflow or
 * input-denormal flag is run again by the plain C path), and in plain C by ftz_fma, IEEE arithmetic
 * corrected to x86's flush.
 *
 * fma_kernels.h defines, before including this: bx_t / bw_t (what one step of 16 keeps of a row of x / a group of w), bx_load(p, h) (8 floats of x's
 * copy, the half h of a block), bw_load(a, b, h) (the half h of w's pairs, widened), bf_dot(acc, x, w),
 * BF_ENV (the task's float environment set and restored around it) and bf_sums / bf_add (dot's tree and
 * the bias add under the flush).
 */

#include <string.h>

/* float32 -> bfloat16 bits: round half to even; subnormal -> zero of its sign; NaN -> quiet NaN (no branch:
 * the row loop vectorizes) */
AI uint16_t bf16_of(uint32_t u) {
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t r = (u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded;
    return (uint16_t)((u & 0x7F800000u) == 0 ? (u >> 16) & 0x8000u : r);
}

#define BCASE(R, NG) case R * 8 + NG: btile_emu(R, NG, nc, x, ldx, w, ldw, K, out, ldo, bias, pf); break;
#if SWARM_NG == 4
#define BROW(R) BCASE(R, 1) BCASE(R, 2) BCASE(R, 3) BCASE(R, 4)
#else
#define BROW(R) BCASE(R, 1) BCASE(R, 2) BCASE(R, 3)
#endif
#if G == 1 /* tiles of at most SWARM_MR (3) rows (bcols_emu): no more cases to compile */
#define BCASES BROW(1) BROW(2) BROW(3)
#else
#define BCASES BROW(1) BROW(2) BROW(3) BROW(4) BROW(5) BROW(6)
#endif

typedef struct {
    const void *x;  /* x's copy: float32 halves (bf16_rows) or bfloat16 row pairs (the AVX512-BF16 path) */
    const uint16_t *w;
    const float *bias;
    float *out;
    int64_t M, K, ldx, N, ldw, ldo, nb;
    atomic_int *flagged;  /* aarch64: set by a task whose flush decided tininess before rounding */
} blinear_ctx;

/* one step of 16 along K into the tile's accumulators: the odd halves of the pairs, then the even; x: rows of
 * bf16_rows' copy */
AI void bstep_emu(const int MR, const int NG, const float *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                  const uint16_t *wlast, vg acc[SWARM_MR_SMALL][SWARM_NG]) {
    (void)wlast;
    for (int h = 0; h < 2; h++) {
        bx_t xv[SWARM_MR_SMALL];
        for (int r = 0; r < MR; r++) xv[r] = bx_load(x + r * ldx, h);
        for (int g = 0; g < NG; g++) {
            const bw_t wv = bw_load(w + G * g * ldw, g == NG - 1 ? wlast : w + (G * g + G - 1) * ldw, h);
            for (int r = 0; r < MR; r++) acc[r][g] = bf_dot(acc[r][g], xv[r], wv);
        }
    }
}
/* rows [0, MR) x columns [0, nc) of out; x: bf16_rows' copy (ldx >= K rounded up to 16, zero-padded) */
AI void btile_emu(const int MR, const int NG, int nc, const float *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                  int64_t K, float *out, int64_t ldo, const float *bias, const uint16_t *pf) {
    const int last = NG * G - 1 < nc ? NG * G - 1 : nc - 1;
    vg acc[SWARM_MR_SMALL][SWARM_NG];
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < NG; g++) acc[r][g] = vg_zero();
    const int64_t k16 = K & ~(int64_t)15;
    for (int64_t k = 0; k < k16; k += 16) {
        if (pf && k % 32 == 0) /* the next rows of w while these compute */
            for (int c = 0; c < SWARM_NG * G; c++) __builtin_prefetch(pf + c * ldw + k, 0, 2);
        bstep_emu(MR, NG, x + k, ldx, w + k, ldw, w + last * ldw + k, acc);
    }
    if (k16 < K) { /* the last K % 16, w's columns copied beside +0 (x is padded already) */
        uint16_t wt[SWARM_NG * G][16];
        for (int c = 0; c < NG * G; c++) {
            const uint16_t *src = w + (c < nc ? c : nc - 1) * ldw;
            for (int64_t j = 0; j < 16; j++) wt[c][j] = k16 + j < K ? src[k16 + j] : 0;
        }
        bstep_emu(MR, NG, x + k16, ldx, wt[0], 16, wt[last], acc);
    }
    for (int r = 0; r < MR; r++) {
        float sums[SWARM_NG * G + 2];
        bf_sums(acc[r], NG, sums);
        for (int c = 0; c < nc; c++) out[r * ldo + c] = bias ? bf_add(sums[c], bias[c]) : sums[c];
    }
}
static void bblock_emu(int mr, int nc, const float *x, int64_t ldx, const uint16_t *w, int64_t ldw, int64_t K,
                       float *out, int64_t ldo, const float *bias, const uint16_t *pf) {
    switch (mr * 8 + (nc + G - 1) / G) {
        BCASES
    }
}
/* columns [n0, n1) of one task, blocked as linear_task_f32's (order of work only) */
__attribute__((noinline)) static void bcols_emu(const blinear_ctx *c, int64_t i) {
    const int64_t n0 = i * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
    for (int64_t m0 = 0; m0 < c->M; m0 += SWARM_MB) {
        const int64_t m1 = m0 + SWARM_MB < c->M ? m0 + SWARM_MB : c->M;
        /* one ymm per group (16 registers): tiles of SWARM_MR rows at most, so no accumulator spills */
        const int64_t mt = m1 - m0 <= (G == 1 ? SWARM_MR : SWARM_MR_SMALL) ? m1 - m0 : SWARM_MR;
        const int64_t step = SWARM_NG * G;
        for (int64_t n = n0; n < n1; n += step) {
            const int nc = n1 - n < step ? (int)(n1 - n) : (int)step;
            for (int64_t m = m0; m < m1; m += mt) {
                const int mr = m1 - m < mt ? (int)(m1 - m) : (int)mt;
                const uint16_t *pf = m == m0 && n + 3 * step <= n1 ? c->w + (n + 2 * step) * c->ldw : 0;
                bblock_emu(mr, nc, (const float *)c->x + m * c->ldx, c->ldx, c->w + n * c->ldw, c->ldw, c->K,
                           c->out + m * c->ldo + n, c->ldo, c->bias ? c->bias + n : 0, pf);
            }
        }
    }
}
static void btask_emu(const void *c_, int64_t i) {
    BF_ENV(bcols_emu((const blinear_ctx *)c_, i), (const blinear_ctx *)c_);
}

/* x (M, K) float32 rounded to bfloat16 and widened back, each block of 16 as its 8 odd then its 8 even
 * values (the halves the FMAs take), rows of ldxb = K rounded up to 16, zero-padded: a new buffer, or NULL */
static float *bf16_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t *ldxb) {
    const int64_t kp = (K + 15) & ~(int64_t)15;
    float *xb = calloc((size_t)(M * kp > 0 ? M * kp : 1), sizeof(float));
    if (!xb) return 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            uint32_t u;
            memcpy(&u, x + m * ldx + k, sizeof u);
            u = (uint32_t)bf16_of(u) << 16;
            memcpy(xb + m * kp + (k & ~(int64_t)15) + (k & 1 ? 0 : 8) + (k & 15) / 2, &u, sizeof u);
        }
    *ldxb = kp;
    return xb;
}

/* The whole call by FMAs on the widened halves; returns 0, -2 when out of memory (out untouched), 1 when a task flagged
 * (aarch64: the caller runs the call again in plain C). */
static int blinear_emu(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                       int64_t ldw, const float *bias, float *out, int64_t ldo, int threads) {
    int64_t ldxb = 0;
    float *xb = bf16_rows(x, M, K, ldx, &ldxb);
    if (!xb) return -2;
    const int64_t nb = task_columns(K * 2, SWARM_NG * G);
    atomic_int flagged = 0;
    const blinear_ctx c = {xb, w, bias, out, M, K, ldxb, N, ldw, ldo, nb, &flagged};
    swarm_parallel_for(threads, btask_emu, &c, (N + nb - 1) / nb);
    free(xb);
    return atomic_load(&flagged) ? 1 : 0;
}
