// bridge/cuda/bridge_quant.cuh — private to the bridge kernels: the canonical Q8_0 activation
// quantiser (kvb_quant.h, kvb_quantize_act) for one 32-element block, shared by the per-thread
// path (bridge.cu, 34-byte blocks) and the tensor-core path (bridge_mma.cu, int8 rows + scales).
#ifndef KVB_BRIDGE_QUANT_CUH
#define KVB_BRIDGE_QUANT_CUH

#include <cuda_fp16.h>
#include <stdint.h>

#include "kvb_quant_scalar.h"

// 1.5 * 2^23 and its bits. A float in [2^23, 2^24) has a spacing of 1, so an integer |c| < 2^22
// added to it sits exactly in its low mantissa bits: float -> integer after a rounding add
// (kvb_bq_encode), integer -> float after an mma that starts its accumulator there (bridge_mma.cu).
#define KVB_BQ_INT_MAGIC 12582912.0f
#define KVB_BQ_INT_MAGIC_BITS 0x4B400000

// The block's scale from its amax (NaN when any element is): d = amax / 127 and *id = 1 / d (0 when
// d is 0), the loop's own operations.
__device__ static inline float kvb_bq_scale(float amax, float *id) {
    const float d = __fdiv_rn(amax, 127.0f);
    *id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    return d;
}

// One element x -> int8 with the block's inverse scale id: 0 for NaN, else clamped to +-127 and
// rounded to nearest even, without a branch: adding KVB_BQ_INT_MAGIC to |c| <= 127 rounds it to
// an integer in the FADD's own round-to-nearest-even and leaves that integer in the low bits —
// kvb_rne_small's result, which cost a branch chain per element.
__device__ static inline int8_t kvb_bq_encode(float x, float id) {
    const float v = __fmul_rn(x, id);
    const float c = fminf(fmaxf(v, -127.0f), 127.0f); // v NaN: -127, dropped below
    const int r = __float_as_int(__fadd_rn(c, KVB_BQ_INT_MAGIC)) - KVB_BQ_INT_MAGIC_BITS;
    return v == v ? (int8_t)r : (int8_t)0;
}

// fp16(d) widened back to f32, the scale the dot uses: the hardware conversions (IEEE round to
// nearest even, overflow to infinity, subnormals; exact on the way back) for every d but NaN,
// whose payload kvb_f32_to_fp16_inl keeps as the CPU's F16C does.
__device__ static inline float kvb_bq_round_f16(float d) {
    if (d != d) return kvb_fp16_to_f32_inl(kvb_f32_to_fp16_inl(d));
    return __half2float(__float2half_rn(d));
}

// xb (32) f32 -> q (32) int8; returns d = amax / 127 (NaN if any x is NaN), before its fp16
// rounding: the caller stores kvb_f32_to_fp16_inl(d).
__device__ static inline float kvb_bq_quantize32(const float *xb, int8_t *q) {
    float amax = 0.0f;
    int nan = 0;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(xb[j]);
        if (a != a) nan = 1;
        else if (a > amax) amax = a;
    }
    if (nan) amax = __int_as_float(0x7fc00000);
    float id;
    const float d = kvb_bq_scale(amax, &id);
    for (int j = 0; j < 32; j++) q[j] = kvb_bq_encode(xb[j], id);
    return d;
}

// The same quantiser with one block spread over 8 lanes of a warp (lanes 8g .. 8g+7 hold block g's
// elements 4i .. 4i+3 in lane 8g+i: one 16-byte load each, coalesced). amax is the maximum of the
// block's |x| that are not NaN (a maximum is exact whatever the order, and it starts from 0 as the
// loop does), NaN when any element is; then every element gets the loop's own operations.
// Returns d on the group's lanes; q[0..3] get the lane's four values.
__device__ static inline float kvb_bq_quantize32_oct(const float x[4], int8_t q[4]) {
    float amax = 0.0f;
    bool nan = false;
    for (int j = 0; j < 4; j++) {
        const float a = fabsf(x[j]);
        if (a != a) nan = true;
        else amax = fmaxf(amax, a);
    }
    const int lane = (int)(threadIdx.x & 31);
    const unsigned group_nan = (__ballot_sync(0xffffffffu, nan) >> (lane & ~7)) & 0xffu;
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o)); // within the 8
    if (group_nan) amax = __int_as_float(0x7fc00000);
    float id;
    const float d = kvb_bq_scale(amax, &id);
    for (int j = 0; j < 4; j++) q[j] = kvb_bq_encode(x[j], id);
    return d;
}

#endif
