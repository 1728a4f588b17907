/* tests/test_router.c — the router (`serve --role router`) in front of decode nodes started in this
 * process on loopback (a tiny generated model, no prefill peer): 12 conversations of 4 turns from 4
 * client threads, every reply's choices byte-equal to the same request sent to a decode node
 * directly (greedy), every later turn placed "history" on its first turn's backend, the router's
 * /metrics and the backends' own request counts agreeing; one decode node stopped mid-run (every
 * request still answered once, conversations on it "moved", requests the backends saw = requests
 * sent + retries); a backend that dies after its first SSE event (a stream ended by an error event,
 * never retried); a backend that accepts and stays silent (the request moves on after the
 * first-byte timeout, 1 s here); hostile input answered by the router without reaching a backend;
 * /health 503 once no backend is up; the official openai client through the router; the LRU table and rendezvous order on their own. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cJSON.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvb_http.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvb_router.h"
#include "kvbt.h"
#include "node_client.h"
#include "router_internal.h"

static char g_model[512];

static int setup(void **state) {
    (void)state;
    kvb_err err = {0};
    kvbt_tmp_path(g_model, sizeof g_model, "router.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 37, .n_threads = 2};
    if (kvb_gen_model(&o, g_model, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    return 0;
}

static kvb_decode_node *start_decode_key(const char *api_key) {
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .model_path = g_model, .n_threads = 1,
                           .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096, .api_key = api_key};
    kvb_decode_node *n = NULL;
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &n, &err)) fail_msg("decode node: %s", err.msg);
    return n;
}

static kvb_decode_node *start_decode(void) { return start_decode_key(NULL); }

/* A router in front of ports[0 .. n) (cfg's other fields as given). */
static kvb_router *start_router(const uint16_t *ports, size_t n, kvb_router_config cfg, char names[][32]) {
    const char *list[8];
    for (size_t i = 0; i < n; i++) {
        snprintf(names[i], 32, "127.0.0.1:%u", ports[i]);
        list[i] = names[i];
    }
    cfg.http_listen = "127.0.0.1:0";
    cfg.backends = list;
    cfg.n_backends = n;
    kvb_router *r = NULL;
    kvb_err err = {0};
    if (kvb_router_start(&cfg, &r, &err)) fail_msg("router: %s", err.msg);
    return r;
}

/* ---- a client (libcurl): status, the router's headers, the body ---------------------------------- */

typedef struct {
    long status;
    char backend[64], placement[16], content_type[64], verdict[160];
    kvb_strbuf body;
    double seconds;
} reply;

static size_t on_header(char *line, size_t size, size_t n, void *ud) {
    reply *r = ud;
    const size_t len = size * n;
    struct { const char *name; char *dst; size_t cap; } want[] = {
        {"X-KVBridge-Backend:", r->backend, sizeof r->backend},
        {"X-KVBridge-Placement:", r->placement, sizeof r->placement},
        {"Content-Type:", r->content_type, sizeof r->content_type},
        {"X-KVBridge:", r->verdict, sizeof r->verdict}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const size_t nl = strlen(want[i].name);
        if (len > nl && strncasecmp(line, want[i].name, nl) == 0) {
            size_t a = nl, b = len;
            while (a < b && line[a] == ' ') a++;
            while (b > a && (line[b - 1] == '\r' || line[b - 1] == '\n')) b--;
            snprintf(want[i].dst, want[i].cap, "%.*s", (int)(b - a), line + a);
        }
    }
    return len;
}

static size_t on_body(char *p, size_t size, size_t n, void *ud) {
    kvb_strbuf_putn(&((reply *)ud)->body, p, size * n);
    return size * n;
}

/* POSTs body (len bytes; extra_header may be NULL) to http://127.0.0.1:port/path. */
static void post(uint16_t port, const char *path, const char *body, size_t len, const char *extra_header, reply *r) {
    memset(r, 0, sizeof *r);
    CURL *c = curl_easy_init();
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%u%s", port, path);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    if (extra_header) h = curl_slist_append(h, extra_header);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 60000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    const double t0 = kvb_now_s();
    const CURLcode rc = curl_easy_perform(c);
    r->seconds = kvb_now_s() - t0;
    if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    if (!r->body.p) kvb_strbuf_put(&r->body, "");
}

/* What must be equal between two replies to the same greedy request: each chunk's (or the body's)
 * "choices", in order, and [DONE]. Ids, timestamps and timings differ by design. */
