/* bridge — owns both ends of the cache transfer. The producer side turns a prefill engine's
 * attention inputs into the decoder's own cache: for each (chunk, layer) it runs the decoder's
 * cache-producing arithmetic (kvb_kv_produce, with the DECODER's K/V weights and cache format) and
 * cuts the encoded rows into slabs at block boundaries, each with its XXH3 checksum, handed to a
 * sink (the prefill node's staging ring and lanes, or the receiver in tests and `kvbridge
 * verify`). Positions up to (never including) the last prompt token are shipped, the decoder
 * computes that one itself; a local (sliding-window) layer's rows only where the decoder keeps
 * them (kvb_kvformat_local_keep_from). The decode side is one receiver (range check, the store's
 * slab assembler and block writer, the DONE check, the tail), driven over the peer's lanes by
 * kvb_bridge_rx_run or in process by verify and bench quality; and the fault kinds it reports. */
#ifndef KVB_BRIDGE_H
#define KVB_BRIDGE_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_engine_cpu.h"
#include "kvb_kvformat.h"
#include "kvb_model.h"
#include "kvb_store.h"
#include "kvb_transport.h"

/* One slab: tokens [pos0, pos0+n) of one layer, all inside one cache block.
 * k, v: (n, n_head_kv, row_bytes) in the decoder's cache dtype. */
typedef struct {
    uint32_t layer;
    uint32_t pos0, n;
    const uint8_t *k, *v;
    size_t k_bytes, v_bytes;
    uint64_t checksum; /* kvb_slab_checksum(k, v); 0 until the sink computes it under
                          kvb_bridge_cpu_sink_checksums */
} kvb_slab;

typedef kvb_status (*kvb_slab_sink)(void *ctx, const kvb_slab *slab, kvb_err *err);

typedef struct kvb_bridge_cpu kvb_bridge_cpu;

/* decoder: the decoder's model (its K/V weights and arithmetic); fmt: the decoder's cache format;
 * ship_tokens: how many leading positions to ship (a multiple of fmt->block_tokens); max_chunk:
 * the largest chunk of attention inputs one call passes. */
kvb_status kvb_bridge_cpu_create(const kvb_model *decoder, const kvb_kvformat *fmt, kvb_pool *pool,
                                 uint32_t max_chunk, kvb_bridge_cpu **out, kvb_err *err);
void kvb_bridge_cpu_free(kvb_bridge_cpu *b);
/* Sets the sink and the positions [ship_from, ship_to) to ship for the next prompt (what the
 * decoder lacks: from its cached prefix up to the last prompt token). Local (sliding-window)
 * layers ship only the positions the decoder keeps, from kvb_kvformat_local_keep_from(fmt,
 * ship_to) on; global layers ship every position. */
void kvb_bridge_cpu_begin(kvb_bridge_cpu *b, uint32_t ship_from, uint32_t ship_to, kvb_slab_sink sink,
                          void *sink_ctx);
/* The engine's layer hook (kvb_layer_hook): h (n, n_embd) attention inputs at pos0 .. pos0+n-1. */
kvb_status kvb_bridge_cpu_layer(void *bridge, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                kvb_err *err);
/* Bridge mode `prefill` (the engine's rows hook, kvb_kv_rows_hook): the prefill engine's own
 * encoded K/V rows (src_dtype) re-encoded into the decoder's cache dtype (decoded to f32, encoded
 * again; copied as they are when the dtypes match). Cheaper than decoder mode — no projection —
 * and exact only when the prefill engine computes in the decoder's own format and arithmetic. */
kvb_status kvb_bridge_cpu_rows(void *bridge, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                               const uint8_t *v_rows, uint32_t src_dtype, kvb_err *err);
/* Where the rows come from: by default kvb_kv_produce on this CPU; a device producer (the CUDA
 * bridge kernel, kvb_bridge_cuda_layer) computes the same rows elsewhere and this object still
 * cuts and ships the slabs. fn(ctx, layer, pos0, n, h (n, n_embd), k_rows, v_rows) fills
 * (n, n_head_kv, row_bytes) rows in the decoder's cache dtype. */
typedef kvb_status (*kvb_rows_producer)(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                        uint8_t *k_rows, uint8_t *v_rows, kvb_err *err);
void kvb_bridge_cpu_set_producer(kvb_bridge_cpu *b, kvb_rows_producer fn, void *ctx);
/* on: slabs reach the sink with checksum 0 and the sink computes kvb_slab_checksum itself (the
 * prefill node's senders do, one per lane, in parallel, instead of the one thread that cuts). */
