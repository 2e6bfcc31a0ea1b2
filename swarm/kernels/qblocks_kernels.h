/* GEMMs over weights in llama.cpp's block formats, in swarm's one arithmetic (fma.c states it): included
 * by each ISA's file after fma_kernels.h. Integers are exact in any order, so each ISA may compute a
 * block's integer dot as it likes; the float steps are the same scalar IEEE operations everywhere.
 *
 * Activations, per row, per block of 32 (quantize_row):
 *   amax = max |x_i|; d = amax / 127; q_i = round_half_even(x_i * (d != 0 ? 1 / d : 0)) clamped to
 *   [-127, 127] (0 for NaN); s = d * (float)sum(q); sum16 = the integer sums of each half.
 * Weights, per block of 32 along K (unpack_*): int8 values v_i, integer multipliers ma, mb of its two
 * halves of 16 (1, 1 except Q6_K's sub-block scales), a float scale S and, for formats with a minimum,
 * a float M:
 *   Q8_0: v = q, S = d.                         Q4_0: v = q - 8, S = d.
 *   Q4_1: v = q, S = d, M = m.                  Q4_K: v = q, S = d * sc_j, M = -(dmin * m_j).
 *   Q6_K: v = q - 32, ma, mb = the two 16-value sub-block scales, S = d.
 *   (fp16 fields widened exactly; products of two floats rounded once, IEEE.)
 * The dot of row x and column w over K: acc = +0; for each block b in order:
 *   I = ma * sum_{i<16} v_i q_i + mb * sum_{i>=16} v_i q_i (int32, exact);
 *   acc = fmaf((float)I, S * d_b, acc); then, with a minimum, acc = fmaf(M, s_b, acc);
 * then + bias (one add). A row's bits depend on its own data only (any M, any thread count, any ISA).
 */
#ifndef SWARM_QBLOCKS_KERNELS_H
#define SWARM_QBLOCKS_KERNELS_H

#include <string.h>

enum { QF_Q8_0 = 0, QF_Q4_0 = 1, QF_Q4_1 = 2, QF_Q4_K = 3, QF_Q6_K = 4 };

static const int qf_block[] = {32, 32, 32, 256, 256};       /* weights per block */
static const int qf_bytes[] = {34, 18, 20, 144, 210};       /* bytes per block */

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

/* One row of K activations into blocks of 32 (the header states the steps). */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s, int32_t *sum16) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 32; i++) {
            float v = nearbyintf(xb[i] * id);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v == v ? v : 0.0f;
            q[32 * b + i] = (int8_t)v;
            if (i < 16) lo += (int8_t)v; else hi += (int8_t)v;
        }
        d[b] = db;
        sum16[2 * b] = lo, sum16[2 * b + 1] = hi;
        s[b] = db * (float)(lo + hi);
    }
}

typedef struct {
    int8_t v[32];
    int32_t ma, mb;
    float S, M;
} wblock;

/* Block j (of 32 along K) of one weight row in format f. */
AI void unpack(int f, const uint8_t *row, int64_t j, wblock *o) {
    o->ma = o->mb = 1;
    o->M = 0.0f;
    if (f == QF_Q8_0) {
        const uint8_t *p = row + 34 * j;
        o->S = f16_to_f32(p);
        memcpy(o->v, p + 2, 32);
    } else if (f == QF_Q4_0 || f == QF_Q4_1) {
        const uint8_t *p = row + (f == QF_Q4_0 ? 18 : 20) * j;
        const int off = f == QF_Q4_0 ? 8 : 0;
        const uint8_t *qs = p + (f == QF_Q4_0 ? 2 : 4);
        o->S = f16_to_f32(p);
        if (f == QF_Q4_1) o->M = f16_to_f32(p + 2);
        for (int i = 0; i < 16; i++) {
            o->v[i] = (int8_t)((qs[i] & 15) - off);
            o->v[i + 16] = (int8_t)((qs[i] >> 4) - off);
        }
    } else if (f == QF_Q4_K) {
        const uint8_t *p = row + 144 * (j / 8), *sc = p + 4, *qs = p + 16;
        const int sub = (int)(j % 8);
        int scale, min;
        if (sub < 4) {
            scale = sc[sub] & 63, min = sc[sub + 4] & 63;
        } else {
            scale = (sc[sub + 4] & 15) | ((sc[sub - 4] >> 6) << 4);
            min = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
        }
        o->S = f16_to_f32(p) * (float)scale;
        o->M = -(f16_to_f32(p + 2) * (float)min);
        const uint8_t *q = qs + 32 * (sub / 2);
        const int shift = 4 * (sub % 2);
        for (int i = 0; i < 32; i++) o->v[i] = (int8_t)((q[i] >> shift) & 15);
    } else {  /* Q6_K: ql[128] qh[64] scales[16] d */
        const uint8_t *p = row + 210 * (j / 8);
        const int sub = (int)(j % 8), half = sub / 4, g = sub % 4;
        const uint8_t *ql = p + 64 * half + 32 * (g % 2), *qh = p + 128 + 32 * half;
        const int8_t *scales = (const int8_t *)(p + 192);
        o->S = f16_to_f32(p + 208);
        o->ma = scales[2 * sub], o->mb = scales[2 * sub + 1];
        for (int i = 0; i < 32; i++) {
            const int lo = (g < 2 ? ql[i] : ql[i] >> 4) & 15, hi = (qh[i] >> (2 * g)) & 3;
            o->v[i] = (int8_t)((lo | (hi << 4)) - 32);
        }
    }
}

