/* quant/types.c — the ggml type table (names and block layouts of every type number we know,
 * so a GGUF reader can size any tensor), portable fp16/bf16 scalar conversions, whole-row
 * conversions between f32 and the supported storage types (dequantisers for Q8_0/Q4_0/Q5_0 and
 * the K-quants Q4_K/Q5_K/Q6_K; ggml's reference quantisers for the 32-element types, so the bytes
 * we write are the bytes llama-quantize writes, and our own documented quantiser for the
 * K-quants), and the canonical Q8_0 activation quantiser that every SIMD version must reproduce
 * byte for byte. Conversions are plain IEEE f32 arithmetic in a fixed order, bit manipulation and
 * integer arithmetic: they do not depend on the machine or the FPU's denormal mode. */
#include <math.h>
#include <string.h>
#include <strings.h>

#include "kvb_quant.h"
#include "kvb_quant_scalar.h"
#include "quant_impl.h"

/* ---- type table -------------------------------------------------------------------------- */

#define QK_K 256
static const kvb_type_info g_types[KVB_TYPE_COUNT_] = {
    [KVB_TYPE_F32] = {"F32", 1, 4, 1},
    [KVB_TYPE_F16] = {"F16", 1, 2, 1},
    [KVB_TYPE_Q4_0] = {"Q4_0", 32, 18, 1},
    [KVB_TYPE_Q4_1] = {"Q4_1", 32, 20, 0},
    [KVB_TYPE_Q5_0] = {"Q5_0", 32, 22, 1},
    [KVB_TYPE_Q5_1] = {"Q5_1", 32, 24, 0},
    [KVB_TYPE_Q8_0] = {"Q8_0", 32, 34, 1},
    [KVB_TYPE_Q8_1] = {"Q8_1", 32, 36, 0},
    [KVB_TYPE_Q2_K] = {"Q2_K", QK_K, 84, 0},
    [KVB_TYPE_Q3_K] = {"Q3_K", QK_K, 110, 0},
    [KVB_TYPE_Q4_K] = {"Q4_K", QK_K, 144, 1},
    [KVB_TYPE_Q5_K] = {"Q5_K", QK_K, 176, 1},
    [KVB_TYPE_Q6_K] = {"Q6_K", QK_K, 210, 1},
    [KVB_TYPE_Q8_K] = {"Q8_K", QK_K, 292, 0},
    /* i-quants and friends: layouts from ggml-common.h (sizes checked by its static_asserts) */
    [16] = {"IQ2_XXS", QK_K, 66, 0},  /* d + u16 qs[32] */
    [17] = {"IQ2_XS", QK_K, 74, 0},   /* d + u16 qs[32] + scales[8] */
    [18] = {"IQ3_XXS", QK_K, 98, 0},  /* d + qs[96] */
    [19] = {"IQ1_S", QK_K, 50, 0},    /* d + qs[32] + u16 qh[8] */
    [20] = {"IQ4_NL", 32, 18, 0},     /* d + qs[16] */
    [21] = {"IQ3_S", QK_K, 110, 0},   /* d + qs[64] + qh[8] + signs[32] + scales[4] */
    [22] = {"IQ2_S", QK_K, 82, 0},    /* d + qs[64] + qh[8] + scales[8] */
    [23] = {"IQ4_XS", QK_K, 136, 0},  /* d + scales_h + scales_l[4] + qs[128] */
    [KVB_TYPE_I8] = {"I8", 1, 1, 0},
    [KVB_TYPE_I16] = {"I16", 1, 2, 0},
    [KVB_TYPE_I32] = {"I32", 1, 4, 0},
    [KVB_TYPE_I64] = {"I64", 1, 8, 0},
    [KVB_TYPE_F64] = {"F64", 1, 8, 0},
    [29] = {"IQ1_M", QK_K, 56, 0},    /* qs[32] + qh[16] + scales[8] */
    [KVB_TYPE_BF16] = {"BF16", 1, 2, 1},
    /* 31..33 (Q4_0_4_4 ...) and 36..38 (IQ4_NL_4_4 ...) were removed from GGUF: unknown */
    [34] = {"TQ1_0", QK_K, 54, 0},    /* qs[48] + qh[4] + d */
    [35] = {"TQ2_0", QK_K, 66, 0},    /* qs[64] + d */
    [39] = {"MXFP4", 32, 17, 0},      /* e (E8M0) + qs[16] */
};

