/* engine/prefill_cpu.c — the CPU engine (engine/cpu) behind the prefill-engine table: its forward
 * with the bridge on its layer hook (decoder mode: the bridge computes the decoder's rows from the
 * engine's attention inputs) or on its rows hook (the prefill bridge mode: the engine's own rows
 * re-encoded). The rows live in the bridge's and the engine's buffers, reused at once: the sink
 * copies what it keeps. */
#include <stdio.h>
#include <stdlib.h>

#include "kvb_engine_cpu.h"
#include "kvb_gguf.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "prefill_engine_internal.h"

typedef struct {
    kvb_prefill_engine base; /* first: the table's handle */
    kvb_engine *e;
} prefill_cpu;

static kvb_engine *engine_of(const kvb_prefill_engine *e) { return ((const prefill_cpu *)e)->e; }

static void cpu_free(kvb_prefill_engine *e) {
    kvb_engine_free(engine_of(e));
    free(e);
}

static void cpu_describe(const kvb_prefill_engine *e, char *buf, size_t cap) {
    snprintf(buf, cap, "%d threads, %s kernels", kvb_engine_threads(engine_of(e)), kvb_simd_name());
}

static void cpu_attention_describe(const kvb_prefill_engine *e, char *buf, size_t cap) {
    (void)e;
    snprintf(buf, cap, "the CPU engine's attention over its paged cache");
}

static void cpu_stats(kvb_prefill_engine *e, kvb_prefill_stats *out) {
    out->host_threads = kvb_engine_threads(engine_of(e)); /* no device: the rest stays 0 */
    kvb_store_stats ss;
    kvb_store_get_stats(kvb_engine_store(engine_of(e)), &ss);
    out->cache_evictions = ss.evictions;
}

static kvb_pool *cpu_pool(kvb_prefill_engine *e) { return kvb_engine_pool(engine_of(e)); }

static kvb_status cpu_seq_create(kvb_prefill_engine *e, void **seq, kvb_err *err) {
    return kvb_seq_create(engine_of(e), (kvb_seq **)seq, err);
}

static void cpu_seq_free(void *seq) { kvb_seq_free(seq); }

static kvb_status cpu_attach_cached(void *seq, const int32_t *tokens, uint32_t n, uint32_t *n_cached, kvb_err *err) {
    return kvb_seq_attach_cached(seq, tokens, n, n_cached, err);
}

static kvb_status cpu_forward(kvb_prefill_engine *e, void *seq, const int32_t *tokens, uint32_t n, float *logits,
                              bool all_logits, kvb_err *err) {
    return kvb_engine_forward(engine_of(e), seq, tokens, n, logits, all_logits, err);
}

static const kvb_prefill_engine_ops cpu_ops = {
    .name = "cpu",
    .free = cpu_free,
    .describe = cpu_describe,
    .attention_describe = cpu_attention_describe,
    .stats = cpu_stats,
    .pool = cpu_pool,
    .seq_create = cpu_seq_create,
    .seq_free = cpu_seq_free,
    .attach_cached = cpu_attach_cached,
    .forward = cpu_forward,
    .rows_stay_put = false,
};

kvb_status kvb_prefill_cpu_open(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                kvb_err *err) {
    *out = NULL;
    kvb_engine_opts eo = {.n_threads = o->n_threads, .cache_dtype = o->cache_dtype, .block_tokens = o->block_tokens,
                          .max_ctx = o->max_ctx, .max_batch = o->max_batch, .n_blocks = o->n_blocks,
                          .ggml_arith = o->ggml_arith};
    if (o->bridge && o->bridge_engine_rows) {
        eo.rows_hook = kvb_bridge_cpu_rows;
        eo.rows_hook_ctx = o->bridge;
    } else if (o->bridge) {
        eo.layer_hook = kvb_bridge_cpu_layer;
        eo.layer_hook_ctx = o->bridge;
    }
    /* the engine reads the weights in place: every page now, when asked, not on the first forward */
    kvb_status st = o->prefault ? kvb_gguf_prefault(m->gguf, err) : KVB_OK;
    if (!st && o->bridge && o->ggml_arith) st = kvb_bridge_cpu_set_ggml(o->bridge, err);
    prefill_cpu *pc = st ? NULL : calloc(1, sizeof *pc);
    if (!st && !pc) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    if (!st) st = kvb_engine_create(m, &eo, &pc->e, err);
    if (st) {
        free(pc);
        return st;
    }
    pc->base.ops = &cpu_ops;
    *out = &pc->base;
    return KVB_OK;
}
