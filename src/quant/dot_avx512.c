/* quant/dot_avx512.c — AVX-512 (F/BW/VL/DQ + VNNI) kernels of the canonical dot product.
 * Float weights (F32/F16/BF16): one zmm holds the 16 canonical accumulators, element i goes to
 * lane i % 16 with one vfmadd per 16 elements; a tile of up to 8 rows x 4 tokens keeps that
 * many independent chains in registers, and a tail of n % 16 elements uses masked loads and a
 * masked fma so untouched lanes keep their exact bits. Quant weights (Q8_0, Q4_0, Q5_0, Q4_K,
 * Q5_K, Q6_K x Q8_0 activations): 16 consecutive 32-element blocks are transposed so that dword
 * lane j of eight zmm holds block perm(j)'s 32 bytes (a fixed per-type permutation that makes the
 * transpose cheap, see "quant weights"); then eight vpdpbusd give the exact int32 block sums of 16
 * blocks at once. vpdpbusd wants unsigned x signed bytes, so Q8_0 weights are offset by +128
 * (w ^ 0x80) and the others use their raw unsigned q, with the exact correction -offset*sum(x)
 * preloaded in the accumulator (exact for every byte value); Q4_K/Q5_K's min term is its own fma
 * with -sum(x), Q6_K's two half-block scales are applied to the two exact half sums. The sums are
 * converted to f32 and fma'd with the scale products into the accumulator whose lane j is
 * canonical lane perm(j); a final vpermps restores the canonical lane order before the 8-4-2-1
 * reduction. Activations are transposed once per tile and group and reused by all rows; each
 * weight group is transposed once and reused by all tokens. Everything is exact integer work or
 * the same IEEE operations, in the same order, as the scalar spec. */
#include <immintrin.h>
#include <string.h>

#include "kvb_quant.h"
#include "quant_impl.h"

#define UNROLL _Pragma("GCC unroll 16")
#define INLINE static inline __attribute__((always_inline))

