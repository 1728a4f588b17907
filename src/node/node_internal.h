/* node/node_internal.h — private to the node module: the staging ring. */
#ifndef KVB_NODE_INTERNAL_H
#define KVB_NODE_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "kvb_bridge.h"
#include "kvb_node.h"

typedef struct {
    uint32_t n_slots;
    size_t slot_bytes;
    uint8_t *buf;    /* (n_slots, slot_bytes): K then V of one slab */
    kvb_slab *meta;  /* (n_slots) */
    uint32_t head, tail, count, peak;
    bool closed, failed, inited;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} kvb_ring;

kvb_status kvb_ring_init(kvb_ring *r, uint32_t slots, size_t slot_bytes, kvb_err *err);
void kvb_ring_destroy(kvb_ring *r);
void kvb_ring_reset(kvb_ring *r);
/* Copies the slab into the next free slot; blocks while the ring is full; fails once failed. */
kvb_status kvb_ring_push(kvb_ring *r, const kvb_slab *s, kvb_err *err);
/* Waits for the oldest filled slot (true), or returns false once closed and drained, or failed. */
bool kvb_ring_peek(kvb_ring *r, kvb_slab *out);
void kvb_ring_pop(kvb_ring *r);
void kvb_ring_close(kvb_ring *r); /* producer done */
void kvb_ring_fail(kvb_ring *r);  /* consumer gave up: producer's pushes fail */

#endif
