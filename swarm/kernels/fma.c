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
 *   dotseq(a, b, K): one FMA chain over k in k order from +0 (attention's scores, 8 keys per vector).
 *   linear: out[m, n] = dot(x[m], w[n], K) (+ bias[n]).
 *   attention, per query row at absolute position p and head h (kv head h / (H / Hkv)), over its
 *     own keys j in [lo, p] (lo = p - window + 1 with a sliding window, else 0): the online softmax
 *     over key blocks at fixed positions (multiples of SWARM_KB), as swarm_attention states.
 * Only the row's own data enter, so a decode step and the same row in any chunk agree bit for bit.
 * The same code runs on Intel and AMD: these are IEEE operations, no vendor library decides.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef SWARM_MB
#define SWARM_MB 24
#endif
/* A block of at most this many rows (a verify chunk of K + 1 <= 6, a short prefill tail) is one tile:
 * each 4 rows of w are read once for all its rows, not once per 3 (measured 2026-12-03, AMD EPYC, 1
 * thread, SmolLM2's GEMMs: 5 rows 24.2 ms vs 26.9 ms as 3 + 2, one row 20 ms; the accumulators spill
 * past 16 registers and are still cheaper than a second pass over w). */
#define SWARM_MR_SMALL 6
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
                 int64_t K, float *out, int64_t ldo, const float *bias, const float *pf) {
    __m256 acc[SWARM_MR_SMALL][4];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 xv[SWARM_MR_SMALL];
        for (int r = 0; r < MR; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
        if (pf && (k & 15) == 0)  /* the next rows of w, a cache line each, while these compute */
            for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(pf + c * ldw + k), _MM_HINT_T0);
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
                      float *out, int64_t ldo, const float *bias, const float *pf) {
#define CASE(R, C) case R * 8 + C: dot_tile(R, C, x, ldx, w, ldw, K, out, ldo, bias, pf); break;
    switch (mr * 8 + nr) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
        CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
        CASE(5, 1) CASE(5, 2) CASE(5, 3) CASE(5, 4)
        CASE(6, 1) CASE(6, 2) CASE(6, 3) CASE(6, 4)
    }
#undef CASE
}

/* ---- A small pool of worker threads (POSIX threads), so a stage's --threads reach these kernels.
 * Work is cut into tasks whose outputs do not overlap (columns of a GEMM, query rows and heads of
 * attention), and every output element is computed by the same code whichever thread takes its
 * task, so the number of threads never changes a bit. One dispatch at a time: a caller that finds
 * the pool busy (another thread of the process is in a kernel) runs its tasks itself. */
#define SWARM_MAX_THREADS 64
#define SWARM_SPIN 4000  /* pause loops a worker spins on before it sleeps (~50-150 us): decode steps come fast */

typedef void (*task_fn)(const void *ctx, int64_t i);

static struct {
    pthread_mutex_t mu, busy;
    pthread_cond_t go, done;
    int workers;                    /* threads started (besides the caller) */
    unsigned long seen0[SWARM_MAX_THREADS];
    atomic_ulong gen;               /* bumped once per dispatch */
    atomic_llong next;              /* the next task index to take */
    atomic_int running;             /* workers of this dispatch still busy */
    task_fn fn;
    const void *ctx;
    int64_t ntasks;
    int want;                       /* workers 1..want take part in this dispatch */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER, .go = PTHREAD_COND_INITIALIZER,
           .done = PTHREAD_COND_INITIALIZER};

