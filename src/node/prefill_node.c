/* node/prefill_node.c — the prefill role: accepts authenticated decode nodes, and for each
 * PREFILL computes what the decoder lacks on its engine with the bridge hooked after every
 * (chunk, layer), streaming slabs through the staging ring to one sender thread per lane (the
 * connections a decode node grouped with LANE frames; a connection without one is its own group),
 * then DONE on every lane. Its own
 * store is its prefix cache: a conversation's next turn recomputes only from the decoder's cached
 * prefix (capped by what this node's cache holds), never less than what it must ship. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_prefill_engine.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "kvb_transport.h"
#include "node_internal.h"

#define MAX_CONNS 64 /* connections: a decode node holds one per lane */

/* One lane's sender: a thread of the node's, started for the first request that has this many
 * lanes and kept (starting four threads per request cost 0.1-0.6 ms of its time to first token). */
typedef struct {
    kvb_prefill_node *n;
    pthread_t thread;
    bool started;
    /* under n->crew_mu: a request's lane is handed over by bumping job, and given back with busy */
    uint64_t job;
    bool busy;
    /* the request's, written by serve_prefill before the hand-over and read back after it */
    kvb_conn *c;
    uint64_t request_id;
    uint32_t slabs_sent; /* on this lane */
    uint64_t bytes_sent; /* K and V bytes of those slabs */
    kvb_err err;
    bool failed;
} sender_ctx;

struct kvb_prefill_node {
    kvb_prefill_config cfg;
    char *psk;
    kvb_model *m;
    kvb_prefill_engine *pe; /* the prefill engine (the factory's choice), or NULL: filler rows stand in */
    kvb_bridge_cpu *br;     /* cuts rows into slabs (and computes them, on the CPU engine) */
    uint64_t staging_bytes; /* host memory the engine's bridge rows stay in (its pinned slots) */
    uint32_t ship_from, ship_to; /* the request in flight: positions the decoder lacks */
    kvb_kvformat fmt; /* the decoder's format */
    kvb_hello hello;
    kvb_transport_config tcfg;
    kvb_listener *l;
    kvb_metric *m_refused;                            /* handshakes refused, by reason */
    uint64_t refused_counted[KVB_HANDSHAKE_REASONS];  /* of the listener's, in m_refused (accept thread) */
    pthread_t accept_thread;
    bool accept_started;
    atomic_bool stop; /* read by the accept and connection threads */
    atomic_bool draining;  /* kvb_prefill_node_quiesce: new PREFILLs are refused */
    atomic_uint in_flight; /* PREFILLs accepted and not yet answered (computing, or waiting their turn) */
    kvb_prefill_ops ops;   /* metrics, and /health and /metrics with cfg.http_listen */
    pthread_mutex_t mu; /* the engine: held by the request admission gave it to, and by helpers */
    kvb_admission *adm; /* who computes next: a bounded queue, round robin between decode nodes */
    kvb_metric *m_evictions; /* the engine's prefix cache: blocks evicted (least recently used) */
    uint64_t evictions_counted;
    /* the connection table, guarded by conns_mu (taken before lanes_mu, never after it): a slot is
     * used from its registration until the accept thread reaps it, which it does only once the
     * slot's thread ended (conn_done) and no request holds it as a lane (conn_busy) */
    pthread_mutex_t conns_mu;
    kvb_conn *conns[MAX_CONNS];
    pthread_t conn_threads[MAX_CONNS];
    bool conn_used[MAX_CONNS], conn_done[MAX_CONNS];
    uint32_t conn_busy[MAX_CONNS]; /* requests (served or refused now) using the slot's connection */
    pthread_mutex_t lanes_mu;     /* the lane fields (a LANE frame may arrive while a request runs) */
    kvb_msg_lane lane[MAX_CONNS]; /* each connection's lane (group 0: it sent none) */
    char who[MAX_CONNS][KVB_ADMISSION_WHO_MAX]; /* each connection's decode node: "NAME@HOST" */
    atomic_uint slab_seq;         /* slabs sent for the request in flight, over all lanes (faults) */
    kvb_ring ring;
    uint8_t *filler_k, *filler_v; /* bench_filler_rows: (chunk, n_head_kv, row_bytes) each, made at start */
    uint64_t peak_capture;
    uint32_t warmup_tokens; /* the start's warm-up prefill, and its seconds */
    double warmup_s;
    kvb_staging_stats last_staging; /* the last request's */
    int fault_kind; /* 0 none, 1 corrupt, 2 die, 3 stall, 4 pause */
    uint32_t fault_at;
    atomic_uint fault_left; /* requests it may still fire in (UINT32_MAX: every one) */
    sender_ctx senders[KVB_WIRE_MAX_LANES]; /* lane l's sender, started on first use */
    pthread_mutex_t crew_mu;
    pthread_cond_t crew_cv; /* a lane handed to a sender, a sender done with one, or crew_stop */
    bool crew_stop;
};

/* The CPU engine's rows live in buffers it reuses at once: copied into the ring. */
static kvb_status sink_to_ring(void *ctx, const kvb_slab *s, kvb_err *err) {
    return kvb_ring_push(&((kvb_prefill_node *)ctx)->ring, s, err);
}

/* Rows that stay put until the ring says they were sent (the CUDA bridge's pinned slot, the
 * bench's filler): sent from where they lie; their producer waits with kvb_ring_wait_sent_to. */
static kvb_status sink_view_to_ring(void *ctx, const kvb_slab *s, kvb_err *err) {
    return kvb_ring_push_view(&((kvb_prefill_node *)ctx)->ring, s, err);
}

/* Whether an injected fault fires now: one sender per request reaches its slab index. */
static bool fault_fires(kvb_prefill_node *n) {
    unsigned left = atomic_load(&n->fault_left);
    while (left && !atomic_compare_exchange_weak(&n->fault_left, &left, left == UINT32_MAX ? left : left - 1)) {
    }
    return left != 0;
}

