/* Cross-ISA check of cpu_qgemm.c: deterministic inputs, one line per (variant, kind, M, K) with a
 * hash of the output bits. test_cpu_qgemm_variants.py builds it natively and for arm64 (run under
 * qemu-user) and compares the lines: every variant must print the same hashes. The inputs are made
 * here (an LCG), so both builds see the same bytes whatever the host.
 * Usage: qgemm_check [dump]  (dump: also print every output value's bits for the first case)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int qgemm(const uint8_t*, int, int, int, const float*, int, float*, int);
int qgemm_select(int);
int qgemm_supported(int);
const char* qgemm_variant_name(int);

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(state >> 33);
}

/* a finite fp16 with |v| in about [2^-9, 2^-1] */
static void put_f16(uint8_t* p) {
    const uint16_t h = (uint16_t)(((next() & 1) << 15) | ((6 + next() % 8) << 10) | (next() & 0x3FF));
    memcpy(p, &h, 2);
}

static void fill_weights(int kind, uint8_t* w, int N, int K) {
    const int values = kind == 4 ? 256 : 32, bytes = kind == 0 ? 18 : kind == 1 ? 20 : kind == 8 ? 34 : 144;
    const int nblk = N * (K / values);
    for (int b = 0; b < nblk; b++) {
        uint8_t* p = w + (size_t)b * bytes;
        for (int i = 0; i < bytes; i++) p[i] = (uint8_t)next();
        put_f16(p);
        if (kind == 1 || kind == 4) put_f16(p + 2);
    }
}

static void fill_x(float* x, int M, int K) {
    for (int i = 0; i < M * K; i++) x[i] = ((float)(int)(next() % 2001) - 1000.0f) / 250.0f;
    if (M > 1) memset(x + K, 0, sizeof(float) * 32);   /* an all-zero block */
    if (M > 2) x[2 * K + 5] = 1000.0f;                  /* an outlier */
}

static uint64_t hash(const float* y, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, y + i, 4);
        for (int j = 0; j < 4; j++) h = (h ^ ((u >> (8 * j)) & 0xFF)) * 1099511628211ull;
    }
    return h;
}

int main(int argc, char** argv) {
    const int dump = argc > 1 && !strcmp(argv[1], "dump");
    const int kinds[4] = {0, 1, 8, 4};
    const int Ms[6] = {1, 2, 3, 8, 16, 37};
    const int N = 24;
    for (int v = 0; v < 5; v++) {
        if (!qgemm_supported(v) || qgemm_select(v)) continue;
        for (int ki = 0; ki < 4; ki++) {
            const int kind = kinds[ki];
            const int Ks[2] = {kind == 4 ? 256 : 96, kind == 4 ? 768 : 576};
            for (int kk = 0; kk < 2; kk++) {
                const int K = Ks[kk];
                for (int mi = 0; mi < 6; mi++) {
                    const int M = Ms[mi];
                    state = 0x9E3779B97F4A7C15ull + 1000003ull * (uint64_t)(kind * 7 + K + M);
                    uint8_t* w = malloc((size_t)N * K * 2);
                    float* x = malloc(sizeof(float) * M * K);
                    float* y = malloc(sizeof(float) * M * N);
                    fill_weights(kind, w, N, K);
                    fill_x(x, M, K);
                    const int rc = qgemm(w, kind, N, K, x, M, y, 2);
                    printf("%s kind=%d K=%d M=%d rc=%d hash=%016llx\n", qgemm_variant_name(v), kind, K, M, rc,
                           (unsigned long long)hash(y, M * N));
                    if (dump && ki == 0 && kk == 0 && mi == 0)
                        for (int i = 0; i < M * N; i++) printf("  y[%d]=%.9g\n", i, y[i]);
                    free(w); free(x); free(y);
                }
            }
        }
    }
    return 0;
}
