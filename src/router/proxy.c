/* proxy.c — one request through the router: placed (placement.c), sent byte for byte to the
 * backend with libcurl (connections kept alive in a pool shared by every call), and its reply passed
 * back. A 200 text/event-stream reply is passed on event by event as it arrives (whole "\n\n"-ended
 * events only, so an error event appended after a cut is a well-formed event); any other reply is
 * read whole and passed on with its status, Content-Type and X-KVBridge. Both get
 * X-KVBridge-Backend and X-KVBridge-Placement. Until the first byte has been passed on, a failure
 * (refused or unreachable, no reply head within first_byte_timeout_ms, a 503, the connection
 * breaking) sends the same request to the next backend, up to `retries` times; after it, a failure
 * ends the client's stream with an SSE error event and is never retried. A client that leaves
 * aborts the upstream request (the backend stops decoding). */
#include <ctype.h>
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "router_internal.h"

typedef enum { ATTEMPT_DONE = 0, ATTEMPT_RETRY, ATTEMPT_GONE } attempt_result;

typedef struct {
    kvb_router *r;
    kvb_completion_out *out;
    size_t backend;
    router_place_kind place;
    long status;             /* the reply's, 0 before its status line */
    char content_type[128];
    char verdict[KVB_VERDICT_MAX];
    bool sse;                /* a 200 event stream: passed on as it comes */
    bool passed;             /* the reply began at the client: no retry from here */
    bool client_gone;
    bool timed_out;          /* no reply head within the first-byte timeout */
    double head_deadline;
    kvb_strbuf buf;          /* reply bytes not passed on: all of a whole reply; a stream's partial event */
} upstream_call;

/* ---- the reply, as it comes ------------------------------------------------------------------- */

/* Copies a header's value (spaces and CRLF trimmed) when line is "name: value". */
static bool header_is(const char *line, size_t n, const char *name, char *dst, size_t cap) {
    const size_t nl = strlen(name);
    if (n <= nl || line[nl] != ':' || strncasecmp(line, name, nl) != 0) return false;
    const char *v = line + nl + 1, *end = line + n;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ')) end--;
    const size_t len = (size_t)(end - v) < cap - 1 ? (size_t)(end - v) : cap - 1;
    memcpy(dst, v, len);
    dst[len] = 0;
    return true;
}

static size_t on_header(char *line, size_t size, size_t nitems, void *ud) {
    upstream_call *c = ud;
    const size_t n = size * nitems;
    if (n > 5 && strncmp(line, "HTTP/", 5) == 0) { /* a status line: a new head */
        const char *sp = memchr(line, ' ', n);
        c->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        c->content_type[0] = c->verdict[0] = 0;
        return n;
    }
    if (!header_is(line, n, "Content-Type", c->content_type, sizeof c->content_type))
        header_is(line, n, "X-KVBridge", c->verdict, sizeof c->verdict);
    return n;
}

/* Begins the client's reply with the upstream's status and headers and the router's own two. */
static kvb_status begin_reply(upstream_call *c) {
    const char *h[2 * 6];
    size_t n = 0;
    h[2 * n] = "Content-Type", h[2 * n + 1] = c->content_type[0] ? c->content_type : "application/json", n++;
    if (c->verdict[0]) h[2 * n] = "X-KVBridge", h[2 * n + 1] = c->verdict, n++;
    if (c->sse) {
        h[2 * n] = "Cache-Control", h[2 * n + 1] = "no-cache", n++;
        h[2 * n] = "X-Accel-Buffering", h[2 * n + 1] = "no", n++;
    }
    h[2 * n] = "X-KVBridge-Backend", h[2 * n + 1] = c->r->backends[c->backend].name, n++;
    h[2 * n] = "X-KVBridge-Placement", h[2 * n + 1] = router_place_names[c->place], n++;
    kvb_status st = kvb_completion_relay_begin(c->out, (int)c->status, h, n);
    if (st == KVB_OK) c->passed = true;
    return st;
}

/* The end of the last whole event in b[0 .. n) ("\n\n"), 0 when none. */
static size_t whole_events(const char *b, size_t n) {
    for (size_t i = n; i >= 2; i--)
        if (b[i - 1] == '\n' && b[i - 2] == '\n') return i;
    return 0;
}

