/* quant/kvb_quant_scalar.h — the scalar conversions every implementation of the canonical
 * arithmetic shares: fp16/bf16 <-> f32 and the two int8 roundings, as inline functions that
 * compile for the host (C11) and, under nvcc, for the device too (KVB_HD). The CPU's
 * kvb_f32_to_fp16 & co. and the CUDA bridge kernel call these very functions, so their bits
 * cannot drift apart. Part of quant's contract (kvb_quant.h). */
#ifndef KVB_QUANT_SCALAR_H
#define KVB_QUANT_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define KVB_HD __host__ __device__
#else
#define KVB_HD
#endif

static inline KVB_HD uint32_t kvb_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline KVB_HD float kvb_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Same results as x86 F16C (vcvtph2ps): exact; a signalling NaN comes back quiet with its
 * payload shifted into the top of the f32 mantissa. */
static inline KVB_HD float kvb_fp16_to_f32_inl(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    const uint32_t m = h & 0x3ffu;
    if (e == 0x1f) return kvb_bits_f32(sign | 0x7f800000u | (m ? 0x00400000u | (m << 13) : 0u));
    if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in f32 */
        const float v = (float)m * 0x1p-24f;
        return kvb_bits_f32(sign | kvb_f32_bits(v));
    }
    return kvb_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* Round to nearest even, overflow to infinity; NaN stays NaN, made quiet, keeping the top of
 * its payload (same as F16C vcvtps2ph with imm 0, and ggml's GGML_FP32_TO_FP16 on x86). */
static inline KVB_HD uint16_t kvb_f32_to_fp16_inl(float f) {
    const uint32_t x = kvb_f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 (incl. inf) -> inf */
    if (ax >= 0x38800000u) {                                    /* normal fp16 (>= 2^-14) */
        const uint32_t r = ax - (112u << 23);                   /* rebias exponent 127 -> 15 */
        return (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    const uint32_t e = ax >> 23;
    if (e < 102) return sign; /* < 2^-25: rounds to zero (2^-25 itself is a tie -> even 0) */
    /* subnormal fp16: value = m * 2^(e-150); in units of 2^-24 that is m >> (126 - e) */
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e; /* 14..24 */
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q); /* q == 0x400 is the smallest normal: the encoding still works */
}

static inline KVB_HD float kvb_bf16_to_f32_inl(uint16_t h) { return kvb_bits_f32((uint32_t)h << 16); }

static inline KVB_HD uint16_t kvb_f32_to_bf16_inl(float f) {
    const uint32_t u = kvb_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64u);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

/* roundf(v) clamped to [-127, 127], NaN -> 0. For every finite input of ggml's Q8_0 reference
 * quantiser |v| <= 127 + a few ulp, so this is exactly its (int8_t)roundf(v); the clamp and the
 * NaN rule only define what ggml leaves undefined (1/d overflowing to inf, NaN inputs). */
static inline KVB_HD int8_t kvb_q8_roundf(float v) {
    if (!(v == v)) return 0;
    if (v >= 127.0f) return 127;
    if (v <= -127.0f) return -127;
    return (int8_t)roundf(v);
}

/* The 6-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K super-block, from its 12 packed
 * bytes (layout in kvb_quant.h). */
static inline KVB_HD void kvb_k_scale_min(const uint8_t *scales, int s, int *sc, int *m) {
    if (s < 4) {
        *sc = scales[s] & 63;
        *m = scales[s + 4] & 63;
    } else {
        *sc = (scales[s + 4] & 15) | ((scales[s - 4] >> 6) << 4);
        *m = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
    }
}

/* Round half to even, independent of the FPU rounding mode; |v| <= 127 here. */
static inline KVB_HD float kvb_rne_small(float v) {
    const float t = truncf(v);
    const float frac = v - t; /* exact: |v| < 2^23 */
    const float one = v < 0.0f ? -1.0f : 1.0f;
    if (fabsf(frac) > 0.5f) return t + one;
    if (fabsf(frac) == 0.5f && ((int)t & 1) != 0) return t + one; /* tie: to even */
    return t;
}

#endif
