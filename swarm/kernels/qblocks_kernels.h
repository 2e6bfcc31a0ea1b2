/* GEMMs over weights in llama.cpp's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) with activations
 * quantized to 16 bits per block of 32, integer dot products and float32 sums in a fixed order: one
 * arithmetic that every ISA gives bit for bit (fma.c's QBLOCKS_ARITHMETIC names it); included by each
 * ISA's file after fma_kernels.h. (llama.cpp rounds activations to 8 bits; 16 keep the next-token argmax of the float32
 * expansion, and integer sums cost no more memory traffic, which is what a decode step waits on.)
 *
 * Activations: each row of x, per block b of 32 (k = 32b + i):
 *   a = the largest |x_i| that is not NaN (+0 if none); d_x = a / 32767; id = d_x != 0 ? 1 / d_x : 0;
 *   q_i = round-half-even(clamp(x_i * id, -32767, 32767)), NaN -> 0 (float32 ops, then an integer).
 * Lanes: lane l = 0..7 of a block holds k in A_l = {2l, 2l + 1} and B_l = {16 + 2l, 17 + 2l};
 *   s_l = sum of q over A_l and B_l (an integer), t_l = d_x * s_l (float32).
 * Weights of block b: integers w and float32 scales (fp16 fields widened exactly; each product here is
 * exact: an fp16 times an integer of at most 8 bits):
 *   Q8_0: w = q, c = d.   Q4_0: w = q - 8, c = d.   Q4_1: w = q, c = d, mn = m.
 *   Q4_K (sub-block j): w = q, c = d * sc_j, mn = -(dmin * m_j).
 *   Q6_K: w = q - 32; the block's two sub-blocks of 16 have cA = d * sc_2j (k < 16), cB = d * sc_2j+1.
 * Product, per output (m, n), 8 float32 lanes from +0, blocks b in k order, integer sums exact (at
 * most 4 * 128 * 32767 < 2^24, so any instruction may form them and the float conversion is exact):
 *   PA_l = sum over A_l of w_k q_k, PB_l likewise, P_l = PA_l + PB_l;
 *   Q6_K: acc_l = fma(cA * d_x, PA_l, acc_l); acc_l = fma(cB * d_x, PB_l, acc_l);
 *   others: acc_l = fma(c * d_x, P_l, acc_l); then where the format has mn: acc_l = fma(mn, t_l, acc_l);
 *   out = dot's tree over the 8 lanes (fma.c), + bias[n].
 * A row's bits are its own (its scales, its integers): any number of rows, threads, ISA.
 */
#ifndef SWARM_QBLOCKS_KERNELS_H
#define SWARM_QBLOCKS_KERNELS_H

#include <string.h>

enum { QF_Q8_0 = 0, QF_Q4_0 = 1, QF_Q4_1 = 2, QF_Q4_K = 3, QF_Q6_K = 4 };

static const int qf_block[] = {32, 32, 32, 256, 256};       /* weights per block */
static const int qf_bytes[] = {34, 18, 20, 144, 210};       /* bytes per block */
#define QF_HAS_MIN(F) ((F) == QF_Q4_1 || (F) == QF_Q4_K)

