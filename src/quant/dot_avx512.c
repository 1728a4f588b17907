/* quant/dot_avx512.c — AVX-512 (F/BW/VL/DQ + VNNI) kernels of the canonical dot product.
 * Float weights (F32/F16/BF16): one zmm holds the 16 canonical accumulators, element i goes to
 * lane i % 16 with one vfmadd per 16 elements; a tile of up to 8 rows x 4 tokens keeps that
 * many independent chains in registers, and a tail of n % 16 elements uses masked loads and a
 * masked fma so untouched lanes keep their exact bits. Quant weights (Q8_0/Q4_0 x Q8_0): 16
 * consecutive blocks are transposed so that dword lane j of eight zmm holds block P(j)'s 32
 * bytes (P(j) = 4*(j%4) + j/4, a fixed permutation that makes the transpose cheap); then eight
 * vpdpbusd give the exact int32 block sums of 16 blocks at once. vpdpbusd wants unsigned x
 * signed bytes, so Q8_0 weights are offset by +128 (w ^ 0x80) and Q4_0 uses its raw nibbles,
 * with the exact correction -128*sum(x) / -8*sum(x) preloaded in the accumulator (exact for
 * every byte value). The sums are converted to f32, multiplied by the 16 scale products and
 * fma'd into the accumulator whose lane j is canonical lane P(j); a final vpermps restores the
 * canonical lane order before the 8-4-2-1 reduction. Activations are transposed once per tile
 * and group and reused by all rows; each weight group is transposed once and reused by all
 * tokens. Everything is exact integer work or the same IEEE operations as the scalar spec. */
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

/* Per-lane block order of the transposed layout: lane j holds block P(j) of a 16-block group. */

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

/* 16 Q8_0 blocks (34 bytes each) -> q[i] lane j = qs dword i (bytes 4i..4i+3) of block P(j),
 * each byte xor'ed with `flip` (0x80 turns int8 weights into uint8 w+128; 0 keeps them). */
INLINE void tr_q8(const uint8_t *blk, __m512i q[8], __m512i flip) {
    static const int first[8] = {0, 4, 8, 12, 2, 6, 10, 14}; /* Z_p = blocks (first[p], +1) */
    __m512i z[8];
    UNROLL for (int p = 0; p < 8; p++) {
        const uint8_t *b = blk + 34 * first[p] + 2;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)b);
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(const void *)(b + 34));
        z[p] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
    }
    __m512i a[4], b[4];
    tr4(z[0], z[1], z[2], z[3], a); /* lanes128: blocks {0,4,8,12}.dw i | .dw 4+i | {1,5,9,13}... */
    tr4(z[4], z[5], z[6], z[7], b); /* same for blocks {2,6,10,14} and {3,7,11,15} */
    UNROLL for (int i = 0; i < 4; i++) {
        q[i] = _mm512_shuffle_i32x4(a[i], b[i], 0x88);     /* 128-lanes a0 a2 b0 b2 */
        q[4 + i] = _mm512_shuffle_i32x4(a[i], b[i], 0xDD); /* 128-lanes a1 a3 b1 b3 */
    }
}

/* 16 Q4_0 blocks (18 bytes each) -> q[i] lane j = nibbles of elements 4i..4i+3 (i < 4) or
 * 16+4(i-4).. (i >= 4) of block P(j), as bytes 0..15. */
INLINE void tr_q4(const uint8_t *blk, __m512i q[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i lo[4], hi[4];
    UNROLL for (int m = 0; m < 4; m++) {
        const uint8_t *b = blk + 18 * 4 * m + 2;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)b));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(b + 18)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(b + 36)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(b + 54)), 3);
        lo[m] = _mm512_and_si512(z, m4);
        hi[m] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
    }
    tr4(lo[0], lo[1], lo[2], lo[3], q);     /* lane 4c+m = block 4m+c = P(4c+m) */
    tr4(hi[0], hi[1], hi[2], hi[3], q + 4);
}

/* The 16 fp16 scales (first two bytes of each block) in lane order P: byte_idx[j] is the byte
 * offset of block P(j) (34*P(j) or 18*P(j)); each gather reads 4 bytes, all inside the block. */