/* The canonical 8-4-2-1 reduction of 16 lanes. */
INLINE float reduce16(__m512 a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

/* ---- float weights ------------------------------------------------------------------------ */

/* 16 weights starting at element i, as exact f32. */
INLINE __m512 ldw(const int type, const uint8_t *p, int64_t i) {
    if (type == KVB_TYPE_F32) return _mm512_loadu_ps((const float *)(const void *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)(const void *)p + i));
    if (type == KVB_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
INLINE __m512 ldw_mask(const int type, const uint8_t *p, int64_t i, __mmask16 m) {
    if (type == KVB_TYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)(const void *)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)(const void *)p + i);
    if (type == KVB_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* rb rows x tb tokens (rb <= 8, tb <= 4, compile-time constants after inlining). */
INLINE void ftile(const int type, const int rb, const int tb, const uint8_t *w, size_t ws,
                  const uint8_t *x, size_t xs, float *y, size_t ys, int64_t n) {
    __m512 acc[8][4];
    UNROLL for (int r = 0; r < rb; r++) UNROLL for (int t = 0; t < tb; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 xv[4];
        UNROLL for (int t = 0; t < tb; t++) xv[t] = _mm512_loadu_ps((const float *)(const void *)(x + (size_t)t * xs) + i);
        UNROLL for (int r = 0; r < rb; r++) {
            const __m512 wv = ldw(type, w + (size_t)r * ws, i);
            UNROLL for (int t = 0; t < tb; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    if (i < n) { /* element i still goes to lane i % 16; lanes past n keep their bits */
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        __m512 xv[4];
        UNROLL for (int t = 0; t < tb; t++) xv[t] = _mm512_maskz_loadu_ps(m, (const float *)(const void *)(x + (size_t)t * xs) + i);
        UNROLL for (int r = 0; r < rb; r++) {
            const __m512 wv = ldw_mask(type, w + (size_t)r * ws, i, m);
            UNROLL for (int t = 0; t < tb; t++) acc[r][t] = _mm512_mask3_fmadd_ps(wv, xv[t], acc[r][t], m);
        }
    }
    UNROLL for (int r = 0; r < rb; r++) UNROLL for (int t = 0; t < tb; t++) y[(size_t)t * ys + (size_t)r] = reduce16(acc[r][t]);
}

INLINE void mm_float_t(const int type, const uint8_t *w, size_t ws, int n_rows, const uint8_t *x,
                       size_t xs, int n_tok, float *y, size_t ys, int64_t n) {
    if (n_tok < 4) { /* decode: 8 rows at a time, 8 independent fma chains per token */
        for (int t = 0; t < n_tok; t++) {
            const uint8_t *xt = x + (size_t)t * xs;
            float *yt = y + (size_t)t * ys;
            int r = 0;
            for (; r + 8 <= n_rows; r += 8) ftile(type, 8, 1, w + (size_t)r * ws, ws, xt, xs, yt + r, ys, n);
            for (; r + 4 <= n_rows; r += 4) ftile(type, 4, 1, w + (size_t)r * ws, ws, xt, xs, yt + r, ys, n);
            for (; r < n_rows; r++) ftile(type, 1, 1, w + (size_t)r * ws, ws, xt, xs, yt + r, ys, n);
        }
        return;
    }
    /* prefill: rows outer so a 4-row weight tile stays in L1/L2 while every token group uses it */
    int r = 0;
    for (; r < n_rows; r += 4) {
        const int rb = KVB_MIN(4, n_rows - r);
        const uint8_t *wr = w + (size_t)r * ws;
        int t = 0;
        for (; t + 4 <= n_tok; t += 4) {
            const uint8_t *xt = x + (size_t)t * xs;
            float *yt = y + (size_t)t * ys + r;
            if (rb == 4) ftile(type, 4, 4, wr, ws, xt, xs, yt, ys, n);
            else
                for (int k = 0; k < rb; k++) ftile(type, 1, 4, wr + (size_t)k * ws, ws, xt, xs, yt + k, ys, n);
        }
        for (; t < n_tok; t++) {
            const uint8_t *xt = x + (size_t)t * xs;
            float *yt = y + (size_t)t * ys + r;
            if (rb == 4) ftile(type, 4, 1, wr, ws, xt, xs, yt, ys, n);
            else
                for (int k = 0; k < rb; k++) ftile(type, 1, 1, wr + (size_t)k * ws, ws, xt, xs, yt + k, ys, n);
        }
    }
}

/* ---- quant weights ------------------------------------------------------------------------ */

/* A group is 16 consecutive activation blocks (512 elements; for the K-quants two super-blocks).
 * Its blocks are transposed so that dword lane j of eight zmm q[0..7] holds the 32 bytes of block
 * perm(j) (q[i] lane j = elements 4i..4i+3). The transposition starts from eight zmm z[p], each
 * holding two whole blocks (block A[p] in its low 256 bits, B[p] in its high 256 bits); after it,
 * lane j = 4L + m holds block A[m] (L = 0), B[m] (L = 1), A[4+m] (L = 2), B[4+m] (L = 3). Each
 * weight type uses the pairing its storage makes cheap, and its activations are transposed with
 * the same pairing:
 *   Q8_0/Q4_0/Q5_0: A = 0,4,8,12,2,6,10,14, B = A+1  -> perm(j) = 4(j%4) + j/4
 *   Q4_K/Q5_K:      A = 0,1,4,5,8,9,12,13,  B = A+2  (the low nibbles of one 64-byte load of qs
 *                   are sub-blocks 2k and 2k+2, the high nibbles 2k+1 and 2k+3)
 *   Q6_K:           A = 0,2,4,6,8,10,12,14, B = A+1  (the low nibbles of 64 ql bytes are blocks
 *                   4h and 4h+1, the high nibbles 4h+2 and 4h+3)
 * For the K-quants lanes 0-7 are then the first super-block and lanes 8-15 the second. */
static const int k_pair_a[3][8] = {
    {0, 4, 8, 12, 2, 6, 10, 14}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
static const int k_pair_b[3][8] = {
    {1, 5, 9, 13, 3, 7, 11, 15}, {2, 3, 6, 7, 10, 11, 14, 15}, {1, 3, 5, 7, 9, 11, 13, 15}};

INLINE int pairing(const int type) {
    return type == KVB_TYPE_Q4_K || type == KVB_TYPE_Q5_K ? 1 : type == KVB_TYPE_Q6_K ? 2 : 0;
}

/* perm[j]: the block (= canonical lane) in lane j for a pairing; perm_inv[perm[j]] = j. */
static void lane_blocks(int pairing_id, int perm[16], int perm_inv[16]) {
    for (int j = 0; j < 16; j++) {
        const int L = j / 4, m = j % 4;
        perm[j] = (L % 2 ? k_pair_b : k_pair_a)[pairing_id][m + 4 * (L / 2)];
    }
    for (int j = 0; j < 16; j++) perm_inv[perm[j]] = j;
}

/* One 4x4 dword transpose inside each 128-bit lane: out[i].lane128[c] = {a0.c.i, a1.c.i, a2.c.i,
 * a3.c.i} (dword i of 128-bit lane c of each input). */
INLINE void tr4(__m512i a0, __m512i a1, __m512i a2, __m512i a3, __m512i out[4]) {
    const __m512i l01 = _mm512_unpacklo_epi32(a0, a1), h01 = _mm512_unpackhi_epi32(a0, a1);
    const __m512i l23 = _mm512_unpacklo_epi32(a2, a3), h23 = _mm512_unpackhi_epi32(a2, a3);
    out[0] = _mm512_unpacklo_epi64(l01, l23);
    out[1] = _mm512_unpackhi_epi64(l01, l23);
    out[2] = _mm512_unpacklo_epi64(h01, h23);
    out[3] = _mm512_unpackhi_epi64(h01, h23);
}

/* z[0..7] (two blocks each, see above) -> q[0..7] transposed. */
INLINE void tr_pairs(const __m512i z[8], __m512i q[8]) {
    __m512i a[4], b[4];
    tr4(z[0], z[1], z[2], z[3], a); /* lanes128: A[0..3].dw i | A[0..3].dw 4+i | B[0..3].dw i | .. */
    tr4(z[4], z[5], z[6], z[7], b); /* the same for A[4..7], B[4..7] */
    UNROLL for (int i = 0; i < 4; i++) {
        q[i] = _mm512_shuffle_i32x4(a[i], b[i], 0x88);     /* 128-lanes a0 a2 b0 b2 */
        q[4 + i] = _mm512_shuffle_i32x4(a[i], b[i], 0xDD); /* 128-lanes a1 a3 b1 b3 */
    }
}

/* 16 Q8_0 blocks (34 bytes each: activations, or Q8_0 weights) paired by pairing_id, each byte
 * xor'ed with `flip` (0x80 turns int8 weights into uint8 w+128; 0 keeps them). */
INLINE void tr_q8(const int pairing_id, const uint8_t *blk, __m512i q[8], __m512i flip) {
    __m512i z[8];
    UNROLL for (int p = 0; p < 8; p++) {
        const uint8_t *lo = blk + 34 * k_pair_a[pairing_id][p] + 2, *hi = blk + 34 * k_pair_b[pairing_id][p] + 2;
        const __m256i l = _mm256_loadu_si256((const __m256i *)(const void *)lo);
        const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)hi);
        z[p] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1), flip);
    }
    tr_pairs(z, q);
}

/* The fifth bits of Q5_0 elements 16h..16h+15 of blocks b0..b0+3 (22 bytes apart) as one mask:
 * bit 16c + j = bit 16h + j of block b0+c's qh, i.e. the byte layout of tr_nibbles's z before its
 * transpose. Plain integer loads: cheaper than spreading bits inside vectors. */
static inline __mmask64 q5_0_fifth_mask(const uint8_t *b0, int h) {
    uint64_t m = 0;
    for (int c = 0; c < 4; c++) {
        uint16_t v;
        memcpy(&v, b0 + 22 * c + 2 + 2 * h, 2);
        m |= (uint64_t)v << (16 * c);
    }
    return (__mmask64)m;
}

/* 16 Q4_0 / Q5_0 blocks (bb = 18 / 22 bytes each, nibbles at byte qs_off = 2 / 6) -> q[i] lane j
 * = elements 4i..4i+3 of block perm(j) (pairing 0) as unsigned bytes: Q4_0's nibbles, Q5_0's
 * nibbles + 16 * fifth bit. */
INLINE void tr_nibbles(const uint8_t *blk, const int bb, const int qs_off, __m512i q[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), c16 = _mm512_set1_epi8(16);
    __m512i lo[4], hi[4];
    UNROLL for (int m = 0; m < 4; m++) {
        const uint8_t *b = blk + bb * 4 * m + qs_off;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)b));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(b + bb)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(b + 2 * bb)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(b + 3 * bb)), 3);
        lo[m] = _mm512_and_si512(z, m4);                         /* elements 0-15 of 4 blocks */
        hi[m] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);   /* elements 16-31 */
        if (bb == 22) {
            const uint8_t *b0 = blk + bb * 4 * m;
            lo[m] = _mm512_mask_add_epi8(lo[m], q5_0_fifth_mask(b0, 0), lo[m], c16);
            hi[m] = _mm512_mask_add_epi8(hi[m], q5_0_fifth_mask(b0, 1), hi[m], c16);
        }
    }
    tr4(lo[0], lo[1], lo[2], lo[3], q);     /* lane 4c+m = block 4m+c = perm(4c+m) */
    tr4(hi[0], hi[1], hi[2], hi[3], q + 4); /* elements 16.. = 4i for i = 4..7 */
}

