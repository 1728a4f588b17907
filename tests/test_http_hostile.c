/* tests/test_http_hostile.c — the HTTP front door against hostile clients, at the socket level
 * (issue 32). Over 400 hostile requests of our own, made by generators below — malformed request
 * lines, headers and chunk sizes, random bytes, Content-Length and Transfer-Encoding games, bodies
 * over the limit, JSON strings with invalid escapes, lone surrogates and NULs, unknown fields on
 * every route, wrong types and out-of-range values — each must get a 4xx whose body is an OpenAI
 * error with a message (naming the field where the case knows it) within 1 s: no silent close, no
 * hang, no 5xx, and a normal request served right after it. Strings that are accepted come back
 * byte for byte (the fake tokenizer's ids are the prompt's bytes). Then the connection limits:
 * 300 idle or trickling connections (from one address, then from forty) and a normal request from
 * another client still answered within 1 s (and /metrics shows them waiting, the ones over a
 * client's share refused); a full house and a client over its share get a 503 with Retry-After,
 * idle kept-alive connections make room for a new client instead;
 * a head or body that stops coming gets a 408 at its deadline; and /metrics counts the refusals,
 * framing errors and deadlines. The handlers are fakes (echo, bytes as tokens), as in
 * tests/test_http_server.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvb_http.h"

#define MODEL "kvb-hostile"
#define BODY_LIMIT (64 * 1024)
#define ANSWER_WITHIN_S 1.0

/* ---- fake handlers: echo, and a tokenizer whose ids are the text's bytes ------------------------- */

static const char *request_text(const kvb_completion_req *req) {
    if (req->prompt) return req->prompt;
    return req->n_messages ? req->messages[req->n_messages - 1].content : "";
}

static void echo_completion(void *ctx, const kvb_completion_req *req, kvb_completion_out *out) {
    (void)ctx;
    const char *text = request_text(req);
    if (strcmp(text, "PAUSE") == 0) {
        struct timespec ts = {1, 500000000L};
        nanosleep(&ts, NULL);
    }
    kvb_completion_set_verdict(out, "complete");
    kvb_completion_emit(out, text);
    kvb_completion_finish(out, KVB_FINISH_STOP, NULL);
}

static int bytes_tokenize(void *ctx, const kvb_completion_req *req, int32_t **ids, size_t *n_ids,
                          uint32_t *max_model_len, kvb_http_error *err) {
    (void)ctx;
    (void)err;
    const char *text = request_text(req);
    const size_t n = strlen(text);
    *ids = malloc((n ? n : 1) * sizeof **ids);
    if (!*ids) return 500;
    for (size_t i = 0; i < n; i++) (*ids)[i] = (unsigned char)text[i];
    *n_ids = n;
    *max_model_len = 4096;
    return 0;
}

static int bytes_detokenize(void *ctx, const kvb_completion_req *req, char **text, kvb_http_error *err) {
    (void)ctx;
    (void)err;
    *text = malloc(req->n_prompt_tokens + 1);
    if (!*text) return 500;
    for (size_t i = 0; i < req->n_prompt_tokens; i++) (*text)[i] = (char)(req->prompt_tokens[i] & 0x7f ? req->prompt_tokens[i] & 0x7f : '?');
    (*text)[req->n_prompt_tokens] = '\0';
    return 0;
}

static kvb_http_server *start_server(unsigned max_connections, unsigned per_client, unsigned header_s, unsigned body_s) {
    kvb_http_config cfg = {.listen = "127.0.0.1:0", .model_id = MODEL, .max_body_bytes = BODY_LIMIT,
                           .max_connections = max_connections, .max_connections_per_client = per_client,
                           .header_timeout_s = header_s, .body_timeout_s = body_s};
    kvb_http_handlers h = {.completion = echo_completion, .tokenize = bytes_tokenize, .detokenize = bytes_detokenize};
    kvb_http_server *s = NULL;
    kvb_err err = {0};
    if (kvb_http_server_start(&cfg, &h, &s, &err) != KVB_OK) fail_msg("server start: %s", err.msg);
    return s;
}

/* ---- a raw client: what came back, and when --------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef enum { OUT_RESPONSE = 0, OUT_SILENT_CLOSE, OUT_HANG, OUT_PARTIAL } outcome;
static const char *const outcome_names[] = {"response", "closed without a response", "no response in time",
                                            "a cut response"};

typedef struct {
    outcome out;
    int status;
    double seconds;
    char data[65536]; /* the response as it came: head and body (NUL-terminated) */
    size_t len;
    const char *body; /* into data */
} reply;

/* A connection to 127.0.0.1:port from the address `from` (NULL: any). */
static int dial(uint16_t port, const char *from) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    if (from) {
        struct sockaddr_in src = {.sin_family = AF_INET};
        inet_pton(AF_INET, from, &src.sin_addr);
        if (bind(fd, (struct sockaddr *)&src, sizeof src) != 0) fail_msg("bind %s: %s", from, strerror(errno));
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) fail_msg("connect: %s", strerror(errno));
    return fd;
}

