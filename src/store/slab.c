/* store/slab.c — slab assembly for the bridge receiver: a pending block owns one private
 * WRITING page, a coverage map (layer, token) and a mutex; each slab is validated completely
 * (layer, token range, exact K and V lengths, no cell already covered or claimed, XXH3-64 of K || V)
 * before any byte is copied, then scattered from the slab's (token, kv_head, row) order into the
 * block layout (layer, kv, kv_head, token, head_dim). Puts on one pending may run on several threads
 * at once: under the pending's mutex a put checks the slab and CLAIMS its cells (covered = 2), then
 * hashes and scatters with the mutex released (the cells of distinct claims are disjoint bytes of
 * the page), and re-takes it to mark the cells arrived (covered = 1) or, on a checksum mismatch, to
 * give the claim back. The slab that completes the coverage commits the block, still under the
 * pending's mutex, through kvb_store_commit_block, the same writer the engine uses. Lock order: a
 * pending's mutex, then the store's (s->mu); nothing takes them the other way round. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#include "store_internal.h"

typedef enum { PENDING_ASSEMBLING = 0, PENDING_COMMITTED, PENDING_FAILED } pending_phase;

/* covered cell values */
enum { CELL_MISSING = 0, CELL_ARRIVED = 1, CELL_CLAIMED = 2 };

struct kvb_slab_pending {
    kvb_store *store;
    /* set at begin, then read-only */
    uint64_t key, parent_key;
    int32_t *tokens;        /* (block_tokens) */
    uint32_t n_valid;       /* tokens [0, n_valid) of the page are assembled: block_tokens, or a tail's length */
    bool tail;              /* a tail: never committed; its page is taken by a sequence */
    /* guarded by mu */
    pthread_mutex_t mu;
    kvb_block_id page;      /* the WRITING page while assembling or failed; NONE once committed or taken */
    kvb_block_id committed; /* the committed id (may differ from page after a dedup) */
    uint32_t n_missing;     /* (layer, token) cells not yet arrived (claimed ones included) */
    pending_phase phase;
    uint8_t *covered;       /* (n_layer, block_tokens): CELL_ARRIVED once that layer of that token is in the
                               page (or is a local row not kept), CELL_CLAIMED while a put is scattering it */
    uint32_t local_lo;      /* local layers' rows of tokens before this are not kept (never arrive) */
    uint32_t n_inflight;    /* puts between their claim and its end (arrived or given back) */
    uint64_t n_accepted;    /* slabs accepted so far */
};

uint64_t kvb_slab_checksum(const void *k, size_t k_bytes, const void *v, size_t v_bytes) {
    const kvb_bytes kv[2] = {{k, k_bytes}, {v, v_bytes}};
    return kvb_xxh3_pieces(kv, 2);
}

/* The getters take the mutex of a pending they see as const. */
static pthread_mutex_t *pending_mu(const kvb_slab_pending *p) { return (pthread_mutex_t *)&p->mu; }

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
    if (!p) return KVB_BLOCK_NONE;
    kvb_block_id id = KVB_BLOCK_NONE;
    pthread_mutex_lock(&p->mu);
    if (p->tail && !p->n_missing && p->page != KVB_BLOCK_NONE) { /* n_missing == 0: no put is scattering */
        id = p->page;
        p->page = KVB_BLOCK_NONE; /* the caller's now (still counted as writing): close leaves it alone */
    }
    pthread_mutex_unlock(&p->mu);
    return id;
}

