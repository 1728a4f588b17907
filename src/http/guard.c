/* guard.c — the listening socket and what stands between it and libmicrohttpd. MHD 0.9.75 closes
 * a connection whose request line is garbage without a word, answers other framing errors with
 * an HTML page, waits 120 s on a chunk size of FFFFFFFFFFFFFFFF, holds a thread for every idle or
 * trickling connection and drops new connections silently at its limit. So one thread here accepts
 * each connection and reads its request head with MSG_PEEK (nothing is consumed) until the head
 * is whole: a request line, headers and framing that break HTTP/1.1's rules get their 4xx (JSON in
 * OpenAI's error shape, Connection: close) at once; a head not whole within its deadline
 * (10 s unless configured) gets a 408. Only a whole, well-formed head is handed to MHD (MHD_add_connection), which then
 * reads it afresh, so idle and trickling clients never hold one of its threads. At the handoff, a
 * full house (max_connections in MHD) closes the connection kept alive idle the longest to make
 * room, or is a 503 with Retry-After when every one is serving a request; one client (by IP address)
 * may hold at most max_connections_per_client connections, waiting or served, before its next one
 * is a 503 too. After a refusal the guard reads and drops what the client still sends for a
 * moment before closing, so the close does not reset the connection under the answer. For a
 * chunked body, the chunk sizes that arrived with the head are checked too (a size over the body
 * limit is a 413 at once). Once MHD has a request, the guard also keeps its body deadline: a body
 * not whole 30 s (unless configured) after its head is answered 408 and the connection shut down.
 * Later requests on a kept-alive connection are MHD's alone (its own checks, its idle timeout).
 * Counted in /metrics: refused connections (503s) by reason, framing errors by status, deadlines,
 * and the open connections, waiting and serving. */
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "http_internal.h"

#define GUARD_PEEK_MAX (HTTP_HEAD_MAX + 4096) /* the head and the start of a chunked body */
#define GUARD_PENDING_MAX 4096    /* connections sending their head; more are 503s */
#define GUARD_LINGER_S 1.0        /* after a refusal, what the client still sends is dropped this long */
#define GUARD_CHUNK_WAIT_S 0.1    /* a chunked head waits this long for its first chunk size */
#define GUARD_TICK_MS 100
#define GUARD_TICK_PARTIAL_MS 20  /* while a part of some head waits: how soon its next bytes are seen */

typedef enum { PEND_HEAD = 0, PEND_LINGER } pend_state;

typedef struct {
    int fd;
    struct sockaddr_storage addr;
    socklen_t addr_len;
    double t_start;    /* accepted (PEND_HEAD) or refused (PEND_LINGER) */
    double t_head;     /* a chunked head was whole at this time (0: not yet) */
    size_t peeked;     /* bytes seen at the last look: a part of a head stays readable, so it is
                          looked at again each tick instead of being polled (which would spin) */
    pend_state state;
} guard_pending;

typedef struct {
    int fd;
    struct sockaddr_storage addr; /* the client's: per-client counts */
    double idle_since;            /* kept alive between requests since then; 0: a request is on it */
} guard_active;

struct http_guard {
    kvb_http_server *server;
    http_guard_limits limits;
    int listen_fd;
    int wake[2];                 /* a byte here ends the thread */
    pthread_t thread;
    bool thread_started;
    guard_pending *pending;      /* (GUARD_PENDING_MAX) */
    size_t n_pending;
    struct pollfd *polls;        /* (GUARD_PENDING_MAX + 2) */
    char peek[GUARD_PEEK_MAX];
    double shown_waiting, shown_serving; /* this guard's share of kvb_http_connections (a registry may be
                                            shared by several servers: it adds its changes) */
    pthread_mutex_t mu;          /* the fields below: MHD's threads close connections and bodies */
    guard_active *active;        /* (max_active) connections handed to MHD */
    size_t n_active;
    http_body_watch *bodies;     /* requests whose body is being read, oldest first */
};

/* ---- answers ------------------------------------------------------------------------------------ */

