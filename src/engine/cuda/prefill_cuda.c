/* engine/cuda/prefill_cuda.c — the CUDA engine behind the prefill-engine table, on one GPU or
 * tensor-parallel over several: its layer hook feeds the CUDA bridge kernel (each rank's bridge its
 * own KV heads) with the attention inputs of the positions the decoder lacks; the bridge's rows
 * reach the cutter from pinned slots one layer late, and a slot is reused once the caller's
 * release says its slabs left. Also the device bridge `kvbridge verify` attaches to a cutter. */
#include <stdlib.h>

#include "kvb_bridge_cuda.h"
#include "kvb_engine_cuda.h"
#include "prefill_engine_internal.h"

_Static_assert(KVB_PREFILL_MAX_GPUS == KVB_CUDA_MAX_GPUS, "one rank limit");
_Static_assert((int)KVB_PREFILL_ATTN_OWN == (int)KVB_CUDA_ATTN_OWN &&
                   (int)KVB_PREFILL_ATTN_CUDNN == (int)KVB_CUDA_ATTN_CUDNN,
               "kvb_prefill_attention numbers kvb_cuda_attention's kinds");
_Static_assert((int)KVB_PREFILL_WEIGHTS_BF16 == (int)KVB_CUDA_WEIGHTS_BF16 &&
                   (int)KVB_PREFILL_WEIGHTS_PACKED == (int)KVB_CUDA_WEIGHTS_PACKED,
               "kvb_prefill_weights numbers kvb_cuda_weights' kinds");

typedef struct {
    kvb_prefill_engine base; /* first: the table's handle */
    const kvb_model *m;
    kvb_cuda_engine *ce;
    kvb_bridge_cuda *bc;                      /* rank 0's bridge, which ships (NULL: no bridge) */
    kvb_bridge_cuda *bcr[KVB_CUDA_MAX_GPUS];  /* every rank's, each for its KV heads */
} prefill_cuda;

static prefill_cuda *cuda_of(const kvb_prefill_engine *e) { return (prefill_cuda *)e; }

/* The engine's layer hook: the bridge kernel on the positions the decoder lacks, on `rank`'s device. */
static kvb_status cuda_layer_hook(void *ctx, int rank, uint32_t layer, uint32_t pos0, uint32_t cnt, const float *d_h,
                                  void *stream, kvb_err *err) {
    prefill_cuda *pc = ctx;
    uint32_t lo, hi;
    kvb_prefill_ship_span(&pc->base, layer, pos0, cnt, &lo, &hi);
    if (lo >= hi) return KVB_OK;
    return kvb_bridge_cuda_enqueue(pc->bcr[rank], layer, lo, hi - lo, d_h + (size_t)(lo - pos0) * pc->m->d.n_embd,
                                   stream, err);
}

/* The bridge's rows, one layer late, cut into slabs from its pinned slot: the ticket is the
 * release's mark after them (+ 1: a ticket is never 0), and the slot is handed back after
 * cuda_rows_sent(ticket); without a release mark, once the cutter returns. */
static kvb_status cuda_ship_rows(void *ctx, uint32_t layer, uint32_t pos0, uint32_t cnt, const uint8_t *k,
                                 const uint8_t *v, uint64_t *ticket, kvb_err *err) {
    prefill_cuda *pc = ctx;
    const kvb_prefill_opts *o = &pc->base.o;
    kvb_status st = kvb_bridge_cpu_rows(o->bridge, layer, pos0, cnt, k, v, pc->base.bridge_fmt.dtype, err);
    *ticket = st || !o->release.mark ? 0 : o->release.mark(o->release.ctx) + 1;
    return st;
}

static kvb_status cuda_rows_sent(void *ctx, uint64_t ticket, kvb_err *err) {
    const kvb_rows_release *r = &((prefill_cuda *)ctx)->base.o.release;
    return r->wait_sent ? r->wait_sent(r->ctx, ticket - 1, err) : KVB_OK;
}

static void cuda_free(kvb_prefill_engine *e) {
    prefill_cuda *pc = cuda_of(e);
    kvb_cuda_engine_free(pc->ce);
    kvb_bridge_cuda_free(pc->bc); /* and the other ranks' */
    free(pc);
}

static void cuda_describe(const kvb_prefill_engine *e, char *buf, size_t cap) {
    kvb_cuda_engine_describe(cuda_of(e)->ce, buf, cap);
}

static void cuda_attention_describe(const kvb_prefill_engine *e, char *buf, size_t cap) {
    kvb_cuda_engine_attention_describe(cuda_of(e)->ce, buf, cap);
}

