/* GEMV / skinny GEMM straight on raw GGUF block rows, for CPU decode (M = 1..8 tokens).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] where W is stored exactly as in the GGUF file:
 * uint8 rows [N, K / block_values * block_bytes] (rows may come from several tensors,
 * concatenated: every row is independent). Activations and accumulation are fp32;
 * x is never quantized, so the only difference from fp32 reference math is the order
 * of the additions.
 *
 * Per block of 32 weights the codes are widened to int32 -> fp32 and FMA'd with x;
 * the block's affine map is applied once per block: y += d * sum(q * x) + m * sum(x)
 * with sum(x) per block precomputed once per call. Each block is decoded once and used
 * for all M rows of x, so the weights are read once per call.
 *
 * Threads: OpenMP over output rows, a static split. `num_threads` <= 0 means the value from
 * cpu_gemv_set_num_threads, or OpenMP's default. AVX2/FMA/F16C path if __AVX2__, else scalar.
 *
 * This file knows nothing of models, torch or Python: raw pointers in, fp32 out.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32     /* values per Q4_0 / Q4_1 / Q8_0 block, and per Q4_K sub-block */
#define QK_K 256  /* values per Q4_K super-block */
#define MAX_M 8
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024 /* software prefetch distance along a row (measured: 256 and 768 worse) */
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { Q4_0_BYTES = 18, Q4_1_BYTES = 20, Q8_0_BYTES = 34, Q4_K_BYTES = 144 };

static int g_num_threads = 0;

void cpu_gemv_set_num_threads(int n) { g_num_threads = n > 0 ? n : 0; }

#ifdef __AVX2__
int cpu_gemv_has_simd(void) { return 1; }
#else
int cpu_gemv_has_simd(void) { return 0; }
#endif

static int resolve_threads(int n) {
    if (n > 0) return n;
    if (g_num_threads > 0) return g_num_threads;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

ALWAYS_INLINE float fp16_to_fp32(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else /* no F16C (the portable build) */
    const uint32_t exp = (h >> 10) & 0x1F;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact */
        const float f = (float)(h & 0x3FF) * 5.9604645e-8f;
        return (h & 0x8000) ? -f : f;
    }
    const uint32_t bits = ((uint32_t)(h & 0x8000) << 16) | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) |
                          ((uint32_t)(h & 0x3FF) << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K: 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes. */
ALWAYS_INLINE void q4_k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* xs[m * nsub + b] = sum of x[m, 32 b .. 32 b + 31] (x: [M, K], xs: [M, K / 32]): the affine
 * terms of the Q4_K and portable paths. */
static void block_sums(const float* x, int M, int K, float* xs) {
    const int nsub = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nsub; b++) {
            const float* p = x + (size_t)m * K + (size_t)b * QK;
            float s = 0.f;
            for (int i = 0; i < QK; i++) s += p[i];
            xs[(size_t)m * nsub + b] = s;
        }
}

#ifdef __AVX2__
ALWAYS_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE __m256i load_u8x8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}

ALWAYS_INLINE __m256 load_i8x8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* 16 bytes of nibbles -> q[0..31] as 4 x 8 floats: byte j holds q[j] (low) and q[j + 16] (high). */
ALWAYS_INLINE void unpack_nibbles(const uint8_t* qs, __m256* w) {
    const __m256i m4 = _mm256_set1_epi32(0xF);
    __m256i b0 = load_u8x8(qs), b1 = load_u8x8(qs + 8);  /* bytes 0..7, 8..15 as int32 */
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, m4));   /* q[0..7]   */
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, m4));   /* q[8..15]  */
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));   /* q[16..23] */
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));   /* q[24..31] */
}

/* sum_i w[i] * x[i] over 32 values, as 8 lanes (one chain: blocks run in parallel instead) */
ALWAYS_INLINE __m256 dot32(const __m256* w, const float* x) {
    __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a);
    a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a);
}

