/* The kernels of swarm's one CPU arithmetic (stated in fma.c), written once over two vector types that
 * each instruction set implements: v8, eight float32 lanes (a ymm register on x86-64, two q registers
 * on aarch64), and vg, the GEMM's group of G columns times the eight lanes of dot (one ymm: G = 1;
 * one zmm: G = 2, two columns side by side). fma_avx512.c, fma_avx2.c and fma_neon.c each set their
 * target, define SWARM_ISA_* and include this header; fma.c holds the thread pool and picks one.
 *
 * Everything here is IEEE float32: loads, stores, fused multiply-adds, adds, multiplies, divisions,
 * max, the exact bfloat16 -> float32 widening, and integer ops on exponents. Lanes never cross inside
 * a sum; every sum across lanes is dot's fixed tree. No instruction whose result depends on the
 * vector width (an approximate reciprocal, a reassociating reduction) is used, and a dot-product
 * instruction only where it computes the defined bits (vdpbf16ps for the bfloat16 GEMM, checked against
 * the FMAs at first use), so each lane's result is the same function of its inputs on every ISA.
 */
#ifndef SWARM_FMA_KERNELS_H
#define SWARM_FMA_KERNELS_H

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "fma_common.h"

#define AI static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------------------------------
 * v8: eight float32 lanes; lane i of every op depends only on lane i of its operands.
 * ---------------------------------------------------------------------------------------------- */
#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
#include <immintrin.h>
typedef __m256 v8;
AI v8 v8_load(const float *p) { return _mm256_loadu_ps(p); }
AI v8 v8_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
AI void v8_store(float *p, v8 v) { _mm256_storeu_ps(p, v); }
AI v8 v8_set1(float a) { return _mm256_set1_ps(a); }
AI v8 v8_zero(void) { return _mm256_setzero_ps(); }
AI v8 v8_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
AI v8 v8_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
AI v8 v8_sub(v8 a, v8 b) { return _mm256_sub_ps(a, b); }
AI v8 v8_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
AI v8 v8_div(v8 a, v8 b) { return _mm256_div_ps(a, b); }
AI v8 v8_max(v8 a, v8 b) { return _mm256_max_ps(a, b); }  /* a > b ? a : b */
/* exp: Cephes' expf (range reduction by ln 2 in two FMA steps, a degree-5 polynomial by FMA, the
 * exponent built in integers); 0 below -87 (and for -inf and NaN). */
AI v8 v8_exp(v8 x) {
    const __m256 valid = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), valid);
}
/* dot's tree of four vectors at once: hadd pairs neighbours, so the lanes hold (l0 + l1) + (l2 + l3)
 * and (l4 + l5) + (l6 + l7) of each, which the last add joins. */
AI void v8_sums4(v8 a, v8 b, v8 c, v8 d, float *out) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

#elif defined(SWARM_ISA_NEON)
#include <arm_neon.h>
typedef struct { float32x4_t lo, hi; } v8;
AI v8 V8(float32x4_t lo, float32x4_t hi) { v8 v = {lo, hi}; return v; }
AI v8 v8_load(const float *p) { return V8(vld1q_f32(p), vld1q_f32(p + 4)); }
AI v8 v8_load_bf16(const uint16_t *p) {
    return V8(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)), vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4), 16)));
}
AI void v8_store(float *p, v8 v) { vst1q_f32(p, v.lo); vst1q_f32(p + 4, v.hi); }
AI v8 v8_set1(float a) { return V8(vdupq_n_f32(a), vdupq_n_f32(a)); }
AI v8 v8_zero(void) { return v8_set1(0.0f); }
AI v8 v8_fma(v8 a, v8 b, v8 c) { return V8(vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)); }
AI v8 v8_add(v8 a, v8 b) { return V8(vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)); }
AI v8 v8_sub(v8 a, v8 b) { return V8(vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)); }
AI v8 v8_mul(v8 a, v8 b) { return V8(vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)); }
AI v8 v8_div(v8 a, v8 b) { return V8(vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)); }
/* x86's max (a > b ? a : b: the second operand when either is NaN); vmaxq_f32 would give NaN */
AI float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
AI v8 v8_max(v8 a, v8 b) { return V8(max4(a.lo, b.lo), max4(a.hi, b.hi)); }
AI float32x4_t exp4(float32x4_t x) {  /* the steps of the x86 v8_exp, with x86's min and max rules */
    const uint32x4_t valid = vcgeq_f32(x, vdupq_n_f32(-87.0f));
    const float32x4_t hi = vdupq_n_f32(88.0f), m = max4(x, vdupq_n_f32(-87.0f));
    x = vbslq_f32(vcltq_f32(m, hi), m, hi);
    const float32x4_t fx = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, fx, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    float32x4_t y = vfmaq_f32(r, p, vmulq_f32(r, r));
    y = vaddq_f32(y, vdupq_n_f32(1.0f));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127)), 23);
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vmulq_f32(y, vreinterpretq_f32_s32(e))), valid));
}
AI v8 v8_exp(v8 x) { return V8(exp4(x.lo), exp4(x.hi)); }
/* dot's tree: vpaddq(lo, hi) = [l0 + l1, l2 + l3, l4 + l5, l6 + l7]; again: [(l0 + l1) + (l2 + l3),
 * (l4 + l5) + (l6 + l7), ...]; then the last add. */
