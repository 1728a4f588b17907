/* engine/cuda/moe_math.h — the router's arithmetic, one definition for the GPU kernel (moe.cu)
 * and its CPU twin (tests/test_cuda_moe.c), so the two give the same bits: an exp built only from
 * correctly rounded operations (fmaf, one product, one sum, rintf, a power of two set by bits)
 * and the softmax / top-k / renormalisation of one token in the CPU engine's order (engine/cpu/
 * moe.c: max, exp(l - max) summed in expert order, each divided by the sum; the top k largest
 * first, the lower expert index on a tie; the k weights divided by their sum when norm). Every
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

/* One token: p (X) holds its router logits and receives the probabilities; sel (K) and w (K) the
 * chosen experts and their weights. */
KVB_MOE_HD void kvb_moe_route_one(float *p, int X, int K, int norm, int32_t *sel, float *w) {
    float mx = p[0];
    for (int x = 1; x < X; x++) mx = p[x] > mx ? p[x] : mx;
    float sum = 0.0f;
    for (int x = 0; x < X; x++) {
        p[x] = kvb_moe_expf(KVB_MOE_ADD(p[x], -mx));
        sum = KVB_MOE_ADD(sum, p[x]);
    }
    for (int x = 0; x < X; x++) p[x] = KVB_MOE_DIV(p[x], sum);
    float wsum = 0.0f;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int x = 0; x < X; x++) {
            int taken = 0;
            for (int i = 0; i < k; i++) taken |= sel[i] == x;
            if (!taken && (best < 0 || p[x] > p[best])) best = x;
        }
        sel[k] = best;
        w[k] = p[best];
        wsum = KVB_MOE_ADD(wsum, w[k]);
    }
    if (norm)
        for (int k = 0; k < K; k++) w[k] = KVB_MOE_DIV(w[k], wsum);
}

#endif
