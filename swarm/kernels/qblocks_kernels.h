/* GEMMs over weights in llama.cpp's block formats, in swarm's one arithmetic (fma.c states it): included
 * by each ISA's file after fma_kernels.h.
 *
 * A weight is its format's value, computed exactly as the gguf package (llama.cpp's Python reference)
 * dequantizes it, in float32 (fp16 fields widened exactly; each product below is exact in float32, so
 * only the one add of Q4_1 and Q4_K rounds):
 *   Q8_0: d * q.   Q4_0: d * (q - 8).   Q4_1: d * q + m.   Q4_K: (d * sc_j) * q - dmin * m_j.
 *   Q6_K: (d * sc_16) * (q - 32).
 * and the product is fma.c's linear over those values: out[m, n] = dot(x[m], w[n], K) (+ bias[n]). So a
 * stage holding the blocks computes the very bits of a float32 stage holding the dequantized checkpoint
 * (swarm's conversion of a GGUF), on every ISA, for any number of rows, while it holds only the blocks:
 * each task dequantizes a block of columns into a buffer its GEMM tiles then read from L2.
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

/* Weights [0, K) of one row in format f, as float32 values (the header's formulas). */
static void dequant_row(int f, const uint8_t *row, int64_t K, float *out) {
    if (f == QF_Q8_0 || f == QF_Q4_0 || f == QF_Q4_1) {
        for (int64_t b = 0; b < K / 32; b++) {
            const uint8_t *p = row + qf_bytes[f] * b;
            const float d = f16_to_f32(p);
            float *o = out + 32 * b;
            if (f == QF_Q8_0) {
                const int8_t *q = (const int8_t *)(p + 2);
                for (int i = 0; i < 32; i++) o[i] = d * (float)q[i];
            } else if (f == QF_Q4_0) {
                const uint8_t *q = p + 2;
                for (int i = 0; i < 16; i++) {
                    o[i] = d * (float)((q[i] & 15) - 8);
                    o[i + 16] = d * (float)((q[i] >> 4) - 8);
                }
            } else {
                const float m = f16_to_f32(p + 2);
                const uint8_t *q = p + 4;
                for (int i = 0; i < 16; i++) {
                    o[i] = d * (float)(q[i] & 15) + m;
                    o[i + 16] = d * (float)(q[i] >> 4) + m;
                }
            }
        }
    } else if (f == QF_Q4_K) {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *p = row + 144 * sb, *sc = p + 4, *qs = p + 16;
            const float d = f16_to_f32(p), dmin = f16_to_f32(p + 2);
            for (int j = 0; j < 8; j++) {
                int scale, min;
                q4k_scale_min(sc, j, &scale, &min);
                const float ds = d * (float)scale, dm = dmin * (float)min;
                const uint8_t *q = qs + 32 * (j / 2);
                const int shift = 4 * (j % 2);
                float *o = out + 256 * sb + 32 * j;
                for (int i = 0; i < 32; i++) o[i] = ds * (float)((q[i] >> shift) & 15) - dm;
            }
        }
    } else {  /* Q6_K: ql[128] qh[64] scales[16] d */
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *p = row + 210 * sb;
            const int8_t *scales = (const int8_t *)(p + 192);
            const float d = f16_to_f32(p + 208);
            for (int half = 0; half < 2; half++)
                for (int g = 0; g < 4; g++) {
                    const uint8_t *ql = p + 64 * half + 32 * (g % 2), *qh = p + 128 + 32 * half;
                    float *o = out + 256 * sb + 128 * half + 32 * g;
                    for (int i = 0; i < 32; i++) {
                        const int lo = (g < 2 ? ql[i] : ql[i] >> 4) & 15, hi = (qh[i] >> (2 * g)) & 3;
                        const float ds = d * (float)scales[8 * half + 2 * g + i / 16];
                        o[i] = ds * (float)((lo | (hi << 4)) - 32);
                    }
                }
        }
    }
}

typedef struct {
    int fmt;
    const float *x, *bias;
    const uint8_t *w;
    float *out;
    int64_t M, K, ldx, N, ldw, ldo, nb;
    int failed;  /* a task could not allocate its buffer */
} qlinear_ctx;

