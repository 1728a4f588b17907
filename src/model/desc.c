/* model/desc.c — the architecture description read from GGUF metadata ({arch}.* keys), every
 * value range-checked so a hostile file cannot make later code allocate or index absurdly; for
 * gemma3 also the facts the file does not carry (embedding scale, local/global layer pattern,
 * the local layers' RoPE base, the attention scale), each stated where it is set; for qwen3moe
 * the expert keys with llama.cpp's defaults (moe_desc); for deepseek2 the latent attention's ranks and
 * sizes, the leading dense layers, shared experts, gating, group-limited routing and YaRN
 * (deepseek2_desc). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvb_model.h"
#include "kvb_quant.h"

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

/* {arch}.attention.sliding_window_pattern, when the file has it: a u32 period (llama.cpp's
 * reading: layer i is local iff period == 0 or i % period < period - 1) or an array of n_layer
 * booleans (true = sliding-window layer), as gguf-py's add_sliding_window_pattern writes it. */
static kvb_status read_swa_pattern(const kvb_gguf *g, kvb_model_desc *d, kvb_err *err) {
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", d->arch_name);
    const kvb_gguf_kv *kv = kvb_gguf_find(g, key);
    if (!kv) return KVB_OK; /* the caller's default stays */
    if (kv->type != KVB_GGUF_ARRAY)
        return get_u32_key(g, d->arch_name, "attention.sliding_window_pattern", true, 0, 0, KVB_MAX_LAYERS,
                           &d->swa_pattern, err);
    const size_t es = kvb_gguf_vtype_size(kv->arr_type);
    const bool integral = kv->arr_type == KVB_GGUF_BOOL || kv->arr_type == KVB_GGUF_U8 || kv->arr_type == KVB_GGUF_I8 ||
                          kv->arr_type == KVB_GGUF_U16 || kv->arr_type == KVB_GGUF_I16 ||
                          kv->arr_type == KVB_GGUF_U32 || kv->arr_type == KVB_GGUF_I32;
    if (!integral || es == 0)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: %s is an array of %s, expected booleans", kvb_gguf_path(g), key,
                           kvb_gguf_vtype_name(kv->arr_type));
    if (kv->arr_len != d->n_layer)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: %s has %llu entries for %u layers", kvb_gguf_path(g), key,
                           (unsigned long long)kv->arr_len, d->n_layer);
    memset(d->swa_local_mask, 0, sizeof d->swa_local_mask);
    for (uint32_t i = 0; i < d->n_layer; i++) {
        uint64_t v = 0; /* little-endian element of es bytes */
        for (size_t b = 0; b < es; b++) v |= (uint64_t)kv->arr_data[(size_t)i * es + b] << (8 * b);
        if (v > 1)
            return kvb_err_set(err, KVB_ERR_FORMAT, "%s: %s[%u] = %llu is not a boolean", kvb_gguf_path(g), key, i,
                               (unsigned long long)v);
        if (v) d->swa_local_mask[i / 64] |= 1ull << (i % 64);
    }
    d->swa_layers_explicit = true;
    return KVB_OK;
}

/* Gemma 3's facts. Checked against the GGUF of gemma-3-270m (llama.cpp's converter) and the
 * public Gemma 3 description (Hugging Face's Gemma3TextConfig / modeling, llama.cpp's gemma3):
 *  - attention.sliding_window (required; 512 for 270M): local layers attend keys k with p - k < window
 *    (HF's sliding-window overlay keeps kv_idx > q_idx - window; llama.cpp masks p1 - p0 >= n_swa);
 *  - the layer pattern is not in the file: five local layers then one global, layer i global iff
 *    (i + 1) % 6 == 0 (HF sliding_window_pattern 6 / layer_types; 270M: layers 5, 11, 17 global);
 *    an attention.sliding_window_pattern key overrides it;
 *  - local layers rotate with base 10000 (rope_local_base_freq), global ones with rope.freq_base (1e6)
 *    and any rope scaling (Gemma 3 4B+ scale the global layers linearly by 8; local layers never);
 *  - token embeddings are multiplied by sqrt(n_embd) (HF Gemma3TextScaledWordEmbedding; we multiply
 *    in f32 by sqrtf(n_embd) like llama.cpp, HF rounds the scale to the weights' dtype first);
 *  - attention scale 1/sqrt(query_pre_attn_scalar): 256 = head_dim for 270M/1B/4B/12B; the 27B uses
 *    n_embd / n_head = 168 (its config; llama.cpp picks it by block_count 62);
 *  - post-attention and post-MLP RMSNorms, GeGLU MLP with tanh-approximated GELU
 *    (hidden_activation gelu_pytorch_tanh), per-head q/k RMSNorm, rotate-halves (neox) RoPE;
 *  - no logit soft-capping in Gemma 3 (Gemma 2 had it): a file that sets either soft-cap is refused;
 *  - the stored RMSNorm weights already include Gemma's "+1" (llama.cpp's converter adds it): in the
 *    270M file every norm weight minus 1 is exactly a bf16 value (the checkpoint's dtype), while the
 *    stored values themselves are not (70 % are), so they are used as plain RMSNorm weights. */
