/* Float32 rows written in llama.cpp's K-quant block formats, Q4_K and Q6_K, with the bytes llama.cpp's
 * reference quantizers write (ggml/src/ggml-quants.c: quantize_row_q4_K_ref with make_qkx2_quants,
 * quantize_row_q6_K_ref with make_qx_quants; what llama-quantize writes without an importance matrix).
 *
 * Each step below is the reference's float32 operation in the reference's order, one at a time (this
 * file is compiled with -ffp-contract=off: no multiply-add is fused), so the bytes are the same on any
 * CPU. Rounding to an integer is llama.cpp's: add 1.5 * 2^23 and read the low mantissa bits (half to even
 * for |v| < 2^22). Scales go to IEEE half by round to nearest even. tests/kernels/test_qquantize.py holds
 * the bytes equal to llama.cpp's own (its shared library where installed, a recorded fixture always).
 *
 * Block layouts (little endian), per 256 weights along K:
 *   Q4_K (144 bytes): d (half), dmin (half), 12 bytes of eight 6-bit scales and mins, 128 bytes of 4-bit q.
 *   Q6_K (210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales, d (half).
 * Value of weight i of sub-block j: Q4_K d*sc_j*q_i - dmin*m_j; Q6_K d*sc_j*(q_i - 32).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SUPER 256 /* weights per super-block (QK_K) */

