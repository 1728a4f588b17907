/* node/prefill_admission.c — a prefill node's admission: who computes on the engine next. A PREFILL
 * either takes the engine at once (nobody holds it, nobody waits) or waits in a bounded queue, which
 * hands the engine over round robin between decode nodes and in arrival order within one, so a
 * decode node that sends many requests at once does not make another wait behind all of them.
 * Beyond max_queue requests waiting in all, or max_per_decoder from one decode node, a request is
 * refused at once (the caller answers it with an ERROR of code BUSY, and the decoder goes to
 * another prefill node or computes the prompt itself). A decode node is known by the name in its
 * HELLO and the host it connects from ("door@10.0.0.5"): two decode nodes of the same name on
 * different hosts are two, one decode node's lanes (several connections, ports that change when it
 * dials again) are one; two of the same name on one host share one turn. Metrics: per decode node
 * requests by outcome, the queue's length, the time waited for the engine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node_internal.h"

#define ADM_DECODERS 256 /* decode nodes remembered (their counters stay in the registry) */
#define ADM_LOG 128      /* the served order kept for kvb_admission_served */

typedef struct {
    char who[KVB_ADMISSION_WHO_MAX];
    uint32_t waiting;
    uint64_t seen; /* the admission's clock when it last asked */
} adm_decoder;

struct kvb_admission_waiter {
    int dec;
    bool go; /* its turn came (under mu) */
    struct kvb_admission_waiter *next;
};

struct kvb_admission {
    uint32_t max_queue, max_per_decoder;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool busy, stopping; /* the engine is held; stopping: waiters leave refused */
    uint32_t waiting;
    kvb_admission_waiter *head, *tail; /* arrival order */
    int rr;                            /* the decode node served last */
    uint32_t n_dec;
    uint64_t clock;
    adm_decoder dec[ADM_DECODERS];
    int log[ADM_LOG]; /* decoders served, ring of the last ADM_LOG */
    uint64_t n_log;
    kvb_metric *m_requests, *m_queue, *m_wait;
};

kvb_status kvb_admission_create(uint32_t max_queue, uint32_t max_per_decoder, kvb_metrics *mx, kvb_admission **out,
                                kvb_err *err) {
    *out = NULL;
    kvb_admission *a = calloc(1, sizeof *a);
    if (!a) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    a->max_queue = max_queue;
    a->max_per_decoder = max_per_decoder;
    a->rr = -1;
    kvb_status st = kvb_metrics_register(
        mx, KVB_METRIC_COUNTER, "kvbridge_prefill_decoder_requests_total",
        "PREFILL requests by decode node (its HELLO name @ the host it connects from) and outcome: served, failed, "
        "refused (draining, a request this node cannot serve), busy_queue (--max-queue requests were waiting), "
        "busy_decoder (--max-queue-per-decoder of this decode node's were waiting)",
        "decoder,outcome", NULL, 0, &a->m_requests, err);
    if (!st)
        st = kvb_metrics_register(mx, KVB_METRIC_GAUGE, "kvbridge_prefill_queue",
                                  "PREFILLs waiting for the engine (the one computing not counted)", NULL, NULL, 0,
                                  &a->m_queue, err);
    if (!st)
        st = kvb_metrics_register(mx, KVB_METRIC_HISTOGRAM, "kvbridge_prefill_queue_wait_seconds",
                                  "An admitted PREFILL's wait for the engine (0 when it was free)", NULL, NULL, 0,
                                  &a->m_wait, err);
    if (st) {
        free(a);
        return st;
    }
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    *out = a;
    return KVB_OK;
}

void kvb_admission_free(kvb_admission *a) {
    if (!a) return;
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    free(a);
}

void kvb_admission_who(const char *name, const char *peer_addr, char *who, size_t cap) {
    /* the host without the port: "[v6]:port" or "v4:port" */
    const char *colon = strrchr(peer_addr, ':');
    int hl = colon ? (int)(colon - peer_addr) : (int)strlen(peer_addr);
    if (hl >= 2 && peer_addr[0] == '[' && peer_addr[hl - 1] == ']') peer_addr++, hl -= 2;
    snprintf(who, cap, "%.64s@%.*s", name, hl > 64 ? 64 : hl, peer_addr);
}

/* The decode node's slot: known, a free one, or the one idle longest. Caller holds mu. */
static int decoder_of(kvb_admission *a, const char *who) {
    int idle = -1;
    for (uint32_t i = 0; i < a->n_dec; i++) {
        if (!strcmp(a->dec[i].who, who)) return (int)i;
        if (!a->dec[i].waiting && (idle < 0 || a->dec[i].seen < a->dec[idle].seen)) idle = (int)i;
    }
    const int d = a->n_dec < ADM_DECODERS ? (int)a->n_dec++ : idle;
    if (d < 0) return -1; /* every one of them waiting: cannot be, the connections are fewer */
    snprintf(a->dec[d].who, sizeof a->dec[d].who, "%s", who);
    a->dec[d].waiting = 0;
    return d;
}