/* Weights of one block as 4 x 8 floats. KIND: 0 = Q4_0, 1 = Q4_1, 8 = Q8_0. */
ALWAYS_INLINE void unpack_block(const uint8_t* blk, const int KIND, __m256* w) {
    if (KIND == 8) {
        w[0] = load_i8x8(blk + 2); w[1] = load_i8x8(blk + 10);
        w[2] = load_i8x8(blk + 18); w[3] = load_i8x8(blk + 26);
    } else {
        unpack_nibbles(blk + (KIND == 1 ? 4 : 2), w);
    }
}

/* R consecutive rows of a 32-value block type: y[m * N + r] for m < M, r < R.
 * Per block: decode each row's block once into its fp32 weights (d q + m for Q4_1, d (q - 8) for
 * Q4_0, d q for Q8_0: 4 FMAs shared by all M tokens), then per token one 32-value dot product
 * added to that token's accumulator. R = 2 for M <= 2 (two rows give two independent chains);
 * R = 1 otherwise (the M chains are enough, and 8 accumulators plus the block fit the 16 registers).
 * Each token's result is computed by the same operations in the same order whatever M is (batch
 * invariance: a token decoded in a continuous batch gets bit-identical logits to the same token
 * decoded alone).
 * NOTE: an earlier form (the dot of the raw codes scaled by d, plus an affine term m * sum(x) kept
 * in a second accumulator per token) spilled registers at M = 8 and rounded its M > 2 variant
 * differently; this one measured 13 % faster at M = 1, 21 % at M = 8, and is closer to the
 * dequantized weights' exact product.
 * NOTE: this core sustains ~3.5 instructions per cycle, so instruction count is the cost model
 * (gathering 8 blocks' scales with vpgatherdd, or 8-rows-per-lane layouts, measured slower). */
ALWAYS_INLINE void tile_blocks32(const uint8_t* row, size_t row_bytes, int nb, const float* x, int K,
                                 float* y, int N, const int R, const int M, const int KIND) {
    const int BYTES = KIND == 0 ? Q4_0_BYTES : KIND == 1 ? Q4_1_BYTES : Q8_0_BYTES;
    __m256 acc[2][MAX_M];
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            const uint8_t* blk = row + r * row_bytes + (size_t)b * BYTES;
            _mm_prefetch((const char*)blk + PREFETCH_BYTES, _MM_HINT_T0);
            uint32_t bits = 0;
            memcpy(&bits, blk, KIND == 1 ? 4 : 2);                              /* d | m << 16 */
            const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));      /* [d, m, 0, 0] */
            const __m256 vd = _mm256_broadcastss_ps(dm);
            __m256 w[4];
            unpack_block(blk, KIND, w);
            if (KIND == 8) {
                for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(w[i], vd);
            } else {  /* the block's weights: d q + m (Q4_1), d (q - 8) (Q4_0) */
                const __m256 vm = KIND == 1 ? _mm256_broadcastss_ps(_mm_movehdup_ps(dm))
                                            : _mm256_mul_ps(vd, _mm256_set1_ps(-8.f));
                for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(w[i], vd, vm);
            }
#pragma GCC unroll 8
            for (int m = 0; m < M; m++)
                acc[r][m] = _mm256_add_ps(acc[r][m], dot32(w, x + (size_t)m * K + (size_t)b * QK));
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int m = 0; m < M; m++)
            y[(size_t)m * N + r] = hsum256(acc[r][m]);
}

/* One Q4_K row: per super-block, 4 chunks of 32 bytes; low nibbles are sub-block 2j,
 * high nibbles sub-block 2j + 1 (64 consecutive values per chunk). */
