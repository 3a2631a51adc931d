/* The small per-layer operations of a one-token decode step, fused in C.
 *
 * Between the four GEMVs of a layer, torch runs ~15 tiny ops (norms, RoPE, the KV write,
 * grouped attention, SiLU): a few microseconds of math each, but ~8 ms of dispatch per
 * token on this CPU. These functions do the same fp32 math, and decode_layers runs every
 * layer of a token in one call. Built into
 * the same library as cpu_gemv.c (see cpu_gemv.py); the torch code in
 * edge_runtime/model.py is the reference they are tested against. A step is one OpenMP
 * region: its threads split every phase and meet at team_barrier.h's barrier (see layers()).
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* If add != NULL: x += add (the residual). Then out = x * rsqrt(mean(x^2) + eps) * w. */
void decode_add_rmsnorm(float* x, const float* add, const float* w, int dim, float eps, float* out) {
    double ss = 0.0;
    for (int i = 0; i < dim; i++) {
        if (add) x[i] += add[i];
        ss += (double)x[i] * x[i];
    }
    const float r = 1.0f / sqrtf((float)(ss / dim) + eps);
    for (int i = 0; i < dim; i++) out[i] = x[i] * r * w[i];
}

/* ---- the paged KV cache (kernels/kv_cache.py) ------------------------------------------------
 * One layer's K (or V) pool: [num_blocks, block_size, nkv, hd] in fp32, fp16, bf16 or int8; int8
 * has one fp32 scale per (slot, head) in [num_blocks, block_size, nkv]. Position p of a sequence
 * lives in slot table[p / bs] * bs + p % bs. The write rounding equals torch's (.to(fp16/bf16):
 * round to nearest even; int8: scale = amax / 127, q = round-half-even(x / scale)). */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };

typedef struct {
    void* k; void* v;            /* this layer's pools */
    float* ks; float* vs;        /* int8 scales (NULL otherwise) */
    const int* table;            /* the sequence's block table */
    int bs, kind, rotated;       /* rotated: int8 rows are stored in the Hadamard basis */
    const int* tail; int base;   /* a draft tree's row (decode_layers_batch_tree): positions p >= base live in
                                  * slots tail[p - base] (its ancestors', then its own); NULL otherwise */
} paged_kv;

/* The slot that holds position p. */
static inline size_t kv_slot(const paged_kv* kv, int p) {
    if (kv->tail && p >= kv->base) return (size_t)kv->tail[p - kv->base];
    return (size_t)kv->table[p / kv->bs] * kv->bs + p % kv->bs;
}

/* x[n] <- x H / sqrt(n) (n a power of two): the butterfly of kv_cache.hadamard_rotate, same order of
 * additions, so both round alike. Its own inverse. */
static void hadamard_rotate(float* x, int n) {
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float r = (float)(1.0 / sqrt((double)n));  /* as torch: the double 1/sqrt(n) rounded to float */
    for (int i = 0; i < n; i++) x[i] *= r;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__F16C__)
static inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, 0); }
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else /* the portable build: IEEE half conversions, round to nearest even */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00;                   /* NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00;                  /* overflow (rounds past 65504) -> inf */
    if (u < 0x38800000u) {                                       /* subnormal half or zero */
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);     /* a / 2^-24, exact scaling, RNE */
    }
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += 0xfffu + mant_odd;                                      /* round the 13 dropped bits to even */
    return sign | (uint16_t)((u - 0x38000000u) >> 13);
}
static inline float f16_to_f32(uint16_t h) {
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float f;
    if (e == 0) {
        f = (float)m * 5.9604645e-8f;
        return (h & 0x8000) ? -f : f;
    }
    const uint32_t bits = ((uint32_t)(h & 0x8000) << 16) | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* Store row x[hd] (head j of the token in `slot`); int8 rows rotated first when `rotated`. */
static void kv_store(void* pool, float* scales, int kind, int rotated, size_t slot, int nkv, int j, int hd,
                     const float* x) {
    const size_t off = (slot * nkv + j) * hd;
    float tmp[512];
    if (kind == KV_I8 && rotated) {
        memcpy(tmp, x, sizeof(float) * hd);
        hadamard_rotate(tmp, hd);
        x = tmp;
    }
    if (kind == KV_F32) {
        memcpy((float*)pool + off, x, sizeof(float) * hd);
    } else if (kind == KV_F16) {
        uint16_t* d = (uint16_t*)pool + off;
        for (int i = 0; i < hd; i++) d[i] = f32_to_f16(x[i]);
    } else if (kind == KV_BF16) {
        uint16_t* d = (uint16_t*)pool + off;
        for (int i = 0; i < hd; i++) d[i] = f32_to_bf16(x[i]);
    } else {
        float amax = 0.0f;
        for (int i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float scale = amax / 127.0f, div = scale > 1e-30f ? scale : 1e-30f;
        int8_t* d = (int8_t*)pool + off;
        for (int i = 0; i < hd; i++) {
            float q = nearbyintf(x[i] / div);
            d[i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        }
        scales[slot * nkv + j] = scale;
    }
}

/* Load row (slot, head j) into out[hd] as fp32. */
static inline void kv_load(const void* pool, const float* scales, int kind, size_t slot, int nkv, int j, int hd,
                           float* out) {
    const size_t off = (slot * nkv + j) * hd;
    if (kind == KV_F32) {
        memcpy(out, (const float*)pool + off, sizeof(float) * hd);
    } else if (kind == KV_F16) {
        const uint16_t* s = (const uint16_t*)pool + off;
        int i = 0;
#if defined(__F16C__)
        for (; i + 8 <= hd; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
        for (; i < hd; i++) out[i] = f16_to_f32(s[i]);
    } else if (kind == KV_BF16) {
        const uint16_t* s = (const uint16_t*)pool + off;
        for (int i = 0; i < hd; i++) out[i] = bf16_to_f32(s[i]);
    } else {
        const int8_t* s = (const int8_t*)pool + off;
        const float sc = scales[slot * nkv + j];
        for (int i = 0; i < hd; i++) out[i] = (float)s[i] * sc;
    }
}

/* Row (slot, head j) as fp32: a pointer into an fp32 pool, else converted into buf[hd]. */
static inline const float* kv_row(const void* pool, const float* scales, int kind, size_t slot, int nkv, int j,
                                  int hd, float* buf) {
    if (kind == KV_F32) return (const float*)pool + (slot * nkv + j) * hd;
    kv_load(pool, scales, kind, slot, nkv, j, hd, buf);
    return buf;
}

/* exp(x) from IEEE multiplies and adds only (no libm, no FMA: the library is built with
 * -ffp-contract=off), so every CPU and OS rounds it alike, and gcc vectorizes the loops that call it.
 * x = n ln2 + r (n = round(x / ln2) by the 1.5 * 2^23 trick, ln2 split in two so n ln2 is exact),
 * exp(r) by a degree-6 Taylor polynomial in Horner form (|r| <= ln2 / 2: relative error ~2e-7), times
 * 2^n built in the exponent bits. x < -87.3 gives 0, x > 88.7 gives +inf. */
static inline float exp_ieee(float x) {
    const float magic = 12582912.0f;
    x = x < -87.33654f ? -87.33654f : x > 88.72283f ? 88.72283f : x;
    const float nf = (x * 1.44269504f + magic) - magic;
    const float r = (x - nf * 0.693145752f) - nf * 1.42860677e-06f;
    float p = 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t n = (int32_t)nf;
    /* 2^n as two factors, so n = 128 (x near 88.7) still builds from valid exponents */
    const int32_t n1 = n >> 1, n2 = n - n1;
    uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    return p * s1 * s2;
}

static inline float dot(const float* a, const float* b, int n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  /* 8 lanes: lets gcc vectorize the dot product */
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float d = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) d += a[i] * b[i];
    return d;
}

/* qkv: [nh*hd | nkv*hd | nkv*hd] for one token at position pos. kv_store_token applies rotate-half RoPE
 * (cos/sin rows of length hd) to its k and writes k and v into the paged cache at pos; attend_head then
 * attends one query head h over positions 0..pos of its KV head (h / (nh / nkv)), and attend_rows the
 * query heads of one KV head for the rows of one sequence (a token and its drafts), reading and converting
 * each K and V row once for all of them (fp16 rows of 64, the default cache). Each (row, query head) gets
 * the same operations whoever runs it and whichever of the two does, so the threads may split a step's
 * units any way. Rows are prefetched ahead (between layers the GEMVs evict the
 * cache). nh * hd <= 8192, hd <= 512. */
static void kv_store_token(const float* qkv, int nh, int nkv, int hd, const float* cos_row, const float* sin_row,
                           const paged_kv* kv, int pos) {
    const int half = hd / 2;
    const float* v = qkv + (nh + nkv) * hd;
    const size_t wslot = kv_slot(kv, pos);
    float row[512];
    for (int j = 0; j < nkv; j++) {  /* k with RoPE, v as is, into the cache */
        const float* k = qkv + (nh + j) * hd;
        for (int i = 0; i < half; i++) {
            row[i] = k[i] * cos_row[i] - k[i + half] * sin_row[i];
            row[i + half] = k[i + half] * cos_row[i + half] + k[i] * sin_row[i + half];
        }
        kv_store(kv->k, kv->ks, kv->kind, kv->rotated, wslot, nkv, j, hd, row);
        kv_store(kv->v, kv->vs, kv->kind, kv->rotated, wslot, nkv, j, hd, v + j * hd);
    }
}

#define KV_PREFETCH 6 /* rows ahead */

static inline void kv_prefetch(const void* pool, int kind, size_t slot, int nkv, int j, int hd) {
    const size_t bytes = kind == KV_F32 ? 4 : kind == KV_I8 ? 1 : 2;
    const char* p = (const char*)pool + (slot * nkv + j) * hd * bytes;
    for (size_t o = 0; o < hd * bytes; o += 64) __builtin_prefetch(p + o);
}

#define MAX_QUERIES 64 /* queries per shared attention pass (attend_queries_f16_64) */

#if defined(__AVX2__) && defined(__F16C__)
/* exp_ieee on 8 lanes: the same IEEE operations in the same order (the clamps as max / min: no NaN here) */
static inline __m256 exp8_ieee(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
    const __m256 nf = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), magic), magic);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(nf, _mm256_set1_ps(0.693145752f))),
                                   _mm256_mul_ps(nf, _mm256_set1_ps(1.42860677e-06f)));
    __m256 p = _mm256_set1_ps(1.38888889e-3f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.33333333e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.16666667e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.66666667e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    const __m256i n = _mm256_cvttps_epi32(nf), n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* sc[0..n) <- exp(sc - max) (8 lanes at a time, then the rest); returns 1 / their sum, added in order */
static inline float softmax_exp(float* sc, int n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int s = 0;
    for (; s + 8 <= n; s += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sc + s));
    float m8[8], mx = -INFINITY, sum = 0.0f;
    _mm256_storeu_ps(m8, mv);
    for (int i = 0; i < 8; i++) mx = m8[i] > mx ? m8[i] : mx;
    for (; s < n; s++) mx = sc[s] > mx ? sc[s] : mx;
    const __m256 mxv = _mm256_set1_ps(mx);
    for (s = 0; s + 8 <= n; s += 8) _mm256_storeu_ps(sc + s, exp8_ieee(_mm256_sub_ps(_mm256_loadu_ps(sc + s), mxv)));
    for (; s < n; s++) sc[s] = exp_ieee(sc[s] - mx);
    for (s = 0; s < n; s++) sum += sc[s];
    return 1.0f / sum;
}