/* One request's slabs on this sender's lane, until the ring is closed and empty, or fails. */
static void send_lane(sender_ctx *sc) {
    kvb_prefill_node *n = sc->n;
    kvb_slab s;
    uint32_t slot;
    bool checksum_known;
    for (double t_take = kvb_now_s(); kvb_ring_take(&n->ring, &slot, &s, &checksum_known); t_take = kvb_now_s()) {
        const double t_got = kvb_now_s();
        kvb_trace_span("prefill.ring_take", t_take, t_got, s.layer);
        sc->slabs_sent++;
        const uint32_t idx = atomic_fetch_add(&n->slab_seq, 1) + 1; /* over all lanes */
        if (!checksum_known) /* here, one thread per lane, unless the producer made it while it waited */
            s.checksum = kvb_slab_checksum(s.k, s.k_bytes, s.v, s.v_bytes);
        if (n->fault_kind && idx == n->fault_at && fault_fires(n)) {
            if (n->fault_kind == 1) ((uint8_t *)s.k)[s.k_bytes / 2] ^= 0x40; /* after its checksum */
            if (n->fault_kind == 2) {
                kvb_log(KVB_LOG_WARN, "prefill: fault injection: dropping the connection at slab %u", idx);
                kvb_conn_shutdown(sc->c);
            }
            if (n->fault_kind == 3) {
                kvb_log(KVB_LOG_WARN, "prefill: fault injection: stalling at slab %u", idx);
                for (int i = 0; i < 300 && !n->stop; i++) usleep(100000);
            }
            if (n->fault_kind == 4) {
                kvb_log(KVB_LOG_INFO, "prefill: fault injection: pausing 2 s at slab %u", idx);
                for (int i = 0; i < 20 && !n->stop; i++) usleep(100000);
            }
        }
        kvb_msg_slab m = {.layer = s.layer, .pos0 = s.pos0, .n = s.n, .k = s.k, .v = s.v,
                          .k_bytes = s.k_bytes, .v_bytes = s.v_bytes, .checksum = s.checksum};
        if (kvb_conn_send_slab(sc->c, sc->request_id, &m, 60000, &sc->err)) {
            sc->failed = true;
            kvb_ring_fail(&n->ring);
            break;
        }
        sc->bytes_sent += s.k_bytes + s.v_bytes;
        kvb_trace_span("prefill.send_slab", t_got, kvb_now_s(), s.layer); /* checksum and send */
        kvb_ring_done(&n->ring, slot);
    }
}

static void *sender_main(void *arg) {
    sender_ctx *sc = arg;
    kvb_prefill_node *n = sc->n;
    uint64_t done = 0;
    pthread_mutex_lock(&n->crew_mu);
    for (;;) {
        while (sc->job == done && !n->crew_stop) pthread_cond_wait(&n->crew_cv, &n->crew_mu);
        if (sc->job == done) break; /* stopping, with no lane in hand */
        done = sc->job;
        pthread_mutex_unlock(&n->crew_mu);
        send_lane(sc);
        pthread_mutex_lock(&n->crew_mu);
        sc->busy = false;
        pthread_cond_broadcast(&n->crew_cv);
    }
    pthread_mutex_unlock(&n->crew_mu);
    return NULL;
}

/* Hands lanes[0 .. n_lanes) of request_id to senders 0 .. n_lanes - 1, starting any that never ran. */
static kvb_status senders_start(kvb_prefill_node *n, kvb_conn *const *lanes, uint32_t n_lanes, uint64_t request_id,
                                kvb_err *err) {
    pthread_mutex_lock(&n->crew_mu);
    kvb_status st = KVB_OK;
    for (uint32_t l = 0; l < n_lanes && !st; l++) {
        sender_ctx *sc = &n->senders[l];
        if (!sc->started) {
            sc->n = n;
            sc->started = pthread_create(&sc->thread, NULL, sender_main, sc) == 0;
            if (!sc->started) {
                st = kvb_err_set(err, KVB_ERR_INTERNAL, "could not start a sender thread");
                break;
            }
        }
        sc->c = lanes[l];
        sc->request_id = request_id;
        sc->slabs_sent = 0;
        sc->bytes_sent = 0;
        sc->failed = false;
        memset(&sc->err, 0, sizeof sc->err);
        sc->busy = true;
        sc->job++;
    }
    pthread_cond_broadcast(&n->crew_cv);
    pthread_mutex_unlock(&n->crew_mu);
    return st;
}

/* Waits until senders 0 .. n_lanes - 1 are done with the request they were handed. */
static void senders_wait(kvb_prefill_node *n, uint32_t n_lanes) {
    pthread_mutex_lock(&n->crew_mu);
    for (uint32_t l = 0; l < n_lanes; l++)
        while (n->senders[l].busy) pthread_cond_wait(&n->crew_cv, &n->crew_mu);
    pthread_mutex_unlock(&n->crew_mu);
}

uint64_t kvb_filler_fingerprint(uint64_t model_fingerprint) {
    return model_fingerprint ^ 0x66696c6c65722121ull; /* "filler!!" */
}

/* bench_filler_rows: the filler, made once at start (it stands in for an engine's rows: not
 * staging memory, not counted as capture, and not the request's time). */
static kvb_status filler_rows_make(kvb_prefill_node *n, kvb_err *err) {
    const size_t bytes = (size_t)n->cfg.chunk_tokens * n->m->d.n_head_kv * kvb_kvformat_row_bytes(&n->fmt);
    n->filler_k = malloc(bytes);
    n->filler_v = malloc(bytes);
    if (!n->filler_k || !n->filler_v) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for filler rows");
    for (size_t i = 0; i < bytes; i++) n->filler_k[i] = (uint8_t)(i * 7), n->filler_v[i] = (uint8_t)(i * 13);
    return KVB_OK;
}

/* bench_filler_rows: every (chunk, layer) of [ship_from, ship_to) as filler rows through the same
 * cutting, staging and sending as computed rows, a chunk's layer at a time as the CUDA bridge
 * hands over its pinned slot (the slab path's own ceiling). */