static char *choices_text(const reply *r) {
    kvb_strbuf out = {0};
    const bool sse = strncmp(r->content_type, "text/event-stream", 17) == 0;
    for (const char *p = r->body.p; p && *p;) {
        const char *end = sse ? strstr(p, "\n\n") : p + strlen(p);
        if (!end) end = p + strlen(p);
        const char *json = sse && strncmp(p, "data: ", 6) == 0 ? p + 6 : p;
        cJSON *j = cJSON_ParseWithLength(json, (size_t)(end - json));
        if (j) {
            const cJSON *ch = cJSON_GetObjectItem(j, "choices");
            char *s = cJSON_PrintUnformatted(ch ? ch : j);
            kvb_strbuf_put(&out, s);
            kvb_strbuf_put(&out, "\n");
            cJSON_free(s);
            cJSON_Delete(j);
        } else {
            kvb_strbuf_putn(&out, json, (size_t)(end - json));
            kvb_strbuf_put(&out, "\n");
        }
        p = *end ? end + (sse ? 2 : 0) : end;
    }
    return out.p ? out.p : strdup("");
}

/* The reply's text: a body's message content, or a stream's deltas joined. */
static char *reply_text(const reply *r) {
    kvb_strbuf out = {0};
    kvb_strbuf_put(&out, "");
    const bool sse = strncmp(r->content_type, "text/event-stream", 17) == 0;
    for (const char *p = r->body.p; p && (p = strstr(p, sse ? "data: {" : "{")); p++) {
        cJSON *j = cJSON_Parse(p + (sse ? 6 : 0));
        const char *end = sse ? strstr(p, "\n\n") : NULL;
        if (!j && end) j = cJSON_ParseWithLength(p + 6, (size_t)(end - p - 6));
        const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        const cJSON *msg = cJSON_GetObjectItem(c0, sse ? "delta" : "message");
        const cJSON *content = cJSON_GetObjectItem(msg, "content");
        if (cJSON_IsString(content)) kvb_strbuf_put(&out, content->valuestring);
        cJSON_Delete(j);
        if (!sse) break;
    }
    return out.p;
}

/* ---- conversations ------------------------------------------------------------------------------ */

#define N_CONV 12
#define N_TURNS 4
#define N_CLIENTS 4

typedef struct {
    char *history; /* the messages so far, as JSON array members */
    char backend[N_TURNS][64], placement[N_TURNS][16];
} conversation;

typedef struct {
    uint16_t router_port, ref_port;
    conversation conv[N_CONV];
    atomic_int answered, failures;
    bool streams;   /* odd conversations stream */
    char failure[512];
    pthread_mutex_t mu;
} run_state;