_Static_assert(sizeof(kvb_block_q8_0) == 34 && sizeof(kvb_block_q4_0) == 18 && sizeof(kvb_block_q5_0) == 22,
               "32-element block layouts");
_Static_assert(sizeof(kvb_block_q4_k) == 144 && sizeof(kvb_block_q5_k) == 176 && sizeof(kvb_block_q6_k) == 210,
               "K-quant block layouts");

const kvb_type_info *kvb_type_get(uint32_t type) {
    if (type >= KVB_TYPE_COUNT_ || g_types[type].block_elems == 0) return NULL;
    return &g_types[type];
}

const char *kvb_type_name(uint32_t type) {
    const kvb_type_info *ti = kvb_type_get(type);
    return ti ? ti->name : "?";
}

kvb_status kvb_type_from_name(const char *name, kvb_type *out, kvb_err *err) {
    if (name != NULL) {
        for (uint32_t t = 0; t < KVB_TYPE_COUNT_; t++) {
            if (g_types[t].block_elems != 0 && strcasecmp(name, g_types[t].name) == 0) {
                if (out) *out = (kvb_type)t;
                return KVB_OK;
            }
        }
    }
    return kvb_err_set(err, KVB_ERR_INVALID,
                       "unknown tensor type '%s' (expected one of f32, f16, bf16, q8_0, q4_0, ...)",
                       name ? name : "(null)");
}

size_t kvb_row_bytes(uint32_t type, int64_t n) {
    const kvb_type_info *ti = kvb_type_get(type);
    if (ti == NULL || n < 0 || n % ti->block_elems != 0) return 0;
    uint64_t bytes;
    if (kvb_mul_overflow_u64((uint64_t)(n / ti->block_elems), (uint64_t)ti->block_bytes, &bytes) ||
        bytes > (uint64_t)SIZE_MAX)
        return 0;
    return (size_t)bytes;
}

/* ---- fp16 / bf16 ------------------------------------------------------------------------- */

float kvb_fp16_to_f32(uint16_t h) { return kvb_fp16_to_f32_inl(h); }
uint16_t kvb_f32_to_fp16(float f) { return kvb_f32_to_fp16_inl(f); }
float kvb_bf16_to_f32(uint16_t h) { return kvb_bf16_to_f32_inl(h); }
uint16_t kvb_f32_to_bf16(float f) { return kvb_f32_to_bf16_inl(f); }

/* ---- K-quant quantisers (the rule is in kvb_quant.h) ------------------------------------- */

/* The smallest fp16 >= v (v >= 0), capped at the largest finite fp16; NaN -> the cap too. */
static uint16_t fp16_up(float v) {
    if (!(v <= 65504.0f)) return 0x7bff;
    if (!(v > 0.0f)) return 0;
    uint16_t h = kvb_f32_to_fp16(v);
    if (kvb_fp16_to_f32(h) < v) h++; /* positive fp16 bit patterns are ordered like their values */
    return h;
}

/* min(cap, ceil(a / b)) for a, b >= 0; 0 when a or b is 0 (or NaN). */
static int ceil_div_cap(float a, float b, int cap) {
    if (!(a > 0.0f) || !(b > 0.0f)) return 0;
    const float t = a / b;
    return t < (float)cap ? (int)ceilf(t) : cap;
}

/* round_half_even(clamp(v, lo, hi)); NaN -> 0. lo <= 0 <= hi, |lo|, |hi| <= 127. */
static int round_clamp(float v, int lo, int hi) {
    if (!(v == v)) return 0;
    v = v < (float)lo ? (float)lo : (v > (float)hi ? (float)hi : v);
    return (int)kvb_rne_small(v);
}

