/* ref_model.c — the float64 reference forward pass (see ref_model.h for the conventions). Loading
 * reads metadata with the GGUF reader's typed getters, checks every tensor's type and dims against
 * the description, insists that every tensor in the file is used (as llama.cpp does: a stray
 * tensor means the file is not what we think it is), and dequantises everything to double with
 * the decoders at the top of this file. The forward pass is written for clarity, not speed: one
 * token at a time, one output element at a time, summing in index order in double. Nothing here
 * calls quant/, model/ or an engine, so an engine bug cannot be mirrored into the oracle. */
#include "ref_model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

/* ---- dequantisation ---------------------------------------------------------------------------- */

/* IEEE binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. */
double ref_fp16_to_double(uint16_t h) {
    const int sign = (h >> 15) & 1;
    const int exp = (h >> 10) & 0x1f;
    const int mant = h & 0x3ff;
    double v;
    if (exp == 0) {
        v = ldexp((double)mant, -24); /* subnormal (or zero): mant * 2^-14 * 2^-10 */
    } else if (exp == 31) {
        v = mant == 0 ? INFINITY : NAN;
    } else {
        v = ldexp((double)(1024 + mant), exp - 25); /* (1 + mant/1024) * 2^(exp-15) */
    }
    return sign ? -v : v;
}

/* bfloat16: the top half of an IEEE binary32: 1 sign, 8 exponent (bias 127), 7 mantissa bits. */
double ref_bf16_to_double(uint16_t h) {
    const int sign = (h >> 15) & 1;
    const int exp = (h >> 7) & 0xff;
    const int mant = h & 0x7f;
    double v;
    if (exp == 0) {
        v = ldexp((double)mant, -133); /* subnormal: mant * 2^-126 * 2^-7 */
    } else if (exp == 255) {
        v = mant == 0 ? INFINITY : NAN;
    } else {
        v = ldexp((double)(128 + mant), exp - 134); /* (1 + mant/128) * 2^(exp-127) */
    }
    return sign ? -v : v;
}

static uint16_t rd_u16le(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

size_t ref_row_bytes(uint32_t type, int64_t n) {
    if (n < 0) return 0;
    switch (type) {
    case REF_TYPE_F32: return (size_t)n * 4;
    case REF_TYPE_F16:
    case REF_TYPE_BF16: return (size_t)n * 2;
    case REF_TYPE_Q8_0: return n % 32 ? 0 : (size_t)(n / 32) * 34; /* fp16 d + 32 x int8 */
    case REF_TYPE_Q4_0: return n % 32 ? 0 : (size_t)(n / 32) * 18; /* fp16 d + 16 bytes of nibbles */
    case REF_TYPE_Q5_0: return n % 32 ? 0 : (size_t)(n / 32) * 22; /* fp16 d + 4 bytes qh + 16 bytes */
    case REF_TYPE_Q4_K: return n % 256 ? 0 : (size_t)(n / 256) * 144;
    case REF_TYPE_Q5_K: return n % 256 ? 0 : (size_t)(n / 256) * 176;
    case REF_TYPE_Q6_K: return n % 256 ? 0 : (size_t)(n / 256) * 210;
    default: return 0;
    }
}

/* ---- Q5_0 and the K-quants (Q4_K, Q5_K, Q6_K) ---------------------------------------------
 * Written from ggml's block layouts (ggml-common.h), independently of src/quant. All values are
 * exact in double: fp16 scales are multiples of 2^-24 below 2^16, times integer scales and quants
 * of at most 6+6 bits, so every product and the Q4_K/Q5_K difference fit in 53 bits.
 *   Q5_0 (22 bytes / 32): d fp16 | qh u32 (bit j = bit 4 of element j) | qs[16] (element j: low
 *        nibble of qs[j], element j+16: high nibble); x = d * (q - 16)
 *   Q4_K (144 bytes / 256): d fp16 | dmin fp16 | 12 bytes of scales | qs[128]. Scales: bytes 0-3
 *        hold sc0-3 in their low 6 bits and the top 2 bits of sc4-7; bytes 4-7 likewise m0-3 and
 *        the top of m4-7; bytes 8-11 hold the low 4 bits of sc4-7 (low nibble) and of m4-7 (high
 *        nibble). Sub-block s (32 elements): nibbles of qs[32*(s/2) ..], low for even s, high for
 *        odd; x = d * sc_s * q - dmin * m_s
 *   Q5_K (176 bytes / 256): as Q4_K with qh[32] between the scales and qs; bit s of qh[l] is the
 *        fifth bit of element l of sub-block s
 *   Q6_K (210 bytes / 256): ql[128] | qh[64] | int8 scales[16] | d fp16. Each half of 128 elements
 *        uses 64 ql and 32 qh bytes; byte l (< 32) of the half's qh gives the top 2 bits of its
 *        elements l, l+32, l+64, l+96 (bits 0-1, 2-3, 4-5, 6-7), whose low 4 bits are the low
 *        nibbles of ql[l], ql[l+32] and the high nibbles of ql[l], ql[l+32]; x = d * sc[e/16] * (q - 32)
 * Returns 0, or -1 for another type. */
static int ref_dequant_row_q5_k_family(uint32_t type, const uint8_t *p, double *dst, int64_t n) {
    switch (type) {
    case REF_TYPE_Q5_0:
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = p + 22 * b;
            const double d = ref_fp16_to_double(rd_u16le(blk));
            const uint32_t qh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16 | (uint32_t)blk[5] << 24;
            for (int j = 0; j < 32; j++) {
                const int nib = j < 16 ? blk[6 + j] & 0x0f : blk[6 + j - 16] >> 4;
                const int q = nib + (int)(16 * ((qh >> j) & 1));
                dst[32 * b + j] = d * (q - 16);
            }
        }
        return 0;
    case REF_TYPE_Q4_K:
    case REF_TYPE_Q5_K: {
        const bool five = type == REF_TYPE_Q5_K;
        const int bytes = five ? 176 : 144;
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = p + (int64_t)bytes * b;
            const double d = ref_fp16_to_double(rd_u16le(blk)), dmin = ref_fp16_to_double(rd_u16le(blk + 2));
            const uint8_t *sc = blk + 4, *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            int scale[8], mins[8];
            for (int i = 0; i < 4; i++) {
                scale[i] = sc[i] % 64;
                mins[i] = sc[4 + i] % 64;
                scale[4 + i] = sc[8 + i] % 16 + 16 * (sc[i] / 64);
                mins[4 + i] = sc[8 + i] / 16 + 16 * (sc[4 + i] / 64);
            }
            for (int e = 0; e < 256; e++) {
                const int s = e / 32, l = e % 32;
                const uint8_t byte = qs[32 * (s / 2) + l];
                int q = s % 2 ? byte / 16 : byte % 16;
                if (five) q += 16 * ((qh[l] >> s) & 1);
                dst[256 * b + e] = d * scale[s] * q - dmin * mins[s];
            }
        }
        return 0;
    }
    case REF_TYPE_Q6_K:
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = p + 210 * b;
            const uint8_t *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const double d = ref_fp16_to_double(rd_u16le(blk + 208));
            double *y = dst + 256 * b;
            for (int half = 0; half < 2; half++) {
                const uint8_t *L = ql + 64 * half, *H = qh + 32 * half;
                for (int l = 0; l < 32; l++) {
                    const int q[4] = {(L[l] & 15) | (H[l] & 3) << 4, (L[l + 32] & 15) | ((H[l] >> 2) & 3) << 4,
                                      (L[l] >> 4) | ((H[l] >> 4) & 3) << 4, (L[l + 32] >> 4) | ((H[l] >> 6) & 3) << 4};
                    for (int k = 0; k < 4; k++) {
                        const int e = 128 * half + 32 * k + l;
                        y[e] = d * sc[e / 16] * (q[k] - 32);
                    }
                }
            }
        }
        return 0;
    default: return -1;
    }
}
/* ---- end of Q5_0 and the K-quants --------------------------------------------------------- */

int ref_dequant_row(uint32_t type, const void *src, double *dst, int64_t n) {
    const uint8_t *p = src;
    if (n < 0 || (n > 0 && ref_row_bytes(type, n) == 0)) return -1;
    switch (type) {
    case REF_TYPE_F32:
        for (int64_t i = 0; i < n; i++) {
            float f;
            memcpy(&f, p + 4 * i, 4); /* GGUF is little-endian, as is every host we run on */
            dst[i] = (double)f;
        }
        return 0;
    case REF_TYPE_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = ref_fp16_to_double(rd_u16le(p + 2 * i));
        return 0;
    case REF_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = ref_bf16_to_double(rd_u16le(p + 2 * i));
        return 0;
    case REF_TYPE_Q8_0:
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = p + 34 * b; /* [d: fp16][qs: int8 x 32] */
            const double d = ref_fp16_to_double(rd_u16le(blk));
            for (int j = 0; j < 32; j++) {
                const int q = blk[2 + j] < 128 ? blk[2 + j] : blk[2 + j] - 256; /* two's complement */
                dst[32 * b + j] = d * q;
            }
        }
        return 0;
    case REF_TYPE_Q4_0:
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *blk = p + 18 * b; /* [d: fp16][qs: 16 bytes] */
            const double d = ref_fp16_to_double(rd_u16le(blk));
            for (int j = 0; j < 16; j++) {
                dst[32 * b + j] = d * ((blk[2 + j] & 0x0f) - 8);  /* low nibble: element j */
                dst[32 * b + j + 16] = d * ((blk[2 + j] >> 4) - 8); /* high nibble: element j+16 */
            }
        }
        return 0;
    default: return ref_dequant_row_q5_k_family(type, p, dst, n);
    }
}

/* ---- comparison helpers -------------------------------------------------------------------- */

double ref_rel_l2(const float *a, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = (double)a[i] - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

double ref_max_abs(const float *a, const double *ref, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - ref[i]);
        if (!(e <= m)) m = e; /* NaN propagates as NaN */
    }
    return m;
}

