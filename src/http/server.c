/* server.c — the libmicrohttpd daemon (one thread per connection, poll; the connections come from
 * the guard in guard.c, which listens, answers framing errors and keeps the deadlines), routing, body limits,
 * the non-completion routes (/v1/models, /health, /metrics, the chat page at / and its live status
 * snapshot /v1/kvbridge/status) and the glue that turns a
 * kvb_completion_out into a response: non-streaming completions run the handler on the connection
 * thread and answer once it returns; streaming ones run it on a worker thread and answer (200,
 * text/event-stream, X-KVBridge) once the first delta or the finish is there. Early refusals (404,
 * 405, 413 by Content-Length, 415) are queued before the body is read, which makes MHD close the
 * connection after the answer; everything else keeps the connection alive. With an API key
 * configured, the /v1/ routes answer 401 (WWW-Authenticate: Bearer) before the body is read
 * unless "Authorization: Bearer KEY" matches: the server keeps the key's SHA-256 only and compares
 * the presented token's digest in constant time. /health and /metrics stay open. A client's
 * X-Request-Id comes back on the response and goes into the access log. Draining (quiesce), it
 * answers every new API request 503 (Connection: close) and /health 503 {"status": "draining"},
 * and lets the completions in flight finish. (It keeps accepting connections: MHD_quiesce_daemon
 * under thread-per-connection cut responses in flight now and then.) With allowed
 * origins (CORS), a response to a request from one of them names it in Access-Control-Allow-Origin,
 * and an OPTIONS preflight gets a 204 before any key is asked for (browsers send none there). With a
 * relay handler (the router), the completion routes, once validated, and the model listing pass
 * another server's reply on as it comes (status, headers and bytes the relay gives). */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "http_internal.h"

typedef enum {
    ROUTE_UNKNOWN = 0,
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_MODELS,
    ROUTE_MODEL_ONE,
    ROUTE_HEALTH,
    ROUTE_METRICS,
    ROUTE_TOKENIZE,
    ROUTE_DETOKENIZE,
    ROUTE_PAGE,   /* the chat page: "/" and its files (web.c) */
    ROUTE_STATUS, /* the page's live panel: GET /v1/kvbridge/status */
} route_id;

static const char *const route_labels[] = {"other", "/v1/chat/completions", "/v1/completions",
                                           "/v1/models", "/v1/models/{id}", "/health", "/metrics",
                                           "/tokenize", "/detokenize", "/ (page)",
                                           "/v1/kvbridge/status"};

typedef struct {
    kvb_http_server *server;
    route_id route;
    const http_web_asset *asset; /* ROUTE_PAGE: the file */
    double t_start;
    http_buf body;
    bool body_too_large;
    size_t body_discarded;
    bool responded;        /* a response is queued */
    unsigned status;       /* its status */
    bool timeout_lifted;   /* streaming: connection timeout off while the stream runs */
    char method[8];        /* for the log line: "POST", "GET", "HEAD" (others cut) */
    kvb_completion_req *req;
    kvb_completion_out *out;
    char origin[256];      /* the request's Origin when it is an allowed one (CORS), else "" */
    char request_id[129];  /* the client's X-Request-Id (printable ASCII, <= 128 bytes), else "" */
    kvb_relay_req relay;   /* handlers.relay: what the relay is given (path malloc'd) */
    bool body_watched;     /* the guard keeps the body's deadline */
    http_body_watch body_watch;
} request_ctx;

/* ---- responses ---------------------------------------------------------------------------------- */

/* Headers every response of the request carries: the client's X-Request-Id back, and for an
 * allowed origin's request (CORS) that origin named ("*" when any may call). */
static void add_request_headers(const request_ctx *ctx, struct MHD_Response *resp) {
    if (ctx->request_id[0]) MHD_add_response_header(resp, "X-Request-Id", ctx->request_id);
    if (!ctx->origin[0]) return;
    const bool any = strcmp(ctx->server->allow_origins, "*") == 0;
    MHD_add_response_header(resp, "Access-Control-Allow-Origin", any ? "*" : ctx->origin);
    if (!any) MHD_add_response_header(resp, "Vary", "Origin");
    MHD_add_response_header(resp, "Access-Control-Expose-Headers", "X-KVBridge");
}

/* Queues resp (and drops this reference to it); the request has answered with status. */
static enum MHD_Result queue_response(request_ctx *ctx, struct MHD_Connection *conn, unsigned status,
                                      struct MHD_Response *resp) {
    enum MHD_Result r = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    if (r == MHD_YES) {
        ctx->responded = true;
        ctx->status = status;
    }
    return r;
}

/* hdr_name/hdr_value: one more response header (Allow on a 405, WWW-Authenticate on a 401), or NULL. */
static enum MHD_Result queue_body(request_ctx *ctx, struct MHD_Connection *conn, unsigned status,
                                  const char *content_type, const char *body, size_t len,
                                  const char *verdict, const char *hdr_name, const char *hdr_value) {
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    if (verdict && verdict[0]) MHD_add_response_header(resp, "X-KVBridge", verdict);
    if (hdr_name && hdr_value) MHD_add_response_header(resp, hdr_name, hdr_value);
    add_request_headers(ctx, resp);
    return queue_response(ctx, conn, status, resp);
}

static enum MHD_Result queue_json(request_ctx *ctx, struct MHD_Connection *conn, unsigned status,
                                  cJSON *root, const char *verdict) {
    char *s = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!s) return MHD_NO;
    enum MHD_Result r = queue_body(ctx, conn, status, "application/json", s, strlen(s), verdict, NULL, NULL);
    cJSON_free(s);
    return r;
}

static enum MHD_Result queue_error(request_ctx *ctx, struct MHD_Connection *conn, const kvb_http_error *e,
                                   const char *verdict, const char *hdr_name, const char *hdr_value) {
    char *s = http_error_json(e);
    if (!s) return MHD_NO;
    unsigned status = (e->status >= 400 && e->status <= 599) ? (unsigned)e->status : 500;
    enum MHD_Result r =
        queue_body(ctx, conn, status, "application/json", s, strlen(s), verdict, hdr_name, hdr_value);
    cJSON_free(s);
    kvb_log(KVB_LOG_DEBUG, "http: %u %s", status, e->message);
    return r;
}