static const char *reason_phrase(int status) {
    switch (status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
    }
}

/* Writes e as a whole HTTP/1.1 response (JSON error, Connection: close) without blocking; a client
 * too slow to take a few hundred bytes loses it. */
static void send_error(int fd, const kvb_http_error *e) {
    char *json = http_error_json(e);
    char head[320];
    const int n = snprintf(head, sizeof head,
                           "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                           "Connection: close\r\n%s\r\n",
                           e->status, reason_phrase(e->status), json ? strlen(json) : 0,
                           e->status == 503 ? "Retry-After: 1\r\n" : "");
    http_buf b = {0};
    http_buf_append(&b, head, (size_t)n);
    if (json) http_buf_append_str(&b, json);
    if (!b.oom) (void)!send(fd, b.data, b.len, MSG_NOSIGNAL | MSG_DONTWAIT);
    http_buf_free(&b);
    cJSON_free(json);
}

static void count_refusal(kvb_http_server *s, const kvb_http_error *e, const char *reason) {
    char code[8];
    snprintf(code, sizeof code, "%d", e->status);
    if (e->status == 503) kvb_metric_add(s->m_refused, KVB_LABELS(reason), 1);
    else if (e->status == 408) kvb_metric_add(s->m_deadlines, KVB_LABELS("headers"), 1);
    else kvb_metric_add(s->m_framing, KVB_LABELS(code), 1);
}

/* Answers the pending connection p with e and lets it linger (its later bytes are read and dropped). */
static void refuse_pending(http_guard *g, guard_pending *p, const kvb_http_error *e, const char *reason) {
    send_error(p->fd, e);
    shutdown(p->fd, SHUT_WR);
    count_refusal(g->server, e, reason);
    kvb_log(KVB_LOG_DEBUG, "http: refused a connection: %d %s", e->status, e->message);
    p->state = PEND_LINGER;
    p->t_start = kvb_now_s();
}

/* ---- connections handed to MHD --------------------------------------------------------------------- */

static bool same_client(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr,
                      sizeof(struct in6_addr)) == 0;
    return true;
}

/* Connections of this client: waiting for their head here, and handed to MHD. */
static size_t client_connections(http_guard *g, const struct sockaddr_storage *addr) {
    size_t n = 0;
    for (size_t i = 0; i < g->n_pending; i++)
        n += g->pending[i].state == PEND_HEAD && same_client(&g->pending[i].addr, addr);
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->n_active; i++) n += same_client(&g->active[i].addr, addr);
    pthread_mutex_unlock(&g->mu);
    return n;
}

void http_guard_connection_closed(http_guard *g, int fd) {
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->n_active; i++)
        if (g->active[i].fd == fd) {
            g->active[i] = g->active[--g->n_active];
            break;
        }
    pthread_mutex_unlock(&g->mu);
}

void http_guard_connection_idle(http_guard *g, int fd, bool idle) {
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < g->n_active; i++)
        if (g->active[i].fd == fd) g->active[i].idle_since = idle ? kvb_now_s() : 0;
    pthread_mutex_unlock(&g->mu);
}

/* With every connection taken: the one kept alive idle the longest is shut down (MHD then closes
 * it; its client opens another when it has a request, as after any keep-alive timeout) and its
 * place is free. False when every connection is serving a request. With mu held. */
static bool evict_idle(http_guard *g) {
    size_t oldest = g->n_active;
    for (size_t i = 0; i < g->n_active; i++)
        if (g->active[i].idle_since > 0 && (oldest == g->n_active || g->active[i].idle_since < g->active[oldest].idle_since))
            oldest = i;
    if (oldest == g->n_active) return false;
    shutdown(g->active[oldest].fd, SHUT_RDWR); /* MHD closes the fd only after its NOTIFY_CLOSED, which waits for mu */
    g->active[oldest] = g->active[--g->n_active];
    kvb_metric_add(g->server->m_evicted, NULL, 1);
    return true;
}

/* A whole head: to MHD (making room by closing an idle kept-alive connection if need be), or a 503
 * when every connection is serving a request. Returns true when handed. */
