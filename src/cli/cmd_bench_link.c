/* cli/cmd_bench_link.c — `kvbridge bench link`: the transport's throughput beside the raw link,
 * measured the same way in the same run: N bytes as plain TCP sends of S bytes, then N bytes as
 * authenticated, checksummed SLAB frames of S bytes (each slab's checksum computed a few slabs ahead
 * of the sender on a thread of its own, as the bridge's staging ring does, and verified by the
 * receiver as the store does, on the payload UCX lends it), each way over one connection or over
 * --streams connections at once (N / streams bytes on each, one sending and one receiving thread
 * per connection, started together, as a decode node stripes a request's slabs over its lanes),
 * timed from the first byte to the last acknowledgement; alternated, medians of --reps. With
 * --transport ucx the framed leg also runs over UCX, and UCX's own put bandwidth (ucp_put_nbx of
 * the same bytes into the receive ring the listener registered and advertised, nothing framed or
 * checked) is measured beside it as the ceiling. One side listens, the other connects (two hosts,
 * two namespaces, or one machine). */
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvb_cli.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "kvb_transport.h"

static int tcp_listen(const char *host, const char *port) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    if (getaddrinfo(*host ? host : NULL, port, &hints, &ai) != 0 || !ai) return -1;
    int fd = socket(ai->ai_family, SOCK_STREAM, 0), one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    /* a round's streams are all dialed before any is accepted: room for all of them */
    if (fd >= 0 && (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 2 * KVB_MAX_LANES) != 0)) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

static bool send_all(int fd, const void *p, size_t n) {
    for (size_t off = 0; off < n;) {
        ssize_t k = send(fd, (const char *)p + off, n - off, MSG_NOSIGNAL);
        if (k <= 0) return false;
        off += (size_t)k;
    }
    return true;
}

static bool recv_all(int fd, void *p, size_t n) {
    for (size_t off = 0; off < n;) {
        ssize_t k = recv(fd, (char *)p + off, n - off, 0);
        if (k <= 0) return false;
        off += (size_t)k;
    }
    return true;
}

/* The raw leg, both ends: `bytes` sent in pieces of `piece` bytes, then a 1-byte acknowledgement
 * once the receiver has read them all (buf: its receive buffer of cap bytes). */
static bool raw_send_acked(int fd, const uint8_t *data, size_t piece, uint64_t bytes) {
    bool ok = true;
    for (uint64_t sent = 0; ok && sent < bytes; sent += piece)
        ok = send_all(fd, data, (size_t)(bytes - sent < piece ? bytes - sent : piece));
    char ack;
    return ok && recv_all(fd, &ack, 1);
}

static bool raw_recv_acked(int fd, char *buf, size_t cap, uint64_t bytes) {
    uint64_t got = 0;
    while (got < bytes) {
        ssize_t k = recv(fd, buf, cap, 0);
        if (k <= 0) break;
        got += (uint64_t)k;
    }
    return got == bytes && send_all(fd, "k", 1);
}

/* A round's header is {bytes for this stream, streams}; this bit in the second word says the round
 * is raw TCP only (kvb_bench_raw_remote_gbs: the server then expects no framed leg). */
#define RAW_ONLY (1ull << 32)

/* `piece` bytes of filler to send (malloc'd; NULL when out of memory). */
static uint8_t *filler_piece(size_t piece) {
    uint8_t *data = malloc(piece);
    if (data)
        for (size_t i = 0; i < piece; i++) data[i] = (uint8_t)(i * 131 + 7);
    return data;
}

/* Stream i's share when `bytes` are split over `streams` connections (the first ones carry the
 * remainder, a byte each). */
static uint64_t stream_share(uint64_t bytes, uint32_t streams, uint32_t i) {
    return bytes / streams + (i < bytes % streams ? 1 : 0);
}

/* ---- parallel streams: each end of each connection on its own thread, started together ---- */

/* Holds every thread of a run until all of them exist, so the streams start together; or, when
 * one could not be created, lets the others go without sending anything. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state; /* 0: wait, 1: go, -1: abort */
} start_gate;

static bool gate_pass(start_gate *g) {
    pthread_mutex_lock(&g->mu);
    while (g->state == 0) pthread_cond_wait(&g->cv, &g->mu);
    const bool go = g->state > 0;
    pthread_mutex_unlock(&g->mu);
    return go;
}