static enum MHD_Result refuse(request_ctx *ctx, struct MHD_Connection *conn, int status,
                              const char *allow, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static enum MHD_Result refuse(request_ctx *ctx, struct MHD_Connection *conn, int status,
                              const char *allow, const char *fmt, ...) {
    kvb_http_error e;
    va_list ap;
    va_start(ap, fmt);
    http_error_vset(&e, status, NULL, NULL, fmt, ap);
    va_end(ap);
    return queue_error(ctx, conn, &e, NULL, allow ? MHD_HTTP_HEADER_ALLOW : NULL, allow);
}

/* ---- simple routes ------------------------------------------------------------------------------ */

static cJSON *model_object(const kvb_http_server *s) {
    cJSON *m = cJSON_CreateObject();
    if (!m) return NULL;
    cJSON_AddStringToObject(m, "id", s->model_id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->started_unix);
    cJSON_AddStringToObject(m, "owned_by", "kvbridge");
    if (s->max_model_len) cJSON_AddNumberToObject(m, "max_model_len", s->max_model_len);
    return m;
}

static enum MHD_Result serve_models(request_ctx *ctx, struct MHD_Connection *conn) {
    cJSON *root = cJSON_CreateObject();
    cJSON *data = root ? cJSON_AddArrayToObject(root, "data") : NULL;
    if (!data) { cJSON_Delete(root); return MHD_NO; }
    cJSON_AddStringToObject(root, "object", "list");
    cJSON_AddItemToArray(data, model_object(ctx->server));
    return queue_json(ctx, conn, 200, root, NULL);
}

static enum MHD_Result serve_model_one(request_ctx *ctx, struct MHD_Connection *conn, const char *id) {
    if (strcmp(id, ctx->server->model_id) != 0) {
        kvb_http_error e;
        http_error_set(&e, 404, "model_not_found", "model", "The model '%.200s' does not exist.", id);
        return queue_error(ctx, conn, &e, NULL, NULL, NULL);
    }
    return queue_json(ctx, conn, 200, model_object(ctx->server), NULL);
}

static enum MHD_Result serve_health(request_ctx *ctx, struct MHD_Connection *conn) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return MHD_NO;
    const bool draining = atomic_load(&ctx->server->draining);
    cJSON_AddStringToObject(root, "status", draining ? "draining" : "ok"); /* a balancer stops sending */
    cJSON_AddStringToObject(root, "model", ctx->server->model_id);
    if (ctx->server->handlers.health) ctx->server->handlers.health(ctx->server->handlers.ctx, root);
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(root, "status"); /* a handler may say not ok */
    const bool ok = cJSON_IsString(st) && strcmp(st->valuestring, "ok") == 0;
    return queue_json(ctx, conn, ok ? 200 : 503, root, NULL);
}

static enum MHD_Result serve_metrics(request_ctx *ctx, struct MHD_Connection *conn) {
    char *text = NULL;
    size_t len = 0;
    kvb_err err = {0};
    if (kvb_metrics_render(ctx->server->metrics, &text, &len, &err) != KVB_OK)
        return refuse(ctx, conn, 500, NULL, "%s", err.msg);
    enum MHD_Result r = queue_body(ctx, conn, 200, KVB_METRICS_CONTENT_TYPE, text, len, NULL, NULL, NULL);
    free(text);
    return r;
}

/* The chat page's files: static bytes compiled in, revalidated on every load (a new binary's page
 * shows at once), under a strict Content-Security-Policy (its own script and styles only, no
 * inline script, its own API only, never framed). Open: the page holds no data; the API it calls
 * asks for the key. */
static enum MHD_Result serve_page(request_ctx *ctx, struct MHD_Connection *conn) {
    const http_web_asset *a = ctx->asset;
    struct MHD_Response *resp = MHD_create_response_from_buffer(a->len, (void *)a->data, MHD_RESPMEM_PERSISTENT);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, http_web_content_type(a->name));
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "Content-Security-Policy", HTTP_WEB_CSP);
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(resp, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(resp, "X-Frame-Options", "DENY");
    add_request_headers(ctx, resp);
    return queue_response(ctx, conn, 200, resp);
}

/* GET /v1/kvbridge/status: the server's own fields, then the handler's (peer, bridges, link, cache).
 * A /v1/ route: with --api-key it needs the key (it tells the node's load and what is in flight). */
static enum MHD_Result serve_status(request_ctx *ctx, struct MHD_Connection *conn) {
    kvb_http_server *s = ctx->server;
    cJSON *root = cJSON_CreateObject();
    if (!root) return MHD_NO;
    cJSON_AddStringToObject(root, "object", "kvbridge.status");
    cJSON_AddStringToObject(root, "model", s->model_id);
    cJSON_AddStringToObject(root, "status", atomic_load(&s->draining) ? "draining" : "ok");
    const double now = kvb_now_s();
    cJSON_AddNumberToObject(root, "now_s", now); /* monotonic: rates from two snapshots */
    cJSON_AddNumberToObject(root, "uptime_s", now - s->started_s);
    cJSON_AddNumberToObject(root, "in_flight", atomic_load(&s->completions_in_flight));
    if (s->handlers.status) s->handlers.status(s->handlers.ctx, root);
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!text) return MHD_NO;
    enum MHD_Result r = queue_body(ctx, conn, 200, "application/json", text, strlen(text), NULL,
                                   MHD_HTTP_HEADER_CACHE_CONTROL, "no-store"); /* a snapshot */
    cJSON_free(text);
    return r;
}

/* ---- tokenizing ---------------------------------------------------------------------------------- */

/* A request naming a model must name this one (404 model_not_found), as completions must. */
static bool model_mismatch(const kvb_http_server *s, const char *model, kvb_http_error *e) {
    if (!model || s->accept_any_model || strcmp(model, s->model_id) == 0) return false;
    http_error_set(e, 404, "model_not_found", "model", "The model '%.200s' does not exist; this server serves '%.200s'.",
                   model, s->model_id);
    return true;
}

/* POST /tokenize -> {"count", "max_model_len", "tokens", "token_strs": null}; POST /detokenize ->
 * {"prompt"} (vLLM's shapes). */