static kvb_status ship_filler_rows(kvb_prefill_node *n, kvb_err *err) {
    const uint32_t chunk = n->cfg.chunk_tokens;
    kvb_status st = KVB_OK;
    uint64_t before = 0; /* the ring's mark after the previous (chunk, layer) */
    for (uint32_t p = n->ship_from; !st && p < n->ship_to; p += chunk) {
        const uint32_t cnt = n->ship_to - p < chunk ? n->ship_to - p : chunk;
        for (uint32_t l = 0; !st && l < n->m->d.n_layer; l++) {
            st = kvb_bridge_cpu_rows(n->br, l, p, cnt, n->filler_k, n->filler_v, n->fmt.dtype, err);
            const uint64_t mark = kvb_ring_mark(&n->ring);
            /* as the CUDA bridge's two pinned slots: one batch in the senders' hands, the next queued */
            if (!st) st = kvb_ring_wait_sent_to(&n->ring, before, err);
            before = mark;
        }
    }
    return st;
}

/* The engine's bridge rows that stay put (pinned slots) are released once the senders took them:
 * a batch's mark is the ring's after its slabs. */
static uint64_t ring_mark(void *ctx) { return kvb_ring_mark(&((kvb_prefill_node *)ctx)->ring); }

static kvb_status ring_wait_sent(void *ctx, uint64_t mark, kvb_err *err) {
    return kvb_ring_wait_sent_to(&((kvb_prefill_node *)ctx)->ring, mark, err);
}

/* The next rows' positions and sink: through the engine, which computes them, or (filler rows) the
 * cutter alone. */
static void bridge_begin(kvb_prefill_node *n, uint32_t ship_from, uint32_t ship_to, kvb_slab_sink sink) {
    if (n->pe) kvb_prefill_bridge_begin(n->pe, ship_from, ship_to, sink, n);
    else kvb_bridge_cpu_begin(n->br, ship_from, ship_to, sink, n);
}

/* The lanes a PREFILL on connection `slot` is answered over: that connection, and when it is lane 0
 * of a group, the group's other lanes in order (out: (lanes) connections, out_slots their table
 * slots). 0 with a message when the group is incomplete. The lanes are held (conn_busy) until
 * release_lanes, so none is reaped while the request uses it. */
static uint32_t gather_lanes(kvb_prefill_node *n, int slot, kvb_conn **out, int *out_slots, char *why,
                             size_t why_cap) {
    pthread_mutex_lock(&n->conns_mu);
    out[0] = n->conns[slot];
    out_slots[0] = slot;
    pthread_mutex_lock(&n->lanes_mu);
    const kvb_msg_lane me = n->lane[slot];
    uint32_t lanes = me.group && me.lane == 0 ? me.lanes : 1;
    for (uint32_t l = 1; l < lanes; l++) {
        out[l] = NULL;
        for (int i = 0; i < MAX_CONNS && !out[l]; i++)
            if (n->conn_used[i] && i != slot && n->lane[i].group == me.group && n->lane[i].lane == l &&
                n->lane[i].lanes == lanes && kvb_conn_usable(n->conns[i])) {
                out[l] = n->conns[i];
                out_slots[l] = i;
            }
        if (!out[l]) {
            snprintf(why, why_cap, "lane %u of the %u this connection's group has is not connected", l, lanes);
            lanes = 0;
        }
    }
    pthread_mutex_unlock(&n->lanes_mu);
    for (uint32_t l = 0; l < lanes; l++) n->conn_busy[out_slots[l]]++;
    pthread_mutex_unlock(&n->conns_mu);
    return lanes;
}

/* Connections from decode nodes whose threads still run. Caller holds conns_mu. */
static uint32_t conns_open_locked(const kvb_prefill_node *n) {
    uint32_t k = 0;
    for (int i = 0; i < MAX_CONNS; i++) k += n->conn_used[i] && !n->conn_done[i];
    return k;
}

static uint32_t conns_open(kvb_prefill_node *n) {
    pthread_mutex_lock(&n->conns_mu);
    const uint32_t k = conns_open_locked(n);
    pthread_mutex_unlock(&n->conns_mu);
    return k;
}

static void release_lanes(kvb_prefill_node *n, const int *slots, uint32_t n_lanes) {
    pthread_mutex_lock(&n->conns_mu);
    for (uint32_t l = 0; l < n_lanes; l++) n->conn_busy[slots[l]]--;
    pthread_mutex_unlock(&n->conns_mu);
}

static void send_error_all(kvb_conn *const *lanes, uint32_t n_lanes, uint64_t request_id, uint32_t code,
                           const char *msg) {
    for (uint32_t l = 0; l < n_lanes; l++) kvb_conn_send_error(lanes[l], request_id, code, msg, 10000, NULL);
}

/* Serves one PREFILL over its lanes; the caller holds the engine (n->mu). t0: its arrival. */
static const char *serve_prefill_locked(kvb_prefill_node *n, kvb_conn *const *lanes, uint32_t n_lanes,
                                        kvb_msg_prefill *p, double t0);

/* The engine's prefix-cache evictions since the last look, into their counter. Caller holds mu. */
static void count_evictions(kvb_prefill_node *n) {
    if (!n->pe) return;
    kvb_prefill_stats ps;
    kvb_prefill_engine_stats(n->pe, &ps);
    if (ps.cache_evictions > n->evictions_counted)
        kvb_metric_add(n->m_evictions, NULL, (double)(ps.cache_evictions - n->evictions_counted));
    n->evictions_counted = ps.cache_evictions;
}

/* One PREFILL that arrived on connection `slot`: refused at once while draining or when the queue
 * is full (BUSY), else served when admission gives it the engine (round robin between decode
 * nodes, in arrival order within one). */
