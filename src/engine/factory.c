/* engine/factory.c — the one place that chooses a prefill engine: the CPU engine, the CUDA engine
 * on one GPU, or the CUDA engine tensor-parallel over several (kvb_prefill_opts.device and .gpus),
 * and the device bridge `kvbridge verify` runs; a build without CUDA says so here, and how to build
 * with it. Everything else reaches the engine it was given through kvb_prefill_engine.h's table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_engine_internal.h"

#define NO_CUDA_MSG                                                                                              \
    "this kvbridge was built without CUDA (configure with -DKVB_CUDA=ON where nvcc is installed, e.g. "          \
    "cmake -S . -B build -DKVB_CUDA=ON)"

bool kvb_prefill_device_available(kvb_device device, char *why, size_t cap) {
    if (device == KVB_DEVICE_CPU) return true;
#ifdef KVB_HAVE_CUDA
    if (device == KVB_DEVICE_CUDA) return kvb_prefill_cuda_available(why, cap);
#endif
    if (cap) snprintf(why, cap, "%s", device == KVB_DEVICE_CUDA ? NO_CUDA_MSG : "unknown device");
    return false;
}

/* The open function for o's device and rank count, or a status saying why there is none. */
static kvb_status pick_engine(const kvb_prefill_opts *o,
                              kvb_status (**open)(const kvb_model *, const kvb_prefill_opts *, kvb_prefill_engine **,
                                                  kvb_err *),
                              kvb_err *err) {
    if (o->gpus < 0 || o->gpus > KVB_PREFILL_MAX_GPUS)
        return kvb_err_set(err, KVB_ERR_INVALID, "%d GPUs: at most %d", o->gpus, KVB_PREFILL_MAX_GPUS);
    if (o->device == KVB_DEVICE_CPU) {
        if (o->gpus > 1 || o->tp_one_device)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "tensor parallelism (--gpus) needs the CUDA device");
        *open = kvb_prefill_cpu_open;
        return KVB_OK;
    }
    if (o->device != KVB_DEVICE_CUDA) return kvb_err_set(err, KVB_ERR_INVALID, "unknown device %d", (int)o->device);
    if (o->ggml_arith)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "--kv-arith ggml (llama.cpp's CPU arithmetic) runs on the CPU engine "
                                                     "only");
#ifdef KVB_HAVE_CUDA
    if (o->bridge && o->bridge_engine_rows)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "bridge mode prefill is not available with --device cuda (use decoder mode)");
    *open = o->gpus > 1 ? kvb_prefill_cuda_tp_open : kvb_prefill_cuda_open;
    return KVB_OK;
#else
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "--device cuda: %s", NO_CUDA_MSG);
#endif
}

kvb_status kvb_prefill_engine_create(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                     kvb_err *err) {
    *out = NULL;
    kvb_status (*open)(const kvb_model *, const kvb_prefill_opts *, kvb_prefill_engine **, kvb_err *) = NULL;
    kvb_status st = pick_engine(o, &open, err);
    if (st) return st;
    if (o->bridge && !o->bridge_fmt)
        return kvb_err_set(err, KVB_ERR_INVALID, "a bridge needs the decoder's cache format");
    kvb_prefill_engine *e = NULL;
    if ((st = open(m, o, &e, err))) return st;
    e->o = *o;
    if (o->bridge) {
        e->bridge_fmt = *o->bridge_fmt;
        e->o.bridge_fmt = &e->bridge_fmt;
    }
    *out = e;
    return KVB_OK;
}

void kvb_prefill_engine_free(kvb_prefill_engine *e) {
    if (e) e->ops->free(e);
}

const char *kvb_prefill_engine_name(const kvb_prefill_engine *e) { return e->ops->name; }

void kvb_prefill_engine_describe(const kvb_prefill_engine *e, char *buf, size_t cap) { e->ops->describe(e, buf, cap); }

void kvb_prefill_engine_attention_describe(const kvb_prefill_engine *e, char *buf, size_t cap) {
    e->ops->attention_describe(e, buf, cap);
}

void kvb_prefill_engine_stats(kvb_prefill_engine *e, kvb_prefill_stats *out) {
    memset(out, 0, sizeof *out);
    e->ops->stats(e, out);
    out->last_forward_s = e->last_forward_s;
}

kvb_pool *kvb_prefill_engine_pool(kvb_prefill_engine *e) { return e->ops->pool ? e->ops->pool(e) : NULL; }

bool kvb_prefill_rows_stay_put(const kvb_prefill_engine *e) { return e->ops->rows_stay_put; }

struct kvb_prefill_seq {
    kvb_prefill_engine *e;
    void *impl;
};

