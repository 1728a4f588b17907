/* engine/cpu/forward.c — one forward pass over a chunk of tokens: embed (gemma3: times
 * sqrt(n_embd)), then per layer attention-norm -> K/V through kvb_kv_produce into the paged cache
 * -> Q (bias, q-norm, RoPE with the layer's own table) -> attention over the cache (a sliding
 * window on local layers) -> output projection (gemma3: post-attention norm) + residual ->
 * ffn-norm -> SwiGLU or (gemma3) GeGLU MLP (gemma3: post-MLP norm), or the mixture of experts
 * (qwen3moe, qwen2moe, deepseek2's MoE layers; moe.c) + residual; deepseek2's latent attention replaces the
 * Q projection and the output projection (mla.c) around the same attention over the cache; then the final
 * norm and the output head. Long inputs are split into max_batch chunks; prefill and
 * token-by-token decode run the same arithmetic. A chunk may hold segments of several sequences
 * (kvb_engine_forward_segments; a decode batch, kvb_engine_forward_batch, is one token of each):
 * the weights are read once for all, and each token's arithmetic is what its own sequence's
 * forward does (every projection is a per-token column; attention, RoPE and the cache rows are
 * per sequence). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

typedef struct {
    kvb_engine *e;
    uint32_t layer, n;
    const float *norm_w; /* for norm tasks */
    float *src, *dst;
    const float *rope_cos, *rope_sin; /* (n, n_rot/2) the layer's own table */
} tok_job;

static void norm_task(void *ctx, int t, int worker) {
    (void)worker;
    const tok_job *j = ctx;
    const kvb_model_desc *d = &j->e->m->d;
    kvb_cpu_rmsnorm_arith(j->src + (size_t)t * d->n_embd, j->norm_w, d->n_embd, d->norm_eps,
                          j->dst + (size_t)t * d->n_embd, j->e->o.ggml_arith);
}

/* q += bq; per-head q-norm; RoPE — for token t */
static void q_post_task(void *ctx, int t, int worker) {
    (void)worker;
    const tok_job *j = ctx;
    const kvb_engine *e = j->e;
    const kvb_model_desc *d = &e->m->d;
    const kvb_layer_weights *w = &e->m->layers[j->layer];
    const size_t Q = (size_t)d->n_head * d->head_dim, half = d->n_rot / 2;
    float *q = e->q + (size_t)t * Q;
    if (w->bq)
        for (size_t i = 0; i < Q; i++) q[i] = q[i] + w->bq[i];
    for (uint32_t h = 0; h < d->n_head; h++) {
        float *qh = q + (size_t)h * d->head_dim;
        if (w->q_norm) kvb_cpu_rmsnorm_arith(qh, w->q_norm, d->head_dim, d->norm_eps, qh, e->o.ggml_arith);
        kvb_cpu_rope_arith(qh, d->n_rot, d->rope_neox, j->rope_cos + (size_t)t * half,
                           j->rope_sin + (size_t)t * half, e->o.ggml_arith);
    }
}

/* x += src for token t */
static void residual_task(void *ctx, int t, int worker) {
    (void)worker;
    const tok_job *j = ctx;
    const size_t E = j->e->m->d.n_embd;
    float *x = j->dst + (size_t)t * E;
    const float *o = j->src + (size_t)t * E;
    for (size_t i = 0; i < E; i++) x[i] = x[i] + o[i];
}

/* x += rmsnorm(src) * norm_w for token t (gemma3's post norms: the branch output is normed, then
 * added; src is overwritten with the normed values) */
static void norm_residual_task(void *ctx, int t, int worker) {
    (void)worker;
    const tok_job *j = ctx;
    const kvb_model_desc *d = &j->e->m->d;
    const size_t E = d->n_embd;
    float *o = j->src + (size_t)t * E, *x = j->dst + (size_t)t * E;
    kvb_cpu_rmsnorm_arith(o, j->norm_w, d->n_embd, d->norm_eps, o, j->e->o.ggml_arith);
    for (size_t i = 0; i < E; i++) x[i] = x[i] + o[i];
}

