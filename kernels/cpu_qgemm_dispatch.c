/* Run-time choice among the variants of cpu_qgemm.c built into this library.
 *
 * Variants by id: 0 portable, 1 avx2, 2 avxvnni, 3 avx512vnni (x86-64), 4 neon (arm64 with
 * dotprod), 5 amx (avx512vnni plus AMX tile multiplies for two or more rows of x; the OS must grant
 * the tile state, which the support check requests). At load the best one this CPU runs is selected, from what the CPU itself reports
 * (__builtin_cpu_supports on x86-64: cpuid plus the OS's register-state check; getauxval's
 * HWCAP on Linux arm64), so the same build serves every CPU. qgemm_select switches (the
 * EDGE_RUNTIME_ISA override and the tests use it); a variant the CPU cannot run is refused.
 * Every variant gives bit-identical results (see cpu_qgemm.c), so switching changes speed only.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

typedef int (*qgemm_fn)(const uint8_t*, int, int, int, const float*, int, float*, int);
typedef int (*qquant_fn)(const float*, int, int, int8_t*, float*, int32_t*, float*);
typedef int (*qteam_fn)(const uint8_t*, int, int, int, int, const float*, int, float*, void*, int, int,
                        void (*)(void*), void*);
typedef size_t (*qws_fn)(int, int);
#define VARIANT_DECLS(v)                                                                                  \
    extern int qgemm_team_##v(const uint8_t*, int, int, int, int, const float*, int, float*, void*, int, int, \
                              void (*)(void*), void*);                                                   \
    extern size_t qgemm_workspace_##v(int, int);
VARIANT_DECLS(portable)
#if defined(__x86_64__)
VARIANT_DECLS(avx2)
VARIANT_DECLS(avxvnni)
VARIANT_DECLS(avx512vnni)
VARIANT_DECLS(amx)
#endif
#if defined(__aarch64__)
VARIANT_DECLS(neon)
#endif

extern int qgemm_packed_portable(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_portable(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_quantize_portable(const float*, int, int, int8_t*, float*, int32_t*, float*);
#if defined(__x86_64__)
extern int qgemm_packed_avx2(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_packed_avxvnni(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_packed_avx512vnni(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_packed_amx(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_amx(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_quantize_amx(const float*, int, int, int8_t*, float*, int32_t*, float*);
extern int qgemm_avx2(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_avxvnni(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_avx512vnni(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_quantize_avx2(const float*, int, int, int8_t*, float*, int32_t*, float*);
extern int qgemm_quantize_avxvnni(const float*, int, int, int8_t*, float*, int32_t*, float*);
extern int qgemm_quantize_avx512vnni(const float*, int, int, int8_t*, float*, int32_t*, float*);
#endif
#if defined(__aarch64__)
extern int qgemm_packed_neon(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_neon(const uint8_t*, int, int, int, const float*, int, float*, int);
extern int qgemm_quantize_neon(const float*, int, int, int8_t*, float*, int32_t*, float*);
#endif

enum { V_PORTABLE = 0, V_AVX2 = 1, V_AVXVNNI = 2, V_AVX512VNNI = 3, V_NEON = 4, V_AMX = 5, NUM_VARIANTS = 6 };
static const char* const NAMES[NUM_VARIANTS] = {"portable", "avx2", "avxvnni", "avx512vnni", "neon", "amx"};

static qgemm_fn fns[NUM_VARIANTS], packed_fns[NUM_VARIANTS];
static qquant_fn quants[NUM_VARIANTS];
static qteam_fn teams[NUM_VARIANTS];
static qws_fn workspaces[NUM_VARIANTS];
static int current = -1;

#if defined(__x86_64__)
/* AMX-TILE and AMX-INT8 in cpuid, and (Linux) the kernel's grant of the tile data state to this process,
 * asked once: without the grant the first tile instruction faults. */
static int amx_usable(void) {
    static int usable = -1;
    if (usable >= 0) return usable;
    unsigned a, b, c, d;
    usable = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return usable;
#if defined(__linux__)
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18) */
    usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
    return usable;
}
#endif

