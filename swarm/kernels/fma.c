/* Batch-invariant float32 GEMM and attention for x86-64 CPUs with AVX2 and FMA.
 *
 * Every output element is one fixed function of its own inputs, whatever else is computed in the
 * same call: how many rows (a decode row, a verify chunk, a prefill slice, packed sessions), where
 * the row sits, how the loops are blocked. That is the batch invariance of Thinking Machines'
 * kernels (He et al., "Defeating Nondeterminism in LLM Inference", 2025) by construction on a CPU,
 * where a BLAS gives a 1-row GEMM (its GEMV path) other bits than the same row in a larger GEMM.
 *
 * The fixed functions (IEEE float32, fused multiply-add where written, nothing else reassociated:
 * compiled with -ffp-contract=off and never with -ffast-math):
 *   dot(a, b, K): 8 lanes, lane l accumulates k = 8i + l by an FMA chain in i order from +0;
 *     then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); then the K % 8 tail in k order by fmaf.
 *   linear: out[m, n] = dot(x[m], w[n], K) (+ bias[n]).
 *   attention, per query row at absolute position p and head h (kv head h / (H / Hkv)), over its
 *     own keys j in [lo, p] (lo = p - window + 1 with a sliding window, else 0):
 *       s_j = dot(q, k_j, Dh) * scale; m = max_j s_j; e_j = exp8(s_j - m) (the polynomial below);
 *       l = sum8(e) (8 lanes by (j - lo) % 8, each in j order, the fixed pairwise finish);
 *       o[d] = FMA chain of e_j * v_j[d] in j order from +0; out = o / l.
 * Only the row's own data enter, so a decode step and the same row in any chunk agree bit for bit.
 * The same code runs on Intel and AMD: these are IEEE operations, no vendor library decides.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#ifndef SWARM_MB
#define SWARM_MB 24
#endif
#define AI static inline __attribute__((always_inline))

AI float hsum8(__m256 v) {
    float a[8];
    _mm256_storeu_ps(a, v);
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* The same sums as hsum8 for four vectors at once: hadd pairs neighbours, so the lanes hold
 * (l0 + l1) + (l2 + l3) and (l4 + l5) + (l6 + l7) of each vector, which the last add joins. */
AI __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* out[r * ldo + c] = dot(x + r * ldx, w + c * ldw, K) (+ bias[c]) for r < MR, c < NR. */
AI void dot_tile(const int MR, const int NR, const float *x, int64_t ldx, const float *w, int64_t ldw,
                 int64_t K, float *out, int64_t ldo, const float *bias) {
    __m256 acc[3][4];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 xv[3];
        for (int r = 0; r < MR; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
        for (int c = 0; c < NR; c++) {
            const __m256 wv = _mm256_loadu_ps(w + c * ldw + k);
            for (int r = 0; r < MR; r++) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < MR; r++) {
        float sums[4];
        if (NR == 4) {
            _mm_storeu_ps(sums, hsum8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
        } else {
            for (int c = 0; c < NR; c++) sums[c] = hsum8(acc[r][c]);
        }
        for (int c = 0; c < NR; c++) {
            float s = sums[c];
            for (int64_t k = k8; k < K; k++) s = fmaf(x[r * ldx + k], w[c * ldw + k], s);
            if (bias) s = s + bias[c];
            out[r * ldo + c] = s;
        }
    }
}

static void dot_block(int mr, int nr, const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                      float *out, int64_t ldo, const float *bias) {
#define CASE(R, C) case R * 8 + C: dot_tile(R, C, x, ldx, w, ldw, K, out, ldo, bias); break;
    switch (mr * 8 + nr) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
    }
#undef CASE
}

/* out (M, N), row stride ldo = x (M, K), row stride ldx, times w (N, K) transposed, row stride ldw
 * (an nn.Linear weight as stored), plus bias (N) or NULL. Blocked so that nb rows of w stay in L2
 * while blocks of SWARM_MB rows of x pass, each 4 rows of w meeting all rows of the block while
 * they are in L1 (measured on the AMD EPYC: 3x4 tiles beat 4x2, 5x2 and 6x2; SWARM_MB 24 beat 12 and
 * unblocked rows for a 256-row prefill slice). The blocking changes the order of work, never of any sum. */
void swarm_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N, int64_t ldw,
                  const float *bias, float *out, int64_t ldo) {
    int64_t nb = (int64_t)(196608 / (K * 4 > 0 ? K * 4 : 1)) & ~(int64_t)3;
    if (nb < 4) nb = 4;
    const int64_t mb = SWARM_MB;
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
        const int64_t n1 = n0 + nb < N ? n0 + nb : N;
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = m0 + mb < M ? m0 + mb : M;
            for (int64_t n = n0; n < n1; n += 4) {
                const int nr = n1 - n < 4 ? (int)(n1 - n) : 4;
                for (int64_t m = m0; m < m1; m += 3) {
                    const int mr = m1 - m < 3 ? (int)(m1 - m) : 3;
                    dot_block(mr, nr, x + m * ldx, ldx, w + n * ldw, ldw, K, out + m * ldo + n, ldo,
                              bias ? bias + n : 0);
                }
            }
        }
    }
}