static void send_bytes(int fd, const void *bytes, size_t n) {
    const char *p = bytes;
    while (n) { /* the server may answer and close before it has everything: that is fine */
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

/* Whether data holds a whole response (its head and its Content-Length body). */
static bool response_whole(reply *r) {
    char *end = strstr(r->data, "\r\n\r\n");
    if (!end) return false;
    const char *cl = strcasestr(r->data, "\r\nContent-Length:");
    if (!cl || cl > end) return false;
    r->body = end + 4;
    return r->len - (size_t)(r->body - r->data) >= (size_t)atol(cl + 17);
}

/* Reads fd until a whole response, the server's close, or limit_s since t0. */
static void await_reply(int fd, double t0, double limit_s, reply *r) {
    r->len = 0;
    r->data[0] = '\0';
    r->body = NULL;
    r->out = OUT_HANG;
    for (;;) {
        const double left = t0 + limit_s - now_s();
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, (int)(left * 1000) + 1) <= 0) break;
        ssize_t n = recv(fd, r->data + r->len, sizeof r->data - 1 - r->len, 0);
        if (n <= 0) {
            r->out = r->len ? OUT_PARTIAL : OUT_SILENT_CLOSE;
            break;
        }
        r->len += (size_t)n;
        r->data[r->len] = '\0';
        if (response_whole(r)) {
            r->out = OUT_RESPONSE;
            break;
        }
    }
    r->seconds = now_s() - t0;
    r->status = 0;
    if (r->out == OUT_RESPONSE) sscanf(r->data, "HTTP/1.%*d %d", &r->status);
}

/* One exchange on a fresh connection from `from` (NULL: any), waiting at most limit_s. */
static void exchange_from(uint16_t port, const char *from, const char *bytes, size_t n, double limit_s, reply *r) {
    int fd = dial(port, from);
    const double t0 = now_s();
    send_bytes(fd, bytes, n);
    await_reply(fd, t0, limit_s, r);
    close(fd);
}

/* One hostile exchange on a fresh connection. */
static void exchange(uint16_t port, const char *bytes, size_t n, reply *r) {
    exchange_from(port, NULL, bytes, n, ANSWER_WITHIN_S + 0.5, r);
}

static const char health_close[] = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
static const char metrics_close[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

/* NULL when r is a 4xx OpenAI error with a message (and param, when want_param is given: equal,
 * or a prefix of it when the case ends want_param with '*') in time; else what is wrong. */
static const char *hostile_verdict(const reply *r, const char *want_param, char *why, size_t cap) {
    if (r->out != OUT_RESPONSE) return outcome_names[r->out];
    if (r->status < 400 || r->status > 499) return snprintf(why, cap, "status %d", r->status), why;
    if (r->seconds > ANSWER_WITHIN_S) return snprintf(why, cap, "answered after %.2f s", r->seconds), why;
    cJSON *j = cJSON_Parse(r->body);
    const cJSON *err = cJSON_GetObjectItemCaseSensitive(j, "error");
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(err, "message");
    const cJSON *param = cJSON_GetObjectItemCaseSensitive(err, "param");
    const char *verdict = NULL;
    if (!cJSON_IsString(msg) || !msg->valuestring[0]) verdict = "no error message in a JSON body";
    else if (want_param) {
        const size_t n = strlen(want_param);
        const bool prefix = n && want_param[n - 1] == '*';
        const char *got = cJSON_IsString(param) ? param->valuestring : "(null)";
        if (prefix ? strncmp(got, want_param, n - 1) != 0 : strcmp(got, want_param) != 0)
            verdict = (snprintf(why, cap, "param '%s', expected '%s'", got, want_param), why);
    }
    cJSON_Delete(j);
    return verdict;
}

/* A normal request, answered 200 in time. */
static void expect_served(uint16_t port, const char *from, const char *after) {
    reply *r = malloc(sizeof *r);
    assert_non_null(r);
    exchange_from(port, from, health_close, sizeof health_close - 1, ANSWER_WITHIN_S, r);
    if (r->out != OUT_RESPONSE || r->status != 200)
        fail_msg("after %s: a normal request got %s (status %d, %.2f s)", after, outcome_names[r->out], r->status,
                 r->seconds);
    free(r);
}

/* ---- the hostile cases ------------------------------------------------------------------------------ */

typedef struct {
    char *bytes;
    size_t len;
    char name[96];
    char param[96]; /* "" : not checked */
} hostile_case;

typedef struct {
    hostile_case *items;
    size_t n, cap;
} case_list;

static void add_raw(case_list *l, const char *bytes, size_t len, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void add_raw(case_list *l, const char *bytes, size_t len, const char *param, const char *fmt, ...) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 256;
        l->items = realloc(l->items, l->cap * sizeof *l->items);
        assert_non_null(l->items);
    }
    hostile_case *c = &l->items[l->n++];
    c->bytes = malloc(len + 1);
    assert_non_null(c->bytes);
    memcpy(c->bytes, bytes, len);
    c->bytes[len] = '\0';
    c->len = len;
    snprintf(c->param, sizeof c->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->name, sizeof c->name, fmt, ap);
    va_end(ap);
}

