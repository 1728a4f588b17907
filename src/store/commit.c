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

kvb_status kvb_store_commit_block(kvb_store *s, kvb_block_id id, uint64_t key, uint64_t parent_key,
                                  const int32_t *tokens, kvb_block_id *committed_out, kvb_err *err) {
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
        kvb_store_free_page_locked(s, id); /* dedup: the first committed copy wins */
        reference_locked(s, existing);
        s->dedups++;
        *committed_out = existing;
        pthread_mutex_unlock(&s->mu);
        return KVB_OK;
    }
    block_meta *m = &s->meta[id];
    m->key = key;
    m->parent_key = parent_key;
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
    for (uint32_t i = 0; i < found; i++) reference_locked(s, ids_out[i]);
    s->lookups++;
    s->lookup_hit_blocks += found;
    pthread_mutex_unlock(&s->mu);
    *n_blocks_out = found;
    return KVB_OK;
}