AI float f16_to_f32(const uint8_t *p) {  /* IEEE half, little endian, widened exactly */
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal half: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

/* Q4_K's 6-bit scale and minimum of sub-block j (0-7) from the super-block's 12 scale bytes (GGML's
 * get_scale_min_k4). */
AI void q4k_scale_min(const uint8_t *sc, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = sc[j] & 63, *min = sc[j + 4] & 63;
    } else {
        *scale = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
        *min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* x's rows quantized (the header's activations): q (M, K), d (M, K / 32), t (M, K / 32, 8). */
typedef struct {
    int16_t *q;
    float *d;
    float *t;
} qx_rows;

/* Row x[0, K) into q, d, t (one row's slices): the header's activations, one implementation per ISA. */
#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
static void qx_row(const float *x, int64_t K, int16_t *q, float *d, float *t) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-32767.0f), hi = _mm256_set1_ps(32767.0f);
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);  /* hadd works per 128-bit half */
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);  /* a NaN first operand gives m */
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float a = _mm_cvtss_f32(h), db = a / 32767.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        __m256i qi[4];
        for (int i = 0; i < 4; i++) {
            __m256 u = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
            u = _mm256_and_ps(u, _mm256_cmp_ps(u, u, _CMP_ORD_Q));  /* NaN -> +0 */
            u = _mm256_min_ps(_mm256_max_ps(u, lo), hi);
            qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        /* packs_epi32 interleaves 128-bit halves: [0-3, 8-11 | 4-7, 12-15] -> permute 64-bit quarters */
        const __m256i q01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xd8);
        const __m256i q23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xd8);
        _mm256_storeu_si256((__m256i *)(q + 32 * b), q01);
        _mm256_storeu_si256((__m256i *)(q + 32 * b + 16), q23);
        /* pair sums 2j, 2j + 1 of k < 16 and of k >= 16, in j order, then added: s_l */
        const __m256i pa = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(qi[0], qi[1]), order);
        const __m256i pb = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(qi[2], qi[3]), order);
        _mm256_storeu_ps(t + 8 * b, _mm256_mul_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(_mm256_add_epi32(pa, pb))));
        d[b] = db;
    }
}
#elif defined(SWARM_ISA_NEON)
static void qx_row(const float *x, int64_t K, int16_t *q, float *d, float *t) {
    for (int64_t b = 0; b < K / 32; b++) {
        float32x4_t v[8], m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(x + 32 * b + 4 * i);
            m = vmaxnmq_f32(m, vabsq_f32(v[i]));  /* maxNum: a NaN operand gives the other */
        }
        const float a = vmaxnmvq_f32(m), db = a / 32767.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int32x4_t qi[8];
        for (int i = 0; i < 8; i++) {
            float32x4_t u = vmulq_f32(v[i], vdupq_n_f32(id));
            u = vbslq_f32(vceqq_f32(u, u), u, vdupq_n_f32(0.0f));  /* NaN -> +0 */
            u = vminq_f32(vmaxq_f32(u, vdupq_n_f32(-32767.0f)), vdupq_n_f32(32767.0f));
            qi[i] = vcvtnq_s32_f32(u);  /* to nearest, ties to even */
        }
        for (int i = 0; i < 8; i += 2) vst1q_s16(q + 32 * b + 4 * i, vcombine_s16(vmovn_s32(qi[i]), vmovn_s32(qi[i + 1])));
        /* pair sums: vpaddq gives [2j + 2j+1] for j in order */
        const int32x4_t s0 = vaddq_s32(vpaddq_s32(qi[0], qi[1]), vpaddq_s32(qi[4], qi[5]));
        const int32x4_t s1 = vaddq_s32(vpaddq_s32(qi[2], qi[3]), vpaddq_s32(qi[6], qi[7]));
        vst1q_f32(t + 8 * b, vmulq_f32(vdupq_n_f32(db), vcvtq_f32_s32(s0)));
        vst1q_f32(t + 8 * b + 4, vmulq_f32(vdupq_n_f32(db), vcvtq_f32_s32(s1)));
        d[b] = db;
    }
}
#else
static void qx_row(const float *x, int64_t K, int16_t *q, float *d, float *t) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        int16_t *qb = q + 32 * b;
        float a = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float v = fabsf(xb[i]);
            a = v > a ? v : a;  /* a NaN never compares greater */
        }
        const float db = a / 32767.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = xb[i] * id;
            v = v != v ? 0.0f : v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v;
            qb[i] = (int16_t)nearbyintf(v);  /* the default rounding: to nearest, ties to even */
        }
        d[b] = db;
        for (int l = 0; l < 8; l++)
            t[8 * b + l] = db * (float)(qb[2 * l] + qb[2 * l + 1] + qb[16 + 2 * l] + qb[17 + 2 * l]);
    }
}
#endif

typedef struct {
    int fmt;
    const float *x, *bias;
    const uint8_t *w;
    float *out;
    int64_t M, K, ldx, N, ldw, ldo, nb, rows_per_task;
    int vnni;  /* x86: q_vnni() */
    qx_rows xq;
} qlinear_ctx;

AI const int16_t *qx_q(const qlinear_ctx *c, int64_t m, int64_t b) { return c->xq.q + m * c->K + 32 * b; }
AI float qx_d(const qlinear_ctx *c, int64_t m, int64_t b) { return c->xq.d[m * (c->K / 32) + b]; }
AI const float *qx_t(const qlinear_ctx *c, int64_t m, int64_t b) { return c->xq.t + (m * (c->K / 32) + b) * 8; }

static void quantize_task(const void *c_, int64_t t) {
    const qlinear_ctx *c = c_;
    const int64_t m1 = (t + 1) * c->rows_per_task < c->M ? (t + 1) * c->rows_per_task : c->M, nb = c->K / 32;
    for (int64_t m = t * c->rows_per_task; m < m1; m++)
        qx_row(c->x + m * c->ldx, c->K, c->xq.q + m * c->K, c->xq.d + m * nb, c->xq.t + m * nb * 8);
}

/* Block b (of 32 weights) of weight row `row` in format F: its integers w (the header's, offsets applied),
 * scales c (of k < 16 and k >= 16: equal but for Q6_K) and minimum mn (0 where the format has none). */
