/* tests/test_transport_ucx.c — the transport over the UCX backend on loopback (every case skips
 * when this build has no UCX). ctest runs it twice: with UCX's own choice (shared memory between
 * the endpoints) and with UCX_TLS=tcp; each run checks that the lanes UCX reports are the ones
 * that run allows; a third run sets KVB_UCX_RING=0 (no receive ring). Large payloads go through
 * the ring only in the first: without a ring, or over TCP only, they go as tagged rendezvous
 * messages. Cases: the handshake and a stream of PREFILL, SLABs of up to 24 MiB (bytes
 * intact, bit for bit), DONE and PING/PONG with matching counters; 60 slabs of sizes around the
 * ring path's bounds (64 KiB, a quarter of the ring and one byte more), laps of the ring and its
 * credits, bit for bit; a wrong key refused on both sides (KVB_ERR_AUTH), and a SLAB sent in place
 * of the handshake refused with nothing delivered; a corrupt payload (a frame whose bytes no
 * longer match its hash) fails the receive with KVB_ERR_CHECKSUM, through the ring too, and a K
 * corrupted after its slab checksum arrives as sent, so the consumer's check refuses it; a large
 * payload shorter or longer than its header says is refused (KVB_ERR_FORMAT tagged, the ring's
 * bytes where the header says do not hash: KVB_ERR_CHECKSUM); a silent peer is a timeout within
 * the deadline; a shutdown wakes a blocked receive, and the other end of a lane shut down but
 * left open ends its pending receive with KVB_ERR_PEER_GONE at once; a peer process killed mid-frame or between
 * frames of a stream is KVB_ERR_PEER_GONE, not a hang (the peer is this binary run again, so it
 * starts UCX afresh rather than inheriting the parent's state through fork). Payloads lent out of
 * the ring (kvb_conn_recv_lend; nothing is lent in the other two runs): a lent slot is never put
 * into again while lent (the sender waits at it) and the stream goes on once it is returned;
 * loans stay valid after the peer shut down, after a timeout and after the connection closed; a
 * frame whose hash fails returns its loan; a lent slab whose checksum does not match is refused by
 * the consumer on the view and the stream after it arrives intact. */
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xxhash.h>

#include "kvb_quant.h"
#include "transport_internal.h"

#define IO_TIMEOUT_MS 5000
static const uint8_t PSK[32] = "0123456789abcdef0123456789abcdef";
static const uint8_t OTHER_PSK[32] = "0123456789abcdef0123456789abcdeX";
static const uint64_t MODEL_FP = 0x6d6f64656c2d6670ULL;
static const kvb_wire_backend *UCX;

static kvb_hello make_hello(kvb_wire_role role, const char *name) {
    kvb_kvformat f;
    kvb_hello h;
    kvb_err e = {0};
    assert_int_equal(kvb_kvformat_init(&f, KVB_TYPE_F16, 16, 4, 2, 64, &e), KVB_OK);
    if (kvb_hello_init(&h, role, KVB_BRIDGE_MODE_DECODER, name, MODEL_FP, &f, &e)) fail_msg("hello: %s", e.msg);
    return h;
}

static kvb_transport_config make_config(const uint8_t *psk) {
    return (kvb_transport_config){.psk = psk, .psk_len = 32, .backend = UCX};
}

static int setup(void **state) {
    (void)state;
    kvb_err e = {0};
    if (kvb_wire_backend_by_name("ucx", &UCX, &e) != KVB_OK) UCX = NULL;
    return 0;
}

static kvb_listener *listen_ucx(void) {
    if (!UCX) skip();
    kvb_listener *l = NULL;
    kvb_err e = {0};
    if (kvb_transport_listen("127.0.0.1:0", UCX, &l, &e)) fail_msg("listen: %s", e.msg);
    assert_int_not_equal(kvb_listener_port(l), 0);
    return l;
}

typedef struct {
    kvb_listener *l;
    const uint8_t *psk;
    kvb_conn *conn;
    kvb_status st;
    kvb_err err;
    pthread_t thread;
} accept_job;

static void *accept_main(void *arg) {
    accept_job *j = arg;
    kvb_hello me = make_hello(KVB_ROLE_PREFILL, "prefill-a");
    kvb_transport_config cfg = make_config(j->psk);
    j->st = kvb_transport_accept(j->l, &me, &cfg, IO_TIMEOUT_MS, &j->conn, NULL, &j->err);
    return NULL;
}

/* decode connects with dpsk, prefill accepts with ppsk; returns the connecting side's status. */
static kvb_status try_pair(kvb_listener *l, const uint8_t *dpsk, const uint8_t *ppsk, kvb_conn **decode,
                           accept_job *j, kvb_err *e) {
    *j = (accept_job){.l = l, .psk = ppsk};
    assert_int_equal(pthread_create(&j->thread, NULL, accept_main, j), 0);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a");
    kvb_transport_config cfg = make_config(dpsk);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", kvb_listener_port(l));
    kvb_status st = kvb_transport_connect(addr, &me, &cfg, IO_TIMEOUT_MS, decode, NULL, e);
    pthread_join(j->thread, NULL);
    return st;
}

static void connect_pair(kvb_listener *l, kvb_conn **decode, kvb_conn **prefill) {
    accept_job j;
    kvb_err e = {0};
    if (try_pair(l, PSK, PSK, decode, &j, &e)) fail_msg("connect: %s", e.msg);
    if (j.st) fail_msg("accept: %s", j.err.msg);
    *prefill = j.conn;
}

