/* bridge/staging_ring.c — the prefill node's bounded capture memory: a fixed ring of slab-sized
 * staging slots between the bridge (producer, on the engine's thread) and the sender threads, one
 * per lane. Senders take filled slots in order and finish them in any order; a slot is free again
 * once it and every older slot are sent. A full ring blocks the producer (back-pressure from a slow
 * link); memory never grows with the prompt. A request whose rows stay put (the CUDA bridge's
 * pinned slot) pushes views instead, many more of them at once: the producer publishes a layer's
 * slabs without waiting for each one's slot (measured on the H200 host: with 16 slots the
 * producer's wake-up per freed slot held the slab path to ~4 GB/s). Senders and the producer wait
 * on separate condition variables; a freed slot wakes the producer only when it can go on. While
 * the producer waits for a layer's views to be sent it computes their checksums from the newest
 * back, as the senders take them from the oldest on: a sender that finds its slab's checksum made
 * only sends it (each slot's RING_HASH_* state, under the lock, says who hashes it). A producer of
 * views waits only for the batch before the one it just pushed (kvb_ring_wait_sent_to, by the
 * count of slots freed so far), so the senders go from one layer's slabs to the next without
 * draining the ring in between. */
#include <stdlib.h>
#include <string.h>

#include "kvb_bridge.h"

kvb_status kvb_ring_init(kvb_ring *r, uint32_t slots, uint32_t view_slots, size_t slot_bytes, kvb_err *err) {
    memset(r, 0, sizeof *r);
    if (slots == 0) return kvb_err_set(err, KVB_ERR_INVALID, "the staging ring needs at least one slot");
    r->n_slots = slots;
    r->view_slots = view_slots > slots ? view_slots : slots;
    r->cap = slots;
    r->slot_bytes = slot_bytes;
    r->buf = malloc((size_t)slots * slot_bytes);
    r->meta = calloc(r->view_slots, sizeof *r->meta);
    r->sent = calloc(r->view_slots, sizeof *r->sent);
    r->hash = calloc(r->view_slots, sizeof *r->hash);
    if (!r->buf || !r->meta || !r->sent || !r->hash) {
        kvb_ring_destroy(r);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for %u staging slots of %zu bytes", slots, slot_bytes);
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv_taken, NULL);
    pthread_cond_init(&r->cv_freed, NULL);
    pthread_cond_init(&r->cv_hashed, NULL);
    r->inited = true;
    return KVB_OK;
}

void kvb_ring_destroy(kvb_ring *r) {
    if (r->inited) {
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv_taken);
        pthread_cond_destroy(&r->cv_freed);
        pthread_cond_destroy(&r->cv_hashed);
    }
    free(r->buf);
    free(r->meta);
    free(r->sent);
    free(r->hash);
    memset(r, 0, sizeof *r);
}

void kvb_ring_reset(kvb_ring *r, bool views) {
    pthread_mutex_lock(&r->mu);
    r->head = r->tail = r->count = r->next_take = r->untaken = 0;
    r->cap = views ? r->view_slots : r->n_slots;
    memset(r->sent, 0, r->view_slots * sizeof *r->sent);
    memset(r->hash, RING_HASH_NONE, r->view_slots * sizeof *r->hash);
    r->closed = r->failed = false;
    r->pushed = r->freed = r->wait_mark = 0;
    r->full_s = r->empty_s = 0;
    r->hashed_by_producer = r->hash_waiters = 0;
    pthread_mutex_unlock(&r->mu);
}

/* Waits for a free slot (the ring full: back-pressure) and returns it, or fails once failed. */
static kvb_status ring_claim(kvb_ring *r, uint32_t *slot, kvb_err *err) {
    pthread_mutex_lock(&r->mu);
    if (r->count == r->cap && !r->failed) {
        const double t0 = kvb_now_s();
        while (r->count == r->cap && !r->failed) pthread_cond_wait(&r->cv_freed, &r->mu);
        r->full_s += kvb_now_s() - t0;
    }
    if (r->failed) {
        pthread_mutex_unlock(&r->mu);
        return kvb_err_set(err, KVB_ERR_IO, "the link to the decode node failed; stopping this prefill");
    }
    *slot = r->tail;
    pthread_mutex_unlock(&r->mu);
    return KVB_OK;
}

/* The claimed slot (meta filled) is ready for the senders. */
static void ring_publish(kvb_ring *r, bool copy) {
    pthread_mutex_lock(&r->mu);
    r->hash[r->tail] = RING_HASH_NONE;
    r->tail = (r->tail + 1) % r->cap;
    r->count++;
    r->untaken++;
    r->pushed++;
    if (copy && r->count > r->peak) r->peak = r->count; /* staging memory in use */
    pthread_cond_signal(&r->cv_taken); /* one slab: one sender */
    pthread_mutex_unlock(&r->mu);
}

kvb_status kvb_ring_push(kvb_ring *r, const kvb_slab *s, kvb_err *err) {
    if (s->k_bytes + s->v_bytes > r->slot_bytes)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "slab of %zu bytes exceeds a staging slot (%zu)",
                           s->k_bytes + s->v_bytes, r->slot_bytes);
    if (r->cap != r->n_slots) /* a slot index past the staging memory */
        return kvb_err_set(err, KVB_ERR_INTERNAL, "staging ring: a copy pushed into a ring reset for views");
    uint32_t slot = 0;
    kvb_status st = ring_claim(r, &slot, err);
    if (st) return st;
    /* the slot is ours until count says otherwise: copy without the lock */
    uint8_t *dst = r->buf + (size_t)slot * r->slot_bytes;
    memcpy(dst, s->k, s->k_bytes);
    if (s->v_bytes) memcpy(dst + s->k_bytes, s->v, s->v_bytes); /* a latent (mla) slab has no V part */
    r->meta[slot] = *s;
    r->meta[slot].k = dst;
    r->meta[slot].v = dst + s->k_bytes;
    ring_publish(r, true);
    return KVB_OK;
}