/* Columns [t * nb, (t + 1) * nb): dequantized into a buffer, then fma.c's linear over it. */
static void qlinear_task(const void *c_, int64_t t) {
    qlinear_ctx *c = (qlinear_ctx *)c_;
    const int64_t n0 = t * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
    float *buf = malloc((size_t)((n1 - n0) * c->K) * sizeof(float));
    if (!buf) {
        c->failed = 1;
        return;
    }
    for (int64_t n = n0; n < n1; n++) dequant_row(c->fmt, c->w + n * c->ldw, c->K, buf + (n - n0) * c->K);
    const linear_ctx_f32 lc = {c->x, c->bias ? c->bias + n0 : 0, buf, c->out + n0, c->M, c->K, c->ldx, n1 - n0, c->K,
                               c->ldo, n1 - n0};
    linear_task_f32(&lc, 0);
    free(buf);
}

#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
/* x86, a few rows (decode steps, verify chunks): each block of one column dequantized into four ymm
 * registers by the header's formulas (an FMA where the product it fuses is exact, which rounds as the
 * product then the add), then dot's chain for every row: lane l takes k = 8i + l in i order, as
 * linear_f32 does, so the bits are the buffer path's. */
AI __m256 q_f32(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }  /* bytes 0-7, unsigned */

AI float q_half(const uint8_t *p) {  /* f16_to_f32 by F16C: the same exact widening, one instruction */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

AI void q_block8(const int F, const uint8_t *row, int64_t b, __m256 w[4]) {
    if (F == QF_Q8_0) {
        const uint8_t *p = row + 34 * b;
        const __m256 d = _mm256_set1_ps(q_half(p));
        for (int v = 0; v < 4; v++)
            w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 2 + 8 * v)))));
    } else if (F == QF_Q4_0 || F == QF_Q4_1) {
        const uint8_t *p = row + qf_bytes[F] * b;
        const __m256 d = _mm256_set1_ps(q_half(p));
        const __m128i q = _mm_loadu_si128((const __m128i *)(p + (F == QF_Q4_0 ? 2 : 4)));
        const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        if (F == QF_Q4_0) {
            const __m256 eight = _mm256_set1_ps(8.0f);
            for (int v = 0; v < 4; v++) w[v] = _mm256_mul_ps(d, _mm256_sub_ps(q_f32(parts[v]), eight));
        } else {
            const __m256 m = _mm256_set1_ps(q_half(p + 2));
            for (int v = 0; v < 4; v++) w[v] = _mm256_fmadd_ps(d, q_f32(parts[v]), m);  /* d * q exact */
        }
    } else if (F == QF_Q4_K) {
        const uint8_t *p = row + 144 * (b / 8), *sc = p + 4;
        const int j = (int)(b % 8);
        int scale, min;
        q4k_scale_min(sc, j, &scale, &min);
        const __m256 ds = _mm256_set1_ps(q_half(p) * (float)scale), dm = _mm256_set1_ps(q_half(p + 2) * (float)min);
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * (j / 2)));
        const __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
        const __m128i qlo = _mm256_castsi256_si128(q), qhi = _mm256_extracti128_si256(q, 1);
        const __m128i parts[4] = {qlo, _mm_srli_si128(qlo, 8), qhi, _mm_srli_si128(qhi, 8)};
        for (int v = 0; v < 4; v++) w[v] = _mm256_fmsub_ps(ds, q_f32(parts[v]), dm);  /* ds * q exact */
    } else {  /* Q6_K */
        const uint8_t *p = row + 210 * (b / 8);
        const int j = (int)(b % 8), half = j / 4, g = j % 4;
        const int8_t *scales = (const int8_t *)(p + 192);
        const float d = q_half(p + 208);
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32 * (g % 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
        const __m256i lo = _mm256_and_si256(g < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), _mm256_set1_epi8(3));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
        const __m128i qlo = _mm256_castsi256_si128(q), qhi = _mm256_extracti128_si256(q, 1);
        const __m128i parts[4] = {qlo, _mm_srli_si128(qlo, 8), qhi, _mm_srli_si128(qhi, 8)};
        for (int v = 0; v < 4; v++) {
            const __m256 ds = _mm256_set1_ps(d * (float)scales[8 * half + 2 * g + v / 2]);
            w[v] = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[v])));
        }
    }
}