static void note_failure(run_state *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note_failure(run_state *s, const char *fmt, ...) {
    pthread_mutex_lock(&s->mu);
    if (!atomic_fetch_add(&s->failures, 1)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->failure, sizeof s->failure, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&s->mu);
}

/* One turn of conversation c: through the router and straight to the reference node; the two
 * replies' choices must be byte-equal. */
static void one_turn(run_state *s, int c, int turn) {
    conversation *cv = &s->conv[c];
    char user[128], body[16384];
    snprintf(user, sizeof user, "{\"role\":\"user\",\"content\":\"conversation %d, question %d: go on\"}", c, turn);
    if (turn == 0) {
        char sys[160];
        snprintf(sys, sizeof sys, "{\"role\":\"system\",\"content\":\"You are test assistant number %d.\"}", c);
        cv->history = malloc(strlen(sys) + 1);
        strcpy(cv->history, sys);
    }
    const bool stream = s->streams && (c & 1);
    snprintf(body, sizeof body, "{\"model\":\"m\",\"messages\":[%s,%s],\"max_tokens\":8,\"temperature\":0%s}", cv->history,
             user, stream ? ",\"stream\":true" : "");
    reply via, ref;
    post(s->router_port, "/v1/chat/completions", body, strlen(body), NULL, &via);
    post(s->ref_port, "/v1/chat/completions", body, strlen(body), NULL, &ref);
    char *a = choices_text(&via), *b = choices_text(&ref), *text = reply_text(&via);
    if (via.status != 200 || ref.status != 200) note_failure(s, "conv %d turn %d: status %ld (reference %ld): %s", c, turn,
                                                             via.status, ref.status, via.body.p);
    else if (strcmp(a, b) != 0) note_failure(s, "conv %d turn %d: choices differ:\n%s\nvs\n%s", c, turn, a, b);
    else if (!strstr(a, "\"content\":") || !strstr(a, "\"finish_reason\":\"") || (stream && !strstr(a, "[DONE]")))
        note_failure(s, "conv %d turn %d: no reply in '%s'", c, turn, a);
    snprintf(cv->backend[turn], sizeof cv->backend[turn], "%s", via.backend);
    snprintf(cv->placement[turn], sizeof cv->placement[turn], "%s", via.placement);
    cJSON *content = cJSON_CreateString(text); /* the reply joins the history as JSON-escaped text */
    char *esc = cJSON_PrintUnformatted(content);
    const size_t grow = strlen(user) + strlen(esc) + 64;
    cv->history = realloc(cv->history, strlen(cv->history) + grow);
    sprintf(cv->history + strlen(cv->history), ",%s,{\"role\":\"assistant\",\"content\":%s}", user, esc);
    cJSON_free(esc);
    cJSON_Delete(content);
    free(a), free(b), free(text), free(via.body.p), free(ref.body.p);
    atomic_fetch_add(&s->answered, 1);
}

typedef struct {
    run_state *s;
    int client;
} client_arg;

static void *client_main(void *arg) {
    client_arg *ca = arg;
    for (int turn = 0; turn < N_TURNS; turn++)
        for (int c = ca->client; c < N_CONV; c += N_CLIENTS) one_turn(ca->s, c, turn);
    return NULL;
}

static void run_clients(run_state *s) {
    pthread_t th[N_CLIENTS];
    client_arg args[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++) {
        args[i] = (client_arg){s, i};
        assert_int_equal(pthread_create(&th[i], NULL, client_main, &args[i]), 0);
    }
    for (int i = 0; i < N_CLIENTS; i++) pthread_join(th[i], NULL);
}

static double metric(uint16_t port, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static double metric(uint16_t port, const char *fmt, ...) {
    char series[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(series, sizeof series, fmt, ap);
    va_end(ap);
    return kvbt_metric(port, series);
}

static void free_run(run_state *s) {
    for (int c = 0; c < N_CONV; c++) free(s->conv[c].history);
    pthread_mutex_destroy(&s->mu);
}

/* ---- 12 conversations x 4 turns through the router ---------------------------------------------- */

static void test_conversations_stay_on_their_backend(void **state) {
    (void)state;
    kvb_decode_node *nodes[3], *ref = start_decode();
    uint16_t ports[3];
    for (int i = 0; i < 3; i++) ports[i] = kvb_decode_node_port(nodes[i] = start_decode());
    char names[3][32];
    kvb_router *r = start_router(ports, 3, (kvb_router_config){0}, names);
    run_state s = {.router_port = kvb_router_port(r), .ref_port = kvb_decode_node_port(ref), .streams = true};
    pthread_mutex_init(&s.mu, NULL);
    run_clients(&s);
    if (atomic_load(&s.failures)) fail_msg("%d failure(s); first: %s", atomic_load(&s.failures), s.failure);
    int per_backend[3] = {0};
    for (int c = 0; c < N_CONV; c++) {
        const conversation *cv = &s.conv[c];
        assert_string_equal(cv->placement[0], "new");
        for (int t = 1; t < N_TURNS; t++) {
            assert_string_equal(cv->placement[t], "history");
            assert_string_equal(cv->backend[t], cv->backend[0]);
        }
        for (int b = 0; b < 3; b++) per_backend[b] += strcmp(cv->backend[0], names[b]) == 0 ? N_TURNS : 0;
    }
    const uint16_t rp = kvb_router_port(r);
    assert_true(metric(rp, "kvbridge_router_placements_total{result=\"new\"} ") == N_CONV);
    assert_true(metric(rp, "kvbridge_router_placements_total{result=\"history\"} ") == N_CONV * (N_TURNS - 1));
    assert_true(metric(rp, "kvbridge_router_placements_total{result=\"moved\"} ") == 0);
    assert_true(metric(rp, "kvbridge_router_retries_total ") == 0);
    int used = 0;
    for (int b = 0; b < 3; b++) { /* the router's count, the backend's own and the replies' headers agree */
        used += per_backend[b] > 0;
        assert_true(metric(rp, "kvbridge_router_backend_requests_total{backend=\"%s\"} ", names[b]) == per_backend[b]);
        assert_true(metric(ports[b], "kvb_http_requests_total{route=\"/v1/chat/completions\",code=\"200\"} ") ==
                    per_backend[b]);
    }
    assert_true(used >= 2); /* 12 conversations spread over the backends */
    kvb_router_stop(r);
    for (int i = 0; i < 3; i++) kvb_decode_node_stop(nodes[i]);
    kvb_decode_node_stop(ref);
    free_run(&s);
}

/* ---- one decode node stopped mid-run ------------------------------------------------------------ */

typedef struct {
    run_state *s;
    kvb_decode_node **nodes;
    const char (*names)[32];
    int killed;
} killer_arg;

/* Stops the backend of conversation 0 once a third of the turns are answered. */
static void *killer_main(void *arg) {
    killer_arg *k = arg;
    while (atomic_load(&k->s->answered) < N_CONV * N_TURNS / 3) usleep(2000);
    for (int b = 0; b < 3; b++)
        if (strcmp(k->s->conv[0].backend[0], k->names[b]) == 0) k->killed = b;
    kvb_decode_node_stop(k->nodes[k->killed]);
    k->nodes[k->killed] = NULL;
    return NULL;
}

static void test_backend_stopped_mid_run(void **state) {
    (void)state;
    kvb_decode_node *nodes[3], *ref = start_decode();
    uint16_t ports[3];
    for (int i = 0; i < 3; i++) ports[i] = kvb_decode_node_port(nodes[i] = start_decode());
    char names[3][32];
    kvb_router *r = start_router(ports, 3, (kvb_router_config){.health_interval_ms = 200}, names);
    run_state s = {.router_port = kvb_router_port(r), .ref_port = kvb_decode_node_port(ref)};
    pthread_mutex_init(&s.mu, NULL);
    killer_arg k = {.s = &s, .nodes = nodes, .names = (const char (*)[32])names, .killed = -1};
    pthread_t killer;
    assert_int_equal(pthread_create(&killer, NULL, killer_main, &k), 0);
    run_clients(&s);
    pthread_join(killer, NULL);
    if (atomic_load(&s.failures)) fail_msg("%d failure(s); first: %s", atomic_load(&s.failures), s.failure);
    assert_true(k.killed >= 0);
    int moved = 0;
    for (int c = 0; c < N_CONV; c++)
        for (int t = 1; t < N_TURNS; t++) {
            const conversation *cv = &s.conv[c];
            const bool same = strcmp(cv->backend[t], cv->backend[t - 1]) == 0;
            assert_string_equal(cv->placement[t], same ? "history" : "moved");
            moved += !same;
        }
    assert_true(moved >= 1);                                  /* conversation 0's at least */
    assert_string_not_equal(s.conv[0].backend[N_TURNS - 1], names[k.killed]);
    const uint16_t rp = kvb_router_port(r);
    const double retries = metric(rp, "kvbridge_router_retries_total ");
    double sent = 0;
    for (int b = 0; b < 3; b++) {
        const double n = metric(rp, "kvbridge_router_backend_requests_total{backend=\"%s\"} ", names[b]);
        sent += n;
        if (b != k.killed) /* a survivor answered every request it was sent, once */
            assert_true(metric(ports[b], "kvb_http_requests_total{route=\"/v1/chat/completions\",code=\"200\"} ") == n);
    }
    assert_true(sent == N_CONV * N_TURNS + retries);
    assert_true(metric(rp, "kvbridge_router_replies_cut_total ") == 0);
    assert_true(metric(rp, "kvbridge_router_backend_up{backend=\"%s\"} ", names[k.killed]) == 0);
    printf("router: stopped %s mid-run; %d turn(s) moved, %.0f retried\n", names[k.killed], moved, retries);
    kvb_router_stop(r);
    for (int i = 0; i < 3; i++) kvb_decode_node_stop(nodes[i]);
    kvb_decode_node_stop(ref);
    free_run(&s);
}

/* ---- fake backends: silent, or dying after its first event --------------------------------------- */

typedef struct {
    int fd;
    uint16_t port;
    bool answer;       /* false: accept nothing, say nothing (a silent backend) */
    atomic_int posts;  /* completion requests it got */
    pthread_t thread;
} fake_backend;

/* Reads a request head and its Content-Length body; false when the peer went away. */
static bool read_request(int c, char *buf, size_t cap, bool *is_post) {
    size_t n = 0;
    char *head_end = NULL;
    while (!head_end) {
        ssize_t k = recv(c, buf + n, cap - 1 - n, 0);
        if (k <= 0) return false;
        n += (size_t)k;
        buf[n] = 0;
        head_end = strstr(buf, "\r\n\r\n");
    }
    *is_post = strncmp(buf, "POST", 4) == 0;
    const char *cl = strcasestr(buf, "Content-Length:");
    const size_t want = (size_t)(head_end + 4 - buf) + (cl ? (size_t)atol(cl + 15) : 0);
    while (n < want && n < cap - 1) {
        ssize_t k = recv(c, buf + n, cap - 1 - n, 0);
        if (k <= 0) return false;
        n += (size_t)k;
    }
    return true;
}

/* Answers /health 200; a completion with an SSE head and one event, then hangs up mid-stream. */
static void *fake_main(void *arg) {
    fake_backend *f = arg;
    for (;;) {
        int c = accept(f->fd, NULL, NULL);
        if (c < 0) return NULL;
        char buf[65536];
        bool is_post = false;
        if (read_request(c, buf, sizeof buf, &is_post)) {
            static const char health[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n"
                                         "Connection: close\r\n\r\n{\"status\":\"ok\"}";
            static const char event[] = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"first\"}}]}\n\n";
            char out[512];
            int len = is_post ? snprintf(out, sizeof out, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                         "X-KVBridge: complete\r\nTransfer-Encoding: chunked\r\n\r\n%zx\r\n%s\r\n",
                                         strlen(event), event)
                              : snprintf(out, sizeof out, "%s", health);
            if (is_post) atomic_fetch_add(&f->posts, 1);
            if (send(c, out, (size_t)len, MSG_NOSIGNAL) < 0) perror("fake backend");
            if (is_post) usleep(100000); /* the event reaches the client; then the backend dies */
        }
        close(c);
    }
}

static void fake_start(fake_backend *f, bool answer) {
    f->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(f->fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(f->fd, 16), 0);
    assert_int_equal(getsockname(f->fd, (struct sockaddr *)&a, &len), 0);
    f->port = ntohs(a.sin_port);
    f->answer = answer;
    atomic_init(&f->posts, 0);
    if (answer) assert_int_equal(pthread_create(&f->thread, NULL, fake_main, f), 0);
}

static void fake_stop(fake_backend *f) {
    shutdown(f->fd, SHUT_RDWR);
    if (f->answer) pthread_join(f->thread, NULL);
    close(f->fd);
}

/* A chat body (a user message of salt and a number) whose rendezvous order over names puts backend `first` first. */
static void body_placed_first(char *body, size_t cap, const char names[][32], size_t n, uint32_t first, const char *salt,
                              bool stream) {
    for (int tag = 0; tag < 10000; tag++) {
        snprintf(body, cap, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"%s %d\"}],"
                 "\"max_tokens\":4,\"temperature\":0%s}", salt, tag, stream ? ",\"stream\":true" : "");
        kvb_completion_req *req = NULL;
        kvb_http_error e;
        assert_int_equal(kvb_completion_req_parse(KVB_API_CHAT_COMPLETIONS, body, strlen(body), &req, &e), KVB_OK);
        const char *list[8];
        uint32_t order[8];
        for (size_t i = 0; i < n; i++) list[i] = names[i];
        kvb_router_rendezvous(kvb_router_conversation_key(req, 1024), list, NULL, n, order);
        kvb_completion_req_free(req);
        if (order[0] == first) return;
    }
    fail_msg("no conversation placed first on backend %u", first);
}

static void test_stream_cut_after_first_event_is_not_retried(void **state) {
    (void)state;
    fake_backend f;
    fake_start(&f, true);
    kvb_decode_node *node = start_decode();
    uint16_t ports[2] = {f.port, kvb_decode_node_port(node)};
    char names[2][32], body[512];
    kvb_router *r = start_router(ports, 2, (kvb_router_config){.health_interval_ms = 60000}, names);
    body_placed_first(body, sizeof body, names, 2, 0, "cut", true);
    reply via;
    post(kvb_router_port(r), "/v1/chat/completions", body, strlen(body), NULL, &via);
    assert_int_equal(via.status, 200);
    assert_string_equal(via.backend, names[0]);
    assert_string_equal(via.verdict, "complete"); /* the backend's header, passed through */
    const char *first = strstr(via.body.p, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"first\"}}]}\n\n");
    const char *error = strstr(via.body.p, "data: {\"error\":");
    if (!first || !error || error < first) fail_msg("not the event then an error event: '%s'", via.body.p);
    assert_non_null(strstr(error, "\"code\":\"upstream_failed\""));
    assert_null(strstr(via.body.p, "[DONE]"));
    const uint16_t rp = kvb_router_port(r);
    assert_int_equal(atomic_load(&f.posts), 1); /* sent once, */
    assert_true(metric(rp, "kvbridge_router_retries_total ") == 0);             /* never again: */
    assert_true(metric(ports[1], "kvb_http_requests_total{route=\"/v1/chat/completions\",code=\"200\"} ") == 0);
    assert_true(metric(rp, "kvbridge_router_replies_cut_total ") == 1);
    assert_true(metric(rp, "kvbridge_router_upstream_failures_total{backend=\"%s\",kind=\"io\"} ", names[0]) == 1);
    free(via.body.p);
    kvb_router_stop(r);
    kvb_decode_node_stop(node);
    fake_stop(&f);
}

static void test_silent_backend_is_passed_over(void **state) {
    (void)state;
    fake_backend f;
    fake_start(&f, false); /* listens; the kernel completes connections no one reads */
    kvb_decode_node *node = start_decode();
    uint16_t ports[2] = {f.port, kvb_decode_node_port(node)};
    char names[2][32], body[512];
    kvb_router *r = start_router(ports, 2, (kvb_router_config){.health_interval_ms = 60000, .first_byte_timeout_ms = 1000},
                                 names);
    body_placed_first(body, sizeof body, names, 2, 0, "silent", false);
    reply via;
    post(kvb_router_port(r), "/v1/chat/completions", body, strlen(body), NULL, &via);
    assert_int_equal(via.status, 200);
    assert_string_equal(via.backend, names[1]);
    assert_string_equal(via.placement, "moved");
    printf("router: a silent backend cost %.2f s (first-byte timeout 1 s)\n", via.seconds);
    assert_true(via.seconds >= 0.9 && via.seconds < 4.0);
    const uint16_t rp = kvb_router_port(r);
    assert_true(metric(rp, "kvbridge_router_upstream_failures_total{backend=\"%s\",kind=\"timeout\"} ", names[0]) == 1);
    assert_true(metric(rp, "kvbridge_router_retries_total ") == 1);
    free(via.body.p);
    /* marked down: another new conversation placed first there goes elsewhere at once */
    body_placed_first(body, sizeof body, names, 2, 0, "again", false);
    post(kvb_router_port(r), "/v1/chat/completions", body, strlen(body), NULL, &via);
    assert_int_equal(via.status, 200);
    assert_string_equal(via.backend, names[1]);
    assert_string_equal(via.placement, "new");
    assert_true(via.seconds < 0.9);
    free(via.body.p);
    kvb_router_stop(r);
    kvb_decode_node_stop(node);
    fake_stop(&f);
}

/* ---- hostile input, the API key ------------------------------------------------------------------ */

/* Decode nodes run with their own --api-key: a router given it (--backend-api-key) relays with
 * it; one without it passes the node's 401 on (a client error, not a backend failure: no retry,
 * the node stays up); a key that would break the header line is refused at start. */
static void test_backend_api_key(void **state) {
    (void)state;
    kvb_decode_node *node = start_decode_key("node-key-0123");
    uint16_t ports[1] = {kvb_decode_node_port(node)};
    char names[1][32];
    const char *ok = "{\"model\":\"m\",\"prompt\":\"hello\",\"max_tokens\":2,\"temperature\":0}";
    kvb_router *with = start_router(ports, 1, (kvb_router_config){.backend_api_key = "node-key-0123"}, names);
    reply via;
    post(kvb_router_port(with), "/v1/completions", ok, strlen(ok), NULL, &via);
    if (via.status != 200) fail_msg("with the key: %ld %s", via.status, via.body.p);
    free(via.body.p);
    kvb_router *without = start_router(ports, 1, (kvb_router_config){0}, names);
    post(kvb_router_port(without), "/v1/completions", ok, strlen(ok), NULL, &via);
    assert_int_equal(via.status, 401);
    free(via.body.p);
    assert_true(metric(kvb_router_port(without), "kvbridge_router_retries_total ") == 0);
    assert_true(metric(kvb_router_port(without), "kvbridge_router_backend_up{backend=\"%s\"} ", names[0]) == 1);
    kvb_router_stop(without);
    kvb_router_stop(with);
    const char *list[1] = {names[0]};
    kvb_router_config bad = {.http_listen = "127.0.0.1:0", .backends = list, .n_backends = 1,
                             .backend_api_key = "key\r\nX-Injected: 1"};
    kvb_router *r = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_router_start(&bad, &r, &err), KVB_ERR_INVALID);
    assert_null(r);
    kvb_decode_node_stop(node);
}

static void test_hostile_input_never_reaches_a_backend(void **state) {
    (void)state;
    kvb_decode_node *node = start_decode();
    uint16_t ports[1] = {kvb_decode_node_port(node)};
    char names[1][32];
    kvb_router *r = start_router(ports, 1, (kvb_router_config){.api_key = "router-key-0123", .health_interval_ms = 50},
                                 names);
    const uint16_t rp = kvb_router_port(r);
    const char *auth = "Authorization: Bearer router-key-0123";
    struct { const char *body; long status; const char *header; } cases[] = {
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}", 400, auth},          /* bad JSON */
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temprature\":0}", 400, auth},
        {"{\"model\":\"m\",\"messages\":[]}", 400, auth},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 401, NULL},      /* no key */
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 401, "Authorization: Bearer wrong-key-0"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        reply via;
        post(rp, "/v1/chat/completions", cases[i].body, strlen(cases[i].body), cases[i].header, &via);
        if (via.status != cases[i].status) fail_msg("case %zu: %ld, want %ld: %s", i, via.status, cases[i].status, via.body.p);
        assert_non_null(strstr(via.body.p, "\"error\""));
        free(via.body.p);
    }
    const size_t big = (size_t)33 << 20; /* over the 32 MiB limit */
    char *huge = malloc(big);
    memset(huge, ' ', big);
    memcpy(huge, "{\"model\":", 9);
    reply via;
    post(rp, "/v1/completions", huge, big, auth, &via);
    free(huge);
    assert_int_equal(via.status, 413);
    free(via.body.p);
    assert_true(metric(rp, "kvbridge_router_backend_requests_total{backend=\"%s\"} ", names[0]) == 0);
    const char *ok = "{\"model\":\"m\",\"prompt\":\"hello\",\"max_tokens\":2,\"temperature\":0}";
    post(rp, "/v1/completions", ok, strlen(ok), auth, &via); /* with the key it goes through */
    assert_int_equal(via.status, 200);
    assert_string_equal(via.backend, names[0]);
    free(via.body.p);
    assert_true(metric(ports[0], "kvb_http_requests_total{route=\"/v1/completions\",code=\"200\"} ") == 1);
    /* the model listing comes from the backend; an odd model id is its 404, no fault of the backend's */
    char cmd[256], health[2048] = "";
    snprintf(cmd, sizeof cmd, "curl -s -w ' %%{http_code}' -H '%s' http://127.0.0.1:%u/v1/models", auth, rp);
    assert_int_equal(kvbt_sh(cmd, health, sizeof health, 0), 0);
    if (!strstr(health, "\"object\":\"list\"") || !strstr(health, "} 200")) fail_msg("/v1/models: %s", health);
    snprintf(cmd, sizeof cmd, "curl -s -w ' %%{http_code}' -H '%s' 'http://127.0.0.1:%u/v1/models/a%%20b%%0d%%0a'", auth, rp);
    assert_int_equal(kvbt_sh(cmd, health, sizeof health, 0), 0);
    if (!strstr(health, "model_not_found") || !strstr(health, "} 404")) fail_msg("/v1/models/ID: %s", health);
    assert_true(metric(rp, "kvbridge_router_backend_up{backend=\"%s\"} ", names[0]) == 1);
    /* its only backend gone: /health says so (503), a request is the router's 503 */
    kvb_decode_node_stop(node);
    health[0] = 0;
    snprintf(cmd, sizeof cmd, "curl -s -w ' %%{http_code}' http://127.0.0.1:%u/health", rp);
    for (int i = 0; i < 100 && !strstr(health, "no_backend_up"); i++) {
        usleep(20000);
        assert_int_equal(kvbt_sh(cmd, health, sizeof health, 0), 0);
    }
    if (!strstr(health, "\"status\":\"no_backend_up\"") || !strstr(health, "\"state\":\"down\"") ||
        !strstr(health, "} 503"))
        fail_msg("/health: %s", health);
    post(rp, "/v1/completions", ok, strlen(ok), auth, &via);
    assert_int_equal(via.status, 503);
    assert_non_null(strstr(via.body.p, "no_backend_available"));
    free(via.body.p);
    kvb_router_stop(r);
}