/* A 512-bit vector of byte lo in bytes 0-31 and byte hi in bytes 32-63. */
INLINE __m512i bytes2(int lo, int hi) {
    return _mm512_inserti64x4(_mm512_set1_epi8((char)lo), _mm256_set1_epi8((char)hi), 1);
}

/* fp16 values a (lanes 0-7) and b (lanes 8-15) as f32. */
INLINE __m512 f16_pair(const uint8_t *pa, const uint8_t *pb) {
    uint16_t a, b;
    memcpy(&a, pa, 2);
    memcpy(&b, pb, 2);
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a)));
}

/* Two Q4_K / Q5_K super-blocks (sbb = 144 / 176 bytes) -> q (pairing 1: 4/5-bit unsigned q per
 * byte) and the exact per-lane scale products wdA = fp16(d) * sc, wdM = fp16(dmin) * m. */
INLINE void tr_q45k(const int five, const uint8_t *sb, __m512i q[8], __m512 *wdA, __m512 *wdM) {
    const int sbb = five ? 176 : 144, qs_off = five ? 48 : 16;
    const __m512i m4 = _mm512_set1_epi8(0x0f), c16 = _mm512_set1_epi8(16);
    __m512i z[8];
    UNROLL for (int S = 0; S < 2; S++) {
        const uint8_t *b = sb + S * sbb;
        __m512i qh = _mm512_setzero_si512();
        if (five) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(const void *)(b + 16)));
        UNROLL for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_loadu_si512((const void *)(b + qs_off + 64 * h));
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (five) { /* lo: sub-blocks 4h | 4h+2, hi: 4h+1 | 4h+3; bit s of qh[l] */
                const __mmask64 lo5 = _mm512_test_epi8_mask(qh, bytes2(1 << (4 * h), 1 << (4 * h + 2)));
                const __mmask64 hi5 = _mm512_test_epi8_mask(qh, bytes2(2 << (4 * h), 2 << (4 * h + 2)));
                lo = _mm512_mask_add_epi8(lo, lo5, lo, c16);
                hi = _mm512_mask_add_epi8(hi, hi5, hi, c16);
            }
            z[4 * S + 2 * h] = lo;
            z[4 * S + 2 * h + 1] = hi;
        }
    }
    tr_pairs(z, q);
    /* The 6-bit scales and mins in lane order: within a super-block lanes 0-7 are sub-blocks
     * 0,1,4,5,2,3,6,7. Bytes 0-7 of each 128-bit half become sc, 8-15 m:
     *   low 6 / 4 bits: sc s<4: b[s]&63, s>=4: b[s+4]&15; m s<4: b[s+4]&63, s>=4: b[s+4]>>4
     *   top 2 bits (s >= 4): sc: b[s-4]>>6, m: b[s]>>6, moved to bits 4-5 */
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(sb + 4))),
        _mm_loadu_si128((const __m128i *)(const void *)(sb + sbb + 4)), 1);
    const __m256i ctrl_a = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 8, 9, 6, 7, 10, 11));
    const __m256i ctrl_c = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(-128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7));
    const __m256i mask_a =
        _mm256_broadcastsi128_si256(_mm_setr_epi8(63, 63, 15, 15, 63, 63, 15, 15, 63, 63, 0, 0, 63, 63, 0, 0));
    const __m256i mask_b = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 0, 0, 15, 15));
    const __m256i a = _mm256_shuffle_epi8(raw, ctrl_a), c = _mm256_shuffle_epi8(raw, ctrl_c);
    const __m256i low = _mm256_or_si256(_mm256_and_si256(a, mask_a), _mm256_and_si256(_mm256_srli_epi16(a, 4), mask_b));
    const __m256i top = _mm256_srli_epi16(_mm256_and_si256(c, _mm256_set1_epi8((char)0xc0)), 2);
    const __m256i scm = _mm256_permute4x64_epi64(_mm256_or_si256(low, top), _MM_SHUFFLE(3, 1, 2, 0));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(scm)));
    const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(scm, 1)));
    *wdA = _mm512_mul_ps(f16_pair(sb, sb + sbb), sc);         /* exact */
    *wdM = _mm512_mul_ps(f16_pair(sb + 2, sb + sbb + 2), m);  /* exact */
}

