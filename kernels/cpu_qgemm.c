/* Integer dot-product GEMM on raw GGUF block rows: y = x @ W.T for any number of rows of x.
 *
 * The activations are quantized to 8 bits per 32-value block (Q8_0-style: d = amax / 127,
 * q = round-half-even(x / d), plus the block's sum of q), then every 32-value block of a weight
 * row meets every block of x through an exact integer dot product. The float work per
 * (row of x, row of W) is fixed, so every ISA variant and every caller gets the same bits:
 *
 *   per block b:  c_b = (dw_b * dx_b) * (float)isum_b              Q8_0
 *                 c_b = (dw_b * dx_b) * (float)(isum_b - 8 sx_b)    Q4_0  (w = d (q - 8))
 *                 c_b = (dw_b * dx_b) * (float)isum_b + mw_b * sxf_b      Q4_1  (w = d q + m)
 *                 c_b = (d * dx_b) * (float)(sc_b isum_b) - mw_b * sxf_b  Q4_K  (w = d sc q - dmin mn,
 *                                                                  mw_b = dmin * (float)mn_b)
 *   where isum_b = sum_i q_w[i] q_x[i] (int32, exact), sx_b = sum_i q_x[i], sxf_b = dx_b * (float)sx_b;
 *   lane l = b % 8 accumulates acc_l += c_b (a last group of r < 8 blocks adds to lanes 0..r-1 only), and
 *   y = ((acc_0 + acc_1) + (acc_2 + acc_3)) + ((acc_4 + acc_5) + (acc_6 + acc_7)).
 * Every float operation is a single IEEE multiply, add or subtract (built with -ffp-contract=off:
 * no FMA), so the result does not depend on the variant, on M, on the rows x is batched with,
 * on the thread split, or on the tiling.
 *
 * This file is compiled once per variant (-DQG_NAME=portable|avx2|avxvnni|avx512vnni|amx|neon with
 * that ISA's flags; amx is avx512vnni plus tile multiplies for two or more rows of x from the packed
 * layout); only the integer dot product differs between them. cpu_qgemm_dispatch.c
 * picks one at run time. It knows nothing of models, torch or Python: raw pointers in, fp32 out.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team_barrier.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(QG_AVX2) || defined(QG_AVXVNNI) || defined(QG_AVX512VNNI)
#define QG_X86 1
#include <immintrin.h>
#elif defined(QG_NEON)
#include <arm_neon.h>
#endif

#ifndef QG_NAME
#error "define QG_NAME (the variant's name)"
#endif
#define QG_CAT2(a, b) a##_##b
#define QG_CAT(a, b) QG_CAT2(a, b)
#define FN(name) QG_CAT(name, QG_NAME)

#define QK 32          /* values per block of x, and per Q4_0 / Q4_1 / Q8_0 block and Q4_K sub-block */
#define GROUP 8        /* blocks per accumulation group (one lane each) */
#define M_CHUNK 16     /* rows of x per pass over a tile of W */
#define N_TILE 16      /* rows of W per tile */
#define MIN_BYTES_PER_THREAD 16384
#ifndef MLANES_MIN
#define MLANES_MIN 5 /* x86 runs groups of 8 rows of x through row_mlanes, and a last group of >= 5 rows */
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024 /* software prefetch distance along a row, as cpu_gemv.c */
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { K_Q4_0 = 0, K_Q4_1 = 1, K_Q4_K = 4, K_Q8_0 = 8 };

/* ---- activations: 8 bits per 32-value block ------------------------------------------------ */

/* One row of x quantized: nbp = K / 32 rounded up to GROUP, padded with zero blocks. */
typedef struct {
    int8_t* q;    /* [nbp * 32] */
    float* d;     /* [nbp] scale */
    int32_t* s;   /* [nbp] sum of q */
    float* sf;    /* [nbp] d * (float)s */
} qrow;

ALWAYS_INLINE float fp16_to_fp32(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float f;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact */
        f = (float)m * 5.9604645e-8f;
        return (h & 0x8000) ? -f : f;
    }
    const uint32_t bits = ((uint32_t)(h & 0x8000) << 16) | (e == 31 ? 0x7F800000u : (e + 112) << 23) | (m << 13);
    memcpy(&f, &bits, 4);
    return f;
}

/* x[K] -> one qrow. NOTE: (v + 1.5 * 2^23) - 1.5 * 2^23 is v rounded half to even for |v| < 2^22 in
 * any IEEE single arithmetic (|v| <= 127 here), so every variant and the numpy reference agree. */
static void quantize_row(const float* x, int K, int nbp, qrow r) {
    const int nb = K / QK;
    const float magic = 12582912.0f;
    for (int b = 0; b < nb; b++) {
        const float* p = x + (size_t)b * QK;
        uint32_t mx = 0; /* max |x| through its bits: non-negative floats order as integers */
        for (int i = 0; i < QK; i++) {
            uint32_t u;
            memcpy(&u, p + i, 4);
            u &= 0x7FFFFFFFu;
            mx = u > mx ? u : mx;
        }
        float amax;
        memcpy(&amax, &mx, 4);
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < QK; i++) {
            const float v = (p[i] * id + magic) - magic;
            const int q = (int)v;
            r.q[(size_t)b * QK + i] = (int8_t)q;
            s += q;
        }
        r.d[b] = d;
        r.s[b] = s;
        r.sf[b] = d * (float)s;
    }
    for (int b = nb; b < nbp; b++) { /* padding: contributes exact zeros */
        memset(r.q + (size_t)b * QK, 0, QK);
        r.d[b] = 0.0f;
        r.s[b] = 0;
        r.sf[b] = 0.0f;
    }
}

/* ---- weights: one group of 8 blocks unpacked ---------------------------------------------- */

/* u[b * 32 + i]: weight code i of block b (Q4: 0..15; Q8_0: |w|), sg: Q8_0's signed codes;
 * dw, mw, sc: the per-block float parameters and Q4_K's integer scales (zero for padding). */
typedef struct {
    uint8_t u[GROUP * QK] __attribute__((aligned(32)));
    int8_t sg[GROUP * QK] __attribute__((aligned(32)));
    float dw[GROUP], mw[GROUP];
    int32_t sc[GROUP];
} wgroup;

ALWAYS_INLINE void q4k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

#ifndef QG_X86 /* ---- portable C and NEON: a group unpacked into memory, then the dots and the epilogue ---- */
/* 16 bytes of nibbles -> 32 codes: byte i holds code i (low) and code i + 16 (high). */
ALWAYS_INLINE void nibbles16(const uint8_t* qs, uint8_t* u) {
    for (int i = 0; i < 16; i++) { u[i] = qs[i] & 0xF; u[i + 16] = qs[i] >> 4; }
}

