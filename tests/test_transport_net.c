/* tests/test_transport_net.c — the transport over loopback (127.0.0.1, ephemeral ports, every wait
 * bounded): a handshake with the same key yields usable connections that carry PREFILL, SLABs
 * (bytes intact), DONE, ERROR, PING/PONG in both directions with matching counters; a wrong key is
 * refused on BOTH sides with messages that say so; an impostor that cannot prove the key is refused
 * by the connecting side; model, format, role and bridge-mode mismatches are refused with messages
 * naming what differs; an attacker that skips authentication (SLAB first, SLAB instead of AUTH, a
 * bad proof followed by a SLAB) gets an ERROR and no connection, so nothing is delivered; hostile
 * frames from an authenticated peer (oversize length, corrupt payload, a frame type the role may not
 * receive, an inconsistent SLAB) fail the receive, count, and leave the connection unusable; a
 * silent peer turns into a timeout within the deadline (handshake and after it), a peer that stops
 * reading makes a large send time out, and a shutdown from another thread wakes a blocked receive.
 * The raw peers here implement the handshake transcript independently from the header's spec. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <xxhash.h>

#include "kvb_quant.h"
#include "kvb_transport.h"

#define IO_TIMEOUT_MS 5000
static const uint8_t PSK[32] = "0123456789abcdef0123456789abcdef";
static const uint8_t OTHER_PSK[32] = "0123456789abcdef0123456789abcdeX";
static const uint64_t MODEL_FP = 0x6d6f64656c2d6670ULL;

static kvb_kvformat make_format(uint32_t block_tokens, uint32_t dtype) {
    kvb_kvformat f;
    kvb_err e = {0};
    assert_int_equal(kvb_kvformat_init(&f, dtype, block_tokens, 4, 2, 64, &e), KVB_OK);
    return f;
}

static kvb_hello make_hello(kvb_wire_role role, const char *name, uint64_t model_fp, uint32_t block_tokens,
                            uint32_t dtype) {
    kvb_hello h;
    kvb_err e = {0};
    kvb_kvformat f = make_format(block_tokens, dtype);
    if (kvb_hello_init(&h, role, KVB_BRIDGE_MODE_DECODER, name, model_fp, &f, &e)) fail_msg("hello: %s", e.msg);
    return h;
}

static kvb_transport_config make_config(const uint8_t *psk) {
    kvb_transport_config c = {.psk = psk, .psk_len = 32};
    return c;
}

static kvb_listener *listen_loopback(void) {
    kvb_listener *l = NULL;
    kvb_err e = {0};
    if (kvb_transport_listen("127.0.0.1:0", NULL, &l, &e)) fail_msg("listen: %s", e.msg);
    assert_int_not_equal(kvb_listener_port(l), 0);
    return l;
}

static void loopback_addr(char *buf, size_t cap, uint16_t port) { snprintf(buf, cap, "127.0.0.1:%u", port); }

/* ---- an accept running on its own thread ------------------------------------------------------- */

typedef struct {
    kvb_listener *l;
    kvb_hello mine;
    kvb_transport_config cfg;
    int timeout_ms;
    kvb_conn *conn;
    kvb_hello peer;
    kvb_status st;
    kvb_err err;
    pthread_t thread;
} accept_job;

static void *accept_main(void *arg) {
    accept_job *j = arg;
    j->st = kvb_transport_accept(j->l, &j->mine, &j->cfg, j->timeout_ms, &j->conn, &j->peer, &j->err);
    return NULL;
}

static void accept_start(accept_job *j) { assert_int_equal(pthread_create(&j->thread, NULL, accept_main, j), 0); }
static void accept_join(accept_job *j) { pthread_join(j->thread, NULL); }

/* An authenticated pair: decode connects, prefill accepts. */
static void connect_pair(kvb_listener *l, kvb_conn **decode, kvb_conn **prefill) {
    accept_job j = {.l = l, .mine = make_hello(KVB_ROLE_PREFILL, "prefill-a", MODEL_FP, 16, KVB_TYPE_F16),
                    .cfg = make_config(PSK), .timeout_ms = IO_TIMEOUT_MS};
    accept_start(&j);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16);
    kvb_transport_config cfg = make_config(PSK);
    char addr[64];
    loopback_addr(addr, sizeof addr, kvb_listener_port(l));
    kvb_err e = {0};
    kvb_status st = kvb_transport_connect(addr, &me, &cfg, IO_TIMEOUT_MS, decode, NULL, &e);
    accept_join(&j);
    if (st) fail_msg("connect: %s", e.msg);
    if (j.st) fail_msg("accept: %s", j.err.msg);
    *prefill = j.conn;
}

/* ---- raw peers: plain sockets speaking the wire format by hand ---------------------------------- */

static int raw_connect(uint16_t port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static int raw_listen(uint16_t *port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 4), 0);
    socklen_t sl = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &sl);
    *port = ntohs(a.sin_port);
    return fd;
}

