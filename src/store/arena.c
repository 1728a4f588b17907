/* store/arena.c — the store's pages: creation of the arena and its metadata, the free-page
 * stack, the LRU list of evictable (committed, unreferenced) blocks, allocation with eviction,
 * references (retain/release), stats and the invariant check. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "store_internal.h"

kvb_status kvb_store_create(const kvb_kvformat *fmt, uint64_t model_fingerprint, uint32_t n_blocks, kvb_store **out,
                            kvb_err *err) {
    *out = NULL;
    if (!fmt || fmt->block_tokens == 0 || fmt->n_layer == 0 || fmt->n_head_kv == 0 ||
        kvb_kvformat_row_bytes(fmt) == 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "block store: the cache format is missing or empty");
    if (n_blocks == 0 || n_blocks == KVB_BLOCK_NONE)
        return kvb_err_set(err, KVB_ERR_RANGE, "block store: %u blocks is out of range (1..%u)", n_blocks,
                           KVB_BLOCK_NONE - 1);
    const size_t block_bytes = kvb_kvformat_block_bytes(fmt);
    uint64_t arena_bytes;
    if (kvb_mul_overflow_u64(block_bytes, n_blocks, &arena_bytes) || arena_bytes > ((uint64_t)1 << 40))
        return kvb_err_set(err, KVB_ERR_RANGE, "block store: %u blocks x %zu bytes exceeds 1 TiB", n_blocks,
                           block_bytes);
    kvb_store *s = calloc(1, sizeof *s);
    if (!s) return kvb_err_set(err, KVB_ERR_NOMEM, "block store: out of memory");
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s);
        return kvb_err_set(err, KVB_ERR_INTERNAL, "block store: cannot create its mutex");
    }
    s->fmt = *fmt;
    s->model_fp = model_fingerprint;
    s->format_fp = kvb_kvformat_fingerprint(fmt);
    s->root_key = kvb_chain_root(s->model_fp, s->format_fp);
    s->block_bytes = block_bytes;
    s->n_blocks = n_blocks;
    uint32_t n_buckets = 16;
    while (n_buckets < 2 * (uint64_t)n_blocks && n_buckets < (1u << 31)) n_buckets *= 2;
    s->bucket_mask = n_buckets - 1;
    /* local layers: the span of OS pages wholly inside each page's local part, which a block that
     * keeps none of its local rows gives back (page-aligned arena so the span is the same for all) */
    const long os_page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    if (fmt->window) {
        size_t len, off = kvb_kvformat_local_part(fmt, &len);
        const size_t lo = (off + (size_t)os_page - 1) / (size_t)os_page * (size_t)os_page;
        const size_t hi = (off + len) / (size_t)os_page * (size_t)os_page;
        if (block_bytes % (size_t)os_page == 0 && hi > lo) { /* every page the same span */
            s->local_release_off = lo;
            s->local_release_len = hi - lo;
        }
    }
    s->arena = kvb_aligned_alloc(fmt->window ? (size_t)os_page : 64, (size_t)arena_bytes);
    s->meta = calloc(n_blocks, sizeof *s->meta);
    s->tokens = malloc((size_t)n_blocks * fmt->block_tokens * sizeof(int32_t));
    s->free_stack = malloc((size_t)n_blocks * sizeof(kvb_block_id));
    s->buckets = malloc((size_t)n_buckets * sizeof(kvb_block_id));
    if (!s->arena || !s->meta || !s->tokens || !s->free_stack || !s->buckets) {
        kvb_store_free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "block store: out of memory for %u blocks of %zu bytes", n_blocks,
                           block_bytes);
    }
    for (uint32_t i = 0; i < n_buckets; i++) s->buckets[i] = KVB_BLOCK_NONE;
    for (uint32_t i = 0; i < n_blocks; i++) {
        s->meta[i] = (block_meta){.state = BLOCK_FREE, .lru_prev = KVB_BLOCK_NONE, .lru_next = KVB_BLOCK_NONE,
                                  .index_next = KVB_BLOCK_NONE};
        s->free_stack[i] = n_blocks - 1 - i; /* block 0 is handed out first */
    }
    s->n_free = n_blocks;
    s->lru_head = s->lru_tail = KVB_BLOCK_NONE;
    *out = s;
    return KVB_OK;
}

void kvb_store_free(kvb_store *s) {
    if (!s) return;
    pthread_mutex_destroy(&s->mu);
    kvb_aligned_free(s->arena);
    free(s->meta);
    free(s->tokens);
    free(s->free_stack);
    free(s->buckets);
    free(s);
}

