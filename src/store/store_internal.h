/* store/store_internal.h — private to the store's files (not a contract): the store and block
 * metadata structures, and the helpers the files share. Functions named *_locked must be called
 * with s->mu held. */
#ifndef KVB_STORE_INTERNAL_H
#define KVB_STORE_INTERNAL_H

#include <pthread.h>

#include "kvb_store.h"

typedef enum { BLOCK_FREE = 0, BLOCK_WRITING = 1, BLOCK_COMMITTED = 2 } block_state;

typedef struct {
    uint64_t key;             /* COMMITTED: chain key */
    uint64_t parent_key;      /* COMMITTED: parent's chain key (root for block 0 of a chain) */
    uint32_t state;           /* block_state */
    uint32_t refs;            /* COMMITTED: references held by sequences/callers */
    kvb_block_id lru_prev;    /* COMMITTED with refs == 0: neighbours on the LRU list */
    kvb_block_id lru_next;
    kvb_block_id index_next;  /* COMMITTED: next block in the same index bucket */
    uint32_t local_lo;        /* COMMITTED: the block's local-layer rows are kept for tokens [local_lo,
                                 block_tokens) only (0: every row; always 0 without local layers) */
    uint32_t local_released;  /* 1: the memory of the page's local part was given back to the system */
} block_meta;

struct kvb_store {
    kvb_kvformat fmt;
    uint64_t model_fp, format_fp, root_key;
    size_t block_bytes;
    uint32_t n_blocks;
    uint8_t *arena;           /* (n_blocks, block_bytes) */
    block_meta *meta;         /* (n_blocks) */
    int32_t *tokens;          /* (n_blocks, block_tokens): token ids of each COMMITTED block */
    kvb_block_id *free_stack; /* (n_blocks) ids of FREE pages; top = free_stack[n_free - 1] */
    uint32_t n_free;
    kvb_block_id lru_head;    /* least recently used evictable block */
    kvb_block_id lru_tail;    /* most recently used evictable block */
    kvb_block_id *buckets;    /* (bucket_mask + 1) heads of index chains */
    uint32_t bucket_mask;
    uint32_t n_writing, n_committed, n_referenced, n_evictable, n_pending;
    uint64_t commits, dedups, commit_refusals, evictions, alloc_failures, lookups, lookup_hit_blocks;
    uint64_t slabs_accepted, slabs_rejected;
    uint64_t local_completions, lookup_window_cuts, local_drops;
    uint32_t n_local_released; /* pages whose local part is given back */
    size_t local_release_off, local_release_len; /* page-aligned span inside a page's local part */
    pthread_mutex_t mu;
};

/* commit.c: kvb_store_commit_block for a block whose local-layer rows are kept from token local_lo
 * on (slab assembly of a block the bridge cut). */
kvb_status kvb_store_commit_block_kept(kvb_store *s, kvb_block_id id, uint64_t key, uint64_t parent_key,
                                       const int32_t *tokens, uint32_t local_lo, kvb_block_id *committed_out,
                                       kvb_err *err);

/* arena.c: a page's local part back to the system (a committed block that keeps none of its
 * local rows), and the bookkeeping when its memory is used again. */
void kvb_store_release_local_locked(kvb_store *s, kvb_block_id id);
void kvb_store_reuse_local_locked(kvb_store *s, kvb_block_id id);

/* chain_index.c: the key -> committed block hash index (chained through meta.index_next). */
kvb_block_id kvb_store_index_find_locked(const kvb_store *s, uint64_t key);
void kvb_store_index_insert_locked(kvb_store *s, kvb_block_id id);
void kvb_store_index_remove_locked(kvb_store *s, kvb_block_id id);

/* arena.c: LRU list of evictable blocks, free pages. */
void kvb_store_lru_push_mru_locked(kvb_store *s, kvb_block_id id);
void kvb_store_lru_unlink_locked(kvb_store *s, kvb_block_id id);
void kvb_store_free_page_locked(kvb_store *s, kvb_block_id id); /* WRITING -> FREE */

#endif