static enum MHD_Result serve_tokenizer(request_ctx *ctx, struct MHD_Connection *conn) {
    kvb_http_server *s = ctx->server;
    kvb_http_error e;
    const bool tok = ctx->route == ROUTE_TOKENIZE;
    kvb_status parsed = tok ? kvb_tokenize_req_parse(ctx->body.data, ctx->body.len, &ctx->req, &e)
                            : kvb_detokenize_req_parse(ctx->body.data, ctx->body.len, &ctx->req, &e);
    if (parsed != KVB_OK || model_mismatch(s, ctx->req->model, &e)) return queue_error(ctx, conn, &e, NULL, NULL, NULL);
    cJSON *root = cJSON_CreateObject();
    if (!root) return refuse(ctx, conn, 500, NULL, "Out of memory answering.");
    int status;
    http_error_set(&e, 500, NULL, NULL, "The tokenizer failed."); /* unless the handler says more */
    if (tok) {
        int32_t *ids = NULL;
        size_t n = 0;
        uint32_t ctx_len = 0;
        status = s->handlers.tokenize(s->handlers.ctx, ctx->req, &ids, &n, &ctx_len, &e);
        cJSON *arr = status ? NULL : cJSON_CreateArray();
        for (size_t i = 0; arr && i < n; i++) {
            cJSON *v = cJSON_CreateNumber(ids[i]);
            if (!v) { cJSON_Delete(arr); arr = NULL; break; }
            cJSON_AddItemToArray(arr, v);
        }
        free(ids);
        if (!status && !arr) status = 500, http_error_set(&e, 500, NULL, NULL, "Out of memory answering.");
        if (!status) {
            cJSON_AddNumberToObject(root, "count", (double)n);
            cJSON_AddNumberToObject(root, "max_model_len", ctx_len);
            cJSON_AddItemToObject(root, "tokens", arr);
            cJSON_AddNullToObject(root, "token_strs");
        }
    } else {
        char *text = NULL;
        status = s->handlers.detokenize(s->handlers.ctx, ctx->req, &text, &e);
        if (!status) {
            http_buf clean = {0}; /* a token may hold part of a character */
            http_utf8_sanitize_append(&clean, text ? text : "", text ? strlen(text) : 0);
            if (clean.oom || !cJSON_AddStringToObject(root, "prompt", clean.data))
                status = 500, http_error_set(&e, 500, NULL, NULL, "Out of memory answering.");
            http_buf_free(&clean);
        }
        free(text);
    }
    if (status) {
        cJSON_Delete(root);
        if (status < 400 || status > 599) status = 500;
        e.status = status;
        return queue_error(ctx, conn, &e, NULL, NULL, NULL);
    }
    return queue_json(ctx, conn, 200, root, NULL);
}

/* ---- completions -------------------------------------------------------------------------------- */

static int connection_fd(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? (int)ci->connect_fd : -1;
}

static enum MHD_Result queue_completion_error(request_ctx *ctx, struct MHD_Connection *conn) {
    kvb_completion_out *out = ctx->out;
    pthread_mutex_lock(&out->mu);
    kvb_http_error e = out->error;
    char verdict[KVB_VERDICT_MAX] = "";
    if (out->has_verdict) memcpy(verdict, out->verdict, sizeof verdict);
    pthread_mutex_unlock(&out->mu);
    return queue_error(ctx, conn, &e, verdict, NULL, NULL);
}

static enum MHD_Result serve_completion(request_ctx *ctx, struct MHD_Connection *conn) {
    kvb_http_server *s = ctx->server;
    kvb_http_error e;
    kvb_api api = ctx->route == ROUTE_CHAT ? KVB_API_CHAT_COMPLETIONS : KVB_API_COMPLETIONS;
    const double t_parse = kvb_now_s();
    kvb_trace_span("http.receive", ctx->t_start, t_parse, ctx->body.len); /* headers to the body's last byte */
    const kvb_status parsed = kvb_completion_req_parse(api, ctx->body.data, ctx->body.len, &ctx->req, &e);
    kvb_trace_span("http.parse", t_parse, kvb_now_s(), ctx->body.len);
    if (parsed != KVB_OK) return queue_error(ctx, conn, &e, NULL, NULL, NULL);
    http_buf_free(&ctx->body);
    if (model_mismatch(s, ctx->req->model, &e)) return queue_error(ctx, conn, &e, NULL, NULL, NULL);
    ctx->out = http_completion_new(s, ctx->req, connection_fd(conn));
    if (ctx->out) atomic_fetch_add(&s->completions_in_flight, 1);
    if (!ctx->out) return refuse(ctx, conn, 503, NULL, "Out of memory starting the completion.");
    kvb_completion_out *out = ctx->out;

    if (!ctx->req->stream) {
        const double t_run = kvb_now_s();
        http_completion_run_inline(out);
        kvb_trace_span("http.completion", t_run, kvb_now_s(), 0);
        if (out->client_gone) return MHD_NO; /* nobody to answer */
        if (out->failed) return queue_completion_error(ctx, conn);
        if (out->cancelled) { /* the server stopped it: what was decoded is cut short, never a 200 */
            kvb_http_error e;
            http_error_set(&e, 503, "server_shutting_down", NULL, "This server stopped before the reply was done; "
                           "send the request to another one.");
            return queue_error(ctx, conn, &e, NULL, MHD_HTTP_HEADER_CONNECTION, "close");
        }
        /* the last choice joins the body's (the others joined at kvb_completion_next_choice) */
        char *body = NULL;
        if (http_completion_close_choice(out, out->finish_reason)) {
            body = http_completion_json(&out->meta, out->done_choices, &out->usage, out->final_verdict);
            out->done_choices = NULL; /* taken by it, freed by it on failure */
        }
        if (!body) return refuse(ctx, conn, 500, NULL, "Out of memory formatting the response.");
        enum MHD_Result r = queue_body(ctx, conn, 200, "application/json", body, strlen(body),
                                       out->final_verdict, NULL, NULL);
        cJSON_free(body);
        return r;
    }

    if (!http_completion_start_worker(out))
        return refuse(ctx, conn, 503, NULL, "Could not start a thread for the completion.");
    int begun = http_completion_wait_begun(out);
    if (begun < 0) return MHD_NO; /* client gone or server stopping: the completed callback joins */
    if (begun == 0) return queue_completion_error(ctx, conn);

    struct MHD_Response *resp = MHD_create_response_from_callback(
        MHD_SIZE_UNKNOWN, 16 * 1024, http_completion_stream_read, out, NULL);
    if (!resp) return MHD_NO;
    char verdict[KVB_VERDICT_MAX];
    pthread_mutex_lock(&out->mu);
    memcpy(verdict, out->verdict, sizeof verdict);
    pthread_mutex_unlock(&out->mu);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    MHD_add_response_header(resp, "X-KVBridge", verdict);
    add_request_headers(ctx, resp);
    /* MHD would cut a stream whose gaps between deltas exceed the idle timeout: lift it for this
     * response (request_completed puts it back). */
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    ctx->timeout_lifted = true;
    return queue_response(ctx, conn, 200, resp);
}

/* ---- relaying (handlers.relay: the router) ---------------------------------------------------------- */

/* The relayed reply's head: its status, its headers, ours (X-Request-Id, CORS). A reply already
 * whole goes out with a Content-Length; one still coming is read from `pending` as it arrives. */
static enum MHD_Result queue_relayed(request_ctx *ctx, struct MHD_Connection *conn) {
    kvb_completion_out *out = ctx->out;
    pthread_mutex_lock(&out->mu);
    const bool whole = out->ended && !out->failed;
    struct MHD_Response *resp =
        whole ? MHD_create_response_from_buffer(out->pending.len - out->pending_off,
                                                out->pending.data ? out->pending.data + out->pending_off : (void *)"",
                                                MHD_RESPMEM_MUST_COPY)
              : MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, http_completion_stream_read, out, NULL);
    const int status = out->relay_status;
    const char *h = out->relay_headers.data;
    for (size_t i = 0; resp && i < out->relay_n_headers; i++) {
        const char *value = h + strlen(h) + 1;
        MHD_add_response_header(resp, h, value);
        h = value + strlen(value) + 1;
    }
    pthread_mutex_unlock(&out->mu);
    if (!resp) return MHD_NO;
    add_request_headers(ctx, resp);
    if (!whole) { /* a stream: its gaps may exceed the idle timeout (request_completed puts it back) */
        MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
        ctx->timeout_lifted = true;
    }
    return queue_response(ctx, conn, (unsigned)status, resp);
}

