/* node/node_internal.h — private to the node module: the prefill node's operations endpoint, the
 * batched decode steps and a reply's optional parts (decode side). The bridge's own machinery (the
 * staging ring, the receiving threads, the pipelined tail) is in src/bridge. */
#ifndef KVB_NODE_INTERNAL_H
#define KVB_NODE_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "kvb_bridge.h"
#include "kvb_engine_cpu.h"
#include "kvb_grammar.h"
#include "kvb_http.h"
#include "kvb_node.h"
#include "kvb_store.h"
#include "kvb_transport.h"

/* The decode node's decode steps, batched across requests, and who computes on its engine
 * (decode_batch.c). A step: append `token` to the request's sequence `s`, then sample the next
 * token from its logits with `smp` (the request's own sampler). */
typedef struct kvb_decode_step {
    kvb_seq *s;
    int32_t token;
    kvb_sampler *smp;
    int32_t next; /* out: the sampled token, when st is KVB_OK */
    kvb_status st;
    kvb_err err;
    bool done;                    /* the batcher's */
    struct kvb_decode_step *link; /* the batcher's */
} kvb_decode_step;
typedef struct kvb_decode_batch kvb_decode_batch;
/* At most cap steps per batch. m_batches, m_steps: counters of batches run and steps in them;
 * m_in_prompts: of steps run within a prompt phase (kvb_decode_batch_run_pending, or while it lent
 * the engine); each may be NULL. */
kvb_status kvb_decode_batch_create(kvb_engine *e, uint32_t cap, uint32_t n_vocab, kvb_metric *m_batches,
                                   kvb_metric *m_steps, kvb_metric *m_in_prompts, kvb_decode_batch **out,
                                   kvb_err *err);
/* A request starts / ends decoding: between the two it hands in a step whenever it has emitted
 * its last token, and a batch's leader waits (briefly) for the steps of all of them. */
void kvb_decode_batch_join(kvb_decode_batch *b);
void kvb_decode_batch_leave(kvb_decode_batch *b);
/* Whether any request is decoding (between join and leave). */
bool kvb_decode_batch_decoding(kvb_decode_batch *b);
/* Runs one step in a batch with whatever other requests handed in meanwhile (up to cap), once the
 * engine is free, or within a prompt phase; returns step->st (step->err says why). */
kvb_status kvb_decode_batch_step(kvb_decode_batch *b, kvb_decode_step *step);
/* A prompt phase computes on the engine between these two (nobody else does meanwhile); begin
 * first runs the steps handed in so far. */
void kvb_decode_batch_exec_begin(kvb_decode_batch *b);
void kvb_decode_batch_exec_end(kvb_decode_batch *b);
/* Within a prompt phase that computes nothing for a while (a bridged transfer without the
 * pipelined tail): the batches run on the engine meanwhile, their steps counted as run within a
 * prompt phase; reclaim waits for the batch in flight and runs the steps waiting then. */
void kvb_decode_batch_exec_lend(kvb_decode_batch *b);
void kvb_decode_batch_exec_reclaim(kvb_decode_batch *b);
/* Within a prompt phase (between two slices of the prompt, or at the pipelined tail's gates while
 * a bridged prompt's layers arrive), on the thread computing for it: runs the steps handed in so
 * far as one batch, if any, after waiting (briefly, as a batch's leader does) for every decoding
 * request's step, and wakes their requests. Returns how many steps ran. */
uint32_t kvb_decode_batch_run_pending(kvb_decode_batch *b);
/* Within a prompt phase: n tokens of the prompt's sequence s (logits: NULL, or (n_vocab) for the
 * last one) computed in one forward with the steps handed in so far (as many as fit the engine's
 * chunk beside them; after waiting briefly for every decoding request's, as run_pending does),
 * the weights read once for both; the steps' requests are woken. Each is the same bits as apart.
 * Returns the prompt's status; a step's own error goes to that step. */
kvb_status kvb_decode_batch_forward_slice(kvb_decode_batch *b, kvb_seq *s, const int32_t *toks, uint32_t n,
                                          float *logits, kvb_err *err);