void kvb_store_prefault(kvb_store *s) {
    const size_t bytes = (size_t)s->n_blocks * s->block_bytes;
    volatile uint8_t *p = s->arena; /* every write must happen: each one is a page's first touch */
    for (size_t off = 0; off < bytes; off += 4096) {
        const size_t in_page = off % s->block_bytes; /* local parts are touched by whoever writes them */
        if (s->local_release_len && in_page >= s->local_release_off &&
            in_page < s->local_release_off + s->local_release_len)
            continue;
        p[off] = 0;
    }
}

void kvb_store_release_local_locked(kvb_store *s, kvb_block_id id) {
    if (!s->local_release_len || s->meta[id].local_released) return;
    if (madvise(s->arena + (size_t)id * s->block_bytes + s->local_release_off, s->local_release_len,
                MADV_DONTNEED) != 0)
        return; /* kept: nothing is lost but memory */
    s->meta[id].local_released = 1;
    s->n_local_released++;
}

uint32_t kvb_store_drop_local_rows(kvb_store *s, const kvb_block_id *ids, uint32_t n) {
    if (!s->fmt.window) return 0;
    uint32_t dropped = 0;
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = 0; i < n; i++) {
        const kvb_block_id id = ids[i];
        if (id >= s->n_blocks || s->meta[id].state != BLOCK_COMMITTED || s->meta[id].refs != 1 ||
            s->meta[id].local_lo >= s->fmt.block_tokens)
            continue;
        s->meta[id].local_lo = s->fmt.block_tokens; /* keeps no local row: lookups see it (kvb_store_lookup) */
        kvb_store_release_local_locked(s, id);
        dropped++;
    }
    s->local_drops += dropped;
    pthread_mutex_unlock(&s->mu);
    return dropped;
}

void kvb_store_reuse_local_locked(kvb_store *s, kvb_block_id id) {
    if (!s->meta[id].local_released) return; /* the next write faults fresh zero pages in */
    s->meta[id].local_released = 0;
    s->n_local_released--;
}

const kvb_kvformat *kvb_store_kvformat(const kvb_store *s) { return &s->fmt; }
uint32_t kvb_store_n_blocks(const kvb_store *s) { return s->n_blocks; }
size_t kvb_store_block_bytes(const kvb_store *s) { return s->block_bytes; }
uint64_t kvb_store_root_key(const kvb_store *s) { return s->root_key; }

uint8_t *kvb_store_block_data(kvb_store *s, kvb_block_id id) {
    if (id >= s->n_blocks) return NULL;
    return s->arena + (size_t)id * s->block_bytes;
}

/* ---- LRU list: head = least recently used ---------------------------------------------- */

void kvb_store_lru_push_mru_locked(kvb_store *s, kvb_block_id id) {
    block_meta *m = &s->meta[id];
    m->lru_prev = s->lru_tail;
    m->lru_next = KVB_BLOCK_NONE;
    if (s->lru_tail != KVB_BLOCK_NONE)
        s->meta[s->lru_tail].lru_next = id;
    else
        s->lru_head = id;
    s->lru_tail = id;
    s->n_evictable++;
}

void kvb_store_lru_unlink_locked(kvb_store *s, kvb_block_id id) {
    block_meta *m = &s->meta[id];
    if (m->lru_prev != KVB_BLOCK_NONE)
        s->meta[m->lru_prev].lru_next = m->lru_next;
    else
        s->lru_head = m->lru_next;
    if (m->lru_next != KVB_BLOCK_NONE)
        s->meta[m->lru_next].lru_prev = m->lru_prev;
    else
        s->lru_tail = m->lru_prev;
    m->lru_prev = m->lru_next = KVB_BLOCK_NONE;
    s->n_evictable--;
}

void kvb_store_free_page_locked(kvb_store *s, kvb_block_id id) {
    s->meta[id].state = BLOCK_FREE;
    s->n_writing--;
    s->free_stack[s->n_free++] = id;
}

/* ---- allocation -------------------------------------------------------------------------- */