/* Attention for Q queries of KV head j at once, fp16 rows of 64 (query i over positions 0..n[i]-1; kv's block table
 * covers the largest n): the query heads of one KV head, and the rows of one sequence (a token and its
 * drafts: the same positions up to the earlier row's), so every 8 positions' K rows, then V rows, are
 * read and converted to fp32 once into L1 for all of them instead of once per query (at a few hundred
 * tokens of context those reads, not the arithmetic, set attention's cost). Each query gets attend_head_hd's
 * operations in its order, so its bits do not depend on the queries it shares a pass with: 8 scores at a
 * time with dot()'s tree (hadd and cross-lane steps: ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))),
 * positions past its last whole 8 by dot(), softmax_exp's exps (exp_ieee's operations on 8 lanes), then
 * its probabilities times V in position order. q: Q prepared queries of 64; sc[i], out[i]: query i's
 * scores (n[i]) and output (64). */
static void attend_queries_f16_64(const float* q, int Q, const int* n, const paged_kv* kv, int nkv, int j,
                                  float* const* sc, float* const* out) {
    float buf[8][64] __attribute__((aligned(32)));
    int nmax = 0;
    for (int i = 0; i < Q; i++) nmax = n[i] > nmax ? n[i] : nmax;
#define ROW(p, s) ((p) + (kv_slot(kv, (s)) * nkv + j) * 64)
#define LOAD(pool, s0, cnt)                                                                               \
    for (int i = 0; i < (cnt); i++) {                                                                    \
        const uint16_t* r = ROW(pool, (s0) + i);                                                         \
        if ((s0) + i + 8 < nmax) { const char* pf = (const char*)ROW(pool, (s0) + i + 8); __builtin_prefetch(pf); __builtin_prefetch(pf + 64); } \
        for (int c = 0; c < 8; c++) _mm256_store_ps(buf[i] + 8 * c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(r + 8 * c)))); \
    }
    const uint16_t* kp = (const uint16_t*)kv->k;
    for (int s = 0; s < nmax; s += 8) {
        const int cnt = nmax - s < 8 ? nmax - s : 8;
        LOAD(kp, s, cnt)
        for (int g = 0; g < Q; g++) {
            const float* qg = q + 64 * g;
            if (n[g] >= s + 8) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int c = 0; c < 8; c++)
                        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_load_ps(buf[i] + 8 * c)));
                    a[i] = acc;
                }
                const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
                _mm256_storeu_ps(sc[g] + s, _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31)));
            } else {
                for (int i = 0; s + i < n[g]; i++) sc[g][s + i] = dot(qg, buf[i], 64);
            }
        }
    }
    float inv[MAX_QUERIES];
    for (int g = 0; g < Q; g++) {
        inv[g] = softmax_exp(sc[g], n[g]);
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(out[g] + 8 * c, _mm256_setzero_ps());
    }
    const uint16_t* vp = (const uint16_t*)kv->v;
    for (int s = 0; s < nmax; s += 8) {
        const int cnt = nmax - s < 8 ? nmax - s : 8;
        LOAD(vp, s, cnt)
        for (int g = 0; g < Q; g++) {
            const int cg = n[g] - s < cnt ? n[g] - s : cnt;
            if (cg <= 0) continue;
            __m256 o[8];
            for (int c = 0; c < 8; c++) o[c] = _mm256_loadu_ps(out[g] + 8 * c);
            for (int i = 0; i < cg; i++) {
                const __m256 pv = _mm256_set1_ps(sc[g][s + i] * inv[g]);
                for (int c = 0; c < 8; c++) o[c] = _mm256_add_ps(o[c], _mm256_mul_ps(pv, _mm256_load_ps(buf[i] + 8 * c)));
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(out[g] + 8 * c, o[c]);
        }
    }
#undef LOAD
#undef ROW
}
#endif

/* Query head qs[hd] with RoPE, scaled, in the stored basis. */
static inline __attribute__((always_inline)) void prepare_query(const float* qs, const int HD, const float* cos_row,
                                                                 const float* sin_row, float scale, int rotated,
                                                                 float* q) {
    const int half = HD / 2;
    for (int i = 0; i < half; i++) {
        q[i] = (qs[i] * cos_row[i] - qs[i + half] * sin_row[i]) * scale;
        q[i + half] = (qs[i + half] * cos_row[i + half] + qs[i] * sin_row[i + half]) * scale;
    }
    if (rotated) hadamard_rotate(q, HD);
}

/* scores sc[pos + 1] (scratch), out[hd]; HD: hd as a compile-time constant where it is 64. */
static inline __attribute__((always_inline)) void attend_head_hd(const float* qkv, int nh, int nkv, const int HD,
                                                                  const float* cos_row, const float* sin_row,
                                                                  const paged_kv* kv, int pos, float scale, int h,
                                                                  float* out, float* sc) {
    const int j = h / (nh / nkv), n = pos + 1;
    float row[512], q[512], o[512];
    prepare_query(qkv + h * HD, HD, cos_row, sin_row, scale, kv->rotated, q);
    for (int s = 0; s < n; s++) {
        const size_t slot = kv_slot(kv, s);
        if (s + KV_PREFETCH < n) kv_prefetch(kv->k, kv->kind, kv_slot(kv, s + KV_PREFETCH), nkv, j, HD);
        sc[s] = dot(q, kv_row(kv->k, kv->ks, kv->kind, slot, nkv, j, HD, row), HD);
    }
    float mx = -INFINITY, sum = 0.0f;
    for (int s = 0; s < n; s++) mx = sc[s] > mx ? sc[s] : mx;
    for (int s = 0; s < n; s++) sc[s] = exp_ieee(sc[s] - mx);
    for (int s = 0; s < n; s++) sum += sc[s];
    const float inv = 1.0f / sum;
    for (int i = 0; i < HD; i++) o[i] = 0.0f;
    for (int s = 0; s < n; s++) {  /* probabilities times V */
        const size_t slot = kv_slot(kv, s);
        if (s + KV_PREFETCH < n) kv_prefetch(kv->v, kv->kind, kv_slot(kv, s + KV_PREFETCH), nkv, j, HD);
        const float* vr = kv_row(kv->v, kv->vs, kv->kind, slot, nkv, j, HD, row);
        const float p = sc[s] * inv;
        for (int i = 0; i < HD; i++) o[i] += p * vr[i];
    }
    if (kv->rotated) hadamard_rotate(o, HD);  /* back to the model's basis */
    memcpy(out, o, sizeof(float) * HD);
}

