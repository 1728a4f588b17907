/* bridge/tail_pipe.c — the decoder's pipelined tail. While a bridged prompt's blocks arrive, a thread
 * runs the prompt's last token through the decoder's own forward on a provisional sequence: the
 * cached prefix, then the pages still being assembled (borrowed, kvb_seq_borrow_pages) and a
 * page for the last token's row. Before each layer's attention the forward waits at a gate until
 * every pending block (and the tail) holds that layer, so layer L runs as soon as the last chunk's
 * layer L has arrived, not after the whole transfer; only the last layer and the output head are
 * left once DONE comes. While layers are still arriving the forward runs on fewer of the engine's
 * threads, so that its workers (which spin between steps) do not take the CPUs from the threads
 * receiving and committing the slabs (traced on the H200 host with all 16: the tail fell five
 * layers behind an 8K prompt's transfer, one layer taking 7.7 ms). The result is used only when
 * the bridge was complete and every block was committed on the very page the forward read (a
 * dedup moves a block to another page: then the logits are dropped and the decoder runs the token
 * after the transfer, as without the pipe).
 *
 * The prompt phase holds the engine for the whole transfer, so the other requests' decode steps
 * would wait for all of it (seconds at 128K tokens, more CPU to CPU). Instead the gate runs them
 * while it waits: the batcher tells it when a step is handed in, it runs the steps as a batch on
 * its own thread (the engine keeps the tail's state across that), at the transfer's pool width,
 * and goes back to waiting. The tail may fall behind by a batch; the streams do not stop. */
#include <stdlib.h>
#include <string.h>

#include "kvb_engine_cpu.h"
#include "kvb_store.h"
#include "bridge_internal.h"

struct kvb_tail_pipe {
    kvb_engine *e;
    kvb_store *store;
    kvb_seq *ps;                   /* the provisional sequence */
    kvb_slab_pending *const *pend; /* (n_pend) the caller's, in position order; the tail last if any */
    uint32_t n_pend, n_layer;
    bool has_tail;                 /* pend[n_pend - 1] is the tail */
    kvb_block_id *pages;           /* (n_pend + !has_tail) the pages borrowed, in order */
    kvb_block_id own_page;         /* the last token's page when there is no tail (ours), or NONE */
    int32_t last_token;
    float *logits;                 /* (n_vocab) the caller's */
    int threads_in_transfer;       /* the engine's pool width while later layers are arriving */
    kvb_bridge_batch_hooks batch;  /* the other requests' decode steps, run while waiting (or not) */
    uint32_t steps_run;            /* by the gates, in batches_run batches (the tail thread's) */
    uint32_t batches_run;
    /* guarded by mu */
    uint8_t *counted;              /* (n_pend, n_layer) 1 once counted in ready */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t *ready;               /* (n_layer) pending blocks holding that layer */
    bool steps_waiting;            /* a decode step was handed in since the gate last ran them */
    bool abort, finished;
    kvb_status st;
    kvb_err err;
    double finished_at;
    pthread_t thread;
};