kvb_status kvb_prefill_seq_create(kvb_prefill_engine *e, kvb_prefill_seq **out, kvb_err *err) {
    *out = NULL;
    kvb_prefill_seq *s = calloc(1, sizeof *s);
    if (!s) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    s->e = e;
    kvb_status st = e->ops->seq_create(e, &s->impl, err);
    if (st) {
        free(s);
        return st;
    }
    *out = s;
    return KVB_OK;
}

void kvb_prefill_seq_free(kvb_prefill_seq *s) {
    if (!s) return;
    s->e->ops->seq_free(s->impl);
    free(s);
}

kvb_status kvb_prefill_seq_attach_cached(kvb_prefill_seq *s, const int32_t *tokens, uint32_t n, uint32_t *n_cached,
                                         kvb_err *err) {
    return s->e->ops->attach_cached(s->impl, tokens, n, n_cached, err);
}

void kvb_prefill_bridge_begin(kvb_prefill_engine *e, uint32_t ship_from, uint32_t ship_to, kvb_slab_sink sink,
                              void *sink_ctx) {
    if (!e->o.bridge) return;
    e->ship_from = ship_from;
    e->ship_to = ship_to;
    e->local_from = ship_to > ship_from ? kvb_kvformat_local_keep_from(&e->bridge_fmt, ship_to) : 0;
    kvb_bridge_cpu_begin(e->o.bridge, ship_from, ship_to, sink, sink_ctx);
}

void kvb_prefill_ship_span(const kvb_prefill_engine *e, uint32_t layer, uint32_t pos0, uint32_t n, uint32_t *lo,
                           uint32_t *hi) {
    const uint32_t from = kvb_kvformat_layer_local(&e->bridge_fmt, layer) && e->local_from > e->ship_from
                              ? e->local_from
                              : e->ship_from;
    *lo = pos0 > from ? pos0 : from;
    *hi = pos0 + n < e->ship_to ? pos0 + n : e->ship_to;
}

kvb_status kvb_prefill_forward(kvb_prefill_engine *e, kvb_prefill_seq *s, const int32_t *tokens, uint32_t n,
                               float *logits, bool all_logits, kvb_err *err) {
    const double t0 = kvb_now_s();
    kvb_status st = e->ops->forward(e, s->impl, tokens, n, logits, all_logits, err);
    e->last_forward_s = kvb_now_s() - t0;
    return st;
}

/* What a capability an engine lacks answers. */
static kvb_status unsupported(const kvb_prefill_engine *e, const char *what, kvb_err *err) {
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "the %s engine has no %s (a GPU engine's)", e->ops->name, what);
}

kvb_status kvb_prefill_engine_set_attention(kvb_prefill_engine *e, kvb_prefill_attention a, kvb_err *err) {
    return e->ops->set_attention ? e->ops->set_attention(e, a, err) : unsupported(e, "attention choice", err);
}

kvb_status kvb_prefill_engine_gate_next(kvb_prefill_engine *e, int gate_ms, kvb_err *err) {
    return e->ops->gate_next ? e->ops->gate_next(e, gate_ms, err) : unsupported(e, "gated forward", err);
}

kvb_status kvb_prefill_engine_gemm_ceiling(kvb_prefill_engine *e, int reps, double *tflops_median,
                                           double *tflops_best, kvb_err *err) {
    *tflops_median = *tflops_best = 0;
    return e->ops->gemm_ceiling ? e->ops->gemm_ceiling(e, reps, tflops_median, tflops_best, err)
                                : unsupported(e, "GEMM ceiling", err);
}

kvb_status kvb_device_bridge_attach(kvb_device device, const kvb_model *decoder, const kvb_kvformat *fmt,
                                    uint32_t max_chunk, int ranks, bool perturbed, kvb_bridge_cpu *cutter,
                                    kvb_device_bridge **out, kvb_err *err) {
    *out = NULL;
    if (ranks < 1 || ranks > KVB_PREFILL_MAX_GPUS)
        return kvb_err_set(err, KVB_ERR_INVALID, "--gpus %d: 1 to %d", ranks, KVB_PREFILL_MAX_GPUS);
    if (device != KVB_DEVICE_CUDA)
        return kvb_err_set(err, KVB_ERR_INVALID, "a device bridge runs on a GPU (the CPU bridge is the cutter's own)");
#ifdef KVB_HAVE_CUDA
    return kvb_device_bridge_cuda_attach(decoder, fmt, max_chunk, ranks, perturbed, cutter, out, err);
#else
    (void)decoder, (void)fmt, (void)max_chunk, (void)perturbed, (void)cutter;
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "the CUDA bridge: %s", NO_CUDA_MSG);
#endif
}

void kvb_device_bridge_free(kvb_device_bridge *b) {
#ifdef KVB_HAVE_CUDA
    kvb_device_bridge_cuda_free(b);
#else
    (void)b; /* none can exist */
#endif
}