/* fn(ctx) is called each time a step is handed in, under the batcher's lock (it may only signal:
 * take no lock that is held while calling into the batcher); NULL clears it, and once this returns
 * fn is not running. One at a time: the prompt phase's pipelined tail sets it while it waits. */
void kvb_decode_batch_on_step(kvb_decode_batch *b, void (*fn)(void *ctx), void *ctx);
/* After every step has returned. NULL is a no-op. */
void kvb_decode_batch_free(kvb_decode_batch *b);

/* A prefill node's operations endpoint (prefill_ops.c): its metrics registry and families and,
 * with an HTTP address, /health and /metrics (completion routes 404: clients talk to decode nodes). */
typedef struct {
    kvb_metrics *metrics;
    kvb_http_server *http; /* NULL without an address */
    kvb_metric *m_requests, *m_tokens, *m_bytes, *m_seconds, *m_in_flight, *m_conns, *m_draining;
} kvb_prefill_ops;
kvb_status kvb_prefill_ops_start(kvb_prefill_ops *o, const char *http_listen, const char *model_id,
                                 void (*health)(void *ctx, cJSON *body), void *ctx, kvb_err *err);
/* Draining: the gauge set, /health a 503 "draining" (the node still serves what it accepted). */
void kvb_prefill_ops_quiesce(kvb_prefill_ops *o);
void kvb_prefill_ops_stop(kvb_prefill_ops *o);

/* ---- a prefill node's admission (prefill_admission.c) ------------------------------------------ */

/* Who computes on the engine next: a bounded queue served round robin between decode nodes (FIFO
 * within one). A decode node is "NAME@HOST": its HELLO name and the host it connects from. */
typedef struct kvb_admission kvb_admission;
typedef struct kvb_admission_waiter kvb_admission_waiter;
#define KVB_ADMISSION_WHO_MAX 136
typedef enum {
    KVB_ADMITTED = 0,           /* the caller holds the engine until kvb_admission_leave */
    KVB_ADMISSION_BUSY_QUEUE,   /* max_queue requests were waiting: refuse with BUSY */
    KVB_ADMISSION_BUSY_DECODER, /* max_per_decoder of this decode node's were waiting: refuse with BUSY */
    KVB_ADMISSION_STOPPING,     /* the node stops */
} kvb_admission_verdict;
/* Registers its families (kvbridge_prefill_decoder_requests_total, _queue, _queue_wait_seconds) in mx. */
kvb_status kvb_admission_create(uint32_t max_queue, uint32_t max_per_decoder, kvb_metrics *mx, kvb_admission **out,
                                kvb_err *err);
void kvb_admission_free(kvb_admission *a); /* NULL is a no-op; nobody may be inside */
/* who (cap >= KVB_ADMISSION_WHO_MAX): "NAME@HOST" from a HELLO's name and "HOST:PORT". */
void kvb_admission_who(const char *name, const char *peer_addr, char *who, size_t cap);
/* Takes the engine, at once or after waiting its turn; otherwise why says which bound and the
 * queue's length (a BUSY refusal, counted) or that the node stops. */
kvb_admission_verdict kvb_admission_enter(kvb_admission *a, const char *who, char *why, size_t cap);
void kvb_admission_leave(kvb_admission *a); /* the engine to the next by round robin */
/* A request's outcome in kvbridge_prefill_decoder_requests_total (served, failed, refused). */
void kvb_admission_count(kvb_admission *a, const char *who, const char *outcome);
uint32_t kvb_admission_waiting(kvb_admission *a);
void kvb_admission_stop(kvb_admission *a); /* waiters leave refused, and so do later requests */
/* The decode nodes given the engine, oldest first (the last 128), space-separated; its length. */
size_t kvb_admission_served(kvb_admission *a, char *buf, size_t cap);

/* ---- a decode node's prefill peers (decode_peers.c) ------------------------------------------- */

