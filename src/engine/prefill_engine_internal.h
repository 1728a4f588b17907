/* engine/prefill_engine_internal.h — what a prefill engine implements behind kvb_prefill_engine.h:
 * its table of functions and the state every engine shares (the options, the bridge's range). An
 * implementation embeds kvb_prefill_engine first in its own struct; only the factory
 * (engine/factory.c) calls its open function. */
#ifndef KVB_PREFILL_ENGINE_INTERNAL_H
#define KVB_PREFILL_ENGINE_INTERNAL_H

#include "kvb_prefill_engine.h"

typedef struct {
    const char *name; /* kvb_prefill_engine_name */
    void (*free)(kvb_prefill_engine *e);
    void (*describe)(const kvb_prefill_engine *e, char *buf, size_t cap);
    void (*attention_describe)(const kvb_prefill_engine *e, char *buf, size_t cap);
    void (*stats)(kvb_prefill_engine *e, kvb_prefill_stats *out);
    kvb_pool *(*pool)(kvb_prefill_engine *e); /* NULL: none */
    kvb_status (*seq_create)(kvb_prefill_engine *e, void **seq, kvb_err *err);
    void (*seq_free)(void *seq);
    kvb_status (*attach_cached)(void *seq, const int32_t *tokens, uint32_t n, uint32_t *n_cached, kvb_err *err);
    /* the forward, with the bridge's last rows handed over (or dropped on failure) before it returns */
    kvb_status (*forward)(kvb_prefill_engine *e, void *seq, const int32_t *tokens, uint32_t n, float *logits,
                          bool all_logits, kvb_err *err);
    /* optional (NULL: KVB_ERR_UNSUPPORTED) */
    kvb_status (*set_attention)(kvb_prefill_engine *e, kvb_prefill_attention a, kvb_err *err);
    kvb_status (*gate_next)(kvb_prefill_engine *e, int gate_ms, kvb_err *err);
    kvb_status (*gemm_ceiling)(kvb_prefill_engine *e, int reps, double *median, double *best, kvb_err *err);
    bool rows_stay_put;
} kvb_prefill_engine_ops;

struct kvb_prefill_engine {
    const kvb_prefill_engine_ops *ops;
    kvb_prefill_opts o;       /* as created; o.bridge_fmt points at bridge_fmt */
    kvb_kvformat bridge_fmt;  /* the decoder's format, with a bridge */
    /* kvb_prefill_bridge_begin's: the positions the decoder lacks, and where local layers' rows
     * it keeps begin */
    uint32_t ship_from, ship_to, local_from;
    double last_forward_s; /* kvb_prefill_forward's wall time, the bridge's last rows included */
};

/* The bridge's positions of (layer, [pos0, pos0 + n)): [*lo, *hi), empty when *lo >= *hi (a local
 * layer's rows the decoder does not keep are not computed). */
void kvb_prefill_ship_span(const kvb_prefill_engine *e, uint32_t layer, uint32_t pos0, uint32_t n, uint32_t *lo,
                           uint32_t *hi);

/* The implementations' open functions: e's base is filled by the factory after they return. */
kvb_status kvb_prefill_cpu_open(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                kvb_err *err);
/* engine/cuda/prefill_cuda.c, in a build with CUDA (only the factory calls them, and only there) */
kvb_status kvb_prefill_cuda_open(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                 kvb_err *err);
kvb_status kvb_prefill_cuda_tp_open(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                    kvb_err *err);
bool kvb_prefill_cuda_available(char *why, size_t cap);
kvb_status kvb_device_bridge_cuda_attach(const kvb_model *decoder, const kvb_kvformat *fmt, uint32_t max_chunk,
                                         int ranks, bool perturbed, kvb_bridge_cpu *cutter, kvb_device_bridge **out,
                                         kvb_err *err);
void kvb_device_bridge_cuda_free(kvb_device_bridge *b);

#endif