/* Whether large payloads go through the receive ring in this run: not without one (KVB_UCX_RING=0),
 * nor over TCP only (UCX_TLS=tcp), where they go tagged. */
static bool ring_in_use(void) {
    const char *ring = getenv("KVB_UCX_RING"), *tls = getenv("UCX_TLS");
    return !(ring && !strcmp(ring, "0")) && !(tls && !strcmp(tls, "tcp"));
}

/* The lanes must be the ones this run allows: TCP only with UCX_TLS=tcp, else shared memory
 * (both ends are on this host) and no TCP. */
static void check_lanes(kvb_conn *c) {
    char d[256];
    kvb_conn_describe(c, d, sizeof d);
    print_message("    carried by: %s\n", d);
    assert_true(strncmp(d, "ucx ", 4) == 0);
    const char *tls = getenv("UCX_TLS");
    assert_non_null(strchr(d + 4, '/')); /* at least one TRANSPORT/DEVICE */
    if (tls && !strcmp(tls, "tcp")) {
        assert_non_null(strstr(d, "tcp/"));
        assert_null(strstr(d, "memory"));
    } else {
        assert_non_null(strstr(d, "memory"));
        assert_null(strstr(d, "tcp/"));
    }
    if (ring_in_use()) assert_non_null(strstr(d, "put into the peer's ring"));
    else assert_null(strstr(d, "put into the peer's ring"));
    char last[256];
    kvb_ucx_last_lanes(last, sizeof last);
    assert_non_null(strstr(d, last));
}

/* Receives 6 SLABs (each into its own buffer) and DONE. */
typedef struct {
    kvb_conn *c;
    kvb_wire_buf buf[7];
    kvb_msg msg[7];
    kvb_status st[7];
    kvb_err err;
} stream_job;

static void *stream_main(void *arg) {
    stream_job *j = arg;
    for (int i = 0; i < 7; i++)
        if ((j->st[i] = kvb_conn_recv_into(j->c, IO_TIMEOUT_MS, &j->buf[i], &j->msg[i], &j->err)) != KVB_OK) break;
    return NULL;
}