/* sum_{i<16} v_i q_i and sum_{i>=16} v_i q_i: integers, exact in any order */
AI void idot32(const int8_t *v, const int8_t *q, int32_t *lo, int32_t *hi) {
    int32_t a = 0, b = 0;
    for (int i = 0; i < 16; i++) a += (int32_t)v[i] * q[i];
    for (int i = 16; i < 32; i++) b += (int32_t)v[i] * q[i];
    *lo = a, *hi = b;
}

typedef struct {
    int fmt;
    const int8_t *xq;
    const float *xd, *xs;
    const int32_t *sum16;
    const uint8_t *w;
    const float *bias;
    float *out;
    int64_t M, K, N, ldw, ldo, nb;
} qlinear_ctx;

/* Columns [n0, n1) for every row, one column at a time (the definition, and the path for columns that do
 * not fill a vector tile): each weight block unpacked once for a block of rows. */
static void qlinear_cols(const qlinear_ctx *c, int64_t n0, int64_t n1) {
    const int64_t nblk = c->K / 32;
    const int has_min = c->fmt == QF_Q4_1 || c->fmt == QF_Q4_K;
    for (int64_t m0 = 0; m0 < c->M; m0 += SWARM_MB) {
        const int64_t m1 = m0 + SWARM_MB < c->M ? m0 + SWARM_MB : c->M;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = c->w + n * c->ldw;
            float acc[SWARM_MB];
            for (int64_t m = m0; m < m1; m++) acc[m - m0] = 0.0f;
            for (int64_t b = 0; b < nblk; b++) {
                wblock wb;
                unpack(c->fmt, row, b, &wb);
                for (int64_t m = m0; m < m1; m++) {
                    int32_t lo, hi;
                    idot32(wb.v, c->xq + m * c->K + 32 * b, &lo, &hi);
                    const int32_t I = wb.ma * lo + wb.mb * hi;
                    float a = fmaf((float)I, wb.S * c->xd[m * nblk + b], acc[m - m0]);
                    if (has_min) a = fmaf(wb.M, c->xs[m * nblk + b], a);
                    acc[m - m0] = a;
                }
            }
            for (int64_t m = m0; m < m1; m++)
                c->out[m * c->ldo + n] = c->bias ? acc[m - m0] + c->bias[n] : acc[m - m0];
        }
    }
}


#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
/* Four columns at once: per block, four int32 sums by maddubs/madd (exact: |v| <= 128 and |q| <= 127 keep
 * every int16 pair sum below 2^15), reduced across lanes exactly, then the float steps of the definition
 * on four lanes, one column each. */
AI __m256i q_values(int f, const uint8_t *row, int64_t b) {
    if (f == QF_Q8_0) return _mm256_loadu_si256((const __m256i *)(row + 34 * b + 2));
    if (f == QF_Q4_K) {
        const int sub = (int)(b % 8), shift = 4 * (sub % 2);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 144 * (b / 8) + 16 + 32 * (sub / 2)));
        return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(15));
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)(row + (f == QF_Q4_0 ? 18 : 20) * b + (f == QF_Q4_0 ? 2 : 4)));
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
    return _mm256_set_m128i(hi, lo);
}

AI __m256i q_dot(int f, __m256i w, __m256i x) {  /* eight int32 partial sums of w_i * x_i */
    const __m256i ones = _mm256_set1_epi16(1);
    if (f == QF_Q8_0)
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);  /* w: nibbles 0..15, unsigned */
}

