/* swarm's one CPU arithmetic: batch-invariant float32 GEMM, attention, RMSNorm and SiLU whose bits
 * are defined here, independently of the vector unit that computes them.
 *
 * Every output element is one fixed function of its own inputs, whatever else is computed in the
 * same call: how many rows (a decode row, a verify chunk, a prefill slice, packed sessions), where
 * the row sits, how the loops are blocked, how many threads share the work, and which instruction
 * set runs it. That is the batch invariance of Thinking Machines' kernels (He et al., "Defeating
 * Nondeterminism in LLM Inference", 2025) by construction on a CPU, where a BLAS gives a 1-row GEMM
 * (its GEMV path) other bits than the same row in a larger GEMM, and MKL's AVX-512 path other bits
 * than its AVX2 path.
 *
 * The arithmetic (SWARM_ARITHMETIC; IEEE float32, fused multiply-add where written, nothing else
 * reassociated: compiled with -ffp-contract=off and never with -ffast-math):
 *   dot(a, b, K): 8 lanes, lane l accumulates k = 8i + l by an FMA chain in i order from +0; then
 *     ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); then the K % 8 tail in k order by fmaf.
 *   dotseq(a, b, K): one FMA chain over k in k order from +0 (attention's scores, 8 keys per vector).
 *   exp(x): Cephes' expf (range reduction by ln 2 in two FMA steps, a degree-5 polynomial by FMA,
 *     the exponent built in integers), 0 below -87.
 *   linear: out[m, n] = dot(x[m], w[n], K) (+ bias[n]). With bfloat16 weights the GEMM is
 *     SWARM_BF16_ARITHMETIC instead (fma_bf16.h): x rounded to bfloat16, pairs of products by FMA in
 *     lanes of 16 along K, flush to zero: the bits of AVX512-BF16's vdpbf16ps. A bfloat16 cache enters
 *     attention widened to float32 (exact).
 *   attention, per query row at absolute position p and head h (kv head h / (H / Hkv)), over its
 *     own keys j in [lo, p] (lo = p - window + 1 with a sliding window, else 0): the online softmax
 *     over key blocks at fixed positions (multiples of 64), as swarm_attention states.
 *   rmsnorm: r = 1 / sqrt(dot(x, x, D) / D + eps); out[d] = w[d] * (x[d] * r).
 *   silu: x / (1 + exp(-x)).
 * Implementations (fma_kernels.h): AVX-512F + BW (fma_avx512.c: dot's 8 lanes of two columns side by side
 * in one zmm register), AVX2 + FMA (fma_avx2.c: one column per ymm register), NEON (fma_neon.c,
 * aarch64: the 8 lanes in two q registers), and plain C one lane at a time (fma_generic.c: the
 * reference, on any CPU). One library holds every implementation its architecture
 * has; swarm_use_isa picks one (the best the CPU runs, by default). They give the same bits: lanes
 * never cross inside a sum, and every sum across lanes is dot's tree. These are the bits of swarm's
 * AVX2-only fma.c before the ISAs were split (2026-12-06), so earlier receipts still re-run.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fma_common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define SWARM_ARITHMETIC "swarm-f32-1: dot8 fma lanes, pairwise tree; attention key blocks of 64; cephes exp"
/* the bfloat16 GEMM's (fma_bf16.h) */
#define SWARM_BF16_ARITHMETIC "swarm-bf16dot-1: x rounded to bfloat16, 8 lanes of pairs by fma odd then even, flush to zero, pairwise tree"
/* the block formats' (qblocks_kernels.h) */
#define QBLOCKS_ARITHMETIC "swarm-q16dot-1: x in 16-bit blocks of 32 (float32 scale, half-even), integer pair sums, fma lanes, pairwise tree"
#ifndef SWARM_SOURCE_DIGEST
#define SWARM_SOURCE_DIGEST ""  /* setup.py passes the digest of the sources it built from */
#endif

/* ---- A small pool of worker threads (POSIX threads), so a stage's --threads reach these kernels.
 * Work is cut into tasks whose outputs do not overlap (columns of a GEMM, query rows and heads of
 * attention), and every output element is computed by the same code whichever thread takes its
 * task, so the number of threads never changes a bit. One dispatch at a time: a caller that finds
 * the pool busy (another thread of the process is in a kernel) runs its tasks itself. The caller takes
 * tasks too and waits only for workers that joined before it ran out of tasks: a worker the OS has not
 * scheduled yet (another process on the core) finds the dispatch closed and skips it, so a busy core
 * slows a call by the tasks it ran, never by a wake-up. */
#define SWARM_MAX_THREADS 64
#define SWARM_SPIN 4000  /* pause loops a worker spins on before it sleeps (~50-150 us): decode steps come fast */