static void test_handshake_and_stream(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    kvb_err e = {0};
    int32_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = 1000 + i;
    kvb_msg_prefill req = {.request_id = 7, .bridge_mode = KVB_BRIDGE_MODE_DECODER, .n_tokens = 64,
                           .cached_tokens = 16, .ship_tokens = 48, .last_cached_key = 0x99, .tokens = tokens};
    if (kvb_conn_send_prefill(dc, &req, IO_TIMEOUT_MS, &e)) fail_msg("send prefill: %s", e.msg);
    kvb_msg m;
    if (kvb_conn_recv(pc, IO_TIMEOUT_MS, &m, &e)) fail_msg("prefill recv: %s", e.msg);
    assert_int_equal(m.type, KVB_FRAME_PREFILL);
    assert_memory_equal(m.u.prefill.tokens, tokens, sizeof tokens);
    kvb_msg_free(&m);

    /* slabs from 1 byte to 12 MiB each side, received on another thread while they are sent */
    enum { NS = 6 };
    const size_t sizes[NS] = {2048, 1, 65536, 1 << 20, 12 << 20, 4096 * 3 + 7};
    uint8_t *k[NS], *v[NS];
    stream_job rj = {.c = dc};
    pthread_t rt;
    assert_int_equal(pthread_create(&rt, NULL, stream_main, &rj), 0);
    for (int s = 0; s < NS; s++) {
        k[s] = malloc(sizes[s]);
        v[s] = malloc(sizes[s]);
        for (size_t i = 0; i < sizes[s]; i++) {
            k[s][i] = (uint8_t)(s * 31 + i * 7 + (i >> 11));
            v[s][i] = (uint8_t)(s * 17 + i * 3 + (i >> 13));
        }
        kvb_msg_slab sl = {.layer = (uint32_t)s % 4, .pos0 = 16, .n = 16, .k = k[s], .v = v[s], .k_bytes = sizes[s],
                           .v_bytes = sizes[s], .checksum = XXH3_64bits(k[s], sizes[s])};
        if (kvb_conn_send_slab(pc, 7, &sl, IO_TIMEOUT_MS, &e)) fail_msg("send slab %d: %s", s, e.msg);
    }
    kvb_msg_done done = {.tokens_covered = 48, .blocks = 2, .slabs = NS, .prefill_seconds = 0.25};
    assert_int_equal(kvb_conn_send_done(pc, 7, &done, IO_TIMEOUT_MS, &e), KVB_OK);
    pthread_join(rt, NULL);
    for (int s = 0; s < NS; s++) {
        if (rj.st[s]) fail_msg("slab recv %d: %s", s, rj.err.msg);
        m = rj.msg[s];
        assert_int_equal(m.type, KVB_FRAME_SLAB);
        assert_int_equal(m.u.slab.layer, (uint32_t)s % 4);
        assert_int_equal(m.u.slab.k_bytes, sizes[s]);
        assert_int_equal(m.u.slab.checksum, XXH3_64bits(k[s], sizes[s]));
        assert_memory_equal(m.u.slab.k, k[s], sizes[s]);
        assert_memory_equal(m.u.slab.v, v[s], sizes[s]);
        free(k[s]);
        free(v[s]);
        free(rj.buf[s].data);
    }
    if (rj.st[NS]) fail_msg("done recv: %s", rj.err.msg);
    assert_int_equal(rj.msg[NS].type, KVB_FRAME_DONE);
    m = rj.msg[NS];
    assert_int_equal(m.u.done.slabs, NS);
    free(rj.buf[NS].data);
    /* both directions at once: PING from decode, PONG back */
    assert_int_equal(kvb_conn_send_ping(dc, 0xabcdef, IO_TIMEOUT_MS, &e), KVB_OK);
    assert_int_equal(kvb_conn_recv(pc, IO_TIMEOUT_MS, &m, &e), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_PING);
    assert_int_equal(kvb_conn_send_pong(pc, m.u.ping.token, IO_TIMEOUT_MS, &e), KVB_OK);
    assert_int_equal(kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_PONG);
    assert_int_equal(m.u.ping.token, 0xabcdef);
    check_lanes(dc);
    check_lanes(pc);
    kvb_conn_stats ds, ps;
    kvb_conn_get_stats(dc, &ds);
    kvb_conn_get_stats(pc, &ps);
    assert_int_equal(ds.bytes_sent, ps.bytes_received);
    assert_int_equal(ps.bytes_sent, ds.bytes_received);
    assert_int_equal(ds.frames_received, ps.frames_sent);
    assert_int_equal(ds.checksum_failures + ps.checksum_failures, 0);
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

/* A quarter of the receive ring (the largest payload it carries) as this run configures it. */
static uint64_t ring_quarter(void) {
    const char *e = getenv("KVB_UCX_RING");
    uint64_t r = e && *e ? strtoull(e, NULL, 10) : 8u << 20;
    return r ? r / 4 : 8u << 20;
}

/* Receives n SLABs and checks each, bit for bit, against what slab_of made for its index. */
typedef struct {
    kvb_conn *c;
    int n;
    const uint64_t *sizes; /* payload bytes, cycled */
    int n_sizes;
    const uint8_t *pool;
    int got;
    kvb_status st;
    kvb_err err;
} laps_job;

/* Slab i of a stream: its payload is sizes[i % n] bytes; K and V are views into pool at offsets
 * that depend on i, so every slab's bytes differ from its neighbours'. */
static kvb_msg_slab slab_of(const laps_job *j, int i) {
    const uint64_t kv = j->sizes[i % j->n_sizes] - KVB_SLAB_HEAD_BYTES, kb = kv / 2;
    kvb_msg_slab sl = {.layer = (uint32_t)i, .pos0 = 0, .n = 1, .k = j->pool + i, .v = j->pool + 3 * i + 1,
                       .k_bytes = kb, .v_bytes = kv - kb};
    sl.checksum = XXH3_64bits(sl.k, kb) ^ XXH3_64bits(sl.v, kv - kb);
    return sl;
}

static void *laps_main(void *arg) {
    laps_job *j = arg;
    for (; j->got < j->n; j->got++) {
        kvb_msg m;
        if ((j->st = kvb_conn_recv(j->c, IO_TIMEOUT_MS, &m, &j->err)) != KVB_OK) return NULL;
        kvb_msg_slab want = slab_of(j, j->got);
        if (m.type != KVB_FRAME_SLAB || m.u.slab.layer != want.layer || m.u.slab.k_bytes != want.k_bytes ||
            m.u.slab.v_bytes != want.v_bytes || m.u.slab.checksum != want.checksum ||
            memcmp(m.u.slab.k, want.k, want.k_bytes) != 0 || memcmp(m.u.slab.v, want.v, want.v_bytes) != 0) {
            j->st = kvb_err_set(&j->err, KVB_ERR_FORMAT, "slab %d arrived different from what was sent", j->got);
            return NULL;
        }
    }
    return NULL;
}

/* 60 slabs of sizes around the ring path's bounds (below the threshold, at it, a quarter of the
 * ring and one byte more, which goes tagged), several laps of the ring: every one bit for bit. */
static void test_ring_laps(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    const uint64_t q = ring_quarter();
    const uint64_t sizes[] = {65536, q, (1u << 20) + 13, q + 1, 65535, (3u << 20) + 7};
    uint8_t *pool = malloc(q + 256);
    for (uint64_t i = 0; i < q + 256; i++) pool[i] = (uint8_t)(i * 2654435761u >> 13);
    laps_job j = {.c = dc, .n = 60, .sizes = sizes, .n_sizes = 6, .pool = pool};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, laps_main, &j), 0);
    kvb_err e = {0};
    kvb_status st = KVB_OK;
    for (int i = 0; i < j.n && !st; i++) {
        kvb_msg_slab sl = slab_of(&j, i);
        st = kvb_conn_send_slab(pc, 7, &sl, IO_TIMEOUT_MS, &e);
    }
    pthread_join(t, NULL);
    if (st) fail_msg("send: %s", e.msg);
    if (j.st) fail_msg("receive (after %d slabs): %s", j.got, j.err.msg);
    assert_int_equal(j.got, j.n);
    check_lanes(dc);
    kvb_conn_stats ds, ps;
    kvb_conn_get_stats(dc, &ds);
    kvb_conn_get_stats(pc, &ps);
    assert_int_equal(ds.bytes_received, ps.bytes_sent);
    free(pool);
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

/* A SLAB (of a size the ring would carry) sent in place of the handshake: the accepting side
 * refuses it and hands out no connection; nothing of it is delivered. */