static int write_all(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w <= 0) return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n) {
    uint8_t *b = p;
    while (n) {
        ssize_t r = recv(fd, b, n, 0);
        if (r <= 0) return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

static void raw_send(int fd, uint16_t type, uint64_t req, const void *payload, size_t n) {
    uint8_t *buf = malloc(KVB_WIRE_HEADER_BYTES + n);
    size_t w;
    kvb_err e = {0};
    kvb_iov iov = {payload, n};
    assert_int_equal(kvb_wire_frame_encode(type, req, &iov, 1, buf, KVB_WIRE_HEADER_BYTES + n, &w, &e), KVB_OK);
    assert_int_equal(write_all(fd, buf, w), 0);
    free(buf);
}

/* Reads one frame; returns its type (payload into buf, *n bytes) or -1. */
static int raw_recv(int fd, uint8_t *buf, size_t cap, size_t *n, kvb_frame_header *hdr) {
    uint8_t h[KVB_WIRE_HEADER_BYTES];
    if (read_all(fd, h, sizeof h)) return -1;
    kvb_err e = {0};
    if (kvb_wire_header_decode(h, cap, hdr, &e)) fail_msg("raw peer: %s", e.msg);
    if (read_all(fd, buf, (size_t)hdr->payload_len)) return -1;
    *n = (size_t)hdr->payload_len;
    assert_int_equal(XXH3_64bits(buf, *n), hdr->payload_hash);
    return hdr->type;
}

/* The key proof, built from the spec in kvb_transport.h (independently of handshake.c). */
static void spec_proof(const uint8_t *psk, size_t psk_len, char dir, const uint8_t *hc, size_t hc_len,
                       const uint8_t *hs, size_t hs_len, uint8_t mac[32]) {
    uint8_t t[1024];
    size_t n = 0;
    memcpy(t, "kvbridge-auth-v1", 16);
    n = 16;
    t[n++] = (uint8_t)dir;
    memcpy(t + n, hc + 44, 32); /* the nonce sits at offset 44 of a HELLO payload */
    n += 32;
    memcpy(t + n, hs + 44, 32);
    n += 32;
    for (int i = 0; i < 8; i++) t[n++] = (uint8_t)((uint64_t)hc_len >> (8 * i));
    memcpy(t + n, hc, hc_len);
    n += hc_len;
    for (int i = 0; i < 8; i++) t[n++] = (uint8_t)((uint64_t)hs_len >> (8 * i));
    memcpy(t + n, hs, hs_len);
    n += hs_len;
    unsigned int ml = 0;
    assert_non_null(HMAC(EVP_sha256(), psk, (int)psk_len, t, n, mac, &ml));
    assert_int_equal(ml, 32);
}

static size_t encode_hello(kvb_hello *h, uint8_t *buf, uint8_t nonce_seed) {
    for (int i = 0; i < 32; i++) h->nonce[i] = (uint8_t)(nonce_seed + 13 * i);
    size_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_msg_hello_encode(h, buf, 256, &n, &e), KVB_OK);
    return n;
}

/* A raw connecting peer that completes the handshake with the right key (verifying the server's
 * proof against the spec), then is free to send anything. Returns the socket. */
static int raw_authenticated_client(uint16_t port, kvb_wire_role role) {
    int fd = raw_connect(port);
    kvb_hello me = make_hello(role, "raw-peer", MODEL_FP, 16, KVB_TYPE_F16);
    uint8_t hc[256], hs[256], buf[256];
    size_t hc_len = encode_hello(&me, hc, 3), hs_len, n;
    kvb_frame_header h;
    raw_send(fd, KVB_FRAME_HELLO, 0, hc, hc_len);
    assert_int_equal(raw_recv(fd, hs, sizeof hs, &hs_len, &h), KVB_FRAME_HELLO);
    uint8_t mac[32], expect[32];
    spec_proof(PSK, 32, 'C', hc, hc_len, hs, hs_len, mac);
    raw_send(fd, KVB_FRAME_AUTH, 0, mac, 32);
    int t = raw_recv(fd, buf, sizeof buf, &n, &h);
    if (t == KVB_FRAME_ERROR) fail_msg("raw peer refused: %.*s", (int)(n - 8), buf + 8);
    assert_int_equal(t, KVB_FRAME_AUTH_OK);
    spec_proof(PSK, 32, 'S', hc, hc_len, hs, hs_len, expect);
    assert_int_equal(n, 32);
    assert_memory_equal(buf, expect, 32); /* the server's proof follows the spec too */
    return fd;
}

/* ---- tests ---------------------------------------------------------------------------------------- */

static void test_handshake_and_stream(void **state) {
    (void)state;
    kvb_listener *l = listen_loopback();
    accept_job j = {.l = l, .mine = make_hello(KVB_ROLE_PREFILL, "prefill-a", MODEL_FP, 16, KVB_TYPE_F16),
                    .cfg = make_config(PSK), .timeout_ms = IO_TIMEOUT_MS};
    accept_start(&j);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16), peer;
    kvb_transport_config cfg = make_config(PSK);
    char addr[64];
    loopback_addr(addr, sizeof addr, kvb_listener_port(l));
    kvb_conn *dc = NULL;
    kvb_err e = {0};
    kvb_status st = kvb_transport_connect(addr, &me, &cfg, IO_TIMEOUT_MS, &dc, &peer, &e);
    accept_join(&j);
    if (st) fail_msg("connect: %s", e.msg);
    if (j.st) fail_msg("accept: %s", j.err.msg);
    kvb_conn *pc = j.conn;
    assert_string_equal(peer.name, "prefill-a");
    assert_int_equal(peer.role, KVB_ROLE_PREFILL);
    assert_string_equal(j.peer.name, "decoder-a");
    assert_string_equal(kvb_conn_peer_hello(pc)->name, "decoder-a");
    assert_true(strncmp(kvb_conn_peer_addr(pc), "127.0.0.1:", 10) == 0);
    assert_memory_not_equal(peer.nonce, j.peer.nonce, KVB_WIRE_NONCE_BYTES);

    /* decode -> prefill: PREFILL */
    int32_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = 1000 + i;
    kvb_msg_prefill req = {.request_id = 7, .bridge_mode = KVB_BRIDGE_MODE_DECODER, .n_tokens = 64,
                           .cached_tokens = 16, .ship_tokens = 48, .last_cached_key = 0x99, .tokens = tokens};
    assert_int_equal(kvb_conn_send_prefill(dc, &req, IO_TIMEOUT_MS, &e), KVB_OK);
    kvb_msg m;
    if (kvb_conn_recv(pc, IO_TIMEOUT_MS, &m, &e)) fail_msg("prefill recv: %s", e.msg);
    assert_int_equal(m.type, KVB_FRAME_PREFILL);
    assert_int_equal(m.request_id, 7);
    assert_int_equal(m.u.prefill.ship_tokens, 48);
    assert_memory_equal(m.u.prefill.tokens, tokens, sizeof tokens);
    kvb_msg_free(&m);

    /* prefill -> decode: 2 blocks x 4 layers of slabs, then DONE */
    enum { NS = 8, KB = 16 * 2 * 64 * 2 };
    static uint8_t kbuf[NS][KB], vbuf[NS][KB];
    for (int s = 0; s < NS; s++)
        for (int i = 0; i < KB; i++) {
            kbuf[s][i] = (uint8_t)(s * 31 + i);
            vbuf[s][i] = (uint8_t)(s * 17 + i * 3);
        }
    for (int s = 0; s < NS; s++) {
        kvb_msg_slab sl = {.layer = (uint32_t)(s % 4), .pos0 = 16 + 16 * (uint32_t)(s / 4), .n = 16, .k = kbuf[s],
                           .v = vbuf[s], .k_bytes = KB, .v_bytes = KB};
        sl.checksum = XXH3_64bits(kbuf[s], KB) ^ (uint64_t)s;
        if (kvb_conn_send_slab(pc, 7, &sl, IO_TIMEOUT_MS, &e)) fail_msg("send slab: %s", e.msg);
    }
    uint64_t keys[2] = {0x1111, 0x2222};
    kvb_msg_done done = {.tokens_covered = 48, .blocks = 2, .slabs = NS,
                         .chain_digest = kvb_wire_chain_digest(keys, 2), .prefill_seconds = 0.5};
    assert_int_equal(kvb_conn_send_done(pc, 7, &done, IO_TIMEOUT_MS, &e), KVB_OK);
    for (int s = 0; s < NS; s++) {
        if (kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e)) fail_msg("slab recv: %s", e.msg);
        assert_int_equal(m.type, KVB_FRAME_SLAB);
        assert_int_equal(m.request_id, 7);
        assert_int_equal(m.u.slab.layer, (uint32_t)(s % 4));
        assert_int_equal(m.u.slab.pos0, 16 + 16 * (uint32_t)(s / 4));
        assert_int_equal(m.u.slab.k_bytes, KB);
        assert_memory_equal(m.u.slab.k, kbuf[s], KB);
        assert_memory_equal(m.u.slab.v, vbuf[s], KB);
        assert_int_equal(m.u.slab.checksum, XXH3_64bits(kbuf[s], KB) ^ (uint64_t)s);
    }
    assert_int_equal(kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_DONE);
    assert_int_equal(m.u.done.slabs, NS);
    assert_int_equal(m.u.done.chain_digest, kvb_wire_chain_digest(keys, 2));

    /* health, request errors and cancel */
    assert_int_equal(kvb_conn_send_ping(dc, 99, IO_TIMEOUT_MS, &e), KVB_OK);
    assert_int_equal(kvb_conn_recv(pc, IO_TIMEOUT_MS, &m, &e), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_PING);
    assert_int_equal(kvb_conn_send_pong(pc, m.u.ping.token, IO_TIMEOUT_MS, &e), KVB_OK);
    assert_int_equal(kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_PONG);
    assert_int_equal(m.u.ping.token, 99);
    assert_int_equal(kvb_conn_send_cancel(dc, 8, IO_TIMEOUT_MS, &e), KVB_OK);
    assert_int_equal(kvb_conn_recv(pc, IO_TIMEOUT_MS, &m, &e), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_CANCEL);
    assert_int_equal(m.u.cancel.request_id, 8);
    assert_int_equal(kvb_conn_send_error(pc, 8, KVB_WIRE_ERR_CANCELLED, "cancelled by the decoder", IO_TIMEOUT_MS, &e),
                     KVB_OK);
    assert_int_equal(kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_ERROR);
    assert_int_equal(m.u.error.code, KVB_WIRE_ERR_CANCELLED);
    assert_string_equal(m.u.error.msg, "cancelled by the decoder");

    /* roles: a decode node never sends SLABs, a prefill node never sends PREFILL (refused locally,
     * the connection stays usable) */
    kvb_msg_slab sl = {.n = 1, .k = kbuf[0], .v = vbuf[0], .k_bytes = 4, .v_bytes = 4};
    assert_int_equal(kvb_conn_send_slab(dc, 1, &sl, IO_TIMEOUT_MS, &e), KVB_ERR_INVALID);
    assert_true(strstr(e.msg, "decode node does not send SLAB") != NULL);
    assert_int_equal(kvb_conn_send_prefill(pc, &req, IO_TIMEOUT_MS, &e), KVB_ERR_INVALID);
    assert_true(kvb_conn_usable(dc) && kvb_conn_usable(pc));

    kvb_conn_stats ds, ps;
    kvb_conn_get_stats(dc, &ds);
    kvb_conn_get_stats(pc, &ps);
    assert_int_equal(ds.bytes_sent, ps.bytes_received);
    assert_int_equal(ps.bytes_sent, ds.bytes_received);
    assert_int_equal(ds.frames_sent, ps.frames_received);
    assert_int_equal(ps.frames_sent, ds.frames_received);
    assert_int_equal(ds.frames_sent, 2 + 3); /* HELLO, AUTH + PREFILL, PING, CANCEL */
    assert_int_equal(ps.frames_sent, 2 + NS + 3); /* HELLO, AUTH_OK + slabs, DONE, PONG, ERROR */
    assert_true(ps.bytes_sent > (uint64_t)NS * 2 * KB);
    assert_int_equal(ds.checksum_failures + ds.protocol_errors + ds.timeouts, 0);

    /* the peer closing is a clean error on the other side */
    kvb_conn_close(pc);
    assert_int_equal(kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e), KVB_ERR_PEER_GONE);
    assert_int_equal(e.code, KVB_ERR_PEER_GONE);
    assert_true(strstr(e.msg, "closed the connection") != NULL);
    assert_false(kvb_conn_usable(dc));
    /* a later call fails fast with the first failure's code */
    assert_int_equal(kvb_conn_send_ping(dc, 7, IO_TIMEOUT_MS, &e), KVB_ERR_PEER_GONE);
    assert_true(strstr(e.msg, "unusable after an earlier failure") != NULL);
    kvb_conn_close(dc);
    kvb_listener_stats ls;
    kvb_listener_get_stats(l, &ls);
    assert_int_equal(ls.accepted, 1);
    kvb_listener_close(l);
}