static void pending_free(kvb_slab_pending *p) {
    if (!p) return;
    free(p->tokens);
    free(p->covered);
    free(p);
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
    if (!p || !p->tokens || !p->covered || pthread_mutex_init(&p->mu, NULL)) {
        pending_free(p);
        return kvb_err_set(err, KVB_ERR_NOMEM, "slab assembly: out of memory");
    }
    kvb_status st = kvb_store_alloc(s, 1, &p->page, err);
    if (st) {
        pthread_mutex_destroy(&p->mu);
        pending_free(p);
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

/* Counts a rejected slab and words its error. Takes s->mu: the caller may hold p->mu (that order). */
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

/* Every check a slab passes before its bytes are looked at; on success its cells are CLAIMED for
 * this put and *page_out is the page to scatter into. Caller holds p->mu. */
static kvb_status claim_locked(kvb_slab_pending *p, uint32_t layer, uint32_t token0, uint32_t n_tokens,
                               const void *k, size_t k_bytes, const void *v, size_t v_bytes, kvb_block_id *page_out,
                               kvb_err *err) {
    const kvb_kvformat *f = &p->store->fmt;
    const uint32_t bt = f->block_tokens, nkv = f->n_head_kv;
    const size_t row = kvb_kvformat_row_bytes(f);
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
    const size_t want = (size_t)n_tokens * nkv * row, want_v = kvb_kvformat_parts(f) == 2 ? want : 0;
    if (k_bytes != want || v_bytes != want_v)
        return reject(p, err, KVB_ERR_FORMAT,
                      "layer %u tokens %u+%u: K is %zu bytes and V is %zu bytes, expected %zu and %zu "
                      "(%u tokens x %u kv heads x %zu row bytes)",
                      layer, token0, n_tokens, k_bytes, v_bytes, want, want_v, n_tokens, nkv, row);
    if (!k || (want_v && !v)) return reject(p, err, KVB_ERR_FORMAT, "layer %u tokens %u+%u: K or V bytes are missing", layer,
                                token0, n_tokens);
    if (token0 < p->local_lo && kvb_kvformat_layer_local(f, layer))
        return reject(p, err, KVB_ERR_FORMAT,
                      "layer %u tokens %u+%u: a local (sliding-window) layer's rows before token %u are not kept by "
                      "the decoder",
                      layer, token0, n_tokens, p->local_lo);
    uint8_t *cov = p->covered + (size_t)layer * bt; /* (block_tokens) */
    for (uint32_t t = token0; t < token0 + n_tokens; t++)
        if (cov[t])
            return reject(p, err, KVB_ERR_FORMAT,
                          "layer %u tokens %u+%u: token %u of this layer has %s (duplicate or overlapping slab)",
                          layer, token0, n_tokens, t,
                          cov[t] == CELL_ARRIVED ? "already arrived" : "already been claimed by a slab being put");
    memset(cov + token0, CELL_CLAIMED, n_tokens);
    p->n_inflight++;
    *page_out = p->page;
    return KVB_OK;
}

kvb_status kvb_store_slab_put(kvb_slab_pending *p, uint32_t layer, uint32_t token0, uint32_t n_tokens,
                              const void *k, size_t k_bytes, const void *v, size_t v_bytes, uint64_t checksum,
                              kvb_block_id *committed_out, kvb_err *err) {
    if (committed_out) *committed_out = KVB_BLOCK_NONE;
    if (!p) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: no pending block");
    kvb_store *s = p->store;
    const kvb_kvformat *f = &s->fmt;

    /* ---- validate everything and claim the cells before a byte is copied ---- */
    kvb_block_id page = KVB_BLOCK_NONE;
    pthread_mutex_lock(&p->mu);
    kvb_status st = claim_locked(p, layer, token0, n_tokens, k, k_bytes, v, v_bytes, &page, err);
    pthread_mutex_unlock(&p->mu);
    if (st) return st;
    /* the cells are ours: no other put writes them, and the page stays until they arrive */
    uint8_t *cov = p->covered + (size_t)layer * f->block_tokens; /* (block_tokens) */
    uint64_t got = kvb_slab_checksum(k, k_bytes, v, v_bytes);
    if (got != checksum) {
        pthread_mutex_lock(&p->mu);
        memset(cov + token0, CELL_MISSING, n_tokens); /* a retransmission may follow */
        p->n_inflight--;
        pthread_mutex_unlock(&p->mu);
        return reject(p, err, KVB_ERR_FORMAT,
                      "layer %u tokens %u+%u: checksum mismatch (slab says %016llx, bytes hash to %016llx): corrupt",
                      layer, token0, n_tokens, (unsigned long long)checksum, (unsigned long long)got);
    }

    /* ---- scatter (token, kv_head, row) -> (layer, kv, kv_head, token, head_dim) ---- */
    kvb_kvformat_scatter_rows_stream(f, kvb_store_block_data(s, page), layer, token0, n_tokens, k, v);

    pthread_mutex_lock(&p->mu);
    memset(cov + token0, CELL_ARRIVED, n_tokens);
    p->n_inflight--;
    p->n_missing -= n_tokens;
    p->n_accepted++;
    pthread_mutex_lock(&s->mu);
    s->slabs_accepted++;
    pthread_mutex_unlock(&s->mu);
    if (p->n_missing || p->tail) { /* a complete tail waits to be taken, never committed */
        pthread_mutex_unlock(&p->mu);
        return KVB_OK;
    }

    /* ---- complete (every other put has ended): publish through the one block writer ---- */
    kvb_block_id id;
    st = kvb_store_commit_block_kept(s, p->page, p->key, p->parent_key, p->tokens, p->local_lo, &id, err);
    if (st) {
        p->phase = PENDING_FAILED;
        pthread_mutex_unlock(&p->mu);
        return kvb_err_prefix(err, "slab assembly: ");
    }
    p->phase = PENDING_COMMITTED;
    p->page = KVB_BLOCK_NONE; /* committed, or freed by a dedup */
    p->committed = id;
    pthread_mutex_unlock(&p->mu);
    if (committed_out)
        *committed_out = id;
    else
        kvb_store_release(s, &id, 1, NULL);
    return KVB_OK;
}

/* Caller holds p->mu; token0 != p->local_lo. */
static kvb_status keep_local_from_locked(kvb_slab_pending *p, uint32_t token0, kvb_err *err) {
    const kvb_kvformat *f = &p->store->fmt;
    if (p->tail) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: a tail keeps every local row");
    if (!f->window) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: the cache format has no local layers");
    if (token0 > f->block_tokens)
        return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: local rows kept from token %u of a %u-token block",
                           token0, f->block_tokens);
    if (p->n_accepted || p->n_inflight || p->phase != PENDING_ASSEMBLING || p->local_lo)
        return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: the kept local rows are set before the first slab");
    for (uint32_t l = 0; l < f->n_layer; l++)
        if (kvb_kvformat_layer_local(f, l)) {
            memset(p->covered + (size_t)l * f->block_tokens, CELL_ARRIVED, token0); /* not expected: never arrive */
            p->n_missing -= token0;
        }
    p->local_lo = token0;
    return KVB_OK;
}

kvb_status kvb_store_slab_keep_local_from(kvb_slab_pending *p, uint32_t token0, kvb_err *err) {
    if (!p) return kvb_err_set(err, KVB_ERR_INVALID, "slab assembly: no pending block");
    pthread_mutex_lock(&p->mu);
    kvb_status st = token0 == p->local_lo ? KVB_OK : keep_local_from_locked(p, token0, err);
    pthread_mutex_unlock(&p->mu);
    return st;
}

uint32_t kvb_store_slab_missing(const kvb_slab_pending *p) {
    pthread_mutex_lock(pending_mu(p));
    const uint32_t missing = p->n_missing;
    pthread_mutex_unlock(pending_mu(p));
    return missing;
}

uint32_t kvb_store_slab_layer_missing(const kvb_slab_pending *p, uint32_t layer) {
    const kvb_kvformat *f = &p->store->fmt;
    if (layer >= f->n_layer) return 0;
    const uint8_t *cov = p->covered + (size_t)layer * f->block_tokens; /* (block_tokens) */
    uint32_t missing = 0;
    pthread_mutex_lock(pending_mu(p));
    for (uint32_t t = 0; t < p->n_valid; t++) missing += cov[t] != CELL_ARRIVED; /* a claimed cell is not in yet */
    pthread_mutex_unlock(pending_mu(p));
    return missing;
}

bool kvb_store_slab_committed(const kvb_slab_pending *p) {
    pthread_mutex_lock(pending_mu(p));
    const bool committed = p->phase == PENDING_COMMITTED;
    pthread_mutex_unlock(pending_mu(p));
    return committed;
}

kvb_block_id kvb_store_slab_block(const kvb_slab_pending *p) {
    pthread_mutex_lock(pending_mu(p));
    const kvb_block_id id = p->phase == PENDING_COMMITTED ? p->committed : p->page;
    pthread_mutex_unlock(pending_mu(p));
    return id;
}

void kvb_store_slab_close(kvb_slab_pending *p) {
    if (!p) return;
    kvb_store *s = p->store;
    pthread_mutex_lock(&p->mu); /* no put is in flight (the contract); this orders close after the last */
    pthread_mutex_lock(&s->mu);
    if (p->page != KVB_BLOCK_NONE) kvb_store_free_page_locked(s, p->page); /* never committed: discard */
    s->n_pending--;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_destroy(&p->mu);
    pending_free(p);
}