static void serve_prefill(kvb_prefill_node *n, int slot, kvb_msg_prefill *p) {
    const double t0 = kvb_now_s();
    kvb_metric_set(n->ops.m_in_flight, NULL, atomic_fetch_add(&n->in_flight, 1) + 1.0);
    const char *outcome = "refused";
    kvb_conn *lanes[KVB_WIRE_MAX_LANES];
    int lane_slots[KVB_WIRE_MAX_LANES];
    char why[256];
    const uint32_t n_lanes = gather_lanes(n, slot, lanes, lane_slots, why, sizeof why);
    kvb_admission_verdict v = KVB_ADMISSION_STOPPING;
    if (!n_lanes) {
        kvb_conn_send_error(n->conns[slot], p->request_id, KVB_WIRE_ERR_REQUEST, why, 10000, NULL);
    } else if (atomic_load(&n->draining)) { /* stopping: the decoder computes this prompt itself */
        send_error_all(lanes, n_lanes, p->request_id, KVB_WIRE_ERR_REQUEST,
                       "this prefill node is draining (shutting down); compute natively");
    } else if ((v = kvb_admission_enter(n->adm, n->who[slot], why, sizeof why)) != KVB_ADMITTED) {
        const bool busy = v != KVB_ADMISSION_STOPPING; /* the decoder goes elsewhere, or computes it */
        send_error_all(lanes, n_lanes, p->request_id, busy ? KVB_WIRE_ERR_BUSY : KVB_WIRE_ERR_REQUEST, why);
        if (busy) outcome = "busy";
    } else {
        pthread_mutex_lock(&n->mu);
        outcome = serve_prefill_locked(n, lanes, n_lanes, p, t0);
        count_evictions(n);
        pthread_mutex_unlock(&n->mu);
        kvb_admission_leave(n->adm);
    }
    if (n_lanes) release_lanes(n, lane_slots, n_lanes);
    if (strcmp(outcome, "busy")) kvb_admission_count(n->adm, n->who[slot], outcome); /* busy: counted by reason */
    kvb_metric_add(n->ops.m_requests, KVB_LABELS(outcome), 1);
    kvb_metric_set(n->ops.m_in_flight, NULL, atomic_fetch_sub(&n->in_flight, 1) - 1.0);
}

/* DONE on every lane of a served request: the chain digest of the blocks shipped, and each lane's
 * own slab count. t0: the request's arrival. */
static void send_done_all(kvb_prefill_node *n, kvb_conn *const *lanes, uint32_t n_lanes, const kvb_msg_prefill *p,
                          double t0) {
    const uint32_t bt = n->fmt.block_tokens, nb = (p->ship_tokens - p->cached_tokens) / bt;
    uint64_t *keys = malloc(sizeof(uint64_t) * (nb ? nb : 1));
    uint64_t key = p->last_cached_key;
    for (uint32_t b = 0; keys && b < nb; b++) {
        key = kvb_chain_next(key, p->tokens + p->cached_tokens + (size_t)b * bt, bt);
        keys[b] = key;
    }
    kvb_msg_done d = {.tokens_covered = p->ship_tokens,
                      .blocks = nb,
                      .chain_digest = keys ? kvb_wire_chain_digest(keys, nb) : 0,
                      .prefill_seconds = kvb_now_s() - t0};
    free(keys);
    kvb_err err = {0};
    for (uint32_t l = 0; l < n_lanes; l++) {
        d.slabs = n->senders[l].slabs_sent;
        if (kvb_conn_send_done(lanes[l], p->request_id, &d, 10000, &err))
            kvb_log(KVB_LOG_WARN, "prefill: sending DONE on lane %u failed: %s", l, err.msg);
    }
}

/* Returns the outcome for kvbridge_prefill_requests_total: "served", "refused" or "failed". */
static const char *serve_prefill_locked(kvb_prefill_node *n, kvb_conn *const *lanes, uint32_t n_lanes,
                                        kvb_msg_prefill *p, double t0) {
    kvb_err err = {0};
    if (p->bridge_mode != n->hello.bridge_mode) {
        send_error_all(lanes, n_lanes, p->request_id, KVB_WIRE_ERR_MODE, "this prefill node runs another bridge mode");
        return "refused";
    }
    if (kvb_msg_prefill_check(p, &n->fmt, &err) || p->n_tokens > n->cfg.max_ctx) {
        if (!err.msg[0]) snprintf(err.msg, sizeof err.msg, "prompt of %u tokens exceeds this node's limit of %u",
                                  p->n_tokens, n->cfg.max_ctx);
        send_error_all(lanes, n_lanes, p->request_id, KVB_WIRE_ERR_REQUEST, err.msg);
        return "refused";
    }
    for (uint32_t i = 0; i < p->n_tokens; i++)
        if ((uint32_t)p->tokens[i] >= n->m->d.n_vocab) {
            send_error_all(lanes, n_lanes, p->request_id, KVB_WIRE_ERR_REQUEST, "token id outside the vocabulary");
            return "refused";
        }
    kvb_prefill_seq *s = NULL;
    uint32_t adopted = 0, computed = 0; /* computed: prompt tokens this node's engine ran */
    kvb_status st = KVB_OK;
    /* adopt our own cached prefix, but never past the decoder's: we need the attention inputs of
     * every position we ship, so those are recomputed */
    if (n->pe) {
        st = kvb_prefill_seq_create(n->pe, &s, &err);
        if (!st) st = kvb_prefill_seq_attach_cached(s, p->tokens, p->cached_tokens + 1, &adopted, &err);
    }
    n->ship_from = p->cached_tokens;
    n->ship_to = p->ship_tokens;
    /* rows that stay put (an engine's pinned slots, the bench's filler) are sent from where they lie */
    const bool views = !n->pe || kvb_prefill_rows_stay_put(n->pe);
    kvb_ring_reset(&n->ring, views);
    atomic_store(&n->slab_seq, 0);
    const double t_checked = kvb_now_s();
    kvb_trace_span("prefill.setup", t0, t_checked, p->n_tokens); /* lanes, checks, our cached prefix */
    if (!st) {
        bridge_begin(n, p->cached_tokens, p->ship_tokens, views ? sink_view_to_ring : sink_to_ring);
        st = senders_start(n, lanes, n_lanes, p->request_id, &err);
    }
    kvb_trace_span("prefill.senders_start", t_checked, kvb_now_s(), n_lanes);
    if (!st && !n->pe)
        st = ship_filler_rows(n, &err);
    else if (!st && p->ship_tokens > adopted) {
        st = kvb_prefill_forward(n->pe, s, p->tokens + adopted, p->ship_tokens - adopted, NULL, false, &err);
        if (!st) computed = p->ship_tokens - adopted;
    }
    kvb_ring_close(&n->ring);
    if (st) kvb_ring_fail(&n->ring); /* what was staged is not sent: the request failed */
    const double t_join = kvb_now_s();
    kvb_trace_span("prefill.compute", t0, t_join, p->ship_tokens - p->cached_tokens); /* from PREFILL's arrival */
    bool link_failed = false;
    senders_wait(n, n_lanes);
    sender_ctx *sc = n->senders;
    for (uint32_t l = 0; l < n_lanes; l++)
        if (sc[l].failed && !link_failed) {
            link_failed = true;
            kvb_log(KVB_LOG_WARN, "prefill: request %llu: link failed on lane %u: %s",
                    (unsigned long long)p->request_id, l, sc[l].err.msg);
        }
    if (n->ring.peak * n->ring.slot_bytes > n->peak_capture) n->peak_capture = n->ring.peak * n->ring.slot_bytes;
    n->last_staging = (kvb_staging_stats){.full_s = n->ring.full_s,
                                          .empty_s = n->ring.empty_s / n_lanes,
                                          .slabs = atomic_load(&n->slab_seq),
                                          .checksums_by_producer = n->ring.hashed_by_producer};
    kvb_prefill_seq_free(s);

    uint64_t bytes = 0;
    for (uint32_t l = 0; l < n_lanes; l++) bytes += sc[l].bytes_sent;
    kvb_metric_add(n->ops.m_bytes, NULL, (double)bytes);
    if (link_failed) /* the connection is unusable; the decoder keeps what it committed */
        return "failed";
    if (st) {
        kvb_log(KVB_LOG_WARN, "prefill: request %llu failed: %s", (unsigned long long)p->request_id, err.msg);
        send_error_all(lanes, n_lanes, p->request_id, KVB_WIRE_ERR_REQUEST, err.msg);
        return "failed";
    }
    const double t_done = kvb_now_s();
    kvb_trace_span("prefill.senders_join", t_join, t_done, 0);
    send_done_all(n, lanes, n_lanes, p, t0);
    kvb_trace_span("prefill.send_done", t_done, kvb_now_s(), n_lanes);
    kvb_metric_add(n->ops.m_tokens, KVB_LABELS("shipped"), (double)(p->ship_tokens - p->cached_tokens));
    kvb_metric_add(n->ops.m_tokens, KVB_LABELS("computed"), (double)computed);
    kvb_metric_add(n->ops.m_tokens, KVB_LABELS("cached"), (double)adopted); /* this node's prefix cache's hits */
    kvb_metric_observe(n->ops.m_seconds, NULL, kvb_now_s() - t0);
    return "served";
}

