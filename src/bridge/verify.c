/* bridge/verify.c — the evidence behind "decoder-exact": the decoder's own forward commits its
 * cache blocks; an independent prefill engine feeds the bridge, whose slabs are assembled and
 * committed into a second store by the decode node's own receiver (receiver.c: range check, slab
 * assembler, block writer, the DONE check against what the sender says it shipped); cache arrays,
 * block bytes and chunked-vs-one-shot output are compared bit for bit, and the receiver must
 * refuse slabs outside the range it expects. */
#include <stdlib.h>
#include <string.h>

#include "kvb_bridge.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "kvb_prefill_engine.h"

typedef struct {
    const kvb_kvformat *fmt;
    uint32_t ship;
    size_t tok_bytes;       /* n_head_kv * row_bytes */
    uint8_t *k, *v;         /* (layer, pos, n_head_kv, row_bytes) every shipped row */
    kvb_bridge_receiver *rcv; /* assemble into a store through it (NULL: only collect) */
    uint64_t bytes, local_bytes; /* every slab; those of local layers */
    uint32_t slabs;              /* the bridge emitted (a sender's DONE counts them) */
} collector;

static kvb_status collect_slab(void *ctx, const kvb_slab *s, kvb_err *err) {
    collector *c = ctx;
    if (s->layer >= c->fmt->n_layer || s->pos0 + s->n > c->ship)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "bridge emitted a slab outside the shipped range");
    size_t off = ((size_t)s->layer * c->ship + s->pos0) * c->tok_bytes;
    memcpy(c->k + off, s->k, s->k_bytes);
    if (s->v_bytes) memcpy(c->v + off, s->v, s->v_bytes); /* a latent (mla) format has no V part */
    c->bytes += s->k_bytes + s->v_bytes;
    if (kvb_kvformat_layer_local(c->fmt, s->layer)) c->local_bytes += s->k_bytes + s->v_bytes;
    c->slabs++;
    return c->rcv ? kvb_bridge_receiver_put(c->rcv, s, err) : KVB_OK;
}

/* The receiver against the DONE a prefill node would send after shipping blocks [0, ship) as one
 * lane: the slabs the bridge emitted, the chain keys from the decoder's own store. */
static kvb_status check_done(const collector *c, kvb_store *dec_store, const int32_t *toks, uint32_t ship,
                             kvb_err *err) {
    kvb_msg_done d;
    kvb_status st = kvb_bridge_done_for(dec_store, toks, 0, ship, c->slabs, &d, err);
    const uint32_t accepted = kvb_bridge_receiver_slabs(c->rcv);
    return st ? st : kvb_bridge_receiver_check_done(c->rcv, &d, &accepted, 1, err);
}

/* The receiver's range check: over blocks [1, nb) of a fresh receiver (the first block cached),
 * a well-formed slab (checksummed) for block 0 and one for block nb (no tail) must both be refused
 * as KVB_ERR_FORMAT, before the store sees them. */
static kvb_status check_range_refused(kvb_store *store, const int32_t *toks, const collector *one, uint32_t bt,
                                      uint32_t nb, kvb_err *err) {
    kvb_bridge_receiver *r = NULL;
    kvb_status st = kvb_bridge_receiver_create(store, toks, bt, nb * bt, &r, err);
    const uint32_t outside[2] = {0, nb * bt};
    const size_t n_bytes = (size_t)bt * one->tok_bytes; /* layer 0's first block of rows: real bytes */
    const size_t v_bytes = kvb_kvformat_parts(one->fmt) == 2 ? n_bytes : 0;
    for (int i = 0; i < 2 && !st; i++) {
        kvb_slab s = {.layer = 0, .pos0 = outside[i], .n = bt, .k = one->k, .v = v_bytes ? one->v : NULL,
                      .k_bytes = n_bytes, .v_bytes = v_bytes,
                      .checksum = kvb_slab_checksum(one->k, n_bytes, v_bytes ? one->v : NULL, v_bytes)};
        kvb_err perr = {0};
        const kvb_status got = kvb_bridge_receiver_put(r, &s, &perr);
        if (got != KVB_ERR_FORMAT)
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "the receiver took a slab for position %u outside [%u, %u) (%s)",
                             outside[i], bt, nb * bt, got ? perr.msg : "accepted");
    }
    kvb_bridge_receiver_free(r);
    return st;
}

static void collector_free(collector *c) {
    free(c->k);
    free(c->v);
    kvb_bridge_receiver_free(c->rcv);
}

/* The decoder's attention inputs, recorded by its layer hook: (layer, pos, n_embd) for pos < ship. */
typedef struct {
    uint32_t ship, n_embd;
    float *h;
} input_recorder;