static int round_magic(float v) { /* llama.cpp's nearest_int */
    float t = v + 12582912.f;
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

static uint16_t to_half(float f) { /* IEEE half, round to nearest even; NaN stays NaN */
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to infinity */
    if (ax >= 0x38800000u) {                                     /* normal half */
        const uint32_t r = ax - 0x38000000u, h = r >> 13, rest = r & 0x1fffu;
        return (uint16_t)(sign | (h + (rest > 0x1000u || (rest == 0x1000u && (h & 1)))));
    }
    if (ax <= 0x33000000u) return (uint16_t)sign; /* at most half the smallest subnormal: zero */
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u, shift = 126u - (ax >> 23);
    const uint32_t h = mant >> shift, rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    return (uint16_t)(sign | (h + (rest > half || (rest == half && (h & 1)))));
}

static float from_half(uint16_t h) { /* exact */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    uint32_t x;
    if (e == 0x1f) {
        x = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        x = sign | ((e + 112) << 23) | (m << 13);
    } else {
        float v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static void put_half(uint8_t *p, float f) {
    const uint16_t h = to_half(f);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

static float get_half(const uint8_t *p) { return from_half((uint16_t)(p[0] | (p[1] << 8))); }

static int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Q4_K's fit of one sub-block of 32 (make_qkx2_quants with nmax 15, rmin -1, rdelta 0.1, 20 steps, squared
 * error): levels q in L, returns the scale and writes the offset (>= 0) to *offset. */
static float fit_q4k_sub(const float *x, const float *w, uint8_t *L, float *offset) {
    enum { N = 32, NMAX = 15, STEPS = 20 };
    const float rmin = -1.f, rdelta = 0.1f;
    float lo = x[0], hi = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < N; ++i) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (lo > 0) lo = 0;
    if (hi == lo) {
        memset(L, 0, N);
        *offset = -lo;
        return 0.f;
    }
    float iscale = NMAX / (hi - lo), scale = 1 / iscale, best = 0;
    for (int i = 0; i < N; ++i) {
        L[i] = (uint8_t)clamp_int(round_magic(iscale * (x[i] - lo)), 0, NMAX);
        const float diff = scale * L[i] + lo - x[i];
        best += w[i] * (diff * diff);
    }
    uint8_t trial[N];
    for (int step = 0; step <= STEPS; ++step) {
        iscale = (rmin + rdelta * step + NMAX) / (hi - lo);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < N; ++i) {
            const int l = clamp_int(round_magic(iscale * (x[i] - lo)), 0, NMAX);
            trial[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float det = sum_w * sum_l2 - sum_l * sum_l;
        if (!(det > 0)) continue;
        float s = (sum_w * sum_xl - sum_x * sum_l) / det, m = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if (m > 0) {
            m = 0;
            s = sum_xl / sum_l2;
        }
        float err = 0;
        for (int i = 0; i < N; ++i) {
            const float diff = s * trial[i] + m - x[i];
            err += w[i] * (diff * diff);
        }
        if (err < best) {
            memcpy(L, trial, N);
            best = err;
            scale = s;
            lo = m;
        }
    }
    *offset = -lo;
    return scale;
}

static void q4k_scale_min(const uint8_t *sc, int j, int *scale, int *min) { /* the 6-bit pair of sub-block j */
    if (j < 4) {
        *scale = sc[j] & 63;
        *min = sc[j + 4] & 63;
    } else {
        *scale = (sc[j + 4] & 0xf) | ((sc[j - 4] >> 6) << 4);
        *min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

static void quantize_q4k_block(const float *x, uint8_t *out) {
    uint8_t L[SUPER], *sc = out + 4, *q = out + 16;
    float scales[8], mins[8], w[32], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
        const float av = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) w[l] = av + fabsf(xs[l]);
        scales[j] = fit_q4k_sub(xs, w, L + 32 * j, &mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    memset(sc, 0, 12);
    for (int j = 0; j < 8; ++j) {
        uint8_t ls = (uint8_t)round_magic(inv_scale * scales[j]), lm = (uint8_t)round_magic(inv_min * mins[j]);
        if (ls > 63) ls = 63;
        if (lm > 63) lm = 63;
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xf) | ((lm & 0xf) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    put_half(out, max_scale / 63.f);
    put_half(out + 2, max_min / 63.f);
    const float d_all = get_half(out), dmin_all = get_half(out + 2);
    for (int j = 0; j < 8; ++j) { /* the levels again, against the scales as stored */
        int s6, m6;
        q4k_scale_min(sc, j, &s6, &m6);
        const float d = d_all * s6;
        if (!d) continue;
        const float dm = dmin_all * m6;
        for (int i = 0; i < 32; ++i) L[32 * j + i] = (uint8_t)clamp_int(round_magic((x[32 * j + i] + dm) / d), 0, 15);
    }
    for (int j = 0; j < SUPER; j += 64)
        for (int l = 0; l < 32; ++l) *q++ = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

/* Q6_K's fit of one sub-block of 16 (make_qx_quants with nmax 32, weights x^2): levels 0..63 in L. */
static float fit_q6k_sub(const float *x, uint8_t *L) {
    enum { N = 16, NMAX = 32 };
    float peak = 0, apeak = 0;
    for (int i = 0; i < N; ++i) {
        const float a = fabsf(x[i]);
        if (a > apeak) {
            apeak = a;
            peak = x[i];
        }
    }
    if (apeak < 1e-15f) {
        memset(L, 0, N);
        return 0.f;
    }
    float iscale = -NMAX / peak, sumlx = 0, suml2 = 0;
    for (int i = 0; i < N; ++i) {
        const int l = clamp_int(round_magic(iscale * x[i]), -NMAX, NMAX - 1);
        L[i] = (uint8_t)(l + NMAX);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int step = -9; step <= 9; ++step) {
        if (!step) continue;
        iscale = -(NMAX + 0.1f * step) / peak;
        sumlx = suml2 = 0;
        for (int i = 0; i < N; ++i) {
            const int l = clamp_int(round_magic(iscale * x[i]), -NMAX, NMAX - 1);
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < N; ++i) L[i] = (uint8_t)(NMAX + clamp_int(round_magic(iscale * x[i]), -NMAX, NMAX - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

static void quantize_q6k_block(const float *x, uint8_t *out) {
    uint8_t L[SUPER], *ql = out, *qh = out + 128;
    int8_t *sc = (int8_t *)(out + 192);
    float scales[16], max_scale = 0, max_abs = 0;
    for (int j = 0; j < 16; ++j) {
        scales[j] = fit_q6k_sub(x + 16 * j, L + 16 * j);
        if (fabsf(scales[j]) > max_abs) {
            max_abs = fabsf(scales[j]);
            max_scale = scales[j];
        }
    }
    if (max_abs < 1e-15f) {
        memset(out, 0, 210);
        return;
    }
    const float iscale = -128.f / max_scale;
    put_half(out + 208, 1 / iscale);
    for (int j = 0; j < 16; ++j) {
        const int s = round_magic(iscale * scales[j]);
        sc[j] = (int8_t)(s < 127 ? s : 127);
    }
    const float d_all = get_half(out + 208);
    for (int j = 0; j < 16; ++j) { /* the levels again, against the scales as stored */
        const float d = d_all * sc[j];
        if (!d) continue;
        for (int i = 0; i < 16; ++i) L[16 * j + i] = (uint8_t)(clamp_int(round_magic(x[16 * j + i] / d), -32, 31) + 32);
    }
    for (int j = 0; j < SUPER; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t *v = L + j + l;
            ql[l] = (uint8_t)((v[0] & 0xf) | ((v[64] & 0xf) << 4));
            ql[l + 32] = (uint8_t)((v[32] & 0xf) | ((v[96] & 0xf) << 4));
            qh[l] = (uint8_t)((v[0] >> 4) | ((v[32] >> 4) << 2) | ((v[64] >> 4) << 4) | ((v[96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

/* rows x k float32 (row stride ldx floats) to blocks: fmt 3 Q4_K (144 bytes per 256), 4 Q6_K (210 per
 * 256), fma.c's format index; row r's blocks at out + r * ldo. Returns 0, or -1: another format, or k not a
 * multiple of 256. */
int swarm_quantize_kquant(int fmt, const float *x, int64_t rows, int64_t k, int64_t ldx, uint8_t *out, int64_t ldo) {
    if ((fmt != 3 && fmt != 4) || k <= 0 || k % SUPER) return -1;
    const int64_t bytes = fmt == 3 ? 144 : 210;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < k / SUPER; ++b) {
            const float *xb = x + r * ldx + b * SUPER;
            uint8_t *ob = out + r * ldo + b * bytes;
            if (fmt == 3)
                quantize_q4k_block(xb, ob);
            else
                quantize_q6k_block(xb, ob);
        }
    return 0;
}
