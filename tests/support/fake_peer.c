/* tests/support/fake_peer.c — the misbehaving prefill nodes of fake_peer.h: one thread per peer
 * polls its listener every 20 ms, accepts whatever arrives, and does to each open connection what
 * its kind says (nothing, a byte every 50 ms, garbage once, an ERROR frame then close). Sockets the
 * dialler closed are kept until the table is full (then every one is closed): the peer never
 * reads, so it does not notice, as a hung process would not. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fake_peer.h"
#include "kvb_transport.h"

#define MAX_OPEN 64

struct kvbt_fake_peer {
    kvbt_peer_kind kind;
    int lfd;
    uint16_t port;
    pthread_t thread;
    atomic_bool stop;
    atomic_uint accepted;
    int fds[MAX_OPEN]; /* (n_open) connections held open (the thread's own) */
    size_t sent[MAX_OPEN]; /* trickle: bytes of the header sent on each */
    int n_open;
};

static void send_quiet(int fd, const void *p, size_t n) {
    if (send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) { /* the dialler gave up: nothing to do */
    }
}

/* An ERROR frame ([request] "busy"), as a prefill node that takes no more decode nodes answers. */
static void send_busy(int fd) {
    kvb_msg_error m;
    kvb_msg_error_set(&m, KVB_WIRE_ERR_REQUEST, "busy: too many decode nodes connected");
    uint8_t payload[8 + KVB_WIRE_ERROR_MSG_MAX], frame[KVB_WIRE_HEADER_BYTES + sizeof payload];
    size_t len = 0, w = 0;
    kvb_err e = {0};
    if (kvb_msg_error_encode(&m, payload, sizeof payload, &len, &e)) fail_msg("fake peer: %s", e.msg);
    kvb_iov iov = {payload, len};
    if (kvb_wire_frame_encode(KVB_FRAME_ERROR, 0, &iov, 1, frame, sizeof frame, &w, &e)) fail_msg("fake peer: %s", e.msg);
    send_quiet(fd, frame, w);
}

static void on_accept(kvbt_fake_peer *p, int fd) {
    atomic_fetch_add(&p->accepted, 1);
    if (p->kind == KVBT_PEER_BUSY) {
        send_busy(fd);
        usleep(20 * 1000); /* let the frame go before the close */
        close(fd);
        return;
    }
    if (p->kind == KVBT_PEER_GARBAGE) {
        uint8_t junk[256];
        for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)(i * 37 + 11);
        send_quiet(fd, junk, sizeof junk);
    }
    if (p->n_open == MAX_OPEN) {
        for (int i = 0; i < p->n_open; i++) close(p->fds[i]);
        p->n_open = 0;
    }
    p->sent[p->n_open] = 0;
    p->fds[p->n_open++] = fd;
}

/* The start of a valid frame header (magic, version, type HELLO), a byte at a time. */
static void trickle(kvbt_fake_peer *p) {
    static const uint8_t header[8] = {'K', 'V', 'B', '1', KVB_WIRE_VERSION, 0, KVB_FRAME_HELLO, 0};
    for (int i = 0; i < p->n_open; i++)
        if (p->sent[i] < sizeof header) send_quiet(p->fds[i], header + p->sent[i]++, 1);
}

static void *peer_main(void *arg) {
    kvbt_fake_peer *p = arg;
    double next_trickle = kvb_now_s();
    while (!atomic_load(&p->stop)) {
        struct pollfd pf = {.fd = p->lfd, .events = POLLIN};
        if (poll(&pf, 1, 20) > 0) {
            int fd = accept(p->lfd, NULL, NULL);
            if (fd >= 0) on_accept(p, fd);
        }
        if (p->kind == KVBT_PEER_TRICKLE && kvb_now_s() >= next_trickle) {
            trickle(p);
            next_trickle = kvb_now_s() + 0.05;
        }
    }
    return NULL;
}

kvbt_fake_peer *kvbt_fake_peer_start(kvbt_peer_kind kind) {
    kvbt_fake_peer *p = calloc(1, sizeof *p);
    assert_non_null(p);
    p->kind = kind;
    p->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(p->lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(p->lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(p->lfd, 64), 0);
    socklen_t sl = sizeof a;
    assert_int_equal(getsockname(p->lfd, (struct sockaddr *)&a, &sl), 0);
    p->port = ntohs(a.sin_port);
    atomic_init(&p->stop, false);
    atomic_init(&p->accepted, 0);
    assert_int_equal(pthread_create(&p->thread, NULL, peer_main, p), 0);
    return p;
}

uint16_t kvbt_fake_peer_port(const kvbt_fake_peer *p) { return p->port; }
unsigned kvbt_fake_peer_accepted(kvbt_fake_peer *p) { return atomic_load(&p->accepted); }

void kvbt_fake_peer_stop(kvbt_fake_peer *p) {
    if (!p) return;
    atomic_store(&p->stop, true);
    pthread_join(p->thread, NULL);
    for (int i = 0; i < p->n_open; i++) close(p->fds[i]);
    close(p->lfd);
    free(p);
}
