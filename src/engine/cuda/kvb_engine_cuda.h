/* engine/cuda — the CUDA engine: bf16 weights on the GPU (files of every type the quant module
 * decodes — F32/F16/BF16/Q8_0/Q4_0/Q5_0/Q4_K/Q5_K/Q6_K — are converted at load; or, for a model
 * whose bf16 form does not fit, kept packed in the file's type and expanded a layer at a time:
 * kvb_cuda_weights), cuBLAS GEMMs
 * (bf16 operands, f32 accumulation), fused kernels (RMSNorm, bias + q/k-norm + RoPE + cache write,
 * SwiGLU or GeGLU; the residual add rides on the GEMM epilogue, or on gemma3's post norms) and
 * a causal flash-attention kernel (tensor cores, online softmax; a sliding window on gemma3's
 * local layers) over a paged bf16 KV cache that may already hold a prefix. Architectures: llama,
 * qwen2, qwen3, gemma3, and qwen3moe on one GPU (as the CPU engine reads them: kvb_model_desc; a
 * mixture of experts' MLP is moe_ffn.c's: router, tokens permuted by expert, a cuBLAS GEMM per
 * expert or one grouped GEMM, KVB_CUDA_MOE_GEMM=loop|grouped, weighted un-permute). Long prompts run in chunks of max_batch tokens, so activation memory
 * is fixed at creation, whatever the prompt length. Filled blocks are indexed under their chain
 * keys (the store module's kvb_chain_root / kvb_chain_next, rooted in the model and cache-format
 * fingerprints), so a prompt that extends a cached prefix computes only the new part.
 *
 * This header is plain C and includes no CUDA header. Every CUDA and cuBLAS call is checked; a
 * failure comes back as a kvb_status with a message naming the call and the CUDA error; nothing
 * here exits. The engine runs on one stream; calls on one engine must not overlap.
 *
 * Cache layout: kvformat's (layer, k_or_v, kv_head, token, head_dim) per block, dtype BF16.
 * Arithmetic (what "bf16 forward" means here, so tolerances can be argued):
 *   x (residual stream)  f32 on the device; embedding rows are the bf16 weights widened (gemma3:
 *                        times sqrtf(n_embd), one f32 product)
 *   h = rmsnorm(x) * w   f32 math, rounded to bf16 (GEMM operand); norm weights as the file stores
 *                        them (gemma3's include their +1, see model/desc.c)
 *   qkv = W_qkv h        bf16 x bf16, f32 accumulate, f32 out; + bias (f32); q/k-norm in f32;
 *                        RoPE from kvb_rope_table (one host table per kind of layer — gemma3's
 *                        local layers have their own base — products rounded, no fma);
 *                        q rounded to bf16, K and V rounded to bf16 into the cache
 *   attention            bf16 Q.K^T and P.V on tensor cores with f32 accumulation, scores times
 *                        the description's attn_scale, f32 online softmax (P rounded to bf16 for
 *                        the P.V product), output rounded to bf16; on a local layer the query at
 *                        p reads keys k with p - k < swa_window
 *   x += W_o att         f32 out, residual added in the GEMM (beta = 1); gemma3: o = W_o att in
 *                        f32, x += rmsnorm(o) * post_attention_norm in f32
 *   g|u = W_gu h         bf16 out; a = silu(g) * u (gemma3: gelu_tanh(g) * u, the CPU engine's
 *                        formula) in f32, rounded to bf16; x += W_down a (f32; gemma3 through the
 *                        post-MLP norm like the attention branch)
 *   qwen3moe's MLP       router logits = W_r h (f32 out); softmax, top-k, renormalised in f32
 *                        (moe_math.h, the CPU engine's order); per routed expert g|u and a as
 *                        above, y = W_down a in f32 (grouped GEMMs: rounded to bf16); x += the
 *                        k weighted y summed in rank order, each product and sum rounded once
 *   logits = W_out rmsnorm(x)   f32 out (W_out = the embedding table when the file ties them) */
#ifndef KVB_ENGINE_CUDA_H
#define KVB_ENGINE_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_kvformat.h"
#include "kvb_model.h"

/* Called once per (chunk, layer) after the layer's attention input is computed and before its
 * Q/K/V projection is enqueued: d_h (n, n_embd) f32 in DEVICE memory — rmsnorm(x) * attn_norm
 * before the engine rounds it to bf16 — for positions pos0 .. pos0+n-1. Work the hook enqueues on
 * `stream` (the engine's cudaStream_t) sees d_h; the engine overwrites it after the hook returns,
 * in stream order. A non-OK status aborts the forward with that status. */
typedef kvb_status (*kvb_cuda_layer_hook)(void *ctx, int rank, uint32_t layer, uint32_t pos0, uint32_t n,
                                          const float *d_h, void *stream, kvb_err *err);

/* The most tensor-parallel ranks (GPUs) one engine takes. */
#define KVB_CUDA_MAX_GPUS 8

