/* bridge/recv_pipe.c — one lane's receiving thread for one bridged request: it reads frames
 * into a small ring of its own payload buffers while the request's thread verifies and commits
 * the slabs that already arrived, so the socket copy overlaps the checksum and the scatter into
 * blocks; where the backend lends payloads (UCX's receive ring, kvb_conn_recv_lend) nothing is
 * copied: the slab is verified and committed straight from the ring, returned on release.
 * Messages come out in arrival order; a message's views stay valid until it is released. The
 * thread ends by itself after its request's DONE or ERROR, or on the
 * first receive failure (passed on as the last item); stopping it early shuts the connection down
 * (the conn is no longer trustworthy when the consumer gives up mid-stream). */
#include <stdlib.h>
#include <string.h>

#include "bridge_internal.h"

#define PIPE_SLOTS 8

typedef struct {
    kvb_msg m;
    kvb_wire_loan loan; /* the payload, when the backend lent it (m's views point into it) */
    kvb_status st;      /* the receive's status: a failure is the last item */
    kvb_err err;
} pipe_item;

struct kvb_recv_pipe {
    kvb_conn *c;
    uint64_t request_id;
    int timeout_ms;
    kvb_wire_buf bufs[PIPE_SLOTS]; /* slot i's payload: item i's views point into it */
    pipe_item items[PIPE_SLOTS];
    uint32_t head, count;
    bool reader_done, stop;
    double reader_wait_s, consumer_wait_s; /* see kvb_recv_pipe_waits */
    pthread_t reader;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void *reader_main(void *arg) {
    kvb_recv_pipe *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        if (p->count == PIPE_SLOTS && !p->stop) {
            const double t0 = kvb_now_s();
            while (p->count == PIPE_SLOTS && !p->stop) pthread_cond_wait(&p->cv, &p->mu);
            p->reader_wait_s += kvb_now_s() - t0;
        }
        const bool stop = p->stop;
        const uint32_t slot = (p->head + p->count) % PIPE_SLOTS;
        pthread_mutex_unlock(&p->mu);
        if (stop) break;
        /* the slot is the reader's until count covers it: receive without the lock */
        pipe_item *it = &p->items[slot];
        memset(&it->err, 0, sizeof it->err);
        const double t_recv = kvb_now_s();
        it->st = kvb_conn_recv_lend(p->c, p->timeout_ms, &p->bufs[slot], &it->loan, &it->m, &it->err);
        kvb_trace_span("decode.recv_frame", t_recv, kvb_now_s(), it->st ? 0 : it->m.type);
        const bool last = it->st || ((it->m.type == KVB_FRAME_DONE || it->m.type == KVB_FRAME_ERROR) &&
                                     it->m.request_id == p->request_id);
        pthread_mutex_lock(&p->mu);
        p->count++;
        if (last) p->reader_done = true; /* with the item: a stop after it never shuts the link */
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        if (last) break;
    }
    pthread_mutex_lock(&p->mu);
    p->reader_done = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

kvb_status kvb_recv_pipe_start(kvb_conn *c, uint64_t request_id, int timeout_ms, kvb_recv_pipe **out, kvb_err *err) {
    *out = NULL;
    kvb_recv_pipe *p = calloc(1, sizeof *p);
    if (!p) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the receiving thread");
    p->c = c;
    p->request_id = request_id;
    p->timeout_ms = timeout_ms;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (pthread_create(&p->reader, NULL, reader_main, p) != 0) {
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        free(p);
        return kvb_err_set(err, KVB_ERR_INTERNAL, "could not start the receiving thread");
    }
    *out = p;
    return KVB_OK;
}

kvb_status kvb_recv_pipe_next(kvb_recv_pipe *p, kvb_msg *m, kvb_err *err) {
    pthread_mutex_lock(&p->mu);
    if (p->count == 0 && !p->reader_done) {
        const double t0 = kvb_now_s();
        while (p->count == 0 && !p->reader_done) pthread_cond_wait(&p->cv, &p->mu);
        p->consumer_wait_s += kvb_now_s() - t0;
    }
    if (p->count == 0) { /* the reader ended after its last item was released: nothing more comes */
        pthread_mutex_unlock(&p->mu);
        return kvb_err_set(err, KVB_ERR_INVALID, "receive: the request's stream already ended");
    }
    pipe_item *it = &p->items[p->head];
    pthread_mutex_unlock(&p->mu);
    *m = it->m;
    if (it->st) *err = it->err;
    return it->st;
}

void kvb_recv_pipe_release(kvb_recv_pipe *p) {
    pthread_mutex_lock(&p->mu);
    if (p->count) {
        kvb_msg_free(&p->items[p->head].m);
        kvb_wire_loan_return(&p->items[p->head].loan);
        p->head = (p->head + 1) % PIPE_SLOTS;
        p->count--;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
}

void kvb_recv_pipe_waits(kvb_recv_pipe *p, double *reader_s, double *consumer_s) {
    pthread_mutex_lock(&p->mu);
    *reader_s = p->reader_wait_s;
    *consumer_s = p->consumer_wait_s;
    pthread_mutex_unlock(&p->mu);
}

void kvb_recv_pipe_abort(kvb_recv_pipe *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    const bool running = !p->reader_done;
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (running) kvb_conn_shutdown(p->c); /* a reader blocked in receive wakes up and fails */
}

void kvb_recv_pipe_stop(kvb_recv_pipe *p) {
    if (!p) return;
    kvb_recv_pipe_abort(p);
    pthread_join(p->reader, NULL);
    while (p->count) kvb_recv_pipe_release(p);
    for (int i = 0; i < PIPE_SLOTS; i++) free(p->bufs[i].data);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}
