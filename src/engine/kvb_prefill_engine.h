/* engine/kvb_prefill_engine.h — one prefill engine, whatever computes it: a table of functions
 * (create/free, forward a chunk, attach a cached prefix, the bridge hooked after every (chunk,
 * layer), stats, name and device) behind an opaque handle, chosen once by the factory
 * (engine/factory.c) from kvb_prefill_opts.device and .gpus: the CPU engine, the CUDA engine on one
 * GPU, or the CUDA engine tensor-parallel over several. Callers (the prefill node, `run`, `bench
 * prefill`) hold a kvb_prefill_engine and never ask which one it is; what differs between engines
 * is answered here as a capability (a function an engine lacks returns KVB_ERR_UNSUPPORTED with a
 * message). A build without CUDA answers KVB_ERR_UNSUPPORTED for the CUDA device, saying how to
 * build with it.
 *
 * The bridge: with opts.bridge set, every (chunk, layer) of a forward hands the decoder's cache
 * rows for the positions named by the last kvb_prefill_bridge_begin to that kvb_bridge_cpu, which
 * cuts them into slabs for its sink. On the CPU the bridge computes them from the engine's
 * attention inputs (decoder mode) or re-encodes the engine's own rows (engine_rows, the prefill
 * bridge mode); on a GPU a bridge kernel computes them on the device (decoder mode only), each
 * tensor-parallel rank its own KV heads, and the rows reach the cutter from pinned host slots
 * one layer late. Such rows stay where they lie until `release` says they were sent
 * (kvb_prefill_rows_stay_put); kvb_prefill_forward returns once every row of the forward was
 * handed to the cutter. */
#ifndef KVB_PREFILL_ENGINE_H
#define KVB_PREFILL_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_bridge.h"
#include "kvb_core.h"
#include "kvb_kvformat.h"
#include "kvb_model.h"

/* The most tensor-parallel ranks (GPUs) one engine takes. */
#define KVB_PREFILL_MAX_GPUS 8

typedef enum { KVB_DEVICE_CPU = 0, KVB_DEVICE_CUDA = 1 } kvb_device;

/* Attention on a GPU engine's global layers (numbered as kvb_cuda_attention). */
typedef enum {
    KVB_PREFILL_ATTN_AUTO = 0, /* the engine's choice (cuDNN's fused attention when it loads) */
    KVB_PREFILL_ATTN_OWN,      /* the engine's own flash-attention kernel */
    KVB_PREFILL_ATTN_CUDNN,    /* cuDNN's fused attention */
} kvb_prefill_attention;

/* How a GPU engine keeps its weights (numbered as kvb_cuda_weights and the CLI's --gpu-weights). */
typedef enum {
    KVB_PREFILL_WEIGHTS_AUTO = 0, /* bf16 when it fits, else packed */
    KVB_PREFILL_WEIGHTS_BF16,
    KVB_PREFILL_WEIGHTS_PACKED,
} kvb_prefill_weights;

/* Rows that stay put (kvb_prefill_rows_stay_put): after the cutter took a batch of them, mark(ctx)
 * names the point of the sink's queue just past their slabs; wait_sent(ctx, mark) returns once
 * every slab up to it has left, and the engine reuses the rows' memory only then. mark NULL: the
 * sink is done with a slab when it returns. */
typedef struct {
    uint64_t (*mark)(void *ctx);
    kvb_status (*wait_sent)(void *ctx, uint64_t mark, kvb_err *err);
    void *ctx;
} kvb_rows_release;

typedef struct {
    kvb_device device;
    int n_threads;           /* CPU: compute threads; GPU: host threads converting weights (0 = all) */
    uint32_t cache_dtype;    /* CPU: the engine's own cache dtype (a GPU engine caches bf16) */
    uint32_t block_tokens;   /* CPU: tokens per cache block (0 = the engine's default) */
    uint32_t max_ctx;        /* tokens per sequence (0 = the engine's default) */
    uint32_t max_batch;      /* tokens per forward chunk (0 = the engine's default: 512 CPU, 8192 GPU) */
    uint32_t n_blocks;       /* CPU: blocks in the engine's store (0 = one max_ctx sequence) */
    bool prefault;           /* CPU: read every weight page at creation, not on the first forward */
    bool no_prefix_cache;    /* GPU: every prompt computed cold (benchmarks) */
    int gpus;                /* GPU: tensor-parallel ranks, 1..KVB_PREFILL_MAX_GPUS (0 = 1) */
    bool tp_one_device;      /* GPU, gpus > 1: every rank on one device (tests the split) */
    kvb_prefill_weights weights;
    kvb_prefill_attention attention;
    /* the bridge, or NULL: the decoder's rows through this cutter (the caller keeps it alive) */
    kvb_bridge_cpu *bridge;
    const kvb_kvformat *bridge_fmt; /* with bridge: the decoder's cache format (copied) */
    bool bridge_engine_rows; /* CPU only: re-encode the engine's own rows (bridge mode `prefill`) */
    bool ggml_arith;         /* CPU only: the llama.cpp fidelity level (kvb_engine_opts.ggml_arith), the
                                bridge's rows too (kvb_bridge_cpu_set_ggml) */
    kvb_rows_release release; /* with bridge, where rows stay put */
} kvb_prefill_opts;

