/* tests/test_http_server.c — the HTTP front door on loopback (issue 6, items 3-4 and the openai
 * client acceptance) with a fake completion handler that echoes the last user message (or the
 * prompt) word by word under the verdict "partial 3/8". A raw-socket HTTP/1.1 client (chunked
 * decoding, keep-alive) checks: non-streaming and streaming chat and text completions (SSE parsed
 * chunk by chunk, deltas join to the message, the X-KVBridge header equals usage.kvbridge.verdict,
 * the include_usage chunk), max_tokens -> "length", handler errors before (a real 400) and after the
 * first token (an SSE error event), handler contract violations (500), HTTP refusals (404, 405 +
 * Allow, 413 by Content-Length and by chunked upload, 415, 400 naming the param, model_not_found),
 * /health with the handler's fields, /v1/models, /metrics as valid Prometheus text (a small parser
 * below), client disconnects seen by the handler (streaming and not) and counted, concurrent
 * clients, stopping the server mid-stream, and the metrics registry on its own (values, escaping,
 * histograms, name checks, threads), and the API key (401 invalid_api_key + WWW-Authenticate on the
 * /v1/ routes without the right "Authorization: Bearer KEY", /health and /metrics open, short keys
 * refused). Last, tests/openai_client_check.py runs the official openai client against the server,
 * without a key and with one (skips with a message when .venv/bin/python or openai is missing). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvb_http.h"

#define MODEL "kvb-test"
#define VERDICT "partial 3/8"
#define SMALL_BODY_LIMIT (64 * 1024)

/* ---- the fake handler ------------------------------------------------------------------------- */

typedef struct {
    atomic_int calls;
    atomic_int saw_cancel;      /* emit returned KVB_ERR_IO or cancelled() became true */
    atomic_int slow_running;    /* a SLOW request is inside the handler */
    atomic_int choice_overruns; /* next_choice past n was refused */
    atomic_int contract_errors; /* emit/finish answered KVB_ERR_INVALID where the test expects it */
} fake_state;

static fake_state g_fake;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static size_t count_words(const char *s) {
    size_t n = 0;
    bool in = false;
    for (; *s; s++) {
        bool sp = *s == ' ' || *s == '\n' || *s == '\t';
        if (!sp && !in) n++;
        in = !sp;
    }
    return n;
}

/* With logprobs asked for, the word's entry: its bytes at -0.5 per word so far, and the asked
 * number of alternatives "alt0", "alt1", ... each 1 lower. The word "RAW" stands for a token
 * holding part of a character (bytes E2 82, logprob -inf) whose text is not emitted yet. */
static kvb_status add_word_logprobs(kvb_completion_out *out, const kvb_completion_req *req, const char *word,
                                    int64_t index) {
    if (!req->logprobs) return KVB_OK;
    const bool raw = strcmp(word, "RAW") == 0 || strcmp(word, " RAW") == 0;
    kvb_token_logprob tok = {.bytes = raw ? "\xe2\x82" : word, .n_bytes = raw ? 2 : strlen(word),
                             .logprob = raw ? -INFINITY : -0.5f * (float)(index + 1)};
    kvb_token_logprob top[KVB_HTTP_MAX_TOP_LOGPROBS];
    static const char *const alts[4] = {"alt0", "alt1", "alt2", "alt3"};
    for (uint32_t j = 0; j < req->top_logprobs && j < 4; j++)
        top[j] = (kvb_token_logprob){.bytes = alts[j], .n_bytes = 4, .logprob = tok.logprob - 1.0f - (float)j};
    return kvb_completion_add_logprobs(out, &tok, top, req->top_logprobs < 4 ? req->top_logprobs : 4);
}

/* Emits `text` word by word: "a", " b", " c" (so the deltas join to the text). */
static kvb_status emit_words(kvb_completion_out *out, const kvb_completion_req *req, const char *text,
                             int64_t max_words, int64_t *emitted, int delay_ms) {
    const char *p = text;
    *emitted = 0;
    while (*p) {
        const char *start = p;
        while (*p == ' ') p++;
        while (*p && *p != ' ') p++;
        if (p == start) break;
        if (max_words >= 0 && *emitted >= max_words) return KVB_ERR_RANGE;
        char word[256];
        size_t n = (size_t)(p - start) < sizeof word - 1 ? (size_t)(p - start) : sizeof word - 1;
        memcpy(word, start, n);
        word[n] = '\0';
        kvb_status st = add_word_logprobs(out, req, word, *emitted);
        if (!st) st = kvb_completion_emit(out, strstr(word, "RAW") ? "" : word);
        if (st) return st;
        (*emitted)++;
        if (delay_ms) sleep_ms(delay_ms);
    }
    return KVB_OK;
}

static void fake_completion(void *ctx, const kvb_completion_req *req, kvb_completion_out *out) {
    fake_state *fs = ctx;
    atomic_fetch_add(&fs->calls, 1);
    const char *text = "";
    size_t prompt_words = 0;
    char token_text[64];
    if (req->api == KVB_API_CHAT_COMPLETIONS) {
        for (size_t i = 0; i < req->n_messages; i++) {
            prompt_words += count_words(req->messages[i].content);
            if (strcmp(req->messages[i].role, "user") == 0) text = req->messages[i].content;
        }
    } else if (req->prompt) {
        text = req->prompt;
        prompt_words = count_words(text);
    } else {
        snprintf(token_text, sizeof token_text, "tokens %zu", req->n_prompt_tokens);
        text = token_text;
        prompt_words = req->n_prompt_tokens;
    }
    if (strcmp(text, "FAIL_CONTEXT") == 0) {
        kvb_completion_fail(out, 400, "context_length_exceeded", "messages",
                            "This model's maximum context length is 64 tokens; the prompt has 99.");
        return;
    }
    if (strcmp(text, "NO_VERDICT") == 0) {
        if (kvb_completion_emit(out, "x") == KVB_ERR_INVALID) atomic_fetch_add(&fs->contract_errors, 1);
        kvb_completion_fail(out, 500, NULL, NULL, "handler contract: emit without a verdict");
        return;
    }
    if (strcmp(text, "FORGET") == 0) return; /* neither finish nor fail */
    kvb_completion_set_verdict(out, VERDICT);
    if (strcmp(text, "FAIL_MIDSTREAM") == 0) {
        kvb_completion_emit(out, "partial");
        kvb_completion_fail(out, 500, NULL, NULL, "the decoder failed mid-stream");
        if (kvb_completion_emit(out, "more") == KVB_ERR_INVALID) atomic_fetch_add(&fs->contract_errors, 1);
        return;
    }
    int64_t emitted = 0;
    kvb_status st;
    if (strcmp(text, "PAUSE") == 0) { /* gaps longer than the idle timeout of test_idle_timeout */
        sleep_ms(1500);
        st = kvb_completion_emit(out, "a");
        sleep_ms(1500);
        if (st == KVB_OK) st = kvb_completion_emit(out, " b");
        emitted = 2;
    } else if (strcmp(text, "SLOW") == 0) {
        atomic_fetch_add(&fs->slow_running, 1);
        st = KVB_OK;
        for (int i = 0; i < 400 && st == KVB_OK; i++) { /* 20 s at most */
            st = kvb_completion_emit(out, i ? " tick" : "tick");
            if (st == KVB_OK) emitted++;
            sleep_ms(50);
        }
        if (st == KVB_ERR_IO && kvb_completion_cancelled(out)) atomic_fetch_add(&fs->saw_cancel, 1);
        atomic_fetch_sub(&fs->slow_running, 1);
    } else { /* n choices: "#c " then the words, for c > 0 after the previous choice ended */
        st = KVB_OK;
        for (uint32_t c = 0; c < req->n; c++) {
            if (c && (st = kvb_completion_next_choice(out, st == KVB_ERR_RANGE ? KVB_FINISH_LENGTH : KVB_FINISH_STOP)))
                break;
            char tag[16];
            snprintf(tag, sizeof tag, "#%u ", c);
            if (req->n > 1 && (st = kvb_completion_emit(out, tag))) break;
            int64_t words = 0;
            st = emit_words(out, req, text, req->max_tokens, &words, 0);
            emitted += words;
            if (st != KVB_OK && st != KVB_ERR_RANGE) break;
        }
        if (req->n > 1 && kvb_completion_next_choice(out, KVB_FINISH_STOP) == KVB_ERR_INVALID)
            atomic_fetch_add(&fs->choice_overruns, 1); /* no choice past n */
    }
    if (st == KVB_ERR_IO) return; /* client gone: nothing to finish (the server answers for us) */
    /* the handler's own buffer, as the decode node's: the reply must not read it after we return */
    char faults[64];
    snprintf(faults, sizeof faults, "%s", "peer lost: \x01 \xff\"x\""); /* quotes the peer: made printable */
    kvb_usage u = {
        .prompt_tokens = (int64_t)prompt_words,
        .completion_tokens = emitted,
        .cached_tokens = 5,
        .bridged_tokens = 12,
        .native_tokens = 7,
        .tokenize_s = 0.003,
        .queue_s = 0.002,
        .lookup_s = 0.001,
        .prefill_s = 0.25,
        .transfer_s = 0.125,
        .native_s = 0.0625,
        .decode_s = 0.5,
        .bridge_attempts = 2,
        .bridge_faults = faults,
    };
    kvb_completion_finish(out, st == KVB_ERR_RANGE ? KVB_FINISH_LENGTH : KVB_FINISH_STOP, &u);
    if (kvb_completion_finish(out, KVB_FINISH_STOP, &u) == KVB_ERR_INVALID)
        atomic_fetch_add(&fs->contract_errors, 1); /* a second finish is refused */
    volatile char *vf = faults; /* what a dangling pointer would show (volatile: not optimised away) */
    for (size_t i = 0; i + 1 < sizeof faults; i++) vf[i] = 'Z';
}

static void fake_health(void *ctx, cJSON *body) {
    (void)ctx;
    cJSON_AddStringToObject(body, "peer", "up");
    cJSON_AddNumberToObject(body, "queue_depth", 0);
}

/* /tokenize: one id per word, its length; "TOOLONG" is a 400 naming the prompt. /detokenize:
 * "<id>" per token, space-separated; id 666 is a 400 naming it. */
static int fake_tokenize(void *ctx, const kvb_completion_req *req, int32_t **ids, size_t *n_ids,
                         uint32_t *max_model_len, kvb_http_error *err) {
    (void)ctx;
    const char *text = req->api == KVB_API_CHAT_COMPLETIONS ? req->messages[req->n_messages - 1].content : req->prompt;
    if (!text) text = "";
    if (strcmp(text, "TOOLONG") == 0) {
        kvb_http_error_set(err, 400, NULL, "prompt", "the prompt is too long");
        return 400;
    }
    *ids = malloc(sizeof(int32_t) * (strlen(text) + 1));
    *n_ids = 0;
    for (const char *p = text; *p;) {
        while (*p == ' ') p++;
        const char *w = p;
        while (*p && *p != ' ') p++;
        if (p > w) (*ids)[(*n_ids)++] = (int32_t)(p - w);
    }
    *max_model_len = 4096;
    return 0;
}

static int fake_detokenize(void *ctx, const kvb_completion_req *req, char **text, kvb_http_error *err) {
    (void)ctx;
    char *out = malloc(16 * req->n_prompt_tokens + 1);
    size_t len = 0;
    out[0] = 0;
    for (size_t i = 0; i < req->n_prompt_tokens; i++) {
        if (req->prompt_tokens[i] == 666) {
            free(out);
            kvb_http_error_set(err, 400, NULL, "tokens[0]", "no such token");
            return 400;
        }
        len += (size_t)sprintf(out + len, "%s<%d>", i ? " " : "", req->prompt_tokens[i]);
    }
    *text = out;
    return 0;
}

#define API_KEY "sk-kvb-test-0123456789abcdef"

static kvb_http_server *start_server_key(kvb_metrics *metrics, const char *api_key) {
    kvb_http_config cfg = {
        .listen = "127.0.0.1:0",
        .model_id = MODEL,
        .max_body_bytes = SMALL_BODY_LIMIT,
        .metrics = metrics,
        .api_key = api_key,
        .max_model_len = 4096,
    };
    kvb_http_handlers h = {.ctx = &g_fake, .completion = fake_completion, .health = fake_health,
                           .tokenize = fake_tokenize, .detokenize = fake_detokenize};
    kvb_http_server *s = NULL;
    kvb_err err = {0};
    if (kvb_http_server_start(&cfg, &h, &s, &err) != KVB_OK) fail_msg("server start: %s", err.msg);
    assert_true(kvb_http_server_port(s) != 0);
    return s;
}

static kvb_http_server *start_server(kvb_metrics *metrics) { return start_server_key(metrics, NULL); }

/* ---- a raw HTTP/1.1 client ---------------------------------------------------------------------- */

typedef struct {
    int status;
    char head[8192]; /* status line + headers */
    char *body;      /* de-chunked, NUL-terminated */
    size_t body_len;
    bool chunked;
} http_resp;