/* Runs one handshake with the given hellos and keys; both sides must fail. */
static void expect_refusal(kvb_hello server, const uint8_t *server_psk, kvb_hello client, const uint8_t *client_psk,
                           kvb_status want_st, const char *server_needle, const char *client_needle) {
    kvb_listener *l = listen_loopback();
    accept_job j = {.l = l, .mine = server, .cfg = make_config(server_psk), .timeout_ms = IO_TIMEOUT_MS};
    accept_start(&j);
    kvb_transport_config cfg = make_config(client_psk);
    char addr[64];
    loopback_addr(addr, sizeof addr, kvb_listener_port(l));
    kvb_conn *c = (kvb_conn *)0x1;
    kvb_err e = {0};
    kvb_status st = kvb_transport_connect(addr, &client, &cfg, IO_TIMEOUT_MS, &c, NULL, &e);
    accept_join(&j);
    print_message("    accepting side: %s\n    connecting side: %s\n", j.err.msg, e.msg);
    assert_null(c);
    assert_null(j.conn);
    assert_int_equal(st, want_st);
    assert_int_equal(j.st, want_st);
    if (!strstr(j.err.msg, server_needle)) fail_msg("accepting side's message lacks \"%s\": %s", server_needle, j.err.msg);
    if (!strstr(e.msg, client_needle)) fail_msg("connecting side's message lacks \"%s\": %s", client_needle, e.msg);
    /* the listener counted the refusal under its reason, and nothing else */
    kvb_listener_stats ls;
    kvb_listener_get_stats(l, &ls);
    assert_int_equal(ls.accepted, 0);
    for (int r = 0; r < KVB_HANDSHAKE_REASONS; r++)
        assert_int_equal(ls.failed[r], r == (int)kvb_handshake_reason_of(want_st) ? 1 : 0);
    kvb_listener_close(l);
}