ALWAYS_INLINE void row_q4_k(const uint8_t* row, int nsb, const float* x, int K, const float* xs,
                            float* y, int N, const int M) {
    const int nsub = K / QK;
    const __m256i m4 = _mm256_set1_epi32(0xF);
    __m256 acc[MAX_M];
    float macc[MAX_M];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) { acc[m] = _mm256_setzero_ps(); macc[m] = 0.f; }
    for (int s = 0; s < nsb; s++) {
        const uint8_t* blk = row + (size_t)s * Q4_K_BYTES;
        const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
        const uint8_t* sc6 = blk + 4;
        const uint8_t* qs = blk + 16;
        for (int j = 0; j < 4; j++) {
            int sc0, mn0, sc1, mn1;
            q4_k_scale_min(sc6, 2 * j, &sc0, &mn0);
            q4_k_scale_min(sc6, 2 * j + 1, &sc1, &mn1);
            __m256 lo[4], hi[4];
            for (int i = 0; i < 4; i++) {
                __m256i bq = load_u8x8(qs + 32 * j + 8 * i);
                lo[i] = _mm256_cvtepi32_ps(_mm256_and_si256(bq, m4));
                hi[i] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bq, 4));
            }
            const __m256 d0 = _mm256_set1_ps(d * sc0), d1 = _mm256_set1_ps(d * sc1);
            const float m0 = dmin * mn0, m1 = dmin * mn1;
            const int sub = s * 8 + 2 * j;
#pragma GCC unroll 8
            for (int m = 0; m < M; m++) {
                const float* xm = x + (size_t)m * K + (size_t)sub * QK;
                acc[m] = _mm256_fmadd_ps(d0, dot32(lo, xm), acc[m]);
                acc[m] = _mm256_fmadd_ps(d1, dot32(hi, xm + QK), acc[m]);
                macc[m] -= m0 * xs[m * nsub + sub] + m1 * xs[m * nsub + sub + 1];
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) y[(size_t)m * N] = hsum256(acc[m]) + macc[m];
}

#else /* scalar fallback */

ALWAYS_INLINE void row_blocks32(const uint8_t* row, int nb, const float* x, int K, const float* xs,
                                float* y, int N, const int M, const int KIND) {
    const int BYTES = KIND == 0 ? Q4_0_BYTES : KIND == 1 ? Q4_1_BYTES : Q8_0_BYTES;
    float acc[MAX_M] = {0};
    for (int b = 0; b < nb; b++) {
        const uint8_t* blk = row + (size_t)b * BYTES;
        const float d = fp16_to_fp32(blk);
        float q[QK], mn = 0.f;
        if (KIND == 8) {
            for (int i = 0; i < QK; i++) q[i] = (float)(int8_t)blk[2 + i];
        } else {
            const uint8_t* qs = blk + (KIND == 1 ? 4 : 2);
            mn = KIND == 1 ? fp16_to_fp32(blk + 2) : -8.f * d;
            for (int i = 0; i < 16; i++) { q[i] = (float)(qs[i] & 0xF); q[i + 16] = (float)(qs[i] >> 4); }
        }
        for (int m = 0; m < M; m++) {
            const float* xm = x + (size_t)m * K + (size_t)b * QK;
            float dot = 0.f;
            for (int i = 0; i < QK; i++) dot += q[i] * xm[i];
            acc[m] += d * dot + (KIND == 8 ? 0.f : mn * xs[m * nb + b]);
        }
    }
    for (int m = 0; m < M; m++) y[(size_t)m * N] = acc[m];
}

ALWAYS_INLINE void row_q4_k(const uint8_t* row, int nsb, const float* x, int K, const float* xs,
                            float* y, int N, const int M) {
    const int nsub = K / QK;
    float acc[MAX_M] = {0};
    for (int s = 0; s < nsb; s++) {
        const uint8_t* blk = row + (size_t)s * Q4_K_BYTES;
        const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
        for (int t = 0; t < 8; t++) {
            int sc, mn;
            q4_k_scale_min(blk + 4, t, &sc, &mn);
            const uint8_t* qs = blk + 16 + 32 * (t / 2);
            const int shift = 4 * (t & 1), sub = s * 8 + t;
            for (int m = 0; m < M; m++) {
                const float* xm = x + (size_t)m * K + (size_t)sub * QK;
                float dot = 0.f;
                for (int i = 0; i < QK; i++) dot += (float)((qs[i] >> shift) & 0xF) * xm[i];
                acc[m] += d * sc * dot - dmin * mn * xs[m * nsub + sub];
            }
        }
    }
    for (int m = 0; m < M; m++) y[(size_t)m * N] = acc[m];
}
#endif