/* 1 when this library holds variant v and this CPU can run it. */
int qgemm_supported(int v) {
    if (v == V_PORTABLE) return 1;
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (v == V_AVX2) return avx2;
    if (v == V_AVXVNNI) return avx2 && __builtin_cpu_supports("avxvnni");
    if (v == V_AVX512VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    if (v == V_AMX) return qgemm_supported(V_AVX512VNNI) && amx_usable();
#endif
#if defined(__aarch64__)
#if defined(__linux__)
    if (v == V_NEON) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
    if (v == V_NEON) return 1; /* every Apple arm64 core has dotprod */
#endif
#endif
    return 0;
}

int qgemm_best(void);

static void init(void) {
    if (current >= 0) return;
    fns[V_PORTABLE] = qgemm_portable;
    packed_fns[V_PORTABLE] = qgemm_packed_portable;
    quants[V_PORTABLE] = qgemm_quantize_portable;
#define SET_TEAM(id, v) teams[id] = qgemm_team_##v, workspaces[id] = qgemm_workspace_##v
    SET_TEAM(V_PORTABLE, portable);
#if defined(__x86_64__)
    fns[V_AVX2] = qgemm_avx2;
    packed_fns[V_AVX2] = qgemm_packed_avx2;
    packed_fns[V_AVXVNNI] = qgemm_packed_avxvnni;
    packed_fns[V_AVX512VNNI] = qgemm_packed_avx512vnni;
    fns[V_AVXVNNI] = qgemm_avxvnni;
    fns[V_AVX512VNNI] = qgemm_avx512vnni;
    quants[V_AVX2] = qgemm_quantize_avx2;
    quants[V_AVXVNNI] = qgemm_quantize_avxvnni;
    quants[V_AVX512VNNI] = qgemm_quantize_avx512vnni;
    SET_TEAM(V_AVX2, avx2);
    SET_TEAM(V_AVXVNNI, avxvnni);
    SET_TEAM(V_AVX512VNNI, avx512vnni);
    fns[V_AMX] = qgemm_amx;
    packed_fns[V_AMX] = qgemm_packed_amx;
    quants[V_AMX] = qgemm_quantize_amx;
    SET_TEAM(V_AMX, amx);
#endif
#if defined(__aarch64__)
    fns[V_NEON] = qgemm_neon;
    packed_fns[V_NEON] = qgemm_packed_neon;
    quants[V_NEON] = qgemm_quantize_neon;
    SET_TEAM(V_NEON, neon);
#endif
    current = qgemm_best();
}

/* The best variant this library holds and this CPU runs (its id). */
int qgemm_best(void) {
    if (!fns[V_PORTABLE]) init();
    for (int v = NUM_VARIANTS - 1; v > 0; v--)
        if (fns[v] && qgemm_supported(v)) return v;
    return V_PORTABLE;
}

const char* qgemm_variant_name(int v) { return v >= 0 && v < NUM_VARIANTS ? NAMES[v] : ""; }

/* The selected variant's id. */
int qgemm_variant(void) {
    init();
    return current;
}

/* Select variant v; returns 0, or -1 when v is unknown or not runnable here (nothing changes). */
int qgemm_select(int v) {
    init();
    if (v < 0 || v >= NUM_VARIANTS || !fns[v] || !qgemm_supported(v)) return -1;
    current = v;
    return 0;
}

/* y [M, N] = x [M, K] @ W.T through the selected variant (see cpu_qgemm.c). */
int qgemm(const uint8_t* w, int kind, int N, int K, const float* x, int M, float* y, int num_threads) {
    init();
    return fns[current](w, kind, N, K, x, M, y, num_threads);
}

/* The selected variant's team GEMM and its workspace size (see cpu_qgemm.c; the fused decode step runs
 * every GEMM of a step inside one parallel region through these). */
int qgemm_team(const uint8_t* w, int kind, int packed, int N, int K, const float* x, int M, float* y, void* ws,
               int t, int T, void (*sync)(void*), void* ctx) {
    init();
    return teams[current](w, kind, packed, N, K, x, M, y, ws, t, T, sync, ctx);
}

size_t qgemm_workspace(int K, int M) {
    init();
    return workspaces[current](K, M);
}

/* The selected variant's activation quantization (test hook). */
int qgemm_quantize(const float* x, int M, int K, int8_t* q, float* d, int32_t* s, float* sf) {
    init();
    return quants[current](x, M, K, q, d, s, sf);
}

/* 1 when the selected variant has a kernel for the packed layout of `kind`. */
int qgemm_packed_supported(int kind) {
    init();
    return (current == V_AVX2 || current == V_AVXVNNI || current == V_AVX512VNNI || current == V_AMX) &&
           (kind == 0 || kind == 1 || kind == 8);
}

/* y = x @ W.T from W in the packed layout (qgemm_repack); -3 where the selected variant has no such kernel. */
int qgemm_packed(const uint8_t* wp, int kind, int N, int K, const float* x, int M, float* y, int num_threads) {
    init();
    return packed_fns[current](wp, kind, N, K, x, M, y, num_threads);
}

/* Bytes of the packed layout of an [N, K] weight of `kind` (0 when it has none). */
long long qgemm_packed_bytes(int kind, int N, int K) {
    const int tb = kind == 0 ? 144 : kind == 1 ? 160 : kind == 8 ? 272 : 0;
    if (!tb || K % 32 || N < 0) return 0;
    return (long long)((N + 7) / 8) * (K / 32) * tb;
}

/* Raw GGUF rows [N, row_bytes] of Q4_0 (0), Q4_1 (1) or Q8_0 (8) -> the packed layout (see cpu_qgemm.c):
 * tiles of 8 rows (missing rows zero), per tile and block the codes as registers of 4 rows x 2 steps
 * (see tiles_packed in cpu_qgemm.c), then the rows' fp16 d (and m). Returns 0, or -1 for another kind or K % 32. Layout only: no arithmetic. */
int qgemm_repack(const uint8_t* w, int kind, int N, int K, uint8_t* out) {
    const long long total = qgemm_packed_bytes(kind, N, K);
    if (!total) return -1;
    const int nb = K / 32, bytes = kind == 0 ? 18 : kind == 1 ? 20 : 34, tb = kind == 0 ? 144 : kind == 1 ? 160 : 272;
    const int codes = kind == 8 ? 256 : 128, qoff = kind == 1 ? 4 : 2;
    memset(out, 0, (size_t)total);
    for (int n = 0; n < N; n++) {
        const int t = n / 8, r = n % 8;
        for (int b = 0; b < nb; b++) {
            const uint8_t* src = w + ((size_t)n * nb + b) * bytes;
            uint8_t* dst = out + ((size_t)t * nb + b) * tb;
            uint8_t q[32];
            const int R = r / 4, rl = r % 4; /* register (R, j): byte 16 h + 4 rl + i = code 4 (j + 4 h) + i */
            if (kind == 8) {
                memcpy(q, src + 2, 32);
                for (int j = 0; j < 4; j++)
                    for (int h = 0; h < 2; h++) memcpy(dst + 32 * (4 * R + j) + 16 * h + 4 * rl, q + 4 * (j + 4 * h), 4);
            } else {
                for (int i = 0; i < 16; i++) { q[i] = src[qoff + i] & 0xF; q[i + 16] = src[qoff + i] >> 4; }
                for (int j = 0; j < 4; j++)
                    for (int h = 0; h < 2; h++)
                        for (int i = 0; i < 4; i++)
                            dst[32 * j + 16 * h + 4 * rl + i] |= (uint8_t)(q[4 * (j + 4 * h) + i] << (4 * R));
            }
            memcpy(dst + codes + 2 * r, src, 2);                      /* d */
            if (kind == 1) memcpy(dst + codes + 16 + 2 * r, src + 2, 2); /* m */
        }
    }
    return 0;
}