/* Blocks g * 8 .. g * 8 + nvalid - 1 of one row (for Q4_K: super-block g, always 8 sub-blocks). */
ALWAYS_INLINE void unpack_group(const uint8_t* row, int g, int nvalid, const int KIND, wgroup* w) {
    if (KIND == K_Q4_K) {
        const uint8_t* blk = row + (size_t)g * 144;
        const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
        for (int t = 0; t < GROUP; t++) {
            int sc, mn;
            q4k_scale_min(blk + 4, t, &sc, &mn);
            const uint8_t* qs = blk + 16 + 32 * (t / 2);
            const int shift = 4 * (t & 1);
            for (int i = 0; i < QK; i++) w->u[t * QK + i] = (qs[i] >> shift) & 0xF;
            w->dw[t] = d;
            w->sc[t] = sc;
            w->mw[t] = dmin * (float)mn;
        }
        return;
    }
    const int BYTES = KIND == K_Q4_0 ? 18 : KIND == K_Q4_1 ? 20 : 34;
    for (int t = 0; t < GROUP; t++) {
        if (t >= nvalid) {
            memset(w->u + t * QK, 0, QK);
            memset(w->sg + t * QK, 0, QK);
            w->dw[t] = 0.0f;
            w->mw[t] = 0.0f;
            w->sc[t] = 0;
            continue;
        }
        const uint8_t* blk = row + (size_t)(g * GROUP + t) * BYTES;
        w->dw[t] = fp16_to_fp32(blk);
        w->mw[t] = KIND == K_Q4_1 ? fp16_to_fp32(blk + 2) : 0.0f;
        w->sc[t] = 1;
        if (KIND == K_Q8_0) {
            memcpy(w->sg + t * QK, blk + 2, QK);
            for (int i = 0; i < QK; i++) {
                const int v = (int8_t)blk[2 + i];
                w->u[t * QK + i] = (uint8_t)(v < 0 ? -v : v);
            }
        } else {
            nibbles16(blk + (KIND == K_Q4_1 ? 4 : 2), w->u + t * QK);
        }
    }
}

/* ---- the integer dot products: isum[b] = sum_i code[b][i] * q_x[b][i] for the 8 blocks ---- */
#endif

#ifdef QG_X86
/* u8 x s8 over one 32-value block -> 8 int32 partial sums (exact: |pair| <= 2 * 255 * 127 needs the
 * VNNI forms; maddubs pairs stay below 2^15 because codes are <= 15, or |w| <= 128 with the sign trick). */
ALWAYS_INLINE __m256i dot_block(__m256i u, __m256i x) {
#if defined(QG_AVX512VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#elif defined(QG_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* 8 vectors of 8 partial sums -> [sum(p0), ..., sum(p7)] */
ALWAYS_INLINE __m256i reduce8(const __m256i* p) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
#endif

#ifndef QG_X86
/* isum[b] for b < nvalid (0 beyond). */
ALWAYS_INLINE void dots8(const wgroup* w, const int8_t* xq, const int KIND, int nvalid, int32_t* isum) {
#if defined(QG_NEON)
    for (int b = nvalid; b < GROUP; b++) isum[b] = 0;
    for (int b = 0; b < nvalid; b++) {
        const int8x16_t x0 = vld1q_s8(xq + b * QK), x1 = vld1q_s8(xq + b * QK + 16);
        int8x16_t w0, w1;
        if (KIND == K_Q8_0) {
            w0 = vld1q_s8(w->sg + b * QK);
            w1 = vld1q_s8(w->sg + b * QK + 16);
        } else { /* 4-bit codes 0..15 are valid signed bytes */
            w0 = vreinterpretq_s8_u8(vld1q_u8(w->u + b * QK));
            w1 = vreinterpretq_s8_u8(vld1q_u8(w->u + b * QK + 16));
        }
        isum[b] = vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, x0), w1, x1));
    }
#else
    for (int b = nvalid; b < GROUP; b++) isum[b] = 0;
    for (int b = 0; b < nvalid; b++) {
        int32_t s = 0;
        if (KIND == K_Q8_0)
            for (int i = 0; i < QK; i++) s += (int32_t)w->sg[b * QK + i] * xq[b * QK + i];
        else
            for (int i = 0; i < QK; i++) s += (int32_t)w->u[b * QK + i] * xq[b * QK + i];
        isum[b] = s;
    }
#endif
}

/* acc[l] += c_l for the blocks l < nvalid of one group and one row of x (the formulas at the top). */
ALWAYS_INLINE void accumulate(const wgroup* w, const int32_t* isum, const float* dx, const int32_t* sx,
                              const float* sxf, const int KIND, int nvalid, float* acc) {
    for (int l = 0; l < nvalid; l++) {
        int32_t i = isum[l];
        if (KIND == K_Q4_0) i -= 8 * sx[l];
        if (KIND == K_Q4_K) i *= w->sc[l];
        float c = (w->dw[l] * dx[l]) * (float)i;
        if (KIND == K_Q4_1) c = c + w->mw[l] * sxf[l];
        if (KIND == K_Q4_K) c = c - w->mw[l] * sxf[l];
        acc[l] = acc[l] + c;
    }
}

#endif

ALWAYS_INLINE float lanes_sum(const float* a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* ---- the driver ------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t* w;
    size_t row_bytes;
    int N, K, M, nbp, ngroups;
    const int8_t* q; const float* d; const int32_t* s; const float* sf;  /* quantized x: [M, nbp(*32)] */
    float* y;  /* [M, N] */
    /* x86: the same values for rows 0 .. 8 * mgroups - 1, 8 rows interleaved (zero rows past M):
     * xi [mgroups][nbp][8 steps][8 rows][4 values], di / si / sfi [mgroups][nbp][8 rows] */
    int mgroups;
    int8_t* xi; float* di; int32_t* si; float* sfi;
} qg_args;

#ifndef QG_X86
/* Rows [n0, n1) of W against every row of x. */
ALWAYS_INLINE void rows(const qg_args* a, int n0, int n1, const int KIND) {
    const int nb = KIND == K_Q4_K ? a->ngroups * GROUP : a->K / QK;
    wgroup w;
    int32_t isum[GROUP] __attribute__((aligned(32)));
    float acc[M_CHUNK][GROUP] __attribute__((aligned(32)));
    for (int t0 = n0; t0 < n1; t0 += N_TILE) {
        const int t1 = t0 + N_TILE < n1 ? t0 + N_TILE : n1;
        for (int m0 = 0; m0 < a->M; m0 += M_CHUNK) {
            const int mc = a->M - m0 < M_CHUNK ? a->M - m0 : M_CHUNK;
            for (int n = t0; n < t1; n++) {
                const uint8_t* row = a->w + (size_t)n * a->row_bytes;
                memset(acc, 0, sizeof(float) * GROUP * mc);
                for (int g = 0; g < a->ngroups; g++) {
                    const int nvalid = nb - g * GROUP < GROUP ? nb - g * GROUP : GROUP;
                    unpack_group(row, g, nvalid, KIND, &w);
                    for (int m = 0; m < mc; m++) {
                        const size_t xb = (size_t)(m0 + m) * a->nbp + (size_t)g * GROUP;
                        dots8(&w, a->q + xb * QK, KIND, nvalid, isum);
                        accumulate(&w, isum, a->d + xb, a->s + xb, a->sf + xb, KIND, nvalid, acc[m]);
                    }
                }
                for (int m = 0; m < mc; m++) a->y[(size_t)(m0 + m) * a->N + n] = lanes_sum(acc[m]);
            }
        }
    }
}