AI void q_block_ints(const int F, const uint8_t *row, int64_t b, int8_t w[32], float c[2], float *mn) {
    *mn = 0.0f;
    if (F == QF_Q8_0 || F == QF_Q4_0 || F == QF_Q4_1) {
        const uint8_t *p = row + qf_bytes[F] * b;
        c[0] = c[1] = f16_to_f32(p);
        if (F == QF_Q8_0) {
            for (int i = 0; i < 32; i++) w[i] = (int8_t)p[2 + i];
        } else {
            const uint8_t *q = p + (F == QF_Q4_0 ? 2 : 4);
            const int off = F == QF_Q4_0 ? 8 : 0;
            for (int i = 0; i < 16; i++) w[i] = (int8_t)((q[i] & 15) - off), w[i + 16] = (int8_t)((q[i] >> 4) - off);
            if (F == QF_Q4_1) *mn = f16_to_f32(p + 2);
        }
    } else if (F == QF_Q4_K) {
        const uint8_t *p = row + 144 * (b / 8);
        const int j = (int)(b % 8);
        int scale, min;
        q4k_scale_min(p + 4, j, &scale, &min);
        c[0] = c[1] = f16_to_f32(p) * (float)scale;
        *mn = -(f16_to_f32(p + 2) * (float)min);
        const uint8_t *q = p + 16 + 32 * (j / 2);
        for (int i = 0; i < 32; i++) w[i] = (int8_t)((q[i] >> (4 * (j % 2))) & 15);
    } else {  /* Q6_K: ql[128] qh[64] scales[16] d */
        const uint8_t *p = row + 210 * (b / 8);
        const int j = (int)(b % 8), half = j / 4, g = j % 4;
        const int8_t *scales = (const int8_t *)(p + 192);
        const float d = f16_to_f32(p + 208);
        const uint8_t *ql = p + 64 * half + 32 * (g % 2), *qh = p + 128 + 32 * half;
        for (int i = 0; i < 32; i++) {
            const int lo = (g < 2 ? ql[i] : ql[i] >> 4) & 15, hi = (qh[i] >> (2 * g)) & 3;
            w[i] = (int8_t)((lo | (hi << 4)) - 32);
        }
        c[0] = d * (float)scales[8 * half + 2 * g];
        c[1] = d * (float)scales[8 * half + 2 * g + 1];
    }
}

#if !defined(SWARM_ISA_AVX2) && !defined(SWARM_ISA_AVX512)
/* ---- NEON and plain C: the definition as written, per column, a few rows at a time. */
#define Q_RT 4  /* rows per pass of the portable path (order of work only) */

static void q_cols_portable(const int F, const qlinear_ctx *c, int64_t n0, int64_t n1) {
    const int64_t nb = c->K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < c->M; m0 += Q_RT) {
            const int rt = c->M - m0 < Q_RT ? (int)(c->M - m0) : Q_RT;
            v8 acc[Q_RT];
            for (int r = 0; r < rt; r++) acc[r] = v8_zero();
            for (int64_t b = 0; b < nb; b++) {
                int8_t w[32];
                float cw[2], mn;
                q_block_ints(F, c->w + n * c->ldw, b, w, cw, &mn);
                for (int r = 0; r < rt; r++) {
                    const int16_t *xq = qx_q(c, m0 + r, b);
                    float pa[8], pb[8];
                    for (int l = 0; l < 8; l++) {
                        const int32_t a = w[2 * l] * xq[2 * l] + w[2 * l + 1] * xq[2 * l + 1];
                        const int32_t bb = w[16 + 2 * l] * xq[16 + 2 * l] + w[17 + 2 * l] * xq[17 + 2 * l];
                        pa[l] = (float)a, pb[l] = (float)bb;
                        if (F != QF_Q6_K) pa[l] = (float)(a + bb);
                    }
                    const v8 dx = v8_set1(qx_d(c, m0 + r, b));
                    acc[r] = v8_fma(v8_mul(v8_set1(cw[0]), dx), v8_load(pa), acc[r]);
                    if (F == QF_Q6_K) acc[r] = v8_fma(v8_mul(v8_set1(cw[1]), dx), v8_load(pb), acc[r]);
                    if (QF_HAS_MIN(F)) acc[r] = v8_fma(v8_set1(mn), v8_load(qx_t(c, m0 + r, b)), acc[r]);
                }
            }
            for (int r = 0; r < rt; r++) {
                const float s = v8_sum(acc[r]);
                c->out[(m0 + r) * c->ldo + n] = c->bias ? s + c->bias[n] : s;
            }
        }
}
#endif

