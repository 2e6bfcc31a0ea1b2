/* One Llama-structured decoder layer (Llama, Mistral, Qwen2, Qwen3) over a packed step's rows in one call:
 * exactly the operations LayerBlock's module path runs in the fma kernel mode, in its order, through the
 * same entry points (swarm_rmsnorm, swarm_linear / swarm_linear_bf16 / swarm_qlinear, swarm_attention /
 * swarm_attention_bf16, swarm_silu: whatever ISA is in use), plus plain float32 element-wise C for what
 * torch computes element-wise (rotary, residual adds, silu(gate) * up), each product and sum rounded
 * once as torch rounds it (this file is compiled with -ffp-contract=off like the rest).
 *
 *   x = rmsnorm(h, input_layernorm);  q, k, v = x Wq^T (+bq), x Wk^T (+bk), x Wv^T (+bv)
 *   [Qwen3: q, k = rmsnorm per head of Dh (q_norm, k_norm)]
 *   q, k = (q * cos) + (rotate_half(q) * sin)      (rotate_half(q) = cat(-q[Dh/2:], q[:Dh/2]) per head)
 *   cache[pos + i] = k, v for each session; a = attention of each session's rows over its own cache
 *   h = h + a Wo^T (+bo);  x = rmsnorm(h, post_attention_layernorm)
 *   h = h + (silu(x Wg^T) * (x Wu^T)) Wd^T
 *
 * A bfloat16 block holds h, cos, sin, its weights and its cache in bfloat16; the module path then rounds
 * each module's float32 result to bfloat16 (round to nearest even) where the module returns it: here
 * every intermediate is held as a float32 that is a bfloat16 value, rounded at the same points, so the
 * kernels' widened inputs are the module path's bit for bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fma_common.h"

enum { PROJ_F32 = 0, PROJ_BF16 = 1, PROJ_BLOCKS = 2, PROJ_FP8 = 3 };

/* One projection: out (M, n) = x (M, k) times w transposed, + bias. */
typedef struct {
    int32_t kind;       /* PROJ_F32, PROJ_BF16 (raw 16-bit patterns), PROJ_BLOCKS (llama.cpp's blocks) or PROJ_FP8 */
    int32_t fmt;        /* PROJ_BLOCKS: the format's number in swarm_qlinear */
    const void *w;      /* (n, k) rows, row stride ldw: elements (PROJ_F32, PROJ_BF16) or bytes (the others) */
    int64_t ldw;
    int64_t n, k;
    const float *bias;  /* (n) float32 or NULL */
    const float *scale; /* PROJ_FP8: the (n / bn, k / bk) block scales (row stride lds), as swarm_fp8_linear */
    int64_t lds, bn, bk;
} swarm_proj;

/* One decoder layer's weights and constants (built once per layer, see fma.py's LayerPlan). */
typedef struct {
    int32_t bf16;                       /* 1: a bfloat16 block (h, cos, sin, cache in bfloat16) */
    int32_t pad;
    int64_t D, H, Hkv, Dh, I;           /* hidden size, heads, kv heads, head dim, MLP width */
    float eps_in, eps_post, eps_qk;     /* the RMSNorms' epsilons (eps_qk: q_norm's and k_norm's) */
    float scale;                        /* attention's score scale */
    int64_t window;                     /* sliding window in positions, 0: none */
    const float *norm_in, *norm_post;   /* (D) float32 */
    const float *q_norm, *k_norm;       /* (Dh) float32, or NULL: no per-head norms (all but Qwen3) */
    swarm_proj q, k, v, o, gate, up, down;
} swarm_layer;

/* One session's rows in the packed step: positions [pos, pos + t) at rows [off, off + t). */
typedef struct {
    int64_t pos, t, off;
    void *const *keys;    /* per layer slot: the (capacity, Hkv, Dh) key buffer, block dtype */
    void *const *values;  /* likewise the values */
} swarm_segment;

/* The packed step: N rows of h, updated in place. */
typedef struct {
    int64_t N;
    void *h;              /* (N, D) block dtype, contiguous */
    const void *cos;      /* (N, Dh) block dtype: each row's rotary cos (the block's RotaryTable) */
    const void *sin;
    int64_t nseg;
    const swarm_segment *segs;
} swarm_rows;

