/* node/prefill_ops.c — a prefill node's operations endpoint: its Prometheus metrics and, when it is
 * given an HTTP address (serve --role prefill --http ADDR), /health and /metrics on the HTTP
 * module's server, for probes and scrapers. The completion routes answer 404: a prefill node serves
 * decode nodes over its own link, and clients talk to a decode node. Draining shows on /health as
 * a 503 {"status": "draining"} (kvb_http_server_quiesce), so a balancer or orchestrator sees it. */
#include <string.h>

#include "node_internal.h"

static void refuse_completion(void *ctx, const kvb_completion_req *req, kvb_completion_out *out) {
    (void)ctx, (void)req;
    kvb_completion_fail(out, 404, "not_a_decode_node", NULL,
                        "this is a kvbridge prefill node: it computes prompts for decode nodes over its --listen "
                        "link; send completions to a decode node's --http address");
}

kvb_status kvb_prefill_ops_start(kvb_prefill_ops *o, const char *http_listen, const char *model_id,
                                 void (*health)(void *ctx, cJSON *body), void *ctx, kvb_err *err) {
    memset(o, 0, sizeof *o);
    kvb_status st = kvb_metrics_create(&o->metrics, err);
    if (st) return st;
    kvb_metrics *mx = o->metrics;
    if ((st = kvb_metrics_register(mx, KVB_METRIC_COUNTER, "kvbridge_prefill_requests_total",
                                   "PREFILL requests by outcome: served (DONE sent), refused (draining, an "
                                   "incomplete lane group, a request this node cannot serve), busy (the queue was "
                                   "full: refused with BUSY), failed (the link or the computation)",
                                   "outcome", NULL, 0, &o->m_requests, err)) ||
        (st = kvb_metrics_register(mx, KVB_METRIC_COUNTER, "kvbridge_prefill_tokens_total",
                                   "Prompt tokens by what this node did with them: computed (its engine ran them), "
                                   "shipped (their cache went to the decoder), cached (taken from its own prefix "
                                   "cache, not computed)",
                                   "kind", NULL, 0, &o->m_tokens, err)) ||
        (st = kvb_metrics_register(mx, KVB_METRIC_COUNTER, "kvbridge_prefill_slab_bytes_total",
                                   "Cache bytes sent as slabs (K and V, without frame headers)", NULL, NULL, 0,
                                   &o->m_bytes, err)) ||
        (st = kvb_metrics_register(mx, KVB_METRIC_HISTOGRAM, "kvbridge_prefill_request_seconds",
                                   "A served PREFILL from its arrival to its DONE, the wait for the engine included",
                                   NULL, NULL, 0, &o->m_seconds, err)) ||
        (st = kvb_metrics_register(mx, KVB_METRIC_GAUGE, "kvbridge_prefill_in_flight",
                                   "PREFILLs accepted and not yet answered (computing, or waiting for the engine)",
                                   NULL, NULL, 0, &o->m_in_flight, err)) ||
        (st = kvb_metrics_register(mx, KVB_METRIC_GAUGE, "kvbridge_prefill_connections",
                                   "Connections from decode nodes (each lane is one)", NULL, NULL, 0, &o->m_conns,
                                   err)) ||
        (st = kvb_metrics_register(mx, KVB_METRIC_GAUGE, "kvbridge_prefill_draining",
                                   "1 once the node drains (new PREFILLs are refused, those accepted finish)", NULL,
                                   NULL, 0, &o->m_draining, err))) {
        kvb_prefill_ops_stop(o);
        return st;
    }
    if (!http_listen) return KVB_OK;
    kvb_http_config hc = {.listen = http_listen, .model_id = model_id, .accept_any_model = true, .metrics = mx};
    kvb_http_handlers hh = {.ctx = ctx, .completion = refuse_completion, .health = health};
    if ((st = kvb_http_server_start(&hc, &hh, &o->http, err))) {
        kvb_prefill_ops_stop(o);
        return kvb_err_prefix(err, "the prefill node's --http endpoint: ");
    }
    return KVB_OK;
}

void kvb_prefill_ops_quiesce(kvb_prefill_ops *o) {
    kvb_metric_set(o->m_draining, NULL, 1);
    if (o->http) kvb_http_server_quiesce(o->http);
}

void kvb_prefill_ops_stop(kvb_prefill_ops *o) {
    kvb_http_server_stop(o->http); /* before the registry its routes read */
    kvb_metrics_free(o->metrics);
    memset(o, 0, sizeof *o);
}
