/* model/load.c — binds a GGUF's tensors to the architecture: every expected tensor must be
 * present with the expected dims and a supported type; vectors (norms, biases) are made f32;
 * a mixture of experts' stacked expert tensors are bound as one matrix each; the model fingerprint hashes the description (every field, the gemma3 window, layer pattern,
 * local RoPE base and scales included) and each tensor's name, type, dims and bytes (sampled) so
 * two nodes can tell whether they hold the same model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_model.h"
#include "kvb_quant.h"

typedef struct {
    kvb_model *m;
    size_t f32_used, f32_cap;
} binder;

static kvb_status find_tensor(const kvb_gguf *g, const char *name, bool required, const kvb_gguf_tensor **out,
                              kvb_err *err) {
    *out = kvb_gguf_find_tensor(g, name);
    if (!*out && required)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: tensor '%s' is missing (required by architecture)",
                           kvb_gguf_path(g), name);
    return KVB_OK;
}

/* t must be [ne0, ne1] (ne2 == 1: a matrix or, ne1 == 1, a vector) or [ne0, ne1, ne2] (a stack). */
static kvb_status check_dims(const kvb_gguf *g, const kvb_gguf_tensor *t, uint64_t ne0, uint64_t ne1, uint64_t ne2,
                             kvb_err *err) {
    uint32_t want_min = ne2 > 1 ? 3 : ne1 > 1 ? 2 : 1, want_max = ne2 > 1 ? 3 : 2;
    bool ok = t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2 && t->ne[3] == 1 && t->n_dims <= want_max &&
              t->n_dims >= want_min;
    if (ok) return KVB_OK;
    char third[32] = "";
    if (ne2 > 1) snprintf(third, sizeof third, ", %llu", (unsigned long long)ne2);
    return kvb_err_set(err, KVB_ERR_FORMAT,
                       "%s: tensor '%.*s' has dims [%llu, %llu, %llu, %llu], expected [%llu, %llu%s] for this architecture",
                       kvb_gguf_path(g), (int)t->name.len, t->name.ptr, (unsigned long long)t->ne[0],
                       (unsigned long long)t->ne[1], (unsigned long long)t->ne[2], (unsigned long long)t->ne[3],
                       (unsigned long long)ne0, (unsigned long long)ne1, third);
}

/* A matrix (n_stack == 1) or ggml's stack of n_stack matrices [cols, rows, n_stack], bound as one
 * (n_stack * rows, cols) matrix: row r of matrix k is row k * rows + r. */
static kvb_status bind_stack(binder *b, const char *name, uint64_t cols, uint64_t rows, uint64_t n_stack,
                             bool required, kvb_mat *out, kvb_err *err) {
    const kvb_gguf *g = b->m->gguf;
    const kvb_gguf_tensor *t;
    kvb_status st = find_tensor(g, name, required, &t, err);
    memset(out, 0, sizeof *out);
    if (st || !t) return st;
    if ((st = check_dims(g, t, cols, rows, n_stack, err))) return st;
    const kvb_type_info *ti = kvb_type_get(t->type);
    if (!ti || !ti->supported) {
        char names[256] = ""; /* the types quant computes with, from its table */
        for (uint32_t ty = 0; ty < KVB_TYPE_COUNT_; ty++) {
            const kvb_type_info *tj = kvb_type_get(ty);
            if (!tj || !tj->supported) continue;
            size_t used = strlen(names);
            snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", tj->name);
        }
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%s: tensor '%s' has type %s, which this engine does not compute with yet (supported: %s)",
                           kvb_gguf_path(g), name, kvb_type_name(t->type), names);
    }
    out->data = t->data;
    out->type = t->type;
    out->cols = (int64_t)cols;
    out->rows = (int64_t)(rows * n_stack);
    out->row_bytes = kvb_row_bytes(t->type, (int64_t)cols);
    return KVB_OK;
}

static kvb_status bind_mat(binder *b, const char *name, uint64_t cols, uint64_t rows, bool required, kvb_mat *out,
                           kvb_err *err) {
    return bind_stack(b, name, cols, rows, 1, required, out, err);
}