INLINE __m512 gather_d(const uint8_t *blk, __m512i byte_idx) {
    const __m512i g = _mm512_i32gather_epi32(byte_idx, (const void *)blk, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

/* One activation group (16 Q8_0 blocks) prepared for the weight type. */
typedef struct {
    __m512i q[8];    /* transposed qs */
    __m512 d;        /* x scales, lane order P */
    __m512i negcorr; /* -(128 or 8) * sum of the block's qs, lane order P */
} xgroup;

INLINE void prep_x(const uint8_t *xblk, xgroup *o, const __m512i corr_bytes, const __m512i idx34) {
    tr_q8(xblk, o->q, _mm512_setzero_si512());
    o->d = gather_d(xblk, idx34);
    __m512i c = _mm512_setzero_si512();
    UNROLL for (int i = 0; i < 8; i++) c = _mm512_dpbusd_epi32(c, corr_bytes, o->q[i]);
    o->negcorr = _mm512_sub_epi32(_mm512_setzero_si512(), c);
}

#define QT 16 /* tokens per chunk */
#define QR 16 /* rows per chunk (share one activation preparation) */

static void mm_quant(uint32_t type, const uint8_t *w, size_t ws, int n_rows, const uint8_t *x,
                     size_t xs, int n_tok, float *y, size_t ys, int64_t n) {
    const int is_q8 = type == KVB_TYPE_Q8_0;
    const int wbb = is_q8 ? 34 : 18; /* weight block bytes */
    const int64_t nb = n / 32, ng = (nb + 15) / 16;
    const int tail = (int)(nb % 16); /* blocks in the last group when it is partial */
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i idx34 = _mm512_mullo_epi32(perm, _mm512_set1_epi32(34));
    const __m512i idxw = _mm512_mullo_epi32(perm, _mm512_set1_epi32(wbb));
    const __m512i corr_bytes = _mm512_set1_epi8(is_q8 ? (char)0x80 : 8);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __mmask16 tail_mask = 0;
    for (int j = 0; j < 16; j++)
        if ((4 * (j % 4) + j / 4) < tail) tail_mask |= (__mmask16)(1u << j);

    xgroup xg[QT];                 /* [token] this group's activations */
    __m512 acc[QR][QT];            /* [row][token] lanes in order P */
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
                    prep_x(xb, &xg[t], corr_bytes, idx34);
                }
                for (int r = 0; r < nr; r++) {
                    const uint8_t *wb = w + (size_t)(r0 + r) * ws + (size_t)g * 16 * (size_t)wbb;
                    /* The tile reads its rows' groups column by column, which the hardware
                     * prefetchers do not follow: fetch the same group of the next tile's row
                     * into L2 now (decode streams weights from DRAM exactly once). */
                    if (r0 + QR + r < n_rows) {
                        const char *pf = (const char *)wb + (size_t)QR * ws;
                        for (int k = 0; k < 16 * wbb; k += 64) _mm_prefetch(pf + k, _MM_HINT_T1);
                    }
                    if (partial) {
                        memcpy(wpad, wb, (size_t)tail * (size_t)wbb);
                        wb = wpad;
                    }
                    __m512i q[8];
                    if (is_q8) tr_q8(wb, q, flip);
                    else tr_q4(wb, q);
                    const __m512 wd = gather_d(wb, idxw);
                    for (int t = 0; t < nt; t++) {
                        const xgroup *xt = &xg[t];
                        __m512i s0 = xt->negcorr, s1 = _mm512_setzero_si512();
                        UNROLL for (int i = 0; i < 8; i += 2) {
                            s0 = _mm512_dpbusd_epi32(s0, q[i], xt->q[i]);
                            s1 = _mm512_dpbusd_epi32(s1, q[i + 1], xt->q[i + 1]);
                        }
                        const __m512 sf = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                        const __m512 d = _mm512_mul_ps(wd, xt->d);
                        acc[r][t] = partial ? _mm512_mask3_fmadd_ps(sf, d, acc[r][t], tail_mask)
                                            : _mm512_fmadd_ps(sf, d, acc[r][t]);
                    }
                }
            }
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++)
                    y[(size_t)(t0 + t) * ys + (size_t)(r0 + r)] =
                        reduce16(_mm512_permutexvar_ps(perm, acc[r][t])); /* P is an involution */
        }
    }
}

/* ---- dispatch entry ----------------------------------------------------------------------- */

static void matmul_avx512(uint32_t type, const void *w, size_t ws, int n_rows, const void *act,
                          size_t as, int n_tok, float *y, size_t ys, int64_t n) {
    switch (type) {
    case KVB_TYPE_F32: mm_float_t(KVB_TYPE_F32, w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_F16: mm_float_t(KVB_TYPE_F16, w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    case KVB_TYPE_BF16: mm_float_t(KVB_TYPE_BF16, w, ws, n_rows, act, as, n_tok, y, ys, n); break;
    default: mm_quant(type, w, ws, n_rows, act, as, n_tok, y, ys, n); break;
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

const kvb_quant_kernels kvb_quant_kernels_avx512 = {
    .name = "avx512-vnni",
    .matmul = matmul_avx512,
    .quantize_q8_0 = quantize_q8_0_avx512,
    .f16_to_f32 = f16_to_f32_avx512,
};
