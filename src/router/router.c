/* router.c — the router's lifetime: the config's checks and defaults, libcurl's one-time global
 * set-up and the connection pool shared by every upstream call (a CURLSH with its locks), the
 * backends, the history table, the metrics, the health thread, and the HTTP server (src/http) with
 * the relay handler and a /health that is ok while at least one backend is up (503 otherwise) and
 * lists each backend's state. */
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router_internal.h"

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_global_rc = CURLE_FAILED_INIT;
static void curl_global(void) { curl_global_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

static void share_lock(CURL *h, curl_lock_data data, curl_lock_access access, void *ud) {
    (void)h, (void)access;
    kvb_router *r = ud;
    pthread_mutex_lock(&r->share_mu[(unsigned)data % KVB_ARRAY_LEN(r->share_mu)]);
}

static void share_unlock(CURL *h, curl_lock_data data, void *ud) {
    (void)h;
    kvb_router *r = ud;
    pthread_mutex_unlock(&r->share_mu[(unsigned)data % KVB_ARRAY_LEN(r->share_mu)]);
}

/* /health: {"status": "ok" | "no_backend_up", "role": "router", "backends_up", "backends": [{"backend",
 * "state", "in_flight", "reason"}]}. */
static void router_health(void *ctx, cJSON *body) {
    kvb_router *r = ctx;
    cJSON *arr = cJSON_CreateArray();
    size_t n_up = 0;
    pthread_mutex_lock(&r->mu);
    for (size_t i = 0; arr && i < r->n_backends; i++) {
        const router_backend *b = &r->backends[i];
        const bool up = atomic_load(&b->up);
        n_up += up;
        cJSON *o = cJSON_CreateObject();
        if (!o) continue;
        cJSON_AddStringToObject(o, "backend", b->name);
        cJSON_AddStringToObject(o, "state", up ? "up" : "down");
        cJSON_AddNumberToObject(o, "in_flight", atomic_load(&b->in_flight));
        if (!up && b->down_reason[0]) cJSON_AddStringToObject(o, "reason", b->down_reason);
        cJSON_AddItemToArray(arr, o);
    }
    pthread_mutex_unlock(&r->mu);
    cJSON_AddStringToObject(body, "role", "router");
    cJSON_AddNumberToObject(body, "backends_up", (double)n_up);
    if (arr) cJSON_AddItemToObject(body, "backends", arr);
    if (!n_up) cJSON_ReplaceItemInObjectCaseSensitive(body, "status", cJSON_CreateString("no_backend_up"));
}

static kvb_status check_config(const kvb_router_config *c, kvb_err *err) {
    if (!c->http_listen || !c->http_listen[0]) return kvb_err_set(err, KVB_ERR_INVALID, "router: --http is required");
    if (c->n_backends < 1 || c->n_backends > KVB_ROUTER_MAX_BACKENDS || !c->backends)
        return kvb_err_set(err, KVB_ERR_INVALID, "router: give 1 to %d --backend HOST:PORT (got %zu)",
                           KVB_ROUTER_MAX_BACKENDS, c->n_backends);
    for (size_t i = 0; i < c->n_backends; i++) {
        const char *b = c->backends[i];
        const char *colon = b ? strrchr(b, ':') : NULL;
        if (!b || !colon || colon == b || !colon[1] || strlen(b) >= sizeof(((router_backend *)0)->name) ||
            strspn(colon + 1, "0123456789") != strlen(colon + 1) || strpbrk(b, " /?#@\t\r\n"))
            return kvb_err_set(err, KVB_ERR_INVALID, "router: backend '%s' is not HOST:PORT", b ? b : "(null)");
        for (size_t j = 0; j < i; j++)
            if (strcmp(b, c->backends[j]) == 0) return kvb_err_set(err, KVB_ERR_INVALID, "router: backend '%s' given twice", b);
    }
    const char *k = c->backend_api_key; /* goes into a header line: visible ASCII only, bounded */
    if (k && *k) {
        const size_t n = strlen(k);
        bool visible = n <= KVB_ROUTER_KEY_MAX;
        for (size_t i = 0; visible && i < n; i++) visible = k[i] > 0x20 && k[i] < 0x7f;
        if (!visible)
            return kvb_err_set(err, KVB_ERR_INVALID, "router: --backend-api-key must be 1 to %d visible ASCII characters",
                               KVB_ROUTER_KEY_MAX);
    }
    return KVB_OK;
}

/* The backends, the table, the shared connection pool and the metrics (the server's registry). */
static kvb_status router_init(kvb_router *r, const kvb_router_config *cfg, kvb_err *err) {
    r->cfg = *cfg;
    kvb_router_config *c = &r->cfg;
    if (!c->backend_max_inflight) c->backend_max_inflight = 8;
    if (!c->health_interval_ms) c->health_interval_ms = 1000;
    c->retries = c->retries == 0 ? 2 : c->retries < 0 ? 0 : c->retries;
    if (!c->connect_timeout_ms) c->connect_timeout_ms = 1000;
    if (!c->first_byte_timeout_ms) c->first_byte_timeout_ms = 60000;
    if (!c->history_entries) c->history_entries = 65536;
    if (!c->prefix_bytes) c->prefix_bytes = 1024;
    r->n_backends = cfg->n_backends;
    r->backends = calloc(r->n_backends, sizeof *r->backends);
    r->names = calloc(r->n_backends, sizeof *r->names);
    if (!r->backends || !r->names) return kvb_err_set(err, KVB_ERR_NOMEM, "router: out of memory");
    for (size_t i = 0; i < r->n_backends; i++) {
        router_backend *b = &r->backends[i];
        snprintf(b->name, sizeof b->name, "%s", cfg->backends[i]);
        snprintf(b->base_url, sizeof b->base_url, "http://%s", cfg->backends[i]);
        atomic_init(&b->up, true);
        atomic_init(&b->in_flight, 0);
        r->names[i] = b->name;
    }
    c->backends = r->names;
    kvb_status st = router_history_create(c->history_entries, &r->history, err);
    if (st) return st;
    pthread_once(&curl_once, curl_global);
    if (curl_global_rc != CURLE_OK) return kvb_err_set(err, KVB_ERR_INTERNAL, "router: libcurl did not initialise");
    if (!(r->share = curl_share_init())) return kvb_err_set(err, KVB_ERR_NOMEM, "router: out of memory (libcurl)");
    curl_share_setopt(r->share, CURLSHOPT_LOCKFUNC, share_lock);
    curl_share_setopt(r->share, CURLSHOPT_UNLOCKFUNC, share_unlock);
    curl_share_setopt(r->share, CURLSHOPT_USERDATA, r);
    curl_share_setopt(r->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT);
    curl_share_setopt(r->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    if ((st = kvb_metrics_create(&r->metrics, err))) return st;
    if ((st = router_metrics_register(r->metrics, &r->m, err))) return st;
    for (size_t i = 0; i < r->n_backends; i++) {
        kvb_metric_set(r->m.up, KVB_LABELS(r->names[i]), 1);
        kvb_metric_set(r->m.in_flight, KVB_LABELS(r->names[i]), 0);
    }
    return KVB_OK;
}

kvb_status kvb_router_start(const kvb_router_config *cfg, kvb_router **out, kvb_err *err) {
    *out = NULL;
    kvb_status st = check_config(cfg, err);
    if (st) return st;
    kvb_router *r = calloc(1, sizeof *r);
    if (!r) return kvb_err_set(err, KVB_ERR_NOMEM, "router: out of memory");
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->poll_mu, NULL);
    kvb_cond_init_monotonic(&r->poll_cv);
    for (size_t i = 0; i < KVB_ARRAY_LEN(r->share_mu); i++) pthread_mutex_init(&r->share_mu[i], NULL);
    if ((st = router_init(r, cfg, err)) || (st = router_poller_start(r, err))) goto fail;
    const kvb_http_config hc = {.listen = cfg->http_listen, .model_id = "kvbridge-router", .accept_any_model = true,
                                .metrics = r->metrics, .api_key = cfg->api_key, .allow_origins = cfg->allow_origins};
    const kvb_http_handlers hh = {.ctx = r, .relay = router_relay, .health = router_health};
    if ((st = kvb_http_server_start(&hc, &hh, &r->http, err))) goto fail;
    kvb_log(KVB_LOG_INFO, "router: %zu backend(s), at most %u in flight each, health every %u ms, %d retries",
            r->n_backends, r->cfg.backend_max_inflight, r->cfg.health_interval_ms, r->cfg.retries);
    *out = r;
    return KVB_OK;
fail:
    kvb_router_stop(r);
    return st;
}

uint16_t kvb_router_port(const kvb_router *r) { return r ? kvb_http_server_port(r->http) : 0; }

kvb_metrics *kvb_router_metrics(kvb_router *r) { return r ? r->metrics : NULL; }

void kvb_router_quiesce(kvb_router *r) {
    if (r) kvb_http_server_quiesce(r->http);
}

unsigned kvb_router_in_flight(kvb_router *r) { return r ? kvb_http_server_in_flight(r->http) : 0; }

void kvb_router_stop(kvb_router *r) {
    if (!r) return;
    kvb_http_server_stop(r->http); /* cuts replies in flight: their transfers abort */
    router_poller_stop(r);
    if (r->share) curl_share_cleanup(r->share);
    kvb_metrics_free(r->metrics);
    router_history_free(r->history);
    free(r->backends);
    free(r->names);
    for (size_t i = 0; i < KVB_ARRAY_LEN(r->share_mu); i++) pthread_mutex_destroy(&r->share_mu[i]);
    pthread_cond_destroy(&r->poll_cv);
    pthread_mutex_destroy(&r->poll_mu);
    pthread_mutex_destroy(&r->mu);
    free(r);
}
