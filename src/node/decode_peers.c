/* node/decode_peers.c — a decode node's prefill peers: one kvb_peer_link each (its own thread
 * dials, keeps the lanes up and pings them while idle, so a silent peer is found off the request
 * path; each PONG reports the peer's queue), each peer's health and metrics, and placement. The
 * node remembers which peer produced each bridged request's last block (its chain key, in a
 * bounded set-associative table, least recently used evicted): a prompt's longest prefix that a
 * peer produced names the peer holding the conversation's history in its own prefix cache. A
 * request goes there unless that peer is not up or its queue is above max_queue; otherwise to the
 * least-loaded peer that is up (ties: the one given fewest requests, so new conversations spread).
 * Only the prompt FIFO's holder places, records, borrows and gives back lanes: one at a time. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_store.h"
#include "node_internal.h"

#define PLACE_SETS 512 /* the placement table: PLACE_SETS x PLACE_WAYS chain keys */
#define PLACE_WAYS 8

typedef struct {
    kvb_peer_set *set;
    char *spec;       /* "NAME=HOST:PORT" or "HOST:PORT", copied; name and addr point into it */
    const char *name, *addr;
    kvb_peer_link *link;
    char transport_now[288]; /* its kvbridge_peer_transport label (the link's thread) */
    _Atomic uint64_t placed; /* requests placed here (the status snapshot reads it) */
} decode_peer;

typedef struct {
    uint64_t key;  /* a bridged block's chain key (0: empty) */
    uint64_t used; /* the table's clock when last recorded or matched */
    uint32_t peer;
} place_entry;

struct kvb_peer_set {
    decode_peer *peers;
    uint32_t n, max_queue;
    const kvb_transport_config *tcfg;
    kvb_metric *m_up, *m_refused, *m_transport, *m_queue, *m_bytes, *m_requests, *m_placements;
    place_entry table[PLACE_SETS][PLACE_WAYS];
    uint64_t clock;
};

const char *const kvb_placement_names[] = {"history", "new", "moved"};

/* The link's thread on every change: the gauges, the failed attempts by reason, and a log line. */
static void on_peer_state(void *ctx, kvb_peer_state state, kvb_status code, const char *why) {
    decode_peer *p = ctx;
    kvb_peer_set *s = p->set;
    kvb_metric_set(s->m_up, KVB_LABELS(p->name), state == KVB_PEER_UP);
    if (state == KVB_PEER_DOWN) {
        kvb_metric_add(s->m_refused, KVB_LABELS(p->name, kvb_handshake_reason_name(kvb_handshake_reason_of(code))), 1);
        kvb_log(KVB_LOG_INFO, "decode: prefill node %s unavailable: %s", p->name, why);
    } else if (state == KVB_PEER_UP) { /* what UCX selected shows, so a fallback to TCP does */
        char now[sizeof p->transport_now] = "tcp", lanes[256];
        if (s->tcfg->backend && strcmp(s->tcfg->backend->name, "tcp") != 0) {
            kvb_ucx_last_lanes(lanes, sizeof lanes);
            snprintf(now, sizeof now, "%s %s", s->tcfg->backend->name, lanes);
        }
        if (p->transport_now[0] && strcmp(now, p->transport_now) != 0)
            kvb_metric_set(s->m_transport, KVB_LABELS(p->name, p->transport_now), 0);
        snprintf(p->transport_now, sizeof p->transport_now, "%s", now);
        kvb_metric_set(s->m_transport, KVB_LABELS(p->name, now), 1);
        kvb_log(KVB_LOG_INFO, "decode: prefill node %s connected over %s", p->name, now);
    }
}

