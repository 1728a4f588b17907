/* tests/test_peer_link.c — kvb_peer_link against a real prefill-side listener (kvb_transport_listen
 * and _accept on a thread, each connection answered by its own thread: LANE noted, PING answered
 * with PONG) and against fake peers (tests/support/fake_peer.h): the link comes up with its lanes
 * grouped, is dialled again at once after a drop, and is down with the right typed reason for a
 * peer that is not there (gone), stays silent or trickles (timeout), speaks garbage (protocol),
 * refuses (refused), holds another key (auth) or another model (mismatch); in every state
 * kvb_peer_link_lanes answers at once (< 10 ms), a failed peer is dialled with exponential
 * back-off rather than in a loop, and stopping the link cuts an attempt under way short; the
 * heartbeat reports the peer's queue, leaves lent lanes alone and finds a peer gone silent. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fake_peer.h"
#include "kvb_quant.h"
#include "kvb_transport.h"

static const char PSK[] = "0123456789abcdef0123456789abcdef";
static const char OTHER_PSK[] = "0123456789abcdef0123456789abcdeX";
static const uint64_t MODEL_FP = 0x6d6f64656c2d6670ULL;

static kvb_hello make_hello(kvb_wire_role role, const char *name, uint64_t model_fp) {
    kvb_kvformat f;
    kvb_hello h;
    kvb_err e = {0};
    assert_int_equal(kvb_kvformat_init(&f, KVB_TYPE_F16, 16, 4, 2, 64, &e), KVB_OK);
    if (kvb_hello_init(&h, role, KVB_BRIDGE_MODE_DECODER, name, model_fp, &f, &e)) fail_msg("hello: %s", e.msg);
    return h;
}

/* ---- a real prefill-side listener --------------------------------------------------------------- */

#define MAX_SERVED 64
typedef struct {
    kvb_listener *l;
    kvb_hello hello;
    kvb_transport_config cfg;
    pthread_t thread;
    atomic_bool stop;
    kvb_conn *conns[MAX_SERVED];
    pthread_t conn_threads[MAX_SERVED];
    int n_conns;
    atomic_uint lanes_seen; /* LANE frames received */
} server;

static atomic_bool g_mute;   /* the listener's connections stop answering PINGs (alive, but silent) */
static atomic_uint g_pings;  /* PINGs they received */

static void *serve_conn(void *arg) {
    kvb_conn *c = arg;
    for (;;) {
        kvb_msg m;
        if (kvb_conn_recv(c, 60 * 1000, &m, NULL)) return NULL; /* closed, or shut down by the test */
        if (m.type == KVB_FRAME_PING) atomic_fetch_add(&g_pings, 1);
        if (m.type == KVB_FRAME_PING && !atomic_load(&g_mute)) { /* the answer carries a queue of 3, 2 waiting */
            const kvb_msg_ping pong = {.token = m.u.ping.token, .in_flight = 3, .waiting = 2};
            kvb_conn_send_pong_load(c, &pong, 1000, NULL);
        }
        kvb_msg_free(&m);
    }
}

static void *server_main(void *arg) {
    server *s = arg;
    while (!atomic_load(&s->stop) && s->n_conns < MAX_SERVED) {
        kvb_conn *c = NULL;
        if (kvb_transport_accept(s->l, &s->hello, &s->cfg, 500, &c, NULL, NULL)) continue; /* 500 ms: a slow handshake too */
        s->conns[s->n_conns] = c;
        assert_int_equal(pthread_create(&s->conn_threads[s->n_conns], NULL, serve_conn, c), 0);
        s->n_conns++;
    }
    return NULL;
}