static void resp_free(http_resp *r) {
    free(r->body);
    memset(r, 0, sizeof *r);
}

static int connect_to(uint16_t port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) fail_msg("connect: %s", strerror(errno));
    return fd;
}

static void send_all(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return; /* the server may close early (413): reading tells */
        p += w;
        n -= (size_t)w;
    }
}

/* Buffered reader over the socket. */
typedef struct {
    int fd;
    char buf[65536];
    size_t off, len;
} reader;

static int rd_byte(reader *r) {
    if (r->off == r->len) {
        ssize_t n;
        do n = recv(r->fd, r->buf, sizeof r->buf, 0);
        while (n < 0 && errno == EINTR);
        if (n <= 0) return -1;
        r->off = 0;
        r->len = (size_t)n;
    }
    return (unsigned char)r->buf[r->off++];
}

static bool rd_line(reader *r, char *line, size_t cap) {
    size_t n = 0;
    for (;;) {
        int c = rd_byte(r);
        if (c < 0) return false;
        if (c == '\n') break;
        if (n + 1 < cap) line[n++] = (char)c;
    }
    if (n && line[n - 1] == '\r') n--;
    line[n] = '\0';
    return true;
}

static void body_append(http_resp *resp, const char *p, size_t n) {
    resp->body = realloc(resp->body, resp->body_len + n + 1);
    assert_non_null(resp->body);
    memcpy(resp->body + resp->body_len, p, n);
    resp->body_len += n;
    resp->body[resp->body_len] = '\0';
}

static const char *header_value(const http_resp *r, const char *name, char *out, size_t cap) {
    size_t nl = strlen(name);
    for (const char *p = strchr(r->head, '\n'); p; p = strchr(p, '\n')) {
        p++;
        if (strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
            const char *v = p + nl + 1;
            while (*v == ' ') v++;
            size_t n = strcspn(v, "\r\n");
            if (n >= cap) n = cap - 1;
            memcpy(out, v, n);
            out[n] = '\0';
            return out;
        }
    }
    return NULL;
}

/* Reads one response (status, headers, body by Content-Length, chunked, or to EOF). */
static bool read_response(reader *rd, http_resp *resp, bool head_request) {
    memset(resp, 0, sizeof *resp);
    char line[8192];
    if (!rd_line(rd, line, sizeof line)) return false;
    if (sscanf(line, "HTTP/1.%*d %d", &resp->status) != 1) return false;
    size_t hl = (size_t)snprintf(resp->head, sizeof resp->head, "%s\n", line);
    long long content_length = -1;
    for (;;) {
        if (!rd_line(rd, line, sizeof line)) return false;
        if (!line[0]) break;
        if (hl < sizeof resp->head) hl += (size_t)snprintf(resp->head + hl, sizeof resp->head - hl, "%s\n", line);
        if (strncasecmp(line, "Content-Length:", 15) == 0) content_length = atoll(line + 15);
        if (strncasecmp(line, "Transfer-Encoding:", 18) == 0 && strstr(line, "chunked")) resp->chunked = true;
    }
    body_append(resp, "", 0);
    if (head_request) return true;
    if (resp->chunked) {
        for (;;) {
            if (!rd_line(rd, line, sizeof line)) return false;
            unsigned long size = strtoul(line, NULL, 16);
            if (size == 0) {
                while (rd_line(rd, line, sizeof line) && line[0]) {} /* trailers */
                return true;
            }
            for (unsigned long i = 0; i < size; i++) {
                int c = rd_byte(rd);
                if (c < 0) return false;
                char ch = (char)c;
                body_append(resp, &ch, 1);
            }
            if (!rd_line(rd, line, sizeof line)) return false; /* CRLF after the chunk */
        }
    }
    if (content_length >= 0) {
        for (long long i = 0; i < content_length; i++) {
            int c = rd_byte(rd);
            if (c < 0) return false;
            char ch = (char)c;
            body_append(resp, &ch, 1);
        }
        return true;
    }
    for (int c; (c = rd_byte(rd)) >= 0;) {
        char ch = (char)c;
        body_append(resp, &ch, 1);
    }
    return true;
}

/* One request on a fresh connection (Connection: close). */
static void http_raw(uint16_t port, const char *raw, size_t raw_len, http_resp *resp) {
    int fd = connect_to(port);
    send_all(fd, raw, raw_len);
    reader *rd = calloc(1, sizeof *rd);
    assert_non_null(rd);
    rd->fd = fd;
    bool head = strncmp(raw, "HEAD ", 5) == 0;
    if (!read_response(rd, resp, head)) fail_msg("no complete HTTP response to: %.200s", raw);
    free(rd);
    close(fd);
}

static void http_call(uint16_t port, const char *method, const char *path, const char *content_type,
                      const char *body, http_resp *resp) {
    char *req = malloc(1024 + (body ? strlen(body) : 0));
    assert_non_null(req);
    int n = sprintf(req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n", method, path);
    if (content_type) n += sprintf(req + n, "Content-Type: %s\r\n", content_type);
    if (body) n += sprintf(req + n, "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
    else n += sprintf(req + n, "\r\n");
    http_raw(port, req, (size_t)n, resp);
    free(req);
}

/* Like http_call with an Authorization header (its whole value, e.g. "Bearer KEY"; NULL: none). */
static void http_call_auth(uint16_t port, const char *method, const char *path, const char *authorization,
                           const char *content_type, const char *body, http_resp *resp) {
    char *req = malloc(1024 + (authorization ? strlen(authorization) : 0) + (body ? strlen(body) : 0));
    assert_non_null(req);
    int n = sprintf(req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n", method, path);
    if (authorization) n += sprintf(req + n, "Authorization: %s\r\n", authorization);
    if (content_type) n += sprintf(req + n, "Content-Type: %s\r\n", content_type);
    if (body) n += sprintf(req + n, "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
    else n += sprintf(req + n, "\r\n");
    http_raw(port, req, (size_t)n, resp);
    free(req);
}

static void post_json(uint16_t port, const char *path, const char *body, http_resp *resp) {
    http_call(port, "POST", path, "application/json", body, resp);
}

static cJSON *parse_body(const http_resp *r) {
    cJSON *j = cJSON_Parse(r->body);
    if (!j) fail_msg("response body is not JSON: %.300s", r->body);
    return j;
}

/* The item at "a.b.0.c" (object keys and array indexes), or NULL. */
static const cJSON *jitem(const cJSON *obj, const char *path) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    const cJSON *cur = obj;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ".", &save); tok && cur; tok = strtok_r(NULL, ".", &save)) {
        if (tok[0] >= '0' && tok[0] <= '9') cur = cJSON_GetArrayItem(cur, atoi(tok));
        else cur = cJSON_GetObjectItemCaseSensitive(cur, tok);
    }
    return cur;
}

static const char *jstr(const cJSON *obj, const char *path) {
    const cJSON *cur = jitem(obj, path);
    return cJSON_IsString(cur) ? cur->valuestring : NULL;
}

static double jnum(const cJSON *obj, const char *path) {
    const cJSON *cur = jitem(obj, path);
    if (!cJSON_IsNumber(cur)) fail_msg("%s is not a number", path);
    return cur->valuedouble;
}

static void expect_error(const http_resp *r, int status, const char *param, const char *code,
                         const char *msg_part) {
    if (r->status != status) fail_msg("expected %d, got %d: %.300s", status, r->status, r->body);
    cJSON *j = parse_body(r);
    const char *type = jstr(j, "error.type");
    assert_non_null(type);
    assert_string_equal(type, status >= 500 ? "server_error" : "invalid_request_error");
    const char *msg = jstr(j, "error.message");
    assert_non_null(msg);
    if (msg_part && !strstr(msg, msg_part)) fail_msg("message '%s' lacks '%s'", msg, msg_part);
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "error"), "param");
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "error"), "code");
    assert_non_null(p);
    assert_non_null(c);
    if (param) assert_string_equal(p->valuestring ? p->valuestring : "(null)", param);
    else assert_true(cJSON_IsNull(p));
    if (code) assert_string_equal(c->valuestring ? c->valuestring : "(null)", code);
    else assert_true(cJSON_IsNull(c));
    cJSON_Delete(j);
}

/* ---- usage.kvbridge ----------------------------------------------------------------------------- */

static void expect_kvbridge_usage(const cJSON *usage, const char *verdict_header, int64_t completion_tokens) {
    assert_non_null(usage);
    assert_true(jnum(usage, "completion_tokens") == (double)completion_tokens);
    assert_true(jnum(usage, "total_tokens") == jnum(usage, "prompt_tokens") + jnum(usage, "completion_tokens"));
    assert_true(jnum(usage, "prompt_tokens_details.cached_tokens") == 5);
    const char *v = jstr(usage, "kvbridge.verdict");
    assert_non_null(v);
    assert_string_equal(v, VERDICT);
    assert_string_equal(v, verdict_header); /* header and body agree */
    assert_true(jnum(usage, "kvbridge.cached_tokens") == 5);
    assert_true(jnum(usage, "kvbridge.bridged_tokens") == 12);
    assert_true(jnum(usage, "kvbridge.native_tokens") == 7);
    assert_true(jnum(usage, "kvbridge.tokenize_s") == 0.003);
    assert_true(jnum(usage, "kvbridge.queue_s") == 0.002);
    assert_true(jnum(usage, "kvbridge.lookup_s") == 0.001);
    assert_true(jnum(usage, "kvbridge.prefill_s") == 0.25);
    assert_true(jnum(usage, "kvbridge.native_s") == 0.0625);
    assert_true(jnum(usage, "kvbridge.transfer_s") == 0.125);
    assert_true(jnum(usage, "kvbridge.decode_s") == 0.5);
    assert_true(jnum(usage, "kvbridge.bridge_attempts") == 2);
    assert_string_equal(jstr(usage, "kvbridge.bridge_faults"), "peer lost: ? ?\"x\"");
}

/* ---- SSE ---------------------------------------------------------------------------------------- */

typedef struct {
    cJSON *events[512]; /* parsed data payloads, in order */
    size_t n_events;
    bool done;          /* "data: [DONE]" was the last event */
} sse_stream;

static void sse_parse(const char *body, sse_stream *s) {
    memset(s, 0, sizeof *s);
    const char *p = body;
    while (*p) {
        const char *end = strstr(p, "\n\n");
        if (!end) fail_msg("SSE event not terminated by a blank line: %.200s", p);
        if (strncmp(p, "data: ", 6) != 0) fail_msg("SSE line is not 'data: ': %.200s", p);
        assert_false(s->done); /* nothing after [DONE] */
        size_t n = (size_t)(end - p - 6);
        if (n == 6 && strncmp(p + 6, "[DONE]", 6) == 0) {
            s->done = true;
        } else {
            assert_null(memchr(p + 6, '\n', n)); /* one line per event */
            cJSON *j = cJSON_ParseWithLength(p + 6, n);
            if (!j) fail_msg("SSE data is not JSON: %.*s", (int)n, p + 6);
            assert_true(s->n_events < KVB_ARRAY_LEN(s->events));
            s->events[s->n_events++] = j;
        }
        p = end + 2;
    }
}

static void sse_free(sse_stream *s) {
    for (size_t i = 0; i < s->n_events; i++) cJSON_Delete(s->events[i]);
}

/* Checks a chat or text stream: the deltas join to `expect_text`, one finish chunk, and (with
 * include_usage) a final usage chunk. */
static void check_stream(const http_resp *r, bool chat, const char *expect_text, const char *finish,
                         bool include_usage, int64_t completion_tokens) {
    assert_int_equal(r->status, 200);
    assert_true(r->chunked);
    char ct[128], verdict[128];
    assert_non_null(header_value(r, "Content-Type", ct, sizeof ct));
    assert_string_equal(ct, "text/event-stream");
    assert_non_null(header_value(r, "X-KVBridge", verdict, sizeof verdict));
    assert_string_equal(verdict, VERDICT);
    sse_stream s;
    sse_parse(r->body, &s);
    assert_true(s.done);
    char text[4096] = "";
    int finishes = 0, roles = 0;
    const char *id = NULL;
    size_t n_choice_events = include_usage ? s.n_events - 1 : s.n_events;
    for (size_t i = 0; i < n_choice_events; i++) {
        const cJSON *e = s.events[i];
        assert_string_equal(jstr(e, "object"), chat ? "chat.completion.chunk" : "text_completion");
        assert_string_equal(jstr(e, "model"), MODEL);
        if (!id) id = jstr(e, "id");
        assert_string_equal(jstr(e, "id"), id); /* one id for the whole stream */
        assert_int_equal(strncmp(id, chat ? "chatcmpl-" : "cmpl-", chat ? 9 : 5), 0);
        assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(e, "choices")), 1);
        const char *piece = chat ? jstr(e, "choices.0.delta.content") : jstr(e, "choices.0.text");
        if (chat && jstr(e, "choices.0.delta.role")) {
            assert_int_equal(i, 0);
            assert_string_equal(jstr(e, "choices.0.delta.role"), "assistant");
            roles++;
        }
        if (piece) strncat(text, piece, sizeof text - strlen(text) - 1);
        const char *fr = jstr(e, "choices.0.finish_reason");
        if (fr) {
            assert_string_equal(fr, finish);
            assert_int_equal(i, n_choice_events - 1); /* the finish chunk is the last choice chunk */
            finishes++;
        }
        const cJSON *usage = cJSON_GetObjectItem(e, "usage");
        if (include_usage) assert_true(cJSON_IsNull(usage));
        else assert_null(usage);
    }
    assert_int_equal(finishes, 1);
    assert_int_equal(roles, chat ? 1 : 0);
    assert_string_equal(text, expect_text);
    if (include_usage) {
        const cJSON *last = s.events[s.n_events - 1];
        assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(last, "choices")), 0);
        expect_kvbridge_usage(cJSON_GetObjectItem(last, "usage"), verdict, completion_tokens);
    }
    sse_free(&s);
}