AI __m128i q_sum4(__m256i a, __m256i b, __m256i c, __m256i d) {  /* [sum a, sum b, sum c, sum d] */
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

AI void q_scales(int f, const uint8_t *row, int64_t ldw, int64_t b, float *S, float *M) {
    for (int c = 0; c < 4; c++) {
        const uint8_t *r = row + c * ldw;
        if (f == QF_Q4_K) {
            const uint8_t *p = r + 144 * (b / 8), *sc = p + 4;
            const int sub = (int)(b % 8);
            int scale, min;
            if (sub < 4) {
                scale = sc[sub] & 63, min = sc[sub + 4] & 63;
            } else {
                scale = (sc[sub + 4] & 15) | ((sc[sub - 4] >> 6) << 4);
                min = (sc[sub + 4] >> 4) | ((sc[sub] >> 6) << 4);
            }
            S[c] = f16_to_f32(p) * (float)scale;
            M[c] = -(f16_to_f32(p + 2) * (float)min);
        } else {
            const uint8_t *p = r + qf_bytes[f] * b;
            S[c] = f16_to_f32(p);
            M[c] = f == QF_Q4_1 ? f16_to_f32(p + 2) : 0.0f;
        }
    }
}

AI void qlinear_tile(const int F, const int MR, const qlinear_ctx *c, int64_t m0, int64_t n) {
    const int64_t nblk = c->K / 32;
    const uint8_t *row = c->w + n * c->ldw;
    __m128 acc[4];
    for (int r = 0; r < MR; r++) acc[r] = _mm_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        __m256i w[4];
        for (int k = 0; k < 4; k++) w[k] = q_values(F, row + k * c->ldw, b);
        float S[4], Mn[4];
        q_scales(F, row, c->ldw, b, S, Mn);
        const __m128 s4 = _mm_loadu_ps(S), m4 = _mm_loadu_ps(Mn);
        for (int r = 0; r < MR; r++) {
            const int64_t m = m0 + r;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(c->xq + m * c->K + 32 * b));
            __m128i I = q_sum4(q_dot(F, w[0], x), q_dot(F, w[1], x), q_dot(F, w[2], x), q_dot(F, w[3], x));
            if (F == QF_Q4_0) /* v = q - 8: sum (q - 8) x = sum q x - 8 sum x */
                I = _mm_sub_epi32(I, _mm_set1_epi32(8 * (c->sum16[(m * nblk + b) * 2] + c->sum16[(m * nblk + b) * 2 + 1])));
            const __m128 scale = _mm_mul_ps(s4, _mm_set1_ps(c->xd[m * nblk + b]));
            acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(I), scale, acc[r]);
            if (F == QF_Q4_1 || F == QF_Q4_K) acc[r] = _mm_fmadd_ps(m4, _mm_set1_ps(c->xs[m * nblk + b]), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) {
        float o[4];
        _mm_storeu_ps(o, acc[r]);
        for (int k = 0; k < 4; k++) c->out[(m0 + r) * c->ldo + n + k] = c->bias ? o[k] + c->bias[n + k] : o[k];
    }
}

AI void qlinear_fast(const int F, const qlinear_ctx *c, int64_t n0, int64_t n1) {
    const int64_t n4 = n0 + (n1 - n0) / 4 * 4;
    for (int64_t m0 = 0; m0 < c->M; m0 += 4) {
        const int mr = c->M - m0 < 4 ? (int)(c->M - m0) : 4;
        for (int64_t n = n0; n < n4; n += 4) {
            switch (mr) {
                case 1: qlinear_tile(F, 1, c, m0, n); break;
                case 2: qlinear_tile(F, 2, c, m0, n); break;
                case 3: qlinear_tile(F, 3, c, m0, n); break;
                default: qlinear_tile(F, 4, c, m0, n); break;
            }
        }
    }
    if (n4 < n1) qlinear_cols(c, n4, n1);
}
#endif

static void qlinear_task(const void *c_, int64_t t) {
    const qlinear_ctx *c = c_;
    const int64_t n0 = t * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
    switch (c->fmt) {
        case QF_Q8_0: qlinear_fast(QF_Q8_0, c, n0, n1); return;
        case QF_Q4_0: qlinear_fast(QF_Q4_0, c, n0, n1); return;
        case QF_Q4_1: qlinear_fast(QF_Q4_1, c, n0, n1); return;
        case QF_Q4_K: qlinear_fast(QF_Q4_K, c, n0, n1); return;
        default: break;
    }
#endif
    qlinear_cols(c, n0, n1);
}

/* out (M, N) = x (M, K) times the block-format weight w (N rows of ldw bytes) transposed, + bias.
 * Returns 0, -1 when K is not a multiple of the format's block or the format is unknown, -2 when out of
 * memory for the quantized activations. */
static int qlinear(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                   int64_t ldw, const float *bias, float *out, int64_t ldo, int threads) {
    if (fmt < 0 || fmt > QF_Q6_K || K % qf_block[fmt]) return -1;
    const int64_t nblk = K / 32;
    int8_t *xq = malloc((size_t)(M * K) + 1);
    float *xd = malloc((size_t)(M * nblk * 2 + 1) * sizeof(float));
    int32_t *sum16 = malloc((size_t)(M * nblk * 2 + 1) * sizeof(int32_t));
    if (!xq || !xd || !sum16) {
        free(xq), free(xd), free(sum16);
        return -2;
    }
    float *xs = xd + M * nblk;
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, xq + m * K, xd + m * nblk, xs + m * nblk, sum16 + m * nblk * 2);
    int64_t nb = 64;  /* columns per task: order of work only */
    const qlinear_ctx c = {fmt, xq, xd, xs, sum16, w, bias, out, M, K, N, ldw, ldo, nb};
    swarm_parallel_for(threads, qlinear_task, &c, (N + nb - 1) / nb);
    free(xq), free(xd), free(sum16);
    return 0;
}

#endif
