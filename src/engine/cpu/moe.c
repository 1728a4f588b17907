/* engine/cpu/moe.c — the mixture-of-experts MLP (qwen3moe, qwen2moe) of a chunk of tokens: the router's
 * logits (ffn_gate_inp . h), a softmax over every expert in f32, the top n_expert_used
 * (largest first, the lower expert index on a tie), their probabilities divided by their sum when
 * the model renormalises; then the tokens grouped by expert, so each routed expert's gate, up and
 * down rows are read once per chunk (a decode step reads only its token's experts), each group
 * through the engine's matmul (every weight type it has) on views of the stacked expert tensors,
 * SwiGLU as the dense MLP computes it; last, each token's outputs summed in rank order, weighted.
 * Every token's arithmetic is its own (the matmul computes each row alone, the sum's order is the
 * token's ranks), so a chunk, a decode step and a decode batch give one token the same bits. qwen2moe
 * adds a shared expert every token runs (a SwiGLU MLP of n_ff_shexp), scaled by the sigmoid of its own
 * gate's logit, after the routed experts' sum. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

typedef struct {
    kvb_engine *e;
    uint32_t nr;
} moe_job;

/* Token t's routing: probabilities over all experts, the top k, their weights. */
static void route_task(void *ctx, int t, int worker) {
    (void)worker;
    const moe_job *j = ctx;
    kvb_engine *e = j->e;
    const kvb_model_desc *d = &e->m->d;
    const uint32_t X = d->n_expert, K = d->n_expert_used;
    float *p = e->moe_logits + (size_t)t * X; /* (n_expert) logits, then probabilities */
    float mx = p[0];
    for (uint32_t x = 1; x < X; x++) mx = p[x] > mx ? p[x] : mx;
    float sum = 0.0f;
    for (uint32_t x = 0; x < X; x++) {
        p[x] = expf(p[x] - mx);
        sum += p[x];
    }
    for (uint32_t x = 0; x < X; x++) p[x] = p[x] / sum;
    uint32_t *sel = e->moe_sel + (size_t)t * K;
    float *wt = e->moe_w + (size_t)t * K, wsum = 0.0f;
    for (uint32_t k = 0; k < K; k++) {
        uint32_t best = UINT32_MAX;
        for (uint32_t x = 0; x < X; x++) {
            bool taken = false;
            for (uint32_t i = 0; i < k; i++) taken |= sel[i] == x;
            if (!taken && (best == UINT32_MAX || p[x] > p[best])) best = x;
        }
        sel[k] = best;
        wt[k] = p[best];
        wsum += wt[k];
    }
    if (d->expert_weights_norm)
        for (uint32_t k = 0; k < K; k++) wt[k] = wt[k] / wsum;
}

/* Token t's output: the sum over its ranks k of w[k] * (expert sel[k]'s output), in rank order; then,
 * with a shared expert (qwen2moe), + sigmoid(its gate logit) * its output. */
static void combine_task(void *ctx, int t, int worker) {
    (void)worker;
    const moe_job *j = ctx;
    kvb_engine *e = j->e;
    const uint32_t E = e->m->d.n_embd, K = e->m->d.n_expert_used;
    float *out = e->h + (size_t)t * E;
    const float *wt = e->moe_w + (size_t)t * K;
    for (uint32_t k = 0; k < K; k++) {
        const float *y = e->moe_y + ((size_t)t * K + k) * E;
        if (k == 0)
            for (uint32_t i = 0; i < E; i++) out[i] = wt[0] * y[i];
        else
            for (uint32_t i = 0; i < E; i++) out[i] = out[i] + wt[k] * y[i];
    }
    if (!e->m->d.n_ff_shexp) return;
    const float gate = 1.0f / (1.0f + expf(-e->moe_logits[t])), *sh = e->moe_x + (size_t)t * E;
    for (uint32_t i = 0; i < E; i++) out[i] = out[i] + gate * sh[i];
}

/* qwen2moe's shared expert on all nr tokens of h: its SwiGLU MLP's outputs into moe_x (nr, n_embd), its
 * gate's logits into moe_logits (nr) (the routing has read them by then). */