#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
/* ---- x86: block b of a column as 32 signed bytes in k order (offsets applied), its scales and minimum. */
AI float q_half(const uint8_t *p) {  /* f16_to_f32 by F16C: the same exact widening, one instruction */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

AI __m256i nibbles32(__m128i q) {  /* 16 bytes -> low nibbles then high nibbles, 32 bytes */
    const __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

AI __m256i q_w32(const int F, const uint8_t *row, int64_t b, float *ca, float *cb, float *mn) {
    if (F == QF_Q8_0) {
        const uint8_t *p = row + 34 * b;
        *ca = *cb = q_half(p);
        return _mm256_loadu_si256((const __m256i *)(p + 2));
    }
    if (F == QF_Q4_0 || F == QF_Q4_1) {
        const uint8_t *p = row + qf_bytes[F] * b;
        *ca = *cb = q_half(p);
        if (F == QF_Q4_1) *mn = q_half(p + 2);
        const __m256i q = nibbles32(_mm_loadu_si128((const __m128i *)(p + (F == QF_Q4_0 ? 2 : 4))));
        return F == QF_Q4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
    }
    if (F == QF_Q4_K) {
        const uint8_t *p = row + 144 * (b / 8);
        const int j = (int)(b % 8);
        int scale, min;
        q4k_scale_min(p + 4, j, &scale, &min);
        *ca = *cb = q_half(p) * (float)scale;
        *mn = -(q_half(p + 2) * (float)min);
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * (j / 2)));
        return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
    }
    /* Q6_K */
    const uint8_t *p = row + 210 * (b / 8);
    const int j = (int)(b % 8), half = j / 4, g = j % 4;
    const int8_t *scales = (const int8_t *)(p + 192) + 8 * half + 2 * g;
    const float d = q_half(p + 208);
    *ca = d * (float)scales[0], *cb = d * (float)scales[1];
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32 * (g % 2)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
    const __m256i lo = _mm256_and_si256(g < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

/* VNNI's vpdpwssd: acc + the dot of 2 by 2 signed 16-bit integers in each 32-bit lane, exact (the same sum
 * as madd then add). Inline asm, so the file's target need not name the extension: run only where the CPU
 * has it (q_vnni). */
AI __m256i dpwssd_evex(__m256i acc, __m256i a, __m256i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}
AI __m256i dpwssd_vex(__m256i acc, __m256i a, __m256i b) {
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}
AI __m256i q_dot16(const int V, __m256i acc, __m256i a, __m256i b) {
    if (V == 1) return dpwssd_evex(acc, a, b);
    if (V == 2) return dpwssd_vex(acc, a, b);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

/* Which vpdpwssd this CPU runs: 1 AVX512-VNNI (with VL), 2 AVX-VNNI, 0 none or SWARM_VNNI=0 (madd). */
static int q_vnni(void) {
    const char *env = getenv("SWARM_VNNI");
    if (env && env[0] == '0') return 0;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) return 1;
    return __builtin_cpu_supports("avxvnni") ? 2 : 0;
}

#define Q_PF 2  /* prefetch this many tiles ahead */

/* The b-th of K / 32 shares of the NC weight rows from pf (a later tile's, while this one computes: a decode
 * step streams the weights from memory), a cache line once each, into L2: the rows are one run of bytes,
 * which a tile reads as NC interleaved streams that the hardware prefetcher follows badly (Q8_0, one row
 * over 113 MB of weights: 13.5 -> 6.6 ms on an AMD EPYC). Order of work only. */
AI void q_prefetch(const int F, const qlinear_ctx *c, const uint8_t *pf, const int NC, int64_t b) {
    (void)F;
    const int64_t nb = c->K / 32, bytes = NC * c->ldw;
    for (int64_t o = (b * bytes / nb) & ~(int64_t)63; o < (b + 1) * bytes / nb; o += 64) __builtin_prefetch(pf + o, 0, 2);
}
#endif

#if defined(SWARM_ISA_AVX2)
/* MR rows x NC columns from (m, n): every block's weights widened once for the MR rows. */
AI void q_tile(const int F, const int V, const int MR, const int NC, const qlinear_ctx *c, int64_t m, int64_t n,
               const uint8_t *pf) {
    __m256 acc[4][4];
    for (int r = 0; r < MR; r++)
        for (int k = 0; k < NC; k++) acc[r][k] = _mm256_setzero_ps();
    const int small = F == QF_Q8_0 || F == QF_Q4_0 || F == QF_Q4_1;  /* 32-weight blocks, fp16 fields first */
    for (int64_t b = 0; b < c->K / 32; b++) {
        if (pf) q_prefetch(F, c, pf, NC, b);
        __m256 sc = _mm256_setzero_ps();
        if (small) {  /* the NC columns' first two fp16 fields (d, then m or weights) widened by one vcvtph2ps */
            uint32_t h[4];
            for (int k = 0; k < 4; k++) memcpy(&h[k], c->w + (n + (k < NC ? k : NC - 1)) * c->ldw + qf_bytes[F] * b, 4);
            sc = _mm256_cvtph_ps(_mm_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3]));
        }
#pragma GCC unroll 4
        for (int k = 0; k < NC; k++) {
            float ca = 0.0f, cb = 0.0f, mn = 0.0f;
            __m256i wa, wb;
            __m256 cv, mv;
            if (small) {  /* the values q_w32 gives, in fewer instructions (a decode step is bound by them) */
                const uint8_t *p = c->w + (n + k) * c->ldw + qf_bytes[F] * b;
                if (F == QF_Q8_0) {
                    wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 2)));
                    wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 18)));
                } else {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(p + (F == QF_Q4_0 ? 2 : 4))), m15 = _mm_set1_epi8(15);
                    wa = _mm256_cvtepu8_epi16(_mm_and_si128(q, m15));
                    wb = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), m15));
                    if (F == QF_Q4_0) wa = _mm256_sub_epi16(wa, _mm256_set1_epi16(8)), wb = _mm256_sub_epi16(wb, _mm256_set1_epi16(8));
                }
                cv = _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(2 * k));
                mv = _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(2 * k + 1));
            } else {
                const __m256i w = q_w32(F, c->w + (n + k) * c->ldw, b, &ca, &cb, &mn);
                wa = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
                wb = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
                cv = _mm256_set1_ps(ca), mv = _mm256_set1_ps(mn);
            }
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) {
                const int16_t *xq = qx_q(c, m + r, b);
                const __m256 dx = _mm256_set1_ps(qx_d(c, m + r, b));
                const __m256i xa = _mm256_loadu_si256((const __m256i *)xq);
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + 16));
                if (F == QF_Q6_K) {
                    const __m256 pa = _mm256_cvtepi32_ps(_mm256_madd_epi16(wa, xa));
                    const __m256 pb = _mm256_cvtepi32_ps(_mm256_madd_epi16(wb, xb));
                    acc[r][k] = _mm256_fmadd_ps(_mm256_mul_ps(cv, dx), pa, acc[r][k]);
                    acc[r][k] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(cb), dx), pb, acc[r][k]);
                } else {
                    const __m256i p = q_dot16(V, _mm256_madd_epi16(wa, xa), wb, xb);
                    acc[r][k] = _mm256_fmadd_ps(_mm256_mul_ps(cv, dx), _mm256_cvtepi32_ps(p), acc[r][k]);
                }
                if (QF_HAS_MIN(F)) acc[r][k] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(qx_t(c, m + r, b)), acc[r][k]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        float s[4];
        v8_sums4(acc[r][0], acc[r][NC > 1 ? 1 : 0], acc[r][NC > 2 ? 2 : 0], acc[r][NC > 3 ? 3 : 0], s);
        for (int k = 0; k < NC; k++) c->out[(m + r) * c->ldo + n + k] = c->bias ? s[k] + c->bias[n + k] : s[k];
    }
}
#define Q_COLS 4  /* columns per tile at one or two rows; two at three or four */

