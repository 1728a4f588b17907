/* placement.c — where a conversation goes: its key (XXH3 of its first messages or of its prompt's
 * head), the bounded LRU table that remembers the backend that served each key last (a hash of
 * chains over a fixed array of entries, a doubly linked recency list through the same entries: no
 * allocation after start), weighted rendezvous hashing over the backends (score w / -ln(u), u the
 * key's hash with the backend's name in (0, 1), w = 1 / (1 + in flight): the same key keeps its
 * order while loads are equal, and a busy backend yields new keys to idle ones), and the choice
 * among them: history while up and not full, else the first usable one in rendezvous order. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router_internal.h"

const char *const router_place_names[3] = {"history", "new", "moved"};

/* ---- the conversation key ----------------------------------------------------------------------- */

static uint64_t mix_piece(uint64_t h, const char *tag, const void *bytes, size_t n) {
    const kvb_bytes pieces[3] = {{&h, sizeof h}, {tag, strlen(tag) + 1}, {bytes, n}};
    return kvb_xxh3_pieces(pieces, 3);
}

uint64_t kvb_router_conversation_key(const kvb_completion_req *req, uint32_t prefix_bytes) {
    uint64_t h = 0x6b7662726f757465ull; /* "kvbroute" */
    if (req->api == KVB_API_CHAT_COMPLETIONS) {
        size_t i = 0;
        if (req->n_messages && strcmp(req->messages[0].role, "system") == 0) {
            h = mix_piece(h, "system", req->messages[0].content, strlen(req->messages[0].content));
            i = 1;
        }
        for (; i < req->n_messages; i++)
            if (strcmp(req->messages[i].role, "user") == 0) {
                h = mix_piece(h, "user", req->messages[i].content, strlen(req->messages[i].content));
                break;
            }
        return h;
    }
    if (req->prompt) {
        const size_t n = strlen(req->prompt);
        return mix_piece(h, "prompt", req->prompt, n < prefix_bytes ? n : prefix_bytes);
    }
    const size_t n_ids = req->n_prompt_tokens < prefix_bytes / 4 ? req->n_prompt_tokens : prefix_bytes / 4;
    return mix_piece(h, "ids", req->prompt_tokens, n_ids * sizeof(int32_t));
}

/* ---- rendezvous --------------------------------------------------------------------------------- */

void kvb_router_rendezvous(uint64_t key, const char *const *names, const uint32_t *in_flight, size_t n,
                           uint32_t *order) {
    double score[KVB_ROUTER_MAX_BACKENDS];
    for (size_t i = 0; i < n && i < KVB_ROUTER_MAX_BACKENDS; i++) {
        const uint64_t hv = kvb_hash64(names[i], strlen(names[i]), key);
        const double u = ((double)(hv >> 11) + 0.5) * 0x1p-53; /* (0, 1) */
        const double w = 1.0 / (1.0 + (in_flight ? in_flight[i] : 0));
        score[i] = w / -log(u);
        order[i] = (uint32_t)i;
    }
    for (size_t i = 1; i < n && i < KVB_ROUTER_MAX_BACKENDS; i++) { /* insertion sort, best first */
        const uint32_t o = order[i];
        size_t j = i;
        while (j > 0 && (score[order[j - 1]] < score[o] || (score[order[j - 1]] == score[o] && order[j - 1] > o))) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = o;
    }
}

int router_pick(kvb_router *r, uint64_t key, const bool *tried, bool retry, router_place_kind *place) {
    const uint32_t max_in = r->cfg.backend_max_inflight;
    uint32_t load[KVB_ROUTER_MAX_BACKENDS], order[KVB_ROUTER_MAX_BACKENDS];
    for (size_t i = 0; i < r->n_backends; i++) load[i] = atomic_load(&r->backends[i].in_flight);
    pthread_mutex_lock(&r->mu);
    const int hist = router_history_get(r->history, key);
    pthread_mutex_unlock(&r->mu);
    if (hist >= 0 && !tried[hist] && atomic_load(&r->backends[hist].up) && load[hist] < max_in) {
        *place = retry ? ROUTER_PLACE_MOVED : ROUTER_PLACE_HISTORY;
        return hist;
    }
    *place = (hist >= 0 || retry) ? ROUTER_PLACE_MOVED : ROUTER_PLACE_NEW;
    kvb_router_rendezvous(key, r->names, load, r->n_backends, order);
    /* up and not full; else up (every one full: the least loaded waits its turn there); else any
     * not tried yet (health may lag: a connect attempt is cheap and says) */
    int full = -1, down = -1;
    for (size_t k = 0; k < r->n_backends; k++) {
        const uint32_t i = order[k];
        if (tried[i]) continue;
        if (!atomic_load(&r->backends[i].up)) {
            if (down < 0) down = (int)i;
        } else if (load[i] < max_in) {
            return (int)i;
        } else if (full < 0 || load[i] < load[full]) {
            full = (int)i;
        }
    }
    return full >= 0 ? full : down;
}