static void test_slab_before_handshake_refused(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    accept_job j = {.l = l, .psk = PSK};
    assert_int_equal(pthread_create(&j.thread, NULL, accept_main, &j), 0);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", kvb_listener_port(l));
    kvb_err e = {0};
    double deadline;
    assert_int_equal(wire_deadline(IO_TIMEOUT_MS, &deadline, &e), KVB_OK);
    kvb_link *link = NULL;
    assert_int_equal(UCX->connect(addr, deadline, &link, &e), KVB_OK);
    const size_t n = 512 << 10;
    uint8_t *p = calloc(1, n);
    kvb_msg_slab sl = {.layer = 0, .pos0 = 0, .n = 1, .k = p + KVB_SLAB_HEAD_BYTES, .v = p + KVB_SLAB_HEAD_BYTES,
                       .k_bytes = n - KVB_SLAB_HEAD_BYTES, .v_bytes = 0};
    kvb_msg_slab_encode_head(&sl, p);
    kvb_iov iov = {p, n};
    kvb_frame_header h = {.type = KVB_FRAME_SLAB, .request_id = 1, .payload_len = n,
                          .payload_hash = kvb_wire_frame_payload_hash(KVB_FRAME_SLAB, &iov, 1)};
    uint8_t hdr[KVB_WIRE_HEADER_BYTES];
    kvb_wire_header_encode(&h, hdr);
    kvb_status sst = UCX->send_frame(link, hdr, &iov, 1, deadline, &e);
    pthread_join(j.thread, NULL);
    print_message("    accepting side: %s (the sender: %s)\n", j.err.msg, sst ? e.msg : "sent");
    assert_int_not_equal(j.st, KVB_OK);
    assert_null(j.conn);
    kvb_listener_stats ls;
    kvb_listener_get_stats(l, &ls);
    assert_int_equal(ls.accepted, 0);
    UCX->close(link);
    free(p);
    kvb_listener_close(l);
}

static void test_wrong_key_refused_both_sides(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    kvb_conn *dc = NULL;
    accept_job j;
    kvb_err e = {0};
    assert_int_equal(try_pair(l, OTHER_PSK, PSK, &dc, &j, &e), KVB_ERR_AUTH);
    print_message("    connecting side: %s\n    accepting side: %s\n", e.msg, j.err.msg);
    assert_int_equal(j.st, KVB_ERR_AUTH);
    assert_null(dc);
    assert_null(j.conn);
    kvb_listener_stats ls;
    kvb_listener_get_stats(l, &ls);
    assert_int_equal(ls.failed[KVB_HANDSHAKE_AUTH], 1);
    assert_int_equal(ls.accepted, 0);
    kvb_listener_close(l);
}

/* One receive on its own thread, timed; with lend, as kvb_conn_recv_lend (the loan is returned). */
typedef struct {
    kvb_conn *c;
    kvb_status st;
    kvb_err err;
    double seconds;
    int timeout_ms;
    bool lend;
    bool lent; /* the backend set the loan (it must be empty after a failure) */
} recv_job;

static void *recv_main(void *arg) {
    recv_job *j = arg;
    kvb_msg m;
    kvb_wire_buf buf = {0};
    kvb_wire_loan loan = {0};
    double t0 = kvb_now_s();
    j->st = j->lend ? kvb_conn_recv_lend(j->c, j->timeout_ms, &buf, &loan, &m, &j->err)
                    : kvb_conn_recv(j->c, j->timeout_ms, &m, &j->err);
    j->seconds = kvb_now_s() - t0;
    j->lent = loan.data != NULL || loan.give_back != NULL;
    kvb_wire_loan_return(&loan);
    free(buf.data);
    return NULL;
}

/* A SLAB of kv bytes of K and of V whose head changes after its frame hash was taken (corrupted
 * in flight): the receiver's hash check fails the receive before the message is decoded; a
 * payload lent out of the ring (lend) is returned by then. */
static void corrupt_payload(size_t kv, bool lend) {
    kvb_listener *l = listen_ucx();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    uint8_t head[KVB_SLAB_HEAD_BYTES], *k = malloc(kv), *v = malloc(kv);
    for (size_t i = 0; i < kv; i++) k[i] = v[i] = (uint8_t)i;
    kvb_msg_slab sl = {.layer = 1, .pos0 = 16, .n = 16, .k = k, .v = v, .k_bytes = kv, .v_bytes = kv,
                       .checksum = XXH3_64bits(k, kv)};
    kvb_msg_slab_encode_head(&sl, head);
    kvb_iov iov[3] = {{head, sizeof head}, {k, kv}, {v, kv}};
    kvb_frame_header h = {.type = KVB_FRAME_SLAB, .request_id = 7, .payload_len = sizeof head + 2 * kv,
                          .payload_hash = kvb_wire_frame_payload_hash(KVB_FRAME_SLAB, iov, 3)};
    uint8_t hdr[KVB_WIRE_HEADER_BYTES];
    kvb_wire_header_encode(&h, hdr);
    head[9] ^= 0x20; /* in flight */
    kvb_err e = {0};
    double deadline;
    assert_int_equal(wire_deadline(IO_TIMEOUT_MS, &deadline, &e), KVB_OK);
    recv_job j = {.c = dc, .timeout_ms = IO_TIMEOUT_MS, .lend = lend}; /* a rendezvous needs the receiver there */
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, recv_main, &j), 0);
    assert_int_equal(pc->backend->send_frame(pc->link, hdr, iov, 3, deadline, &e), KVB_OK);
    pthread_join(t, NULL);
    assert_int_equal(j.st, KVB_ERR_CHECKSUM);
    assert_false(j.lent);
    print_message("    %s\n", j.err.msg);
    assert_false(kvb_conn_usable(dc));
    kvb_conn_stats ds;
    kvb_conn_get_stats(dc, &ds);
    assert_int_equal(ds.checksum_failures, 1);
    free(k);
    free(v);
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