typedef struct {
    uint64_t weight_bytes, kv_bytes, act_bytes; /* device bytes (0 on the CPU) */
    uint64_t dev_total_bytes;     /* the device's memory (0 on the CPU) */
    uint64_t dev_peak_used_bytes; /* the most seen in use on the device since creation (0 on the CPU) */
    uint64_t staging_bytes;       /* host memory the bridge's rows stay in (pinned slots; 0 on the CPU) */
    double last_forward_s;        /* wall time of the last kvb_prefill_forward (the bridge's last rows included) */
    double last_gated_gpu_s;      /* after kvb_prefill_engine_gate_next's forward: the device's time */
    int host_threads;             /* threads computing on the host (the CPU engine's; 0 on a device) */
    uint64_t cache_evictions;     /* CPU: blocks the engine's prefix cache evicted to make room */
} kvb_prefill_stats;

typedef struct kvb_prefill_engine kvb_prefill_engine;
typedef struct kvb_prefill_seq kvb_prefill_seq;

/* True when `device` can run here; otherwise false with the reason in why. */
bool kvb_prefill_device_available(kvb_device device, char *why, size_t cap);
/* The factory: the engine for o->device and o->gpus. KVB_ERR_UNSUPPORTED for a device this build
 * lacks or an option the device does not take. */
kvb_status kvb_prefill_engine_create(const kvb_model *m, const kvb_prefill_opts *o, kvb_prefill_engine **out,
                                     kvb_err *err);
void kvb_prefill_engine_free(kvb_prefill_engine *e);
/* "cpu", "cuda" or "cuda-tp". */
const char *kvb_prefill_engine_name(const kvb_prefill_engine *e);
/* CPU: "16 threads, avx2 kernels"; GPU: the device, its memory and the weights' form. */
void kvb_prefill_engine_describe(const kvb_prefill_engine *e, char *buf, size_t cap);
/* GPU: the attention in use ("cuDNN 9.13.0 fused attention", ...); CPU: the engine's own. */
void kvb_prefill_engine_attention_describe(const kvb_prefill_engine *e, char *buf, size_t cap);
void kvb_prefill_engine_stats(kvb_prefill_engine *e, kvb_prefill_stats *out);
/* The CPU engine's thread pool, idle between forwards (a sampler may use it there); else NULL. */
kvb_pool *kvb_prefill_engine_pool(kvb_prefill_engine *e);
/* Whether the bridge's rows stay where they lie until released (opts.release), rather than being
 * reused as soon as the cutter returns. */
bool kvb_prefill_rows_stay_put(const kvb_prefill_engine *e);

/* A sequence: its tokens and their K/V in the engine's cache. */
kvb_status kvb_prefill_seq_create(kvb_prefill_engine *e, kvb_prefill_seq **out, kvb_err *err);
void kvb_prefill_seq_free(kvb_prefill_seq *s);
/* On an empty sequence: adopts the longest cached chain of full blocks for tokens[0 .. n-2];
 * *n_cached = tokens now in the sequence; the caller forwards tokens[*n_cached .. n). */
kvb_status kvb_prefill_seq_attach_cached(kvb_prefill_seq *s, const int32_t *tokens, uint32_t n, uint32_t *n_cached,
                                         kvb_err *err);

/* The next forwards ship positions [ship_from, ship_to) through the bridge to sink (local
 * sliding-window layers from kvb_kvformat_local_keep_from(bridge_fmt, ship_to) on); ship_from ==
 * ship_to: the bridge idles. No-op without a bridge. */
void kvb_prefill_bridge_begin(kvb_prefill_engine *e, uint32_t ship_from, uint32_t ship_to, kvb_slab_sink sink,
                              void *sink_ctx);
/* Runs tokens[0..n) at the sequence's next positions, in chunks of max_batch; logits NULL, or
 * (n_vocab) for the last token, or with all_logits (n, n_vocab). With the bridge: returns once
 * every row of the forward was handed to the cutter (or, on failure, dropped). */
kvb_status kvb_prefill_forward(kvb_prefill_engine *e, kvb_prefill_seq *s, const int32_t *tokens, uint32_t n,
                               float *logits, bool all_logits, kvb_err *err);

/* ---- what benchmarks ask of a GPU engine (KVB_ERR_UNSUPPORTED elsewhere) ---------------------- */
/* Switches global layers' attention (side-by-side timing). */
kvb_status kvb_prefill_engine_set_attention(kvb_prefill_engine *e, kvb_prefill_attention a, kvb_err *err);
/* The next forward waits behind a gate opened after gate_ms, so the device's own time for it is
 * measured (stats.last_gated_gpu_s). */
kvb_status kvb_prefill_engine_gate_next(kvb_prefill_engine *e, int gate_ms, kvb_err *err);
/* The device's bf16 GEMM ceiling, 8192^3 through cuBLAS, reps timed products: TFLOP/s. */
kvb_status kvb_prefill_engine_gemm_ceiling(kvb_prefill_engine *e, int reps, double *tflops_median,
                                           double *tflops_best, kvb_err *err);

/* ---- the bridge alone on a device (`kvbridge verify`) ----------------------------------------
 * The decoder's rows computed by `device`'s bridge kernel (ranks > 1: that many tensor-parallel
 * rank bridges, each its KV heads) instead of the cutter's own CPU arithmetic: attached to `cutter`
 * with kvb_bridge_cpu_set_producer. Free it after the cutter's last use. */
typedef struct kvb_device_bridge kvb_device_bridge;
kvb_status kvb_device_bridge_attach(kvb_device device, const kvb_model *decoder, const kvb_kvformat *fmt,
                                    uint32_t max_chunk, int ranks, bool perturbed, kvb_bridge_cpu *cutter,
                                    kvb_device_bridge **out, kvb_err *err);
void kvb_device_bridge_free(kvb_device_bridge *b);

#endif