int ref_argmax(const double *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

int ref_argmax_f32(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* ---- the model ------------------------------------------------------------------------------- */

typedef struct {
    double *attn_norm;        /* (n_embd) */
    double *wq;               /* (n_head*head_dim, n_embd), row-major: wq[r*n_embd + c] */
    double *wk, *wv;          /* (n_head_kv*head_dim, n_embd) */
    double *bq;               /* NULL or (n_head*head_dim) */
    double *bk, *bv;          /* NULL or (n_head_kv*head_dim) */
    double *q_norm, *k_norm;  /* NULL or (head_dim) */
    double *wo;               /* (n_embd, n_head*head_dim) */
    double *bo;               /* NULL or (n_embd) */
    double *post_attn_norm;   /* NULL or (n_embd) (gemma3) */
    double *ffn_norm;         /* (n_embd) */
    double *w_gate, *w_up;    /* (n_ff, n_embd) */
    double *w_down;           /* (n_embd, n_ff) */
    double *post_ffw_norm;    /* NULL or (n_embd) (gemma3) */
    double *gate_inp;         /* NULL or (n_expert, n_embd) router (qwen3moe) */
    double *gate_exps, *up_exps; /* NULL or (n_expert, n_ff_exp, n_embd) */
    double *down_exps;        /* NULL or (n_expert, n_embd, n_ff_exp) */
    double *gate_inp_shexp;   /* NULL or (n_embd) the shared expert's gate (qwen2moe) */
    double *gate_shexp, *up_shexp; /* NULL or (n_ff_shexp, n_embd) the shared expert (qwen2moe, deepseek2) */
    double *down_shexp;       /* NULL or (n_embd, n_ff_shexp) */
    /* deepseek2 (NULL otherwise) */
    double *wq_a, *q_a_norm, *wq_b; /* (q_lora, n_embd), (q_lora), (n_head * k_mla, q_lora) */
    double *wkv_a, *kv_a_norm;  /* (R + P, n_embd), (R) */
    double *wk_b;             /* (n_head, R, N): head h's key up-projection, k_nope = wk_b[h]^T latent */
    double *wv_b;             /* (n_head, v_mla, R) */
    double *exp_probs_b;      /* NULL or (n_expert) */
} ref_layer;

struct ref_model {
    ref_desc d;
    double *inv_freq;    /* (n_rot/2) global layers */
    double *inv_freq_local; /* NULL or (n_rot/2): local layers (gemma3) */
    double *tok_embd;    /* (n_vocab, n_embd) */
    double *output_norm; /* (n_embd) */
    double *output;      /* (n_vocab, n_embd); == tok_embd when tied (then not separately owned) */
    ref_layer *layers;   /* (n_layer) */
    double *route_gap;   /* NULL, or (n) per token the smallest router-logit gap at the top-k boundary over
                            layers (ref_model_forward_gaps) */
};

static void seterr(char *buf, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void seterr(char *buf, size_t cap, const char *fmt, ...) {
    if (!buf || cap == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
}

/* Loading state: the open file, the error buffer, and the tensors consumed so far. */
typedef struct {
    kvb_gguf *g;
    const char *path;
    const char *arch;
    char *err;
    size_t cap;
    const kvb_gguf_tensor **used; /* (n_used) */
    size_t n_used, cap_used;
} loader;

static int mark_used(loader *L, const kvb_gguf_tensor *t) {
    if (L->n_used == L->cap_used) {
        size_t nc = L->cap_used ? 2 * L->cap_used : 64;
        const kvb_gguf_tensor **nu = realloc(L->used, nc * sizeof *nu);
        if (!nu) {
            seterr(L->err, L->cap, "%s: out of memory", L->path);
            return -1;
        }
        L->used = nu;
        L->cap_used = nc;
    }
    L->used[L->n_used++] = t;
    return 0;
}

/* Reads {arch}.suffix as u32. Absent: *out = def, or an error if required. */
static int meta_u32(loader *L, const char *suffix, bool required, uint32_t def, uint32_t *out) {
    char key[160];
    kvb_err e = {0};
    snprintf(key, sizeof key, "%s.%s", L->arch, suffix);
    kvb_status s = kvb_gguf_get_u32(L->g, key, out, &e);
    if (s == KVB_ERR_NOT_FOUND && !required) {
        *out = def;
        return 0;
    }
    if (s != KVB_OK) {
        seterr(L->err, L->cap, "%s: key %s: %s", L->path, key, s == KVB_ERR_NOT_FOUND ? "missing" : e.msg);
        return -1;
    }
    return 0;
}

/* Reads {arch}.suffix as f32 (widened). Returns 1 if present, 0 if absent (out = def), -1 on error. */
static int meta_f32(loader *L, const char *suffix, bool required, double def, double *out) {
    char key[160];
    kvb_err e = {0};
    float f = 0;
    snprintf(key, sizeof key, "%s.%s", L->arch, suffix);
    kvb_status s = kvb_gguf_get_f32(L->g, key, &f, &e);
    if (s == KVB_ERR_NOT_FOUND && !required) {
        *out = def;
        return 0;
    }
    if (s != KVB_OK) {
        seterr(L->err, L->cap, "%s: key %s: %s", L->path, key, s == KVB_ERR_NOT_FOUND ? "missing" : e.msg);
        return -1;
    }
    if (!isfinite(f)) {
        seterr(L->err, L->cap, "%s: key %s is not finite", L->path, key);
        return -1;
    }
    *out = (double)f;
    return 1;
}

/* Finds tensor `name`, checks it is (rows, cols) (1-D when rows == 0) in a supported type, and
 * returns it dequantised: (max(rows,1), cols) doubles in *out. Absent and !required: *out = NULL. */
static int load_stack(loader *L, const char *name, int64_t rows, int64_t cols, int64_t n_stack, bool required,
                      double **out);
static int load_tensor(loader *L, const char *name, int64_t rows, int64_t cols, bool required, double **out) {
    return load_stack(L, name, rows, cols, 1, required, out);
}

/* load_tensor for ggml's stack of n_stack (rows, cols) matrices [cols, rows, n_stack] when
 * n_stack > 1: (n_stack * rows, cols) doubles. */
static int load_stack(loader *L, const char *name, int64_t rows, int64_t cols, int64_t n_stack, bool required,
                      double **out) {
    *out = NULL;
    const kvb_gguf_tensor *t = kvb_gguf_find_tensor(L->g, name);
    if (!t) {
        if (!required) return 0;
        seterr(L->err, L->cap, "%s: tensor %s missing", L->path, name);
        return -1;
    }
    const uint32_t want_dims = n_stack > 1 ? 3 : rows > 0 ? 2 : 1;
    const int64_t nrows = (rows > 0 ? rows : 1) * n_stack;
    bool ok = t->n_dims >= want_dims && t->n_dims <= KVB_GGUF_MAX_DIMS && t->ne[0] == (uint64_t)cols &&
              (want_dims == 1 || t->ne[1] == (uint64_t)rows) && (want_dims < 3 || t->ne[2] == (uint64_t)n_stack);
    for (uint32_t i = want_dims; ok && i < t->n_dims; i++) ok = t->ne[i] == 1;
    if (!ok) {
        seterr(L->err, L->cap, "%s: tensor %s has dims [%llu, %llu, %llu, %llu] (n_dims %u), expected [%lld, %lld]",
               L->path, name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
               (unsigned long long)t->ne[2], (unsigned long long)t->ne[3], (unsigned)t->n_dims, (long long)cols,
               (long long)nrows);
        return -1;
    }
    const size_t rb = ref_row_bytes(t->type, cols);
    if (rb == 0) {
        seterr(L->err, L->cap, "%s: tensor %s: type %u is not one the reference decodes (F32, F16, BF16, Q8_0, Q4_0) "
               "or its row of %lld is not whole blocks", L->path, name, (unsigned)t->type, (long long)cols);
        return -1;
    }
    if (t->n_bytes != rb * (uint64_t)nrows) {
        seterr(L->err, L->cap, "%s: tensor %s: reader says %llu bytes, layout says %llu", L->path, name,
               (unsigned long long)t->n_bytes, (unsigned long long)(rb * (uint64_t)nrows));
        return -1;
    }
    double *buf = malloc((size_t)nrows * (size_t)cols * sizeof *buf);
    if (!buf) {
        seterr(L->err, L->cap, "%s: out of memory for tensor %s", L->path, name);
        return -1;
    }
    const uint8_t *src = t->data;
    for (int64_t r = 0; r < nrows; r++) {
        if (ref_dequant_row(t->type, src + (size_t)r * rb, buf + (size_t)r * (size_t)cols, cols) != 0) {
            free(buf);
            seterr(L->err, L->cap, "%s: tensor %s: cannot decode", L->path, name);
            return -1;
        }
    }
    for (size_t i = 0; i < (size_t)nrows * (size_t)cols; i++) {
        if (!isfinite(buf[i])) {
            free(buf);
            seterr(L->err, L->cap, "%s: tensor %s: element %zu is not finite", L->path, name, i);
            return -1;
        }
    }
    if (mark_used(L, t) != 0) {
        free(buf);
        return -1;
    }
    *out = buf;
    return 0;
}

static int load_blk(loader *L, int layer, const char *suffix, int64_t rows, int64_t cols, bool required,
                    double **out) {
    char name[128];
    snprintf(name, sizeof name, "blk.%d.%s", layer, suffix);
    return load_tensor(L, name, rows, cols, required, out);
}

void ref_model_free(ref_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int l = 0; l < m->d.n_layer; l++) {
            ref_layer *y = &m->layers[l];
            double *ptrs[] = {y->attn_norm, y->wq, y->wk, y->wv, y->bq, y->bk, y->bv, y->q_norm, y->k_norm,
                              y->wo, y->bo, y->ffn_norm, y->w_gate, y->w_up, y->w_down, y->post_attn_norm,
                              y->post_ffw_norm, y->gate_inp, y->gate_exps, y->up_exps, y->down_exps,
                              y->gate_inp_shexp, y->gate_shexp, y->up_shexp, y->down_shexp, y->wq_a,
                              y->q_a_norm, y->wq_b, y->wkv_a, y->kv_a_norm, y->wk_b, y->wv_b, y->exp_probs_b};
            for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) free(ptrs[i]);
        }
        free(m->layers);
    }
    if (m->output != m->tok_embd) free(m->output);
    free(m->tok_embd);
    free(m->output_norm);
    free(m->inv_freq);
    free(m->inv_freq_local);
    free(m);
}

/* YaRN as ggml's rope computes it (ext_factor 1): pair i's angle is theta/factor * (1 - r) + theta * r,
 * r = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1), lo = floor(c(32)), hi = ceil(c(1)) clamped to
 * [0, n_rot - 1], c(beta) = n_rot ln(orig / (2 pi beta)) / (2 ln base); deepseek2's scores are then
 * scaled by mscale^2, mscale = 1 + 0.1 mscale_all_dim ln(factor). */
static void yarn_inv_freq(ref_model *m, double factor, double orig) {
    ref_desc *d = &m->d;
    const double nr = d->n_rot, base = d->rope_freq_base;
    const double lo = fmax(0.0, floor(nr * log(orig / (2 * M_PI * 32.0)) / (2 * log(base))));
    const double hi = fmin(nr - 1, ceil(nr * log(orig / (2 * M_PI * 1.0)) / (2 * log(base))));
    for (int i = 0; i < d->n_rot / 2; i++) {
        const double r = 1.0 - fmin(1.0, fmax(0.0, (i - lo) / fmax(0.001, hi - lo)));
        m->inv_freq[i] = m->inv_freq[i] / factor * (1 - r) + m->inv_freq[i] * r;
    }
    d->yarn_factor = factor;
    d->rope_scaling = REF_SCALING_NONE;
    const double mscale = 1.0 + 0.1 * d->yarn_log_mul * log(factor);
    d->attn_scale *= mscale * mscale;
}

/* Reads the rope.scaling.* keys and rope_freqs.weight and fills d->rope_* and m->inv_freq.
 * Policy (llama.cpp first):
 *  - rope_freqs.weight present: divide each inverse frequency by it (llama.cpp's ggml_rope_ext
 *    freq_factors; this is how convert_hf_to_gguf.py stores Llama-3 scaling). Together with a
 *    rope.scaling.factor other than 0/1 it is ambiguous (llama.cpp would apply both) and refused.
 *  - else scaling.type == "llama3", or type absent with factor > 1 and a low/high_freq_factor key:
 *    Hugging Face's llama3 rule computed here from factor, low_freq_factor (default 1),
 *    high_freq_factor (default 4), original_context_length (default 8192).
 *  - else type absent or "linear" with factor != 0, 1: linear, inverse frequency / factor (what
 *    llama.cpp does: rope_freq_scale = 1/factor, and "linear" is its default type).
 *  - "yarn" for deepseek2 (yarn_inv_freq); "none" or no factor: unscaled. Any other type (longrope, ...)
 *    is refused. */
static int load_rope(loader *L, ref_model *m) {
    ref_desc *d = &m->d;
    const int half = d->n_rot / 2;
    char key[160], type[64] = "";
    kvb_err e = {0};
    snprintf(key, sizeof key, "%s.rope.scaling.type", L->arch);
    kvb_status s = kvb_gguf_get_str(L->g, key, type, sizeof type, &e);
    if (s != KVB_OK && s != KVB_ERR_NOT_FOUND) {
        seterr(L->err, L->cap, "%s: key %s: %s", L->path, key, e.msg);
        return -1;
    }
    const bool have_type = s == KVB_OK;
    double factor, low, high, orig;
    int has_low, has_high; /* 1 when the key is present */
    if (meta_f32(L, "rope.scaling.factor", false, 0.0, &factor) < 0) return -1;
    if ((has_low = meta_f32(L, "rope.scaling.low_freq_factor", false, 1.0, &low)) < 0) return -1;
    if ((has_high = meta_f32(L, "rope.scaling.high_freq_factor", false, 4.0, &high)) < 0) return -1;
    uint32_t orig_u;
    if (meta_u32(L, "rope.scaling.original_context_length", false, 8192, &orig_u) != 0) return -1;
    orig = (double)orig_u;
    d->rope_factor = factor;
    d->rope_low_freq_factor = low;
    d->rope_high_freq_factor = high;
    d->rope_orig_ctx = orig;

    m->inv_freq = malloc((size_t)(half > 0 ? half : 1) * sizeof *m->inv_freq);
    if (!m->inv_freq) {
        seterr(L->err, L->cap, "%s: out of memory", L->path);
        return -1;
    }
    for (int i = 0; i < half; i++) m->inv_freq[i] = pow(d->rope_freq_base, -2.0 * i / d->n_rot);

    double *ff = NULL;
    if (load_tensor(L, "rope_freqs.weight", 0, half, false, &ff) != 0) return -1;
    if (ff) {
        if (factor != 0 && factor != 1) {
            free(ff);
            seterr(L->err, L->cap, "%s: both rope_freqs.weight and %s.rope.scaling.factor = %g: ambiguous "
                   "(llama.cpp would apply both)", L->path, L->arch, factor);
            return -1;
        }
        for (int i = 0; i < half; i++) {
            if (!(ff[i] > 0)) {
                seterr(L->err, L->cap, "%s: rope_freqs.weight[%d] = %g is not positive", L->path, i, ff[i]);
                free(ff);
                return -1;
            }
            m->inv_freq[i] /= ff[i];
        }
        free(ff);
        d->rope_scaling = REF_SCALING_FREQS_TENSOR;
        return 0;
    }
    if (have_type && strcmp(type, "yarn") == 0 && d->arch == REF_ARCH_DEEPSEEK2 && factor > 1) {
        yarn_inv_freq(m, factor, orig);
        return 0;
    }
    if (have_type && strcmp(type, "none") != 0 && strcmp(type, "linear") != 0 && strcmp(type, "llama3") != 0) {
        seterr(L->err, L->cap, "%s: rope scaling type \"%s\" is not supported (none, linear, llama3)", L->path, type);
        return -1;
    }
    const bool llama3 =
        (have_type && strcmp(type, "llama3") == 0) || (!have_type && factor > 1 && (has_low > 0 || has_high > 0));
    if (llama3) {
        if (!(factor > 0) || !(low > 0) || !(high > low) || !(orig > 0)) {
            seterr(L->err, L->cap, "%s: llama3 rope scaling needs factor > 0 and 0 < low_freq_factor < "
                   "high_freq_factor (got %g, %g, %g, orig ctx %g)", L->path, factor, low, high, orig);
            return -1;
        }
        const double low_wavelen = orig / low, high_wavelen = orig / high;
        for (int i = 0; i < half; i++) {
            const double f = m->inv_freq[i], wavelen = 2 * M_PI / f;
            if (wavelen < high_wavelen) {
                /* high frequency: unchanged */
            } else if (wavelen > low_wavelen) {
                m->inv_freq[i] = f / factor;
            } else {
                const double smooth = (orig / wavelen - low) / (high - low);
                m->inv_freq[i] = (1 - smooth) * f / factor + smooth * f;
            }
        }
        d->rope_scaling = REF_SCALING_LLAMA3;
    } else if ((!have_type || strcmp(type, "linear") == 0) && factor != 0 && factor != 1) {
        if (!(factor > 0)) {
            seterr(L->err, L->cap, "%s: rope.scaling.factor %g is not positive", L->path, factor);
            return -1;
        }
        for (int i = 0; i < half; i++) m->inv_freq[i] /= factor;
        d->rope_scaling = REF_SCALING_LINEAR;
    } else {
        d->rope_scaling = REF_SCALING_NONE;
    }
    return 0;
}

/* Gemma 3's facts (see ref_model.h), read independently of model/: the window is required; the
 * layer pattern is Gemma 3's 5 local + 1 global unless attention.sliding_window_pattern is present
 * as a period p (layer i local iff p == 0 or i % p < p - 1, llama.cpp's reading) or as one boolean
 * per layer (true = sliding window, gguf-py's writer); logit soft-capping (Gemma 2) is refused. */
static int load_gemma3_desc(loader *L, ref_model *m) {
    ref_desc *d = &m->d;
    uint32_t window;
    if (meta_u32(L, "attention.sliding_window", true, 0, &window)) return -1;
    if (window == 0 || window > (1u << 24)) {
        seterr(L->err, L->cap, "%s: attention.sliding_window %u is not in [1, 2^24]", L->path, window);
        return -1;
    }
    d->swa_window = (int)window;
    char key[160];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", L->arch);
    const kvb_gguf_kv *kv = kvb_gguf_find(L->g, key);
    if (kv && kv->type == KVB_GGUF_ARRAY) {
        if (kv->arr_type != KVB_GGUF_BOOL || kv->arr_len != (uint64_t)d->n_layer) {
            seterr(L->err, L->cap, "%s: %s must be %d booleans", L->path, key, d->n_layer);
            return -1;
        }
        for (int i = 0; i < d->n_layer; i++) {
            if (kv->arr_data[i] > 1) {
                seterr(L->err, L->cap, "%s: %s[%d] is not a boolean", L->path, key, i);
                return -1;
            }
            d->layer_local[i] = kv->arr_data[i] == 1;
        }
    } else {
        uint32_t period = 6;
        if (kv && meta_u32(L, "attention.sliding_window_pattern", true, 0, &period)) return -1;
        for (int i = 0; i < d->n_layer; i++) d->layer_local[i] = period == 0 || (uint32_t)i % period < period - 1;
    }
    d->rope_freq_base_local = 10000.0;
    d->embd_scale = sqrt((double)d->n_embd);
    const int qpas = d->n_layer == 62 ? d->n_embd / d->n_head : d->head_dim; /* query_pre_attn_scalar */
    if (qpas < 1) {
        seterr(L->err, L->cap, "%s: query_pre_attn_scalar %d", L->path, qpas);
        return -1;
    }
    d->attn_scale = 1.0 / sqrt((double)qpas);
    d->has_post_norms = true;
    d->ffn_gelu = true;
    d->has_qk_norm = true;
    const char *caps[] = {"final_logit_softcapping", "attn_logit_softcapping"};
    for (int i = 0; i < 2; i++) {
        double cap;
        if (meta_f32(L, caps[i], false, 0.0, &cap) < 0) return -1;
        if (cap != 0) {
            seterr(L->err, L->cap, "%s: %s.%s = %g: soft-capping is not part of Gemma 3", L->path, L->arch, caps[i], cap);
            return -1;
        }
    }
    return 0;
}

static int load_moe_desc(loader *L, ref_desc *d);
static int load_mla_desc(loader *L, ref_desc *d, int vlen);

static int load_desc(loader *L, ref_model *m) {
    ref_desc *d = &m->d;
    uint32_t embd, nl, ff, nh, nhkv, hd, nrot, vlen;
    if (meta_u32(L, "embedding_length", true, 0, &embd) || meta_u32(L, "block_count", true, 0, &nl) ||
        meta_u32(L, "feed_forward_length", true, 0, &ff) || meta_u32(L, "attention.head_count", true, 0, &nh))
        return -1;
    if (meta_u32(L, "attention.head_count_kv", false, nh, &nhkv)) return -1;
    if (nh == 0 || embd == 0 || nl == 0 || ff == 0 || nhkv == 0 || embd > (1u << 20) || nl > REF_MAX_LAYERS ||
        ff > (1u << 22) || nh > 4096) {
        seterr(L->err, L->cap, "%s: implausible shape: embd %u, layers %u, ff %u, heads %u/%u", L->path, embd, nl, ff,
               nh, nhkv);
        return -1;
    }
    if (meta_u32(L, "attention.key_length", false, embd / nh, &hd)) return -1;
    if (meta_u32(L, "attention.value_length", false, hd, &vlen)) return -1;
    if (meta_u32(L, "rope.dimension_count", false, hd, &nrot)) return -1;
    const bool ds2 = d->arch == REF_ARCH_DEEPSEEK2; /* value_length is the latent: checked in load_mla_desc */
    if (hd == 0 || hd > 4096 || (vlen != hd && !ds2) || nh % nhkv != 0 || nrot > hd || nrot % 2 != 0) {
        seterr(L->err, L->cap, "%s: bad attention shape: head_dim %u, value_length %u, heads %u/%u, n_rot %u "
               "(need value_length == key_length, n_head %% n_head_kv == 0, even n_rot <= head_dim)",
               L->path, hd, vlen, nh, nhkv, nrot);
        return -1;
    }
    if (d->arch == REF_ARCH_LLAMA && nrot != hd) {
        seterr(L->err, L->cap, "%s: llama with n_rot %u != head_dim %u (llama.cpp refuses this)", L->path, nrot, hd);
        return -1;
    }
    d->n_embd = (int)embd;
    d->n_layer = (int)nl;
    d->n_ff = (int)ff;
    d->n_head = (int)nh;
    d->n_head_kv = (int)nhkv;
    d->head_dim = (int)hd;
    d->n_rot = (int)nrot;
    if (meta_f32(L, "rope.freq_base", false, 10000.0, &d->rope_freq_base) < 0) return -1;
    if (meta_f32(L, "attention.layer_norm_rms_epsilon", true, 0, &d->norm_eps) < 0) return -1;
    if (!(d->rope_freq_base > 0) || !(d->norm_eps >= 0)) {
        seterr(L->err, L->cap, "%s: bad rope.freq_base %g or rms epsilon %g", L->path, d->rope_freq_base, d->norm_eps);
        return -1;
    }
    d->rope_style = d->arch == REF_ARCH_LLAMA || ds2 ? REF_ROPE_NORM : REF_ROPE_NEOX;
    d->embd_scale = 1.0;
    d->attn_scale = 1.0 / sqrt((double)d->head_dim);
    if (d->arch == REF_ARCH_QWEN3MOE || d->arch == REF_ARCH_QWEN2MOE) return load_moe_desc(L, d);
    if (ds2) return load_mla_desc(L, d, (int)vlen);
    return d->arch == REF_ARCH_GEMMA3 ? load_gemma3_desc(L, m) : 0;
}

/* The local layers' inverse frequencies: rope_freq_base_local^(-2i/n_rot), no scaling. */
static int load_local_rope(loader *L, ref_model *m) {
    const ref_desc *d = &m->d;
    if (d->swa_window == 0) return 0;
    const int half = d->n_rot / 2;
    m->inv_freq_local = malloc((size_t)(half > 0 ? half : 1) * sizeof *m->inv_freq_local);
    if (!m->inv_freq_local) {
        seterr(L->err, L->cap, "%s: out of memory", L->path);
        return -1;
    }
    for (int i = 0; i < half; i++) m->inv_freq_local[i] = pow(d->rope_freq_base_local, -2.0 * i / d->n_rot);
    return 0;
}

/* Layer l's router and stacked experts, by llama.cpp's names; the shared expert where the model has one
 * (qwen2moe's behind its gate vector, deepseek2's ungated). */
static int load_experts(loader *L, int l, const ref_desc *d, ref_layer *y) {
    char name[128];
    const int64_t E = d->n_embd, F = d->n_ff_exp, X = d->n_expert;
    snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
    if (load_tensor(L, name, X, E, true, &y->gate_inp)) return -1;
    snprintf(name, sizeof name, "blk.%d.ffn_gate_exps.weight", l);
    if (load_stack(L, name, F, E, X, true, &y->gate_exps)) return -1;
    snprintf(name, sizeof name, "blk.%d.ffn_up_exps.weight", l);
    if (load_stack(L, name, F, E, X, true, &y->up_exps)) return -1;
    snprintf(name, sizeof name, "blk.%d.ffn_down_exps.weight", l);
    if (load_stack(L, name, E, F, X, true, &y->down_exps)) return -1;
    if (!d->n_ff_shexp) return 0;
    const int64_t S = d->n_ff_shexp;
    return (d->arch == REF_ARCH_QWEN2MOE && load_blk(L, l, "ffn_gate_inp_shexp.weight", 0, E, true, &y->gate_inp_shexp)) ||
                   load_blk(L, l, "ffn_gate_shexp.weight", S, E, true, &y->gate_shexp) ||
                   load_blk(L, l, "ffn_up_shexp.weight", S, E, true, &y->up_shexp) ||
                   load_blk(L, l, "ffn_down_shexp.weight", E, S, true, &y->down_shexp)
               ? -1
               : 0;
}

/* qwen3moe's and qwen2moe's keys: expert_count, expert_used_count (required), expert_feed_forward_length
 * (else feed_forward_length / expert_used_count, llama.cpp's fallback), expert_weights_norm (bool,
 * default true for qwen3moe, false for qwen2moe: llama.cpp's graphs), qwen2moe's
 * expert_shared_feed_forward_length. */
static int load_moe_desc(loader *L, ref_desc *d) {
    uint32_t x, k, f;
    if (meta_u32(L, "expert_count", true, 0, &x) || meta_u32(L, "expert_used_count", true, 0, &k)) return -1;
    if (x == 0 || x > 4096 || k == 0 || k > x) {
        seterr(L->err, L->cap, "%s: bad expert counts: %u experts, %u used", L->path, x, k);
        return -1;
    }
    if (meta_u32(L, "expert_feed_forward_length", false, (uint32_t)d->n_ff / k, &f)) return -1;
    if (f == 0 || f > (1u << 22)) {
        seterr(L->err, L->cap, "%s: bad expert_feed_forward_length %u", L->path, f);
        return -1;
    }
    d->n_expert = (int)x;
    d->n_expert_used = (int)k;
    d->n_ff_exp = (int)f;
    const bool qwen2moe = d->arch == REF_ARCH_QWEN2MOE;
    if (qwen2moe) { /* the shared expert's size, else feed_forward_length (llama.cpp's fallback) */
        uint32_t s;
        if (meta_u32(L, "expert_shared_feed_forward_length", false, (uint32_t)d->n_ff, &s)) return -1;
        if (s == 0 || s > (1u << 22)) {
            seterr(L->err, L->cap, "%s: bad expert_shared_feed_forward_length %u", L->path, s);
            return -1;
        }
        d->n_ff_shexp = (int)s;
    }
    char key[96];
    snprintf(key, sizeof key, "%s.expert_weights_norm", L->arch);
    const kvb_gguf_kv *kv = kvb_gguf_find(L->g, key);
    d->expert_weights_norm = !qwen2moe; /* llama.cpp: qwen3moe renormalises, qwen2moe does not */
    if (kv) {
        if (kv->type != KVB_GGUF_BOOL) {
            seterr(L->err, L->cap, "%s: %s is not a bool", L->path, key);
            return -1;
        }
        bool b = true;
        if (kvb_gguf_get_bool(L->g, key, &b, NULL) != KVB_OK) return -1;
        d->expert_weights_norm = b;
    }
    return 0;
}

/* deepseek2's keys, read here independently of model/ (names as gguf-py's Keys spell them): the
 * latent ranks and head sizes (the MLA form: head_count_kv 1, key_length R + P, value_length R),
 * dense lead, expert counts, shared experts, gating, groups, weights scale and norm, YaRN. */
static int load_mla_desc(loader *L, ref_desc *d, int vlen) {
    uint32_t ql, r, km, vm, lead, x, k, f, sh, gate, ng, gu;
    if (meta_u32(L, "attention.q_lora_rank", false, 0, &ql) || meta_u32(L, "attention.kv_lora_rank", true, 0, &r) ||
        meta_u32(L, "attention.key_length_mla", true, 0, &km) ||
        meta_u32(L, "attention.value_length_mla", true, 0, &vm) ||
        meta_u32(L, "leading_dense_block_count", false, 0, &lead) || meta_u32(L, "expert_count", true, 0, &x) ||
        meta_u32(L, "expert_used_count", true, 0, &k) || meta_u32(L, "expert_feed_forward_length", true, 0, &f) ||
        meta_u32(L, "expert_shared_count", true, 0, &sh) || meta_u32(L, "expert_gating_func", false, 1, &gate) ||
        meta_u32(L, "expert_group_count", false, 0, &ng) || meta_u32(L, "expert_group_used_count", false, 0, &gu))
        return -1;
    if (d->n_head_kv != 1 || d->head_dim != (int)r + d->n_rot || vlen != (int)r || km <= (uint32_t)d->n_rot ||
        x == 0 || x > 4096 || k == 0 || k > x || (gate != 1 && gate != 2) || ng > 256 || (ng > 1 && (x % ng || gu == 0 || gu > ng))) {
        seterr(L->err, L->cap, "%s: not a deepseek2 MLA shape the reference reads", L->path);
        return -1;
    }
    d->mla = true;
    d->attn_scale = 1.0 / sqrt((double)km); /* times mscale^2 under YaRN (load_rope) */
    d->n_lora_q = (int)ql;
    d->n_lora_kv = (int)r;
    d->k_mla = (int)km;
    d->v_mla = (int)vm;
    d->n_dense_lead = (int)lead;
    d->n_expert = (int)x;
    d->n_expert_used = (int)k;
    d->n_ff_exp = (int)f;
    d->n_ff_shexp = (int)(f * sh); /* llama.cpp's ffn_*_shexp width: the shared experts side by side */
    d->gating = (int)gate;
    d->n_groups = (int)ng;
    d->n_group_used = (int)gu;
    if (meta_f32(L, "expert_weights_scale", false, 0.0, &d->expert_weights_scale) < 0) return -1;
    char key[96];
    snprintf(key, sizeof key, "%s.expert_weights_norm", L->arch);
    bool b = false;
    if (kvb_gguf_find(L->g, key) && kvb_gguf_get_bool(L->g, key, &b, NULL) != KVB_OK) return -1;
    d->expert_weights_norm = b;
    double lm = 0;
    if (meta_f32(L, "rope.scaling.yarn_log_multiplier", false, 0.0, &lm) < 0) return -1;
    d->yarn_log_mul = lm / 0.1;
    return 0;
}

/* Layer l of deepseek2: the latent attention's tensors, then the dense FFN or the experts with
 * their shared experts and optional selection bias. */
static int load_mla_layer(loader *L, int l, const ref_desc *d, ref_layer *y) {
    const int64_t E = d->n_embd, H = d->n_head, R = d->n_lora_kv, P = d->n_rot, K = d->k_mla, N = K - P,
                  Vd = d->v_mla, QL = d->n_lora_q;
    char name[128];
    if (QL ? load_blk(L, l, "attn_q_a.weight", QL, E, true, &y->wq_a) ||
                 load_blk(L, l, "attn_q_a_norm.weight", 0, QL, true, &y->q_a_norm) ||
                 load_blk(L, l, "attn_q_b.weight", H * K, QL, true, &y->wq_b)
           : load_blk(L, l, "attn_q.weight", H * K, E, true, &y->wq))
        return -1;
    if (load_blk(L, l, "attn_kv_a_mqa.weight", R + P, E, true, &y->wkv_a) ||
        load_blk(L, l, "attn_kv_a_norm.weight", 0, R, true, &y->kv_a_norm) ||
        load_blk(L, l, "attn_output.weight", E, H * Vd, true, &y->wo) ||
        load_blk(L, l, "ffn_norm.weight", 0, E, true, &y->ffn_norm))
        return -1;
    snprintf(name, sizeof name, "blk.%d.attn_k_b.weight", l);
    if (load_stack(L, name, R, N, H, true, &y->wk_b)) return -1;
    snprintf(name, sizeof name, "blk.%d.attn_v_b.weight", l);
    if (load_stack(L, name, Vd, R, H, true, &y->wv_b)) return -1;
    if (l < d->n_dense_lead)
        return load_blk(L, l, "ffn_gate.weight", d->n_ff, E, true, &y->w_gate) ||
                       load_blk(L, l, "ffn_up.weight", d->n_ff, E, true, &y->w_up) ||
                       load_blk(L, l, "ffn_down.weight", E, d->n_ff, true, &y->w_down)
                   ? -1
                   : 0;
    return load_experts(L, l, d, y) || load_blk(L, l, "exp_probs_b.bias", 0, d->n_expert, false, &y->exp_probs_b)
               ? -1
               : 0;
}

static int load_weights(loader *L, ref_model *m) {
    ref_desc *d = &m->d;
    const int64_t E = d->n_embd, F = d->n_ff, QD = (int64_t)d->n_head * d->head_dim,
                  KD = (int64_t)d->n_head_kv * d->head_dim;
    const kvb_gguf_tensor *te = kvb_gguf_find_tensor(L->g, "token_embd.weight");
    if (!te || te->n_dims < 2 || te->ne[1] == 0 || te->ne[1] > (1u << 24)) {
        seterr(L->err, L->cap, "%s: token_embd.weight missing or not 2-D with 1..2^24 rows", L->path);
        return -1;
    }
    d->n_vocab = (int)te->ne[1];
    const kvb_gguf_kv *tok = kvb_gguf_find(L->g, "tokenizer.ggml.tokens");
    if (tok && tok->type == KVB_GGUF_ARRAY && tok->arr_len != (uint64_t)d->n_vocab) {
        seterr(L->err, L->cap, "%s: tokenizer.ggml.tokens has %llu entries but token_embd.weight %d rows", L->path,
               (unsigned long long)tok->arr_len, d->n_vocab);
        return -1;
    }
    if (load_tensor(L, "token_embd.weight", d->n_vocab, E, true, &m->tok_embd)) return -1;
    if (load_tensor(L, "output_norm.weight", 0, E, true, &m->output_norm)) return -1;
    if (load_tensor(L, "output.weight", d->n_vocab, E, false, &m->output)) return -1;
    d->tied_output = m->output == NULL;
    if (d->tied_output) m->output = m->tok_embd;

    m->layers = calloc((size_t)d->n_layer, sizeof *m->layers);
    if (!m->layers) {
        seterr(L->err, L->cap, "%s: out of memory", L->path);
        return -1;
    }
    const bool qwen2 = d->arch == REF_ARCH_QWEN2 || d->arch == REF_ARCH_QWEN2MOE, qwen3 = d->arch == REF_ARCH_QWEN3, llama = d->arch == REF_ARCH_LLAMA,
               gemma3 = d->arch == REF_ARCH_GEMMA3;
    for (int l = 0; l < d->n_layer; l++) {
        ref_layer *y = &m->layers[l];
        if (d->mla) {
            if (load_blk(L, l, "attn_norm.weight", 0, E, true, &y->attn_norm) || load_mla_layer(L, l, d, y)) return -1;
            continue;
        }
        if (load_blk(L, l, "attn_norm.weight", 0, E, true, &y->attn_norm) ||
            load_blk(L, l, "attn_q.weight", QD, E, true, &y->wq) || load_blk(L, l, "attn_k.weight", KD, E, true, &y->wk) ||
            load_blk(L, l, "attn_v.weight", KD, E, true, &y->wv) ||
            load_blk(L, l, "attn_output.weight", E, QD, true, &y->wo) ||
            load_blk(L, l, "ffn_norm.weight", 0, E, true, &y->ffn_norm))
            return -1;
        if (d->n_expert ? load_experts(L, l, d, y)
                        : load_blk(L, l, "ffn_gate.weight", F, E, true, &y->w_gate) ||
                              load_blk(L, l, "ffn_up.weight", F, E, true, &y->w_up) ||
                              load_blk(L, l, "ffn_down.weight", E, F, true, &y->w_down))
            return -1;
        /* llama.cpp: qwen2 requires q/k/v biases; llama accepts each of them and attn_output.bias
         * optionally; qwen3 has none of them but requires the per-head q/k norms. Anything else is
         * left unconsumed and rejected below. */
        if (qwen2 || llama) {
            if (load_blk(L, l, "attn_q.bias", 0, QD, qwen2, &y->bq) ||
                load_blk(L, l, "attn_k.bias", 0, KD, qwen2, &y->bk) ||
                load_blk(L, l, "attn_v.bias", 0, KD, qwen2, &y->bv))
                return -1;
            if (y->bq || y->bk || y->bv) d->has_qkv_bias = true;
        }
        if (llama) {
            if (load_blk(L, l, "attn_output.bias", 0, E, false, &y->bo)) return -1;
            if (y->bo) d->has_o_bias = true;
        }
        if (qwen3 || gemma3 || d->arch == REF_ARCH_QWEN3MOE) {
            if (load_blk(L, l, "attn_q_norm.weight", 0, d->head_dim, true, &y->q_norm) ||
                load_blk(L, l, "attn_k_norm.weight", 0, d->head_dim, true, &y->k_norm))
                return -1;
            d->has_qk_norm = true;
        }
        if (gemma3 && (load_blk(L, l, "post_attention_norm.weight", 0, E, true, &y->post_attn_norm) ||
                       load_blk(L, l, "post_ffw_norm.weight", 0, E, true, &y->post_ffw_norm)))
            return -1;
    }
    return 0;
}

ref_model *ref_model_load(const char *gguf_path, char *errbuf, size_t cap) {
    seterr(errbuf, cap, "%s", "");
    kvb_err e = {0};
    kvb_gguf *g = NULL;
    if (kvb_gguf_open(gguf_path, &g, &e) != KVB_OK) {
        seterr(errbuf, cap, "%s", e.msg);
        return NULL;
    }
    ref_model *m = calloc(1, sizeof *m);
    char arch[32] = "";
    loader L = {.g = g, .path = gguf_path, .arch = arch, .err = errbuf, .cap = cap};
    if (!m) {
        seterr(errbuf, cap, "%s: out of memory", gguf_path);
        goto fail;
    }
    if (kvb_gguf_get_str(g, "general.architecture", arch, sizeof arch, &e) != KVB_OK) {
        seterr(errbuf, cap, "%s: general.architecture: %s", gguf_path, e.msg);
        goto fail;
    }
    if (strcmp(arch, "llama") == 0) m->d.arch = REF_ARCH_LLAMA;
    else if (strcmp(arch, "qwen2") == 0) m->d.arch = REF_ARCH_QWEN2;
    else if (strcmp(arch, "qwen3") == 0) m->d.arch = REF_ARCH_QWEN3;
    else if (strcmp(arch, "qwen3moe") == 0) m->d.arch = REF_ARCH_QWEN3MOE;
    else if (strcmp(arch, "qwen2moe") == 0) m->d.arch = REF_ARCH_QWEN2MOE;
    else if (strcmp(arch, "gemma3") == 0) m->d.arch = REF_ARCH_GEMMA3;
    else if (strcmp(arch, "deepseek2") == 0) m->d.arch = REF_ARCH_DEEPSEEK2;
    else {
        seterr(errbuf, cap,
               "%s: architecture \"%s\" is not one the reference implements (llama, qwen2, qwen3, qwen3moe, qwen2moe, "
               "gemma3, deepseek2)",
               gguf_path, arch);
        goto fail;
    }
    if (load_desc(&L, m) || load_rope(&L, m) || load_local_rope(&L, m) || load_weights(&L, m)) goto fail;
    if (L.n_used != kvb_gguf_n_tensors(g)) {
        /* Name one tensor nobody consumed. */
        for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
            const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
            bool used = false;
            for (size_t j = 0; j < L.n_used && !used; j++) used = L.used[j] == t;
            if (!used) {
                seterr(errbuf, cap, "%s: tensor %.*s is not part of a %s model (llama.cpp would refuse the file)",
                       gguf_path, (int)KVB_MIN(t->name.len, 200), t->name.ptr, arch);
                break;
            }
        }
        goto fail;
    }
    free(L.used);
    kvb_gguf_close(g); /* everything is copied out as double */
    return m;
fail:
    free(L.used);
    ref_model_free(m);
    kvb_gguf_close(g);
    return NULL;
}