static void server_start(server *s, const char *psk, uint64_t model_fp) {
    memset(s, 0, sizeof *s);
    kvb_err e = {0};
    if (kvb_transport_listen("127.0.0.1:0", NULL, &s->l, &e)) fail_msg("listen: %s", e.msg);
    s->hello = make_hello(KVB_ROLE_PREFILL, "prefill-a", model_fp);
    s->cfg = (kvb_transport_config){.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    atomic_init(&s->stop, false);
    assert_int_equal(pthread_create(&s->thread, NULL, server_main, s), 0);
}

static void server_stop(server *s) {
    atomic_store(&s->stop, true);
    pthread_join(s->thread, NULL);
    for (int i = 0; i < s->n_conns; i++) kvb_conn_shutdown(s->conns[i]);
    for (int i = 0; i < s->n_conns; i++) {
        pthread_join(s->conn_threads[i], NULL);
        kvb_conn_close(s->conns[i]);
    }
    kvb_listener_close(s->l);
}

/* ---- the link under test -------------------------------------------------------------------------- */

typedef struct {
    atomic_uint ups, downs;
    atomic_uint by_reason[KVB_HANDSHAKE_REASONS];
} observed;

static void on_state(void *ctx, kvb_peer_state state, kvb_status code, const char *why) {
    observed *o = ctx;
    (void)why;
    if (state == KVB_PEER_UP) atomic_fetch_add(&o->ups, 1);
    if (state == KVB_PEER_DOWN) {
        atomic_fetch_add(&o->downs, 1);
        atomic_fetch_add(&o->by_reason[kvb_handshake_reason_of(code)], 1);
    }
}

static kvb_peer_link *link_start_hb(uint16_t port, const char *psk, uint32_t lanes, int timeout_ms, int heartbeat_ms,
                                    observed *o) {
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP);
    kvb_transport_config cfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    kvb_peer_link_config lc = {.addr = addr, .hello = &me, .tcfg = &cfg, .lanes = lanes,
                               .connect_timeout_ms = timeout_ms, .backoff_min_s = 0.05, .backoff_max_s = 0.2,
                               .on_state = on_state, .on_state_ctx = o, .heartbeat_ms = heartbeat_ms};
    kvb_peer_link *l = NULL;
    kvb_err e = {0};
    if (kvb_peer_link_start(&lc, &l, &e)) fail_msg("link: %s", e.msg);
    return l; /* everything in lc was copied: the locals may go */
}

static kvb_peer_link *link_start(uint16_t port, const char *psk, uint32_t lanes, int timeout_ms, observed *o) {
    return link_start_hb(port, psk, lanes, timeout_ms, 0, o);
}

/* Calls kvb_peer_link_lanes every millisecond for `seconds`: the slowest call's seconds, and the
 * status of the last one (its message in err). */
static double hammer_lanes(kvb_peer_link *l, double seconds, kvb_status *last, kvb_err *err) {
    double slowest = 0;
    const double until = kvb_now_s() + seconds;
    do {
        kvb_conn *const *lanes;
        uint32_t n;
        const double t0 = kvb_now_s();
        *last = kvb_peer_link_lanes(l, &lanes, &n, err);
        slowest = KVB_MAX(slowest, kvb_now_s() - t0);
        if (*last == KVB_OK) assert_non_null(lanes);
        usleep(1000);
    } while (kvb_now_s() < until);
    return slowest;
}

/* ---- the link against a real listener ------------------------------------------------------------ */

