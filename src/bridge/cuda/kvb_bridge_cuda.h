/* bridge/cuda/kvb_bridge_cuda.h — the bridge kernel on the GPU: the decoder's cache-producing
 * arithmetic (kvb_kv_produce, specified in engine/cpu/kvb_engine_cpu.h) with the DECODER's K/V
 * weights in their own file type (Q8_0 weights against Q8_0-quantised activations, integer block
 * sums), reproduced bit for bit on the device. Attention inputs (n, n_embd) f32 go in; K and V
 * rows (n, n_head_kv, row_bytes) in the decoder's cache dtype come out — for deepseek2 (latent
 * attention) one latent row per token (n, 1, row_bytes of R + P values: the normed latent and
 * the roped key part) as the K rows, and no V rows (v_rows is never written; it may be NULL).
 * Plain C; every CUDA call checked. */
#ifndef KVB_BRIDGE_CUDA_H
#define KVB_BRIDGE_CUDA_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_model.h"

typedef struct kvb_bridge_cuda kvb_bridge_cuda;

/* Uploads every layer's K/V weights, biases and k-norm (deepseek2: attn_kv_a_mqa and
 * attn_kv_a_norm) of `decoder`; buffers for max_tokens
 * positions per call. cache_dtype: F32, F16, BF16 or Q8_0. */
kvb_status kvb_bridge_cuda_create(const kvb_model *decoder, uint32_t cache_dtype, uint32_t max_tokens,
                                  kvb_bridge_cuda **out, kvb_err *err);
/* Tensor-parallel prefill: n_ranks (2..8) bridges, out[r] on devices[r] computing KV heads
 * [r Hkv / n_ranks, (r+1) Hkv / n_ranks) (none for some ranks when Hkv < n_ranks). Each rank's
 * engine thread calls kvb_bridge_cuda_enqueue on its own bridge with its own attention input (every
 * rank's is the same); the rows land at their heads' place in out[0]'s pinned slots, and out[0]
 * ships a slot once every rank has filled it — the slab sequence one bridge would ship, bit for bit.
 * set_ship, flush, discard, pinned_bytes and free go to out[0] (free releases every rank's). Needs
 * the shipping thread (not KVB_BRIDGE_SHIPPER=0). kvb_bridge_cuda_layer on out[r] writes only its
 * heads' columns of k_rows/v_rows. devices NULL: ranks on devices 0 .. n_ranks-1 when the host
 * has that many, else all on the current device. */
kvb_status kvb_bridge_cuda_create_ranks(const kvb_model *decoder, uint32_t cache_dtype, uint32_t max_tokens,
                                        int n_ranks, const int *devices, kvb_bridge_cuda **out, kvb_err *err);
void kvb_bridge_cuda_free(kvb_bridge_cuda *b);
/* Test-only: the K projection as dot(first half) + dot(second half), as the CPU's test_perturb. */
void kvb_bridge_cuda_set_perturbed(kvb_bridge_cuda *b, bool perturbed);
/* h (n, n_embd) f32 host memory, positions pos0 .. pos0+n-1 -> k_rows, v_rows (n, n_head_kv,
 * row_bytes) host memory. */
kvb_status kvb_bridge_cuda_layer(kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                 uint8_t *k_rows, uint8_t *v_rows, kvb_err *err);

/* ---- the prefill node's path: attention inputs already on the device ------------------------
 * The CUDA engine's layer hook hands over d_h (n, n_embd) f32 in device memory on its stream.
 * kvb_bridge_cuda_enqueue queues the bridge kernels on that stream and copies the rows into one
 * of the pinned host slots (two; KVB_BRIDGE_SLOTS=N, 2..8, for N), then ships the PREVIOUS
 * call's rows (waiting for their copy, which was queued before the previous layer's own compute)
 * through the ship callback — so the host
 * cuts and sends layer L's slabs while the GPU computes layer L. kvb_bridge_cuda_flush ships what
 * is still pending, in order; call it after the forward. Staging memory is the slots
 * (kvb_bridge_cuda_pinned_bytes), whatever the prompt length. By default a thread of the bridge
 * ships instead, so the hook returns at once and the engine's thread keeps the stream full
 * (KVB_BRIDGE_SHIPPER=0: the engine's thread ships inline, as described first). The ship callback
 * then runs on that thread; a failure it returns comes back from the next enqueue, or from flush.
 * The callback may return before the rows have left: it then sets *ticket to a nonzero value, and
 * the slot stays taken until `sent` (ctx, ticket) has returned. The shipping thread calls it once
 * the NEXT slot's rows were handed to the callback (or at flush, discard and free), so the rows of
 * two layers can be queued at once and the link never waits for the slot's hand-back. *ticket 0
 * (or sent NULL): the slot is free again when the callback returns. */
typedef kvb_status (*kvb_bridge_rows_ship)(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n,
                                           const uint8_t *k_rows, const uint8_t *v_rows, uint64_t *ticket,
                                           kvb_err *err);
typedef kvb_status (*kvb_bridge_rows_sent)(void *ctx, uint64_t ticket, kvb_err *err);
void kvb_bridge_cuda_set_ship(kvb_bridge_cuda *b, kvb_bridge_rows_ship fn, kvb_bridge_rows_sent sent, void *ctx);
kvb_status kvb_bridge_cuda_enqueue(kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, const float *d_h,
                                   void *stream, kvb_err *err);
kvb_status kvb_bridge_cuda_flush(kvb_bridge_cuda *b, kvb_err *err);
/* Drops what is pending without shipping it (after a failed forward). */
void kvb_bridge_cuda_discard(kvb_bridge_cuda *b);
size_t kvb_bridge_cuda_pinned_bytes(const kvb_bridge_cuda *b);

#endif
