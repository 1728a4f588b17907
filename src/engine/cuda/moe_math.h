/* engine/cuda/moe_math.h — the router's arithmetic, one definition for the GPU kernel (moe.cu)
 * and its CPU twin (tests/test_cuda_moe.c), so the two give the same bits: an exp built only from
 * correctly rounded operations (fmaf, one product, one sum, rintf, a power of two set by bits)
 * and the routing of one token in the CPU engine's order (engine/cpu/moe.c: softmax as max,
 * exp(l - max) summed in expert order, each divided by the sum, or deepseek2's sigmoid; the
 * selection bias and group-limited choice where the model has them; the top k largest first, the
 * lower expert index on a tie; the k weights divided by their sum when norm, scaled). Every
 * product and sum is written as its own rounded operation: nvcc contracts a*b+c into an FMA unless
 * told not to, the C side builds with -ffp-contract=off. */
#ifndef KVB_MOE_MATH_H
#define KVB_MOE_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define KVB_MOE_HD __host__ __device__ __forceinline__
#else
#define KVB_MOE_HD static inline
#endif

#if defined(__CUDA_ARCH__)
#define KVB_MOE_MUL(a, b) __fmul_rn((a), (b))
#define KVB_MOE_ADD(a, b) __fadd_rn((a), (b))
#define KVB_MOE_DIV(a, b) __fdiv_rn((a), (b))
#define KVB_MOE_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define KVB_MOE_MUL(a, b) ((a) * (b))
#define KVB_MOE_ADD(a, b) ((a) + (b))
#define KVB_MOE_DIV(a, b) ((a) / (b))
#define KVB_MOE_FMA(a, b, c) fmaf((a), (b), (c))
#endif

/* exp(x) within about 2 ulp for x in [-87, 88]; 0 below (a softmax term under 1e-38 of the
 * largest one), x above 88 taken as 88. Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, and a
 * degree-6 polynomial (Cephes' expf coefficients), then times 2^k. */