/* Takes the waiter *pp out of the queue. Caller holds mu. */
static void unlink_locked(kvb_admission *a, kvb_admission_waiter **pp) {
    kvb_admission_waiter *w = *pp;
    *pp = w->next;
    if (a->tail == w) {
        a->tail = NULL;
        for (kvb_admission_waiter *x = a->head; x; x = x->next) a->tail = x;
    }
    a->waiting--;
    a->dec[w->dec].waiting--;
    kvb_metric_set(a->m_queue, NULL, a->waiting);
}

static void served_locked(kvb_admission *a, int d) {
    a->rr = d;
    a->log[a->n_log++ % ADM_LOG] = d;
}

kvb_admission_verdict kvb_admission_enter(kvb_admission *a, const char *who, char *why, size_t cap) {
    pthread_mutex_lock(&a->mu);
    const int d = decoder_of(a, who);
    kvb_admission_verdict v = KVB_ADMITTED;
    if (d >= 0) a->dec[d].seen = ++a->clock;
    if (a->stopping) v = KVB_ADMISSION_STOPPING;
    else if (d < 0) v = KVB_ADMISSION_BUSY_QUEUE;
    else if (!a->busy && !a->head) {
        a->busy = true;
        served_locked(a, d);
        kvb_metric_observe(a->m_wait, NULL, 0);
    } else if (a->waiting >= a->max_queue) {
        v = KVB_ADMISSION_BUSY_QUEUE;
        snprintf(why, cap, "queue full: %u waiting, --max-queue %u", a->waiting, a->max_queue);
    } else if (a->dec[d].waiting >= a->max_per_decoder) {
        v = KVB_ADMISSION_BUSY_DECODER;
        snprintf(why, cap, "this decoder's share full: %u of %u waiting, --max-queue-per-decoder %u",
                 a->dec[d].waiting, a->waiting, a->max_per_decoder);
    } else {
        const double t0 = kvb_now_s();
        kvb_admission_waiter w = {.dec = d};
        if (a->tail) a->tail->next = &w;
        else a->head = &w;
        a->tail = &w;
        a->waiting++;
        a->dec[d].waiting++;
        kvb_metric_set(a->m_queue, NULL, a->waiting);
        while (!w.go && !a->stopping) pthread_cond_wait(&a->cv, &a->mu);
        if (!w.go) { /* stopping: out of the queue, refused */
            kvb_admission_waiter **pp = &a->head;
            while (*pp != &w) pp = &(*pp)->next;
            unlink_locked(a, pp);
            v = KVB_ADMISSION_STOPPING;
        } else {
            kvb_metric_observe(a->m_wait, NULL, kvb_now_s() - t0);
        }
    }
    if (v == KVB_ADMISSION_STOPPING) snprintf(why, cap, "this prefill node is stopping; compute natively");
    if (v == KVB_ADMISSION_BUSY_QUEUE && d < 0) snprintf(why, cap, "too many decode nodes waiting");
    pthread_mutex_unlock(&a->mu);
    if (v == KVB_ADMISSION_BUSY_QUEUE || v == KVB_ADMISSION_BUSY_DECODER)
        kvb_admission_count(a, who, v == KVB_ADMISSION_BUSY_QUEUE ? "busy_queue" : "busy_decoder");
    return v;
}

void kvb_admission_leave(kvb_admission *a) {
    pthread_mutex_lock(&a->mu);
    kvb_admission_waiter *next = NULL, **at = NULL;
    /* round robin: the first decode node after the one served last that has a request waiting, and
     * its oldest one */
    for (uint32_t k = 1; k <= a->n_dec && !next; k++) {
        const int d = (int)(((uint32_t)(a->rr < 0 ? 0 : a->rr) + k) % a->n_dec);
        for (kvb_admission_waiter **pp = &a->head; *pp && !next; pp = &(*pp)->next)
            if ((*pp)->dec == d) next = *pp, at = pp;
    }
    if (next) {
        unlink_locked(a, at);
        next->go = true; /* the engine goes to it: busy stays */
        served_locked(a, next->dec);
        pthread_cond_broadcast(&a->cv);
    } else {
        a->busy = false;
    }
    pthread_mutex_unlock(&a->mu);
}

void kvb_admission_count(kvb_admission *a, const char *who, const char *outcome) {
    kvb_metric_add(a->m_requests, KVB_LABELS(who, outcome), 1);
}

uint32_t kvb_admission_waiting(kvb_admission *a) {
    pthread_mutex_lock(&a->mu);
    const uint32_t w = a->waiting;
    pthread_mutex_unlock(&a->mu);
    return w;
}

void kvb_admission_stop(kvb_admission *a) {
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->stopping = true;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

size_t kvb_admission_served(kvb_admission *a, char *buf, size_t cap) {
    pthread_mutex_lock(&a->mu);
    size_t len = 0;
    if (cap) buf[0] = 0;
    const uint64_t from = a->n_log > ADM_LOG ? a->n_log - ADM_LOG : 0;
    for (uint64_t i = from; i < a->n_log && len < cap; i++) {
        const int k = snprintf(buf + len, cap - len, "%s%s", len ? " " : "", a->dec[a->log[i % ADM_LOG]].who);
        if (k < 0) break;
        len += (size_t)k;
    }
    pthread_mutex_unlock(&a->mu);
    return len < cap ? len : cap ? cap - 1 : 0;
}
