/* quant/dot_avx2.c — AVX2 + FMA + F16C kernels of the canonical dot product, for x86 CPUs
 * without AVX-512. The 16 canonical accumulators live in two ymm (lanes 0-7 and 8-15). Float
 * weights: element i -> lane i % 16, one vfmadd per 8 elements, tiles of up to 4 rows x 4 tokens
 * (or 8 rows x 1 token in decode); a tail of n % 16 elements is copied into zero-padded
 * buffers and its fma result blended into only the lanes it owns, so other lanes keep their
 * exact bits. Quant weights: per block, vpmaddubsw(|w|, sign(x, w)) + vpmaddwd gives eight exact
 * partial sums (no saturation: |w| <= 128 and |x| <= 127, which kvb_quantize_act guarantees),
 * an hadd tree turns 8 blocks into one ymm of exact block sums in natural order, and the scale
 * products are fma'd into the accumulator of lanes 0-7 or 8-15. A partial last group of < 8
 * blocks runs on zero-padded copies and is blended in the same way. The K-quants map one
 * super-block to one group of 8 blocks: Q4_K/Q5_K multiply their unsigned q directly
 * (vpmaddubsw(q, x)) and fma the min term with -sum(x), which tiles of 4 rows x 4 tokens compute
 * once per activation group; Q6_K uses q - 32 with the sign trick and vpmaddwd by its two
 * half-block scales, which gives the exact scaled block sum S directly. */
#include <immintrin.h>
#include <string.h>

#include "kvb_quant.h"
#include "quant_impl.h"

#define UNROLL _Pragma("GCC unroll 16")
#define INLINE static inline __attribute__((always_inline))

/* The canonical 8-4-2-1 reduction; a0 = lanes 0-7, a1 = lanes 8-15. */
INLINE float reduce16(__m256 a0, __m256 a1) {
    const __m256 s8 = _mm256_add_ps(a0, a1);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

/* Lane mask (all-ones in lanes l < k) for a blend, k in 0..8. */
INLINE __m256 lane_mask(int k) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), idx));
}

/* ---- float weights ------------------------------------------------------------------------ */

INLINE __m256 ldw8(const int type, const void *p) {
    if (type == KVB_TYPE_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == KVB_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE float w_scalar(const int type, const uint8_t *p, int64_t i) {
    if (type == KVB_TYPE_F32) {
        float v;
        memcpy(&v, p + 4 * i, 4);
        return v;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return type == KVB_TYPE_F16 ? kvb_fp16_to_f32(h) : kvb_bf16_to_f32(h);
}

INLINE void ftile(const int type, const int rb, const int tb, const uint8_t *w, size_t ws,
                  const uint8_t *x, size_t xs, float *y, size_t ys, int64_t n) {
    const int esz = type == KVB_TYPE_F32 ? 4 : 2;
    __m256 acc[8][4][2];
    UNROLL for (int r = 0; r < rb; r++) UNROLL for (int t = 0; t < tb; t++) {
        acc[r][t][0] = _mm256_setzero_ps();
        acc[r][t][1] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 xv[4][2];
        UNROLL for (int t = 0; t < tb; t++) {
            const float *xp = (const float *)(const void *)(x + (size_t)t * xs) + i;
            xv[t][0] = _mm256_loadu_ps(xp);
            xv[t][1] = _mm256_loadu_ps(xp + 8);
        }
        UNROLL for (int r = 0; r < rb; r++) {
            const uint8_t *wp = w + (size_t)r * ws + (size_t)i * (size_t)esz;
            const __m256 w0 = ldw8(type, wp), w1 = ldw8(type, wp + 8 * esz);
            UNROLL for (int t = 0; t < tb; t++) {
                acc[r][t][0] = _mm256_fmadd_ps(w0, xv[t][0], acc[r][t][0]);
                acc[r][t][1] = _mm256_fmadd_ps(w1, xv[t][1], acc[r][t][1]);
            }
        }
    }
    if (i < n) { /* tail: lanes 0..rem-1 of the 16 get one more fma, the others keep their bits */
        const int rem = (int)(n - i);
        const __m256 m0 = lane_mask(rem), m1 = lane_mask(rem - 8 < 0 ? 0 : rem - 8);
        float xt[4][16], wt[16]; /* zero-padded copies of the tail */
        UNROLL for (int t = 0; t < tb; t++) {
            memset(xt[t], 0, sizeof xt[t]);
            memcpy(xt[t], (const float *)(const void *)(x + (size_t)t * xs) + i, (size_t)rem * 4);
        }
        UNROLL for (int r = 0; r < rb; r++) {
            memset(wt, 0, sizeof wt);
            for (int k = 0; k < rem; k++) wt[k] = w_scalar(type, w + (size_t)r * ws, i + k);
            const __m256 w0 = _mm256_loadu_ps(wt), w1 = _mm256_loadu_ps(wt + 8);
            UNROLL for (int t = 0; t < tb; t++) {
                const __m256 f0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt[t]), acc[r][t][0]);
                const __m256 f1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt[t] + 8), acc[r][t][1]);
                acc[r][t][0] = _mm256_blendv_ps(acc[r][t][0], f0, m0);
                acc[r][t][1] = _mm256_blendv_ps(acc[r][t][1], f1, m1);
            }
        }
    }
    UNROLL for (int r = 0; r < rb; r++) UNROLL for (int t = 0; t < tb; t++)
        y[(size_t)t * ys + (size_t)r] = reduce16(acc[r][t][0], acc[r][t][1]);
}

