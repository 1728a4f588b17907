/* bridge/rx_lanes.c — the decode side of a bridged request over the peer's lanes (several
 * connections, grouped with LANE frames): the PREFILL goes out on lane 0, then per lane a
 * receiving thread reads ahead (recv_pipe.c) while a committing thread puts each slab through the
 * one receiver (receiver.c: range check, the store's slab assembler, the block writer), and the
 * pipelined tail (tail_pipe.c) runs the last prompt token layer by layer as the blocks complete.
 * The first fault on any lane stops the others; once every lane ended, their DONEs are checked
 * against what arrived. The lanes are the caller's: this never connects or closes one, it says
 * in the outcome when the caller must drop them. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "bridge_internal.h"

typedef struct lane_rx lane_rx;
typedef struct {
    kvb_bridge_receiver *r;
    uint64_t rid;
    lane_rx *lanes; /* (n_lanes) */
    uint32_t n_lanes;
    pthread_mutex_t mu;   /* the fields below */
    char fault[160];      /* the first fault on any lane ("" = none) */
    kvb_bridge_fault fault_kind;
    bool drop;            /* the lanes can no longer be trusted */
    bool stopping;        /* a lane faulted: the others stop */
    uint32_t running;     /* lane threads not yet ended */
    pthread_cond_t ended; /* (monotonic) a lane thread ended */
} bridge_rx;

struct lane_rx {
    bridge_rx *rx;
    kvb_recv_pipe *pipe;
    uint32_t slabs; /* accepted on this lane */
    uint64_t bytes;
    kvb_msg_done done; /* its DONE (every lane has one when no fault was recorded) */
    pthread_t thread;
    bool started;
};

/* Records the first fault; unless it is the peer's own refusal (which comes on every lane), the
 * other lanes are shut so their threads stop now. */
static void rx_fault(bridge_rx *rx, kvb_bridge_fault kind, bool drop, const char *fmt, const char *msg) {
    pthread_mutex_lock(&rx->mu);
    if (rx->fault_kind == KVB_BRIDGE_FAULT_NONE) {
        snprintf(rx->fault, sizeof rx->fault, fmt, msg);
        rx->fault_kind = kind;
    }
    rx->drop |= drop;
    const bool stop_others = drop && !rx->stopping;
    if (stop_others) rx->stopping = true;
    pthread_mutex_unlock(&rx->mu);
    if (stop_others)
        for (uint32_t l = 0; l < rx->n_lanes; l++) kvb_recv_pipe_abort(rx->lanes[l].pipe);
}

static bool rx_stopping(bridge_rx *rx) {
    pthread_mutex_lock(&rx->mu);
    const bool s = rx->stopping;
    pthread_mutex_unlock(&rx->mu);
    return s;
}

/* One SLAB frame through the receiver; false after recording the fault of a slab it refused. */
static bool lane_put(lane_rx *ln, const kvb_msg_slab *sl) {
    const kvb_slab s = {.layer = sl->layer, .pos0 = sl->pos0, .n = sl->n, .k = sl->k, .v = sl->v,
                        .k_bytes = sl->k_bytes, .v_bytes = sl->v_bytes, .checksum = sl->checksum};
    kvb_err err = {0};
    const double t_put = kvb_now_s();
    const kvb_status st = kvb_bridge_receiver_put(ln->rx->r, &s, &err);
    kvb_trace_span("decode.slab_put", t_put, kvb_now_s(), sl->layer); /* verify and scatter */
    if (st) {
        rx_fault(ln->rx, KVB_BRIDGE_FAULT_CORRUPT_SLAB, true, "corrupt slab rejected: %.120s", err.msg);
        return false;
    }
    ln->slabs++;
    ln->bytes += sl->k_bytes + sl->v_bytes;
    return true;
}