static void test_wrong_key_refused_both_sides(void **state) {
    (void)state;
    kvb_hello s = make_hello(KVB_ROLE_PREFILL, "prefill-a", MODEL_FP, 16, KVB_TYPE_F16);
    kvb_hello c = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16);
    expect_refusal(s, PSK, c, OTHER_PSK, KVB_ERR_AUTH, "authentication failed", "authentication failed");
    expect_refusal(s, OTHER_PSK, c, PSK, KVB_ERR_AUTH, "different keys", "refused the connection: [auth]");
}

static void test_mismatches_refused_with_reason(void **state) {
    (void)state;
    kvb_hello s = make_hello(KVB_ROLE_PREFILL, "prefill-a", MODEL_FP, 16, KVB_TYPE_F16);
    kvb_hello c = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP + 1, 16, KVB_TYPE_F16);
    expect_refusal(s, PSK, c, PSK, KVB_ERR_MISMATCH, "model fingerprint differs", "[model] model fingerprint differs");
    c = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 32, KVB_TYPE_F16);
    expect_refusal(s, PSK, c, PSK, KVB_ERR_MISMATCH, "cache format differs: block_tokens 16 vs 32",
                   "[format] cache format differs: block_tokens 16 vs 32");
    c = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_Q8_0);
    expect_refusal(s, PSK, c, PSK, KVB_ERR_MISMATCH, "cache format differs: dtype F16 vs Q8_0", "uses q8_0/16tok");
    c = make_hello(KVB_ROLE_PREFILL, "prefill-b", MODEL_FP, 16, KVB_TYPE_F16);
    expect_refusal(s, PSK, c, PSK, KVB_ERR_MISMATCH, "both nodes are prefill nodes", "[role]");
    c = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16);
    c.bridge_mode = KVB_BRIDGE_MODE_PREFILL;
    expect_refusal(s, PSK, c, PSK, KVB_ERR_MISMATCH, "bridge mode differs", "[mode]");
}

