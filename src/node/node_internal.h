/* node/node_internal.h — private to the node module: the staging ring (prefill side), the
 * receiving thread, the pipelined tail, the batched decode steps and a reply's optional parts
 * (decode side). */
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

enum { RING_HASH_NONE, RING_HASH_BUSY, RING_HASH_DONE }; /* a filled slot's checksum: nobody's yet,
                                                          the producer's now, made (meta.checksum) */

typedef struct {
    uint32_t n_slots;    /* slots with staging memory: the capacity for copies */
    uint32_t view_slots; /* the capacity for views (no memory of their own): a layer's slabs at once */
    uint32_t cap;        /* this request's: n_slots for copies, view_slots for views (kvb_ring_reset) */
    size_t slot_bytes;
    uint8_t *buf;    /* (n_slots, slot_bytes): K then V of one slab */
    kvb_slab *meta;  /* (view_slots, >= n_slots) */
    bool *sent;      /* (view_slots) taken and sent, not yet freed (an older slot is still in flight) */
    uint8_t *hash;   /* (view_slots) RING_HASH_*: who computes the slab's checksum (kvb_ring_wait_sent) */
    uint32_t head, tail, count, peak; /* count: filled slots not yet freed, oldest at head; peak: of copies */
    uint64_t pushed, freed;           /* slots pushed and freed since the last reset (kvb_ring_mark) */
    uint64_t wait_mark;               /* nonzero while the producer waits for freed to reach it
                                         (kvb_ring_wait_sent_to): only a freed slot that does wakes it */
    uint32_t next_take, untaken;      /* the oldest filled slot no sender took yet; how many */
    bool closed, failed, inited;
    double full_s, empty_s; /* since the last reset: the producer blocked on a full ring (the link or
                               the decoder is the slower stage), the senders on an empty one (the
                               producer is; summed over the senders) */
    uint32_t hashed_by_producer; /* since the last reset: checksums kvb_ring_wait_sent computed */
    uint32_t hash_waiters;       /* senders waiting for a checksum the producer is computing */
    pthread_mutex_t mu;
    pthread_cond_t cv_taken;  /* senders wait here for a slab to take (one woken per slab) */
    pthread_cond_t cv_freed;  /* the producer waits here for free slots (or all sent) */
    pthread_cond_t cv_hashed; /* senders wait here for a checksum the producer is computing */
} kvb_ring;

/* `slots` staging slots of slot_bytes for copies; up to view_slots views in flight (a view costs
 * no staging memory, so a whole layer's slabs can wait for the senders at once). */
kvb_status kvb_ring_init(kvb_ring *r, uint32_t slots, uint32_t view_slots, size_t slot_bytes, kvb_err *err);
void kvb_ring_destroy(kvb_ring *r);
/* Empty for a new request, which pushes either copies or views (views: `views` true). */
void kvb_ring_reset(kvb_ring *r, bool views);
/* Copies the slab into the next free slot; blocks while the ring is full; fails once failed. */
kvb_status kvb_ring_push(kvb_ring *r, const kvb_slab *s, kvb_err *err);
/* As push, but without the copy: the slot holds the slab's own K and V pointers, so the caller
 * keeps those bytes unchanged until kvb_ring_wait_sent returns (the CUDA bridge's pinned rows are
 * sent straight from its slot). Blocks only when view_slots views are in flight. */
kvb_status kvb_ring_push_view(kvb_ring *r, const kvb_slab *s, kvb_err *err);
/* Waits until every slab pushed so far was sent (the time it idles counts as the ring standing
 * full); fails once failed. Meanwhile it computes the checksums (kvb_slab_checksum) of the slabs no
 * sender took yet, newest first, while the senders take the oldest: a sender then only sends, and
 * the two meet in the middle (a sender otherwise hashes and sends one slab after the other, which
 * held one lane to ~80 % of a loopback stream). */
kvb_status kvb_ring_wait_sent(kvb_ring *r, kvb_err *err);
/* Slabs pushed since the last reset: a mark for kvb_ring_wait_sent_to. */
uint64_t kvb_ring_mark(kvb_ring *r);
/* As kvb_ring_wait_sent, but only until every slab pushed before `mark` was sent: a producer of
 * views pushes one batch of rows (a layer of a pinned slot), then waits for the batch before it,
 * so the senders never run dry between the two (two batches' views must fit in view_slots). */