/* ---- a tiny Prometheus text format (0.0.4) checker ------------------------------------------------ */

typedef struct {
    char name[128];
    char type[16];
} prom_family;

static bool prom_name_ok(const char *s, size_t n, bool label) {
    if (n == 0) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool a = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (!label && c == ':');
        if (!a && !(i && c >= '0' && c <= '9')) return false;
    }
    return true;
}

static bool prom_value_ok(const char *s, double *v) {
    if (strcmp(s, "+Inf") == 0) { *v = INFINITY; return true; }
    if (strcmp(s, "-Inf") == 0) { *v = -INFINITY; return true; }
    if (strcmp(s, "NaN") == 0) { *v = NAN; return true; }
    char *end = NULL;
    *v = strtod(s, &end);
    return end != s && *end == '\0';
}

/* Returns the number of samples, or fails the test with the offending line. Checks: every line is
 * a HELP/TYPE comment or a sample; names and label names are valid; label values use only the
 * \\ \" \n escapes; values parse; each family has one TYPE, before its samples; histogram buckets
 * carry le, are cumulative, end with +Inf == _count. */
static int prom_check(const char *text) {
    prom_family fams[256];
    size_t n_fams = 0;
    int samples = 0;
    assert_true(text[0] == '\0' || text[strlen(text) - 1] == '\n');
    char bucket_series[1024] = "";
    double last_bucket = -1, inf_bucket = -1;
    const char *line = text;
    while (*line) {
        const char *eol = strchr(line, '\n');
        size_t len = (size_t)(eol - line);
        char l[2048];
        if (len >= sizeof l) fail_msg("line too long");
        memcpy(l, line, len);
        l[len] = '\0';
        line = eol + 1;
        if (l[0] == '#') {
            char kw[8], name[128], rest[1024] = "";
            if (sscanf(l, "# %7s %127s %1023[^\n]", kw, name, rest) < 2) continue; /* plain comment */
            if (strcmp(kw, "TYPE") == 0) {
                if (!prom_name_ok(name, strlen(name), false)) fail_msg("bad TYPE name: %s", l);
                if (strcmp(rest, "counter") && strcmp(rest, "gauge") && strcmp(rest, "histogram") &&
                    strcmp(rest, "summary") && strcmp(rest, "untyped"))
                    fail_msg("bad TYPE: %s", l);
                for (size_t i = 0; i < n_fams; i++)
                    if (strcmp(fams[i].name, name) == 0) fail_msg("second TYPE for %s", name);
                assert_true(n_fams < KVB_ARRAY_LEN(fams));
                snprintf(fams[n_fams].name, sizeof fams[n_fams].name, "%.127s", name);
                snprintf(fams[n_fams].type, sizeof fams[n_fams].type, "%.15s", rest);
                n_fams++;
            } else if (strcmp(kw, "HELP") == 0) {
                if (!prom_name_ok(name, strlen(name), false)) fail_msg("bad HELP name: %s", l);
                for (const char *q = rest; *q; q++)
                    if (*q == '\\' && q[1] != '\\' && q[1] != 'n') fail_msg("bad HELP escape: %s", l);
                    else if (*q == '\\') q++;
            }
            continue;
        }
        if (!l[0]) fail_msg("blank line in exposition");
        /* sample: name[{labels}] value [timestamp] */
        const char *p = l;
        size_t nl = strcspn(p, "{ ");
        if (!prom_name_ok(p, nl, false)) fail_msg("bad sample name: %s", l);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)nl, p);
        p += nl;
        char series_no_le[1024];
        size_t sn = (size_t)snprintf(series_no_le, sizeof series_no_le, "%s{", name);
        char le[64] = "";
        if (*p == '{') {
            p++;
            while (*p != '}') {
                size_t ln = strcspn(p, "=");
                if (!prom_name_ok(p, ln, true) || p[ln] != '=' || p[ln + 1] != '"') fail_msg("bad label: %s", l);
                char lname[64];
                snprintf(lname, sizeof lname, "%.*s", (int)ln, p);
                p += ln + 2;
                char val[512];
                size_t vn = 0;
                while (*p != '"') {
                    if (!*p) fail_msg("unterminated label value: %s", l);
                    if (*p == '\\') {
                        if (p[1] != '\\' && p[1] != '"' && p[1] != 'n') fail_msg("bad escape: %s", l);
                        if (vn + 1 < sizeof val) val[vn++] = p[1] == 'n' ? '\n' : p[1];
                        p += 2;
                        continue;
                    }
                    if (*p == '\n') fail_msg("raw newline in label");
                    if (vn + 1 < sizeof val) val[vn++] = *p;
                    p++;
                }
                val[vn] = '\0';
                p++;
                if (strcmp(lname, "le") == 0) snprintf(le, sizeof le, "%.63s", val);
                else if (sn < sizeof series_no_le) sn += (size_t)snprintf(series_no_le + sn, sizeof series_no_le - sn, "%s=%s,", lname, val);
                if (*p == ',') p++;
                else if (*p != '}') fail_msg("expected , or }: %s", l);
            }
            p++;
        }
        snprintf(series_no_le + sn, sizeof series_no_le - sn, "}");
        if (*p != ' ') fail_msg("no space before the value: %s", l);
        p++;
        char vbuf[64] = "";
        sscanf(p, "%63s", vbuf);
        double v;
        if (!prom_value_ok(vbuf, &v)) fail_msg("bad value '%s': %s", vbuf, l);
        /* its family */
        const prom_family *fam = NULL;
        for (size_t i = 0; i < n_fams && !fam; i++) {
            size_t fl = strlen(fams[i].name);
            if (strcmp(fams[i].name, name) == 0) fam = &fams[i];
            else if (strcmp(fams[i].type, "histogram") == 0 && strncmp(name, fams[i].name, fl) == 0 &&
                     (!strcmp(name + fl, "_bucket") || !strcmp(name + fl, "_sum") || !strcmp(name + fl, "_count")))
                fam = &fams[i];
        }
        if (!fam) {
            fail_msg("sample before (or without) its TYPE: %s", l);
            return -1;
        }
        if (strcmp(fam->type, "histogram") == 0) {
            size_t fl = strlen(fam->name);
            if (!strcmp(name + fl, "_bucket")) {
                if (!le[0]) fail_msg("bucket without le: %s", l);
                if (strcmp(series_no_le, bucket_series) != 0) {
                    snprintf(bucket_series, sizeof bucket_series, "%s", series_no_le);
                    last_bucket = -1;
                }
                if (v < last_bucket) fail_msg("buckets not cumulative: %s", l);
                last_bucket = v;
                if (strcmp(le, "+Inf") == 0) inf_bucket = v;
            } else if (!strcmp(name + fl, "_count")) {
                if (inf_bucket < 0 || v != inf_bucket) fail_msg("_count != +Inf bucket: %s", l);
                inf_bucket = -1;
            } else if (strcmp(name + fl, "_sum") != 0) {
                fail_msg("bad histogram sample: %s", l);
            }
        } else if (le[0]) {
            fail_msg("le label outside a histogram: %s", l);
        }
        samples++;
    }
    return samples;
}

/* The value of the sample line that starts with `series` exactly (e.g. "x_total{a=\"b\"}"). */
static double prom_value(const char *text, const char *series) {
    size_t n = strlen(series);
    for (const char *line = text; *line;) {
        if (strncmp(line, series, n) == 0 && line[n] == ' ') return strtod(line + n + 1, NULL);
        const char *eol = strchr(line, '\n');
        if (!eol) break;
        line = eol + 1;
    }
    return -1;
}

/* ---- fixtures ----------------------------------------------------------------------------------- */

typedef struct {
    kvb_metrics *metrics;
    kvb_http_server *server;
    uint16_t port;
} fixture;

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    kvb_err err = {0};
    if (kvb_metrics_create(&f->metrics, &err) != KVB_OK) return -1;
    f->server = start_server(f->metrics);
    f->port = kvb_http_server_port(f->server);
    *state = f;
    return 0;
}

static int setup_key(void **state) {
    fixture *f = calloc(1, sizeof *f);
    kvb_err err = {0};
    if (kvb_metrics_create(&f->metrics, &err) != KVB_OK) return -1;
    f->server = start_server_key(f->metrics, API_KEY);
    f->port = kvb_http_server_port(f->server);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    kvb_http_server_stop(f->server);
    kvb_metrics_free(f->metrics);
    free(f);
    return 0;
}

/* ---- completion tests --------------------------------------------------------------------------- */

static void test_chat_non_streaming(void **state) {
    fixture *f = *state;
    http_resp r;
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"system\",\"content\":\"be nice\"},"
              "{\"role\":\"user\",\"content\":\"hello big world\"}],\"max_tokens\":50}",
              &r);
    assert_int_equal(r.status, 200);
    char ct[128], verdict[128];
    assert_non_null(header_value(&r, "Content-Type", ct, sizeof ct));
    assert_string_equal(ct, "application/json");
    assert_non_null(header_value(&r, "X-KVBridge", verdict, sizeof verdict));
    assert_string_equal(verdict, VERDICT);
    cJSON *j = parse_body(&r);
    assert_string_equal(jstr(j, "object"), "chat.completion");
    assert_string_equal(jstr(j, "model"), MODEL);
    assert_int_equal(strncmp(jstr(j, "id"), "chatcmpl-", 9), 0);
    assert_true(jnum(j, "created") > 1.7e9);
    assert_string_equal(jstr(j, "choices.0.message.role"), "assistant");
    assert_string_equal(jstr(j, "choices.0.message.content"), "hello big world");
    assert_string_equal(jstr(j, "choices.0.finish_reason"), "stop");
    assert_true(jnum(j, "usage.prompt_tokens") == 5); /* words of all messages */
    expect_kvbridge_usage(cJSON_GetObjectItem(j, "usage"), verdict, 3);
    cJSON_Delete(j);
    resp_free(&r);
}

static void test_completion_non_streaming(void **state) {
    fixture *f = *state;
    http_resp r;
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"once upon a time\"}", &r);
    assert_int_equal(r.status, 200);
    char verdict[128];
    assert_non_null(header_value(&r, "X-KVBridge", verdict, sizeof verdict));
    cJSON *j = parse_body(&r);
    assert_string_equal(jstr(j, "object"), "text_completion");
    assert_int_equal(strncmp(jstr(j, "id"), "cmpl-", 5), 0);
    assert_string_equal(jstr(j, "choices.0.text"), "once upon a time");
    assert_string_equal(jstr(j, "choices.0.finish_reason"), "stop");
    expect_kvbridge_usage(cJSON_GetObjectItem(j, "usage"), verdict, 4);
    cJSON_Delete(j);
    resp_free(&r);
    /* token id prompt */
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":[1,2,3]}", &r);
    assert_int_equal(r.status, 200);
    j = parse_body(&r);
    assert_string_equal(jstr(j, "choices.0.text"), "tokens 3");
    cJSON_Delete(j);
    resp_free(&r);
}

static void test_max_tokens_length(void **state) {
    fixture *f = *state;
    http_resp r;
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"a b c d e\"}],\"max_tokens\":2}", &r);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_body(&r);
    assert_string_equal(jstr(j, "choices.0.message.content"), "a b");
    assert_string_equal(jstr(j, "choices.0.finish_reason"), "length");
    assert_true(jnum(j, "usage.completion_tokens") == 2);
    cJSON_Delete(j);
    resp_free(&r);
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"a b c d e\"}],\"max_tokens\":3,"
              "\"stream\":true}", &r);
    check_stream(&r, true, "a b c", "length", false, 3);
    resp_free(&r);
}

static void test_chat_streaming(void **state) {
    fixture *f = *state;
    http_resp r;
    const char *msg = "streams arrive one word at a time, caf\xc3\xa9 \xe2\x9c\x93";
    char body[512];
    snprintf(body, sizeof body,
             "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"stream\":true,"
             "\"stream_options\":{\"include_usage\":true}}", msg);
    post_json(f->port, "/v1/chat/completions", body, &r);
    check_stream(&r, true, msg, "stop", true, (int64_t)count_words(msg));
    resp_free(&r);
    /* without include_usage: no usage anywhere, still the header */
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"x y\"}],\"stream\":true}", &r);
    check_stream(&r, true, "x y", "stop", false, 2);
    resp_free(&r);
    /* finishing without any token still streams a role chunk and a finish chunk */
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"\"}],\"stream\":true,"
              "\"stream_options\":{\"include_usage\":true}}", &r);
    check_stream(&r, true, "", "stop", true, 0);
    resp_free(&r);
}

