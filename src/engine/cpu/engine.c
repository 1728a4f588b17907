/* engine/cpu/engine.c — the CPU engine's lifetime: options and defaults, the thread pool, the
 * paged KV cache pool (one arena of fixed-size blocks in the decoder's cache format, a free
 * list), per-chunk scratch (the RoPE tables of every layer kind included), and sequences that own
 * lists of blocks. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

static kvb_status alloc_f(float **p, size_t n, kvb_err *err) {
    *p = kvb_aligned_alloc(64, n * sizeof(float));
    return *p ? KVB_OK : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for engine scratch (%zu floats)", n);
}
static kvb_status alloc_b(uint8_t **p, size_t n, kvb_err *err) {
    *p = kvb_aligned_alloc(64, n);
    return *p ? KVB_OK : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for engine scratch (%zu bytes)", n);
}

/* The mixture-of-experts scratch (see cpu_internal.h), B = max_batch tokens. */
static kvb_status alloc_moe(kvb_engine *e, kvb_err *err) {
    const kvb_model_desc *d = &e->m->d;
    const size_t B = e->o.max_batch, K = d->n_expert_used, F = d->n_ff_exp, X = d->n_expert;
    const size_t XW = d->n_embd > F ? d->n_embd : F;
    /* the widest activation row any expert matrix takes (f32 activations are the widest) */
    const size_t act_row = kvb_row_bytes(KVB_TYPE_F32, (int64_t)XW);
    kvb_status st;
    if ((st = alloc_f(&e->moe_logits, B * X, err)) || (st = alloc_f(&e->moe_w, B * K, err)) ||
        (st = alloc_f(&e->moe_x, B * K * d->n_embd, err)) || (st = alloc_f(&e->moe_g, B * K * F, err)) ||
        (st = alloc_f(&e->moe_u, B * K * F, err)) || (st = alloc_f(&e->moe_y, B * K * d->n_embd, err)) ||
        (st = alloc_b(&e->moe_act, B * K * act_row, err)))
        return st;
    e->moe_sel = calloc(B * K, sizeof(uint32_t));
    e->moe_slot = calloc(B * K, sizeof(uint32_t));
    e->moe_off = calloc(X + 1, sizeof(uint32_t));
    e->moe_fill = calloc(X + 1, sizeof(uint32_t));
    e->moe_active = calloc(X, sizeof(uint32_t));
    if (!e->moe_sel || !e->moe_slot || !e->moe_off || !e->moe_fill || !e->moe_active)
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the experts' scratch");
    const size_t FS = d->n_ff_shexp;
    if (FS && ((st = alloc_f(&e->sh_g, B * FS, err)) || (st = alloc_f(&e->sh_u, B * FS, err)) ||
               (st = alloc_f(&e->sh_y, B * d->n_embd, err)) || (st = alloc_f(&e->sh_gate, B, err))))
        return st;
    return KVB_OK;
}

/* deepseek2's latent attention scratch: the projected queries, one head's gathered rows and their
 * projection, the heads' values. */
static kvb_status alloc_mla(kvb_engine *e, kvb_err *err) {
    const kvb_model_desc *d = &e->m->d;
    const size_t B = e->o.max_batch, H = d->n_head, N = d->head_dim_k_mla - d->n_rot;
    const size_t T = KVB_MAX(KVB_MAX((size_t)d->n_lora_q, (size_t)d->n_lora_kv), KVB_MAX(N, (size_t)d->head_dim_v_mla));
    kvb_status st;
    if ((st = alloc_f(&e->mla_q, B * H * d->head_dim_k_mla, err)) || (st = alloc_f(&e->mla_t, B * T, err)) ||
        (st = alloc_f(&e->mla_u, B * T, err)) || (st = alloc_f(&e->mla_o, B * H * d->head_dim_v_mla, err)))
        return st;
    return KVB_OK;
}

