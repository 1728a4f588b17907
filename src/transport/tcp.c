/* transport/tcp.c — the TCP backend: "HOST:PORT" addresses, a non-blocking listener (several
 * threads may accept on it), blocking connected sockets driven with MSG_DONTWAIT and poll() so
 * every call honours its deadline (a stalled peer is a timeout, never a hang), TCP_NODELAY, large
 * socket buffers, MSG_NOSIGNAL instead of SIGPIPE, frames sent as one gather write (header +
 * payload pieces, no copy) and received with the next frame's header read ahead with each payload. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport_internal.h"

/* Socket buffer size asked for on both ends (the kernel caps it at net.core.{r,w}mem_max). */
#define TCP_SOCKET_BUFFER_BYTES (4 << 20)

typedef struct {
    kvb_link base;
    int fd;
    /* the start of the next frame's header, read together with the previous frame's payload
     * (tcp_recv_frame asks for both in one recvmsg): (ahead_n) bytes */
    uint8_t ahead[KVB_WIRE_HEADER_BYTES];
    size_t ahead_n;
} tcp_link;

typedef struct {
    kvb_link_listener base;
    int fd;
    char addr[96];
} tcp_listener;

/* Splits "HOST:PORT" / "[V6]:PORT" into host (empty -> NULL) and port. */
kvb_status wire_parse_addr(const char *addr, char *host, size_t host_cap, char *port, size_t port_cap, kvb_err *err) {
    if (!addr || !*addr) return kvb_err_set(err, KVB_ERR_INVALID, "address is empty (expected HOST:PORT)");
    const char *colon, *h0 = addr, *h1;
    if (addr[0] == '[') {
        const char *close = strchr(addr, ']');
        if (!close || close[1] != ':')
            return kvb_err_set(err, KVB_ERR_INVALID, "address \"%s\": expected [IPV6]:PORT", addr);
        h0 = addr + 1;
        h1 = close;
        colon = close + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon) return kvb_err_set(err, KVB_ERR_INVALID, "address \"%s\": expected HOST:PORT", addr);
        h1 = colon;
    }
    size_t hn = (size_t)(h1 - h0), pn = strlen(colon + 1);
    if (hn >= host_cap || pn == 0 || pn >= port_cap || pn > 5)
        return kvb_err_set(err, KVB_ERR_INVALID, "address \"%s\": bad host or port", addr);
    unsigned long v = 0;
    for (size_t i = 0; i < pn; i++) {
        char c = colon[1 + i];
        if (c < '0' || c > '9') return kvb_err_set(err, KVB_ERR_INVALID, "address \"%s\": port is not a number", addr);
        v = v * 10 + (unsigned long)(c - '0');
    }
    if (v > 65535) return kvb_err_set(err, KVB_ERR_INVALID, "address \"%s\": port %lu is out of range", addr, v);
    memcpy(host, h0, hn);
    host[hn] = 0;
    if (hn == 1 && host[0] == '*') host[0] = 0;
    memcpy(port, colon + 1, pn + 1);
    return KVB_OK;
}

void wire_format_sockaddr(const struct sockaddr *sa, char *buf, size_t cap) {
    char ip[INET6_ADDRSTRLEN] = "?";
    unsigned port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
        port = ntohs(in->sin_port);
        snprintf(buf, cap, "%s:%u", ip, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof ip);
        port = ntohs(in6->sin6_port);
        snprintf(buf, cap, "[%s]:%u", ip, port);
    } else {
        snprintf(buf, cap, "?");
    }
}

/* The kernel's cap on an explicit buffer size (net.core.rmem_max / wmem_max), 0 if unreadable. */
static long read_sysctl(const char *path) {
    FILE *f = fopen(path, "r");
    long v = 0;
    if (f) {
        if (fscanf(f, "%ld", &v) != 1) v = 0;
        fclose(f);
    }
    return v;
}

/* TCP_NODELAY always. Buffer sizes only where the kernel lets us have the size asked for: an
 * explicit size switches autotuning off, and on a host with the default caps (about 208 KiB)
 * autotuning (up to net.ipv4.tcp_{r,w}mem max, 4-6 MiB by default) is the larger buffer. */