typedef struct kvb_peer_set kvb_peer_set;
typedef struct {
    const char *const *peers;  /* (n_peers) "HOST:PORT" or "NAME=HOST:PORT" (the name in verdicts and metrics) */
    uint32_t n_peers;
    const kvb_hello *hello;    /* this node's HELLO, and the transport (key, backend): copied by each link */
    const kvb_transport_config *tcfg; /* kept: its backend names the transport in metrics */
    uint32_t lanes;
    int connect_timeout_ms;
    int heartbeat_ms;          /* kvb_peer_link_config.heartbeat_ms */
    uint32_t max_queue;        /* a history peer whose queue is above this is passed over */
    kvb_metrics *metrics;      /* the node's registry: the peers' families go in it */
} kvb_peer_set_config;

typedef enum { KVB_PLACED_HISTORY = 0, KVB_PLACED_NEW, KVB_PLACED_MOVED } kvb_placement_result;
extern const char *const kvb_placement_names[]; /* "history", "new", "moved" */
typedef struct {
    int peer;                   /* the chosen peer */
    int history;                /* the peer that produced the longest prefix of the prompt, or -1 */
    uint32_t history_blocks;    /* that prefix's blocks */
    kvb_placement_result result;
    char why[112];              /* "history", "new", "history on A, A down", ... */
} kvb_placement;

/* Starts every peer's link (each dials at once) and registers the peers' metric families. */
kvb_status kvb_peer_set_start(const kvb_peer_set_config *cfg, kvb_peer_set **out, kvb_err *err);
/* Waits up to timeout_ms for each link's first attempt to end (up or down). */
void kvb_peer_set_wait_first(kvb_peer_set *s, int timeout_ms);
void kvb_peer_set_stop(kvb_peer_set *s); /* NULL is fine */
uint32_t kvb_peer_set_count(const kvb_peer_set *s);
const char *kvb_peer_set_name(const kvb_peer_set *s, int peer); /* "" for -1 */
const char *kvb_peer_set_addr(const kvb_peer_set *s, int peer); /* "HOST:PORT"; "" for -1 */
/* Places a request whose prompt's whole blocks have chain keys keys[0 .. n_keys): the peer that
 * produced its longest prefix unless it is not up or its queue is above max_queue, else the
 * least-loaded peer that is up; the chosen peer's lanes are lent (release or drop them). Never
 * waits for a connect. KVB_ERR_PEER_GONE when none is up, with every peer's reason in err (one
 * peer: its link's own words, as kvb_peer_link_lanes gives them). */
kvb_status kvb_peer_set_place(kvb_peer_set *s, const uint64_t *keys, uint32_t n_keys, kvb_placement *pl,
                              kvb_conn *const **lanes, uint32_t *n_lanes, kvb_err *err);
/* After a fault on not_peer's lanes: the least-loaded other peer that is up, its lanes lent; -1: none. */
int kvb_peer_set_other(kvb_peer_set *s, int not_peer, kvb_conn *const **lanes, uint32_t *n_lanes);
/* The same peer's lanes again after a fault (waits up to timeout_ms while it redials). */
kvb_status kvb_peer_set_lanes_again(kvb_peer_set *s, int peer, int timeout_ms, kvb_conn *const **lanes,
                                    uint32_t *n_lanes, kvb_err *err);
void kvb_peer_set_release(kvb_peer_set *s, int peer); /* the lanes go back (they stay up); -1: no-op */
void kvb_peer_set_drop(kvb_peer_set *s, int peer);    /* the lanes are closed and dialled again */
/* peer produced the prompt prefix whose last block has this chain key (a bridged request's). */
void kvb_peer_set_record(kvb_peer_set *s, uint64_t key, int peer);
void kvb_peer_set_count_bytes(kvb_peer_set *s, int peer, uint64_t bytes);
void kvb_peer_set_count_request(kvb_peer_set *s, int peer, const char *verdict_kind);
/* One peer: its link's state and why; several: up when any is, else the first's. */
kvb_peer_state kvb_peer_set_summary(kvb_peer_set *s, char *why, size_t cap);
/* [{"name", "addr", "state", "reason", "in_flight", "waiting", "placed"}], one per peer. */
cJSON *kvb_peer_set_json(kvb_peer_set *s);

