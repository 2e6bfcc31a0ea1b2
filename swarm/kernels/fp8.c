/* Weights held as published: FP8 (float8 e4m3fn bytes with a float32 scale per bn x bk block, the layout of
 * DeepSeek-V3/R1, Qwen3 FP8 and GLM-4.5 FP8) and, at the end, MXFP4 (gpt-oss's experts), multiplied in
 * swarm's float32 or bfloat16 arithmetic: each weight value is decoded, w[n, k] = float(e4m3(w8[n, k])) *
 * scale[n / bn, k / bk] (one float32 multiply, rounded to bfloat16 half-even for a bfloat16 stage: the bits
 * transformers' dequantization gives), in registers for a float32 decode step (gemv4) or a panel of rows at a
 * time into the GEMM's weight layout, and swarm_linear / swarm_linear_bf16 runs on those values. Every output
 * is therefore the bits of the same GEMM over the dequantized weight: a stage holding the published bytes
 * and a stage holding the dequantized floats compute the same rows. Compiled with -ffp-contract=off like
 * the rest. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fma_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DECODE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DECODE_CLONES
#endif

static inline float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t u32_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* e4m3fn (bias 7, no infinities, 0x7F / 0xFF NaN) to float32's bits, exactly: a normal number's exponent
 * and mantissa shift into place, a subnormal one is m * 2^-9. Selections by masks, so loops vectorize. */
static inline uint32_t e4m3_bits(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80) << 24, em = b & 0x7F;
    const uint32_t normal = sign | ((em << 20) + (120u << 23));
    const uint32_t sub = sign | u32_of((float)(b & 7) * 0x1p-9f);
    const uint32_t is_normal = 0u - (uint32_t)((em >> 3) != 0), is_nan = 0u - (uint32_t)(em == 0x7F);
    const uint32_t v = (normal & is_normal) | (sub & ~is_normal);
    return (v & ~is_nan) | ((sign | 0x7FC00000u) & is_nan);
}

/* torch's float32 -> bfloat16: round half to even, a NaN kept quiet */
static inline uint16_t bf16_rne(float f) {
    const uint32_t u = u32_of(f);
    const uint32_t is_nan = 0u - (uint32_t)((u & 0x7FFFFFFFu) > 0x7F800000u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1)) >> 16, quiet = (u >> 16) | 0x40;
    return (uint16_t)((rounded & ~is_nan) | (quiet & is_nan));
}

/* dst[i] = e4m3(src[i]) * sc, float32, or rounded to bfloat16 when bf16: the definition, one value at a time */
DECODE_CLONES static void decode_plain(const uint8_t *src, int64_t n, float sc, void *dst, int bf16) {
    if (bf16) {
        uint16_t *out = dst;
        for (int64_t k = 0; k < n; k++) out[k] = bf16_rne(f32_of(e4m3_bits(src[k])) * sc);
    } else {
        float *out = dst;
        for (int64_t k = 0; k < n; k++) out[k] = f32_of(e4m3_bits(src[k])) * sc;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* e4m3 bytes as float16 bits: the same sign, exponent and mantissa fields, worth 2^-8 of the e4m3 value
 * (float16's exponent bias is 15, e4m3's 7; subnormals included), so F16C's conversion and a multiply by
 * sc * 2^8 (exact: a power of two) give the same product as the definition. A NaN byte (0x7F, 0xFF) goes
 * to decode_plain (any_nan). */
__attribute__((target("avx2,f16c"))) static inline __m128i e4m3_as_f16(__m128i b16) {
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b16, _mm_set1_epi16(0x80)), 8);
    return _mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(b16, _mm_set1_epi16(0x7F)), 7));
}

__attribute__((target("avx2,f16c"))) static inline __m128i bf16_rne8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* whether any of n bytes is a NaN (0x7F or 0xFF) */
__attribute__((target("avx2,f16c"))) static int any_nan(const uint8_t *src, int64_t n) {
    int64_t k = 0;
    __m256i hit = _mm256_setzero_si256();
    for (; k + 32 <= n; k += 32) {
        const __m256i em = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(src + k)), _mm256_set1_epi8(0x7F));
        hit = _mm256_or_si256(hit, _mm256_cmpeq_epi8(em, _mm256_set1_epi8(0x7F)));
    }
    int found = !_mm256_testz_si256(hit, hit);
    for (; k < n; k++) found |= (src[k] & 0x7F) == 0x7F;
    return found;
}