static void tune_socket(int fd) {
    static _Atomic int snd_ok = -1, rcv_ok = -1; /* -1: not read yet (a race reads twice, harmlessly) */
    if (atomic_load(&snd_ok) < 0) atomic_store(&snd_ok, read_sysctl("/proc/sys/net/core/wmem_max") >= TCP_SOCKET_BUFFER_BYTES);
    if (atomic_load(&rcv_ok) < 0) atomic_store(&rcv_ok, read_sysctl("/proc/sys/net/core/rmem_max") >= TCP_SOCKET_BUFFER_BYTES);
    int one = 1, bytes = TCP_SOCKET_BUFFER_BYTES;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (atomic_load(&snd_ok) == 1) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    if (atomic_load(&rcv_ok) == 1) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

/* Waits for events on fd until the deadline: KVB_OK when ready, KVB_ERR_TIMEOUT ("timed out") else. */
static kvb_status wait_fd(int fd, short events, double deadline, const char *what, const char *peer, kvb_err *err) {
    const atomic_bool *cancel = wire_thread_cancel();
    for (;;) {
        int ms = wire_ms_left(deadline);
        if (ms == 0) return kvb_err_set(err, KVB_ERR_TIMEOUT, "%s %s: timed out", what, peer);
        if (cancel && atomic_load(cancel))
            return kvb_err_set(err, KVB_ERR_CANCELLED, "%s %s: cancelled", what, peer);
        if (cancel && ms > WIRE_CANCEL_POLL_MS) ms = WIRE_CANCEL_POLL_MS;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, ms);
        if (r > 0) return KVB_OK; /* readable, writable or an error the next call reports */
        if (r < 0 && errno != EINTR) return kvb_err_set(err, KVB_ERR_IO, "%s %s: poll: %s", what, peer, strerror(errno));
    }
}

static kvb_status tcp_listen(const char *addr, kvb_link_listener **out, kvb_err *err) {
    char host[256], port[8];
    kvb_status st = wire_parse_addr(addr, host, sizeof host, port, sizeof port, err);
    if (st) return st;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    int gai = getaddrinfo(host[0] ? host : NULL, port, &hints, &res);
    if (gai) return kvb_err_set(err, KVB_ERR_IO, "listen on %s: %s", addr, gai_strerror(gai));
    int fd = -1, last_errno = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        tune_socket(fd); /* accepted sockets inherit the buffer sizes */
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 128) == 0) break;
        last_errno = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) return kvb_err_set(err, KVB_ERR_IO, "listen on %s: %s", addr, strerror(last_errno));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
        int e = errno;
        close(fd);
        return kvb_err_set(err, KVB_ERR_IO, "listen on %s: getsockname: %s", addr, strerror(e));
    }
    tcp_listener *l = calloc(1, sizeof *l);
    if (!l) {
        close(fd);
        return kvb_err_set(err, KVB_ERR_NOMEM, "listen on %s: out of memory", addr);
    }
    l->base.backend = &kvb_wire_backend_tcp;
    l->base.port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                  : ((struct sockaddr_in *)&ss)->sin_port);
    l->fd = fd;
    snprintf(l->addr, sizeof l->addr, "%s", addr);
    *out = &l->base;
    return KVB_OK;
}

static kvb_status new_link(int fd, const struct sockaddr *peer, kvb_link **out, kvb_err *err) {
    tcp_link *t = calloc(1, sizeof *t);
    if (!t) {
        close(fd);
        return kvb_err_set(err, KVB_ERR_NOMEM, "tcp: out of memory");
    }
    t->base.backend = &kvb_wire_backend_tcp;
    wire_format_sockaddr(peer, t->base.peer_addr, sizeof t->base.peer_addr);
    t->fd = fd;
    *out = &t->base;
    return KVB_OK;
}