/* g = silu(g) * u (SwiGLU) or gelu_tanh(g) * u (gemma3's GeGLU) for token t */
static void glu_task(void *ctx, int t, int worker) {
    (void)worker;
    const tok_job *j = ctx;
    const size_t FF = j->e->m->d.n_ff;
    float *g = j->e->g + (size_t)t * FF;
    const float *u = j->e->u + (size_t)t * FF;
    if (j->e->m->d.mlp_gelu) {
        for (size_t i = 0; i < FF; i++) g[i] = kvb_cpu_gelu_tanh(g[i]) * u[i];
        return;
    }
    for (size_t i = 0; i < FF; i++) {
        float a = g[i];
        g[i] = (a / (1.0f + expf(-a))) * u[i];
    }
}

/* Copies encoded K/V rows (the chunk's, from row t0 on) into the sequence's cache blocks at
 * positions pos0 .. pos0+n-1, a block at a time. */
static void store_kv_rows(kvb_engine *e, kvb_seq *s, uint32_t layer, uint32_t pos0, uint32_t n, uint32_t t0) {
    const uint32_t bt = e->o.block_tokens;
    const size_t tok_bytes = (size_t)e->m->d.n_head_kv * e->row_bytes;
    for (uint32_t t = 0; t < n;) {
        const uint32_t p = pos0 + t, cnt = KVB_MIN(n - t, bt - p % bt);
        kvb_kvformat_scatter_rows(&e->fmt, kvb_store_block_data(e->store, s->blocks[p / bt]), layer, p % bt, cnt,
                                  e->k_rows + (t0 + t) * tok_bytes, e->v_rows + (t0 + t) * tok_bytes);
        t += cnt;
    }
}

/* Whose the chunk's tokens are: n_seg segments of distinct sequences, segment i being seg_n[i]
 * tokens of seqs[i] at seqs[i]->len.., back to back in the chunk (one sequence's chunk: n_seg 1;
 * a decode batch: every seg_n 1). */
typedef struct {
    kvb_seq *const *seqs;
    const uint32_t *seg_n;
    uint32_t n_seg;
} chunk_seqs;

/* Calls s's gate before layer l's attention (it returns once earlier positions' layer l is
 * there). The gate may run other forwards on this engine meanwhile, so what the chunk still needs
 * of the engine's scratch is kept across it: the residual stream x and the queries q of its n
 * tokens, and the RoPE rows of its positions (filled again). The rest is written again before it
 * is read (h, att, g, u by the projections; the K/V rows went into the cache before the gate). */
static kvb_status gate_keeping_state(kvb_engine *e, kvb_seq *s, uint32_t l, uint32_t pos0, uint32_t n,
                                     kvb_err *err) {
    const kvb_model_desc *d = &e->m->d;
    const size_t xf = (size_t)n * d->n_embd, qf = (size_t)n * d->n_head * d->head_dim;
    if (s->gate_saved_floats < xf + qf) {
        float *p = realloc(s->gate_saved, sizeof(float) * (xf + qf));
        if (!p) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for a gated chunk of %u tokens", n);
        s->gate_saved = p;
        s->gate_saved_floats = xf + qf;
    }
    memcpy(s->gate_saved, e->x, sizeof(float) * xf);
    memcpy(s->gate_saved + xf, e->q, sizeof(float) * qf);
    kvb_status st = s->gate(s->gate_ctx, l, err);
    memcpy(e->x, s->gate_saved, sizeof(float) * xf);
    memcpy(e->q, s->gate_saved + xf, sizeof(float) * qf);
    kvb_rope_tables_fill(&e->rope, pos0, n);
    return st;
}

/* The last layer, when only each segment's last token needs logits: row i of x and of h (its
 * attention-normed input) becomes segment i's last row, and the RoPE rows their positions. The
 * rows dropped had their K/V stored already; each row's arithmetic is its own, so what is kept
 * is the same bits. */