kvb_status kvb_store_alloc(kvb_store *s, uint32_t n, kvb_block_id *ids_out, kvb_err *err) {
    if (n && !ids_out)
        return kvb_err_set(err, KVB_ERR_INVALID, "block store: alloc of %u blocks needs an output array", n);
    pthread_mutex_lock(&s->mu);
    if ((uint64_t)s->n_free + s->n_evictable < n) {
        s->alloc_failures++;
        uint32_t free = s->n_free, evictable = s->n_evictable, referenced = s->n_referenced, writing = s->n_writing;
        pthread_mutex_unlock(&s->mu);
        return kvb_err_set(err, KVB_ERR_RANGE,
                           "block store is full: %u block(s) wanted, %u free + %u evictable of %u (%u referenced by "
                           "sequences, %u being written); nothing more can be evicted: release blocks or raise the "
                           "store size",
                           n, free, evictable, s->n_blocks, referenced, writing);
    }
    for (uint32_t i = 0; i < n; i++) {
        kvb_block_id id;
        if (s->n_free) {
            id = s->free_stack[--s->n_free];
        } else {
            id = s->lru_head; /* evict the least recently used unreferenced committed block */
            kvb_store_lru_unlink_locked(s, id);
            kvb_store_index_remove_locked(s, id);
            s->n_committed--;
            s->evictions++;
        }
        kvb_store_reuse_local_locked(s, id);
        s->meta[id].state = BLOCK_WRITING;
        s->meta[id].refs = 0;
        s->n_writing++;
        ids_out[i] = id;
    }
    pthread_mutex_unlock(&s->mu);
    return KVB_OK;
}

/* ---- references ---------------------------------------------------------------------------- */

kvb_status kvb_store_retain(kvb_store *s, const kvb_block_id *ids, uint32_t n, kvb_err *err) {
    if (n && !ids) return kvb_err_set(err, KVB_ERR_INVALID, "block store: retain of %u blocks without their ids", n);
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] >= s->n_blocks || s->meta[ids[i]].state != BLOCK_COMMITTED) {
            kvb_block_id bad = ids[i];
            pthread_mutex_unlock(&s->mu);
            return kvb_err_set(err, KVB_ERR_INVALID, "block store: cannot retain block %u: %s", bad,
                               bad >= s->n_blocks ? "no such block" : "it is not committed");
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        block_meta *m = &s->meta[ids[i]];
        if (m->refs++ == 0) {
            kvb_store_lru_unlink_locked(s, ids[i]);
            s->n_referenced++;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return KVB_OK;
}

kvb_status kvb_store_release(kvb_store *s, const kvb_block_id *ids, uint32_t n, kvb_err *err) {
    kvb_block_id bad = KVB_BLOCK_NONE;
    const char *why = NULL;
    uint32_t n_bad = 0;
    if (n && !ids) return kvb_err_set(err, KVB_ERR_INVALID, "block store: release of %u blocks without their ids", n);
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = n; i-- > 0;) { /* last to first: a chain's head becomes the most recently used */
        kvb_block_id id = ids[i];
        const char *w = NULL;
        if (id >= s->n_blocks) {
            w = "no such block";
        } else if (s->meta[id].state == BLOCK_WRITING) {
            kvb_store_free_page_locked(s, id);
        } else if (s->meta[id].state == BLOCK_COMMITTED && s->meta[id].refs > 0) {
            if (--s->meta[id].refs == 0) {
                s->n_referenced--;
                kvb_store_lru_push_mru_locked(s, id);
            }
        } else {
            w = s->meta[id].state == BLOCK_FREE ? "it is free" : "it holds no reference";
        }
        if (w) {
            n_bad++;
            bad = id;
            why = w;
        }
    }
    pthread_mutex_unlock(&s->mu);
    if (n_bad)
        return kvb_err_set(err, KVB_ERR_INVALID, "block store: %u release(s) skipped; block %u: %s (double release?)",
                           n_bad, bad, why);
    return KVB_OK;
}

/* ---- stats and invariants ------------------------------------------------------------------ */

void kvb_store_get_stats(kvb_store *s, kvb_store_stats *o) {
    pthread_mutex_lock(&s->mu);
    *o = (kvb_store_stats){
        .n_blocks = s->n_blocks,
        .free = s->n_free,
        .writing = s->n_writing,
        .committed = s->n_committed,
        .referenced = s->n_referenced,
        .evictable = s->n_evictable,
        .pending_slab_blocks = s->n_pending,
        .commits = s->commits,
        .dedups = s->dedups,
        .commit_refusals = s->commit_refusals,
        .evictions = s->evictions,
        .alloc_failures = s->alloc_failures,
        .lookups = s->lookups,
        .lookup_hit_blocks = s->lookup_hit_blocks,
        .slabs_accepted = s->slabs_accepted,
        .slabs_rejected = s->slabs_rejected,
        .local_completions = s->local_completions,
        .local_drops = s->local_drops,
        .lookup_window_cuts = s->lookup_window_cuts,
        .local_released = s->n_local_released,
        .local_released_bytes = (uint64_t)s->n_local_released * s->local_release_len,
    };
    pthread_mutex_unlock(&s->mu);
}

