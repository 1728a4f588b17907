/* router_metrics.c — the router's metric families, in the project's registry (src/http/metrics.c)
 * beside the HTTP server's own: requests sent to each backend, placement decisions, retries,
 * each backend's health and load, upstream failures by kind (connect: refused or unreachable;
 * timeout: no reply head in time; status_5xx: the backend answered 5xx; io: the connection broke)
 * and replies cut after bytes had gone out. */
#include "router_internal.h"

kvb_status router_metrics_register(kvb_metrics *m, router_metrics *out, kvb_err *err) {
    struct {
        kvb_metric **slot;
        kvb_metric_type type;
        const char *name, *help, *labels;
    } defs[] = {
        {&out->requests, KVB_METRIC_COUNTER, "kvbridge_router_backend_requests_total",
         "Requests sent to each backend, retries included.", "backend"},
        {&out->placements, KVB_METRIC_COUNTER, "kvbridge_router_placements_total",
         "Requests answered, by how their backend was picked: history (where the conversation was served "
         "last), new (a new conversation, by rendezvous hashing weighted by load), moved (its backend was "
         "down, full, or failed before a byte was passed on).", "result"},
        {&out->retries, KVB_METRIC_COUNTER, "kvbridge_router_retries_total",
         "Requests sent again to another backend because the first got no byte passed on to the client.", NULL},
        {&out->up, KVB_METRIC_GAUGE, "kvbridge_router_backend_up", "1 while the backend is up, 0 while down.",
         "backend"},
        {&out->in_flight, KVB_METRIC_GAUGE, "kvbridge_router_backend_in_flight",
         "Requests in flight on each backend.", "backend"},
        {&out->failures, KVB_METRIC_COUNTER, "kvbridge_router_upstream_failures_total",
         "Failed upstream requests by backend and kind: connect, timeout (no reply head in time), status_5xx, "
         "io (the connection broke).", "backend,kind"},
        {&out->cut, KVB_METRIC_COUNTER, "kvbridge_router_replies_cut_total",
         "Replies ended with an error after bytes had been passed on (never retried).", NULL},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(defs); i++) {
        kvb_status st = kvb_metrics_register(m, defs[i].type, defs[i].name, defs[i].help, defs[i].labels, NULL, 0,
                                             defs[i].slot, err);
        if (st) return st;
    }
    return KVB_OK;
}