/* One end of one connection. The thread only uses the socket or connection; the caller opens and
 * closes it. An end that fails shuts its socket or connection down, so that the other end, which
 * may be waiting for bytes or for the acknowledgement, fails too instead of waiting forever. */
typedef struct {
    void *(*main)(void *); /* raw_send_main, raw_recv_main, slab_send_main or slab_recv_main */
    int fd;                /* raw ends: the socket */
    kvb_conn *conn;        /* transport ends: the authenticated connection */
    const uint8_t *data;   /* senders: `piece` bytes of filler, shared, read-only */
    size_t piece;          /* senders: bytes per send or per slab; raw receivers: the buffer's size */
    uint64_t bytes;        /* what this connection carries (raw receivers: what they expect) */
    start_gate *gate;      /* set by run_ends */
    bool ok;               /* set by the thread */
    bool no_ring;          /* raw_put_main: the peer advertised no ring (KVB_UCX_RING=0): nothing put */
    double done_s;         /* senders: kvb_now_s() when the acknowledgement arrived */
    kvb_err err;           /* transport ends: what failed */
} stream_end;

static void *raw_send_main(void *arg) {
    stream_end *s = arg;
    if (!gate_pass(s->gate)) return NULL;
    s->ok = raw_send_acked(s->fd, s->data, s->piece, s->bytes);
    s->done_s = kvb_now_s();
    if (!s->ok) shutdown(s->fd, SHUT_RDWR);
    return NULL;
}

static void *raw_recv_main(void *arg) {
    stream_end *s = arg;
    char *buf = malloc(s->piece); /* before the start: not timed */
    if (gate_pass(s->gate)) s->ok = buf && raw_recv_acked(s->fd, buf, s->piece, s->bytes);
    free(buf);
    if (!s->ok) shutdown(s->fd, SHUT_RDWR);
    return NULL;
}

/* A sender's end (st: how its sending went): PING, and the PONG as the acknowledgement; the time it
 * came, whether all went well (a failed end shuts its connection down). */
static void *ping_acked(stream_end *s, kvb_status st) {
    kvb_msg pong;
    if (!st) st = kvb_conn_send_ping(s->conn, 42, 10000, &s->err);
    if (!st) st = kvb_conn_recv(s->conn, 60000, &pong, &s->err);
    if (!st && pong.type != KVB_FRAME_PONG)
        st = kvb_err_set(&s->err, KVB_ERR_FORMAT, "the listener answered PING with frame type %u, not PONG",
                         (unsigned)pong.type);
    s->done_s = kvb_now_s();
    s->ok = st == KVB_OK;
    if (!s->ok) kvb_conn_shutdown(s->conn);
    return NULL;
}

/* The slabs' checksums, computed on a thread of their own at most SUMS_AHEAD slabs ahead of the
 * sender, as the bridge's staging ring has its producer checksum slabs before a lane's sender
 * takes them: a slab's checksum is computed while the one before it is sent. */
#define SUMS_AHEAD 4
typedef struct {
    const uint8_t *data;
    size_t piece;
    uint64_t bytes;
    uint64_t sum[SUMS_AHEAD]; /* slab i's at i % SUMS_AHEAD */
    uint64_t made, taken;     /* slabs checksummed, and taken by the sender */
    bool stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} sums_ahead;

/* Slab i of a stream of `bytes` in slabs of `piece` bytes: K the first half of data, V the rest. */
static kvb_msg_slab bench_slab(const uint8_t *data, size_t piece, uint64_t bytes, uint64_t i) {
    const size_t n = (size_t)KVB_MIN(bytes - i * piece, piece);
    return (kvb_msg_slab){.layer = 0, .pos0 = 0, .n = 1, .k = data, .v = data + n / 2, .k_bytes = n / 2,
                          .v_bytes = n - n / 2};
}

static void *sums_main(void *arg) {
    sums_ahead *q = arg;
    for (uint64_t i = 0; i * q->piece < q->bytes; i++) {
        const kvb_msg_slab m = bench_slab(q->data, q->piece, q->bytes, i);
        const uint64_t c = kvb_slab_checksum(m.k, m.k_bytes, m.v, m.v_bytes);
        pthread_mutex_lock(&q->mu);
        while (q->made - q->taken == SUMS_AHEAD && !q->stop) pthread_cond_wait(&q->cv, &q->mu);
        const bool stop = q->stop;
        if (!stop) q->sum[q->made++ % SUMS_AHEAD] = c;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
        if (stop) break;
    }
    return NULL;
}