/* One lane: verifies and commits its slabs until its DONE or ERROR, or a fault anywhere. */
static void *lane_main(void *arg) {
    lane_rx *ln = arg;
    bridge_rx *rx = ln->rx;
    kvb_err err = {0};
    for (;; kvb_recv_pipe_release(ln->pipe)) {
        kvb_msg m;
        const kvb_status st = kvb_recv_pipe_next(ln->pipe, &m, &err);
        if (st) {
            if (!rx_stopping(rx)) {
                const kvb_bridge_fault kind = kvb_bridge_fault_of_receive(st);
                const char *fmt = kind == KVB_BRIDGE_FAULT_TIMEOUT        ? "peer stalled: %.120s"
                                  : kind == KVB_BRIDGE_FAULT_CORRUPT_SLAB ? "corrupt frame rejected: %.120s"
                                                                          : "peer lost: %.120s";
                rx_fault(rx, kind, true, fmt, err.msg);
            }
            break;
        }
        if (rx_stopping(rx)) break;
        if (m.request_id != rx->rid) continue; /* a late frame of an abandoned request, a PONG */
        if (m.type == KVB_FRAME_SLAB) {
            if (!lane_put(ln, &m.u.slab)) break;
        } else if (m.type == KVB_FRAME_DONE) {
            ln->done = m.u.done;
            break;
        } else if (m.type == KVB_FRAME_ERROR && m.u.error.code == KVB_WIRE_ERR_BUSY) {
            rx_fault(rx, KVB_BRIDGE_FAULT_PEER_BUSY, false, "prefill node busy (%.130s)", m.u.error.msg);
            break;
        } else if (m.type == KVB_FRAME_ERROR) {
            rx_fault(rx, KVB_BRIDGE_FAULT_PEER_ERROR, false, "peer refused: %.130s", m.u.error.msg);
            break;
        }
    }
    pthread_mutex_lock(&rx->mu);
    rx->running--;
    pthread_cond_broadcast(&rx->ended);
    pthread_mutex_unlock(&rx->mu);
    return NULL;
}

/* Until every started lane thread has ended. A client that goes away meanwhile (looked at every
 * 100 ms) stops the bridge as a fault of kind client_gone: the lanes are shut, the peer is told
 * to cancel, and what arrived stays cached. */
static void wait_lanes(bridge_rx *rx, const kvb_bridge_rx_opts *op) {
    pthread_mutex_lock(&rx->mu);
    while (rx->running) {
        kvb_cond_wait_until(&rx->ended, &rx->mu, kvb_now_s() + 0.1);
        if (!rx->running || rx->stopping || !op->cancelled) continue;
        pthread_mutex_unlock(&rx->mu);
        if (op->cancelled(op->cancelled_ctx))
            rx_fault(rx, KVB_BRIDGE_FAULT_CLIENT_GONE, true, "%s", "the client went away");
        pthread_mutex_lock(&rx->mu);
    }
    pthread_mutex_unlock(&rx->mu);
}

/* Starts every lane's receiving thread, the pipelined tail when asked for, then every lane's
 * committing thread; a failure is recorded as an internal fault (the PREFILL went out: its stream
 * would arrive unread, so the lanes are dropped). Returns the pipelined tail, or NULL. */
static kvb_tail_pipe *start_lanes(bridge_rx *rx, const kvb_bridge_rx_opts *op) {
    kvb_err err = {0};
    for (uint32_t l = 0; l < rx->n_lanes; l++)
        if (kvb_recv_pipe_start(op->lanes[l], rx->rid, op->lane_timeout_ms, &rx->lanes[l].pipe, &err)) {
            rx_fault(rx, KVB_BRIDGE_FAULT_INTERNAL, true, "%.150s", err.msg);
            return NULL;
        }
    kvb_tail_pipe *tp = NULL;
    if (op->tail_engine) { /* without it the last token runs after the transfer */
        uint32_t n_pend = 0;
        kvb_slab_pending *const *pend = kvb_bridge_receiver_pending(rx->r, &n_pend);
        if (kvb_tail_pipe_start(op->tail_engine, op->toks, op->n_tok, op->cached, pend, n_pend,
                                kvb_bridge_receiver_tail_tokens(rx->r) != 0, op->logits, op->tail_threads, &op->batch,
                                &tp, &err))
            kvb_log(KVB_LOG_WARN, "bridge: no pipelined tail for this request: %s", err.msg);
    }
    kvb_bridge_receiver_set_tail_pipe(rx->r, tp);
    for (uint32_t l = 0; l < rx->n_lanes; l++) {
        pthread_mutex_lock(&rx->mu);
        rx->running++;
        pthread_mutex_unlock(&rx->mu);
        rx->lanes[l].started = pthread_create(&rx->lanes[l].thread, NULL, lane_main, &rx->lanes[l]) == 0;
        if (!rx->lanes[l].started) {
            pthread_mutex_lock(&rx->mu);
            rx->running--;
            pthread_mutex_unlock(&rx->mu);
            rx_fault(rx, KVB_BRIDGE_FAULT_INTERNAL, true, "%s", "could not start a receiving thread");
            break;
        }
    }
    return tp;
}

