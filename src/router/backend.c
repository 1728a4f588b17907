/* backend.c — the backends' health: one thread polls every backend's GET /health each
 * health_interval_ms, all at once on one libcurl multi handle, each poll bounded by the interval
 * (a silent backend cannot hold the others' polls back); a 200 marks a backend up, anything else
 * (refused, timed out, 503 draining, 5xx) down with the reason. The proxy path marks a backend down
 * at once on a connect failure, a timeout or a 5xx; only a poll's 200 brings it back. */
#include <curl/curl.h>
#include <stdio.h>
#include <string.h>

#include "router_internal.h"

void router_backend_set_up(kvb_router *r, size_t i, bool up, const char *why) {
    router_backend *b = &r->backends[i];
    const bool was = atomic_exchange(&b->up, up);
    kvb_metric_set(r->m.up, KVB_LABELS(b->name), up ? 1 : 0);
    pthread_mutex_lock(&r->mu);
    snprintf(b->down_reason, sizeof b->down_reason, "%s", up ? "" : (why ? why : "down"));
    pthread_mutex_unlock(&r->mu);
    if (was != up)
        kvb_log(up ? KVB_LOG_INFO : KVB_LOG_WARN, "router: backend %s is %s%s%s", b->name, up ? "up" : "down",
                up ? "" : ": ", up ? "" : (why ? why : ""));
}

static size_t discard_body(char *p, size_t size, size_t n, void *ud) {
    (void)p;
    (void)ud;
    return size * n;
}

static bool poller_stopping(kvb_router *r) {
    pthread_mutex_lock(&r->poll_mu);
    const bool s = r->stopping;
    pthread_mutex_unlock(&r->poll_mu);
    return s;
}

/* One round: every backend's /health at once; each answer (or its failure) marks it. */
static void poll_round(kvb_router *r, CURLM *multi, CURL **easy, long timeout_ms) {
    for (size_t i = 0; i < r->n_backends; i++) {
        char url[192];
        snprintf(url, sizeof url, "%s/health", r->backends[i].base_url);
        curl_easy_setopt(easy[i], CURLOPT_URL, url);
        curl_easy_setopt(easy[i], CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(easy[i], CURLOPT_TIMEOUT_MS, timeout_ms);
        curl_easy_setopt(easy[i], CURLOPT_CONNECTTIMEOUT_MS,
                         (long)r->cfg.connect_timeout_ms < timeout_ms ? (long)r->cfg.connect_timeout_ms : timeout_ms);
        curl_easy_setopt(easy[i], CURLOPT_WRITEFUNCTION, discard_body);
        curl_easy_setopt(easy[i], CURLOPT_PRIVATE, (void *)(uintptr_t)i);
        curl_multi_add_handle(multi, easy[i]);
    }
    int running = 1;
    while (running > 0 && !poller_stopping(r)) {
        if (curl_multi_perform(multi, &running) != CURLM_OK) break;
        if (running > 0) curl_multi_poll(multi, NULL, 0, 100, NULL);
    }
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(multi, &left))) {
        if (msg->msg != CURLMSG_DONE) continue;
        void *priv = NULL;
        long code = 0;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, &priv);
        curl_easy_getinfo(msg->easy_handle, CURLINFO_RESPONSE_CODE, &code);
        const size_t i = (size_t)(uintptr_t)priv;
        char why[160];
        if (msg->data.result != CURLE_OK) snprintf(why, sizeof why, "/health: %s", curl_easy_strerror(msg->data.result));
        else snprintf(why, sizeof why, "/health answered %ld", code);
        router_backend_set_up(r, i, msg->data.result == CURLE_OK && code == 200, why);
    }
    for (size_t i = 0; i < r->n_backends; i++) curl_multi_remove_handle(multi, easy[i]);
}

static void *poller_main(void *arg) {
    kvb_router *r = arg;
    CURLM *multi = curl_multi_init();
    CURL *easy[KVB_ROUTER_MAX_BACKENDS] = {0};
    bool ok = multi != NULL;
    for (size_t i = 0; ok && i < r->n_backends; i++) ok = (easy[i] = curl_easy_init()) != NULL;
    if (!ok) kvb_log(KVB_LOG_ERROR, "router: cannot start libcurl handles for health polls; backends stay as they are");
    const long interval_ms = r->cfg.health_interval_ms;
    const long timeout_ms = interval_ms < 100 ? 100 : interval_ms;
    while (ok && !poller_stopping(r)) {
        const double next = kvb_now_s() + interval_ms * 1e-3;
        poll_round(r, multi, easy, timeout_ms);
        pthread_mutex_lock(&r->poll_mu);
        while (!r->stopping && kvb_now_s() < next) kvb_cond_wait_until(&r->poll_cv, &r->poll_mu, next);
        pthread_mutex_unlock(&r->poll_mu);
    }
    for (size_t i = 0; i < r->n_backends; i++)
        if (easy[i]) curl_easy_cleanup(easy[i]);
    if (multi) curl_multi_cleanup(multi);
    return NULL;
}

kvb_status router_poller_start(kvb_router *r, kvb_err *err) {
    if (pthread_create(&r->poller, NULL, poller_main, r) != 0)
        return kvb_err_set(err, KVB_ERR_IO, "router: cannot start the health thread");
    r->poller_started = true;
    return KVB_OK;
}

void router_poller_stop(kvb_router *r) {
    if (!r->poller_started) return;
    pthread_mutex_lock(&r->poll_mu);
    r->stopping = true;
    pthread_cond_broadcast(&r->poll_cv);
    pthread_mutex_unlock(&r->poll_mu);
    pthread_join(r->poller, NULL);
    r->poller_started = false;
}