#else
/* The x86 form of `rows`: the same arithmetic, with a group's 8 blocks of codes held in registers
 * (Q8_0: the signed codes; |w| and the sign move to x per row of x) and its parameters as vectors. */
ALWAYS_INLINE void load_group(const uint8_t* row, int g, int nvalid, const int KIND, __m256i* u, __m256* dw,
                              __m256* mw, __m256i* sc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (KIND == K_Q4_K) {
        const uint8_t* blk = row + (size_t)g * 144;
        uint16_t h[2];
        memcpy(h, blk, 4);
        const float d = _cvtsh_ss(h[0]), dmin = _cvtsh_ss(h[1]);
        int scs[GROUP], mns[GROUP];
        for (int t = 0; t < GROUP; t++) q4k_scale_min(blk + 4, t, &scs[t], &mns[t]);
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * j));
            u[2 * j] = _mm256_and_si256(v, m4);
            u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        *dw = _mm256_set1_ps(d);
        *sc = _mm256_setr_epi32(scs[0], scs[1], scs[2], scs[3], scs[4], scs[5], scs[6], scs[7]);
        *mw = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(
                  _mm256_setr_epi32(mns[0], mns[1], mns[2], mns[3], mns[4], mns[5], mns[6], mns[7])));
        return;
    }
    const int BYTES = KIND == K_Q4_0 ? 18 : KIND == K_Q4_1 ? 20 : 34;
    /* NOTE: the 8 fp16 scales go straight into a register (pinsrw): 8 scalar stores and one vector load
     * would miss store forwarding and stall every group */
    __m128i d16 = _mm_setzero_si128(), m16 = _mm_setzero_si128();
#define QG_BLOCK(b)                                                                                        \
    if (b < nvalid) {                                                                                      \
        const uint8_t* blk = row + (size_t)(g * GROUP + b) * BYTES;                                        \
        uint16_t dh, mh;                                                                                   \
        memcpy(&dh, blk, 2);                                                                               \
        d16 = _mm_insert_epi16(d16, dh, b);                                                                \
        if (KIND == K_Q4_1) { memcpy(&mh, blk + 2, 2); m16 = _mm_insert_epi16(m16, mh, b); }               \
        if (KIND == K_Q8_0) {                                                                              \
            u[b] = _mm256_loadu_si256((const __m256i*)(blk + 2));                                          \
        } else {                                                                                           \
            const __m128i v = _mm_loadu_si128((const __m128i*)(blk + (KIND == K_Q4_1 ? 4 : 2)));           \
            u[b] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);                        \
        }                                                                                                  \
    } else {                                                                                               \
        u[b] = _mm256_setzero_si256();                                                                     \
    }
    QG_BLOCK(0) QG_BLOCK(1) QG_BLOCK(2) QG_BLOCK(3) QG_BLOCK(4) QG_BLOCK(5) QG_BLOCK(6) QG_BLOCK(7)
#undef QG_BLOCK
    *dw = _mm256_cvtph_ps(d16);
    *mw = _mm256_cvtph_ps(m16);
}

/* acc += the group's contributions against one row of x (xq: its 8 blocks; dx, sx, sxf: their terms). */
ALWAYS_INLINE __m256 group_row(const __m256i* u, __m256 dw, __m256 mw, __m256i sc, int nvalid, const int8_t* xq,
                               const float* dx, const int32_t* sx, const float* sxf, __m256 acc, const int KIND) {
    __m256i p[GROUP];
#pragma GCC unroll 8
    for (int b = 0; b < GROUP; b++) {
        if (b >= nvalid) {
            p[b] = _mm256_setzero_si256();
            continue;
        }
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
        p[b] = KIND == K_Q8_0 ? dot_block(_mm256_abs_epi8(u[b]), _mm256_sign_epi8(x, u[b])) : dot_block(u[b], x);
    }
    __m256i is = reduce8(p);
    if (KIND == K_Q4_0) is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)sx), 3));
    if (KIND == K_Q4_K) is = _mm256_mullo_epi32(is, sc);
    __m256 c = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(dx)), _mm256_cvtepi32_ps(is));
    if (KIND == K_Q4_1) c = _mm256_add_ps(c, _mm256_mul_ps(mw, _mm256_loadu_ps(sxf)));
    if (KIND == K_Q4_K) c = _mm256_sub_ps(c, _mm256_mul_ps(mw, _mm256_loadu_ps(sxf)));
    const __m256 sum = _mm256_add_ps(acc, c);
    if (nvalid == GROUP) return sum;
    /* lanes past the last block keep their value (not + 0.0: -0.0 stays -0.0) */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_blendv_ps(acc, sum, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nvalid), lane)));
}

ALWAYS_INLINE float hsum_lanes(__m256 v) {
    float a[GROUP];
    _mm256_storeu_ps(a, v);
    return lanes_sum(a);
}

/* Group g of one row: prefetch ahead along the row, then load_group; returns the group's valid blocks. */
ALWAYS_INLINE int fetch_group(const qg_args* a, const uint8_t* row, int g, const int KIND, __m256i* u, __m256* dw,
                              __m256* mw, __m256i* sc) {
    const int nb = KIND == K_Q4_K ? a->ngroups * GROUP : a->K / QK;
    const int span = KIND == K_Q4_K ? 144 : GROUP * (KIND == K_Q4_0 ? 18 : KIND == K_Q4_1 ? 20 : 34);
    const int nvalid = nb - g * GROUP < GROUP ? nb - g * GROUP : GROUP;
    for (int c = 0; c < span; c += 64)
        _mm_prefetch((const char*)row + (size_t)g * span + PREFETCH_BYTES + c, _MM_HINT_T0);
    *sc = _mm256_setzero_si256();
    load_group(row, g, nvalid, KIND, u, dw, mw, sc);
    return nvalid;
}

/* Row n of W against rows m0 .. m0 + MC - 1 of x (MC: a compile-time count, 1..4: the accumulators
 * stay in registers; a row's codes are unpacked again for every 4 rows of x, from L1). */
