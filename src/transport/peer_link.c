/* transport/peer_link.c — a decode node's link to its prefill node, kept up off the request path:
 * the link's own thread dials the peer's lanes (connect and handshake each, then LANE grouping
 * when there are several), waits out an exponential back-off after a failed attempt, and dials
 * again at once when the owner drops lanes that were up. kvb_peer_link_lanes only reads the state
 * under the link's lock, so a request is answered at once whatever the peer does (a peer that
 * accepts and stays silent costs the link's thread a connect timeout, never a request). An
 * attempt under way when the link stops is cut short through the thread's cancel flag. While up
 * and idle (no owner holds the lanes), the thread pings every lane each heartbeat interval: a peer
 * that died without closing its sockets, or stopped answering, is found within about two intervals
 * and dialled again (then down, with the reason), and each PONG reports the peer's queue. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <openssl/crypto.h>

#include "transport_internal.h"

struct kvb_peer_link {
    char *addr;
    kvb_hello hello;
    kvb_transport_config tcfg;
    uint8_t *psk; /* the link's copy of tcfg.psk */
    uint32_t n_lanes;
    int timeout_ms;
    double backoff_min_s, backoff_max_s;
    void (*on_state)(void *ctx, kvb_peer_state state, kvb_status code, const char *why);
    void *on_state_ctx;
    pthread_t thread;
    atomic_bool cancel; /* the thread's dial gives up (stop) */
    pthread_mutex_t mu; /* the fields below */
    pthread_cond_t cv;  /* (monotonic) the state changed, or the thread has work (drop, stop) */
    bool stop;
    kvb_peer_state state;
    kvb_status code;          /* the last failed attempt's (KVB_OK while up or connecting) */
    char why[sizeof(((kvb_err *)0)->msg)]; /* its message ("" while up) */
    double next_attempt_at;   /* while down (kvb_now_s clock) */
    double backoff_s;         /* the wait after the last failure; 0 after a success */
    kvb_conn *lanes[KVB_WIRE_MAX_LANES]; /* (n_lanes) while up; lane 0 carries PREFILL and CANCEL */
    int heartbeat_ms;         /* ping idle lanes this often (0: never) */
    bool lent;                /* an owner holds the lanes (kvb_peer_link_lanes .. release or drop) */
    bool pinging;             /* the thread's heartbeat is on the lanes: an owner waits for it */
    double idle_since;        /* the lanes' last use: a request's release, or the last heartbeat */
    bool load_known;          /* a PONG reported the peer's queue (after the last dial) */
    uint32_t load_in_flight, load_waiting;
};

const char *kvb_peer_state_name(kvb_peer_state s) {
    switch (s) {
    case KVB_PEER_CONNECTING: return "connecting";
    case KVB_PEER_UP: return "up";
    case KVB_PEER_DOWN: return "down";
    }
    return "unknown";
}

/* A few words on why the link is down, short enough for a request's verdict. */
static const char *reason_phrase(kvb_status code) {
    switch (kvb_handshake_reason_of(code)) {
    case KVB_HANDSHAKE_AUTH: return "the pre-shared keys differ";
    case KVB_HANDSHAKE_MISMATCH: return "another model, cache format or protocol version";
    case KVB_HANDSHAKE_TIMEOUT: return "the peer said nothing in time";
    case KVB_HANDSHAKE_PROTOCOL: return "the peer does not speak kvbridge";
    case KVB_HANDSHAKE_REFUSED: return "the peer refused the connection";
    case KVB_HANDSHAKE_GONE: return "no connection to the peer";
    default: return "the connection failed";
    }
}

static void close_lanes(kvb_conn **lanes, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        kvb_conn_close(lanes[i]);
        lanes[i] = NULL;
    }
}

/* Groups the lanes at the peer: LANE on each, then a PING whose PONG says the peer has read it (a
 * connection's frames are handled in order), so a PREFILL on lane 0 finds the group complete. */
