// engine/cuda/bridge_quant.cuh — private to the bridge kernels: the canonical Q8_0 activation
// quantiser (kvb_quant.h, kvb_quantize_act) for one 32-element block, shared by the per-thread
// path (bridge.cu, 34-byte blocks) and the tensor-core path (bridge_mma.cu, int8 rows + scales).
#ifndef KVB_BRIDGE_QUANT_CUH
#define KVB_BRIDGE_QUANT_CUH

#include <stdint.h>

#include "kvb_quant_scalar.h"

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
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    for (int j = 0; j < 32; j++) {
        float v = __fmul_rn(xb[j], id);
        if (!(v == v)) {
            q[j] = 0;
            continue;
        }
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[j] = (int8_t)kvb_rne_small(v);
    }
    return d;
}

// The same quantiser with one block spread over a warp, lane j holding x[j] (coalesced loads):
// amax is the maximum of the lanes' |x| that are not NaN (a maximum is exact whatever the order,
// and it starts from 0 as the loop does), NaN when any lane is; then every lane does the loop's
// own operations on its element. Returns d on every lane; *q gets lane j's value.
__device__ static inline float kvb_bq_quantize32_warp(float x, int8_t *q) {
    const float a = fabsf(x);
    const unsigned nan = __ballot_sync(0xffffffffu, a != a);
    float amax = a != a ? 0.0f : a;
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (nan) amax = __int_as_float(0x7fc00000);
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    float v = __fmul_rn(x, id);
    if (!(v == v)) {
        *q = 0;
    } else {
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        *q = (int8_t)kvb_rne_small(v);
    }
    return d;
}

#endif
