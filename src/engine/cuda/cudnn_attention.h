/* engine/cuda/cudnn_attention.h — private to the CUDA engine (not a contract): causal attention
 * for a chunk of queries through cuDNN's fused flash attention (the backend graph API, C),
 * the alternative to our own kernel (attention.cu) that the engine measures against it.
 *
 * cuDNN is loaded at run time (dlopen of libcudnn.so.9), so the binary runs without it; where it
 * is missing or has no engine for a shape, run returns KVB_ERR_UNSUPPORTED with the reason and the
 * engine falls back to its own kernel. The paged cache is not addressable by one stride per
 * dimension, so each call first gathers the layer's K and V rows for positions 0 .. pos0+n-1
 * into contiguous scratch (kv_head, token, head_dim) — a copy that costs ~1 % of the attention
 * it feeds at 32K tokens (measured in bench/RESULTS.md). Execution plans are built per (query
 * rows, key rows) shape, ~50 ms of host time each, for the chunks kvb_cudnn_attn_take gives to
 * cuDNN, and kept (a few dozen; the oldest is dropped; a shape whose plan cannot be built is
 * remembered and refused). Global layers only: a
 * sliding-window layer is refused (UNSUPPORTED). Arithmetic: bf16 Q.K^T and P.V with f32
 * accumulation, scores times scale, f32 softmax, P rounded to bf16, output bf16 — the same
 * contract as our kernel; the order of accumulation is cuDNN's. */
#ifndef KVB_CUDNN_ATTENTION_H
#define KVB_CUDNN_ATTENTION_H

#include <stdbool.h>
#include <stdint.h>

#include "cuda_kernels.h"
#include "kvb_core.h"

typedef struct kvb_cudnn_attn kvb_cudnn_attn;

/* Loads cuDNN and creates a handle bound to stream st, with K/V scratch for up to max_kv
 * positions of Hkv heads of head_dim D (2 * max_kv * Hkv * D bf16; *scratch_bytes set). max_q:
 * the most query rows a call may have. */
kvb_status kvb_cudnn_attn_create(cudaStream_t st, int Hkv, int D, uint32_t max_q, uint32_t max_kv,
                                 kvb_cudnn_attn **out, size_t *scratch_bytes, kvb_err *err);
void kvb_cudnn_attn_free(kvb_cudnn_attn *a);

/* "cuDNN 9.19.0 fused attention (12 execution plans built, 0.842 s)": the version and the plans
 * built so far with the host time they took (one per new shape). Valid until the next call. */
const char *kvb_cudnn_attn_describe(kvb_cudnn_attn *a);

/* Execution plans built so far. */
uint32_t kvb_cudnn_attn_plans_built(const kvb_cudnn_attn *a);

/* A chunk's attention work at which its plan is built at first sight: cuDNN's gain in that one
 * chunk then about pays for the ~50 ms the plan takes to build (measured on the H200: the 1B shape
 * saves ~9 ms per 8K chunk from position 0 and ~60 ms per 8K chunk at 32K, 4.4e12 and 3.1e13
 * flops over its 16 layers). */
#define KVB_CUDNN_EAGER_FLOPS 2.5e13

/* Whether a chunk of n queries at pos0 (H heads, `layers` layers) should run on cuDNN: yes when
 * its shape has a plan, when its attention work is at least KVB_CUDNN_EAGER_FLOPS, when the shape
 * was declined once before (it recurs: its plan pays), or with KVB_CUDNN_PLANS=eager; else no, and
 * the shape is remembered (the newest 256). A plan takes ~50 ms of host time to build, more than a
 * short chunk's whole attention: a conversation turn or the last chunk of a prompt of a new length
 * then runs on the engine's own kernel instead of waiting for it. Call once per chunk, then
 * kvb_cudnn_attn_run for each of its layers when it says yes. */
bool kvb_cudnn_attn_take(kvb_cudnn_attn *a, int H, int n, int pos0, int layers);

/* a->out (n, H*D) bf16 = causal attention of a->q (n, H*D) bf16 at positions pos0 .. pos0+n-1
 * over the cache's layer a->layer (window must be 0), enqueued on the handle's stream. */
kvb_status kvb_cudnn_attn_run(kvb_cudnn_attn *a, const kvb_cu_attn_args *args, kvb_err *err);

#endif