/* A completion (validated first: a bad request is our 4xx and reaches no backend) or a model
 * listing, handed to the relay: a stream's on a thread of its own, answered once its reply's head
 * is known; any other on this thread, answered once whole. */
static enum MHD_Result serve_relay(request_ctx *ctx, struct MHD_Connection *conn, const char *url) {
    kvb_http_server *s = ctx->server;
    if (ctx->route == ROUTE_CHAT || ctx->route == ROUTE_COMPLETIONS) {
        kvb_http_error e;
        const kvb_api api = ctx->route == ROUTE_CHAT ? KVB_API_CHAT_COMPLETIONS : KVB_API_COMPLETIONS;
        if (kvb_completion_req_parse(api, ctx->body.data, ctx->body.len, &ctx->req, &e) != KVB_OK)
            return queue_error(ctx, conn, &e, NULL, NULL, NULL);
        ctx->relay.body = ctx->body.data ? ctx->body.data : "";
        ctx->relay.body_len = ctx->body.len;
        ctx->relay.req = ctx->req;
    }
    ctx->relay.path = strdup(url);
    ctx->relay.request_id = ctx->request_id;
    ctx->out = ctx->relay.path ? http_completion_new(s, ctx->req, connection_fd(conn)) : NULL;
    if (!ctx->out) return refuse(ctx, conn, 503, NULL, "Out of memory starting the request.");
    atomic_fetch_add(&s->completions_in_flight, 1);
    ctx->out->relay = &ctx->relay;
    if (!ctx->out->streaming) { /* as a non-streamed completion: on this thread, answered whole */
        http_completion_run_inline(ctx->out);
        if (ctx->out->client_gone) return MHD_NO;
        if (!ctx->out->stream_started) return queue_completion_error(ctx, conn);
        return queue_relayed(ctx, conn);
    }
    if (!http_completion_start_worker(ctx->out))
        return refuse(ctx, conn, 503, NULL, "Could not start a thread for the request.");
    const int begun = http_completion_wait_begun(ctx->out);
    if (begun < 0) return MHD_NO; /* client gone or server stopping: the completed callback joins */
    if (begun == 0) return queue_completion_error(ctx, conn);
    return queue_relayed(ctx, conn);
}

/* ---- routing ------------------------------------------------------------------------------------ */

static route_id route_of(const kvb_http_server *s, const char *url) {
    if (strcmp(url, "/v1/chat/completions") == 0) return ROUTE_CHAT;
    if (strcmp(url, "/v1/completions") == 0) return ROUTE_COMPLETIONS;
    if (strcmp(url, "/v1/models") == 0) return ROUTE_MODELS;
    if (strncmp(url, "/v1/models/", 11) == 0 && url[11]) return ROUTE_MODEL_ONE;
    if (strcmp(url, "/health") == 0) return ROUTE_HEALTH;
    if (strcmp(url, "/metrics") == 0) return ROUTE_METRICS;
    if (strcmp(url, "/tokenize") == 0 && s->handlers.tokenize) return ROUTE_TOKENIZE;
    if (strcmp(url, "/detokenize") == 0 && s->handlers.detokenize) return ROUTE_DETOKENIZE;
    if (strcmp(url, "/v1/kvbridge/status") == 0) return ROUTE_STATUS;
    if (http_web_find(url)) return ROUTE_PAGE;
    return ROUTE_UNKNOWN;
}

static bool is_post_route(route_id r) {
    return r == ROUTE_CHAT || r == ROUTE_COMPLETIONS || r == ROUTE_TOKENIZE || r == ROUTE_DETOKENIZE;
}

/* ---- the API key -------------------------------------------------------------------------------- */

static bool sha256(const void *bytes, size_t n, unsigned char out[HTTP_API_KEY_DIGEST_LEN]) {
    unsigned int len = 0;
    return EVP_Digest(bytes, n, out, &len, EVP_sha256(), NULL) == 1 && len == HTTP_API_KEY_DIGEST_LEN;
}

/* The /v1/ routes (the status snapshot too) and (de)tokenizing; /health and /metrics stay open (probes
 * and scrapers carry no key), and so does the page (static files: it asks for the key on a 401). */
static bool route_needs_key(route_id r) {
    return r != ROUTE_HEALTH && r != ROUTE_METRICS && r != ROUTE_PAGE && r != ROUTE_UNKNOWN;
}

/* NULL when the request carries the key; else the 401's message. The token's digest is compared
 * with the key's in constant time, whatever the token's length. */
static const char *api_key_refusal(const kvb_http_server *s, struct MHD_Connection *conn) {
    static const char missing[] = "Missing API key: send the header 'Authorization: Bearer KEY' (this server "
                                  "was started with --api-key).";
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!v) return missing;
    while (*v == ' ' || *v == '\t') v++;
    if (strncasecmp(v, "Bearer", 6) != 0 || v[6] != ' ') return missing; /* another scheme, or no token */
    const char *token = v + 6;
    while (*token == ' ') token++;
    size_t n = strlen(token);
    while (n && (token[n - 1] == ' ' || token[n - 1] == '\t')) n--;
    if (!n) return missing;
    unsigned char digest[HTTP_API_KEY_DIGEST_LEN];
    if (!sha256(token, n, digest) ||
        CRYPTO_memcmp(digest, s->api_key_digest, HTTP_API_KEY_DIGEST_LEN) != 0)
        return "Incorrect API key provided.";
    return NULL;
}

/* "application/json" with optional parameters (charset) and any case. */
static bool is_json_media_type(const char *ct) {
    while (*ct == ' ' || *ct == '\t') ct++;
    static const char json[] = "application/json";
    if (strncasecmp(ct, json, sizeof json - 1) != 0) return false;
    const char *rest = ct + sizeof json - 1;
    while (*rest == ' ' || *rest == '\t') rest++;
    return *rest == '\0' || *rest == ';';
}

/* Whether origin is one of the allowed ones (exact match in the comma-separated list, or "*"). */
static bool origin_allowed(const char *allowed, const char *origin) {
    if (!allowed || !origin || !origin[0]) return false;
    if (strcmp(allowed, "*") == 0) return true;
    const size_t n = strlen(origin);
    for (const char *p = allowed; *p;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && memcmp(p, origin, n) == 0) return true;
        p += len + (end ? 1 : 0);
    }
    return false;
}