static void keep_last_rows(kvb_engine *e, chunk_seqs cs) {
    const size_t E = e->m->d.n_embd;
    for (uint32_t i = 0, t = 0; i < cs.n_seg; i++) {
        t += cs.seg_n[i];
        if (t - 1 != i) {
            memcpy(e->x + i * E, e->x + (size_t)(t - 1) * E, sizeof(float) * E);
            memcpy(e->h + i * E, e->h + (size_t)(t - 1) * E, sizeof(float) * E);
        }
        e->tok_pos[i] = cs.seqs[i]->len + cs.seg_n[i] - 1;
    }
    if (cs.n_seg == 1) kvb_rope_tables_fill(&e->rope, e->tok_pos[0], 1);
    else kvb_rope_tables_fill_at(&e->rope, e->tok_pos, cs.n_seg);
}

/* logits: NULL, or with all_logits (n, n_vocab) for every token (one segment only), else
 * (n_seg, n_vocab): row i for segment i's last token. */
static kvb_status forward_chunk(kvb_engine *e, chunk_seqs cs, const int32_t *tokens, uint32_t n, float *logits,
                                bool all_logits, kvb_err *err) {
    const kvb_model *m = e->m;
    const kvb_model_desc *d = &m->d;
    const uint32_t E = d->n_embd;
    const size_t Q = (size_t)d->n_head * d->head_dim;
    kvb_status st = KVB_OK;
    for (uint32_t i = 0; i < cs.n_seg; i++)
        if ((st = kvb_cpu_seq_reserve(cs.seqs[i], cs.seqs[i]->len + cs.seg_n[i], err))) return st;

    for (uint32_t i = 0, t = 0; i < cs.n_seg; i++)
        for (uint32_t k = 0; k < cs.seg_n[i]; k++, t++) {
            kvb_seq *ts = cs.seqs[i];
            const uint32_t pos = ts->len + k;
            if (tokens[t] < 0 || (uint32_t)tokens[t] >= d->n_vocab)
                return kvb_err_set(err, KVB_ERR_INVALID, "token id %d at position %u is outside the vocabulary (0..%u)",
                                   tokens[t], pos, d->n_vocab - 1);
            float *xt = e->x + (size_t)t * E; /* (n_embd) */
            kvb_row_to_f32(m->tok_embd.type,
                           (const uint8_t *)m->tok_embd.data + (size_t)tokens[t] * m->tok_embd.row_bytes, xt, E);
            if (d->embd_scale > 0) /* gemma3: rows times sqrtf(n_embd), one f32 product each */
                for (uint32_t j = 0; j < E; j++) xt[j] = xt[j] * d->embd_scale;
            ts->tokens[pos] = tokens[t];
            e->tok_pos[t] = pos;
        }
    kvb_seq *s = cs.n_seg == 1 ? cs.seqs[0] : NULL; /* one sequence's chunk: its hooks and gate */
    if (s) kvb_rope_tables_fill(&e->rope, s->len, n);
    else kvb_rope_tables_fill_at(&e->rope, e->tok_pos, n);
    kvb_pool *tok_pool = n > 1 ? e->pool : NULL;
    const uint32_t pos0 = s ? s->len : 0;
    uint32_t nr = n; /* rows going on: n, or in the last layer with logits only, one per segment */

    for (uint32_t l = 0; l < d->n_layer; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        tok_job tj = {.e = e, .layer = l, .n = n, .norm_w = w->attn_norm, .src = e->x, .dst = e->h};
        kvb_rope_tables_layer(&e->rope, l, &tj.rope_cos, &tj.rope_sin);
        kvb_pool_parallel_for(tok_pool, (int)n, norm_task, &tj);

        if (e->o.layer_hook && (st = e->o.layer_hook(e->o.layer_hook_ctx, l, pos0, n, e->h, err))) return st;
        kvb_kv_produce_args ka = {m, l, e->fmt.dtype, e->pool, tj.rope_cos, tj.rope_sin, false, e->o.ggml_arith};
        kvb_kv_produce(&ka, e->h, n, e->kv_scratch, e->k_rows, e->v_rows);
        if (e->o.rows_hook &&
            (st = e->o.rows_hook(e->o.rows_hook_ctx, l, pos0, n, e->k_rows, e->v_rows, e->fmt.dtype, err)))
            return st;
        for (uint32_t i = 0, t0 = 0; i < cs.n_seg; t0 += cs.seg_n[i++])
            store_kv_rows(e, cs.seqs[i], l, cs.seqs[i]->len, cs.seg_n[i], t0);
        /* The last layer's attention and MLP feed only the logits: a chunk that computes none (a
         * prefill node's forward, every chunk but a prompt's last) needs of that layer its K and V */
        if (l + 1 == d->n_layer && !logits) break;
        /* ... and with logits for each segment's last token only, of that layer just those rows */
        const bool last_rows = l + 1 == d->n_layer && !all_logits && n > cs.n_seg;
        if (last_rows) {
            keep_last_rows(e, cs);
            nr = cs.n_seg;
            tok_pool = nr > 1 ? e->pool : NULL;
            tj.n = nr;
            kvb_rope_tables_layer(&e->rope, l, &tj.rope_cos, &tj.rope_sin);
        }

        if (d->mla) { /* latent attention: queries against the cache row (mla.c) */
            kvb_cpu_mla_query(e, l, nr, tj.rope_cos, tj.rope_sin);
        } else {
            kvb_cpu_matmul(e->pool, &w->wq, e->h, nr, e->q, e->act);
            kvb_pool_parallel_for(tok_pool, (int)nr, q_post_task, &tj);
        }
        if (s && s->gate && (st = gate_keeping_state(e, s, l, last_rows ? pos0 + n - 1 : pos0, nr, err))) return st;
        for (uint32_t i = 0, t0 = 0; i < cs.n_seg; i++) { /* each segment's query rows */
            const uint32_t rows = last_rows ? 1 : cs.seg_n[i], qpos = cs.seqs[i]->len + cs.seg_n[i] - rows;
            kvb_cpu_attention(e, cs.seqs[i], l, qpos, rows, e->q + t0 * Q, e->att + t0 * Q);
            t0 += rows;
        }
        if (d->mla) kvb_cpu_mla_output(e, l, nr); /* h := attention output (nr, E), through V_b and W_o */
        else kvb_cpu_matmul(e->pool, &w->wo, e->att, nr, e->h, e->act); /* h := attention output (nr, E) */
        tj.src = e->h;
        tj.dst = e->x;
        tj.norm_w = w->post_attn_norm;
        kvb_pool_parallel_for(tok_pool, (int)nr, w->post_attn_norm ? norm_residual_task : residual_task, &tj);

        tj.norm_w = w->ffn_norm;
        tj.src = e->x;
        tj.dst = e->h;
        kvb_pool_parallel_for(tok_pool, (int)nr, norm_task, &tj);
        if (!kvb_layer_is_dense(d, l)) {
            kvb_cpu_moe(e, w, nr, tok_pool); /* h := the experts' output (nr, E) */
        } else {
            kvb_cpu_matmul(e->pool, &w->w_gate, e->h, nr, e->g, e->act);
            kvb_cpu_matmul(e->pool, &w->w_up, e->h, nr, e->u, e->act);
            kvb_pool_parallel_for(tok_pool, (int)nr, glu_task, &tj);
            kvb_cpu_matmul(e->pool, &w->w_down, e->g, nr, e->h, e->act); /* h := MLP output (nr, E) */
        }
        tj.src = e->h;
        tj.dst = e->x;
        tj.norm_w = w->post_ffw_norm;
        kvb_pool_parallel_for(tok_pool, (int)nr, w->post_ffw_norm ? norm_residual_task : residual_task, &tj);
    }
    for (uint32_t i = 0; i < cs.n_seg; i++) cs.seqs[i]->len += cs.seg_n[i];

    if (logits) { /* all_logits: every row; else row i is segment i's last token (nr == n_seg) */
        tok_job tj = {.e = e, .n = nr, .norm_w = m->output_norm, .src = e->x, .dst = e->h};
        kvb_pool_parallel_for(tok_pool, (int)nr, norm_task, &tj);
        kvb_cpu_matmul(e->pool, &m->output, e->h, nr, logits, e->act);
    }
    return KVB_OK;
}

