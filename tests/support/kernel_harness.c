/* Runs swarm's CPU kernels (swarm/kernels/fma*.c) on fixed pseudo-random inputs in one instruction set
 * and writes every output's float32 bytes to stdout, so tests/kernels/test_isa.py can compare the
 * bytes of each ISA: AVX-512, AVX2 and plain C natively, NEON under qemu-aarch64.
 *
 * usage: kernel_harness ISA_INDEX   (exit 2: this CPU does not run that ISA; 3: out of memory)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../swarm/kernels/fma_common.h"  /* the kernels' public entry points */

int swarm_use_isa(int i);

static uint32_t state = 2463534242u;

static float next(void) {  /* xorshift32, as floats in [-4, 4) with 22 random bits */
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    return (float)((int32_t)(state >> 9) - (1 << 22)) / (float)(1 << 20);
}

static float *floats(int64_t n) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!p) exit(3);
    for (int64_t i = 0; i < n; i++) p[i] = next();
    return p;
}

static uint16_t *bf16s(int64_t n) {  /* bfloat16 patterns of floats in [-4, 4) */
    uint16_t *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
    if (!p) exit(3);
    for (int64_t i = 0; i < n; i++) {
        union { float f; uint32_t u; } v = {next()};
        p[i] = (uint16_t)(v.u >> 16);
    }
    return p;
}

static uint8_t *bytes(int64_t n) {  /* random block bytes; fp16 scale fields made finite below */
    uint8_t *p = malloc((size_t)(n > 0 ? n : 1));
    if (!p) exit(3);
    for (int64_t i = 0; i < n; i++) {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        p[i] = (uint8_t)(state >> 11);
    }
    return p;
}

static void fix_half(uint8_t *p) { p[1] = (uint8_t)((p[1] & 0x83) | 0x1c); }  /* |h| in [2^-8, 2^-4) */

static void emit(const float *p, int64_t n) { fwrite(p, sizeof(float), (size_t)n, stdout); }

int main(int argc, char **argv) {
    if (argc != 2 || swarm_use_isa(atoi(argv[1])) < 0) return 2;
    /* GEMMs: decode rows, verify chunks, prefill blocks; K and N off every vector width; 1 and 3 threads */
    static const int64_t gemm[][3] = {{1, 576, 1536}, {5, 576, 577}, {37, 40, 172}, {3, 13, 7}, {64, 200, 96},
                                      {7, 17, 33}, {25, 100, 1}, {2, 8, 3}, {30, 129, 61}};
    for (size_t i = 0; i < sizeof(gemm) / sizeof(gemm[0]); i++) {
        const int64_t M = gemm[i][0], K = gemm[i][1], N = gemm[i][2];
        float *x = floats(M * K), *w = floats(N * K), *b = floats(N), *out = floats(M * N);
        uint16_t *wb = bf16s(N * K);
        swarm_linear(x, M, K, K, w, N, K, i % 2 ? b : 0, out, N, 1 + (int)(i % 3));
        emit(out, M * N);
        swarm_linear_bf16(x, M, K, K, wb, N, K, i % 2 ? 0 : b, out, N, 1 + (int)(i % 2));
        emit(out, M * N);
        free(x), free(w), free(b), free(out), free(wb);
    }
    /* the bfloat16 GEMM near float32's smallest normals: flushes (and aarch64's rerun in plain C) */
    {
        const int64_t M = 3, K = 48, N = 40;
        float *x = floats(M * K), *b = floats(N), *out = floats(M * N);
        uint16_t *wb = bf16s(N * K);
        for (int64_t i = 0; i < M * K; i++) x[i] = ldexpf(x[i], i % 2 ? -60 : 0);
        for (int64_t i = 0; i < N * K; i++) wb[i] = (uint16_t)((wb[i] & 0x807F) | ((1 + i % 6) << 7));  /* 2^-126.. */
        for (int64_t i = 0; i < N; i++) b[i] = ldexpf(b[i], -124);
        swarm_linear_bf16(x, M, K, K, wb, N, K, b, out, N, 2);
        emit(out, M * N);
        free(x), free(b), free(out), free(wb);
    }
    /* attention: T rows at pos0 over a cache; GQA groups, a sliding window, key blocks crossed */
    static const int64_t att[][6] = {{9, 9, 3, 64, 140, 0}, {1, 9, 3, 64, 300, 0}, {5, 8, 2, 16, 20, 5},
                                     {30, 4, 4, 13, 0, 0}, {70, 6, 3, 8, 60, 70}, {3, 8, 1, 40, 100, 0}};
    for (size_t i = 0; i < sizeof(att) / sizeof(att[0]); i++) {
        const int64_t T = att[i][0], H = att[i][1], Hkv = att[i][2], Dh = att[i][3], pos = att[i][4], win = att[i][5];
        const int64_t S = pos + T;
        float *q = floats(T * H * Dh), *k = floats(S * Hkv * Dh), *v = floats(S * Hkv * Dh), *out = floats(T * H * Dh);
        uint16_t *kb = bf16s(S * Hkv * Dh), *vb = bf16s(S * Hkv * Dh);
        if (swarm_attention(q, T, H, Dh, H * Dh, k, v, Hkv, Hkv * Dh, pos, win, 0.125f, out, 2)) return 3;
        emit(out, T * H * Dh);
        if (swarm_attention_bf16(q, T, H, Dh, H * Dh, kb, vb, Hkv, Hkv * Dh, pos, win, 0.125f, out, 1)) return 3;
        emit(out, T * H * Dh);
        free(q), free(k), free(v), free(out), free(kb), free(vb);
    }
    /* block formats: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, random bytes with finite scales; a decode row, a verify
     * chunk and a prefill block; x with a zero block and a NaN (rounded to 0) */
    static const int qbytes[] = {34, 18, 20, 144, 210}, qblock[] = {32, 32, 32, 256, 256};
    static const int64_t qrows[] = {1, 5, 9};
    for (int f = 0; f < 5; f++)
        for (int r = 0; r < 3; r++) {
            const int64_t M = qrows[r], K = 512, N = 38, blocks = K / qblock[f], ldw = blocks * qbytes[f];
            float *x = floats(M * K), *b = floats(N), *out = floats(M * N);
            uint8_t *w = bytes(N * ldw);
            for (int64_t n = 0; n < N; n++)
                for (int64_t j = 0; j < blocks; j++) {
                    uint8_t *blk = w + n * ldw + j * qbytes[f];
                    if (f == 4) {
                        fix_half(blk + 208);
                    } else {
                        fix_half(blk);
                        if (f == 2 || f == 3) fix_half(blk + 2);
                    }
                }
            for (int64_t i = 32; i < 64; i++) x[(M - 1) * K + i] = 0.0f;
            x[(M - 1) * K + 100] = __builtin_nanf("");
            if (swarm_qlinear(f, x, M, K, K, w, N, ldw, (f + r) % 2 ? b : 0, out, N, 1 + r % 2)) return 3;
            emit(out, M * N);
            free(x), free(b), free(out), free(w);
        }
    float *x = floats(21 * 41), *w = floats(41), *out = floats(21 * 41);
    swarm_rmsnorm(x, 21, 41, w, 1e-5f, out);
    emit(out, 21 * 41);
    for (int64_t i = 0; i < 21 * 41; i++) x[i] *= 12.0f;  /* past exp's clamps at -87 and 88 too */
    swarm_silu(x, 21 * 41, out);
    emit(out, 21 * 41);
    free(x), free(w), free(out);
    return 0;
}
