/* bridge/bridge_cpu.c — the CPU bridge producer: attention inputs of one (chunk, layer) ->
 * the decoder's cache rows via kvb_kv_produce (the decoder's own arithmetic, the same function
 * the decoder's engine fills its cache with, rotating each layer with that layer's own RoPE
 * table: local sliding-window layers have their own base) -> slabs cut at block boundaries ->
 * the sink. */
#include <stdlib.h>
#include <string.h>

#include "kvb_bridge.h"
#include "kvb_quant.h"
#include "kvb_store.h"

struct kvb_bridge_cpu {
    const kvb_model *m;
    kvb_kvformat fmt;
    kvb_pool *pool;
    uint32_t max_chunk;
    kvb_rope_tables rope;        /* (layer kind, max_chunk, n_rot/2), filled for the current chunk */
    void *scratch;
    uint8_t *k_rows, *v_rows;    /* (max_chunk, n_head_kv, row_bytes) */
    uint32_t ship_from, ship_to;
    uint32_t local_from;         /* local layers: the decoder keeps rows from here on (the cut) */
    kvb_slab_sink sink;
    void *sink_ctx;
    bool perturbed;
    bool ggml;                  /* the llama.cpp fidelity level (kvb_bridge_cpu_set_ggml) */
    kvb_rows_producer producer; /* NULL: kvb_kv_produce here */
    void *producer_ctx;
    bool sink_checksums;        /* slabs leave with checksum 0: the sink computes it */
};

kvb_status kvb_bridge_cpu_create(const kvb_model *decoder, const kvb_kvformat *fmt, kvb_pool *pool,
                                 uint32_t max_chunk, kvb_bridge_cpu **out, kvb_err *err) {
    *out = NULL;
    const kvb_model_desc *d = &decoder->d;
    if (fmt->n_layer != d->n_layer || fmt->n_head_kv != d->n_head_kv || fmt->head_dim != d->head_dim)
        return kvb_err_set(err, KVB_ERR_INVALID, "cache format geometry does not match the decoder's model");
    kvb_bridge_cpu *b = calloc(1, sizeof *b);
    if (!b) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating the bridge");
    b->m = decoder;
    b->fmt = *fmt;
    b->pool = pool;
    b->max_chunk = max_chunk;
    const size_t rows = (size_t)max_chunk * d->n_head_kv * kvb_kvformat_row_bytes(fmt);
    kvb_status st = kvb_rope_tables_init(&b->rope, decoder, max_chunk, err);
    if (st) {
        kvb_bridge_cpu_free(b);
        return st;
    }
    b->scratch = kvb_aligned_alloc(64, kvb_kv_produce_scratch_bytes(decoder, max_chunk));
    b->k_rows = malloc(rows);
    b->v_rows = malloc(rows);
    if (!b->scratch || !b->k_rows || !b->v_rows) {
        kvb_bridge_cpu_free(b);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for bridge buffers (%u tokens)", max_chunk);
    }
    *out = b;
    return KVB_OK;
}

void kvb_bridge_cpu_free(kvb_bridge_cpu *b) {
    if (!b) return;
    kvb_rope_tables_free(&b->rope);
    kvb_aligned_free(b->scratch);
    free(b->k_rows);
    free(b->v_rows);
    free(b);
}

void kvb_bridge_cpu_begin(kvb_bridge_cpu *b, uint32_t ship_from, uint32_t ship_to, kvb_slab_sink sink,
                          void *sink_ctx) {
    b->ship_from = ship_from;
    b->ship_to = ship_to;
    b->local_from = kvb_kvformat_local_keep_from(&b->fmt, ship_to);
    b->sink = sink;
    b->sink_ctx = sink_ctx;
}

void kvb_bridge_cpu_set_perturbed(kvb_bridge_cpu *b, bool perturbed) { b->perturbed = perturbed; }

kvb_status kvb_bridge_cpu_set_ggml(kvb_bridge_cpu *b, kvb_err *err) {
    if (b->m->d.mla)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "ggml's arithmetic is not reproduced for latent attention");
    kvb_status st = kvb_rope_tables_set_ggml(&b->rope, err);
    if (!st) b->ggml = true;
    return st;
}

void kvb_bridge_cpu_sink_checksums(kvb_bridge_cpu *b, bool on) { b->sink_checksums = on; }

void kvb_bridge_cpu_set_producer(kvb_bridge_cpu *b, kvb_rows_producer fn, void *ctx) {
    b->producer = fn;
    b->producer_ctx = ctx;
}

static kvb_status emit_slabs(kvb_bridge_cpu *b, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                             const uint8_t *v_rows, kvb_err *err);
static bool clip_to_ship(const kvb_bridge_cpu *b, uint32_t layer, uint32_t *pos0, uint32_t *n, uint32_t *skip);

