/* node/http_client.c — a minimal blocking HTTP/1.1 client for kvbridge's own tools (the demo,
 * the ladder benchmark, tests, the llama-server front door): one POST (or GET) with Connection:
 * close, the reply read with a deadline until its Content-Length is in (as a keep-alive client has
 * it; without one, until the server closes), status line, X-KVBridge header and body returned. Not
 * a general-purpose client. */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvb_node.h"

void kvb_http_reply_free(kvb_http_reply *r) {
    free(r->body);
    r->body = NULL;
}

static int wait_fd(int fd, short ev, double deadline) {
    int ms = (int)((deadline - kvb_now_s()) * 1000);
    if (ms <= 0) return 0;
    struct pollfd p = {.fd = fd, .events = ev};
    return poll(&p, 1, ms);
}

/* The value (leading spaces skipped) of the header `name` (case-insensitive, without the colon) in
 * a reply head whose lines end before `end`, or NULL. */
static const char *header_value(const char *head, const char *end, const char *name) {
    const size_t nl = strlen(name);
    for (const char *line = strstr(head, "\r\n"); line && line < end; line = strstr(line + 2, "\r\n"))
        if (!strncasecmp(line + 2, name, nl) && line[2 + nl] == ':') {
            const char *v = line + 3 + nl;
            while (*v == ' ') v++;
            return v;
        }
    return NULL;
}

int kvb_tcp_dial(const char *host, const char *port) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, port, &hints, &ai) != 0 || !ai) return -1;
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

/* One request: POST with the JSON body, or GET when json is NULL. */
static kvb_status http_call(const char *host, uint16_t port, const char *path, const char *json, int timeout_ms,
                            kvb_http_reply *out, kvb_err *err) {
    memset(out, 0, sizeof *out);
    double deadline = kvb_now_s() + timeout_ms / 1000.0;
    char portstr[8];
    snprintf(portstr, sizeof portstr, "%u", port);
    int fd = kvb_tcp_dial(host, portstr);
    if (fd < 0) return kvb_err_set(err, KVB_ERR_IO, "cannot connect to %s:%u: %s", host, port, strerror(errno));
    size_t jl = json ? strlen(json) : 0, hl;
    char head[512];
    if (json)
        hl = (size_t)snprintf(head, sizeof head,
                              "POST %s HTTP/1.1\r\nHost: %s:%u\r\nContent-Type: application/json\r\nContent-Length: "
                              "%zu\r\nConnection: close\r\n\r\n",
                              path, host, port, jl);
    else
        hl = (size_t)snprintf(head, sizeof head, "GET %s HTTP/1.1\r\nHost: %s:%u\r\nConnection: close\r\n\r\n", path,
                              host, port);
    const char *parts[2] = {head, json ? json : ""};
    size_t lens[2] = {hl, jl};
    for (int i = 0; i < 2; i++)
        for (size_t off = 0; off < lens[i];) {
            if (wait_fd(fd, POLLOUT, deadline) <= 0) goto timeout;
            ssize_t k = send(fd, parts[i] + off, lens[i] - off, MSG_NOSIGNAL);
            if (k <= 0) {
                close(fd);
                return kvb_err_set(err, KVB_ERR_IO, "sending to %s:%u failed", host, port);
            }
            off += (size_t)k;
        }
    size_t cap = 1 << 16, len = 0, want = SIZE_MAX; /* want: the whole reply's bytes, once known */
    char *buf = malloc(cap);
    while (len < want) {
        if (!buf) break;
        if (len + 1 >= cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) break;
            buf = nb;
        }
        if (wait_fd(fd, POLLIN, deadline) <= 0) {
            free(buf);
            goto timeout;
        }
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k < 0) break;
        if (k == 0) break;
        len += (size_t)k;
        buf[len] = 0;
        const char *end = want == SIZE_MAX ? strstr(buf, "\r\n\r\n") : NULL;
        const char *cl = end ? header_value(buf, end, "Content-Length") : NULL;
        unsigned long long body_len; /* the head is in: a Content-Length says when the reply is complete */
        if (cl && sscanf(cl, "%llu", &body_len) == 1 && body_len < ((size_t)1 << 40))
            want = (size_t)(end + 4 - buf) + (size_t)body_len;
    }
    close(fd);
    if (!buf) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    buf[len] = 0;
    char *body = strstr(buf, "\r\n\r\n");
    if (!body || sscanf(buf, "HTTP/1.%*d %d", &out->status) != 1) {
        free(buf);
        return kvb_err_set(err, KVB_ERR_FORMAT, "malformed HTTP reply from %s:%u", host, port);
    }
    *body = 0;
    const char *v = header_value(buf, body, "X-KVBridge");
    if (v) {
        size_t k = strcspn(v, "\r\n");
        snprintf(out->verdict, sizeof out->verdict, "%.*s", (int)(k < sizeof out->verdict ? k : sizeof out->verdict - 1), v);
    }
    out->body_len = len - (size_t)(body + 4 - buf);
    out->body = malloc(out->body_len + 1);
    if (!out->body) {
        free(buf);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    }
    memcpy(out->body, body + 4, out->body_len + 1);
    free(buf);
    return KVB_OK;
timeout:
    close(fd);
    return kvb_err_set(err, KVB_ERR_IO, "no reply from %s:%u within %d ms", host, port, timeout_ms);
}

kvb_status kvb_http_post(const char *host, uint16_t port, const char *path, const char *json, int timeout_ms,
                         kvb_http_reply *out, kvb_err *err) {
    return http_call(host, port, path, json, timeout_ms, out, err);
}

kvb_status kvb_http_get(const char *host, uint16_t port, const char *path, int timeout_ms, kvb_http_reply *out,
                        kvb_err *err) {
    return http_call(host, port, path, NULL, timeout_ms, out, err);
}