static void run_tasks(task_fn fn, const void *ctx, int64_t ntasks) {
    for (int64_t i; (i = atomic_fetch_add(&pool.next, 1)) < ntasks;) fn(ctx, i);
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    unsigned long seen = pool.seen0[id];
    for (;;) {
        unsigned long g;
        int spins = 0;
        while ((g = atomic_load(&pool.gen)) == seen) {
            if (++spins < SWARM_SPIN) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.go, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        if (id > pool.want) continue;
        run_tasks(pool.fn, pool.ctx, pool.ntasks);
        if (atomic_fetch_sub(&pool.running, 1) == 1) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return 0;
}

static void pool_after_fork(void) {  /* a forked child has none of the parent's threads */
    pthread_mutex_init(&pool.mu, 0);
    pthread_mutex_init(&pool.busy, 0);
    pthread_cond_init(&pool.go, 0);
    pthread_cond_init(&pool.done, 0);
    pool.workers = 0;
}

/* Run fn(ctx, i) for i < ntasks on up to `threads` threads (the caller being one of them). */
static void parallel_for(int threads, task_fn fn, const void *ctx, int64_t ntasks) {
    if (threads > SWARM_MAX_THREADS) threads = SWARM_MAX_THREADS;
    if (threads > ntasks) threads = (int)ntasks;
    if (threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t i = 0; i < ntasks; i++) fn(ctx, i);
        return;
    }
    static int atfork = 0;
    if (!atfork) atfork = pthread_atfork(0, 0, pool_after_fork) == 0;
    pthread_mutex_lock(&pool.mu);
    while (pool.workers < threads - 1) {
        const int id = pool.workers + 1;
        pthread_t th;
        pool.seen0[id] = atomic_load(&pool.gen);
        if (pthread_create(&th, 0, worker_main, (void *)(intptr_t)id) != 0) break;
        pthread_detach(th);
        pool.workers = id;
    }
    const int want = pool.workers < threads - 1 ? pool.workers : threads - 1;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.ntasks = ntasks;
    pool.want = want;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.running, want);
    atomic_fetch_add(&pool.gen, 1);
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    run_tasks(fn, ctx, ntasks);
    for (int spins = 0; atomic_load(&pool.running) != 0 && spins < SWARM_SPIN; spins++) _mm_pause();
    pthread_mutex_lock(&pool.mu);
    while (atomic_load(&pool.running) != 0) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
}

/* Columns [n0, n1) of out: blocked so that nb rows of w stay in L2 while blocks of SWARM_MB rows of
 * x pass, each 4 rows of w meeting all rows of the block while they are in L1 (measured on the AMD
 * EPYC: 3x4 tiles beat 4x2, 5x2 and 6x2; SWARM_MB 24 beat 12 and unblocked rows for a 256-row
 * prefill slice). The blocking changes the order of work, never of any sum. */
static void linear_cols(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t n0, int64_t n1,
                        int64_t ldw, const float *bias, float *out, int64_t ldo) {
    const int64_t mb = SWARM_MB;
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t m1 = m0 + mb < M ? m0 + mb : M;
        const int64_t mt = m1 - m0 <= SWARM_MR_SMALL ? m1 - m0 : 3;  /* rows per tile */
        for (int64_t n = n0; n < n1; n += 4) {
            const int nr = n1 - n < 4 ? (int)(n1 - n) : 4;
            for (int64_t m = m0; m < m1; m += mt) {
                const int mr = m1 - m < mt ? (int)(m1 - m) : (int)mt;
                const float *pf = m == m0 && n + 4 + 4 * 2 <= n1 ? w + (n + 4 * 2) * ldw : 0;
                dot_block(mr, nr, x + m * ldx, ldx, w + n * ldw, ldw, K, out + m * ldo + n, ldo, bias ? bias + n : 0, pf);
            }
        }
    }
}

typedef struct {
    const float *x, *w, *bias;
    float *out;
    int64_t M, K, ldx, N, ldw, ldo, nb;
} linear_ctx;

static void linear_task(const void *c_, int64_t i) {
    const linear_ctx *c = c_;
    const int64_t n0 = i * c->nb, n1 = n0 + c->nb < c->N ? n0 + c->nb : c->N;
    linear_cols(c->x, c->M, c->K, c->ldx, c->w, n0, n1, c->ldw, c->bias, c->out, c->ldo);
}