/* A CORS preflight (OPTIONS on a known route, CORS on): 204 with what the browser may send. */
static enum MHD_Result queue_preflight(request_ctx *ctx, struct MHD_Connection *conn) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    if (!resp) return MHD_NO;
    add_request_headers(ctx, resp);
    if (ctx->origin[0]) {
        MHD_add_response_header(resp, "Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS");
        MHD_add_response_header(resp, "Access-Control-Allow-Headers", "Authorization, Content-Type");
        MHD_add_response_header(resp, "Access-Control-Max-Age", "600");
    }
    return queue_response(ctx, conn, 204, resp);
}

/* First call for a request: headers are in. Returns MHD_YES to go on reading, or a queued
 * early refusal. */
static enum MHD_Result on_headers(request_ctx *ctx, struct MHD_Connection *conn, const char *url,
                                  const char *method) {
    kvb_http_server *s = ctx->server;
    ctx->route = route_of(s, url);
    if (ctx->route == ROUTE_PAGE) ctx->asset = http_web_find(url);
    bool get = strcmp(method, MHD_HTTP_METHOD_GET) == 0 || strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
    bool post = strcmp(method, MHD_HTTP_METHOD_POST) == 0;
    const char *rid = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id");
    if (rid && strlen(rid) < sizeof ctx->request_id) {
        bool printable = true;
        for (const char *p = rid; *p && printable; p++) printable = (unsigned char)*p > ' ' && (unsigned char)*p < 0x7f;
        if (printable) memcpy(ctx->request_id, rid, strlen(rid) + 1);
    }
    const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Origin");
    if (s->allow_origins && origin_allowed(s->allow_origins, origin) && strlen(origin) < sizeof ctx->origin)
        memcpy(ctx->origin, origin, strlen(origin) + 1);
    if (ctx->route == ROUTE_UNKNOWN)
        return refuse(ctx, conn, 404, NULL, "Invalid URL (%.16s %.200s)", method, url);
    if (s->allow_origins && strcmp(method, MHD_HTTP_METHOD_OPTIONS) == 0) return queue_preflight(ctx, conn);
    if (is_post_route(ctx->route) && !post)
        return refuse(ctx, conn, 405, "POST", "Method %.16s is not allowed on %s; use POST.", method,
                      route_labels[ctx->route]);
    if (!is_post_route(ctx->route) && !get)
        return refuse(ctx, conn, 405, "GET, HEAD", "Method %.16s is not allowed on %s; use GET.", method,
                      route_labels[ctx->route]);
    if (atomic_load(&s->draining) && route_needs_key(ctx->route)) { /* the API routes; probes stay */
        kvb_http_error e;
        http_error_set(&e, 503, "server_shutting_down", NULL, "This server is shutting down and takes no new "
                       "requests; send it to another one.");
        return queue_error(ctx, conn, &e, NULL, MHD_HTTP_HEADER_CONNECTION, "close");
    }
    if (s->has_api_key && route_needs_key(ctx->route)) {
        const char *why = api_key_refusal(s, conn);
        if (why) {
            kvb_http_error e;
            http_error_set(&e, 401, "invalid_api_key", NULL, "%s", why);
            return queue_error(ctx, conn, &e, NULL, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
        }
    }
    if (!post) return MHD_YES;
    const char *ct = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    if (ct && !is_json_media_type(ct))
        return refuse(ctx, conn, 415, NULL, "Unsupported Content-Type '%.100s'; send application/json.", ct);
    const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end = NULL;
        unsigned long long n = strtoull(cl, &end, 10);
        if (end != cl && n > s->max_body_bytes)
            return refuse(ctx, conn, 413, NULL, "Request body of %llu bytes is over the limit of %zu bytes.",
                          n, s->max_body_bytes);
    }
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
    (void)version;
    kvb_http_server *s = cls;
    request_ctx *ctx = *con_cls;
    if (!ctx) {
        ctx = calloc(1, sizeof *ctx);
        if (!ctx) return MHD_NO;
        ctx->server = s;
        ctx->t_start = kvb_now_s();
        snprintf(ctx->method, sizeof ctx->method, "%s", method);
        *con_cls = ctx;
        kvb_metric_add(s->m_in_flight, NULL, 1);
        http_guard_connection_idle(s->guard, connection_fd(conn), false);
        enum MHD_Result r = on_headers(ctx, conn, url, method);
        if (r == MHD_YES && !ctx->responded && is_post_route(ctx->route)) { /* its body has a deadline */
            http_guard_body_begin(s->guard, &ctx->body_watch, connection_fd(conn));
            ctx->body_watched = true;
        }
        return r;
    }
    if (ctx->responded) { /* an early refusal is queued; MHD discards the rest */
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (!ctx->body_too_large && ctx->body.len + n > s->max_body_bytes) {
            ctx->body_too_large = true;
            http_buf_free(&ctx->body);
        }
        if (ctx->body_too_large) {
            ctx->body_discarded += n;
            /* a chunked upload that keeps going far past the limit: stop reading it at all */
            return ctx->body_discarded > 4 * s->max_body_bytes ? MHD_NO : MHD_YES;
        }
        http_buf_append(&ctx->body, upload_data, n);
        return ctx->body.oom ? MHD_NO : MHD_YES;
    }
    /* the whole request is in */
    if (ctx->body_watched) {
        ctx->body_watched = false;
        if (!http_guard_body_end(s->guard, &ctx->body_watch)) return MHD_NO; /* answered 408 already */
    }
    if (ctx->body_too_large)
        return refuse(ctx, conn, 413, NULL, "Request body is over the limit of %zu bytes.", s->max_body_bytes);
    if (s->handlers.relay && (ctx->route == ROUTE_CHAT || ctx->route == ROUTE_COMPLETIONS ||
                              ctx->route == ROUTE_MODELS || ctx->route == ROUTE_MODEL_ONE))
        return serve_relay(ctx, conn, url);
    switch (ctx->route) {
    case ROUTE_CHAT:
    case ROUTE_COMPLETIONS: return serve_completion(ctx, conn);
    case ROUTE_MODELS: return serve_models(ctx, conn);
    case ROUTE_MODEL_ONE: return serve_model_one(ctx, conn, url + 11);
    case ROUTE_HEALTH: return serve_health(ctx, conn);
    case ROUTE_METRICS: return serve_metrics(ctx, conn);
    case ROUTE_PAGE: return serve_page(ctx, conn);
    case ROUTE_STATUS: return serve_status(ctx, conn);
    case ROUTE_TOKENIZE:
    case ROUTE_DETOKENIZE: return serve_tokenizer(ctx, conn);
    default: return MHD_NO;
    }
}

static const char *verdict_class(const char *v) {
    if (strcmp(v, "complete") == 0) return "complete";
    if (strncmp(v, "partial", 7) == 0) return "partial";
    if (strncmp(v, "declined", 8) == 0) return "declined";
    return "other";
}

