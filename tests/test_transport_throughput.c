/* tests/test_transport_throughput.c — transfer speed over loopback, printed, not asserted (issue 6
 * acceptance: transfer >= 85 % of the raw link measured the same way in the same run). Both legs
 * move the same bytes over 127.0.0.1 between two threads with the same socket options (TCP_NODELAY,
 * the same buffer sizes) and are timed the same way (sender start to the receiver's last byte):
 *   transport: 1 GiB as SLAB frames of 1 MiB of K+V each (kvb_conn_send_slab: header + head + K + V
 *              gathered without a copy, payload XXH3 on both ends; kvb_conn_recv: header checks,
 *              payload into the connection buffer, hash verified, SLAB decoded);
 *   raw:       the same bytes with plain send()/recv() of 1 MiB, no framing, no checksums.
 * Three alternating rounds; every round and the medians are printed with the ratio.
 * KVB_TRANSPORT_BENCH_MIB sets the volume (default 1024). The test fails only if a leg fails. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvb_quant.h"
#include "kvb_transport.h"

#define SLAB_KV_BYTES (1u << 20) /* K + V per frame */
#define ROUNDS 3
#define SOCKBUF (4 << 20)        /* what the TCP backend asks for */
static const uint8_t PSK[32] = "0123456789abcdef0123456789abcdef";

static uint64_t g_frames;
static uint8_t *g_kv;
static _Atomic double g_t0;

static double now(void) { return kvb_now_s(); }

/* ---- transport leg ---------------------------------------------------------------------------- */

typedef struct {
    kvb_conn *c;
    uint64_t bytes;
    double t_end;
    kvb_status st;
    kvb_err err;
} recv_leg;

static void *transport_receiver(void *arg) {
    recv_leg *r = arg;
    kvb_msg m;
    for (uint64_t i = 0; i < g_frames; i++) {
        r->st = kvb_conn_recv(r->c, 30000, &m, &r->err);
        if (r->st) return NULL;
        if (m.type != KVB_FRAME_SLAB) {
            r->st = KVB_ERR_INTERNAL;
            return NULL;
        }
        r->bytes += m.u.slab.k_bytes + m.u.slab.v_bytes;
    }
    r->t_end = now();
    return NULL;
}

typedef struct {
    kvb_listener *l;
    kvb_hello mine;
    kvb_transport_config cfg;
    kvb_conn *conn;
    kvb_status st;
    kvb_err err;
} accept_job;
static void *accept_main(void *arg) {
    accept_job *j = arg;
    j->st = kvb_transport_accept(j->l, &j->mine, &j->cfg, 10000, &j->conn, NULL, &j->err);
    return NULL;
}

static double run_transport(void) {
    kvb_kvformat fmt;
    kvb_err e = {0};
    assert_int_equal(kvb_kvformat_init(&fmt, KVB_TYPE_F16, 16, 4, 2, 64, &e), KVB_OK);
    kvb_listener *l = NULL;
    if (kvb_transport_listen("127.0.0.1:0", NULL, &l, &e)) fail_msg("%s", e.msg);
    accept_job j = {.l = l, .cfg = {.psk = PSK, .psk_len = 32}};
    assert_int_equal(kvb_hello_init(&j.mine, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, "decoder", 7, &fmt, &e), KVB_OK);
    pthread_t at;
    pthread_create(&at, NULL, accept_main, &j);
    kvb_hello me;
    assert_int_equal(kvb_hello_init(&me, KVB_ROLE_PREFILL, KVB_BRIDGE_MODE_DECODER, "prefill", 7, &fmt, &e), KVB_OK);
    kvb_transport_config cfg = {.psk = PSK, .psk_len = 32};
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", kvb_listener_port(l));
    kvb_conn *pc = NULL;
    if (kvb_transport_connect(addr, &me, &cfg, 10000, &pc, NULL, &e)) fail_msg("%s", e.msg);
    pthread_join(at, NULL);
    if (j.st) fail_msg("%s", j.err.msg);

    recv_leg r = {.c = j.conn};
    pthread_t rt;
    atomic_store(&g_t0, now());
    pthread_create(&rt, NULL, transport_receiver, &r);
    for (uint64_t i = 0; i < g_frames; i++) {
        kvb_msg_slab s = {.layer = (uint32_t)(i % 16), .pos0 = (uint32_t)(i / 16) * 16, .n = 16, .k = g_kv,
                          .v = g_kv + SLAB_KV_BYTES / 2, .k_bytes = SLAB_KV_BYTES / 2, .v_bytes = SLAB_KV_BYTES / 2,
                          .checksum = i};
        if (kvb_conn_send_slab(pc, 1, &s, 30000, &e)) fail_msg("send: %s", e.msg);
    }
    pthread_join(rt, NULL);
    if (r.st) fail_msg("receive: %s", r.err.msg);
    assert_int_equal(r.bytes, g_frames * SLAB_KV_BYTES);
    double secs = r.t_end - atomic_load(&g_t0);
    kvb_conn_close(pc);
    kvb_conn_close(j.conn);
    kvb_listener_close(l);
    return (double)g_frames * SLAB_KV_BYTES / secs / 1e9;
}