ALWAYS_INLINE void row_x86(const qg_args* a, int n, int m0, const int MC, const int KIND) {
    const uint8_t* row = a->w + (size_t)n * a->row_bytes;
    __m256 acc[4];
#pragma GCC unroll 4
    for (int m = 0; m < MC; m++) acc[m] = _mm256_setzero_ps();
    for (int g = 0; g < a->ngroups; g++) {
        __m256i u[GROUP], sc;
        __m256 dw, mw;
        const int nvalid = fetch_group(a, row, g, KIND, u, &dw, &mw, &sc);
#pragma GCC unroll 4
        for (int m = 0; m < MC; m++) {
            const size_t xb = (size_t)(m0 + m) * a->nbp + (size_t)g * GROUP;
            acc[m] = group_row(u, dw, mw, sc, nvalid, a->q + xb * QK, a->d + xb, a->s + xb, a->sf + xb, acc[m], KIND);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MC; m++) a->y[(size_t)(m0 + m) * a->N + n] = hsum_lanes(acc[m]);
}

/* Rows m of x as the lanes: 8 rows of x against one row of W per pass. Each 32-bit lane holds 4 values of
 * its row of x; the weight's 4 codes at the same k are broadcast to every lane, so 8 steps give each lane
 * its block's exact isum with no horizontal reduction; the epilogue is the same per-lane arithmetic, and
 * block b adds to accumulator b % 8, so every (row of x, row of W) gets row_x86's bits. */
ALWAYS_INLINE __m256i mstep(__m256i s, __m256i wb, __m256i x, const int KIND) {
    if (KIND == K_Q8_0) { /* signed codes: |w| times x with w's sign, summed in 32 bits */
        const __m256i aw = _mm256_abs_epi8(wb), sx = _mm256_sign_epi8(x, wb);
#if defined(QG_AVX512VNNI)
        return _mm256_dpbusd_epi32(s, aw, sx);
#elif defined(QG_AVXVNNI)
        return _mm256_dpbusd_avx_epi32(s, aw, sx);
#else
        return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
    }
#if defined(QG_AVX512VNNI)
    return _mm256_dpbusd_epi32(s, wb, x);
#elif defined(QG_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(s, wb, x);
#else /* 4-bit codes: 8 steps of |pair| <= 2 * 15 * 127 stay below 2^15, so 16-bit sums are exact */
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(wb, x));
#endif
}

/* a + b in the width mstep accumulates in (16 bits for AVX2's Q4 steps, else 32). */
ALWAYS_INLINE __m256i madd_width(__m256i a, __m256i b, const int KIND) {
#if defined(QG_AVX512VNNI) || defined(QG_AVXVNNI)
    (void)KIND;
    return _mm256_add_epi32(a, b);
#else
    return KIND == K_Q8_0 ? _mm256_add_epi32(a, b) : _mm256_add_epi16(a, b);
#endif
}

ALWAYS_INLINE __m256i mfinish(__m256i s, const int KIND) {
#if defined(QG_AVX512VNNI) || defined(QG_AVXVNNI)
    (void)KIND;
    return s;
#else
    return KIND == K_Q8_0 ? s : _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

ALWAYS_INLINE void row_mlanes(const qg_args* a, int n, int mg, const int KIND) {
    const uint8_t* row = a->w + (size_t)n * a->row_bytes;
    uint8_t ub[GROUP][QK] __attribute__((aligned(32)));
    __m256 acc[GROUP];
#pragma GCC unroll 8
    for (int t = 0; t < GROUP; t++) acc[t] = _mm256_setzero_ps();
    for (int g = 0; g < a->ngroups; g++) {
        __m256i u[GROUP], sc;
        __m256 dw, mw;
        const int nvalid = fetch_group(a, row, g, KIND, u, &dw, &mw, &sc);
#pragma GCC unroll 8
        for (int t = 0; t < GROUP; t++) _mm256_store_si256((__m256i*)ub[t], u[t]);
#pragma GCC unroll 8
        for (int t = 0; t < GROUP; t++) {
            if (t >= nvalid) break;
            const size_t xb = (size_t)mg * a->nbp + (size_t)g * GROUP + t;
            const int8_t* xv = a->xi + xb * 256;
            __m256i acc_i = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                int32_t w4;
                memcpy(&w4, ub[t] + 4 * j, 4);
                acc_i = mstep(acc_i, _mm256_set1_epi32(w4), _mm256_loadu_si256((const __m256i*)(xv + 32 * j)), KIND);
            }
            __m256i is = mfinish(acc_i, KIND);
            const __m256i lane_t = _mm256_set1_epi32(t);
            if (KIND == K_Q4_0) is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(a->si + xb * 8)), 3));
            if (KIND == K_Q4_K) is = _mm256_mullo_epi32(is, _mm256_permutevar8x32_epi32(sc, lane_t));
            __m256 c = _mm256_mul_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(dw, lane_t), _mm256_loadu_ps(a->di + xb * 8)),
                                     _mm256_cvtepi32_ps(is));
            if (KIND == K_Q4_1)
                c = _mm256_add_ps(c, _mm256_mul_ps(_mm256_permutevar8x32_ps(mw, lane_t), _mm256_loadu_ps(a->sfi + xb * 8)));
            if (KIND == K_Q4_K)
                c = _mm256_sub_ps(c, _mm256_mul_ps(_mm256_permutevar8x32_ps(mw, lane_t), _mm256_loadu_ps(a->sfi + xb * 8)));
            acc[t] = _mm256_add_ps(acc[t], c);
        }
    }
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])),
                                   _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7])));
    float out[8];
    _mm256_storeu_ps(out, y);
    const int rows_x = a->M - 8 * mg < 8 ? a->M - 8 * mg : 8;
    for (int m = 0; m < rows_x; m++) a->y[(size_t)(8 * mg + m) * a->N + n] = out[m];
}

/* x rows of m-group mg, block b, into the interleaved arrays */
static void interleave(const qg_args* a, int mg, int b) {
    const size_t xb = (size_t)mg * a->nbp + b;
    int8_t* dst = a->xi + xb * 256;
    for (int m = 0; m < 8; m++) {
        const int row = 8 * mg + m;
        const size_t src = (size_t)row * a->nbp + b;
        if (row < a->M) {
            for (int j = 0; j < 8; j++) memcpy(dst + 32 * j + 4 * m, a->q + src * QK + 4 * j, 4);
            a->di[xb * 8 + m] = a->d[src];
            a->si[xb * 8 + m] = a->s[src];
            a->sfi[xb * 8 + m] = a->sf[src];
        } else {
            for (int j = 0; j < 8; j++) memset(dst + 32 * j + 4 * m, 0, 4);
            a->di[xb * 8 + m] = 0.0f;
            a->si[xb * 8 + m] = 0;
            a->sfi[xb * 8 + m] = 0.0f;
        }
    }
}