static kvb_status gemma3_desc(const kvb_gguf *g, kvb_model_desc *d, kvb_err *err) {
    const char *a = d->arch_name;
    kvb_status st;
    if ((st = get_u32_key(g, a, "attention.sliding_window", true, 0, 1, 1u << 24, &d->swa_window, err))) return st;
    d->swa_pattern = 6;
    if ((st = read_swa_pattern(g, d, err))) return st;
    d->rope_freq_base_local = 10000.0f;
    d->embd_scale = sqrtf((float)d->n_embd);
    const uint32_t query_pre_attn_scalar = d->n_layer == 62 ? d->n_embd / d->n_head : d->head_dim;
    if (query_pre_attn_scalar == 0)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: gemma3 27B shape with n_embd %u < n_head %u", kvb_gguf_path(g),
                           d->n_embd, d->n_head);
    d->attn_scale = 1.0f / sqrtf((float)query_pre_attn_scalar);
    d->has_post_norms = true;
    d->mlp_gelu = true;
    const char *caps[] = {"final_logit_softcapping", "attn_logit_softcapping"};
    for (size_t i = 0; i < 2; i++) {
        float cap = 0;
        if ((st = get_f32_key(g, a, caps[i], 0.0f, -1e30f, 1e30f, &cap, err))) return st;
        if (cap != 0.0f)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                               "%s: %s.%s = %g: Gemma 3 has no logit soft-capping and this engine does not implement it",
                               kvb_gguf_path(g), a, caps[i], (double)cap);
    }
    return KVB_OK;
}

/* The mixture-of-experts keys as llama.cpp's converter writes them for qwen3moe (gguf-py's
 * Keys.LLM.EXPERT_*): expert_count and expert_used_count are required; expert_feed_forward_length
 * falls back to feed_forward_length / expert_used_count as llama.cpp's loader does;
 * expert_weights_norm (absent in converted Qwen3-MoE files) defaults to true, the top-k
 * renormalisation llama.cpp applies to qwen3moe (HF norm_topk_prob); expert_gating_func, when
 * present, must be softmax (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX = 1). qwen2moe (Qwen1.5-MoE,
 * Qwen2-57B-A14B): the same keys, the top-k not renormalised (llama.cpp's graph passes norm_w = false;
 * HF norm_topk_prob false), and expert_shared_feed_forward_length, the shared expert's inner size
 * (else feed_forward_length, llama.cpp's fallback). */
static kvb_status moe_desc(const kvb_gguf *g, kvb_model_desc *d, kvb_err *err) {
    const char *a = d->arch_name;
    kvb_status st;
    if ((st = get_u32_key(g, a, "expert_count", true, 0, 1, KVB_MAX_EXPERTS, &d->n_expert, err))) return st;
    if ((st = get_u32_key(g, a, "expert_used_count", true, 0, 1, d->n_expert, &d->n_expert_used, err))) return st;
    if ((st = get_u32_key(g, a, "expert_feed_forward_length", false, d->n_ff / d->n_expert_used, 1, 1u << 18,
                          &d->n_ff_exp, err)))
        return st;
    uint32_t gating = 1;
    if ((st = get_u32_key(g, a, "expert_gating_func", false, 1, 0, 1u << 16, &gating, err))) return st;
    if (gating != 1)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: %s.expert_gating_func = %u: only softmax (1) is supported",
                           kvb_gguf_path(g), a, gating);
    const bool qwen2moe = d->arch == KVB_ARCH_QWEN2MOE;
    if (qwen2moe && (st = get_u32_key(g, a, "expert_shared_feed_forward_length", false, d->n_ff, 1, 1u << 18,
                                      &d->n_ff_shexp, err)))
        return st;
    char key[128];
    snprintf(key, sizeof key, "%s.expert_weights_norm", a);
    kvb_err e2 = {0};
    st = kvb_gguf_get_bool(g, key, &d->expert_weights_norm, &e2);
    if (st == KVB_ERR_NOT_FOUND) d->expert_weights_norm = !qwen2moe;
    else if (st) return kvb_err_set(err, st, "%s: %s", kvb_gguf_path(g), e2.msg);
    return KVB_OK;
}

