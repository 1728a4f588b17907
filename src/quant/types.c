/* quant/types.c — the ggml type table (names and block layouts of every type number we know,
 * so a GGUF reader can size any tensor), portable fp16/bf16 scalar conversions, whole-row
 * conversions between f32 and the supported storage types using ggml's reference quantisers
 * (so the bytes we write are the bytes llama-quantize writes), and the canonical Q8_0
 * activation quantiser that every SIMD version must reproduce byte for byte. Conversions are
 * pure bit manipulation and integer arithmetic: they do not depend on the compiler, the FPU's
 * denormal mode or the machine. */
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
    [KVB_TYPE_Q5_0] = {"Q5_0", 32, 22, 0},
    [KVB_TYPE_Q5_1] = {"Q5_1", 32, 24, 0},
    [KVB_TYPE_Q8_0] = {"Q8_0", 32, 34, 1},
    [KVB_TYPE_Q8_1] = {"Q8_1", 32, 36, 0},
    [KVB_TYPE_Q2_K] = {"Q2_K", QK_K, 84, 0},
    [KVB_TYPE_Q3_K] = {"Q3_K", QK_K, 110, 0},
    [KVB_TYPE_Q4_K] = {"Q4_K", QK_K, 144, 0},
    [KVB_TYPE_Q5_K] = {"Q5_K", QK_K, 176, 0},
    [KVB_TYPE_Q6_K] = {"Q6_K", QK_K, 210, 0},
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

/* ---- row conversions ------------------------------------------------------------------- */

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
        const kvb_block_q8_0 *b = src; /* [n/32] */
        for (int64_t i = 0; i < n / KVB_QK8_0; i++) {
            const float d = kvb_fp16_to_f32(b[i].d);
            for (int j = 0; j < KVB_QK8_0; j++) dst[i * KVB_QK8_0 + j] = (float)b[i].qs[j] * d;
        }
        return;
    }
    case KVB_TYPE_Q4_0: {
        const kvb_block_q4_0 *b = src; /* [n/32] */
        for (int64_t i = 0; i < n / KVB_QK4_0; i++) {
            const float d = kvb_fp16_to_f32(b[i].d);
            for (int j = 0; j < KVB_QK4_0 / 2; j++) {
                dst[i * KVB_QK4_0 + j] = (float)((b[i].qs[j] & 0x0f) - 8) * d;
                dst[i * KVB_QK4_0 + j + 16] = (float)((b[i].qs[j] >> 4) - 8) * d;
            }
        }
        return;
    }
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
        return KVB_TYPE_Q8_0;
    default:
        return KVB_TYPE_F32;
    }
}

/* The canonical activation quantiser (see kvb_quantize_act in kvb_quant.h). */
void kvb_quantize_q8_0_act_ref(const float *x, void *dst, int64_t n) {
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
        const float id = d != 0.0f ? 1.0f / d : 0.0f; /* NaN d -> NaN id */
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

void kvb_quantize_act(uint32_t weight_type, const float *x, void *dst, int64_t n) {
    if (kvb_act_type(weight_type) == KVB_TYPE_Q8_0) {
        kvb_quant_active()->quantize_q8_0(x, dst, n);
    } else {
        memcpy(dst, x, (size_t)n * sizeof(float));
    }
}