static size_t on_body(char *p, size_t size, size_t nmemb, void *ud) {
    upstream_call *c = ud;
    const size_t n = size * nmemb;
    if (!c->passed && !c->sse)
        c->sse = c->status == 200 && strncasecmp(c->content_type, "text/event-stream", 17) == 0;
    kvb_strbuf_putn(&c->buf, p, n);
    if (c->buf.oom) return 0;
    if (!c->sse) return n;
    const size_t cut = whole_events(c->buf.p, c->buf.n);
    if (!cut) return n;
    if ((!c->passed && begin_reply(c) != KVB_OK) || kvb_completion_relay_write(c->out, c->buf.p, cut) != KVB_OK) {
        c->client_gone = true;
        return 0; /* aborts the upstream request */
    }
    memmove(c->buf.p, c->buf.p + cut, c->buf.n - cut);
    c->buf.n -= cut;
    c->buf.p[c->buf.n] = 0;
    return n;
}

static int on_progress(void *ud, curl_off_t dl_total, curl_off_t dl_now, curl_off_t ul_total, curl_off_t ul_now) {
    (void)dl_total, (void)dl_now, (void)ul_total, (void)ul_now;
    upstream_call *c = ud;
    if (kvb_completion_cancelled(c->out)) {
        c->client_gone = true;
        return 1;
    }
    if (!c->status && kvb_now_s() > c->head_deadline) {
        c->timed_out = true;
        return 1;
    }
    return 0;
}

/* ---- one attempt ------------------------------------------------------------------------------ */

/* base + path with every byte outside [A-Za-z0-9/-._~:@+] percent-encoded (the server hands the
 * path over decoded: "/v1/models/a b" must not become a malformed URL, which is no backend's fault). */
static void build_url(char *url, size_t cap, const char *base, const char *path) {
    size_t n = (size_t)snprintf(url, cap, "%s", base);
    for (const unsigned char *p = (const unsigned char *)path; *p && n + 4 < cap; p++) {
        if (isalnum(*p) || strchr("/-._~:@+", *p)) url[n++] = (char)*p;
        else n += (size_t)snprintf(url + n, cap - n, "%%%02X", *p);
    }
    url[n] = 0;
}

