/* store/chain_index.c — chain keys (root from the model and format fingerprints, then one XXH3-64
 * step per full block of token ids) and the hash index from chain key to committed block: a
 * power-of-two bucket array whose chains run through block_meta.index_next. */
#include <string.h>

#include "store_internal.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#include <xxhash.h>
#endif

uint64_t kvb_chain_root(uint64_t model_fingerprint, uint64_t format_fingerprint) {
    uint8_t b[16];
    for (int i = 0; i < 8; i++) {
        b[i] = (uint8_t)(model_fingerprint >> (8 * i));
        b[8 + i] = (uint8_t)(format_fingerprint >> (8 * i));
    }
    return kvb_hash64(b, sizeof b, KVB_CHAIN_ROOT_SEED);
}

uint64_t kvb_chain_next(uint64_t parent_key, const int32_t *tokens, uint32_t n_tokens) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return kvb_hash64(tokens, (size_t)n_tokens * sizeof(int32_t), parent_key);
#else
    /* Big-endian hosts hash the same little-endian bytes, streamed in small pieces. */
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset_withSeed(st, parent_key);
    uint8_t buf[256];
    for (uint32_t i = 0; i < n_tokens;) {
        uint32_t m = 0;
        for (; m < sizeof buf / 4 && i < n_tokens; m++, i++)
            for (int b = 0; b < 4; b++) buf[4 * m + b] = (uint8_t)((uint32_t)tokens[i] >> (8 * b));
        XXH3_64bits_update(st, buf, 4 * (size_t)m);
    }
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
#endif
}

uint32_t kvb_store_chain_keys(const kvb_store *s, const int32_t *tokens, uint32_t n_tokens, uint64_t *keys_out) {
    const uint32_t bt = s->fmt.block_tokens, n = n_tokens / bt;
    uint64_t key = s->root_key;
    for (uint32_t i = 0; i < n; i++) {
        key = kvb_chain_next(key, tokens + (size_t)i * bt, bt);
        keys_out[i] = key;
    }
    return n;
}

static inline uint32_t bucket_of(const kvb_store *s, uint64_t key) {
    /* Keys are hash outputs already; fold the high half in for good measure. */
    return (uint32_t)(key ^ (key >> 32)) & s->bucket_mask;
}

kvb_block_id kvb_store_index_find_locked(const kvb_store *s, uint64_t key) {
    for (kvb_block_id id = s->buckets[bucket_of(s, key)]; id != KVB_BLOCK_NONE; id = s->meta[id].index_next)
        if (s->meta[id].key == key) return id;
    return KVB_BLOCK_NONE;
}

void kvb_store_index_insert_locked(kvb_store *s, kvb_block_id id) {
    uint32_t b = bucket_of(s, s->meta[id].key);
    s->meta[id].index_next = s->buckets[b];
    s->buckets[b] = id;
}

void kvb_store_index_remove_locked(kvb_store *s, kvb_block_id id) {
    kvb_block_id *link = &s->buckets[bucket_of(s, s->meta[id].key)];
    while (*link != KVB_BLOCK_NONE) {
        if (*link == id) {
            *link = s->meta[id].index_next;
            s->meta[id].index_next = KVB_BLOCK_NONE;
            return;
        }
        link = &s->meta[*link].index_next;
    }
}