int ref_model_n_vocab(const ref_model *m) { return m->d.n_vocab; }
const ref_desc *ref_model_desc(const ref_model *m) { return &m->d; }
const double *ref_model_inv_freq(const ref_model *m) { return m->inv_freq; }
const double *ref_model_inv_freq_layer(const ref_model *m, int layer) {
    return layer >= 0 && layer < m->d.n_layer && m->d.layer_local[layer] ? m->inv_freq_local : m->inv_freq;
}

/* ---- the forward pass --------------------------------------------------------------------------- */

/* y = W x (+ b): W (rows, cols) row-major, x (cols), y (rows). */
static void matvec(const double *W, const double *b, const double *x, double *y, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const double *w = W + (size_t)r * (size_t)cols;
        double s = 0;
        for (int c = 0; c < cols; c++) s += w[c] * x[c];
        y[r] = b ? s + b[r] : s;
    }
}

/* y = x / sqrt(mean(x^2) + eps) * w; x, y, w: (n). y may alias x. */
static void rmsnorm(const double *x, const double *w, double *y, int n, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static void rope_with(const ref_model *m, const double *inv_freq, double *x, int pos) {
    const int half = m->d.n_rot / 2;
    for (int i = 0; i < half; i++) {
        const double theta = (double)pos * inv_freq[i];
        const double c = cos(theta), s = sin(theta);
        /* NORM pairs adjacent elements; NEOX pairs element i with element i + n_rot/2. */
        const int i0 = m->d.rope_style == REF_ROPE_NORM ? 2 * i : i;
        const int i1 = m->d.rope_style == REF_ROPE_NORM ? 2 * i + 1 : i + half;
        const double a = x[i0], b = x[i1];
        x[i0] = a * c - b * s;
        x[i1] = a * s + b * c;
    }
}

void ref_rope(const ref_model *m, double *x, int pos) { rope_with(m, m->inv_freq, x, pos); }
void ref_rope_layer(const ref_model *m, int layer, double *x, int pos) {
    rope_with(m, ref_model_inv_freq_layer(m, layer), x, pos);
}

static double silu(double x) { return x / (1.0 + exp(-x)); }
/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
static double gelu_tanh(double x) { return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }

/* sel (K) := the indices of the K largest scores (X), largest first, the lower index on a tie. */
static void top_k(const double *score, int X, int K, int *sel) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int x = 0; x < X; x++) {
            bool taken = false;
            for (int i = 0; i < k; i++) taken = taken || sel[i] == x;
            if (!taken && (best < 0 || score[x] > score[best])) best = x;
        }
        sel[k] = best;
    }
}