/* Which attention runs on global layers (sliding-window layers always use the engine's kernel). */
typedef enum {
    KVB_CUDA_ATTN_AUTO = 0, /* KVB_CUDA_ATTENTION from the environment (own|cudnn) if set, else cuDNN's
                               fused attention when libcudnn.so.9 loads and the head size is 64 or
                               128 (the sizes its test covers), else the engine's kernel */
    KVB_CUDA_ATTN_OWN,      /* the engine's flash-attention kernel (attention.cu) */
    KVB_CUDA_ATTN_CUDNN,    /* cuDNN's fused attention; creation fails when cuDNN cannot be loaded */
} kvb_cuda_attention;

/* How the weight matrices live on the GPU. Either way each GEMM reads the same bf16 values (the
 * CPU's conversion of the file's type), so the results are the same bits. */
typedef enum {
    KVB_CUDA_WEIGHTS_AUTO = 0, /* bf16 when the bf16 weights, the KV cache and the activations fit the
                                  device's free memory with 2 GiB (or 5 %) to spare, else packed
                                  (with tp_one_device each rank counts on 1/n_gpus of the device) */
    KVB_CUDA_WEIGHTS_BF16,     /* every matrix converted to bf16 on the host at load */
    KVB_CUDA_WEIGHTS_PACKED,   /* matrices copied in the file's type (F32, F16, BF16, Q8_0, Q4_0, Q5_0,
                                  Q4_K, Q5_K, Q6_K), each layer's expanded into one bf16 set on the
                                  device just before the layer runs: a Q4_0 file takes ~0.28x the
                                  memory of its bf16 form, for one expansion per layer and chunk */
} kvb_cuda_weights;

typedef struct {
    int device;            /* CUDA device ordinal (default 0) */
    uint32_t block_tokens; /* tokens per cache block: a power of two in [16, 1024]; 0 = 64 */
    uint32_t max_ctx;      /* max tokens per sequence; 0 = min(training context, 8192) */
    uint32_t n_blocks;     /* cache blocks on the GPU; 0 = enough for one max_ctx sequence */
    uint32_t max_batch;    /* tokens per forward chunk (activation memory grows with it); 0 = 8192 */
    bool no_prefix_cache;  /* true: filled blocks are not indexed (every prompt computed cold) */
    int n_threads;         /* host threads for converting weights at load; 0 = all CPUs */
    kvb_cuda_layer_hook layer_hook; /* the bridge (prefill node), or NULL */
    void *layer_hook_ctx;
    bool hook_every_rank;  /* tensor parallel: call the hook on every rank's thread (rank = its index,
                              d_h and stream on its device), not on rank 0's only */
    kvb_cuda_attention attention;   /* after creation: OWN or CUDNN, the one in use */
    int n_gpus;            /* tensor-parallel ranks, 1..8 (0 = 1): see "Tensor parallelism" below */
    bool tp_one_device;    /* n_gpus > 1: every rank on `device`, summed by the engine itself (testing
                              the split on a one-GPU host); else ranks on device .. device+n_gpus-1
                              through NCCL */
    kvb_cuda_weights weights; /* after creation: BF16 or PACKED, the one in use (rank 0's) */
    bool tp_overlap;       /* n_gpus > 1: each all-reduce runs on a second stream of the rank, and the
                              O and down projections of a chunk of 64+ rows run in two halves of
                              rows, the first half's all-reduce beside the second half's GEMM; off
                              by default until measured on several GPUs (KVB_TP_OVERLAP=1 turns it
                              on wherever the engine is created) */
} kvb_cuda_opts;

/* Tensor parallelism (n_gpus = N > 1). One host thread per rank drives that rank's GPU; rank r
 * holds heads [r H/N, (r+1) H/N), KV heads [r Hkv/N, (r+1) Hkv/N) (their Q/K/V rows, bias and
 * cache) and MLP columns [r FF/N, (r+1) FF/N) (gate/up rows, down columns), and the O and down
 * projections' matching input columns. After each of those two row-parallel GEMMs one all-reduce
 * (f32, NCCL's or the engine's own) sums the ranks' partial products, so the residual stream x is
 * the same on every rank, bit for bit; rank 0 adds x itself (beta = 1) and the others contribute
 * only their products (gemma3: the branch output is summed before its post norm). Embeddings,
 * norms and RoPE tables are on every rank; the output head and the logits on rank 0. The layer
 * hook runs on rank 0 only (its attention input is every rank's), or with hook_every_rank on each
 * rank (the tensor-parallel bridge: each rank its KV heads). Callers see one engine:
 * kvb_cuda_engine_kvformat describes the whole model's cache; sequences, prefix caching and
 * forward behave as with one GPU. Needs H and FF divisible by N, and Hkv divisible by N or N by
 * Hkv (then each KV head is computed and cached on the N/Hkv ranks whose query heads read it). A layer hook's error stops
 * further hook calls, lets the forward finish in lockstep, and is returned at its end; any other
 * failure on a rank aborts the all-reduce and leaves the engine refusing further work. */

typedef struct kvb_cuda_engine kvb_cuda_engine;
typedef struct kvb_cuda_seq kvb_cuda_seq;

/* True when a CUDA device can be used; otherwise false with the reason in why (e.g. "no CUDA
 * device: CUDA driver version is insufficient for CUDA runtime version"). */