static void set_options(kvb_router *r, CURL *easy, const kvb_relay_req *rr, upstream_call *c, struct curl_slist *hdrs,
                        char *url, size_t url_cap) {
    build_url(url, url_cap, r->backends[c->backend].base_url, rr->path);
    curl_easy_reset(easy);
    curl_easy_setopt(easy, CURLOPT_URL, url);
    curl_easy_setopt(easy, CURLOPT_SHARE, r->share);
    curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(easy, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, (long)r->cfg.connect_timeout_ms);
    curl_easy_setopt(easy, CURLOPT_HTTPHEADER, hdrs);
    if (rr->body) {
        curl_easy_setopt(easy, CURLOPT_POSTFIELDS, rr->body);
        curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)rr->body_len);
    } else {
        curl_easy_setopt(easy, CURLOPT_HTTPGET, 1L);
    }
    curl_easy_setopt(easy, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(easy, CURLOPT_HEADERDATA, c);
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(easy, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(easy, CURLOPT_XFERINFODATA, c);
    curl_easy_setopt(easy, CURLOPT_NOPROGRESS, 0L);
}

static void count_failure(kvb_router *r, size_t b, const char *kind, const char *why) {
    kvb_metric_add(r->m.failures, KVB_LABELS(r->backends[b].name, kind), 1);
    router_backend_set_up(r, b, false, why);
}

/* After the transfer: the reply passed on (or its failure said), or a retry elsewhere. */
static attempt_result settle(upstream_call *c, CURLcode res, char *why, size_t why_cap) {
    kvb_router *r = c->r;
    const char *name = r->backends[c->backend].name;
    if (c->client_gone) return ATTEMPT_GONE;
    if (res == CURLE_OK && c->status >= 100) {
        if (c->status >= 500) {
            snprintf(why, why_cap, "%s answered %ld", name, c->status);
            count_failure(r, c->backend, "status_5xx", why);
            if (c->status == 503 && !c->passed) return ATTEMPT_RETRY;
        }
        if (!c->passed && begin_reply(c) != KVB_OK) return ATTEMPT_GONE;
        if (c->buf.n && kvb_completion_relay_write(c->out, c->buf.p, c->buf.n) != KVB_OK) return ATTEMPT_GONE;
        kvb_completion_relay_end(c->out);
        return ATTEMPT_DONE;
    }
    const char *kind = "io";
    if (c->timed_out) {
        kind = "timeout";
        snprintf(why, why_cap, "%s sent no reply head within %u ms", name, r->cfg.first_byte_timeout_ms);
    } else {
        if (res == CURLE_COULDNT_CONNECT || res == CURLE_COULDNT_RESOLVE_HOST) kind = "connect";
        else if (res == CURLE_OPERATION_TIMEDOUT) kind = "timeout";
        snprintf(why, why_cap, "%s: %s", name, curl_easy_strerror(res));
    }
    count_failure(r, c->backend, kind, why);
    if (!c->passed) return ATTEMPT_RETRY;
    kvb_metric_add(r->m.cut, NULL, 1);
    kvb_completion_fail(c->out, 502, "upstream_failed", NULL, "The backend failed mid-reply (%s); the reply is cut "
                        "and was not sent again.", why);
    return ATTEMPT_DONE;
}

static attempt_result attempt(kvb_router *r, CURL *easy, const kvb_relay_req *rr, upstream_call *c, char *why,
                              size_t why_cap) {
    struct curl_slist *hdrs = NULL, *more;
    char rid[160], auth[KVB_ROUTER_KEY_MAX + 32];
    snprintf(rid, sizeof rid, "X-Request-Id: %s", rr->request_id);
    const char *key = r->cfg.backend_api_key;
    if (key && *key) snprintf(auth, sizeof auth, "Authorization: Bearer %s", key);
    const char *lines[] = {"Content-Type: application/json", "Expect:", rr->request_id[0] ? rid : NULL,
                           key && *key ? auth : NULL};
    for (size_t i = 0; i < KVB_ARRAY_LEN(lines); i++)
        if (lines[i] && (more = curl_slist_append(hdrs, lines[i]))) hdrs = more;
    char url[3 * 8192 + 192]; /* a path of up to HTTP_TARGET_MAX bytes, each escaped */
    set_options(r, easy, rr, c, hdrs, url, sizeof url);
    router_backend *b = &r->backends[c->backend];
    kvb_metric_add(r->m.requests, KVB_LABELS(b->name), 1);
    kvb_metric_set(r->m.in_flight, KVB_LABELS(b->name), atomic_fetch_add(&b->in_flight, 1) + 1);
    c->head_deadline = kvb_now_s() + r->cfg.first_byte_timeout_ms * 1e-3;
    const CURLcode res = curl_easy_perform(easy);
    kvb_metric_set(r->m.in_flight, KVB_LABELS(b->name), atomic_fetch_sub(&b->in_flight, 1) - 1);
    curl_slist_free_all(hdrs);
    return settle(c, res, why, why_cap);
}

/* ---- the relay handler ------------------------------------------------------------------------ */

void router_relay(void *ctx, const kvb_relay_req *rr, kvb_completion_out *out) {
    kvb_router *r = ctx;
    CURL *easy = curl_easy_init();
    if (!easy) {
        kvb_completion_fail(out, 503, NULL, NULL, "Out of memory starting the upstream request.");
        return;
    }
    const uint64_t key = rr->req ? kvb_router_conversation_key(rr->req, r->cfg.prefix_bytes) : 0;
    bool tried[KVB_ROUTER_MAX_BACKENDS] = {0};
    char why[256] = "every backend is down";
    for (int n = 0; n <= r->cfg.retries; n++) {
        upstream_call c = {.r = r, .out = out};
        const int b = router_pick(r, key, tried, n > 0, &c.place);
        if (b < 0) break;
        tried[b] = true;
        c.backend = (size_t)b;
        if (n > 0) kvb_metric_add(r->m.retries, NULL, 1);
        const attempt_result ar = attempt(r, easy, rr, &c, why, sizeof why);
        free(c.buf.p);
        if (ar == ATTEMPT_RETRY) continue;
        if (ar == ATTEMPT_DONE && rr->req) { /* a completion (the model listing is no placement) */
            kvb_metric_add(r->m.placements, KVB_LABELS(router_place_names[c.place]), 1);
            if (c.status >= 200 && c.status < 300) {
                pthread_mutex_lock(&r->mu);
                router_history_put(r->history, key, b);
                pthread_mutex_unlock(&r->mu);
            }
        }
        curl_easy_cleanup(easy);
        return;
    }
    curl_easy_cleanup(easy);
    kvb_completion_fail(out, 503, "no_backend_available", NULL, "No backend could take the request: %s.", why);
}