/* ---- the official openai client through the router ------------------------------------------------ */

/* tests/openai_node_check.py (streaming with usage, logprobs, JSON mode, structured outputs) against
 * the router in front of a decode node bridged to a prefill node: the verdicts, headers and usage
 * it checks come through untouched. */
static void test_openai_client_through_router(void **state) {
    (void)state;
    const char *src = getenv("KVB_SOURCE_DIR");
    if (!src) src = ".";
    char py[600];
    snprintf(py, sizeof py, "%s/.venv/bin/python", src);
    if (access(py, X_OK) != 0) kvbt_skip("no %s (tools/install.sh makes the venv)", py);
    kvb_prefill_config pc = {.listen = "127.0.0.1:0", .model_path = g_model, .psk = "router-test-psk-0123456789",
                             .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096};
    kvb_prefill_node *pn = NULL;
    kvb_err err = {0};
    if (kvb_prefill_node_start(&pc, &pn, &err)) fail_msg("prefill node: %s", err.msg);
    char peer[32];
    snprintf(peer, sizeof peer, "127.0.0.1:%u", kvb_prefill_node_port(pn));
    kvb_decode_config dc = {.http_listen = "127.0.0.1:0", .peer = peer, .psk = pc.psk, .model_path = g_model,
                            .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096};
    kvb_decode_node *dn = NULL;
    if (kvb_decode_node_start(&dc, &dn, &err)) fail_msg("decode node: %s", err.msg);
    uint16_t ports[1] = {kvb_decode_node_port(dn)};
    char names[1][32], cmd[1400], out[8192];
    kvb_router *r = start_router(ports, 1, (kvb_router_config){0}, names);
    snprintf(cmd, sizeof cmd, "'%s' '%s/tests/openai_node_check.py' %u", py, src, kvb_router_port(r));
    const int rc = kvbt_sh(cmd, out, sizeof out, 1);
    printf("%s", out);
    kvb_router_stop(r);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
    if (rc == 77) kvbt_skip("the venv has no openai package");
    assert_int_equal(rc, 0);
}