static bool hand_off(http_guard *g, guard_pending *p) {
    kvb_http_error e;
    pthread_mutex_lock(&g->mu);
    const bool full = g->n_active >= g->limits.max_active && !evict_idle(g);
    if (!full) g->active[g->n_active++] = (guard_active){.fd = p->fd, .addr = p->addr};
    pthread_mutex_unlock(&g->mu);
    if (full) {
        http_error_set(&e, 503, "server_busy", NULL, "All %u connections of this server are serving requests; "
                       "retry in a moment.", g->limits.max_active);
        refuse_pending(g, p, &e, "capacity");
        return false;
    }
    const int fd = p->fd;
    if (MHD_add_connection(g->server->daemon, fd, (const struct sockaddr *)&p->addr, p->addr_len) != MHD_YES)
        http_guard_connection_closed(g, fd); /* MHD closed it */
    return true;
}

/* ---- requests whose body is being read ------------------------------------------------------------- */

void http_guard_body_begin(http_guard *g, http_body_watch *w, int fd) {
    pthread_mutex_lock(&g->mu);
    *w = (http_body_watch){.fd = fd, .deadline = kvb_now_s() + g->limits.body_timeout_s, .listed = true, .next = g->bodies};
    if (g->bodies) g->bodies->prev = w;
    g->bodies = w;
    pthread_mutex_unlock(&g->mu);
}

static void body_unlink(http_guard *g, http_body_watch *w) {
    if (!w->listed) return;
    if (w->prev) w->prev->next = w->next;
    else g->bodies = w->next;
    if (w->next) w->next->prev = w->prev;
    w->listed = false;
}

bool http_guard_body_end(http_guard *g, http_body_watch *w) {
    pthread_mutex_lock(&g->mu);
    body_unlink(g, w);
    const bool answered = w->killed;
    pthread_mutex_unlock(&g->mu);
    return !answered;
}

/* Bodies past their deadline: a 408, and the connection shut down (MHD then closes it). */
static void body_deadlines(http_guard *g, double now) {
    pthread_mutex_lock(&g->mu);
    for (http_body_watch *w = g->bodies, *next; w; w = next) {
        next = w->next;
        if (now < w->deadline) continue;
        kvb_http_error e;
        http_error_set(&e, 408, NULL, NULL, "The request body did not arrive within %.0f s.", g->limits.body_timeout_s);
        send_error(w->fd, &e);
        shutdown(w->fd, SHUT_RDWR);
        w->killed = true;
        body_unlink(g, w);
        kvb_metric_add(g->server->m_deadlines, KVB_LABELS("body"), 1);
    }
    pthread_mutex_unlock(&g->mu);
}

/* ---- the thread ------------------------------------------------------------------------------------ */