kvb_status kvb_engine_create(const kvb_model *m, const kvb_engine_opts *opts, kvb_engine **out, kvb_err *err) {
    *out = NULL;
    kvb_engine *e = calloc(1, sizeof *e);
    if (!e) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating the engine");
    e->m = m;
    e->o = opts ? *opts : (kvb_engine_opts){0};
    kvb_engine_opts *o = &e->o;
    const kvb_model_desc *d = &m->d;
    kvb_status st = KVB_OK;
    if (o->n_threads <= 0) o->n_threads = kvb_cpu_count();
    if (!o->block_tokens) o->block_tokens = 32;
    if (!o->max_ctx) o->max_ctx = d->n_ctx_train < 8192 ? d->n_ctx_train : 8192;
    if (!o->max_batch) o->max_batch = 512;
    if (!o->n_blocks) o->n_blocks = (o->max_ctx + o->block_tokens - 1) / o->block_tokens;
    if ((st = kvb_model_kvformat(d, o->cache_dtype, o->block_tokens, &e->fmt, err))) goto fail;
    e->row_bytes = kvb_kvformat_row_bytes(&e->fmt);
    e->block_bytes = kvb_kvformat_block_bytes(&e->fmt);
    if ((st = kvb_pool_create(o->n_threads, &e->pool, err))) goto fail;

    if (o->store) {
        e->store = o->store;
        if (kvb_kvformat_fingerprint(kvb_store_kvformat(o->store)) != kvb_kvformat_fingerprint(&e->fmt)) {
            char a[64], b[64];
            kvb_kvformat_describe(kvb_store_kvformat(o->store), a, sizeof a);
            kvb_kvformat_describe(&e->fmt, b, sizeof b);
            st = kvb_err_set(err, KVB_ERR_INVALID, "the shared store holds %s blocks but the engine writes %s", a, b);
            goto fail;
        }
    } else {
        if ((st = kvb_store_create(&e->fmt, m->fingerprint, o->n_blocks, &e->store, err))) goto fail;
        e->own_store = true;
    }
    const size_t B = o->max_batch, E = d->n_embd, Q = (size_t)d->n_head * d->head_dim, FF = d->n_ff;
    size_t widest = E > Q ? E : Q;
    widest = KVB_MAX(widest, KVB_MAX((size_t)d->n_lora_q, (size_t)d->n_head * d->head_dim_v_mla));
    widest = KVB_MAX(widest, (size_t)d->n_ff_shexp);
    widest = widest > FF ? widest : FF;
    widest = widest > d->n_ff_exp ? widest : d->n_ff_exp;
    size_t act_row = kvb_row_bytes(KVB_TYPE_F32, (int64_t)widest); /* f32 activations are the widest form */
    if ((st = alloc_f(&e->x, B * E, err)) || (st = alloc_f(&e->h, B * E, err)) || (st = alloc_f(&e->q, B * Q, err)) ||
        (st = alloc_f(&e->att, B * Q, err)) || (st = alloc_f(&e->g, B * FF, err)) ||
        (st = alloc_f(&e->u, B * FF, err)) || (st = alloc_b(&e->act, B * act_row, err)) ||
        (st = alloc_b(&e->k_rows, B * d->n_head_kv * e->row_bytes, err)) ||
        (st = alloc_b(&e->v_rows, B * d->n_head_kv * e->row_bytes, err)) ||
        (st = alloc_b((uint8_t **)&e->kv_scratch, kvb_kv_produce_scratch_bytes(m, (uint32_t)B), err)) ||
        (st = alloc_f(&e->logit_h, E, err)))
        goto fail;
    if ((st = kvb_rope_tables_init(&e->rope, m, (uint32_t)B, err))) goto fail;
    if (o->ggml_arith && d->mla) {
        st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "ggml's arithmetic is not reproduced for latent attention");
        goto fail;
    }
    if (o->ggml_arith && (st = kvb_rope_tables_set_ggml(&e->rope, err))) goto fail;
    e->attn_scratch = calloc((size_t)o->n_threads, sizeof(float *));
    e->tok_pos = calloc(B, sizeof(uint32_t));
    e->seg_ones = calloc(B, sizeof(uint32_t));
    if (!e->attn_scratch || !e->tok_pos || !e->seg_ones) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < o->n_threads; i++)
        if ((st = alloc_f(&e->attn_scratch[i], kvb_cpu_attn_scratch_floats(e), err))) goto fail;
    if (d->n_expert && (st = alloc_moe(e, err))) goto fail;
    if (d->mla && (st = alloc_mla(e, err))) goto fail;
    *out = e;
    return KVB_OK;