ALWAYS_INLINE void rows_x86(const qg_args* a, int n0, int n1, const int KIND) {
    for (int t0 = n0; t0 < n1; t0 += N_TILE) {
        const int t1 = t0 + N_TILE < n1 ? t0 + N_TILE : n1;
        for (int mg = 0; mg < a->mgroups; mg++)
            for (int n = t0; n < t1; n++) row_mlanes(a, n, mg, KIND);
        for (int m0 = 8 * a->mgroups; m0 < a->M; m0 += M_CHUNK) { /* the last 1..4 rows */
            const int mc = a->M - m0 < M_CHUNK ? a->M - m0 : M_CHUNK;
            for (int n = t0; n < t1; n++)
                for (int mm = 0; mm < mc; mm += 4) {
                    const int r = mc - mm < 4 ? mc - mm : 4;
                    if (r == 4) row_x86(a, n, m0 + mm, 4, KIND);
                    else if (r == 3) row_x86(a, n, m0 + mm, 3, KIND);
                    else if (r == 2) row_x86(a, n, m0 + mm, 2, KIND);
                    else row_x86(a, n, m0 + mm, 1, KIND);
                }
        }
    }
}
#define rows rows_x86
#endif

#ifdef QG_X86
/* ---- the packed layout (qgemm_repack in cpu_qgemm_dispatch.c): rows of W as the lanes ---------------
 * Tiles of 8 rows; per tile and block, the codes as 32-byte registers holding 4 rows x 2 steps: byte
 * 16 h + 4 r + i of register (R, j) is code 4 (j + 4 h) + i of row 4 R + r (Q4: register (0, j) in the low
 * and (1, j) in the high nibbles of 32-byte piece j; Q8_0: register (R, j) is piece 4 R + j), then the 8
 * rows' fp16 d (and Q4_1's fp16 m). One load of x's block and four in-lane shuffles give each half the 4
 * values of its step (a broadcast from memory per step cost more), so 4 steps per register give each
 * row's exact isum in two halves, added once; the epilogue is the per-lane form of the formulas at the
 * top, and block b adds to accumulator b % 8: the same bits as the row-major kernels. */
ALWAYS_INLINE int tile_bytes(const int KIND) { return KIND == K_Q4_0 ? 144 : KIND == K_Q4_1 ? 160 : 272; }

/* Tiles [t0, t1) against every row of x; y columns past N are not written. */
ALWAYS_INLINE void tiles_packed(const qg_args* a, int t0, int t1, const int KIND) {
    const int nb = a->K / QK, TB = tile_bytes(KIND);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    float accbuf[M_CHUNK][GROUP][8] __attribute__((aligned(32)));
    for (int t = t0; t < t1; t++) {
        const uint8_t* tile = a->w + (size_t)t * nb * TB;
        for (int m0 = 0; m0 < a->M; m0 += M_CHUNK) {
            const int mc = a->M - m0 < M_CHUNK ? a->M - m0 : M_CHUNK;
            for (int m = 0; m < mc; m++)
                for (int l = 0; l < GROUP; l++) _mm256_store_ps(accbuf[m][l], _mm256_setzero_ps());
            for (int b = 0; b < nb; b++) {
                const uint8_t* blk = tile + (size_t)b * TB;
                _mm_prefetch((const char*)blk + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char*)blk + PREFETCH_BYTES + 64, _MM_HINT_T0);
                _mm_prefetch((const char*)blk + PREFETCH_BYTES + 128, _MM_HINT_T0);
                if (KIND == K_Q8_0) _mm_prefetch((const char*)blk + PREFETCH_BYTES + 192, _MM_HINT_T0);
                __m256i wlo[4], whi[4]; /* step pair j of rows 0-3, of rows 4-7 */
                if (KIND == K_Q8_0) {
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        wlo[j] = _mm256_loadu_si256((const __m256i*)(blk + 32 * j));
                        whi[j] = _mm256_loadu_si256((const __m256i*)(blk + 32 * (4 + j)));
                    }
                } else {
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 32 * j));
                        wlo[j] = _mm256_and_si256(v, m4);
                        whi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                }
                const int codes = KIND == K_Q8_0 ? 256 : 128;
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + codes)));
                const __m256 mw = KIND == K_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + codes + 16)))
                                                 : _mm256_setzero_ps();
                const int l = b % GROUP;
                for (int m = 0; m < mc; m++) {
                    const size_t xb = (size_t)(m0 + m) * a->nbp + b;
                    const int8_t* xq = a->q + xb * QK;
                    /* one load of x's block; in-lane shuffles give 128-bit half h the 4 values of step j + 4 h */
                    const __m256i xall = _mm256_loadu_si256((const __m256i*)xq);
                    const __m256i x0 = _mm256_shuffle_epi32(xall, 0x00), x1 = _mm256_shuffle_epi32(xall, 0x55);
                    const __m256i x2 = _mm256_shuffle_epi32(xall, 0xAA), x3 = _mm256_shuffle_epi32(xall, 0xFF);
                    const __m256i z = _mm256_setzero_si256();
                    const __m256i lo = mstep(mstep(mstep(mstep(z, wlo[0], x0, KIND), wlo[1], x1, KIND), wlo[2], x2, KIND),
                                             wlo[3], x3, KIND);
                    const __m256i hi = mstep(mstep(mstep(mstep(z, whi[0], x0, KIND), whi[1], x1, KIND), whi[2], x2, KIND),
                                             whi[3], x3, KIND);
                    /* lo = [rows 0-3, steps 0-3 | rows 0-3, steps 4-7], hi the same for rows 4-7: add the halves
                     * (in mstep's width: AVX2's 16-bit Q4 sums of 8 steps stay below 2^15, as before) */
                    const __m256i pa = _mm256_permute2x128_si256(lo, hi, 0x20), pb = _mm256_permute2x128_si256(lo, hi, 0x31);
                    __m256i is = mfinish(madd_width(pa, pb, KIND), KIND);
                    if (KIND == K_Q4_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * a->s[xb]));
                    __m256 c = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->d[xb])), _mm256_cvtepi32_ps(is));
                    if (KIND == K_Q4_1) c = _mm256_add_ps(c, _mm256_mul_ps(mw, _mm256_set1_ps(a->sf[xb])));
                    _mm256_store_ps(accbuf[m][l], _mm256_add_ps(_mm256_load_ps(accbuf[m][l]), c));
                }
            }
            const int rows_w = a->N - 8 * t < 8 ? a->N - 8 * t : 8;
            for (int m = 0; m < mc; m++) {
                __m256 v[GROUP];
                for (int l = 0; l < GROUP; l++) v[l] = _mm256_load_ps(accbuf[m][l]);
                const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])),
                                               _mm256_add_ps(_mm256_add_ps(v[4], v[5]), _mm256_add_ps(v[6], v[7])));
                float out[8];
                _mm256_storeu_ps(out, y);
                for (int r = 0; r < rows_w; r++) a->y[(size_t)(m0 + m) * a->N + 8 * t + r] = out[r];
            }
        }
    }
}

