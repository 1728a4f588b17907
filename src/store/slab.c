/* store/slab.c — slab assembly for the bridge receiver: a pending block owns one private
 * WRITING page and a coverage map (layer, token); each slab is validated completely (layer,
 * token range, exact K and V lengths, no cell already covered, XXH3-64 of K || V) before any byte
 * is copied, then scattered from the slab's (token, kv_head, row) order into the block layout
 * (layer, kv, kv_head, token, head_dim). The slab that completes the coverage commits the block
 * through kvb_store_commit_block, the same writer the engine uses. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#include "store_internal.h"

typedef enum { PENDING_ASSEMBLING = 0, PENDING_COMMITTED, PENDING_FAILED } pending_phase;

struct kvb_slab_pending {
    kvb_store *store;
    kvb_block_id page;      /* the WRITING page while assembling or failed; NONE once committed */
    kvb_block_id committed; /* the committed id (may differ from page after a dedup) */
    uint64_t key, parent_key;
    uint32_t n_missing;     /* (layer, token) cells not yet arrived */
    pending_phase phase;
    int32_t *tokens;        /* (block_tokens) */
    uint8_t *covered;       /* (n_layer, block_tokens): 1 once that layer of that token arrived */
    uint32_t n_valid;       /* tokens [0, n_valid) of the page are assembled: block_tokens, or a tail's length */
    bool tail;              /* a tail: never committed; its page is taken by a sequence */
    uint32_t local_lo;      /* local layers' rows of tokens before this are not kept (never arrive) */
    uint64_t n_accepted;    /* slabs accepted so far */
};

uint64_t kvb_slab_checksum(const void *k, size_t k_bytes, const void *v, size_t v_bytes) {
    const kvb_bytes kv[2] = {{k, k_bytes}, {v, v_bytes}};
    return kvb_xxh3_pieces(kv, 2);
}

static kvb_status pending_open(kvb_store *s, uint32_t n_valid, kvb_slab_pending **out, kvb_err *err);

kvb_status kvb_store_slab_begin(kvb_store *s, uint64_t key, uint64_t parent_key, const int32_t *tokens,
                                kvb_slab_pending **out, kvb_err *err) {
    *out = NULL;
    const kvb_kvformat *f = &s->fmt;
    if (!tokens) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: the block's tokens are missing");
    uint64_t expected = kvb_chain_next(parent_key, tokens, f->block_tokens);
    if (expected != key)
        return kvb_err_set(err, KVB_ERR_INVALID,
                           "slab assembly: chain key %016llx does not match its parent key %016llx and tokens "
                           "(expected %016llx)",
                           (unsigned long long)key, (unsigned long long)parent_key, (unsigned long long)expected);
    kvb_slab_pending *p;
    kvb_status st = pending_open(s, f->block_tokens, &p, err);
    if (st) return st;
    p->key = key;
    p->parent_key = parent_key;
    memcpy(p->tokens, tokens, (size_t)f->block_tokens * sizeof(int32_t));
    *out = p;
    return KVB_OK;
}

kvb_status kvb_store_slab_begin_tail(kvb_store *s, uint32_t n_tokens, kvb_slab_pending **out, kvb_err *err) {
    *out = NULL;
    if (n_tokens == 0 || n_tokens >= s->fmt.block_tokens)
        return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: a tail has 1..%u tokens, not %u",
                           s->fmt.block_tokens - 1, n_tokens);
    kvb_status st = pending_open(s, n_tokens, out, err);
    if (!st) (*out)->tail = true;
    return st;
}

kvb_block_id kvb_store_slab_take_tail(kvb_slab_pending *p) {
    if (!p || !p->tail || p->n_missing || p->page == KVB_BLOCK_NONE) return KVB_BLOCK_NONE;
    kvb_block_id id = p->page;
    p->page = KVB_BLOCK_NONE; /* the caller's now (still counted as writing): close leaves it alone */
    return id;
}