/* One Q4_K (five = 0) or Q5_K (five = 1) super-block from x [256] into blk (144 / 176 bytes). */
static void quantize_k_min(const float *x, int five, uint8_t *blk) {
    const int levels = five ? 31 : 15;
    float mn[8], hi[8], off[8], step[8]; /* per sub-block: -min(0, min x), max x, ... */
    float mn_max = 0.0f, step_max = 0.0f;
    for (int s = 0; s < 8; s++) {
        float lo = 0.0f;
        hi[s] = -INFINITY;
        for (int l = 0; l < 32; l++) { /* NaN compares false: skipped */
            const float v = x[32 * s + l];
            if (v < lo) lo = v;
            if (v > hi[s]) hi[s] = v;
        }
        mn[s] = 0.0f - lo; /* >= +0 */
        if (mn[s] > mn_max) mn_max = mn[s];
    }
    const uint16_t dmin_h = fp16_up(mn_max / 63.0f);
    const float dmin = kvb_fp16_to_f32(dmin_h);
    int sc[8], m[8];
    for (int s = 0; s < 8; s++) {
        m[s] = ceil_div_cap(mn[s], dmin, 63);
        off[s] = dmin * (float)m[s];
        const float range = hi[s] + off[s];
        step[s] = range > 0.0f ? range / (float)levels : 0.0f;
        if (step[s] > step_max) step_max = step[s];
    }
    const uint16_t d_h = fp16_up(step_max / 63.0f);
    const float d = kvb_fp16_to_f32(d_h);
    memset(blk, 0, five ? sizeof(kvb_block_q5_k) : sizeof(kvb_block_q4_k));
    memcpy(blk, &d_h, 2);
    memcpy(blk + 2, &dmin_h, 2);
    uint8_t *scales = blk + 4, *qh = five ? blk + 16 : NULL, *qs = blk + (five ? 48 : 16);
    for (int s = 0; s < 8; s++) {
        sc[s] = ceil_div_cap(step[s], d, 63);
        const float st = d * (float)sc[s];
        for (int l = 0; l < 32; l++) {
            const int q = st > 0.0f ? round_clamp((x[32 * s + l] + off[s]) / st, 0, levels) : 0;
            qs[32 * (s / 2) + l] |= (uint8_t)((q & 0x0f) << (4 * (s % 2)));
            if (qh) qh[l] |= (uint8_t)((q >> 4) << s);
        }
    }
    for (int s = 0; s < 4; s++) { /* the packing of kvb_k_scale_min, inverted */
        scales[s] = (uint8_t)(sc[s] | (sc[s + 4] >> 4) << 6);
        scales[s + 4] = (uint8_t)(m[s] | (m[s + 4] >> 4) << 6);
        scales[s + 8] = (uint8_t)((sc[s + 4] & 0x0f) | (m[s + 4] & 0x0f) << 4);
    }
}

/* One Q6_K super-block from x [256]. */
static void quantize_q6_k(const float *x, kvb_block_q6_k *y) {
    float step[16], step_max = 0.0f; /* per sub-block of 16 */
    for (int t = 0; t < 16; t++) {
        float amax = 0.0f;
        for (int l = 0; l < 16; l++)
            if (fabsf(x[16 * t + l]) > amax) amax = fabsf(x[16 * t + l]); /* NaN skipped */
        step[t] = amax / 31.0f;
        if (step[t] > step_max) step_max = step[t];
    }
    const uint16_t d_h = fp16_up(step_max / 127.0f);
    const float d = kvb_fp16_to_f32(d_h);
    memset(y, 0, sizeof *y);
    y->d = d_h;
    for (int t = 0; t < 16; t++) {
        const int sc = ceil_div_cap(step[t], d, 127);
        y->scales[t] = (int8_t)sc;
        const float st = d * (float)sc;
        for (int l = 0; l < 16; l++) {
            const int e = 16 * t + l, h = e / 128, c = (e % 128) / 32, i = e % 32;
            const int q = 32 + (st > 0.0f ? round_clamp(x[e] / st, -32, 31) : 0);
            y->ql[64 * h + 32 * (c % 2) + i] |= (uint8_t)((q & 0x0f) << (4 * (c / 2)));
            y->qh[32 * h + i] |= (uint8_t)((q >> 4) << (2 * c));
        }
    }
}

/* ---- row conversions ------------------------------------------------------------------- */

void kvb_f32_rows_weighted_add(float *acc, const float *w, const float *rows, size_t row_stride, int n_rows,
                               int64_t n) {
    const kvb_quant_kernels *k = kvb_quant_active();
    if (k->rows_weighted_add) {
        k->rows_weighted_add(acc, w, rows, row_stride, n_rows, n);
        return;
    }
    for (int r = 0; r < n_rows; r++) {
        const float wr = w[r], *row = rows + (size_t)r * row_stride; /* (n) */
        for (int64_t i = 0; i < n; i++) {
            const float prod = wr * row[i];
            acc[i] = acc[i] + prod;
        }
    }
}