/* Two Q6_K super-blocks -> q (pairing 2: 6-bit unsigned q per byte), the per-lane scales of the
 * block's two 16-element halves (sc0, sc1 as f32) and fp16(d) per lane. */
INLINE void tr_q6k(const uint8_t *sb, __m512i q[8], __m512 *wd, __m512 *sc0, __m512 *sc1) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* top bits: blocks 4h (bits 0-1 of qh[l]) and 4h+1 (bits 2-3) shift left by 4 and 2 to bits
     * 4-5; blocks 4h+2 (bits 4-5) and 4h+3 (bits 6-7) shift right by 0 and 2 (16-bit shifts: the
     * bits crossing into the neighbouring byte are masked off) */
    const __m512i sh_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sh_hi = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m512i z[8];
    UNROLL for (int S = 0; S < 2; S++) {
        UNROLL for (int h = 0; h < 2; h++) {
            const uint8_t *b = sb + 210 * S;
            const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * h));
            const __m256i qh32 = _mm256_loadu_si256((const __m256i *)(const void *)(b + 128 + 32 * h));
            const __m512i qh = _mm512_broadcast_i64x4(qh32);
            const __m512i tlo = _mm512_and_si512(_mm512_sllv_epi16(qh, sh_lo), m30);
            const __m512i thi = _mm512_and_si512(_mm512_srlv_epi16(qh, sh_hi), m30);
            /* 0xEA: (a & b) | c */
            z[4 * S + 2 * h] = _mm512_ternarylogic_epi32(v, m4, tlo, 0xEA);
            z[4 * S + 2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m4, thi, 0xEA);
        }
    }
    tr_pairs(z, q);
    /* lanes 0-7 of a super-block are blocks 0,2,4,6,1,3,5,7: their scales [2k] then [2k+1] */
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(sb + 192))),
        _mm_loadu_si128((const __m128i *)(const void *)(sb + 210 + 192)), 1);
    const __m256i ctrl =
        _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15));
    const __m256i s = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(raw, ctrl), _MM_SHUFFLE(3, 1, 2, 0));
    *sc0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(s)));
    *sc1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(s, 1)));
    *wd = f16_pair(sb + 208, sb + 210 + 208);
}