static void tiles_q4_0(const qg_args* a, int t0, int t1) { tiles_packed(a, t0, t1, K_Q4_0); }
static void tiles_q4_1(const qg_args* a, int t0, int t1) { tiles_packed(a, t0, t1, K_Q4_1); }
static void tiles_q8_0(const qg_args* a, int t0, int t1) { tiles_packed(a, t0, t1, K_Q8_0); }
#endif

#ifdef QG_AMX
/* ---- AMX: the packed layout through tile multiplies (Sapphire Rapids and later) ---------------------
 * A pair of 8-row tiles of W (16 rows of W, the columns of C) against up to 16 rows of x (C's rows), one
 * 32-value block at a time: TDPBSUD (Q8_0: TDPBSSD) gives the block's exact isum for all 16 x 16 pairs
 * (int32, no saturation), the same integers the VNNI kernels sum; the epilogue is tiles_packed's per-lane
 * arithmetic with 16 rows of W as the lanes, block b adding to accumulator b % 8. So it gives the same bits
 * as every other variant, and the rows beyond the first cost a tile row each instead of a pass of their own.
 * Tile registers: 0-3 C (mc x 16 int32), 4-5 A (mc rows of x's block, 32 codes), 6-7 B (8 steps x 16 rows
 * x 4 codes, built from the packed layout: each 16-byte quarter of a packed register is 4 rows x one step
 * of 4 codes, which is B's layout). */
#define AMX_MIN_M 4 /* fewer rows keep the VNNI kernel: per block the tile work costs more than 1-3 rows of VNNI */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_cfg;

static void amx_configure(int mc) {
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 4; i++) cfg.rows[i] = (uint8_t)mc, cfg.colsb[i] = 64; /* C: mc rows of x x 16 of W, int32 */
    for (int i = 4; i < 6; i++) cfg.rows[i] = (uint8_t)mc, cfg.colsb[i] = 32; /* A: mc rows of x x a block's codes */
    for (int i = 6; i < 8; i++) cfg.rows[i] = 8, cfg.colsb[i] = 64;           /* B: 8 steps x 16 rows of W x 4 */
    _tile_loadconfig(&cfg);
}

/* B for block `blk_a` of tile t (rows 0-7 of the pair) and `blk_b` of tile t + 1 (rows 8-15; NULL: zeros):
 * step s's 64 bytes are row n's 4 codes 4 s .. 4 s + 3 for n = 0..15. In the packed layout register (R, j)
 * holds step j in its low and step j + 4 in its high 16 bytes, 4 rows each: Q4 has R = 0 (rows 0-3) in the
 * low and R = 1 (rows 4-7) in the high nibbles of piece j, Q8_0 has them in pieces j and 4 + j. */
ALWAYS_INLINE void amx_b(const uint8_t* blk_a, const uint8_t* blk_b, const int KIND, uint8_t* bb) {
    const __m512i lo_steps = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);  /* quarters 0 and 2 of both */
    const __m512i hi_steps = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15); /* quarters 1 and 3 */
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512i r0, r1; /* rows 0-3 | rows 4-7 of both tiles, per quarter */
        if (KIND == K_Q8_0) {
            const __m256i a0 = _mm256_loadu_si256((const __m256i*)(blk_a + 32 * j));
            const __m256i a1 = _mm256_loadu_si256((const __m256i*)(blk_a + 32 * (4 + j)));
            const __m256i b0 = blk_b ? _mm256_loadu_si256((const __m256i*)(blk_b + 32 * j)) : _mm256_setzero_si256();
            const __m256i b1 = blk_b ? _mm256_loadu_si256((const __m256i*)(blk_b + 32 * (4 + j))) : _mm256_setzero_si256();
            r0 = _mm512_inserti64x4(_mm512_castsi256_si512(a0), b0, 1);
            r1 = _mm512_inserti64x4(_mm512_castsi256_si512(a1), b1, 1);
        } else {
            const __m256i a = _mm256_loadu_si256((const __m256i*)(blk_a + 32 * j));
            const __m256i b = blk_b ? _mm256_loadu_si256((const __m256i*)(blk_b + 32 * j)) : _mm256_setzero_si256();
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), m4 = _mm512_set1_epi8(0x0F);
            r0 = _mm512_and_si512(v, m4);
            r1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        _mm512_store_si512((__m512i*)(bb + 64 * j), _mm512_permutex2var_epi64(r0, lo_steps, r1));
        _mm512_store_si512((__m512i*)(bb + 64 * (j + 4)), _mm512_permutex2var_epi64(r0, hi_steps, r1));
    }
}

/* dw (and Q4_1's mw) of one block of the pair as 16 lanes: rows 0-7 from tile t, 8-15 from t + 1 (or zero) */
ALWAYS_INLINE __m512 amx_halves(const uint8_t* pa, const uint8_t* pb) {
    const __m128i lo = _mm_loadu_si128((const __m128i*)pa);
    const __m128i hi = pb ? _mm_loadu_si128((const __m128i*)pb) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* The epilogue of one block (its isums in cb, mc rows of x): tiles_packed's formulas, 16 rows of W as lanes. */
ALWAYS_INLINE void amx_epilogue(const qg_args* a, int m0, int mc, int b, const int32_t (*cb)[16], __m512 dw, __m512 mw,
                                float (*acc)[GROUP][16], const int KIND) {
    const int l = b % GROUP;
    for (int m = 0; m < mc; m++) {
        const size_t xb = (size_t)(m0 + m) * a->nbp + b;
        __m512i is = _mm512_load_si512((const __m512i*)cb[m]);
        if (KIND == K_Q4_0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(8 * a->s[xb]));
        __m512 c = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->d[xb])), _mm512_cvtepi32_ps(is));
        if (KIND == K_Q4_1) c = _mm512_add_ps(c, _mm512_mul_ps(mw, _mm512_set1_ps(a->sf[xb])));
        _mm512_store_ps(acc[m][l], _mm512_add_ps(_mm512_load_ps(acc[m][l]), c));
    }
}

#define AMX_SEG 32   /* blocks whose B is built ahead (16 KB) */
#define AMX_LAG 2  /* blocks between a block's multiply and its epilogue (C tiles 0-3, A tiles 4-5, B tiles 6-7) */

/* Tiles [t0, t1) of W (taken in pairs) against every row of x; y columns past N are not written. B is built
 * for a run of blocks first (tile loads then read settled memory); each block's multiply is issued two
 * blocks ahead of its epilogue, and the next pair's weights are prefetched while this pair computes. */