typedef struct {
    const uint8_t* w;  /* [N, row_bytes] */
    size_t row_bytes;
    int N, K, M;
    const float* x;   /* [M, K] */
    const float* xs;  /* [M, K / 32] block sums of x */
    float* y;         /* [M, N] */
} gemv_args;

/* Rows [n0, n1) for a compile-time M and KIND (4 = Q4_K). */
ALWAYS_INLINE void rows_m(const gemv_args* a, int n0, int n1, const int M, const int KIND) {
    int n = n0;
#ifdef __AVX2__
    for (; KIND != 4 && M <= 2 && n + 2 <= n1; n += 2)
        tile_blocks32(a->w + (size_t)n * a->row_bytes, a->row_bytes, a->K / QK, a->x, a->K, a->y + n, a->N, 2, M,
                      KIND);
#endif
    for (; n < n1; n++) {
        const uint8_t* row = a->w + (size_t)n * a->row_bytes;
        if (KIND == 4)
            row_q4_k(row, a->K / QK_K, a->x, a->K, a->xs, a->y + n, a->N, M);
        else
#ifdef __AVX2__
            tile_blocks32(row, 0, a->K / QK, a->x, a->K, a->y + n, a->N, 1, M, KIND);
#else
            row_blocks32(row, a->K / QK, a->x, a->K, a->xs, a->y + n, a->N, M, KIND);
#endif
    }
}

ALWAYS_INLINE void rows_any_m(const gemv_args* a, int n0, int n1, const int KIND) {
#define CASE_M(m) case m: rows_m(a, n0, n1, m, KIND); break;
    switch (a->M) { CASE_M(1) CASE_M(2) CASE_M(3) CASE_M(4) CASE_M(5) CASE_M(6) CASE_M(7) CASE_M(8) }
#undef CASE_M
}

typedef void (*rows_fn)(const gemv_args*, int, int);

#define MIN_BYTES_PER_THREAD 16384 /* below this the fork / join costs more than it saves */
#define STACK_SUBS (MAX_M * 64)    /* x block sums kept on the stack up to K = 2048 */

/* Shared driver: checks, block sums of x, then a static split of whole rows (in pairs)
 * over threads. Returns 0, -1 for bad arguments (K not a multiple of the block, M outside
 * 1..8, N < 0), -2 when out of memory. */
static int gemv_driver(const uint8_t* w, int N, int K, const float* x, int M, float* y, int num_threads,
                       int kind, int block_values, int block_bytes, rows_fn fn) {
    if (N < 0 || K <= 0 || K % block_values || M < 1 || M > MAX_M) return -1;
    if (N == 0) return 0;
    gemv_args a = {w, (size_t)(K / block_values) * block_bytes, N, K, M, x, NULL, y};
    const size_t subs = (size_t)M * (K / QK);
    float stack_buf[STACK_SUBS] __attribute__((aligned(32)));
    float* buf = stack_buf;
    if (kind != 8) {
        if (subs > STACK_SUBS && !(buf = (float*)aligned_alloc(32, (sizeof(float) * subs + 31) / 32 * 32)))
            return -2;
        block_sums(x, M, K, buf);
        a.xs = buf;
    }
    int nt = resolve_threads(num_threads);
    const size_t max_nt = (size_t)N * a.row_bytes / MIN_BYTES_PER_THREAD + 1;
    if ((size_t)nt > max_nt) nt = (int)max_nt;
    if (nt > (N + 1) / 2) nt = (N + 1) / 2;
    if (nt <= 1) {
        fn(&a, 0, N);
    } else {
        const int pairs = (N + 1) / 2;
#pragma omp parallel num_threads(nt)
        {
#ifdef _OPENMP
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
            const int t = 0, T = 1;
#endif
            /* whole row pairs, split as schedule(static) would */
            int n0 = 2 * (int)((long long)pairs * t / T), n1 = 2 * (int)((long long)pairs * (t + 1) / T);
            fn(&a, n0, n1 < N ? n1 : N);
        }
    }
    if (buf != stack_buf) free(buf);
    return 0;
}