/* A 1-D vector made f32 (converted into the model's owned buffer when stored otherwise). */
static kvb_status bind_vec(binder *b, const char *name, uint64_t n, bool required, const float **out,
                           kvb_err *err) {
    const kvb_gguf *g = b->m->gguf;
    const kvb_gguf_tensor *t;
    *out = NULL;
    kvb_status st = find_tensor(g, name, required, &t, err);
    if (st || !t) return st;
    if ((st = check_dims(g, t, n, 1, 1, err))) return st;
    if (t->type == KVB_TYPE_F32 && ((uintptr_t)t->data % 4) == 0) {
        *out = t->data;
        return KVB_OK;
    }
    const kvb_type_info *ti = kvb_type_get(t->type);
    if (!ti || !ti->supported || b->f32_used + n > b->f32_cap)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: vector '%s' has unsupported type %s", kvb_gguf_path(g),
                           name, kvb_type_name(t->type));
    float *dst = b->m->owned_f32 + b->f32_used;
    kvb_row_to_f32(t->type, t->data, dst, (int64_t)n);
    b->f32_used += n;
    *out = dst;
    return KVB_OK;
}

/* Layer l's shared expert (n_ff_shexp > 0: qwen2moe, deepseek2), llama.cpp's names and ggml's shapes:
 * ffn_gate_shexp / ffn_up_shexp [n_embd, S], ffn_down_shexp [S, n_embd], S = n_ff_shexp; qwen2moe's
 * sigmoid gate ffn_gate_inp_shexp [n_embd] (one row; deepseek2 has none). */
static kvb_status bind_shexp(binder *b, uint32_t l, kvb_layer_weights *w, kvb_err *err) {
    const kvb_model_desc *d = &b->m->d;
    const uint64_t E = d->n_embd, S = d->n_ff_shexp;
    char name[96];
    kvb_status st;
    if (S == 0) return KVB_OK;
#define L_NAME(fmt) (snprintf(name, sizeof name, "blk.%u." fmt, l), name)
    if (d->arch == KVB_ARCH_QWEN2MOE &&
        (st = bind_mat(b, L_NAME("ffn_gate_inp_shexp.weight"), E, 1, true, &w->gate_inp_shexp, err)))
        return st;
    if ((st = bind_mat(b, L_NAME("ffn_gate_shexp.weight"), E, S, true, &w->gate_shexp, err))) return st;
    if ((st = bind_mat(b, L_NAME("ffn_up_shexp.weight"), E, S, true, &w->up_shexp, err))) return st;
    return bind_mat(b, L_NAME("ffn_down_shexp.weight"), S, E, true, &w->down_shexp, err);
#undef L_NAME
}

/* Layer l's mixture of experts, with llama.cpp's names and ggml's shapes: the router
 * ffn_gate_inp [n_embd, n_expert] and the stacks ffn_gate_exps / ffn_up_exps
 * [n_embd, n_ff_exp, n_expert] and ffn_down_exps [n_ff_exp, n_embd, n_expert]; deepseek2's optional
 * selection bias exp_probs_b.bias [n_expert]; the shared expert (bind_shexp). */
static kvb_status bind_moe(binder *b, uint32_t l, kvb_layer_weights *w, kvb_err *err) {
    const kvb_model_desc *d = &b->m->d;
    const uint64_t E = d->n_embd, F = d->n_ff_exp, X = d->n_expert;
    char name[96];
    kvb_status st;
    snprintf(name, sizeof name, "blk.%u.ffn_gate_inp.weight", l);
    if ((st = bind_mat(b, name, E, X, true, &w->ffn_gate_inp, err))) return st;
    snprintf(name, sizeof name, "blk.%u.ffn_gate_exps.weight", l);
    if ((st = bind_stack(b, name, E, F, X, true, &w->gate_exps, err))) return st;
    snprintf(name, sizeof name, "blk.%u.ffn_up_exps.weight", l);
    if ((st = bind_stack(b, name, E, F, X, true, &w->up_exps, err))) return st;
    snprintf(name, sizeof name, "blk.%u.ffn_down_exps.weight", l);
    if ((st = bind_stack(b, name, F, E, X, true, &w->down_exps, err))) return st;
    snprintf(name, sizeof name, "blk.%u.exp_probs_b.bias", l); /* deepseek2's selection bias (V3), optional */
    if (d->arch == KVB_ARCH_DEEPSEEK2 && (st = bind_vec(b, name, X, false, &w->exp_probs_b, err))) return st;
    return bind_shexp(b, l, w, err);
}