INLINE void mm_float_t(const int type, const uint8_t *w, size_t ws, int n_rows, const uint8_t *x,
                       size_t xs, int n_tok, float *y, size_t ys, int64_t n) {
    if (n_tok < 2) { /* decode: 4 rows at a time, 8 independent fma chains */
        for (int t = 0; t < n_tok; t++) {
            const uint8_t *xt = x + (size_t)t * xs;
            float *yt = y + (size_t)t * ys;
            int r = 0;
            for (; r + 4 <= n_rows; r += 4) ftile(type, 4, 1, w + (size_t)r * ws, ws, xt, xs, yt + r, ys, n);
            for (; r < n_rows; r++) ftile(type, 1, 1, w + (size_t)r * ws, ws, xt, xs, yt + r, ys, n);
        }
        return;
    }
    /* prefill: 2 rows x 2 tokens (8 accumulator ymm + 4 operands fit the 16 registers), rows
     * outer so the two weight rows stay in cache while every token pair uses them */
    for (int r = 0; r < n_rows; r += 2) {
        const int rb = KVB_MIN(2, n_rows - r);
        const uint8_t *wr = w + (size_t)r * ws;
        int t = 0;
        for (; t + 2 <= n_tok; t += 2) {
            const uint8_t *xt = x + (size_t)t * xs;
            float *yt = y + (size_t)t * ys + r;
            if (rb == 2) ftile(type, 2, 2, wr, ws, xt, xs, yt, ys, n);
            else ftile(type, 1, 2, wr, ws, xt, xs, yt, ys, n);
        }
        for (; t < n_tok; t++) {
            const uint8_t *xt = x + (size_t)t * xs;
            float *yt = y + (size_t)t * ys + r;
            if (rb == 2) ftile(type, 2, 1, wr, ws, xt, xs, yt, ys, n);
            else ftile(type, 1, 1, wr, ws, xt, xs, yt, ys, n);
        }
    }
}

/* ---- quant weights ------------------------------------------------------------------------ */

/* The fifth bits of a Q5_0 block (qh, bit j = element j) as 32 bytes of 0 or 16. */
INLINE __m256i q5_0_high(const uint8_t *qh_bytes) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                            _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                               0x0303030303030303)); /* byte j/8 */
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201);             /* bit j%8 */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit), _mm256_set1_epi8(16));
}

/* 32 signed weight bytes of one block (Q8_0 qs as is; Q4_0 nibbles - 8, Q5_0 5-bit q - 16;
 * element order). */
INLINE __m256i ldq(const int type, const uint8_t *blk) {
    if (type == KVB_TYPE_Q8_0) return _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2));
    const int qs_off = type == KVB_TYPE_Q4_0 ? 2 : 6;
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(blk + qs_off));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
    if (type == KVB_TYPE_Q4_0) return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
    return _mm256_sub_epi8(_mm256_or_si256(nib, q5_0_high(blk + 2)), _mm256_set1_epi8(16));
}

/* Eight exact int32 partial sums of one block: sum over 4 elements each, each pair of products
 * times the int16 in `mul` (ones, or Q6_K's scales). */
INLINE __m256i bdot_mul(__m256i w, __m256i x, __m256i mul) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p, mul);
}
INLINE __m256i bdot(__m256i w, __m256i x) { return bdot_mul(w, x, _mm256_set1_epi16(1)); }