static void run_shared_expert(kvb_engine *e, const kvb_layer_weights *w, uint32_t nr) {
    const size_t n = (size_t)nr * e->m->d.n_ff_shexp;
    kvb_cpu_matmul(e->pool, &w->gate_inp_shexp, e->h, nr, e->moe_logits, e->act); /* (nr, 1) */
    kvb_cpu_matmul(e->pool, &w->gate_shexp, e->h, nr, e->moe_g, e->act);          /* (nr, S) */
    kvb_cpu_matmul(e->pool, &w->up_shexp, e->h, nr, e->moe_u, e->act);
    for (size_t i = 0; i < n; i++) {
        const float a = e->moe_g[i];
        e->moe_g[i] = (a / (1.0f + expf(-a))) * e->moe_u[i];
    }
    kvb_cpu_matmul(e->pool, &w->down_shexp, e->moe_g, nr, e->moe_x, e->act); /* (nr, E) */
}

/* Rows [expert * rows, (expert + 1) * rows) of a stacked expert tensor as one matrix. */
static kvb_mat expert_view(const kvb_mat *stack, uint32_t expert, int64_t rows) {
    kvb_mat v = *stack;
    v.data = (const uint8_t *)stack->data + (size_t)expert * (size_t)rows * stack->row_bytes;
    v.rows = rows;
    return v;
}

/* Expert x's SwiGLU MLP on its n tokens' slots (token * K + rank), outputs into moe_y by slot. */
static void run_expert(kvb_engine *e, const kvb_layer_weights *w, uint32_t x, const uint32_t *slots, uint32_t n) {
    const kvb_model_desc *d = &e->m->d;
    const uint32_t E = d->n_embd, F = d->n_ff_exp, K = d->n_expert_used;
    for (uint32_t i = 0; i < n; i++) /* gather: moe_x (n, E) */
        memcpy(e->moe_x + (size_t)i * E, e->h + (size_t)(slots[i] / K) * E, sizeof(float) * E);
    const kvb_mat gate = expert_view(&w->gate_exps, x, F), up = expert_view(&w->up_exps, x, F),
                  down = expert_view(&w->down_exps, x, E);
    kvb_cpu_matmul(e->pool, &gate, e->moe_x, n, e->moe_g, e->act); /* (n, F) */
    kvb_cpu_matmul(e->pool, &up, e->moe_x, n, e->moe_u, e->act);
    for (size_t i = 0; i < (size_t)n * F; i++) {
        const float a = e->moe_g[i];
        e->moe_g[i] = (a / (1.0f + expf(-a))) * e->moe_u[i];
    }
    kvb_cpu_matmul(e->pool, &down, e->moe_g, n, e->moe_x, e->act); /* moe_x := (n, E) expert output */
    for (uint32_t i = 0; i < n; i++)
        memcpy(e->moe_y + (size_t)slots[i] * E, e->moe_x + (size_t)i * E, sizeof(float) * E);
}

void kvb_cpu_moe(kvb_engine *e, const kvb_layer_weights *w, uint32_t nr, kvb_pool *tok_pool) {
    const kvb_model_desc *d = &e->m->d;
    const uint32_t X = d->n_expert, K = d->n_expert_used;
    moe_job j = {e, nr};
    kvb_cpu_matmul(e->pool, &w->ffn_gate_inp, e->h, nr, e->moe_logits, e->act); /* (nr, n_expert) */
    kvb_pool_parallel_for(tok_pool, (int)nr, route_task, &j);
    /* group the (token, rank) slots by expert, tokens ascending: a counting sort */
    uint32_t *off = e->moe_off; /* (n_expert + 1) */
    memset(off, 0, sizeof(uint32_t) * (X + 1));
    for (size_t s = 0; s < (size_t)nr * K; s++) off[e->moe_sel[s] + 1]++;
    for (uint32_t x = 0; x < X; x++) off[x + 1] += off[x];
    for (uint32_t x = 0; x <= X; x++) e->moe_fill[x] = off[x];
    for (uint32_t s = 0; s < nr * K; s++) e->moe_slot[e->moe_fill[e->moe_sel[s]]++] = s;
    for (uint32_t x = 0; x < X; x++)
        if (off[x + 1] > off[x]) run_expert(e, w, x, e->moe_slot + off[x], off[x + 1] - off[x]);
    if (d->n_ff_shexp) run_shared_expert(e, w, nr);
    kvb_pool_parallel_for(tok_pool, (int)nr, combine_task, &j);
}