/* Layer l's latent attention (deepseek2, MLA form) with llama.cpp's names and ggml's shapes:
 * attn_q_a [E, q_lora] + attn_q_a_norm [q_lora] + attn_q_b [q_lora, H*K] (or attn_q [E, H*K] without
 * q_lora), attn_kv_a_mqa [E, R+P], attn_kv_a_norm [R], the split up-projections attn_k_b [N, R, H]
 * and attn_v_b [R, Vd, H], attn_output [H*Vd, E]; K = key_length_mla, N = K - P. */
static kvb_status bind_mla(binder *b, uint32_t l, kvb_layer_weights *w, kvb_err *err) {
    const kvb_model_desc *d = &b->m->d;
    const uint64_t E = d->n_embd, H = d->n_head, K = d->head_dim_k_mla, R = d->n_lora_kv, P = d->n_rot;
    const uint64_t N = K - P, Vd = d->head_dim_v_mla;
    char name[96];
    kvb_status st;
#define L_NAME(fmt) (snprintf(name, sizeof name, "blk.%u." fmt, l), name)
    if (d->n_lora_q) {
        if ((st = bind_mat(b, L_NAME("attn_q_a.weight"), E, d->n_lora_q, true, &w->wq_a, err))) return st;
        if ((st = bind_vec(b, L_NAME("attn_q_a_norm.weight"), d->n_lora_q, true, &w->q_a_norm, err))) return st;
        if ((st = bind_mat(b, L_NAME("attn_q_b.weight"), d->n_lora_q, H * K, true, &w->wq_b, err))) return st;
    } else if ((st = bind_mat(b, L_NAME("attn_q.weight"), E, H * K, true, &w->wq, err))) {
        return st;
    }
    if ((st = bind_mat(b, L_NAME("attn_kv_a_mqa.weight"), E, R + P, true, &w->wkv_a, err))) return st;
    if ((st = bind_vec(b, L_NAME("attn_kv_a_norm.weight"), R, true, &w->kv_a_norm, err))) return st;
    if ((st = bind_stack(b, L_NAME("attn_k_b.weight"), N, R, H, true, &w->wk_b, err))) return st;
    if ((st = bind_stack(b, L_NAME("attn_v_b.weight"), R, Vd, H, true, &w->wv_b, err))) return st;
    return bind_mat(b, L_NAME("attn_output.weight"), H * Vd, E, true, &w->wo, err);
#undef L_NAME
}

static kvb_status bind_attn(binder *b, uint32_t l, kvb_layer_weights *w, kvb_err *err);

static uint64_t fingerprint(const kvb_model *m) {
    const kvb_model_desc *d = &m->d; /* zeroed before it was filled: padding bytes hash as zeros */
    uint64_t h = kvb_hash64(d, sizeof *d, 0x6b76622d6d6f646cULL);
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(m->gguf); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(m->gguf, i);
        h = kvb_hash64(t->name.ptr, t->name.len, h);
        h = kvb_hash64(t->ne, sizeof t->ne, h ^ t->type);
        /* Hash up to 64 KiB from the start and end of each tensor: weights differ everywhere
         * when models differ, and this keeps loading an 8B model fast. */
        size_t n = t->n_bytes < 65536 ? t->n_bytes : 65536;
        h = kvb_hash64(t->data, n, h);
        h = kvb_hash64((const char *)t->data + (t->n_bytes - n), n, h);
    }
    return h;
}