static kvb_status tcp_accept(kvb_link_listener *base, double deadline, kvb_link **out, kvb_err *err) {
    tcp_listener *l = (tcp_listener *)base;
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(l->fd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC);
        if (fd >= 0) {
            tune_socket(fd);
            return new_link(fd, (struct sockaddr *)&ss, out, err);
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return kvb_err_set(err, KVB_ERR_IO, "accept on %s: %s", l->addr, strerror(errno));
        kvb_status st = wait_fd(l->fd, POLLIN, deadline, "waiting for a connection on", l->addr, err);
        if (st) return st;
    }
}

static void tcp_listener_close(kvb_link_listener *base) {
    if (!base) return;
    tcp_listener *l = (tcp_listener *)base;
    close(l->fd);
    free(l);
}

static kvb_status tcp_connect(const char *addr, double deadline, kvb_link **out, kvb_err *err) {
    char host[256], port[8];
    kvb_status st = wire_parse_addr(addr, host, sizeof host, port, sizeof port, err);
    if (st) return st;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int gai = getaddrinfo(host[0] ? host : "localhost", port, &hints, &res);
    if (gai) return kvb_err_set(err, KVB_ERR_PEER_GONE, "connect to %s: %s", addr, gai_strerror(gai));
    kvb_err last = {0};
    kvb_err_set(&last, KVB_ERR_PEER_GONE, "connect to %s: no address", addr);
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            kvb_err_set(&last, KVB_ERR_IO, "connect to %s: socket: %s", addr, strerror(errno));
            continue;
        }
        tune_socket(fd);
        int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (r != 0 && errno == EINPROGRESS) {
            if (wait_fd(fd, POLLOUT, deadline, "connect to", addr, &last) != KVB_OK) {
                close(fd);
                break; /* the deadline is spent: do not try further addresses */
            }
            int soerr = 0;
            socklen_t sl = sizeof soerr;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
            r = soerr ? -1 : 0;
            errno = soerr;
        }
        if (r != 0) {
            /* refused, reset, unreachable: no connection can be made now */
            kvb_err_set(&last, KVB_ERR_PEER_GONE, "connect to %s: %s", addr, strerror(errno));
            close(fd);
            continue;
        }
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK); /* blocking; every call uses MSG_DONTWAIT + poll */
        st = new_link(fd, ai->ai_addr, out, err);
        freeaddrinfo(res);
        return st;
    }
    freeaddrinfo(res);
    if (err) *err = last;
    return last.code;
}

static kvb_status io_error(const char *what, const char *peer, int e, kvb_err *err) {
    if (e == EPIPE || e == ECONNRESET)
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: the peer closed the connection", what, peer);
    if (e == ECONNABORTED || e == ENOTCONN || e == ETIMEDOUT || e == EHOSTUNREACH || e == ENETUNREACH)
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: %s", what, peer, strerror(e));
    return kvb_err_set(err, KVB_ERR_IO, "%s %s: %s", what, peer, strerror(e));
}

static kvb_status tcp_send_frame(kvb_link *base, const uint8_t header[KVB_WIRE_HEADER_BYTES], const kvb_iov *iov,
                                 int n_iov, double deadline, kvb_err *err) {
    tcp_link *t = (tcp_link *)base;
    struct iovec v[4];
    int nv = 0;
    v[nv++] = (struct iovec){.iov_base = (void *)header, .iov_len = KVB_WIRE_HEADER_BYTES};
    if (n_iov < 0 || n_iov > 3) return kvb_err_set(err, KVB_ERR_INVALID, "send: %d payload pieces (at most 3)", n_iov);
    for (int i = 0; i < n_iov; i++)
        if (iov[i].len) v[nv++] = (struct iovec){.iov_base = (void *)iov[i].data, .iov_len = iov[i].len};
    int first = 0;
    while (first < nv) {
        struct msghdr msg = {.msg_iov = v + first, .msg_iovlen = (size_t)(nv - first)};
        ssize_t w = sendmsg(t->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                kvb_status st = wait_fd(t->fd, POLLOUT, deadline, "send to", t->base.peer_addr, err);
                if (st) return st;
                continue;
            }
            return io_error("send to", t->base.peer_addr, errno, err);
        }
        size_t done = (size_t)w;
        while (first < nv && done >= v[first].iov_len) done -= v[first++].iov_len;
        if (first < nv) {
            v[first].iov_base = (uint8_t *)v[first].iov_base + done;
            v[first].iov_len -= done;
        }
    }
    return KVB_OK;
}