/* exp of 8 floats: Cephes' expf range reduction and polynomial, all FMA; 0 below -87 (and for -inf). */
AI __m256 exp8(__m256 x) {
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

/* o[h][d] = FMA chain over j of e[h][j] * v_j[d] for HR heads and DV vectors of 8 dims at dim d0. */
AI void pv_tile(const int HR, const int DV, const float *e, int64_t lde, const float *v, int64_t ldv,
                int64_t n, float *o, int64_t ldo) {
    __m256 acc[3][4];
    for (int h = 0; h < HR; h++)
        for (int c = 0; c < DV; c++) acc[h][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m256 vv[4];
        for (int c = 0; c < DV; c++) vv[c] = _mm256_loadu_ps(v + j * ldv + 8 * c);
        for (int h = 0; h < HR; h++) {
            const __m256 eh = _mm256_set1_ps(e[h * lde + j]);
            for (int c = 0; c < DV; c++) acc[h][c] = _mm256_fmadd_ps(eh, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HR; h++)
        for (int c = 0; c < DV; c++) _mm256_storeu_ps(o + h * ldo + 8 * c, acc[h][c]);
}

static void pv_block(int hr, int dv, const float *e, int64_t lde, const float *v, int64_t ldv, int64_t n,
                     float *o, int64_t ldo) {
#define CASE(R, C) case R * 8 + C: pv_tile(R, C, e, lde, v, ldv, n, o, ldo); break;
    switch (hr * 8 + dv) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
    }
#undef CASE
}

/* Causal attention of T query rows at positions [pos0, pos0 + T) against one session's cache.
 *   q: (T, H, Dh), token stride ldq (floats), heads contiguous; k, v: position-major caches,
 *   key j of kv head g at k + j * ldkv + g * Dh (likewise v), holding at least pos0 + T positions;
 *   window: sliding window in positions (0: none); out: (T, H, Dh) contiguous;
 *   scratch: at least 3 * (pos0 + T + 8) + 3 * Dh floats. */
void swarm_attention(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const float *k,
                     const float *v, int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale,
                     float *out, float *scratch) {
    const int64_t group = H / Hkv;
    const int64_t stride = pos0 + T + 8;
    float *s = scratch;                 /* 3 rows of scores, then probabilities */
    float *o = scratch + 3 * stride;    /* 3 rows of Dh unnormalized outputs */
    const int64_t d8 = Dh & ~(int64_t)7;
    for (int64_t t = 0; t < T; t++) {
        const int64_t p = pos0 + t;
        const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        const int64_t n = p - lo + 1;
        const int64_t npad = (n + 7) & ~(int64_t)7;
        for (int64_t h0 = 0, hr = 3; h0 < H; h0 += hr) {
            const int64_t g = h0 / group;
            hr = 3;  /* heads of this block: at most 3, all of kv head g */
            if (h0 + hr > H) hr = H - h0;
            if ((h0 + hr - 1) / group != g) hr = (g + 1) * group - h0;
            const float *qh = q + t * ldq + h0 * Dh;
            const float *kg = k + lo * ldkv + g * Dh;
            const float *vg = v + lo * ldkv + g * Dh;
            for (int64_t j = 0; j < n; j += 4)
                dot_block((int)hr, n - j < 4 ? (int)(n - j) : 4, qh, Dh, kg + j * ldkv, ldkv, Dh, s + j, stride, 0);
            float l[3];
            for (int h = 0; h < hr; h++) {
                float *sh = s + h * stride;
                for (int64_t j = n; j < npad; j++) sh[j] = -INFINITY;
                const __m256 sc = _mm256_set1_ps(scale);
                __m256 mx = _mm256_set1_ps(-INFINITY);
                for (int64_t j = 0; j < npad; j += 8) {  /* max is exact: any order gives the same m */
                    const __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(sh + j), sc);
                    _mm256_storeu_ps(sh + j, sv);
                    mx = _mm256_max_ps(mx, sv);
                }
                float lanes[8], m = -INFINITY;
                _mm256_storeu_ps(lanes, mx);
                for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
                const __m256 mv = _mm256_set1_ps(m);
                __m256 sum = _mm256_setzero_ps();
                for (int64_t j = 0; j < npad; j += 8) {
                    const __m256 ev = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mv));
                    _mm256_storeu_ps(sh + j, ev);
                    sum = _mm256_add_ps(sum, ev);
                }
                l[h] = hsum8(sum);
            }
            for (int64_t d = 0; d < d8; d += 32) {
                const int dv = d8 - d < 32 ? (int)((d8 - d) / 8) : 4;
                pv_block((int)hr, dv, s, stride, vg + d, ldkv, n, o + d, Dh);
            }
            for (int h = 0; h < hr; h++)
                for (int64_t d = d8; d < Dh; d++) {
                    float acc = 0.0f;
                    for (int64_t j = 0; j < n; j++) acc = fmaf(s[h * stride + j], vg[j * ldkv + d], acc);
                    o[h * Dh + d] = acc;
                }
            float *dst = out + (t * H + h0) * Dh;
            for (int h = 0; h < hr; h++)
                for (int64_t d = 0; d < Dh; d++) dst[h * Dh + d] = o[h * Dh + d] / l[h];
        }
    }
}