static void attend_head(const float* qkv, int nh, int nkv, int hd, const float* cos_row, const float* sin_row,
                        const paged_kv* kv, int pos, float scale, int h, float* out, float* sc) {
    if (hd == 64)
        attend_head_hd(qkv, nh, nkv, 64, cos_row, sin_row, kv, pos, scale, h, out, sc);
    else
        attend_head_hd(qkv, nh, nkv, hd, cos_row, sin_row, kv, pos, scale, h, out, sc);
}

/* Whether attend_rows serves this cache: fp16 rows of 64 (the default) and whole query groups that fit
 * one pass (nh / nkv <= MAX_QUERIES), on a build with the AVX2 kernels. */
static int group_attention(const int* dims) {
#if defined(__AVX2__) && defined(__F16C__)
    const int nh = dims[1], nkv = dims[2];
    return dims[3] == 64 && dims[8] == KV_F16 && nh % nkv == 0 && nh / nkv <= MAX_QUERIES;
#else
    (void)dims;
    return 0;
#endif
}

/* Query heads g0..g1-1 of KV head j for rows m0..m0+R-1 of one sequence (group_attention true) in one
 * attend_queries_f16_64 pass; kv: the last row's (its block table covers every row's positions). The
 * same bits per (row, head) as attend_head. attn, scores: the step's [M][nh * 64] and [M][nh][score_stride]. */
static void attend_rows(const float* qkv, int n_qkv, int nh, int nkv, const float** cos_rows, const float** sin_rows,
                        const int* pos, int m0, int R, int g0, int g1, const paged_kv* kv, float scale, int j,
                        float* attn, float* scores, size_t n_scores, size_t score_stride) {
#if defined(__AVX2__) && defined(__F16C__)
    const int G = nh / nkv;
    float q[MAX_QUERIES * 64] __attribute__((aligned(32)));
    float* scs[MAX_QUERIES];
    float* outs[MAX_QUERIES];
    int n[MAX_QUERIES], Q = 0;
    for (int m = m0; m < m0 + R; m++)
        for (int g = g0; g < g1; g++, Q++) {
            const int h = j * G + g;
            prepare_query(qkv + (size_t)m * n_qkv + h * 64, 64, cos_rows[m], sin_rows[m], scale, kv->rotated,
                          q + 64 * Q);
            scs[Q] = scores + (size_t)m * n_scores + (size_t)h * score_stride;
            outs[Q] = attn + ((size_t)m * nh + h) * 64;
            n[Q] = pos[m] + 1;
        }
    attend_queries_f16_64(q, Q, n, kv, nkv, j, scs, outs);
#else
    (void)qkv; (void)n_qkv; (void)nh; (void)nkv; (void)cos_rows; (void)sin_rows; (void)pos; (void)m0; (void)R;
    (void)g0; (void)g1; (void)kv; (void)scale; (void)j; (void)attn; (void)scores; (void)n_scores; (void)score_stride;
#endif
}

/* Rows of the step that attend together (attend_rows): runs of consecutive positions of one sequence (a
 * token and its drafts: row m continues row m - 1's run when its position is the next one and its block
 * table agrees on every block row m - 1 reads), cut every `most` rows. Returns the number of parts. */
static int attention_parts(int M, const int* pos, const int* tables, int table_stride, int bs, int one_sequence,
                           int most, int* part0, int* partn) {
    int np = 0;
    for (int m = 0; m < M; m++) {
        const int same = m > 0 && pos[m] == pos[m - 1] + 1 && partn[np - 1] < most &&
                         (one_sequence || !memcmp(tables + (size_t)(m - 1) * table_stride,
                                                  tables + (size_t)m * table_stride,
                                                  sizeof(int) * (size_t)(pos[m - 1] / bs + 1)));
        if (same) {
            partn[np - 1]++;
        } else {
            part0[np] = m;
            partn[np++] = 1;
        }
    }
    return np;
}

/* Where thread t's share of the attention units (part, query head), in order, starts: the shares are cut
 * by cost, each unit weighing its part's rows times the keys its last row reads (plus a unit's fixed
 * work), so rows at long positions do not leave one thread waiting for another at the barrier (batch
 * rows' positions differ widely). Which thread computes a unit never changes its bits. t == T: the end. */
static int unit_split(int nparts, int nh, const int* part0, const int* partn, const int* pos, int t, int T) {
    if (t <= 0) return 0;
    if (t >= T) return nparts * nh;
    int64_t total = 0;
    for (int p = 0; p < nparts; p++) total += (int64_t)partn[p] * (pos[part0[p] + partn[p] - 1] + 1) + 32;
    const int64_t target = total * nh * t / T;
    int64_t acc = 0;
    for (int u = 0; u < nparts * nh; u++) {
        if (acc >= target) return u;
        const int p = u / nh;
        acc += (int64_t)partn[p] * (pos[part0[p] + partn[p] - 1] + 1) + 32;
    }
    return nparts * nh;
}

/* ---- one parallel region per step: a team of threads and its barrier ----------------------------- */

extern int qgemm_team(const uint8_t*, int, int, int, int, const float*, int, float*, void*, int, int,
                      void (*)(void*), void*);
extern size_t qgemm_workspace(int, int);
extern int gemv_team(const uint8_t*, int, int, int, const float*, int, float*, void*, int, int, void (*)(void*),
                     void*);

#include "team_barrier.h"

/* y = x @ W.T for this thread's share. kind: a kind code, plus 16 for cpu_qgemm's packed layout;
 * arith 0: fp32 activations (cpu_gemv.c, the exact path), 1: 8-bit activations (cpu_qgemm.c). */
static int team_gemm(int kind, int arith, const uint8_t* w, int N, int K, const float* x, int M, float* y,
                     void* ws, int t, team_barrier* b) {
    if (arith) return qgemm_team(w, kind & 15, kind >= 16, N, K, x, M, y, ws, t, b->n, team_sync, b);
    if (kind >= 16) return -3;
    return gemv_team(w, kind, N, K, x, M, y, ws, t, b->n, team_sync, b);
}

/* Elements [i0, i1) of one row's silu(gate) * up (gate_up: [gate | up]). */
static void silu_mul_range(const float* gate_up, int hidden, float* out, int i0, int i1) {
    int i = i0;
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= i1; i += 8) {  /* silu's operations on 8 lanes */
        const __m256 g = _mm256_loadu_ps(gate_up + i);
        const __m256 e = exp8_ieee(_mm256_xor_ps(g, sign));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(gate_up + hidden + i)));
    }
#endif
    for (; i < i1; i++) {
        const float g = gate_up[i];
        out[i] = g / (1.0f + exp_ieee(-g)) * gate_up[hidden + i];
    }
}

/* ---- the whole stack of layers for one step in one call ------------------------------------ */

/* Layer l's cache as row m sees it: its sequence's block table (tables + m * table_stride) and, for a draft
 * tree's node (bases[m] >= 0), its path's slots. */
static inline paged_kv row_kv(void** kv_pools, int l, const int* dims, const int* tables, int table_stride,
                              const int* tails, int tail_stride, const int* bases, int m) {
    const int tree = tails && bases[m] >= 0;
    const paged_kv kv = {kv_pools[4 * l], kv_pools[4 * l + 1], (float*)kv_pools[4 * l + 2],
                         (float*)kv_pools[4 * l + 3], tables + (size_t)m * table_stride, dims[7], dims[8], dims[9],
                         tree ? tails + (size_t)m * tail_stride : NULL, tree ? bases[m] : 0};
    return kv;
}

/* dims: dim, nh, nkv, hd, hidden, max_pos, num_threads, block_size, kv_kind, rotated, arith. Per l, w[4 l + j]
 * and kinds[4 l + j] for j = qkv, o, gate_up, down (raw GGUF rows, kind codes as gguf_dequantize's, plus 16
 * for cpu_qgemm's packed layout); norms[2 l + j] for j = attn, ffn; kv_pools[4 l + j] for j = k pool,
 * v pool, k scales, v scales (scales NULL unless int8). M tokens, each of its own sequence: token m is at
 * position pos[m], its sequence's block table is tables + m * table_stride, its RoPE rows cos_rows[m] and
 * sin_rows[m]. x [M, dim] is the residual stream, updated in place (the last layer's MLP output is
 * added). Every row goes through exactly the operations of a one-token step (the GEMMs compute each row
 * on its own; attention is a unit per (row, query head)), so a token's result does not depend on what
 * else is in the batch, nor on the number of threads.
 * The whole step is one OpenMP region: the threads split each phase and meet at team_sync barriers;
 * row m's norms are computed by thread m % T, the thread that quantizes it for the next GEMM.
 * scratch: at least M * (dim * 3 + (nh + 2 nkv) hd + nh hd + 3 hidden + nh (max_pos + 1)) floats.
 * Returns 0, the failing GEMM's rc, or -2 when out of memory. */