/* Block sums of 8 blocks (v[k] = bdot of block k) -> lane k = sum of block k. */
INLINE __m256i hsum8(const __m256i v[8]) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20),
                            _mm256_permute2x128_si256(q0, q1, 0x31));
}

/* fp16 scales of 8 blocks (the first at blk, `stride` bytes apart) as f32: two 64-bit words built
 * from scalar loads, not a gather (vpgatherdd is microcoded on AMD cores: it held a quarter of the
 * Q8_0 kernel's time there). */
INLINE uint64_t d4(const uint8_t *blk, int stride) {
    uint16_t h[4];
    for (int k = 0; k < 4; k++) memcpy(&h[k], blk + k * stride, 2);
    return (uint64_t)h[0] | (uint64_t)h[1] << 16 | (uint64_t)h[2] << 32 | (uint64_t)h[3] << 48;
}
INLINE __m256 load_d8(const uint8_t *blk, int stride) {
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)d4(blk + 4 * stride, stride), (long long)d4(blk, stride)));
}

#define QT2 4 /* tokens per weight load */

/* Q8_0 / Q4_0 / Q5_0 weights (type a compile-time constant after inlining). */
INLINE void mm_quant_t(const int type, const uint8_t *w, size_t ws, int n_rows, const uint8_t *x,
                       size_t xs, int n_tok, float *y, size_t ys, int64_t n) {
    const int wbb = type == KVB_TYPE_Q8_0 ? 34 : type == KVB_TYPE_Q4_0 ? 18 : 22;
    const int64_t nb = n / 32, ng = (nb + 7) / 8;
    const int tail = (int)(nb % 8);
    const __m256 tmask = lane_mask(tail);
    uint8_t wpad[8 * 34], xpad[QT2][8 * 34]; /* zero-padded partial last group */
    memset(wpad, 0, sizeof wpad);
    memset(xpad, 0, sizeof xpad);
    enum { XD_KEEP = 256 };    /* groups whose activation scales are converted once per tile (n <= 65536) */
    __m256 xdk[QT2][XD_KEEP]; /* [token][group] */
    const int64_t n_keep = ng - (tail != 0) <= XD_KEEP ? ng - (tail != 0) : 0;

    for (int t0 = 0; t0 < n_tok; t0 += QT2) {
        const int nt = KVB_MIN(QT2, n_tok - t0);
        for (int t = 0; t < nt; t++)
            for (int64_t g = 0; g < n_keep; g++) xdk[t][g] = load_d8(x + (size_t)(t0 + t) * xs + (size_t)g * 8 * 34, 34);
        for (int r = 0; r < n_rows; r++) {
            __m256 acc[QT2][2];
            for (int t = 0; t < nt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
            const uint8_t *wr = w + (size_t)r * ws;
            for (int64_t g = 0; g < ng; g++) {
                const int partial = tail != 0 && g == ng - 1;
                const uint8_t *wb = wr + (size_t)g * 8 * (size_t)wbb;
                if (partial) {
                    memcpy(wpad, wb, (size_t)tail * (size_t)wbb);
                    wb = wpad;
                }
                __m256i wq[8];
                UNROLL for (int k = 0; k < 8; k++) wq[k] = ldq(type, wb + k * wbb);
                const __m256 wd = load_d8(wb, wbb);
                for (int t = 0; t < nt; t++) {
                    const uint8_t *xb = x + (size_t)(t0 + t) * xs + (size_t)g * 8 * 34;
                    if (partial) {
                        memcpy(xpad[t], xb, (size_t)tail * 34);
                        xb = xpad[t];
                    }
                    __m256i v[8];
                    UNROLL for (int k = 0; k < 8; k++)
                        v[k] = bdot(wq[k], _mm256_loadu_si256((const __m256i *)(const void *)(xb + 34 * k + 2)));
                    const __m256 sf = _mm256_cvtepi32_ps(hsum8(v));
                    const __m256 d = _mm256_mul_ps(wd, g < n_keep ? xdk[t][g] : load_d8(xb, 34));
                    const __m256 f = _mm256_fmadd_ps(sf, d, acc[t][g & 1]);
                    acc[t][g & 1] = partial ? _mm256_blendv_ps(acc[t][g & 1], f, tmask) : f;
                }
            }
            for (int t = 0; t < nt; t++)
                y[(size_t)(t0 + t) * ys + (size_t)r] = reduce16(acc[t][0], acc[t][1]);
        }
    }
}

/* ---- K-quant weights: one super-block is one group of 8 activation blocks (lanes 0-7 or 8-15) */

/* A Q4_K / Q5_K super-block's 8 sub-blocks as unsigned bytes (q, element order) and the exact
 * per-sub-block scale products fp16(d)*sc (wdA) and fp16(dmin)*m (wdM). */
INLINE void ld_q45k(const int five, const uint8_t *sb, __m256i wq[8], __m256 *wdA, __m256 *wdM) {
    const uint8_t *qs = sb + (five ? 48 : 16);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i qh = _mm256_setzero_si256();
    if (five) qh = _mm256_loadu_si256((const __m256i *)(const void *)(sb + 16));
    UNROLL for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(qs + 32 * j));
        wq[2 * j] = _mm256_and_si256(v, m4);
        wq[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if (five) {
        const __m256i c16 = _mm256_set1_epi8(16);
        UNROLL for (int k = 0; k < 8; k++) { /* bit k of qh[l] -> bit 4 (16-bit shifts; masked) */
            const __m256i h = k <= 4 ? _mm256_slli_epi16(qh, 4 - k) : _mm256_srli_epi16(qh, k - 4);
            wq[k] = _mm256_or_si256(wq[k], _mm256_and_si256(h, c16));
        }
    }
    /* 6-bit scales: bytes 0-7 sc of sub-blocks 0..7, 8-15 their m (see kvb_quant.h) */
    const __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)(sb + 4));
    const __m128i ctrl_a = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m128i ctrl_c = _mm_setr_epi8(-128, -128, -128, -128, 0, 1, 2, 3, -128, -128, -128, -128, 4, 5, 6, 7);
    const __m128i mask_a = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i mask_b = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
    const __m128i a = _mm_shuffle_epi8(raw, ctrl_a), c = _mm_shuffle_epi8(raw, ctrl_c);
    const __m128i low = _mm_or_si128(_mm_and_si128(a, mask_a), _mm_and_si128(_mm_srli_epi16(a, 4), mask_b));
    const __m128i scm = _mm_or_si128(low, _mm_srli_epi16(_mm_and_si128(c, _mm_set1_epi8((char)0xc0)), 2));
    uint16_t d, dmin;
    memcpy(&d, sb, 2);
    memcpy(&dmin, sb + 2, 2);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scm));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scm, 8)));
    *wdA = _mm256_mul_ps(_mm256_set1_ps(kvb_fp16_to_f32(d)), sc);    /* exact */
    *wdM = _mm256_mul_ps(_mm256_set1_ps(kvb_fp16_to_f32(dmin)), m);  /* exact */
}

