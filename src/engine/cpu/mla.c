/* engine/cpu/mla.c — DeepSeek's latent attention (deepseek2) on the CPU, the absorbed form for
 * every token, prefill and decode alike (a token's arithmetic never depends on its chunk, so
 * chunked == one shot and a bridged cache decodes as the decoder's own):
 *  - the cache row (kvb_kv_produce, engine/cpu/kv_produce.c): c = W_kv_a h (R + P), the latent
 *    c[0:R] RMS-normed with attn_kv_a_norm, the key's rope part c[R:R+P] rotated (pairs (2i, 2i+1),
 *    the layer's table, YaRN in its frequencies); [latent, k_pe] encoded in the cache dtype — what
 *    llama.cpp's deepseek2 cache holds (Kcur = concat(kv_cmpr, k_pe));
 *  - the query (kvb_cpu_mla_query): q = W_q_b norm(W_q_a h) (or W_q h), per head q_nope (N) and q_pe
 *    (P, rotated); q_nope absorbed through the key up-projection, q_abs = K_b[h] q_nope (R), so head h's
 *    query against the cache row is [q_abs, q_pe] (R + P): one multi-query attention over the latent
 *    rows (kvb_cpu_attention, the format's single part serving as key and value);
 *  - the output (kvb_cpu_mla_output): the attention's latent part o[0:R] of each head through the
 *    value up-projection V_b[h] (Vd), then W_o.
 * The expanded form (k_nope = K_b^T latent, v = V_b latent per head) is the float64 reference's. */
#include <string.h>

#include "cpu_internal.h"

/* Head h's rows of a stacked per-head matrix (rows_per_head each) as one matrix. */
static kvb_mat head_view(const kvb_mat *stack, uint32_t h, int64_t rows_per_head) {
    kvb_mat v = *stack;
    v.data = (const uint8_t *)stack->data + (size_t)h * (size_t)rows_per_head * stack->row_bytes;
    v.rows = rows_per_head;
    return v;
}

void kvb_cpu_mla_query(kvb_engine *e, uint32_t layer, uint32_t nr, const float *rope_cos, const float *rope_sin) {
    const kvb_model_desc *d = &e->m->d;
    const kvb_layer_weights *w = &e->m->layers[layer];
    const uint32_t H = d->n_head, K = d->head_dim_k_mla, P = d->n_rot, N = K - P, R = d->n_lora_kv, RP = R + P;
    const uint32_t half = P / 2;
    float *q = e->mla_q; /* (nr, H, K) */
    if (w->wq_a.data) {
        const uint32_t QL = d->n_lora_q;
        kvb_cpu_matmul(e->pool, &w->wq_a, e->h, nr, e->mla_t, e->act); /* (nr, QL) */
        for (uint32_t t = 0; t < nr; t++)
            kvb_cpu_rmsnorm(e->mla_t + (size_t)t * QL, w->q_a_norm, QL, d->norm_eps, e->mla_t + (size_t)t * QL);
        kvb_cpu_matmul(e->pool, &w->wq_b, e->mla_t, nr, q, e->act);
    } else {
        kvb_cpu_matmul(e->pool, &w->wq, e->h, nr, q, e->act);
    }
    for (uint32_t hh = 0; hh < H; hh++) {
        /* q_abs = K_b[h] q_nope: (nr, N) gathered, through head h's (R, N) rows, into e->q's latent part */
        for (uint32_t t = 0; t < nr; t++)
            memcpy(e->mla_t + (size_t)t * N, q + ((size_t)t * H + hh) * K, sizeof(float) * N);
        const kvb_mat kb = head_view(&w->wk_b, hh, R);
        kvb_cpu_matmul(e->pool, &kb, e->mla_t, nr, e->mla_u, e->act); /* (nr, R) */
        for (uint32_t t = 0; t < nr; t++) {
            float *qc = e->q + ((size_t)t * H + hh) * RP; /* (R + P) the head's query against the cache row */
            memcpy(qc, e->mla_u + (size_t)t * R, sizeof(float) * R);
            memcpy(qc + R, q + ((size_t)t * H + hh) * K + N, sizeof(float) * P);
            kvb_cpu_rope(qc + R, P, false, rope_cos + (size_t)t * half, rope_sin + (size_t)t * half);
        }
    }
}

void kvb_cpu_mla_output(kvb_engine *e, uint32_t layer, uint32_t nr) {
    const kvb_model_desc *d = &e->m->d;
    const kvb_layer_weights *w = &e->m->layers[layer];
    const uint32_t H = d->n_head, P = d->n_rot, R = d->n_lora_kv, RP = R + P, Vd = d->head_dim_v_mla;
    for (uint32_t hh = 0; hh < H; hh++) {
        for (uint32_t t = 0; t < nr; t++) /* the head's attention over the latent: o[0:R] */
            memcpy(e->mla_t + (size_t)t * R, e->att + ((size_t)t * H + hh) * RP, sizeof(float) * R);
        const kvb_mat vb = head_view(&w->wv_b, hh, Vd);
        kvb_cpu_matmul(e->pool, &vb, e->mla_t, nr, e->mla_u, e->act); /* (nr, Vd) */
        for (uint32_t t = 0; t < nr; t++)
            memcpy(e->mla_o + ((size_t)t * H + hh) * Vd, e->mla_u + (size_t)t * Vd, sizeof(float) * Vd);
    }
    kvb_cpu_matmul(e->pool, &w->wo, e->mla_o, nr, e->h, e->act); /* h := attention output (nr, E) */
}