/* The framed leg's sender: SLAB frames (their checksums from sums_main), then PING; the PONG is
 * the acknowledgement. */
static void *slab_send_main(void *arg) {
    stream_end *s = arg;
    if (!gate_pass(s->gate)) return NULL;
    sums_ahead q = {.data = s->data, .piece = s->piece, .bytes = s->bytes};
    pthread_mutex_init(&q.mu, NULL);
    pthread_cond_init(&q.cv, NULL);
    pthread_t th;
    kvb_status st = pthread_create(&th, NULL, sums_main, &q) != 0
                        ? kvb_err_set(&s->err, KVB_ERR_INTERNAL, "could not start the checksum thread")
                        : KVB_OK;
    const bool started = st == KVB_OK;
    for (uint64_t i = 0; !st && i * s->piece < s->bytes; i++) {
        kvb_msg_slab m = bench_slab(s->data, s->piece, s->bytes, i);
        pthread_mutex_lock(&q.mu);
        while (q.made == i) pthread_cond_wait(&q.cv, &q.mu);
        m.checksum = q.sum[i % SUMS_AHEAD];
        q.taken++;
        pthread_cond_broadcast(&q.cv);
        pthread_mutex_unlock(&q.mu);
        st = kvb_conn_send_slab(s->conn, 1, &m, 60000, &s->err);
    }
    if (started) {
        pthread_mutex_lock(&q.mu);
        q.stop = true;
        pthread_cond_broadcast(&q.cv);
        pthread_mutex_unlock(&q.mu);
        pthread_join(th, NULL);
    }
    pthread_cond_destroy(&q.cv);
    pthread_mutex_destroy(&q.mu);
    return ping_acked(s, st);
}

/* The raw UCX leg's sender: UCX's own puts of the bytes into the peer's advertised receive ring
 * (no frames, no checksums, no credits), then PING; the PONG is the acknowledgement. */
static void *raw_put_main(void *arg) {
    stream_end *s = arg;
    if (!gate_pass(s->gate)) return NULL;
    kvb_status st = kvb_conn_ucx_raw_put(s->conn, s->data, s->piece, s->bytes, 60000, &s->err);
    if (st == KVB_ERR_UNSUPPORTED) { /* still PING, which the listener waits for */
        s->no_ring = true;
        st = KVB_OK;
    }
    return ping_acked(s, st);
}

/* The framed leg's receiver: verifies every slab's checksum until PING, answers PONG. Payloads are
 * taken as the bridge's receiver takes them (kvb_conn_recv_lend: UCX lends them out of its ring). */
static void *slab_recv_main(void *arg) {
    stream_end *s = arg;
    if (!gate_pass(s->gate)) return NULL;
    kvb_wire_buf buf = {0};
    for (;;) {
        kvb_msg m;
        kvb_wire_loan loan;
        if (kvb_conn_recv_lend(s->conn, 60000, &buf, &loan, &m, &s->err)) break;
        const bool corrupt = m.type == KVB_FRAME_SLAB && kvb_slab_checksum(m.u.slab.k, m.u.slab.k_bytes, m.u.slab.v,
                                                                           m.u.slab.v_bytes) != m.u.slab.checksum;
        kvb_wire_loan_return(&loan);
        if (corrupt) {
            kvb_err_set(&s->err, KVB_ERR_FORMAT, "a slab arrived corrupt (its checksum does not match)");
            kvb_msg_free(&m);
            break;
        }
        if (m.type == KVB_FRAME_PING) {
            s->ok = kvb_conn_send_pong(s->conn, m.u.ping.token, 10000, &s->err) == KVB_OK;
            break;
        }
    }
    free(buf.data);
    if (!s->ok) kvb_conn_shutdown(s->conn);
    return NULL;
}

/* Runs each of the n ends (n <= 2 * KVB_MAX_LANES) on its own thread, all released together once
 * every thread exists, and waits for them. True when every end succeeded; *seconds then runs from
 * the release to the last sender's acknowledgement. A thread that cannot be created fails the
 * run: the ones already created are released without sending. */
