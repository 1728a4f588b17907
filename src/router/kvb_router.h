/* router — `kvbridge serve --role router`: an OpenAI-compatible front in front of several decode
 * nodes, loading no model. It serves HTTP with the project's server (src/http: request reading,
 * validation limits, the guard, the API key), validates each completion request there (a bad one
 * is its 4xx and reaches no backend), and passes it byte for byte to one decode node over libcurl,
 * passing the reply back as it comes (an SSE stream event by event; X-KVBridge and the body's
 * usage untouched) with two headers of its own: X-KVBridge-Backend (HOST:PORT) and
 * X-KVBridge-Placement (history | new | moved).
 *
 * Placement keeps a conversation on the decode node that holds its prefix: its key is an XXH3 of
 * its first messages (the system message and the first user message for chat; the prompt's first
 * prefix_bytes for /v1/completions), and a bounded LRU table remembers the backend that served each
 * key last. A known key goes back there ("history") while it is up and has fewer than
 * backend_max_inflight requests in flight; a new key goes to the first healthy backend in
 * rendezvous order, weighted by load ("new"); a known key whose backend is down or full goes to the
 * next in that order ("moved"), as does a request retried elsewhere.
 *
 * Retries never send a request twice after its first byte reached the client: a connect failure, a
 * 503, a silent backend (no reply head within first_byte_timeout_ms) or any failure before a byte
 * of the reply was passed on sends the same request to the next backend (at most `retries` times);
 * a failure after that ends the client's reply (a stream with an SSE error event, OpenAI's shape).
 * Health: one thread polls every backend's /health each health_interval_ms (all at once, each
 * bounded by the interval); a connect failure, a timeout or a 5xx on a proxied request marks the
 * backend down at once, and only a 200 from /health brings it back. */
#ifndef KVB_ROUTER_H
#define KVB_ROUTER_H

#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_http.h"

#define KVB_ROUTER_MAX_BACKENDS 64
#define KVB_ROUTER_KEY_MAX 256 /* the longest --backend-api-key */

typedef struct {
    const char *http_listen;            /* "HOST:PORT" (port 0 = ephemeral) */
    const char *const *backends;        /* (n_backends) decode nodes, "HOST:PORT" each */
    size_t n_backends;                  /* 1 .. KVB_ROUTER_MAX_BACKENDS */
    const char *api_key;                /* NULL or "": open; else /v1/ needs it (as a decode node) */
    const char *allow_origins;          /* CORS, as kvb_http_config.allow_origins */
    const char *backend_api_key;        /* NULL or "": none; else every relayed request carries
                                           'Authorization: Bearer KEY' (decode nodes run --api-key) */
    uint32_t backend_max_inflight;      /* a backend with this many in flight is full (default 8) */
    uint32_t health_interval_ms;        /* /health polls (default 1000; each bounded by it) */
    int retries;                        /* other backends tried after a failure with no byte passed
                                           on (0: the default, 2; negative: none) */
    uint32_t connect_timeout_ms;        /* TCP connect to a backend (default 1000) */
    uint32_t first_byte_timeout_ms;     /* the reply's head must come this soon (default 60000: a
                                           non-streamed reply's head comes with its last token) */
    uint32_t history_entries;           /* LRU table of conversation keys (default 65536) */
    uint32_t prefix_bytes;              /* /v1/completions: key bytes of the prompt (default 1024) */
} kvb_router_config;

typedef struct kvb_router kvb_router;

kvb_status kvb_router_start(const kvb_router_config *cfg, kvb_router **out, kvb_err *err);
uint16_t kvb_router_port(const kvb_router *r);
kvb_metrics *kvb_router_metrics(kvb_router *r);
/* A graceful stop's first half: new requests get 503, those in flight go on (kvb_http_server_quiesce). */
void kvb_router_quiesce(kvb_router *r);
unsigned kvb_router_in_flight(kvb_router *r);
/* Stops polling and serving (replies in flight are cut), frees. NULL is a no-op. */
void kvb_router_stop(kvb_router *r);

/* ---- placement, exposed for tests and tools ------------------------------------------------- */

/* A conversation's key: XXH3 of its first system message (if it leads) and first user message
 * (chat), or of the prompt's first prefix_bytes (text) or ids (tokens; 4 bytes each). */
uint64_t kvb_router_conversation_key(const kvb_completion_req *req, uint32_t prefix_bytes);
/* Rendezvous order of n backends (their "HOST:PORT" names) for key, weighted by load (in_flight[i]
 * requests; NULL: all idle): order[0 .. n) gets the indices, best first. */
void kvb_router_rendezvous(uint64_t key, const char *const *names, const uint32_t *in_flight, size_t n,
                           uint32_t *order);

#endif
