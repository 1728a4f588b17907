/* quant/dot_neon.c — AArch64 NEON kernels of the canonical dot product (baseline ARMv8-A
 * Advanced SIMD only: no dotprod/fp16 arithmetic extensions are assumed). The 16 canonical
 * accumulators are four float32x4 (lanes 0-3, 4-7, 8-11, 12-15) updated with vfmaq_f32 (fused,
 * one rounding, like fmaf). Float weights: element i -> lane i % 16; fp16 is widened exactly
 * with vcvt_f32_f16, bf16 by a 16-bit shift; a tail of n % 16 elements uses scalar fmaf on the
 * lanes it owns. Quant weights: each block's int32 sum is computed exactly with vmull_s8 +
 * vpadalq_s16 + vaddvq_s32, then one scalar fmaf per block into acc[b % 16] — simple and
 * faithful to the specification; the reduction is the same 8-4-2-1 tree. Q5_0 and the K-quants
 * (Q4_K, Q5_K, Q6_K) are not vectorised here: they run the portable scalar code (dot_scalar.c),
 * because no ARM machine was at hand to test NEON versions bit for bit. */
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "kvb_quant.h"
#include "quant_impl.h"

static float reduce_acc(const float32x4_t a[4]) {
    const float32x4_t s8a = vaddq_f32(a[0], a[2]); /* lanes 0-3: acc[i] + acc[i+8] */
    const float32x4_t s8b = vaddq_f32(a[1], a[3]); /* lanes 4-7 */
    const float32x4_t s4 = vaddq_f32(s8a, s8b);    /* i < 4: + acc[i+4] */
    const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
    return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}

static inline float32x4_t ldw4(uint32_t type, const uint8_t *w, int64_t i) {
    if (type == KVB_TYPE_F32) return vld1q_f32((const float *)(const void *)w + i);
    const uint16x4_t h = vld1_u16((const uint16_t *)(const void *)w + i);
    if (type == KVB_TYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

static float w_scalar(uint32_t type, const uint8_t *w, int64_t i) {
    if (type == KVB_TYPE_F32) {
        float v;
        memcpy(&v, w + 4 * i, 4);
        return v;
    }
    uint16_t h;
    memcpy(&h, w + 2 * i, 2);
    return type == KVB_TYPE_F16 ? kvb_fp16_to_f32(h) : kvb_bf16_to_f32(h);
}

static float dot_float(uint32_t type, const uint8_t *w, const float *x, int64_t n) {
    float32x4_t acc[4];
    for (int k = 0; k < 4; k++) acc[k] = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 4; k++)
            acc[k] = vfmaq_f32(acc[k], ldw4(type, w, i + 4 * k), vld1q_f32(x + i + 4 * k));
    if (i < n) {
        float a[16];
        for (int k = 0; k < 4; k++) vst1q_f32(a + 4 * k, acc[k]);
        for (int l = 0; i + l < n; l++) a[l] = fmaf(w_scalar(type, w, i + l), x[i + l], a[l]);
        for (int k = 0; k < 4; k++) acc[k] = vld1q_f32(a + 4 * k);
    }
    return reduce_acc(acc);
}

/* Exact sum of 32 int8 x int8 products. */
static inline int32_t sum_s8(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
    int32x4_t s = vdupq_n_s32(0);
    s = vpadalq_s16(s, vmull_s8(vget_low_s8(w0), vget_low_s8(x0)));
    s = vpadalq_s16(s, vmull_s8(vget_high_s8(w0), vget_high_s8(x0)));
    s = vpadalq_s16(s, vmull_s8(vget_low_s8(w1), vget_low_s8(x1)));
    s = vpadalq_s16(s, vmull_s8(vget_high_s8(w1), vget_high_s8(x1)));
    return vaddvq_s32(s);
}

static float dot_quant(uint32_t type, const uint8_t *w, const kvb_block_q8_0 *x, int64_t n) {
    float acc[16];
    for (int l = 0; l < 16; l++) acc[l] = 0.0f;
    const int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; b++) {
        const int8x16_t x0 = vld1q_s8(x[b].qs), x1 = vld1q_s8(x[b].qs + 16);
        int32_t s;
        uint16_t wd;
        if (type == KVB_TYPE_Q8_0) {
            const uint8_t *blk = w + (size_t)b * 34;
            memcpy(&wd, blk, 2);
            s = sum_s8(vld1q_s8((const int8_t *)(blk + 2)), vld1q_s8((const int8_t *)(blk + 18)), x0, x1);
        } else {
            const uint8_t *blk = w + (size_t)b * 18;
            memcpy(&wd, blk, 2);
            const uint8x16_t q = vld1q_u8(blk + 2);
            const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0f))), vdupq_n_s8(8));
            const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), vdupq_n_s8(8));
            s = sum_s8(lo, hi, x0, x1);
        }
        const float d = kvb_fp16_to_f32(wd) * kvb_fp16_to_f32(x[b].d);
        acc[b % 16] = fmaf((float)s, d, acc[b % 16]);
    }
    float32x4_t a[4];
    for (int k = 0; k < 4; k++) a[k] = vld1q_f32(acc + 4 * k);
    return reduce_acc(a);
}