static void test_up_grouped_and_redialled_after_drop(void **state) {
    (void)state;
    server s;
    server_start(&s, PSK, MODEL_FP);
    observed o = {0};
    kvb_peer_link *l = link_start(kvb_listener_port(s.l), PSK, 3, 5000, &o);
    kvb_conn *const *lanes = NULL;
    uint32_t n = 0;
    kvb_err e = {0};
    char why[512];
    if (kvb_peer_link_wait_lanes(l, 5000, &lanes, &n, &e)) {
        kvb_peer_link_state(l, why, sizeof why);
        fail_msg("not up: %s (%s)", e.msg, why);
    }
    assert_int_equal(n, 3);
    assert_int_equal(kvb_peer_link_state(l, why, sizeof why), KVB_PEER_UP);
    assert_string_equal(why, "");
    assert_int_equal(atomic_load(&o.ups), 1);
    /* each lane is a working connection: grouped (the listener saw LANE + PING on each, answered) */
    for (uint32_t i = 0; i < n; i++) {
        assert_true(kvb_conn_usable(lanes[i]));
        kvb_msg m;
        assert_int_equal(kvb_conn_send_ping(lanes[i], 100 + i, 1000, &e), KVB_OK);
        assert_int_equal(kvb_conn_recv(lanes[i], 2000, &m, &e), KVB_OK);
        assert_int_equal(m.type, KVB_FRAME_PONG);
        assert_int_equal(m.u.ping.token, 100 + i);
    }
    kvb_status last;
    assert_true(hammer_lanes(l, 0.05, &last, &e) < 0.010);
    assert_int_equal(last, KVB_OK);
    kvb_listener_stats ls;
    kvb_listener_get_stats(s.l, &ls);
    assert_int_equal(ls.accepted, 3);

    /* dropped mid-stream: dialled again at once, without a back-off */
    kvb_err why_drop = {.code = KVB_ERR_TIMEOUT, .msg = "a lane stalled"};
    const double t0 = kvb_now_s();
    kvb_peer_link_drop(l, &why_drop);
    if (kvb_peer_link_wait_lanes(l, 5000, &lanes, &n, &e)) fail_msg("not up again: %s", e.msg);
    print_message("    up again %.3f s after the drop\n", kvb_now_s() - t0);
    assert_int_equal(n, 3);
    assert_int_equal(atomic_load(&o.ups), 2);
    assert_int_equal(atomic_load(&o.downs), 0);
    kvb_listener_get_stats(s.l, &ls);
    assert_int_equal(ls.accepted, 6);

    /* a lane that failed since (here: shut down by this side) is found at the next request: the
     * request is declined at once and the link dials again */
    kvb_conn_shutdown(lanes[1]);
    const double t1 = kvb_now_s();
    assert_int_equal(kvb_peer_link_lanes(l, &lanes, &n, &e), KVB_ERR_PEER_GONE);
    assert_true(kvb_now_s() - t1 < 0.010);
    assert_null(lanes);
    assert_non_null(strstr(e.msg, "connecting"));
    if (kvb_peer_link_wait_lanes(l, 5000, &lanes, &n, &e)) fail_msg("not up a third time: %s", e.msg);
    assert_int_equal(atomic_load(&o.ups), 3);
    kvb_peer_link_stop(l);
    server_stop(&s);
}

/* A peer that refuses the handshake: the link is down with the typed reason, the request is told
 * at once, and the listener counted the refusal too. */
static void refused_by_listener(const char *server_psk, uint64_t server_fp, kvb_status want,
                                kvb_handshake_reason reason, const char *needle) {
    server s;
    server_start(&s, server_psk, server_fp);
    observed o = {0};
    kvb_peer_link *l = link_start(kvb_listener_port(s.l), PSK, 2, 5000, &o);
    kvb_conn *const *lanes;
    uint32_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_peer_link_wait_lanes(l, 5000, &lanes, &n, &e), want);
    print_message("    %s\n", e.msg);
    assert_non_null(strstr(e.msg, needle));
    assert_non_null(strstr(e.msg, "next attempt in"));
    char why[512];
    assert_int_equal(kvb_peer_link_state(l, why, sizeof why), KVB_PEER_DOWN);
    kvb_status last;
    assert_true(hammer_lanes(l, 0.3, &last, &e) < 0.010);
    if (last != KVB_ERR_PEER_GONE || !strstr(e.msg, "connecting")) {
        char full[512];
        kvb_peer_link_state(l, full, sizeof full);
        if (last != want) fail_msg("%s: %s (%s)", kvb_status_name(last), e.msg, full);
    }
    assert_true(atomic_load(&o.by_reason[reason]) >= 1);
    assert_int_equal(atomic_load(&o.ups), 0);
    kvb_peer_link_stop(l);
    kvb_listener_stats ls;
    kvb_listener_get_stats(s.l, &ls);
    assert_true(ls.failed[reason] >= 1);
    assert_int_equal(ls.accepted, 0);
    server_stop(&s);
}

/* The heartbeat: the grouping's PONG reports the peer's queue; lanes an owner holds are never
 * pinged, idle ones are; a peer that stays connected but stops answering is found (the link leaves
 * up and, its redial unanswered too, is down) within the interval plus KVB_HEARTBEAT_TIMEOUT_MS. */