/* The 16 fp16 scales (first two bytes of each 32-element block) in lane order: byte_idx[j] is
 * the byte offset of block perm(j); each gather reads 4 bytes, all inside the block. */
INLINE __m512 gather_d(const uint8_t *blk, __m512i byte_idx) {
    const __m512i g = _mm512_i32gather_epi32(byte_idx, (const void *)blk, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

/* One activation group (16 Q8_0 blocks) prepared for the weight type. */
typedef struct {
    __m512i q[8];     /* transposed qs (the weight type's pairing) */
    __m512 d;         /* x scales, lane order */
    __m512i negcorr;  /* Q8_0/Q4_0/Q5_0: -(128/8/16) * sum of the block's qs; Q6_K: -32 * sum of
                         its elements 0-15 */
    __m512i negcorr1; /* Q6_K: -32 * sum of elements 16-31 */
    __m512 nsx;       /* Q4_K/Q5_K: -(float)(sum of the block's qs) */
} xgroup;

INLINE void prep_x(const int type, const uint8_t *xblk, xgroup *o, const __m512i idx34) {
    tr_q8(pairing(type), xblk, o->q, _mm512_setzero_si512());
    o->d = gather_d(xblk, idx34);
    const __m512i zero = _mm512_setzero_si512();
    if (type == KVB_TYPE_Q4_K || type == KVB_TYPE_Q5_K) {
        const __m512i ones = _mm512_set1_epi8(1);
        __m512i c = zero;
        UNROLL for (int i = 0; i < 8; i++) c = _mm512_dpbusd_epi32(c, ones, o->q[i]);
        o->nsx = _mm512_cvtepi32_ps(_mm512_sub_epi32(zero, c)); /* exact: |sum| <= 32*127 */
    } else if (type == KVB_TYPE_Q6_K) {
        const __m512i c32 = _mm512_set1_epi8(32);
        __m512i c0 = zero, c1 = zero;
        UNROLL for (int i = 0; i < 4; i++) {
            c0 = _mm512_dpbusd_epi32(c0, c32, o->q[i]);
            c1 = _mm512_dpbusd_epi32(c1, c32, o->q[4 + i]);
        }
        o->negcorr = _mm512_sub_epi32(zero, c0);
        o->negcorr1 = _mm512_sub_epi32(zero, c1);
    } else {
        const char offset = type == KVB_TYPE_Q8_0 ? (char)0x80 : type == KVB_TYPE_Q4_0 ? 8 : 16;
        const __m512i corr_bytes = _mm512_set1_epi8(offset);
        __m512i c = zero;
        UNROLL for (int i = 0; i < 8; i++) c = _mm512_dpbusd_epi32(c, corr_bytes, o->q[i]);
        o->negcorr = _mm512_sub_epi32(zero, c);
    }
}

#define QT 16 /* tokens per chunk */
#define QR 16 /* rows per chunk (share one activation preparation) */

/* Every quantised weight type; `type` is a compile-time constant after inlining. Weights: exact
 * integer block sums by vpdpbusd (unsigned weight bytes x signed activations: Q8_0 weights are
 * offset by +128, the others are stored unsigned: Q4_0/Q5_0 q, Q6_K q with the -8/-16/-128/-32
 * offset folded into the accumulator's start as -offset * sum(x), exact for every byte value).
 * Q4_K/Q5_K need no offset: the min term is its own fma with -sum(x). Q6_K's two 16-element
 * halves are summed apart and combined as sc0*s0 + sc1*s1 in f32, exactly (every partial result
 * is an integer below 2^24). Then the canonical fma(s) per lane, masked for a partial group. */
INLINE void mm_quant_t(const int type, const uint8_t *w, size_t ws, int n_rows, const uint8_t *x, size_t xs,
                       int n_tok, float *y, size_t ys, int64_t n) {
    const int kq = type == KVB_TYPE_Q4_K || type == KVB_TYPE_Q5_K || type == KVB_TYPE_Q6_K;
    const int five_k = type == KVB_TYPE_Q5_K;
    /* 32-element types: block bytes; K-quants: super-block bytes */
    const int wbb = type == KVB_TYPE_Q8_0   ? 34
                    : type == KVB_TYPE_Q4_0 ? 18
                    : type == KVB_TYPE_Q5_0 ? 22
                    : type == KVB_TYPE_Q4_K ? 144
                    : type == KVB_TYPE_Q5_K ? 176
                                            : 210;
    const size_t gbytes = kq ? 2 * (size_t)wbb : 16 * (size_t)wbb; /* weight bytes per group */
    const int64_t nb = n / 32, ng = (nb + 15) / 16;
    const int tail = (int)(nb % 16); /* blocks in the last group when it is partial (K: 8) */
    const size_t tail_bytes = kq ? (size_t)wbb * (size_t)(tail / 8) : (size_t)tail * (size_t)wbb;
    int perm[16], perm_inv[16];
    lane_blocks(pairing(type), perm, perm_inv);
    const __m512i permv = _mm512_loadu_si512((const void *)perm);
    const __m512i restore = _mm512_loadu_si512((const void *)perm_inv);
    const __m512i idx34 = _mm512_mullo_epi32(permv, _mm512_set1_epi32(34));
    const __m512i idxw = _mm512_mullo_epi32(permv, _mm512_set1_epi32(wbb));
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __mmask16 tail_mask = 0;
    for (int j = 0; j < 16; j++)
        if (perm[j] < tail) tail_mask |= (__mmask16)(1u << j);

    xgroup xg[QT];                        /* [token] this group's activations */
    __m512 acc[QR][QT];                   /* [row][token] lanes in perm order */
    uint8_t wpad[16 * 34], xpad[16 * 34]; /* zero-padded copy of a partial last group */
    memset(wpad, 0, sizeof wpad);
    memset(xpad, 0, sizeof xpad);

    for (int t0 = 0; t0 < n_tok; t0 += QT) {
        const int nt = KVB_MIN(QT, n_tok - t0);
        for (int r0 = 0; r0 < n_rows; r0 += QR) {
            const int nr = KVB_MIN(QR, n_rows - r0);
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++) acc[r][t] = _mm512_setzero_ps();
            for (int64_t g = 0; g < ng; g++) {
                const int partial = tail != 0 && g == ng - 1;
                for (int t = 0; t < nt; t++) {
                    const uint8_t *xb = x + (size_t)(t0 + t) * xs + (size_t)g * 16 * 34;
                    if (partial) {
                        memcpy(xpad, xb, (size_t)tail * 34);
                        xb = xpad;
                    }
                    prep_x(type, xb, &xg[t], idx34);
                }
                for (int r = 0; r < nr; r++) {
                    const uint8_t *wb = w + (size_t)(r0 + r) * ws + (size_t)g * gbytes;
                    /* The tile reads its rows' groups column by column, which the hardware
                     * prefetchers do not follow: fetch the same group of the next tile's row
                     * into L2 now (decode streams weights from DRAM exactly once). */
                    if (r0 + QR + r < n_rows) {
                        const char *pf = (const char *)wb + (size_t)QR * ws;
                        for (size_t k = 0; k < gbytes; k += 64) _mm_prefetch(pf + k, _MM_HINT_T1);
                    }
                    if (partial) {
                        memcpy(wpad, wb, tail_bytes);
                        wb = wpad;
                    }
                    __m512i q[8];
                    __m512 wd = _mm512_setzero_ps(), wd2 = wd, wd3 = wd; /* per type, see below */
                    if (type == KVB_TYPE_Q8_0) tr_q8(0, wb, q, flip);
                    else if (type == KVB_TYPE_Q4_0) tr_nibbles(wb, 18, 2, q);
                    else if (type == KVB_TYPE_Q5_0) tr_nibbles(wb, 22, 6, q);
                    else if (type == KVB_TYPE_Q6_K) tr_q6k(wb, q, &wd, &wd2, &wd3); /* d, sc0, sc1 */
                    else tr_q45k(five_k, wb, q, &wd, &wd2);                            /* d*sc, dmin*m */
                    if (!kq) wd = gather_d(wb, idxw);
                    for (int t = 0; t < nt; t++) {
                        const xgroup *xt = &xg[t];
                        __m512 f;
                        if (type == KVB_TYPE_Q6_K) {
                            __m512i s0 = xt->negcorr, s1 = xt->negcorr1;
                            UNROLL for (int i = 0; i < 4; i++) {
                                s0 = _mm512_dpbusd_epi32(s0, q[i], xt->q[i]);
                                s1 = _mm512_dpbusd_epi32(s1, q[4 + i], xt->q[4 + i]);
                            }
                            const __m512 S = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), wd3,
                                                             _mm512_mul_ps(_mm512_cvtepi32_ps(s0), wd2));
                            f = _mm512_fmadd_ps(S, _mm512_mul_ps(wd, xt->d), acc[r][t]);
                        } else {
                            __m512i s0 = kq ? _mm512_setzero_si512() : xt->negcorr, s1 = _mm512_setzero_si512();
                            UNROLL for (int i = 0; i < 8; i += 2) {
                                s0 = _mm512_dpbusd_epi32(s0, q[i], xt->q[i]);
                                s1 = _mm512_dpbusd_epi32(s1, q[i + 1], xt->q[i + 1]);
                            }
                            const __m512 sf = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                            f = _mm512_fmadd_ps(sf, _mm512_mul_ps(wd, xt->d), acc[r][t]);
                            if (kq) f = _mm512_fmadd_ps(xt->nsx, _mm512_mul_ps(wd2, xt->d), f);
                        }
                        acc[r][t] = partial ? _mm512_mask_mov_ps(acc[r][t], tail_mask, f) : f;
                    }
                }
            }
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++)
                    y[(size_t)(t0 + t) * ys + (size_t)(r0 + r)] = reduce16(_mm512_permutexvar_ps(restore, acc[r][t]));
        }
    }
}