/* Many rows (a prefill or verify chunk): the task's columns go in panels of QP_COLS, each unpacked once into
 * 16-bit integers and float32 scales (q_w32's values, widened), so the tiles over the rows read one run of
 * aligned bytes with no unpacking; the same products in the same order. */
#define QP_COLS 32
#define QP_MIN_ROWS 8
typedef struct {
    int16_t *w;          /* (nb, QP_COLS, 32): block b of column j at (b * QP_COLS + j) * 32 */
    float *ca, *cb, *mn; /* (nb, QP_COLS) */
} q_panel;

AI void q_pack(const int F, const qlinear_ctx *c, int64_t n, int ncol, q_panel *pk) {
    const int64_t nb = c->K / 32;
    for (int j = 0; j < ncol; j++) {
        const uint8_t *row = c->w + (n + j) * c->ldw;
        for (int64_t b = 0; b < nb; b++) {
            float ca = 0.0f, cb = 0.0f, mn = 0.0f;
            const __m256i w = q_w32(F, row, b, &ca, &cb, &mn);
            int16_t *o = pk->w + (b * QP_COLS + j) * 32;
            _mm256_store_si256((__m256i *)o, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)));
            _mm256_store_si256((__m256i *)(o + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1)));
            pk->ca[b * QP_COLS + j] = ca, pk->cb[b * QP_COLS + j] = cb, pk->mn[b * QP_COLS + j] = mn;
        }
    }
}

/* MR rows x NC columns from (m, column j0 of the panel at n): q_tile's arithmetic on the unpacked panel,
 * each row's integers loaded once per block for the NC columns. */
AI void q_tile_packed(const int F, const int V, const int MR, const int NC, const qlinear_ctx *c, const q_panel *pk,
                      int64_t m, int64_t n, int j0) {
    const int64_t nb = c->K / 32;
    __m256 acc[4][2];
    const int16_t *xq[4];
    const float *xd[4], *xt[4];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) {
        xq[r] = c->xq.q + (m + r) * c->K, xd[r] = c->xq.d + (m + r) * nb, xt[r] = c->xq.t + (m + r) * nb * 8;
#pragma GCC unroll 2
        for (int k = 0; k < NC; k++) acc[r][k] = _mm256_setzero_ps();
    }
    const int16_t *wp = pk->w + j0 * 32;
    const float *cap = pk->ca + j0, *cbp = pk->cb + j0, *mnp = pk->mn + j0;
    for (int64_t b = 0; b < nb; b++, wp += QP_COLS * 32, cap += QP_COLS, cbp += QP_COLS, mnp += QP_COLS) {
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            const __m256i xa = _mm256_loadu_si256((const __m256i *)(xq[r] + 32 * b));
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq[r] + 32 * b + 16));
            const __m256 dx = _mm256_broadcast_ss(xd[r] + b);
#pragma GCC unroll 2
            for (int k = 0; k < NC; k++) {
                const __m256i wa = _mm256_load_si256((const __m256i *)(wp + 32 * k));
                const __m256i wb = _mm256_load_si256((const __m256i *)(wp + 32 * k + 16));
                if (F == QF_Q6_K) {
                    const __m256 pa = _mm256_cvtepi32_ps(_mm256_madd_epi16(wa, xa));
                    const __m256 pb = _mm256_cvtepi32_ps(_mm256_madd_epi16(wb, xb));
                    acc[r][k] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(cap + k), dx), pa, acc[r][k]);
                    acc[r][k] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(cbp + k), dx), pb, acc[r][k]);
                } else {
                    const __m256i p = q_dot16(V, _mm256_madd_epi16(wa, xa), wb, xb);
                    acc[r][k] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(cap + k), dx), _mm256_cvtepi32_ps(p), acc[r][k]);
                }
                if (QF_HAS_MIN(F))
                    acc[r][k] = _mm256_fmadd_ps(_mm256_broadcast_ss(mnp + k), _mm256_loadu_ps(xt[r] + 8 * b), acc[r][k]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        float s[4];
        v8_sums4(acc[r][0], acc[r][NC > 1 ? 1 : 0], acc[r][0], acc[r][0], s);
        for (int k = 0; k < NC; k++) c->out[(m + r) * c->ldo + n + j0 + k] = c->bias ? s[k] + c->bias[n + j0 + k] : s[k];
    }
}

