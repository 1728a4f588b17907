/* engine/cpu/moe.c — the mixture-of-experts MLP (qwen3moe, qwen2moe, deepseek2) of a chunk of tokens:
 * the router's logits (ffn_gate_inp . h), a softmax (or deepseek2's sigmoid) over every expert in f32,
 * the top n_expert_used by selection score (largest first, the lower expert index on a tie; the
 * score is the probability plus V3's selection bias, over the best groups only where the model
 * groups experts), their probabilities divided by their sum when the model renormalises and
 * scaled when it says so; then the tokens grouped by expert, so each routed expert's gate, up and
 * down rows are read once per chunk (a decode step reads only its token's experts), every active
 * expert's tiles in one parallel pass for gate and up and one for down (a decode step is two
 * hand-offs to the pool, not three per expert), through the engine's tile kernel (every weight type
 * it has) on views of the stacked expert tensors, SwiGLU as the dense MLP computes it; last, each
 * token's outputs summed in rank order, weighted.
 * Every token's arithmetic is its own (the matmul computes each row alone, the sum's order is the
 * token's ranks), so a chunk, a decode step and a decode batch give one token the same bits.
 * The shared expert (qwen2moe, deepseek2: one SwiGLU of n_ff_shexp every token runs) is added to the
 * routed sum last, scaled by the sigmoid of its gate's logit where the layer has that gate (qwen2moe). */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

typedef struct {
    kvb_engine *e;
    uint32_t nr;
    const float *bias; /* (n_expert) the layer's selection bias (deepseek2 V3), or NULL */
    bool shared;       /* sh_y holds the shared expert's output, added last */
    bool gated;        /* ... scaled by sigmoid(sh_gate) (qwen2moe) */
} moe_job;

/* The n_group_used groups of experts with the largest scores (each group's two best experts'
 * scores summed, largest first, the lower group on a tie); every expert of the other groups gets
 * -inf (llama.cpp's group-limited routing for deepseek2, DeepSeek-V3's). sel: (n_expert) scores. */
static void keep_best_groups(const kvb_model_desc *d, float *sel) {
    const uint32_t G = d->n_expert_groups, per = d->n_expert / G;
    float gs[KVB_MAX_EXPERTS];
    bool keep[KVB_MAX_EXPERTS];
    for (uint32_t g = 0; g < G; g++) {
        const float *s = sel + (size_t)g * per;
        uint32_t a = 0, b = UINT32_MAX;
        for (uint32_t i = 1; i < per; i++)
            if (s[i] > s[a]) a = i;
        for (uint32_t i = 0; i < per; i++)
            if (i != a && (b == UINT32_MAX || s[i] > s[b])) b = i;
        gs[g] = s[a] + s[b];
        keep[g] = false;
    }
    for (uint32_t k = 0; k < d->n_group_used; k++) {
        uint32_t best = UINT32_MAX;
        for (uint32_t g = 0; g < G; g++)
            if (!keep[g] && (best == UINT32_MAX || gs[g] > gs[best])) best = g;
        keep[best] = true;
    }
    for (uint32_t g = 0; g < G; g++)
        if (!keep[g])
            for (uint32_t i = 0; i < per; i++) sel[(size_t)g * per + i] = -INFINITY;
}

/* Token t's routing: probabilities over all experts (softmax, or deepseek2's sigmoid), the top k by
 * selection score (the probability plus the layer's selection bias when it has one, the best groups
 * only when the model groups its experts), their unbiased probabilities as weights, divided by their
 * sum (clamped below at 2^-14, as llama.cpp does) when the model renormalises, times the model's
 * scale when it has one. */