/* on the stream (256 bytes each), and through the ring (256 KiB each) */
static void test_corrupt_payload_is_checksum_error(void **state) {
    (void)state;
    corrupt_payload(256, false);
    corrupt_payload(256 << 10, false);
    corrupt_payload(256 << 10, true);
}

/* An authenticated peer whose large payload is shorter or longer than its frame header says:
 * refused with `want`, never bytes beyond what arrived (tagged: KVB_ERR_FORMAT; through the ring
 * the header says where the payload is and how long, and the bytes there do not hash:
 * KVB_ERR_CHECKSUM). */
static void payload_length_lies(uint64_t header_says, size_t sent, kvb_status want) {
    kvb_listener *l = listen_ucx();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    uint8_t *p = calloc(1, sent);
    kvb_iov iov = {p, sent};
    kvb_frame_header h = {.type = KVB_FRAME_DONE, .request_id = 7, .payload_len = header_says};
    uint8_t hdr[KVB_WIRE_HEADER_BYTES];
    kvb_wire_header_encode(&h, hdr);
    kvb_err e = {0};
    double deadline;
    assert_int_equal(wire_deadline(IO_TIMEOUT_MS, &deadline, &e), KVB_OK);
    recv_job j = {.c = dc, .timeout_ms = 2000};
    pthread_t t;
    pthread_create(&t, NULL, recv_main, &j);
    kvb_status sst = pc->backend->send_frame(pc->link, hdr, &iov, 1, deadline, &e);
    pthread_join(t, NULL);
    print_message("    header %llu, sent %zu: %s (the sender: %s)\n", (unsigned long long)header_says, sent, j.err.msg,
                  sst ? e.msg : "sent");
    assert_int_equal(j.st, want);
    assert_false(kvb_conn_usable(dc));
    free(p);
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

static void test_large_payload_length_lies(void **state) {
    (void)state;
    const uint64_t q = ring_quarter();
    const kvb_status in_ring = ring_in_use() ? KVB_ERR_CHECKSUM : KVB_ERR_FORMAT;
    payload_length_lies(q + (256 << 10), q + (100 << 10), KVB_ERR_FORMAT); /* tagged */
    payload_length_lies(q + (128 << 10), q + (300 << 10), KVB_ERR_FORMAT);
    payload_length_lies(256 << 10, 100 << 10, in_ring);
    payload_length_lies(128 << 10, 300 << 10, in_ring);
}

static void test_silent_peer_times_out(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    kvb_err e = {0};
    kvb_msg m;
    double t0 = kvb_now_s();
    assert_int_equal(kvb_conn_recv(dc, 300, &m, &e), KVB_ERR_TIMEOUT);
    double dt = kvb_now_s() - t0;
    print_message("    %s after %.3f s\n", e.msg, dt);
    assert_true(dt >= 0.29 && dt < 1.5);
    assert_non_null(strstr(e.msg, "timed out"));
    assert_false(kvb_conn_usable(dc));
    kvb_conn *c = NULL;
    kvb_hello me = make_hello(KVB_ROLE_PREFILL, "prefill-a");
    kvb_transport_config cfg = make_config(PSK);
    t0 = kvb_now_s();
    assert_int_equal(kvb_transport_accept(l, &me, &cfg, 200, &c, NULL, &e), KVB_ERR_TIMEOUT);
    dt = kvb_now_s() - t0;
    assert_true(dt >= 0.19 && dt < 1.5);
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

static void test_shutdown_wakes_blocked_receive(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    recv_job j = {.c = dc, .timeout_ms = IO_TIMEOUT_MS};
    pthread_t t;
    pthread_create(&t, NULL, recv_main, &j);
    usleep(100 * 1000);
    kvb_conn_shutdown(dc);
    pthread_join(t, NULL);
    print_message("    %s after %.3f s\n", j.err.msg, j.seconds);
    assert_int_equal(j.st, KVB_ERR_CANCELLED);
    assert_true(j.seconds < 2.0);
    kvb_conn_close(dc);
    /* the other end learns that its peer closed */
    kvb_msg m;
    kvb_err e = {0};
    assert_int_equal(kvb_conn_recv(pc, IO_TIMEOUT_MS, &m, &e), KVB_ERR_PEER_GONE);
    print_message("    the other end: %s\n", e.msg);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

/* Three lanes, each with its other end blocked in a receive; one is shut down by the prefill side
 * and then left alone (not closed, nothing on its side progressed, as a node that drops a lane
 * keeps it until later): that lane's other end ends its pending receive with KVB_ERR_PEER_GONE
 * well within a second, where it used to wait out its whole timeout at times under load, and the
 * two other lanes are untouched (still waiting, then a timeout of their own). */
static void test_shutdown_tells_open_peer(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    kvb_conn *dc[3], *pc[3];
    for (int i = 0; i < 3; i++) connect_pair(l, &dc[i], &pc[i]);
    recv_job j[3];
    pthread_t t[3];
    for (int i = 0; i < 3; i++) {
        j[i] = (recv_job){.c = dc[i], .timeout_ms = i == 1 ? IO_TIMEOUT_MS : 1500};
        pthread_create(&t[i], NULL, recv_main, &j[i]);
    }
    usleep(200 * 1000);
    kvb_conn_shutdown(pc[1]);
    for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
    print_message("    lane 1: %s after %.3f s\n", j[1].err.msg, j[1].seconds);
    assert_int_equal(j[1].st, KVB_ERR_PEER_GONE);
    assert_true(j[1].seconds < 0.2 + 1.0);
    for (int i = 0; i < 3; i += 2) {
        assert_int_equal(j[i].st, KVB_ERR_TIMEOUT);
        assert_true(kvb_conn_usable(pc[i]));
    }
    for (int i = 0; i < 3; i++) {
        kvb_conn_close(dc[i]);
        kvb_conn_close(pc[i]);
    }
    kvb_listener_close(l);
}

#define CHILD_TOKENS 200000 /* a PREFILL of 800 KB: through the ring */

/* The child (this binary with KVB_UCX_CHILD_PORT set): connects as a decode node; with
 * KVB_UCX_CHILD_MODE=frame sends a PREFILL header that promises more than the ring carries (such a
 * payload follows as a tagged message) and not the payload; with =stream two whole PREFILLs of
 * CHILD_TOKENS tokens; then kills itself. */
static int child_main(const char *port) {
    kvb_err e = {0};
    if (kvb_wire_backend_by_name("ucx", &UCX, &e)) return 2;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%s", port);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "doomed");
    kvb_transport_config cfg = make_config(PSK);
    kvb_conn *c = NULL;
    if (kvb_transport_connect(addr, &me, &cfg, IO_TIMEOUT_MS, &c, NULL, &e)) {
        fprintf(stderr, "child: %s\n", e.msg);
        return 3;
    }
    const char *mode = getenv("KVB_UCX_CHILD_MODE");
    if (mode && !strcmp(mode, "stream")) {
        int32_t *tokens = malloc(sizeof *tokens * CHILD_TOKENS);
        for (int i = 0; i < CHILD_TOKENS; i++) tokens[i] = i % 32000;
        for (uint64_t r = 1; r <= 2; r++) {
            kvb_msg_prefill req = {.request_id = r, .bridge_mode = KVB_BRIDGE_MODE_DECODER, .n_tokens = CHILD_TOKENS,
                                   .cached_tokens = 0, .ship_tokens = 16, .last_cached_key = 0x99, .tokens = tokens};
            if (kvb_conn_send_prefill(c, &req, IO_TIMEOUT_MS, &e)) return 4;
        }
    } else {
        kvb_frame_header h = {.type = KVB_FRAME_PREFILL, .request_id = 1, .payload_len = ring_quarter() + (1 << 20)};
        uint8_t hdr[KVB_WIRE_HEADER_BYTES];
        kvb_wire_header_encode(&h, hdr);
        double deadline;
        wire_deadline(IO_TIMEOUT_MS, &deadline, &e);
        if (c->backend->send_frame(c->link, hdr, NULL, 0, deadline, &e)) return 4;
    }
    usleep(200 * 1000); /* let it arrive */
    raise(SIGKILL);
    return 5;
}

/* A child that kills itself (mode: child_main's); returns the status of the receive after the
 * `whole` frames it sent whole, which are checked. */
static void peer_killed(const char *mode, int whole, const char *where) {
    kvb_listener *l = listen_ucx();
    char port[16];
    snprintf(port, sizeof port, "%u", kvb_listener_port(l));
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        setenv("KVB_UCX_CHILD_PORT", port, 1);
        setenv("KVB_UCX_CHILD_MODE", mode, 1);
        execl("/proc/self/exe", "test_transport_ucx", (char *)NULL);
        _exit(127);
    }
    kvb_hello me = make_hello(KVB_ROLE_PREFILL, "prefill-a");
    kvb_transport_config cfg = make_config(PSK);
    kvb_conn *c = NULL;
    kvb_err e = {0};
    if (kvb_transport_accept(l, &me, &cfg, 10000, &c, NULL, &e)) fail_msg("accept: %s", e.msg);
    kvb_msg m;
    for (int r = 1; r <= whole; r++) {
        if (kvb_conn_recv(c, 10000, &m, &e)) fail_msg("PREFILL %d: %s", r, e.msg);
        assert_int_equal(m.type, KVB_FRAME_PREFILL);
        assert_int_equal(m.request_id, r);
        assert_int_equal(m.u.prefill.n_tokens, CHILD_TOKENS);
        for (int i = 0; i < CHILD_TOKENS; i++)
            if (m.u.prefill.tokens[i] != i % 32000) fail_msg("PREFILL %d: token %d is %d", r, i, m.u.prefill.tokens[i]);
        kvb_msg_free(&m);
    }
    double t0 = kvb_now_s();
    kvb_status st = kvb_conn_recv(c, 10000, &m, &e);
    double dt = kvb_now_s() - t0;
    int wst = 0;
    waitpid(pid, &wst, 0);
    print_message("    %s after %.3f s\n", e.msg, dt);
    assert_true(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL);
    assert_int_equal(st, KVB_ERR_PEER_GONE);
    assert_non_null(strstr(e.msg, where));
    assert_non_null(strstr(e.msg, "the peer is gone"));
    /* the child dies 0.2 s after its last send, and the kernel closes its sockets with it: the
     * connection manager's endpoint fails at once (about 0.21 s measured), well before any
     * keepalive round */
    assert_true(dt < 2.0);
    kvb_conn_close(c);
    kvb_listener_close(l);
}

static void test_peer_killed_mid_frame(void **state) {
    (void)state;
    peer_killed("frame", 0, "PREFILL payload");
}

static void test_peer_killed_between_frames(void **state) {
    (void)state;
    peer_killed("stream", 2, "frame header");
}

/* ---- payloads lent out of the receive ring (kvb_conn_recv_lend) ---- */

/* Sends the n slabs of slab_of(what, i) on its own thread, counting those sent (with
 * corrupt_first, slab 0 carries a checksum its bytes do not match); with shut, then shuts its
 * connection down (the peer's pending receive ends at once). */
typedef struct {
    kvb_conn *c;
    const laps_job *what;
    bool corrupt_first, shut;
    atomic_int sent;
    kvb_status st;
    kvb_err err;
} send_job;

static void *send_main(void *arg) {
    send_job *j = arg;
    for (int i = 0; i < j->what->n && !j->st; i++) {
        kvb_msg_slab sl = slab_of(j->what, i);
        if (i == 0 && j->corrupt_first) sl.checksum ^= 1;
        if (!(j->st = kvb_conn_send_slab(j->c, 7, &sl, 20000, &j->err))) atomic_fetch_add(&j->sent, 1);
    }
    if (j->shut) kvb_conn_shutdown(j->c);
    return NULL;
}

/* The slab as slab_of made slab i, bit for bit. */
static void check_slab(const kvb_msg_slab *got, const laps_job *j, int i) {
    kvb_msg_slab want = slab_of(j, i);
    assert_int_equal(got->layer, want.layer);
    assert_int_equal(got->k_bytes, want.k_bytes);
    assert_int_equal(got->v_bytes, want.v_bytes);
    assert_int_equal(got->checksum, want.checksum);
    if (memcmp(got->k, want.k, want.k_bytes) != 0 || memcmp(got->v, want.v, want.v_bytes) != 0)
        fail_msg("slab %d: its bytes differ from what was sent", i);
}

/* Receives slab i with a loan (lent out of the ring when this run uses one: K is then a view into
 * the loan's payload, right after the slab's head; else nothing lent) and checks it. */
static kvb_msg recv_lent(kvb_conn *c, const laps_job *j, int i, kvb_wire_buf *buf, kvb_wire_loan *loan) {
    kvb_msg m;
    kvb_err e = {0};
    if (kvb_conn_recv_lend(c, IO_TIMEOUT_MS, buf, loan, &m, &e)) fail_msg("slab %d: %s", i, e.msg);
    assert_int_equal(m.type, KVB_FRAME_SLAB);
    if (ring_in_use()) {
        assert_non_null(loan->data);
        assert_ptr_equal(m.u.slab.k, loan->data + KVB_SLAB_HEAD_BYTES);
    } else {
        assert_null(loan->data);
    }
    check_slab(&m.u.slab, j, i);
    return m;
}

/* A connected pair and n slabs of `size` bytes each (slab_of's: views into a pool made for them)
 * sent from the prefill side on a thread (send_main). */
typedef struct {
    kvb_conn *dc, *pc;
    uint64_t size;
    laps_job what;
    send_job sj;
    pthread_t t;
} lent_stream;

static void stream_start(lent_stream *s, kvb_listener *l, uint64_t size, int n, bool corrupt_first, bool shut) {
    connect_pair(l, &s->dc, &s->pc);
    s->size = size;
    const size_t pool_bytes = size + 4 * (size_t)n;
    uint8_t *pool = malloc(pool_bytes);
    for (size_t i = 0; i < pool_bytes; i++) pool[i] = (uint8_t)(i * 2654435761u >> 13);
    s->what = (laps_job){.n = n, .sizes = &s->size, .n_sizes = 1, .pool = pool};
    s->sj = (send_job){.c = s->pc, .what = &s->what, .corrupt_first = corrupt_first, .shut = shut};
    assert_int_equal(pthread_create(&s->t, NULL, send_main, &s->sj), 0);
}

/* Waits for the sender, which must have sent everything; closes its end (the test closes dc). */
static void stream_end(lent_stream *s) {
    pthread_join(s->t, NULL);
    if (s->sj.st) fail_msg("send: %s", s->sj.err.msg);
    assert_int_equal(atomic_load(&s->sj.sent), s->what.n);
    kvb_conn_close(s->pc);
    free((uint8_t *)s->what.pool);
}

/* Receives slabs from..n-1 of the stream, each lent, checked and returned at once. */
static void recv_rest(lent_stream *s, int from, kvb_wire_buf *buf) {
    kvb_wire_loan loan;
    for (int i = from; i < s->what.n; i++) {
        recv_lent(s->dc, &s->what, i, buf, &loan);
        kvb_wire_loan_return(&loan);
    }
}

/* A lent slot is never put into again while its loan is out: slab 0 is kept lent while the next
 * ones arrive (each returned at once); the sender fills the ring up to slab 0's room and waits
 * there; slab 0 is then still as sent; once it is returned, the rest of the stream follows, bit
 * for bit (laps of the ring). */
static void test_lent_slot_never_reused(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    lent_stream s;
    stream_start(&s, l, (1u << 20) + 13, 48, false, false); /* laps end with a skip */
    kvb_wire_buf buf = {0}, held_buf = {0};
    kvb_wire_loan held, loan;
    kvb_msg first = recv_lent(s.dc, &s.what, 0, &held_buf, &held);
    const int fit = (int)(4 * ring_quarter() / s.size); /* slabs in the first lap: slab `fit` needs slab 0's room */
    for (int i = 1; i < fit; i++) {
        recv_lent(s.dc, &s.what, i, &buf, &loan);
        kvb_wire_loan_return(&loan);
    }
    if (ring_in_use()) { /* the sender gets as far as slab 0's room (however loaded the host), no further */
        for (int ms = 0; ms < IO_TIMEOUT_MS && atomic_load(&s.sj.sent) < fit; ms += 10) usleep(10 * 1000);
        usleep(200 * 1000);
        print_message("    %d slabs sent while slab 0 is lent (%d fit in a lap)\n", atomic_load(&s.sj.sent), fit);
        assert_int_equal(atomic_load(&s.sj.sent), fit);
    }
    check_slab(&first.u.slab, &s.what, 0);
    kvb_wire_loan_return(&held);
    recv_rest(&s, fit, &buf);
    stream_end(&s);
    assert_true(kvb_conn_usable(s.dc));
    kvb_conn_close(s.dc);
    free(buf.data);
    free(held_buf.data);
    kvb_listener_close(l);
}

/* Loans outlive the peer and the connection: two slabs lent, the peer shuts down, the next
 * receive is KVB_ERR_PEER_GONE; both views are still as sent, one is returned before the
 * connection is closed and one after (the ring goes with the last; ASan watches). A receive that
 * times out leaves its connection's loans as valid. */
static void test_loans_outlive_peer_and_close(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    lent_stream s;
    stream_start(&s, l, 256 << 10, 2, false, true);
    kvb_wire_buf buf[2] = {{0}, {0}};
    kvb_wire_loan loan[2];
    kvb_msg m[2], after;
    for (int i = 0; i < 2; i++) m[i] = recv_lent(s.dc, &s.what, i, &buf[i], &loan[i]);
    kvb_err e = {0};
    assert_int_equal(kvb_conn_recv(s.dc, IO_TIMEOUT_MS, &after, &e), KVB_ERR_PEER_GONE);
    print_message("    %s\n", e.msg);
    check_slab(&m[0].u.slab, &s.what, 0);
    kvb_wire_loan_return(&loan[0]);
    kvb_conn_close(s.dc);
    check_slab(&m[1].u.slab, &s.what, 1);
    kvb_wire_loan_return(&loan[1]);
    kvb_wire_loan_return(&loan[1]); /* emptied: a second return does nothing */
    stream_end(&s);

    stream_start(&s, l, 256 << 10, 1, false, false);
    m[0] = recv_lent(s.dc, &s.what, 0, &buf[0], &loan[0]);
    assert_int_equal(kvb_conn_recv(s.dc, 300, &after, &e), KVB_ERR_TIMEOUT);
    check_slab(&m[0].u.slab, &s.what, 0);
    kvb_wire_loan_return(&loan[0]);
    kvb_conn_close(s.dc);
    stream_end(&s);
    free(buf[0].data);
    free(buf[1].data);
    kvb_listener_close(l);
}

/* A lent slab whose K no longer matches its checksum (changed after the checksum was taken; the
 * frame's hash covers only the head) arrives, and the consumer's check refuses it on the view;
 * returned, the ring's room goes back and the slabs after it (laps of the ring) arrive intact. */
static void test_lent_slab_checksum_refused(void **state) {
    (void)state;
    kvb_listener *l = listen_ucx();
    lent_stream s;
    stream_start(&s, l, 256 << 10, 200, true, false);
    kvb_wire_buf buf = {0};
    kvb_wire_loan loan;
    kvb_msg m;
    kvb_err e = {0};
    if (kvb_conn_recv_lend(s.dc, IO_TIMEOUT_MS, &buf, &loan, &m, &e)) fail_msg("slab 0: %s", e.msg);
    assert_int_equal(m.type, KVB_FRAME_SLAB);
    assert_true(ring_in_use() ? loan.data != NULL : loan.data == NULL);
    const kvb_msg_slab sent = slab_of(&s.what, 0);
    assert_memory_equal(m.u.slab.k, sent.k, sent.k_bytes); /* the bytes as sent, */
    assert_int_not_equal(XXH3_64bits(m.u.slab.k, m.u.slab.k_bytes) ^ XXH3_64bits(m.u.slab.v, m.u.slab.v_bytes),
                         m.u.slab.checksum); /* which do not match the checksum it carries */
    kvb_wire_loan_return(&loan);
    recv_rest(&s, 1, &buf);
    stream_end(&s);
    assert_true(kvb_conn_usable(s.dc));
    kvb_conn_close(s.dc);
    free(buf.data);
    kvb_listener_close(l);
}

int main(void) {
    const char *child_port = getenv("KVB_UCX_CHILD_PORT");
    if (child_port) return child_main(child_port);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handshake_and_stream),
        cmocka_unit_test(test_ring_laps),
        cmocka_unit_test(test_slab_before_handshake_refused),
        cmocka_unit_test(test_wrong_key_refused_both_sides),
        cmocka_unit_test(test_corrupt_payload_is_checksum_error),
        cmocka_unit_test(test_large_payload_length_lies),
        cmocka_unit_test(test_silent_peer_times_out),
        cmocka_unit_test(test_shutdown_wakes_blocked_receive),
        cmocka_unit_test(test_shutdown_tells_open_peer),
        cmocka_unit_test(test_peer_killed_mid_frame),
        cmocka_unit_test(test_peer_killed_between_frames),
        cmocka_unit_test(test_lent_slot_never_reused),
        cmocka_unit_test(test_loans_outlive_peer_and_close),
        cmocka_unit_test(test_lent_slab_checksum_refused),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