__attribute__((target("avx2,f16c"))) static void decode_f16c(const uint8_t *src, int64_t n, float sc, void *dst,
                                                          int bf16) {
    const __m256 s = _mm256_set1_ps(sc * 256.0f);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m128i b16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + k)));
        const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(e4m3_as_f16(b16)), s);
        if (bf16)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + k), bf16_rne8(v));
        else
            _mm256_storeu_ps((float *)dst + k, v);
    }
    decode_plain(src + k, n - k, sc, bf16 ? (void *)((uint16_t *)dst + k) : (void *)((float *)dst + k), bf16);
}

/* decode_f16c's steps sixteen values at a time */
__attribute__((target("avx512f,avx512bw,avx2,f16c"))) static void decode_avx512(const uint8_t *src, int64_t n,
                                                                             float sc, void *dst, int bf16) {
    const __m512 s = _mm512_set1_ps(sc * 256.0f);
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m256i b16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + k)));
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b16, _mm256_set1_epi16(0x80)), 8);
        const __m256i h = _mm256_or_si256(sign, _mm256_slli_epi16(_mm256_and_si256(b16, _mm256_set1_epi16(0x7F)), 7));
        const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), s);
        if (bf16) {
            const __m512i u = _mm512_castps_si512(v);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            const __m512i r =
                _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
            const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                          _mm512_set1_epi32(0x7F800000));
            const __m512i out = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + k), _mm512_cvtepi32_epi16(out));
        } else {
            _mm512_storeu_ps((float *)dst + k, v);
        }
    }
    decode_f16c(src + k, n - k, sc, bf16 ? (void *)((uint16_t *)dst + k) : (void *)((float *)dst + k), bf16);
}

/* One row of x against columns of the FP8 weight, decoded in registers: swarm_linear's dot (fma.c: 8 lanes
 * along K by FMA chains, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), the K % 8 tail by fmaf in k
 * order, then + bias) over the same weight values as decode_f16c gives, four columns at a time. Rows whose
 * scales or bytes decode_f16c does not take (see decode_run) are decoded by decode_run and go through
 * swarm_linear. Needs bk a multiple of 8 (no group of 8 straddles two scales). */
__attribute__((target("avx2,fma,f16c"))) static void gemv4(const float *x, int64_t K, const uint8_t *const *rows,
                                                          const float *const *sc, int64_t bk, float *out4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k0 = 0; k0 < k8; k0 += bk) {
        const int64_t k1 = k0 + bk < k8 ? k0 + bk : k8;
        __m256 s[4];
        for (int c = 0; c < 4; c++) s[c] = _mm256_set1_ps(sc[c][k0 / bk] * 256.0f);
        for (int64_t k = k0; k < k1; k += 8) {
            const __m256 xv = _mm256_loadu_ps(x + k);
            for (int c = 0; c < 4; c++) {
                const __m128i b16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(rows[c] + k)));
                acc[c] = _mm256_fmadd_ps(xv, _mm256_mul_ps(_mm256_cvtph_ps(e4m3_as_f16(b16)), s[c]), acc[c]);
            }
        }
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(out4, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int c = 0; c < 4; c++)
        for (int64_t k = k8; k < K; k++) out4[c] = fmaf(x[k], f32_of(e4m3_bits(rows[c][k])) * sc[c][k / bk], out4[c]);
}

/* The decoders follow the ISA the GEMMs run (swarm_use_isa): AVX-512's on "avx512", F16C's on "avx2" and
 * "avx512", the plain definition on the others (every one gives the same values). */
static int avx512_ok(void) {
    return !strcmp(swarm_isa_in_use(), "avx512") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw");
}

static int f16c_ok(void) {
    const char *isa = swarm_isa_in_use();
    return (!strcmp(isa, "avx512") || !strcmp(isa, "avx2")) && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("f16c");
}

static int fma_ok(void) { return f16c_ok() && __builtin_cpu_supports("fma"); }
#endif

/* dst[i] = e4m3(src[i]) * sc for n values (float32, or bfloat16 when bf16): F16C's conversion where the CPU
 * has it and sc * 2^8 is a finite normal number (the same bits), else the definition */
static void decode_run(const uint8_t *src, int64_t n, float sc, void *dst, int bf16) {
#if defined(__x86_64__) && defined(__GNUC__)
    const float s8 = sc * 256.0f;
    if (f16c_ok() && isnormal(s8) && isnormal(sc) && !any_nan(src, n)) {
        (avx512_ok() ? decode_avx512 : decode_f16c)(src, n, sc, dst, bf16);
        return;
    }
#endif
    decode_plain(src, n, sc, dst, bf16);
}

/* rows [n0, n1) of w8 (row stride ldw bytes) times their scales into dst (row stride K): float32, or
 * bfloat16 when bf16 */
