/* router_internal.h — what the router's files share: the backends and their health (backend.c),
 * the placement table (placement.c), the proxy path (proxy.c) and the metric families
 * (router_metrics.c), held by one kvb_router (router.c). */
#ifndef KVB_ROUTER_INTERNAL_H
#define KVB_ROUTER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "kvb_router.h"

/* ---- backends (backend.c) ------------------------------------------------------------------ */

typedef struct {
    char name[128];         /* "HOST:PORT", as given */
    char base_url[160];     /* "http://HOST:PORT" */
    atomic_bool up;         /* assumed up until a poll or a request says otherwise */
    atomic_uint in_flight;  /* proxied requests now */
    char down_reason[160];  /* guarded by the router's mu */
} router_backend;

/* ---- placement (placement.c) --------------------------------------------------------------- */

typedef enum { ROUTER_PLACE_HISTORY = 0, ROUTER_PLACE_NEW, ROUTER_PLACE_MOVED } router_place_kind;
extern const char *const router_place_names[3];

/* The LRU table of conversation keys -> the backend that served each last. */
typedef struct router_history router_history;
kvb_status router_history_create(uint32_t capacity, router_history **out, kvb_err *err);
void router_history_free(router_history *h);
/* The backend of key, or -1. Refreshes the key. Callers hold the router's mu. */
int router_history_get(router_history *h, uint64_t key);
/* Records (or updates) key -> backend; evicts the least recently used key when full. mu held. */
void router_history_put(router_history *h, uint64_t key, int backend);

/* ---- metrics (router_metrics.c) ------------------------------------------------------------ */

typedef struct {
    kvb_metric *requests;   /* requests sent to each backend (attempts), by backend */
    kvb_metric *placements; /* by result */
    kvb_metric *retries;    /* requests sent again elsewhere (no byte had been passed on) */
    kvb_metric *up;         /* gauge per backend */
    kvb_metric *in_flight;  /* gauge per backend */
    kvb_metric *failures;   /* upstream failures by backend and kind */
    kvb_metric *cut;        /* replies cut after bytes went out (never retried) */
} router_metrics;

kvb_status router_metrics_register(kvb_metrics *m, router_metrics *out, kvb_err *err);

/* ---- the router ---------------------------------------------------------------------------- */

struct kvb_router {
    kvb_router_config cfg;   /* defaults applied; backends point into `backends` */
    router_backend *backends;
    size_t n_backends;
    const char **names;      /* (n_backends) backends[i].name */
    pthread_mutex_t mu;      /* the history table, down reasons */
    router_history *history;
    kvb_metrics *metrics;
    router_metrics m;
    void *share;             /* CURLSH: connections and DNS shared by every upstream call */
    pthread_mutex_t share_mu[8];
    kvb_http_server *http;
    /* the health poller */
    pthread_t poller;
    bool poller_started;
    pthread_mutex_t poll_mu;
    pthread_cond_t poll_cv;
    bool stopping;           /* guarded by poll_mu */
};

/* Marks backend i up or down (with why), the gauge and a log line on a change. */
void router_backend_set_up(kvb_router *r, size_t i, bool up, const char *why);
kvb_status router_poller_start(kvb_router *r, kvb_err *err);
void router_poller_stop(kvb_router *r);

/* Picks a backend for key, leaving out those in tried[] (n_backends flags): the history backend
 * while it is up and not full, else the first usable one in rendezvous order. -1 when every
 * backend was tried. *place says how it was picked (a retry is "moved"). */
int router_pick(kvb_router *r, uint64_t key, const bool *tried, bool retry, router_place_kind *place);

/* The relay handler: one request, proxied with retries (proxy.c). */
void router_relay(void *ctx, const kvb_relay_req *rr, kvb_completion_out *out);

#endif