/* DeepSeek V2/V3 (deepseek2) as llama.cpp's converter writes its MLA form and the pinned llama.cpp
 * reads it (src/models/deepseek2.cpp, llama-context.cpp):
 *  - attention.kv_lora_rank (required); attention.q_lora_rank required unless the model is a "lite"
 *    one (llama.cpp: 27 or 26 layers), where the query is attn_q directly (V2-Lite); 0 = none;
 *  - attention.key_length_mla / value_length_mla (required here: without them the file is the legacy
 *    unsplit attn_kv_b form, which we do not read); head_count_kv 1, key_length = kv_lora_rank +
 *    rope.dimension_count, value_length = kv_lora_rank (the latent cache row);
 *  - leading_dense_block_count (default 0), expert_shared_count (required), expert_weights_scale
 *    (default 0 = none), expert_weights_norm (default false), expert_gating_func (default softmax: older
 *    V2 files have none), expert_group_count / expert_group_used_count (default 0 = no groups);
 *  - the attention scale is mscale^2 / sqrt(key_length_mla), mscale = 1 + 0.1 * log_mul * ln(factor)
 *    under YaRN (llama.cpp pre-scales kq_scale so), else 1;
 *  - rope: pairs (2i, 2i+1) (llama.cpp's LLAMA_ROPE_TYPE_NORM for deepseek2). */