typedef struct {
    kvb_prefill_node *n;
    int slot;
} conn_arg;

static void *conn_main(void *arg) {
    conn_arg *ca = arg;
    kvb_prefill_node *n = ca->n;
    const int slot = ca->slot;
    kvb_conn *c = n->conns[slot];
    free(ca);
    while (!n->stop && kvb_conn_usable(c)) {
        kvb_msg m;
        kvb_err err = {0};
        if (kvb_conn_recv(c, 24 * 3600 * 1000, &m, &err)) {
            if (!n->stop) kvb_log(KVB_LOG_INFO, "prefill: connection from %s ended: %s", kvb_conn_peer_addr(c), err.msg);
            break;
        }
        if (m.type == KVB_FRAME_PREFILL) serve_prefill(n, slot, &m.u.prefill);
        else if (m.type == KVB_FRAME_LANE) {
            pthread_mutex_lock(&n->lanes_mu);
            n->lane[slot] = m.u.lane;
            pthread_mutex_unlock(&n->lanes_mu);
        } else if (m.type == KVB_FRAME_PING) { /* a decode node's heartbeat: the answer carries our queue */
            const unsigned in_flight = atomic_load(&n->in_flight);
            const kvb_msg_ping pong = {.token = m.u.ping.token, .in_flight = in_flight,
                                       .waiting = kvb_admission_waiting(n->adm)};
            kvb_conn_send_pong_load(c, &pong, 10000, NULL);
        }
        else if (m.type == KVB_FRAME_ERROR) kvb_log(KVB_LOG_WARN, "prefill: peer error: %s", m.u.error.msg);
        kvb_msg_free(&m);
    }
    pthread_mutex_lock(&n->conns_mu);
    n->conn_done[slot] = true; /* the accept thread may reap the slot once no request holds it */
    kvb_metric_set(n->ops.m_conns, NULL, conns_open_locked(n));
    pthread_mutex_unlock(&n->conns_mu);
    return NULL;
}

/* The listener's refused handshakes since the last look, into the counter by reason. */
static void count_refusals(kvb_prefill_node *n) {
    kvb_listener_stats ls;
    kvb_listener_get_stats(n->l, &ls);
    for (int r = 0; r < KVB_HANDSHAKE_REASONS; r++)
        if (ls.failed[r] > n->refused_counted[r]) {
            kvb_metric_add(n->m_refused, KVB_LABELS(kvb_handshake_reason_name((kvb_handshake_reason)r)),
                           (double)(ls.failed[r] - n->refused_counted[r]));
            n->refused_counted[r] = ls.failed[r];
        }
}

static void *accept_main(void *arg) {
    kvb_prefill_node *n = arg;
    while (!n->stop) {
        kvb_conn *c = NULL;
        kvb_hello peer;
        kvb_err err = {0};
        /* the timeout bounds the wait and the handshake: generous, since a loaded machine can be
         * slow to schedule either side; stop() wakes this with a connection of its own */
        if (kvb_transport_accept(n->l, &n->hello, &n->tcfg, 5000, &c, &peer, &err)) {
            count_refusals(n); /* a wait in which nobody connected counts nothing */
            if (!n->stop && err.code != KVB_ERR_TIMEOUT) kvb_log(KVB_LOG_WARN, "prefill: refused a peer: %s", err.msg);
            continue;
        }
        /* the connection table only, not the engine: a decode node connects while a prompt computes */
        pthread_mutex_lock(&n->conns_mu);
        int slot = -1;
        for (int i = 0; i < MAX_CONNS && slot < 0; i++)
            if (!n->conn_used[i]) slot = i;
            else if (n->conn_done[i] && !n->conn_busy[i]) { /* reap a finished connection: its thread ended */
                pthread_join(n->conn_threads[i], NULL);
                kvb_conn_close(n->conns[i]);
                n->conn_used[i] = n->conn_done[i] = false;
                slot = i;
            }
        conn_arg *ca = slot >= 0 ? malloc(sizeof *ca) : NULL;
        if (!ca) {
            pthread_mutex_unlock(&n->conns_mu);
            kvb_conn_send_error(c, 0, KVB_WIRE_ERR_REQUEST, "too many decode nodes connected", 1000, NULL);
            kvb_conn_close(c);
            continue;
        }
        *ca = (conn_arg){n, slot};
        n->conns[slot] = c;
        kvb_admission_who(peer.name, kvb_conn_peer_addr(c), n->who[slot], sizeof n->who[slot]);
        pthread_mutex_lock(&n->lanes_mu);
        n->lane[slot] = (kvb_msg_lane){0}; /* a group of one until it says otherwise */
        pthread_mutex_unlock(&n->lanes_mu);
        n->conn_used[slot] = pthread_create(&n->conn_threads[slot], NULL, conn_main, ca) == 0;
        if (!n->conn_used[slot]) {
            free(ca);
            kvb_conn_close(c);
        }
        kvb_metric_set(n->ops.m_conns, NULL, conns_open_locked(n));
        pthread_mutex_unlock(&n->conns_mu);
        kvb_log(KVB_LOG_INFO, "prefill: decode node %s connected", n->who[slot]);
    }
    return NULL;
}