fail:
    kvb_engine_free(e);
    return st;
}

void kvb_engine_free(kvb_engine *e) {
    if (!e) return;
    if (e->attn_scratch)
        for (int i = 0; i < e->o.n_threads; i++) kvb_aligned_free(e->attn_scratch[i]);
    free(e->attn_scratch);
    free(e->tok_pos);
    free(e->seg_ones);
    kvb_pool_destroy(e->pool);
    if (e->own_store) kvb_store_free(e->store);
    free(e->moe_sel);
    free(e->moe_slot);
    free(e->moe_off);
    free(e->moe_fill);
    free(e->moe_active);
    kvb_aligned_free(e->moe_act);
    float *fs[] = {e->x, e->h, e->q, e->att, e->g, e->u, e->logit_h, e->moe_logits, e->moe_w, e->moe_x, e->moe_g,
                   e->moe_u, e->moe_y, e->sh_g, e->sh_u, e->sh_y, e->sh_gate, e->mla_q, e->mla_t, e->mla_u, e->mla_o};
    for (size_t i = 0; i < KVB_ARRAY_LEN(fs); i++) kvb_aligned_free(fs[i]);
    kvb_aligned_free(e->act);
    kvb_aligned_free(e->k_rows);
    kvb_aligned_free(e->v_rows);
    kvb_aligned_free(e->kv_scratch);
    kvb_rope_tables_free(&e->rope);
    free(e);
}

const kvb_kvformat *kvb_engine_kvformat(const kvb_engine *e) { return &e->fmt; }
uint32_t kvb_engine_max_batch(const kvb_engine *e) { return e->o.max_batch; }

int kvb_engine_threads(const kvb_engine *e) { return e->o.n_threads; }

kvb_pool *kvb_engine_pool(kvb_engine *e) { return e->pool; }

kvb_store *kvb_engine_store(const kvb_engine *e) { return e->store; }

kvb_status kvb_seq_create(kvb_engine *e, kvb_seq **out, kvb_err *err) {
    kvb_seq *s = calloc(1, sizeof *s);
    if (!s) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating a sequence");
    s->e = e;
    s->last_key = kvb_store_root_key(e->store);
    *out = s;
    return KVB_OK;
}

/* An ordinary sequence's blocks go back (committed ones stay cached). */
static void seq_release_blocks(kvb_seq *s) {
    /* sliding-window layers: only the local rows a continuation's window reads stay — one resuming
     * at the end of the committed chain, or at the position kvb_seq_keep_window_at named (the
     * prompt's end: a next turn whose reply tokenizes differently resumes there); blocks wholly
     * before both windows give theirs up, so the decoder's memory for local layers stays about two
     * windows per conversation, however long it grew */
    const uint32_t W = s->e->fmt.window, bt = s->e->o.block_tokens;
    if (W) {
        uint32_t resume = s->n_committed * bt;
        if (s->keep_window_at && s->keep_window_at < resume) resume = s->keep_window_at / bt * bt;
        const uint32_t lo = resume + 1 > W ? resume + 1 - W : 0; /* the first key that window reads */
        kvb_store_drop_local_rows(s->e->store, s->blocks, lo / bt);
    }
    if (s->n_blocks) kvb_store_release(s->e->store, s->blocks, s->n_blocks, NULL);
}