static void cuda_stats(kvb_prefill_engine *e, kvb_prefill_stats *out) {
    prefill_cuda *pc = cuda_of(e);
    kvb_cuda_stats cs;
    kvb_cuda_engine_stats(pc->ce, &cs);
    *out = (kvb_prefill_stats){.weight_bytes = cs.weight_bytes,
                               .kv_bytes = cs.kv_bytes,
                               .act_bytes = cs.act_bytes,
                               .dev_total_bytes = cs.dev_total_bytes,
                               .dev_peak_used_bytes = cs.dev_peak_used_bytes,
                               .staging_bytes = pc->bc ? kvb_bridge_cuda_pinned_bytes(pc->bc) : 0,
                               .last_gated_gpu_s = cs.last_gated_gpu_s};
}

static kvb_status cuda_seq_create(kvb_prefill_engine *e, void **seq, kvb_err *err) {
    return kvb_cuda_seq_create(cuda_of(e)->ce, (kvb_cuda_seq **)seq, err);
}

static void cuda_seq_free(void *seq) { kvb_cuda_seq_free(seq); }

static kvb_status cuda_attach_cached(void *seq, const int32_t *tokens, uint32_t n, uint32_t *n_cached, kvb_err *err) {
    const double t0 = kvb_now_s();
    kvb_status st = kvb_cuda_seq_attach_cached(seq, tokens, n, n_cached, err);
    kvb_trace_span("prefill.cuda_attach", t0, kvb_now_s(), st ? 0 : *n_cached);
    return st;
}

/* The forward, then the bridge's last layers' rows shipped (or dropped after a failure). */
static kvb_status cuda_forward(kvb_prefill_engine *e, void *seq, const int32_t *tokens, uint32_t n, float *logits,
                               bool all_logits, kvb_err *err) {
    prefill_cuda *pc = cuda_of(e);
    const double t0 = kvb_now_s();
    kvb_status st = kvb_cuda_forward(pc->ce, seq, tokens, n, logits, all_logits, err);
    if (!pc->bc) return st;
    const double t1 = kvb_now_s();
    kvb_trace_span("prefill.cuda_forward", t0, t1, n);
    if (!st) st = kvb_bridge_cuda_flush(pc->bc, err);
    else kvb_bridge_cuda_discard(pc->bc);
    kvb_trace_span("prefill.cuda_flush", t1, kvb_now_s(), 0);
    return st;
}

static kvb_status cuda_set_attention(kvb_prefill_engine *e, kvb_prefill_attention a, kvb_err *err) {
    return kvb_cuda_engine_set_attention(cuda_of(e)->ce, (kvb_cuda_attention)a, err);
}

static kvb_status cuda_gate_next(kvb_prefill_engine *e, int gate_ms, kvb_err *err) {
    return kvb_cuda_engine_gate_next(cuda_of(e)->ce, gate_ms, err);
}

static kvb_status cuda_gemm_ceiling(kvb_prefill_engine *e, int reps, double *median, double *best, kvb_err *err) {
    return kvb_cuda_gemm_bench(kvb_cuda_engine_opts(cuda_of(e)->ce)->device, 8192, 8192, 8192, reps, median, best,
                               err);
}

#define CUDA_OPS(NAME)                                                                                          \
    {                                                                                                           \
        .name = NAME, .free = cuda_free, .describe = cuda_describe, .attention_describe = cuda_attention_describe, \
        .stats = cuda_stats, .seq_create = cuda_seq_create, .seq_free = cuda_seq_free,                          \
        .attach_cached = cuda_attach_cached, .forward = cuda_forward, .set_attention = cuda_set_attention,      \
        .gate_next = cuda_gate_next, .gemm_ceiling = cuda_gemm_ceiling, .rows_stay_put = true,                  \
    }
static const kvb_prefill_engine_ops cuda_ops = CUDA_OPS("cuda");
static const kvb_prefill_engine_ops cuda_tp_ops = CUDA_OPS("cuda-tp");

/* The bridge kernels: one on the engine's device, or one per rank on the device the engine put the
 * rank on, each for its KV heads; buffers for a forward chunk. */