/* The batcher's on_step hook (under its lock): a step was handed in. */
static void step_handed_in(void *ctx) {
    kvb_tail_pipe *t = ctx;
    pthread_mutex_lock(&t->mu);
    t->steps_waiting = true;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

static kvb_status gate(void *ctx, uint32_t layer, kvb_err *err) {
    kvb_tail_pipe *t = ctx;
    const double t0 = kvb_now_s();
    pthread_mutex_lock(&t->mu);
    bool parked = false;
    while (!t->abort && t->ready[layer] < t->n_pend) {
        if (t->steps_waiting && t->batch.run_pending) { /* the others' decode steps, while this layer is on its way */
            t->steps_waiting = false;
            pthread_mutex_unlock(&t->mu); /* the batcher calls step_handed_in under its lock */
            const double tb = kvb_now_s();
            kvb_engine_set_threads(t->e, t->threads_in_transfer);
            const uint32_t ran = t->batch.run_pending(t->batch.ctx);
            if (ran) kvb_trace_span("decode.tail_gate_batch", tb, kvb_now_s(), ran);
            pthread_mutex_lock(&t->mu);
            t->steps_run += ran;
            t->batches_run += ran != 0;
            parked = false;
            continue;
        }
        if (!parked) kvb_engine_park_threads(t->e); /* the receiver needs the CPUs */
        parked = true;
        pthread_cond_wait(&t->cv, &t->mu);
    }
    const bool abort = t->abort;
    bool arriving = false; /* a later layer still has rows on the way */
    for (uint32_t l = layer + 1; l < t->n_layer && !arriving; l++) arriving = t->ready[l] < t->n_pend;
    pthread_mutex_unlock(&t->mu);
    kvb_engine_set_threads(t->e, arriving ? t->threads_in_transfer : 0); /* on the forward's own thread */
    kvb_trace_span("decode.tail_gate", t0, kvb_now_s(), layer); /* waiting for the layer's rows */
    return abort ? kvb_err_set(err, KVB_ERR_INTERNAL, "pipelined tail: the bridge stopped before layer %u", layer)
                 : KVB_OK;
}

static void *tail_main(void *arg) {
    kvb_tail_pipe *t = arg;
    kvb_err err = {0};
    const double t0 = kvb_now_s();
    kvb_status st = kvb_engine_forward(t->e, t->ps, &t->last_token, 1, t->logits, false, &err);
    if (t->batch.on_step) t->batch.on_step(t->batch.ctx, NULL, NULL); /* past its last gate */
    kvb_engine_set_threads(t->e, 0); /* all of them again, for the decode steps */
    kvb_trace_span("decode.tail_forward", t0, kvb_now_s(), 0);
    pthread_mutex_lock(&t->mu);
    t->st = st;
    t->err = err;
    t->finished = true;
    t->finished_at = kvb_now_s();
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Counts pending i's layer when it is complete and not yet counted; wakes the gate when that
 * layer is now complete everywhere. Callers: the threads that put the slabs (one per lane). */
static void count_layer(kvb_tail_pipe *t, uint32_t i, uint32_t layer) {
    pthread_mutex_lock(&t->mu);
    uint8_t *c = t->counted + (size_t)i * t->n_layer + layer;
    if (!*c && !kvb_store_slab_layer_missing(t->pend[i], layer)) {
        *c = 1;
        if (++t->ready[layer] == t->n_pend) pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
}

static void tail_pipe_free(kvb_tail_pipe *t) {
    if (!t) return;
    if (t->batch.on_step) t->batch.on_step(t->batch.ctx, NULL, NULL);
    kvb_seq_free(t->ps); /* borrowed pages stay with their pendings */
    if (t->own_page != KVB_BLOCK_NONE) kvb_store_release(t->store, &t->own_page, 1, NULL);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t->pages);
    free(t->counted);
    free(t->ready);
    free(t);
}

kvb_status kvb_tail_pipe_start(kvb_engine *e, const int32_t *toks, uint32_t n_tok, uint32_t cached,
                               kvb_slab_pending *const *pend, uint32_t n_pend, bool has_tail, float *logits,
                               int threads_in_transfer, const kvb_bridge_batch_hooks *batch, kvb_tail_pipe **out,
                               kvb_err *err) {
    *out = NULL;
    kvb_store *store = kvb_engine_store(e);
    const kvb_kvformat *f = kvb_store_kvformat(store);
    const uint32_t bt = f->block_tokens, n_pages = n_pend + !has_tail;
    kvb_tail_pipe *t = calloc(1, sizeof *t);
    if (!t) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    t->e = e;
    t->store = store;
    t->pend = pend;
    t->n_pend = n_pend;
    t->n_layer = f->n_layer;
    t->has_tail = has_tail;
    t->own_page = KVB_BLOCK_NONE;
    t->last_token = toks[n_tok - 1];
    t->logits = logits;
    t->threads_in_transfer = threads_in_transfer;
    if (batch) t->batch = *batch;
    t->steps_waiting = true; /* steps handed in before the hook was set: the first gate looks */
    t->pages = malloc(sizeof(kvb_block_id) * (n_pages ? n_pages : 1));
    t->counted = calloc((size_t)n_pend * t->n_layer + 1, 1);
    t->ready = calloc(t->n_layer, sizeof(uint32_t));
    kvb_status st = t->pages && t->counted && t->ready ? KVB_OK : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    uint32_t got = 0;
    if (!st) st = kvb_seq_create(e, &t->ps, err);
    if (!st) st = kvb_seq_attach_cached(t->ps, toks, n_tok, &got, err);
    if (!st && got != cached)
        st = kvb_err_set(err, KVB_ERR_INVALID, "pipelined tail: the cached prefix changed (%u, expected %u tokens)",
                         got, cached);
    for (uint32_t i = 0; !st && i < n_pend; i++) t->pages[i] = kvb_store_slab_block(pend[i]);
    if (!st && !has_tail && !(st = kvb_store_alloc(store, 1, &t->own_page, err))) t->pages[n_pend] = t->own_page;
    /* tokens [cached, n_tok - 1): the blocks and the tail; the last token's row goes in the last page */
    if (!st) st = kvb_seq_borrow_pages(t->ps, t->pages, n_pages, toks + cached, n_tok - 1 - cached, err);
    if (!st && (n_tok - 1) / bt != cached / bt + n_pages - 1)
        st = kvb_err_set(err, KVB_ERR_INTERNAL, "pipelined tail: %u pages do not end at the last token", n_pages);
    if (st) {
        tail_pipe_free(t);
        return st;
    }
    kvb_seq_set_layer_gate(t->ps, gate, t);
    if (t->batch.on_step) t->batch.on_step(t->batch.ctx, step_handed_in, t);
    for (uint32_t i = 0; i < n_pend; i++) /* layers that are there already: none expected (local rows cut) */
        for (uint32_t l = 0; l < t->n_layer; l++) count_layer(t, i, l);
    if (pthread_create(&t->thread, NULL, tail_main, t) != 0) {
        tail_pipe_free(t);
        return kvb_err_set(err, KVB_ERR_INTERNAL, "pipelined tail: could not start its thread");
    }
    *out = t;
    return KVB_OK;
}

void kvb_tail_pipe_slab(kvb_tail_pipe *t, uint32_t i, uint32_t layer) {
    if (t && i < t->n_pend && layer < t->n_layer) count_layer(t, i, layer);
}

bool kvb_tail_pipe_finish(kvb_tail_pipe *t, bool abort, kvb_block_id tail_page, kvb_block_id *last_page,
                          double *wait_s) {
    *last_page = KVB_BLOCK_NONE;
    *wait_s = 0;
    if (!t) return false;
    const double t0 = kvb_now_s();
    pthread_mutex_lock(&t->mu);
    for (uint32_t l = 0; !abort && l < t->n_layer; l++)
        abort = t->ready[l] < t->n_pend; /* a layer that never arrived: its gate would wait forever */
    if (abort) t->abort = true;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->thread, NULL);
    *wait_s = t->finished_at > t0 ? t->finished_at - t0 : 0;
    bool ok = !abort && t->st == KVB_OK;
    /* every block committed on the page the forward read, and the tail complete on its page */
    const uint32_t n_blocks = t->n_pend - t->has_tail;
    for (uint32_t i = 0; ok && i < n_blocks; i++)
        ok = kvb_store_slab_committed(t->pend[i]) && kvb_store_slab_block(t->pend[i]) == t->pages[i];
    if (ok && t->has_tail) ok = tail_page != KVB_BLOCK_NONE && tail_page == t->pages[n_blocks];
    if (ok) {
        *last_page = t->has_tail ? tail_page : t->own_page;
        t->own_page = KVB_BLOCK_NONE; /* now the caller's */
    }
    tail_pipe_free(t);
    return ok;
}