static kvb_status check_locked(kvb_store *s, kvb_err *err) {
    const uint32_t N = s->n_blocks;
    uint32_t n_state[3] = {0, 0, 0}, n_ref = 0, n_zero = 0;
    for (uint32_t i = 0; i < N; i++) {
        const block_meta *m = &s->meta[i];
        if (m->state > BLOCK_COMMITTED)
            return kvb_err_set(err, KVB_ERR_INTERNAL, "block %u: bad state %u", i, m->state);
        n_state[m->state]++;
        if (m->state != BLOCK_COMMITTED && m->refs)
            return kvb_err_set(err, KVB_ERR_INTERNAL, "block %u: not committed but has %u refs", i, m->refs);
        if (m->state == BLOCK_COMMITTED) {
            if (m->local_lo > (s->fmt.window ? s->fmt.block_tokens : 0))
                return kvb_err_set(err, KVB_ERR_INTERNAL, "block %u: local rows kept from token %u", i, m->local_lo);
            if (m->local_released && m->local_lo != s->fmt.block_tokens)
                return kvb_err_set(err, KVB_ERR_INTERNAL, "block %u: local part given back but rows kept", i);
            if (m->refs) n_ref++;
            else n_zero++;
            if (kvb_store_index_find_locked(s, m->key) != i)
                return kvb_err_set(err, KVB_ERR_INTERNAL, "block %u: committed but its key is not indexed to it", i);
            if (kvb_chain_next(m->parent_key, s->tokens + (size_t)i * s->fmt.block_tokens, s->fmt.block_tokens) !=
                m->key)
                return kvb_err_set(err, KVB_ERR_INTERNAL, "block %u: key does not match parent key and tokens", i);
        }
    }
    uint32_t n_released = 0;
    for (uint32_t i = 0; i < N; i++) n_released += s->meta[i].local_released != 0;
    if (n_released != s->n_local_released)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "%u pages with their local part given back, counted %u", n_released,
                           s->n_local_released);
    if (n_state[BLOCK_FREE] != s->n_free || n_state[BLOCK_WRITING] != s->n_writing ||
        n_state[BLOCK_COMMITTED] != s->n_committed || n_ref != s->n_referenced || n_zero != s->n_evictable)
        return kvb_err_set(err, KVB_ERR_INTERNAL,
                           "counts: free %u/%u writing %u/%u committed %u/%u referenced %u/%u evictable %u/%u",
                           n_state[BLOCK_FREE], s->n_free, n_state[BLOCK_WRITING], s->n_writing,
                           n_state[BLOCK_COMMITTED], s->n_committed, n_ref, s->n_referenced, n_zero, s->n_evictable);
    if (s->n_pending > s->n_writing)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "%u pending slab blocks but only %u writing", s->n_pending,
                           s->n_writing);
    for (uint32_t i = 0; i < s->n_free; i++)
        if (s->free_stack[i] >= N || s->meta[s->free_stack[i]].state != BLOCK_FREE)
            return kvb_err_set(err, KVB_ERR_INTERNAL, "free stack slot %u holds block %u which is not free", i,
                               s->free_stack[i]);
    uint32_t walked = 0;
    kvb_block_id prev = KVB_BLOCK_NONE;
    for (kvb_block_id id = s->lru_head; id != KVB_BLOCK_NONE; id = s->meta[id].lru_next) {
        if (id >= N || ++walked > s->n_evictable || s->meta[id].state != BLOCK_COMMITTED || s->meta[id].refs ||
            s->meta[id].lru_prev != prev)
            return kvb_err_set(err, KVB_ERR_INTERNAL, "LRU list broken at block %u", id);
        prev = id;
    }
    if (walked != s->n_evictable || prev != s->lru_tail)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "LRU list holds %u blocks, %u evictable", walked, s->n_evictable);
    uint32_t indexed = 0;
    for (uint32_t b = 0; b <= s->bucket_mask; b++)
        for (kvb_block_id id = s->buckets[b]; id != KVB_BLOCK_NONE; id = s->meta[id].index_next) {
            if (id >= N || ++indexed > s->n_committed || s->meta[id].state != BLOCK_COMMITTED)
                return kvb_err_set(err, KVB_ERR_INTERNAL, "index bucket %u holds block %u which is not committed", b,
                                   id);
        }
    if (indexed != s->n_committed)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "index holds %u blocks, %u committed", indexed, s->n_committed);
    return KVB_OK;
}

kvb_status kvb_store_check(kvb_store *s, kvb_err *err) {
    pthread_mutex_lock(&s->mu);
    kvb_status st = check_locked(s, err);
    pthread_mutex_unlock(&s->mu);
    return st;
}