static int layers(int n_layers, int M, const int* dims, float eps, float scale, const uint8_t** w,
                  const int* kinds, const float** norms, void** kv_pools, const int* tables,
                  int table_stride, const int* pos, const float** cos_rows, const float** sin_rows,
                  float* x, float* scratch, int one_sequence, const int* tails, int tail_stride,
                  const int* bases) {
    const int dim = dims[0], nh = dims[1], nkv = dims[2], hd = dims[3], hidden = dims[4];
    const int max_pos = dims[5], nt = dims[6] > 1 ? dims[6] : 1, arith = dims[10];
    const int n_qkv = (nh + 2 * nkv) * hd;
    const size_t n_scores = (size_t)nh * (max_pos + 1);
    const int group_mode = group_attention(dims), G = nh / nkv;
    const int stride = one_sequence ? 0 : table_stride;  /* one sequence: every row reads `tables` */
    int* part0 = malloc(sizeof(int) * 2 * (size_t)M);
    if (!part0) return -2;
    int* partn = part0 + M;
    const int nparts = attention_parts(M, pos, tables, table_stride, dims[7], one_sequence,
                                       G <= MAX_QUERIES ? MAX_QUERIES / G : 1, part0, partn);
    float* normed = scratch;
    float* qkv = normed + (size_t)M * dim;
    float* attn = qkv + (size_t)M * n_qkv;
    float* o = attn + (size_t)M * nh * hd;
    float* gu = o + (size_t)M * dim;
    float* act = gu + (size_t)M * 2 * hidden;
    float* down = act + (size_t)M * hidden;
    float* scores = down + (size_t)M * dim;
    const int kmax = dim > hidden ? (dim > nh * hd ? dim : nh * hd) : (hidden > nh * hd ? hidden : nh * hd);
    size_t wsb = arith ? qgemm_workspace(kmax, M) : sizeof(float) * (size_t)M * (kmax / 32);
    void* ws = aligned_alloc(64, (wsb + 63) / 64 * 64);
    if (!ws) {
        free(part0);
        return -2;
    }
    team_barrier bar;
    team_barrier_init(&bar, 1);
    int rc_all = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = team_enter(&bar);
        const int T = bar.n;
        int rc = 0;
        for (int l = 0; l < n_layers && !rc; l++) {
            const uint8_t** lw = w + 4 * l;
            const int* lk = kinds + 4 * l;
            for (int m = t; m < M; m += T)
                decode_add_rmsnorm(x + (size_t)m * dim, l ? down + (size_t)m * dim : 0, norms[2 * l], dim, eps,
                                   normed + (size_t)m * dim);
            if ((rc = team_gemm(lk[0], arith, lw[0], n_qkv, dim, normed, M, qkv, ws, t, &bar))) break;
            team_sync(&bar);
            /* every row's k/v first (for one sequence, later rows attend to them), then attention */
            for (int m = t; m < M; m += T) {
                const paged_kv kv = row_kv(kv_pools, l, dims, tables, stride, tails, tail_stride, bases, m);
                kv_store_token(qkv + (size_t)m * n_qkv, nh, nkv, hd, cos_rows[m], sin_rows[m], &kv, pos[m]);
            }
            team_sync(&bar);
            /* units: (part, query head) in order; a thread's consecutive units of one part and one KV head
             * are one attend_rows pass (each K and V row read once for all of them); the same bits per
             * (row, head) however the units fall. Other caches: (row, query head) units, attend_head. */
            if (group_mode) {
                const int U = nparts * nh, u1 = unit_split(nparts, nh, part0, partn, pos, t + 1, T);
                for (int u = unit_split(nparts, nh, part0, partn, pos, t, T); u < u1;) {
                    const int p = u / nh, h = u % nh, j = h / G;
                    const int end = u1 < p * nh + (j + 1) * G ? u1 : p * nh + (j + 1) * G;
                    const int last = part0[p] + partn[p] - 1;
                    const paged_kv kv = row_kv(kv_pools, l, dims, tables, stride, tails, tail_stride, bases, last);
                    attend_rows(qkv, n_qkv, nh, nkv, cos_rows, sin_rows, pos, part0[p], partn[p], h - j * G,
                                end - p * nh - j * G, &kv, scale, j, attn, scores, n_scores, (size_t)max_pos + 1);
                    u = end;
                }
            } else {
                for (int u = M * nh * t / T; u < M * nh * (t + 1) / T; u++) {
                    const int m = u / nh, h = u % nh;
                    const paged_kv kv = row_kv(kv_pools, l, dims, tables, stride, tails, tail_stride, bases, m);
                    attend_head(qkv + (size_t)m * n_qkv, nh, nkv, hd, cos_rows[m], sin_rows[m], &kv, pos[m], scale,
                                h, attn + ((size_t)m * nh + h) * hd,
                                scores + (size_t)m * n_scores + (size_t)h * (max_pos + 1));
                }
            }
            team_sync(&bar);
            if ((rc = team_gemm(lk[1], arith, lw[1], dim, nh * hd, attn, M, o, ws, t, &bar))) break;
            team_sync(&bar);
            for (int m = t; m < M; m += T)
                decode_add_rmsnorm(x + (size_t)m * dim, o + (size_t)m * dim, norms[2 * l + 1], dim, eps,
                                   normed + (size_t)m * dim);
            if ((rc = team_gemm(lk[2], arith, lw[2], 2 * hidden, dim, normed, M, gu, ws, t, &bar))) break;
            team_sync(&bar);
            const int i0 = hidden / 8 * t / T * 8, i1 = t == T - 1 ? hidden : hidden / 8 * (t + 1) / T * 8;
            for (int m = 0; m < M; m++)
                silu_mul_range(gu + (size_t)m * 2 * hidden, hidden, act + (size_t)m * hidden, i0, i1);
            team_sync(&bar);
            if ((rc = team_gemm(lk[3], arith, lw[3], dim, hidden, act, M, down, ws, t, &bar))) break;
            team_sync(&bar);
        }
        if (!rc)
            for (int m = t; m < M; m += T)
                for (int i = 0; i < dim; i++) x[(size_t)m * dim + i] += down[(size_t)m * dim + i];
        if (t == 0) rc_all = rc;
    }
    free(ws);
    free(part0);
    return rc_all;
}

int decode_layers_batch(int n_layers, int M, const int* dims, float eps, float scale, const uint8_t** w,
                        const int* kinds, const float** norms, void** kv_pools, const int* tables,
                        int table_stride, const int* pos, const float** cos_rows, const float** sin_rows,
                        float* x, float* scratch) {
    return layers(n_layers, M, dims, eps, scale, w, kinds, norms, kv_pools, tables, table_stride, pos, cos_rows,
                  sin_rows, x, scratch, 0, NULL, 0, NULL);
}

/* M consecutive tokens of ONE sequence (speculative verification): token m at position pos[0] + m, all
 * with the block table `table`. Each layer stores every row's k/v before any row attends, and row m
 * attends over positions 0..pos[m] only (causal), so row m's result equals the one-token step at its
 * position bit for bit: the same operations in the same order. pos: M positions, consecutive. */
int decode_layers_chunk(int n_layers, int M, const int* dims, float eps, float scale, const uint8_t** w,
                        const int* kinds, const float** norms, void** kv_pools, const int* table,
                        const int* pos, const float** cos_rows, const float** sin_rows, float* x, float* scratch) {
    return layers(n_layers, M, dims, eps, scale, w, kinds, norms, kv_pools, table, 0, pos, cos_rows, sin_rows,
                  x, scratch, 1, NULL, 0, NULL);
}

/* decode_layers_batch with draft trees (tree attention): a row m with bases[m] >= 0 is a tree node of its
 * sequence, at position pos[m] = bases[m] + its depth (its RoPE); its K/V go to slot
 * tails[m * tail_stride + depth], its own, and the entries before are its ancestors' slots, the tree's root
 * (at bases[m]) first. It attends over positions 0..bases[m] - 1 of its table, then its ancestors and
 * itself, in position order: the one-token step's operations on the same values, so the row equals that
 * step after its path, bit for bit. Rows with bases[m] < 0 are plain. A tree's nodes come in depth-first
 * order (a node's first child right after it), so a run of rows one deeper each is one path and attends in
 * one pass. */
int decode_layers_batch_tree(int n_layers, int M, const int* dims, float eps, float scale, const uint8_t** w,
                             const int* kinds, const float** norms, void** kv_pools, const int* tables,
                             int table_stride, const int* pos, const float** cos_rows, const float** sin_rows,
                             float* x, float* scratch, const int* tails, int tail_stride, const int* bases) {
    return layers(n_layers, M, dims, eps, scale, w, kinds, norms, kv_pools, tables, table_stride, pos, cos_rows,
                  sin_rows, x, scratch, 0, tails, tail_stride, bases);
}

/* One token: decode_layers_batch with M = 1 (dims[5] is its position; table its block table). */
int decode_layers(int n_layers, const int* dims, float eps, float scale, const uint8_t** w, const int* kinds,
                  const float** norms, void** kv_pools, const int* table, const float* cos_row,
                  const float* sin_row, float* x, float* scratch) {
    return decode_layers_batch(n_layers, 1, dims, eps, scale, w, kinds, norms, kv_pools, table, 0, dims + 5,
                               &cos_row, &sin_row, x, scratch);
}