static kvb_status deepseek2_desc(const kvb_gguf *g, kvb_model_desc *d, uint32_t vlen, kvb_err *err) {
    const char *a = d->arch_name, *path = kvb_gguf_path(g);
    kvb_status st;
    d->mla = true;
    const bool lite = d->n_layer == 27 || d->n_layer == 26;
    if ((st = get_u32_key(g, a, "attention.kv_lora_rank", true, 0, 1, 8192, &d->n_lora_kv, err))) return st;
    if ((st = get_u32_key(g, a, "attention.q_lora_rank", !lite, 0, 0, 65536, &d->n_lora_q, err))) return st;
    if ((st = get_u32_key(g, a, "attention.key_length_mla", true, 0, 2, 1024, &d->head_dim_k_mla, err)))
        return kvb_err_prefix(err, "(the legacy attn_kv_b form is not read) ");
    if ((st = get_u32_key(g, a, "attention.value_length_mla", true, 0, 1, 1024, &d->head_dim_v_mla, err))) return st;
    if (d->n_head_kv != 1 || d->head_dim != d->n_lora_kv + d->n_rot || vlen != d->n_lora_kv)
        return kvb_err_set(err, KVB_ERR_FORMAT,
                           "%s: deepseek2 MLA form needs head_count_kv 1, key_length = kv_lora_rank + rope dims (%u) "
                           "and value_length = kv_lora_rank (%u); the file has %u, %u, %u",
                           path, d->n_lora_kv + d->n_rot, d->n_lora_kv, d->n_head_kv, d->head_dim, vlen);
    if (d->head_dim_k_mla <= d->n_rot)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: key_length_mla %u leaves no non-rotated part beside %u rope dims",
                           path, d->head_dim_k_mla, d->n_rot);
    if ((st = get_u32_key(g, a, "leading_dense_block_count", false, 0, 0, d->n_layer, &d->n_layer_dense_lead, err)))
        return st;
    if ((st = get_u32_key(g, a, "expert_count", true, 0, 1, KVB_MAX_EXPERTS, &d->n_expert, err))) return st;
    if ((st = get_u32_key(g, a, "expert_used_count", true, 0, 1, d->n_expert, &d->n_expert_used, err))) return st;
    if ((st = get_u32_key(g, a, "expert_feed_forward_length", true, 0, 1, 1u << 18, &d->n_ff_exp, err))) return st;
    if ((st = get_u32_key(g, a, "expert_shared_count", true, 0, 0, 64, &d->n_expert_shared, err))) return st;
    d->n_ff_shexp = d->n_ff_exp * d->n_expert_shared; /* llama.cpp's width of ffn_*_shexp; no key for it here */
    if ((st = get_f32_key(g, a, "expert_weights_scale", 0.0f, 0.0f, 1e6f, &d->expert_weights_scale, err))) return st;
    if ((st = get_u32_key(g, a, "expert_gating_func", false, KVB_GATING_SOFTMAX, KVB_GATING_SOFTMAX,
                          KVB_GATING_SIGMOID, &d->expert_gating, err)))
        return st;
    char key[128];
    snprintf(key, sizeof key, "%s.expert_weights_norm", a);
    kvb_err e2 = {0};
    st = kvb_gguf_get_bool(g, key, &d->expert_weights_norm, &e2);
    if (st == KVB_ERR_NOT_FOUND) d->expert_weights_norm = false;
    else if (st) return kvb_err_set(err, st, "%s: %s", path, e2.msg);
    if ((st = get_u32_key(g, a, "expert_group_count", false, 0, 0, d->n_expert, &d->n_expert_groups, err))) return st;
    if ((st = get_u32_key(g, a, "expert_group_used_count", false, 0, 0, d->n_expert, &d->n_group_used, err))) return st;
    if (d->n_expert_groups > 1 &&
        (d->n_expert % d->n_expert_groups || d->n_group_used == 0 || d->n_group_used >= d->n_expert_groups ||
         d->n_expert / d->n_expert_groups < 2 || d->n_group_used * (d->n_expert / d->n_expert_groups) < d->n_expert_used))
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: %u experts in %u groups, %u groups used, top %u: inconsistent",
                           path, d->n_expert, d->n_expert_groups, d->n_group_used, d->n_expert_used);
    d->rope_neox = false;
    float mscale = 1.0f;
    if (d->rope_yarn_factor > 1.0f) mscale = 1.0f + 0.1f * d->rope_yarn_log_mul * logf(d->rope_yarn_factor);
    d->attn_scale = mscale * mscale / sqrtf((float)d->head_dim_k_mla);
    return KVB_OK;
}

/* YaRN keys (rope.scaling.type yarn), as llama.cpp reads them: factor, original_context_length
 * (default: context_length), attn_factor (default 1), yarn_log_multiplier (stored times 0.1 by the
 * converter: divided back), beta_fast / beta_slow at llama.cpp's defaults 32 / 1. */