static bool run_ends(stream_end *e, size_t n, double *seconds) {
    pthread_t th[2 * KVB_MAX_LANES];
    if (n == 0 || n > sizeof th / sizeof th[0]) return false;
    start_gate g = {.state = 0};
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cv, NULL);
    size_t made = 0;
    for (; made < n; made++) {
        e[made].gate = &g;
        e[made].ok = false;
        e[made].done_s = 0;
        if (pthread_create(&th[made], NULL, e[made].main, &e[made]) != 0) break;
    }
    pthread_mutex_lock(&g.mu);
    g.state = made == n ? 1 : -1;
    const double t0 = kvb_now_s();
    pthread_cond_broadcast(&g.cv);
    pthread_mutex_unlock(&g.mu);
    bool ok = made == n;
    double last = t0;
    for (size_t i = 0; i < made; i++) {
        pthread_join(th[i], NULL);
        ok = ok && e[i].ok;
        if (e[i].done_s > last) last = e[i].done_s;
    }
    pthread_cond_destroy(&g.cv);
    pthread_mutex_destroy(&g.mu);
    *seconds = last - t0;
    return ok;
}

/* ---- the raw loopback, in process (bench ladder's yardstick) ---- */

double kvb_bench_raw_loopback_gbs(uint64_t bytes, size_t piece, uint32_t streams) {
    if (streams < 1 || streams > KVB_MAX_LANES || piece == 0) return 0;
    stream_end e[2 * KVB_MAX_LANES]; /* the senders, then their receivers */
    for (uint32_t i = 0; i < 2 * streams; i++) e[i] = (stream_end){.fd = -1};
    int lfd = tcp_listen("127.0.0.1", "0");
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    char port[16];
    uint8_t *data = filler_piece(piece);
    bool ok = lfd >= 0 && data && getsockname(lfd, (struct sockaddr *)&sa, &sl) == 0;
    if (ok) snprintf(port, sizeof port, "%u", ntohs(((struct sockaddr_in *)&sa)->sin_port));
    /* one connection at a time, so the socket accepted is the one just dialed: each receiver
     * knows its sender's share */
    for (uint32_t i = 0; ok && i < streams; i++) {
        stream_end *snd = &e[i], *rcv = &e[streams + i];
        const uint64_t share = stream_share(bytes, streams, i);
        *snd = (stream_end){.main = raw_send_main, .fd = kvb_tcp_dial("127.0.0.1", port), .data = data,
                            .piece = piece, .bytes = share};
        *rcv = (stream_end){.main = raw_recv_main, .fd = snd->fd >= 0 ? accept(lfd, NULL, NULL) : -1,
                            .piece = 1 << 20, .bytes = share};
        ok = snd->fd >= 0 && rcv->fd >= 0;
    }
    double dt = 0, gbs = 0;
    if (ok && run_ends(e, 2 * (size_t)streams, &dt) && dt > 0) gbs = (double)bytes / dt / 1e9;
    for (uint32_t i = 0; i < 2 * streams; i++)
        if (e[i].fd >= 0) close(e[i].fd);
    if (lfd >= 0) close(lfd);
    free(data);
    return gbs;
}

static kvb_status make_hello(kvb_wire_role role, kvb_hello *h, kvb_err *err) {
    kvb_kvformat f;
    kvb_status st = kvb_kvformat_init(&f, KVB_TYPE_F16, 32, 1, 1, 64, err);
    return st ? st : kvb_hello_init(h, role, KVB_BRIDGE_MODE_DECODER, "bench-link", 0, &f, err);
}

/* Splits "HOST:PORT"; returns the port number. */
static long split_addr(const char *addr, char *host, size_t cap) {
    const char *c = strrchr(addr, ':');
    if (!c || (size_t)(c - addr) >= cap) return -1;
    memcpy(host, addr, (size_t)(c - addr));
    host[c - addr] = 0;
    return strtol(c + 1, NULL, 10);
}

/* The listener's framed leg of a round: accepts `streams` connections on l, verifies and answers
 * them; false (said on stderr) when they did not all come. */
