#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
int qgemm_packed_base(const uint8_t*, int, int, int, const float*, int, float*, int);
int qgemm_packed_exp(const uint8_t*, int, int, int, const float*, int, float*, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static float frand(void) { return (float)rand() / RAND_MAX; }
int main(int argc, char** argv) {
    int kind = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]), nt = argc > 4 ? atoi(argv[4]) : 1;
    int TB = kind == 0 ? 144 : kind == 1 ? 160 : 272, codes = kind == 8 ? 256 : 128;
    int nb = K / 32, tiles = (N + 7) / 8;
    uint8_t* w = aligned_alloc(64, (size_t)tiles * nb * TB);
    for (size_t i = 0; i < (size_t)tiles * nb; i++) {
        uint8_t* blk = w + i * TB;
        for (int j = 0; j < codes; j++) blk[j] = rand();
        for (int r = 0; r < 8; r++) {
            uint16_t h = _cvtss_sh(0.001f + 0.01f * frand(), 0); memcpy(blk + codes + 2 * r, &h, 2);
            if (kind == 1) { h = _cvtss_sh(-0.05f * frand(), 0); memcpy(blk + codes + 16 + 2 * r, &h, 2); }
        }
    }
    int Ms[] = {1, 2, 3, 4, 8};
    for (int mi = 0; mi < 5; mi++) {
        int M = Ms[mi];
        float* x = malloc(sizeof(float) * M * K); float* y0 = malloc(sizeof(float) * M * N); float* y1 = malloc(sizeof(float) * M * N);
        for (int i = 0; i < M * K; i++) x[i] = frand() * 2 - 1;
        qgemm_packed_base(w, kind, N, K, x, M, y0, nt); qgemm_packed_exp(w, kind, N, K, x, M, y1, nt);
        int same = memcmp(y0, y1, sizeof(float) * M * N) == 0;
        double best[2] = {1e9, 1e9};
        int reps = (int)(2e7 / ((double)N * K * (M + 1))) + 1;
        for (int round = 0; round < 15; round++)
            for (int v = 0; v < 2; v++) {
                double t = now();
                for (int r = 0; r < reps; r++) (v ? qgemm_packed_exp : qgemm_packed_base)(w, kind, N, K, x, M, v ? y1 : y0, nt);
                t = (now() - t) / reps; if (t < best[v]) best[v] = t;
            }
        double br = (double)N * nb;
        printf("kind %d %dx%d M=%d: base %7.1f us (%.2f cyc/br/row) exp %7.1f us (%.2f)  ratio %.3f %s\n", kind, N, K, M,
               best[0] * 1e6, best[0] * 2.9e9 / br / M, best[1] * 1e6, best[1] * 2.9e9 / br / M, best[1] / best[0], same ? "same" : "DIFFERENT");
        free(x); free(y0); free(y1);
    }
}