/* eo (n_embd) := expert x's SwiGLU FFN of h; g, u (n_ff_exp) scratch. */
static void expert_swiglu(const ref_desc *d, const ref_layer *y, size_t x, const double *h, double *g, double *u,
                          double *eo) {
    const int E = d->n_embd, F = d->n_ff_exp;
    matvec(y->gate_exps + x * F * E, NULL, h, g, F, E);
    matvec(y->up_exps + x * F * E, NULL, h, u, F, E);
    for (int i = 0; i < F; i++) g[i] = silu(g[i]) * u[i];
    matvec(y->down_exps + x * E * F, NULL, g, eo, E, F);
}

/* o (n_embd) += the shared expert's SwiGLU output for h (n_ff_shexp > 0; else nothing), times
 * sigmoid(gate_inp_shexp . h) where the layer has that gate (qwen2moe); g, u (n_ff_shexp), eo
 * (n_embd) scratch. */
static void shared_expert_add(const ref_desc *d, const ref_layer *y, const double *h, double *g, double *u,
                              double *eo, double *o) {
    const int E = d->n_embd, S = d->n_ff_shexp;
    if (!S) return;
    double gate = 1.0;
    if (y->gate_inp_shexp) {
        double gl;
        matvec(y->gate_inp_shexp, NULL, h, &gl, 1, E);
        gate = 1.0 / (1.0 + exp(-gl));
    }
    matvec(y->gate_shexp, NULL, h, g, S, E);
    matvec(y->up_shexp, NULL, h, u, S, E);
    for (int i = 0; i < S; i++) g[i] = silu(g[i]) * u[i];
    matvec(y->down_shexp, NULL, g, eo, E, S);
    for (int i = 0; i < E; i++) o[i] += gate * eo[i];
}

