/* http_internal.h — shared inside src/http only: a growable byte buffer, UTF-8 checks, the
 * OpenAI error helpers and the response/SSE formatting the server and the completion share. */
#ifndef KVB_HTTP_INTERNAL_H
#define KVB_HTTP_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_http.h"

/* ---- byte buffer: appends never fail loudly; `oom` records a failed growth ----------------- */

typedef struct {
    char *data; /* NUL-terminated when non-NULL */
    size_t len, cap;
    bool oom;
} http_buf;

void http_buf_append(http_buf *b, const void *bytes, size_t n);
void http_buf_append_str(http_buf *b, const char *s);
void http_buf_appendf(http_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void http_buf_consume(http_buf *b, size_t n); /* drops the first n bytes */
void http_buf_free(http_buf *b);

/* ---- UTF-8 ----------------------------------------------------------------------------- */

bool http_utf8_valid(const char *s, size_t n);
/* Appends s with each invalid sequence's maximal subpart replaced by one U+FFFD (as Python's
 * decode(errors='replace') does). */
void http_utf8_sanitize_append(http_buf *b, const char *s, size_t n);

/* ---- errors ------------------------------------------------------------------------------ */

#define http_error_set kvb_http_error_set /* the module's own name for the public one */
void http_error_vset(kvb_http_error *e, int status, const char *code, const char *param,
                     const char *fmt, va_list ap) __attribute__((format(printf, 5, 0)));
/* {"error": {...}} as malloc'd JSON text; NULL on allocation failure. */
char *http_error_json(const kvb_http_error *e);

/* ---- strict JSON (json_strict.c): 400s naming the field by its path ------------------------ */

/* Every string of the raw body (keys too), before cJSON decodes it: escapes are JSON's own, "\u"
 * has four hex digits, is not U+0000 and pairs its surrogates. Malformed JSON is left to cJSON. */
kvb_status http_json_strings_check(const char *body, size_t len, kvb_http_error *e);
/* No object of the tree has a key twice (a lookup would see only the first). */
kvb_status http_json_unique_keys(const cJSON *root, kvb_http_error *e);
/* Each member of obj is one of known[0 .. n_known), else a 400 "Unrecognized request argument
 * supplied: PREFIX.KEY" (code unknown_parameter, param PREFIX.KEY; prefix NULL or "": top level). */
kvb_status http_json_refuse_unknown(const cJSON *obj, const char *prefix, const char *const *known,
                                    size_t n_known, kvb_http_error *e);
/* That 400 for one member: returns KVB_ERR_INVALID. */
kvb_status http_error_unknown_field(kvb_http_error *e, const char *prefix, const char *key);

/* ---- response formatting ------------------------------------------------------------------ */

typedef struct {
    kvb_api api;
    char id[48];          /* "chatcmpl-..." / "cmpl-..." */
    int64_t created;      /* unix seconds */
    const char *model;    /* the served model id */
    bool include_usage;   /* streaming: "usage": null in each chunk, a usage chunk at the end */
    uint32_t index;       /* the choice being written (n > 1: one after another) */
} http_completion_meta;

/* A reply's logprobs, recorded token by token and taken as a choice's "logprobs" object: chat
 * {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
 * "refusal": null}; completions {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}]
 * (the top ones and the picked one: up to N+1), "text_offset" (characters before each token)}. */
typedef struct {
    kvb_api api;
    cJSON *content;                                            /* chat */
    cJSON *tokens, *token_logprobs, *top_logprobs, *text_offset; /* completions */
    size_t n;                                                  /* tokens recorded since the last take */
    int64_t chars;                                             /* completions: characters so far */
    bool oom;
} http_logprobs;

void http_logprobs_add(http_logprobs *lp, const kvb_token_logprob *token, const kvb_token_logprob *top,
                       size_t n_top);
/* The recorded tokens as a choice's "logprobs" object, emptying the record (a stream's next chunk
 * starts afresh; completions' text_offset continues). NULL when nothing was recorded and !even_empty,
 * or on allocation failure (lp->oom). */
cJSON *http_logprobs_take(http_logprobs *lp, bool even_empty);
void http_logprobs_free(http_logprobs *lp);

const char *http_finish_reason_name(kvb_finish_reason r);
/* Builds the usage object (with usage.kvbridge). */
cJSON *http_usage_json(const kvb_usage *u, const char *verdict);
/* One choice of a non-streaming body: {"index", "message" | "text", "logprobs" (taken over; NULL:
 * null), "finish_reason"}. NULL on allocation failure. */
cJSON *http_choice_json(kvb_api api, uint32_t index, const char *text, cJSON *logprobs, kvb_finish_reason reason);
/* Non-streaming body: chat.completion / text_completion with these choices (taken over) and the
 * usage. malloc'd; NULL on allocation failure. */
char *http_completion_json(const http_completion_meta *m, cJSON *choices, const kvb_usage *u, const char *verdict);
/* One streaming chunk as "data: {...}\n\n" appended to b. chat: first_chunk adds the assistant
 * role; logprobs (taken over; NULL: null) are the chunk's tokens'; finish (non-NULL) closes the
 * choice. usage_chunk != NULL writes the final usage-only chunk (choices []) instead. */
void http_sse_chunk(http_buf *b, const http_completion_meta *m, const char *delta, cJSON *logprobs,
                    bool first_chunk, const char *finish, const kvb_usage *usage_chunk, const char *verdict);
void http_sse_error(http_buf *b, const kvb_http_error *e);
#define HTTP_SSE_DONE "data: [DONE]\n\n"

/* ---- the chat page (web.c; its bytes are web/'s files, compiled in by web/embed.cmake) ------- */

typedef struct {
    const char *name;          /* the file's name under web/ ("index.html", "app.js") */
    const unsigned char *data; /* (len) the file's bytes, NUL-terminated */
    size_t len;
} http_web_asset;
extern const http_web_asset http_web_assets[]; /* sorted by name (generated) */
extern const size_t http_web_n_assets;

/* The asset a GET of url serves ("/" is index.html, "/NAME" a file of web/), or NULL. */
const http_web_asset *http_web_find(const char *url);
/* Its Content-Type by the name's extension (text types in UTF-8); application/octet-stream else. */
const char *http_web_content_type(const char *name);
/* The page's Content-Security-Policy: its own scripts, styles and API only; no inline script,
 * no other origin, no framing. */
#define HTTP_WEB_CSP                                                                                   \
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "  \
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

/* ---- server and one completion in flight (server.c, completion.c) -------------------------- */

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

struct MHD_Connection;

#define HTTP_API_KEY_DIGEST_LEN 32 /* SHA-256 */
#define HTTP_API_KEY_MIN 8

/* ---- request heads (head.c) ------------------------------------------------------------------ */

#define HTTP_HEAD_MAX 16384   /* request line and headers; a longer head is a 431 */
#define HTTP_TARGET_MAX 8192  /* a longer request target is a 414 */
#define HTTP_HEADERS_MAX 100  /* more header lines is a 431 */

typedef struct {
    bool http10, has_host, chunked;
    long long content_length;     /* -1: none */
    size_t method_len;            /* the method is buf[0 .. method_len) */
    size_t target_off, target_len; /* the target is buf[target_off .. + target_len) */
    size_t head_len;              /* bytes up to and with the empty line */
} http_head;

/* buf[0 .. n): what a client sent so far. 0: not a whole head yet (nothing wrong so far); 1: a
 * whole, well-formed head (h); -1: refused, e filled (a 4xx: 400, 413, 414 or 431). */
int http_head_check(const char *buf, size_t n, http_head *h, kvb_http_error *e);
/* The start of a chunked body, buf[0 .. n): each chunk size line that arrived is hex within the
 * body limit (in all), each chunk's data ends with CRLF. -1 with e filled (400 or 413); 1 when a
 * chunk size line was seen (the rest is for the HTTP library), 0 when none is there yet. */
int http_chunks_check(const char *buf, size_t n, size_t max_body, kvb_http_error *e);

/* ---- the guard in front of MHD (guard.c) ------------------------------------------------------ */

#define HTTP_HEADER_TIMEOUT_DEFAULT_S 10 /* a connection's request head must be whole this soon */
#define HTTP_BODY_TIMEOUT_DEFAULT_S 30   /* and its body this soon after the head */
#define HTTP_PER_CLIENT_DEFAULT(max_conn) ((max_conn) / 2 > 8 ? (max_conn) / 2 : 8)

typedef struct {
    unsigned max_active;     /* connections handed to MHD at once */
    unsigned max_per_client; /* per client address, waiting or handed */
    double header_timeout_s, body_timeout_s;
} http_guard_limits;

struct sockaddr_storage;
typedef struct http_guard http_guard;
/* A request whose body is being read: answered 408 and shut down past its deadline. */
typedef struct http_body_watch {
    int fd;
    double deadline;
    bool listed, killed;
    struct http_body_watch *prev, *next;
} http_body_watch;

/* Listens on addr and hands whole, well-formed request heads to s->daemon (started with
 * MHD_USE_NO_LISTEN_SOCKET) within the limits. */
kvb_status http_guard_start(kvb_http_server *s, const struct sockaddr_storage *addr, const http_guard_limits *limits,
                            http_guard **out, kvb_err *err);
uint16_t http_guard_port(const http_guard *g);
/* MHD closed a connection the guard handed it (its NOTIFY_CONNECTION). */
void http_guard_connection_closed(http_guard *g, int fd);
/* The connection on fd is kept alive between requests (idle), or has a request again: a full
 * house closes the one idle the longest to make room. */
void http_guard_connection_idle(http_guard *g, int fd, bool idle);
/* The body of the request on fd is being read / is whole. body_end returns false when the
 * deadline already answered it (the request must not be served). */
void http_guard_body_begin(http_guard *g, http_body_watch *w, int fd);
bool http_guard_body_end(http_guard *g, http_body_watch *w);
/* Stops accepting and closes the connections not handed over; free after MHD has stopped. */
void http_guard_stop_accepting(http_guard *g);
void http_guard_free(http_guard *g);

struct kvb_http_server {
    struct MHD_Daemon *daemon;
    kvb_http_handlers handlers;
    char *model_id;
    uint32_t max_model_len; /* 0: not reported */
    bool accept_any_model;
    size_t max_body_bytes;
    unsigned idle_timeout_s;
    uint16_t port;
    int64_t started_unix;
    double started_s; /* kvb_now_s() at start: the status snapshot's uptime */
    atomic_bool stopping;
    atomic_bool draining;               /* kvb_http_server_quiesce: new API requests get 503 */
    atomic_uint completions_in_flight;  /* completions begun and not yet answered */
    atomic_uint_fast64_t next_id;
    uint64_t id_salt;
    kvb_metrics *metrics;
    bool owns_metrics;
    char *allow_origins;                                /* NULL: no CORS; else "a,b,c" or "*" */
    bool has_api_key;                                   /* /v1/ routes need the bearer token */
    unsigned char api_key_digest[HTTP_API_KEY_DIGEST_LEN]; /* SHA-256 of the key, never the key */
    http_guard *guard;
    kvb_metric *m_refused, *m_framing, *m_deadlines; /* the guard's: 503s by reason, 4xx by status, 408s by phase */
    kvb_metric *m_connections;                       /* the guard's: open connections, waiting or serving */
    kvb_metric *m_evicted;                           /* the guard's: idle kept-alive connections closed for room */
    kvb_metric *m_requests, *m_duration, *m_in_flight, *m_ttft, *m_gap, *m_prompt_tokens,
        *m_generated_tokens, *m_disconnects, *m_verdicts;
};

#define HTTP_STREAM_BACKLOG_MAX ((size_t)1 << 20) /* emit waits while more is unsent */
#define HTTP_WAIT_SLICE_MS 50 /* how often waits look at the socket and the stop flag */

struct kvb_completion_out {
    kvb_http_server *server;
    const kvb_completion_req *req;
    http_completion_meta meta;
    int fd; /* the client's socket, polled for hang-up; -1 if unknown */
    bool streaming;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* guarded by mu */
    char verdict[KVB_VERDICT_MAX];      /* the header's */
    bool has_verdict;
    bool stream_started;                /* streaming: 200 + headers decided (first emit/finish) */
    bool ended;                         /* finish or fail called */
    bool failed;
    kvb_http_error error;
    kvb_finish_reason finish_reason;
    kvb_usage usage;
    char final_verdict[KVB_VERDICT_MAX]; /* the body's (usage.kvbridge.verdict) */
    char final_faults[3 * KVB_VERDICT_MAX]; /* usage.kvbridge.bridge_faults, copied: the handler's
                                               buffer is gone when a non-streamed body is made */
    char final_peer[KVB_VERDICT_MAX];       /* usage.kvbridge.peer, copied likewise */
    bool handler_returned;
    bool cancelled;                     /* client gone or server stopping */
    bool client_gone;
    http_buf text;                      /* non-streaming: the current choice's text */
    cJSON *done_choices;                /* non-streaming: the choices before the current one (n > 1) */
    http_logprobs logprobs;             /* with req->logprobs: recorded, not yet sent */
    http_buf pending;                   /* streaming: SSE bytes; [pending_off, len) not yet sent */
    size_t pending_off;
    bool emitted;                       /* a non-empty delta went out */
    double t_start, t_first_token;
    double t_last_emit; /* the last non-empty delta's time (the stream's gaps) */
    /* relaying (handlers.relay): the reply's status and headers ("name\0value\0" pairs) */
    const kvb_relay_req *relay;         /* non-NULL: this completion relays another server's reply */
    int relay_status;
    http_buf relay_headers;
    size_t relay_n_headers;
    /* worker thread (streaming) */
    bool thread_started;
    pthread_t thread;
};

kvb_completion_out *http_completion_new(kvb_http_server *s, const kvb_completion_req *req, int fd);
void http_completion_free(kvb_completion_out *out);
/* Runs the handler on this thread (non-streaming). */
void http_completion_run_inline(kvb_completion_out *out);
/* Streaming: starts the handler on a worker thread; false if the thread could not start. */
bool http_completion_start_worker(kvb_completion_out *out);
/* Streaming: waits until the response shape is known. Returns 1 when a 200 stream should be
 * queued, 0 when the completion ended before streaming (error response), -1 when the client went
 * away or the server is stopping (close the connection). */
int http_completion_wait_begun(kvb_completion_out *out);
/* The MHD content reader for a streaming response (cls = out). */
ssize_t http_completion_stream_read(void *cls, uint64_t pos, char *buf, size_t max);
/* Non-streaming: the current choice (its text, logprobs and reason) appended to out->done_choices,
 * its text emptied for the next. false on allocation failure. With mu held, or after the handler
 * returned. */
bool http_completion_close_choice(kvb_completion_out *out, kvb_finish_reason reason);
/* Marks the completion cancelled (connection closing) and joins the worker. */
void http_completion_abandon(kvb_completion_out *out);
bool http_peer_closed(int fd);

/* Text made safe for a header (the verdict) or a reply (the bridge's faults, which quote the
 * peer): printable ASCII only, each other byte '?', cut to cap-1 bytes (cap >= 1). */
void http_printable_copy(char *dst, size_t cap, const char *src);

#endif
