/* bridge/receiver.c — the one receiver: the bridge's slabs committed into a store, whether they
 * arrive on the decode node's lanes (rx_lanes.c) or from a bridge in this process (`kvbridge
 * verify`, `kvbridge bench quality`): a pending block per shipped block under its chain key (and a
 * pending tail for a partial last block), every slab range-checked and put through the store's
 * slab assembler, a block committed by the one block writer once complete, the sender's DONE
 * checked against what arrived, a complete tail's page handed to the caller. Also the names of the
 * bridge's fault kinds. */
#include <stdatomic.h>
#include <stdlib.h>

#include "bridge_internal.h"

struct kvb_bridge_receiver {
    uint32_t bt;                /* tokens per block */
    uint32_t b0, nb;            /* shipped blocks: b0 .. b0 + nb - 1 */
    uint32_t tail;              /* tokens of block b0 + nb shipped as a tail (0: none) */
    uint32_t ship_to;           /* positions shipped end here (the tail's end) */
    kvb_slab_pending **pending; /* (nb + 1): the blocks, then the tail */
    uint64_t parent_key;        /* the chain key of block b0 - 1 (the root key when b0 is 0) */
    uint64_t digest;            /* kvb_wire_chain_digest of the shipped blocks' keys */
    kvb_tail_pipe *tp;          /* told of every accepted slab (NULL: none) */
    _Atomic uint64_t bytes;     /* accepted (put runs on several lanes at once) */
    _Atomic uint32_t slabs;     /* accepted */
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
        r->ship_to = ship_to;
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
    r->parent_key = r->b0 ? keys[r->b0 - 1] : root;
    r->digest = kvb_wire_chain_digest(keys + r->b0, r->nb);
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
    if (st) return st;
    atomic_fetch_add_explicit(&r->bytes, s->k_bytes + s->v_bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&r->slabs, 1, memory_order_relaxed);
    kvb_tail_pipe_slab(r->tp, g - r->b0, s->layer);
    return KVB_OK;
}

void kvb_bridge_receiver_set_tail_pipe(kvb_bridge_receiver *r, kvb_tail_pipe *tp) { r->tp = tp; }

uint32_t kvb_bridge_receiver_missing(const kvb_bridge_receiver *r) {
    uint32_t missing = 0;
    for (uint32_t b = 0; b < r->nb; b++) missing += !kvb_store_slab_committed(r->pending[b]);
    return missing + (r->tail && kvb_store_slab_missing(r->pending[r->nb]) != 0);
}

uint64_t kvb_bridge_receiver_bytes(const kvb_bridge_receiver *r) {
    return atomic_load_explicit(&r->bytes, memory_order_relaxed);
}

uint32_t kvb_bridge_receiver_slabs(const kvb_bridge_receiver *r) {
    return atomic_load_explicit(&r->slabs, memory_order_relaxed);
}

uint32_t kvb_bridge_receiver_blocks(const kvb_bridge_receiver *r) { return r->nb; }
uint32_t kvb_bridge_receiver_tail_tokens(const kvb_bridge_receiver *r) { return r->tail; }
uint64_t kvb_bridge_receiver_parent_key(const kvb_bridge_receiver *r) { return r->parent_key; }

kvb_slab_pending *const *kvb_bridge_receiver_pending(const kvb_bridge_receiver *r, uint32_t *n) {
    *n = r->nb + (r->tail ? 1 : 0);
    return r->pending;
}