/* ---- the LRU table ------------------------------------------------------------------------------ */

typedef struct {
    uint64_t key;
    int32_t backend;
    int32_t prev, next; /* recency list: head = most recent */
    int32_t chain;      /* next entry in the same bucket */
} history_entry;

struct router_history {
    history_entry *e; /* (capacity) */
    int32_t *bucket;  /* (n_buckets) first entry of each chain, -1: none */
    uint32_t capacity, used, n_buckets;
    int32_t head, tail;
};

kvb_status router_history_create(uint32_t capacity, router_history **out, kvb_err *err) {
    *out = NULL;
    if (capacity < 1 || capacity > (1u << 26)) return kvb_err_set(err, KVB_ERR_INVALID, "router: history of %u entries", capacity);
    router_history *h = calloc(1, sizeof *h);
    uint32_t nb = 1;
    while (nb < 2 * capacity) nb <<= 1;
    if (h) {
        h->e = calloc(capacity, sizeof *h->e);
        h->bucket = malloc(nb * sizeof *h->bucket);
    }
    if (!h || !h->e || !h->bucket) {
        router_history_free(h);
        return kvb_err_set(err, KVB_ERR_NOMEM, "router: out of memory for %u history entries", capacity);
    }
    for (uint32_t i = 0; i < nb; i++) h->bucket[i] = -1;
    h->capacity = capacity;
    h->n_buckets = nb;
    h->head = h->tail = -1;
    *out = h;
    return KVB_OK;
}

void router_history_free(router_history *h) {
    if (!h) return;
    free(h->e);
    free(h->bucket);
    free(h);
}

static void unlink_recent(router_history *h, int32_t i) {
    history_entry *x = &h->e[i];
    if (x->prev >= 0) h->e[x->prev].next = x->next;
    else h->head = x->next;
    if (x->next >= 0) h->e[x->next].prev = x->prev;
    else h->tail = x->prev;
}

static void push_recent(router_history *h, int32_t i) {
    h->e[i].prev = -1;
    h->e[i].next = h->head;
    if (h->head >= 0) h->e[h->head].prev = i;
    h->head = i;
    if (h->tail < 0) h->tail = i;
}

static int32_t find(const router_history *h, uint64_t key) {
    for (int32_t i = h->bucket[key & (h->n_buckets - 1)]; i >= 0; i = h->e[i].chain)
        if (h->e[i].key == key) return i;
    return -1;
}

int router_history_get(router_history *h, uint64_t key) {
    const int32_t i = find(h, key);
    if (i < 0) return -1;
    unlink_recent(h, i);
    push_recent(h, i);
    return h->e[i].backend;
}

void router_history_put(router_history *h, uint64_t key, int backend) {
    int32_t i = find(h, key);
    if (i >= 0) {
        unlink_recent(h, i);
    } else {
        if (h->used < h->capacity) {
            i = (int32_t)h->used++;
        } else { /* the least recent key leaves: out of its chain and the list */
            i = h->tail;
            unlink_recent(h, i);
            int32_t *link = &h->bucket[h->e[i].key & (h->n_buckets - 1)];
            while (*link != i) link = &h->e[*link].chain;
            *link = h->e[i].chain;
        }
        h->e[i].key = key;
        int32_t *b = &h->bucket[key & (h->n_buckets - 1)];
        h->e[i].chain = *b;
        *b = i;
    }
    h->e[i].backend = backend;
    push_recent(h, i);
}
