/* Dequantization of raw GGUF rows to fp32, for prefill: one dense GEMM on the dequantized
 * weight beats per-token GEMVs from a few dozen tokens on. Built into the same library as
 * cpu_gemv.c (see cpu_gemv.py). Reference: gguf.quants.dequantize. */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* ---- dequantization to fp32 rows (prefill: one dense GEMM on the dequantized weight) ---- */

static inline float deq_f16(const uint8_t* p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else { exp = 127 - 15 + 1; while (!(man & 1024)) { man <<= 1; exp--; } man &= 1023; bits = sign | (exp << 23) | (man << 13); }
    } else if (exp == 31) { bits = sign | 0x7f800000u | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

static void deq_row_q4_0(const uint8_t* b, int K, float* y) {
    for (int i = 0; i < K / 32; i++, b += 18, y += 32) {
        const float d = deq_f16(b);
        for (int j = 0; j < 16; j++) { y[j] = d * (float)((b[2 + j] & 15) - 8); y[j + 16] = d * (float)((b[2 + j] >> 4) - 8); }
    }
}

static void deq_row_q4_1(const uint8_t* b, int K, float* y) {
    for (int i = 0; i < K / 32; i++, b += 20, y += 32) {
        const float d = deq_f16(b), m = deq_f16(b + 2);
        for (int j = 0; j < 16; j++) { y[j] = d * (float)(b[4 + j] & 15) + m; y[j + 16] = d * (float)(b[4 + j] >> 4) + m; }
    }
}

static void deq_row_q8_0(const uint8_t* b, int K, float* y) {
    for (int i = 0; i < K / 32; i++, b += 34, y += 32) {
        const float d = deq_f16(b);
        const int8_t* q = (const int8_t*)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
    }
}

static inline void deq_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
    if (j < 4) { *sc = q[j] & 63; *mn = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static void deq_row_q4_k(const uint8_t* b, int K, float* y) {
    for (int i = 0; i < K / 256; i++, b += 144) {
        const float d = deq_f16(b), dmin = deq_f16(b + 2);
        const uint8_t* scales = b + 4;
        const uint8_t* q = b + 16;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
            uint8_t sc, mn;
            deq_scale_min_k4(is, scales, &sc, &mn);
            const float d1 = d * sc, m1 = dmin * mn;
            deq_scale_min_k4(is + 1, scales, &sc, &mn);
            const float d2 = d * sc, m2 = dmin * mn;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

/* kind: 0 = q4_0, 1 = q4_1, 8 = q8_0, 4 = q4_k. w: raw rows [N, row_bytes]; y: fp32 [N, K]. */
int gguf_dequantize(const uint8_t* w, int N, int K, int kind, float* y, int num_threads) {
    int row_bytes;
    void (*fn)(const uint8_t*, int, float*);
    if (kind == 0) { row_bytes = K / 32 * 18; fn = deq_row_q4_0; }
    else if (kind == 1) { row_bytes = K / 32 * 20; fn = deq_row_q4_1; }
    else if (kind == 8) { row_bytes = K / 32 * 34; fn = deq_row_q8_0; }
    else if (kind == 4) { if (K % 256) return 2; row_bytes = K / 256 * 144; fn = deq_row_q4_k; }
    else return 1;
    if (K % 32 || N <= 0) return 2;
    const int nt = num_threads > 0 ? num_threads : 1;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int n = 0; n < N; n++) fn(w + (size_t)n * row_bytes, K, y + (size_t)n * K);
    return 0;
}