/* Receives exactly n bytes into dst; with read_ahead, each receive also asks for the next frame's
 * header (into t->ahead, up to its size, once dst is full): one system call per frame instead of
 * two when the sender is ahead, as it is while slabs stream. */
static kvb_status recv_exact(tcp_link *t, uint8_t *dst, size_t n, bool read_ahead, double deadline, const char *what,
                             kvb_err *err) {
    size_t got = 0;
    while (got < n) {
        struct iovec v[2] = {{.iov_base = dst + got, .iov_len = n - got},
                             {.iov_base = t->ahead, .iov_len = sizeof t->ahead}};
        struct msghdr msg = {.msg_iov = v, .msg_iovlen = read_ahead ? 2 : 1};
        ssize_t r = recvmsg(t->fd, &msg, MSG_DONTWAIT);
        if (r > 0) {
            if ((size_t)r > n - got) { /* the rest went into the next header */
                t->ahead_n = (size_t)r - (n - got);
                r = (ssize_t)(n - got);
            }
            got += (size_t)r;
            continue;
        }
        if (r == 0) {
            return kvb_err_set(err, KVB_ERR_PEER_GONE, "receive from %s: the peer closed the connection (%s, %zu of %zu bytes)",
                               t->base.peer_addr, what, got, n);
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            kvb_status st = wait_fd(t->fd, POLLIN, deadline, "receive from", t->base.peer_addr, err);
            if (st == KVB_ERR_TIMEOUT)
                return kvb_err_set(err, KVB_ERR_TIMEOUT, "receive from %s: timed out (%s, %zu of %zu bytes)",
                                   t->base.peer_addr, what, got, n);
            if (st) return st;
            continue;
        }
        return io_error("receive from", t->base.peer_addr, errno, err);
    }
    return KVB_OK;
}

static kvb_status tcp_recv_frame(kvb_link *base, uint64_t max_payload, kvb_frame_header *hdr, kvb_wire_buf *buf,
                                 kvb_wire_loan *loan, double deadline, kvb_err *err) {
    (void)loan; /* nothing is lent: payloads are read into buf */
    tcp_link *t = (tcp_link *)base;
    uint8_t h[KVB_WIRE_HEADER_BYTES];
    const size_t had = t->ahead_n; /* read with the last payload */
    memcpy(h, t->ahead, had);
    t->ahead_n = 0;
    kvb_status st = had < sizeof h ? recv_exact(t, h + had, sizeof h - had, false, deadline, "frame header", err) : KVB_OK;
    if (st) return st;
    st = kvb_wire_header_decode(h, max_payload, hdr, err);
    if (st) return st;
    if (hdr->payload_len > SIZE_MAX) return kvb_err_set(err, KVB_ERR_RANGE, "payload does not fit in memory");
    st = kvb_wire_buf_reserve(buf, (size_t)hdr->payload_len, err); /* only after the length passed the limit */
    if (st) return st;
    return recv_exact(t, buf->data, (size_t)hdr->payload_len, true, deadline, kvb_frame_type_name(hdr->type), err);
}

static void tcp_shutdown(kvb_link *base) {
    tcp_link *t = (tcp_link *)base;
    shutdown(t->fd, SHUT_RDWR);
}

static void tcp_close(kvb_link *base) {
    if (!base) return;
    tcp_link *t = (tcp_link *)base;
    close(t->fd);
    free(t);
}

const kvb_wire_backend kvb_wire_backend_tcp = {
    .name = "tcp",
    .listen = tcp_listen,
    .accept = tcp_accept,
    .listener_close = tcp_listener_close,
    .connect = tcp_connect,
    .send_frame = tcp_send_frame,
    .recv_frame = tcp_recv_frame,
    .shutdown = tcp_shutdown,
    .close = tcp_close,
};