/* Test hook: store n rows x[n, nkv, hd] into the given slots of one pool pair's K side, as the decode
 * step does (tests compare the bytes with torch's PagedKVCache.write). */
void decode_kv_store_rows(void* pool, float* scales, int kind, int rotated, const int64_t* slots, int n, int nkv,
                          int hd, const float* x) {
    for (int t = 0; t < n; t++)
        for (int j = 0; j < nkv; j++)
            kv_store(pool, scales, kind, rotated, (size_t)slots[t], nkv, j, hd, x + ((size_t)t * nkv + j) * hd);
}

/* out[m] = the index of row m's largest value (x [M, N] fp32), as torch.argmax: the first one on ties,
 * and the first NaN if the row has one. The engine's greedy tokens for a whole step in one call. */
/* team_gemm for any number of rows: cpu_gemv's fp32-activation GEMV takes 8 rows a call, so more go in runs of
 * 8 (the runs share ws: each is waited for before the next). */
static int team_gemm_rows(int kind, int arith, const uint8_t* w, int N, int K, const float* x, int M, float* y,
                          void* ws, int t, team_barrier* b) {
    if (arith) return team_gemm(kind, arith, w, N, K, x, M, y, ws, t, b);
    int rc = 0;
    for (int r = 0; r < M && !rc; r += 8) {
        rc = team_gemm(kind, arith, w, N, K, x + (size_t)r * K, M - r < 8 ? M - r : 8, y + (size_t)r * N, ws, t, b);
        if (r + 8 < M) team_sync(b);
    }
    return rc;
}

/* A draft head's input for F rows, in a team (mtp_head_step, attn_head_chain): the model's features h [F, parts *
 * dim] fused when parts > 1 (each part normed with its gain g_f, then W_f), then z = W_in [rms(h) g_h | rms(e) g_e].
 * u [F, parts * dim], hf [F, dim], a [F, 2 dim]: scratch. Returns a GEMV's rc. */
static int team_head_input(int F, int dim, int parts, float eps, int kind, int arith, const uint8_t* w_f,
                           const uint8_t* w_in, const float* g_f, const float* g_h, const float* g_e, const float* h,
                           const float* e, float* u, float* hf, float* a, float* z, void* ws, int t, team_barrier* bar) {
    const int T = bar->n;
    int rc = 0;
    if (parts > 1) {
        for (int f = t; f < F; f += T)
            for (int p = 0; p < parts; p++)
                decode_add_rmsnorm((float*)h + ((size_t)f * parts + p) * dim, NULL, g_f + (size_t)p * dim, dim, eps,
                                   u + ((size_t)f * parts + p) * dim);
        team_sync(bar);
        rc = team_gemm_rows(kind, arith, w_f, dim, parts * dim, u, F, hf, ws, t, bar);
        team_sync(bar);
        h = hf;
    }
    if (rc) return rc;
    for (int f = t; f < F; f += T) {
        decode_add_rmsnorm((float*)h + (size_t)f * dim, NULL, g_h, dim, eps, a + (size_t)f * 2 * dim);
        decode_add_rmsnorm((float*)e + (size_t)f * dim, NULL, g_e, dim, eps, a + (size_t)f * 2 * dim + dim);
    }
    team_sync(bar);
    rc = team_gemm_rows(kind, arith, w_in, dim, 2 * dim, a, F, z, ws, t, bar);
    team_sync(bar);
    return rc;
}

/* ---- one draft step of an MTP head (edge_runtime/spec/mtp.py: MtpHead.forward, then its draft logits) ----
 * F rows (F <= 8) in one parallel region, the GEMVs of team_gemm (the arithmetic of Q8Head's per-call GEMVs)
 * and decode_add_rmsnorm's norms. dims: dim, hidden, n_vocab, parts (1 + the number of tapped layers; 1: no
 * fusion), num_threads, the weights' kind code (+ 16: cpu_qgemm's packed layout) and arith (0: fp32
 * activations, cpu_gemv.c; 1: 8-bit activations, cpu_qgemm.c). w: w_f (unused when parts == 1), w_in,
 * w_gate_up, w_down, the draft vocabulary's rows. g: g_f [parts * dim], g_h, g_e, g_m, g_o [dim].
 * h [F, parts * dim]: the features; e [F, dim]: the chosen tokens' embeddings. Out: state [F, dim] (the next
 * step's h) and logits [F, n_vocab]. Returns 0, a GEMV's rc (-1: bad shapes), or -2 out of memory. */
int mtp_head_step(int F, const int* dims, float eps, const uint8_t** w, const float** g, const float* h,
                  const float* e, float* state, float* logits) {
    const int dim = dims[0], hidden = dims[1], n_vocab = dims[2], parts = dims[3], nt = dims[4] > 1 ? dims[4] : 1;
    const int kind = dims[5], arith = dims[6];
    if (F < 1 || F > 8 || parts < 1 || dim % 32 || hidden % 32) return -1;
    const int kmax = parts * dim > 2 * dim ? (parts * dim > hidden ? parts * dim : hidden)
                                           : (2 * dim > hidden ? 2 * dim : hidden);
    const size_t n = (size_t)F * ((size_t)parts * dim + 2 * dim + 3 * dim + 3 * (size_t)hidden);
    float* buf = aligned_alloc(64, (sizeof(float) * n + 63) / 64 * 64);
    if (!buf) return -2;
    float* u = buf;                                  /* [F, parts * dim]: the normed features */
    float* a = u + (size_t)F * parts * dim;          /* [F, 2 dim]: [rms(h) g_h | rms(e) g_e] */
    float* hf = a + (size_t)F * 2 * dim;             /* [F, dim]: the fused features */
    float* z = hf + (size_t)F * dim;                 /* [F, dim]: the residual */
    float* dn = z + (size_t)F * dim;                 /* [F, dim]: the MLP's output */
    float* gu = dn + (size_t)F * dim;                /* [F, 2 hidden] */
    float* act = gu + (size_t)F * 2 * hidden;        /* [F, hidden] */
    const size_t wsb = arith ? qgemm_workspace(kmax, F) : sizeof(float) * (size_t)F * (kmax / 32);
    void* ws = aligned_alloc(64, (wsb + 63) / 64 * 64);
    if (!ws) {
        free(buf);
        return -2;
    }
    team_barrier bar;
    team_barrier_init(&bar, 1);
    int rc_all = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = team_enter(&bar), T = bar.n;
        int rc = team_head_input(F, dim, parts, eps, kind, arith, w[0], w[1], g[0], g[1], g[2], h, e, u, hf, a, z, ws, t,
                                 &bar);
        if (!rc) {
            for (int f = t; f < F; f += T) decode_add_rmsnorm(z + (size_t)f * dim, NULL, g[3], dim, eps, u + (size_t)f * dim);
            team_sync(&bar);
            rc = team_gemm(kind, arith, w[2], 2 * hidden, dim, u, F, gu, ws, t, &bar);
            team_sync(&bar);
        }
        if (!rc) {
            const int i0 = hidden / 8 * t / T * 8, i1 = t == T - 1 ? hidden : hidden / 8 * (t + 1) / T * 8;
            for (int f = 0; f < F; f++) silu_mul_range(gu + (size_t)f * 2 * hidden, hidden, act + (size_t)f * hidden, i0, i1);
            team_sync(&bar);
            rc = team_gemm(kind, arith, w[3], dim, hidden, act, F, dn, ws, t, &bar);
            team_sync(&bar);
        }
        if (!rc) {
            for (int f = t; f < F; f += T)
                decode_add_rmsnorm(z + (size_t)f * dim, dn + (size_t)f * dim, g[4], dim, eps, state + (size_t)f * dim);
            team_sync(&bar);
            rc = team_gemm(kind, arith, w[4], n_vocab, dim, state, F, logits, ws, t, &bar);
        }
        if (t == 0) rc_all = rc;
    }
    free(ws);
    free(buf);
    return rc_all;
}

void rows_argmax(const float* x, int M, int N, int64_t* out);

/* q [hd] and k [hd] of one head rotated to position pos (rotate-half RoPE, pairs (i, i + hd/2), angle
 * pos * freqs[i], the order of spec/attn_head.py's rope). */
static void rope_pair(float* x, int hd, const float* freqs, int pos) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const float ang = (float)pos * freqs[i], c = cosf(ang), s = sinf(ang), a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

/* One head's attention for one query q [hd] over `runs` runs of keys and values (run r: k[r], v[r], count[r]
 * rows of hd floats one after another), in that order: scores scaled, softmax with exp_ieee (every build: no
 * AVX2 needed), out [hd] the weighted sum. sc: scratch for the scores (the runs' total). */