/* out (M, N), row stride ldo = x (M, K), row stride ldx, times w (N, K) transposed, row stride ldw
 * (an nn.Linear weight as stored), plus bias (N) or NULL; on up to `threads` threads, each taking
 * blocks of nb columns. */
void swarm_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N, int64_t ldw,
                  const float *bias, float *out, int64_t ldo, int threads) {
    int64_t nb = (int64_t)(196608 / (K * 4 > 0 ? K * 4 : 1)) & ~(int64_t)3;
    if (nb < 4) nb = 4;
    const linear_ctx c = {x, w, bias, out, M, K, ldx, N, ldw, ldo, nb};
    parallel_for(threads, linear_task, &c, (N + nb - 1) / nb);
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

/* o[h][d] = o[h][d] * alpha[h], then an FMA chain over j of e[h][j] * v_j[d] in j order, for HR
 * heads and DV vectors of 8 dims. */
AI void pv_tile(const int HR, const int DV, const float *e, int64_t lde, const float *v, int64_t ldv,
                int64_t n, float *o, int64_t ldo, const float *alpha) {
    __m256 acc[3][4];
    for (int h = 0; h < HR; h++) {
        const __m256 a = _mm256_set1_ps(alpha[h]);
        for (int c = 0; c < DV; c++) acc[h][c] = _mm256_mul_ps(_mm256_loadu_ps(o + h * ldo + 8 * c), a);
    }
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
                     float *o, int64_t ldo, const float *alpha) {
#define CASE(R, C) case R * 8 + C: pv_tile(R, C, e, lde, v, ldv, n, o, ldo, alpha); break;
    switch (hr * 8 + dv) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
        CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
        CASE(5, 1) CASE(5, 2) CASE(5, 3) CASE(5, 4)
        CASE(6, 1) CASE(6, 2) CASE(6, 3) CASE(6, 4)
    }
#undef CASE
}

#define SWARM_KB 64  /* keys per block: fixes the arithmetic (the blocks sit at multiples of it) */
#define SWARM_RB 8   /* query rows per task: order of work only */

/* s[h][8c + i] = dotseq(q_h, key 8c + i) for HR heads and CV vectors of 8 keys, from kt: one key
 * block transposed, kt[d * SWARM_KB + j] = k_j[d]. dotseq is one FMA chain over d in d order from +0. */