static kvb_status group_lanes(kvb_conn **lanes, uint32_t n, double deadline, uint32_t load[2], kvb_err *err) {
    uint64_t group = 0;
    while (!group)
        if (getrandom(&group, sizeof group, 0) != (ssize_t)sizeof group)
            group = (uint64_t)(kvb_now_s() * 1e9) ^ (uint64_t)(uintptr_t)lanes; /* no entropy: unique is enough */
    for (uint32_t l = 0; l < n; l++) {
        const int ms = wire_ms_left(deadline);
        if (ms < 1) return kvb_err_set(err, KVB_ERR_TIMEOUT, "grouping the lanes: timed out before lane %u", l);
        kvb_msg_lane m = {.group = group, .lane = l, .lanes = n};
        kvb_status st = kvb_conn_send_lane(lanes[l], &m, ms, err);
        if (!st) st = kvb_conn_send_ping(lanes[l], group + l, ms, err);
        kvb_msg r = {0};
        if (!st) st = kvb_conn_recv(lanes[l], KVB_MAX(wire_ms_left(deadline), 1), &r, err);
        if (!st && (r.type != KVB_FRAME_PONG || r.u.ping.token != group + l))
            st = kvb_err_set(err, KVB_ERR_FORMAT, "lane %u: the peer answered %s, not the PONG to its LANE", l,
                             kvb_frame_type_name(r.type));
        if (!st) {
            load[0] = r.u.ping.in_flight; /* the peer's queue */
            load[1] = r.u.ping.waiting;
        }
        kvb_msg_free(&r);
        if (st) return kvb_err_prefix(err, "grouping the lanes: ");
    }
    return KVB_OK;
}

/* One attempt: every lane connected and handshaken, then grouped, within the link's timeout. On
 * failure nothing stays open. */
static kvb_status dial(kvb_peer_link *l, kvb_conn **lanes, uint32_t load[2], kvb_err *err) {
    const double deadline = kvb_now_s() + l->timeout_ms / 1000.0;
    kvb_status st = KVB_OK;
    for (uint32_t i = 0; !st && i < l->n_lanes; i++) {
        const int ms = wire_ms_left(deadline);
        st = ms < 1 ? kvb_err_set(err, KVB_ERR_TIMEOUT, "connect to %s: timed out before lane %u of %u", l->addr, i,
                                  l->n_lanes)
                    : kvb_transport_connect(l->addr, &l->hello, &l->tcfg, ms, &lanes[i], NULL, err);
    }
    if (!st && l->n_lanes > 1) st = group_lanes(lanes, l->n_lanes, deadline, load, err);
    if (st) close_lanes(lanes, l->n_lanes);
    return st;
}

/* mu held: whoever sees the new state sees the owner's gauge updated too. */
static void notify(kvb_peer_link *l, kvb_peer_state state, kvb_status code, const char *why) {
    if (l->on_state) l->on_state(l->on_state_ctx, state, code, why);
}

/* One heartbeat (the link's thread, mu not held, the lanes idle): a PING on every lane and its
 * PONG within timeout_ms, which carries the peer's queue. A frame left over from a request that
 * ended early (an ERROR on another lane) is skipped. */
static kvb_status heartbeat(kvb_peer_link *l, uint32_t *in_flight, uint32_t *waiting, kvb_err *err) {
    const double deadline = kvb_now_s() + KVB_HEARTBEAT_TIMEOUT_MS / 1000.0;
    for (uint32_t i = 0; i < l->n_lanes; i++) {
        const uint64_t token = ((uint64_t)i << 56) ^ (uint64_t)(kvb_now_s() * 1e6);
        kvb_status st = kvb_conn_send_ping(l->lanes[i], token, KVB_MAX(wire_ms_left(deadline), 1), err);
        for (bool got = false; !st && !got;) {
            kvb_msg r = {0};
            st = kvb_conn_recv(l->lanes[i], KVB_MAX(wire_ms_left(deadline), 1), &r, err);
            got = !st && r.type == KVB_FRAME_PONG && r.u.ping.token == token;
            if (got) {
                *in_flight = r.u.ping.in_flight;
                *waiting = r.u.ping.waiting;
            }
            kvb_msg_free(&r);
        }
        if (st) return kvb_err_prefix(err, "heartbeat on lane %u: ", i);
    }
    return KVB_OK;
}