static void attend_runs(const float* q, int hd, float scale, int runs, const float* const* k, const float* const* v,
                        const int* count, float* sc, float* out) {
    int keys = 0;
    for (int r = 0; r < runs; r++)
        for (int p = 0; p < count[r]; p++) sc[keys++] = dot(q, k[r] + (size_t)p * hd, hd) * scale;
    float mx = -INFINITY, sum = 0.0f;
    for (int p = 0; p < keys; p++) mx = sc[p] > mx ? sc[p] : mx;
    for (int p = 0; p < keys; p++) sum += (sc[p] = exp_ieee(sc[p] - mx));
    const float inv = 1.0f / sum;
    for (int i = 0; i < hd; i++) out[i] = 0.0f;
    for (int r = 0, p = 0; r < runs; r++)
        for (int e = 0; e < count[r]; e++, p++) {
            const float pr = sc[p] * inv, *vr = v[r] + (size_t)e * hd;
            for (int i = 0; i < hd; i++) out[i] += pr * vr[i];
        }
}

/* A draft head call's scratch: `floats` fp32 values and the GEMV workspace for `rows` rows of at most kmax
 * inputs (arith: cpu_qgemm's 8-bit activations, else cpu_gemv's). Returns 0, or -2 with nothing held. */
static int head_scratch(size_t floats, int kmax, int rows, int arith, float** buf, void** ws) {
    *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    const size_t wsb = arith ? qgemm_workspace(kmax, rows) : sizeof(float) * (size_t)rows * (kmax / 32);
    *ws = aligned_alloc(64, (wsb + 63) / 64 * 64);
    if (*buf && *ws) return 0;
    free(*buf);
    free(*ws);
    return -2;
}