kvb_status kvb_engine_forward(kvb_engine *e, kvb_seq *s, const int32_t *tokens, uint32_t n, float *logits,
                              bool all_logits, kvb_err *err) {
    if (n == 0) return kvb_err_set(err, KVB_ERR_INVALID, "forward called with no tokens");
    if (s->e != e) return kvb_err_set(err, KVB_ERR_INVALID, "sequence belongs to another engine");
    if ((uint64_t)s->len + n > e->o.max_ctx)
        return kvb_err_set(err, KVB_ERR_RANGE, "%u + %u tokens exceed the context limit of %u tokens", s->len, n,
                           e->o.max_ctx);
    const uint32_t B = e->o.max_batch, V = e->m->d.n_vocab;
    for (uint32_t done = 0; done < n;) {
        uint32_t c = n - done < B ? n - done : B;
        bool last = done + c == n;
        float *lg = NULL;
        if (logits && all_logits) lg = logits + (size_t)done * V;
        else if (logits && last) lg = logits;
        kvb_status st = forward_chunk(e, (chunk_seqs){&s, &c, 1}, tokens + done, c, lg, all_logits, err);
        if (st == KVB_OK) st = kvb_cpu_seq_commit_full(s, err);
        if (st) return st;
        done += c;
    }
    return KVB_OK;
}