void kvb_seq_free(kvb_seq *s) {
    if (!s) return;
    if (s->borrowed_to) { /* a provisional sequence: only its own blocks go back, none gives up rows */
        if (s->borrowed_from) kvb_store_release(s->e->store, s->blocks, s->borrowed_from, NULL);
        if (s->n_blocks > s->borrowed_to) /* pages a forward took past the borrowed ones */
            kvb_store_release(s->e->store, s->blocks + s->borrowed_to, s->n_blocks - s->borrowed_to, NULL);
    } else {
        seq_release_blocks(s);
    }
    free(s->blocks);
    free(s->tokens);
    free(s->gate_saved);
    free(s);
}

uint32_t kvb_seq_len(const kvb_seq *s) { return s->len; }

static kvb_status seq_grow(kvb_seq *s, uint32_t need_blocks, kvb_err *err) {
    if (need_blocks <= s->cap) return KVB_OK;
    uint32_t cap = s->cap ? s->cap * 2 : 16;
    while (cap < need_blocks) cap *= 2;
    uint32_t *nb = realloc(s->blocks, sizeof(uint32_t) * cap);
    if (nb) s->blocks = nb;
    int32_t *nt = nb ? realloc(s->tokens, sizeof(int32_t) * cap * s->e->o.block_tokens) : NULL;
    if (!nb || !nt) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory growing a sequence");
    s->tokens = nt;
    s->cap = cap;
    return KVB_OK;
}

kvb_status kvb_cpu_seq_reserve(kvb_seq *s, uint32_t new_len, kvb_err *err) {
    kvb_engine *e = s->e;
    if (new_len > e->o.max_ctx)
        return kvb_err_set(err, KVB_ERR_RANGE, "sequence of %u tokens exceeds the context limit of %u tokens", new_len,
                           e->o.max_ctx);
    uint32_t need = (new_len + e->o.block_tokens - 1) / e->o.block_tokens;
    kvb_status st = seq_grow(s, need, err);
    if (st || need <= s->n_blocks) return st;
    if ((st = kvb_store_alloc(e->store, need - s->n_blocks, s->blocks + s->n_blocks, err)))
        return kvb_err_prefix(err, "KV cache: ");
    s->n_blocks = need;
    return KVB_OK;
}

kvb_status kvb_cpu_seq_commit_full(kvb_seq *s, kvb_err *err) {
    const uint32_t bt = s->e->o.block_tokens;
    if (s->borrowed_to) return KVB_OK; /* a provisional sequence publishes nothing */
    while (!s->commit_refused && s->n_committed < s->len / bt) {
        const uint32_t b = s->n_committed;
        const int32_t *toks = s->tokens + (size_t)b * bt;
        uint64_t key = kvb_chain_next(s->last_key, toks, bt);
        kvb_block_id committed;
        kvb_err e2 = {0};
        kvb_status st = kvb_store_commit_block(s->e->store, s->blocks[b], key, s->last_key, toks, &committed, &e2);
        if (st == KVB_ERR_INVALID) {
            /* a 64-bit key collision: keep the block private to this sequence, publish no more */
            kvb_log(KVB_LOG_WARN, "not caching sequence blocks: %s", e2.msg);
            s->commit_refused = true;
            break;
        }
        if (st) return kvb_err_set(err, st, "%s", e2.msg);
        s->blocks[b] = committed;
        s->last_key = key;
        s->n_committed++;
    }
    return KVB_OK;
}

void kvb_seq_keep_window_at(kvb_seq *s, uint32_t pos) { s->keep_window_at = pos; }