/* The prefill engine the configuration names, with the bridge on its layer hook. Decoder mode: the
 * engine computes in the decoder's own cache format, so its attention inputs are the decoder's,
 * and the bridge runs the decoder's arithmetic on them (a GPU engine computes the prompt in bf16,
 * and the bridge kernel runs the decoder's arithmetic on the GPU, layer by layer). Prefill mode:
 * the engine's own rows (its own format) are re-encoded instead. Its own store is the prefix cache
 * across requests. */
static kvb_status engine_create(kvb_prefill_node *n, kvb_err *err) {
    const kvb_prefill_config *cfg = &n->cfg;
    const uint32_t bt = cfg->block_tokens;
    kvb_prefill_opts po = {
        .device = cfg->cuda ? KVB_DEVICE_CUDA : KVB_DEVICE_CPU,
        .n_threads = cfg->n_threads,
        .cache_dtype = cfg->prefill_mode && cfg->engine_cache_dtype ? cfg->engine_cache_dtype : cfg->cache_dtype,
        .block_tokens = bt,
        .max_ctx = cfg->max_ctx,
        .max_batch = cfg->chunk_tokens,
        .n_blocks = cfg->cache_blocks ? cfg->cache_blocks : 2 * ((cfg->max_ctx + bt - 1) / bt),
        .prefault = true, /* every weight page now, not on the first request */
        .gpus = cfg->gpus > 1 ? cfg->gpus : 1,
        .tp_one_device = cfg->tp_one_device,
        .weights = (kvb_prefill_weights)cfg->gpu_weights,
        .bridge = n->br,
        .bridge_fmt = &n->fmt,
        .bridge_engine_rows = cfg->prefill_mode,
        .ggml_arith = cfg->kv_ggml,
        .release = {.mark = ring_mark, .wait_sent = ring_wait_sent, .ctx = n},
    };
    kvb_status st = kvb_prefill_engine_create(n->m, &po, &n->pe, err);
    if (st) return st;
    char dev[512], att[768];
    kvb_prefill_engine_describe(n->pe, dev, sizeof dev);
    kvb_prefill_engine_attention_describe(n->pe, att, sizeof att);
    kvb_log(KVB_LOG_INFO, "prefill: %s engine: %s; attention: %s", kvb_prefill_engine_name(n->pe), dev, att);
    kvb_prefill_stats ps;
    kvb_prefill_engine_stats(n->pe, &ps);
    n->staging_bytes = ps.staging_bytes;
    return KVB_OK;
}

static kvb_status parse_fault(kvb_prefill_node *n, const char *f, kvb_err *err) {
    if (!f || !*f) return KVB_OK;
    const char *kinds[] = {"corrupt:", "die:", "stall:", "pause:"};
    for (int i = 0; i < 4; i++)
        if (!strncmp(f, kinds[i], strlen(kinds[i]))) {
            char *end;
            const unsigned long at = strtoul(f + strlen(kinds[i]), &end, 10);
            unsigned long times = UINT32_MAX;
            if (*end == 'x') times = strtoul(end + 1, &end, 10);
            if (*end || at < 1 || at >= UINT32_MAX || times < 1 || times > UINT32_MAX) break;
            n->fault_kind = i + 1;
            n->fault_at = (uint32_t)at;
            atomic_store(&n->fault_left, (unsigned)times);
            return KVB_OK;
        }
    return kvb_err_set(err, KVB_ERR_INVALID, "fault '%s' is not corrupt:N, die:N, stall:N or pause:N (N >= 1), or one of them "
                                             "with xK (the first K requests only)", f);
}

/* /health with --http: {"status": "ok" (503 "draining" once quiesced), "role": "prefill", ...}. */
static void prefill_health(void *ctx, cJSON *body) {
    kvb_prefill_node *n = ctx;
    cJSON_AddStringToObject(body, "role", "prefill");
    cJSON_AddNumberToObject(body, "in_flight", atomic_load(&n->in_flight));
    cJSON_AddNumberToObject(body, "connections", conns_open(n));
}