static void redial_locked(kvb_peer_link *l, const char *why);

/* The link is up: waits until its lanes were idle for a heartbeat's interval (or the owner drops
 * them, or the link stops), then pings them; no PONG in time and the link dials again. mu held. */
static void keep_up_locked(kvb_peer_link *l) {
    const double due = l->idle_since + l->heartbeat_ms / 1000.0;
    if (!l->heartbeat_ms || l->lent || kvb_now_s() < due) {
        kvb_cond_wait_until(&l->cv, &l->mu, l->heartbeat_ms && !l->lent ? due : kvb_now_s() + 3600);
        return;
    }
    l->pinging = true;
    pthread_mutex_unlock(&l->mu);
    uint32_t in_flight = 0, waiting = 0;
    kvb_err err = {0};
    const kvb_status st = heartbeat(l, &in_flight, &waiting, &err);
    pthread_mutex_lock(&l->mu);
    l->pinging = false;
    l->idle_since = kvb_now_s();
    if (!st) {
        l->load_known = true;
        l->load_in_flight = in_flight;
        l->load_waiting = waiting;
    } else if (!l->stop && l->state == KVB_PEER_UP) {
        kvb_log(KVB_LOG_INFO, "peer link %s: %s", l->addr, err.msg);
        redial_locked(l, err.msg);
    }
    pthread_cond_broadcast(&l->cv); /* an owner waiting for the lanes */
}