static struct {
    pthread_mutex_t mu, busy;
    pthread_cond_t go, done;
    int workers;                    /* threads started (besides the caller) */
    unsigned long seen0[SWARM_MAX_THREADS];
    atomic_ulong gen;               /* bumped once per dispatch */
    atomic_llong next;              /* the next task index to take */
    atomic_int running;             /* workers inside a dispatch (joined, not yet left) */
    atomic_ulong closed;            /* the last dispatch whose caller ran out of tasks: late workers skip it */
    swarm_task_fn fn;
    const void *ctx;
    int64_t ntasks;
    int want;                       /* workers 1..want take part in this dispatch */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER, .go = PTHREAD_COND_INITIALIZER,
           .done = PTHREAD_COND_INITIALIZER};

static void run_tasks(swarm_task_fn fn, const void *ctx, int64_t ntasks) {
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
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.go, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        if (id > pool.want) continue;
        atomic_fetch_add(&pool.running, 1);
        /* joined: the caller now waits for this worker, unless the dispatch closed or a newer one began */
        if (atomic_load(&pool.gen) == g && atomic_load(&pool.closed) != g) run_tasks(pool.fn, pool.ctx, pool.ntasks);
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

void swarm_parallel_for(int threads, swarm_task_fn fn, const void *ctx, int64_t ntasks) {
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
    const unsigned long g = atomic_fetch_add(&pool.gen, 1) + 1;
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    run_tasks(fn, ctx, ntasks);
    atomic_store(&pool.closed, g);  /* every task taken: wait only for workers already inside */
    for (int spins = 0; atomic_load(&pool.running) != 0 && spins < SWARM_SPIN; spins++) cpu_relax();
    pthread_mutex_lock(&pool.mu);
    while (atomic_load(&pool.running) != 0) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
}

/* ---- The instruction sets this library holds, best first, and the one in use. */
#if defined(__x86_64__) || defined(_M_X64)
extern __attribute__((visibility("hidden"))) const swarm_isa swarm_isa_avx512, swarm_isa_avx2, swarm_isa_generic;
static const swarm_isa *const isas[] = {&swarm_isa_avx512, &swarm_isa_avx2, &swarm_isa_generic};
static int isa_supported(int i) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (i == 0) return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (i == 1) return avx2;
    return 1;
}
#elif defined(__aarch64__)
extern __attribute__((visibility("hidden"))) const swarm_isa swarm_isa_neon, swarm_isa_generic;
static const swarm_isa *const isas[] = {&swarm_isa_neon, &swarm_isa_generic};
static int isa_supported(int i) { (void)i; return 1; }
#else
extern __attribute__((visibility("hidden"))) const swarm_isa swarm_isa_generic;
static const swarm_isa *const isas[] = {&swarm_isa_generic};
static int isa_supported(int i) { (void)i; return 1; }
#endif
#define N_ISAS ((int)(sizeof(isas) / sizeof(isas[0])))

static const swarm_isa *isa;  /* the one in use: swarm_use_isa, else the best supported */

int swarm_isa_count(void) { return N_ISAS; }
const char *swarm_isa_name(int i) { return i >= 0 && i < swarm_isa_count() ? isas[i]->name : ""; }
int swarm_isa_supported(int i) { return i >= 0 && i < swarm_isa_count() && isa_supported(i); }
const char *swarm_arithmetic(void) { return SWARM_ARITHMETIC; }
const char *swarm_qblocks_arithmetic(void) { return QBLOCKS_ARITHMETIC; }
const char *swarm_bf16_arithmetic(void) { return SWARM_BF16_ARITHMETIC; }

static const swarm_isa *current(void);
/* 1: the bfloat16 GEMM runs AVX512-BF16's vdpbf16ps now (else FMAs on the widened halves: the same bits) */
int swarm_bf16_dot_instruction(void) {
#if defined(__x86_64__) || defined(_M_X64)
    extern __attribute__((visibility("hidden"))) int swarm_avx512_bf16_dp(void);
    return current() == &swarm_isa_avx512 && swarm_avx512_bf16_dp();
#else
    return 0;
#endif
}
const char *swarm_source_digest(void) { return SWARM_SOURCE_DIGEST; }

/* Use ISA i from now on (-1: the best this CPU runs). Returns the index in use, or -1 when i is not
 * supported here (or no ISA is), leaving the choice as it was. */
int swarm_use_isa(int i) {
    if (i < 0)
        for (i = 0; i < swarm_isa_count() && !isa_supported(i); i++) {}
    if (!swarm_isa_supported(i)) return -1;
    isa = isas[i];
    return i;
}

static const swarm_isa *current(void) {
    if (!isa) swarm_use_isa(-1);
    return isa;
}

const char *swarm_isa_in_use(void) { return current()->name; }

/* out (M, N), row stride ldo = x (M, K), row stride ldx, times w (N, K) transposed, row stride ldw (an
 * nn.Linear weight as stored), plus bias (N) or NULL; on up to `threads` threads. */
void swarm_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N, int64_t ldw,
                  const float *bias, float *out, int64_t ldo, int threads) {
    const swarm_isa *i = current();
    (M == 1 && i->one_row ? i->one_row : i)->linear(x, M, K, ldx, w, N, ldw, bias, out, ldo, threads);
}