/* A pending assembly over tokens [0, n_valid) of a fresh private page. */
static kvb_status pending_open(kvb_store *s, uint32_t n_valid, kvb_slab_pending **out, kvb_err *err) {
    const kvb_kvformat *f = &s->fmt;
    const size_t n_cells = (size_t)f->n_layer * f->block_tokens;
    kvb_slab_pending *p = calloc(1, sizeof *p);
    if (p) {
        p->tokens = malloc((size_t)f->block_tokens * sizeof(int32_t));
        p->covered = calloc(n_cells, 1);
    }
    if (!p || !p->tokens || !p->covered) {
        if (p) {
            free(p->tokens);
            free(p->covered);
        }
        free(p);
        return kvb_err_set(err, KVB_ERR_NOMEM, "slab assembly: out of memory");
    }
    kvb_status st = kvb_store_alloc(s, 1, &p->page, err);
    if (st) {
        free(p->tokens);
        free(p->covered);
        free(p);
        return kvb_err_prefix(err, "slab assembly: ");
    }
    p->store = s;
    p->committed = KVB_BLOCK_NONE;
    p->n_valid = n_valid;
    p->n_missing = f->n_layer * n_valid;
    p->phase = PENDING_ASSEMBLING;
    pthread_mutex_lock(&s->mu);
    s->n_pending++;
    pthread_mutex_unlock(&s->mu);
    *out = p;
    return KVB_OK;
}

static kvb_status reject(kvb_slab_pending *p, kvb_err *err, kvb_status code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static kvb_status reject(kvb_slab_pending *p, kvb_err *err, kvb_status code, const char *fmt, ...) {
    kvb_store *s = p->store;
    pthread_mutex_lock(&s->mu);
    s->slabs_rejected++;
    pthread_mutex_unlock(&s->mu);
    if (err) {
        char msg[sizeof err->msg];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        kvb_err_set(err, code, "slab rejected (block key %016llx): %s", (unsigned long long)p->key, msg);
    }
    return code;
}

kvb_status kvb_store_slab_put(kvb_slab_pending *p, uint32_t layer, uint32_t token0, uint32_t n_tokens,
                              const void *k, size_t k_bytes, const void *v, size_t v_bytes, uint64_t checksum,
                              kvb_block_id *committed_out, kvb_err *err) {
    if (committed_out) *committed_out = KVB_BLOCK_NONE;
    if (!p) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: no pending block");
    kvb_store *s = p->store;
    const kvb_kvformat *f = &s->fmt;
    const uint32_t bt = f->block_tokens, nkv = f->n_head_kv;
    const size_t row = kvb_kvformat_row_bytes(f);

    /* ---- validate everything before a byte is copied ---- */
    if (p->phase == PENDING_COMMITTED)
        return reject(p, err, KVB_ERR_FORMAT, "layer %u tokens %u+%u: the block is already complete (duplicate)",
                      layer, token0, n_tokens);
    if (p->phase == PENDING_FAILED)
        return reject(p, err, KVB_ERR_INVALID, "the block's commit was refused; close it");
    if (layer >= f->n_layer)
        return reject(p, err, KVB_ERR_FORMAT, "layer %u is out of range (the format has %u layers)", layer,
                      f->n_layer);
    if (n_tokens == 0 || token0 >= p->n_valid || n_tokens > p->n_valid - token0)
        return reject(p, err, KVB_ERR_FORMAT, "token range %u+%u is not inside the %s (0..%u)", token0, n_tokens,
                      p->tail ? "tail" : "block", p->n_valid);
    if (p->page == KVB_BLOCK_NONE)
        return reject(p, err, KVB_ERR_INVALID, "layer %u tokens %u+%u: the tail was already taken", layer, token0,
                      n_tokens);
    const size_t want = (size_t)n_tokens * nkv * row;
    if (k_bytes != want || v_bytes != want)
        return reject(p, err, KVB_ERR_FORMAT,
                      "layer %u tokens %u+%u: K is %zu bytes and V is %zu bytes, expected %zu each "
                      "(%u tokens x %u kv heads x %zu row bytes)",
                      layer, token0, n_tokens, k_bytes, v_bytes, want, n_tokens, nkv, row);
    if (!k || !v) return reject(p, err, KVB_ERR_FORMAT, "layer %u tokens %u+%u: K or V bytes are missing", layer,
                                token0, n_tokens);
    if (token0 < p->local_lo && kvb_kvformat_layer_local(f, layer))
        return reject(p, err, KVB_ERR_FORMAT,
                      "layer %u tokens %u+%u: a local (sliding-window) layer's rows before token %u are not kept by "
                      "the decoder",
                      layer, token0, n_tokens, p->local_lo);
    uint8_t *cov = p->covered + (size_t)layer * bt;
    for (uint32_t t = token0; t < token0 + n_tokens; t++)
        if (cov[t])
            return reject(p, err, KVB_ERR_FORMAT,
                          "layer %u tokens %u+%u: token %u of this layer has already arrived (duplicate or "
                          "overlapping slab)",
                          layer, token0, n_tokens, t);
    uint64_t got = kvb_slab_checksum(k, k_bytes, v, v_bytes);
    if (got != checksum)
        return reject(p, err, KVB_ERR_FORMAT,
                      "layer %u tokens %u+%u: checksum mismatch (slab says %016llx, bytes hash to %016llx): corrupt",
                      layer, token0, n_tokens, (unsigned long long)checksum, (unsigned long long)got);

    /* ---- scatter (token, kv_head, row) -> (layer, kv, kv_head, token, head_dim) ---- */
    kvb_kvformat_scatter_rows(f, kvb_store_block_data(s, p->page), layer, token0, n_tokens, k, v);
    memset(cov + token0, 1, n_tokens);
    p->n_missing -= n_tokens;
    p->n_accepted++;
    pthread_mutex_lock(&s->mu);
    s->slabs_accepted++;
    pthread_mutex_unlock(&s->mu);
    if (p->n_missing || p->tail) return KVB_OK; /* a complete tail waits to be taken, never committed */

    /* ---- complete: publish through the one block writer ---- */
    kvb_block_id id;
    kvb_status st = kvb_store_commit_block_kept(s, p->page, p->key, p->parent_key, p->tokens, p->local_lo, &id, err);
    if (st) {
        p->phase = PENDING_FAILED;
        return kvb_err_prefix(err, "slab assembly: ");
    }
    p->phase = PENDING_COMMITTED;
    p->page = KVB_BLOCK_NONE; /* committed, or freed by a dedup */
    p->committed = id;
    if (committed_out)
        *committed_out = id;
    else
        kvb_store_release(s, &id, 1, NULL);
    return KVB_OK;
}

kvb_status kvb_store_slab_keep_local_from(kvb_slab_pending *p, uint32_t token0, kvb_err *err) {
    if (!p) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: no pending block");
    const kvb_kvformat *f = &p->store->fmt;
    if (token0 == p->local_lo) return KVB_OK;
    if (p->tail) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: a tail keeps every local row");
    if (!f->window) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: the cache format has no local layers");
    if (token0 > f->block_tokens)
        return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: local rows kept from token %u of a %u-token block",
                           token0, f->block_tokens);
    if (p->n_accepted || p->phase != PENDING_ASSEMBLING || p->local_lo)
        return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: the kept local rows are set before the first slab");
    for (uint32_t l = 0; l < f->n_layer; l++)
        if (kvb_kvformat_layer_local(f, l)) {
            memset(p->covered + (size_t)l * f->block_tokens, 1, token0); /* not expected: never arrive */
            p->n_missing -= token0;
        }
    p->local_lo = token0;
    return KVB_OK;
}