static bool refuse_all(void *ctx, const kvb_hello *mine, const kvb_hello *peer, uint32_t *code, char *why, size_t cap) {
    (void)mine;
    (void)peer;
    (*(int *)ctx)++;
    *code = KVB_WIRE_ERR_INCOMPATIBLE;
    snprintf(why, cap, "rope scaling differs (custom check)");
    return false;
}

static void test_custom_check(void **state) {
    (void)state;
    int calls = 0;
    kvb_listener *l = listen_loopback();
    accept_job j = {.l = l, .mine = make_hello(KVB_ROLE_PREFILL, "prefill-a", MODEL_FP, 16, KVB_TYPE_F16),
                    .cfg = make_config(PSK), .timeout_ms = IO_TIMEOUT_MS};
    j.cfg.check = refuse_all;
    j.cfg.check_ctx = &calls;
    accept_start(&j);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16);
    kvb_transport_config cfg = make_config(PSK);
    char addr[64];
    loopback_addr(addr, sizeof addr, kvb_listener_port(l));
    kvb_conn *c = NULL;
    kvb_err e = {0};
    assert_int_equal(kvb_transport_connect(addr, &me, &cfg, IO_TIMEOUT_MS, &c, NULL, &e), KVB_ERR_MISMATCH);
    accept_join(&j);
    assert_int_equal(j.st, KVB_ERR_MISMATCH);
    assert_int_equal(calls, 1);
    assert_true(strstr(e.msg, "[incompatible] rope scaling differs") != NULL);
    assert_true(strstr(j.err.msg, "rope scaling differs") != NULL);
    kvb_listener_close(l);
}

/* An impostor server that does not hold the key: the connecting side refuses it and tells it why. */
typedef struct {
    int lfd;
    int got_error_code;
} impostor_job;

static void *impostor_main(void *arg) {
    impostor_job *j = arg;
    int fd = accept(j->lfd, NULL, NULL);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t buf[2048], hs[256];
    size_t n;
    kvb_frame_header h;
    j->got_error_code = -1;
    if (raw_recv(fd, buf, sizeof buf, &n, &h) != KVB_FRAME_HELLO) goto out;
    kvb_hello me = make_hello(KVB_ROLE_PREFILL, "impostor", MODEL_FP, 16, KVB_TYPE_F16);
    size_t hs_len = encode_hello(&me, hs, 77);
    raw_send(fd, KVB_FRAME_HELLO, 0, hs, hs_len);
    if (raw_recv(fd, buf, sizeof buf, &n, &h) != KVB_FRAME_AUTH) goto out;
    uint8_t fake[32];
    memset(fake, 0x42, sizeof fake);
    raw_send(fd, KVB_FRAME_AUTH_OK, 0, fake, 32);
    if (raw_recv(fd, buf, sizeof buf, &n, &h) == KVB_FRAME_ERROR) {
        kvb_msg_error em;
        kvb_err e = {0};
        if (kvb_msg_error_decode(buf, n, &em, &e) == KVB_OK) j->got_error_code = (int)em.code;
    }
out:
    close(fd);
    return NULL;
}

static void test_impostor_server_refused(void **state) {
    (void)state;
    uint16_t port;
    impostor_job j = {.lfd = raw_listen(&port)};
    pthread_t t;
    pthread_create(&t, NULL, impostor_main, &j);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16);
    kvb_transport_config cfg = make_config(PSK);
    char addr[64];
    loopback_addr(addr, sizeof addr, port);
    kvb_conn *c = NULL;
    kvb_err e = {0};
    assert_int_equal(kvb_transport_connect(addr, &me, &cfg, IO_TIMEOUT_MS, &c, NULL, &e), KVB_ERR_AUTH);
    pthread_join(t, NULL);
    close(j.lfd);
    print_message("    %s\n", e.msg);
    assert_null(c);
    assert_true(strstr(e.msg, "node 'impostor' could not prove") != NULL);
    assert_int_equal(j.got_error_code, KVB_WIRE_ERR_AUTH);
}