/* Columns [n0, n1) of every row, panel by panel; 0 when out of memory for a panel (the caller then tiles
 * without one). */
AI int q_cols_packed(const int F, const int V, const qlinear_ctx *c, int64_t n0, int64_t n1) {
    const int64_t nb = c->K / 32;
    char *buf = aligned_alloc(64, (size_t)(nb * QP_COLS * (64 + 12)) + 64);
    if (!buf) return 0;
    q_panel pk = {(int16_t *)buf, (float *)(buf + nb * QP_COLS * 64), (float *)(buf + nb * QP_COLS * 68),
                  (float *)(buf + nb * QP_COLS * 72)};
    for (int64_t n = n0; n < n1; n += QP_COLS) {
        const int ncol = n1 - n < QP_COLS ? (int)(n1 - n) : QP_COLS;
        q_pack(F, c, n, ncol, &pk);
        for (int64_t m = 0; m < c->M;) {
            const int mr = c->M - m >= 4 ? 4 : (int)(c->M - m);
            for (int j = 0; j < ncol; j += 2) {
                const int two = j + 2 <= ncol;
#define QP(R) two ? q_tile_packed(F, V, R, 2, c, &pk, m, n, j) : q_tile_packed(F, V, R, 1, c, &pk, m, n, j)
                switch (mr) {
                    case 1: QP(1); break;
                    case 2: QP(2); break;
                    case 3: QP(3); break;
                    default: QP(4); break;
                }
#undef QP
            }
            m += mr;
        }
    }
    free(buf);
    return 1;
}
#elif defined(SWARM_ISA_AVX512)
/* MR rows x NC columns from (m, n), two columns per zmm register (lanes 0-7 one, 8-15 the next); an odd NC's
 * last register repeats its column in the upper half, never stored. */
AI __m512 join8(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}
AI __m512i dpwssd512(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
/* Block b of columns na and nb of a 32-weight format (Q8_0, Q4_0, Q4_1): the integers as 16-bit lanes,
 * [na's k < 16 | nb's k < 16] (*wa) and the same for k >= 16 (*wb); each column's scale over its 8 lanes
 * (*ca) and, for Q4_1, its minimum (*mw). The values q_w32 gives, in fewer instructions (a decode step is
 * bound by them): both columns' bytes in one register from the load on (GGML's nibble order puts k < 16 in
 * the low nibbles), both columns' fp16 fields widened by one vcvtph2ps. */
AI void q_pair32(const int F, const qlinear_ctx *c, int64_t na, int64_t nb, int64_t b, __m512i *wa, __m512i *wb,
                 __m512 *ca, __m512 *mw) {
    const uint8_t *pa = c->w + na * c->ldw + qf_bytes[F] * b, *pb = c->w + nb * c->ldw + qf_bytes[F] * b;
#define Q_TWO(OFF) _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(pa + (OFF)))), \
                                           _mm_loadu_si128((const __m128i *)(pb + (OFF))), 1)
    __m256i lo, hi;
    if (F == QF_Q8_0) {
        lo = Q_TWO(2), hi = Q_TWO(18);
    } else {
        const __m256i q = Q_TWO(F == QF_Q4_0 ? 2 : 4), m15 = _mm256_set1_epi8(15);
        lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
        if (F == QF_Q4_0) lo = _mm256_sub_epi8(lo, _mm256_set1_epi8(8)), hi = _mm256_sub_epi8(hi, _mm256_set1_epi8(8));
    }
#undef Q_TWO
    *wa = _mm512_cvtepi8_epi16(lo), *wb = _mm512_cvtepi8_epi16(hi);
    uint32_t sa, sb;  /* d (and m) at the block's start: Q4_1 [d, m], the others [d, ...] */
    memcpy(&sa, pa, 4), memcpy(&sb, pb, 4);
    const __m128i h = F == QF_Q4_1 ? _mm_insert_epi32(_mm_cvtsi32_si128((int)sa), (int)sb, 1)
                                   : _mm_cvtsi32_si128((int)((sa & 0xffffu) | (sb << 16)));
    const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(h));  /* Q4_1: da, ma, db, mb; else da, db */
    const int j = F == QF_Q4_1 ? 2 : 1;
    *ca = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, j, j, j, j, j, j, j, j), f);
    *mw = F == QF_Q4_1 ? _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), f)
                       : _mm512_setzero_ps();
}