static void add_text(case_list *l, const char *text, const char *name) { add_raw(l, text, strlen(text), NULL, "%s", name); }

/* A POST of body to route (Content-Length, Connection: close). */
static void add_post(case_list *l, const char *route, const char *body, const char *param, const char *name) {
    const size_t n = strlen(body);
    char *req = malloc(n + 256);
    assert_non_null(req);
    int h = sprintf(req, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    "Content-Length: %zu\r\n\r\n", route, n);
    memcpy(req + h, body, n);
    add_raw(l, req, (size_t)h + n, param, "%s %s", route, name);
    free(req);
}

static void free_cases(case_list *l) {
    for (size_t i = 0; i < l->n; i++) free(l->items[i].bytes);
    free(l->items);
}

static const char *const framing_texts[] = {
    "HELLO\r\n\r\n", "\r\n\r\n", " GET /health HTTP/1.1\r\nHost: x\r\n\r\n", "GET\r\n\r\n", "GET /health\r\n\r\n",
    "GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", "GET /health  HTTP/1.1\r\nHost: x\r\n\r\n",
    "GET /health HTTP/1.1 extra\r\nHost: x\r\n\r\n", "GET /health HTTP/2.0\r\nHost: x\r\n\r\n",
    "GET /health HTTP/9.9\r\nHost: x\r\n\r\n", "GET /health HTTP/1.1x\r\nHost: x\r\n\r\n", "GET /health http/1.1\r\nHost: x\r\n\r\n",
    "GET /health HTTP/1\r\nHost: x\r\n\r\n", "GET /health FTP/1.1\r\nHost: x\r\n\r\n", "G(T /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "GET /hea\x01lth HTTP/1.1\r\nHost: x\r\n\r\n", "GET /hea\x7flth HTTP/1.1\r\nHost: x\r\n\r\n",
    "GET\t/health HTTP/1.1\r\nHost: x\r\n\r\n", "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "SSH-2.0-OpenSSH_9.6\r\n\r\n", "{\"model\":\"x\"}\r\n\r\n",
    "GET /health HTTP/1.1\r\n\r\n", "GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    "GET /health HTTP/1.1\r\nHost: x\r\nbroken header line\r\n\r\n", "GET /health HTTP/1.1\r\nHost: x\r\n: empty name\r\n\r\n",
    "GET /health HTTP/1.1\r\nHost: x\r\nX Y: z\r\n\r\n", "GET /health HTTP/1.1\r\nHost : x\r\n\r\n",
    "GET /health HTTP/1.1\r\nHost: x\r\nX: a\r\n folded\r\n\r\n", "GET /health HTTP/1.1\r\nHost: x\r\n\tX: tab\r\n\r\n",
    "GET /health HTTP/1.1\r\nHost: x\r\nX\x80Y: high\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1 2\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0x10\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +7\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n12345",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nabc",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\nabc\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFF\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n100000\r\nabc",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n 3\r\nabc\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\r\nabc\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nQ\r\n",
    "GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", "DELETE /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    "POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3\r\n\r\n{{{",
    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n{",
};

static void add_framing_cases(case_list *l) {
    for (size_t i = 0; i < sizeof framing_texts / sizeof *framing_texts; i++) {
        char name[48];
        snprintf(name, sizeof name, "framing #%zu", i);
        add_text(l, framing_texts[i], name);
    }
    /* a control byte in a header value, and each separator in a header name */
    for (int c = 1; c < 32; c++) {
        if (c == '\t' || c == '\n' || c == '\r') continue;
        char req[96];
        int n = snprintf(req, sizeof req, "GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a%cb\r\n\r\n", c);
        add_raw(l, req, (size_t)n, NULL, "control byte 0x%02x in a header value", c);
    }
    for (const char *sep = "()<>@,;\\\"/[]?={} "; *sep; sep++) {
        char req[96];
        int n = snprintf(req, sizeof req, "GET /health HTTP/1.1\r\nHost: x\r\nX%cY: z\r\n\r\n", *sep);
        add_raw(l, req, (size_t)n, NULL, "'%c' in a header name", *sep);
    }
    /* a long request target, a long header, many headers */
    static char big[40000];
    int n = snprintf(big, sizeof big, "GET /");
    memset(big + n, 'a', 9000);
    n += 9000;
    n += snprintf(big + n, sizeof big - (size_t)n, " HTTP/1.1\r\nHost: x\r\n\r\n");
    add_raw(l, big, (size_t)n, NULL, "a 9000-byte target");
    n = snprintf(big, sizeof big, "GET /health HTTP/1.1\r\nHost: x\r\nX: ");
    memset(big + n, 'b', 20000);
    n += 20000;
    n += snprintf(big + n, sizeof big - (size_t)n, "\r\n\r\n");
    add_raw(l, big, (size_t)n, NULL, "a 20000-byte header");
    n = snprintf(big, sizeof big, "GET /health HTTP/1.1\r\nHost: x\r\n");
    for (int i = 0; i < 200; i++) n += snprintf(big + n, sizeof big - (size_t)n, "X-%d: y\r\n", i);
    n += snprintf(big + n, sizeof big - (size_t)n, "\r\n");
    add_raw(l, big, (size_t)n, NULL, "200 headers");
    /* random bytes (a fixed seed), each ending like a head */
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 100; i++) {
        char junk[300];
        const size_t len = 8 + (size_t)(x % 250);
        for (size_t k = 0; k < len; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            junk[k] = (char)(x & 0xff);
        }
        if (i % 2) memcpy(junk, "GET ", 4); /* half of them look like a start */
        memcpy(junk + len, "\r\n\r\n", 4);
        add_raw(l, junk, len + 4, NULL, "random bytes #%d", i);
    }
}

/* The routes, and where a string goes in each (and its param). */
typedef struct {
    const char *path, *prefix, *string_param;
} route_shape;

static const route_shape routes[] = {
    {"/v1/chat/completions", "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}]",
     "messages[0].content"},
    {"/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"%s\"", "prompt"},
    {"/tokenize", "{\"prompt\":\"%s\"", "prompt"},
    {"/detokenize", "{\"tokens\":[1],\"model\":\"%s\"", "model"},
};

static void add_route_body(case_list *l, size_t route, const char *string, const char *extra, const char *param,
                           const char *name) {
    char body[2048];
    int n = snprintf(body, sizeof body, routes[route].prefix, string);
    snprintf(body + n, sizeof body - (size_t)n, "%s}", extra);
    add_post(l, routes[route].path, body, param, name);
}

static void add_json_cases(case_list *l) {
    static const char *const escapes[] = {
        "\\uZZZZ", "\\u12", "\\u12G4", "\\uG123", "\\u 123", "\\u0000", "\\u0000abc", "\\uD800", "\\uDBFF", "\\uDC00",
        "\\uDFFF", "\\uD800\\u0041", "\\uD800\\uD800", "\\uD800x", "\\uDC00\\uD800", "\\a", "\\x41", "\\0", "\\'",
        "\\U0041", "\\e", "\\v", "\\ ", "\\%", "\\u00", "\\uFFFG",
    };
    for (size_t r = 0; r < sizeof routes / sizeof *routes; r++)
        for (size_t i = 0; i < sizeof escapes / sizeof *escapes; i++) {
            char s[64];
            snprintf(s, sizeof s, "abc%sxyz", escapes[i]);
            add_route_body(l, r, s, "", routes[r].string_param, escapes[i]);
        }
    static const char *const unknown[] = {
        "temprature", "foo", "Model", "max_tokens ", "n_predict", "repetition_penalty", "min_p", "use_beam_search",
        "guided_json", "chat_template", "x", "_", "prompt_logprobs", "extra_body", "api_key", "maxTokens",
        "length_penalty", "truncate_prompt_tokens", "priority", "request_id",
    };
    for (size_t r = 0; r < sizeof routes / sizeof *routes; r++)
        for (size_t i = 0; i < sizeof unknown / sizeof *unknown; i++) {
            char extra[96];
            snprintf(extra, sizeof extra, ",\"%s\":1", unknown[i]);
            add_route_body(l, r, "ok", extra, unknown[i], unknown[i]);
        }
    /* fields a route does not take though another does */
    static const struct { size_t route; const char *field; } misplaced[] = {
        {0, "echo"}, {0, "suffix"}, {0, "best_of"}, {0, "prompt"}, {0, "tokens"}, {1, "messages"}, {1, "tools"},
        {1, "metadata"}, {1, "store"}, {1, "tokens"}, {2, "max_tokens"}, {2, "stream"}, {2, "kvbridge"}, {2, "tokens"},
        {2, "temperature"}, {3, "prompt"}, {3, "messages"}, {3, "add_special_tokens"}, {3, "n"}, {3, "user"},
    };
    for (size_t i = 0; i < sizeof misplaced / sizeof *misplaced; i++) {
        char extra[96];
        snprintf(extra, sizeof extra, ",\"%s\":1", misplaced[i].field);
        add_route_body(l, misplaced[i].route, "ok", extra, misplaced[i].field, misplaced[i].field);
    }
    /* wrong types and values, on both completion routes */
    static const struct { const char *field, *value, *param; } params[] = {
        {"temperature", "\"1\"", "temperature"}, {"temperature", "true", "temperature"}, {"temperature", "[]", "temperature"},
        {"temperature", "-0.1", "temperature"}, {"temperature", "2.5", "temperature"}, {"temperature", "1e400", "temperature"},
        {"top_p", "\"x\"", "top_p"}, {"top_p", "1.5", "top_p"}, {"top_p", "-1", "top_p"},
        {"max_tokens", "\"5\"", "max_tokens"}, {"max_tokens", "1.5", "max_tokens"}, {"max_tokens", "-1", "max_tokens"},
        {"max_tokens", "1e20", "max_tokens"}, {"n", "0", "n"}, {"n", "17", "n"}, {"n", "1.5", "n"}, {"n", "\"2\"", "n"},
        {"seed", "\"1\"", "seed"}, {"seed", "1.5", "seed"}, {"seed", "1e30", "seed"}, {"top_k", "-2", "top_k"},
        {"top_k", "1.5", "top_k"}, {"presence_penalty", "3", "presence_penalty"},
        {"frequency_penalty", "-3", "frequency_penalty"}, {"stop", "5", "stop"}, {"stop", "[1]", "stop[0]"},
        {"stop", "[\"\"]", "stop[0]"}, {"stop", "\"\"", "stop"}, {"stop", "[\"a\",\"b\",\"c\",\"d\",\"e\"]", "stop"},
        {"stream", "1", "stream"}, {"stream", "\"true\"", "stream"}, {"logit_bias", "[]", "logit_bias"},
        {"logit_bias", "{\"x\":1}", "logit_bias"}, {"logit_bias", "{\"1\":1000}", "logit_bias"},
        {"min_tokens", "-1", "min_tokens"}, {"stop_token_ids", "[-1]", "stop_token_ids[0]"},
        {"stop_token_ids", "\"1\"", "stop_token_ids"}, {"user", "5", "user"},
        {"response_format", "{\"type\":\"xml\"}", "response_format"},
        {"kvbridge", "{\"bridge\":\"maybe\"}", "kvbridge.bridge"}, {"kvbridge", "{\"x\":1}", "kvbridge"},
        {"ignore_eos", "\"no\"", "ignore_eos"}, {"model", "5", "model"}, {"model", "\"\"", "model"},
    };
    for (size_t r = 0; r < 2; r++)
        for (size_t i = 0; i < sizeof params / sizeof *params; i++) {
            char extra[128], name[96];
            snprintf(extra, sizeof extra, ",\"%s\":%s", params[i].field, params[i].value);
            snprintf(name, sizeof name, "%s=%s", params[i].field, params[i].value);
            char body[512];
            int n = snprintf(body, sizeof body, routes[r].prefix, "ok");
            if (strcmp(params[i].field, "model") == 0) /* replaces the model: the last key would be a duplicate */
                n = snprintf(body, sizeof body, "{\"model\":%s,%s", params[i].value,
                             r == 0 ? "\"messages\":[{\"role\":\"user\",\"content\":\"ok\"}]" : "\"prompt\":\"ok\"");
            snprintf(body + n, sizeof body - (size_t)n, "%s}", strcmp(params[i].field, "model") == 0 ? "" : extra);
            add_post(l, routes[r].path, body, params[i].param, name);
        }
    /* a key sent twice, and malformed JSON */
    for (size_t r = 0; r < sizeof routes / sizeof *routes; r++) {
        add_route_body(l, r, "ok", r == 3 ? ",\"tokens\":[2]" : r == 0 ? ",\"messages\":[]" : ",\"prompt\":\"b\"",
                       r == 3 ? "tokens" : r == 0 ? "messages" : "prompt", "a key twice");
        add_post(l, routes[r].path, "{\"model\":", NULL, "cut JSON");
        add_post(l, routes[r].path, "[]", NULL, "an array body");
        add_post(l, routes[r].path, "{\"a\":1}{}", NULL, "two values");
    }
}

/* Bodies over the limit, by Content-Length and by chunks, and deep nesting. */
static void add_size_cases(case_list *l) {
    char *big = malloc(2 * BODY_LIMIT + 4096), *text = malloc(BODY_LIMIT + 64);
    assert_non_null(big);
    assert_non_null(text);
    for (size_t r = 0; r < sizeof routes / sizeof *routes; r++) {
        memset(text, 'p', BODY_LIMIT);
        text[BODY_LIMIT] = '\0';
        int n = sprintf(big, routes[r].prefix, text);
        sprintf(big + n, "}");
        add_post(l, routes[r].path, big, NULL, "a body over the limit");
        char head[256];
        int h = snprintf(head, sizeof head, "POST %s HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         "Content-Type: application/json\r\n\r\n%x\r\n", routes[r].path, BODY_LIMIT * 2);
        add_raw(l, head, (size_t)h, NULL, "%s: a chunk over the limit", routes[r].path);
        /* a long string whose bad escape is at its very end */
        memset(text, 'q', 30000);
        strcpy(text + 30000, "\\uD83D");
        n = sprintf(big, routes[r].prefix, text);
        sprintf(big + n, "}");
        add_post(l, routes[r].path, big, routes[r].string_param, "a bad escape after 30000 bytes");
        /* nesting deeper than the JSON parser takes */
        n = sprintf(big, "{\"model\":\"" MODEL "\",\"x\":");
        for (int i = 0; i < 3000; i++) big[n++] = '[';
        for (int i = 0; i < 3000; i++) big[n++] = ']';
        sprintf(big + n, "}");
        add_post(l, routes[r].path, big, NULL, "3000 levels of nesting");
    }
    free(text);
    free(big);
}

static size_t g_cases_run;

static void run_cases(uint16_t port, case_list *l) {
    int failures = 0;
    reply *r = malloc(sizeof *r);
    assert_non_null(r);
    for (size_t i = 0; i < l->n; i++) {
        const hostile_case *c = &l->items[i];
        exchange(port, c->bytes, c->len, r);
        char why[160];
        const char *bad = hostile_verdict(r, c->param[0] ? c->param : NULL, why, sizeof why);
        if (bad) {
            print_error("case '%s' (%.60s...): %s\n  got: %.300s\n", c->name, c->bytes, bad, r->data);
            failures++;
        }
        expect_served(port, NULL, c->name);
        g_cases_run++;
    }
    free(r);
    if (failures) fail_msg("%d of %zu hostile cases were not answered as they should be", failures, l->n);
}

/* ---- tests ------------------------------------------------------------------------------------------ */

static void test_framing(void **state) {
    (void)state;
    kvb_http_server *s = start_server(0, 0, 0, 0);
    case_list l = {0};
    add_framing_cases(&l);
    run_cases(kvb_http_server_port(s), &l);
    free_cases(&l);
    kvb_http_server_stop(s);
}

static void test_json_and_params(void **state) {
    (void)state;
    kvb_http_server *s = start_server(0, 0, 0, 0);
    case_list l = {0};
    add_json_cases(&l);
    add_size_cases(&l);
    run_cases(kvb_http_server_port(s), &l);
    free_cases(&l);
    kvb_http_server_stop(s);
}

/* Accepted strings come back byte for byte: /tokenize's ids are the prompt's bytes. */
static void test_strings_exact(void **state) {
    (void)state;
    kvb_http_server *s = start_server(0, 0, 0, 0);
    static const struct { const char *json, *bytes; } cases[] = {
        {"a\\u00e9b", "a\xc3\xa9" "b"}, {"\\ud83d\\ude00", "\xf0\x9f\x98\x80"}, {"\\uD83D\\uDE00!", "\xf0\x9f\x98\x80!"},
        {"x\\u005cu0000y", "x\\u0000y"}, {"\\\\u0000", "\\u0000"}, {"\\/\\\"\\\\", "/\"\\"},
        {"\\b\\f\\n\\r\\t", "\b\f\n\r\t"}, {"\\u20ac\\u0041", "\xe2\x82\xac" "A"}, {"\\uFFFF", "\xef\xbf\xbf"},
        {"\\u0001", "\x01"}, {"\\uDBFF\\uDFFF", "\xf4\x8f\xbf\xbf"}, {"caf\xc3\xa9", "caf\xc3\xa9"},
        {"abc\\u0020def", "abc def"}, {"", ""}, {"\xe2\x82\xac\\u20AC", "\xe2\x82\xac\xe2\x82\xac"},
    };
    const uint16_t port = kvb_http_server_port(s);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char body[256], req[512];
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"add_special_tokens\":false}", cases[i].json);
        int n = snprintf(req, sizeof req, "POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
        reply *r = malloc(sizeof *r);
        assert_non_null(r);
        exchange(port, req, (size_t)n, r);
        if (r->out != OUT_RESPONSE || r->status != 200) fail_msg("case %zu: %s %d %.200s", i, outcome_names[r->out], r->status, r->data);
        cJSON *j = cJSON_Parse(r->body);
        const cJSON *toks = cJSON_GetObjectItemCaseSensitive(j, "tokens");
        const size_t want = strlen(cases[i].bytes);
        if (!cJSON_IsArray(toks) || (size_t)cJSON_GetArraySize(toks) != want) fail_msg("case %zu: %.200s", i, r->body);
        size_t k = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, toks) {
            if ((int)t->valuedouble != (unsigned char)cases[i].bytes[k]) fail_msg("case %zu: byte %zu differs", i, k);
            k++;
        }
        cJSON_Delete(j);
        free(r);
    }
    kvb_http_server_stop(s);
}

/* Within the limits is served: a head just under 16 KiB, 100 headers, a chunked body in pieces. */
static void test_large_heads_served(void **state) {
    (void)state;
    kvb_http_server *s = start_server(0, 0, 0, 0);
    const uint16_t port = kvb_http_server_port(s);
    char *req = malloc(20000);
    assert_non_null(req);
    reply *r = malloc(sizeof *r);
    assert_non_null(r);
    int n = sprintf(req, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: ");
    memset(req + n, 'p', 16000 - (size_t)n);
    n = 16000;
    n += sprintf(req + n, "\r\n\r\n");
    exchange(port, req, (size_t)n, r);
    if (r->status != 200) fail_msg("a 16000-byte head: %s %d %.200s", outcome_names[r->out], r->status, r->data);
    n = sprintf(req, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (int i = 0; i < 97; i++) n += sprintf(req + n, "X-H%d: %d\r\n", i, i);
    n += sprintf(req + n, "\r\n");
    exchange(port, req, (size_t)n, r);
    assert_int_equal(r->status, 200);
    /* chunked, the head and each chunk sent on their own */
    static const char *const parts[] = {
        ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
         "Transfer-Encoding: chunked\r\n\r\n"),
        "a\r\n{\"model\":\"\r\n", "b\r\nkvb-hostile\r\n", "16\r\n\",\"prompt\":\"in parts\"}\r\n", "0\r\n\r\n",
    };
    int fd = dial(port, NULL);
    const double t0 = now_s();
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++) {
        send_bytes(fd, parts[i], strlen(parts[i]));
        struct timespec ts = {0, 150000000L}; /* past the guard's wait for the first chunk */
        nanosleep(&ts, NULL);
    }
    await_reply(fd, t0, 3.0, r);
    close(fd);
    if (r->status != 200 || !strstr(r->body, "in parts")) fail_msg("chunked in parts: %d %.300s", r->status, r->data);
    free(r);
    free(req);
    kvb_http_server_stop(s);
}

/* n connections from `from`: idle (nothing sent) or trickling (part of a head). */
static void open_idle(uint16_t port, const char *from, int *fds, int n, bool trickle) {
    for (int i = 0; i < n; i++) {
        fds[i] = dial(port, from);
        if (trickle) send_bytes(fds[i], "POST /v1/completions HTTP/1.1\r\nHo", 33);
    }
}

static void test_idle_connections(void **state) {
    (void)state;
    kvb_http_server *s = start_server(0, 0, 0, 0); /* 256 connections, 128 per client */
    const uint16_t port = kvb_http_server_port(s);
    int fds[320];
    /* 300 from one address, half of them trickling */
    open_idle(port, "127.0.0.2", fds, 150, false);
    open_idle(port, "127.0.0.2", fds + 150, 150, true);
    expect_served(port, "127.0.0.1", "300 idle connections from one client");
    for (int i = 0; i < 300; i++) close(fds[i]);
    /* 320 from 40 addresses (8 each, within a client's share, more than the server's 256) */
    for (int i = 0; i < 320; i++) {
        char from[32];
        snprintf(from, sizeof from, "127.0.1.%d", 1 + i % 40);
        open_idle(port, from, &fds[i], 1, i % 2);
    }
    expect_served(port, "127.0.0.1", "320 idle connections from 40 clients");
    reply *m = malloc(sizeof *m); /* /metrics sees them waiting */
    assert_non_null(m);
    exchange(port, metrics_close, sizeof metrics_close - 1, m);
    assert_int_equal(m->status, 200);
    const char *waiting = strstr(m->body, "kvb_http_connections{state=\"waiting\"} ");
    assert_non_null(waiting);
    if (atof(waiting + strlen("kvb_http_connections{state=\"waiting\"} ")) < 320) fail_msg("%.80s", waiting);
    assert_non_null(strstr(m->body, "kvb_http_connections_refused_total{reason=\"per_client\"} 172")); /* 300 - 128 */
    free(m);
    /* a completion too, on a fresh connection while they wait */
    case_list l = {0};
    add_route_body(&l, 1, "still served", "", NULL, "normal");
    reply *r = malloc(sizeof *r);
    assert_non_null(r);
    exchange(port, l.items[0].bytes, l.items[0].len, r);
    assert_int_equal(r->out, OUT_RESPONSE);
    assert_int_equal(r->status, 200);
    assert_true(r->seconds < ANSWER_WITHIN_S);
    assert_non_null(strstr(r->body, "still served"));
    free(r);
    free_cases(&l);
    for (int i = 0; i < 320; i++) close(fds[i]);
    kvb_http_server_stop(s);
}

typedef struct {
    uint16_t port;
    char from[32]; /* the client's address */
    int status;
} paused_call;

static void *pause_call(void *arg) { /* a completion that takes 1.5 s; a 503 is retried, as Retry-After says */
    paused_call *c = arg;
    case_list l = {0};
    add_route_body(&l, 1, "PAUSE", "", NULL, "pause");
    reply *r = malloc(sizeof *r);
    for (int attempt = 0; attempt < 20; attempt++) { /* a connection of the test before may not be closed yet */
        exchange_from(c->port, c->from, l.items[0].bytes, l.items[0].len, 5, r);
        c->status = r->out == OUT_RESPONSE ? r->status : -1;
        if (c->status != 503) break;
        struct timespec ts = {0, 100000000L};
        nanosleep(&ts, NULL);
    }
    free(r);
    free_cases(&l);
    return NULL;
}

static void expect_503(uint16_t port, const char *from, const char *what) {
    reply *r = malloc(sizeof *r);
    assert_non_null(r);
    exchange_from(port, from, health_close, sizeof health_close - 1, ANSWER_WITHIN_S, r);
    if (r->status != 503 || !strcasestr(r->data, "\r\nRetry-After: 1"))
        fail_msg("%s: %s %d %.300s", what, outcome_names[r->out], r->status, r->data);
    cJSON *j = cJSON_Parse(r->body);
    assert_non_null(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "error"), "message"));
    cJSON_Delete(j);
    free(r);
}

/* A full house of requests is a 503 with Retry-After, and so is a client over its share; both end.
 * A full house of connections kept alive idle makes room instead. */
static void test_limits(void **state) {
    (void)state;
    kvb_http_server *s = start_server(4, 3, 0, 0);
    const uint16_t port = kvb_http_server_port(s);
    /* one client's share: 3 connections; the 4th is refused, another client is not */
    int fds[3];
    open_idle(port, "127.0.0.2", fds, 3, false);
    expect_503(port, "127.0.0.2", "a client over its share");
    expect_served(port, "127.0.0.1", "a client over its share");
    for (int i = 0; i < 3; i++) close(fds[i]);
    /* four completions in flight (from four clients) fill the house */
    paused_call calls[4];
    pthread_t threads[4];
    for (int i = 0; i < 4; i++) {
        calls[i] = (paused_call){.port = port};
        snprintf(calls[i].from, sizeof calls[i].from, "127.0.0.%d", 10 + i);
        pthread_create(&threads[i], NULL, pause_call, &calls[i]);
    }
    for (int waited = 0; kvb_http_server_in_flight(s) < 4 && waited < 3000; waited += 10) { /* all four inside */
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
    }
    assert_int_equal(kvb_http_server_in_flight(s), 4);
    expect_503(port, "127.0.0.4", "a full house");
    for (int i = 0; i < 4; i++) pthread_join(threads[i], NULL);
    for (int i = 0; i < 4; i++) assert_int_equal(calls[i].status, 200);
    expect_served(port, "127.0.0.4", "the house emptied");
    /* four connections kept alive idle after a request fill the house too: a new client is served
     * all the same, in the place of the one idle the longest, which is closed */
    int kept[4];
    reply *r = malloc(sizeof *r);
    assert_non_null(r);
    static const char health[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < 4; i++) {
        char from[32];
        snprintf(from, sizeof from, "127.0.0.%d", 20 + i);
        kept[i] = dial(port, from);
        const double t0 = now_s();
        send_bytes(kept[i], health, sizeof health - 1);
        await_reply(kept[i], t0, ANSWER_WITHIN_S, r);
        assert_int_equal(r->status, 200);
        struct timespec gap = {0, 20000000L}; /* their idle times differ */
        nanosleep(&gap, NULL);
    }
    expect_served(port, "127.0.0.30", "four connections kept alive idle");
    await_reply(kept[0], now_s(), ANSWER_WITHIN_S, r); /* the oldest was closed */
    assert_int_equal(r->out, OUT_SILENT_CLOSE);
    for (int i = 1; i < 4; i++) { /* the others still serve */
        const double t0 = now_s();
        send_bytes(kept[i], health, sizeof health - 1);
        await_reply(kept[i], t0, ANSWER_WITHIN_S, r);
        if (r->status != 200) fail_msg("kept-alive connection %d: %s %d", i, outcome_names[r->out], r->status);
    }
    for (int i = 0; i < 4; i++) close(kept[i]);
    free(r);
    kvb_http_server_stop(s);
}

/* A head or a body that stops coming gets a 408 at its deadline, and the metrics count it all. */
static void test_deadlines_and_metrics(void **state) {
    (void)state;
    kvb_http_server *s = start_server(0, 0, 1, 1);
    const uint16_t port = kvb_http_server_port(s);
    reply *r = malloc(sizeof *r);
    assert_non_null(r);
    static const char *const stalls[] = {
        "GET /health HTTP/1.1\r\nHo", /* the head stops */
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"model\":", /* the body stops */
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n9\r\n{\"model\"", /* a chunk */
    };
    for (size_t i = 0; i < sizeof stalls / sizeof *stalls; i++) {
        exchange_from(port, NULL, stalls[i], strlen(stalls[i]), 3.0, r);
        if (r->out != OUT_RESPONSE || r->status != 408 || r->seconds < 0.9)
            fail_msg("stall %zu: %s %d after %.2f s", i, outcome_names[r->out], r->status, r->seconds);
    }
    reply *m = r;
    exchange(port, "HELLO\r\n\r\n", 9, m);
    assert_int_equal(m->status, 400);
    exchange_from(port, NULL, metrics_close, sizeof metrics_close - 1, 2.0, m);
    assert_int_equal(m->status, 200);
    assert_non_null(strstr(m->body, "kvb_http_deadline_timeouts_total{phase=\"headers\"} 1"));
    assert_non_null(strstr(m->body, "kvb_http_deadline_timeouts_total{phase=\"body\"} 2"));
    assert_non_null(strstr(m->body, "kvb_http_framing_errors_total{code=\"400\"} 1"));
    assert_non_null(strstr(m->body, "# TYPE kvb_http_connections_refused_total counter"));
    free(r);
    kvb_http_server_stop(s);
}

static void test_case_count(void **state) {
    (void)state;
    if (g_cases_run < 400) fail_msg("only %zu hostile cases ran; the acceptance asks for 400 or more", g_cases_run);
    print_message("%zu hostile cases, each answered with a 4xx and a message in time\n", g_cases_run);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_framing),
        cmocka_unit_test(test_json_and_params),
        cmocka_unit_test(test_strings_exact),
        cmocka_unit_test(test_large_heads_served),
        cmocka_unit_test(test_idle_connections),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_deadlines_and_metrics),
        cmocka_unit_test(test_case_count),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
