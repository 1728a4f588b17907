/* http — the decode node's front door: an OpenAI-compatible HTTP server (libmicrohttpd, one
 * thread per connection) with POST /v1/chat/completions and /v1/completions (JSON or SSE
 * streaming), GET /v1/models[/ID], /health and /metrics, the chat page at / (web/'s files, compiled
 * in) and its live snapshot GET /v1/kvbridge/status, plus the metrics registry /metrics
 * renders (counters, gauges, histograms with labels, Prometheus text format 0.0.4, thread-safe).
 * This module parses and validates request bytes (hostile: wrong types and out-of-range values
 * are 400s that name the param, in OpenAI's error shape) into a kvb_completion_req and formats
 * responses; it does not render chat templates, tokenize or decode — the handler (the decode
 * node) does. The handler's callbacks (completion once per request, health) are called
 * CONCURRENTLY from several connection threads: they must be thread-safe (completion may
 * serialize internally, e.g. queue requests on one engine; the server itself never queues). It
 * emits text deltas with kvb_completion_emit, names the bridge verdict with
 * kvb_completion_set_verdict BEFORE the first emit (the X-KVBridge header goes out with the first
 * byte of a stream), and ends with kvb_completion_finish (usage, incl. usage.kvbridge) or
 * kvb_completion_fail (an OpenAI-style error; a real 4xx/5xx status while nothing has been
 * emitted, an SSE error event after). A client that disconnects (or half-closes its socket) makes
 * emit return KVB_ERR_IO and kvb_completion_cancelled return true; a handler should stop decoding
 * then, and should poll kvb_completion_cancelled during long work that emits nothing (prefill),
 * because stopping the server waits for every handler to return. */
#ifndef KVB_HTTP_H
#define KVB_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>

#include "kvb_core.h"
#include "kvb_grammar.h"   /* kvb_json_schema: response_format json_schema, compiled at parse time */
#include "kvb_tokenizer.h" /* kvb_chat_msg: parsed messages go straight to kvb_chat_render */

/* ---- metrics registry -------------------------------------------------------------------- */

typedef struct kvb_metrics kvb_metrics;
typedef struct kvb_metric kvb_metric; /* one family: name, type, help, label names, its series */
typedef enum { KVB_METRIC_COUNTER = 0, KVB_METRIC_GAUGE, KVB_METRIC_HISTOGRAM } kvb_metric_type;

#define KVB_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define KVB_METRIC_MAX_LABELS 8
#define KVB_METRIC_MAX_SERIES 4096 /* per family; further label combinations are dropped */
/* Label values for one observation, in the order of the family's label names. */
#define KVB_LABELS(...) ((const char *const[]){__VA_ARGS__})

kvb_status kvb_metrics_create(kvb_metrics **out, kvb_err *err);
void kvb_metrics_free(kvb_metrics *m);
/* Registers a family, or returns the one already registered under `name` when type, label names
 * and buckets are the same (a mismatch is KVB_ERR_INVALID). name: [a-zA-Z_:][a-zA-Z0-9_:]*;
 * label_names: comma-separated ("route,code"), NULL or "" for none, each [a-zA-Z_][a-zA-Z0-9_]*,
 * not "__"-prefixed, not "le" for histograms. Histograms: `bounds` are the finite, strictly
 * increasing bucket upper bounds (+Inf is implicit); NULL picks latency buckets 1 ms .. 60 s.
 * Families live until kvb_metrics_free; the pointer is stable. */
kvb_status kvb_metrics_register(kvb_metrics *m, kvb_metric_type type, const char *name,
                                const char *help, const char *label_names, const double *bounds,
                                size_t n_bounds, kvb_metric **out, kvb_err *err);
/* Observations: label_values has one entry per label name (NULL when the family has none; a NULL
 * entry is ""). Counter: add(delta >= 0). Gauge: add (any sign) or set. Histogram: observe.
 * Misuse (wrong type, negative or NaN counter delta) is ignored. Any thread. */