AI float v8_tree(v8 v) {
    const float32x4_t p = vpaddq_f32(v.lo, v.hi), q = vpaddq_f32(p, p);
    return vgetq_lane_f32(q, 0) + vgetq_lane_f32(q, 1);
}
AI void v8_sums4(v8 a, v8 b, v8 c, v8 d, float *out) {
    out[0] = v8_tree(a), out[1] = v8_tree(b), out[2] = v8_tree(c), out[3] = v8_tree(d);
}
#elif defined(SWARM_ISA_GENERIC)
/* Plain C, one lane at a time: the definition run as written (any CPU; a reference for the others). */
typedef struct { float f[8]; } v8;
#define LANES(expr) do { for (int i_ = 0; i_ < 8; i_++) { expr; } } while (0)
AI v8 v8_load(const float *p) { v8 v; LANES(v.f[i_] = p[i_]); return v; }
AI v8 v8_load_bf16(const uint16_t *p) {
    v8 v;
    LANES(union { uint32_t u; float f; } c = {(uint32_t)p[i_] << 16}; v.f[i_] = c.f);
    return v;
}
AI void v8_store(float *p, v8 v) { LANES(p[i_] = v.f[i_]); }
AI v8 v8_set1(float a) { v8 v; LANES(v.f[i_] = a); return v; }
AI v8 v8_zero(void) { return v8_set1(0.0f); }
AI v8 v8_fma(v8 a, v8 b, v8 c) { LANES(c.f[i_] = fmaf(a.f[i_], b.f[i_], c.f[i_])); return c; }
AI v8 v8_add(v8 a, v8 b) { LANES(a.f[i_] = a.f[i_] + b.f[i_]); return a; }
AI v8 v8_sub(v8 a, v8 b) { LANES(a.f[i_] = a.f[i_] - b.f[i_]); return a; }
AI v8 v8_mul(v8 a, v8 b) { LANES(a.f[i_] = a.f[i_] * b.f[i_]); return a; }
AI v8 v8_div(v8 a, v8 b) { LANES(a.f[i_] = a.f[i_] / b.f[i_]); return a; }
AI v8 v8_max(v8 a, v8 b) { LANES(a.f[i_] = a.f[i_] > b.f[i_] ? a.f[i_] : b.f[i_]); return a; }
AI float exp1(float x) {  /* the steps of the x86 v8_exp, one lane, with x86's min and max rules */
    const int valid = x >= -87.0f;
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    const float fx = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-fx, 0.693359375f, x);
    r = fmaf(-fx, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    float y = fmaf(p, r * r, r);
    y = y + 1.0f;
    union { uint32_t u; float f; } e = {(uint32_t)((int32_t)fx + 127) << 23};
    return valid ? y * e.f : 0.0f;
}
AI v8 v8_exp(v8 x) { LANES(x.f[i_] = exp1(x.f[i_])); return x; }
AI void v8_sums4(v8 a, v8 b, v8 c, v8 d, float *out) {
    const v8 *v[4] = {&a, &b, &c, &d};
    for (int k = 0; k < 4; k++) {
        const float *l = v[k]->f;
        out[k] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    }
}
#else
#error "define SWARM_ISA_AVX512, SWARM_ISA_AVX2, SWARM_ISA_NEON or SWARM_ISA_GENERIC before including fma_kernels.h"
#endif

/* dot's tree of one vector: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
AI float v8_sum(v8 v) {
    float s[4];
    v8_sums4(v, v, v, v, s);
    return s[0];
}

AI float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
AI float f32_id(float v) { return v; }

/* ------------------------------------------------------------------------------------------------
 * vg: the GEMM's vector, eight lanes of dot for each of G columns of w; x's eight lanes broadcast to
 * every column. SWARM_MR x SWARM_NG groups per tile (SWARM_NG * G columns), at most SWARM_MR_SMALL
 * rows when a whole block of rows is one tile.
 * ---------------------------------------------------------------------------------------------- */
#if defined(SWARM_ISA_AVX512)
typedef __m512 vg;
#define G 2
#define SWARM_MR 6
#define SWARM_NG 3  /* 6 x 3 zmm accumulators, 6 of x, 3 of w: 27 of the 32 registers */
AI __m256 lo8(__m512 v) { return _mm512_castps512_ps256(v); }
AI __m256 hi8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
AI vg vg_join(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}
AI vg vg_w_f32(const float *a, const float *b) { return vg_join(_mm256_loadu_ps(a), _mm256_loadu_ps(b)); }
AI vg vg_x(const float *x) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x)))); }
AI vg vg_zero(void) { return _mm512_setzero_ps(); }
AI vg vg_fma(vg a, vg b, vg c) { return _mm512_fmadd_ps(a, b, c); }
/* column sums of ng groups (2 * ng columns) */
AI void vg_sums(const vg *acc, int ng, float *out) {
    for (int g = 0; g < ng; g += 2) {
        const vg b = g + 1 < ng ? acc[g + 1] : acc[g];
        v8_sums4(lo8(acc[g]), hi8(acc[g]), lo8(b), hi8(b), out + 2 * g);
    }
}
#else
typedef v8 vg;
#define G 1
#define SWARM_MR 3
#define SWARM_NG 4  /* 3 x 4 accumulators of eight lanes: 12 ymm registers, or 24 q registers */
#define vg_w_f32(a, b) v8_load(a)
#define vg_x v8_load
#define vg_zero v8_zero
#define vg_fma v8_fma
AI void vg_sums(const vg *acc, int ng, float *out) {
    if (ng == 4) {
        v8_sums4(acc[0], acc[1], acc[2], acc[3], out);
    } else {
        for (int g = 0; g < ng; g++) out[g] = v8_sum(acc[g]);
    }
}
#endif