static kvb_status record_inputs(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const float *h, kvb_err *err) {
    (void)err;
    input_recorder *r = ctx;
    if (pos0 >= r->ship) return KVB_OK;
    if (n > r->ship - pos0) n = r->ship - pos0;
    memcpy(r->h + ((size_t)layer * r->ship + pos0) * r->n_embd, h, sizeof(float) * n * r->n_embd);
    return KVB_OK;
}

/* Feeds the recorded attention inputs through the bridge in chunks of `chunk` tokens, chunk-major
 * like an engine (every layer of a chunk, then the next chunk). */
static kvb_status run_bridge(const kvb_model *m, const kvb_verify_opts *o, const kvb_kvformat *fmt,
                             const input_recorder *in, uint32_t chunk, collector *c, kvb_err *err) {
    kvb_bridge_cpu *br = NULL;
    kvb_status st = kvb_bridge_cpu_create(m, fmt, NULL, chunk, &br, err);
    if (st) return st;
    kvb_bridge_cpu_set_perturbed(br, o->perturb);
    kvb_device_bridge *gpu = NULL; /* the CUDA bridge kernel computes the rows: one, or o->gpus rank bridges */
    if (o->cuda) {
        st = kvb_device_bridge_attach(KVB_DEVICE_CUDA, m, fmt, chunk, o->gpus > 1 ? o->gpus : 1, o->perturb, br, &gpu,
                                      err);
        if (st) {
            kvb_bridge_cpu_free(br);
            return st;
        }
    }
    kvb_bridge_cpu_begin(br, 0, c->ship, collect_slab, c);
    for (uint32_t p = 0; p < in->ship && !st; p += chunk) {
        uint32_t n = in->ship - p < chunk ? in->ship - p : chunk;
        for (uint32_t l = 0; l < m->d.n_layer && !st; l++)
            st = kvb_bridge_cpu_layer(br, l, p, n, in->h + ((size_t)l * in->ship + p) * in->n_embd, err);
    }
    kvb_bridge_cpu_free(br);
    kvb_device_bridge_free(gpu);
    return st;
}

/* The bridge's one-shot rows against the decoder's own blocks (dec_ids, in ds_store), every
 * (layer, K/V) array from position 0 (a local layer's from keep) to ship, and the chunked rows
 * against the one-shot ones, into r's arrays and chunked rows. */
static void compare_arrays(const kvb_kvformat *fmt, const kvb_model_desc *d, kvb_store *ds_store,
                           const kvb_block_id *dec_ids, const collector *one, const collector *chunked, uint32_t keep,
                           kvb_verify_result *r) {
    const uint8_t *kv[2] = {one->k, one->v}, *kvc[2] = {chunked->k, chunked->v};
    const size_t rb = kvb_kvformat_row_bytes(fmt), tok_bytes = one->tok_bytes;
    const uint32_t ship = one->ship, bt = fmt->block_tokens;
    for (uint32_t l = 0; l < d->n_layer; l++)
        for (uint32_t w = 0; w < kvb_kvformat_parts(fmt); w++) { /* K and V, or a latent row alone */
            bool same = true;
            for (uint32_t p = kvb_kvformat_layer_local(fmt, l) ? keep : 0; p < ship && same; p++)
                for (uint32_t h = 0; h < d->n_head_kv && same; h++) {
                    const uint8_t *dec = kvb_store_block_data(ds_store, dec_ids[p / bt]) +
                                         kvb_kvformat_row_offset(fmt, l, w, h, p % bt);
                    const uint8_t *brg = kv[w] + ((size_t)l * ship + p) * tok_bytes + (size_t)h * rb;
                    same = memcmp(dec, brg, rb) == 0;
                }
            r->arrays_ok += same;
            r->arrays_total++;
            size_t n = (size_t)ship * tok_bytes;
            r->chunked_ok += memcmp(kv[w] + (size_t)l * n, kvc[w] + (size_t)l * n, n) == 0;
            r->chunked_total++;
        }
}