ALWAYS_INLINE void tiles_amx(const qg_args* a, int t0, int t1, const int KIND) {
    const int nb = a->K / QK, TB = tile_bytes(KIND), codes = KIND == K_Q8_0 ? 256 : 128;
    const size_t xstride = (size_t)a->nbp * QK;
    uint8_t bb[AMX_SEG][512] __attribute__((aligned(64)));
    int32_t cb[4][16][16] __attribute__((aligned(64)));
    float acc[16][GROUP][16] __attribute__((aligned(64)));
    int configured = 0;
    for (int t = t0; t < t1; t += 2) {
        const uint8_t* ta = a->w + (size_t)t * nb * TB;
        const uint8_t* tb = t + 1 < t1 ? ta + (size_t)nb * TB : NULL;
        for (int m0 = 0; m0 < a->M; m0 += 16) {
            const int mc = a->M - m0 < 16 ? a->M - m0 : 16;
            if (mc != configured) {
                amx_configure(mc);
                configured = mc;
            }
            for (int m = 0; m < mc; m++)
                for (int l = 0; l < GROUP; l++) _mm512_store_ps(acc[m][l], _mm512_setzero_ps());
            const int8_t* xq = a->q + (size_t)m0 * xstride;
            for (int s0 = 0; s0 < nb; s0 += AMX_SEG) {
                const int sn = nb - s0 < AMX_SEG ? nb - s0 : AMX_SEG;
                for (int i = 0; i < sn; i++) {
                    const uint8_t* ba = ta + (size_t)(s0 + i) * TB;
                    const uint8_t* bq = tb ? tb + (size_t)(s0 + i) * TB : NULL;
                    amx_b(ba, bq, KIND, bb[i]);
                }
                /* software pipeline: block i's loads, multiply and tile store are issued before block i - 2's
                 * epilogue (C tile and cb slot i % 4, A and B tiles by parity), so the tile unit and the vector
                 * units work at once and a stored tile is read two blocks later */
                for (int i = 0; i < sn + AMX_LAG; i++) {
                    if (i < sn) {
                        const int b = s0 + i;
#define AMX_DOT(c, at, bt)                                                                   \
    _tile_loadd(at, xq + (size_t)b * QK, (long)xstride);                                     \
    _tile_loadd(bt, bb[i], 64);                                                              \
    _tile_zero(c);                                                                           \
    if (KIND == K_Q8_0) _tile_dpbssd(c, at, bt);                                             \
    else _tile_dpbsud(c, at, bt);                                                            \
    _tile_stored(c, cb[c], 64);
                        switch (i & 3) {
                            case 0: AMX_DOT(0, 4, 6) break;
                            case 1: AMX_DOT(1, 5, 7) break;
                            case 2: AMX_DOT(2, 4, 6) break;
                            default: AMX_DOT(3, 5, 7) break;
                        }
#undef AMX_DOT
                        if (m0 + 16 >= a->M && t + 2 < t1) { /* the next pair's block, while this one computes */
                            const char* na = (const char*)(ta + (size_t)(2 * nb + b) * TB);
                            for (int c = 0; c < TB; c += 64) {
                                _mm_prefetch(na + c, _MM_HINT_T0);
                                _mm_prefetch(na + (size_t)nb * TB + c, _MM_HINT_T0);
                            }
                        }
                    }
                    if (i >= AMX_LAG) {
                        const int j = i - AMX_LAG, b = s0 + j;
                        const uint8_t* ba = ta + (size_t)b * TB;
                        const uint8_t* bq = tb ? tb + (size_t)b * TB : NULL;
                        const __m512 dw = amx_halves(ba + codes, bq ? bq + codes : NULL);
                        const __m512 mw = KIND == K_Q4_1 ? amx_halves(ba + codes + 16, bq ? bq + codes + 16 : NULL)
                                                         : _mm512_setzero_ps();
                        amx_epilogue(a, m0, mc, b, (const int32_t(*)[16])cb[j & 3], dw, mw, acc, KIND);
                    }
                }
            }
            const int left = a->N - 8 * t, rows_w = left < (tb ? 16 : 8) ? left : (tb ? 16 : 8);
            for (int m = 0; m < mc; m++) {
                __m512 v[GROUP];
                for (int l = 0; l < GROUP; l++) v[l] = _mm512_load_ps(acc[m][l]);
                const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_add_ps(v[2], v[3])),
                                               _mm512_add_ps(_mm512_add_ps(v[4], v[5]), _mm512_add_ps(v[6], v[7])));
                float out[16] __attribute__((aligned(64)));
                _mm512_store_ps(out, y);
                memcpy(a->y + (size_t)(m0 + m) * a->N + 8 * t, out, sizeof(float) * (size_t)rows_w);
            }
        }
    }
    if (configured) _tile_release();
}

static void amx_q4_0(const qg_args* a, int t0, int t1) { tiles_amx(a, t0, t1, K_Q4_0); }
static void amx_q4_1(const qg_args* a, int t0, int t1) { tiles_amx(a, t0, t1, K_Q4_1); }
static void amx_q8_0(const qg_args* a, int t0, int t1) { tiles_amx(a, t0, t1, K_Q8_0); }
#endif

static void rows_q4_0(const qg_args* a, int n0, int n1) { rows(a, n0, n1, K_Q4_0); }
static void rows_q4_1(const qg_args* a, int n0, int n1) { rows(a, n0, n1, K_Q4_1); }
static void rows_q8_0(const qg_args* a, int n0, int n1) { rows(a, n0, n1, K_Q8_0); }
static void rows_q4_k(const qg_args* a, int n0, int n1) { rows(a, n0, n1, K_Q4_K); }

/* The workspace qgemm_team needs for M rows of K values (any kind): the quantized rows, their scales and
 * sums, and on x86 the interleaved copy of groups of 8 rows. */
size_t FN(qgemm_workspace)(int K, int M) {
    const size_t nbp = (size_t)(K / QK + GROUP - 1) / GROUP * GROUP;
    size_t bytes = (size_t)M * nbp * QK + sizeof(float) * 3 * (size_t)M * nbp;
#ifdef QG_X86
    const size_t nblk = (size_t)(M / 8 + 1) * nbp;
    bytes += 32 + nblk * 256 + nblk * 8 * 12;
#endif
    return (bytes + 63) / 64 * 64;
}


/* y [M, N] = x [M, K] @ W.T by a team of T threads: every thread of a parallel region calls it with its
 * own t (0 .. T - 1) and the same arguments, workspace ws (qgemm_workspace(K, M) bytes, 32-byte aligned)
 * and barrier sync(ctx). Thread t quantizes rows t, t + T, ... of x (so a caller that wrote row m on
 * thread m % T needs no barrier before the call), then every thread computes its share of y; the caller
 * synchronises before reading y or reusing ws. W: raw GGUF rows of `kind` (0 Q4_0, 1 Q4_1, 4 Q4_K,
 * 8 Q8_0), or qgemm_repack's layout when packed. Returns 0 on every thread, or the same error on every
 * thread: -1 for bad arguments (unknown kind, K not a multiple of the block, M < 1, N < 0), -3 where this
 * variant has no packed kernel for the kind. */