/* The largest score not among sel (K); -inf when every index is. */
static double best_unchosen(const double *score, int X, const int *sel, int K) {
    double best = -INFINITY;
    for (int x = 0; x < X; x++) {
        bool taken = false;
        for (int i = 0; i < K; i++) taken = taken || sel[i] == x;
        if (!taken && score[x] > best) best = score[x];
    }
    return best;
}

/* o (n_embd) := the mixture-of-experts FFN of the normed row h (n_embd): softmax router, the top
 * n_expert_used (largest first, lower index on a tie), renormalised weights, the weighted sum of
 * those experts' SwiGLU outputs; qwen2moe: + the gated shared expert's. g, u: (max(n_ff_exp,
 * n_ff_shexp)) scratch. Returns 0 or -1 (allocation). */
static int moe_ffn(const ref_desc *d, const ref_layer *y, const double *h, double *g, double *u, double *o,
                   double *gap) {
    const int E = d->n_embd, X = d->n_expert, K = d->n_expert_used;
    double *p = malloc((size_t)X * sizeof *p);   /* (n_expert) */
    double *eo = malloc((size_t)E * sizeof *eo); /* (n_embd) one expert's output */
    int *sel = malloc((size_t)K * sizeof *sel);  /* (n_expert_used) */
    double *w = malloc((size_t)K * sizeof *w);   /* (n_expert_used) */
    if (!p || !eo || !sel || !w) {
        free(p), free(eo), free(sel), free(w);
        return -1;
    }
    matvec(y->gate_inp, NULL, h, p, X, E); /* router logits first: the gap is measured on them */
    double *lg = malloc((size_t)X * sizeof *lg);
    if (!lg) {
        free(p), free(eo), free(sel), free(w);
        return -1;
    }
    memcpy(lg, p, (size_t)X * sizeof *lg);
    double mx = p[0], sum = 0, wsum = 0;
    for (int x = 1; x < X; x++) mx = p[x] > mx ? p[x] : mx;
    for (int x = 0; x < X; x++) sum += (p[x] = exp(p[x] - mx));
    for (int x = 0; x < X; x++) p[x] /= sum;
    top_k(p, X, K, sel);
    for (int k = 0; k < K; k++) wsum += (w[k] = p[sel[k]]);
    if (gap && K < X) { /* the last chosen logit minus the best logit not chosen */
        const double gk = lg[sel[K - 1]] - best_unchosen(lg, X, sel, K);
        if (gk < *gap) *gap = gk;
    }
    free(lg);
    for (int i = 0; i < E; i++) o[i] = 0;
    for (int k = 0; k < K; k++) {
        const size_t x = (size_t)sel[k];
        expert_swiglu(d, y, x, h, g, u, eo);
        const double wk = d->expert_weights_norm ? w[k] / wsum : w[k];
        for (int i = 0; i < E; i++) o[i] += wk * eo[i];
    }
    shared_expert_add(d, y, h, g, u, eo, o);
    free(p), free(eo), free(sel), free(w);
    return 0;
}