kvb_status kvb_seq_adopt_tail(kvb_seq *s, kvb_block_id page, const int32_t *tokens, uint32_t n, kvb_err *err) {
    const uint32_t bt = s->e->o.block_tokens;
    if (n == 0 || n > bt || s->len % bt || s->n_blocks != s->len / bt)
        return kvb_err_set(err, KVB_ERR_INVALID, "a tail of %u tokens needs 1..%u tokens on a sequence that ends "
                           "on a block boundary (it has %u tokens)", n, bt, s->len);
    if (page >= kvb_store_n_blocks(s->e->store))
        return kvb_err_set(err, KVB_ERR_INVALID, "tail page %u is not a block of this engine's store", page);
    kvb_status st = seq_grow(s, s->n_blocks + 1, err);
    if (st) return st;
    s->blocks[s->n_blocks++] = page;
    memcpy(s->tokens + s->len, tokens, (size_t)n * sizeof(int32_t));
    s->len += n;
    if (n < bt) return KVB_OK;
    if ((st = kvb_cpu_seq_commit_full(s, err))) { /* a whole block: published now, through the one writer */
        s->n_blocks--;
        s->len -= n;
    }
    return st;
}

void kvb_engine_park_threads(kvb_engine *e) { kvb_pool_park(e->pool); }

void kvb_engine_set_threads(kvb_engine *e, int n) { kvb_pool_set_width(e->pool, n); }

void kvb_seq_set_layer_gate(kvb_seq *s, kvb_layer_gate gate, void *ctx) {
    s->gate = gate;
    s->gate_ctx = ctx;
}

kvb_status kvb_seq_borrow_pages(kvb_seq *s, const kvb_block_id *pages, uint32_t n_pages, const int32_t *tokens,
                                uint32_t n_tokens, kvb_err *err) {
    const uint32_t bt = s->e->o.block_tokens;
    if (s->len % bt || s->n_blocks != s->len / bt || s->borrowed_to)
        return kvb_err_set(err, KVB_ERR_INVALID, "pages are borrowed once, by a sequence that ends on a block boundary "
                           "(it has %u tokens)", s->len);
    if ((uint64_t)n_pages * bt < n_tokens || n_pages == 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "%u borrowed pages cannot hold %u tokens", n_pages, n_tokens);
    if ((uint64_t)s->len + n_tokens > s->e->o.max_ctx)
        return kvb_err_set(err, KVB_ERR_RANGE, "%u + %u tokens exceed the context limit of %u tokens", s->len,
                           n_tokens, s->e->o.max_ctx);
    for (uint32_t i = 0; i < n_pages; i++)
        if (pages[i] >= kvb_store_n_blocks(s->e->store))
            return kvb_err_set(err, KVB_ERR_INVALID, "page %u is not a block of this engine's store", pages[i]);
    kvb_status st = seq_grow(s, s->n_blocks + n_pages, err);
    if (st) return st;
    s->borrowed_from = s->n_blocks;
    memcpy(s->blocks + s->n_blocks, pages, (size_t)n_pages * sizeof(kvb_block_id));
    s->n_blocks += n_pages;
    s->borrowed_to = s->n_blocks;
    memcpy(s->tokens + s->len, tokens, (size_t)n_tokens * sizeof(int32_t));
    s->len += n_tokens;
    return KVB_OK;
}

kvb_status kvb_seq_attach_cached(kvb_seq *s, const int32_t *tokens, uint32_t n, uint32_t *n_cached, kvb_err *err) {
    *n_cached = 0;
    if (s->len != 0 || s->n_blocks != 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "cached prefixes attach only to an empty sequence");
    if (n < 2) return KVB_OK;
    const uint32_t bt = s->e->o.block_tokens;
    uint32_t max_blocks = (n - 1) / bt, found = 0;
    kvb_status st = seq_grow(s, max_blocks + 1, err);
    if (st) return st;
    if ((st = kvb_store_lookup(s->e->store, tokens, n - 1, s->blocks, &found, err))) return st;
    s->n_blocks = s->n_committed = found;
    s->len = found * bt;
    memcpy(s->tokens, tokens, (size_t)s->len * sizeof(int32_t));
    for (uint32_t b = 0; b < found; b++) s->last_key = kvb_chain_next(s->last_key, tokens + (size_t)b * bt, bt);
    *n_cached = s->len;
    return KVB_OK;
}