static inline float bf16_value(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16 bits, round to nearest even (torch's c10::round_to_nearest_even; NaN -> 0x7FC0) */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_round(float f) { return bf16_value(bf16_bits(f)); }

static void round_all(float *x, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) x[i] = bf16_round(x[i]);
}

/* out (M, p->n) = x (M, p->k) p^T + bias, then rounded as the block's Linear returns it. */
static int project(const swarm_proj *p, const float *x, int64_t M, float *out, int bf16, int threads) {
    int rc = 0;
    if (p->kind == PROJ_BLOCKS)
        rc = swarm_qlinear(p->fmt, x, M, p->k, p->k, (const uint8_t *)p->w, p->n, p->ldw, p->bias, out, p->n, threads);
    else if (p->kind == PROJ_FP8)
        rc = swarm_fp8_linear(x, M, p->k, p->k, (const uint8_t *)p->w, p->n, p->ldw, p->scale, p->lds, p->bn, p->bk,
                              p->bias, out, p->n, bf16, threads);
    else if (p->kind == PROJ_BF16)
        rc = swarm_linear_bf16(x, M, p->k, p->k, (const uint16_t *)p->w, p->n, p->ldw, p->bias, out, p->n, threads);
    else
        swarm_linear(x, M, p->k, p->k, (const float *)p->w, p->n, p->ldw, p->bias, out, p->n, threads);
    round_all(out, M * p->n, bf16);
    return rc;
}

/* project() for the n projections of one input (q, k, v; gate, up), outs[i] (M, ps[i]->n): one
 * swarm_qlinear_many where all are block formats (the same bits, x quantized once, one dispatch). */
static int project_many(const swarm_proj *const *ps, int n, const float *x, int64_t M, float *const *outs, int bf16,
                        int threads) {
    int blocks = n <= SWARM_QPARTS_MAX;
    for (int i = 0; i < n; i++) blocks &= ps[i]->kind == PROJ_BLOCKS && ps[i]->k == ps[0]->k;
    if (!blocks) {
        int rc = 0;
        for (int i = 0; i < n && !rc; i++) rc = project(ps[i], x, M, outs[i], bf16, threads);
        return rc;
    }
    swarm_qpart parts[SWARM_QPARTS_MAX];
    for (int i = 0; i < n; i++)
        parts[i] = (swarm_qpart){ps[i]->fmt, (const uint8_t *)ps[i]->w, ps[i]->n, ps[i]->ldw, ps[i]->bias, outs[i], ps[i]->n};
    const int rc = swarm_qlinear_many(parts, n, x, M, ps[0]->k, ps[0]->k, threads);
    for (int i = 0; i < n; i++) round_all(outs[i], M * ps[i]->n, bf16);
    return rc;
}

static void rmsnorm_rows(const float *x, int64_t rows, int64_t D, const float *w, float eps, float *out, int bf16) {
    swarm_rmsnorm(x, rows, D, w, eps, out);
    round_all(out, rows * D, bf16);
}

/* x (N, heads, Dh) = (x * cos) + (rotate_half(x) * sin), each product and the sum rounded (bfloat16: each to
 * bfloat16, as torch's bfloat16 ops round every result), row n with cos[n], sin[n]. */
static void rotary(float *x, int64_t N, int64_t heads, int64_t Dh, const void *cos, const void *sin, int bf16) {
    const int64_t half = Dh / 2;
    float c[Dh], s[Dh], r[Dh];
    for (int64_t n = 0; n < N; n++) {
        for (int64_t d = 0; d < Dh; d++) {
            c[d] = bf16 ? bf16_value(((const uint16_t *)cos)[n * Dh + d]) : ((const float *)cos)[n * Dh + d];
            s[d] = bf16 ? bf16_value(((const uint16_t *)sin)[n * Dh + d]) : ((const float *)sin)[n * Dh + d];
        }
        for (int64_t hd = 0; hd < heads; hd++) {
            float *xh = x + (n * heads + hd) * Dh;
            for (int64_t d = 0; d < half; d++) r[d] = -xh[d + half];
            for (int64_t d = half; d < Dh; d++) r[d] = xh[d - half];
            if (bf16)
                for (int64_t d = 0; d < Dh; d++) xh[d] = bf16_round(bf16_round(xh[d] * c[d]) + bf16_round(r[d] * s[d]));
            else
                for (int64_t d = 0; d < Dh; d++) {
                    const float a = xh[d] * c[d], b = r[d] * s[d];
                    xh[d] = a + b;
                }
        }
    }
}

/* Read n values of the block dtype as float32 (bfloat16 widened: exact). */
__attribute__((noinline)) static void load_rows(float *dst, const void *src, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_value(((const uint16_t *)src)[i]);
    else
        memcpy(dst, src, (size_t)n * sizeof(float));
}

/* Write n float32 values as the block dtype (bfloat16: rounded to nearest even). */
static void store_row(void *dst, const float *src, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = bf16_bits(src[i]);
    else
        memcpy(dst, src, (size_t)n * sizeof(float));
}

/* Run decoder layer L over the step's rows (R->h updated in place), using each session's buffers of layer
 * slot `slot`. Returns 0; -1: a block format or K swarm_qlinear refuses; -2: out of memory (h and the
 * caches may then hold part of the layer: the caller rolls the forward back). */
int swarm_layer_forward(const swarm_layer *L, const swarm_rows *R, int64_t slot, int threads) {
    const int64_t N = R->N, D = L->D, H = L->H, Hkv = L->Hkv, Dh = L->Dh, I = L->I;
    const int64_t qw = H * Dh, kw = Hkv * Dh;
    const int bf16 = L->bf16;
    if (N <= 0) return 0;
    if (Dh <= 0 || Dh % 2 || Dh > 4096) return -1;
    float *buf = malloc(sizeof(float) * (size_t)N * (size_t)(3 * D + 2 * qw + 2 * kw + 2 * I));
    if (!buf) return -2;
    float *h = buf, *x = h + N * D, *o = x + N * D, *q = o + N * D, *att = q + N * qw, *k = att + N * qw,
          *v = k + N * kw, *g = v + N * kw, *u = g + N * I;
    int rc = 0;
    load_rows(h, R->h, N * D, bf16);

    /* attention */
    rmsnorm_rows(h, N, D, L->norm_in, L->eps_in, x, bf16);
    if ((rc = project_many((const swarm_proj *[]){&L->q, &L->k, &L->v}, 3, x, N, (float *[]){q, k, v}, bf16, threads)))
        goto done;
    if (L->q_norm) {
        rmsnorm_rows(q, N * H, Dh, L->q_norm, L->eps_qk, q, bf16);
        rmsnorm_rows(k, N * Hkv, Dh, L->k_norm, L->eps_qk, k, bf16);
    }
    rotary(q, N, H, Dh, R->cos, R->sin, bf16);
    rotary(k, N, Hkv, Dh, R->cos, R->sin, bf16);
    const size_t item = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t s = 0; s < R->nseg; s++) {
        const swarm_segment *sg = &R->segs[s];
        char *kc = (char *)sg->keys[slot], *vc = (char *)sg->values[slot];
        for (int64_t i = 0; i < sg->t; i++) {
            store_row(kc + (size_t)((sg->pos + i) * kw) * item, k + (sg->off + i) * kw, kw, bf16);
            store_row(vc + (size_t)((sg->pos + i) * kw) * item, v + (sg->off + i) * kw, kw, bf16);
        }
    }
    for (int64_t s = 0; s < R->nseg; s++) {
        const swarm_segment *sg = &R->segs[s];
        if (!sg->t) continue;
        const float *qs = q + sg->off * qw;
        float *as = att + sg->off * qw;
        const int bad = bf16 ? swarm_attention_bf16(qs, sg->t, H, Dh, qw, (const uint16_t *)sg->keys[slot],
                                                    (const uint16_t *)sg->values[slot], Hkv, kw, sg->pos, L->window,
                                                    L->scale, as, threads)
                             : swarm_attention(qs, sg->t, H, Dh, qw, (const float *)sg->keys[slot],
                                               (const float *)sg->values[slot], Hkv, kw, sg->pos, L->window, L->scale,
                                               as, threads);
        if (bad) {
            rc = -2;
            goto done;
        }
    }
    round_all(att, N * qw, bf16);
    if ((rc = project(&L->o, att, N, o, bf16, threads))) goto done;
    for (int64_t i = 0; i < N * D; i++) h[i] = h[i] + o[i];
    round_all(h, N * D, bf16);

    /* MLP */
    rmsnorm_rows(h, N, D, L->norm_post, L->eps_post, x, bf16);
    if ((rc = project_many((const swarm_proj *[]){&L->gate, &L->up}, 2, x, N, (float *[]){g, u}, bf16, threads)))
        goto done;
    swarm_silu(g, N * I, g);
    round_all(g, N * I, bf16);
    for (int64_t i = 0; i < N * I; i++) g[i] = g[i] * u[i];
    round_all(g, N * I, bf16);
    if ((rc = project(&L->down, g, N, o, bf16, threads))) goto done;
    for (int64_t i = 0; i < N * D; i++) h[i] = h[i] + o[i];
    store_row(R->h, h, N * D, bf16);
done:
    free(buf);
    return rc < 0 ? rc : (rc ? -1 : 0);
}
