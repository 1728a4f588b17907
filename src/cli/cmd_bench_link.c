/* cli/cmd_bench_link.c — `kvbridge bench link`: the transport's throughput beside the raw link,
 * measured the same way in the same run: N bytes as plain TCP sends of S bytes, then N bytes as
 * authenticated, checksummed SLAB frames of S bytes (the sender computes each slab's checksum and
 * the receiver verifies it, as the bridge and the store do), each timed from the first byte to the
 * receiver's acknowledgement; alternated, medians of --reps. One side listens, the other connects
 * (two hosts, two namespaces, or one machine). */
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

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge bench link --listen HOST:PORT [--psk KEY]\n"
            "       kvbridge bench link --peer HOST:PORT [--bytes N] [--slab-bytes S] [--reps R] [--psk KEY]\n\n"
            "Measures kvbridge's transport against the raw TCP link between two machines: the listener serves\n"
            "plain TCP on PORT and the transport on PORT+1; the connecting side sends N bytes (default 1 GiB)\n"
            "each way of sending, in pieces of S bytes (default 1 MiB), alternating, R times (default 3), and\n"
            "prints both GB/s and their ratio. Both sides need the same pre-shared key (--psk or KVB_PSK).\n");
}

static int tcp_listen(const char *host, const char *port) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    if (getaddrinfo(*host ? host : NULL, port, &hints, &ai) != 0 || !ai) return -1;
    int fd = socket(ai->ai_family, SOCK_STREAM, 0), one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd >= 0 && (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 4) != 0)) {
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

/* ---- the raw loopback, in process (bench ladder --slab-path-only's yardstick) ---- */

typedef struct {
    int lfd;
    uint64_t bytes;
    bool ok;
} raw_sink;

static void *raw_sink_main(void *arg) {
    raw_sink *r = arg;
    int fd = accept(r->lfd, NULL, NULL);
    char *buf = malloc(1 << 20);
    r->ok = fd >= 0 && buf && raw_recv_acked(fd, buf, 1 << 20, r->bytes);
    free(buf);
    if (fd >= 0) close(fd);
    return NULL;
}

double kvb_bench_raw_loopback_gbs(uint64_t bytes, size_t piece) {
    raw_sink r = {.lfd = tcp_listen("127.0.0.1", "0"), .bytes = bytes};
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    char port[16];
    uint8_t *data = malloc(piece);
    if (r.lfd < 0 || !data || getsockname(r.lfd, (struct sockaddr *)&sa, &sl) != 0) {
        if (r.lfd >= 0) close(r.lfd);
        free(data);
        return 0;
    }
    snprintf(port, sizeof port, "%u", ntohs(((struct sockaddr_in *)&sa)->sin_port));
    for (size_t i = 0; i < piece; i++) data[i] = (uint8_t)(i * 131 + 7);
    pthread_t th;
    double gbs = 0;
    if (pthread_create(&th, NULL, raw_sink_main, &r) == 0) {
        int fd = kvb_tcp_dial("127.0.0.1", port);
        double t0 = kvb_now_s();
        bool ok = fd >= 0 && raw_send_acked(fd, data, piece, bytes);
        double dt = kvb_now_s() - t0;
        if (fd >= 0) close(fd);
        pthread_join(th, NULL);
        if (ok && r.ok) gbs = (double)bytes / dt / 1e9;
    }
    close(r.lfd);
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

static int serve(const char *addr, const char *psk) {
    char host[128], port[16], tport[140];
    long p = split_addr(addr, host, sizeof host);
    if (p <= 0 || p > 65534) {
        fprintf(stderr, "kvbridge bench link: --listen expects HOST:PORT (PORT < 65535), got '%s'\n", addr);
        return 2;
    }
    snprintf(port, sizeof port, "%ld", p);
    snprintf(tport, sizeof tport, "%s:%ld", host, p + 1);
    int lfd = tcp_listen(host, port);
    kvb_listener *l = NULL;
    kvb_err err = {0};
    kvb_hello me;
    if (lfd < 0 || kvb_transport_listen(tport, NULL, &l, &err) || make_hello(KVB_ROLE_DECODE, &me, &err)) {
        fprintf(stderr, "kvbridge bench link: cannot listen on %s / %s: %s\n", addr, tport, err.msg);
        if (lfd >= 0) close(lfd);
        kvb_listener_close(l);
        return 1;
    }
    kvb_transport_config cfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    printf("bench link: serving raw TCP on %s and the transport on %s\n", addr, tport);
    fflush(stdout);
    size_t cap = 1 << 24;
    char *buf = malloc(cap);
    int rc = 0;
    for (;;) { /* each round: one raw transfer, then one framed transfer; a raw length of 0 ends */
        int fd = accept(lfd, NULL, NULL);
        uint64_t n = 0;
        if (fd < 0 || !recv_all(fd, &n, 8)) break;
        if (n == 0) {
            close(fd);
            break;
        }
        raw_recv_acked(fd, buf, cap, n);
        close(fd);
        kvb_conn *c = NULL;
        if (kvb_transport_accept(l, &me, &cfg, 60000, &c, NULL, &err)) {
            fprintf(stderr, "kvbridge bench link: %s\n", err.msg);
            rc = 1;
            break;
        }
        for (;;) {
            kvb_msg m;
            if (kvb_conn_recv(c, 60000, &m, &err)) {
                fprintf(stderr, "kvbridge bench link: %s\n", err.msg);
                break;
            }
            if (m.type == KVB_FRAME_SLAB &&
                kvb_slab_checksum(m.u.slab.k, m.u.slab.k_bytes, m.u.slab.v, m.u.slab.v_bytes) != m.u.slab.checksum) {
                fprintf(stderr, "kvbridge bench link: a slab arrived corrupt (its checksum does not match)\n");
                kvb_msg_free(&m);
                break;
            }
            if (m.type == KVB_FRAME_PING) {
                kvb_conn_send_pong(c, m.u.ping.token, 10000, &err);
                break;
            }
        }
        kvb_conn_close(c);
    }
    free(buf);
    close(lfd);
    kvb_listener_close(l);
    return rc;
}

static int measure(const char *addr, const char *psk, uint64_t bytes, size_t slab, int reps) {
    char host[128], port[16], tport[140];
    long p = split_addr(addr, host, sizeof host);
    if (p <= 0 || p > 65534) {
        fprintf(stderr, "kvbridge bench link: --peer expects HOST:PORT, got '%s'\n", addr);
        return 2;
    }
    snprintf(port, sizeof port, "%ld", p);
    snprintf(tport, sizeof tport, "%s:%ld", host, p + 1);
    uint8_t *data = malloc(slab);
    if (!data) return 1;
    for (size_t i = 0; i < slab; i++) data[i] = (uint8_t)(i * 131 + 7);
    kvb_hello me;
    kvb_err err = {0};
    kvb_transport_config cfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    double raw[100], framed[100];
    int rc = 0;
    if (make_hello(KVB_ROLE_PREFILL, &me, &err)) goto fail;
    for (int r = 0; r < reps; r++) {
        int fd = kvb_tcp_dial(host, port);
        if (fd < 0) {
            kvb_err_set(&err, KVB_ERR_IO, "cannot connect to %s", addr);
            goto fail;
        }
        double t0 = kvb_now_s();
        bool ok = send_all(fd, &bytes, 8) && raw_send_acked(fd, data, slab, bytes);
        raw[r] = bytes / (kvb_now_s() - t0) / 1e9;
        close(fd);
        if (!ok) {
            kvb_err_set(&err, KVB_ERR_IO, "raw transfer to %s failed", addr);
            goto fail;
        }
        kvb_conn *c = NULL;
        if (kvb_transport_connect(tport, &me, &cfg, 10000, &c, NULL, &err)) goto fail;
        t0 = kvb_now_s();
        kvb_status st = KVB_OK;
        for (uint64_t sent = 0; !st && sent < bytes; sent += slab) {
            size_t piece = (size_t)(bytes - sent < slab ? bytes - sent : slab);
            kvb_msg_slab m = {.layer = 0, .pos0 = 0, .n = 1, .k = data, .v = data + piece / 2,
                              .k_bytes = piece / 2, .v_bytes = piece - piece / 2};
            m.checksum = kvb_slab_checksum(m.k, m.k_bytes, m.v, m.v_bytes);
            st = kvb_conn_send_slab(c, 1, &m, 60000, &err);
        }
        kvb_msg pong;
        if (!st) st = kvb_conn_send_ping(c, 42, 10000, &err);
        if (!st) st = kvb_conn_recv(c, 60000, &pong, &err);
        framed[r] = bytes / (kvb_now_s() - t0) / 1e9;
        kvb_conn_close(c);
        if (st) goto fail;
        fprintf(stderr, "bench link: round %d: raw %.3f GB/s, kvbridge transport %.3f GB/s\n", r + 1, raw[r], framed[r]);
    }
    {
        int fd = kvb_tcp_dial(host, port); /* tell the server to stop */
        uint64_t zero = 0;
        if (fd >= 0) {
            send_all(fd, &zero, 8);
            close(fd);
        }
    }
    double mr = kvb_median_sort(raw, reps), mf = kvb_median_sort(framed, reps);
    printf("link       %s, %.2f GiB per leg in %zu-byte pieces, %d rounds (medians)\n", addr, bytes / 1073741824.0,
           slab, reps);
    printf("raw TCP    %.3f GB/s\nkvbridge   %.3f GB/s (SLAB frames: header and slab head hashed, the slab checksum of K || V computed and verified, authenticated link)\n"
           "ratio      %.0f %% of the raw link\n",
           mr, mf, 100.0 * mf / mr);
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
    long long bytes = 1LL << 30, slab = 1 << 20, reps = 3;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 0;
        } else if (!strcmp(a, "--listen")) {
            if (!(listen = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--peer")) {
            if (!(peer = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--psk")) {
            if (!(psk = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--bytes")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1 << 20, 1LL << 40, &bytes))
                return 2;
        } else if (!strcmp(a, "--slab-bytes")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 4096, 1 << 26, &slab))
                return 2;
        } else if (!strcmp(a, "--reps")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, 100, &reps)) return 2;
        } else {
            fprintf(stderr, "kvbridge bench link: unknown option '%s' (see kvbridge bench link --help)\n", a);
            return 2;
        }
    }
    if (!listen == !peer || !psk || strlen(psk) < KVB_WIRE_PSK_MIN) {
        fprintf(stderr, "kvbridge bench link: give exactly one of --listen or --peer, and a key of >= %d bytes "
                        "(--psk or KVB_PSK)\n", KVB_WIRE_PSK_MIN);
        return 2;
    }
    return listen ? serve(listen, psk) : measure(peer, psk, (uint64_t)bytes, (size_t)slab, (int)reps);
}