/* ---- the table and the order on their own -------------------------------------------------------- */

static void test_history_is_a_bounded_lru(void **state) {
    (void)state;
    router_history *h = NULL;
    kvb_err err = {0};
    assert_int_equal(router_history_create(4, &h, &err), KVB_OK);
    for (uint64_t k = 1; k <= 4; k++) router_history_put(h, k * 0x1000, (int)k); /* same bucket bits: chains */
    assert_int_equal(router_history_get(h, 0x1000), 1); /* key 1 is now the most recent */
    router_history_put(h, 0x5000, 5);                  /* evicts key 2, the least recent */
    assert_int_equal(router_history_get(h, 0x2000), -1);
    assert_int_equal(router_history_get(h, 0x1000), 1);
    assert_int_equal(router_history_get(h, 0x3000), 3);
    assert_int_equal(router_history_get(h, 0x5000), 5);
    router_history_put(h, 0x3000, 7); /* an update keeps one entry */
    assert_int_equal(router_history_get(h, 0x3000), 7);
    assert_int_equal(router_history_get(h, 0x4000), 4);
    router_history_free(h);

    const char *names[3] = {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"};
    int first[3] = {0}, moved_by_load = 0;
    for (uint64_t key = 0; key < 3000; key++) {
        uint32_t o[3], o2[3];
        kvb_router_rendezvous(key, names, NULL, 3, o);
        assert_int_equal(o[0] + o[1] + o[2], 3); /* a permutation */
        assert_true(o[0] != o[1] && o[1] != o[2] && o[0] != o[2]);
        first[o[0]]++;
        const uint32_t load[3] = {o[0] == 0 ? 8u : 0u, o[0] == 1 ? 8u : 0u, o[0] == 2 ? 8u : 0u};
        kvb_router_rendezvous(key, names, load, 3, o2);
        moved_by_load += o2[0] != o[0];
    }
    for (int i = 0; i < 3; i++) assert_true(first[i] > 800 && first[i] < 1200); /* about a third each */
    assert_true(moved_by_load > 2000); /* a loaded backend yields most new keys */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_history_is_a_bounded_lru),
        cmocka_unit_test(test_hostile_input_never_reaches_a_backend),
        cmocka_unit_test(test_backend_api_key),
        cmocka_unit_test(test_conversations_stay_on_their_backend),
        cmocka_unit_test(test_backend_stopped_mid_run),
        cmocka_unit_test(test_stream_cut_after_first_event_is_not_retried),
        cmocka_unit_test(test_silent_backend_is_passed_over),
        cmocka_unit_test(test_openai_client_through_router),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