static void decode_rows(const uint8_t *w8, int64_t ldw, int64_t K, const float *scale, int64_t lds, int64_t bn,
                        int64_t bk, int64_t n0, int64_t n1, void *dst, int bf16) {
    for (int64_t n = n0; n < n1; n++) {
        const float *s = scale + (n / bn) * lds;
        for (int64_t k0 = 0; k0 < K; k0 += bk) {
            const int64_t k1 = k0 + bk < K ? k0 + bk : K, at = (n - n0) * K + k0;
            decode_run(w8 + n * ldw + k0, k1 - k0, s[k0 / bk],
                       bf16 ? (void *)((uint16_t *)dst + at) : (void *)((float *)dst + at), bf16);
        }
    }
}

/* whether decode_f16c takes row n whole: its scales and their 2^8 multiples normal, no NaN byte */
static int row_in_registers(const uint8_t *w8, int64_t ldw, int64_t K, const float *scale, int64_t lds, int64_t bn,
                            int64_t bk, int64_t n) {
    const float *s = scale + (n / bn) * lds;
    for (int64_t j = 0; j < (K + bk - 1) / bk; j++)
        if (!isnormal(s[j]) || !isnormal(s[j] * 256.0f)) return 0;
#if defined(__x86_64__) && defined(__GNUC__)
    return !any_nan(w8 + n * ldw, K);
#else
    return 0;
#endif
}

typedef struct {
    const float *x, *scale, *bias;
    const uint8_t *w;
    float *out;
    int64_t M, K, ldx, N, ldw, lds, bn, bk, ldo, nb;
    int bf16;
    int failed; /* set by a task that could not allocate its panel */
} fp8_ctx;

static __thread void *panel;
static __thread size_t panel_bytes;

static int panel_room(size_t need) {
    if (need <= panel_bytes) return 1;
    void *p = realloc(panel, need);
    if (!p) return 0;
    panel = p;
    panel_bytes = need;
    return 1;
}

/* Rows per panel task: about 192 KB of decoded panel, which stays in L2 while x's rows pass, in whole tiles of
 * every ISA's column step (6 and 4), and fewer where that leaves a thread without rows (order of work only). */
static int64_t panel_rows(int64_t K, int64_t N, int bf16, int threads) {
    int64_t nb = 196608 / (K * (bf16 ? 2 : 4));
    if (nb < 1) nb = 1;
    if (nb > 48) nb -= nb % 48;
    if (threads > 1 && (N + nb - 1) / nb < threads && N >= threads) nb = (N + threads - 1) / threads;
    return nb;
}

/* out[:, n0:n1] (+ bias[n0:n1]) = x times the panel's decoded rows [n0, n1) (float32, or bfloat16 when bf16), by
 * swarm_linear / swarm_linear_bf16 on this thread. Returns 0, or -2 when out of memory. */
static int panel_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t n0, int64_t n1, const float *bias,
                      float *out, int64_t ldo, int bf16) {
    bias = bias ? bias + n0 : 0;
    if (bf16)
        return swarm_linear_bf16(x, M, K, ldx, (const uint16_t *)panel, n1 - n0, K, bias, out + n0, ldo, 1) ? -2 : 0;
    swarm_linear(x, M, K, ldx, (const float *)panel, n1 - n0, K, bias, out + n0, ldo, 1);
    return 0;
}

/* one row of x (M == 1, float32, bk % 8 == 0): columns [n0, n1) four at a time, decoded in registers */
static void gemv_task(const void *c_, int64_t i) {
    fp8_ctx *c = (fp8_ctx *)c_;
    const int64_t n0 = i * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
#if defined(__x86_64__) && defined(__GNUC__)
    int64_t ready[4];
    int held = 0;
    for (int64_t n = n0; n < n1; n++) {
        if (row_in_registers(c->w, c->ldw, c->K, c->scale, c->lds, c->bn, c->bk, n)) {
            ready[held++] = n;
        } else { /* decode_run's row, then swarm_linear: the same bits */
            if (!panel_room((size_t)c->K * 4)) {
                __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
                return;
            }
            decode_rows(c->w, c->ldw, c->K, c->scale, c->lds, c->bn, c->bk, n, n + 1, panel, 0);
            panel_gemm(c->x, 1, c->K, c->ldx, n, n + 1, c->bias, c->out, c->ldo, 0);
        }
        if (held == 4 || (n == n1 - 1 && held)) {
            const uint8_t *rows[4];
            const float *sc[4];
            float sums[4];
            for (int j = 0; j < 4; j++) {
                const int64_t m = ready[j < held ? j : held - 1];
                rows[j] = c->w + m * c->ldw;
                sc[j] = c->scale + (m / c->bn) * c->lds;
            }
            gemv4(c->x, c->K, rows, sc, c->bk, sums);
            for (int j = 0; j < held; j++) c->out[ready[j]] = c->bias ? sums[j] + c->bias[ready[j]] : sums[j];
            held = 0;
        }
    }
#else
    (void)n0, (void)n1;
#endif
}

