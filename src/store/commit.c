/* store/commit.c — the one block writer (commit: WRITING -> COMMITTED, with dedup against an
 * already committed block of the same key) and the prefix lookup (longest committed chain from
 * the root, each block referenced for the caller). */
#include <string.h>

#include "store_internal.h"

static void reference_locked(kvb_store *s, kvb_block_id id) {
    if (s->meta[id].refs++ == 0) {
        kvb_store_lru_unlink_locked(s, id);
        s->n_referenced++;
    }
}

/* The committed block `existing` keeps its local rows from token meta.local_lo on; the WRITING
 * page `id` of the same key holds them from local_lo on, earlier: copy the rows existing lacks.
 * No holder of `existing` reads those rows (a lookup hands a block out only where the window its
 * adopter reads starts at or after local_lo), so the bytes a reader may read never change. */
static void complete_local_locked(kvb_store *s, kvb_block_id existing, kvb_block_id id, uint32_t local_lo) {
    const kvb_kvformat *f = &s->fmt;
    const uint32_t have = s->meta[existing].local_lo;
    const size_t row = kvb_kvformat_row_bytes(f);
    uint8_t *dst = kvb_store_block_data(s, existing);
    const uint8_t *src = kvb_store_block_data(s, id);
    for (uint32_t l = 0; l < f->n_layer; l++) {
        if (!kvb_kvformat_layer_local(f, l)) continue;
        for (uint32_t w = 0; w < kvb_kvformat_parts(f); w++)
            for (uint32_t h = 0; h < f->n_head_kv; h++) {
                const size_t off = kvb_kvformat_row_offset(f, l, w, h, local_lo);
                memcpy(dst + off, src + off, (size_t)(have - local_lo) * row);
            }
    }
    kvb_store_reuse_local_locked(s, existing); /* the copy above faulted its memory back in */
    s->meta[existing].local_lo = local_lo;
    s->local_completions++;
}

kvb_status kvb_store_commit_block(kvb_store *s, kvb_block_id id, uint64_t key, uint64_t parent_key,
                                  const int32_t *tokens, kvb_block_id *committed_out, kvb_err *err) {
    return kvb_store_commit_block_kept(s, id, key, parent_key, tokens, 0, committed_out, err);
}

kvb_status kvb_store_commit_block_kept(kvb_store *s, kvb_block_id id, uint64_t key, uint64_t parent_key,
                                       const int32_t *tokens, uint32_t local_lo, kvb_block_id *committed_out,
                                       kvb_err *err) {
    const uint32_t bt = s->fmt.block_tokens;
    if (committed_out) *committed_out = KVB_BLOCK_NONE;
    if (!tokens || !committed_out) {
        pthread_mutex_lock(&s->mu);
        s->commit_refusals++;
        pthread_mutex_unlock(&s->mu);
        return kvb_err_set(err, KVB_ERR_INVALID, "block store: commit of block %u needs its tokens and an output id",
                           id);
    }
    const uint64_t expected = kvb_chain_next(parent_key, tokens, bt);
    pthread_mutex_lock(&s->mu);
    if (id >= s->n_blocks || s->meta[id].state != BLOCK_WRITING) {
        s->commit_refusals++;
        const char *why = id >= s->n_blocks                         ? "no such block"
                          : s->meta[id].state == BLOCK_FREE         ? "it is free (never allocated, or released)"
                                                                    : "it is already committed";
        pthread_mutex_unlock(&s->mu);
        return kvb_err_set(err, KVB_ERR_INVALID, "block store: cannot commit block %u: %s", id, why);
    }
    if (expected != key) {
        s->commit_refusals++;
        pthread_mutex_unlock(&s->mu);
        return kvb_err_set(err, KVB_ERR_INVALID,
                           "block store: cannot commit block %u: chain key %016llx does not match its parent key "
                           "%016llx and tokens (expected %016llx)",
                           id, (unsigned long long)key, (unsigned long long)parent_key, (unsigned long long)expected);
    }
    kvb_block_id existing = kvb_store_index_find_locked(s, key);
    if (existing != KVB_BLOCK_NONE) {
        if (s->meta[existing].parent_key != parent_key ||
            memcmp(s->tokens + (size_t)existing * bt, tokens, (size_t)bt * sizeof(int32_t)) != 0) {
            s->commit_refusals++;
            pthread_mutex_unlock(&s->mu);
            return kvb_err_set(err, KVB_ERR_INVALID,
                               "block store: cannot commit block %u: chain key %016llx is already held by block %u "
                               "with other tokens or another parent (hash collision)",
                               id, (unsigned long long)key, existing);
        }
        /* dedup: the first committed copy wins; local rows it never kept are taken from this one */
        if (s->meta[existing].local_lo > local_lo) complete_local_locked(s, existing, id, local_lo);
        kvb_store_free_page_locked(s, id);
        reference_locked(s, existing);
        s->dedups++;
        *committed_out = existing;
        pthread_mutex_unlock(&s->mu);
        return KVB_OK;
    }
    block_meta *m = &s->meta[id];
    m->key = key;
    m->parent_key = parent_key;
    m->local_lo = s->fmt.window ? local_lo : 0;
    if (s->fmt.window && m->local_lo >= bt) kvb_store_release_local_locked(s, id); /* keeps no local row */
    m->state = BLOCK_COMMITTED;
    m->refs = 1;
    memcpy(s->tokens + (size_t)id * bt, tokens, (size_t)bt * sizeof(int32_t));
    kvb_store_index_insert_locked(s, id);
    s->n_writing--;
    s->n_committed++;
    s->n_referenced++;
    s->commits++;
    *committed_out = id;
    pthread_mutex_unlock(&s->mu);
    return KVB_OK;
}