/* A Q6_K super-block's 8 blocks as signed bytes q - 32 and, per block, the int16 multipliers
 * for bdot_mul (scales[2k] for its first 16 elements, scales[2k+1] for the rest). */
INLINE void ld_q6k(const uint8_t *sb, __m256i wq[8], __m256i sc16[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    UNROLL for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(const void *)(sb + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(const void *)(sb + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)(sb + 128 + 32 * h));
        /* block 4h + c: low nibbles of l0 (c 0), l1 (1), high nibbles of l0 (2), l1 (3); top
         * bits 2c, 2c+1 of qh moved to bits 4-5 */
        wq[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        wq[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        wq[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
        wq[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
    }
    UNROLL for (int k = 0; k < 8; k++) wq[k] = _mm256_sub_epi8(wq[k], c32);
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(sb + 192))); /* 16 x i16 */
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,   /* low lane: word 0 */
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3); /* high: word 1 */
    UNROLL for (int k = 0; k < 8; k++) /* dword k = (scales[2k], scales[2k+1]) everywhere, then split */
        sc16[k] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(k)), pick);
}

#define KR2 4 /* rows per K-quant tile (share one activation preparation) */

/* Q4_K / Q5_K / Q6_K weights, in tiles of KR2 rows x QT2 tokens so that each activation group's
 * preparation (its scales and, for Q4_K/Q5_K, -sum(x) per block) is shared by the tile's rows. */