/* One line per request, as an operator reads a server's access log: at INFO, completions (the id
 * the client got, tokens by where they came from, time to the first token, the verdict, how it
 * ended) and the other API calls and refusals; at DEBUG, probes and scrapes (every few seconds). */
static void log_request(const request_ctx *ctx, double seconds) {
    const char *method = ctx->method;
    const kvb_completion_out *out = ctx->out;
    const char *route = route_labels[ctx->route];
    const unsigned status = ctx->responded ? ctx->status : 0u;
    if (!out) { /* refused before a completion began, or another route */
        const bool probe = ctx->route == ROUTE_HEALTH || ctx->route == ROUTE_METRICS || ctx->route == ROUTE_MODELS ||
                           ctx->route == ROUTE_MODEL_ONE || ctx->route == ROUTE_PAGE || ctx->route == ROUTE_STATUS;
        kvb_log(probe ? KVB_LOG_DEBUG : KVB_LOG_INFO, "http: %s %s %u %.3fs%s%s", method, route, status, seconds,
                ctx->request_id[0] ? " req=" : "", ctx->request_id);
        return;
    }
    if (kvb_log_get_level() < KVB_LOG_INFO) return;
    if (out->relay) { /* another server's reply: its own log has the tokens and the verdict */
        char ttfb[32] = "-";
        if (out->emitted) snprintf(ttfb, sizeof ttfb, "%.3fs", out->t_first_token - out->t_start);
        kvb_log(KVB_LOG_INFO, "http: %s %s %u relayed%s%s %.3fs%s first byte %s%s", method, route, status,
                ctx->request_id[0] ? " req=" : "", ctx->request_id, seconds, out->streaming ? " stream" : "", ttfb,
                out->failed ? " (cut)" : out->client_gone ? " (client gone)" : "");
        return;
    }
    const kvb_usage *u = &out->usage;
    char ttft[32] = "-";
    if (out->emitted) snprintf(ttft, sizeof ttft, "%.3fs", out->t_first_token - out->t_start);
    char end[161]; /* an error's message may quote the client's bytes: printable ASCII only */
    http_printable_copy(end, sizeof end, out->client_gone ? "client gone"
                                         : out->failed    ? out->error.message
                                         : out->ended     ? http_finish_reason_name(out->finish_reason)
                                                          : "unfinished");
    kvb_log(KVB_LOG_INFO,
            "http: %s %s %u %s%s%s %.3fs%s prompt=%lld (cached %lld, bridged %lld, native %lld) completion=%lld "
            "ttft=%s verdict=\"%s\" end=\"%s\"",
            method, route, status, out->meta.id, ctx->request_id[0] ? " req=" : "", ctx->request_id, seconds,
            out->streaming ? " stream" : "", (long long)u->prompt_tokens,
            (long long)u->cached_tokens, (long long)u->bridged_tokens, (long long)u->native_tokens,
            (long long)u->completion_tokens, ttft, out->ended && !out->failed ? out->final_verdict : out->verdict, end);
}

static void request_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                              enum MHD_RequestTerminationCode toe) {
    kvb_http_server *s = cls;
    request_ctx *ctx = *con_cls;
    if (!ctx) return;
    *con_cls = NULL;
    if (ctx->body_watched) http_guard_body_end(s->guard, &ctx->body_watch);
    kvb_completion_out *out = ctx->out;
    const double seconds = kvb_now_s() - ctx->t_start;
    if (out) http_completion_abandon(out); /* joins a streaming worker: its fields are final */
    log_request(ctx, seconds);
    if (out) {
        const char *api = out->meta.api == KVB_API_CHAT_COMPLETIONS ? "chat" : "completions";
        bool delivered = toe == MHD_REQUEST_TERMINATED_COMPLETED_OK;
        if (out->client_gone || (!delivered && toe != MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN))
            kvb_metric_add(s->m_disconnects, KVB_LABELS(api), 1);
        if (out->emitted && (!out->relay || out->req)) /* a relayed model listing has no first token */
            kvb_metric_observe(s->m_ttft, KVB_LABELS(api), out->t_first_token - out->t_start);
        if (out->ended && !out->failed && !out->relay) {
            kvb_metric_add(s->m_prompt_tokens, KVB_LABELS(api), (double)out->usage.prompt_tokens);
            kvb_metric_add(s->m_generated_tokens, KVB_LABELS(api), (double)out->usage.completion_tokens);
            kvb_metric_add(s->m_verdicts, KVB_LABELS(verdict_class(out->final_verdict)), 1);
        }
        http_completion_free(out);
        atomic_fetch_sub(&s->completions_in_flight, 1);
    }
    if (ctx->timeout_lifted)
        MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, s->idle_timeout_s);
    if (toe == MHD_REQUEST_TERMINATED_COMPLETED_OK) /* kept alive for the next request, if any */
        http_guard_connection_idle(s->guard, connection_fd(conn), true);
    char code[16];
    snprintf(code, sizeof code, "%u", ctx->responded ? ctx->status : 0u);
    const char *route = route_labels[ctx->route];
    kvb_metric_add(s->m_requests, KVB_LABELS(route, code), 1);
    kvb_metric_observe(s->m_duration, KVB_LABELS(route), seconds);
    kvb_metric_add(s->m_in_flight, NULL, -1);
    kvb_completion_req_free(ctx->req);
    http_buf_free(&ctx->body);
    free((char *)ctx->relay.path);
    free(ctx);
}

/* A connection the guard handed over is closed: it no longer counts against the limits. */
static void connection_notified(void *cls, struct MHD_Connection *conn, void **socket_context,
                                enum MHD_ConnectionNotificationCode toe) {
    kvb_http_server *s = cls;
    (void)socket_context;
    if (toe == MHD_CONNECTION_NOTIFY_CLOSED && s->guard) http_guard_connection_closed(s->guard, connection_fd(conn));
}

static void mhd_logger(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    if (kvb_log_get_level() < KVB_LOG_DEBUG) return;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
    kvb_log(KVB_LOG_DEBUG, "http (microhttpd): %s", msg);
}

/* ---- lifetime ----------------------------------------------------------------------------------- */