/* The peers' metric families: type, name, help, label names, and the field that holds it. */
static const struct {
    kvb_metric_type type;
    const char *name, *help, *labels;
    size_t field; /* offsetof(kvb_peer_set, its kvb_metric *) */
} k_peer_metrics[] = {
    {KVB_METRIC_GAUGE, "kvbridge_peer_up", "1 while the link to a prefill node is up", "peer",
     offsetof(kvb_peer_set, m_up)},
    {KVB_METRIC_COUNTER, "kvbridge_peer_handshakes_refused_total",
     "Attempts to connect to a prefill node that failed, by reason: auth (another key), mismatch (another model, "
     "cache format or version), timeout (it said nothing in time), protocol (not kvbridge), refused (it said no), "
     "gone (nobody answered, or it closed), other",
     "peer,reason", offsetof(kvb_peer_set, m_refused)},
    {KVB_METRIC_GAUGE, "kvbridge_peer_transport",
     "1 for what carries a prefill node's link since it last came up: tcp, or ucx and the transports UCX selected "
     "(a fallback to TCP shows as tcp/...)",
     "peer,carried_by", offsetof(kvb_peer_set, m_transport)},
    {KVB_METRIC_GAUGE, "kvbridge_peer_queue",
     "A prefill node's PREFILLs in flight (from every decode node), as its last PONG reported at placement", "peer",
     offsetof(kvb_peer_set, m_queue)},
    {KVB_METRIC_COUNTER, "kvbridge_peer_slab_bytes_total", "Cache bytes received as slabs, by the prefill node that "
     "sent them", "peer", offsetof(kvb_peer_set, m_bytes)},
    {KVB_METRIC_COUNTER, "kvbridge_peer_requests_total",
     "Bridged completions by prefill node and verdict (a request resumed on another node counts for both)",
     "peer,verdict", offsetof(kvb_peer_set, m_requests)},
    {KVB_METRIC_COUNTER, "kvbridge_placements_total",
     "Bridged requests by placement: history (on the prefill node that produced the longest cached prefix of the "
     "prompt), new (no node did), moved (that node was down or its queue above --peer-max-queue)",
     "result", offsetof(kvb_peer_set, m_placements)},
};

static kvb_status register_metrics(kvb_peer_set *s, kvb_metrics *mx, kvb_err *err) {
    kvb_status st = KVB_OK;
    for (size_t i = 0; !st && i < KVB_ARRAY_LEN(k_peer_metrics); i++)
        st = kvb_metrics_register(mx, k_peer_metrics[i].type, k_peer_metrics[i].name, k_peer_metrics[i].help,
                                  k_peer_metrics[i].labels, NULL, 0,
                                  (kvb_metric **)((char *)s + k_peer_metrics[i].field), err);
    return st;
}

kvb_status kvb_peer_set_start(const kvb_peer_set_config *cfg, kvb_peer_set **out, kvb_err *err) {
    *out = NULL;
    if (cfg->n_peers > KVB_MAX_PEERS)
        return kvb_err_set(err, KVB_ERR_INVALID, "%u prefill peers: at most %d", cfg->n_peers, KVB_MAX_PEERS);
    kvb_peer_set *s = calloc(1, sizeof *s);
    if (s) s->peers = calloc(cfg->n_peers ? cfg->n_peers : 1, sizeof *s->peers);
    if (!s || !s->peers) {
        free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    }
    s->max_queue = cfg->max_queue;
    s->tcfg = cfg->tcfg;
    kvb_status st = register_metrics(s, cfg->metrics, err);
    for (uint32_t i = 0; !st && i < cfg->n_peers; i++) {
        decode_peer *p = &s->peers[i];
        p->set = s;
        p->spec = strdup(cfg->peers[i]);
        if (!p->spec) {
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
            break;
        }
        s->n = i + 1; /* kvb_peer_set_stop frees it from here on */
        char *eq = strchr(p->spec, '=');
        if (eq) *eq = 0;
        p->name = p->spec;
        p->addr = eq ? eq + 1 : p->spec;
        if (!p->name[0] || !p->addr[0] || strchr(p->name, '"') || strchr(p->name, '\\')) {
            st = kvb_err_set(err, KVB_ERR_INVALID, "--peer '%s': HOST:PORT, or NAME=HOST:PORT", cfg->peers[i]);
            break;
        }
        for (uint32_t j = 0; j < i; j++)
            if (!strcmp(s->peers[j].name, p->name))
                st = kvb_err_set(err, KVB_ERR_INVALID, "--peer '%s': the name %s is given twice", cfg->peers[i],
                                 p->name);
        kvb_metric_set(s->m_up, KVB_LABELS(p->name), 0);
    }
    for (uint32_t i = 0; !st && i < s->n; i++) { /* each link's thread dials now */
        decode_peer *p = &s->peers[i];
        kvb_peer_link_config lc = {.addr = p->addr, .hello = cfg->hello, .tcfg = cfg->tcfg, .lanes = cfg->lanes,
                                   .connect_timeout_ms = cfg->connect_timeout_ms, .on_state = on_peer_state,
                                   .on_state_ctx = p, .heartbeat_ms = cfg->heartbeat_ms};
        st = kvb_peer_link_start(&lc, &p->link, err);
    }
    if (st) {
        kvb_peer_set_stop(s);
        return st;
    }
    *out = s;
    return KVB_OK;
}

