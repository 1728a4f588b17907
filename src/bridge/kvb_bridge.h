/* bridge — turns a prefill engine's attention inputs into the decoder's own cache: for each
 * (chunk, layer) it runs the decoder's cache-producing arithmetic (kvb_kv_produce, with the
 * DECODER's K/V weights and cache format) and cuts the encoded rows into slabs at block
 * boundaries, each with its XXH3 checksum, handed to a sink (the transport, or a store's slab
 * assembler in tests and `kvbridge verify`). Positions up to (never including) the last prompt
 * token are shipped, the decoder computes that one itself; a local (sliding-window) layer's rows
 * only where the decoder keeps them (kvb_kvformat_local_keep_from). */
#ifndef KVB_BRIDGE_H
#define KVB_BRIDGE_H

#include <stdint.h>

#include "kvb_core.h"
#include "kvb_engine_cpu.h"
#include "kvb_kvformat.h"
#include "kvb_model.h"
#include "kvb_store.h"

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

/* ---- an in-process receiver: slabs into a store, as a decode node commits them ---------------
 * The decode node's side of the bridge without the wire: one pending block (kvb_store_slab_begin)
 * per full block of tokens [ship_from, ship_to) under its chain key, and when ship_to ends inside
 * a block, a pending tail (kvb_store_slab_begin_tail) for the rest; each slab goes to the store's
 * slab assembler (kvb_store_slab_put: every field and the checksum checked before a byte is
 * copied), a block is committed through the one block writer once every layer of every token has
 * arrived (a tail never is: a sequence adopts its page). No reference is kept to a committed block
 * (like the decode node): a decoder engine over the same store adopts the chain with
 * kvb_seq_attach_cached, then the tail with kvb_seq_adopt_tail. `kvbridge verify` and
 * `kvbridge bench quality` run the bridge into a store through it. */
typedef struct kvb_bridge_receiver kvb_bridge_receiver;

/* tokens: the prompt, at least ship_to of them; ship_from a multiple of the store's block_tokens,
 * ship_from <= ship_to (a decode node ships up to, never including, the last prompt token). With
 * local layers each block expects their rows only from kvb_kvformat_local_keep_from(fmt, ship_to)
 * on (kvb_store_slab_keep_local_from), as the bridge cuts them. Fails (nothing held) when the
 * store cannot take the blocks. */
kvb_status kvb_bridge_receiver_create(kvb_store *store, const int32_t *tokens, uint32_t ship_from, uint32_t ship_to,
                                      kvb_bridge_receiver **out, kvb_err *err);
/* The sink (kvb_slab_sink): KVB_ERR_FORMAT for a slab outside [ship_from, ship_to), else what the
 * slab assembler says. */
kvb_status kvb_bridge_receiver_put(void *receiver, const kvb_slab *slab, kvb_err *err);
/* Blocks not yet committed, plus 1 for an incomplete tail (0 once the bridge delivered everything). */
uint32_t kvb_bridge_receiver_missing(const kvb_bridge_receiver *r);
/* Slab bytes (K + V) accepted so far. */
uint64_t kvb_bridge_receiver_bytes(const kvb_bridge_receiver *r);
/* The complete tail's page, a WRITING page of the store now owned by the caller (hand it to
 * kvb_seq_adopt_tail, or give it back with kvb_store_release); KVB_BLOCK_NONE when there is no
 * tail, it is incomplete, or it was taken. */
kvb_block_id kvb_bridge_receiver_take_tail(kvb_bridge_receiver *r);
/* Closes every pending block (an uncommitted one's page, and an untaken tail's, go back;
 * committed blocks stay in the store, unreferenced). NULL is a no-op. */
void kvb_bridge_receiver_free(kvb_bridge_receiver *r);

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
    uint32_t arrays_ok, arrays_total;   /* (layer x K/V) cache arrays bit-identical: bridge vs decoder */
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