/* The verdict (verdict: KVB_VERDICT_MAX bytes) from fmt: a text that does not fit is cut at the
 * last word that leaves room for "...", never inside a word (verdict.c). */
void kvb_verdict_format(char *verdict, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- a reply's optional parts (reply_fields.c) ------------------------------------------------- */

/* A reply token's logprobs (the sampler's `last`) to the client, the tokens' bytes from the
 * vocabulary; unconditioned: an echoed prompt's first token (null logprob). scratch holds
 * (1 + KVB_MAX_TOP_LOGPROBS) tokens of kvb_tokenizer_max_token_len bytes. */
kvb_status kvb_reply_send_logprobs(const kvb_tokenizer *tok, kvb_completion_out *out, const kvb_pick_logprobs *lp,
                                   bool unconditioned, char *scratch);
/* echo with logprobs: the whole prompt toks[0 .. n_toks) through the engine (a prompt phase holds
 * it) with every row's logits; each prompt token's logprob and top `top` under the rows before it
 * to the client (the first one's null), the last row's logits (n_vocab) into `logits`. 64 rows at
 * a time, their log_softmax on the engine's pool; the batch's waiting steps run between slices.
 * KVB_ERR_IO when the client went away. */
kvb_status kvb_reply_prompt_logprobs(kvb_engine *e, kvb_decode_batch *batch, const kvb_tokenizer *tok, uint32_t n_vocab,
                                     kvb_seq *s, const int32_t *toks, uint32_t n_toks, uint32_t top, float *logits,
                                     kvb_completion_out *out, char *scratch, kvb_err *err);
/* The prompt's text at the head of an echo reply: as given, or its ids decoded. */
kvb_status kvb_reply_emit_echo(const kvb_tokenizer *tok, const kvb_completion_req *req, const int32_t *toks, size_t n_tok,
                               kvb_completion_out *out);

/* The rules a reply's tokens are drawn under, as the sampler's constraint (kvb_reply_constrain,
 * ctx: a kvb_reply_rules): before min_tokens reply tokens, no end-of-generation token and no stop
 * token id (vLLM's min_tokens); with response_format's JSON mode, only tokens that keep the reply
 * a JSON prefix, valid under the request's JSON schema when it has one (its masker over the node's
 * vocabulary bytes, on the engine's pool: idle whenever a sampler runs, it is the sampler's too).
 * `generated` is the reply's tokens so far, set by the request's thread before each step. */
typedef struct {
    kvb_json_state s;           /* the reply so far (kvb_json_init_schema with the request's schema) */
    kvb_json_masker *masker;    /* NULL: no JSON mode */
    int64_t min_tokens, generated;
    const int32_t *eog_ids;     /* (n_eog) the vocabulary's end-of-generation tokens */
    size_t n_eog;
    const int32_t *stop_ids;    /* (n_stop) the request's stop token ids */
    size_t n_stop;
} kvb_reply_rules;
void kvb_reply_constrain(void *ctx, float *logits);

/* llama-server's streamed /completion (door_stream.c): json_body must ask for "stream" and
 * "return_progress". on_start(ctx, total, cached) runs once, before the first delta: the prompt's
 * tokens and how many llama-server took from its cache (-1, -1 when it did not say); it must set
 * the verdict. Each content delta is emitted to out as it arrives. KVB_OK once the last event came
 * (*end filled); KVB_ERR_CANCELLED when the client went away (the transfer is dropped, so
 * llama-server stops); another code when llama-server failed (end->started: text may be out). */
typedef void (*kvb_door_stream_start)(void *ctx, int total, int cached);
typedef struct {
    bool started, done;
    int prompt_n, predicted; /* timings.prompt_n and tokens_predicted of the last event (-1: absent) */
    kvb_finish_reason finish;
} kvb_door_stream_end;
kvb_status kvb_door_stream_completion(const char *host, uint16_t port, const char *json_body, int timeout_ms,
                                      kvb_completion_out *out, kvb_door_stream_start on_start, void *ctx,
                                      kvb_door_stream_end *end, kvb_err *err);

#endif