/* out (M, N) = x (M, K) times w (N, K) in bfloat16 (raw 16-bit patterns) transposed, + bias (N) or NULL, in
 * SWARM_BF16_ARITHMETIC (fma_bf16.h states it): x rounded to bfloat16, products of pairs by FMA with x86's
 * flush to zero, the bits of vdpbf16ps. Returns 0, or -2 when out of memory (out untouched). */
int swarm_linear_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N, int64_t ldw,
                      const float *bias, float *out, int64_t ldo, int threads) {
    const swarm_isa *i = current();  /* one row: AVX2's FMAs stream w faster than vdpbf16ps's row pairs */
    return (M == 1 && i->one_row ? i->one_row : i)->linear_bf16(x, M, K, ldx, w, N, ldw, bias, out, ldo, threads);
}

/* Causal attention of T query rows at positions [pos0, pos0 + T) against one session's cache, on up
 * to `threads` threads (tasks of 8 query rows and one block of at most 3 heads of a kv head).
 *   q: (T, H, Dh), token stride ldq (floats), heads contiguous; k, v: position-major caches,
 *   key j of kv head g at k + j * ldkv + g * Dh (likewise v), holding at least pos0 + T positions;
 *   window: sliding window in positions (0: none); out: (T, H, Dh) contiguous.
 * Returns 0, or -1 when it cannot allocate its buffer of transposed keys (out is then untouched).
 * Each row p runs the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022)
 * over the key blocks [64b, 64(b + 1)) that meet its keys [lo, p], in ascending b, each block's keys
 * cut to [lo, p]:
 *   s_j = dotseq(q, k_j) * scale; m' = max(m, max_j s_j) (m starts at -inf); alpha = exp(m - m');
 *   e_j = exp(s_j - m'); l = l * alpha + sum8(e) (8 lanes by j % 8 summed across the block's eight
 *   vectors in order, then dot's tree); o[d] = o[d] * alpha, then an FMA chain of e_j * v_j[d]
 *   in j order; at the end out = o / l.
 * The blocks sit at fixed positions and only the row's own data enter, so a decode step and the same
 * row in any chunk agree bit for bit, while a task's rows share each key block in L1. */
int swarm_attention(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const float *k, const float *v,
                    int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale, float *out, int threads) {
    return current()->attention(q, T, H, Dh, ldq, k, v, Hkv, ldkv, pos0, window, scale, out, threads);
}

/* swarm_attention over a bfloat16 cache (raw 16-bit patterns, widened exactly): the bits of swarm_attention
 * on the widened cache. */
int swarm_attention_bf16(const float *q, int64_t T, int64_t H, int64_t Dh, int64_t ldq, const uint16_t *k,
                         const uint16_t *v, int64_t Hkv, int64_t ldkv, int64_t pos0, int64_t window, float scale,
                         float *out, int threads) {
    return current()->attention_bf16(q, T, H, Dh, ldq, k, v, Hkv, ldkv, pos0, window, scale, out, threads);
}

/* out (M, N), row stride ldo = x (M, K) times w (N rows of ldw bytes, each the blocks of one weight row in
 * llama.cpp's block format fmt: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K) transposed, + bias (N) or NULL, in
 * QBLOCKS_ARITHMETIC (qblocks_kernels.h states it): x's rows rounded to 16-bit integers per block of 32,
 * exact integer dot products per block, float32 sums in a fixed order. Returns 0, -1 for an unknown format
 * or a K the format cannot hold, -2 when out of memory (out untouched). */
int swarm_qlinear(int fmt, const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t N,
                  int64_t ldw, const float *bias, float *out, int64_t ldo, int threads) {
    const swarm_qpart part = {fmt, w, N, ldw, bias, out, ldo};
    return swarm_qlinear_many(&part, 1, x, M, K, ldx, threads);
}

/* swarm_qlinear for up to SWARM_QPARTS_MAX weights over the same x (a layer's q, k and v; gate and up): each
 * part's out bit for bit what swarm_qlinear gives it, with x quantized once and one dispatch over all the
 * parts' columns. Returns 0, -1 (a part's format or K, or nparts out of range), -2 (out of memory). */
int swarm_qlinear_many(const swarm_qpart *parts, int nparts, const float *x, int64_t M, int64_t K, int64_t ldx,
                       int threads) {
    const swarm_isa *i = current();
    /* one row in the 32-weight formats: AVX-512's column pairs cost no shuffle there (q_pair32) */
    int own = 0;
    for (int p = 0; p < nparts; p++) own |= parts[p].fmt <= 2;
    return (M == 1 && i->one_row && !own ? i->one_row : i)->qlinear_many(parts, nparts, x, M, K, ldx, threads);
}

void swarm_rmsnorm(const float *x, int64_t N, int64_t D, const float *w, float eps, float *out) {
    current()->rmsnorm(x, N, D, w, eps, out);
}

void swarm_silu(const float *x, int64_t n, float *out) { current()->silu(x, n, out); }