/* The entry points, one per kind:
 *   int q4_0_gemv / q4_1_gemv / q8_0_gemv / q4_k_gemv(const uint8_t* w, int N, int K,
 *                                                    const float* x, int M, float* y, int num_threads)
 * w: uint8 [N, row_bytes] raw GGUF rows; x: fp32 [M, K]; y: fp32 [M, N]; returns 0 or < 0.
 * NOTE: a separate non-inlined rows_<kind> per kind: the OpenMP region in gemv_driver is
 * outlined before inlining, so a KIND constant passed to the driver would not reach it. */
#define GEMV_ENTRY(name, KIND, values, bytes)                                                           \
    static void rows_##name(const gemv_args* a, int n0, int n1) { rows_any_m(a, n0, n1, KIND); }        \
    int name##_gemv(const uint8_t* w, int N, int K, const float* x, int M, float* y, int num_threads) { \
        return gemv_driver(w, N, K, x, M, y, num_threads, KIND, values, bytes, rows_##name);             \
    }
GEMV_ENTRY(q4_0, 0, QK, Q4_0_BYTES)
GEMV_ENTRY(q4_1, 1, QK, Q4_1_BYTES)
GEMV_ENTRY(q8_0, 8, QK, Q8_0_BYTES)
GEMV_ENTRY(q4_k, 4, QK_K, Q4_K_BYTES)

/* The same GEMV by a team of T threads inside the caller's parallel region (the fused decode step runs
 * every GEMV of a step in one region): every thread calls it with its own t and the same arguments;
 * thread t computes the block sums of rows t, t + T, ... into ws (at least M * K / 32 floats), then,
 * after sync(ctx), its share of the rows of W. The caller synchronises before reading y or reusing ws.
 * kind: 0 Q4_0, 1 Q4_1, 4 Q4_K, 8 Q8_0. Returns 0, or -1 (on every thread) for bad arguments. */
int gemv_team(const uint8_t* w, int kind, int N, int K, const float* x, int M, float* y, void* ws, int t, int T,
              void (*sync)(void*), void* ctx) {
    const int values = kind == 4 ? QK_K : QK;
    const int bytes = kind == 0 ? Q4_0_BYTES : kind == 1 ? Q4_1_BYTES : kind == 8 ? Q8_0_BYTES : kind == 4 ? Q4_K_BYTES : 0;
    if (!bytes || N < 0 || K <= 0 || K % values || M < 1 || M > MAX_M) return -1;
    if (N == 0) return 0;
    gemv_args a = {w, (size_t)(K / values) * bytes, N, K, M, x, (const float*)ws, y};
    for (int m = t; m < M; m += T) block_sums(x + (size_t)m * K, 1, K, (float*)ws + (size_t)m * (K / QK));
    sync(ctx);
    const rows_fn fn = kind == 0 ? rows_q4_0 : kind == 1 ? rows_q4_1 : kind == 8 ? rows_q8_0 : rows_q4_k;
    const int pairs = (N + 1) / 2;
    const int n0 = 2 * (int)((long long)pairs * t / T), n1 = 2 * (int)((long long)pairs * (t + 1) / T);
    fn(&a, n0, n1 < N ? n1 : N);
    return 0;
}
