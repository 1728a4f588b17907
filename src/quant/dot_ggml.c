/* quant/dot_ggml.c — ggml's own dot of a Q8_0 or Q5_0 weight row with a Q8_0 activation row, as
 * its x86 CPU backend computes it (kvb_quant.h, "ggml's arithmetic"): eight f32 lanes, lane k
 * taking the integer sum of elements 4k..4k+3 of every 32-element block through one fmaf with the
 * block's scale product, then hsum_float_8's fixed pairing. The plain loops here are the
 * reference; where the dispatch chose AVX2 or AVX-512 kernels the tile runs dot_ggml_avx2.c,
 * bit for bit the same. */
#include <math.h>
#include <string.h>

#include "kvb_quant.h"
#include "quant_impl.h"

int kvb_ggml_dot_type(uint32_t weight_type) {
    return weight_type == KVB_TYPE_Q8_0 || weight_type == KVB_TYPE_Q5_0;
}

/* Block b's 32 signed weight values (Q8_0: qs; Q5_0: (low nibble | fifth bit << 4) - 16) and its
 * fp16 scale. */
static uint16_t weight_block(uint32_t type, const void *w_row, int64_t b, int8_t q[32]) {
    if (type == KVB_TYPE_Q8_0) {
        const kvb_block_q8_0 *w = (const kvb_block_q8_0 *)w_row + b;
        memcpy(q, w->qs, 32);
        return w->d;
    }
    const kvb_block_q5_0 *w = (const kvb_block_q5_0 *)w_row + b;
    uint32_t qh;
    memcpy(&qh, w->qh, 4); /* little-endian host: bit j is element j's fifth bit */
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((w->qs[j] & 0x0f) | (int)((qh >> j) & 1u) << 4) - 16);
        q[j + 16] = (int8_t)(((w->qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) - 16);
    }
    return w->d;
}

float kvb_dot_ggml(uint32_t type, const void *w_row, const void *act_row, int64_t n) {
    if (!kvb_ggml_dot_type(type) || n < 0 || n % 32) return NAN;
    const kvb_block_q8_0 *x = act_row; /* [n/32] */
    float lane[8] = {0};
    for (int64_t b = 0; b < n / 32; b++) {
        int8_t q[32];
        const float d = kvb_fp16_to_f32(weight_block(type, w_row, b, q)) * kvb_fp16_to_f32(x[b].d);
        for (int k = 0; k < 8; k++) {
            int32_t s = 0;
            for (int j = 4 * k; j < 4 * k + 4; j++) s += (int32_t)q[j] * (int32_t)x[b].qs[j];
            lane[k] = fmaf(d, (float)s, lane[k]);
        }
    }
    const float r0 = lane[0] + lane[4], r1 = lane[1] + lane[5], r2 = lane[2] + lane[6], r3 = lane[3] + lane[7];
    return (r0 + r2) + (r1 + r3);
}

void kvb_matmul_tile_ggml(uint32_t type, const void *w, size_t w_stride, int n_rows, const void *act,
                          size_t act_stride, int n_tok, float *y, size_t y_stride, int64_t n) {
#if defined(KVB_X86)
    /* any kernel set but the scalar one means AVX2, FMA and F16C are there */
    if (kvb_ggml_dot_type(type) && n >= 0 && n % 32 == 0 && kvb_quant_active() != &kvb_quant_kernels_scalar) {
        kvb_matmul_tile_ggml_avx2(type, w, w_stride, n_rows, act, act_stride, n_tok, y, y_stride, n);
        return;
    }
#endif
    for (int t = 0; t < n_tok; t++)
        for (int r = 0; r < n_rows; r++)
            y[(size_t)t * y_stride + r] = kvb_dot_ggml(type, (const uint8_t *)w + (size_t)r * w_stride,
                                                       (const uint8_t *)act + (size_t)t * act_stride, n);
}