kvb_status kvb_prefill_node_start(const kvb_prefill_config *cfg, kvb_prefill_node **out, kvb_err *err) {
    *out = NULL;
    kvb_prefill_node *n = calloc(1, sizeof *n);
    if (!n) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    n->cfg = *cfg;
    if (!n->cfg.block_tokens) n->cfg.block_tokens = 32;
    if (!n->cfg.max_ctx) n->cfg.max_ctx = 32768;
    /* filler rows stand in for the GPU's: they go a CUDA chunk's layer at a time */
    if (!n->cfg.chunk_tokens) n->cfg.chunk_tokens = cfg->cuda || cfg->bench_filler_rows ? 8192 : 512;
    if (n->cfg.chunk_tokens > n->cfg.max_ctx) n->cfg.chunk_tokens = n->cfg.max_ctx;
    if (!n->cfg.ring_slots) n->cfg.ring_slots = 16;
    if (!n->cfg.max_queue) n->cfg.max_queue = 8;
    if (!n->cfg.max_queue_per_decoder) n->cfg.max_queue_per_decoder = 4;
    pthread_mutex_init(&n->mu, NULL);
    pthread_mutex_init(&n->conns_mu, NULL);
    pthread_mutex_init(&n->lanes_mu, NULL);
    pthread_mutex_init(&n->crew_mu, NULL);
    pthread_cond_init(&n->crew_cv, NULL);
    kvb_status st = parse_fault(n, cfg->fault, err);
    const uint32_t ctx_blocks = (n->cfg.max_ctx + n->cfg.block_tokens - 1) / n->cfg.block_tokens;
    if (!st && cfg->cache_blocks && cfg->cache_blocks < ctx_blocks)
        st = kvb_err_set(err, KVB_ERR_INVALID, "a prefix cache of %u blocks cannot hold one prompt of the context "
                         "limit (%u tokens: %u blocks of %u)", cfg->cache_blocks, n->cfg.max_ctx, ctx_blocks,
                         n->cfg.block_tokens);
    if (!st && (!cfg->psk || strlen(cfg->psk) < KVB_WIRE_PSK_MIN))
        st = kvb_err_set(err, KVB_ERR_INVALID, "a pre-shared key of at least %d bytes is required (--psk)",
                         KVB_WIRE_PSK_MIN);
    if (!st && !(n->psk = strdup(cfg->psk))) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    if (!st) st = kvb_model_load(cfg->model_path, &n->m, err);
    if (!st) st = kvb_model_kvformat(&n->m->d, cfg->cache_dtype, n->cfg.block_tokens, &n->fmt, err);
    if (!st) st = kvb_bridge_cpu_create(n->m, &n->fmt, NULL, n->cfg.chunk_tokens, &n->br, err);
    if (!st) kvb_bridge_cpu_sink_checksums(n->br, true); /* the senders hash, one per lane */
    /* filler rows stand in for the engine: none is made (nor its activations for a chunk) */
    if (!st && !cfg->bench_filler_rows) st = engine_create(n, err);
    if (!st && cfg->bench_filler_rows) st = filler_rows_make(n, err);
    const uint32_t bt = n->cfg.block_tokens;
    if (!st)
        st = kvb_ring_init(&n->ring, n->cfg.ring_slots, 2 * (n->cfg.chunk_tokens / bt + 2), /* views: two chunk-layers */
                           2 * (size_t)bt * n->m->d.n_head_kv * kvb_kvformat_row_bytes(&n->fmt), err);
    if (!st) st = kvb_hello_init(&n->hello, KVB_ROLE_PREFILL,
                                 cfg->prefill_mode ? KVB_BRIDGE_MODE_PREFILL : KVB_BRIDGE_MODE_DECODER,
                                 cfg->name ? cfg->name : "prefill",
                                 cfg->bench_filler_rows ? kvb_filler_fingerprint(n->m->fingerprint) : n->m->fingerprint,
                                 &n->fmt, err);
    n->tcfg = (kvb_transport_config){.psk = (const uint8_t *)n->psk, .psk_len = n->psk ? strlen(n->psk) : 0,
                                     .backend = cfg->backend};
    if (!st && cfg->cuda && cfg->warmup_tokens) {
        /* twice: the second pass is its shapes' second sight, so cuDNN's plans for them are built
         * (kvb_cudnn_attn_take) — a full first chunk is the shape every long prompt starts with */
        const uint32_t t = cfg->warmup_tokens < n->cfg.max_ctx ? cfg->warmup_tokens : n->cfg.max_ctx - 1;
        double s1 = 0, s2 = 0;
        if (t && !(st = kvb_prefill_node_time_alone(n, t, 1, true, &s1, err)) &&
            !(st = kvb_prefill_node_time_alone(n, t, 1, true, &s2, err))) {
            n->warmup_tokens = t;
            n->warmup_s = s1 + s2;
        }
    }
    if (!st) st = kvb_prefill_ops_start(&n->ops, cfg->http_listen, cfg->name ? cfg->name : "prefill", prefill_health, n,
                                        err);
    if (!st)
        st = kvb_metrics_register(n->ops.metrics, KVB_METRIC_COUNTER, "kvbridge_prefill_handshakes_refused_total",
                                  "Connections from would-be decode nodes whose handshake failed, by reason: auth "
                                  "(another key), mismatch (another model, cache format or version), timeout (it "
                                  "said nothing in time), protocol (not kvbridge), gone (it closed), refused, other",
                                  "reason", NULL, 0, &n->m_refused, err);
    if (!st)
        st = kvb_metrics_register(n->ops.metrics, KVB_METRIC_COUNTER, "kvbridge_prefill_cache_evictions_total",
                                  "Blocks of this node's own prefix cache evicted to make room (least recently used "
                                  "conversations' first; --cache-blocks bounds it)", NULL, NULL, 0, &n->m_evictions,
                                  err);
    if (!st) st = kvb_admission_create(n->cfg.max_queue, n->cfg.max_queue_per_decoder, n->ops.metrics, &n->adm, err);
    if (!st) st = kvb_transport_listen(cfg->listen, cfg->backend, &n->l, err);
    if (!st) {
        n->accept_started = pthread_create(&n->accept_thread, NULL, accept_main, n) == 0;
        if (!n->accept_started) st = kvb_err_set(err, KVB_ERR_INTERNAL, "could not start the accept thread");
    }
    if (st) {
        kvb_prefill_node_stop(n);
        return st;
    }
    *out = n;
    return KVB_OK;
}

uint16_t kvb_prefill_node_port(const kvb_prefill_node *n) { return kvb_listener_port(n->l); }
uint32_t kvb_prefill_node_warmup(const kvb_prefill_node *n, double *seconds) {
    *seconds = n->warmup_s;
    return n->warmup_tokens;
}
uint64_t kvb_prefill_node_peak_capture_bytes(const kvb_prefill_node *n) {
    return n->peak_capture + n->staging_bytes;
}

void kvb_prefill_node_last_staging(kvb_prefill_node *n, kvb_staging_stats *out) {
    pthread_mutex_lock(&n->mu);
    *out = n->last_staging;
    pthread_mutex_unlock(&n->mu);
}