static kvb_status bridges_create(prefill_cuda *pc, const kvb_prefill_opts *o, int gpus, kvb_err *err) {
    const uint32_t chunk = kvb_cuda_engine_opts(pc->ce)->max_batch;
    kvb_status st;
    if (gpus == 1) {
        st = kvb_bridge_cuda_create(pc->m, o->bridge_fmt->dtype, chunk, &pc->bc, err);
        pc->bcr[0] = pc->bc;
    } else {
        int devs[KVB_CUDA_MAX_GPUS];
        const int dev0 = kvb_cuda_engine_opts(pc->ce)->device;
        for (int r = 0; r < gpus; r++) devs[r] = o->tp_one_device ? dev0 : dev0 + r;
        st = kvb_bridge_cuda_create_ranks(pc->m, o->bridge_fmt->dtype, chunk, gpus, devs, pc->bcr, err);
        if (!st) pc->bc = pc->bcr[0];
    }
    if (!st) kvb_bridge_cuda_set_ship(pc->bc, cuda_ship_rows, o->release.wait_sent ? cuda_rows_sent : NULL, pc);
    return st;
}

static kvb_status cuda_open(const kvb_model *m, const kvb_prefill_opts *o, int gpus, kvb_prefill_engine **out,
                            kvb_err *err) {
    *out = NULL;
    prefill_cuda *pc = calloc(1, sizeof *pc);
    if (!pc) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    pc->m = m;
    pc->base.ops = gpus > 1 ? &cuda_tp_ops : &cuda_ops;
    /* the engine first: it checks the GPUs (count, shape splits) and says what is wrong */
    kvb_cuda_opts co = {.max_ctx = o->max_ctx, .max_batch = o->max_batch, .n_threads = o->n_threads,
                        .no_prefix_cache = o->no_prefix_cache, .n_gpus = gpus, .tp_one_device = o->tp_one_device,
                        .hook_every_rank = true, .weights = (kvb_cuda_weights)o->weights,
                        .attention = (kvb_cuda_attention)o->attention,
                        .layer_hook = o->bridge ? cuda_layer_hook : NULL, .layer_hook_ctx = pc};
    kvb_status st = kvb_cuda_engine_create(m, &co, &pc->ce, err);
    if (!st && o->bridge) st = bridges_create(pc, o, gpus, err);
    if (st) {
        cuda_free(&pc->base);
        return st;
    }
    *out = &pc->base;
    return KVB_OK;
}

kvb_status kvb_prefill_cuda_open(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                 kvb_err *err) {
    return cuda_open(m, o, 1, out, err);
}

kvb_status kvb_prefill_cuda_tp_open(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                    kvb_err *err) {
    return cuda_open(m, o, o->gpus, out, err);
}

bool kvb_prefill_cuda_available(char *why, size_t cap) { return kvb_cuda_device_available(why, cap); }

/* ---- the device bridge (`kvbridge verify`) ---------------------------------------------------- */

struct kvb_device_bridge {
    kvb_bridge_cuda *gpu[KVB_CUDA_MAX_GPUS + 1]; /* NULL-terminated: one, or a rank bridge per rank */
};

/* The cutter's producer: every rank bridge writes its KV heads' columns of the rows. */
static kvb_status device_bridge_rows(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                     uint8_t *k_rows, uint8_t *v_rows, kvb_err *err) {
    kvb_status st = KVB_OK;
    for (kvb_bridge_cuda **b = ((kvb_device_bridge *)ctx)->gpu; *b && !st; b++)
        st = kvb_bridge_cuda_layer(*b, layer, pos0, n, h, k_rows, v_rows, err);
    return st;
}

kvb_status kvb_device_bridge_cuda_attach(const kvb_model *decoder, const kvb_kvformat *fmt, uint32_t max_chunk,
                                         int ranks, bool perturbed, kvb_bridge_cpu *cutter, kvb_device_bridge **out,
                                         kvb_err *err) {
    kvb_device_bridge *b = calloc(1, sizeof *b);
    if (!b) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    kvb_status st = ranks > 1 ? kvb_bridge_cuda_create_ranks(decoder, fmt->dtype, max_chunk, ranks, NULL, b->gpu, err)
                              : kvb_bridge_cuda_create(decoder, fmt->dtype, max_chunk, &b->gpu[0], err);
    if (st) {
        free(b);
        return st;
    }
    for (int r = 0; r < ranks; r++) kvb_bridge_cuda_set_perturbed(b->gpu[r], perturbed);
    kvb_bridge_cpu_set_producer(cutter, device_bridge_rows, b);
    *out = b;
    return KVB_OK;
}

void kvb_device_bridge_cuda_free(kvb_device_bridge *b) {
    if (!b) return;
    kvb_bridge_cuda_free(b->gpu[0]); /* and the other ranks' */
    free(b);
}