kvb_status kvb_bridge_receiver_check_done(const kvb_bridge_receiver *r, const kvb_msg_done *done,
                                          const uint32_t *lane_slabs, uint32_t n_lanes, kvb_err *err) {
    if (!n_lanes) return kvb_err_set(err, KVB_ERR_MISMATCH, "no DONE arrived");
    const kvb_msg_done *d = &done[0]; /* every lane's DONE agrees, each counting its own slabs */
    uint32_t slabs = 0, lane_off = 0;
    for (uint32_t l = 0; l < n_lanes; l++) {
        slabs += lane_slabs[l];
        lane_off += done[l].slabs != lane_slabs[l] || done[l].tokens_covered != d->tokens_covered ||
                    done[l].blocks != d->blocks || done[l].chain_digest != d->chain_digest;
    }
    const uint32_t missing = kvb_bridge_receiver_missing(r);
    if (d->tokens_covered != r->ship_to || d->blocks != r->nb || d->chain_digest != r->digest || lane_off || missing)
        return kvb_err_set(err, KVB_ERR_MISMATCH,
                           "DONE does not match what arrived (tokens %u/%u, blocks %u/%u, %u slabs, %u of %u lanes "
                           "disagree, %u blocks missing)",
                           d->tokens_covered, r->ship_to, d->blocks, r->nb, slabs, lane_off, n_lanes, missing);
    return KVB_OK;
}

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

kvb_status kvb_bridge_done_for(const kvb_store *store, const int32_t *tokens, uint32_t ship_from, uint32_t ship_to,
                               uint32_t slabs, kvb_msg_done *out, kvb_err *err) {
    const uint32_t bt = kvb_store_kvformat(store)->block_tokens, b0 = ship_from / bt;
    if (ship_from > ship_to || ship_from % bt)
        return kvb_err_set(err, KVB_ERR_INVALID, "shipped range [%u, %u) does not start a block of %u tokens",
                           ship_from, ship_to, bt);
    const uint32_t nb = (ship_to - ship_from) / bt;
    uint64_t *keys = malloc(sizeof(uint64_t) * (ship_to / bt + 1)); /* (blocks up to ship_to) */
    if (!keys) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    kvb_store_chain_keys(store, tokens, ship_to, keys);
    *out = (kvb_msg_done){.tokens_covered = ship_to, .blocks = nb, .slabs = slabs,
                          .chain_digest = kvb_wire_chain_digest(keys + b0, nb)};
    free(keys);
    return KVB_OK;
}

/* ---- fault kinds ------------------------------------------------------------------------------ */

const char *kvb_bridge_fault_name(kvb_bridge_fault f) {
    static const char *const names[KVB_BRIDGE_FAULT_COUNT] = {
        [KVB_BRIDGE_FAULT_NONE] = "none",
        [KVB_BRIDGE_FAULT_TIMEOUT] = "timeout",
        [KVB_BRIDGE_FAULT_PEER_LOST] = "peer_lost",
        [KVB_BRIDGE_FAULT_CORRUPT_SLAB] = "corrupt_slab",
        [KVB_BRIDGE_FAULT_PEER_ERROR] = "peer_error",
        [KVB_BRIDGE_FAULT_DONE_MISMATCH] = "done_mismatch",
        [KVB_BRIDGE_FAULT_CACHE_FULL] = "cache_full",
        [KVB_BRIDGE_FAULT_CLIENT_GONE] = "client_gone",
        [KVB_BRIDGE_FAULT_PEER_DOWN] = "peer_down",
        [KVB_BRIDGE_FAULT_INTERNAL] = "internal",
        [KVB_BRIDGE_FAULT_PEER_BUSY] = "peer_busy",
    };
    return (unsigned)f < KVB_BRIDGE_FAULT_COUNT ? names[f] : "internal";
}

kvb_bridge_fault kvb_bridge_fault_of_receive(kvb_status st) {
    switch (st) {
    case KVB_ERR_TIMEOUT: return KVB_BRIDGE_FAULT_TIMEOUT;
    case KVB_ERR_CHECKSUM: return KVB_BRIDGE_FAULT_CORRUPT_SLAB;
    default: return KVB_BRIDGE_FAULT_PEER_LOST;
    }
}

bool kvb_bridge_fault_resumable(kvb_bridge_fault f) {
    return f == KVB_BRIDGE_FAULT_CORRUPT_SLAB || f == KVB_BRIDGE_FAULT_PEER_LOST;
}