void kvb_bridge_cpu_sink_checksums(kvb_bridge_cpu *b, bool on);
/* Test-only: perturb the bridge's arithmetic by one reordered addition (the K bias is added to the
 * projection in a different association), so `kvbridge verify` can prove it detects a change. */
void kvb_bridge_cpu_set_perturbed(kvb_bridge_cpu *b, bool perturbed);
/* The llama.cpp fidelity level: rows from here on through kvb_kv_produce with ggml's arithmetic
 * (kvb_kv_produce_args.ggml) and ggml-mode RoPE tables. KVB_ERR_UNSUPPORTED for a latent (mla) or
 * YaRN model. */
kvb_status kvb_bridge_cpu_set_ggml(kvb_bridge_cpu *b, kvb_err *err);

/* ---- the receiver: slabs into a store, the one way every caller commits them -----------------
 * One pending block (kvb_store_slab_begin) per full block of tokens [ship_from, ship_to) under its
 * chain key, and when ship_to ends inside a block, a pending tail (kvb_store_slab_begin_tail) for
 * the rest; each slab is range-checked, then goes to the store's slab assembler
 * (kvb_store_slab_put: every field and the checksum checked before a byte is copied), a block is
 * committed through the one block writer once every layer of every token has arrived (a tail never
 * is: a sequence adopts its page). No reference is kept to a committed block: a decoder engine over
 * the same store adopts the chain with kvb_seq_attach_cached, then the tail with
 * kvb_seq_adopt_tail. The decode node's lanes (kvb_bridge_rx_run), `kvbridge verify` and
 * `kvbridge bench quality` all commit through it; put may run on several threads at once. */
typedef struct kvb_bridge_receiver kvb_bridge_receiver;

/* tokens: the prompt, at least ship_to of them; ship_from a multiple of the store's block_tokens,
 * ship_from <= ship_to (a decode node ships up to, never including, the last prompt token). With
 * local layers each block expects their rows only from kvb_kvformat_local_keep_from(fmt, ship_to)
 * on (kvb_store_slab_keep_local_from), as the bridge cuts them. Fails (nothing held) when the
 * store cannot take the blocks: the store's status (KVB_ERR_INVALID for a range that does not
 * start a block). */
kvb_status kvb_bridge_receiver_create(kvb_store *store, const int32_t *tokens, uint32_t ship_from, uint32_t ship_to,
                                      kvb_bridge_receiver **out, kvb_err *err);
/* The sink (kvb_slab_sink): KVB_ERR_FORMAT for a slab outside [ship_from, ship_to), else what the
 * slab assembler says (KVB_OK: accepted). */
kvb_status kvb_bridge_receiver_put(void *receiver, const kvb_slab *slab, kvb_err *err);
/* Blocks not yet committed, plus 1 for an incomplete tail (0 once the bridge delivered everything). */
uint32_t kvb_bridge_receiver_missing(const kvb_bridge_receiver *r);
/* Slab bytes (K + V) accepted so far. */
uint64_t kvb_bridge_receiver_bytes(const kvb_bridge_receiver *r);
/* Slabs accepted so far (on every lane together). */
uint32_t kvb_bridge_receiver_slabs(const kvb_bridge_receiver *r);
/* Full blocks expected ([ship_from, ship_to) / block_tokens) and the tail's tokens (0: none). */
uint32_t kvb_bridge_receiver_blocks(const kvb_bridge_receiver *r);
uint32_t kvb_bridge_receiver_tail_tokens(const kvb_bridge_receiver *r);
/* The chain key of the block before ship_from (the store's root key when ship_from is 0): what a
 * PREFILL names as the last cached key. */
uint64_t kvb_bridge_receiver_parent_key(const kvb_bridge_receiver *r);
/* The pending blocks in position order, the tail last when there is one; *n receives how many. */
kvb_slab_pending *const *kvb_bridge_receiver_pending(const kvb_bridge_receiver *r, uint32_t *n);
/* What the sender's DONE frames say it shipped: one per lane (n_lanes of them, each counting its
 * own lane's slabs), with lane_slabs[l] the slabs accepted on lane l. KVB_OK when they agree with
 * each other and with what arrived — the tokens covered, the blocks, the chain digest of the
 * shipped blocks' keys (kvb_wire_chain_digest), every lane's slab count — and nothing is missing;
 * else KVB_ERR_MISMATCH saying what differs. */