kvb_status kvb_engine_forward_segments(kvb_engine *e, kvb_seq *const *seqs, const uint32_t *seg_n, uint32_t n_seg,
                                       const int32_t *tokens, float *logits, kvb_err *err) {
    if (n_seg == 0) return kvb_err_set(err, KVB_ERR_INVALID, "a forward of no segments");
    if (e->o.layer_hook || e->o.rows_hook)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "a forward of several sequences does not run the engine's "
                                                     "layer or rows hooks");
    uint64_t n = 0;
    for (uint32_t i = 0; i < n_seg; i++) {
        const kvb_seq *s = seqs[i];
        if (s->e != e) return kvb_err_set(err, KVB_ERR_INVALID, "sequence %u belongs to another engine", i);
        if (s->gate) return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "sequence %u has a layer gate (not batched)", i);
        if (seg_n[i] == 0) return kvb_err_set(err, KVB_ERR_INVALID, "segment %u has no tokens", i);
        if ((uint64_t)s->len + seg_n[i] > e->o.max_ctx)
            return kvb_err_set(err, KVB_ERR_RANGE, "sequence %u: %u + %u tokens exceed the context limit of %u tokens",
                               i, s->len, seg_n[i], e->o.max_ctx);
        for (uint32_t j = 0; j < i; j++)
            if (seqs[j] == s) return kvb_err_set(err, KVB_ERR_INVALID, "sequence %u appears twice in the batch", i);
        n += seg_n[i];
    }
    if (n > e->o.max_batch)
        return kvb_err_set(err, KVB_ERR_INVALID, "a forward of %llu tokens exceeds the engine's max_batch of %u",
                           (unsigned long long)n, e->o.max_batch);
    kvb_status st = forward_chunk(e, (chunk_seqs){seqs, seg_n, n_seg}, tokens, (uint32_t)n, logits, false, err);
    for (uint32_t i = 0; !st && i < n_seg; i++) st = kvb_cpu_seq_commit_full(seqs[i], err);
    return st;
}

kvb_status kvb_engine_forward_batch(kvb_engine *e, kvb_seq *const *seqs, const int32_t *tokens, uint32_t n,
                                    float *logits, kvb_err *err) {
    if (n == 0) return kvb_err_set(err, KVB_ERR_INVALID, "batch forward called with no sequences");
    if (n > e->o.max_batch)
        return kvb_err_set(err, KVB_ERR_INVALID, "a batch of %u sequences exceeds the engine's max_batch of %u", n,
                           e->o.max_batch);
    for (uint32_t i = 0; i < n; i++) e->seg_ones[i] = 1;
    return kvb_engine_forward_segments(e, seqs, e->seg_ones, n, tokens, logits, err);
}