/* The link's thread: dials whenever the link is not up and no back-off is pending. */
static void *link_main(void *arg) {
    kvb_peer_link *l = arg;
    wire_set_thread_cancel(&l->cancel);
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        if (l->state == KVB_PEER_UP) {
            keep_up_locked(l);
            continue;
        }
        if (l->state == KVB_PEER_DOWN && kvb_now_s() < l->next_attempt_at) {
            kvb_cond_wait_until(&l->cv, &l->mu, l->next_attempt_at);
            continue;
        }
        l->state = KVB_PEER_CONNECTING;
        notify(l, KVB_PEER_CONNECTING, KVB_OK, "");
        pthread_mutex_unlock(&l->mu);
        kvb_conn *lanes[KVB_WIRE_MAX_LANES] = {0};
        kvb_err err = {0};
        uint32_t load[2] = {0, 0};
        const kvb_status st = dial(l, lanes, load, &err);
        pthread_mutex_lock(&l->mu);
        if (l->stop) {
            close_lanes(lanes, l->n_lanes);
            break;
        }
        if (!st) {
            memcpy(l->lanes, lanes, sizeof lanes);
            l->load_known = l->n_lanes > 1; /* the grouping's PONG told the queue */
            l->load_in_flight = load[0];
            l->load_waiting = load[1];
            l->idle_since = l->load_known ? kvb_now_s() : 0; /* else a heartbeat at once asks it */
            l->state = KVB_PEER_UP;
            l->code = KVB_OK;
            l->why[0] = 0;
            l->backoff_s = 0;
        } else {
            l->state = KVB_PEER_DOWN;
            l->code = st;
            snprintf(l->why, sizeof l->why, "%s", err.msg);
            l->backoff_s = l->backoff_s ? KVB_MIN(2 * l->backoff_s, l->backoff_max_s) : l->backoff_min_s;
            l->next_attempt_at = kvb_now_s() + l->backoff_s;
        }
        notify(l, l->state, st, l->why); /* before anyone can see the new state */
        pthread_cond_broadcast(&l->cv);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

static kvb_status check_config(const kvb_peer_link_config *cfg, kvb_err *err) {
    if (!cfg || !cfg->addr || !cfg->hello || !cfg->tcfg)
        return kvb_err_set(err, KVB_ERR_INVALID, "peer link: address, HELLO and transport config are required");
    if (cfg->lanes < 1 || cfg->lanes > KVB_WIRE_MAX_LANES)
        return kvb_err_set(err, KVB_ERR_INVALID, "peer link: %u lanes (1..%d)", cfg->lanes, KVB_WIRE_MAX_LANES);
    if (!cfg->tcfg->psk || cfg->tcfg->psk_len < KVB_WIRE_PSK_MIN || cfg->tcfg->psk_len > KVB_WIRE_PSK_MAX)
        return kvb_err_set(err, KVB_ERR_INVALID, "peer link: the pre-shared key must have %d..%d bytes",
                           KVB_WIRE_PSK_MIN, KVB_WIRE_PSK_MAX);
    if (cfg->connect_timeout_ms < 0 || cfg->heartbeat_ms < 0 || cfg->backoff_min_s < 0 || cfg->backoff_max_s < 0 ||
        (cfg->backoff_max_s > 0 && cfg->backoff_max_s < cfg->backoff_min_s))
        return kvb_err_set(err, KVB_ERR_INVALID, "peer link: a negative timeout, or a back-off whose maximum is "
                                                 "below its minimum");
    return KVB_OK;
}

kvb_status kvb_peer_link_start(const kvb_peer_link_config *cfg, kvb_peer_link **out, kvb_err *err) {
    *out = NULL;
    kvb_status st = check_config(cfg, err);
    if (st) return st;
    kvb_peer_link *l = calloc(1, sizeof *l);
    if (!l) return kvb_err_set(err, KVB_ERR_NOMEM, "peer link: out of memory");
    l->addr = strdup(cfg->addr);
    l->psk = malloc(cfg->tcfg->psk_len);
    if (!l->addr || !l->psk) {
        free(l->addr);
        free(l->psk);
        free(l);
        return kvb_err_set(err, KVB_ERR_NOMEM, "peer link: out of memory");
    }
    memcpy(l->psk, cfg->tcfg->psk, cfg->tcfg->psk_len);
    l->hello = *cfg->hello;
    l->tcfg = *cfg->tcfg;
    l->tcfg.psk = l->psk;
    l->n_lanes = cfg->lanes;
    l->timeout_ms = cfg->connect_timeout_ms ? cfg->connect_timeout_ms : 5000;
    l->backoff_min_s = cfg->backoff_min_s > 0 ? cfg->backoff_min_s : 0.5;
    l->backoff_max_s = cfg->backoff_max_s > 0 ? cfg->backoff_max_s : KVB_MAX(30.0, l->backoff_min_s);
    l->on_state = cfg->on_state;
    l->on_state_ctx = cfg->on_state_ctx;
    l->heartbeat_ms = cfg->heartbeat_ms;
    atomic_init(&l->cancel, false);
    l->state = KVB_PEER_CONNECTING;
    pthread_mutex_init(&l->mu, NULL);
    int rc = kvb_cond_init_monotonic(&l->cv);
    if (!rc) rc = pthread_create(&l->thread, NULL, link_main, l);
    if (rc) {
        pthread_mutex_destroy(&l->mu);
        free(l->addr);
        free(l->psk);
        free(l);
        return kvb_err_set(err, KVB_ERR_INTERNAL, "peer link: cannot start its thread (%s)", strerror(rc));
    }
    *out = l;
    return KVB_OK;
}

void kvb_peer_link_stop(kvb_peer_link *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    atomic_store(&l->cancel, true);
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->thread, NULL);
    close_lanes(l->lanes, l->n_lanes);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    OPENSSL_cleanse(l->psk, l->tcfg.psk_len);
    free(l->psk);
    free(l->addr);
    free(l);
}

/* Closes the lanes of a link that was up and wakes the thread to dial again at once. mu held. */
static void redial_locked(kvb_peer_link *l, const char *why) {
    close_lanes(l->lanes, l->n_lanes);
    l->lent = false;
    l->load_known = false;
    l->state = KVB_PEER_CONNECTING;
    l->code = KVB_OK;
    l->backoff_s = 0;
    snprintf(l->why, sizeof l->why, "%s", why);
    notify(l, KVB_PEER_CONNECTING, KVB_OK, l->why);
    pthread_cond_broadcast(&l->cv);
}