static void test_completion_streaming(void **state) {
    fixture *f = *state;
    http_resp r;
    post_json(f->port, "/v1/completions",
              "{\"model\":\"" MODEL "\",\"prompt\":[\"the end is near\"],\"stream\":true,"
              "\"stream_options\":{\"include_usage\":true}}", &r);
    check_stream(&r, false, "the end is near", "stop", true, 4);
    resp_free(&r);
}

/* logprobs in both APIs' shapes, in a body and a stream; "RAW" is a token whose bytes are part of
 * a character and whose text the handler holds back (its entry waits for the finish chunk). */
static void test_logprobs(void **state) {
    fixture *f = *state;
    http_resp r;
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"alpha beta RAW\"}],"
              "\"logprobs\":true,\"top_logprobs\":2}", &r);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_body(&r);
    assert_string_equal(jstr(j, "choices.0.message.content"), "alpha beta");
    const cJSON *content = jitem(j, "choices.0.logprobs.content");
    assert_int_equal(cJSON_GetArraySize(content), 3); /* one per reply token */
    assert_true(cJSON_IsNull(jitem(j, "choices.0.logprobs.refusal")));
    assert_string_equal(jstr(content, "0.token"), "alpha");
    assert_true(jnum(content, "0.logprob") == -0.5);
    assert_int_equal(cJSON_GetArraySize(jitem(content, "0.bytes")), 5);
    assert_true(jnum(content, "0.bytes.0") == 'a');
    assert_string_equal(jstr(content, "1.token"), " beta");
    assert_true(jnum(content, "1.logprob") == -1.0);
    assert_int_equal(cJSON_GetArraySize(jitem(content, "1.top_logprobs")), 2);
    assert_string_equal(jstr(content, "1.top_logprobs.1.token"), "alt1");
    assert_true(jnum(content, "1.top_logprobs.1.logprob") == -3.0);
    assert_true(jnum(content, "1.top_logprobs.1.bytes.3") == '1');
    assert_string_equal(jstr(content, "2.token"), "\xef\xbf\xbd"); /* one U+FFFD for the partial character, as Python shows it */
    assert_true(jnum(content, "2.logprob") == -9999.0);             /* -inf: OpenAI's floor */
    assert_true(jnum(content, "2.bytes.0") == 0xe2 && jnum(content, "2.bytes.1") == 0x82);
    cJSON_Delete(j);
    resp_free(&r);

    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"alpha b\xc3\xa9ta gamma\",\"logprobs\":1}", &r);
    assert_int_equal(r.status, 200);
    j = parse_body(&r);
    const cJSON *lp = jitem(j, "choices.0.logprobs");
    assert_string_equal(jstr(lp, "tokens.1"), " b\xc3\xa9ta");
    assert_true(jnum(lp, "token_logprobs.2") == -1.5);
    assert_true(jnum(lp, "text_offset.0") == 0 && jnum(lp, "text_offset.1") == 5 && jnum(lp, "text_offset.2") == 10);
    assert_int_equal(cJSON_GetArraySize(jitem(lp, "top_logprobs.0")), 2); /* the top one and the picked one */
    assert_true(jnum(lp, "top_logprobs.0.alt0") == -1.5 && jnum(lp, "top_logprobs.0.alpha") == -0.5);
    cJSON_Delete(j);
    resp_free(&r);

    /* not asked: null */
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"alpha\"}", &r);
    j = parse_body(&r);
    assert_true(cJSON_IsNull(jitem(j, "choices.0.logprobs")));
    cJSON_Delete(j);
    resp_free(&r);

    /* a stream: each word's chunk carries its entry; the held-back token's goes with the finish */
    for (int chat = 0; chat < 2; chat++) {
        post_json(f->port, chat ? "/v1/chat/completions" : "/v1/completions",
                  chat ? "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"one two RAW\"}],"
                         "\"logprobs\":true,\"stream\":true}"
                       : "{\"model\":\"" MODEL "\",\"prompt\":\"one two RAW\",\"logprobs\":0,\"stream\":true}", &r);
        sse_stream s;
        sse_parse(r.body, &s);
        size_t entries = 0, text_chunks = 0;
        for (size_t i = 0; i < s.n_events; i++) {
            const cJSON *e = s.events[i];
            const char *piece = chat ? jstr(e, "choices.0.delta.content") : jstr(e, "choices.0.text");
            const cJSON *l = jitem(e, chat ? "choices.0.logprobs.content" : "choices.0.logprobs.tokens");
            const bool finish = jstr(e, "choices.0.finish_reason") != NULL;
            if (piece && *piece) {
                text_chunks++;
                assert_int_equal(cJSON_GetArraySize(l), 1);
                assert_string_equal(jstr(l, chat ? "0.token" : "0"), piece);
            } else if (finish) {
                assert_int_equal(cJSON_GetArraySize(l), 1);
                assert_string_equal(jstr(l, chat ? "0.token" : "0"), "\xef\xbf\xbd");
                if (!chat) assert_true(jnum(e, "choices.0.logprobs.text_offset.0") == 7);
            } else {
                assert_true(cJSON_IsNull(jitem(e, "choices.0.logprobs"))); /* the role chunk */
            }
            if (l) {
                entries += (size_t)cJSON_GetArraySize(l);
                if (chat) assert_int_equal(cJSON_GetArraySize(jitem(l, "0.top_logprobs")), 0);
            }
        }
        assert_int_equal(text_chunks, 2);
        assert_int_equal(entries, 3);
        sse_free(&s);
        resp_free(&r);
    }
}

/* ---- the access log ---------------------------------------------------------------------------- */

static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_log[16384];

static void capture_log(kvb_log_level level, const char *line, void *ctx) {
    (void)ctx;
    pthread_mutex_lock(&g_log_mu);
    size_t n = strlen(g_log);
    snprintf(g_log + n, sizeof g_log - n, "%d %s\n", (int)level, line);
    pthread_mutex_unlock(&g_log_mu);
}

/* The captured line that holds every one of parts (NULL-terminated), waited for up to 2 s (the
 * line is written once the response went out); fails the test when none comes. */
static void expect_log_line(const char *const *parts) {
    for (int tries = 0; tries < 200; tries++) {
        pthread_mutex_lock(&g_log_mu);
        bool found = false;
        for (const char *line = g_log; *line && !found;) {
            const char *eol = strchr(line, '\n');
            found = true;
            for (const char *const *p = parts; *p && found; p++) {
                const char *hit = strstr(line, *p);
                found = hit && hit < eol;
            }
            line = eol + 1;
        }
        pthread_mutex_unlock(&g_log_mu);
        if (found) return;
        sleep_ms(10);
    }
    fail_msg("no log line holds '%s' ... in:\n%s", parts[0], g_log);
}

/* One INFO line per API request: the completion's id, tokens, time to first token, verdict and
 * end; refusals by status; probes only at DEBUG. */
static void test_access_log(void **state) {
    fixture *f = *state;
    g_log[0] = 0;
    kvb_log_set_sink(capture_log, NULL);
    kvb_log_set_level(KVB_LOG_INFO);
    http_resp r;
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"logged words\"}]}", &r);
    cJSON *j = parse_body(&r);
    char id[64];
    snprintf(id, sizeof id, "%s", jstr(j, "id"));
    cJSON_Delete(j);
    resp_free(&r);
    expect_log_line((const char *const[]){"2 http: POST /v1/chat/completions 200 ", id, " prompt=2 (cached 5, bridged 12, native 7) completion=2 ttft=",
                                          "verdict=\"" VERDICT "\" end=\"stop\"", NULL});
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"a b c\",\"max_tokens\":2,\"stream\":true}", &r);
    resp_free(&r);
    expect_log_line((const char *const[]){"POST /v1/completions 200 cmpl-", " stream prompt=3 ", "completion=2 ", "end=\"length\"", NULL});
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"FAIL_CONTEXT\"}", &r);
    resp_free(&r);
    expect_log_line((const char *const[]){"POST /v1/completions 400 cmpl-", "ttft=- ", "end=\"This model's maximum context", NULL});
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"x\",\"max_tokens\":\"\\n\"}", &r);
    resp_free(&r);
    expect_log_line((const char *const[]){"2 http: POST /v1/completions 400 ", NULL});
    /* the client's request id: back on the response, and in the line */
    static const char with_id[] = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                  "X-Request-Id: trace-42.a\r\nContent-Type: application/json\r\nContent-Length: 33\r\n\r\n"
                                  "{\"model\":\"" MODEL "\",\"prompt\":\"q\"}";
    _Static_assert(sizeof "{\"model\":\"" MODEL "\",\"prompt\":\"q\"}" - 1 == 33, "the body's length");
    http_raw(f->port, with_id, sizeof with_id - 1, &r);
    char rid[64];
    assert_non_null(header_value(&r, "X-Request-Id", rid, sizeof rid));
    assert_string_equal(rid, "trace-42.a");
    resp_free(&r);
    expect_log_line((const char *const[]){"POST /v1/completions 200 cmpl-", " req=trace-42.a ", NULL});
    http_call(f->port, "GET", "/health", NULL, NULL, &r);
    resp_free(&r);
    post_json(f->port, "/tokenize", "{\"prompt\":\"x y\"}", &r); /* once its line is in, a probe's would be */
    resp_free(&r);
    expect_log_line((const char *const[]){"POST /tokenize 200 ", NULL});
    pthread_mutex_lock(&g_log_mu);
    assert_null(strstr(g_log, "/health"));
    pthread_mutex_unlock(&g_log_mu);
    kvb_log_set_level(KVB_LOG_WARN);
    kvb_log_set_sink(NULL, NULL);
}

/* n > 1: every choice with its index, text, logprobs and finish reason, in a body and a stream
 * (one role chunk per chat choice, each choice's chunks together, one usage at the end); a handler
 * cannot begin a choice past n. */
static void test_choices(void **state) {
    fixture *f = *state;
    const int overruns = atomic_load(&g_fake.choice_overruns);
    http_resp r;
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"x y\"}],\"n\":3,\"logprobs\":true}", &r);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_body(&r);
    assert_int_equal(cJSON_GetArraySize(jitem(j, "choices")), 3);
    for (int c = 0; c < 3; c++) {
        char path[64], want[24];
        snprintf(want, sizeof want, "#%d x y", c);
        snprintf(path, sizeof path, "choices.%d.message.content", c);
        assert_string_equal(jstr(j, path), want);
        snprintf(path, sizeof path, "choices.%d.index", c);
        assert_true(jnum(j, path) == c);
        snprintf(path, sizeof path, "choices.%d.finish_reason", c);
        assert_string_equal(jstr(j, path), "stop");
        snprintf(path, sizeof path, "choices.%d.logprobs.content", c);
        assert_int_equal(cJSON_GetArraySize(jitem(j, path)), 2); /* its own words' entries */
    }
    assert_true(jnum(j, "usage.completion_tokens") == 6);
    cJSON_Delete(j);
    resp_free(&r);
    /* completions, max_tokens reached in each */
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"a b c\",\"n\":2,\"max_tokens\":1}", &r);
    j = parse_body(&r);
    assert_string_equal(jstr(j, "choices.0.text"), "#0 a");
    assert_string_equal(jstr(j, "choices.1.text"), "#1 a");
    assert_string_equal(jstr(j, "choices.0.finish_reason"), "length");
    assert_string_equal(jstr(j, "choices.1.finish_reason"), "length");
    cJSON_Delete(j);
    resp_free(&r);
    /* a stream */
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"p q\"}],\"n\":2,\"stream\":true,"
              "\"stream_options\":{\"include_usage\":true}}", &r);
    sse_stream ss;
    sse_parse(r.body, &ss);
    assert_true(ss.done);
    char text[2][64] = {"", ""};
    int roles[2] = {0, 0}, finishes[2] = {0, 0}, last_index = 0;
    for (size_t i = 0; i + 1 < ss.n_events; i++) {
        const cJSON *e = ss.events[i];
        const int c = (int)jnum(e, "choices.0.index");
        assert_true(c == 0 || c == 1);
        assert_true(c >= last_index); /* choice 0's chunks, then choice 1's */
        last_index = c;
        if (jstr(e, "choices.0.delta.role")) roles[c]++;
        const char *piece = jstr(e, "choices.0.delta.content");
        if (piece) strncat(text[c], piece, sizeof text[c] - strlen(text[c]) - 1);
        if (jstr(e, "choices.0.finish_reason")) finishes[c]++;
    }
    assert_string_equal(text[0], "#0 p q");
    assert_string_equal(text[1], "#1 p q");
    assert_true(roles[0] == 1 && roles[1] == 1 && finishes[0] == 1 && finishes[1] == 1);
    assert_true(jnum(ss.events[ss.n_events - 1], "usage.completion_tokens") == 4);
    sse_free(&ss);
    resp_free(&r);
    assert_int_equal(atomic_load(&g_fake.choice_overruns), overruns + 3);
}