/* After every lane ended: the counts, the DONE check (no fault yet) and a complete tail's page. */
static void settle(bridge_rx *rx, kvb_bridge_rx_outcome *o) {
    uint32_t lane_slabs[KVB_WIRE_MAX_LANES];
    kvb_msg_done done[KVB_WIRE_MAX_LANES];
    for (uint32_t l = 0; l < rx->n_lanes; l++) {
        o->slabs += lane_slabs[l] = rx->lanes[l].slabs;
        o->bytes += rx->lanes[l].bytes;
        done[l] = rx->lanes[l].done;
    }
    if (rx->fault_kind == KVB_BRIDGE_FAULT_NONE) {
        kvb_err err = {0};
        o->prefill_s = done[0].prefill_seconds;
        if (kvb_bridge_receiver_check_done(rx->r, done, lane_slabs, rx->n_lanes, &err))
            rx_fault(rx, KVB_BRIDGE_FAULT_DONE_MISMATCH, false, "%.150s", err.msg);
        else
            o->tail_page = kvb_bridge_receiver_take_tail(rx->r);
    }
    o->fault = rx->fault_kind;
    snprintf(o->fault_msg, sizeof o->fault_msg, "%s", rx->fault);
}

void kvb_bridge_rx_run(kvb_bridge_receiver *r, const kvb_bridge_rx_opts *op, kvb_bridge_rx_outcome *o) {
    memset(o, 0, sizeof *o);
    o->tail_page = o->last_page = KVB_BLOCK_NONE;
    kvb_err err = {0};
    const double t_send = kvb_now_s();
    if (op->n_lanes == 0 || op->n_lanes > KVB_WIRE_MAX_LANES ||
        kvb_conn_send_prefill(op->lanes[0], op->prefill, op->send_timeout_ms, &err)) {
        o->fault = KVB_BRIDGE_FAULT_PEER_LOST;
        snprintf(o->fault_msg, sizeof o->fault_msg, "peer lost: %.130s", op->n_lanes ? err.msg : "no lanes");
        o->drop_link = true;
        o->t_end = kvb_now_s();
        return;
    }
    const double t_lanes = kvb_now_s();
    kvb_trace_span("decode.send_prefill", t_send, t_lanes, op->n_tok);
    lane_rx lanes[KVB_WIRE_MAX_LANES];
    memset(lanes, 0, sizeof lanes);
    bridge_rx rx = {.r = r, .rid = op->prefill->request_id, .lanes = lanes, .n_lanes = op->n_lanes};
    pthread_mutex_init(&rx.mu, NULL);
    const bool watch = kvb_cond_init_monotonic(&rx.ended) == 0; /* else: joined without watching the client */
    for (uint32_t l = 0; l < op->n_lanes; l++) lanes[l].rx = &rx;
    kvb_tail_pipe *tp = start_lanes(&rx, op);
    /* without the pipelined tail nothing computes for this prompt until DONE: the batches may */
    const bool lent = !tp && op->batch.lend;
    if (lent) op->batch.lend(op->batch.ctx);
    if (watch) wait_lanes(&rx, op);
    for (uint32_t l = 0; l < op->n_lanes; l++)
        if (lanes[l].started) pthread_join(lanes[l].thread, NULL);
    o->t_end = kvb_now_s();
    if (lent && op->batch.reclaim) op->batch.reclaim(op->batch.ctx);
    kvb_trace_span("decode.exchange", t_lanes, o->t_end, kvb_bridge_receiver_blocks(r)); /* until every DONE */
    settle(&rx, o);
    const double t_fin = kvb_now_s();
    o->last_ready = kvb_tail_pipe_finish(tp, o->fault != KVB_BRIDGE_FAULT_NONE, o->tail_page, &o->last_page,
                                         &o->tail_wait_s);
    kvb_bridge_receiver_set_tail_pipe(r, NULL);
    kvb_trace_span("decode.tail_finish", t_fin, kvb_now_s(), o->last_ready);
    for (uint32_t l = 0; l < op->n_lanes; l++) {
        double rd = 0, cs = 0;
        if (lanes[l].pipe) kvb_recv_pipe_waits(lanes[l].pipe, &rd, &cs);
        o->reader_wait_s += rd / op->n_lanes; /* per lane, on average */
        o->consumer_wait_s += cs / op->n_lanes;
    }
    if (o->fault == KVB_BRIDGE_FAULT_CORRUPT_SLAB || o->fault == KVB_BRIDGE_FAULT_CLIENT_GONE)
        kvb_conn_send_cancel(op->lanes[0], rx.rid, 1000, NULL);
    for (uint32_t l = 0; l < op->n_lanes; l++) kvb_recv_pipe_stop(lanes[l].pipe);
    if (watch) pthread_cond_destroy(&rx.ended);
    pthread_mutex_destroy(&rx.mu);
    o->drop_link = rx.drop;
    kvb_trace_span("decode.lanes_stop", t_fin, kvb_now_s(), 0);
}