/* The decode node accepts; an attacker connects and tries to deliver a SLAB without the key. */
static void attack(int variant) {
    kvb_listener *l = listen_loopback();
    accept_job j = {.l = l, .mine = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16),
                    .cfg = make_config(PSK), .timeout_ms = IO_TIMEOUT_MS};
    accept_start(&j);
    int fd = raw_connect(kvb_listener_port(l));
    uint8_t slab[KVB_SLAB_HEAD_BYTES + 8];
    kvb_msg_slab s = {.layer = 0, .pos0 = 0, .n = 1, .k_bytes = 4, .v_bytes = 4};
    kvb_msg_slab_encode_head(&s, slab);
    memset(slab + KVB_SLAB_HEAD_BYTES, 0xee, 8);
    uint8_t buf[2048], hc[256];
    size_t n;
    kvb_frame_header h;
    int expect_error = 1;
    if (variant == 0) {
        raw_send(fd, KVB_FRAME_SLAB, 1, slab, sizeof slab); /* no handshake at all */
    } else {
        kvb_hello me = make_hello(KVB_ROLE_PREFILL, "attacker", MODEL_FP, 16, KVB_TYPE_F16);
        size_t hc_len = encode_hello(&me, hc, 9);
        raw_send(fd, KVB_FRAME_HELLO, 0, hc, hc_len);
        assert_int_equal(raw_recv(fd, buf, sizeof buf, &n, &h), KVB_FRAME_HELLO);
        if (variant == 1) {
            raw_send(fd, KVB_FRAME_SLAB, 1, slab, sizeof slab); /* SLAB instead of AUTH */
        } else {
            uint8_t guess[32] = {0};
            raw_send(fd, KVB_FRAME_AUTH, 0, guess, 32); /* a bad proof, then a SLAB right behind it */
            raw_send(fd, KVB_FRAME_SLAB, 1, slab, sizeof slab);
            expect_error = 0; /* the refusal may be lost to a reset: unread bytes were pending */
        }
    }
    int t = raw_recv(fd, buf, sizeof buf, &n, &h);
    accept_join(&j);
    print_message("    variant %d: %s\n", variant, j.err.msg);
    assert_int_not_equal(j.st, KVB_OK);
    assert_null(j.conn); /* no connection: nothing can be received from it */
    if (variant == 2) {
        assert_int_equal(j.st, KVB_ERR_AUTH);
        assert_true(strstr(j.err.msg, "authentication failed") != NULL);
    } else {
        assert_int_equal(j.st, KVB_ERR_FORMAT);
        assert_true(strstr(j.err.msg, variant == 0 ? "expected HELLO, got SLAB" : "expected AUTH, got SLAB") != NULL);
    }
    if (expect_error) {
        assert_int_equal(t, KVB_FRAME_ERROR);
        kvb_msg_error em;
        kvb_err e = {0};
        assert_int_equal(kvb_msg_error_decode(buf, n, &em, &e), KVB_OK);
        assert_int_equal(em.code, KVB_WIRE_ERR_PROTOCOL);
        assert_true(strstr(em.msg, "got SLAB") != NULL);
    }
    close(fd);
    kvb_listener_close(l);
}

static void test_attacker_skipping_auth_gets_nothing_delivered(void **state) {
    (void)state;
    for (int v = 0; v < 3; v++) attack(v);
}

/* An authenticated raw prefill peer sends one hostile thing; the decode side's receive must fail. */
static void hostile_after_auth(int variant, kvb_status want, const char *needle) {
    kvb_listener *l = listen_loopback();
    accept_job j = {.l = l, .mine = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16),
                    .cfg = make_config(PSK), .timeout_ms = IO_TIMEOUT_MS};
    j.cfg.max_payload = 1 << 20;
    accept_start(&j);
    int fd = raw_authenticated_client(kvb_listener_port(l), KVB_ROLE_PREFILL);
    accept_join(&j);
    if (j.st) fail_msg("accept: %s", j.err.msg);
    kvb_conn *dc = j.conn;

    uint8_t slab[KVB_SLAB_HEAD_BYTES + 8];
    kvb_msg_slab s = {.layer = 1, .pos0 = 16, .n = 1, .k_bytes = 4, .v_bytes = 4};
    kvb_msg_slab_encode_head(&s, slab);
    memset(slab + KVB_SLAB_HEAD_BYTES, 0x5a, 8);
    raw_send(fd, KVB_FRAME_SLAB, 3, slab, sizeof slab); /* one good slab first */
    if (variant == 0) {
        /* a 1 TiB payload announced: refused from the header, nothing is allocated or awaited */
        kvb_frame_header h = {.type = KVB_FRAME_SLAB, .request_id = 3, .payload_len = 1ULL << 40};
        uint8_t hdr[KVB_WIRE_HEADER_BYTES];
        kvb_wire_header_encode(&h, hdr);
        write_all(fd, hdr, sizeof hdr);
    } else if (variant == 1) {
        uint8_t frame[KVB_WIRE_HEADER_BYTES + sizeof slab];
        size_t w;
        kvb_iov iov = {slab, sizeof slab};
        kvb_err e = {0};
        kvb_wire_frame_encode(KVB_FRAME_SLAB, 3, &iov, 1, frame, sizeof frame, &w, &e);
        /* flip a bit of the slab's head in transit (pos0): the frame hash covers the head; a K or V
         * bit is the slab checksum's to catch, in the store (test_store, test_node_loop) */
        frame[KVB_WIRE_HEADER_BYTES + 4] ^= 0x20;
        write_all(fd, frame, w);
    } else if (variant == 2) {
        int32_t tok[1] = {5};
        kvb_msg_prefill pf = {.request_id = 3, .bridge_mode = 1, .n_tokens = 1, .tokens = tok};
        uint8_t buf[64];
        size_t n;
        kvb_err e = {0};
        kvb_msg_prefill_encode(&pf, buf, sizeof buf, &n, &e);
        raw_send(fd, KVB_FRAME_PREFILL, 3, buf, n); /* a decode node never accepts PREFILL */
    } else if (variant == 3) {
        uint8_t bad[sizeof slab];
        memcpy(bad, slab, sizeof bad);
        bad[16] = 5; /* k_bytes 5 + v_bytes 4 != 8 */
        raw_send(fd, KVB_FRAME_SLAB, 3, bad, sizeof bad);
    } else if (variant == 4) {
        raw_send(fd, KVB_FRAME_HELLO, 0, slab, 8); /* handshake frames are over */
    } else {
        /* half a frame, then the peer is gone */
        uint8_t frame[KVB_WIRE_HEADER_BYTES + sizeof slab];
        size_t w;
        kvb_iov iov = {slab, sizeof slab};
        kvb_err e = {0};
        kvb_wire_frame_encode(KVB_FRAME_SLAB, 3, &iov, 1, frame, sizeof frame, &w, &e);
        write_all(fd, frame, w / 2);
        close(fd);
        fd = -1;
    }
    kvb_msg m;
    kvb_err e = {0};
    if (kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e)) fail_msg("the good slab: %s", e.msg);
    assert_int_equal(m.type, KVB_FRAME_SLAB);
    assert_int_equal(m.u.slab.pos0, 16);
    double t0 = kvb_now_s();
    kvb_status st = kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e);
    double dt = kvb_now_s() - t0;
    print_message("    variant %d: %s (%.3f s)\n", variant, e.msg, dt);
    assert_int_equal(st, want);
    if (!strstr(e.msg, needle)) fail_msg("message lacks \"%s\": %s", needle, e.msg);
    assert_true(dt < 1.0); /* refused at once, not after waiting for bytes that never come */
    assert_false(kvb_conn_usable(dc));
    kvb_conn_stats cs;
    kvb_conn_get_stats(dc, &cs);
    assert_int_equal(cs.checksum_failures, variant == 1 ? 1 : 0);
    assert_int_equal(cs.protocol_errors, (variant == 1 || variant == 5) ? 0 : 1);
    /* unusable afterwards, even if good bytes follow */
    if (fd >= 0) raw_send(fd, KVB_FRAME_SLAB, 3, slab, sizeof slab);
    assert_int_equal(kvb_conn_recv(dc, IO_TIMEOUT_MS, &m, &e), want); /* the first failure's code */
    assert_true(strstr(e.msg, "unusable") != NULL);
    if (fd >= 0) close(fd);
    kvb_conn_close(dc);
    kvb_listener_close(l);
}