static void matmul_neon(uint32_t type, const void *w, size_t ws, int n_rows, const void *act,
                        size_t as, int n_tok, float *y, size_t ys, int64_t n) {
    if (type == KVB_TYPE_Q5_0 || kvb_is_kquant_type(type)) { /* not vectorised here: the scalar code */
        kvb_quant_kernels_scalar.matmul(type, w, ws, n_rows, act, as, n_tok, y, ys, n);
        return;
    }
    const uint8_t *wb = w, *ab = act;
    const int quant = type == KVB_TYPE_Q8_0 || type == KVB_TYPE_Q4_0;
    for (int t = 0; t < n_tok; t++) {
        const uint8_t *xt = ab + (size_t)t * as;
        for (int r = 0; r < n_rows; r++) {
            const uint8_t *wr = wb + (size_t)r * ws;
            y[(size_t)t * ys + (size_t)r] =
                quant ? dot_quant(type, wr, (const kvb_block_q8_0 *)(const void *)xt, n)
                      : dot_float(type, wr, (const float *)(const void *)xt, n);
        }
    }
}

/* Same bytes as kvb_quantize_q8_0_act_ref: the per-element rounding is done by vcvtnq_s32_f32
 * (round to nearest, ties to even, independent of FPCR) after the same clamp. */
static void quantize_q8_0_neon(const float *x, void *dst, int64_t n) {
    kvb_block_q8_0 *yb = dst; /* [n/32] */
    for (int64_t b = 0; b < n / 32; b++) {
        float32x4_t v[8];
        uint32x4_t nanm = vdupq_n_u32(0);
        float32x4_t m = vdupq_n_f32(0.0f);
        for (int k = 0; k < 8; k++) {
            v[k] = vld1q_f32(x + 32 * b + 4 * k);
            nanm = vorrq_u32(nanm, vmvnq_u32(vceqq_f32(v[k], v[k])));
            m = vmaxnmq_f32(m, vabsq_f32(v[k]));
        }
        const float amax = vmaxvq_u32(nanm) ? NAN : vmaxnmvq_f32(m);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int k = 0; k < 8; k++) {
            const float32x4_t s = vmulq_n_f32(v[k], id);
            const uint32x4_t ok = vceqq_f32(s, s);
            const float32x4_t c = vminq_f32(vmaxq_f32(s, vdupq_n_f32(-127.0f)), vdupq_n_f32(127.0f));
            const int32x4_t q = vandq_s32(vcvtnq_s32_f32(c), vreinterpretq_s32_u32(ok)); /* NaN -> 0 */
            const int16x4_t q16 = vmovn_s32(q);
            int8_t tmp[8];
            vst1_s8(tmp, vmovn_s16(vcombine_s16(q16, q16)));
            memcpy(yb[b].qs + 4 * k, tmp, 4);
        }
        yb[b].d = kvb_f32_to_fp16(d);
    }
}

const kvb_quant_kernels kvb_quant_kernels_neon = {
    .name = "neon",
    .matmul = matmul_neon,
    .quantize_q8_0 = quantize_q8_0_neon,
};