#define MAX_TEAM 256 /* threads a draft head's call runs on at most */

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The attention draft head (edge_runtime/spec/attn_drafter.py) for B answers in one call, as mtp_head_step is
 * the MLP heads': every answer's rows fed since its last chain go into its key/value cache, then each answer's
 * chain of drafts, the answers' steps s side by side (each matrix once a step for all of them: its weights are
 * read once, not B times). Answer b (meta[4 b ..]: n, m, k, cap): its m <= 8 rows (the model's features, hrows:
 * a pointer to each row's parts * dim floats, and their tokens' embeddings, erows: to each one's dim floats; the
 * answers' rows one after another, pointers so that the caller gathers nothing) go into its cache (kcs[b], vcs[b]: [heads, cap, head_dim]) at positions n..n+m-1; its chain of k drafts starts at
 * the last of them (m = 0: at zlasts[b], the last position's fused input, kept from the call before; k = 0: the
 * rows alone). Step s >= 1 reads the previous step's state and the embedding of its draft (emb_rows [n_vocab,
 * dim]) at position n + m - 1 + s; its key and value go to cache slot n + m + s - 1, past the answer's (scratch:
 * the next call overwrites them). dims: dim, heads, head_dim, hidden, n_vocab, parts, threads, the weights' kind
 * code (+ 16: packed), arith, kmax (the row stride of drafts and probs, >= every k). w: w_f, w_in, w_qkv, w_o,
 * w_gate_up, w_down, the draft vocabulary's rows. g: g_f, g_h, g_e, g_a, g_m, g_o. freqs [head_dim / 2]: RoPE's.
 * Out: drafts [B, kmax] (rows of the draft vocabulary), probs [B, kmax]: each draft's probability under the head
 * (its softmax over the draft vocabulary), made [B], zlasts, seconds [2]: the rows' part and the chains' (the
 * planner prices a draft step by the chains': the rows go in whatever k is). A chain stops early, after the
 * step where the product of its drafts' probabilities falls below `floor` (0: never): a draft that unlikely
 * to be reached cannot pay for its row (draft_planner.DraftPlanner.floor). The GEMVs are team_gemm's, the
 * norms decode_add_rmsnorm's, the attention fp32 (dot, exp_ieee): the drafts agree with the torch reference's
 * to float rounding. Returns 0, a GEMV's rc (< 0), -1 (bad shapes) or -2 (memory). */
int attn_head_chains(int B, const int* dims, const int* meta, float eps, float scale, const uint8_t** w,
                     const float** g, const float* const* hrows, const float* const* erows, float** kcs, float** vcs,
                     float** zlasts,
                     const float* freqs, const float* emb_rows, float floor_p, int* drafts, float* probs, int* made,
                     double* seconds) {
    const double t0 = seconds_now();
    double t_rows = t0;
    const int dim = dims[0], H = dims[1], hd = dims[2], hidden = dims[3], n_vocab = dims[4], parts = dims[5];
    const int nt = dims[6] > 1 ? dims[6] : 1, kind = dims[7], arith = dims[8], kmax = dims[9], qd = H * hd;
    if (B < 1 || B > 64 || kmax < 0 || parts < 1 || dim % 32 || hidden % 32 || qd % 32 || hd % 2) return -1;
    int R = 0, P = 0, keys = 1;                      /* rows fed; rows with a query (a chain's start each) */
    for (int b = 0; b < B; b++) {
        const int n = meta[4 * b], m = meta[4 * b + 1], k = meta[4 * b + 2], cap = meta[4 * b + 3];
        if (m < 0 || m > 8 || k < 0 || k > kmax || n < 0 || n + m < 1 || n + m + k - 1 > cap || (m == 0 && n < 1))
            return -1;
        R += m;
        P += m > 0 ? m : 1;
        keys = n + m + k > keys ? n + m + k : keys;
    }
    int kw = parts * dim > 2 * dim ? parts * dim : 2 * dim;
    kw = kw > hidden ? kw : hidden;
    kw = kw > qd ? kw : qd;
    const int T0 = nt < MAX_TEAM ? nt : MAX_TEAM;
    const size_t nf = (size_t)R * (2 * (size_t)parts * dim + 5 * dim) + (size_t)P * (2 * dim + 3 * (size_t)qd)
                      + (size_t)B * (7 * (size_t)dim + 4 * (size_t)qd + 3 * (size_t)hidden + n_vocab + (size_t)H * keys
                                     + T0);
    float* buf;
    void* ws;
    if (head_scratch(nf, kw, P, arith, &buf, &ws)) return -2;
    float* u = buf;                                  /* [R, parts * dim]: the normed features */
    float* a = u + (size_t)R * parts * dim;          /* [max(R, B), 2 dim]: [rms(h) g_h | rms(e) g_e] */
    float* hf = a + (size_t)(R > B ? R : B) * 2 * dim; /* [R, dim]: the fused features */
    float* zr = hf + (size_t)R * dim;                /* [R, dim]: the rows' fused inputs */
    float* z = zr + (size_t)R * dim;                 /* [P, dim]: the layer's inputs, a chain's start among them */
    float* xq = z + (size_t)P * dim;                 /* [P, dim]: rms(z) g_a */
    float* qkv = xq + (size_t)P * dim;               /* [P, 3 qd] */
    float* zc = qkv + (size_t)P * 3 * qd;            /* [B, dim]: each chain's input (the residual) */
    float* q = zc + (size_t)B * dim;                 /* [B, 3 qd]: its query, key, value */
    float* att = q + (size_t)B * 3 * qd;             /* [B, qd]: the heads' outputs */
    float* o = att + (size_t)B * qd;                 /* [B, dim] */
    float* xm = o + (size_t)B * dim;                 /* [B, dim]: rms(z + o) g_m */
    float* dn = xm + (size_t)B * dim;                /* [B, dim] */
    float* gu = dn + (size_t)B * dim;                /* [B, 2 hidden] */
    float* act = gu + (size_t)B * 2 * hidden;        /* [B, hidden] */
    float* state = act + (size_t)B * hidden;         /* [B, dim]: a step's output */
    float* logits = state + (size_t)B * dim;         /* [B, n_vocab] */
    float* sc = logits + (size_t)B * n_vocab;        /* [B, H, keys]: scores */
    float* part = sc + (size_t)B * H * keys;         /* [B, threads]: shares of each softmax's sum */
    float* h = part + (size_t)B * T0;                /* [R, parts * dim]: the rows' features, gathered */
    float* e = h + (size_t)R * parts * dim;          /* [R, dim]: their tokens' embeddings, gathered */
    int live[64], fill[64], first[64];               /* the chains still drafting (answer b), rows before b */
    double reached[64];                              /* each chain's product of its drafts' probabilities */
    for (int b = 0, r = 0, p = 0; b < B; b++) {
        fill[b] = r;
        first[b] = p;
        r += meta[4 * b + 1];
        p += meta[4 * b + 1] > 0 ? meta[4 * b + 1] : 1;
        made[b] = 0;
        reached[b] = 1.0;
    }
    team_barrier bar;
    team_barrier_init(&bar, 1);
    int rc_all = 0;
    volatile int F = 0;                              /* how many chains go on (live[0..F-1]): thread 0's */
#pragma omp parallel num_threads(T0) if (T0 > 1)
    {
        const int t = team_enter(&bar), T = bar.n;
        int rc = 0;
        for (int r = t; r < R; r += T) {             /* the rows, from wherever the caller keeps them */
            memcpy(h + (size_t)r * parts * dim, hrows[r], sizeof(float) * parts * dim);
            memcpy(e + (size_t)r * dim, erows[r], sizeof(float) * dim);
        }
        team_sync(&bar);
        if (R > 0)
            rc = team_head_input(R, dim, parts, eps, kind, arith, w[0], w[1], g[0], g[1], g[2], h, e, u, hf, a, zr, ws,
                                 t, &bar);
        for (int b = t; b < B && !rc; b += T) {      /* each answer's inputs: its rows', or its last position's */
            const int m = meta[4 * b + 1];
            memcpy(z + (size_t)first[b] * dim, m ? zr + (size_t)fill[b] * dim : zlasts[b], sizeof(float) * dim * (m ? m : 1));
        }
        team_sync(&bar);
        for (int p = t; p < P && !rc; p += T) decode_add_rmsnorm(z + (size_t)p * dim, NULL, g[3], dim, eps, xq + (size_t)p * dim);
        team_sync(&bar);
        if (!rc) rc = team_gemm_rows(kind, arith, w[2], 3 * qd, dim, xq, P, qkv, ws, t, &bar);
        team_sync(&bar);
        for (int b = 0, i = 0; b < B && !rc; b++)    /* rotated keys and values into the caches (a row each) */
            for (int f = 0; f < meta[4 * b + 1]; f++, i++) {
                if (i % T != t) continue;
                const int n = meta[4 * b], cap = meta[4 * b + 3];
                const float* r = qkv + (size_t)(first[b] + f) * 3 * qd;
                for (int j = 0; j < H; j++) {
                    float* kr = kcs[b] + ((size_t)j * cap + n + f) * hd;
                    memcpy(kr, r + qd + (size_t)j * hd, sizeof(float) * hd);
                    rope_pair(kr, hd, freqs, n + f);
                    memcpy(vcs[b] + ((size_t)j * cap + n + f) * hd, r + 2 * qd + (size_t)j * hd, sizeof(float) * hd);
                }
            }
        if (t == 0 && !rc) {                         /* the chains start at each answer's last position */
            for (int b = 0; b < B; b++) {
                const int n = meta[4 * b], m = meta[4 * b + 1], last = first[b] + (m ? m - 1 : 0);
                memcpy(zlasts[b], z + (size_t)last * dim, sizeof(float) * dim);
                if (!meta[4 * b + 2]) continue;
                memcpy(zc + (size_t)F * dim, z + (size_t)last * dim, sizeof(float) * dim);
                memcpy(q + (size_t)F * 3 * qd, qkv + (size_t)last * 3 * qd, sizeof(float) * 3 * qd);
                for (int j = 0; j < H; j++) rope_pair(q + (size_t)F * 3 * qd + (size_t)j * hd, hd, freqs, n + m - 1);
                live[F] = b;
                F = F + 1;
            }
            t_rows = seconds_now();
        }
        team_sync(&bar);
        for (int s = 0; F > 0 && !rc; s++) {
            const int nf_ = F;
            if (s) { /* each chain's previous state and its draft at position N - 1 + s: fused, query, key, value */
                for (int f = t; f < nf_; f += T) {
                    decode_add_rmsnorm(state + (size_t)f * dim, NULL, g[1], dim, eps, a + (size_t)f * 2 * dim);
                    decode_add_rmsnorm((float*)emb_rows + (size_t)drafts[live[f] * kmax + s - 1] * dim, NULL, g[2], dim,
                                       eps, a + (size_t)f * 2 * dim + dim);
                }
                team_sync(&bar);
                rc = team_gemm_rows(kind, arith, w[1], dim, 2 * dim, a, nf_, zc, ws, t, &bar);
                team_sync(&bar);
                for (int f = t; f < nf_; f += T) decode_add_rmsnorm(zc + (size_t)f * dim, NULL, g[3], dim, eps, xq + (size_t)f * dim);
                team_sync(&bar);
                if (!rc) rc = team_gemm_rows(kind, arith, w[2], 3 * qd, dim, xq, nf_, q, ws, t, &bar);
                team_sync(&bar);
                for (int fj = t; fj < nf_ * H && !rc; fj += T) {
                    const int f = fj / H, j = fj % H, b = live[f], N = meta[4 * b] + meta[4 * b + 1];
                    const int cap = meta[4 * b + 3];
                    float* qf = q + (size_t)f * 3 * qd;
                    float* kr = kcs[b] + ((size_t)j * cap + N + s - 1) * hd;
                    rope_pair(qf + (size_t)j * hd, hd, freqs, N - 1 + s);
                    memcpy(kr, qf + qd + (size_t)j * hd, sizeof(float) * hd);
                    rope_pair(kr, hd, freqs, N - 1 + s);
                    memcpy(vcs[b] + ((size_t)j * cap + N + s - 1) * hd, qf + 2 * qd + (size_t)j * hd, sizeof(float) * hd);
                }
                team_sync(&bar);
            }
            for (int fj = t; fj < nf_ * H && !rc; fj += T) { /* chain f, head j: its answer's keys and its own */
                const int f = fj / H, j = fj % H, b = live[f], cap = meta[4 * b + 3];
                const float* kv[2] = {kcs[b] + (size_t)j * cap * hd, vcs[b] + (size_t)j * cap * hd};
                const int count = meta[4 * b] + meta[4 * b + 1] + s;
                attend_runs(q + (size_t)f * 3 * qd + (size_t)j * hd, hd, scale, 1, &kv[0], &kv[1], &count,
                            sc + (size_t)fj * keys, att + (size_t)f * qd + (size_t)j * hd);
            }
            team_sync(&bar);
            if (!rc) rc = team_gemm_rows(kind, arith, w[3], dim, qd, att, nf_, o, ws, t, &bar);
            team_sync(&bar);
            for (int f = t; f < nf_ && !rc; f += T) { /* o = z + W_o attn: the residual after attention */
                float* of = o + (size_t)f * dim;
                for (int i = 0; i < dim; i++) of[i] += zc[(size_t)f * dim + i];
                decode_add_rmsnorm(of, NULL, g[4], dim, eps, xm + (size_t)f * dim);
            }
            team_sync(&bar);
            if (!rc) rc = team_gemm_rows(kind, arith, w[4], 2 * hidden, dim, xm, nf_, gu, ws, t, &bar);
            team_sync(&bar);
            if (!rc) {
                const int i0 = hidden / 8 * t / T * 8, i1 = t == T - 1 ? hidden : hidden / 8 * (t + 1) / T * 8;
                for (int f = 0; f < nf_; f++)
                    silu_mul_range(gu + (size_t)f * 2 * hidden, hidden, act + (size_t)f * hidden, i0, i1);
            }
            team_sync(&bar);
            if (!rc) rc = team_gemm_rows(kind, arith, w[5], dim, hidden, act, nf_, dn, ws, t, &bar);
            team_sync(&bar);
            for (int f = t; f < nf_ && !rc; f += T)
                decode_add_rmsnorm(o + (size_t)f * dim, dn + (size_t)f * dim, g[5], dim, eps, state + (size_t)f * dim);
            team_sync(&bar);
            if (!rc) rc = team_gemm_rows(kind, arith, w[6], n_vocab, dim, state, nf_, logits, ws, t, &bar);
            team_sync(&bar);
            for (int f = t; f < nf_ && !rc; f += T) {
                int64_t best;
                rows_argmax(logits + (size_t)f * n_vocab, 1, n_vocab, &best);
                drafts[live[f] * kmax + s] = (int)best;
            }
            team_sync(&bar);
            if (!rc) { /* each draft's probability: 1 / sum(exp(logit - its logit)), each thread a share */
                const int i0 = (int)((int64_t)n_vocab * t / T), i1 = (int)((int64_t)n_vocab * (t + 1) / T);
                for (int f = 0; f < nf_; f++) {
                    const float* lf = logits + (size_t)f * n_vocab;
                    const float top = lf[drafts[live[f] * kmax + s]];
                    float sum = 0.0f;
                    for (int i = i0; i < i1; i++) sum += exp_ieee(lf[i] - top);
                    part[(size_t)f * T + t] = sum;
                }
            }
            team_sync(&bar);
            if (t == 0 && !rc) { /* the probabilities; the chains that go on keep their states, in order */
                int kept = 0;
                for (int f = 0; f < nf_; f++) {
                    const int b = live[f];
                    float sum = 0.0f;
                    for (int u2 = 0; u2 < T; u2++) sum += part[(size_t)f * T + u2];
                    probs[b * kmax + s] = 1.0f / sum;
                    reached[b] *= probs[b * kmax + s];
                    made[b] = s + 1;
                    if (reached[b] < floor_p || s + 1 >= meta[4 * b + 2]) continue;
                    if (kept != f) memcpy(state + (size_t)kept * dim, state + (size_t)f * dim, sizeof(float) * dim);
                    live[kept++] = b;
                }
                F = kept;
            }
            team_sync(&bar);
        }
        if (t == 0) rc_all = rc;
    }
    free(ws);
    free(buf);
    seconds[0] = t_rows - t0;
    seconds[1] = seconds_now() - t_rows;
    return rc_all;
}

void rows_argmax(const float* x, int M, int N, int64_t* out) {
    for (int m = 0; m < M; m++) {
        const float* r = x + (size_t)m * N;
        int best = 0, i = 0;
#if defined(__AVX2__)
        if (N >= 8) { /* the maximum (any NaN makes the row take the scalar search below) */
            __m256 mx = _mm256_loadu_ps(r), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
            for (i = 8; i + 8 <= N; i += 8) {
                const __m256 v = _mm256_loadu_ps(r + i);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                mx = _mm256_max_ps(mx, v);
            }
            float lanes[8], top;
            _mm256_storeu_ps(lanes, mx);
            top = lanes[0];
            for (int l = 1; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
            for (int k = i; k < N; k++) top = r[k] > top ? r[k] : top;
            if (!_mm256_movemask_ps(nan)) {
                int k = 0;
                const __m256 t = _mm256_set1_ps(top);
                for (; k + 8 <= N; k += 8) {
                    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + k), t, _CMP_EQ_OQ));
                    if (hit) break;
                }
                while (k < N && !(r[k] == top) && !(r[k] != r[k])) k++;
                if (k < N && !(r[k] != r[k])) {
                    out[m] = k;
                    continue;
                }
            }
            i = 0;
        }
#endif
        float top = r[0];
        if (top != top) {
            out[m] = 0;
            continue;
        }
        for (i = 1; i < N; i++) {
            if (r[i] != r[i]) {
                best = i;
                break;
            }
            if (r[i] > top) {
                top = r[i];
                best = i;
            }
        }
        out[m] = best;
    }
}