AI void q_tile(const int F, const int V, const int MR, const int NC, const qlinear_ctx *c, int64_t m, int64_t n,
               const uint8_t *pf) {
    enum { NP = 4 };
    const int np = (NC + 1) / 2;
    __m512 acc[4][NP];
    for (int r = 0; r < MR; r++)
        for (int k = 0; k < np; k++) acc[r][k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < c->K / 32; b++) {
        __m512i xa[4], xb[4];
        __m512 dx[4], tv[4];
        for (int r = 0; r < MR; r++) {
            const int16_t *xq = qx_q(c, m + r, b);
            xa[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xq));
            xb[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + 16)));
            dx[r] = _mm512_set1_ps(qx_d(c, m + r, b));
            tv[r] = QF_HAS_MIN(F) ? _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(qx_t(c, m + r, b)))))
                                  : _mm512_setzero_ps();
        }
        if (pf) q_prefetch(F, c, pf, NC, b);
        for (int k = 0; k < np; k++) {
            const int64_t na = n + 2 * k, nb = 2 * k + 1 < NC ? na + 1 : na;
            float cba = 0.0f, cbb = 0.0f;
            __m512i wa, wb;
            __m512 ca, mw;
            if (F == QF_Q8_0 || F == QF_Q4_0 || F == QF_Q4_1) {
                q_pair32(F, c, na, nb, b, &wa, &wb, &ca, &mw);
            } else {
                float caa, ma = 0.0f, cab, mb = 0.0f;
                const __m256i w0 = q_w32(F, c->w + na * c->ldw, b, &caa, &cba, &ma);
                const __m256i w1 = q_w32(F, c->w + nb * c->ldw, b, &cab, &cbb, &mb);
                /* [column a's k < 16 | column b's k < 16] and the same for k >= 16, widened to 16 bits */
                wa = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(w0, w1, 0x20));
                wb = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(w0, w1, 0x31));
                ca = join8(_mm256_set1_ps(caa), _mm256_set1_ps(cab));
                mw = join8(_mm256_set1_ps(ma), _mm256_set1_ps(mb));
            }
            for (int r = 0; r < MR; r++) {
                if (F == QF_Q6_K) {
                    const __m512 cb = join8(_mm256_set1_ps(cba), _mm256_set1_ps(cbb));
                    const __m512 pa = _mm512_cvtepi32_ps(_mm512_madd_epi16(wa, xa[r]));
                    const __m512 pb = _mm512_cvtepi32_ps(_mm512_madd_epi16(wb, xb[r]));
                    acc[r][k] = _mm512_fmadd_ps(_mm512_mul_ps(ca, dx[r]), pa, acc[r][k]);
                    acc[r][k] = _mm512_fmadd_ps(_mm512_mul_ps(cb, dx[r]), pb, acc[r][k]);
                } else {
                    const __m512i pa = _mm512_madd_epi16(wa, xa[r]);
                    const __m512i p = V ? dpwssd512(pa, wb, xb[r]) : _mm512_add_epi32(pa, _mm512_madd_epi16(wb, xb[r]));
                    acc[r][k] = _mm512_fmadd_ps(_mm512_mul_ps(ca, dx[r]), _mm512_cvtepi32_ps(p), acc[r][k]);
                }
                if (QF_HAS_MIN(F)) acc[r][k] = _mm512_fmadd_ps(mw, tv[r], acc[r][k]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        float s8[2 * NP + 2];
        vg_sums(acc[r], np, s8);
        for (int k = 0; k < NC; k++) c->out[(m + r) * c->ldo + n + k] = c->bias ? s8[k] + c->bias[n + k] : s8[k];
    }
}
#define Q_COLS 8  /* columns per tile at one or two rows; four at three or four */
#endif

#if defined(SWARM_ISA_AVX2)
/* q_cols_packed, compiled once per format and integer instruction (not inlined into each caller): VNNI's EVEX
 * form (V 1) runs on the AVX2 path only when SWARM_ISA forces it on an AVX-512 CPU, so its panels take madd */
static __attribute__((noinline)) int q_cols_packed_fv(const int F, const int V, const qlinear_ctx *c, int64_t n0,
                                                      int64_t n1) {
#define QPV(FF) return V == 2 ? q_cols_packed(FF, 2, c, n0, n1) : q_cols_packed(FF, 0, c, n0, n1)
    switch (F) {
        case QF_Q8_0: QPV(QF_Q8_0);
        case QF_Q4_0: QPV(QF_Q4_0);
        case QF_Q4_1: QPV(QF_Q4_1);
        case QF_Q4_K: QPV(QF_Q4_K);
        default: QPV(QF_Q6_K);
    }
#undef QPV
}
#endif

#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
/* Columns [n0, n1) of every row: tiles of up to 4 rows; Q_COLS columns at 1-2 rows, Q_COLS / 2 at 3-4. */
AI void q_cols_x86(const int F, const int V, const qlinear_ctx *c, int64_t n0, int64_t n1) {
#if defined(SWARM_ISA_AVX2)
    if (c->M >= QP_MIN_ROWS && q_cols_packed_fv(F, V, c, n0, n1)) return;
#endif
    for (int64_t m = 0; m < c->M;) {
        const int mr = c->M - m >= 4 ? 4 : (int)(c->M - m);
        const int nc = mr <= 2 ? Q_COLS : Q_COLS / 2;
        int64_t n = n0;
        for (; n + nc <= n1; n += nc) {  /* whole tiles, then pairs and a last single column */
            const uint8_t *pf = m == 0 && n + (Q_PF + 1) * nc <= n1 ? c->w + (n + Q_PF * nc) * c->ldw : 0;
            switch (mr) {
                case 1: q_tile(F, V, 1, Q_COLS, c, m, n, pf); break;
                case 2: q_tile(F, V, 2, Q_COLS, c, m, n, pf); break;
                case 3: q_tile(F, V, 3, Q_COLS / 2, c, m, n, pf); break;
                default: q_tile(F, V, 4, Q_COLS / 2, c, m, n, pf); break;
            }
        }
        for (; n < n1; n += 2) {
            const int two = n + 2 <= n1;
#define QT(R) two ? q_tile(F, V, R, 2, c, m, n, 0) : q_tile(F, V, R, 1, c, m, n, 0)
            switch (mr) {
                case 1: QT(1); break;
                case 2: QT(2); break;
                case 3: QT(3); break;
                default: QT(4); break;
            }
#undef QT
        }
        m += mr;
    }
}
#endif