/* The answer of a link that is not up: its code, and a short message for a verdict. mu held. */
static kvb_status not_up_locked(const kvb_peer_link *l, kvb_err *err) {
    if (l->state == KVB_PEER_CONNECTING)
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "connecting (an attempt is under way)");
    const double wait_s = KVB_MAX(l->next_attempt_at - kvb_now_s(), 0.0);
    return kvb_err_set(err, l->code ? l->code : KVB_ERR_PEER_GONE, "down (%s), next attempt in %.1f s",
                       reason_phrase(l->code), wait_s);
}

/* The lanes when up and every one usable (a lane found unusable: the link dials again), once a
 * heartbeat on them is over; they are lent until released or dropped. mu held. */
static kvb_status lanes_locked(kvb_peer_link *l, kvb_conn *const **lanes, uint32_t *n, kvb_err *err) {
    while (l->pinging) pthread_cond_wait(&l->cv, &l->mu);
    if (l->state == KVB_PEER_UP) {
        bool usable = true;
        for (uint32_t i = 0; i < l->n_lanes; i++) usable &= kvb_conn_usable(l->lanes[i]);
        if (usable) {
            *lanes = l->lanes;
            *n = l->n_lanes;
            l->lent = true;
            return KVB_OK;
        }
        redial_locked(l, "a lane failed since the last request");
    }
    *lanes = NULL;
    *n = 0;
    return not_up_locked(l, err);
}

kvb_status kvb_peer_link_lanes(kvb_peer_link *l, kvb_conn *const **lanes, uint32_t *n, kvb_err *err) {
    pthread_mutex_lock(&l->mu);
    const kvb_status st = lanes_locked(l, lanes, n, err);
    pthread_mutex_unlock(&l->mu);
    return st;
}

void kvb_peer_link_drop(kvb_peer_link *l, const kvb_err *why) {
    pthread_mutex_lock(&l->mu);
    if (l->state == KVB_PEER_UP)
        redial_locked(l, why ? why->msg : "the lanes were dropped after a fault on one of them");
    pthread_mutex_unlock(&l->mu);
}

kvb_status kvb_peer_link_wait_lanes(kvb_peer_link *l, int timeout_ms, kvb_conn *const **lanes, uint32_t *n,
                                    kvb_err *err) {
    const double until = kvb_now_s() + KVB_MAX(timeout_ms, 0) / 1000.0;
    pthread_mutex_lock(&l->mu);
    while (l->state == KVB_PEER_CONNECTING && kvb_now_s() < until) kvb_cond_wait_until(&l->cv, &l->mu, until);
    const kvb_status st = lanes_locked(l, lanes, n, err);
    pthread_mutex_unlock(&l->mu);
    return st;
}

void kvb_peer_link_release(kvb_peer_link *l) {
    pthread_mutex_lock(&l->mu);
    if (l->lent) {
        l->lent = false;
        l->idle_since = kvb_now_s();
        pthread_cond_broadcast(&l->cv);
    }
    pthread_mutex_unlock(&l->mu);
}

bool kvb_peer_link_load(kvb_peer_link *l, uint32_t *in_flight, uint32_t *waiting) {
    pthread_mutex_lock(&l->mu);
    const bool known = l->state == KVB_PEER_UP && l->load_known;
    *in_flight = known ? l->load_in_flight : 0;
    *waiting = known ? l->load_waiting : 0;
    pthread_mutex_unlock(&l->mu);
    return known;
}

kvb_peer_state kvb_peer_link_state(kvb_peer_link *l, char *why, size_t cap) {
    pthread_mutex_lock(&l->mu);
    const kvb_peer_state s = l->state;
    if (why && cap) {
        if (s == KVB_PEER_DOWN)
            snprintf(why, cap, "%s (next attempt in %.1f s)", l->why, KVB_MAX(l->next_attempt_at - kvb_now_s(), 0.0));
        else if (s == KVB_PEER_CONNECTING && l->why[0])
            snprintf(why, cap, "dialling again after: %s", l->why);
        else
            snprintf(why, cap, "%s", s == KVB_PEER_UP ? "" : l->why);
    }
    pthread_mutex_unlock(&l->mu);
    return s;
}