/* logits (n, n_vocab) := output (rmsnorm(x) * output_norm) for the n rows of x; h (n, n_embd) scratch */
static void output_head(const ref_model *m, const double *x, double *h, int n, double *logits) {
    const int E = m->d.n_embd;
    for (int t = 0; t < n; t++) {
        double *ht = h + (size_t)t * E;
        rmsnorm(x + (size_t)t * E, m->output_norm, ht, E, m->d.norm_eps);
        matvec(m->output, NULL, ht, logits + (size_t)t * m->d.n_vocab, m->d.n_vocab, E);
    }
}

/* ---- deepseek2 ---------------------------------------------------------------------------------- */

/* The latent attention of layer l for the normed rows h (n, n_embd), expanded form: att (n, H * Vd)
 * each head's softmax-weighted values; rows (n, R + P), when not NULL, the cache rows [latent, k_pe].
 * Returns 0 or -1 (allocation). */
static int mla_attention(const ref_model *m, int l, const double *h, int n, double *att, double *rows) {
    const ref_desc *d = &m->d;
    const ref_layer *y = &m->layers[l];
    const int E = d->n_embd, H = d->n_head, R = d->n_lora_kv, P = d->n_rot, K = d->k_mla, N = K - P,
              Vd = d->v_mla, QL = d->n_lora_q;
    const size_t nn = (size_t)n;
    double *c = malloc(nn * (R + P) * sizeof *c);      /* (n, R + P) latent, then k_pe */
    double *q = malloc(nn * H * K * sizeof *q);        /* (n, H, K) */
    double *kn = malloc(nn * H * N * sizeof *kn);      /* (n, H, N) expanded keys' non-rotated part */
    double *v = malloc(nn * H * Vd * sizeof *v);       /* (n, H, Vd) */
    double *qa = malloc((size_t)(QL > 0 ? QL : 1) * sizeof *qa);
    double *p = malloc(nn * sizeof *p);
    int rc = -1;
    if (!c || !q || !kn || !v || !qa || !p) goto done;
    for (int t = 0; t < n; t++) {
        const double *ht = h + (size_t)t * E;
        double *ct = c + (size_t)t * (R + P), *qt = q + (size_t)t * H * K;
        matvec(y->wkv_a, NULL, ht, ct, R + P, E);
        rmsnorm(ct, y->kv_a_norm, ct, R, d->norm_eps);
        ref_rope(m, ct + R, t);
        if (QL) {
            matvec(y->wq_a, NULL, ht, qa, QL, E);
            rmsnorm(qa, y->q_a_norm, qa, QL, d->norm_eps);
            matvec(y->wq_b, NULL, qa, qt, H * K, QL);
        } else {
            matvec(y->wq, NULL, ht, qt, H * K, E);
        }
        for (int hh = 0; hh < H; hh++) {
            ref_rope(m, qt + (size_t)hh * K + N, t);
            const double *kb = y->wk_b + (size_t)hh * R * N; /* (R, N) */
            double *kt = kn + ((size_t)t * H + hh) * N;
            for (int i = 0; i < N; i++) {
                double sum = 0;
                for (int r = 0; r < R; r++) sum += kb[(size_t)r * N + i] * ct[r];
                kt[i] = sum;
            }
            matvec(y->wv_b + (size_t)hh * Vd * R, NULL, ct, v + ((size_t)t * H + hh) * Vd, Vd, R);
        }
    }
    if (rows) memcpy(rows, c, nn * (R + P) * sizeof *c);
    for (int t = 0; t < n; t++)
        for (int hh = 0; hh < H; hh++) {
            const double *qh = q + ((size_t)t * H + hh) * K;
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j <= t; j++) {
                const double *kj = kn + ((size_t)j * H + hh) * N, *pe = c + (size_t)j * (R + P) + R;
                double s = 0;
                for (int i = 0; i < N; i++) s += qh[i] * kj[i];
                for (int i = 0; i < P; i++) s += qh[N + i] * pe[i];
                p[j] = s * d->attn_scale;
                mx = p[j] > mx ? p[j] : mx;
            }
            for (int j = 0; j <= t; j++) sum += (p[j] = exp(p[j] - mx));
            double *ah = att + ((size_t)t * H + hh) * Vd;
            for (int i = 0; i < Vd; i++) ah[i] = 0;
            for (int j = 0; j <= t; j++)
                for (int i = 0; i < Vd; i++) ah[i] += p[j] / sum * v[((size_t)j * H + hh) * Vd + i];
        }
    rc = 0;