void kvb_peer_set_wait_first(kvb_peer_set *s, int timeout_ms) {
    for (uint32_t i = 0; s && i < s->n; i++) {
        kvb_conn *const *lanes;
        uint32_t n_up;
        if (!kvb_peer_link_wait_lanes(s->peers[i].link, timeout_ms, &lanes, &n_up, NULL))
            kvb_peer_link_release(s->peers[i].link);
    }
}

void kvb_peer_set_stop(kvb_peer_set *s) {
    if (!s) return;
    for (uint32_t i = 0; i < s->n; i++) {
        kvb_peer_link_stop(s->peers[i].link); /* before the metrics its thread updates */
        free(s->peers[i].spec);
    }
    free(s->peers);
    free(s);
}

uint32_t kvb_peer_set_count(const kvb_peer_set *s) { return s ? s->n : 0; }
const char *kvb_peer_set_name(const kvb_peer_set *s, int peer) { return peer >= 0 ? s->peers[peer].name : ""; }
const char *kvb_peer_set_addr(const kvb_peer_set *s, int peer) { return peer >= 0 ? s->peers[peer].addr : ""; }

/* ---- placement ------------------------------------------------------------------------------- */

static place_entry *table_find(kvb_peer_set *s, uint64_t key) {
    place_entry *set = s->table[key % PLACE_SETS];
    for (int w = 0; w < PLACE_WAYS; w++)
        if (set[w].key == key) return &set[w];
    return NULL;
}

void kvb_peer_set_record(kvb_peer_set *s, uint64_t key, int peer) {
    if (!key || peer < 0) return;
    place_entry *e = table_find(s, key);
    if (!e) { /* a free way, or the least recently used one */
        place_entry *set = s->table[key % PLACE_SETS];
        e = &set[0];
        for (int w = 1; w < PLACE_WAYS && e->key; w++)
            if (!set[w].key || set[w].used < e->used) e = &set[w];
    }
    *e = (place_entry){.key = key, .used = ++s->clock, .peer = (uint32_t)peer};
}

/* The peer that produced the longest prefix of keys[0 .. n) (chain keys of the prompt's blocks), or -1. */
static int history_peer(kvb_peer_set *s, const uint64_t *keys, uint32_t n, uint32_t *blocks) {
    for (uint32_t i = n; i-- > 0;) {
        place_entry *e = table_find(s, keys[i]);
        if (e && e->peer < s->n) {
            e->used = ++s->clock;
            *blocks = i + 1;
            return (int)e->peer;
        }
    }
    return -1;
}