/* MR rows x NC columns from column n: NC independent chains per row keep the FMA pipes busy. */
AI void q_rows_tile(const int F, const int MR, const int NC, const qlinear_ctx *c, int64_t n) {
    __m256 acc[SWARM_MR_SMALL][4];
    for (int r = 0; r < MR; r++)
        for (int k = 0; k < NC; k++) acc[r][k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < c->K / 32; b++) {
        for (int k = 0; k < NC; k++) {
            __m256 w[4];
            q_block8(F, c->w + (n + k) * c->ldw, b, w);
            for (int r = 0; r < MR; r++) {
                const float *x = c->x + r * c->ldx + 32 * b;
                for (int v = 0; v < 4; v++) acc[r][k] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * v), w[v], acc[r][k]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        float s[4];
        v8_sums4(acc[r][0], acc[r][NC > 1 ? 1 : 0], acc[r][NC > 2 ? 2 : 0], acc[r][NC > 3 ? 3 : 0], s);
        for (int k = 0; k < NC; k++) c->out[r * c->ldo + n + k] = c->bias ? s[k] + c->bias[n + k] : s[k];
    }
}

AI void q_rows(const int F, const int MR, const qlinear_ctx *c, int64_t n0, int64_t n1) {
    const int nc = MR <= 2 ? 4 : 2;  /* accumulators MR x nc and four ymm of weights in 16 registers */
    int64_t n = n0;
    for (; n + nc <= n1; n += nc) q_rows_tile(F, MR, MR <= 2 ? 4 : 2, c, n);
    for (; n < n1; n++) q_rows_tile(F, MR, 1, c, n);
}

static void qrows_task(const void *c_, int64_t t) {
    const qlinear_ctx *c = c_;
    const int64_t n0 = t * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
#define QR(F)                                                                                                    \
    switch (c->M) {                                                                                             \
        case 1: q_rows(F, 1, c, n0, n1); break;                                                                 \
        case 2: q_rows(F, 2, c, n0, n1); break;                                                                 \
        case 3: q_rows(F, 3, c, n0, n1); break;                                                                 \
        case 4: q_rows(F, 4, c, n0, n1); break;                                                                 \
        case 5: q_rows(F, 5, c, n0, n1); break;                                                                 \
        default: q_rows(F, 6, c, n0, n1); break;                                                                \
    }
    switch (c->fmt) {
        case QF_Q8_0: QR(QF_Q8_0) break;
        case QF_Q4_0: QR(QF_Q4_0) break;
        case QF_Q4_1: QR(QF_Q4_1) break;
        case QF_Q4_K: QR(QF_Q4_K) break;
        default: QR(QF_Q6_K) break;
    }
#undef QR
}
#endif

/* out (M, N) = x (M, K) times the block-format weight w (N rows of ldw bytes) transposed, + bias.
 * Returns 0, -1 when K is not a multiple of the format's block or the format is unknown, -2 when out of
 * memory for a task's buffer (out is then incomplete). */
static int qlinear(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                   int64_t ldw, const float *bias, float *out, int64_t ldo, int threads) {
    if (fmt < 0 || fmt > QF_Q6_K || K % qf_block[fmt]) return -1;
    const int64_t step = SWARM_NG * G;  /* whole GEMM tiles per task */
    int64_t nb = (int64_t)(196608 / (K * 4 > 0 ? K * 4 : 1));
    nb -= nb % step;
    if (nb < step) nb = step;
    qlinear_ctx c = {fmt, x, bias, w, out, M, K, ldx, N, ldw, ldo, nb, 0};
#if defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)
    if (M <= SWARM_MR_SMALL) {  /* a few rows: in registers, no buffer */
        swarm_parallel_for(threads, qrows_task, &c, (N + nb - 1) / nb);
        return 0;
    }
#endif
    swarm_parallel_for(threads, qlinear_task, &c, (N + nb - 1) / nb);
    return c.failed ? -2 : 0;
}

#endif