/* RMSNorm of N rows of D (Zhang & Sennrich 2019, as transformers' Llama-family modules compute it):
 *   r = 1 / sqrt(dot(x, x, D) / D + eps) (IEEE sqrt and divisions); out[d] = w[d] * (x[d] * r).
 * Each row alone, so its bits never depend on N or on the rows beside it. */
void swarm_rmsnorm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *out) {
    for (int64_t i = 0; i < N; i++) {
        const float *xi = x + i * D;
        float ss;
        dot_tile(1, 1, xi, D, xi, D, D, &ss, 1, 0);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t d = 0; d < D; d++) out[i * D + d] = w[d] * (xi[d] * r);
    }
}

/* SiLU (Hendrycks & Gimpel 2016; Elfwing et al. 2018) of n floats: x / (1 + exp8(-x)), eight at a
 * time; the last few go through the same vector code from a padded buffer, so an element's bits
 * never depend on where it sits. */
void swarm_silu(const float *x, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v)))));
    }
    if (i < n) {
        float buf[8] = {0};
        for (int64_t j = i; j < n; j++) buf[j - i] = x[j];
        const __m256 v = _mm256_loadu_ps(buf);
        _mm256_storeu_ps(buf, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v)))));
        for (int64_t j = i; j < n; j++) out[j] = buf[j - i];
    }
}
