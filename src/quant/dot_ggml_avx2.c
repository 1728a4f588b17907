/* quant/dot_ggml_avx2.c — kvb_matmul_tile_ggml with AVX2 + FMA + F16C, the same instructions ggml's
 * own x86 kernels use (kvb_quant.h, "ggml's arithmetic"): per 32-element block the weight's signed
 * values, vpmaddubsw(|w|, sign(x, w)) + vpmaddwd by ones = eight exact sums of four, converted and
 * fma'd with the block's scale product into eight lanes, then hsum_float_8's pairing. Bit for bit
 * the portable loops in dot_ggml.c (tests/test_kv_ggml.c). Each weight block is unpacked once per
 * group of up to 8 tokens. */
#include <immintrin.h>
#include <string.h>

#include "kvb_quant.h"
#include "quant_impl.h"

#define TOK_GROUP 8

/* Block b of a Q8_0 / Q5_0 row as 32 signed bytes, and its scale. */
static inline __m256i weight_block(uint32_t type, const uint8_t *row, int64_t b, float *d) {
    if (type == KVB_TYPE_Q8_0) {
        const kvb_block_q8_0 *w = (const kvb_block_q8_0 *)row + b;
        *d = _cvtsh_ss(w->d);
        return _mm256_loadu_si256((const __m256i *)w->qs);
    }
    const kvb_block_q5_0 *w = (const kvb_block_q5_0 *)row + b;
    *d = _cvtsh_ss(w->d);
    uint32_t qh;
    memcpy(&qh, w->qh, 4);
    int8_t q[32];
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((w->qs[j] & 0x0f) | (int)((qh >> j) & 1u) << 4) - 16);
        q[j + 16] = (int8_t)(((w->qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) - 16);
    }
    return _mm256_loadu_si256((const __m256i *)q);
}

static inline float hsum_float_8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

void kvb_matmul_tile_ggml_avx2(uint32_t type, const void *w, size_t w_stride, int n_rows, const void *act,
                               size_t act_stride, int n_tok, float *y, size_t y_stride, int64_t n) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *row = (const uint8_t *)w + (size_t)r * w_stride;
        for (int t0 = 0; t0 < n_tok; t0 += TOK_GROUP) {
            const int nt = n_tok - t0 < TOK_GROUP ? n_tok - t0 : TOK_GROUP;
            __m256 acc[TOK_GROUP];
            for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t b = 0; b < n / 32; b++) {
                float wd;
                const __m256i wq = weight_block(type, row, b, &wd);
                const __m256i ax = _mm256_sign_epi8(wq, wq);
                for (int t = 0; t < nt; t++) {
                    const kvb_block_q8_0 *x = (const kvb_block_q8_0 *)((const uint8_t *)act + (size_t)(t0 + t) * act_stride) + b;
                    const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x->qs), wq);
                    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(wd * _cvtsh_ss(x->d)), _mm256_cvtepi32_ps(dot), acc[t]);
                }
            }
            for (int t = 0; t < nt; t++) y[(size_t)(t0 + t) * y_stride + r] = hsum_float_8(acc[t]);
        }
    }
}