static void route_task(void *ctx, int t, int worker) {
    (void)worker;
    const moe_job *j = ctx;
    kvb_engine *e = j->e;
    const kvb_model_desc *d = &e->m->d;
    const uint32_t X = d->n_expert, K = d->n_expert_used;
    float *p = e->moe_logits + (size_t)t * X; /* (n_expert) logits, then probabilities */
    if (d->expert_gating == KVB_GATING_SIGMOID) {
        for (uint32_t x = 0; x < X; x++) p[x] = 1.0f / (1.0f + expf(-p[x]));
    } else {
        float mx = p[0];
        for (uint32_t x = 1; x < X; x++) mx = p[x] > mx ? p[x] : mx;
        float sum = 0.0f;
        for (uint32_t x = 0; x < X; x++) {
            p[x] = expf(p[x] - mx);
            sum += p[x];
        }
        for (uint32_t x = 0; x < X; x++) p[x] = p[x] / sum;
    }
    float sc[KVB_MAX_EXPERTS]; /* selection scores */
    for (uint32_t x = 0; x < X; x++) sc[x] = j->bias ? p[x] + j->bias[x] : p[x];
    if (d->n_expert_groups > 1) keep_best_groups(d, sc);
    uint32_t *sel = e->moe_sel + (size_t)t * K;
    float *wt = e->moe_w + (size_t)t * K, wsum = 0.0f;
    for (uint32_t k = 0; k < K; k++) {
        uint32_t best = UINT32_MAX;
        for (uint32_t x = 0; x < X; x++) {
            bool taken = false;
            for (uint32_t i = 0; i < k; i++) taken |= sel[i] == x;
            if (!taken && (best == UINT32_MAX || sc[x] > sc[best])) best = x;
        }
        sel[k] = best;
        wt[k] = p[best];
        wsum += wt[k];
    }
    if (d->expert_weights_norm) {
        if (wsum < 6.103515625e-5f) wsum = 6.103515625e-5f;
        for (uint32_t k = 0; k < K; k++) wt[k] = wt[k] / wsum;
    }
    if (d->expert_weights_scale != 0.0f && d->expert_weights_scale != 1.0f)
        for (uint32_t k = 0; k < K; k++) wt[k] = wt[k] * d->expert_weights_scale;
}

/* Token t's output: the sum over its ranks k of w[k] * (expert sel[k]'s output), in rank order; then,
 * with a shared expert, + its output (times sigmoid(its gate logit) where it has a gate). */
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
    if (!j->shared) return;
    const float *sy = e->sh_y + (size_t)t * E;
    const float gate = j->gated ? 1.0f / (1.0f + expf(-e->sh_gate[t])) : 1.0f; /* 1 * y is y, bit for bit */
    for (uint32_t i = 0; i < E; i++) out[i] = out[i] + gate * sy[i];
}

/* g := SiLU(g) * u over n values, as the dense MLP computes it. */
static void swiglu(float *g, const float *u, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const float a = g[i];
        g[i] = (a / (1.0f + expf(-a))) * u[i];
    }
}

/* Rows [expert * rows, (expert + 1) * rows) of a stacked expert tensor as one matrix. */
static kvb_mat expert_view(const kvb_mat *stack, uint32_t expert, int64_t rows) {
    kvb_mat v = *stack;
    v.data = (const uint8_t *)stack->data + (size_t)expert * (size_t)rows * stack->row_bytes;
    v.rows = rows;
    return v;
}

/* Every routed expert of the chunk in two parallel passes instead of three matmuls per expert: the
 * gate and up tiles of all active experts at once, then (after SwiGLU) their down tiles. A task is
 * one tile: (active expert, matrix, rows [r0, r0 + rpt)) over all of that expert's tokens, whose
 * quantised inputs lie contiguous in moe_act in grouped slot order. Each output is kvb_matmul_tile's
 * (kvb_dot per row and token), so the bits do not depend on the tiling. */
typedef struct {
    kvb_engine *e;
    const kvb_layer_weights *w;
    const uint32_t *active;    /* the experts with tokens */
    uint32_t rpt, tiles;       /* rows per task; tiles per (expert, matrix) */
    uint32_t mat0, mats;       /* the pass's matrices: mat0 .. mat0 + mats - 1 of gate (0), up (1), down (2) */
} experts_job;