/* "HOST:PORT", "[V6]:PORT", ":PORT" / "*:PORT" (all interfaces). */
static kvb_status resolve_listen(const char *listen, struct sockaddr_storage *ss, kvb_err *err) {
    if (!listen || !listen[0]) return kvb_err_set(err, KVB_ERR_INVALID, "http: no listen address");
    char host[256];
    const char *port_s;
    if (listen[0] == '[') {
        const char *close = strchr(listen, ']');
        if (!close || close[1] != ':' || (size_t)(close - listen - 1) >= sizeof host)
            return kvb_err_set(err, KVB_ERR_INVALID, "http: bad listen address '%s' (want [V6]:PORT)", listen);
        memcpy(host, listen + 1, (size_t)(close - listen - 1));
        host[close - listen - 1] = '\0';
        port_s = close + 2;
    } else {
        const char *colon = strrchr(listen, ':');
        if (!colon || (size_t)(colon - listen) >= sizeof host)
            return kvb_err_set(err, KVB_ERR_INVALID, "http: bad listen address '%s' (want HOST:PORT)", listen);
        memcpy(host, listen, (size_t)(colon - listen));
        host[colon - listen] = '\0';
        port_s = colon + 1;
    }
    char *end = NULL;
    unsigned long port = strtoul(port_s, &end, 10);
    if (!port_s[0] || *end || port > 65535 || port_s[0] == '-' || port_s[0] == '+')
        return kvb_err_set(err, KVB_ERR_INVALID, "http: bad port in listen address '%s'", listen);
    memset(ss, 0, sizeof *ss);
    if (!host[0] || strcmp(host, "*") == 0) {
        struct sockaddr_in *in = (struct sockaddr_in *)ss;
        in->sin_family = AF_INET;
        in->sin_addr.s_addr = htonl(INADDR_ANY);
        in->sin_port = htons((uint16_t)port);
        return KVB_OK;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc != 0 || !res)
        return kvb_err_set(err, KVB_ERR_INVALID, "http: cannot resolve '%s': %s", host, gai_strerror(rc));
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (ss->ss_family == AF_INET) ((struct sockaddr_in *)ss)->sin_port = htons((uint16_t)port);
    else if (ss->ss_family == AF_INET6) ((struct sockaddr_in6 *)ss)->sin6_port = htons((uint16_t)port);
    else return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "http: '%s' is not an IP address", host);
    return KVB_OK;
}