/* One instance per type, so each is compiled with its type folded in. */
#define MM_QUANT(T, name)                                                                                  \
    static void name(const uint8_t *w, size_t ws, int n_rows, const uint8_t *x, size_t xs, int n_tok,     \
                     float *y, size_t ys, int64_t n) {                                                    \
        mm_quant_t(T, w, ws, n_rows, x, xs, n_tok, y, ys, n);                                             \
    }
MM_QUANT(KVB_TYPE_Q8_0, mm_q8_0)
MM_QUANT(KVB_TYPE_Q4_0, mm_q4_0)
MM_QUANT(KVB_TYPE_Q5_0, mm_q5_0)
MM_QUANT(KVB_TYPE_Q4_K, mm_q4_k)
MM_QUANT(KVB_TYPE_Q5_K, mm_q5_k)
MM_QUANT(KVB_TYPE_Q6_K, mm_q6_k)

/* ---- dispatch entry ----------------------------------------------------------------------- */

static void matmul_avx512(uint32_t type, const void *w, size_t ws, int n_rows, const void *act,
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

static void quantize_q8_0_avx512(const float *x, void *dst, int64_t n) {
    kvb_block_q8_0 *yb = dst; /* [n/32] */
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t b = 0; b < n / 32; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) |
                              _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        if (nan) amax = __builtin_nanf("");
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512 v0 = _mm512_mul_ps(x0, vid), v1 = _mm512_mul_ps(x1, vid);
        const __mmask16 ok0 = _mm512_cmp_ps_mask(v0, v0, _CMP_ORD_Q);
        const __mmask16 ok1 = _mm512_cmp_ps_mask(v1, v1, _CMP_ORD_Q);
        const __m512 c0 = _mm512_min_ps(_mm512_max_ps(v0, lo), hi);
        const __m512 c1 = _mm512_min_ps(_mm512_max_ps(v1, lo), hi);
        const __m512i q0 = _mm512_maskz_cvt_roundps_epi32(ok0, c0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i q1 = _mm512_maskz_cvt_roundps_epi32(ok1, c1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        yb[b].d = kvb_f32_to_fp16(d);
        _mm_storeu_si128((__m128i *)(void *)yb[b].qs, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(void *)(yb[b].qs + 16), _mm512_cvtepi32_epi8(q1));
    }
}

/* F16C conversion is exact (every fp16 value is an f32 value), so this matches the scalar loop. */
static void f16_to_f32_avx512(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(src + i))));
    for (; i < n; i++) dst[i] = kvb_fp16_to_f32(src[i]);
}