static void experts_task(void *ctx, int task, int worker) {
    (void)worker;
    const experts_job *j = ctx;
    kvb_engine *e = j->e;
    const kvb_model_desc *d = &e->m->d;
    const uint32_t E = d->n_embd, F = d->n_ff_exp;
    const uint32_t tile = (uint32_t)task % j->tiles, mat = j->mat0 + ((uint32_t)task / j->tiles) % j->mats;
    const uint32_t x = j->active[(uint32_t)task / j->tiles / j->mats];
    const uint32_t s0 = e->moe_off[x], n = e->moe_off[x + 1] - s0; /* the expert's slots in grouped order */
    const kvb_mat *stack = mat == 2 ? &j->w->down_exps : mat ? &j->w->up_exps : &j->w->gate_exps;
    const uint32_t rows = mat == 2 ? E : F, cols = mat == 2 ? F : E, r0 = tile * j->rpt;
    if (r0 >= rows) return;
    const int nr = (int)(rows - r0 < j->rpt ? rows - r0 : j->rpt);
    const kvb_mat W = expert_view(stack, x, rows);
    float *y = mat == 2 ? e->moe_x : mat ? e->moe_u : e->moe_g; /* (slots, rows) grouped order */
    const size_t act_stride = kvb_row_bytes(kvb_act_type(W.type), cols);
    kvb_matmul_tile(W.type, (const uint8_t *)W.data + (size_t)r0 * W.row_bytes, W.row_bytes, nr,
                    e->moe_act + (size_t)s0 * act_stride, act_stride, (int)n, y + (size_t)s0 * rows + r0, rows, cols);
}

typedef struct {
    kvb_engine *e;
    uint32_t type, cols;
    const float *src;          /* (slots, cols) rows to quantise, or NULL: h's row of each slot's token */
} experts_quant_job;

/* Slot s (grouped order) of the pass's activations: its row of src, or its token's row of h. */
static void experts_quant_task(void *ctx, int s, int worker) {
    (void)worker;
    const experts_quant_job *j = ctx;
    kvb_engine *e = j->e;
    const uint32_t K = e->m->d.n_expert_used;
    const float *x = j->src ? j->src + (size_t)s * j->cols : e->h + (size_t)(e->moe_slot[s] / K) * j->cols;
    kvb_quantize_act(j->type, x, e->moe_act + (size_t)s * kvb_row_bytes(kvb_act_type(j->type), j->cols), j->cols);
}

/* SwiGLU of slot s's gate and up rows (grouped order), as the dense MLP computes it. */
static void experts_glu_task(void *ctx, int s, int worker) {
    (void)worker;
    kvb_engine *e = ctx;
    const size_t F = e->m->d.n_ff_exp;
    swiglu(e->moe_g + (size_t)s * F, e->moe_u + (size_t)s * F, F);
}

/* One pass over every active expert's matrices mat0 .. mat0 + mats - 1 (rows each), tiled as the
 * engine's matmul tiles one matrix (no tile past a matrix's end). */
static void experts_pass(kvb_engine *e, const kvb_layer_weights *w, uint32_t n_active, uint32_t mat0, uint32_t mats,
                         uint32_t rows) {
    uint32_t rpt = kvb_cpu_rows_per_task(e->pool, (int64_t)n_active * mats * rows);
    if (rpt > rows) rpt = (rows + 15) & ~15u;
    experts_job j = {e, w, e->moe_active, rpt, (rows + rpt - 1) / rpt, mat0, mats};
    kvb_pool_parallel_for(e->pool, (int)(n_active * mats * j.tiles), experts_task, &j);
}

/* The routed experts of nr tokens whose slots are grouped by expert (moe_off, moe_slot): outputs into
 * moe_y by slot. */