AI void qk_tile(const int HR, const int CV, const float *q, int64_t Dh, const float *kt, float *s) {
    __m256 acc[3][4];
    for (int h = 0; h < HR; h++)
        for (int c = 0; c < CV; c++) acc[h][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < Dh; d++) {
        __m256 kv[4];
        for (int c = 0; c < CV; c++) kv[c] = _mm256_loadu_ps(kt + d * SWARM_KB + 8 * c);
        for (int h = 0; h < HR; h++) {
            const __m256 qv = _mm256_broadcast_ss(q + h * Dh + d);
            for (int c = 0; c < CV; c++) acc[h][c] = _mm256_fmadd_ps(qv, kv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HR; h++)
        for (int c = 0; c < CV; c++) _mm256_storeu_ps(s + h * SWARM_KB + 8 * c, acc[h][c]);
}

static void qk_block(int hr, int cv, const float *q, int64_t Dh, const float *kt, float *s) {
#define CASE(R, C) case R * 8 + C: qk_tile(R, C, q, Dh, kt, s); break;
    switch (hr * 8 + cv) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
        CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
        CASE(5, 1) CASE(5, 2) CASE(5, 3) CASE(5, 4)
        CASE(6, 1) CASE(6, 2) CASE(6, 3) CASE(6, 4)
    }
#undef CASE
}

typedef struct {
    const float *q, *k, *v;
    float *out, *kt;     /* kt: the call's key blocks transposed, (Hkv, nblk, Dh, SWARM_KB) */
    int64_t T, H, Dh, ldq, Hkv, ldkv, pos0, window, nhb, b0, nblk, nkeys;
    float scale;
    const int64_t *h0s;  /* head blocks: first head and count, at most 3 heads of one kv head */
    const int *hrs;
} attention_ctx;

/* Key block b0 + (i % nblk) of kv head i / nblk, transposed into kt; keys past nkeys are +0. */
static void transpose_task(const void *c_, int64_t i) {
    const attention_ctx *c = c_;
    const int64_t g = i / c->nblk, kb0 = (c->b0 + i % c->nblk) * SWARM_KB, Dh = c->Dh;
    const float *src = c->k + g * Dh;
    float *dst = c->kt + i * Dh * SWARM_KB;
    const int64_t d8 = Dh & ~(int64_t)7;
    for (int64_t j0 = 0; j0 < SWARM_KB; j0 += 8) {
        if (kb0 + j0 + 8 <= c->nkeys) {
            for (int64_t d0 = 0; d0 < d8; d0 += 8) {  /* an 8 x 8 transpose in registers */
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
            for (int64_t d = d8; d < Dh; d++)
                for (int x = 0; x < 8; x++) dst[d * SWARM_KB + j0 + x] = src[(kb0 + j0 + x) * c->ldkv + d];
        } else {
            for (int64_t d = 0; d < Dh; d++)
                for (int x = 0; x < 8; x++)
                    dst[d * SWARM_KB + j0 + x] = kb0 + j0 + x < c->nkeys ? src[(kb0 + j0 + x) * c->ldkv + d] : 0.0f;
        }
    }
}

/* Query rows [t0, t0 + SWARM_RB) and one head block: the online softmax over fixed key blocks. */
static void attention_task(const void *c_, int64_t i) {
    const attention_ctx *c = c_;
    const int64_t Dh = c->Dh, hb = i % c->nhb, t0 = (i / c->nhb) * SWARM_RB;
    const int64_t t1 = t0 + SWARM_RB < c->T ? t0 + SWARM_RB : c->T, h0 = c->h0s[hb];
    const int hr = c->hrs[hb], nr = (int)(t1 - t0);
    const int64_t g = h0 / (c->H / c->Hkv), d8 = Dh & ~(int64_t)7;
    const float *vg = c->v + g * Dh, *ktg = c->kt + g * c->nblk * Dh * SWARM_KB;
    float acc[SWARM_RB * 3 * Dh], m[SWARM_RB * 3], l[SWARM_RB * 3], s[3 * SWARM_KB], alpha[3];
    for (int64_t x = 0; x < nr * 3 * Dh; x++) acc[x] = 0.0f;
    for (int x = 0; x < nr * 3; x++) m[x] = -INFINITY, l[x] = 0.0f;
    const int64_t plast = c->pos0 + t1 - 1, pfirst = c->pos0 + t0;
    const int64_t lofirst = c->window > 0 && pfirst - c->window + 1 > 0 ? pfirst - c->window + 1 : 0;
    const __m256 sc = _mm256_set1_ps(c->scale);
    for (int64_t kb0 = lofirst / SWARM_KB * SWARM_KB; kb0 <= plast; kb0 += SWARM_KB) {
        const float *kt = ktg + (kb0 / SWARM_KB - c->b0) * Dh * SWARM_KB;
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
                __m256 sv[SWARM_KB / 8], mx = _mm256_set1_ps(-INFINITY);
                for (int b = 0; b < SWARM_KB / 8; b++) {  /* max is exact: any order gives the same */
                    sv[b] = _mm256_mul_ps(_mm256_loadu_ps(sh + 8 * b), sc);
                    mx = _mm256_max_ps(mx, sv[b]);
                }
                float lanes[8], mo = m[r * 3 + h], mn = mo;
                _mm256_storeu_ps(lanes, mx);
                for (int x = 0; x < 8; x++) mn = lanes[x] > mn ? lanes[x] : mn;
                _mm256_storeu_ps(lanes, exp8(_mm256_set1_ps(mo - mn)));  /* 0 for the first block */
                alpha[h] = lanes[0];
                const __m256 mv = _mm256_set1_ps(mn);
                __m256 sum = _mm256_setzero_ps();
                for (int b = 0; b < SWARM_KB / 8; b++) {
                    const __m256 ev = exp8(_mm256_sub_ps(sv[b], mv));
                    _mm256_storeu_ps(sh + 8 * b, ev);
                    sum = _mm256_add_ps(sum, ev);
                }
                m[r * 3 + h] = mn;
                l[r * 3 + h] = l[r * 3 + h] * alpha[h] + hsum8(sum);
            }
            float *o = acc + r * 3 * Dh;
            const int64_t n = jb - ja + 1;
            for (int64_t d = 0; d < d8; d += 32) {
                const int dv = d8 - d < 32 ? (int)((d8 - d) / 8) : 4;
                pv_block(hr, dv, s + (ja - kb0), SWARM_KB, vg + ja * c->ldkv + d, c->ldkv, n, o + d, Dh, alpha);
            }
            for (int h = 0; h < hr; h++)
                for (int64_t d = d8; d < Dh; d++) {
                    float a = o[h * Dh + d] * alpha[h];
                    for (int64_t j = 0; j < n; j++) a = fmaf(s[h * SWARM_KB + (ja - kb0) + j], vg[(ja + j) * c->ldkv + d], a);
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

/* Causal attention of T query rows at positions [pos0, pos0 + T) against one session's cache, on up
 * to `threads` threads (tasks of SWARM_RB query rows and one block of at most 3 heads of a kv head).
 *   q: (T, H, Dh), token stride ldq (floats), heads contiguous; k, v: position-major caches,
 *   key j of kv head g at k + j * ldkv + g * Dh (likewise v), holding at least pos0 + T positions;
 *   window: sliding window in positions (0: none); out: (T, H, Dh) contiguous.
 * Returns 0, or -1 when it cannot allocate its buffer of transposed keys (out is then untouched).
 * Each row p runs the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022)
 * over the key blocks [b * SWARM_KB, (b + 1) * SWARM_KB) that meet its keys [lo, p], in ascending b,
 * each block's keys cut to [lo, p]:
 *   s_j = dotseq(q, k_j) * scale (one FMA chain over d in order from +0); m' = max(m, max_j s_j)
 *   (m starts at -inf); alpha = exp8(m - m'); e_j = exp8(s_j - m'); l = l * alpha + sum8(e) (8 lanes
 *   by j % 8 summed across the block's vectors in order, then the pairwise finish); o[d] = o[d] *
 *   alpha, then an FMA chain of e_j * v_j[d] in j order; at the end out = o / l.
 * The blocks sit at fixed positions and only the row's own data enter, so a decode step and the same
 * row in any chunk agree bit for bit, while a task's rows share each key block in L1. */
int swarm_attention(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const float *k,
                    const float *v, int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale,
                    float *out, int threads) {
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
    float *kt = malloc((size_t)(Hkv * nblk * Dh * SWARM_KB) * sizeof(float));
    if (!kt) return -1;
    const attention_ctx c = {q, k, v, out, kt, T, H, Dh, ldq, Hkv, ldkv, pos0, window, nhb, b0, nblk,
                             pos0 + T, scale, h0s, hrs};
    parallel_for(threads, transpose_task, &c, Hkv * nblk);
    parallel_for(threads, attention_task, &c, nhb * ((T + SWARM_RB - 1) / SWARM_RB));
    free(kt);
    return 0;
}

/* RMSNorm of N rows of D (Zhang & Sennrich 2019, as transformers' Llama-family modules compute it):
 *   r = 1 / sqrt(dot(x, x, D) / D + eps) (IEEE sqrt and divisions); out[d] = w[d] * (x[d] * r).
 * Each row alone, so its bits never depend on N or on the rows beside it. */
void swarm_rmsnorm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *out) {
    for (int64_t i = 0; i < N; i++) {
        const float *xi = x + i * D;
        float ss;
        dot_tile(1, 1, xi, D, xi, D, D, &ss, 1, 0, 0);
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