void kvb_metric_add(kvb_metric *f, const char *const *label_values, double delta);
void kvb_metric_set(kvb_metric *f, const char *const *label_values, double value);
void kvb_metric_observe(kvb_metric *f, const char *const *label_values, double value);
/* Counter/gauge value, or a histogram's count; 0 when the series does not exist. */
double kvb_metric_value(kvb_metric *f, const char *const *label_values);
/* The whole registry as Prometheus text exposition format 0.0.4 (families in registration order,
 * series in creation order). *out is malloc'd and NUL-terminated; *len excludes the NUL. */
kvb_status kvb_metrics_render(kvb_metrics *m, char **out, size_t *len, kvb_err *err);

/* ---- errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} ------------ */

typedef struct {
    int status;         /* HTTP status: 400, 404, 405, 413, 415, 500, 503, ... */
    char type[32];      /* "invalid_request_error" (4xx) or "server_error" (5xx) */
    char code[64];      /* "" -> null; e.g. "context_length_exceeded", "model_not_found" */
    char param[96];     /* "" -> null; e.g. "messages[1].content", "max_tokens" */
    char message[512];
} kvb_http_error;

/* Fills e (type from the status: invalid_request_error below 500, server_error from 500; code and
 * param NULL for null). For handlers that answer with an error. */