static void fp8_task(const void *c_, int64_t i) {
    fp8_ctx *c = (fp8_ctx *)c_;
    const int64_t n0 = i * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
    if (!panel_room((size_t)(n1 - n0) * (size_t)c->K * (c->bf16 ? 2 : 4))) {
        __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    decode_rows(c->w, c->ldw, c->K, c->scale, c->lds, c->bn, c->bk, n0, n1, panel, c->bf16);
    if (panel_gemm(c->x, c->M, c->K, c->ldx, n0, n1, c->bias, c->out, c->ldo, c->bf16))
        __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
}

/* out (M, N), row stride ldo = x (M, K) times the FP8 weight w8 (N rows of ldw bytes) dequantized, transposed,
 * + bias (N) or NULL: swarm_linear's bits (bf16 = 0) or swarm_linear_bf16's (bf16 = 1) over
 * float(e4m3(w8[n, k])) * scale[(n / bn) * lds + k / bk] (rounded to bfloat16 when bf16).
 * Returns 0; -1 on arguments that do not fit; -2 when out of memory (out then partly written). */
int swarm_fp8_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w8, int64_t N, int64_t ldw,
                     const float *scale, int64_t lds, int64_t bn, int64_t bk, const float *bias, float *out,
                     int64_t ldo, int bf16, int threads) {
    if (M < 0 || K <= 0 || N < 0 || ldw < K || ldx < K || ldo < N || bn <= 0 || bk <= 0 || lds < (K + bk - 1) / bk)
        return -1;
    if (!M || !N) return 0;
    swarm_task_fn task = fp8_task;
    int64_t nb = panel_rows(K, N, bf16, threads);
#if defined(__x86_64__) && defined(__GNUC__)
    if (M == 1 && !bf16 && bk % 8 == 0 && fma_ok()) { /* a decode step: decoded in registers, no panel */
        task = gemv_task;
        nb = 64;
        if (threads > 1 && (N + nb - 1) / nb < threads) nb = (N + threads - 1) / threads;
    }
#endif
    fp8_ctx c = {x, scale, bias, w8, out, M, K, ldx, N, ldw, lds, bn, bk, ldo, nb, bf16, 0};
    swarm_parallel_for(threads, task, &c, (N + nb - 1) / nb);
    return c.failed ? -2 : 0;
}

/* ------------------------------------------------------------------------------------------------
 * MXFP4 (gpt-oss's experts as published): row n holds K / 32 groups of 16 bytes, two e2m1 values a byte (the
 * low nibble first), and K / 32 e8m0 scales; w[n, k] = e2m1 * 2^(scale - 127), one float32 multiply (exact:
 * an e2m1 value has two significant bits), rounded to bfloat16 for a bfloat16 block (exact too).
 * ---------------------------------------------------------------------------------------------- */

/* e2m1 (1 sign, 2 exponent, 1 mantissa bits; 0, 0.5, 1, 1.5, 2, 3, 4, 6) to float32's bits */
static inline uint32_t e2m1_bits(uint32_t nib) {
    const uint32_t sign = (nib & 8) << 28, e = (nib >> 1) & 3, m = nib & 1;
    const uint32_t normal = sign | ((e + 126) << 23) | (m << 22), sub = sign | (m ? 0x3F000000u : 0);
    const uint32_t is_normal = 0u - (uint32_t)(e != 0);
    return (normal & is_normal) | (sub & ~is_normal);
}

/* 2^(s - 127) as float32 (2^-127 subnormal, 2^128 infinite), the factor torch.ldexp applies */
static inline float e8m0(uint8_t s) {
    if (s == 0) return f32_of(0x00400000u);
    if (s == 255) return f32_of(0x7F800000u);
    return f32_of((uint32_t)s << 23);
}