/* The peer's queue as its last PONG said (UINT32_MAX: not up). */
static uint32_t peer_queue(kvb_peer_set *s, int i) {
    uint32_t in_flight, waiting;
    if (kvb_peer_link_state(s->peers[i].link, NULL, 0) != KVB_PEER_UP) return UINT32_MAX;
    kvb_peer_link_load(s->peers[i].link, &in_flight, &waiting);
    kvb_metric_set(s->m_queue, KVB_LABELS(s->peers[i].name), in_flight);
    return in_flight;
}

/* Peers other than `skip` by (queue, requests placed so far), those up first. */
static uint32_t by_load(kvb_peer_set *s, int skip, int *order, uint32_t *queue) {
    uint32_t k = 0;
    for (uint32_t i = 0; i < s->n; i++) {
        if ((int)i == skip) continue;
        uint32_t j = k++;
        for (; j > 0; j--) {
            const uint32_t o = (uint32_t)order[j - 1];
            if (queue[o] < queue[i] || (queue[o] == queue[i] && s->peers[o].placed <= s->peers[i].placed)) break;
            order[j] = order[j - 1];
        }
        order[j] = (int)i;
    }
    return k;
}

/* Tries the peer's lanes; on failure appends "NAME: why" to msg. */
static bool try_lanes(kvb_peer_set *s, int i, kvb_conn *const **lanes, uint32_t *n_lanes, char *msg, size_t cap) {
    kvb_err e = {0};
    if (!kvb_peer_link_lanes(s->peers[i].link, lanes, n_lanes, &e)) return true;
    const size_t len = strlen(msg);
    if (s->n == 1) snprintf(msg, cap, "%s", e.msg); /* one peer: the link's own words, as before */
    else snprintf(msg + len, cap - len, "%s%s: %s", len ? "; " : "", s->peers[i].name, e.msg);
    return false;
}

kvb_status kvb_peer_set_place(kvb_peer_set *s, const uint64_t *keys, uint32_t n_keys, kvb_placement *pl,
                              kvb_conn *const **lanes, uint32_t *n_lanes, kvb_err *err) {
    memset(pl, 0, sizeof *pl);
    pl->peer = pl->history = -1;
    uint32_t queue[KVB_MAX_PEERS];
    for (uint32_t i = 0; i < s->n; i++) queue[i] = peer_queue(s, (int)i);
    char msg[sizeof err->msg] = "";
    const int h = history_peer(s, keys, n_keys, &pl->history_blocks);
    pl->history = h;
    const bool h_fits = h >= 0 && queue[h] != UINT32_MAX && queue[h] <= s->max_queue;
    if (h_fits && try_lanes(s, h, lanes, n_lanes, msg, sizeof msg)) {
        pl->peer = h;
    } else { /* the least-loaded peer that is up (a busy history peer among them, by its load) */
        int order[KVB_MAX_PEERS];
        const uint32_t k = by_load(s, h_fits ? h : -1, order, queue);
        for (uint32_t j = 0; j < k && pl->peer < 0; j++)
            if (try_lanes(s, order[j], lanes, n_lanes, msg, sizeof msg)) pl->peer = order[j];
        if (h >= 0 && pl->peer != h) {
            const char *hn = s->peers[h].name;
            if (queue[h] == UINT32_MAX) snprintf(pl->why, sizeof pl->why, "history on %s, %s down", hn, hn);
            else if (!h_fits)
                snprintf(pl->why, sizeof pl->why, "history on %s, %s busy (queue %u above %u)", hn, hn, queue[h],
                         s->max_queue);
            else snprintf(pl->why, sizeof pl->why, "history on %s, %s unavailable", hn, hn);
        }
    }
    if (pl->peer < 0) {
        if (s->n > 1 && !msg[0]) snprintf(msg, sizeof msg, "no prefill node is up");
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s", msg);
    }
    pl->result = h < 0 ? KVB_PLACED_NEW : pl->peer == h ? KVB_PLACED_HISTORY : KVB_PLACED_MOVED;
    if (!pl->why[0]) snprintf(pl->why, sizeof pl->why, "%s", kvb_placement_names[pl->result]);
    s->peers[pl->peer].placed++;
    kvb_metric_add(s->m_placements, KVB_LABELS(kvb_placement_names[pl->result]), 1);
    return KVB_OK;
}