#if defined(SWARM_ISA_AVX512)
#define Q_VARIANTS(F) c->vnni ? q_cols_x86(F, 1, c, n0, n1) : q_cols_x86(F, 0, c, n0, n1)
#elif defined(SWARM_ISA_AVX2)
#define Q_VARIANTS(F) c->vnni == 1 ? q_cols_x86(F, 1, c, n0, n1) : c->vnni == 2 ? q_cols_x86(F, 2, c, n0, n1) : q_cols_x86(F, 0, c, n0, n1)
#else
#define Q_VARIANTS(F) q_cols_portable(F, c, n0, n1)
#endif

static void qdot_task(const void *c_, int64_t t) {
    const qlinear_ctx *c = c_;
    const int64_t n0 = t * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
    switch (c->fmt) {
        case QF_Q8_0: Q_VARIANTS(QF_Q8_0); break;
        case QF_Q4_0: Q_VARIANTS(QF_Q4_0); break;
        case QF_Q4_1: Q_VARIANTS(QF_Q4_1); break;
        case QF_Q4_K: Q_VARIANTS(QF_Q4_K); break;
        default: Q_VARIANTS(QF_Q6_K); break;
    }
}
#undef Q_VARIANTS

/* Columns per task of an (N, ldw bytes) weight: a block of w that stays in L2 while the rows pass, and
 * work for every thread. */
static int64_t q_task_cols(int64_t N, int64_t ldw, int threads) {
    int64_t nb = (int64_t)(196608 / (ldw > 0 ? ldw : 1));
    const int64_t spread = (N + 2 * threads - 1) / (2 * threads);
    if (threads > 1 && nb > spread) nb = spread;
    return (nb + 7) & ~(int64_t)7;
}

/* The parts of one call (swarm_qlinear_many), their column tasks numbered part after part. */
typedef struct {
    qlinear_ctx part[SWARM_QPARTS_MAX];
    int64_t first[SWARM_QPARTS_MAX + 1];  /* part p's tasks: [first[p], first[p + 1]) */
} qmany_ctx;

static void qmany_task(const void *c_, int64_t t) {
    const qmany_ctx *c = c_;
    int p = 0;
    while (t >= c->first[p + 1]) p++;
    qdot_task(&c->part[p], t - c->first[p]);
}

/* Each part's out (M, N) = x (M, K) times its block-format weight (N rows of ldw bytes) transposed, + bias, in
 * the header's arithmetic, x quantized once for all. Returns 0, -1 when nparts is out of range or K is not a
 * multiple of a part's block or a format is unknown, -2 when out of memory for x's quantized copy (outs
 * untouched). */
static int qlinear_many(const swarm_qpart *parts, int nparts, const float *x, int64_t M, int64_t K, int64_t ldx,
                        int threads) {
    if (nparts < 1 || nparts > SWARM_QPARTS_MAX) return -1;
    for (int p = 0; p < nparts; p++)
        if (parts[p].fmt < 0 || parts[p].fmt > QF_Q6_K || K % qf_block[parts[p].fmt]) return -1;
    const int64_t nbk = K / 32;
    char *buf = malloc((size_t)(2 * M * K + M * nbk * (4 + 32)) + 64);
    if (!buf) return -2;
    qlinear_ctx c = {0, x, 0, 0, 0, M, K, ldx, 0, 0, 0, 0, 0, 0, {0}};
#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
    c.vnni = q_vnni();
#endif
    c.xq.d = (float *)buf;
    c.xq.t = (float *)(buf + M * nbk * 4);
    c.xq.q = (int16_t *)(buf + M * nbk * 36);
    const int tasks_q = threads > 1 && M >= 8 ? threads : 1;
    c.rows_per_task = (M + tasks_q - 1) / tasks_q;
    swarm_parallel_for(threads, quantize_task, &c, tasks_q);
    qmany_ctx mc;
    mc.first[0] = 0;
    for (int p = 0; p < nparts; p++) {
        const swarm_qpart *q = &parts[p];
        qlinear_ctx *pc = &mc.part[p];
        *pc = c;
        pc->fmt = q->fmt, pc->w = q->w, pc->N = q->N, pc->ldw = q->ldw, pc->bias = q->bias, pc->out = q->out;
        pc->ldo = q->ldo, pc->nb = q_task_cols(q->N, q->ldw, threads);
        mc.first[p + 1] = mc.first[p] + (q->N + pc->nb - 1) / pc->nb;
    }
    swarm_parallel_for(threads, qmany_task, &mc, mc.first[nparts]);
    free(buf);
    return 0;
}

#endif