static bool serve_framed(kvb_listener *l, const kvb_hello *me, const kvb_transport_config *cfg, uint32_t streams) {
    stream_end e[KVB_MAX_LANES];
    kvb_err err = {0};
    uint32_t n = 0;
    for (; n < streams; n++) {
        e[n] = (stream_end){.main = slab_recv_main, .fd = -1};
        if (kvb_transport_accept(l, me, cfg, 60000, &e[n].conn, NULL, &err)) break;
    }
    double dt;
    if (n == streams) {
        run_ends(e, n, &dt); /* a failed transfer shows on the connecting side */
        for (uint32_t i = 0; i < n; i++)
            if (!e[i].ok && e[i].err.msg[0]) fprintf(stderr, "kvbridge bench link: %s\n", e[i].err.msg);
    }
    for (uint32_t i = 0; i < n; i++) kvb_conn_close(e[i].conn);
    if (n < streams) fprintf(stderr, "kvbridge bench link: %s\n", err.msg);
    return n == streams;
}

/* A round, between the two sides: the connecting side opens the round's raw connections, each
 * starting with the header {bytes on this connection, the round's stream count} (uint64 each,
 * host order), and sends; the listener accepts as many as the first header says, receives and
 * acknowledges each; then the connecting side opens as many transport connections and sends
 * SLAB frames and a PING on each, which the listener verifies and answers with PONG. A header
 * with a stream count of 0 ends the listener. With ucx (--transport ucx on both sides), each round's
 * framed leg runs twice: over kvbridge's TCP transport, then over UCX (listening on PORT+2); then
 * UCX's raw puts run over as many UCX connections (the listener only answers their PING). */
static int serve(const char *addr, const char *psk, const kvb_wire_backend *ucx) {
    char host[128], port[16], tport[140], uport[140];
    long p = split_addr(addr, host, sizeof host);
    if (p <= 0 || p > 65534) {
        fprintf(stderr, "kvbridge bench link: --listen expects HOST:PORT (PORT < 65535), got '%s'\n", addr);
        return 2;
    }
    snprintf(port, sizeof port, "%ld", p);
    snprintf(tport, sizeof tport, "%s:%ld", host, p + 1);
    snprintf(uport, sizeof uport, "%s:%ld", host, p + 2);
    int lfd = tcp_listen(host, port);
    kvb_listener *l = NULL, *lu = NULL;
    kvb_err err = {0};
    kvb_hello me;
    if (lfd < 0 || kvb_transport_listen(tport, NULL, &l, &err) || (ucx && kvb_transport_listen(uport, ucx, &lu, &err)) ||
        make_hello(KVB_ROLE_DECODE, &me, &err)) {
        fprintf(stderr, "kvbridge bench link: cannot listen on %s / %s: %s\n", addr, tport, err.msg);
        if (lfd >= 0) close(lfd);
        kvb_listener_close(l);
        kvb_listener_close(lu);
        return 1;
    }
    kvb_transport_config cfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    printf("bench link: serving raw TCP on %s and the transport on %s%s%s\n", addr, tport, ucx ? ", over UCX on " : "",
           ucx ? uport : "");
    fflush(stdout);
    int rc = 0;
    for (;;) { /* each round: the raw transfer, then the framed one, over the round's streams */
        stream_end e[KVB_MAX_LANES];
        uint64_t hdr[2] = {0, 0};
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0 || !recv_all(fd, hdr, sizeof hdr) || hdr[1] == 0) {
            if (fd >= 0) close(fd);
            break;
        }
        const bool raw_only = hdr[1] & RAW_ONLY; /* kvb_bench_raw_remote_gbs: no framed leg follows */
        if ((hdr[1] & ~RAW_ONLY) > KVB_MAX_LANES) {
            fprintf(stderr, "kvbridge bench link: a round asked for %llu streams (at most %d)\n",
                    (unsigned long long)(hdr[1] & ~RAW_ONLY), KVB_MAX_LANES);
            close(fd);
            rc = 1;
            break;
        }
        const uint32_t streams = (uint32_t)(hdr[1] & ~RAW_ONLY);
        const uint64_t round_hdr = hdr[1];
        uint32_t n = 0;
        bool ok = true;
        for (;;) {
            e[n++] = (stream_end){.main = raw_recv_main, .fd = fd, .piece = 1 << 24, .bytes = hdr[0]};
            if (n == streams) break;
            fd = accept(lfd, NULL, NULL);
            ok = fd >= 0 && recv_all(fd, hdr, sizeof hdr) && hdr[1] == round_hdr;
            if (!ok) {
                if (fd >= 0) close(fd);
                break;
            }
        }
        double dt;
        if (ok) run_ends(e, n, &dt); /* a failed transfer shows on the connecting side */
        for (uint32_t i = 0; i < n; i++) close(e[i].fd);
        if (!ok) {
            fprintf(stderr, "kvbridge bench link: a round of %u streams did not open all of them\n", streams);
            rc = 1;
            break;
        }
        if (raw_only) continue;
        if (!serve_framed(l, &me, &cfg, streams) ||
            (lu && (!serve_framed(lu, &me, &cfg, streams) || !serve_framed(lu, &me, &cfg, streams)))) {
            rc = 1;
            break;
        }
    }
    close(lfd);
    kvb_listener_close(l);
    kvb_listener_close(lu);
    return rc;
}

