/* bridge/receiver.c — the bridge's slabs committed into a store in this process, the way the
 * decode node commits what arrives on the wire: a pending block per shipped block under its
 * chain key (and a pending tail for a partial last block), every slab through the store's slab
 * assembler, a block committed by the one block writer once complete, a complete tail's page
 * handed to the caller. `kvbridge verify` and `kvbridge bench quality` assemble through it. */
#include <stdlib.h>

#include "kvb_bridge.h"

struct kvb_bridge_receiver {
    uint32_t bt;                /* tokens per block */
    uint32_t b0, nb;            /* shipped blocks: b0 .. b0 + nb - 1 */
    uint32_t tail;              /* tokens of block b0 + nb shipped as a tail (0: none) */
    kvb_slab_pending **pending; /* (nb + 1): the blocks, then the tail */
    uint64_t bytes;
};

kvb_status kvb_bridge_receiver_create(kvb_store *store, const int32_t *tokens, uint32_t ship_from, uint32_t ship_to,
                                      kvb_bridge_receiver **out, kvb_err *err) {
    *out = NULL;
    const uint32_t bt = kvb_store_kvformat(store)->block_tokens;
    if (ship_from > ship_to || ship_from % bt)
        return kvb_err_set(err, KVB_ERR_INVALID, "shipped range [%u, %u) does not start a block of %u tokens",
                           ship_from, ship_to, bt);
    kvb_bridge_receiver *r = calloc(1, sizeof *r);
    uint64_t *keys = malloc(sizeof(uint64_t) * (ship_to / bt + 1));
    if (r) {
        r->bt = bt;
        r->b0 = ship_from / bt;
        r->nb = (ship_to - ship_from) / bt;
        r->tail = ship_to % bt;
        r->pending = calloc(r->nb + 1, sizeof *r->pending);
    }
    if (!r || !keys || !r->pending) {
        free(keys);
        kvb_bridge_receiver_free(r);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the bridge receiver");
    }
    kvb_store_chain_keys(store, tokens, ship_to, keys);
    const uint64_t root = kvb_store_root_key(store);
    const uint32_t keep = kvb_kvformat_local_keep_from(kvb_store_kvformat(store), ship_to);
    kvb_status st = KVB_OK;
    for (uint32_t b = 0; b < r->nb && !st; b++) {
        const uint32_t g = r->b0 + b, lo = kvb_kvformat_block_local_lo(kvb_store_kvformat(store), keep, g);
        st = kvb_store_slab_begin(store, keys[g], g ? keys[g - 1] : root, tokens + (size_t)g * bt, &r->pending[b],
                                  err);
        if (!st && lo) st = kvb_store_slab_keep_local_from(r->pending[b], lo, err);
    }
    if (!st && r->tail) st = kvb_store_slab_begin_tail(store, r->tail, &r->pending[r->nb], err);
    free(keys);
    if (st) {
        kvb_bridge_receiver_free(r);
        return st;
    }
    *out = r;
    return KVB_OK;
}

kvb_status kvb_bridge_receiver_put(void *receiver, const kvb_slab *s, kvb_err *err) {
    kvb_bridge_receiver *r = receiver;
    const uint32_t g = s->pos0 / r->bt;
    if (g < r->b0 || g > r->b0 + r->nb || (g == r->b0 + r->nb && !r->tail))
        return kvb_err_set(err, KVB_ERR_FORMAT, "slab for position %u outside the shipped range", s->pos0);
    kvb_status st = kvb_store_slab_put(r->pending[g - r->b0], s->layer, s->pos0 % r->bt, s->n, s->k, s->k_bytes, s->v,
                                       s->v_bytes, s->checksum, NULL, err);
    if (!st) r->bytes += s->k_bytes + s->v_bytes;
    return st;
}

uint32_t kvb_bridge_receiver_missing(const kvb_bridge_receiver *r) {
    uint32_t missing = 0;
    for (uint32_t b = 0; b < r->nb; b++) missing += !kvb_store_slab_committed(r->pending[b]);
    return missing + (r->tail && kvb_store_slab_missing(r->pending[r->nb]) != 0);
}

uint64_t kvb_bridge_receiver_bytes(const kvb_bridge_receiver *r) { return r->bytes; }

kvb_block_id kvb_bridge_receiver_take_tail(kvb_bridge_receiver *r) {
    return r->tail ? kvb_store_slab_take_tail(r->pending[r->nb]) : KVB_BLOCK_NONE;
}

void kvb_bridge_receiver_free(kvb_bridge_receiver *r) {
    if (!r) return;
    if (r->pending)
        for (uint32_t b = 0; b <= r->nb; b++) kvb_store_slab_close(r->pending[b]);
    free(r->pending);
    free(r);
}