static void test_hostile_frames_after_auth(void **state) {
    (void)state;
    hostile_after_auth(0, KVB_ERR_RANGE, "exceeds the limit of 1048576 bytes");
    hostile_after_auth(1, KVB_ERR_CHECKSUM, "SLAB payload from 127.0.0.1");
    hostile_after_auth(2, KVB_ERR_FORMAT, "unexpected PREFILL frame");
    hostile_after_auth(3, KVB_ERR_FORMAT, "k_bytes 5 + v_bytes 4");
    hostile_after_auth(4, KVB_ERR_FORMAT, "unexpected HELLO frame");
    hostile_after_auth(5, KVB_ERR_PEER_GONE, "closed the connection");
}

/* A listener that accepts and then never says anything. */
typedef struct {
    int lfd, fd;
} silent_job;
static void *silent_main(void *arg) {
    silent_job *j = arg;
    j->fd = accept(j->lfd, NULL, NULL);
    return NULL;
}

static void test_silent_peer_times_out(void **state) {
    (void)state;
    /* during the handshake */
    uint16_t port;
    silent_job sj = {.lfd = raw_listen(&port), .fd = -1};
    pthread_t t;
    pthread_create(&t, NULL, silent_main, &sj);
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16);
    kvb_transport_config cfg = make_config(PSK);
    char addr[64];
    loopback_addr(addr, sizeof addr, port);
    kvb_conn *c = NULL;
    kvb_err e = {0};
    double t0 = kvb_now_s();
    assert_int_equal(kvb_transport_connect(addr, &me, &cfg, 200, &c, NULL, &e), KVB_ERR_TIMEOUT);
    double dt = kvb_now_s() - t0;
    pthread_join(t, NULL);
    print_message("    handshake: %s after %.3f s\n", e.msg, dt);
    assert_true(strstr(e.msg, "timed out") != NULL);
    assert_true(dt >= 0.19 && dt < 1.0);
    assert_null(c);
    close(sj.fd);
    close(sj.lfd);

    /* nobody connects: accept times out */
    kvb_listener *l = listen_loopback();
    t0 = kvb_now_s();
    assert_int_equal(kvb_transport_accept(l, &me, &cfg, 200, &c, NULL, &e), KVB_ERR_TIMEOUT);
    dt = kvb_now_s() - t0;
    assert_true(strstr(e.msg, "timed out") != NULL);
    assert_true(dt >= 0.19 && dt < 1.0);
    kvb_listener_stats ls; /* nobody came: no handshake failed */
    kvb_listener_get_stats(l, &ls);
    assert_int_equal(ls.failed[KVB_HANDSHAKE_TIMEOUT], 0);

    /* after the handshake: the prefill node accepted and never sends */
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    kvb_msg m;
    t0 = kvb_now_s();
    assert_int_equal(kvb_conn_recv(dc, 200, &m, &e), KVB_ERR_TIMEOUT);
    dt = kvb_now_s() - t0;
    print_message("    stream: %s after %.3f s\n", e.msg, dt);
    assert_true(strstr(e.msg, "timed out") != NULL);
    assert_true(dt >= 0.19 && dt < 1.0);
    kvb_conn_stats cs;
    kvb_conn_get_stats(dc, &cs);
    assert_int_equal(cs.timeouts, 1);
    assert_false(kvb_conn_usable(dc));
    assert_int_equal(kvb_conn_send_ping(dc, 1, 200, &e), KVB_ERR_TIMEOUT);
    assert_true(strstr(e.msg, "unusable after an earlier failure") != NULL);
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