uint32_t kvb_store_slab_missing(const kvb_slab_pending *p) { return p->n_missing; }

uint32_t kvb_store_slab_layer_missing(const kvb_slab_pending *p, uint32_t layer) {
    const kvb_kvformat *f = &p->store->fmt;
    if (layer >= f->n_layer) return 0;
    const uint8_t *cov = p->covered + (size_t)layer * f->block_tokens; /* (block_tokens) */
    uint32_t missing = 0;
    for (uint32_t t = 0; t < p->n_valid; t++) missing += !cov[t];
    return missing;
}
bool kvb_store_slab_committed(const kvb_slab_pending *p) { return p->phase == PENDING_COMMITTED; }
kvb_block_id kvb_store_slab_block(const kvb_slab_pending *p) {
    return p->phase == PENDING_COMMITTED ? p->committed : p->page;
}

void kvb_store_slab_close(kvb_slab_pending *p) {
    if (!p) return;
    kvb_store *s = p->store;
    pthread_mutex_lock(&s->mu);
    if (p->page != KVB_BLOCK_NONE) kvb_store_free_page_locked(s, p->page); /* never committed: discard */
    s->n_pending--;
    pthread_mutex_unlock(&s->mu);
    free(p->tokens);
    free(p->covered);
    free(p);
}