int FN(qgemm_team)(const uint8_t* w, int kind, int packed, int N, int K, const float* x, int M, float* y,
                   void* ws, int t, int T, void (*sync)(void*), void* ctx) {
    const int values = kind == K_Q4_K ? 256 : QK;
    const int bytes = kind == K_Q4_0 ? 18 : kind == K_Q4_1 ? 20 : kind == K_Q8_0 ? 34 : kind == K_Q4_K ? 144 : 0;
    if (!bytes || N < 0 || K <= 0 || K % values || M < 1) return -1;
#ifdef QG_X86
    if (packed && kind == K_Q4_K) return -3;
#else
    if (packed) return -3;
#endif
    if (N == 0) return 0;
    const int nb = K / QK, ngroups = (nb + GROUP - 1) / GROUP, nbp = ngroups * GROUP;
    const size_t nq = (size_t)M * nbp * QK, nf = (size_t)M * nbp;
    int8_t* q = (int8_t*)ws;
    float* f = (float*)(q + nq);
    qg_args a = {w, (size_t)(K / values) * bytes, N, K, M, nbp, ngroups, q, f, (int32_t*)(f + nf), f + 2 * nf, y,
                 0, NULL, NULL, NULL, NULL};
    for (int m = t; m < M; m += T) {
        qrow r = {q + (size_t)m * nbp * QK, f + (size_t)m * nbp, (int32_t*)(f + nf) + (size_t)m * nbp,
                  f + 2 * nf + (size_t)m * nbp};
        quantize_row(x + (size_t)m * K, K, nbp, r);
    }
    sync(ctx);
    void (*fn)(const qg_args*, int, int) = kind == K_Q4_0 ? rows_q4_0 : kind == K_Q4_1 ? rows_q4_1
                                           : kind == K_Q8_0 ? rows_q8_0 : rows_q4_k;
    int units = N; /* what the threads split: rows of W, or tiles of 8 rows when packed */
#ifdef QG_X86
    a.mgroups = packed ? 0 : M / 8 + (M % 8 >= MLANES_MIN); /* a last group of >= MLANES_MIN rows is padded */
    if (a.mgroups) {
        const size_t nblk = (size_t)a.mgroups * nbp;
        a.xi = (int8_t*)(((uintptr_t)(f + 3 * nf) + 31) & ~(uintptr_t)31);
        a.di = (float*)(a.xi + nblk * 256);
        a.si = (int32_t*)(a.di + nblk * 8);
        a.sfi = (float*)(a.si + nblk * 8);
        for (int i = t; i < a.mgroups * nbp; i += T) interleave(&a, i / nbp, i % nbp);
        sync(ctx);
    }
    if (packed) {
        fn = kind == K_Q4_0 ? tiles_q4_0 : kind == K_Q4_1 ? tiles_q4_1 : tiles_q8_0;
        units = (N + 7) / 8;
    }
#endif
#ifdef QG_AMX
    if (packed && M >= AMX_MIN_M) { /* the threads split pairs of tiles */
        fn = kind == K_Q4_0 ? amx_q4_0 : kind == K_Q4_1 ? amx_q4_1 : amx_q8_0;
        const int tiles = units, pairs = (tiles + 1) / 2;
        const int p0 = (int)((long long)pairs * t / T), p1 = (int)((long long)pairs * (t + 1) / T);
        fn(&a, 2 * p0, 2 * p1 < tiles ? 2 * p1 : tiles);
        return 0;
    }
#endif
    fn(&a, (int)((long long)units * t / T), (int)((long long)units * (t + 1) / T));
    return 0;
}

#define STACK_WS (96 * 1024)

/* qgemm_team run by a team of its own (an OpenMP region of at most num_threads, fewer for a small W). */
static int driver(const uint8_t* w, int kind, int N, int K, const float* x, int M, float* y, int num_threads,
                  int packed) {
    const int values = kind == K_Q4_K ? 256 : QK;
    const int bytes = kind == K_Q4_0 ? 18 : kind == K_Q4_1 ? 20 : kind == K_Q8_0 ? 34 : kind == K_Q4_K ? 144 : 0;
    if (!bytes || N < 0 || K <= 0 || K % values || M < 1) return -1;
    const size_t wsb = FN(qgemm_workspace)(K, M);
    uint8_t stack_ws[STACK_WS] __attribute__((aligned(64)));
    void* ws = wsb <= STACK_WS ? (void*)stack_ws : aligned_alloc(64, wsb);
    if (!ws) return -2;
    int nt = num_threads > 0 ? num_threads : 1;
    const size_t max_nt = (size_t)N * ((size_t)(K / values) * bytes) * (M < 4 ? 1 : M / 4) / MIN_BYTES_PER_THREAD + 1;
    if ((size_t)nt > max_nt) nt = (int)max_nt;
    if (nt > (N + 7) / 8) nt = (N + 7) / 8 > 0 ? (N + 7) / 8 : 1;
    int rc = 0;
    team_barrier bar;
    team_barrier_init(&bar, 1);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = team_enter(&bar);
        const int r = FN(qgemm_team)(w, kind, packed, N, K, x, M, y, ws, t, bar.n, team_sync, &bar);
        if (t == 0) rc = r;
    }
    if (ws != (void*)stack_ws) free(ws);
    return rc;
}

int FN(qgemm)(const uint8_t* w, int kind, int N, int K, const float* x, int M, float* y, int num_threads) {
    return driver(w, kind, N, K, x, M, y, num_threads, 0);
}

/* The same product from W in the packed layout of qgemm_repack (x86 variants; Q4_0, Q4_1, Q8_0);
 * -3 where this variant or kind has no packed kernel. */
int FN(qgemm_packed)(const uint8_t* wp, int kind, int N, int K, const float* x, int M, float* y, int num_threads) {
    return driver(wp, kind, N, K, x, M, y, num_threads, 1);
}

/* Test hook: the quantized activations of x [M, K] as this variant computes them. q: int8 [M, K],
 * d and sf: float [M, K / 32], s: int32 [M, K / 32]. Returns 0, or -1 when K % 32. */
int FN(qgemm_quantize)(const float* x, int M, int K, int8_t* q, float* d, int32_t* s, float* sf) {
    if (K <= 0 || K % QK || M < 1) return -1;
    const int nb = K / QK;
    for (int m = 0; m < M; m++) {
        qrow r = {q + (size_t)m * K, d + (size_t)m * nb, s + (size_t)m * nb, sf + (size_t)m * nb};
        quantize_row(x + (size_t)m * K, K, nb, r);
    }
    return 0;
}