kvb_status kvb_ring_wait_sent_to(kvb_ring *r, uint64_t mark, kvb_err *err);
/* Takes the oldest filled slot no sender has taken (waits for one): true with its slot index and
 * slab (views into the slot, valid until kvb_ring_done); false once closed and every slot taken,
 * or failed. Several senders may take at once. *checksum_known: out->checksum is the slab's
 * checksum, computed by kvb_ring_wait_sent (a slab it is computing right now is waited for);
 * false: the sender computes it. */
bool kvb_ring_take(kvb_ring *r, uint32_t *slot, kvb_slab *out, bool *checksum_known);
/* The taken slot was sent: it is free again once every older slot is too. */
void kvb_ring_done(kvb_ring *r, uint32_t slot);
void kvb_ring_close(kvb_ring *r); /* producer done */
void kvb_ring_fail(kvb_ring *r);  /* consumer gave up: producer's pushes fail */

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

/* The decode side's receiving thread for one request (recv_pipe.c). */
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

typedef struct kvb_recv_pipe kvb_recv_pipe;
kvb_status kvb_recv_pipe_start(kvb_conn *c, uint64_t request_id, int timeout_ms, kvb_recv_pipe **out, kvb_err *err);
/* The oldest unreleased message (waits for it); a receive failure is returned with its error, and
 * nothing follows it. */
kvb_status kvb_recv_pipe_next(kvb_recv_pipe *p, kvb_msg *m, kvb_err *err);
/* Done with the message next returned: its buffer may be reused. */
void kvb_recv_pipe_release(kvb_recv_pipe *p);
/* Ends the thread (shutting the connection down if it is still receiving this request's stream:
 * that stream can no longer be trusted) and frees everything. NULL is a no-op. */
void kvb_recv_pipe_stop(kvb_recv_pipe *p);
/* The first half of stop, safe from any thread while another consumes: the reader ends (shutting
 * the connection down if it is still receiving), and next returns what is buffered, then fails.
 * NULL is a no-op. */
void kvb_recv_pipe_abort(kvb_recv_pipe *p);
/* Seconds the reader waited for a free buffer (the verifying thread is the slower stage) and the
 * verifying thread waited for a frame (the link or the sender is). Call before stop. */
void kvb_recv_pipe_waits(kvb_recv_pipe *p, double *reader_s, double *consumer_s);

/* The decoder's pipelined tail (tail_pipe.c): the prompt's last token runs on a thread while the
 * bridged blocks arrive, each layer once every pending block holds it. Start it after the pending
 * blocks are begun: pend (n_pend) in position order, the tail last when has_tail (pages of
 * positions cached .. n_tok - 2; without a tail it takes a page for the last token's row itself);
 * `cached` must be what kvb_seq_attach_cached finds for toks now. The engine is the thread's until
 * finish; logits (n_vocab) is written by it. While later layers are still arriving the forward
 * runs on `threads_in_transfer` of the engine's threads (the rest of the CPUs receive and commit
 * the slabs), then on all of them. With `batch` (or NULL), the other requests' decode steps handed
 * in while the forward waits for a layer run at its gate, as batches on the same width. */
typedef struct kvb_tail_pipe kvb_tail_pipe;
kvb_status kvb_tail_pipe_start(kvb_engine *e, const int32_t *toks, uint32_t n_tok, uint32_t cached,
                               kvb_slab_pending *const *pend, uint32_t n_pend, bool has_tail, float *logits,
                               int threads_in_transfer, kvb_decode_batch *batch, kvb_tail_pipe **out,
                               kvb_err *err);
/* After an accepted slab of pend[i], layer `layer`, on any thread that puts slabs. NULL: no-op. */
void kvb_tail_pipe_slab(kvb_tail_pipe *t, uint32_t i, uint32_t layer);
/* Ends it (abort: the bridge stopped short; a waiting forward gives up, as it does when any layer
 * never arrived everywhere, so finish never waits for what cannot come) and frees it; call before
 * closing the pending blocks. True when logits hold the last token's logits over exactly what
 * was committed: every block committed on the page the forward read, and the tail complete and
 * taken as tail_page (KVB_BLOCK_NONE without a tail). Then *last_page is the page holding the
 * tail's rows and the last token's row (the taken tail page, or the one it took: now the
 * caller's, WRITING). *wait_s: how long finish waited for the forward. NULL: false. */
bool kvb_tail_pipe_finish(kvb_tail_pipe *t, bool abort, kvb_block_id tail_page, kvb_block_id *last_page,
                          double *wait_s);

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

#endif