#define SWARM_MR_SMALL 6  /* a block of at most this many rows (a verify chunk, a short tail) is one tile */
#define SWARM_MB 24       /* rows of x per pass over a block of w's rows (order of work only) */
#define SWARM_KB 64       /* keys per attention block: fixes the arithmetic (blocks sit at multiples of it) */
#define SWARM_RB 8        /* query rows per attention task: order of work only */

/* Columns of w per GEMM task, a multiple of step (at least one step): about 192 KB of w's rows of row_bytes,
 * which stay in L2 while blocks of x pass (order of work only). */
AI int64_t task_columns(int64_t row_bytes, int64_t step) {
    int64_t nb = (int64_t)(196608 / (row_bytes > 0 ? row_bytes : 1));
    nb -= nb % step;
    return nb < step ? step : nb;
}

/* ------------------------------------------------------------------------------------------------
 * GEMM: out[m, n] = dot(x[m], w[n], K) (+ bias[n]), w float32 (bfloat16 weights: fma_bf16.h).
 * ---------------------------------------------------------------------------------------------- */
#define DEFINE_LINEAR(SFX, WT, LOADW, W2F)                                                                          \
    /* rows [0, MR) x columns [0, nc) of out, nc <= NG * G; a pair past nc repeats column nc - 1 */            \
    AI void dot_tile_##SFX(const int MR, const int NG, int nc, const float *x, int64_t ldx, const WT *w,          \
                           int64_t ldw, int64_t K, float *out, int64_t ldo, const float *bias, const WT *pf) {     \
        /* G == 2: the second column of the last pair repeats column nc - 1 when nc is odd */                    \
        const WT *wlast = w + (NG * G - 1 < nc ? NG * G - 1 : nc - 1) * ldw;                                      \
        (void)wlast; /* G == 1 reads one column per group */                                                      \
        vg acc[SWARM_MR_SMALL][SWARM_NG];                                                                         \
        for (int r = 0; r < MR; r++)                                                                              \
            for (int g = 0; g < NG; g++) acc[r][g] = vg_zero();                                                   \
        const int64_t k8 = K & ~(int64_t)7;                                                                       \
        for (int64_t k = 0; k < k8; k += 8) {                                                                     \
            vg xv[SWARM_MR_SMALL];                                                                                \
            for (int r = 0; r < MR; r++) xv[r] = vg_x(x + r * ldx + k);                                           \
            if (pf && (k * (int64_t)sizeof(WT)) % 64 == 0) /* the next rows of w while these compute */          \
                for (int c = 0; c < SWARM_NG * G; c++) __builtin_prefetch(pf + c * ldw + k, 0, 2);                    \
            for (int g = 0; g < NG; g++) {                                                                        \
                const vg wv = LOADW(w + G * g * ldw + k, (g == NG - 1 ? wlast : w + (G * g + G - 1) * ldw) + k);    \
                for (int r = 0; r < MR; r++) acc[r][g] = vg_fma(xv[r], wv, acc[r][g]);                            \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < MR; r++) {                                                                            \
            float sums[SWARM_NG * G + 2];                                                                         \
            vg_sums(acc[r], NG, sums);                                                                            \
            for (int c = 0; c < nc; c++) {                                                                        \
                float s = sums[c];                                                                                \
                for (int64_t k = k8; k < K; k++) s = fmaf(x[r * ldx + k], W2F(w[c * ldw + k]), s);               \
                if (bias) s = s + bias[c];                                                                        \
                out[r * ldo + c] = s;                                                                             \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
    static void dot_block_##SFX(int mr, int nc, const float *x, int64_t ldx, const WT *w, int64_t ldw, int64_t K, \
                                float *out, int64_t ldo, const float *bias, const WT *pf) {                       \
        switch (mr * 8 + (nc + G - 1) / G) {                                                                      \
            LINEAR_CASES(SFX)                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
    typedef struct {                                                                                              \
        const float *x, *bias;                                                                                    \
        const WT *w;                                                                                              \
        float *out;                                                                                               \
        int64_t M, K, ldx, N, ldw, ldo, nb;                                                                       \
    } linear_ctx_##SFX;                                                                                           \
    /* Columns [n0, n1): nb rows of w stay in L2 while blocks of SWARM_MB rows of x pass, each tile's rows of  \
     * w meeting every row of the block while in L1. Order of work only, never of any sum. */                \
    static void linear_task_##SFX(const void *c_, int64_t i) {                                                    \
        const linear_ctx_##SFX *c = c_;                                                                           \
        const int64_t step = SWARM_NG * G, n0 = i * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;            \
        for (int64_t m0 = 0; m0 < c->M; m0 += SWARM_MB) {                                                         \
            const int64_t m1 = m0 + SWARM_MB < c->M ? m0 + SWARM_MB : c->M;                                       \
            const int64_t mt = m1 - m0 <= SWARM_MR_SMALL ? m1 - m0 : SWARM_MR;                                    \
            for (int64_t n = n0; n < n1; n += step) {                                                             \
                const int nc = n1 - n < step ? (int)(n1 - n) : (int)step;                                         \
                for (int64_t m = m0; m < m1; m += mt) {                                                           \
                    const int mr = m1 - m < mt ? (int)(m1 - m) : (int)mt;                                         \
                    const WT *pf = m == m0 && n + 3 * step <= n1 ? c->w + (n + 2 * step) * c->ldw : 0;            \
                    dot_block_##SFX(mr, nc, c->x + m * c->ldx, c->ldx, c->w + n * c->ldw, c->ldw, c->K,          \
                                    c->out + m * c->ldo + n, c->ldo, c->bias ? c->bias + n : 0, pf);             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
    static void linear_##SFX(const float *x, int64_t M, int64_t K, int64_t ldx, const WT *w, int64_t N,           \
                             int64_t ldw, const float *bias, float *out, int64_t ldo, int threads) {              \
        const int64_t step = SWARM_NG * G;                                                                        \
        const int64_t nb = task_columns(K * (int64_t)sizeof(WT), step);                                           \
        const linear_ctx_##SFX c = {x, bias, w, out, M, K, ldx, N, ldw, ldo, nb};                                 \
        swarm_parallel_for(threads, linear_task_##SFX, &c, (N + nb - 1) / nb);                                    \
    }

#define LCASE(SFX, R, NG) case R * 8 + NG: dot_tile_##SFX(R, NG, nc, x, ldx, w, ldw, K, out, ldo, bias, pf); break;
#if SWARM_NG == 4
#define LROW(SFX, R) LCASE(SFX, R, 1) LCASE(SFX, R, 2) LCASE(SFX, R, 3) LCASE(SFX, R, 4)
#else
#define LROW(SFX, R) LCASE(SFX, R, 1) LCASE(SFX, R, 2) LCASE(SFX, R, 3)
#endif
#define LINEAR_CASES(SFX) LROW(SFX, 1) LROW(SFX, 2) LROW(SFX, 3) LROW(SFX, 4) LROW(SFX, 5) LROW(SFX, 6)

DEFINE_LINEAR(f32, float, vg_w_f32, f32_id)

/* ------------------------------------------------------------------------------------------------
 * The bfloat16 GEMM (fma_bf16.h states it): each ISA's view of one step of 16 along K.
 * ---------------------------------------------------------------------------------------------- */
/* the FMAs run on the widened halves of each pair: the odd (h = 0), then the even (h = 1) */
#if defined(SWARM_ISA_AVX512)
AI __m512 bf_half(__m512i v, int h) {
    return _mm512_castsi512_ps(h ? _mm512_slli_epi32(v, 16) : _mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
typedef __m512 bx_t;
typedef __m512 bw_t;
AI __m512 bx_load(const float *p, int h) { return vg_x(p + 8 * h); }
AI __m512i bw_raw(const uint16_t *a, const uint16_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
AI __m512 bw_load(const uint16_t *a, const uint16_t *b, int h) { return bf_half(bw_raw(a, b), h); }
#define bf_dot(acc, x, w) _mm512_fmadd_ps(x, w, acc)
#elif defined(SWARM_ISA_AVX2)
AI __m256 bf_half8(const uint16_t *p, int h) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);  /* two shifts, not a mask: 16 ymm registers */
    return _mm256_castsi256_ps(_mm256_slli_epi32(h ? v : _mm256_srli_epi32(v, 16), 16));
}
typedef __m256 bx_t;
typedef __m256 bw_t;
#define bx_load(p, h) _mm256_loadu_ps((p) + 8 * (h))
#define bw_load(a, b, h) bf_half8(a, h)
#define bf_dot(acc, x, w) _mm256_fmadd_ps(x, w, acc)
#elif defined(SWARM_ISA_NEON)
AI float32x4_t bf_half4(uint16x8_t v, int h) {
    const uint32x4_t u = vreinterpretq_u32_u16(v);
    return vreinterpretq_f32_u32(h ? vshlq_n_u32(u, 16) : vandq_u32(u, vdupq_n_u32(0xFFFF0000u)));
}
AI v8 bf_half8(const uint16_t *p, int h) { return V8(bf_half4(vld1q_u16(p), h), bf_half4(vld1q_u16(p + 8), h)); }
typedef v8 bx_t;
typedef v8 bw_t;
#define bx_load(p, h) v8_load((p) + 8 * (h))
#define bw_load(a, b, h) bf_half8(a, h)
#define bf_dot(acc, x, w) v8_fma(x, w, acc)
#else /* plain C: x86's flush computed in IEEE arithmetic */
#include <float.h>
AI float daz(float a) { return fabsf(a) < FLT_MIN ? copysignf(0.0f, a) : a; }
/* fma(a, b, c) under DAZ and FTZ: IEEE's fmaf is that except where |result| <= FLT_MIN; there x86 rounds
 * the exact value as if the exponent were unbounded and flushes it when it lands below FLT_MIN, so FLT_MIN
 * stays only for an exact value of magnitude >= FLT_MIN - 2^-151 (decided exactly by TwoSum in double) */
static float ftz_fma(float a, float b, float c) {
    a = daz(a), b = daz(b), c = daz(c);
    const float r = fmaf(a, b, c), m = fabsf(r);
    if (!(m <= FLT_MIN) || m == 0.0f) return r;
    if (m < FLT_MIN) return copysignf(0.0f, r);
    const double p = (double)a * (double)b, s = p + (double)c, bb = s - p;
    const double e = (p - (s - bb)) + ((double)c - bb);  /* s + e == a * b + c exactly */
    const double d = (s - copysign((double)FLT_MIN - 0x1p-151, (double)r)) + e;
    return (r > 0 ? d >= 0 : d <= 0) ? r : copysignf(0.0f, r);
}
AI float ftz_add(float a, float b) { return ftz_fma(a, 1.0f, b); }
AI v8 bf_half8(const uint16_t *p, int h) {
    v8 v;
    LANES(union { uint32_t u; float f; } c = {(uint32_t)p[2 * i_ + 1 - h] << 16}; v.f[i_] = c.f);
    return v;
}
typedef v8 bx_t;
typedef v8 bw_t;
#define bx_load(p, h) v8_load((p) + 8 * (h))
#define bw_load(a, b, h) bf_half8(a, h)
AI v8 bf_dot(v8 acc, v8 x, v8 w) { LANES(acc.f[i_] = ftz_fma(x.f[i_], w.f[i_], acc.f[i_])); return acc; }
AI void bf_sums(const vg *acc, int ng, float *out) {
    for (int g = 0; g < ng; g++) {
        const float *l = acc[g].f;
        out[g] = ftz_add(ftz_add(ftz_add(l[0], l[1]), ftz_add(l[2], l[3])), ftz_add(ftz_add(l[4], l[5]), ftz_add(l[6], l[7])));
    }
}
#define bf_add ftz_add
#define BF_ENV(call, ctx) call
#endif
#if !defined(SWARM_ISA_GENERIC)
#define bf_sums vg_sums
#define bf_add(a, b) ((a) + (b))
#endif
#if defined(SWARM_ISA_AVX512) || defined(SWARM_ISA_AVX2)
#define BF_ENV(call, ctx) /* MXCSR's DAZ (bit 6) and FTZ (bit 15), this thread, for the task */                 \
    do {                                                                                                          \
        const unsigned csr_ = _mm_getcsr();                                                                       \
        _mm_setcsr(csr_ | 0x8040u);                                                                               \
        call;                                                                                                     \
        _mm_setcsr(csr_);                                                                                         \
        (void)(ctx);                                                                                              \
    } while (0)
#elif defined(SWARM_ISA_NEON)
AI uint64_t fpcr_get(void) { uint64_t v; __asm__ __volatile__("mrs %0, fpcr" : "=r"(v)); return v; }
AI void fpcr_set(uint64_t v) { __asm__ __volatile__("msr fpcr, %0" : : "r"(v)); }
AI uint64_t fpsr_get(void) { uint64_t v; __asm__ __volatile__("mrs %0, fpsr" : "=r"(v)); return v; }
AI void fpsr_set(uint64_t v) { __asm__ __volatile__("msr fpsr, %0" : : "r"(v)); }
/* FPCR.FZ (bit 24) for the task; FPSR's IDC (bit 7) or UFC (bit 3) afterwards: a flush happened, whose
 * tininess aarch64 decides before rounding (x86 after), so the call is run again in plain C */
#define BF_ENV(call, ctx)                                                                                         \
    do {                                                                                                          \
        const uint64_t cr_ = fpcr_get(), sr_ = fpsr_get();                                                        \
        fpcr_set(cr_ | (1u << 24));                                                                               \
        fpsr_set(0);                                                                                              \
        call;                                                                                                     \
        const uint64_t flags_ = fpsr_get();                                                                       \
        fpsr_set(sr_);                                                                                            \
        fpcr_set(cr_);                                                                                            \
        if (flags_ & 0x88u) atomic_store((ctx)->flagged, 1);                                                      \
    } while (0)
#endif
#include "fma_bf16.h"
#if defined(SWARM_ISA_AVX512)
/* AVX512-BF16: vdpbf16ps does both halves of 16 pairs at once, with the same bits. Its register holds two
 * rows of x side by side (x is copied with each pair of rows interleaved per block of 16, so one aligned
 * load) against one column of w broadcast: no shuffle in the loop. Order of work only. */
#define BDP __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))
#define BDP_RP 4 /* pairs of rows per tile */
#define BDP_NC 6 /* columns per tile: 4 x 6 accumulators, 4 of x, 1 of w */
BDP AI void bdp_step(const int RP, const uint16_t *xp, int64_t ldxp, const uint16_t *const *wc, int64_t k,
                     __m512 acc[BDP_RP][BDP_NC]) {
    __m512i xv[BDP_RP];
    for (int p = 0; p < RP; p++) xv[p] = _mm512_loadu_si512((const void *)(xp + p * ldxp));
    for (int c = 0; c < BDP_NC; c++) {
        const __m512i wv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wc[c] + k)));
        for (int p = 0; p < RP; p++) acc[p][c] = _mm512_dpbf16_ps(acc[p][c], (__m512bh)xv[p], (__m512bh)wv);
    }
}
/* rows [0, mr) (RP pairs) x columns [0, nc) of out (nc <= BDP_NC: the columns past it repeat column nc - 1,
 * unstored); xp: the tile's first pair of rows */
BDP AI void bdp_tile(const int RP, int mr, int nc, const uint16_t *xp, int64_t ldxp, const uint16_t *w,
                     int64_t ldw, int64_t K, float *out, int64_t ldo, const float *bias, const uint16_t *pf) {
    __m512 acc[BDP_RP][BDP_NC];
    const uint16_t *wc[BDP_NC];
    for (int c = 0; c < BDP_NC; c++) wc[c] = w + (c < nc ? c : nc - 1) * ldw;
    for (int p = 0; p < RP; p++)
        for (int c = 0; c < BDP_NC; c++) acc[p][c] = _mm512_setzero_ps();
    const int64_t k16 = K & ~(int64_t)15;
    for (int64_t k = 0; k < k16; k += 16) {
        if (pf && k % 32 == 0)
            for (int c = 0; c < BDP_NC; c++) __builtin_prefetch(pf + c * ldw + k, 0, 2);
        bdp_step(RP, xp + 2 * k, ldxp, wc, k, acc);
    }
    if (k16 < K) { /* the last K % 16 of w's columns beside +0 (x is padded already) */
        uint16_t wt[BDP_NC][16];
        const uint16_t *tc[BDP_NC];
        for (int c = 0; c < BDP_NC; c++) {
            for (int64_t j = 0; j < 16; j++) wt[c][j] = k16 + j < K ? wc[c][k16 + j] : 0;
            tc[c] = wt[c];
        }
        bdp_step(RP, xp + 2 * k16, ldxp, tc, 0, acc);
    }
    for (int p = 0; p < RP; p++)
        for (int c = 0; c < BDP_NC; c += 2) {
            float sm[4]; /* rows 2p and 2p + 1 of column c, then of c + 1 */
            v8_sums4(lo8(acc[p][c]), hi8(acc[p][c]), lo8(acc[p][c + 1]), hi8(acc[p][c + 1]), sm);
            for (int j = 0; j < 4; j++) {
                const int r = 2 * p + (j & 1), col = c + j / 2;
                if (r < mr && col < nc) out[r * ldo + col] = bias ? sm[j] + bias[col] : sm[j];
            }
        }
}
BDP static void bdp_block(int mr, int nc, const uint16_t *xp, int64_t ldxp, const uint16_t *w, int64_t ldw,
                          int64_t K, float *out, int64_t ldo, const float *bias, const uint16_t *pf) {
    switch ((mr + 1) / 2) {  /* pairs of rows: 4 tile shapes to compile, the columns by pointer */
        case 1: bdp_tile(1, mr, nc, xp, ldxp, w, ldw, K, out, ldo, bias, pf); break;
        case 2: bdp_tile(2, mr, nc, xp, ldxp, w, ldw, K, out, ldo, bias, pf); break;
        case 3: bdp_tile(3, mr, nc, xp, ldxp, w, ldw, K, out, ldo, bias, pf); break;
        default: bdp_tile(4, mr, nc, xp, ldxp, w, ldw, K, out, ldo, bias, pf); break;
    }
}
/* columns [n0, n1) of one task: blocks of 24 rows pass nb columns of w held in L2, tiles of 8 x 6 */
BDP __attribute__((noinline)) static void bdp_cols(const blinear_ctx *c, int64_t i) {
    const int64_t n0 = i * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
    for (int64_t m0 = 0; m0 < c->M; m0 += SWARM_MB) {
        const int64_t m1 = m0 + SWARM_MB < c->M ? m0 + SWARM_MB : c->M;
        for (int64_t n = n0; n < n1; n += BDP_NC) {
            const int nc = n1 - n < BDP_NC ? (int)(n1 - n) : BDP_NC;
            for (int64_t m = m0; m < m1; m += 2 * BDP_RP) {
                const int mr = m1 - m < 2 * BDP_RP ? (int)(m1 - m) : 2 * BDP_RP;
                const uint16_t *pf = m == m0 && n + 3 * BDP_NC <= n1 ? c->w + (n + 2 * BDP_NC) * c->ldw : 0;
                bdp_block(mr, nc, (const uint16_t *)c->x + m / 2 * c->ldx, c->ldx, c->w + n * c->ldw, c->ldw, c->K,
                          c->out + m * c->ldo + n, c->ldo, c->bias ? c->bias + n : 0, pf);
            }
        }
    }
}
static void bdp_task(const void *c_, int64_t i) { BF_ENV(bdp_cols((const blinear_ctx *)c_, i), (const blinear_ctx *)c_); }
/* x (M, K) float32 as bfloat16, each pair of rows interleaved per block of 16 (a pair: 2 * kp values, kp = K
 * rounded up to 16; an odd M's last pair padded with a row of +0); a new buffer, or NULL */
static uint16_t *bf16_row_pairs(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t *ldxp) {
    const int64_t kp = (K + 15) & ~(int64_t)15, pairs = (M + 1) / 2;
    uint16_t *xb = calloc((size_t)(pairs * 2 * kp), sizeof(uint16_t));
    if (!xb) return 0;
    for (int64_t m = 0; m < M; m++) {
        uint16_t *dst = xb + m / 2 * 2 * kp + (m % 2) * 16;
        const float *src = x + m * ldx;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            for (int j = 0; j < 16; j++) {
                uint32_t u;
                memcpy(&u, src + k + j, sizeof u);
                dst[2 * k + j] = bf16_of(u);
            }
        for (; k < K; k++) {
            uint32_t u;
            memcpy(&u, src + k, sizeof u);
            dst[k / 16 * 32 + k % 16] = bf16_of(u);
        }
    }
    *ldxp = 2 * kp;
    return xb;
}
static int blinear_dp(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N, int64_t ldw,
                      const float *bias, float *out, int64_t ldo, int threads) {
    int64_t ldxp = 0;
    uint16_t *xb = bf16_row_pairs(x, M, K, ldx, &ldxp);
    if (!xb) return -2;
    const int64_t nb = task_columns(K * 2, BDP_NC);
    const blinear_ctx c = {xb, w, bias, out, M, K, ldxp, N, ldw, ldo, nb, 0};
    swarm_parallel_for(threads, bdp_task, &c, (N + nb - 1) / nb);
    free(xb);
    return 0;
}
/* vdpbf16ps against the FMAs where the order of a pair's products, a rounding or the flush shows (products of
 * bfloat16 values of like magnitude mostly add exactly, so random data alone would hide them): against x of
 * ones, column 0 gives each lane 1, then 0.75 ulp (the odd) and 0.5 ulp (the even): odd first rounds to
 * 1 + 2 ulp, even first to 1 + 1 ulp (the 8 lanes: 8 + 2^-19 or 8 + 2^-20); column 1 gives each lane 1.5 FLT_MIN - FLT_MIN, flushed to 0 (IEEE:
 * the 8 lanes sum to 4 FLT_MIN); column 2 is zero; the rest, and x's other rows, are random over 2^-40..2^40 */
static int bf16_dp_agrees(void) {
    enum { M = 5, K = 48, N = 14 };
    float x[M * K], bias[N], a[M * N], b[M * N];
    uint16_t w[N * K];
    uint32_t st = 2463534242u;
    for (int i = 0; i < M * K + N * K + N; i++) {
        st ^= st << 13, st ^= st >> 17, st ^= st << 5;
        const float v = ldexpf(((float)(st >> 9 & 0x3FFFFF) - 2097152.0f) / 2097152.0f, (int)(st % 81) - 40);
        if (i < M * K) x[i] = i < K ? 1.0f : v;
        else if (i < M * K + N * K) w[i - M * K] = bf16_of((union { float f; uint32_t u; }){v}.u);
        else bias[i - M * K - N * K] = i % 2 ? v : 0.0f;
    }
    for (int k = 0; k < K; k++) {
        const int j = k % 16, odd = j % 2;
        w[k] = k < 16 ? (odd ? 0x3F80 : 0) : k < 32 ? (odd ? 0x33C0 : 0x3380) : 0; /* 1; 1.5 * 2^-24, 2^-24 */
        w[K + k] = k < 16 ? (odd ? 0x00C0 : 0x8080) : 0;                              /* 1.5 FLT_MIN, -FLT_MIN */
        w[2 * K + k] = 0;
    }
    bias[0] = bias[1] = 0.0f;
    volatile int64_t kv = K;  /* not a constant the compiler folds into the copy loops */
    const int64_t k = kv;
    if (blinear_dp(x, M, k, k, w, N, k, bias, a, N, 1) || blinear_emu(x, M, k, k, w, N, k, bias, b, N, 1)) return 0;
    return memcmp(a, b, sizeof a) == 0 && a[0] == 8.0f + 0x1p-19f && a[1] == 0.0f;
}
/* 1: vdpbf16ps runs here: AVX512-BF16, SWARM_BF16DP is not 0, and it gave the FMAs' bits at first use */
static int bf16_dp(void) {
    static atomic_int verdict = -1;  /* -1: not yet checked */
    const char *env = getenv("SWARM_BF16DP");
    if (env && env[0] == '0') return 0;
    int v = atomic_load(&verdict);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512bf16") && bf16_dp_agrees();
        atomic_store(&verdict, v);
    }
    return v;
}
__attribute__((visibility("hidden"))) int swarm_avx512_bf16_dp(void) { return bf16_dp(); }
#endif
#if defined(SWARM_ISA_NEON)
extern __attribute__((visibility("hidden"))) const swarm_isa swarm_isa_generic;
#endif

/* x (M, K) float32 times w (N, K) bfloat16 transposed, + bias: the bfloat16 GEMM; 0, or -2 out of memory */
static int linear_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                       int64_t ldw, const float *bias, float *out, int64_t ldo, int threads) {
#if defined(SWARM_ISA_AVX512)
    if (bf16_dp()) return blinear_dp(x, M, K, ldx, w, N, ldw, bias, out, ldo, threads);
#endif
    const int rc = blinear_emu(x, M, K, ldx, w, N, ldw, bias, out, ldo, threads);
#if defined(SWARM_ISA_NEON)
    if (rc == 1) return swarm_isa_generic.linear_bf16(x, M, K, ldx, w, N, ldw, bias, out, ldo, threads);
#endif
    return rc < 0 ? rc : 0;
}

/* dot(a, b, K) of one pair of rows (RMSNorm's sum of squares): the same function as the GEMM's. */
static float dot1(const float *a, const float *b, int64_t K) {
    v8 acc = v8_zero();
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < k8; k += 8) acc = v8_fma(v8_load(a + k), v8_load(b + k), acc);
    float s = v8_sum(acc);
    for (int64_t k = k8; k < K; k++) s = fmaf(a[k], b[k], s);
    return s;
}

/* ------------------------------------------------------------------------------------------------
 * Attention, per query row at absolute position p and head h (kv head h / (H / Hkv)), over its own
 * keys j in [lo, p]: the online softmax over key blocks at fixed positions (multiples of SWARM_KB),
 * as fma.c states it. Lanes run over keys (scores) or over head dims (the PV sums), never along a sum.
 * ---------------------------------------------------------------------------------------------- */

/* s[h][8c + i] = dotseq(q_h, key 8c + i) over HR heads and CV vectors of 8 keys, from kt (one key block
 * transposed: kt[d * SWARM_KB + j] = k_j[d]); dotseq: one FMA chain over d in d order from +0. */
AI void qk_tile(const int HR, const int CV, const float *q, int64_t Dh, const float *kt, float *s) {
    v8 acc[3][4];
    for (int h = 0; h < HR; h++)
        for (int c = 0; c < CV; c++) acc[h][c] = v8_zero();
    for (int64_t d = 0; d < Dh; d++) {
        v8 kv[4];
        for (int c = 0; c < CV; c++) kv[c] = v8_load(kt + d * SWARM_KB + 8 * c);
        for (int h = 0; h < HR; h++) {
            const v8 qv = v8_set1(q[h * Dh + d]);
            for (int c = 0; c < CV; c++) acc[h][c] = v8_fma(qv, kv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HR; h++)
        for (int c = 0; c < CV; c++) v8_store(s + h * SWARM_KB + 8 * c, acc[h][c]);
}

#define TCASE(F, R, C) case R * 8 + C: F(R, C, ARGS); break;
#define TROW(F, R) TCASE(F, R, 1) TCASE(F, R, 2) TCASE(F, R, 3) TCASE(F, R, 4)

static void qk_block(int hr, int cv, const float *q, int64_t Dh, const float *kt, float *s) {
#define ARGS q, Dh, kt, s
    switch (hr * 8 + cv) { TROW(qk_tile, 1) TROW(qk_tile, 2) TROW(qk_tile, 3) }
#undef ARGS
}

#define ATT(name) name##_f32
#define KV_T float
#define KV_FLOAT 1
#define KV_LOAD8 v8_load
#define KV_TO_F32 f32_id
#include "fma_attention.h"
#undef ATT
#undef KV_T
#undef KV_FLOAT
#undef KV_LOAD8
#undef KV_TO_F32
#define ATT(name) name##_bf16
#define KV_T uint16_t
#define KV_FLOAT 0
#define KV_LOAD8 v8_load_bf16
#define KV_TO_F32 bf16_to_f32
#include "fma_attention.h"

/* RMSNorm of N rows of D: r = 1 / sqrt(dot(x, x, D) / D + eps); out[d] = w[d] * (x[d] * r). */
static void rmsnorm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *out) {
    for (int64_t i = 0; i < N; i++) {
        const float *xi = x + i * D;
        const float r = 1.0f / sqrtf(dot1(xi, xi, D) / (float)D + eps);
        for (int64_t d = 0; d < D; d++) out[i * D + d] = w[d] * (xi[d] * r);
    }
}

/* SiLU of n floats: x / (1 + exp(-x)), 8 at a time; the last few through the same vector code from a
 * padded buffer, so an element's bits never depend on where it sits. */
static void silu(const float *x, int64_t n, float *out) {
    const v8 one = v8_set1(1.0f), zero = v8_zero();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 v = v8_load(x + i);
        v8_store(out + i, v8_div(v, v8_add(one, v8_exp(v8_sub(zero, v)))));
    }
    if (i < n) {
        float buf[8] = {0};
        for (int64_t j = i; j < n; j++) buf[j - i] = x[j];
        const v8 v = v8_load(buf);
        v8_store(buf, v8_div(v, v8_add(one, v8_exp(v8_sub(zero, v)))));
        for (int64_t j = i; j < n; j++) out[j] = buf[j - i];
    }
}

#include "qblocks_kernels.h"

/* ONE_ROW: the ISA whose GEMM runs single rows (a decode step), or 0 for this one */
#define SWARM_DEFINE_ISA(NAME, ONE_ROW)                                                                           \
    __attribute__((visibility("hidden"))) const swarm_isa swarm_isa_##NAME = {                                   \
        #NAME, linear_f32, linear_bf16, attention_f32, attention_bf16, rmsnorm, silu, qlinear_many, ONE_ROW};

#endif