kvb_status kvb_ring_push_view(kvb_ring *r, const kvb_slab *s, kvb_err *err) {
    uint32_t slot = 0;
    kvb_status st = ring_claim(r, &slot, err);
    if (st) return st;
    r->meta[slot] = *s; /* K and V stay where they are: the caller waits (kvb_ring_wait_sent) */
    ring_publish(r, false);
    return KVB_OK;
}

/* Is `slot` filled and not taken by a sender yet? (caller holds mu) */
static bool ring_untaken(const kvb_ring *r, uint32_t slot) {
    return r->untaken && (slot + r->cap - r->next_take) % r->cap < r->untaken;
}

uint64_t kvb_ring_mark(kvb_ring *r) {
    pthread_mutex_lock(&r->mu);
    const uint64_t m = r->pushed;
    pthread_mutex_unlock(&r->mu);
    return m;
}

kvb_status kvb_ring_wait_sent(kvb_ring *r, kvb_err *err) { return kvb_ring_wait_sent_to(r, UINT64_MAX, err); }

kvb_status kvb_ring_wait_sent_to(kvb_ring *r, uint64_t mark, kvb_err *err) {
    pthread_mutex_lock(&r->mu);
    if (mark > r->pushed) mark = r->pushed;
    /* the newest slab first; once the cursor reaches a taken one, every older one is taken too */
    uint32_t next_hash = (r->tail + r->cap - 1) % r->cap;
    while (r->freed < mark && !r->failed) {
        if (ring_untaken(r, next_hash) && r->hash[next_hash] == RING_HASH_NONE) {
            const uint32_t slot = next_hash;
            next_hash = (next_hash + r->cap - 1) % r->cap;
            r->hash[slot] = RING_HASH_BUSY; /* a sender that takes it now waits for the checksum */
            const kvb_slab s = r->meta[slot];
            pthread_mutex_unlock(&r->mu);
            const uint64_t sum = kvb_slab_checksum(s.k, s.k_bytes, s.v, s.v_bytes);
            pthread_mutex_lock(&r->mu);
            r->meta[slot].checksum = sum;
            r->hash[slot] = RING_HASH_DONE;
            r->hashed_by_producer++;
            if (r->hash_waiters) pthread_cond_broadcast(&r->cv_hashed);
            continue;
        }
        const double t0 = kvb_now_s(); /* nothing left to hash: idle until the slabs before mark are sent */
        r->wait_mark = mark; /* > freed >= 0 */
        while (r->freed < mark && !r->failed) pthread_cond_wait(&r->cv_freed, &r->mu);
        r->wait_mark = 0;
        r->full_s += kvb_now_s() - t0;
    }
    const bool failed = r->failed;
    pthread_mutex_unlock(&r->mu);
    return failed ? kvb_err_set(err, KVB_ERR_IO, "the link to the decode node failed; stopping this prefill") : KVB_OK;
}

bool kvb_ring_take(kvb_ring *r, uint32_t *slot, kvb_slab *out, bool *checksum_known) {
    pthread_mutex_lock(&r->mu);
    if (r->untaken == 0 && !r->closed && !r->failed) {
        const double t0 = kvb_now_s();
        while (r->untaken == 0 && !r->closed && !r->failed) pthread_cond_wait(&r->cv_taken, &r->mu);
        r->empty_s += kvb_now_s() - t0;
    }
    bool have = r->untaken > 0 && !r->failed;
    if (have) {
        *slot = r->next_take;
        r->next_take = (r->next_take + 1) % r->cap;
        r->untaken--;
        while (r->hash[*slot] == RING_HASH_BUSY) { /* the producer is hashing it: a few microseconds */
            r->hash_waiters++;
            pthread_cond_wait(&r->cv_hashed, &r->mu);
            r->hash_waiters--;
        }
        *out = r->meta[*slot];
        *checksum_known = r->hash[*slot] == RING_HASH_DONE;
    }
    pthread_mutex_unlock(&r->mu);
    return have;
}

void kvb_ring_done(kvb_ring *r, uint32_t slot) {
    pthread_mutex_lock(&r->mu);
    r->sent[slot] = true;
    bool freed = false;
    while (r->count > r->untaken && r->sent[r->head]) { /* the oldest taken slots that are sent */
        r->sent[r->head] = false;
        r->head = (r->head + 1) % r->cap;
        r->count--;
        r->freed++;
        freed = true;
    }
    if (freed && r->freed >= r->wait_mark) pthread_cond_signal(&r->cv_freed); /* the producer can go on */
    pthread_mutex_unlock(&r->mu);
}

void kvb_ring_close(kvb_ring *r) {
    pthread_mutex_lock(&r->mu);
    r->closed = true;
    pthread_cond_broadcast(&r->cv_taken);
    pthread_mutex_unlock(&r->mu);
}

void kvb_ring_fail(kvb_ring *r) {
    pthread_mutex_lock(&r->mu);
    r->failed = true;
    pthread_cond_broadcast(&r->cv_taken);
    pthread_cond_broadcast(&r->cv_freed);
    pthread_mutex_unlock(&r->mu);
}