static kvb_status register_metrics(kvb_http_server *s, kvb_err *err) {
    static const double token_latency[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
    static const double stream_gap[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
    struct {
        kvb_metric **slot;
        kvb_metric_type type;
        const char *name, *help, *labels;
        const double *bounds;
        size_t n_bounds;
    } defs[] = {
        {&s->m_refused, KVB_METRIC_COUNTER, "kvb_http_connections_refused_total",
         "Connections answered 503 before their request was served, by reason: capacity (every connection "
         "serving), per_client (the client holds its most), waiting (too many heads being sent).", "reason", NULL, 0},
        {&s->m_framing, KVB_METRIC_COUNTER, "kvb_http_framing_errors_total",
         "Requests refused for their HTTP framing (request line, headers, chunk sizes) before reaching a route, by "
         "status code.", "code", NULL, 0},
        {&s->m_deadlines, KVB_METRIC_COUNTER, "kvb_http_deadline_timeouts_total",
         "Requests answered 408 because their headers or body did not arrive in time, by phase.", "phase", NULL, 0},
        {&s->m_connections, KVB_METRIC_GAUGE, "kvb_http_connections",
         "Open client connections: waiting (sending their request head; they hold no thread) and serving (handed "
         "to the HTTP library, at most --max-connections).", "state", NULL, 0},
        {&s->m_evicted, KVB_METRIC_COUNTER, "kvb_http_idle_connections_closed_total",
         "Kept-alive connections idle between requests closed to make room for a new client when every connection "
         "was taken.", NULL, NULL, 0},
        {&s->m_requests, KVB_METRIC_COUNTER, "kvb_http_requests_total",
         "HTTP requests by route and status code (0: no response was sent).", "route,code", NULL, 0},
        {&s->m_duration, KVB_METRIC_HISTOGRAM, "kvb_http_request_duration_seconds",
         "Time from the request's headers to the end of its response.", "route", token_latency,
         KVB_ARRAY_LEN(token_latency)},
        {&s->m_in_flight, KVB_METRIC_GAUGE, "kvb_http_requests_in_flight", "HTTP requests being served.",
         NULL, NULL, 0},
        {&s->m_ttft, KVB_METRIC_HISTOGRAM, "kvb_completion_time_to_first_token_seconds",
         "Time from the request's headers to the first emitted text.", "api", token_latency,
         KVB_ARRAY_LEN(token_latency)},
        {&s->m_gap, KVB_METRIC_HISTOGRAM, "kvb_completion_stream_gap_seconds",
         "Time between two emitted text deltas of a completion: what a streaming client waits between "
         "chunks (a long prompt or transfer of another request shows here).", "api", stream_gap,
         KVB_ARRAY_LEN(stream_gap)},
        {&s->m_prompt_tokens, KVB_METRIC_COUNTER, "kvb_completion_prompt_tokens_total",
         "Prompt tokens of finished completions.", "api", NULL, 0},
        {&s->m_generated_tokens, KVB_METRIC_COUNTER, "kvb_completion_generated_tokens_total",
         "Generated tokens of finished completions.", "api", NULL, 0},
        {&s->m_disconnects, KVB_METRIC_COUNTER, "kvb_completion_client_disconnects_total",
         "Completions whose client went away before the response was delivered.", "api", NULL, 0},
        {&s->m_verdicts, KVB_METRIC_COUNTER, "kvb_completion_verdicts_total",
         "Finished completions by bridge verdict class (complete, partial, declined, other).", "verdict",
         NULL, 0},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(defs); i++) {
        kvb_status st = kvb_metrics_register(s->metrics, defs[i].type, defs[i].name, defs[i].help,
                                             defs[i].labels, defs[i].bounds, defs[i].n_bounds,
                                             defs[i].slot, err);
        if (st) return st;
    }
    return KVB_OK;
}

/* The config's checks: a completion handler, a model id, an API key of printable ASCII and at
 * least HTTP_API_KEY_MIN bytes, origins without spaces or control bytes. */
static kvb_status check_config(const kvb_http_config *cfg, const kvb_http_handlers *h, kvb_err *err) {
    if (!cfg || !h || (!h->completion && !h->relay))
        return kvb_err_set(err, KVB_ERR_INVALID, "http: a config and a completion (or relay) handler are required");
    if (!cfg->model_id || !cfg->model_id[0])
        return kvb_err_set(err, KVB_ERR_INVALID, "http: model_id is required");
    const size_t key_len = cfg->api_key ? strlen(cfg->api_key) : 0;
    if (key_len && key_len < HTTP_API_KEY_MIN)
        return kvb_err_set(err, KVB_ERR_INVALID, "http: the API key (--api-key / KVB_API_KEY) is %zu bytes; use at "
                           "least %d", key_len, HTTP_API_KEY_MIN);
    for (size_t i = 0; i < key_len; i++)
        if ((unsigned char)cfg->api_key[i] <= ' ' || (unsigned char)cfg->api_key[i] >= 0x7f)
            return kvb_err_set(err, KVB_ERR_INVALID, "http: the API key (--api-key / KVB_API_KEY) has a space, "
                               "a control or a non-ASCII byte at offset %zu; a bearer token is printable ASCII",
                               i);
    for (const char *p = cfg->allow_origins; p && *p; p++)
        if ((unsigned char)*p <= ' ' || (unsigned char)*p >= 0x7f)
            return kvb_err_set(err, KVB_ERR_INVALID, "http: the allowed origins ('%s') must be origins like "
                               "https://ui.example, comma-separated without spaces, or *", cfg->allow_origins);
    return KVB_OK;
}

/* Starts MHD (listening on nothing) and the guard that accepts on addr and hands connections over;
 * on failure nothing of them is left running. */
static kvb_status start_listening(kvb_http_server *s, const kvb_http_config *cfg, const struct sockaddr_storage *addr,
                                  kvb_err *err) {
    kvb_status st;
    /* MHD listens on nothing: the guard (guard.c) accepts, checks each request head and hands the
     * connection over; MHD's own limit sits above the guard's, whose count leads MHD's by a moment */
    const unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                           MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC;
    const unsigned max_conn = cfg->max_connections ? cfg->max_connections : 256;
    const unsigned per_client = cfg->max_connections_per_client ? cfg->max_connections_per_client
                                                                : HTTP_PER_CLIENT_DEFAULT(max_conn);
    s->daemon = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s,
                                 MHD_OPTION_NOTIFY_COMPLETED, request_completed, s,
                                 MHD_OPTION_NOTIFY_CONNECTION, connection_notified, s,
                                 MHD_OPTION_CONNECTION_TIMEOUT, s->idle_timeout_s,
                                 MHD_OPTION_CONNECTION_LIMIT, max_conn + 64,
                                 MHD_OPTION_EXTERNAL_LOGGER, mhd_logger, NULL,
                                 MHD_OPTION_END);
    if (!s->daemon) return kvb_err_set(err, KVB_ERR_IO, "http: cannot start the HTTP daemon for %s", cfg->listen);
    const http_guard_limits limits = {
        .max_active = max_conn,
        .max_per_client = per_client,
        .header_timeout_s = cfg->header_timeout_s ? cfg->header_timeout_s : HTTP_HEADER_TIMEOUT_DEFAULT_S,
        .body_timeout_s = cfg->body_timeout_s ? cfg->body_timeout_s : HTTP_BODY_TIMEOUT_DEFAULT_S,
    };
    if ((st = http_guard_start(s, addr, &limits, &s->guard, err))) {
        kvb_log(KVB_LOG_ERROR, "http: cannot listen on %s (address in use, or not a local address?)", cfg->listen);
        MHD_stop_daemon(s->daemon);
        return st;
    }
    return KVB_OK;
}

kvb_status kvb_http_server_start(const kvb_http_config *cfg, const kvb_http_handlers *h,
                                 kvb_http_server **out, kvb_err *err) {
    *out = NULL;
    kvb_status st = check_config(cfg, h, err);
    if (st) return st;
    const size_t key_len = cfg->api_key ? strlen(cfg->api_key) : 0;
    struct sockaddr_storage addr;
    if ((st = resolve_listen(cfg->listen, &addr, err))) return st;

    kvb_http_server *s = calloc(1, sizeof *s);
    if (!s) return kvb_err_set(err, KVB_ERR_NOMEM, "http: out of memory");
    s->handlers = *h;
    s->model_id = strdup(cfg->model_id);
    s->accept_any_model = cfg->accept_any_model;
    s->max_model_len = cfg->max_model_len;
    s->max_body_bytes = cfg->max_body_bytes ? cfg->max_body_bytes : (size_t)32 << 20;
    s->idle_timeout_s = cfg->idle_timeout_s ? cfg->idle_timeout_s : 120;
    s->started_unix = (int64_t)time(NULL);
    s->started_s = kvb_now_s();
    atomic_init(&s->stopping, false);
    atomic_init(&s->draining, false);
    atomic_init(&s->completions_in_flight, 0);
    atomic_init(&s->next_id, 1);
    s->id_salt = kvb_splitmix64((uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)s ^
                                (uint64_t)(kvb_now_s() * 1e9));
    s->allow_origins = cfg->allow_origins && cfg->allow_origins[0] ? strdup(cfg->allow_origins) : NULL;
    if (!s->model_id || (cfg->allow_origins && cfg->allow_origins[0] && !s->allow_origins)) {
        free(s->model_id);
        free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "http: out of memory");
    }
    if (cfg->metrics) {
        s->metrics = cfg->metrics;
    } else if ((st = kvb_metrics_create(&s->metrics, err))) {
        free(s->allow_origins);
        free(s->model_id);
        free(s);
        return st;
    } else {
        s->owns_metrics = true;
    }
    if ((st = register_metrics(s, err))) goto fail;
    if (key_len) {
        if (!sha256(cfg->api_key, key_len, s->api_key_digest)) {
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "http: SHA-256 of the API key failed (OpenSSL)");
            goto fail;
        }
        s->has_api_key = true;
    }

    if ((st = start_listening(s, cfg, &addr, err))) goto fail;
    s->port = http_guard_port(s->guard);
    kvb_log(KVB_LOG_INFO, "http: serving model '%s' on %s (port %u%s%s%s)", s->model_id, cfg->listen, s->port,
            s->has_api_key ? ", API key required on /v1/" : "", s->allow_origins ? ", CORS for " : "",
            s->allow_origins ? s->allow_origins : "");
    *out = s;
    return KVB_OK;
fail:
    OPENSSL_cleanse(s->api_key_digest, sizeof s->api_key_digest);
    if (s->owns_metrics) kvb_metrics_free(s->metrics);
    free(s->allow_origins);
    free(s->model_id);
    free(s);
    return st;
}

uint16_t kvb_http_server_port(const kvb_http_server *s) { return s ? s->port : 0; }

void kvb_http_server_quiesce(kvb_http_server *s) {
    if (!s || atomic_exchange(&s->draining, true)) return;
    kvb_log(KVB_LOG_INFO, "http: draining: new requests get 503; %u completion(s) in flight",
            atomic_load(&s->completions_in_flight));
}

unsigned kvb_http_server_in_flight(kvb_http_server *s) { return s ? atomic_load(&s->completions_in_flight) : 0; }

kvb_metrics *kvb_http_server_metrics(kvb_http_server *s) { return s ? s->metrics : NULL; }

void kvb_http_server_stop(kvb_http_server *s) {
    if (!s) return;
    atomic_store(&s->stopping, true); /* every wait and emit sees it within a slice */
    http_guard_stop_accepting(s->guard);
    MHD_stop_daemon(s->daemon);       /* joins the connection threads (they join the workers) */
    http_guard_free(s->guard);
    OPENSSL_cleanse(s->api_key_digest, sizeof s->api_key_digest);
    if (s->owns_metrics) kvb_metrics_free(s->metrics);
    free(s->allow_origins);
    free(s->model_id);
    free(s);
}