/* The connecting side's raw leg of one round (raw_only: the round has no framed leg); *gbs on
 * success. */
static bool raw_leg(const char *host, const char *port, const uint8_t *data, size_t piece, uint64_t bytes,
                    uint32_t streams, bool raw_only, double *gbs, kvb_err *err) {
    stream_end e[KVB_MAX_LANES];
    uint32_t n = 0;
    bool ok = true;
    while (ok && n < streams) {
        uint64_t hdr[2] = {stream_share(bytes, streams, n), streams | (raw_only ? RAW_ONLY : 0)};
        e[n] = (stream_end){.main = raw_send_main, .fd = kvb_tcp_dial(host, port), .data = data, .piece = piece,
                            .bytes = hdr[0]};
        ok = e[n].fd >= 0 && send_all(e[n].fd, hdr, sizeof hdr);
        if (e[n].fd >= 0) n++;
    }
    double dt = 0;
    if (!ok) kvb_err_set(err, KVB_ERR_IO, "cannot connect to %s:%s", host, port);
    else if (!run_ends(e, n, &dt) || dt <= 0) {
        kvb_err_set(err, KVB_ERR_IO, "raw transfer to %s:%s failed", host, port);
        ok = false;
    }
    for (uint32_t i = 0; i < n; i++) close(e[i].fd);
    if (ok) *gbs = (double)bytes / dt / 1e9;
    return ok;
}

/* The connecting side's framed leg of one round (main: slab_send_main, or raw_put_main for UCX's
 * raw puts); *gbs on success. */
static bool framed_leg(const char *tport, const kvb_hello *me, const kvb_transport_config *cfg, const uint8_t *data,
                       size_t slab, uint64_t bytes, uint32_t streams, void *(*main)(void *), double *gbs,
                       kvb_err *err) {
    stream_end e[KVB_MAX_LANES];
    uint32_t n = 0;
    bool ok = true;
    for (; ok && n < streams; n++) {
        e[n] = (stream_end){.main = main, .fd = -1, .data = data, .piece = slab,
                            .bytes = stream_share(bytes, streams, n)};
        ok = kvb_transport_connect(tport, me, cfg, 10000, &e[n].conn, NULL, err) == KVB_OK;
    }
    double dt = 0;
    if (ok && (!run_ends(e, n, &dt) || dt <= 0)) {
        ok = false;
        kvb_err_set(err, KVB_ERR_IO, "transport transfer to %s failed", tport);
        for (uint32_t i = 0; i < n; i++)
            if (!e[i].ok && e[i].err.msg[0]) {
                *err = e[i].err;
                break;
            }
    }
    for (uint32_t i = 0; i < n; i++) {
        kvb_conn_close(e[i].conn); /* NULL where the connect failed */
        if (e[i].no_ring) dt = 0;  /* no figure */
    }
    if (ok) *gbs = dt > 0 ? (double)bytes / dt / 1e9 : 0;
    return ok;
}