kvb_status kvb_verify_cpu(const kvb_model *m, const kvb_verify_opts *o, kvb_verify_result *r, kvb_err *err) {
    memset(r, 0, sizeof *r);
    const kvb_model_desc *d = &m->d;
    const uint32_t bt = o->block_tokens, L = o->prompt_tokens, ship = (L - 1) / bt * bt, nb = ship / bt;
    if (nb == 0) return kvb_err_set(err, KVB_ERR_INVALID, "verify needs a prompt longer than one block");
    kvb_engine *de = NULL;
    kvb_seq *ds = NULL;
    kvb_store *bstore = NULL;
    collector one = {0}, chunked = {0};
    int32_t *toks = malloc(sizeof(int32_t) * L);
    kvb_block_id *dec_ids = malloc(sizeof(kvb_block_id) * (nb + 1)), *br_ids = malloc(sizeof(kvb_block_id) * (nb + 1));
    kvb_status st = (toks && dec_ids && br_ids) ? KVB_OK : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    kvb_rng rng;
    kvb_rng_seed(&rng, o->seed);
    for (uint32_t i = 0; st == KVB_OK && i < L; i++) toks[i] = (int32_t)(kvb_rng_u64(&rng) % d->n_vocab);

    /* 1. the decoder's own forward: its engine commits its blocks; its attention inputs are kept */
    input_recorder in = {ship, d->n_embd, malloc(sizeof(float) * d->n_layer * ship * d->n_embd)};
    if (!in.h && !st) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    kvb_engine_opts eo = {.n_threads = o->n_threads, .cache_dtype = o->cache_dtype, .block_tokens = bt,
                          .max_ctx = L + bt, .n_blocks = 2 * nb + 4, .layer_hook = record_inputs,
                          .layer_hook_ctx = &in};
    if (!st) st = kvb_engine_create(m, &eo, &de, err);
    if (!st) st = kvb_seq_create(de, &ds, err);
    if (!st) st = kvb_engine_forward(de, ds, toks, L, NULL, false, err);
    const kvb_kvformat *fmt = de ? kvb_engine_kvformat(de) : NULL;
    uint32_t n_dec = 0;
    if (!st) st = kvb_store_lookup(kvb_engine_store(de), toks, ship, dec_ids, &n_dec, err);
    if (!st && n_dec != nb) st = kvb_err_set(err, KVB_ERR_INTERNAL, "decoder committed %u of %u blocks", n_dec, nb);

    /* 2. the bridge, one-shot, assembled into a second store through slabs */
    const size_t tok_bytes = fmt ? (size_t)d->n_head_kv * kvb_kvformat_row_bytes(fmt) : 0;
    if (!st) st = kvb_store_create(fmt, m->fingerprint, 2 * nb + 4, &bstore, err);
    collector *cs[2] = {&one, &chunked};
    for (int i = 0; i < 2 && !st; i++) {
        cs[i]->fmt = fmt;
        cs[i]->ship = ship;
        cs[i]->tok_bytes = tok_bytes;
        cs[i]->k = calloc((size_t)d->n_layer * ship, tok_bytes);
        cs[i]->v = calloc((size_t)d->n_layer * ship, tok_bytes);
        if (!cs[i]->k || !cs[i]->v) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    }
    if (!st) st = kvb_bridge_receiver_create(bstore, toks, 0, ship, &one.rcv, err);
    if (!st) st = run_bridge(m, o, fmt, &in, ship, &one, err);
    if (!st) st = check_done(&one, kvb_engine_store(de), toks, ship, err);
    /* 3. the bridge again, in odd chunks that straddle block boundaries */
    if (!st) st = run_bridge(m, o, fmt, &in, 5, &chunked, err);

    if (!st) {
        kvb_store *ds_store = kvb_engine_store(de);
        /* local (sliding-window) layers: the rows the decoder keeps, from keep on (the bridge cuts
         * the others and the receiving store never holds them) */
        const uint32_t keep = kvb_kvformat_local_keep_from(fmt, ship);
        r->local_keep_from = keep;
        compare_arrays(fmt, d, ds_store, dec_ids, &one, &chunked, keep, r);
        const size_t rb = kvb_kvformat_row_bytes(fmt);
        uint32_t n_br = 0;
        st = kvb_store_lookup(bstore, toks, ship, br_ids, &n_br, err);
        r->blocks_total = nb;
        for (uint32_t b = 0; b < n_br && !st; b++) {
            const uint8_t *x = kvb_store_block_data(bstore, br_ids[b]), *y = kvb_store_block_data(ds_store, dec_ids[b]);
            bool same = true; /* every row the receiving store keeps */
            for (uint32_t l = 0; l < d->n_layer && same; l++) {
                const uint32_t lo = kvb_kvformat_layer_local(fmt, l) ? kvb_kvformat_block_local_lo(fmt, keep, b) : 0;
                for (uint32_t w = 0; w < kvb_kvformat_parts(fmt) && same; w++)
                    for (uint32_t h = 0; h < d->n_head_kv && same; h++) {
                        const size_t off = kvb_kvformat_row_offset(fmt, l, w, h, lo);
                        same = memcmp(x + off, y + off, (size_t)(bt - lo) * rb) == 0;
                    }
            }
            r->blocks_ok += same;
        }
        if (!st) kvb_store_release(bstore, br_ids, n_br, NULL);
        r->slab_bytes = one.bytes;
        r->slab_bytes_local = one.local_bytes;
        r->ship_tokens = ship;
        kvb_store_release(ds_store, dec_ids, n_dec, NULL);
    }
    if (!st && nb > 1) st = check_range_refused(bstore, toks, &one, bt, nb, err);
    collector_free(&one);
    collector_free(&chunked);
    kvb_seq_free(ds);
    kvb_store_free(bstore);
    kvb_engine_free(de);
    free(in.h);
    free(toks);
    free(dec_ids);
    free(br_ids);
    return st;
}