static void test_heartbeat_load_and_silent_peer(void **state) {
    (void)state;
    atomic_store(&g_mute, false);
    server s;
    server_start(&s, PSK, MODEL_FP);
    observed o = {0};
    kvb_peer_link *l = link_start_hb(kvb_listener_port(s.l), PSK, 2, 1000, 100, &o);
    kvb_conn *const *lanes = NULL;
    uint32_t n = 0, in_flight = 0, waiting = 0;
    kvb_err e = {0};
    if (kvb_peer_link_wait_lanes(l, 5000, &lanes, &n, &e)) fail_msg("not up: %s", e.msg);
    assert_true(kvb_peer_link_load(l, &in_flight, &waiting));
    assert_int_equal(in_flight, 3);
    assert_int_equal(waiting, 2);
    const unsigned lent_pings = atomic_load(&g_pings); /* the lanes are lent: no heartbeat on them */
    usleep(400 * 1000);
    assert_int_equal(atomic_load(&g_pings), lent_pings);
    kvb_peer_link_release(l);
    for (int i = 0; i < 200 && atomic_load(&g_pings) == lent_pings; i++) usleep(10 * 1000);
    assert_true(atomic_load(&g_pings) > lent_pings);
    assert_int_equal(kvb_peer_link_state(l, NULL, 0), KVB_PEER_UP);
    atomic_store(&g_mute, true);
    const double t0 = kvb_now_s();
    while (atomic_load(&o.downs) == 0 && kvb_now_s() - t0 < 6) usleep(10 * 1000);
    printf("a silent peer was found down in %.2f s\n", kvb_now_s() - t0);
    assert_true(atomic_load(&o.downs) >= 1);
    assert_true(kvb_now_s() - t0 < 0.1 + KVB_HEARTBEAT_TIMEOUT_MS / 1000.0 + 1.0 + 1.0); /* + the redial's timeout */
    assert_false(kvb_peer_link_load(l, &in_flight, &waiting));
    kvb_peer_link_stop(l);
    server_stop(&s);
    atomic_store(&g_mute, false);
}

static void test_wrong_key_is_auth(void **state) {
    (void)state;
    refused_by_listener(OTHER_PSK, MODEL_FP, KVB_ERR_AUTH, KVB_HANDSHAKE_AUTH, "keys differ");
}

static void test_other_model_is_mismatch(void **state) {
    (void)state;
    refused_by_listener(PSK, MODEL_FP + 1, KVB_ERR_MISMATCH, KVB_HANDSHAKE_MISMATCH, "another model");
}

/* ---- the link against peers that misbehave ------------------------------------------------------- */

/* A fake peer for 1.2 s: lanes() at once throughout, the link down with the reason, attempts spaced
 * by a back-off that grows (0.05 s doubling to 0.2 s, after a 0.3 s timeout each for a peer that
 * never answers): a handful of attempts, not a loop. */
static void misbehaving(kvbt_peer_kind kind, kvb_status want, kvb_handshake_reason reason, unsigned min_attempts,
                        unsigned max_attempts) {
    kvbt_fake_peer *p = kvbt_fake_peer_start(kind);
    observed o = {0};
    kvb_peer_link *l = link_start(kvbt_fake_peer_port(p), PSK, 2, 300, &o);
    kvb_status last;
    kvb_err e = {0};
    const double slowest = hammer_lanes(l, 1.2, &last, &e);
    const unsigned downs = atomic_load(&o.downs);
    print_message("    kind %d: %s; %u attempts failed, slowest lanes() %.3f ms\n", (int)kind, e.msg, downs,
                  slowest * 1e3);
    assert_true(slowest < 0.010);
    assert_int_equal(atomic_load(&o.ups), 0);
    assert_int_equal(atomic_load(&o.by_reason[reason]), downs);
    if (downs < min_attempts || downs > max_attempts)
        fail_msg("%u failed attempts in 1.2 s, expected %u..%u", downs, min_attempts, max_attempts);
    /* the last answer: down with this reason (or connecting again, between two attempts) */
    if (last != KVB_ERR_PEER_GONE || !strstr(e.msg, "connecting")) assert_int_equal(last, want);
    /* stopped while an attempt may be under way: cut short, not waited out */
    const double t0 = kvb_now_s();
    kvb_peer_link_stop(l);
    assert_true(kvb_now_s() - t0 < 0.2);
    kvbt_fake_peer_stop(p);
}