kvb_status kvb_model_load(const char *path, kvb_model **out, kvb_err *err) {
    *out = NULL;
    kvb_model *m = calloc(1, sizeof *m);
    if (!m) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory loading %s", path);
    kvb_status st = kvb_gguf_open(path, &m->gguf, err);
    if (st) goto fail;
    if ((st = kvb_model_desc_from_gguf(m->gguf, &m->d, err))) goto fail;
    kvb_model_desc *d = &m->d;
    const kvb_gguf *g = m->gguf;

    const kvb_gguf_tensor *emb = kvb_gguf_find_tensor(g, "token_embd.weight");
    if (!emb) {
        st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: tensor 'token_embd.weight' is missing", path);
        goto fail;
    }
    if (emb->ne[1] < 2 || emb->ne[1] > (1u << 22)) {
        st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: token_embd.weight has an implausible vocabulary size %llu", path,
                         (unsigned long long)emb->ne[1]);
        goto fail;
    }
    d->n_vocab = (uint32_t)emb->ne[1];

    binder b = {.m = m};
    const uint64_t E = d->n_embd, Q = (uint64_t)d->n_head * d->head_dim, KV = (uint64_t)d->n_head_kv * d->head_dim;
    /* per layer: attn/ffn norms (+ gemma3's two post norms), q/k/v biases, q/k norms; plus the output norm
     * and rope_freqs */
    b.f32_cap = E * (4 * (size_t)d->n_layer + 1) + (size_t)d->n_layer * (Q + 2 * KV + 2 * d->head_dim) + d->n_rot +
                (size_t)d->n_layer * ((size_t)d->n_lora_q + d->n_lora_kv + d->n_expert); /* deepseek2's */
    m->owned_f32 = calloc(b.f32_cap, sizeof(float));
    m->layers = calloc(d->n_layer, sizeof *m->layers);
    if (!m->owned_f32 || !m->layers) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory loading %s", path);
        goto fail;
    }
    if ((st = bind_mat(&b, "token_embd.weight", E, d->n_vocab, true, &m->tok_embd, err))) goto fail;
    if ((st = bind_vec(&b, "output_norm.weight", E, true, &m->output_norm, err))) goto fail;
    if ((st = bind_mat(&b, "output.weight", E, d->n_vocab, false, &m->output, err))) goto fail;
    d->tied_output = m->output.data == NULL;
    if (d->tied_output) m->output = m->tok_embd;
    if ((st = bind_vec(&b, "rope_freqs.weight", d->n_rot / 2, false, &m->rope_freqs, err))) goto fail;

    char name[96];
#define L_NAME(fmt) (snprintf(name, sizeof name, "blk.%u." fmt, l), name)
    for (uint32_t l = 0; l < d->n_layer; l++) {
        kvb_layer_weights *w = &m->layers[l];
        if ((st = bind_vec(&b, L_NAME("attn_norm.weight"), E, true, &w->attn_norm, err))) goto fail;
        if (d->mla) {
            if ((st = bind_mla(&b, l, w, err))) goto fail;
        } else if ((st = bind_attn(&b, l, w, err))) {
            goto fail;
        }
        if ((st = bind_vec(&b, L_NAME("ffn_norm.weight"), E, true, &w->ffn_norm, err))) goto fail;
        if (!kvb_layer_is_dense(d, l)) {
            if ((st = bind_moe(&b, l, w, err))) goto fail;
            continue;
        }
        if ((st = bind_mat(&b, L_NAME("ffn_gate.weight"), E, d->n_ff, true, &w->w_gate, err))) goto fail;
        if ((st = bind_mat(&b, L_NAME("ffn_up.weight"), E, d->n_ff, true, &w->w_up, err))) goto fail;
        if ((st = bind_mat(&b, L_NAME("ffn_down.weight"), d->n_ff, E, true, &w->w_down, err))) goto fail;
    }
#undef L_NAME
    m->fingerprint = fingerprint(m);
    *out = m;
    return KVB_OK;
fail:
    kvb_model_free(m);
    return st;
}

/* Layer l's per-head attention (every architecture but deepseek2): q/k/v/output, qwen2's biases, the
 * q/k norms, gemma3's post norms. */