/* POST /tokenize and /detokenize in vLLM's shapes; their refusals; 404 without handlers. */
static void test_tokenize_routes(void **state) {
    fixture *f = *state;
    http_resp r;
    post_json(f->port, "/tokenize", "{\"prompt\":\"one three fifteen\"}", &r);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_body(&r);
    assert_true(jnum(j, "count") == 3 && jnum(j, "max_model_len") == 4096);
    assert_true(jnum(j, "tokens.0") == 3 && jnum(j, "tokens.1") == 5 && jnum(j, "tokens.2") == 7);
    assert_true(cJSON_IsNull(jitem(j, "token_strs")));
    cJSON_Delete(j);
    resp_free(&r);
    post_json(f->port, "/tokenize", "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"ab\"}]}", &r);
    j = parse_body(&r);
    assert_true(jnum(j, "count") == 1 && jnum(j, "tokens.0") == 2);
    cJSON_Delete(j);
    resp_free(&r);
    post_json(f->port, "/detokenize", "{\"tokens\":[7,8]}", &r);
    j = parse_body(&r);
    assert_string_equal(jstr(j, "prompt"), "<7> <8>");
    cJSON_Delete(j);
    resp_free(&r);
    /* refusals: the parser's, the handler's, another model, the method */
    post_json(f->port, "/tokenize", "{\"prompt\":5}", &r);
    expect_error(&r, 400, "prompt", NULL, "expected a string");
    resp_free(&r);
    post_json(f->port, "/tokenize", "{\"prompt\":\"TOOLONG\"}", &r);
    expect_error(&r, 400, "prompt", NULL, "too long");
    resp_free(&r);
    post_json(f->port, "/detokenize", "{\"tokens\":[666]}", &r);
    expect_error(&r, 400, "tokens[0]", NULL, "no such token");
    resp_free(&r);
    post_json(f->port, "/detokenize", "{\"model\":\"other\",\"tokens\":[1]}", &r);
    expect_error(&r, 404, "model", "model_not_found", "does not exist");
    resp_free(&r);
    http_call(f->port, "GET", "/tokenize", NULL, NULL, &r);
    expect_error(&r, 405, NULL, NULL, "use POST");
    resp_free(&r);
    /* a server whose handler does not tokenize has no such routes */
    kvb_http_config cfg = {.listen = "127.0.0.1:0", .model_id = MODEL};
    kvb_http_handlers h = {.ctx = &g_fake, .completion = fake_completion};
    kvb_http_server *bare = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &bare, &err), KVB_OK);
    post_json(kvb_http_server_port(bare), "/tokenize", "{\"prompt\":\"x\"}", &r);
    expect_error(&r, 404, NULL, NULL, "Invalid URL");
    resp_free(&r);
    kvb_http_server_stop(bare);
}

static void test_handler_errors(void **state) {
    fixture *f = *state;
    http_resp r;
    int before = atomic_load(&g_fake.contract_errors);
    /* before the first token: a real status, streaming or not */
    for (int stream = 0; stream < 2; stream++) {
        char body[256];
        snprintf(body, sizeof body,
                 "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"FAIL_CONTEXT\"}],\"stream\":%s}",
                 stream ? "true" : "false");
        post_json(f->port, "/v1/chat/completions", body, &r);
        expect_error(&r, 400, "messages", "context_length_exceeded", "maximum context length");
        resp_free(&r);
    }
    /* after the first token: 200, the delta, then an SSE error event and no [DONE] */
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"FAIL_MIDSTREAM\"}],\"stream\":true}", &r);
    assert_int_equal(r.status, 200);
    sse_stream s;
    sse_parse(r.body, &s);
    assert_false(s.done);
    assert_true(s.n_events >= 2);
    const cJSON *last = s.events[s.n_events - 1];
    assert_string_equal(jstr(last, "error.message"), "the decoder failed mid-stream");
    assert_string_equal(jstr(last, "error.type"), "server_error");
    assert_string_equal(jstr(s.events[s.n_events - 2], "choices.0.delta.content"), "partial");
    sse_free(&s);
    resp_free(&r);
    /* non-streaming: the failure replaces the partial text */
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"FAIL_MIDSTREAM\"}]}", &r);
    expect_error(&r, 500, NULL, NULL, "failed mid-stream");
    resp_free(&r);
    /* contract violations: emit without a verdict; returning without finish or fail */
    for (int stream = 0; stream < 2; stream++) {
        const char *cases[] = {"NO_VERDICT", "FORGET"};
        for (int c = 0; c < 2; c++) {
            char body[256];
            snprintf(body, sizeof body,
                     "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"stream\":%s}",
                     cases[c], stream ? "true" : "false");
            post_json(f->port, "/v1/chat/completions", body, &r);
            expect_error(&r, 500, NULL, NULL, c == 0 ? "without a verdict" : "without finishing");
            resp_free(&r);
        }
    }
    /* NO_VERDICT x2 and FAIL_MIDSTREAM x2 saw KVB_ERR_INVALID from emit */
    assert_int_equal(atomic_load(&g_fake.contract_errors) - before, 4);
}

/* ---- HTTP refusals ------------------------------------------------------------------------------ */

static void test_http_refusals(void **state) {
    fixture *f = *state;
    http_resp r;
    http_call(f->port, "GET", "/v1/nope", NULL, NULL, &r);
    expect_error(&r, 404, NULL, NULL, "Invalid URL (GET /v1/nope)");
    resp_free(&r);
    post_json(f->port, "/v1/chat/completions/", "{}", &r);
    expect_error(&r, 404, NULL, NULL, "Invalid URL");
    resp_free(&r);

    char allow[64];
    http_call(f->port, "GET", "/v1/chat/completions", NULL, NULL, &r);
    expect_error(&r, 405, NULL, NULL, "use POST");
    assert_non_null(header_value(&r, "Allow", allow, sizeof allow));
    assert_string_equal(allow, "POST");
    resp_free(&r);
    http_call(f->port, "DELETE", "/v1/completions", NULL, NULL, &r);
    expect_error(&r, 405, NULL, NULL, "DELETE");
    resp_free(&r);
    post_json(f->port, "/health", "{}", &r);
    expect_error(&r, 405, NULL, NULL, "use GET");
    assert_non_null(header_value(&r, "Allow", allow, sizeof allow));
    assert_string_equal(allow, "GET, HEAD");
    resp_free(&r);

    const char *ok_body = "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    http_call(f->port, "POST", "/v1/chat/completions", "text/plain", ok_body, &r);
    expect_error(&r, 415, NULL, NULL, "text/plain");
    resp_free(&r);
    http_call(f->port, "POST", "/v1/chat/completions", "application/x-www-form-urlencoded", ok_body, &r);
    expect_error(&r, 415, NULL, NULL, "application/json");
    resp_free(&r);
    http_call(f->port, "POST", "/v1/chat/completions", "Application/JSON; charset=utf-8", ok_body, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    http_call(f->port, "POST", "/v1/chat/completions", NULL, ok_body, &r); /* no Content-Type: accepted */
    assert_int_equal(r.status, 200);
    resp_free(&r);

    post_json(f->port, "/v1/chat/completions", "{\"model\": \"" MODEL "\", \"messages\": [", &r);
    expect_error(&r, 400, NULL, NULL, "malformed JSON");
    resp_free(&r);
    post_json(f->port, "/v1/chat/completions", "", &r);
    expect_error(&r, 400, NULL, NULL, "empty");
    resp_free(&r);
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":\"yes\"}", &r);
    expect_error(&r, 400, "stream", NULL, "expected a boolean");
    resp_free(&r);
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"x\",\"n\":30}", &r);
    expect_error(&r, 400, "n", NULL, "out of range");
    resp_free(&r);
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"gpt-9\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &r);
    expect_error(&r, 404, "model", "model_not_found", "gpt-9");
    resp_free(&r);
}