double kvb_bench_raw_remote_gbs(const char *addr, uint64_t bytes, size_t piece, uint32_t streams) {
    char host[128], port[16];
    long p = split_addr(addr, host, sizeof host);
    if (p <= 0 || p > 65534 || streams < 1 || streams > KVB_MAX_LANES || piece == 0) return 0;
    snprintf(port, sizeof port, "%ld", p);
    uint8_t *data = filler_piece(piece);
    if (!data) return 0;
    double gbs = 0;
    kvb_err err = {0};
    if (!raw_leg(host, port, data, piece, bytes, streams, true, &gbs, &err)) {
        fprintf(stderr, "kvbridge bench: raw link to %s: %s\n", addr, err.msg);
        gbs = 0;
    }
    free(data);
    return gbs;
}

/* The UCX legs' medians beside kvbridge's TCP transport (mf) and the raw TCP link (mr). */
static void print_ucx(double *over_ucx, double *ucx_put, int reps, double mf, double mr) {
    double mu = kvb_median_sort(over_ucx, reps), mp = kvb_median_sort(ucx_put, reps);
    char lanes[256];
    kvb_ucx_last_lanes(lanes, sizeof lanes);
    printf("over UCX   %.3f GB/s (the same frames over UCX: payloads of 64 KiB up to a quarter of the receiver's "
           "registered ring put into it, headers on its stream API as the signal, verified on a view into the ring; "
           "tagged rendezvous messages when larger, or when every lane is TCP; lanes: %s)\n",
           mu, lanes);
    if (mp > 0)
        printf("raw UCX    %.3f GB/s (UCX's own ucp_put_nbx of the same bytes into the receiver's ring, nothing "
               "checked)\nratio      %.2fx kvbridge's TCP transport, %.0f %% of UCX's raw put, %.0f %% of the raw "
               "TCP link\n",
               mp, mu / mf, 100.0 * mu / mp, 100.0 * mu / mr);
    else
        printf("raw UCX    no figure: the listener advertised no receive ring of a piece's size (KVB_UCX_RING)\n"
               "ratio      %.2fx kvbridge's TCP transport, %.0f %% of the raw TCP link\n",
               mu / mf, 100.0 * mu / mr);
}

static int measure(const char *addr, const char *psk, uint64_t bytes, size_t slab, int reps, uint32_t streams,
                   const kvb_wire_backend *ucx) {
    char host[128], port[16], tport[140], uport[140];
    long p = split_addr(addr, host, sizeof host);
    if (p <= 0 || p > 65534) {
        fprintf(stderr, "kvbridge bench link: --peer expects HOST:PORT, got '%s'\n", addr);
        return 2;
    }
    snprintf(port, sizeof port, "%ld", p);
    snprintf(tport, sizeof tport, "%s:%ld", host, p + 1);
    snprintf(uport, sizeof uport, "%s:%ld", host, p + 2);
    uint8_t *data = filler_piece(slab);
    if (!data) return 1;
    kvb_hello me;
    kvb_err err = {0};
    kvb_transport_config cfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    kvb_transport_config ucfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk), .backend = ucx};
    double raw[100], framed[100], over_ucx[100], ucx_put[100];
    int rc = 0;
    if (make_hello(KVB_ROLE_PREFILL, &me, &err)) goto fail;
    for (int r = 0; r < reps; r++) {
        if (!raw_leg(host, port, data, slab, bytes, streams, false, &raw[r], &err) ||
            !framed_leg(tport, &me, &cfg, data, slab, bytes, streams, slab_send_main, &framed[r], &err) ||
            (ucx && (!framed_leg(uport, &me, &ucfg, data, slab, bytes, streams, slab_send_main, &over_ucx[r], &err) ||
                     !framed_leg(uport, &me, &ucfg, data, slab, bytes, streams, raw_put_main, &ucx_put[r], &err))))
            goto fail;
        fprintf(stderr, "bench link: round %d: raw %.3f GB/s, kvbridge transport %.3f GB/s", r + 1, raw[r], framed[r]);
        if (ucx) fprintf(stderr, ", over UCX %.3f GB/s, UCX's raw put %.3f GB/s", over_ucx[r], ucx_put[r]);
        fputc('\n', stderr);
    }
    {
        int fd = kvb_tcp_dial(host, port); /* tell the server to stop: a round of 0 streams */
        uint64_t stop[2] = {0, 0};
        if (fd >= 0) {
            send_all(fd, stop, sizeof stop);
            close(fd);
        }
    }
    double mr = kvb_median_sort(raw, reps), mf = kvb_median_sort(framed, reps);
    char over[80] = "";
    if (streams > 1) snprintf(over, sizeof over, ", each leg over %u connections at once", streams);
    printf("link       %s, %.2f GiB per leg in %zu-byte pieces%s, %d rounds (medians)\n", addr,
           bytes / 1073741824.0, slab, over, reps);
    printf("raw TCP    %.3f GB/s\nkvbridge   %.3f GB/s (SLAB frames: header and slab head hashed, the slab checksum of K || V computed beside the sender and verified, authenticated link)\n"
           "ratio      %.0f %% of the raw link\n",
           mr, mf, 100.0 * mf / mr);
    if (ucx) print_ucx(over_ucx, ucx_put, reps, mf, mr);
    goto done;