static kvb_status yarn_desc(const kvb_gguf *g, kvb_model_desc *d, float factor, kvb_err *err) {
    const char *a = d->arch_name;
    kvb_status st;
    if (d->arch != KVB_ARCH_DEEPSEEK2)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: YaRN rope scaling is implemented for deepseek2 only",
                           kvb_gguf_path(g));
    if (factor <= 1.0f) return KVB_OK; /* no scaling */
    d->rope_yarn_factor = factor;
    if ((st = get_u32_key(g, a, "rope.scaling.original_context_length", false, d->n_ctx_train, 1, 1u << 24,
                          &d->rope_orig_ctx, err)))
        return st;
    if ((st = get_f32_key(g, a, "rope.scaling.attn_factor", 1.0f, 0.0f, 1e3f, &d->rope_attn_factor, err))) return st;
    if (d->rope_attn_factor != 1.0f)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: rope.scaling.attn_factor %g: only 1 is implemented",
                           kvb_gguf_path(g), (double)d->rope_attn_factor);
    float lm = 0;
    if ((st = get_f32_key(g, a, "rope.scaling.yarn_log_multiplier", 0.0f, 0.0f, 1e3f, &lm, err))) return st;
    d->rope_yarn_log_mul = lm / 0.1f;
    d->yarn_beta_fast = 32.0f;
    d->yarn_beta_slow = 1.0f;
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
    else if (strcmp(a, "gemma3") == 0) d->arch = KVB_ARCH_GEMMA3;
    else if (strcmp(a, "qwen3moe") == 0) d->arch = KVB_ARCH_QWEN3MOE;
    else if (strcmp(a, "qwen2moe") == 0) d->arch = KVB_ARCH_QWEN2MOE;
    else if (strcmp(a, "deepseek2") == 0) d->arch = KVB_ARCH_DEEPSEEK2;
    else
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%s: architecture '%s' is not supported (supported: llama, qwen2, qwen3, qwen3moe, qwen2moe, "
                           "gemma3, deepseek2)",
                           kvb_gguf_path(g), a);
    if (kvb_gguf_get_str(g, "general.name", d->name, sizeof d->name, NULL) != KVB_OK) d->name[0] = 0;

    const uint32_t big = 1u << 20;
    if ((st = get_u32_key(g, a, "embedding_length", true, 0, 1, 65536, &d->n_embd, err))) return st;
    if ((st = get_u32_key(g, a, "block_count", true, 0, 1, KVB_MAX_LAYERS, &d->n_layer, err))) return st;
    if ((st = get_u32_key(g, a, "feed_forward_length", true, 0, 1, 1u << 18, &d->n_ff, err))) return st;
    if ((st = get_u32_key(g, a, "attention.head_count", true, 0, 1, 1024, &d->n_head, err))) return st;
    if ((st = get_u32_key(g, a, "attention.head_count_kv", false, d->n_head, 1, d->n_head, &d->n_head_kv, err)))
        return st;
    if (d->n_head % d->n_head_kv)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: head_count %u is not a multiple of head_count_kv %u",
                           kvb_gguf_path(g), d->n_head, d->n_head_kv);
    uint32_t dflt_hd = d->n_embd / d->n_head;
    if ((st = get_u32_key(g, a, "attention.key_length", false, dflt_hd, 2, 8192, &d->head_dim, err))) return st;
    uint32_t vlen;
    if ((st = get_u32_key(g, a, "attention.value_length", false, d->head_dim, 1, 8192, &vlen, err))) return st;
    if (vlen != d->head_dim && d->arch != KVB_ARCH_DEEPSEEK2) /* deepseek2: the latent (deepseek2_desc) */
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
    } else if (strcmp(stype, "yarn") == 0) {
        if ((st = yarn_desc(g, d, factor, err))) return st;
    } else if (stype[0] && strcmp(stype, "none") != 0) {
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%s: rope scaling type '%s' is not supported (llama3, linear, yarn (deepseek2), none)",
                           kvb_gguf_path(g), stype);
    }

    d->rope_neox = d->arch != KVB_ARCH_LLAMA;
    d->has_qkv_bias = d->arch == KVB_ARCH_QWEN2 || d->arch == KVB_ARCH_QWEN2MOE;
    d->has_qk_norm = d->arch == KVB_ARCH_QWEN3 || d->arch == KVB_ARCH_GEMMA3 || d->arch == KVB_ARCH_QWEN3MOE;
    d->attn_scale = 1.0f / sqrtf((float)d->head_dim);
    if (d->arch == KVB_ARCH_GEMMA3) return gemma3_desc(g, d, err);
    if (d->arch == KVB_ARCH_QWEN3MOE || d->arch == KVB_ARCH_QWEN2MOE) return moe_desc(g, d, err);
    if (d->arch == KVB_ARCH_DEEPSEEK2) return deepseek2_desc(g, d, vlen, err);
    return KVB_OK;
}

bool kvb_layer_is_dense(const kvb_model_desc *d, uint32_t layer) {
    return d->n_expert == 0 || (d->arch == KVB_ARCH_DEEPSEEK2 && layer < d->n_layer_dense_lead);
}

bool kvb_layer_is_local(const kvb_model_desc *d, uint32_t layer) {
    if (d->swa_window == 0 || layer >= d->n_layer || layer >= KVB_MAX_LAYERS) return false;
    if (d->swa_layers_explicit) return (d->swa_local_mask[layer / 64] >> (layer % 64)) & 1;
    return d->swa_pattern == 0 || layer % d->swa_pattern < d->swa_pattern - 1;
}

bool kvb_model_has_local_layers(const kvb_model_desc *d) {
    for (uint32_t l = 0; l < d->n_layer; l++)
        if (kvb_layer_is_local(d, l)) return true;
    return false;
}

