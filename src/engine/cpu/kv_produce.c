/* engine/cpu/kv_produce.c — the decoder's cache-producing arithmetic (specified in
 * kvb_engine_cpu.h): attention inputs -> K (projected, biased, k-normed, rotated with the layer's
 * own RoPE table) and V rows encoded in the cache dtype; for deepseek2 the latent row (the normed
 * latent and the roped key part, no V). The CPU engine writes its own cache only
 * through this function. */
#include <string.h>

#include "cpu_internal.h"

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t kvb_kv_produce_scratch_bytes(const kvb_model *m, uint32_t n) {
    const kvb_model_desc *d = &m->d;
    size_t kv = (size_t)d->n_head_kv * d->head_dim;
    size_t act = 0; /* the widest quantised activation row any layer's K or V weights take (files mix types) */
    for (uint32_t l = 0; l < d->n_layer; l++) {
        const uint32_t kt = d->mla ? m->layers[l].wkv_a.type : m->layers[l].wk.type;
        const size_t ak = kvb_row_bytes(kvb_act_type(kt), d->n_embd),
                     av = kvb_row_bytes(kvb_act_type(m->layers[l].wv.type), d->n_embd);
        act = KVB_MAX(act, KVB_MAX(ak, av));
    }
    return 2 * align64((size_t)n * kv * sizeof(float)) + align64((size_t)n * act);
}

/* Test-only variant of k = Wk h with the sum split at the middle block: a different association
 * of the same additions. Never used outside verification. */
static void perturbed_k_projection(const kvb_mat *W, const float *h, uint32_t n, float *k, uint8_t *act) {
    const uint32_t at = kvb_act_type(W->type);
    const int64_t half = (W->cols / 2 / 32) * 32;
    const size_t act_stride = kvb_row_bytes(at, W->cols), w_half = kvb_row_bytes(W->type, half),
                 a_half = kvb_row_bytes(at, half);
    for (uint32_t t = 0; t < n; t++) {
        uint8_t *xa = act + (size_t)t * act_stride;
        kvb_quantize_act(W->type, h + (size_t)t * W->cols, xa, W->cols);
        for (int64_t r = 0; r < W->rows; r++) {
            const uint8_t *wr = (const uint8_t *)W->data + (size_t)r * W->row_bytes;
            k[(size_t)t * W->rows + r] =
                kvb_dot(W->type, wr, xa, half) + kvb_dot(W->type, wr + w_half, xa + a_half, W->cols - half);
        }
    }
}

/* deepseek2's latent cache row (kvb_engine_cpu.h): c = W_kv_a h, latent c[0:R] RMS-normed with
 * attn_kv_a_norm, rope part c[R:R+P] rotated (pairs), [latent, k_pe] encoded; rows (n, row_bytes). */
static void mla_produce(const kvb_kv_produce_args *a, const float *h, uint32_t n, void *scratch, uint8_t *rows) {
    const kvb_model_desc *d = &a->m->d;
    const kvb_layer_weights *w = &a->m->layers[a->layer];
    const uint32_t R = d->n_lora_kv, P = d->n_rot, RP = R + P, half = P / 2;
    const size_t row_bytes = kvb_row_bytes(a->cache_dtype, RP);
    float *c = scratch; /* (n, R + P) */
    uint8_t *act = (uint8_t *)scratch + 2 * align64((size_t)n * RP * sizeof(float));
    kvb_cpu_matmul(a->pool, &w->wkv_a, h, n, c, act);
    if (a->test_perturb) perturbed_k_projection(&w->wkv_a, h, n, c, act);
    for (uint32_t t = 0; t < n; t++) {
        float *ct = c + (size_t)t * RP;
        kvb_cpu_rmsnorm(ct, w->kv_a_norm, R, d->norm_eps, ct);
        kvb_cpu_rope(ct + R, P, false, a->rope_cos + (size_t)t * half, a->rope_sin + (size_t)t * half);
        kvb_f32_to_row(a->cache_dtype, ct, rows + (size_t)t * row_bytes, RP);
    }
}

void kvb_kv_produce(const kvb_kv_produce_args *a, const float *h, uint32_t n, void *scratch, uint8_t *k_rows,
                    uint8_t *v_rows) {
    const kvb_model_desc *d = &a->m->d;
    if (d->mla) {
        mla_produce(a, h, n, scratch, k_rows);
        return;
    }
    const kvb_layer_weights *w = &a->m->layers[a->layer];
    const uint32_t hd = d->head_dim, nkv = d->n_head_kv, half = d->n_rot / 2;
    const size_t kvw = (size_t)nkv * hd;
    const size_t row_bytes = kvb_row_bytes(a->cache_dtype, hd);
    float *k = scratch;                                                  /* (n, n_head_kv, head_dim) */
    float *v = (float *)((uint8_t *)scratch + align64((size_t)n * kvw * sizeof(float))); /* same */
    uint8_t *act = (uint8_t *)v + align64((size_t)n * kvw * sizeof(float));

    kvb_cpu_matmul_arith(a->pool, &w->wk, h, n, k, act, a->ggml);
    if (a->test_perturb) perturbed_k_projection(&w->wk, h, n, k, act);
    kvb_cpu_matmul_arith(a->pool, &w->wv, h, n, v, act, a->ggml);
    for (uint32_t t = 0; t < n; t++) {
        float *kt = k + t * kvw, *vt = v + t * kvw;
        if (w->bk)
            for (size_t i = 0; i < kvw; i++) kt[i] = kt[i] + w->bk[i];
        if (w->bv)
            for (size_t i = 0; i < kvw; i++) vt[i] = vt[i] + w->bv[i];
        for (uint32_t hh = 0; hh < nkv; hh++) {
            float *kh = kt + (size_t)hh * hd;
            if (w->k_norm) kvb_cpu_rmsnorm_arith(kh, w->k_norm, hd, d->norm_eps, kh, a->ggml);
            kvb_cpu_rope_arith(kh, d->n_rot, d->rope_neox, a->rope_cos + (size_t)t * half,
                               a->rope_sin + (size_t)t * half, a->ggml);
            kvb_f32_to_row(a->cache_dtype, kh, k_rows + ((size_t)t * nkv + hh) * row_bytes, hd);
            kvb_f32_to_row(a->cache_dtype, vt + (size_t)hh * hd, v_rows + ((size_t)t * nkv + hh) * row_bytes, hd);
        }
    }
}
