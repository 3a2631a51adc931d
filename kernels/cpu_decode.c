/* The small per-layer operations of a one-token decode step, fused in C.
 *
 * Between the four GEMVs of a layer, torch runs ~15 tiny ops (norms, RoPE, the KV write,
 * grouped attention, SiLU): a few microseconds of math each, but ~8 ms of dispatch per
 * token on this CPU. These functions do the same fp32 math, and decode_layers runs every
 * layer of a token in one call. Built into
 * the same library as cpu_gemv.c (see cpu_gemv.py); the torch code in
 * edge_runtime/model.py is the reference they are tested against. Single-threaded: the
 * work is too small to split.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* qkv: [nh*hd | nkv*hd | nkv*hd] for one token at position pos. Applies rotate-half RoPE
 * (cos/sin rows of length hd) to q and k, writes k and v into the caches
 * ([nkv, n_ctx, hd]), and attends every query head over positions 0..pos of its KV head
 * (query head h uses KV head h / (nh / nkv)). out: [nh * hd]. scores: scratch [pos + 1]. */
void decode_rope_attend(const float* qkv, int nh, int nkv, int hd, const float* cos_row, const float* sin_row,
                        float* k_cache, float* v_cache, int pos, int n_ctx, float scale, float* out, float* scores) {
    const int half = hd / 2, group = nh / nkv;
    const float* v = qkv + (nh + nkv) * hd;
    for (int j = 0; j < nkv; j++) {  /* k with RoPE, v as is, into the caches */
        const float* k = qkv + (nh + j) * hd;
        float* kc = k_cache + ((size_t)j * n_ctx + pos) * hd;
        float* vc = v_cache + ((size_t)j * n_ctx + pos) * hd;
        for (int i = 0; i < half; i++) {
            kc[i] = k[i] * cos_row[i] - k[i + half] * sin_row[i];
            kc[i + half] = k[i + half] * cos_row[i + half] + k[i] * sin_row[i + half];
        }
        memcpy(vc, v + j * hd, sizeof(float) * hd);
    }
    float q[512];
    for (int h = 0; h < nh; h++) {
        const float* qs = qkv + h * hd;
        for (int i = 0; i < half; i++) {
            q[i] = qs[i] * cos_row[i] - qs[i + half] * sin_row[i];
            q[i + half] = qs[i + half] * cos_row[i + half] + qs[i] * sin_row[i + half];
        }
        const int j = h / group;
        const float* kbase = k_cache + (size_t)j * n_ctx * hd;
        const float* vbase = v_cache + (size_t)j * n_ctx * hd;
        float mx = -INFINITY;
        for (int s = 0; s <= pos; s++) {
            const float* kr = kbase + (size_t)s * hd;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  /* 8 lanes: lets gcc vectorize the dot product */
            int i = 0;
            for (; i + 8 <= hd; i += 8)
                for (int l = 0; l < 8; l++) acc[l] += q[i + l] * kr[i + l];
            float dot = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
            for (; i < hd; i++) dot += q[i] * kr[i];
            scores[s] = dot * scale;
            if (scores[s] > mx) mx = scores[s];
        }
        float sum = 0.0f;
        for (int s = 0; s <= pos; s++) { scores[s] = expf(scores[s] - mx); sum += scores[s]; }
        const float inv = 1.0f / sum;
        float* o = out + h * hd;
        for (int i = 0; i < hd; i++) o[i] = 0.0f;
        for (int s = 0; s <= pos; s++) {
            const float p = scores[s] * inv;
            const float* vr = vbase + (size_t)s * hd;
            for (int i = 0; i < hd; i++) o[i] += p * vr[i];
        }
    }
}

/* gate_up: [2 * hidden] = [gate | up]; out[i] = silu(gate[i]) * up[i]. */
void decode_silu_mul(const float* gate_up, int hidden, float* out) {
    for (int i = 0; i < hidden; i++) {
        const float g = gate_up[i];
        out[i] = g / (1.0f + expf(-g)) * gate_up[hidden + i];
    }
}

/* ---- the whole stack of layers for one token in one call ---------------------------------- */

typedef int (*gemv_fn)(const uint8_t*, int, int, const float*, int, float*, int);
extern int q4_0_gemv(const uint8_t*, int, int, const float*, int, float*, int);
extern int q4_1_gemv(const uint8_t*, int, int, const float*, int, float*, int);
extern int q8_0_gemv(const uint8_t*, int, int, const float*, int, float*, int);
extern int q4_k_gemv(const uint8_t*, int, int, const float*, int, float*, int);

static gemv_fn gemv_of(int kind) {
    return kind == 0 ? q4_0_gemv : kind == 1 ? q4_1_gemv : kind == 8 ? q8_0_gemv : kind == 4 ? q4_k_gemv : 0;
}

/* dims: dim, nh, nkv, hd, hidden, n_ctx, pos, num_threads. Per layer l, w[4 l + j] and kinds[4 l + j]
 * for j = qkv, o, gate_up, down (raw GGUF rows, kind codes as gguf_dequantize's); norms[2 l + j] for
 * j = attn, ffn; caches[2 l + j] for j = k, v. x [dim] is the residual stream, updated in place
 * (the last layer's MLP output is added). scratch: at least
 * dim * 3 + (nh + 2 nkv) hd + nh hd + 3 hidden + n_ctx floats. Returns 0, or the failing GEMV's rc. */
int decode_layers(int n_layers, const int* dims, float eps, float scale, const uint8_t** w, const int* kinds,
                  const float** norms, float** caches, const float* cos_row, const float* sin_row,
                  float* x, float* scratch) {
    const int dim = dims[0], nh = dims[1], nkv = dims[2], hd = dims[3], hidden = dims[4];
    const int n_ctx = dims[5], pos = dims[6], nt = dims[7];
    const int n_qkv = (nh + 2 * nkv) * hd;
    float* normed = scratch;
    float* qkv = normed + dim;
    float* attn = qkv + n_qkv;
    float* o = attn + nh * hd;
    float* gu = o + dim;
    float* act = gu + 2 * hidden;
    float* down = act + hidden;
    float* scores = down + dim;
    int rc;
    for (int l = 0; l < n_layers; l++) {
        const uint8_t** lw = w + 4 * l;
        const int* lk = kinds + 4 * l;
        decode_add_rmsnorm(x, l ? down : 0, norms[2 * l], dim, eps, normed);
        if ((rc = gemv_of(lk[0])(lw[0], n_qkv, dim, normed, 1, qkv, nt))) return rc;
        decode_rope_attend(qkv, nh, nkv, hd, cos_row, sin_row, caches[2 * l], caches[2 * l + 1], pos, n_ctx,
                           scale, attn, scores);
        if ((rc = gemv_of(lk[1])(lw[1], dim, nh * hd, attn, 1, o, nt))) return rc;
        decode_add_rmsnorm(x, o, norms[2 * l + 1], dim, eps, normed);
        if ((rc = gemv_of(lk[2])(lw[2], 2 * hidden, dim, normed, 1, gu, nt))) return rc;
        decode_silu_mul(gu, hidden, act);
        if ((rc = gemv_of(lk[3])(lw[3], dim, hidden, act, 1, down, nt))) return rc;
    }
    for (int i = 0; i < dim; i++) x[i] += down[i];
    return 0;
}