/* One level of a draft tree grown from the attention head (edge_runtime/spec/attn_drafter.py: tree_step):
 * attn_head_chain's step s for F frontier nodes at once (F <= 8). root (dims[12] = 1, F = 1, s = 0): the
 * chain's step 0, from zlast (the last fed row's fused input) at position n - 1 over the answer's n keys.
 * Otherwise node f fuses its parent's state h [F, dim] with its token's embedding e [F, dim]; its query, key
 * and value sit at position n + s (s: the keys on its parent's path below the root); it attends over the
 * answer's keys (kc, vc [H, cap, head_dim], the first n), its parent's path (pk, pv [F, H, s, head_dim]) and
 * its own key, in that order (the chain's), and its rotated key and value go out in knew, vnew [F, H,
 * head_dim]. Out: state [F, dim] and the draft vocabulary's logits [F, n_vocab]. dims: dim, heads, head_dim,
 * hidden, n_vocab, threads, the weights' kind code (+ 16: packed), arith, n, F, s, cap, root. w: w_in, w_qkv,
 * w_o, w_gate_up, w_down, the draft vocabulary's rows (attn_head_chain's w[1..6]); g: g_h, g_e, g_a, g_m, g_o.
 * Returns 0, a GEMV's rc, -1 (bad shapes) or -2 (memory). */
int attn_head_tree_level(const int* dims, float eps, float scale, const uint8_t** w, const float** g,
                         const float* h, const float* e, const float* zlast, const float* kc, const float* vc,
                         const float* pk, const float* pv, const float* freqs, float* knew, float* vnew,
                         float* state, float* logits) {
    const int dim = dims[0], H = dims[1], hd = dims[2], hidden = dims[3], n_vocab = dims[4];
    const int nt = dims[5] > 1 ? dims[5] : 1, kind = dims[6], arith = dims[7], n = dims[8], F = dims[9];
    const int s = dims[10], cap = dims[11], root = dims[12], qd = H * hd, keys = root ? n : n + s + 1;
    if (F < 1 || F > 8 || n < 1 || n > cap || s < 0 || (root && (F != 1 || s)) || dim % 32 || hidden % 32
        || qd % 32 || hd % 2)
        return -1;
    int kmax = 2 * dim > hidden ? 2 * dim : hidden;
    kmax = kmax > qd ? kmax : qd;
    const size_t nf = (size_t)F * (7 * (size_t)dim + 4 * (size_t)qd + 3 * (size_t)hidden) + (size_t)F * H * keys;
    float* buf;
    void* ws;
    if (head_scratch(nf, kmax, F, arith, &buf, &ws)) return -2;
    float* a = buf;                                  /* [F, 2 dim]: [rms(h) g_h | rms(e) g_e] */
    float* z = a + (size_t)F * 2 * dim;              /* [F, dim]: the layer's input (the residual) */
    float* xq = z + (size_t)F * dim;                 /* [F, dim]: rms(z) g_a */
    float* qkv = xq + (size_t)F * dim;               /* [F, 3 qd] */
    float* att = qkv + (size_t)F * 3 * qd;           /* [F, qd]: the heads' outputs */
    float* o = att + (size_t)F * qd;                 /* [F, dim] */
    float* xm = o + (size_t)F * dim;                 /* [F, dim]: rms(z + o) g_m */
    float* dn = xm + (size_t)F * dim;                /* [F, dim] */
    float* gu = dn + (size_t)F * dim;                /* [F, 2 hidden] */
    float* act = gu + (size_t)F * 2 * hidden;        /* [F, hidden] */
    float* sc = act + (size_t)F * hidden;            /* [F, H, keys]: scores */
    const int pos = root ? n - 1 : n + s;
    team_barrier bar;
    team_barrier_init(&bar, 1);
    int rc_all = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int t = team_enter(&bar), T = bar.n;
        int rc = 0;
        if (root) {
            if (t == 0) memcpy(z, zlast, sizeof(float) * dim);
        } else {
            for (int f = t; f < F; f += T) {
                decode_add_rmsnorm((float*)h + (size_t)f * dim, NULL, g[0], dim, eps, a + (size_t)f * 2 * dim);
                decode_add_rmsnorm((float*)e + (size_t)f * dim, NULL, g[1], dim, eps, a + (size_t)f * 2 * dim + dim);
            }
            team_sync(&bar);
            rc = team_gemm(kind, arith, w[0], dim, 2 * dim, a, F, z, ws, t, &bar);
        }
        team_sync(&bar);
        for (int f = t; f < F && !rc; f += T) decode_add_rmsnorm(z + (size_t)f * dim, NULL, g[2], dim, eps, xq + (size_t)f * dim);
        team_sync(&bar);
        if (!rc) rc = team_gemm(kind, arith, w[1], 3 * qd, dim, xq, F, qkv, ws, t, &bar);
        team_sync(&bar);
        for (int fj = t; fj < F * H && !rc; fj += T) { /* queries and the nodes' own keys, rotated */
            const int f = fj / H, j = fj % H;
            float* q = qkv + (size_t)f * 3 * qd + (size_t)j * hd;
            rope_pair(q, hd, freqs, pos);
            if (!root) {
                float* kr = knew + (size_t)fj * hd;
                memcpy(kr, q + qd, sizeof(float) * hd);
                rope_pair(kr, hd, freqs, pos);
                memcpy(vnew + (size_t)fj * hd, q + 2 * qd, sizeof(float) * hd);
            }
        }
        team_sync(&bar);
        for (int fj = t; fj < F * H && !rc; fj += T) { /* node f, head j: the answer's keys, its path's, its own */
            const int f = fj / H, j = fj % H;
            const float* ks[3] = {kc + (size_t)j * cap * hd, pk + (size_t)fj * s * hd, knew + (size_t)fj * hd};
            const float* vs[3] = {vc + (size_t)j * cap * hd, pv + (size_t)fj * s * hd, vnew + (size_t)fj * hd};
            const int count[3] = {n, s, 1};
            attend_runs(qkv + (size_t)f * 3 * qd + (size_t)j * hd, hd, scale, root ? 1 : 3, ks, vs, count,
                        sc + (size_t)fj * keys, att + (size_t)f * qd + (size_t)j * hd);
        }
        team_sync(&bar);
        if (!rc) rc = team_gemm(kind, arith, w[2], dim, qd, att, F, o, ws, t, &bar);
        team_sync(&bar);
        for (int f = t; f < F && !rc; f += T) { /* o = z + W_o attn: the residual after attention */
            float* of = o + (size_t)f * dim;
            for (int i = 0; i < dim; i++) of[i] += z[(size_t)f * dim + i];
            decode_add_rmsnorm(of, NULL, g[3], dim, eps, xm + (size_t)f * dim);
        }
        team_sync(&bar);
        if (!rc) rc = team_gemm(kind, arith, w[3], 2 * hidden, dim, xm, F, gu, ws, t, &bar);
        team_sync(&bar);
        if (!rc) {
            const int i0 = hidden / 8 * t / T * 8, i1 = t == T - 1 ? hidden : hidden / 8 * (t + 1) / T * 8;
            for (int f = 0; f < F; f++) silu_mul_range(gu + (size_t)f * 2 * hidden, hidden, act + (size_t)f * hidden, i0, i1);
        }
        team_sync(&bar);
        if (!rc) rc = team_gemm(kind, arith, w[4], dim, hidden, act, F, dn, ws, t, &bar);
        team_sync(&bar);
        for (int f = t; f < F && !rc; f += T)
            decode_add_rmsnorm(o + (size_t)f * dim, dn + (size_t)f * dim, g[4], dim, eps, state + (size_t)f * dim);
        team_sync(&bar);
        if (!rc) rc = team_gemm(kind, arith, w[5], n_vocab, dim, state, F, logits, ws, t, &bar);
        if (t == 0) rc_all = rc;
    }
    free(ws);
    free(buf);
    return rc_all;
}