uint64_t kvb_prefill_node_peak_gpu_bytes(kvb_prefill_node *n) {
    if (!n->pe) return 0;
    kvb_prefill_stats ps;
    pthread_mutex_lock(&n->mu); /* the engine is busy while a request runs */
    kvb_prefill_engine_stats(n->pe, &ps);
    pthread_mutex_unlock(&n->mu);
    return ps.dev_peak_used_bytes; /* 0 on the CPU */
}

/* A timing leg's rows (kvb_prefill_node_time_alone with the bridge on): cut, then dropped. */
static kvb_status sink_discard(void *ctx, const kvb_slab *s, kvb_err *err) {
    (void)ctx, (void)s, (void)err;
    return KVB_OK;
}

kvb_status kvb_prefill_node_time_alone(kvb_prefill_node *n, uint32_t n_tokens, uint64_t seed, bool with_bridge,
                                       double *seconds, kvb_err *err) {
    *seconds = 0;
    if (n->cfg.bench_filler_rows)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "a node that ships filler rows has no engine to time");
    if (n_tokens == 0 || n_tokens > n->cfg.max_ctx)
        return kvb_err_set(err, KVB_ERR_RANGE, "%u tokens: outside 1..%u", n_tokens, n->cfg.max_ctx);
    int32_t *tok = malloc(sizeof(int32_t) * n_tokens);
    float *logits = with_bridge ? NULL : malloc(sizeof(float) * n->m->d.n_vocab); /* (n_vocab) */
    if (!tok || (!with_bridge && !logits)) {
        free(tok);
        free(logits);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    }
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    for (uint32_t i = 0; i < n_tokens; i++) tok[i] = (int32_t)(kvb_rng_u64(&r) % n->m->d.n_vocab);
    pthread_mutex_lock(&n->mu);
    /* the bridge idles, or computes what a request for these tokens would ship (all but the last
     * token, as a decoder asks) and its rows are dropped where the senders would take them */
    n->ship_from = 0;
    n->ship_to = with_bridge ? n_tokens - 1 : 0;
    kvb_ring_reset(&n->ring, false);
    bridge_begin(n, 0, n->ship_to, with_bridge ? sink_discard : sink_to_ring);
    const double t0 = kvb_now_s();
    kvb_prefill_seq *s = NULL;
    kvb_status st = kvb_prefill_seq_create(n->pe, &s, err);
    if (!st) st = kvb_prefill_forward(n->pe, s, tok, n_tokens, logits, false, err);
    kvb_prefill_seq_free(s);
    *seconds = kvb_now_s() - t0;
    kvb_trace_span(with_bridge ? "prefill.alone_bridge" : "prefill.alone", t0, t0 + *seconds, n_tokens);
    pthread_mutex_unlock(&n->mu);
    free(tok);
    free(logits);
    return st;
}

/* Wakes the accept thread: a plain TCP connection that closes at once ends its wait. */
static void poke_listener(kvb_prefill_node *n) {
    char host[128] = "127.0.0.1";
    const char *colon = strrchr(n->cfg.listen, ':');
    size_t hl = colon ? (size_t)(colon - n->cfg.listen) : 0;
    if (hl > 0 && hl < sizeof host && strncmp(n->cfg.listen, "*", hl) && strncmp(n->cfg.listen, "0.0.0.0", hl)) {
        memcpy(host, n->cfg.listen, hl);
        host[hl] = 0;
        if (host[0] == '[') { /* [v6] */
            memmove(host, host + 1, hl);
            char *e = strchr(host, ']');
            if (e) *e = 0;
        }
    }
    char port[8];
    snprintf(port, sizeof port, "%u", kvb_listener_port(n->l));
    int fd = kvb_tcp_dial(host, port);
    if (fd >= 0) close(fd);
}

void kvb_prefill_node_quiesce(kvb_prefill_node *n) {
    if (!n) return;
    atomic_store(&n->draining, true);
    kvb_prefill_ops_quiesce(&n->ops);
}

uint16_t kvb_prefill_node_http_port(const kvb_prefill_node *n) {
    return n && n->ops.http ? kvb_http_server_port(n->ops.http) : 0;
}

unsigned kvb_prefill_node_in_flight(kvb_prefill_node *n) { return n ? atomic_load(&n->in_flight) : 0; }

size_t kvb_prefill_node_served(kvb_prefill_node *n, char *buf, size_t cap) {
    return kvb_admission_served(n->adm, buf, cap);
}

void kvb_prefill_node_stop(kvb_prefill_node *n) {
    if (!n) return;
    n->stop = true;
    if (n->ring.inited) kvb_ring_fail(&n->ring);
    if (n->accept_started) {
        poke_listener(n);
        pthread_join(n->accept_thread, NULL);
    }
    kvb_admission_stop(n->adm); /* the requests waiting are refused */
    for (int i = 0; i < MAX_CONNS; i++)
        if (n->conn_used[i]) kvb_conn_shutdown(n->conns[i]);
    for (int i = 0; i < MAX_CONNS; i++)
        if (n->conn_used[i]) {
            pthread_join(n->conn_threads[i], NULL);
            kvb_conn_close(n->conns[i]);
        }
    pthread_mutex_lock(&n->crew_mu); /* no request runs now: every sender is idle */
    n->crew_stop = true;
    pthread_cond_broadcast(&n->crew_cv);
    pthread_mutex_unlock(&n->crew_mu);
    for (uint32_t l = 0; l < KVB_WIRE_MAX_LANES; l++)
        if (n->senders[l].started) pthread_join(n->senders[l].thread, NULL);
    kvb_listener_close(n->l);
    kvb_ring_destroy(&n->ring);
    kvb_prefill_engine_free(n->pe);
    free(n->filler_k);
    free(n->filler_v);
    kvb_bridge_cpu_free(n->br);
    kvb_model_free(n->m);
    kvb_admission_free(n->adm);
    kvb_prefill_ops_stop(&n->ops);
    pthread_mutex_destroy(&n->mu);
    pthread_mutex_destroy(&n->conns_mu);
    pthread_mutex_destroy(&n->lanes_mu);
    pthread_mutex_destroy(&n->crew_mu);
    pthread_cond_destroy(&n->crew_cv);
    free(n->psk);
    free(n);
}
