/* Attention over one session's KV cache whose element type is KV_T (float, or bfloat16 as raw 16-bit
 * patterns widened exactly on load): included by fma_kernels.h once per type, with ATT(name) naming
 * that type's functions. The arithmetic is stated in fma.c. */
/* o[h][d] = o[h][d] * alpha[h], then an FMA chain over j of e[h][j] * v_j[d] in j order, for HR heads
 * and DV vectors of 8 dims. */
AI void ATT(pv_tile)(const int HR, const int DV, const float *e, int64_t lde, const KV_T *v, int64_t ldv, int64_t n,
                float *o, int64_t ldo, const float *alpha) {
    v8 acc[3][4];
    for (int h = 0; h < HR; h++) {
        const v8 a = v8_set1(alpha[h]);
        for (int c = 0; c < DV; c++) acc[h][c] = v8_mul(v8_load(o + h * ldo + 8 * c), a);
    }
    for (int64_t j = 0; j < n; j++) {
        v8 vv[4];
        for (int c = 0; c < DV; c++) vv[c] = KV_LOAD8(v + j * ldv + 8 * c);
        for (int h = 0; h < HR; h++) {
            const v8 eh = v8_set1(e[h * lde + j]);
            for (int c = 0; c < DV; c++) acc[h][c] = v8_fma(eh, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HR; h++)
        for (int c = 0; c < DV; c++) v8_store(o + h * ldo + 8 * c, acc[h][c]);
}

static void ATT(pv_block)(int hr, int dv, const float *e, int64_t lde, const KV_T *v, int64_t ldv, int64_t n, float *o,
                     int64_t ldo, const float *alpha) {
#define ARGS e, lde, v, ldv, n, o, ldo, alpha
    switch (hr * 8 + dv) { TROW(ATT(pv_tile), 1) TROW(ATT(pv_tile), 2) TROW(ATT(pv_tile), 3) }
#undef ARGS
}

typedef struct {
    const float *q;
    const KV_T *k, *v;
    float *out, *kt;     /* kt: the call's key blocks transposed, (Hkv, nblk, Dh, SWARM_KB); NULL: each task
                          * transposes its kv head's blocks itself, one at a time (a decode step's few rows) */
    int64_t T, H, Dh, ldq, Hkv, ldkv, pos0, window, nhb, b0, nblk, nkeys;
    float scale;
    float *own;          /* with kt NULL: a block of Dh x SWARM_KB per head block */
    const int64_t *h0s;  /* head blocks: first head and count, at most 3 heads of one kv head */
    const int *hrs;
} ATT(attention_ctx);

/* Key block b0 + blk of kv head g, transposed into dst (Dh x SWARM_KB); keys past nkeys are +0. A copy:
 * no arithmetic, so its order is free. */
static void ATT(transpose_block)(const ATT(attention_ctx) *c, int64_t g, int64_t blk, float *dst) {
    const int64_t kb0 = (c->b0 + blk) * SWARM_KB, Dh = c->Dh;
    const KV_T *src = c->k + g * Dh;
    for (int64_t j0 = 0; j0 < SWARM_KB; j0 += 8) {
        int64_t d0 = 0;
#if (defined(SWARM_ISA_AVX2) || defined(SWARM_ISA_AVX512)) && KV_FLOAT
        if (kb0 + j0 + 8 <= c->nkeys) {
            for (; d0 + 8 <= Dh; d0 += 8) {  /* an 8 x 8 transpose in registers */
                __m256 r[8], t[8];
                for (int x = 0; x < 8; x++) r[x] = _mm256_loadu_ps(src + (kb0 + j0 + x) * c->ldkv + d0);
                for (int x = 0; x < 8; x += 2) {
                    t[x] = _mm256_unpacklo_ps(r[x], r[x + 1]);
                    t[x + 1] = _mm256_unpackhi_ps(r[x], r[x + 1]);
                }
                for (int x = 0; x < 8; x += 4) {
                    r[x] = _mm256_shuffle_ps(t[x], t[x + 2], 0x44);
                    r[x + 1] = _mm256_shuffle_ps(t[x], t[x + 2], 0xEE);
                    r[x + 2] = _mm256_shuffle_ps(t[x + 1], t[x + 3], 0x44);
                    r[x + 3] = _mm256_shuffle_ps(t[x + 1], t[x + 3], 0xEE);
                }
                for (int x = 0; x < 4; x++) {
                    _mm256_storeu_ps(dst + (d0 + x) * SWARM_KB + j0, _mm256_permute2f128_ps(r[x], r[x + 4], 0x20));
                    _mm256_storeu_ps(dst + (d0 + x + 4) * SWARM_KB + j0, _mm256_permute2f128_ps(r[x], r[x + 4], 0x31));
                }
            }
        }
#endif
        for (int64_t d = d0; d < Dh; d++)
            for (int x = 0; x < 8; x++)
                dst[d * SWARM_KB + j0 + x] = kb0 + j0 + x < c->nkeys ? KV_TO_F32(src[(kb0 + j0 + x) * c->ldkv + d]) : 0.0f;
    }
}

static void ATT(transpose_task)(const void *c_, int64_t i) {
    const ATT(attention_ctx) *c = c_;
    ATT(transpose_block)(c, i / c->nblk, i % c->nblk, c->kt + i * c->Dh * SWARM_KB);
}

/* Query rows [t0, t0 + SWARM_RB) and one head block: the online softmax over fixed key blocks. */
static void ATT(attention_task)(const void *c_, int64_t i) {
    const ATT(attention_ctx) *c = c_;
    const int64_t Dh = c->Dh, hb = i % c->nhb, t0 = (i / c->nhb) * SWARM_RB;
    const int64_t t1 = t0 + SWARM_RB < c->T ? t0 + SWARM_RB : c->T, h0 = c->h0s[hb];
    const int hr = c->hrs[hb], nr = (int)(t1 - t0);
    const int64_t g = h0 / (c->H / c->Hkv), d8 = Dh & ~(int64_t)7;
    const KV_T *vg_ = c->v + g * Dh;
    const float *ktg = c->kt ? c->kt + g * c->nblk * Dh * SWARM_KB : 0;
    float acc[SWARM_RB * 3 * Dh], m[SWARM_RB * 3], l[SWARM_RB * 3], s[3 * SWARM_KB], alpha[3];
    float *own = c->kt ? 0 : c->own + (i % c->nhb) * Dh * SWARM_KB;  /* this task's block, L1-sized */
    for (int64_t x = 0; x < nr * 3 * Dh; x++) acc[x] = 0.0f;
    for (int x = 0; x < nr * 3; x++) m[x] = -INFINITY, l[x] = 0.0f;
    const int64_t plast = c->pos0 + t1 - 1, pfirst = c->pos0 + t0;
    const int64_t lofirst = c->window > 0 && pfirst - c->window + 1 > 0 ? pfirst - c->window + 1 : 0;
    const v8 sc = v8_set1(c->scale);
    for (int64_t kb0 = lofirst / SWARM_KB * SWARM_KB; kb0 <= plast; kb0 += SWARM_KB) {
        const float *kt = own;
        if (own)
            ATT(transpose_block)(c, g, kb0 / SWARM_KB - c->b0, own);
        else
            kt = ktg + (kb0 / SWARM_KB - c->b0) * Dh * SWARM_KB;
        for (int r = 0; r < nr; r++) {
            const int64_t p = pfirst + r;
            const int64_t lo = c->window > 0 && p - c->window + 1 > 0 ? p - c->window + 1 : 0;
            if (kb0 > p || kb0 + SWARM_KB - 1 < lo) continue;
            const int64_t ja = kb0 > lo ? kb0 : lo, jb = kb0 + SWARM_KB - 1 < p ? kb0 + SWARM_KB - 1 : p;
            const int64_t nk = jb - kb0 + 1, nv = (nk + 7) / 8;
            const float *qh = c->q + (t0 + r) * c->ldq + h0 * Dh;
            for (int64_t cv = 0; cv < nv; cv += 4)
                qk_block(hr, nv - cv < 4 ? (int)(nv - cv) : 4, qh, Dh, kt + 8 * cv, s + 8 * cv);
            for (int h = 0; h < hr; h++) {
                float *sh = s + h * SWARM_KB;
                for (int64_t j = 0; j < ja - kb0; j++) sh[j] = -INFINITY;
                for (int64_t j = nk; j < SWARM_KB; j++) sh[j] = -INFINITY;
                v8 sv[SWARM_KB / 8], mx = v8_set1(-INFINITY);
                for (int b = 0; b < SWARM_KB / 8; b++) {  /* max is exact: any order gives the same */
                    sv[b] = v8_mul(v8_load(sh + 8 * b), sc);
                    mx = v8_max(mx, sv[b]);
                }
                float lanes[8], mo = m[r * 3 + h], mn = mo;
                v8_store(lanes, mx);
                for (int x = 0; x < 8; x++) mn = lanes[x] > mn ? lanes[x] : mn;
                v8_store(lanes, v8_exp(v8_set1(mo - mn)));  /* 0 for the first block */
                alpha[h] = lanes[0];
                const v8 mv = v8_set1(mn);
                v8 sum = v8_zero();
                for (int b = 0; b < SWARM_KB / 8; b++) {
                    const v8 ev = v8_exp(v8_sub(sv[b], mv));
                    v8_store(sh + 8 * b, ev);
                    sum = v8_add(sum, ev);
                }
                m[r * 3 + h] = mn;
                l[r * 3 + h] = l[r * 3 + h] * alpha[h] + v8_sum(sum);
            }
            float *o = acc + r * 3 * Dh;
            const int64_t n = jb - ja + 1;
            for (int64_t d = 0; d < d8; d += 32) {
                const int dv = d8 - d < 32 ? (int)((d8 - d) / 8) : 4;
                ATT(pv_block)(hr, dv, s + (ja - kb0), SWARM_KB, vg_ + ja * c->ldkv + d, c->ldkv, n, o + d, Dh, alpha);
            }
            for (int h = 0; h < hr; h++)
                for (int64_t d = d8; d < Dh; d++) {
                    float a = o[h * Dh + d] * alpha[h];
                    for (int64_t j = 0; j < n; j++) a = fmaf(s[h * SWARM_KB + (ja - kb0) + j], KV_TO_F32(vg_[(ja + j) * c->ldkv + d]), a);
                    o[h * Dh + d] = a;
                }
        }
    }
    for (int r = 0; r < nr; r++) {
        float *dst = c->out + ((t0 + r) * c->H + h0) * Dh;
        for (int h = 0; h < hr; h++)
            for (int64_t d = 0; d < Dh; d++) dst[h * Dh + d] = acc[(r * 3 + h) * Dh + d] / l[r * 3 + h];
    }
}

static int ATT(attention)(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const KV_T *k, const KV_T *v,
                     int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale, float *out, int threads) {
    const int64_t group = H / Hkv;
    int64_t h0s[H];
    int hrs[H], nhb = 0;
    for (int64_t h0 = 0, hr; h0 < H; h0 += hr) {
        const int64_t g = h0 / group;
        hr = 3;  /* heads of this block: at most 3, all of kv head g */
        if (h0 + hr > H) hr = H - h0;
        if ((h0 + hr - 1) / group != g) hr = (g + 1) * group - h0;
        h0s[nhb] = h0;
        hrs[nhb++] = (int)hr;
    }
    const int64_t lo0 = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    const int64_t b0 = lo0 / SWARM_KB, nblk = (pos0 + T - 1) / SWARM_KB - b0 + 1;
    /* one task per kv head (a decode step or a short chunk, heads of a kv head in one block): each task
     * transposes its keys a block at a time, in L1; else every block once, up front, for all tasks */
    const int per_task = T <= SWARM_RB && nhb == Hkv;
    const int64_t floats = per_task ? nhb * Dh * SWARM_KB : Hkv * nblk * Dh * SWARM_KB;
    float *buf = malloc((size_t)floats * sizeof(float));
    if (!buf) return -1;
    const ATT(attention_ctx) c = {q, k, v, out, per_task ? 0 : buf, T, H, Dh, ldq, Hkv, ldkv, pos0, window, nhb, b0,
                             nblk, pos0 + T, scale, per_task ? buf : 0, h0s, hrs};
    if (!per_task) swarm_parallel_for(threads, ATT(transpose_task), &c, Hkv * nblk);
    swarm_parallel_for(threads, ATT(attention_task), &c, nhb * ((T + SWARM_RB - 1) / SWARM_RB));
    free(buf);
    return 0;
}

