/* The small per-layer operations of a one-token decode step, fused in C.
 *
 * Between the four GEMVs of a layer, torch runs ~15 tiny ops (norms, RoPE, the KV write,
 * grouped attention, SiLU): a few microseconds of math each, but ~8 ms of dispatch per
 * token on this CPU. These functions do the same fp32 math in one call each. Built into
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