kvb_status kvb_bridge_receiver_check_done(const kvb_bridge_receiver *r, const kvb_msg_done *done,
                                          const uint32_t *lane_slabs, uint32_t n_lanes, kvb_err *err);
/* The DONE a sender sends (on one lane) after shipping tokens [ship_from, ship_to) of `tokens` in
 * `slabs` slabs, its chain keys from `store` (the sender's own: the same model and cache format):
 * what an in-process bridge (verify, bench quality) holds the receiver to. */
kvb_status kvb_bridge_done_for(const kvb_store *store, const int32_t *tokens, uint32_t ship_from, uint32_t ship_to,
                               uint32_t slabs, kvb_msg_done *out, kvb_err *err);
/* The complete tail's page, a WRITING page of the store now owned by the caller (hand it to
 * kvb_seq_adopt_tail, or give it back with kvb_store_release); KVB_BLOCK_NONE when there is no
 * tail, it is incomplete, or it was taken. */
kvb_block_id kvb_bridge_receiver_take_tail(kvb_bridge_receiver *r);
/* Closes every pending block (an uncommitted one's page, and an untaken tail's, go back;
 * committed blocks stay in the store, unreferenced). NULL is a no-op. */
void kvb_bridge_receiver_free(kvb_bridge_receiver *r);

/* ---- why a bridge stopped short ---------------------------------------------------------------- */

typedef enum {
    KVB_BRIDGE_FAULT_NONE = 0,
    KVB_BRIDGE_FAULT_TIMEOUT,       /* the peer stalled past the lane's deadline */
    KVB_BRIDGE_FAULT_PEER_LOST,     /* a lane failed mid-stream (closed, reset) */
    KVB_BRIDGE_FAULT_CORRUPT_SLAB,  /* a slab failed its range or checksum check */
    KVB_BRIDGE_FAULT_PEER_ERROR,    /* the peer refused the request (an ERROR frame) */
    KVB_BRIDGE_FAULT_DONE_MISMATCH, /* DONE disagrees with what arrived */
    KVB_BRIDGE_FAULT_CACHE_FULL,    /* no room in the store for the pending blocks */
    KVB_BRIDGE_FAULT_CLIENT_GONE,   /* the client went away during the transfer */
    KVB_BRIDGE_FAULT_PEER_DOWN,     /* no usable link to the peer */
    KVB_BRIDGE_FAULT_INTERNAL,      /* a resource or invariant failure on this side */
    KVB_BRIDGE_FAULT_PEER_BUSY,     /* the peer refused the request at once: its queue is full (ERROR BUSY) */
    KVB_BRIDGE_FAULT_COUNT
} kvb_bridge_fault;

/* The fault's name as metrics label and verdicts use it ("timeout", "peer_lost", ...). */
const char *kvb_bridge_fault_name(kvb_bridge_fault f);
/* The fault a failed receive on a lane stands for: a timeout, a frame corrupt in flight
 * (KVB_ERR_CHECKSUM: a corrupt slab), else the peer lost. */
kvb_bridge_fault kvb_bridge_fault_of_receive(kvb_status st);
/* A link fault that a resumed attempt can repair (the blocks that arrived stay): a corrupt slab or
 * a lost peer, not a stall (another timeout), a refusal or a DONE that disagrees. */
bool kvb_bridge_fault_resumable(kvb_bridge_fault f);

/* ---- receiving a bridged request over the peer's lanes (rx_lanes.c) ----------------------------- */

/* The other requests' decode steps, which run while this request's transfer holds the engine:
 * at the pipelined tail's layer gates (run_pending; on_step tells the gate a step was handed in:
 * fn(fn_ctx) under the batcher's lock, NULL clears it), or throughout when there is no pipelined
 * tail (lend, then reclaim). A NULL function: nothing of that kind runs. */
typedef struct {
    void *ctx;
    uint32_t (*run_pending)(void *ctx);
    void (*on_step)(void *ctx, void (*fn)(void *fn_ctx), void *fn_ctx);
    void (*lend)(void *ctx);
    void (*reclaim)(void *ctx);
} kvb_bridge_batch_hooks;