static void test_body_limits(void **state) {
    fixture *f = *state;
    http_resp r;
    /* announced by Content-Length: refused before the body is read */
    const char *big_head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           "Content-Length: 100000000\r\n\r\n{\"model\":";
    http_raw(f->port, big_head, strlen(big_head), &r);
    expect_error(&r, 413, NULL, NULL, "over the limit");
    resp_free(&r);
    /* chunked upload that grows past the limit */
    size_t chunk = 16 * 1024, n_chunks = SMALL_BODY_LIMIT / chunk + 2;
    size_t cap = 256 + n_chunks * (chunk + 16);
    char *req = malloc(cap);
    assert_non_null(req);
    size_t n = (size_t)sprintf(req, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
    for (size_t c = 0; c < n_chunks; c++) {
        n += (size_t)sprintf(req + n, "%zx\r\n", chunk);
        memset(req + n, ' ', chunk);
        n += chunk;
        n += (size_t)sprintf(req + n, "\r\n");
    }
    n += (size_t)sprintf(req + n, "0\r\n\r\n");
    http_raw(f->port, req, n, &r);
    expect_error(&r, 413, NULL, NULL, "over the limit");
    resp_free(&r);
    free(req);
    /* just under the limit is fine */
    size_t pad = SMALL_BODY_LIMIT - 200;
    char *body = malloc(pad + 256);
    assert_non_null(body);
    int bn = sprintf(body, "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"ok\"}],\"user\":\"");
    memset(body + bn, 'x', pad - (size_t)bn);
    strcpy(body + pad, "\"}");
    post_json(f->port, "/v1/chat/completions", body, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    free(body);
}

static void test_garbage_requests(void **state) {
    fixture *f = *state;
    /* malformed HTTP: the server answers 4xx or closes; it must stay up */
    const char *garbage[] = {
        "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", /* a TLS hello */
        "GET\r\n\r\n",
        "POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n12345",
        "GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
        "GET /health HTTP/1.1\r\nHost: x\r\nbroken header line\r\n\r\n",
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(garbage); i++) {
        int fd = connect_to(f->port);
        send_all(fd, garbage[i], strlen(garbage[i]));
        shutdown(fd, SHUT_WR);
        char buf[4096];
        ssize_t got = recv(fd, buf, sizeof buf - 1, 0);
        if (got > 0) {
            buf[got] = '\0';
            int status = 0;
            if (sscanf(buf, "HTTP/1.%*d %d", &status) == 1 && status < 400)
                fail_msg("garbage %zu got status %d", i, status);
        }
        close(fd);
    }
    http_resp r;
    http_call(f->port, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
}

/* ---- simple routes ------------------------------------------------------------------------------ */

static void test_health_and_models(void **state) {
    fixture *f = *state;
    http_resp r;
    http_call(f->port, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_body(&r);
    assert_string_equal(jstr(j, "status"), "ok");
    assert_string_equal(jstr(j, "peer"), "up");
    assert_string_equal(jstr(j, "model"), MODEL);
    cJSON_Delete(j);
    resp_free(&r);
    http_call(f->port, "HEAD", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.body_len, 0);
    resp_free(&r);

    http_call(f->port, "GET", "/v1/models", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    j = parse_body(&r);
    assert_string_equal(jstr(j, "object"), "list");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "data")), 1);
    assert_string_equal(jstr(j, "data.0.id"), MODEL);
    assert_string_equal(jstr(j, "data.0.object"), "model");
    assert_string_equal(jstr(j, "data.0.owned_by"), "kvbridge");
    assert_true(jnum(j, "data.0.max_model_len") == 4096);
    cJSON_Delete(j);
    resp_free(&r);
    http_call(f->port, "GET", "/v1/models/" MODEL, NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    j = parse_body(&r);
    assert_string_equal(jstr(j, "id"), MODEL);
    cJSON_Delete(j);
    resp_free(&r);
    http_call(f->port, "GET", "/v1/models/other", NULL, NULL, &r);
    expect_error(&r, 404, "model", "model_not_found", "other");
    resp_free(&r);
}

static void test_keep_alive(void **state) {
    fixture *f = *state;
    int fd = connect_to(f->port);
    reader *rd = calloc(1, sizeof *rd);
    assert_non_null(rd);
    rd->fd = fd;
    const char *body = "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"again and again\"}]%s}";
    for (int i = 0; i < 4; i++) {
        char b[256], req[512];
        snprintf(b, sizeof b, body, i % 2 ? ",\"stream\":true" : "");
        int n = snprintf(req, sizeof req,
                         "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         "Content-Length: %zu\r\n\r\n%s", strlen(b), b);
        send_all(fd, req, (size_t)n);
        http_resp r;
        assert_true(read_response(rd, &r, false));
        assert_int_equal(r.status, 200);
        if (i % 2) {
            check_stream(&r, true, "again and again", "stop", false, 3);
        } else {
            cJSON *j = parse_body(&r);
            assert_string_equal(jstr(j, "choices.0.message.content"), "again and again");
            cJSON_Delete(j);
        }
        resp_free(&r);
    }
    free(rd);
    close(fd);
}

/* ---- metrics over HTTP -------------------------------------------------------------------------- */

static void test_metrics_endpoint(void **state) {
    fixture *f = *state;
    kvb_metric *custom = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_metrics_register(f->metrics, KVB_METRIC_COUNTER, "kvb_test_faults_total",
                                          "Faults by kind.\nSecond line with a \\ backslash.", "kind",
                                          NULL, 0, &custom, &err), KVB_OK);
    kvb_metric_add(custom, KVB_LABELS("peer \"down\"\\now\nnext"), 2);
    http_resp r;
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"count me\"}]}", &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    /* the previous request's bookkeeping runs after its response went out: poll briefly */
    for (int attempt = 0;; attempt++) {
        http_call(f->port, "GET", "/metrics", NULL, NULL, &r);
        if (prom_value(r.body, "kvb_http_requests_in_flight") == 1 &&
            prom_value(r.body, "kvb_completion_verdicts_total{verdict=\"partial\"}") >= 1)
            break;
        if (attempt == 200) fail_msg("metrics never settled:\n%s", r.body);
        resp_free(&r);
        sleep_ms(10);
    }
    assert_int_equal(r.status, 200);
    char ct[128];
    assert_non_null(header_value(&r, "Content-Type", ct, sizeof ct));
    assert_string_equal(ct, KVB_METRICS_CONTENT_TYPE);
    int samples = prom_check(r.body);
    assert_true(samples > 20);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/v1/chat/completions\",code=\"200\"}") >= 1);
    assert_true(prom_value(r.body, "kvb_completion_generated_tokens_total{api=\"chat\"}") >= 2);
    /* "count me" came as two deltas: one gap between them, at least */
    assert_true(prom_value(r.body, "kvb_completion_stream_gap_seconds_count{api=\"chat\"}") >= 1);
    assert_true(prom_value(r.body, "kvb_completion_stream_gap_seconds_bucket{api=\"chat\",le=\"+Inf\"}") >= 1);
    assert_true(prom_value(r.body, "kvb_test_faults_total{kind=\"peer \\\"down\\\"\\\\now\\nnext\"}") == 2);
    assert_non_null(strstr(r.body, "# HELP kvb_test_faults_total Faults by kind.\\nSecond line with a \\\\ backslash.\n"));
    assert_non_null(strstr(r.body, "# TYPE kvb_http_request_duration_seconds histogram\n"));
    resp_free(&r);
}

/* ---- disconnects, concurrency, stop -------------------------------------------------------------- */

static bool wait_until(atomic_int *v, int target, int timeout_ms) {
    for (int t = 0; t < timeout_ms; t += 10) {
        if (atomic_load(v) >= target) return true;
        sleep_ms(10);
    }
    return atomic_load(v) >= target;
}

static void test_client_disconnect(void **state) {
    fixture *f = *state;
    kvb_metric *disc = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_metrics_register(f->metrics, KVB_METRIC_COUNTER, "kvb_completion_client_disconnects_total",
                                          "Completions whose client went away before the response was delivered.",
                                          "api", NULL, 0, &disc, &err), KVB_OK);
    for (int stream = 1; stream >= 0; stream--) {
        int before = atomic_load(&g_fake.saw_cancel);
        double disc_before = kvb_metric_value(disc, KVB_LABELS("chat"));
        char body[256], req[512];
        snprintf(body, sizeof body,
                 "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"SLOW\"}],\"stream\":%s}",
                 stream ? "true" : "false");
        int n = snprintf(req, sizeof req,
                         "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
        int fd = connect_to(f->port);
        send_all(fd, req, (size_t)n);
        if (stream) { /* read until the first tick arrived, then hang up */
            char buf[4096];
            size_t got = 0;
            while (got < sizeof buf - 1) {
                ssize_t k = recv(fd, buf + got, sizeof buf - 1 - got, 0);
                assert_true(k > 0);
                got += (size_t)k;
                buf[got] = '\0';
                if (strstr(buf, "tick")) break;
            }
            assert_non_null(strstr(buf, "X-KVBridge: " VERDICT));
        } else {
            assert_true(wait_until(&g_fake.slow_running, 1, 5000));
            sleep_ms(200);
        }
        close(fd);
        /* the handler sees emit fail within a few emits (50 ms each), far before its 20 s */
        if (!wait_until(&g_fake.saw_cancel, before + 1, 5000))
            fail_msg("handler did not see the disconnect (stream=%d)", stream);
        for (int i = 0; i < 200 && kvb_metric_value(disc, KVB_LABELS("chat")) < disc_before + 1; i++) sleep_ms(10);
        assert_true(kvb_metric_value(disc, KVB_LABELS("chat")) >= disc_before + 1);
    }
}

typedef struct {
    uint16_t port;
    int index;
    int failures;
} client_arg;

static void *client_main(void *arg) {
    client_arg *a = arg;
    for (int i = 0; i < 6; i++) {
        char msg[128], body[512];
        snprintf(msg, sizeof msg, "client %d request %d says hello", a->index, i);
        bool stream = (a->index + i) % 2;
        snprintf(body, sizeof body,
                 "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"stream\":%s}", msg,
                 stream ? "true" : "false");
        http_resp r;
        post_json(a->port, "/v1/chat/completions", body, &r);
        if (r.status != 200) { a->failures++; resp_free(&r); continue; }
        if (stream) {
            sse_stream s;
            sse_parse(r.body, &s);
            char text[256] = "";
            for (size_t k = 0; k < s.n_events; k++) {
                const char *p = jstr(s.events[k], "choices.0.delta.content");
                if (p) strncat(text, p, sizeof text - strlen(text) - 1);
            }
            if (strcmp(text, msg) != 0 || !s.done) a->failures++;
            sse_free(&s);
        } else {
            cJSON *j = cJSON_Parse(r.body);
            const char *c = j ? jstr(j, "choices.0.message.content") : NULL;
            if (!c || strcmp(c, msg) != 0) a->failures++;
            cJSON_Delete(j);
        }
        resp_free(&r);
    }
    return NULL;
}

static void test_concurrent_clients(void **state) {
    fixture *f = *state;
    enum { N = 8 };
    pthread_t th[N];
    client_arg args[N];
    for (int i = 0; i < N; i++) {
        args[i] = (client_arg){.port = f->port, .index = i};
        assert_int_equal(pthread_create(&th[i], NULL, client_main, &args[i]), 0);
    }
    int failures = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        failures += args[i].failures;
    }
    assert_int_equal(failures, 0);
}

static void test_stop_mid_stream(void **state) {
    (void)state;
    kvb_http_server *s = start_server(NULL); /* owns its metrics */
    int before = atomic_load(&g_fake.saw_cancel);
    const char *body = "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"SLOW\"}],\"stream\":true}";
    char req[512];
    int n = snprintf(req, sizeof req,
                     "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
    int fd = connect_to(kvb_http_server_port(s));
    send_all(fd, req, (size_t)n);
    char buf[2048];
    assert_true(recv(fd, buf, sizeof buf, 0) > 0);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvb_http_server_stop(s); /* must not wait for the 20 s handler */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    if (took > 3.0) fail_msg("stop took %.2f s", took);
    assert_int_equal(atomic_load(&g_fake.saw_cancel), before + 1);
    close(fd);
}

/* A handler slower than the idle timeout is never cut (the stream lifts the timeout, a
 * non-streaming answer counts from when it is queued), and the timeout is back for the idle
 * keep-alive connection afterwards. */
static void test_idle_timeout(void **state) {
    (void)state;
    kvb_http_config cfg = {.listen = "127.0.0.1:0", .model_id = MODEL, .idle_timeout_s = 1};
    kvb_http_handlers h = {.ctx = &g_fake, .completion = fake_completion};
    kvb_http_server *s = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_OK);
    uint16_t port = kvb_http_server_port(s);
    for (int stream = 1; stream >= 0; stream--) {
        int fd = connect_to(port);
        reader *rd = calloc(1, sizeof *rd);
        assert_non_null(rd);
        rd->fd = fd;
        char body[256], req[512];
        snprintf(body, sizeof body,
                 "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"PAUSE\"}],\"stream\":%s}",
                 stream ? "true" : "false");
        int n = snprintf(req, sizeof req,
                         "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
        send_all(fd, req, (size_t)n);
        http_resp r;
        assert_true(read_response(rd, &r, false));
        if (stream) {
            check_stream(&r, true, "a b", "stop", false, 2);
        } else {
            assert_int_equal(r.status, 200);
            cJSON *j = parse_body(&r);
            assert_string_equal(jstr(j, "choices.0.message.content"), "a b");
            cJSON_Delete(j);
        }
        resp_free(&r);
        /* idle keep-alive: closed by the server after about a second */
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        char c;
        ssize_t got = recv(fd, &c, 1, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double waited = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
        assert_int_equal(got, 0);
        if (waited > 5) fail_msg("the idle connection stayed open %.1f s", waited);
        free(rd);
        close(fd);
    }
    kvb_http_server_stop(s);
}

static void test_start_errors(void **state) {
    (void)state;
    kvb_http_handlers h = {.ctx = &g_fake, .completion = fake_completion};
    kvb_http_server *s = NULL;
    kvb_err err = {0};
    const char *bad[] = {"", "127.0.0.1", "127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:8x", "[::1", "no.such.host.invalid:80"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) {
        kvb_http_config cfg = {.listen = bad[i], .model_id = MODEL};
        assert_int_not_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_OK);
        assert_null(s);
        assert_true(err.msg[0] != '\0');
    }
    kvb_http_config cfg = {.listen = "127.0.0.1:0", .model_id = NULL};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_ERR_INVALID);
    /* the port in use */
    kvb_http_server *a = start_server(NULL);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", kvb_http_server_port(a));
    cfg = (kvb_http_config){.listen = addr, .model_id = MODEL};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_ERR_IO);
    kvb_http_server_stop(a);
    /* IPv6 loopback, where the machine has it */
    cfg = (kvb_http_config){.listen = "[::1]:0", .model_id = MODEL};
    if (kvb_http_server_start(&cfg, &h, &s, &err) == KVB_OK) {
        assert_true(kvb_http_server_port(s) != 0);
        kvb_http_server_stop(s);
    }
    kvb_http_server_stop(NULL);
}

/* ---- CORS ----------------------------------------------------------------------------------------- */

