/* model/desc.c — the architecture description read from GGUF metadata ({arch}.* keys), every
 * value range-checked so a hostile file cannot make later code allocate or index absurdly. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvb_model.h"

static kvb_status get_u32_key(const kvb_gguf *g, const char *arch, const char *suffix, bool required,
                              uint32_t dflt, uint32_t lo, uint32_t hi, uint32_t *out, kvb_err *err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kvb_err e2 = {0};
    kvb_status st = kvb_gguf_get_u32(g, key, out, &e2);
    if (st == KVB_ERR_NOT_FOUND && !required) {
        *out = dflt;
        st = KVB_OK;
    } else if (st == KVB_ERR_NOT_FOUND) {
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: required key %s is missing", kvb_gguf_path(g), key);
    } else if (st != KVB_OK) {
        return kvb_err_set(err, st, "%s: %s", kvb_gguf_path(g), e2.msg);
    }
    if (*out < lo || *out > hi)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: %s = %u is out of range [%u, %u]", kvb_gguf_path(g), key,
                           *out, lo, hi);
    return KVB_OK;
}

static kvb_status get_f32_key(const kvb_gguf *g, const char *arch, const char *suffix, float dflt, float lo,
                              float hi, float *out, kvb_err *err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kvb_err e2 = {0};
    kvb_status st = kvb_gguf_get_f32(g, key, out, &e2);
    if (st == KVB_ERR_NOT_FOUND) {
        *out = dflt;
        return KVB_OK;
    }
    if (st != KVB_OK) return kvb_err_set(err, st, "%s: %s", kvb_gguf_path(g), e2.msg);
    if (!(*out >= lo && *out <= hi))
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: %s = %g is out of range [%g, %g]", kvb_gguf_path(g), key,
                           (double)*out, (double)lo, (double)hi);
    return KVB_OK;
}

kvb_status kvb_model_desc_from_gguf(const kvb_gguf *g, kvb_model_desc *d, kvb_err *err) {
    memset(d, 0, sizeof *d);
    kvb_status st = kvb_gguf_get_str(g, "general.architecture", d->arch_name, sizeof d->arch_name, err);
    if (st != KVB_OK) return kvb_err_prefix(err, "%s: general.architecture: ", kvb_gguf_path(g));
    const char *a = d->arch_name;
    if (strcmp(a, "llama") == 0) d->arch = KVB_ARCH_LLAMA;
    else if (strcmp(a, "qwen2") == 0) d->arch = KVB_ARCH_QWEN2;
    else if (strcmp(a, "qwen3") == 0) d->arch = KVB_ARCH_QWEN3;
    else
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%s: architecture '%s' is not supported (supported: llama, qwen2, qwen3)",
                           kvb_gguf_path(g), a);
    if (kvb_gguf_get_str(g, "general.name", d->name, sizeof d->name, NULL) != KVB_OK) d->name[0] = 0;

    const uint32_t big = 1u << 20;
    if ((st = get_u32_key(g, a, "embedding_length", true, 0, 1, 65536, &d->n_embd, err))) return st;
    if ((st = get_u32_key(g, a, "block_count", true, 0, 1, 1024, &d->n_layer, err))) return st;
    if ((st = get_u32_key(g, a, "feed_forward_length", true, 0, 1, 1u << 18, &d->n_ff, err))) return st;
    if ((st = get_u32_key(g, a, "attention.head_count", true, 0, 1, 1024, &d->n_head, err))) return st;
    if ((st = get_u32_key(g, a, "attention.head_count_kv", false, d->n_head, 1, d->n_head, &d->n_head_kv, err)))
        return st;
    if (d->n_head % d->n_head_kv)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: head_count %u is not a multiple of head_count_kv %u",
                           kvb_gguf_path(g), d->n_head, d->n_head_kv);
    uint32_t dflt_hd = d->n_embd / d->n_head;
    if ((st = get_u32_key(g, a, "attention.key_length", false, dflt_hd, 2, 1024, &d->head_dim, err))) return st;
    uint32_t vlen;
    if ((st = get_u32_key(g, a, "attention.value_length", false, d->head_dim, 1, 1024, &vlen, err))) return st;
    if (vlen != d->head_dim)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: key_length %u != value_length %u is not supported",
                           kvb_gguf_path(g), d->head_dim, vlen);
    if ((st = get_u32_key(g, a, "rope.dimension_count", false, d->head_dim, 2, d->head_dim, &d->n_rot, err)))
        return st;
    if (d->n_rot % 2)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: rope.dimension_count %u is odd", kvb_gguf_path(g), d->n_rot);
    if ((st = get_u32_key(g, a, "context_length", false, 4096, 1, 1u << 24, &d->n_ctx_train, err))) return st;
    (void)big;
    if ((st = get_f32_key(g, a, "rope.freq_base", 10000.0f, 1.0f, 1e12f, &d->rope_freq_base, err))) return st;
    if ((st = get_f32_key(g, a, "attention.layer_norm_rms_epsilon", 1e-5f, 0.0f, 1.0f, &d->norm_eps, err)))
        return st;

    /* Llama-3 rope scaling from keys (files converted by llama.cpp carry rope_freqs.weight instead). */
    char key[128], stype[32] = "";
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    kvb_gguf_get_str(g, key, stype, sizeof stype, NULL);
    float factor = 0;
    if ((st = get_f32_key(g, a, "rope.scaling.factor", 0.0f, 0.0f, 1e6f, &factor, err))) return st;
    char lo_key[128];
    snprintf(lo_key, sizeof lo_key, "%s.rope.scaling.low_freq_factor", a);
    bool has_llama3_keys = kvb_gguf_find(g, lo_key) != NULL;
    if (strcmp(stype, "llama3") == 0 || (stype[0] == 0 && factor > 1.0f && has_llama3_keys)) {
        d->rope_scale_factor = factor;
        if ((st = get_f32_key(g, a, "rope.scaling.low_freq_factor", 1.0f, 0.0f, 1e6f, &d->rope_low_freq_factor, err)))
            return st;
        if ((st = get_f32_key(g, a, "rope.scaling.high_freq_factor", 4.0f, 0.0f, 1e6f, &d->rope_high_freq_factor,
                              err)))
            return st;
        if ((st = get_u32_key(g, a, "rope.scaling.original_context_length", false, 8192, 1, 1u << 24,
                              &d->rope_orig_ctx, err)))
            return st;
        if (!(d->rope_high_freq_factor > d->rope_low_freq_factor))
            return kvb_err_set(err, KVB_ERR_FORMAT, "%s: rope scaling high_freq_factor must exceed low_freq_factor",
                               kvb_gguf_path(g));
    } else if (strcmp(stype, "linear") == 0 || (stype[0] == 0 && factor > 1.0f)) {
        /* llama.cpp's reading of a bare factor: linear position scaling */
        if (factor > 0 && factor != 1.0f) d->rope_linear_factor = factor;
    } else if (stype[0] && strcmp(stype, "none") != 0) {
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: rope scaling type '%s' is not supported (llama3, linear, none)",
                           kvb_gguf_path(g), stype);
    }

    d->rope_neox = d->arch != KVB_ARCH_LLAMA;
    d->has_qkv_bias = d->arch == KVB_ARCH_QWEN2;
    d->has_qk_norm = d->arch == KVB_ARCH_QWEN3;
    return KVB_OK;
}

uint64_t kvb_model_n_params_nonembd(const kvb_model_desc *d) {
    uint64_t e = d->n_embd, q = (uint64_t)d->n_head * d->head_dim, kv = (uint64_t)d->n_head_kv * d->head_dim;
    uint64_t per_layer = e * q + 2 * e * kv + q * e + 3 * e * d->n_ff + 2 * e;
    return per_layer * d->n_layer + e + (uint64_t)d->n_vocab * e; /* the output head is a matmul */
}