typedef struct {
    kvb_conn *const *lanes; /* (n_lanes <= KVB_WIRE_MAX_LANES) the peer's lanes; lane 0 carries PREFILL, CANCEL */
    uint32_t n_lanes;
    const kvb_msg_prefill *prefill; /* sent on lane 0; its request_id names the frames to take */
    int send_timeout_ms;            /* the PREFILL's and CANCEL's */
    int lane_timeout_ms;            /* a lane's wait for its next frame before the peer counts as stalled */
    /* the pipelined tail (NULL engine: none): the last token runs while the blocks arrive */
    kvb_engine *tail_engine;
    const int32_t *toks;
    uint32_t n_tok, cached;
    float *logits;                  /* (n_vocab) */
    int tail_threads;               /* the tail's pool width while later layers are arriving */
    kvb_bridge_batch_hooks batch;
    bool (*cancelled)(void *ctx);   /* the client went away (looked at every 100 ms); may be NULL */
    void *cancelled_ctx;
} kvb_bridge_rx_opts;

typedef struct {
    kvb_bridge_fault fault;  /* NONE: every lane's DONE matched what arrived */
    char fault_msg[160];     /* what happened, for the verdict ("" without a fault) */
    bool drop_link;          /* the lanes can no longer be trusted: the caller closes them */
    uint32_t slabs;
    uint64_t bytes;
    double prefill_s;        /* the peer's own time (its DONE) */
    double t_end;            /* when the last lane ended (kvb_now_s) */
    kvb_block_id tail_page;  /* the tail, complete and verified: a writing page now the caller's, or NONE */
    bool last_ready;         /* the pipelined tail computed the last token: logits hold its logits and */
    kvb_block_id last_page;  /* this page (WRITING, the caller's) holds the tail's rows and the last token's */
    double tail_wait_s;      /* how long the pipelined tail ran on after the transfer */
    double reader_wait_s, consumer_wait_s; /* the receiving stages' waits, per lane on average */
} kvb_bridge_rx_outcome;

/* Sends the PREFILL on lane 0 and commits what arrives into r: per lane a receiving thread reads
 * ahead (recv_pipe.c) while a committing thread range-checks and puts each slab through the
 * receiver (kvb_bridge_receiver_put); the first fault on any lane stops the others; once every
 * lane ended, their DONEs are checked (kvb_bridge_receiver_check_done) and a complete tail taken.
 * Never connects or closes a lane: o->drop_link says when the caller must. After a corrupt slab or
 * a client gone the peer is told to CANCEL. Blocks that completed stay committed either way. */
void kvb_bridge_rx_run(kvb_bridge_receiver *r, const kvb_bridge_rx_opts *opts, kvb_bridge_rx_outcome *o);

/* ---- the prefill side's staging ring (staging_ring.c) -------------------------------------------- */

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

/* ---- verification (`kvbridge verify`) ------------------------------------------------------ */

typedef struct {
    uint32_t cache_dtype;  /* the decoder's cache format under test */
    uint32_t block_tokens; /* e.g. 16 */
    uint32_t prompt_tokens;/* e.g. 4 blocks + 7 */
    uint64_t seed;         /* prompt tokens */
    int n_threads;
    bool perturb;          /* test-only: perturb the bridge; every exactness row must then fail */
    bool cuda;             /* compute the bridge rows with the CUDA bridge kernel (needs a GPU) */
    int gpus;              /* with cuda, > 1: that many tensor-parallel rank bridges, each computing
                              its KV heads' columns (kvb_bridge_cuda_create_ranks) */
} kvb_verify_opts;

typedef struct {
    uint32_t arrays_ok, arrays_total;   /* (layer x K/V, or layer for a latent format) cache arrays bit-identical: bridge vs decoder */
    uint32_t blocks_ok, blocks_total;   /* blocks committed via slabs vs blocks the decoder committed
                                           (the rows the receiving store keeps) */
    uint32_t chunked_ok, chunked_total; /* (layer x K/V) bridge output chunked (odd chunks) == one-shot */
    uint64_t slab_bytes;                /* bytes the bridge shipped */
    uint64_t slab_bytes_local;          /* of which local (sliding-window) layers' rows */
    uint32_t ship_tokens;               /* positions shipped (every full block before the last token) */
    uint32_t local_keep_from;           /* local layers' rows shipped and compared from here on (0: all) */
} kvb_verify_result;

/* Runs the decoder natively on a random prompt (its engine commits its own blocks) and records
 * its attention inputs; feeds those same inputs through the CPU bridge (one shot, and in odd
 * 5-token chunks), assembling the one-shot slabs into a second store through the slab path and
 * the one block writer; compares arrays, blocks and chunked output bit for bit. ("Given the same
 * attention input" is the decoder-exact claim; how close a different prefill engine's inputs
 * are is measured separately as end-to-end quality.) */
kvb_status kvb_verify_cpu(const kvb_model *m, const kvb_verify_opts *o, kvb_verify_result *r, kvb_err *err);

#endif