static void accept_new(http_guard *g) {
    for (;;) {
        guard_pending p = {.addr_len = sizeof p.addr, .t_start = kvb_now_s()};
        p.fd = accept4(g->listen_fd, (struct sockaddr *)&p.addr, &p.addr_len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (p.fd < 0) return; /* EAGAIN: all taken; EMFILE and the like: the next tick tries again */
        kvb_http_error e;
        if (g->n_pending == GUARD_PENDING_MAX) { /* no room even to linger: answer and close */
            http_error_set(&e, 503, "server_busy", NULL, "Too many connections are waiting; retry in a moment.");
            send_error(p.fd, &e);
            kvb_metric_add(g->server->m_refused, KVB_LABELS("waiting"), 1);
            close(p.fd);
            continue;
        }
        const size_t mine = client_connections(g, &p.addr);
        guard_pending *slot = &g->pending[g->n_pending++];
        *slot = p;
        if (mine >= g->limits.max_per_client) {
            http_error_set(&e, 503, "too_many_connections", NULL, "This client has %zu connections open, the most "
                           "one client may; reuse one (keep-alive) or retry in a moment.", mine);
            refuse_pending(g, slot, &e, "per_client");
        }
    }
}

/* One pending connection: what poll said of it (revents), or only that its time may be up.
 * Returns false when it is done with (closed or handed to MHD). */
static bool serve_pending(http_guard *g, guard_pending *p, short revents, double now) {
    const bool readable = revents != 0;
    if (p->state == PEND_LINGER) {
        char drop[4096];
        ssize_t n = readable ? recv(p->fd, drop, sizeof drop, MSG_DONTWAIT) : -1;
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ||
            now - p->t_start > GUARD_LINGER_S) {
            close(p->fd);
            return false;
        }
        return true;
    }
    kvb_http_error e;
    int avail = -1; /* a part already seen and nothing new: no need to look again */
    if (!readable && p->peeked && ioctl(p->fd, FIONREAD, &avail) == 0 && (size_t)avail == p->peeked) avail = -2;
    if (readable || (p->peeked && avail != -2)) {
        ssize_t n = recv(p->fd, g->peek, sizeof g->peek, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            close(p->fd); /* gone before its head was whole */
            return false;
        }
        p->peeked = n > 0 ? (size_t)n : p->peeked;
        http_head h;
        const int r = n > 0 ? http_head_check(g->peek, (size_t)n, &h, &e) : 0;
        if (r == 0 && (revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            close(p->fd); /* it stopped sending before its head was whole */
            return false;
        }
        if (r < 0) {
            refuse_pending(g, p, &e, "framing");
            return true;
        }
        if (r > 0 && h.chunked) { /* the sizes that came with the head */
            const int c = http_chunks_check(g->peek + h.head_len, (size_t)n - h.head_len, g->server->max_body_bytes, &e);
            if (c < 0) {
                refuse_pending(g, p, &e, "framing");
                return true;
            }
            if (!p->t_head) p->t_head = now;
            if (c == 0 && (size_t)n < sizeof g->peek && now - p->t_head < GUARD_CHUNK_WAIT_S) return true;
        }
        if (r > 0) return !hand_off(g, p);
    }
    if (p->t_head && now - p->t_head >= GUARD_CHUNK_WAIT_S) return !hand_off(g, p);
    if (now - p->t_start > g->limits.header_timeout_s) {
        http_error_set(&e, 408, NULL, NULL, "The request's headers did not arrive within %.0f s.", g->limits.header_timeout_s);
        refuse_pending(g, p, &e, "deadline");
    }
    return true;
}

static void *guard_main(void *arg) {
    http_guard *g = arg;
    for (;;) {
        g->polls[0] = (struct pollfd){.fd = g->wake[0], .events = POLLIN};
        g->polls[1] = (struct pollfd){.fd = g->listen_fd, .events = POLLIN};
        for (size_t i = 0; i < g->n_pending; i++) { /* a part of a head already seen: only its hang-up */
            const guard_pending *p = &g->pending[i];
            g->polls[i + 2] = (struct pollfd){.fd = p->fd, .events = p->state == PEND_HEAD && p->peeked ? POLLRDHUP : POLLIN};
        }
        const size_t n_polled = g->n_pending;
        bool partial = false;
        for (size_t i = 0; i < n_polled && !partial; i++) partial = g->polls[i + 2].events == POLLRDHUP;
        const int ready = poll(g->polls, n_polled + 2, partial ? GUARD_TICK_PARTIAL_MS : GUARD_TICK_MS);
        if (ready < 0 && errno != EINTR) break;
        if (g->polls[0].revents) break;
        const double now = kvb_now_s();
        size_t kept = 0;
        for (size_t i = 0; i < n_polled; i++) { /* in order, compacting */
            guard_pending p = g->pending[i];
            if (serve_pending(g, &p, g->polls[i + 2].revents, now)) g->pending[kept++] = p;
        }
        memmove(g->pending + kept, g->pending + n_polled, (g->n_pending - n_polled) * sizeof *g->pending);
        g->n_pending = kept + (g->n_pending - n_polled);
        if (g->polls[1].revents) accept_new(g);
        body_deadlines(g, now);
        size_t waiting = 0;
        for (size_t i = 0; i < g->n_pending; i++) waiting += g->pending[i].state == PEND_HEAD;
        pthread_mutex_lock(&g->mu);
        const size_t serving = g->n_active;
        pthread_mutex_unlock(&g->mu);
        kvb_metric_add(g->server->m_connections, KVB_LABELS("waiting"), (double)waiting - g->shown_waiting);
        kvb_metric_add(g->server->m_connections, KVB_LABELS("serving"), (double)serving - g->shown_serving);
        g->shown_waiting = (double)waiting;
        g->shown_serving = (double)serving;
    }
    return NULL;
}

/* ---- lifetime ---------------------------------------------------------------------------------------- */

kvb_status http_guard_start(kvb_http_server *s, const struct sockaddr_storage *addr, const http_guard_limits *limits,
                            http_guard **out, kvb_err *err) {
    *out = NULL;
    http_guard *g = calloc(1, sizeof *g);
    if (!g) return kvb_err_set(err, KVB_ERR_NOMEM, "http: out of memory");
    g->server = s;
    g->limits = *limits;
    g->listen_fd = g->wake[0] = g->wake[1] = -1;
    pthread_mutex_init(&g->mu, NULL);
    g->pending = calloc(GUARD_PENDING_MAX, sizeof *g->pending);
    g->polls = calloc(GUARD_PENDING_MAX + 2, sizeof *g->polls);
    g->active = calloc(limits->max_active, sizeof *g->active);
    kvb_status st = KVB_OK;
    if (!g->pending || !g->polls || !g->active) st = kvb_err_set(err, KVB_ERR_NOMEM, "http: out of memory");
    const socklen_t len = addr->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    const int one = 1;
    if (!st && ((g->listen_fd = socket(addr->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0 ||
                setsockopt(g->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
                bind(g->listen_fd, (const struct sockaddr *)addr, len) != 0 || listen(g->listen_fd, 1024) != 0))
        st = kvb_err_set(err, KVB_ERR_IO, "http: cannot listen (%s)", strerror(errno));
    if (!st && pipe2(g->wake, O_CLOEXEC | O_NONBLOCK) != 0) st = kvb_err_set(err, KVB_ERR_IO, "http: pipe: %s", strerror(errno));
    if (!st) { /* published before the thread starts: a connection it hands on reaches the server's
                  callbacks at once, and they read *out (the server's guard) */
        *out = g;
        g->thread_started = true;
        if (pthread_create(&g->thread, NULL, guard_main, g) != 0) {
            *out = NULL;
            g->thread_started = false;
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "http: cannot start the accepting thread");
        }
    }
    if (st) {
        http_guard_free(g);
        return st;
    }
    return KVB_OK;
}

uint16_t http_guard_port(const http_guard *g) {
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    if (!g || getsockname(g->listen_fd, (struct sockaddr *)&a, &len) != 0) return 0;
    return ntohs(a.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&a)->sin6_port : ((struct sockaddr_in *)&a)->sin_port);
}

void http_guard_stop_accepting(http_guard *g) {
    if (!g || !g->thread_started) return;
    (void)!write(g->wake[1], "x", 1);
    pthread_join(g->thread, NULL);
    g->thread_started = false;
    kvb_metric_add(g->server->m_connections, KVB_LABELS("waiting"), -g->shown_waiting); /* gone with it */
    kvb_metric_add(g->server->m_connections, KVB_LABELS("serving"), -g->shown_serving);
    g->shown_waiting = g->shown_serving = 0;
    for (size_t i = 0; i < g->n_pending; i++) close(g->pending[i].fd);
    g->n_pending = 0;
    close(g->listen_fd);
    g->listen_fd = -1;
}

void http_guard_free(http_guard *g) {
    if (!g) return;
    http_guard_stop_accepting(g);
    if (g->listen_fd >= 0) close(g->listen_fd);
    if (g->wake[0] >= 0) close(g->wake[0]);
    if (g->wake[1] >= 0) close(g->wake[1]);
    pthread_mutex_destroy(&g->mu);
    free(g->pending);
    free(g->polls);
    free(g->active);
    free(g);
}