/* A request with an Origin header (and, when auth is non-NULL, an Authorization one). */
static void call_from(uint16_t port, const char *method, const char *path, const char *origin, const char *auth,
                      const char *body, http_resp *r) {
    char req[2048];
    int n = snprintf(req, sizeof req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nOrigin: %s\r\n", method,
                     path, origin);
    if (auth) n += snprintf(req + n, sizeof req - (size_t)n, "Authorization: %s\r\n", auth);
    if (!strcmp(method, "OPTIONS"))
        n += snprintf(req + n, sizeof req - (size_t)n, "Access-Control-Request-Method: POST\r\n"
                      "Access-Control-Request-Headers: authorization, content-type\r\n");
    if (body) n += snprintf(req + n, sizeof req - (size_t)n, "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                            strlen(body), body);
    else n += snprintf(req + n, sizeof req - (size_t)n, "\r\n");
    http_raw(port, req, (size_t)n, r);
}

/* The response's Access-Control-Allow-Origin, or "" when it has none. */
static const char *acao(const http_resp *r, char *buf, size_t cap) {
    return header_value(r, "Access-Control-Allow-Origin", buf, cap) ? buf : "";
}

static void test_cors(void **state) {
    (void)state;
    const char *chat = "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"cross origin\"}]}";
    kvb_http_handlers h = {.ctx = &g_fake, .completion = fake_completion};
    kvb_http_config cfg = {.listen = "127.0.0.1:0", .model_id = MODEL, .api_key = API_KEY,
                           .allow_origins = "https://ui.example,http://localhost:3000"};
    kvb_http_server *s = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_OK);
    const uint16_t port = kvb_http_server_port(s);
    http_resp r;
    char v[256];
    /* a preflight: 204 with what may be sent, before any key is asked for */
    call_from(port, "OPTIONS", "/v1/chat/completions", "https://ui.example", NULL, NULL, &r);
    assert_int_equal(r.status, 204);
    assert_string_equal(acao(&r, v, sizeof v), "https://ui.example");
    assert_non_null(header_value(&r, "Access-Control-Allow-Headers", v, sizeof v));
    assert_non_null(strstr(v, "Authorization"));
    assert_non_null(header_value(&r, "Access-Control-Allow-Methods", v, sizeof v));
    assert_non_null(strstr(v, "POST"));
    resp_free(&r);
    /* the call itself, JSON and a stream: the origin named, the verdict header readable */
    call_from(port, "POST", "/v1/chat/completions", "http://localhost:3000", "Bearer " API_KEY, chat, &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(acao(&r, v, sizeof v), "http://localhost:3000");
    assert_non_null(header_value(&r, "Vary", v, sizeof v));
    assert_string_equal(v, "Origin");
    assert_non_null(header_value(&r, "Access-Control-Expose-Headers", v, sizeof v));
    assert_string_equal(v, "X-KVBridge");
    resp_free(&r);
    call_from(port, "POST", "/v1/completions", "https://ui.example", "Bearer " API_KEY,
              "{\"model\":\"" MODEL "\",\"prompt\":\"a b\",\"stream\":true}", &r);
    assert_true(r.chunked);
    assert_string_equal(acao(&r, v, sizeof v), "https://ui.example");
    resp_free(&r);
    /* a refusal is readable by the page too */
    call_from(port, "POST", "/v1/chat/completions", "https://ui.example", NULL, chat, &r);
    assert_int_equal(r.status, 401);
    assert_string_equal(acao(&r, v, sizeof v), "https://ui.example");
    resp_free(&r);
    /* another origin: nothing that lets a browser read the answer */
    call_from(port, "OPTIONS", "/v1/chat/completions", "https://evil.example", NULL, NULL, &r);
    assert_int_equal(r.status, 204);
    assert_string_equal(acao(&r, v, sizeof v), "");
    assert_null(header_value(&r, "Access-Control-Allow-Headers", v, sizeof v));
    resp_free(&r);
    call_from(port, "GET", "/v1/models", "https://ui.example.evil", "Bearer " API_KEY, NULL, &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(acao(&r, v, sizeof v), "");
    resp_free(&r);
    kvb_http_server_stop(s);

    /* any origin */
    cfg = (kvb_http_config){.listen = "127.0.0.1:0", .model_id = MODEL, .allow_origins = "*"};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_OK);
    call_from(kvb_http_server_port(s), "GET", "/v1/models", "https://anyone.example", NULL, NULL, &r);
    assert_string_equal(acao(&r, v, sizeof v), "*");
    assert_null(header_value(&r, "Vary", v, sizeof v));
    resp_free(&r);
    kvb_http_server_stop(s);

    /* off (the default): no CORS headers, and OPTIONS is a method this API does not take */
    cfg = (kvb_http_config){.listen = "127.0.0.1:0", .model_id = MODEL};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_OK);
    call_from(kvb_http_server_port(s), "OPTIONS", "/v1/chat/completions", "https://ui.example", NULL, NULL, &r);
    assert_int_equal(r.status, 405);
    assert_string_equal(acao(&r, v, sizeof v), "");
    resp_free(&r);
    call_from(kvb_http_server_port(s), "GET", "/v1/models", "https://ui.example", NULL, NULL, &r);
    assert_string_equal(acao(&r, v, sizeof v), "");
    resp_free(&r);
    kvb_http_server_stop(s);

    /* a list with a space is refused at start */
    cfg = (kvb_http_config){.listen = "127.0.0.1:0", .model_id = MODEL, .allow_origins = "https://a.example, https://b.example"};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "comma-separated"));
}

/* ---- a graceful stop ------------------------------------------------------------------------------- */

typedef struct {
    uint16_t port;
    http_resp r;
} slow_call;

static void *post_pause(void *arg) { /* a completion that takes 3 s ("PAUSE") */
    slow_call *c = arg;
    post_json(c->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"PAUSE\"}", &c->r);
    return NULL;
}

/* Quiesced: the completion in flight finishes whole; a new API request, on a new connection or
 * an open keep-alive one, is a 503 that closes it; /health says draining with a 503. */
static void test_drain(void **state) {
    fixture *f = *state;
    int fd = connect_to(f->port); /* open before the drain, used after it */
    reader *rd = calloc(1, sizeof *rd);
    rd->fd = fd;
    static const char health[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    send_all(fd, health, sizeof health - 1);
    http_resp r;
    assert_true(read_response(rd, &r, false));
    assert_int_equal(r.status, 200);
    resp_free(&r);
    slow_call call = {.port = f->port};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, post_pause, &call), 0);
    for (int i = 0; i < 200 && kvb_http_server_in_flight(f->server) == 0; i++) sleep_ms(10);
    assert_int_equal(kvb_http_server_in_flight(f->server), 1);
    kvb_http_server_quiesce(f->server);
    kvb_http_server_quiesce(f->server); /* idempotent */
    post_json(f->port, "/v1/chat/completions",
              "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"late\"}]}", &r);
    expect_error(&r, 503, NULL, "server_shutting_down", "shutting down");
    char conn_hdr[32];
    assert_non_null(header_value(&r, "Connection", conn_hdr, sizeof conn_hdr));
    resp_free(&r);
    /* the open connection: probes answer draining, API requests are refused */
    send_all(fd, health, sizeof health - 1);
    assert_true(read_response(rd, &r, false));
    assert_int_equal(r.status, 503);
    cJSON *j = parse_body(&r);
    assert_string_equal(jstr(j, "status"), "draining");
    cJSON_Delete(j);
    resp_free(&r);
    static const char api[] = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    send_all(fd, api, sizeof api - 1);
    assert_true(read_response(rd, &r, false));
    expect_error(&r, 503, NULL, "server_shutting_down", "shutting down");
    resp_free(&r);
    free(rd);
    close(fd);
    /* the one in flight ends whole */
    pthread_join(t, NULL);
    assert_int_equal(call.r.status, 200);
    j = parse_body(&call.r);
    assert_string_equal(jstr(j, "choices.0.text"), "a b");
    cJSON_Delete(j);
    resp_free(&call.r);
    for (int i = 0; i < 200 && kvb_http_server_in_flight(f->server) > 0; i++) sleep_ms(10);
    assert_int_equal(kvb_http_server_in_flight(f->server), 0);
}

/* ---- the metrics registry on its own ------------------------------------------------------------- */

static char *render(kvb_metrics *m) {
    char *text = NULL;
    size_t len = 0;
    kvb_err err = {0};
    assert_int_equal(kvb_metrics_render(m, &text, &len, &err), KVB_OK);
    assert_int_equal(len, strlen(text));
    return text;
}

static void test_metrics_registry(void **state) {
    (void)state;
    kvb_metrics *m = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_metrics_create(&m, &err), KVB_OK);
    char *text = render(m);
    assert_string_equal(text, "");
    free(text);
    kvb_metric *c = NULL, *g = NULL, *h = NULL, *again = NULL, *bad = NULL;
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "t_requests_total", "Requests.", "route,code", NULL, 0, &c, &err), KVB_OK);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_GAUGE, "t_peer_up", "Peer up (1) or down (0).", NULL, NULL, 0, &g, &err), KVB_OK);
    const double bounds[] = {0.1, 1, 10};
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_HISTOGRAM, "t_latency_seconds", "Latency.", "phase", bounds, 3, &h, &err), KVB_OK);
    /* same definition: the same family; different: refused */
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "t_requests_total", "Other help.", "route,code", NULL, 0, &again, &err), KVB_OK);
    assert_ptr_equal(again, c);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_GAUGE, "t_requests_total", "x", "route,code", NULL, 0, &bad, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "t_requests_total", "x", "route", NULL, 0, &bad, &err), KVB_ERR_INVALID);
    /* invalid names, labels and bounds */
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "1bad", "x", NULL, NULL, 0, &bad, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "bad-name", "x", NULL, NULL, 0, &bad, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "ok_name", "x", "a,,b", NULL, 0, &bad, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "ok_name", "x", "__reserved", NULL, 0, &bad, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "ok_name", "x", "a,a", NULL, 0, &bad, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_HISTOGRAM, "ok_name", "x", "le", NULL, 0, &bad, &err), KVB_ERR_INVALID);
    const double unsorted[] = {1, 0.5};
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_HISTOGRAM, "ok_name", "x", NULL, unsorted, 2, &bad, &err), KVB_ERR_INVALID);
    const double inf_bound[] = {1, INFINITY};
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_HISTOGRAM, "ok_name", "x", NULL, inf_bound, 2, &bad, &err), KVB_ERR_INVALID);

    kvb_metric_add(c, KVB_LABELS("/a", "200"), 1);
    kvb_metric_add(c, KVB_LABELS("/a", "200"), 2);
    kvb_metric_add(c, KVB_LABELS("/a", "404"), 1);
    kvb_metric_add(c, KVB_LABELS("/a", "404"), -5);  /* counters never go down */
    kvb_metric_add(c, KVB_LABELS("/a", "404"), NAN);
    kvb_metric_set(c, KVB_LABELS("/a", "404"), 100); /* set is for gauges */
    kvb_metric_set(g, NULL, 1);
    kvb_metric_add(g, NULL, -3.5);
    kvb_metric_observe(h, KVB_LABELS("prefill"), 0.05);
    kvb_metric_observe(h, KVB_LABELS("prefill"), 0.1); /* le is inclusive */
    kvb_metric_observe(h, KVB_LABELS("prefill"), 5);
    kvb_metric_observe(h, KVB_LABELS("prefill"), 50);
    kvb_metric_observe(c, KVB_LABELS("/a", "200"), 1); /* observe is for histograms */
    assert_true(kvb_metric_value(c, KVB_LABELS("/a", "200")) == 3);
    assert_true(kvb_metric_value(c, KVB_LABELS("/a", "404")) == 1);
    assert_true(kvb_metric_value(c, KVB_LABELS("/b", "200")) == 0);
    assert_true(kvb_metric_value(g, NULL) == -2.5);
    assert_true(kvb_metric_value(h, KVB_LABELS("prefill")) == 4);
    text = render(m);
    assert_int_equal(prom_check(text), 2 + 1 + (4 + 2)); /* 2 counter series, 1 gauge, 4 buckets + sum + count */
    const char *expect =
        "# HELP t_requests_total Requests.\n"
        "# TYPE t_requests_total counter\n"
        "t_requests_total{route=\"/a\",code=\"200\"} 3\n"
        "t_requests_total{route=\"/a\",code=\"404\"} 1\n"
        "# HELP t_peer_up Peer up (1) or down (0).\n"
        "# TYPE t_peer_up gauge\n"
        "t_peer_up -2.5\n"
        "# HELP t_latency_seconds Latency.\n"
        "# TYPE t_latency_seconds histogram\n"
        "t_latency_seconds_bucket{phase=\"prefill\",le=\"0.1\"} 2\n"
        "t_latency_seconds_bucket{phase=\"prefill\",le=\"1\"} 2\n"
        "t_latency_seconds_bucket{phase=\"prefill\",le=\"10\"} 3\n"
        "t_latency_seconds_bucket{phase=\"prefill\",le=\"+Inf\"} 4\n"
        "t_latency_seconds_sum{phase=\"prefill\"} 55.15\n"
        "t_latency_seconds_count{phase=\"prefill\"} 4\n";
    assert_string_equal(text, expect);
    free(text);
    /* special values */
    kvb_metric_set(g, NULL, INFINITY);
    text = render(m);
    assert_non_null(strstr(text, "t_peer_up +Inf\n"));
    prom_check(text);
    free(text);
    kvb_metric_set(g, NULL, 1e-7);
    text = render(m);
    assert_non_null(strstr(text, "t_peer_up 1e-07\n"));
    free(text);
    kvb_metrics_free(m);
}

typedef struct {
    kvb_metric *c, *h;
    int id;
} hammer_arg;

static void *hammer_main(void *arg) {
    hammer_arg *a = arg;
    char label[16];
    for (int i = 0; i < 20000; i++) {
        snprintf(label, sizeof label, "w%d", i % 4);
        kvb_metric_add(a->c, KVB_LABELS(label), 1);
        kvb_metric_observe(a->h, NULL, (double)(i % 3));
    }
    return NULL;
}

static void test_metrics_threads_and_cap(void **state) {
    (void)state;
    kvb_metrics *m = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_metrics_create(&m, &err), KVB_OK);
    kvb_metric *c = NULL, *h = NULL;
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_COUNTER, "hammer_total", "x", "worker", NULL, 0, &c, &err), KVB_OK);
    assert_int_equal(kvb_metrics_register(m, KVB_METRIC_HISTOGRAM, "hammer_seconds", "x", NULL, NULL, 0, &h, &err), KVB_OK);
    enum { T = 4 };
    pthread_t th[T];
    hammer_arg args[T];
    for (int i = 0; i < T; i++) {
        args[i] = (hammer_arg){c, h, i};
        assert_int_equal(pthread_create(&th[i], NULL, hammer_main, &args[i]), 0);
    }
    for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
    for (int w = 0; w < 4; w++) {
        char label[16];
        snprintf(label, sizeof label, "w%d", w);
        assert_true(kvb_metric_value(c, KVB_LABELS(label)) == T * 5000);
    }
    assert_true(kvb_metric_value(h, NULL) == T * 20000);
    /* label cardinality is capped */
    for (int i = 0; i < KVB_METRIC_MAX_SERIES + 10; i++) {
        char label[32];
        snprintf(label, sizeof label, "v%d", i);
        kvb_metric_add(c, KVB_LABELS(label), 1);
    }
    char *text = render(m);
    prom_check(text);
    size_t lines = 0;
    for (const char *p = text; (p = strstr(p, "hammer_total{")); p++) lines++;
    assert_int_equal(lines, KVB_METRIC_MAX_SERIES);
    free(text);
    kvb_metrics_free(m);
}