fail:
    fprintf(stderr, "kvbridge bench link: %s\n", err.msg);
    rc = 1;
done:
    free(data);
    return rc;
}

int kvb_bench_link(int argc, char **argv) {
    const char *listen = NULL, *peer = NULL, *psk = getenv("KVB_PSK");
    uint64_t bytes = 0, slab = 0;
    long long reps = 0, streams = 0;
    int transport = 0;
    const kvb_opt opts[] = {
        KVB_CLI_STR("listen", &listen, "HOST:PORT", "serve: plain TCP on PORT and the transport on PORT+1"),
        KVB_CLI_STR("peer", &peer, "HOST:PORT", "measure against a listener there"),
        KVB_CLI_OPT_PSK(&psk, "pre-shared key, the same on both sides (or env KVB_PSK)"),
        KVB_CLI_OPT_TRANSPORT(&transport, "ucx: each round's framed leg runs over kvbridge's TCP transport, then "
                                          "over UCX (the listener serves UCX on PORT+2), then as UCX's own raw puts "
                                          "of the same bytes into the listener's receive ring (the ceiling); both "
                                          "sides need the same"),
        {.long_name = "bytes", .kind = KVB_OPT_SIZE, .dst = &bytes, .meta = "N", .def = "1G", .ulo = 1 << 20,
         .uhi = 1ULL << 40, .help = "bytes sent each way of sending, per round"},
        {.long_name = "slab-bytes", .kind = KVB_OPT_SIZE, .dst = &slab, .meta = "S", .def = "1M", .ulo = 4096,
         .uhi = 1 << 26, .help = "the size of each send and each SLAB frame"},
        KVB_CLI_INT("reps", &reps, "R", 1, 100, "3", "rounds; the medians are reported"),
        KVB_CLI_INT("streams", &streams, "C", 1, KVB_MAX_LANES, "1",
                    "send each way over C connections at once: C plain TCP connections, then C authenticated "
                    "kvbridge connections, N/C bytes on each, one sending thread per connection on this side and "
                    "one receiving thread per connection on the listener's, timed from the first byte to the last "
                    "acknowledgement (the raw yardstick for a decode node striping over C lanes). The listener takes "
                    "the count from each round's header"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench link", .opts = opts,
        .usage = "--listen HOST:PORT [--psk KEY]\n--peer HOST:PORT [--bytes N] [--slab-bytes S] [--reps R] "
                 "[--streams C] [--psk KEY]",
        .about = "Measures kvbridge's transport against the raw TCP link between two machines: the listener serves "
                 "plain TCP on PORT and the transport on PORT+1; the connecting side sends N bytes each way of "
                 "sending, in pieces of S bytes, alternating, R times, and prints both GB/s and their ratio. Both "
                 "sides need the same pre-shared key (--psk or KVB_PSK)."};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    if (!listen == !peer || !psk || strlen(psk) < KVB_WIRE_PSK_MIN)
        return kvb_cli_usage_error(&spec, "give exactly one of --listen or --peer, and a key of >= %d bytes (--psk "
                                          "or KVB_PSK)", KVB_WIRE_PSK_MIN);
    const kvb_wire_backend *ucx = NULL;
    kvb_err err = {0};
    if (transport == 1 && kvb_wire_backend_by_name("ucx", &ucx, &err)) {
        fprintf(stderr, "kvbridge bench link: %s\n", err.msg);
        return 2;
    }
    return listen ? serve(listen, psk, ucx)
                  : measure(peer, psk, bytes, (size_t)slab, (int)reps, (uint32_t)streams, ucx);
}