void kvb_row_to_f32(uint32_t type, const void *src, float *dst, int64_t n) {
    switch (type) {
    case KVB_TYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case KVB_TYPE_F16: {
        const uint16_t *s = src; /* [n] */
        const kvb_quant_kernels *k = kvb_quant_active();
        if (k->f16_to_f32) {
            k->f16_to_f32(s, dst, n);
            return;
        }
        for (int64_t i = 0; i < n; i++) dst[i] = kvb_fp16_to_f32(s[i]);
        return;
    }
    case KVB_TYPE_BF16: {
        const uint16_t *s = src; /* [n] */
        for (int64_t i = 0; i < n; i++) dst[i] = kvb_bf16_to_f32(s[i]);
        return;
    }
    case KVB_TYPE_Q8_0: {
        const kvb_quant_kernels *k = kvb_quant_active();
        if (k->q8_0_to_f32) {
            k->q8_0_to_f32(src, dst, n / KVB_QK8_0);
            return;
        }
        for (int64_t u = 0; u < n / 32; u++) kvb_row_unit_to_f32(type, src, u, dst + u * 32);
        return;
    }
    case KVB_TYPE_Q4_0:
    case KVB_TYPE_Q5_0:
    case KVB_TYPE_Q4_K:
    case KVB_TYPE_Q5_K:
    case KVB_TYPE_Q6_K:
        for (int64_t u = 0; u < n / 32; u++) kvb_row_unit_to_f32(type, src, u, dst + u * 32); /* (n/32, 32) */
        return;
    default:
        for (int64_t i = 0; i < n; i++) dst[i] = NAN; /* caller bug: make it visible */
        return;
    }
}


void kvb_f32_to_row(uint32_t type, const float *src, void *dst, int64_t n) {
    switch (type) {
    case KVB_TYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case KVB_TYPE_F16: {
        uint16_t *d = dst; /* [n] */
        for (int64_t i = 0; i < n; i++) d[i] = kvb_f32_to_fp16(src[i]);
        return;
    }
    case KVB_TYPE_BF16: {
        uint16_t *d = dst; /* [n] */
        for (int64_t i = 0; i < n; i++) d[i] = kvb_f32_to_bf16(src[i]);
        return;
    }
    case KVB_TYPE_Q8_0: { /* ggml quantize_row_q8_0_ref */
        kvb_block_q8_0 *y = dst; /* [n/32] */
        for (int64_t i = 0; i < n / KVB_QK8_0; i++) {
            const float *x = src + i * KVB_QK8_0;
            float amax = 0.0f;
            for (int j = 0; j < KVB_QK8_0; j++) {
                const float a = fabsf(x[j]);
                amax = amax > a ? amax : a; /* ggml's MAX(amax, fabsf(v)) */
            }
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            y[i].d = kvb_f32_to_fp16(d);
            for (int j = 0; j < KVB_QK8_0; j++) y[i].qs[j] = kvb_q8_roundf(x[j] * id);
        }
        return;
    }
    case KVB_TYPE_Q4_0: { /* ggml quantize_row_q4_0_ref */
        kvb_block_q4_0 *y = dst; /* [n/32] */
        for (int64_t i = 0; i < n / KVB_QK4_0; i++) {
            const float *x = src + i * KVB_QK4_0;
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < KVB_QK4_0; j++) {
                if (amax < fabsf(x[j])) {
                    amax = fabsf(x[j]);
                    max = x[j];
                }
            }
            const float d = max / -8.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            y[i].d = kvb_f32_to_fp16(d);
            for (int j = 0; j < KVB_QK4_0 / 2; j++) {
                uint8_t q[2];
                for (int h = 0; h < 2; h++) {
                    /* ggml: MIN(15, (int8_t)(x*id + 8.5f)); for finite inputs t is in
                     * [0.5, 16.5], so truncation then the clamp is exactly that; t < 0 or NaN
                     * (undefined in ggml) give 0 here. */
                    const float t = x[j + 16 * h] * id + 8.5f;
                    q[h] = t >= 15.0f ? 15 : (t >= 0.0f ? (uint8_t)t : 0);
                }
                y[i].qs[j] = (uint8_t)(q[0] | (q[1] << 4));
            }
        }
        return;
    }
    case KVB_TYPE_Q5_0: { /* ggml quantize_row_q5_0_ref */
        kvb_block_q5_0 *y = dst; /* [n/32] */
        for (int64_t i = 0; i < n / KVB_QK5_0; i++) {
            const float *x = src + i * KVB_QK5_0;
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < KVB_QK5_0; j++) {
                if (amax < fabsf(x[j])) {
                    amax = fabsf(x[j]);
                    max = x[j];
                }
            }
            const float d = max / -16.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            y[i].d = kvb_f32_to_fp16(d);
            uint32_t qh = 0;
            for (int j = 0; j < KVB_QK5_0 / 2; j++) {
                uint8_t q[2];
                for (int h = 0; h < 2; h++) {
                    /* ggml: MIN(31, (int8_t)(x*id + 16.5f)); t is in [0.5, 32.5] for finite
                     * inputs; t < 0 or NaN (undefined in ggml) give 0 here */
                    const float t = x[j + 16 * h] * id + 16.5f;
                    q[h] = t >= 31.0f ? 31 : (t >= 0.0f ? (uint8_t)t : 0);
                    qh |= (uint32_t)(q[h] >> 4) << (j + 16 * h);
                }
                y[i].qs[j] = (uint8_t)((q[0] & 0x0f) | (q[1] << 4));
            }
            for (int k = 0; k < 4; k++) y[i].qh[k] = (uint8_t)(qh >> (8 * k));
        }
        return;
    }
    case KVB_TYPE_Q4_K:
    case KVB_TYPE_Q5_K: {
        const int five = type == KVB_TYPE_Q5_K;
        const size_t bb = five ? sizeof(kvb_block_q5_k) : sizeof(kvb_block_q4_k);
        for (int64_t i = 0; i < n / KVB_QK_K; i++)
            quantize_k_min(src + i * KVB_QK_K, five, (uint8_t *)dst + (size_t)i * bb);
        return;
    }
    case KVB_TYPE_Q6_K: {
        kvb_block_q6_k *y = dst; /* [n/256] */
        for (int64_t i = 0; i < n / KVB_QK_K; i++) quantize_q6_k(src + i * KVB_QK_K, &y[i]);
        return;
    }
    default:
        memset(dst, 0, kvb_row_bytes(type, n)); /* caller bug; never write past the row */
        return;
    }
}