INLINE void mm_kquant_t(const int type, const uint8_t *w, size_t ws, int n_rows, const uint8_t *x,
                        size_t xs, int n_tok, float *y, size_t ys, int64_t n) {
    const int sbb = type == KVB_TYPE_Q4_K ? 144 : type == KVB_TYPE_Q5_K ? 176 : 210;
    const int64_t ng = n / 256;
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int t0 = 0; t0 < n_tok; t0 += QT2) {
        const int nt = KVB_MIN(QT2, n_tok - t0);
        for (int r0 = 0; r0 < n_rows; r0 += KR2) {
            const int nr = KVB_MIN(KR2, n_rows - r0);
            __m256 acc[KR2][QT2][2]; /* [row][token][lanes 0-7 | 8-15] */
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
            for (int64_t g = 0; g < ng; g++) {
                __m256 xd[QT2], nsx[QT2]; /* per token: the 8 blocks' scales and -sum(x) */
                for (int t = 0; t < nt; t++) {
                    const uint8_t *xb = x + (size_t)(t0 + t) * xs + (size_t)g * 8 * 34;
                    xd[t] = load_d8(xb, 34);
                    if (type != KVB_TYPE_Q6_K) {
                        __m256i v[8];
                        UNROLL for (int k = 0; k < 8; k++) {
                            const __m256i xq = _mm256_loadu_si256((const __m256i *)(const void *)(xb + 34 * k + 2));
                            v[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), xq), ones16);
                        }
                        nsx[t] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setzero_si256(), hsum8(v)));
                    }
                }
                for (int r = 0; r < nr; r++) {
                    const uint8_t *sb = w + (size_t)(r0 + r) * ws + (size_t)g * (size_t)sbb;
                    __m256i wq[8], sc16[8];
                    __m256 wdA, wdM;
                    if (type == KVB_TYPE_Q6_K) {
                        ld_q6k(sb, wq, sc16);
                        uint16_t d;
                        memcpy(&d, sb + 208, 2);
                        wdA = _mm256_set1_ps(kvb_fp16_to_f32(d));
                        wdM = wdA;
                    } else {
                        ld_q45k(type == KVB_TYPE_Q5_K, sb, wq, &wdA, &wdM);
                    }
                    for (int t = 0; t < nt; t++) {
                        const uint8_t *xb = x + (size_t)(t0 + t) * xs + (size_t)g * 8 * 34;
                        __m256i v[8];
                        UNROLL for (int k = 0; k < 8; k++) {
                            const __m256i xq = _mm256_loadu_si256((const __m256i *)(const void *)(xb + 34 * k + 2));
                            v[k] = type == KVB_TYPE_Q6_K ? bdot_mul(wq[k], xq, sc16[k]) /* signed q - 32 */
                                                         : _mm256_madd_epi16(_mm256_maddubs_epi16(wq[k], xq), ones16);
                        }
                        const __m256 sf = _mm256_cvtepi32_ps(hsum8(v));
                        __m256 f = _mm256_fmadd_ps(sf, _mm256_mul_ps(wdA, xd[t]), acc[r][t][g & 1]);
                        if (type != KVB_TYPE_Q6_K) f = _mm256_fmadd_ps(nsx[t], _mm256_mul_ps(wdM, xd[t]), f);
                        acc[r][t][g & 1] = f;
                    }
                }
            }
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++)
                    y[(size_t)(t0 + t) * ys + (size_t)(r0 + r)] = reduce16(acc[r][t][0], acc[r][t][1]);
        }
    }
}

#define MM_QUANT(fn, T, name)                                                                              \
    static void name(const uint8_t *w, size_t ws, int n_rows, const uint8_t *x, size_t xs, int n_tok,     \
                     float *y, size_t ys, int64_t n) {                                                    \
        fn(T, w, ws, n_rows, x, xs, n_tok, y, ys, n);                                                     \
    }
MM_QUANT(mm_quant_t, KVB_TYPE_Q8_0, mm_q8_0)
MM_QUANT(mm_quant_t, KVB_TYPE_Q4_0, mm_q4_0)
MM_QUANT(mm_quant_t, KVB_TYPE_Q5_0, mm_q5_0)
MM_QUANT(mm_kquant_t, KVB_TYPE_Q4_K, mm_q4_k)
MM_QUANT(mm_kquant_t, KVB_TYPE_Q5_K, mm_q5_k)
MM_QUANT(mm_kquant_t, KVB_TYPE_Q6_K, mm_q6_k)