KVB_MOE_HD float kvb_moe_expf(float x) {
    if (!(x >= -87.0f)) return 0.0f; /* NaN too */
    if (x > 88.0f) x = 88.0f;
    const float k = rintf(KVB_MOE_MUL(x, 1.44269504088896341f));
    float r = KVB_MOE_FMA(-k, 0.693359375f, x);
    r = KVB_MOE_FMA(-k, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = KVB_MOE_FMA(p, r, 1.3981999507e-3f);
    p = KVB_MOE_FMA(p, r, 8.3334519073e-3f);
    p = KVB_MOE_FMA(p, r, 4.1665795894e-2f);
    p = KVB_MOE_FMA(p, r, 1.6666665459e-1f);
    p = KVB_MOE_FMA(p, r, 5.0000001201e-1f);
    float y = KVB_MOE_FMA(p, KVB_MOE_MUL(r, r), r);
    y = KVB_MOE_ADD(y, 1.0f);
    const int32_t ki = (int32_t)k; /* -126 .. 127 for x in [-87, 88] */
    const uint32_t bits = (uint32_t)(ki + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return KVB_MOE_MUL(y, scale);
}

/* How a model routes (the CPU engine's route_task, engine/cpu/moe.c): softmax or (deepseek2) sigmoid
 * probabilities; the top k by selection score (the probability, plus a per-expert selection bias
 * where the layer has one, DeepSeek-V3's exp_probs_b), over the n_groups_used best of n_groups
 * groups only when n_groups > 1 (a group's score: its two best experts' scores summed, largest
 * first, the lower group on a tie); the chosen experts' unbiased probabilities as weights, divided
 * by their sum (clamped below at 2^-14, as llama.cpp does) when norm, times scale unless scale is
 * 0 or 1. gating takes kvb_model.h's numbers (KVB_GATING_SOFTMAX 1, KVB_GATING_SIGMOID 2). */
#define KVB_MOE_MAX_GROUPS 64
typedef struct {
    int gating;
    int norm;
    float scale;
    int n_groups, n_groups_used;
} kvb_moe_route_cfg;

/* One token with cfg: p (X) holds its router logits and receives the probabilities; sc (X) the
 * selection scores (may be p itself only when there is no bias and no groups); bias (X) or NULL;
 * sel (K) and w (K) the chosen experts and their weights. */
KVB_MOE_HD void kvb_moe_route_one_cfg(float *p, float *sc, const float *bias, int X, int K, const kvb_moe_route_cfg *c,
                                      int32_t *sel, float *w) {
    if (c->gating == 2) {
        for (int x = 0; x < X; x++) p[x] = KVB_MOE_DIV(1.0f, KVB_MOE_ADD(1.0f, kvb_moe_expf(-p[x])));
    } else {
        float mx = p[0];
        for (int x = 1; x < X; x++) mx = p[x] > mx ? p[x] : mx;
        float sum = 0.0f;
        for (int x = 0; x < X; x++) {
            p[x] = kvb_moe_expf(KVB_MOE_ADD(p[x], -mx));
            sum = KVB_MOE_ADD(sum, p[x]);
        }
        for (int x = 0; x < X; x++) p[x] = KVB_MOE_DIV(p[x], sum);
    }
    if (sc != p)
        for (int x = 0; x < X; x++) sc[x] = bias ? KVB_MOE_ADD(p[x], bias[x]) : p[x];
    if (c->n_groups > 1) { /* every expert of a group not among the best n_groups_used gets -inf */
        const int G = c->n_groups, per = X / c->n_groups;
        float gs[KVB_MOE_MAX_GROUPS];
        uint64_t keep = 0;
        for (int g = 0; g < G; g++) {
            const float *s = sc + g * per;
            int a = 0, b = -1;
            for (int i = 1; i < per; i++)
                if (s[i] > s[a]) a = i;
            for (int i = 0; i < per; i++)
                if (i != a && (b < 0 || s[i] > s[b])) b = i;
            gs[g] = KVB_MOE_ADD(s[a], s[b]);
        }
        for (int k = 0; k < c->n_groups_used; k++) {
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!((keep >> g) & 1) && (best < 0 || gs[g] > gs[best])) best = g;
            keep |= (uint64_t)1 << best;
        }
        for (int g = 0; g < G; g++)
            if (!((keep >> g) & 1))
                for (int i = 0; i < per; i++) sc[g * per + i] = -INFINITY;
    }
    float wsum = 0.0f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int x = 0; x < X; x++) {
            int taken = 0;
            for (int i = 0; i < k; i++) taken |= sel[i] == x;
            if (!taken && (best < 0 || sc[x] > sc[best])) best = x;
        }
        sel[k] = best;
        w[k] = p[best];
        wsum = KVB_MOE_ADD(wsum, w[k]);
    }
    if (c->norm) {
        if (wsum < 6.103515625e-5f) wsum = 6.103515625e-5f;
        for (int k = 0; k < K; k++) w[k] = KVB_MOE_DIV(w[k], wsum);
    }
    if (c->scale != 0.0f && c->scale != 1.0f)
        for (int k = 0; k < K; k++) w[k] = KVB_MOE_MUL(w[k], c->scale);
}

/* One token, softmax routing without bias or groups (qwen3moe): p (X) holds its router logits and
 * receives the probabilities; sel (K) and w (K) the chosen experts and their weights, divided by
 * their sum when norm (a softmax's top k never sum below 1/X, so the clamp above never acts). */
KVB_MOE_HD void kvb_moe_route_one(float *p, int X, int K, int norm, int32_t *sel, float *w) {
    const kvb_moe_route_cfg c = {1, norm, 0.0f, 0, 0};
    kvb_moe_route_one_cfg(p, p, NULL, X, K, &c, sel, w);
}

#endif