bool kvb_cuda_device_available(char *why, size_t cap);

kvb_status kvb_cuda_engine_create(const kvb_model *m, const kvb_cuda_opts *o, kvb_cuda_engine **out, kvb_err *err);
void kvb_cuda_engine_free(kvb_cuda_engine *e);
const kvb_kvformat *kvb_cuda_engine_kvformat(const kvb_cuda_engine *e);
/* The options after defaults were applied. */
const kvb_cuda_opts *kvb_cuda_engine_opts(const kvb_cuda_engine *e);
/* Switches global layers between the engine's kernel and cuDNN's (for side-by-side benchmarks);
 * CUDNN fails with the reason when cuDNN was not loaded at creation. */
kvb_status kvb_cuda_engine_set_attention(kvb_cuda_engine *e, kvb_cuda_attention a, kvb_err *err);
/* "cuDNN 9.13.0 fused attention" or "own flash-attention kernel (cuDNN: <why not>)" */
void kvb_cuda_engine_attention_describe(const kvb_cuda_engine *e, char *buf, size_t cap);
/* "NVIDIA H200, 132 SMs, 139.8 GiB; weights 15.0 GiB bf16, KV 4.0 GiB (512 blocks of 64 tokens)" */
void kvb_cuda_engine_describe(const kvb_cuda_engine *e, char *buf, size_t cap);

/* A sequence: its tokens and their K/V in blocks of the engine's GPU pool. */
kvb_status kvb_cuda_seq_create(kvb_cuda_engine *e, kvb_cuda_seq **out, kvb_err *err);
void kvb_cuda_seq_free(kvb_cuda_seq *s); /* releases its blocks (indexed ones stay cached) */
uint32_t kvb_cuda_seq_len(const kvb_cuda_seq *s);
/* On an empty sequence: adopts the longest cached chain of full blocks for tokens[0 .. n-2] (the
 * last token is always computed, so its logits exist). *n_cached = tokens now in the sequence (a
 * multiple of block_tokens); the caller forwards tokens[*n_cached .. n). */
kvb_status kvb_cuda_seq_attach_cached(kvb_cuda_seq *s, const int32_t *tokens, uint32_t n, uint32_t *n_cached,
                                      kvb_err *err);

/* Runs tokens[0..n) at positions seq_len .. seq_len+n-1 in chunks of max_batch, appending their
 * K/V to the sequence. logits: NULL, or (n_vocab) floats for the last token, or when all_logits
 * (n, n_vocab) for every token. Returns when the logits are on the host. */
kvb_status kvb_cuda_forward(kvb_cuda_engine *e, kvb_cuda_seq *s, const int32_t *tokens, uint32_t n, float *logits,
                            bool all_logits, kvb_err *err);

typedef struct {
    size_t weight_bytes;     /* device bytes of weights */
    size_t kv_bytes;         /* device bytes of the KV pool */
    size_t act_bytes;        /* device bytes of activations, tables and workspaces */
    size_t dev_total_bytes;  /* the device's memory */
    size_t dev_used_bytes;   /* in use now on the device (cudaMemGetInfo; all processes; with tensor
                                parallelism rank 0's device, weight/kv/act bytes summed over ranks) */
    size_t dev_peak_used_bytes; /* the most seen in use at the end of a forward since creation */
    uint32_t n_blocks, free_blocks, cached_blocks; /* cached: indexed blocks no sequence holds */
    uint64_t prefix_hit_tokens; /* tokens adopted from the cache by attach_cached, in total */
    double last_forward_s;   /* wall time of the last kvb_cuda_forward */
    double last_enqueue_s;   /* of which the host spent enqueueing (close to last_forward_s when
                                the GPU is the bottleneck: the launch queue fills and blocks) */
    double last_gated_gpu_s; /* after a gated forward (kvb_cuda_engine_gate_next): the GPU's time for
                                the work enqueued behind the gate, run back to back; else 0 */
} kvb_cuda_stats;

/* Diagnostics for the host-side overhead (launch gaps and host work) of a forward: the next
 * kvb_cuda_forward enqueues a gate kernel first, so the GPU waits while the host enqueues the
 * whole forward; a helper thread opens the gate after gate_ms milliseconds (choose it longer
 * than the enqueueing), and CUDA events time what follows. 1 - last_gated_gpu_s / (an ungated
 * forward's wall time) is the share of a forward the GPU spends waiting for the host. The gated
 * forward's own wall time includes the wait and means nothing. */
kvb_status kvb_cuda_engine_gate_next(kvb_cuda_engine *e, int gate_ms, kvb_err *err);
void kvb_cuda_engine_stats(kvb_cuda_engine *e, kvb_cuda_stats *out);

/* The bf16 GEMM ceiling: C(m,n) = A(m,k) B(k,n) in bf16 with f32 accumulation through cuBLAS on
 * random data, reps timed products (CUDA events, after warm-up). */
kvb_status kvb_cuda_gemm_bench(int device, int m, int n, int k, int reps, double *tflops_median,
                               double *tflops_best, kvb_err *err);

#endif
