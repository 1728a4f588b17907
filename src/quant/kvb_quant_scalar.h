/* quant/kvb_quant_scalar.h — the scalar conversions every implementation of the canonical
 * arithmetic shares: fp16/bf16 <-> f32 and the two int8 roundings, as inline functions that
 * compile for the host (C11) and, under nvcc, for the device too (KVB_HD). The CPU's
 * kvb_f32_to_fp16 & co. and the CUDA bridge kernel call these very functions, so their bits
 * cannot drift apart; likewise the decoding of one 32-element unit of a weight row
 * (kvb_row_unit_to_f32), which kvb_row_to_f32 and the CUDA engine's packed-weight expansion share.
 * Part of quant's contract (kvb_quant.h). */
#ifndef KVB_QUANT_SCALAR_H
#define KVB_QUANT_SCALAR_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvb_quant.h"

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

/* x86's (SSE/AVX, the CPU engine's) NaN results for r = a op b: a NaN operand comes back made quiet,
 * a's before b's; an invalid operation on non-NaN operands (inf * 0, inf - inf) gives the default
 * NaN 0xffc00000. GPUs return 0x7fffffff for every NaN result (and ARM 0x7fc00000), so code that
 * must match the CPU's bits everywhere, NaN included, passes its products and differences through
 * these. Every other result is r itself. */
static inline KVB_HD float kvb_nan_x86(float r, float a, float b) {
    if (r == r) return r;
    if (a != a) return kvb_bits_f32(kvb_f32_bits(a) | 0x00400000u);
    if (b != b) return kvb_bits_f32(kvb_f32_bits(b) | 0x00400000u);
    return kvb_bits_f32(0xffc00000u);
}
static inline KVB_HD float kvb_mul_x86(float a, float b) { return kvb_nan_x86(a * b, a, b); }
static inline KVB_HD float kvb_sub_x86(float a, float b) { return kvb_nan_x86(a - b, a, b); }

/* A little-endian 16-bit field at any byte offset (blocks of 18, 22 or 210 bytes leave fields
 * unaligned). */
static inline KVB_HD uint16_t kvb_le16(const uint8_t *p) { return (uint16_t)(p[0] | (uint16_t)p[1] << 8); }

/* Elements 32u .. 32u+31 of a row of `type` as f32 into out[32], by kvb_row_to_f32's formulas
 * (kvb_quant.h: each product exact, so the same bits wherever this runs and however a compiler
 * contracts `a * b - c`; NaN results as x86 gives them, kvb_nan_x86). row: the row's first byte,
 * in the block layouts above. Types: F32, F16, BF16, Q8_0, Q4_0, Q5_0 (one block per unit), Q4_K,
 * Q5_K, Q6_K (unit u is sub-block u % 8 of super-block u / 8). False, and nothing written, for any
 * other type. */
static inline KVB_HD bool kvb_row_unit_to_f32(uint32_t type, const uint8_t *row, int64_t u, float *out) {
    switch (type) {
    case KVB_TYPE_F32:
        memcpy(out, row + (size_t)u * 128, 128);
        return true;
    case KVB_TYPE_F16:
    case KVB_TYPE_BF16: {
        const uint8_t *p = row + (size_t)u * 64; /* [32] fp16 or bf16 */
        for (int j = 0; j < 32; j++) {
            const uint16_t h = kvb_le16(p + 2 * j);
            out[j] = type == KVB_TYPE_F16 ? kvb_fp16_to_f32_inl(h) : kvb_bf16_to_f32_inl(h);
        }
        return true;
    }
    case KVB_TYPE_Q8_0: {
        const uint8_t *b = row + (size_t)u * sizeof(kvb_block_q8_0);
        const float d = kvb_fp16_to_f32_inl(kvb_le16(b));
        for (int j = 0; j < 32; j++) out[j] = kvb_mul_x86((float)(int8_t)b[offsetof(kvb_block_q8_0, qs) + j], d);
        return true;
    }
    case KVB_TYPE_Q4_0: {
        const uint8_t *b = row + (size_t)u * sizeof(kvb_block_q4_0), *qs = b + offsetof(kvb_block_q4_0, qs);
        const float d = kvb_fp16_to_f32_inl(kvb_le16(b));
        for (int j = 0; j < 16; j++) {
            out[j] = kvb_mul_x86((float)((qs[j] & 0x0f) - 8), d);
            out[j + 16] = kvb_mul_x86((float)((qs[j] >> 4) - 8), d);
        }
        return true;
    }
    case KVB_TYPE_Q5_0: {
        const uint8_t *b = row + (size_t)u * sizeof(kvb_block_q5_0), *qs = b + offsetof(kvb_block_q5_0, qs);
        const uint8_t *h = b + offsetof(kvb_block_q5_0, qh);
        const float d = kvb_fp16_to_f32_inl(kvb_le16(b));
        const uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
        for (int j = 0; j < 16; j++) {
            out[j] = kvb_mul_x86((float)(((qs[j] & 0x0f) | (int)((qh >> j) & 1u) << 4) - 16), d);
            out[j + 16] = kvb_mul_x86((float)(((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) - 16), d);
        }
        return true;
    }
    case KVB_TYPE_Q4_K:
    case KVB_TYPE_Q5_K: {
        const bool five = type == KVB_TYPE_Q5_K;
        const int s = (int)(u % 8);
        const uint8_t *b = row + (size_t)(u / 8) * (five ? sizeof(kvb_block_q5_k) : sizeof(kvb_block_q4_k));
        const uint8_t *qs = b + (five ? offsetof(kvb_block_q5_k, qs) : offsetof(kvb_block_q4_k, qs));
        const uint8_t *qh = five ? b + offsetof(kvb_block_q5_k, qh) : NULL;
        int sc, m;
        kvb_k_scale_min(b + offsetof(kvb_block_q4_k, scales), s, &sc, &m);
        const float ds = kvb_mul_x86(kvb_fp16_to_f32_inl(kvb_le16(b)), (float)sc); /* both exact */
        const float ms = kvb_mul_x86(kvb_fp16_to_f32_inl(kvb_le16(b + offsetof(kvb_block_q4_k, dmin))), (float)m);
        for (int l = 0; l < 32; l++) {
            const int lo = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f;
            out[l] = kvb_sub_x86(kvb_mul_x86(ds, (float)(qh ? lo | ((qh[l] >> s) & 1) << 4 : lo)), ms);
        }
        return true;
    }
    case KVB_TYPE_Q6_K: {
        const int s = (int)(u % 8), hh = s / 4, c = s % 4; /* elements e = 32s + l: h = e/128, c = (e%128)/32 */
        const uint8_t *b = row + (size_t)(u / 8) * sizeof(kvb_block_q6_k);
        const uint8_t *ql = b + offsetof(kvb_block_q6_k, ql), *qh = b + offsetof(kvb_block_q6_k, qh);
        const int8_t *sc = (const int8_t *)(b + offsetof(kvb_block_q6_k, scales));
        const float d = kvb_fp16_to_f32_inl(kvb_le16(b + offsetof(kvb_block_q6_k, d)));
        for (int l = 0; l < 32; l++) {
            const int lo = (ql[64 * hh + 32 * (c % 2) + l] >> (4 * (c / 2))) & 0x0f;
            const int hi = (qh[32 * hh + l] >> (2 * c)) & 3;
            out[l] = kvb_mul_x86(kvb_mul_x86(d, (float)sc[(32 * s + l) / 16]), (float)((lo | hi << 4) - 32));
        }
        return true;
    }
    default:
        return false;
    }
}

#endif