static void test_silent_peer(void **state) {
    (void)state;
    misbehaving(KVBT_PEER_SILENT, KVB_ERR_TIMEOUT, KVB_HANDSHAKE_TIMEOUT, 2, 4);
}

static void test_trickling_peer(void **state) {
    (void)state;
    misbehaving(KVBT_PEER_TRICKLE, KVB_ERR_TIMEOUT, KVB_HANDSHAKE_TIMEOUT, 2, 4);
}

static void test_garbage_peer(void **state) {
    (void)state;
    misbehaving(KVBT_PEER_GARBAGE, KVB_ERR_FORMAT, KVB_HANDSHAKE_PROTOCOL, 4, 9);
}

static void test_busy_peer(void **state) {
    (void)state;
    misbehaving(KVBT_PEER_BUSY, KVB_ERR_REFUSED, KVB_HANDSHAKE_REFUSED, 4, 9);
}

static void test_nobody_listening(void **state) {
    (void)state;
    kvbt_fake_peer *p = kvbt_fake_peer_start(KVBT_PEER_SILENT);
    const uint16_t port = kvbt_fake_peer_port(p);
    kvbt_fake_peer_stop(p); /* the port is free again: connections are refused */
    observed o = {0};
    kvb_peer_link *l = link_start(port, PSK, 1, 300, &o);
    kvb_conn *const *lanes;
    uint32_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_peer_link_wait_lanes(l, 1000, &lanes, &n, &e), KVB_ERR_PEER_GONE);
    assert_non_null(strstr(e.msg, "no connection to the peer"));
    kvb_status last;
    assert_true(hammer_lanes(l, 1.0, &last, &e) < 0.010);
    const unsigned downs = atomic_load(&o.downs);
    assert_int_equal(atomic_load(&o.by_reason[KVB_HANDSHAKE_GONE]), downs);
    assert_true(downs >= 4 && downs <= 9); /* 0.05, 0.1, 0.2, 0.2 ... s apart */
    kvb_peer_link_stop(l);
}

static void test_bad_config(void **state) {
    (void)state;
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP);
    kvb_transport_config cfg = {.psk = (const uint8_t *)PSK, .psk_len = strlen(PSK)};
    kvb_peer_link_config lc = {.addr = "127.0.0.1:1", .hello = &me, .tcfg = &cfg, .lanes = 0};
    kvb_peer_link *l = (kvb_peer_link *)0x1;
    kvb_err e = {0};
    assert_int_equal(kvb_peer_link_start(&lc, &l, &e), KVB_ERR_INVALID);
    assert_null(l);
    lc.lanes = KVB_WIRE_MAX_LANES + 1;
    assert_int_equal(kvb_peer_link_start(&lc, &l, &e), KVB_ERR_INVALID);
    lc.lanes = 1;
    cfg.psk_len = 4;
    assert_int_equal(kvb_peer_link_start(&lc, &l, &e), KVB_ERR_INVALID);
    cfg.psk_len = strlen(PSK);
    lc.backoff_min_s = 2, lc.backoff_max_s = 1;
    assert_int_equal(kvb_peer_link_start(&lc, &l, &e), KVB_ERR_INVALID);
    kvb_peer_link_stop(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_up_grouped_and_redialled_after_drop),
        cmocka_unit_test(test_heartbeat_load_and_silent_peer),
        cmocka_unit_test(test_wrong_key_is_auth),
        cmocka_unit_test(test_other_model_is_mismatch),
        cmocka_unit_test(test_silent_peer),
        cmocka_unit_test(test_trickling_peer),
        cmocka_unit_test(test_garbage_peer),
        cmocka_unit_test(test_busy_peer),
        cmocka_unit_test(test_nobody_listening),
        cmocka_unit_test(test_bad_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