/* ---- activations ------------------------------------------------------------------------ */

uint32_t kvb_act_type(uint32_t weight_type) {
    switch (weight_type) {
    case KVB_TYPE_Q8_0:
    case KVB_TYPE_Q4_0:
    case KVB_TYPE_Q5_0:
    case KVB_TYPE_Q4_K:
    case KVB_TYPE_Q5_K:
    case KVB_TYPE_Q6_K:
        return KVB_TYPE_Q8_0;
    default:
        return KVB_TYPE_F32;
    }
}

/* The Q8_0 activation quantiser, canonical (kvb_quantize_act) or ggml's (kvb_quantize_act_ggml):
 * they differ only in the inverse scale, 1 / (amax / 127) or 127 / amax. */
static void quantize_q8_0_act(const float *x, void *dst, int64_t n, bool ggml_inverse) {
    kvb_block_q8_0 *y = dst; /* [n/32] */
    for (int64_t i = 0; i < n / KVB_QK8_0; i++) {
        const float *xb = x + i * KVB_QK8_0; /* [32] */
        float amax = 0.0f;
        int nan = 0;
        for (int j = 0; j < KVB_QK8_0; j++) {
            const float a = fabsf(xb[j]);
            if (a != a) nan = 1;
            else if (a > amax) amax = a;
        }
        if (nan) amax = NAN;
        const float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f; /* NaN d -> NaN id */
        if (ggml_inverse) id = amax != 0.0f ? 127.0f / amax : 0.0f;
        y[i].d = kvb_f32_to_fp16(d);
        for (int j = 0; j < KVB_QK8_0; j++) {
            float v = xb[j] * id;
            if (!(v == v)) {
                y[i].qs[j] = 0;
                continue;
            }
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            y[i].qs[j] = (int8_t)kvb_rne_small(v);
        }
    }
}

void kvb_quantize_q8_0_act_ref(const float *x, void *dst, int64_t n) { quantize_q8_0_act(x, dst, n, false); }

void kvb_quantize_act_ggml(const float *x, void *dst, int64_t n) { quantize_q8_0_act(x, dst, n, true); }

void kvb_quantize_act(uint32_t weight_type, const float *x, void *dst, int64_t n) {
    if (kvb_act_type(weight_type) == KVB_TYPE_Q8_0) {
        kvb_quant_active()->quantize_q8_0(x, dst, n);
    } else {
        memcpy(dst, x, (size_t)n * sizeof(float));
    }
}