static kvb_status bind_attn(binder *b, uint32_t l, kvb_layer_weights *w, kvb_err *err) {
    const kvb_model_desc *d = &b->m->d;
    const uint64_t E = d->n_embd, Q = (uint64_t)d->n_head * d->head_dim, KV = (uint64_t)d->n_head_kv * d->head_dim;
    char name[96];
    kvb_status st;
#define L_NAME(fmt) (snprintf(name, sizeof name, "blk.%u." fmt, l), name)
    if ((st = bind_mat(b, L_NAME("attn_q.weight"), E, Q, true, &w->wq, err))) return st;
    if ((st = bind_mat(b, L_NAME("attn_k.weight"), E, KV, true, &w->wk, err))) return st;
    if ((st = bind_mat(b, L_NAME("attn_v.weight"), E, KV, true, &w->wv, err))) return st;
    if ((st = bind_mat(b, L_NAME("attn_output.weight"), Q, E, true, &w->wo, err))) return st;
    if (d->has_qkv_bias) {
        if ((st = bind_vec(b, L_NAME("attn_q.bias"), Q, true, &w->bq, err))) return st;
        if ((st = bind_vec(b, L_NAME("attn_k.bias"), KV, true, &w->bk, err))) return st;
        if ((st = bind_vec(b, L_NAME("attn_v.bias"), KV, true, &w->bv, err))) return st;
    }
    if (d->has_qk_norm) {
        if ((st = bind_vec(b, L_NAME("attn_q_norm.weight"), d->head_dim, true, &w->q_norm, err))) return st;
        if ((st = bind_vec(b, L_NAME("attn_k_norm.weight"), d->head_dim, true, &w->k_norm, err))) return st;
    }
    if (d->has_post_norms) {
        if ((st = bind_vec(b, L_NAME("post_attention_norm.weight"), E, true, &w->post_attn_norm, err))) return st;
        if ((st = bind_vec(b, L_NAME("post_ffw_norm.weight"), E, true, &w->post_ffw_norm, err))) return st;
    }
#undef L_NAME
    return KVB_OK;
}

void kvb_model_free(kvb_model *m) {
    if (!m) return;
    kvb_gguf_close(m->gguf);
    free(m->owned_f32);
    free(m->layers);
    free(m);
}

void kvb_model_describe(const kvb_model *m, char *buf, size_t cap) {
    const kvb_model_desc *d = &m->d;
    /* non-embedding parameters count the output head; an untied model also has its embedding */
    uint64_t p = kvb_model_n_params_nonembd(d) + (d->tied_output ? 0 : (uint64_t)d->n_vocab * d->n_embd);
    char local[192] = "";
    uint32_t n_local = 0;
    for (uint32_t l = 0; l < d->n_layer; l++) n_local += kvb_layer_is_local(d, l);
    if (n_local)
        snprintf(local, sizeof local, " (%u local: window %u, rope base %g)", n_local, d->swa_window,
                 (double)d->rope_freq_base_local);
    if (d->n_expert) /* ff is then the expert's, and the parameter count is every expert's */
        snprintf(local, sizeof local, ", %u experts (top %u%s%s, active %.3g M/token)", d->n_expert, d->n_expert_used,
                 d->expert_weights_norm ? ", renormalised" : "",
                 d->arch == KVB_ARCH_QWEN2MOE ? ", + a shared expert" : "", kvb_model_n_params_active(d) / 1e6);
    if (d->mla) { /* heads are then the query heads x the latent cache row */
        size_t u = strlen(local);
        snprintf(local + u, sizeof local - u, ", %u dense first, %u shared, MLA latent %u + rope %u, q_lora %u",
                 d->n_layer_dense_lead, d->n_expert_shared, d->n_lora_kv, d->n_rot, d->n_lora_q);
    }
    snprintf(buf, cap, "%s%s%s: %u layers%s, embd %u, heads %u/%u x %u, ff %u, vocab %u, %s weights, %.3g%s params",
             d->arch_name, d->name[0] ? " " : "", d->name, d->n_layer, local, d->n_embd, d->n_head, d->n_head_kv,
             d->head_dim, d->n_expert ? d->n_ff_exp : d->n_ff, d->n_vocab, kvb_type_name(m->layers[0].wo.type), p >= 1000000000 ? p / 1e9 : p / 1e6,
             p >= 1000000000 ? " B" : " M");
}