static void matmul_avx2(uint32_t type, const void *w, size_t ws, int n_rows, const void *act,
                        size_t as, int n_tok, float *y, size_t ys, int64_t n) {
    switch (type) {
    case KVB_TYPE_F32: mm_float_t(KVB_TYPE_F32, w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_F16: mm_float_t(KVB_TYPE_F16, w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_BF16: mm_float_t(KVB_TYPE_BF16, w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_Q8_0: mm_q8_0(w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_Q4_0: mm_q4_0(w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_Q5_0: mm_q5_0(w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_Q4_K: mm_q4_k(w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_Q5_K: mm_q5_k(w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    default: mm_q6_k(w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    }
}

/* ---- activation quantiser (same bytes as kvb_quantize_q8_0_act_ref) ---------------------- */

static void quantize_q8_0_avx2(const float *x, void *dst, int64_t n) {
    kvb_block_q8_0 *yb = dst; /* [n/32] */
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t b = 0; b < n / 32; b++) {
        __m256 v[4];
        int nan = 0;
        __m256 m = _mm256_setzero_ps();
        UNROLL for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 32 * b + 8 * k);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
            m = _mm256_max_ps(m, _mm256_and_ps(v[k], absm));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float amax = nan ? __builtin_nanf("") : _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        UNROLL for (int k = 0; k < 4; k++) {
            const __m256 s = _mm256_mul_ps(v[k], vid);
            const __m256 ok = _mm256_cmp_ps(s, s, _CMP_ORD_Q);
            const __m256 c = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(s, lo), hi), ok); /* NaN -> 0 */
            q[k] = _mm256_cvttps_epi32(_mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        /* 32 int32 in [-127, 127] -> 32 int8 in order (packs work per 128-bit lane). */
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]); /* q0l q1l | q0h q1h */
        const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);  /* q0l q1l q2l q3l | q0h q1h q2h q3h */
        const __m256i out = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        yb[b].d = kvb_f32_to_fp16(d);
        _mm256_storeu_si256((__m256i *)(void *)yb[b].qs, out);
    }
}

/* F16C conversion is exact (every fp16 value is an f32 value), so this matches the scalar loop. */
static void f16_to_f32_avx2(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src + i))));
    for (; i < n; i++) dst[i] = kvb_fp16_to_f32(src[i]);
}

/* Q8_0 -> f32: int8 -> f32 is exact and the one product rounds as the scalar (float)q * d does. */
static void q8_0_to_f32_avx2(const void *src, float *dst, int64_t n_blocks) {
    const kvb_block_q8_0 *b = src; /* (n_blocks) */
    for (int64_t i = 0; i < n_blocks; i++) {
        const __m256 d = _mm256_set1_ps(kvb_fp16_to_f32(b[i].d));
        for (int g = 0; g < 4; g++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(const void *)(b[i].qs + 8 * g));
            _mm256_storeu_ps(dst + i * 32 + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
        }
    }
}

/* kvb_f32_rows_weighted_add: 32 accumulator elements in registers across all rows, then the next
 * 32; mul then add (two roundings, as the contract says); the tail past a multiple of 8 runs the
 * scalar chain, which is the same operations. */
static void rows_weighted_add_avx2(float *acc, const float *w, const float *rows, size_t row_stride, int n_rows,
                                   int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + i), a1 = _mm256_loadu_ps(acc + i + 8);
        __m256 a2 = _mm256_loadu_ps(acc + i + 16), a3 = _mm256_loadu_ps(acc + i + 24);
        for (int r = 0; r < n_rows; r++) {
            const float *row = rows + (size_t)r * row_stride + i;
            const __m256 wr = _mm256_set1_ps(w[r]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(wr, _mm256_loadu_ps(row)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(wr, _mm256_loadu_ps(row + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(wr, _mm256_loadu_ps(row + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(wr, _mm256_loadu_ps(row + 24)));
        }
        _mm256_storeu_ps(acc + i, a0);
        _mm256_storeu_ps(acc + i + 8, a1);
        _mm256_storeu_ps(acc + i + 16, a2);
        _mm256_storeu_ps(acc + i + 24, a3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(acc + i);
        for (int r = 0; r < n_rows; r++) {
            const __m256 prod = _mm256_mul_ps(_mm256_set1_ps(w[r]), _mm256_loadu_ps(rows + (size_t)r * row_stride + i));
            a = _mm256_add_ps(a, prod);
        }
        _mm256_storeu_ps(acc + i, a);
    }
    for (; i < n; i++) {
        float a = acc[i];
        for (int r = 0; r < n_rows; r++) {
            const float prod = w[r] * rows[(size_t)r * row_stride + i];
            a = a + prod;
        }
        acc[i] = a;
    }
}

const kvb_quant_kernels kvb_quant_kernels_avx2 = {
    .name = "avx2",
    .matmul = matmul_avx2,
    .quantize_q8_0 = quantize_q8_0_avx2,
    .f16_to_f32 = f16_to_f32_avx2,
    .q8_0_to_f32 = q8_0_to_f32_avx2,
    .rows_weighted_add = rows_weighted_add_avx2,
};