kvb_status kvb_model_kvformat(const kvb_model_desc *d, uint32_t dtype, uint32_t block_tokens, kvb_kvformat *f,
                              kvb_err *err) {
    if (d->mla) return kvb_kvformat_init_mla(f, dtype, block_tokens, d->n_layer, d->n_lora_kv, d->n_rot, err);
    kvb_status st = kvb_kvformat_init(f, dtype, block_tokens, d->n_layer, d->n_head_kv, d->head_dim, err);
    if (st || !kvb_model_has_local_layers(d)) return st;
    bool local[KVB_MAX_LAYERS];
    for (uint32_t l = 0; l < d->n_layer; l++) local[l] = kvb_layer_is_local(d, l);
    return kvb_kvformat_set_window(f, d->swa_window, local, err);
}

/* Latent attention's parameters of one layer (deepseek2). */
static uint64_t mla_attn_params(const kvb_model_desc *d) {
    const uint64_t e = d->n_embd, h = d->n_head, qk = d->head_dim_k_mla, r = d->n_lora_kv, p = d->n_rot;
    uint64_t q = d->n_lora_q ? e * d->n_lora_q + d->n_lora_q + (uint64_t)d->n_lora_q * h * qk : e * h * qk;
    return q + e * (r + p) + r + h * r * (qk - p) + h * d->head_dim_v_mla * r + h * d->head_dim_v_mla * e;
}

/* One MoE layer's MLP with `experts` experts counted: the routed experts, the router, the shared expert
 * and its gate where present (qwen2moe's ffn_gate_inp_shexp). */
static uint64_t n_params_moe_mlp(const kvb_model_desc *d, uint64_t experts) {
    const uint64_t e = d->n_embd;
    uint64_t n = experts * 3 * e * d->n_ff_exp + e * d->n_expert + 3 * e * d->n_ff_shexp;
    return n + (d->arch == KVB_ARCH_QWEN2MOE ? e : 0);
}

/* deepseek2: dense leading layers, then MoE layers with shared experts. */
static uint64_t n_params_deepseek2(const kvb_model_desc *d, uint64_t experts) {
    const uint64_t e = d->n_embd;
    const uint64_t dense = 3 * e * d->n_ff, moe = n_params_moe_mlp(d, experts);
    uint64_t n = 0;
    for (uint32_t l = 0; l < d->n_layer; l++) n += mla_attn_params(d) + 2 * e + (kvb_layer_is_dense(d, l) ? dense : moe);
    return n + e + (uint64_t)d->n_vocab * e;
}

/* Non-embedding parameters with `experts` experts of each MoE layer counted. */
static uint64_t n_params_with(const kvb_model_desc *d, uint64_t experts) {
    if (d->arch == KVB_ARCH_DEEPSEEK2) return n_params_deepseek2(d, experts);
    uint64_t e = d->n_embd, q = (uint64_t)d->n_head * d->head_dim, kv = (uint64_t)d->n_head_kv * d->head_dim;
    uint64_t mlp = d->n_expert ? n_params_moe_mlp(d, experts) : 3 * e * d->n_ff;
    uint64_t per_layer = e * q + 2 * e * kv + q * e + mlp + (d->has_post_norms ? 4 : 2) * e;
    return per_layer * d->n_layer + e + (uint64_t)d->n_vocab * e; /* the output head is a matmul */
}

void kvb_model_cache_token_bytes(const kvb_model_desc *d, uint32_t dtype, uint64_t *cache, uint64_t *per_head) {
    const uint32_t k = d->mla ? d->head_dim_k_mla : d->head_dim, v = d->mla ? d->head_dim_v_mla : d->head_dim;
    const uint64_t heads = d->mla ? d->n_head : d->n_head_kv;
    const uint64_t rows = (uint64_t)kvb_row_bytes(dtype, k) + kvb_row_bytes(dtype, v);
    *per_head = (uint64_t)d->n_layer * heads * rows;
    *cache = d->mla ? (uint64_t)d->n_layer * kvb_row_bytes(dtype, d->head_dim) : *per_head;
}

uint64_t kvb_model_n_params_nonembd(const kvb_model_desc *d) { return n_params_with(d, d->n_expert); }
uint64_t kvb_model_n_params_active(const kvb_model_desc *d) { return n_params_with(d, d->n_expert_used); }