/* Q8_0 -> f32: int8 -> f32 is exact and the one product rounds as the scalar (float)q * d does. */
static void q8_0_to_f32_avx512(const void *src, float *dst, int64_t n_blocks) {
    const kvb_block_q8_0 *b = src; /* (n_blocks) */
    for (int64_t i = 0; i < n_blocks; i++) {
        const __m512 d = _mm512_set1_ps(kvb_fp16_to_f32(b[i].d));
        const __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)b[i].qs);
        const __m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(b[i].qs + 16));
        _mm512_storeu_ps(dst + i * 32, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d));
        _mm512_storeu_ps(dst + i * 32 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d));
    }
}

/* kvb_f32_rows_weighted_add: 64 accumulator elements in registers across all rows, then the next
 * 64; mul then add (two roundings, as the contract says); a tail of fewer than 16 elements uses
 * masked loads and stores, so no element outside [0, n) is read or written. */
static void rows_weighted_add_avx512(float *acc, const float *w, const float *rows, size_t row_stride, int n_rows,
                                     int64_t n) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 a0 = _mm512_loadu_ps(acc + i), a1 = _mm512_loadu_ps(acc + i + 16);
        __m512 a2 = _mm512_loadu_ps(acc + i + 32), a3 = _mm512_loadu_ps(acc + i + 48);
        for (int r = 0; r < n_rows; r++) {
            const float *row = rows + (size_t)r * row_stride + i;
            const __m512 wr = _mm512_set1_ps(w[r]);
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(wr, _mm512_loadu_ps(row)));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(wr, _mm512_loadu_ps(row + 16)));
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(wr, _mm512_loadu_ps(row + 32)));
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(wr, _mm512_loadu_ps(row + 48)));
        }
        _mm512_storeu_ps(acc + i, a0);
        _mm512_storeu_ps(acc + i + 16, a1);
        _mm512_storeu_ps(acc + i + 32, a2);
        _mm512_storeu_ps(acc + i + 48, a3);
    }
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512 a = _mm512_maskz_loadu_ps(m, acc + i);
        for (int r = 0; r < n_rows; r++)
            a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(w[r]),
                                               _mm512_maskz_loadu_ps(m, rows + (size_t)r * row_stride + i)));
        _mm512_mask_storeu_ps(acc + i, m, a);
    }
}

const kvb_quant_kernels kvb_quant_kernels_avx512 = {
    .name = "avx512-vnni",
    .matmul = matmul_avx512,
    .quantize_q8_0 = quantize_q8_0_avx512,
    .f16_to_f32 = f16_to_f32_avx512,
    .q8_0_to_f32 = q8_0_to_f32_avx512,
    .rows_weighted_add = rows_weighted_add_avx512,
};