static void run_experts(kvb_engine *e, const kvb_layer_weights *w, uint32_t nr) {
    const kvb_model_desc *d = &e->m->d;
    const uint32_t E = d->n_embd, F = d->n_ff_exp, X = d->n_expert, slots = nr * d->n_expert_used;
    uint32_t n_active = 0;
    for (uint32_t x = 0; x < X; x++)
        if (e->moe_off[x + 1] > e->moe_off[x]) e->moe_active[n_active++] = x;
    kvb_pool *qp = slots > 1 ? e->pool : NULL;
    /* gate and up in one pass when they take the same activations (else one pass each) */
    const bool same_act = kvb_act_type(w->gate_exps.type) == kvb_act_type(w->up_exps.type);
    for (uint32_t mat0 = 0; mat0 < 2; mat0 += same_act ? 2 : 1) {
        experts_quant_job qj = {e, mat0 ? w->up_exps.type : w->gate_exps.type, E, NULL};
        kvb_pool_parallel_for(qp, (int)slots, experts_quant_task, &qj);
        experts_pass(e, w, n_active, mat0, same_act ? 2 : 1, F);
    }
    kvb_pool_parallel_for(qp, (int)slots, experts_glu_task, e);
    experts_quant_job qj = {e, w->down_exps.type, F, e->moe_g};
    kvb_pool_parallel_for(qp, (int)slots, experts_quant_task, &qj);
    experts_pass(e, w, n_active, 2, 1, E);
    for (uint32_t s = 0; s < slots; s++) /* grouped order -> by slot */
        memcpy(e->moe_y + (size_t)e->moe_slot[s] * E, e->moe_x + (size_t)s * E, sizeof(float) * E);
}

/* The shared expert on the chunk's nr rows of h: one SwiGLU of n_ff_shexp, output into sh_y (nr, n_embd);
 * its gate's logits (qwen2moe) into sh_gate (nr). */
static void run_shared(kvb_engine *e, const kvb_layer_weights *w, uint32_t nr) {
    const size_t FS = e->m->d.n_ff_shexp;
    if (w->gate_inp_shexp.data) kvb_cpu_matmul(e->pool, &w->gate_inp_shexp, e->h, nr, e->sh_gate, e->act); /* (nr, 1) */
    kvb_cpu_matmul(e->pool, &w->gate_shexp, e->h, nr, e->sh_g, e->act);
    kvb_cpu_matmul(e->pool, &w->up_shexp, e->h, nr, e->sh_u, e->act);
    swiglu(e->sh_g, e->sh_u, (size_t)nr * FS);
    kvb_cpu_matmul(e->pool, &w->down_shexp, e->sh_g, nr, e->sh_y, e->act);
}

void kvb_cpu_moe(kvb_engine *e, const kvb_layer_weights *w, uint32_t nr, kvb_pool *tok_pool) {
    const kvb_model_desc *d = &e->m->d;
    const uint32_t X = d->n_expert, K = d->n_expert_used;
    moe_job j = {e, nr, w->exp_probs_b, w->gate_shexp.data != NULL, w->gate_inp_shexp.data != NULL};
    if (j.shared) run_shared(e, w, nr); /* before the combine overwrites h */
    kvb_cpu_matmul(e->pool, &w->ffn_gate_inp, e->h, nr, e->moe_logits, e->act); /* (nr, n_expert) */
    kvb_pool_parallel_for(tok_pool, (int)nr, route_task, &j);
    /* group the (token, rank) slots by expert, tokens ascending: a counting sort */
    uint32_t *off = e->moe_off; /* (n_expert + 1) */
    memset(off, 0, sizeof(uint32_t) * (X + 1));
    for (size_t s = 0; s < (size_t)nr * K; s++) off[e->moe_sel[s] + 1]++;
    for (uint32_t x = 0; x < X; x++) off[x + 1] += off[x];
    for (uint32_t x = 0; x <= X; x++) e->moe_fill[x] = off[x];
    for (uint32_t s = 0; s < nr * K; s++) e->moe_slot[e->moe_fill[e->moe_sel[s]]++] = s;
    run_experts(e, w, nr);
    kvb_pool_parallel_for(tok_pool, (int)nr, combine_task, &j);
}