/* rows [n0, n1) decoded into dst (row stride K): float32, or bfloat16 when bf16 */
DECODE_CLONES static void mx_decode_rows(const uint8_t *blocks, int64_t ldb, const uint8_t *scales, int64_t lds,
                                         int64_t K, int64_t n0, int64_t n1, void *dst, int bf16) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = blocks + n * ldb, *sc = scales + n * lds;
        for (int64_t g = 0; g < K / 32; g++) {
            const float p = e8m0(sc[g]);
            const uint8_t *b = row + 16 * g;
            if (bf16) {
                uint16_t *out = (uint16_t *)dst + (n - n0) * K + 32 * g;
                for (int j = 0; j < 16; j++) {
                    out[2 * j] = bf16_rne(f32_of(e2m1_bits(b[j] & 15u)) * p);
                    out[2 * j + 1] = bf16_rne(f32_of(e2m1_bits((uint32_t)b[j] >> 4)) * p);
                }
            } else {
                float *out = (float *)dst + (n - n0) * K + 32 * g;
                for (int j = 0; j < 16; j++) {
                    out[2 * j] = f32_of(e2m1_bits(b[j] & 15u)) * p;
                    out[2 * j + 1] = f32_of(e2m1_bits((uint32_t)b[j] >> 4)) * p;
                }
            }
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* mx_decode_rows' values sixteen bytes (a group of 32) at a time: the nibbles index a table of the 16 e2m1
 * values, times 2^(s - 127); every value is exact in bfloat16 too, so its bfloat16 is its float32's top half */
__attribute__((target("avx512f,avx512bw,avx2"))) static void mx_decode_avx512(const uint8_t *blocks, int64_t ldb,
                                                                          const uint8_t *scales, int64_t lds,
                                                                          int64_t K, int64_t n0, int64_t n1,
                                                                          void *dst, int bf16) {
    float table[16];
    for (int i = 0; i < 16; i++) table[i] = f32_of(e2m1_bits((uint32_t)i));
    const __m512 lut = _mm512_loadu_ps(table);
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = blocks + n * ldb, *sc = scales + n * lds;
        for (int64_t g = 0; g < K / 32; g++) {
            const __m512 p = _mm512_set1_ps(e8m0(sc[g]));
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * g)));
            const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut), p);
            const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), p);
            const __m512 a = _mm512_permutex2var_ps(lo, first, hi), c = _mm512_permutex2var_ps(lo, second, hi);
            const int64_t at = (n - n0) * K + 32 * g;
            if (bf16) {
                uint16_t *out = (uint16_t *)dst + at;
                _mm256_storeu_si256((__m256i *)out,
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(a), 16)));
                _mm256_storeu_si256((__m256i *)(out + 16),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(c), 16)));
            } else {
                _mm512_storeu_ps((float *)dst + at, a);
                _mm512_storeu_ps((float *)dst + at + 16, c);
            }
        }
    }
}
#endif

typedef struct {
    const float *x, *bias;
    const uint8_t *blocks, *scales;
    float *out;
    int64_t M, K, ldx, N, ldb, lds, ldo, nb;
    int bf16;
    int failed;
} mx_ctx;

static void mx_task(const void *c_, int64_t i) {
    mx_ctx *c = (mx_ctx *)c_;
    const int64_t n0 = i * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
    if (!panel_room((size_t)(n1 - n0) * (size_t)c->K * (c->bf16 ? 2 : 4))) {
        __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
        return;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    (avx512_ok() ? mx_decode_avx512 : mx_decode_rows)(c->blocks, c->ldb, c->scales, c->lds, c->K, n0, n1, panel,
                                                      c->bf16);
#else
    mx_decode_rows(c->blocks, c->ldb, c->scales, c->lds, c->K, n0, n1, panel, c->bf16);
#endif
    if (panel_gemm(c->x, c->M, c->K, c->ldx, n0, n1, c->bias, c->out, c->ldo, c->bf16))
        __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
}

/* out (M, N), row stride ldo = x (M, K) times the MXFP4 weight (blocks: N rows of ldb bytes, K / 2 of them
 * used; scales: N rows of lds bytes, K / 32 used) dequantized, transposed, + bias (N) or NULL: swarm_linear's
 * bits (bf16 = 0) or swarm_linear_bf16's (bf16 = 1) over the dequantized weight.
 * Returns 0; -1 on arguments that do not fit (K not a multiple of 32); -2 when out of memory. */
int swarm_mxfp4_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *blocks, int64_t ldb,
                       const uint8_t *scales, int64_t lds, int64_t N, const float *bias, float *out, int64_t ldo,
                       int bf16, int threads) {
    if (M < 0 || K <= 0 || K % 32 || N < 0 || ldb < K / 2 || lds < K / 32 || ldx < K || ldo < N) return -1;
    if (!M || !N) return 0;
    mx_ctx c = {x, bias, blocks, scales, out, M, K, ldx, N, ldb, lds, ldo, panel_rows(K, N, bf16, threads), bf16, 0};
    swarm_parallel_for(threads, mx_task, &c, (N + c.nb - 1) / c.nb);
    return c.failed ? -2 : 0;
}