done:
    free(c), free(q), free(kn), free(v), free(qa), free(p);
    return rc;
}

int ref_route_deepseek(const ref_desc *d, double *pr, const double *bias, int *sel, double *w, double *margin) {
    const int X = d->n_expert, K = d->n_expert_used;
    double *sc = malloc((size_t)X * sizeof *sc);
    if (!sc || X < 1 || K < 1 || K > X || (d->n_groups > 1 && (d->n_groups > 256 || X % d->n_groups))) {
        free(sc);
        return -1;
    }
    double mx = pr[0], sum = 0;
    for (int x = 1; x < X; x++) mx = pr[x] > mx ? pr[x] : mx;
    for (int x = 0; x < X; x++) sum += d->gating == 2 ? 0 : exp(pr[x] - mx);
    for (int x = 0; x < X; x++) pr[x] = d->gating == 2 ? 1.0 / (1.0 + exp(-pr[x])) : exp(pr[x] - mx) / sum;
    for (int x = 0; x < X; x++) sc[x] = pr[x] + (bias ? bias[x] : 0.0);
    *margin = INFINITY; /* the smallest selection-score margin of a routing decision */
    if (d->n_groups > 1) { /* keep the n_group_used groups whose two best scores sum highest */
        const int G = d->n_groups, per = X / G;
        double gs[256];
        bool kept[256] = {false};
        for (int gi = 0; gi < G; gi++) {
            double b1 = -INFINITY, b2 = -INFINITY;
            for (int i = 0; i < per; i++) {
                const double v = sc[gi * per + i];
                if (v > b1) b2 = b1, b1 = v;
                else if (v > b2) b2 = v;
            }
            gs[gi] = b1 + b2;
        }
        double last_kept = INFINITY, best_dropped = -INFINITY;
        for (int k = 0; k < d->n_group_used; k++) {
            int best = -1;
            for (int gi = 0; gi < G; gi++)
                if (!kept[gi] && (best < 0 || gs[gi] > gs[best])) best = gi;
            kept[best] = true;
            last_kept = gs[best];
        }
        for (int gi = 0; gi < G; gi++)
            if (!kept[gi] && gs[gi] > best_dropped) best_dropped = gs[gi];
        *margin = last_kept - best_dropped; /* a group flip routes differently too */
        for (int gi = 0; gi < G; gi++)
            if (!kept[gi])
                for (int i = 0; i < per; i++) sc[gi * per + i] = -INFINITY;
    }
    double wsum = 0;
    top_k(sc, X, K, sel);
    for (int k = 0; k < K; k++) wsum += pr[sel[k]];
    const double best_out = K < X ? best_unchosen(sc, X, sel, K) : -INFINITY;
    if (K < X && sc[sel[K - 1]] - best_out < *margin) *margin = sc[sel[K - 1]] - best_out;
    for (int k = 0; k < K; k++) {
        w[k] = d->expert_weights_norm ? pr[sel[k]] / wsum : pr[sel[k]];
        if (d->expert_weights_scale != 0) w[k] *= d->expert_weights_scale;
    }
    free(sc);
    return 0;
}

/* The experts of a deepseek2 MoE layer for the normed row h: the routing (ref_route_deepseek), the
 * routed sum plus the shared experts. o (n_embd); g, u (max(n_ff_exp, n_ff_shexp)) scratch; gap: the
 * selection-score margin of the routing is folded in (in router-logit units). Returns 0 or -1. */
static int mla_moe(const ref_desc *d, const ref_layer *y, const double *h, double *g, double *u, double *o,
                   double *gap) {
    const int E = d->n_embd, X = d->n_expert, K = d->n_expert_used;
    double *pr = malloc((size_t)X * sizeof *pr), *eo = malloc((size_t)E * sizeof *eo), *w = malloc((size_t)K * sizeof *w);
    int *sel = malloc((size_t)K * sizeof *sel);
    double margin;
    if (!pr || !eo || !w || !sel) {
        free(pr), free(eo), free(w), free(sel);
        return -1;
    }
    matvec(y->gate_inp, NULL, h, pr, X, E);
    if (ref_route_deepseek(d, pr, y->exp_probs_b, sel, w, &margin)) {
        free(pr), free(eo), free(w), free(sel);
        return -1;
    }
    /* in router-logit units: a sigmoid probability moves at most a quarter of its logit's change */
    if (gap && (d->gating == 2 ? 4.0 * margin : margin) < *gap) *gap = d->gating == 2 ? 4.0 * margin : margin;
    for (int i = 0; i < E; i++) o[i] = 0;
    for (int k = 0; k < K; k++) {
        expert_swiglu(d, y, (size_t)sel[k], h, g, u, eo);
        for (int i = 0; i < E; i++) o[i] += w[k] * eo[i];
    }
    shared_expert_add(d, y, h, g, u, eo, o);
    free(pr), free(eo), free(w), free(sel);
    return 0;
}

/* deepseek2's forward (run's contract; k_out receives the cache rows (n, 1, R + P), v_out is not
 * written). */