/* ---- the API key --------------------------------------------------------------------------------- */

/* A 401 invalid_api_key with WWW-Authenticate: Bearer and exactly this message. */
static void expect_401(http_resp *r, const char *message) {
    expect_error(r, 401, NULL, "invalid_api_key", message);
    cJSON *j = parse_body(r);
    assert_string_equal(jstr(j, "error.message"), message);
    cJSON_Delete(j);
    char www[64];
    if (!header_value(r, "WWW-Authenticate", www, sizeof www)) fail_msg("401 without WWW-Authenticate:\n%s", r->head);
    assert_string_equal(www, "Bearer");
    resp_free(r);
}

static void test_api_key(void **state) {
    fixture *f = *state;
    static const char missing[] = "Missing API key: send the header 'Authorization: Bearer KEY' (this server was "
                                  "started with --api-key).";
    static const char wrong[] = "Incorrect API key provided.";
    const char *chat = "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"secret words\"}]}";
    http_resp r;
    int n401_models = 0, n401_chat = 0, n401_one = 0, n401_cmpl = 0;
    const int calls_before = atomic_load(&g_fake.calls);

    /* no header, on every /v1/ route and method */
    http_call(f->port, "GET", "/v1/models", NULL, NULL, &r);
    expect_401(&r, missing);
    n401_models++;
    http_call(f->port, "HEAD", "/v1/models", NULL, NULL, &r);
    assert_int_equal(r.status, 401);
    resp_free(&r);
    n401_models++;
    http_call(f->port, "GET", "/v1/models/" MODEL, NULL, NULL, &r);
    expect_401(&r, missing);
    n401_one++;
    post_json(f->port, "/v1/chat/completions", chat, &r);
    expect_401(&r, missing);
    n401_chat++;
    post_json(f->port, "/v1/completions", "{\"model\":\"" MODEL "\",\"prompt\":\"x\"}", &r);
    expect_401(&r, missing);
    n401_cmpl++;
    post_json(f->port, "/tokenize", "{\"prompt\":\"x\"}", &r);
    expect_401(&r, missing);
    post_json(f->port, "/detokenize", "{\"tokens\":[1]}", &r);
    expect_401(&r, missing);
    /* the order: route (404) and method (405) first, then the key, then content type and length */
    http_call(f->port, "GET", "/v1/nope", NULL, NULL, &r);
    expect_error(&r, 404, NULL, NULL, "Invalid URL");
    resp_free(&r);
    http_call(f->port, "GET", "/v1/chat/completions", NULL, NULL, &r);
    expect_error(&r, 405, NULL, NULL, "use POST");
    char allow[64];
    assert_non_null(header_value(&r, "Allow", allow, sizeof allow));
    assert_string_equal(allow, "POST");
    resp_free(&r);
    http_call(f->port, "POST", "/v1/chat/completions", "text/plain", chat, &r);
    expect_401(&r, missing);
    n401_chat++;
    http_call_auth(f->port, "POST", "/v1/chat/completions", "Bearer " API_KEY, "text/plain", chat, &r);
    expect_error(&r, 415, NULL, NULL, "text/plain");
    resp_free(&r);
    /* a body over the limit is never read without the key: 401 by the headers alone */
    char big_head[256];
    int bn = snprintf(big_head, sizeof big_head, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      "application/json\r\nContent-Length: %d\r\n\r\n{", SMALL_BODY_LIMIT * 4);
    http_raw(f->port, big_head, (size_t)bn, &r);
    expect_401(&r, missing);
    n401_chat++;

    /* not the Bearer scheme, or no token */
    const char *not_bearer[] = {"Basic c2stdGVzdDpzZWNyZXQ=", "Bearer", "Bearer   ", "Bearer:" API_KEY,
                                "Bearer" API_KEY, "Token " API_KEY, API_KEY};
    for (size_t i = 0; i < KVB_ARRAY_LEN(not_bearer); i++) {
        http_call_auth(f->port, "GET", "/v1/models", not_bearer[i], NULL, NULL, &r);
        if (r.status != 401) fail_msg("'Authorization: %s' got %d", not_bearer[i], r.status);
        expect_401(&r, missing);
        n401_models++;
    }
    /* the wrong key: another one, a prefix, the key plus a byte, another case */
    const char *wrong_keys[] = {"Bearer sk-wrong-key-000", "Bearer " API_KEY "x",
                                "Bearer sk-kvb-test-0123456789abcde", "Bearer SK-KVB-TEST-0123456789ABCDEF",
                                "Bearer " API_KEY " " API_KEY};
    for (size_t i = 0; i < KVB_ARRAY_LEN(wrong_keys); i++) {
        http_call_auth(f->port, "GET", "/v1/models", wrong_keys[i], NULL, NULL, &r);
        if (r.status != 401) fail_msg("'Authorization: %s' got %d", wrong_keys[i], r.status);
        expect_401(&r, wrong);
        n401_models++;
    }
    http_call_auth(f->port, "POST", "/v1/chat/completions", "Bearer nope-nope-nope", "application/json", chat, &r);
    expect_401(&r, wrong);
    n401_chat++;
    assert_int_equal(atomic_load(&g_fake.calls) - calls_before, 0); /* no handler ran for any of them */

    /* the right key: any case of the scheme, one or more spaces */
    const char *right[] = {"Bearer " API_KEY, "bearer " API_KEY, "BEARER   " API_KEY};
    for (size_t i = 0; i < KVB_ARRAY_LEN(right); i++) {
        http_call_auth(f->port, "GET", "/v1/models", right[i], NULL, NULL, &r);
        if (r.status != 200) fail_msg("'Authorization: %s' got %d: %s", right[i], r.status, r.body);
        cJSON *j = parse_body(&r);
        assert_string_equal(jstr(j, "data.0.id"), MODEL);
        cJSON_Delete(j);
        resp_free(&r);
    }
    http_call_auth(f->port, "GET", "/v1/models/" MODEL, "Bearer " API_KEY, NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    http_call_auth(f->port, "POST", "/v1/chat/completions", "bearer " API_KEY, "application/json", chat, &r);
    if (r.status != 200) fail_msg("chat with the key: %d %s", r.status, r.body);
    cJSON *j = parse_body(&r);
    assert_string_equal(jstr(j, "choices.0.message.content"), "secret words");
    cJSON_Delete(j);
    resp_free(&r);
    http_call_auth(f->port, "POST", "/v1/chat/completions", "Bearer " API_KEY, "application/json",
                   "{\"model\":\"" MODEL "\",\"messages\":[{\"role\":\"user\",\"content\":\"a b c\"}],"
                   "\"stream\":true}", &r);
    check_stream(&r, true, "a b c", "stop", false, 3);
    resp_free(&r);
    http_call_auth(f->port, "POST", "/v1/completions", "Bearer " API_KEY, "application/json",
                   "{\"model\":\"" MODEL "\",\"prompt\":\"once more\"}", &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);

    /* /health and /metrics stay open; the 401s are counted by route and code */
    http_call(f->port, "GET", "/health", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    for (int attempt = 0;; attempt++) {
        http_call(f->port, "GET", "/metrics", NULL, NULL, &r);
        assert_int_equal(r.status, 200);
        if (prom_value(r.body, "kvb_http_requests_in_flight") == 1 &&
            prom_value(r.body, "kvb_http_requests_total{route=\"/v1/completions\",code=\"200\"}") == 1)
            break;
        if (attempt == 200) fail_msg("metrics never settled:\n%s", r.body);
        resp_free(&r);
        sleep_ms(10);
    }
    assert_true(prom_check(r.body) > 0);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/v1/models\",code=\"401\"}") == n401_models);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/v1/models/{id}\",code=\"401\"}") == n401_one);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/v1/chat/completions\",code=\"401\"}") ==
                n401_chat);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/v1/completions\",code=\"401\"}") == n401_cmpl);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/v1/models\",code=\"200\"}") == 3);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/v1/chat/completions\",code=\"200\"}") == 2);
    assert_true(prom_value(r.body, "kvb_http_requests_total{route=\"/health\",code=\"200\"}") == 1);
    resp_free(&r);
}

static void test_api_key_start(void **state) {
    (void)state;
    kvb_http_handlers h = {.ctx = &g_fake, .completion = fake_completion};
    kvb_http_server *s = NULL;
    kvb_err err = {0};
    /* too short (3 and 7 bytes), and bytes a bearer token cannot carry */
    const char *bad[] = {"abc", "1234567", "has space in it", "tab\there-x", "newline\nkey", "caf\xc3\xa9-key-1"};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) {
        kvb_http_config cfg = {.listen = "127.0.0.1:0", .model_id = MODEL, .api_key = bad[i]};
        assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_ERR_INVALID);
        assert_null(s);
        if (i < 2 && !strstr(err.msg, "at least 8")) fail_msg("short key: '%s'", err.msg);
        if (strstr(err.msg, bad[i])) fail_msg("the message quotes the key: '%s'", err.msg);
    }
    /* 8 bytes is enough; "" means no key */
    kvb_http_config cfg = {.listen = "127.0.0.1:0", .model_id = MODEL, .api_key = "12345678"};
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_OK);
    http_resp r;
    http_call_auth(kvb_http_server_port(s), "GET", "/v1/models", "Bearer 12345678", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    http_call_auth(kvb_http_server_port(s), "GET", "/v1/models", "Bearer 1234567", NULL, NULL, &r);
    expect_401(&r, "Incorrect API key provided.");
    kvb_http_server_stop(s);
    cfg.api_key = "";
    assert_int_equal(kvb_http_server_start(&cfg, &h, &s, &err), KVB_OK);
    http_call(kvb_http_server_port(s), "GET", "/v1/models", NULL, NULL, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    kvb_http_server_stop(s);
}

/* ---- the official openai client ------------------------------------------------------------------ */

/* Runs tests/openai_client_check.py PORT MODEL [API_KEY]. */
static void run_openai_check(uint16_t port, const char *api_key) {
    const char *src = getenv("KVB_SOURCE_DIR");
    char py[1024], script[1024];
    snprintf(py, sizeof py, "%s/.venv/bin/python", src ? src : ".");
    snprintf(script, sizeof script, "%s/tests/openai_client_check.py", src ? src : ".");
    if (access(py, X_OK) != 0) {
        print_message("SKIP openai client check: %s is absent (run tools/install.sh)\n", py);
        skip();
    }
    char cmd[3072], out[16384];
    snprintf(cmd, sizeof cmd, "'%s' '%s' %u " MODEL " %s 2>&1", py, script, port, api_key ? api_key : "");
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    int rc = pclose(p);
    int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    if (code == 77) {
        print_message("SKIP openai client check: the openai package is not installed in %s\n", py);
        skip();
    }
    print_message("%s", out);
    if (code != 0) fail_msg("openai_client_check.py failed (exit %d)", code);
    assert_non_null(strstr(out, " 0 failed"));
}

static void test_openai_client(void **state) {
    fixture *f = *state;
    run_openai_check(f->port, NULL);
}

/* The same checks with the client's api_key, and AuthenticationError with a wrong one. */
static void test_openai_client_api_key(void **state) {
    fixture *f = *state;
    run_openai_check(f->port, API_KEY);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metrics_registry),
        cmocka_unit_test(test_metrics_threads_and_cap),
        cmocka_unit_test(test_start_errors),
        cmocka_unit_test(test_cors),
        cmocka_unit_test_setup_teardown(test_chat_non_streaming, setup, teardown),
        cmocka_unit_test_setup_teardown(test_completion_non_streaming, setup, teardown),
        cmocka_unit_test_setup_teardown(test_max_tokens_length, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chat_streaming, setup, teardown),
        cmocka_unit_test_setup_teardown(test_completion_streaming, setup, teardown),
        cmocka_unit_test_setup_teardown(test_logprobs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tokenize_routes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_choices, setup, teardown),
        cmocka_unit_test_setup_teardown(test_access_log, setup, teardown),
        cmocka_unit_test_setup_teardown(test_drain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_handler_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_http_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_body_limits, setup, teardown),
        cmocka_unit_test_setup_teardown(test_garbage_requests, setup, teardown),
        cmocka_unit_test_setup_teardown(test_health_and_models, setup, teardown),
        cmocka_unit_test_setup_teardown(test_keep_alive, setup, teardown),
        cmocka_unit_test_setup_teardown(test_metrics_endpoint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_client_disconnect, setup, teardown),
        cmocka_unit_test_setup_teardown(test_concurrent_clients, setup, teardown),
        cmocka_unit_test(test_stop_mid_stream),
        cmocka_unit_test(test_idle_timeout),
        cmocka_unit_test(test_api_key_start),
        cmocka_unit_test_setup_teardown(test_api_key, setup_key, teardown),
        cmocka_unit_test_setup_teardown(test_openai_client, setup, teardown),
        cmocka_unit_test_setup_teardown(test_openai_client_api_key, setup_key, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