/* ---- raw leg ---------------------------------------------------------------------------------- */

static void tune(int fd) {
    int one = 1, b = SOCKBUF;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
}

typedef struct {
    int lfd;
    uint64_t bytes;
    double t_end;
    int ok;
} raw_recv_leg;

static void *raw_receiver(void *arg) {
    raw_recv_leg *r = arg;
    int fd = accept(r->lfd, NULL, NULL);
    if (fd < 0) return NULL;
    struct timeval tv = {.tv_sec = 30};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t *buf = malloc(SLAB_KV_BYTES);
    uint64_t want = g_frames * SLAB_KV_BYTES;
    while (r->bytes < want) {
        ssize_t n = recv(fd, buf, SLAB_KV_BYTES, 0);
        if (n <= 0) break;
        r->bytes += (uint64_t)n;
    }
    r->t_end = now();
    r->ok = r->bytes == want;
    free(buf);
    close(fd);
    return NULL;
}

static double run_raw(void) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    tune(lfd);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(lfd, 1), 0);
    socklen_t sl = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &sl);
    raw_recv_leg r = {.lfd = lfd};
    pthread_t rt;
    pthread_create(&rt, NULL, raw_receiver, &r);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    tune(fd);
    struct timeval tv = {.tv_sec = 30};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    atomic_store(&g_t0, now());
    for (uint64_t i = 0; i < g_frames; i++) {
        size_t off = 0;
        while (off < SLAB_KV_BYTES) {
            ssize_t w = send(fd, g_kv + off, SLAB_KV_BYTES - off, MSG_NOSIGNAL);
            if (w <= 0) fail_msg("raw send failed");
            off += (size_t)w;
        }
    }
    pthread_join(rt, NULL);
    close(fd);
    close(lfd);
    assert_true(r.ok);
    return (double)g_frames * SLAB_KV_BYTES / (r.t_end - atomic_load(&g_t0)) / 1e9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void test_loopback_throughput(void **state) {
    (void)state;
    const char *env = getenv("KVB_TRANSPORT_BENCH_MIB");
    uint64_t mib = env ? strtoull(env, NULL, 10) : 1024;
    if (mib < 1) mib = 1;
    g_frames = mib * (1u << 20) / SLAB_KV_BYTES;
    g_kv = malloc(SLAB_KV_BYTES);
    assert_non_null(g_kv);
    kvb_rng rng;
    kvb_rng_seed(&rng, 1);
    for (size_t i = 0; i < SLAB_KV_BYTES; i += 8) {
        uint64_t v = kvb_rng_u64(&rng);
        memcpy(g_kv + i, &v, 8);
    }
    double t[ROUNDS], raw[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        raw[r] = run_raw();
        t[r] = run_transport();
        printf("  round %d: raw send/recv %.2f GB/s, transport SLAB frames %.2f GB/s (%.0f %%)\n", r + 1, raw[r], t[r],
               100.0 * t[r] / raw[r]);
    }
    qsort(t, ROUNDS, sizeof t[0], cmp_double);
    qsort(raw, ROUNDS, sizeof raw[0], cmp_double);
    printf("loopback, %llu MiB in %llu SLAB frames of 1 MiB K+V, median of %d: raw %.2f GB/s, transport %.2f GB/s, "
           "ratio %.1f %% (target >= 85 %%)\n",
           (unsigned long long)mib, (unsigned long long)g_frames, ROUNDS, raw[ROUNDS / 2], t[ROUNDS / 2],
           100.0 * t[ROUNDS / 2] / raw[ROUNDS / 2]);
    fflush(stdout);
    free(g_kv);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_loopback_throughput)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