int kvb_peer_set_other(kvb_peer_set *s, int not_peer, kvb_conn *const **lanes, uint32_t *n_lanes) {
    uint32_t queue[KVB_MAX_PEERS];
    for (uint32_t i = 0; i < s->n; i++) queue[i] = peer_queue(s, (int)i);
    int order[KVB_MAX_PEERS];
    char msg[64] = "";
    const uint32_t k = by_load(s, not_peer, order, queue);
    for (uint32_t j = 0; j < k; j++)
        if (queue[order[j]] != UINT32_MAX && try_lanes(s, order[j], lanes, n_lanes, msg, sizeof msg)) return order[j];
    return -1;
}

kvb_status kvb_peer_set_lanes_again(kvb_peer_set *s, int peer, int timeout_ms, kvb_conn *const **lanes,
                                    uint32_t *n_lanes, kvb_err *err) {
    return kvb_peer_link_wait_lanes(s->peers[peer].link, timeout_ms, lanes, n_lanes, err);
}

void kvb_peer_set_release(kvb_peer_set *s, int peer) {
    if (peer >= 0) kvb_peer_link_release(s->peers[peer].link);
}

void kvb_peer_set_drop(kvb_peer_set *s, int peer) {
    if (peer >= 0) kvb_peer_link_drop(s->peers[peer].link, NULL);
}

void kvb_peer_set_count_bytes(kvb_peer_set *s, int peer, uint64_t bytes) {
    if (peer >= 0 && bytes) kvb_metric_add(s->m_bytes, KVB_LABELS(s->peers[peer].name), (double)bytes);
}

void kvb_peer_set_count_request(kvb_peer_set *s, int peer, const char *verdict_kind) {
    if (peer >= 0) kvb_metric_add(s->m_requests, KVB_LABELS(s->peers[peer].name, verdict_kind), 1);
}

/* ---- health ---------------------------------------------------------------------------------- */

kvb_peer_state kvb_peer_set_summary(kvb_peer_set *s, char *why, size_t cap) {
    if (why && cap) why[0] = 0;
    if (!s || !s->n) return KVB_PEER_DOWN;
    for (uint32_t i = 0; s->n > 1 && i < s->n; i++)
        if (kvb_peer_link_state(s->peers[i].link, NULL, 0) == KVB_PEER_UP) return KVB_PEER_UP;
    return kvb_peer_link_state(s->peers[0].link, why, cap);
}

cJSON *kvb_peer_set_json(kvb_peer_set *s) {
    cJSON *arr = cJSON_CreateArray();
    for (uint32_t i = 0; arr && s && i < s->n; i++) {
        const decode_peer *p = &s->peers[i];
        char why[sizeof(((kvb_err *)0)->msg) + 64] = "";
        const kvb_peer_state ps = kvb_peer_link_state(p->link, why, sizeof why);
        uint32_t in_flight = 0, waiting = 0;
        const bool known = kvb_peer_link_load(p->link, &in_flight, &waiting);
        cJSON *o = cJSON_CreateObject();
        if (!o) break;
        cJSON_AddStringToObject(o, "name", p->name);
        cJSON_AddStringToObject(o, "addr", p->addr);
        cJSON_AddStringToObject(o, "state", kvb_peer_state_name(ps));
        cJSON_AddStringToObject(o, "reason", why);
        if (known) {
            cJSON_AddNumberToObject(o, "in_flight", in_flight);
            cJSON_AddNumberToObject(o, "waiting", waiting);
        }
        cJSON_AddNumberToObject(o, "placed", (double)p->placed);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}