static void test_send_times_out_when_peer_stops_reading(void **state) {
    (void)state;
    kvb_listener *l = listen_loopback();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    size_t half = 4 << 20;
    uint8_t *kv = calloc(1, half);
    assert_non_null(kv);
    kvb_msg_slab s = {.layer = 0, .pos0 = 0, .n = 16, .k = kv, .v = kv, .k_bytes = half, .v_bytes = half};
    kvb_err e = {0};
    kvb_status st = KVB_OK;
    int sent = 0;
    double t0 = kvb_now_s();
    for (; sent < 64 && st == KVB_OK; sent++) st = kvb_conn_send_slab(pc, 1, &s, 200, &e);
    double dt = kvb_now_s() - t0;
    print_message("    %d sends of 8 MiB: %s after %.3f s\n", sent, e.msg, dt);
    assert_int_equal(st, KVB_ERR_TIMEOUT);
    assert_true(strstr(e.msg, "timed out") != NULL);
    assert_true(sent <= 8); /* a few socket buffers' worth, not unbounded */
    assert_true(dt < 3.0);
    kvb_conn_stats cs;
    kvb_conn_get_stats(pc, &cs);
    assert_int_equal(cs.timeouts, 1);
    assert_false(kvb_conn_usable(pc));
    free(kv);
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

typedef struct {
    kvb_conn *c;
    kvb_status st;
    kvb_err err;
    double seconds;
} recv_job;
static void *recv_main(void *arg) {
    recv_job *j = arg;
    kvb_msg m;
    double t0 = kvb_now_s();
    j->st = kvb_conn_recv(j->c, IO_TIMEOUT_MS, &m, &j->err);
    j->seconds = kvb_now_s() - t0;
    return NULL;
}

static void test_shutdown_wakes_blocked_receive(void **state) {
    (void)state;
    kvb_listener *l = listen_loopback();
    kvb_conn *dc, *pc;
    connect_pair(l, &dc, &pc);
    recv_job j = {.c = dc};
    pthread_t t;
    pthread_create(&t, NULL, recv_main, &j);
    usleep(100 * 1000);
    kvb_conn_shutdown(dc);
    pthread_join(t, NULL);
    print_message("    %s after %.3f s\n", j.err.msg, j.seconds);
    assert_int_equal(j.st, KVB_ERR_CANCELLED);
    assert_true(j.seconds < 2.0);
    assert_true(strstr(j.err.msg, "shut down by this node") != NULL);
    assert_false(kvb_conn_usable(dc));
    kvb_conn_close(dc);
    kvb_conn_close(pc);
    kvb_listener_close(l);
}

static void test_bad_arguments_and_refused_connect(void **state) {
    (void)state;
    kvb_hello me = make_hello(KVB_ROLE_DECODE, "decoder-a", MODEL_FP, 16, KVB_TYPE_F16);
    kvb_transport_config cfg = make_config(PSK);
    kvb_conn *c = NULL;
    kvb_err e = {0};
    /* nothing listens on a port we just released */
    uint16_t port;
    int fd = raw_listen(&port);
    close(fd);
    char addr[64];
    loopback_addr(addr, sizeof addr, port);
    double t0 = kvb_now_s();
    assert_int_equal(kvb_transport_connect(addr, &me, &cfg, IO_TIMEOUT_MS, &c, NULL, &e), KVB_ERR_PEER_GONE);
    assert_true(kvb_now_s() - t0 < 1.0);
    assert_true(strstr(e.msg, "refused") != NULL);
    const char *bad[] = {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:12a", "[::1:80"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) {
        assert_int_equal(kvb_transport_connect(bad[i], &me, &cfg, 100, &c, NULL, &e), KVB_ERR_INVALID);
        kvb_listener *l = NULL;
        assert_int_equal(kvb_transport_listen(bad[i], NULL, &l, &e), KVB_ERR_INVALID);
        assert_null(l);
    }
    cfg.psk_len = 8;
    assert_int_equal(kvb_transport_connect(addr, &me, &cfg, 100, &c, NULL, &e), KVB_ERR_INVALID);
    assert_true(strstr(e.msg, "pre-shared key has 8 bytes") != NULL);
    cfg.psk_len = 32;
    assert_int_equal(kvb_transport_connect(addr, &me, &cfg, 0, &c, NULL, &e), KVB_ERR_INVALID);
    cfg.max_payload = KVB_WIRE_MAX_PAYLOAD_LIMIT + 1;
    assert_int_equal(kvb_transport_connect(addr, &me, &cfg, 100, &c, NULL, &e), KVB_ERR_INVALID);
    assert_null(c);
    /* IPv6 loopback and the any-address form parse and listen (when the host has IPv6) */
    kvb_listener *l = NULL;
    assert_int_equal(kvb_transport_listen("*:0", NULL, &l, &e), KVB_OK);
    kvb_listener_close(l);
    if (kvb_transport_listen("[::1]:0", NULL, &l, &e) == KVB_OK) kvb_listener_close(l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handshake_and_stream),
        cmocka_unit_test(test_wrong_key_refused_both_sides),
        cmocka_unit_test(test_mismatches_refused_with_reason),
        cmocka_unit_test(test_custom_check),
        cmocka_unit_test(test_impostor_server_refused),
        cmocka_unit_test(test_attacker_skipping_auth_gets_nothing_delivered),
        cmocka_unit_test(test_hostile_frames_after_auth),
        cmocka_unit_test(test_silent_peer_times_out),
        cmocka_unit_test(test_send_times_out_when_peer_stops_reading),
        cmocka_unit_test(test_shutdown_wakes_blocked_receive),
        cmocka_unit_test(test_bad_arguments_and_refused_connect),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
