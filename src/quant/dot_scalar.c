/* quant/dot_scalar.c — the portable reference of the canonical dot product (kvb_quant.h):
 * sixteen f32 accumulators, element i (float weights) or block b (quant weights) feeding lane
 * i % 16 / b % 16 through one fmaf, then the fixed 8-4-2-1 pairwise reduction. It is written as
 * plain loops that read like the specification; every SIMD file must return exactly these bits,
 * and the tests compare them against this file. Also the scalar kernel set for dispatch. */
#include <math.h>
#include <string.h>

#include "kvb_quant.h"
#include "kvb_quant_scalar.h"
#include "quant_impl.h"

static float reduce16(float acc[16]) {
    for (int h = 8; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) acc[i] = acc[i] + acc[i + h];
    return acc[0];
}

float kvb_dot_scalar(uint32_t type, const void *w_row, const void *act_row, int64_t n) {
    float acc[16];
    for (int i = 0; i < 16; i++) acc[i] = 0.0f;
    switch (type) {
    case KVB_TYPE_F32: {
        const float *w = w_row, *x = act_row; /* [n], [n] */
        for (int64_t i = 0; i < n; i++) acc[i % 16] = fmaf(w[i], x[i], acc[i % 16]);
        break;
    }
    case KVB_TYPE_F16: {
        const uint16_t *w = w_row; /* [n] fp16 */
        const float *x = act_row;  /* [n] */
        for (int64_t i = 0; i < n; i++)
            acc[i % 16] = fmaf(kvb_fp16_to_f32(w[i]), x[i], acc[i % 16]);
        break;
    }
    case KVB_TYPE_BF16: {
        const uint16_t *w = w_row; /* [n] bf16 */
        const float *x = act_row;  /* [n] */
        for (int64_t i = 0; i < n; i++)
            acc[i % 16] = fmaf(kvb_bf16_to_f32(w[i]), x[i], acc[i % 16]);
        break;
    }
    case KVB_TYPE_Q8_0: {
        const kvb_block_q8_0 *w = w_row, *x = act_row; /* [n/32], [n/32] */
        for (int64_t b = 0; b < n / 32; b++) {
            int32_t s = 0;
            for (int j = 0; j < 32; j++) s += (int32_t)w[b].qs[j] * (int32_t)x[b].qs[j];
            const float d = kvb_fp16_to_f32(w[b].d) * kvb_fp16_to_f32(x[b].d);
            acc[b % 16] = fmaf((float)s, d, acc[b % 16]);
        }
        break;
    }
    case KVB_TYPE_Q4_0: {
        const kvb_block_q4_0 *w = w_row;  /* [n/32] */
        const kvb_block_q8_0 *x = act_row; /* [n/32] */
        for (int64_t b = 0; b < n / 32; b++) {
            int32_t s = 0;
            for (int j = 0; j < 16; j++) {
                s += ((int32_t)(w[b].qs[j] & 0x0f) - 8) * (int32_t)x[b].qs[j];
                s += ((int32_t)(w[b].qs[j] >> 4) - 8) * (int32_t)x[b].qs[j + 16];
            }
            const float d = kvb_fp16_to_f32(w[b].d) * kvb_fp16_to_f32(x[b].d);
            acc[b % 16] = fmaf((float)s, d, acc[b % 16]);
        }
        break;
    }
    case KVB_TYPE_Q5_0: {
        const kvb_block_q5_0 *w = w_row;  /* [n/32] */
        const kvb_block_q8_0 *x = act_row; /* [n/32] */
        for (int64_t b = 0; b < n / 32; b++) {
            uint32_t qh;
            memcpy(&qh, w[b].qh, 4); /* little-endian host: bit j is element j's fifth bit */
            int32_t s = 0;
            for (int j = 0; j < 16; j++) {
                const int32_t lo = (w[b].qs[j] & 0x0f) | (int32_t)((qh >> j) & 1u) << 4;
                const int32_t hi = (w[b].qs[j] >> 4) | (int32_t)((qh >> (j + 16)) & 1u) << 4;
                s += (lo - 16) * (int32_t)x[b].qs[j];
                s += (hi - 16) * (int32_t)x[b].qs[j + 16];
            }
            const float d = kvb_fp16_to_f32(w[b].d) * kvb_fp16_to_f32(x[b].d);
            acc[b % 16] = fmaf((float)s, d, acc[b % 16]);
        }
        break;
    }
    case KVB_TYPE_Q4_K:
    case KVB_TYPE_Q5_K: {
        const int five = type == KVB_TYPE_Q5_K;
        const size_t sbb = five ? sizeof(kvb_block_q5_k) : sizeof(kvb_block_q4_k);
        const kvb_block_q8_0 *x = act_row; /* [n/32] */
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *sb = (const uint8_t *)w_row + (size_t)(b / 8) * sbb; /* super-block */
            const int k = (int)(b % 8);                                          /* sub-block */
            uint16_t wd, wdmin;
            memcpy(&wd, sb, 2);
            memcpy(&wdmin, sb + 2, 2);
            const uint8_t *qs = sb + (five ? 48 : 16), *qh = sb + 16; /* [128], [32] (Q5_K) */
            int sc, m;
            kvb_k_scale_min(sb + 4, k, &sc, &m);
            int32_t s = 0, sx = 0;
            for (int j = 0; j < 32; j++) {
                int32_t q = (qs[32 * (k / 2) + j] >> (4 * (k % 2))) & 0x0f;
                if (five) q |= ((qh[j] >> k) & 1) << 4;
                s += q * (int32_t)x[b].qs[j];
                sx += x[b].qs[j];
            }
            const float xd = kvb_fp16_to_f32(x[b].d);
            const float dA = (kvb_fp16_to_f32(wd) * (float)sc) * xd;
            const float dM = (kvb_fp16_to_f32(wdmin) * (float)m) * xd;
            acc[b % 16] = fmaf((float)s, dA, acc[b % 16]);
            acc[b % 16] = fmaf(-(float)sx, dM, acc[b % 16]);
        }
        break;
    }
    case KVB_TYPE_Q6_K: {
        const kvb_block_q6_k *w = w_row;  /* [n/256] */
        const kvb_block_q8_0 *x = act_row; /* [n/32] */
        for (int64_t b = 0; b < n / 32; b++) {
            const kvb_block_q6_k *sb = &w[b / 8];
            const int k = (int)(b % 8), h = k / 4, c = k % 4; /* elements 32k.. of the super-block */
            int32_t half[2] = {0, 0};
            for (int j = 0; j < 32; j++) {
                const int lo = (sb->ql[64 * h + 32 * (c % 2) + j] >> (4 * (c / 2))) & 0x0f;
                const int hi = (sb->qh[32 * h + j] >> (2 * c)) & 3;
                half[j / 16] += ((lo | hi << 4) - 32) * (int32_t)x[b].qs[j];
            }
            const int32_t S = (int32_t)sb->scales[2 * k] * half[0] + (int32_t)sb->scales[2 * k + 1] * half[1];
            const float d = kvb_fp16_to_f32(sb->d) * kvb_fp16_to_f32(x[b].d);
            acc[b % 16] = fmaf((float)S, d, acc[b % 16]);
        }
        break;
    }
    default:
        return NAN;
    }
    return reduce16(acc);
}

static void matmul_scalar(uint32_t type, const void *w, size_t w_stride, int n_rows,
                          const void *act, size_t act_stride, int n_tok, float *y,
                          size_t y_stride, int64_t n) {
    const uint8_t *wb = w, *ab = act;
    for (int t = 0; t < n_tok; t++)
        for (int r = 0; r < n_rows; r++)
            y[(size_t)t * y_stride + (size_t)r] =
                kvb_dot_scalar(type, wb + (size_t)r * w_stride, ab + (size_t)t * act_stride, n);
}

const kvb_quant_kernels kvb_quant_kernels_scalar = {
    .name = "scalar",
    .matmul = matmul_scalar,
    .quantize_q8_0 = kvb_quantize_q8_0_act_ref,
};