void kvb_http_error_set(kvb_http_error *e, int status, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* ---- requests ---------------------------------------------------------------------------- */

typedef enum { KVB_API_CHAT_COMPLETIONS = 0, KVB_API_COMPLETIONS } kvb_api;
typedef enum { KVB_BRIDGE_AUTO = 0, KVB_BRIDGE_FORCE, KVB_BRIDGE_OFF } kvb_bridge_policy;
#define KVB_HTTP_MAX_STOP 4
#define KVB_HTTP_MAX_LOGIT_BIAS 1024
#define KVB_HTTP_MAX_TOP_LOGPROBS 20 /* vLLM's default max_logprobs; OpenAI's chat limit */
#define KVB_HTTP_MAX_N 16
#define KVB_HTTP_MAX_STOP_IDS 16

/* A validated request. Strings are NUL-terminated valid UTF-8 without NUL bytes and live as
 * long as the request. Fields the client left out (or sent as null) have the defaults noted. */
typedef struct {
    kvb_api api;
    const char *model;               /* required (optional, NULL when absent, for /tokenize and /detokenize) */
    /* chat: roles are "system" (also for "developer"), "user", "assistant"; text parts of the
     * array-of-parts form are joined with "\n"; an assistant message with null content is "". */
    const kvb_chat_msg *messages;
    size_t n_messages;               /* >= 1 for chat, 0 for completions */
    /* completions: exactly one of prompt (text, may be "") and prompt_tokens (>= 1 ids, each in
     * [0, INT32_MAX]; the handler checks them against the vocabulary) is set. */
    const char *prompt;
    const int32_t *prompt_tokens;
    size_t n_prompt_tokens;
    uint32_t n;                      /* choices, 1..KVB_HTTP_MAX_N (default 1); each samples the same
                                        prompt on its own (seed + index when a seed is given) */
    int64_t max_tokens;              /* -1: not given (OpenAI's legacy /v1/completions default is
                                        16; chat runs to the context end). max_completion_tokens
                                        wins over max_tokens. chat >= 1, completions >= 0 */
    double temperature;              /* [0, 2], default 1 */
    double top_p;                    /* [0, 1], default 1 */
    int32_t top_k;                   /* extension; >= 0, 0 (or -1 sent) = off; default 0 */
    const int32_t *logit_bias_ids;   /* logit_bias: (n_logit_bias) token ids (>= 0; the handler checks */
    const float *logit_bias_values;  /*   them against the vocabulary), each's bias in [-100, 100] */
    size_t n_logit_bias;
    bool ignore_eos;                 /* extension (vLLM's): an end-of-generation token does not end the
                                        reply, which runs to max_tokens or the context end (benchmarks) */
    bool logprobs;                   /* chat: "logprobs": true; completions: "logprobs": N (0..20) */
    bool json_object;                /* response_format {"type": "json_object"} or {"type":
                                        "json_schema"}: the reply is a JSON object (constrained
                                        decoding); {"type": "text"}: false */
    const kvb_json_schema *json_schema; /* response_format json_schema: the object is valid under this
                                        (compiled; lives with the request); NULL: any object */
    bool echo;                       /* completions: the reply's text starts with the prompt's; with
                                        logprobs, the prompt's tokens come first (the first one's
                                        logprob and top_logprobs null: nothing conditions it) */
    uint32_t top_logprobs;           /* chat: "top_logprobs" (0..20, > 0 only with logprobs); completions: N */
    double frequency_penalty;        /* [-2, 2], default 0 */
    double presence_penalty;         /* [-2, 2], default 0 */
    bool has_seed;
    int64_t seed;
    const char *stop[KVB_HTTP_MAX_STOP]; /* non-empty strings */
    size_t n_stop;
    int32_t stop_token_ids[KVB_HTTP_MAX_STOP_IDS]; /* extension (vLLM's): sampling one ends the reply, like
                                                     an end-of-generation token (ids >= 0; the handler
                                                     checks them against the vocabulary) */
    size_t n_stop_token_ids;
    int64_t min_tokens;              /* extension (vLLM's): no end-of-generation or stop token id before
                                        this many reply tokens; 0 (default) .. max_tokens */
    bool stream;
    bool include_usage;              /* stream_options.include_usage (only with stream) */
    kvb_bridge_policy bridge;          /* extension: {"kvbridge": {"bridge": "auto"|"force"|"off"}} */
    bool add_special_tokens;         /* a text prompt's BOS etc. as the tokenizer adds them: always
                                        true, except from /tokenize ("add_special_tokens": false) */
    void *internal_;                 /* owned storage; kvb_completion_req_free releases it */
} kvb_completion_req;

/* Parses and validates a request body (`len` bytes, need not be NUL-terminated). A field the route
 * does not take is a 400 naming it ("Unrecognized request argument supplied: temprature", code
 * unknown_parameter), as is a key sent twice; a few that OpenAI's and vLLM's clients send are
 * accepted and ignored (user, metadata, store, service_tier, parallel_tool_calls, prompt_cache_key,
 * safety_identifier: request_fields in request.c lists them all). Strings are taken exactly as
 * sent: an invalid escape, a lone UTF-16 surrogate or "\u0000" is a 400 naming the field. Known
 * fields this server cannot honour are 400s rather than silently ignored: n > 16,
 * echo with n > 1, suffix, best_of > 1, tools/functions, response_format other than "text" and "json_object",
 * "tool"/"function" roles, non-text content parts. On failure: KVB_ERR_INVALID (err->status 400)
 * or KVB_ERR_NOMEM (500), *out NULL. */
kvb_status kvb_completion_req_parse(kvb_api api, const char *body, size_t len,
                                    kvb_completion_req **out, kvb_http_error *err);
void kvb_completion_req_free(kvb_completion_req *req);
/* POST /tokenize (vLLM's): {"prompt": text | token ids} or {"messages": [...]} (as a completion
 * request takes them; "model" optional; "add_special_tokens" for a prompt only, default true;
 * "add_generation_prompt" true only) as a request whose prompt or messages are set (api CHAT for
 * messages). Free with kvb_completion_req_free. */
kvb_status kvb_tokenize_req_parse(const char *body, size_t len, kvb_completion_req **out, kvb_http_error *err);
/* POST /detokenize (vLLM's): {"tokens": [ids >= 0]} ("model" optional; [] allowed) as a request
 * whose prompt_tokens hold them (n_prompt_tokens may be 0). */
kvb_status kvb_detokenize_req_parse(const char *body, size_t len, kvb_completion_req **out, kvb_http_error *err);

/* ---- handler side of one completion ------------------------------------------------------ */

typedef struct kvb_completion_out kvb_completion_out;
typedef enum { KVB_FINISH_STOP = 0, KVB_FINISH_LENGTH } kvb_finish_reason;

#define KVB_VERDICT_MAX 128 /* longer verdicts are cut; control bytes become '?' */

typedef struct {
    int64_t prompt_tokens;
    int64_t completion_tokens;
    const char *verdict;   /* NULL: the one given to kvb_completion_set_verdict; else this is the
                              body's verdict (a stream's header already went out with the set one) */
    int64_t cached_tokens; /* prompt tokens found in the prefix cache */
    int64_t bridged_tokens;/* prompt tokens whose cache the prefill node shipped */
    int64_t native_tokens; /* prompt tokens the decoder computed itself */
    /* per-phase wall seconds: the prompt's tokens (chat template and tokenizer, or the ids taken
     * as given); the wait for the engine behind other requests (they run one at a time); prefix
     * lookup; the prefill node's prefill (its own clock, from its DONE); the bridge exchange on
     * this node (request to DONE, overlapping that prefill); this node's own prompt computation
     * (the tail after what arrived, or all of it when native); decoding */
    double tokenize_s, queue_s, lookup_s, prefill_s, transfer_s, native_s, decode_s;
    bool native_pipelined; /* the last prompt token ran layer by layer while the bridged blocks
                              arrived (native_s is then only what it ran on after the transfer) */
    int32_t bridge_attempts;   /* PREFILLs sent for this request: 0 when not bridged, > 1 when an
                                  attempt that stopped short was resumed */
    const char *bridge_faults; /* the attempts' faults, "; "-separated (NULL or "": none); finish copies it */
    const char *peer;          /* the prefill node(s) that bridged, "A" or "A then B" (NULL or "": none); copied */
    const char *placement;     /* how that node was chosen: "history", "new", "moved" (NULL or "": not bridged) */
} kvb_usage;

/* The verdict ("complete", "partial 3/8", "declined: peer down"): required before the first
 * emit (KVB_ERR_INVALID otherwise), may be re-set until then. */
kvb_status kvb_completion_set_verdict(kvb_completion_out *out, const char *verdict);
/* Appends a text delta (UTF-8; invalid bytes become U+FFFD; "" is a no-op). Streaming: sent as a
 * chunk at once (blocks while the client is more than 1 MiB behind). KVB_ERR_IO when the client
 * is gone or the server is stopping (stop decoding), KVB_ERR_INVALID after finish/fail or without
 * a verdict. */
kvb_status kvb_completion_emit(kvb_completion_out *out, const char *delta);
/* One token's log probability, for a request with logprobs. */
typedef struct {
    const char *bytes; /* the token's raw bytes; need not be valid UTF-8 (a token may hold part of a
                          character: "token" then shows U+FFFD, "bytes" the real ones) */
    size_t n_bytes;
    float logprob;     /* natural log; below -9999 (also -inf and NaN) is sent as -9999.0, OpenAI's floor */
    bool unconditioned; /* the prompt's first token, echoed: logprob and top_logprobs are null */
} kvb_token_logprob;
/* Records the next reply token's logprob and its n_top (<= the request's top_logprobs) most likely
 * alternatives, for a request with logprobs (KVB_ERR_INVALID otherwise, and after finish/fail).
 * Once per reply token, in order, before or after the emit that carries its text: a stream sends
 * what was recorded with its next chunk (at the latest with finish's), a body holds them all. */
kvb_status kvb_completion_add_logprobs(kvb_completion_out *out, const kvb_token_logprob *token,
                                       const kvb_token_logprob *top, size_t n_top);
/* n > 1: ends the current choice with reason and begins the next (its text, logprobs and finish
 * reason are its own; a stream sends the next choice's chunks with its index). KVB_ERR_INVALID
 * past the request's n or after finish/fail, KVB_ERR_IO when the client is gone. The last choice
 * ends with kvb_completion_finish. */
kvb_status kvb_completion_next_choice(kvb_completion_out *out, kvb_finish_reason reason);
/* Ends the completion. usage may be NULL (all zero) only if set_verdict was called. */
kvb_status kvb_completion_finish(kvb_completion_out *out, kvb_finish_reason reason,
                                 const kvb_usage *usage);
/* Ends the completion with an error: http_status 400..599, code/param NULL for null. Before the
 * first emit this is the response's status; after it, an SSE event {"error": {...}} closes the
 * stream (the openai client raises it). Returns KVB_OK, or KVB_ERR_INVALID after finish/fail. */
kvb_status kvb_completion_fail(kvb_completion_out *out, int http_status, const char *code,
                               const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* True once the client disconnected or the server is stopping. Cheap (one poll(2)). */
bool kvb_completion_cancelled(kvb_completion_out *out);

/* ---- relaying another server's reply (a router in front of decode nodes) ------------------- */

/* What a relay handler is given: the route, and for a POST the body exactly as the client sent it
 * (validated: it parsed as `req`) to pass on byte for byte. */
typedef struct {
    const char *path;              /* "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/ID" */
    const char *body;              /* (body_len) POST: the client's body; GET: NULL */
    size_t body_len;
    const kvb_completion_req *req; /* POST: the parsed request; GET: NULL */
    const char *request_id;        /* the client's X-Request-Id, or "" */
} kvb_relay_req;

#define KVB_RELAY_MAX_HEADERS 16
/* Begins the relayed reply: its status (100..599) and n_headers (name, value) pairs
 * (headers[2 i], headers[2 i + 1]; Content-Type among them; values made printable ASCII). Once,
 * before any write; KVB_ERR_INVALID otherwise or after fail. */
kvb_status kvb_completion_relay_begin(kvb_completion_out *out, int status, const char *const *headers,
                                      size_t n_headers);
/* Appends reply bytes, as they are (a request with "stream": true sends them at once; blocks while
 * the client is more than 1 MiB behind). KVB_ERR_IO when the client is gone or the server stops. */
kvb_status kvb_completion_relay_write(kvb_completion_out *out, const void *bytes, size_t n);
/* Ends the relayed reply (after begin). A failure after begin is kvb_completion_fail: on a stream
 * it adds an SSE error event and ends the stream. */
kvb_status kvb_completion_relay_end(kvb_completion_out *out);

/* ---- server ------------------------------------------------------------------------------ */

typedef struct {
    void *ctx;
    /* Required. Called once per validated completion request; must end the completion with
     * finish or fail before returning (returning without either is a 500). */
    void (*completion)(void *ctx, const kvb_completion_req *req, kvb_completion_out *out);
    /* Optional: adds fields (peer state, queue depth, ...) to /health's {"status": "ok"}. */
    void (*health)(void *ctx, cJSON *body);
    /* Optional (without them the routes are 404s): POST /tokenize, the ids (*ids malloc'd, may
     * be NULL when *n_ids is 0) exactly as a completion request with this prompt or these
     * messages computes them, and the model's context in *max_model_len; POST /detokenize, the
     * text of prompt_tokens (*text malloc'd, special tokens shown). Each returns 0, or an HTTP
     * status with err filled. Any thread, concurrently. */
    int (*tokenize)(void *ctx, const kvb_completion_req *req, int32_t **ids, size_t *n_ids, uint32_t *max_model_len,
                    kvb_http_error *err);
    int (*detokenize)(void *ctx, const kvb_completion_req *req, char **text, kvb_http_error *err);
    /* Optional: adds the node's live state to GET /v1/kvbridge/status (the chat page's panel polls
     * it): the server fills "object", "model", "status", "now_s", "uptime_s" and "in_flight", this
     * the rest (peer, bridges in flight, link bytes, cache use). Any thread, concurrently; quick. */
    void (*status)(void *ctx, cJSON *body);
    /* Optional: a relay (the router). When set, the completion routes (after validation) and GET
     * /v1/models[/ID] call it instead, on a thread of their own; it answers with relay_begin,
     * relay_write and relay_end (or kvb_completion_fail before begin: the server's own error).
     * `completion` may then be NULL. A health handler that sets "status" to anything but "ok"
     * makes /health a 503. */
    void (*relay)(void *ctx, const kvb_relay_req *rr, kvb_completion_out *out);
} kvb_http_handlers;

typedef struct {
    const char *listen;        /* "HOST:PORT" or "[IPv6]:PORT"; HOST may be a name; port 0 =
                                  ephemeral (see kvb_http_server_port) */
    const char *model_id;      /* the served model: /v1/models, "model" in responses */
    uint32_t max_model_len;    /* its context in tokens, in /v1/models (vLLM's field); 0: left out */
    bool accept_any_model;     /* false: a request naming another model is 404 model_not_found */
    size_t max_body_bytes;     /* 0 = 32 MiB; larger bodies are 413 */
    unsigned max_connections;  /* requests served at once; 0 = 256 (each holds a thread). Past it a
                                  new one is a 503 with Retry-After */
    unsigned max_connections_per_client; /* connections one client address may hold (sending its
                                  request or served); 0 = max_connections / 2, at least 8. Past it
                                  a 503. Connections still sending their request head hold no
                                  thread; a malformed request line, header or chunk size is a 4xx
                                  at once */
    unsigned header_timeout_s; /* a connection's request head must be whole this soon (else 408); 0 = 10 */
    unsigned body_timeout_s;   /* a request's body must be whole this soon after its head (else 408);
                                  0 = 30 */
    unsigned idle_timeout_s;   /* keep-alive idle limit; 0 = 120 (never cuts a slow handler) */
    kvb_metrics *metrics;      /* NULL: the server creates (and frees) its own */
    const char *api_key;       /* NULL or "": none; else every /v1/ route requires "Authorization:
                                  Bearer KEY" (else 401 invalid_api_key; /v1/kvbridge/status too);
                                  /health, /metrics and the page's files stay open. >= 8 bytes of printable ASCII without spaces; the server
                                  keeps only its SHA-256 and compares in constant time */
    const char *allow_origins; /* NULL or "": no CORS; else the browser origins ("https://ui.example",
                                  comma-separated, or "*" for any) whose pages may call the API:
                                  their requests' responses carry Access-Control-Allow-Origin (and
                                  expose X-KVBridge), and OPTIONS preflights get a 204 */
} kvb_http_config;

typedef struct kvb_http_server kvb_http_server;

kvb_status kvb_http_server_start(const kvb_http_config *cfg, const kvb_http_handlers *h,
                                 kvb_http_server **out, kvb_err *err);
uint16_t kvb_http_server_port(const kvb_http_server *s); /* the bound port */
kvb_metrics *kvb_http_server_metrics(kvb_http_server *s);
/* Begins a graceful stop: every new API request is a 503 (server_shutting_down, Connection:
 * close); /health answers 503 {"status": "draining"}, so a balancer stops sending; the
 * completions in flight go on. Then wait for kvb_http_server_in_flight to reach 0 (or give up)
 * and stop. Idempotent. */
void kvb_http_server_quiesce(kvb_http_server *s);
/* Completions begun and not yet answered. */
unsigned kvb_http_server_in_flight(kvb_http_server *s);
/* Stops accepting, cancels every in-flight completion (emit fails), waits for the connection
 * threads and the handlers to return, frees. NULL is a no-op. */
void kvb_http_server_stop(kvb_http_server *s);

#endif