static int run_mla(ref_model *m, const int32_t *tokens, int n, double *logits, int kv_layer, double *h_out,
                   double *k_out) {
    const ref_desc *d = &m->d;
    const int E = d->n_embd, HV = d->n_head * d->v_mla;
    const int F0 = d->n_ff > d->n_ff_exp ? d->n_ff : d->n_ff_exp, F = F0 > d->n_ff_shexp ? F0 : d->n_ff_shexp;
    const size_t nn = (size_t)n;
    double *x = malloc(nn * E * sizeof *x), *h = malloc(nn * E * sizeof *h), *att = malloc(nn * HV * sizeof *att);
    double *g = malloc((size_t)F * sizeof *g), *u = malloc((size_t)F * sizeof *u), *o = malloc((size_t)E * sizeof *o);
    int rc = -1;
    if (!x || !h || !att || !g || !u || !o) goto done;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = m->tok_embd[(size_t)tokens[t] * E + i];
    for (int l = 0; l < d->n_layer; l++) {
        const ref_layer *y = &m->layers[l];
        for (int t = 0; t < n; t++) rmsnorm(x + (size_t)t * E, y->attn_norm, h + (size_t)t * E, E, d->norm_eps);
        if (l == kv_layer) {
            if (h_out) memcpy(h_out, h, nn * E * sizeof *h);
            rc = mla_attention(m, l, h, n, att, k_out);
            goto done;
        }
        if (mla_attention(m, l, h, n, att, NULL)) goto done;
        for (int t = 0; t < n; t++) {
            double *xt = x + (size_t)t * E, *ht = h + (size_t)t * E;
            matvec(y->wo, NULL, att + (size_t)t * HV, o, E, HV);
            for (int i = 0; i < E; i++) xt[i] += o[i];
            rmsnorm(xt, y->ffn_norm, ht, E, d->norm_eps);
            if (l >= d->n_dense_lead) {
                if (mla_moe(d, y, ht, g, u, o, m->route_gap ? m->route_gap + t : NULL)) goto done;
            } else {
                matvec(y->w_gate, NULL, ht, g, d->n_ff, E);
                matvec(y->w_up, NULL, ht, u, d->n_ff, E);
                for (int i = 0; i < d->n_ff; i++) g[i] = silu(g[i]) * u[i];
                matvec(y->w_down, NULL, g, o, E, d->n_ff);
            }
            for (int i = 0; i < E; i++) xt[i] += o[i];
        }
    }
    output_head(m, x, h, n, logits);
    rc = 0;
done:
    free(x), free(h), free(att), free(g), free(u), free(o);
    return rc;
}

/* The forward pass. With kv_layer >= 0 it stops at that layer after copying its attention input
 * to h_out (n, n_embd) and its K and V to k_out/v_out (n, n_head_kv, head_dim), each when not
 * NULL; otherwise it writes logits (n, n_vocab). */
static int run(ref_model *m, const int32_t *tokens, int n, double *logits, int kv_layer, double *h_out,
               double *k_out, double *v_out) {
    const ref_desc *d = &m->d;
    const int F0 = d->n_ff > d->n_ff_exp ? d->n_ff : d->n_ff_exp; /* g, u: the largest FFN's inner size */
    const int E = d->n_embd, F = F0 > d->n_ff_shexp ? F0 : d->n_ff_shexp, H = d->n_head, HKV = d->n_head_kv, D = d->head_dim;
    const int QD = H * D, KD = HKV * D, group = H / HKV;
    const double scale = d->attn_scale;
    if (n < 1 || !tokens || (kv_layer < 0 && !logits) || kv_layer >= d->n_layer) return -1;
    for (int t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= d->n_vocab) return -1;
    if (d->mla) return run_mla(m, tokens, n, logits, kv_layer, h_out, k_out);

    const size_t nn = (size_t)n;
    double *x = malloc(nn * E * sizeof *x);    /* (n, n_embd) residual stream */
    double *h = malloc(nn * E * sizeof *h);    /* (n, n_embd) normed input */
    double *q = malloc(nn * QD * sizeof *q);   /* (n, n_head, head_dim) */
    double *k = malloc(nn * KD * sizeof *k);   /* (n, n_head_kv, head_dim) */
    double *v = malloc(nn * KD * sizeof *v);   /* (n, n_head_kv, head_dim) */
    double *att = malloc(nn * QD * sizeof *att); /* (n, n_head, head_dim) attention output */
    double *p = malloc(nn * sizeof *p);        /* (n) scores / probabilities of one query */
    double *g = malloc((size_t)F * sizeof *g); /* (max(n_ff, n_ff_exp, n_ff_shexp)) */
    double *u = malloc((size_t)F * sizeof *u); /* (max(n_ff, n_ff_exp, n_ff_shexp)) */
    double *o = malloc((size_t)E * sizeof *o); /* (n_embd) */
    int rc = -1;
    if (!x || !h || !q || !k || !v || !att || !p || !g || !u || !o) goto done;

    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = m->tok_embd[(size_t)tokens[t] * E + i] * d->embd_scale;

    for (int l = 0; l < d->n_layer; l++) {
        const ref_layer *y = &m->layers[l];
        /* attention: projections, q/k norm, RoPE */
        for (int t = 0; t < n; t++) {
            double *ht = h + (size_t)t * E, *qt = q + (size_t)t * QD, *kt = k + (size_t)t * KD,
                   *vt = v + (size_t)t * KD;
            rmsnorm(x + (size_t)t * E, y->attn_norm, ht, E, d->norm_eps);
            matvec(y->wq, y->bq, ht, qt, QD, E);
            matvec(y->wk, y->bk, ht, kt, KD, E);
            matvec(y->wv, y->bv, ht, vt, KD, E);
            for (int hh = 0; hh < H; hh++) {
                if (y->q_norm) rmsnorm(qt + hh * D, y->q_norm, qt + hh * D, D, d->norm_eps);
                ref_rope_layer(m, l, qt + hh * D, t);
            }
            for (int hh = 0; hh < HKV; hh++) {
                if (y->k_norm) rmsnorm(kt + hh * D, y->k_norm, kt + hh * D, D, d->norm_eps);
                ref_rope_layer(m, l, kt + hh * D, t);
            }
        }
        if (l == kv_layer) {
            if (h_out) memcpy(h_out, h, nn * E * sizeof *h);
            if (k_out) memcpy(k_out, k, nn * KD * sizeof *k);
            if (v_out) memcpy(v_out, v, nn * KD * sizeof *v);
            rc = 0;
            goto done;
        }
        /* causal softmax attention; query head hh reads kv head hh / group; on a local layer query t
         * reads keys j with t - j < window only */
        for (int t = 0; t < n; t++) {
            const int j0 = d->layer_local[l] && t - d->swa_window + 1 > 0 ? t - d->swa_window + 1 : 0;
            for (int hh = 0; hh < H; hh++) {
                const double *qh = q + (size_t)t * QD + hh * D;
                const int kh = hh / group;
                double mx = -INFINITY;
                for (int j = j0; j <= t; j++) {
                    const double *kj = k + (size_t)j * KD + kh * D;
                    double s = 0;
                    for (int i = 0; i < D; i++) s += qh[i] * kj[i];
                    p[j] = s * scale;
                    if (p[j] > mx) mx = p[j];
                }
                double sum = 0;
                for (int j = j0; j <= t; j++) {
                    p[j] = exp(p[j] - mx);
                    sum += p[j];
                }
                double *ah = att + (size_t)t * QD + hh * D;
                for (int i = 0; i < D; i++) ah[i] = 0;
                for (int j = j0; j <= t; j++) {
                    const double *vj = v + (size_t)j * KD + kh * D;
                    const double w = p[j] / sum;
                    for (int i = 0; i < D; i++) ah[i] += w * vj[i];
                }
            }
        }
        /* output projection (gemma3: post-attention norm) + residual, then the SwiGLU or GeGLU FFN
         * (gemma3: post-FFN norm) + residual */
        for (int t = 0; t < n; t++) {
            double *xt = x + (size_t)t * E, *ht = h + (size_t)t * E;
            matvec(y->wo, y->bo, att + (size_t)t * QD, o, E, QD);
            if (y->post_attn_norm) rmsnorm(o, y->post_attn_norm, o, E, d->norm_eps);
            for (int i = 0; i < E; i++) xt[i] += o[i];
            rmsnorm(xt, y->ffn_norm, ht, E, d->norm_eps);
            if (d->n_expert) {
                if (moe_ffn(d, y, ht, g, u, o, m->route_gap ? m->route_gap + t : NULL)) goto done;
            } else {
                matvec(y->w_gate, NULL, ht, g, F, E);
                matvec(y->w_up, NULL, ht, u, F, E);
                for (int i = 0; i < F; i++) g[i] = (d->ffn_gelu ? gelu_tanh(g[i]) : silu(g[i])) * u[i];
                matvec(y->w_down, NULL, g, o, E, F);
            }
            if (y->post_ffw_norm) rmsnorm(o, y->post_ffw_norm, o, E, d->norm_eps);
            for (int i = 0; i < E; i++) xt[i] += o[i];
        }
    }
    output_head(m, x, h, n, logits);
    rc = 0;
done:
    free(x);
    free(h);
    free(q);
    free(k);
    free(v);
    free(att);
    free(p);
    free(g);
    free(u);
    free(o);
    return rc;
}

int ref_model_forward_gaps(ref_model *m, const int32_t *tokens, int n, double *logits, double *gaps) {
    if (n < 1 || !gaps) return -1;
    for (int t = 0; t < n; t++) gaps[t] = INFINITY;
    m->route_gap = gaps;
    const int rc = run(m, tokens, n, logits, -1, NULL, NULL, NULL);
    m->route_gap = NULL;
    return rc;
}

int ref_model_forward(ref_model *m, const int32_t *tokens, int n, double *logits) {
    if (!m || !logits) return -1;
    return run(m, tokens, n, logits, -1, NULL, NULL, NULL);
}

int ref_model_kv(ref_model *m, const int32_t *tokens, int n, int layer, double *k, double *v) {
    if (!m || !k || (!v && !m->d.mla) || layer < 0) return -1; /* deepseek2: the latent row alone */
    return run(m, tokens, n, NULL, layer, NULL, k, v);
}

int ref_model_attn_input(ref_model *m, const int32_t *tokens, int n, int layer, double *h) {
    if (!m || !h || layer < 0) return -1;
    return run(m, tokens, n, NULL, layer, h, NULL, NULL);
}