kvb_status kvb_bridge_cpu_layer(void *bridge, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                kvb_err *err) {
    kvb_bridge_cpu *b = bridge;
    uint32_t skip; /* only what the decoder lacks */
    if (!clip_to_ship(b, layer, &pos0, &n, &skip)) return KVB_OK;
    h += (size_t)skip * b->m->d.n_embd;
    if (n > b->max_chunk)
        return kvb_err_set(err, KVB_ERR_INVALID, "bridge chunk of %u tokens exceeds its buffers (%u)", n, b->max_chunk);
    if (b->producer) {
        kvb_status st = b->producer(b->producer_ctx, layer, pos0, n, h, b->k_rows, b->v_rows, err);
        if (st) return st;
    } else {
        /* an engine calls every layer of a chunk in turn: the tables are filled once per chunk */
        if (b->rope.n == 0 || pos0 != b->rope.pos0 || n != b->rope.n) kvb_rope_tables_fill(&b->rope, pos0, n);
        kvb_kv_produce_args a = {b->m, layer, b->fmt.dtype, b->pool, NULL, NULL, b->perturbed, b->ggml};
        kvb_rope_tables_layer(&b->rope, layer, &a.rope_cos, &a.rope_sin);
        kvb_kv_produce(&a, h, n, b->scratch, b->k_rows, b->v_rows);
    }
    return emit_slabs(b, layer, pos0, n, b->k_rows, b->v_rows, err);
}

/* Cuts k_rows / v_rows (n tokens from pos0) into slabs at block boundaries and sinks them. */
static kvb_status emit_slabs(kvb_bridge_cpu *b, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                             const uint8_t *v_rows, kvb_err *err) {
    const size_t tok_bytes = (size_t)b->m->d.n_head_kv * kvb_kvformat_row_bytes(&b->fmt);
    const bool has_v = kvb_kvformat_parts(&b->fmt) == 2; /* a latent (mla) format ships K rows only */
    const uint32_t bt = b->fmt.block_tokens;
    for (uint32_t t = 0; t < n;) {
        uint32_t p = pos0 + t, in_block = bt - p % bt, cnt = n - t < in_block ? n - t : in_block;
        kvb_slab s = {.layer = layer,
                      .pos0 = p,
                      .n = cnt,
                      .k = k_rows + (size_t)t * tok_bytes,
                      .v = has_v ? v_rows + (size_t)t * tok_bytes : NULL,
                      .k_bytes = cnt * tok_bytes,
                      .v_bytes = has_v ? cnt * tok_bytes : 0};
        if (!b->sink_checksums) s.checksum = kvb_slab_checksum(s.k, s.k_bytes, s.v, s.v_bytes);
        kvb_status st = b->sink(b->sink_ctx, &s, err);
        if (st) return st;
        t += cnt;
    }
    return KVB_OK;
}

/* Clips [pos0, pos0+n) to the shipped range — for a local (sliding-window) layer, to the part of
 * it the decoder keeps: rows before local_from are neither computed nor shipped; returns false
 * when nothing of it is shipped. */
static bool clip_to_ship(const kvb_bridge_cpu *b, uint32_t layer, uint32_t *pos0, uint32_t *n, uint32_t *skip) {
    *skip = 0;
    const uint32_t from = kvb_kvformat_layer_local(&b->fmt, layer) && b->local_from > b->ship_from ? b->local_from
                                                                                                 : b->ship_from;
    if (*pos0 + *n <= from || *pos0 >= b->ship_to) return false;
    if (*pos0 < from) {
        *skip = from - *pos0;
        *pos0 += *skip;
        *n -= *skip;
    }
    if (*n > b->ship_to - *pos0) *n = b->ship_to - *pos0;
    return true;
}

kvb_status kvb_bridge_cpu_rows(void *bridge, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                               const uint8_t *v_rows, uint32_t src_dtype, kvb_err *err) {
    kvb_bridge_cpu *b = bridge;
    uint32_t skip;
    if (!clip_to_ship(b, layer, &pos0, &n, &skip)) return KVB_OK;
    if (n > b->max_chunk)
        return kvb_err_set(err, KVB_ERR_INVALID, "bridge chunk of %u tokens exceeds its buffers (%u)", n, b->max_chunk);
    const uint32_t hd = b->m->d.head_dim, rows = n * b->m->d.n_head_kv;
    const size_t src_rb = kvb_row_bytes(src_dtype, hd), dst_rb = kvb_kvformat_row_bytes(&b->fmt);
    const uint8_t *src[2] = {k_rows + (size_t)skip * b->m->d.n_head_kv * src_rb,
                             v_rows + (size_t)skip * b->m->d.n_head_kv * src_rb};
    /* rows already in the decoder's dtype are cut where they lie (the sink copies what it keeps) */
    if (src_dtype == b->fmt.dtype) return emit_slabs(b, layer, pos0, n, src[0], src[1], err);
    uint8_t *dst[2] = {b->k_rows, b->v_rows};
    float *tmp = b->scratch; /* (head_dim) */
    for (uint32_t w = 0; w < kvb_kvformat_parts(&b->fmt); w++) {
        for (uint32_t r = 0; r < rows; r++) {
            kvb_row_to_f32(src_dtype, src[w] + (size_t)r * src_rb, tmp, hd);
            kvb_f32_to_row(b->fmt.dtype, tmp, dst[w] + (size_t)r * dst_rb, hd);
        }
    }
    return emit_slabs(b, layer, pos0, n, b->k_rows, b->v_rows, err);
}