kvb_status kvb_store_lookup(kvb_store *s, const int32_t *tokens, uint32_t n_tokens, kvb_block_id *ids_out,
                            uint32_t *n_blocks_out, kvb_err *err) {
    *n_blocks_out = 0;
    const uint32_t bt = s->fmt.block_tokens, n_full = n_tokens / bt;
    if (n_full && (!tokens || !ids_out))
        return kvb_err_set(err, KVB_ERR_INVALID, "block store: lookup of %u tokens needs tokens and an output array",
                           n_tokens);
    uint32_t found = 0;
    pthread_mutex_lock(&s->mu);
    uint64_t parent = s->root_key;
    for (; found < n_full; found++) {
        const int32_t *t = tokens + (size_t)found * bt;
        uint64_t key = kvb_chain_next(parent, t, bt);
        kvb_block_id id = kvb_store_index_find_locked(s, key);
        /* The stored parent key and tokens must match too: a 64-bit key collision is a miss. */
        if (id == KVB_BLOCK_NONE || s->meta[id].parent_key != parent ||
            memcmp(s->tokens + (size_t)id * bt, t, (size_t)bt * sizeof(int32_t)) != 0)
            break;
        ids_out[found] = id;
        parent = key;
    }
    /* Sliding-window layers: whoever adopts c blocks computes position P = c * bt next, whose
     * local layers read keys from max(0, P - window + 1) on; a chain is handed out only as far as
     * every block in that window kept its local rows there (a bridged block may have been cut). */
    const uint32_t before = found;
    while (s->fmt.window && found > 0) {
        const uint64_t P = (uint64_t)found * bt, lo = P > s->fmt.window - 1 ? P - (s->fmt.window - 1) : 0;
        bool ok = true;
        for (uint32_t b = (uint32_t)(lo / bt); b < found && ok; b++) {
            const uint64_t b0 = (uint64_t)b * bt, need = lo > b0 ? lo - b0 : 0; /* first row the window reads */
            ok = s->meta[ids_out[b]].local_lo <= need;
        }
        if (ok) break;
        found--;
    }
    if (found < before) s->lookup_window_cuts++;
    for (uint32_t i = 0; i < found; i++) reference_locked(s, ids_out[i]);
    s->lookups++;
    s->lookup_hit_blocks += found;
    pthread_mutex_unlock(&s->mu);
    *n_blocks_out = found;
    return KVB_OK;
}
