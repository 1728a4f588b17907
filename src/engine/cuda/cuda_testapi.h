/* engine/cuda/cuda_testapi.h — the CUDA engine's kernel entry points for tests, kept out of the
 * engine's public header: each runs one of the engine's kernels on host buffers (testapi.c). Only
 * testapi.c and the GPU tests (tests/test_cuda_*.c) include it; no production path calls these. */
#ifndef KVB_CUDA_TESTAPI_H
#define KVB_CUDA_TESTAPI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_model.h"
#include "moe_math.h"

/* ---- kernel entry points for tests --------------------------------------------------------
 * Each copies its host inputs AND the current contents of its host outputs (so poison set by the
 * caller reaches the device) to the device, runs one kernel, and copies the outputs back. bf16
 * values are raw uint16_t bits. Not for production paths (they allocate and synchronise). */

/* x (n, E) f32 = table[tok[t]] (V, E) bf16 widened, times scale unless scale == 0. */
kvb_status kvb_cuda_test_embed(const uint16_t *table, uint32_t V, uint32_t E, const int32_t *tok, uint32_t n,
                               float scale, float *x, kvb_err *err);
/* With y: y (n, E) bf16 = bf16((x * (1/sqrtf(mean(x^2) + eps))) * w); with acc instead (gemma3's
 * post norm): acc (n, E) f32 += the same values unrounded; x (n, E) f32. */
kvb_status kvb_cuda_test_rmsnorm(const float *x, uint32_t n, uint32_t E, const float *w, float eps, uint16_t *y,
                                 float *acc, kvb_err *err);
/* out (n, FF) bf16 = bf16(silu(g) * u), or with gelu bf16(gelu_tanh(g) * u), with gu (n, 2*FF) bf16
 * rows [g | u]. */
kvb_status kvb_cuda_test_glu(const uint16_t *gu, uint32_t n, uint32_t FF, bool gelu, uint16_t *out, kvb_err *err);
/* y (n, rows) f32 = beta * y + W x for W (rows, cols) bf16 and x (n, cols) bf16, through the
 * engine's cuBLAS call. y_bf16: write bf16 (then beta must be 0). */
kvb_status kvb_cuda_test_gemm(const uint16_t *W, uint32_t rows, uint32_t cols, const uint16_t *x, uint32_t n,
                              float beta, void *y, bool y_bf16, kvb_err *err);

/* The paged cache as tests see it: n_pool_blocks blocks of the kvformat layout (BF16). */
typedef struct {
    uint8_t *pool;           /* host copy (n_pool_blocks * block_bytes) */
    uint32_t n_pool_blocks;
    const int32_t *blocks;   /* the sequence's block table */
    uint32_t n_table;
    uint32_t block_tokens;   /* power of two */
    uint32_t n_layer, n_head_kv, head_dim;
} kvb_cuda_test_cache;

/* The fused QKV epilogue: for token t (position pos0 + t) and each of the H + 2*Hkv head slots of
 * qkv (n, (H + 2*Hkv) * D) f32: v = qkv + bias (if bias); q/k slots: rmsnorm with q_norm/k_norm
 * (if given), RoPE (neox or pairs) with rope_cos/sin (rows = positions 0 .., n_rot/2 columns);
 * q slots -> q_out (n, H*D) bf16; k and v slots -> the cache rows of layer `layer` (bf16). */
typedef struct {
    const float *qkv;
    uint32_t n, H, Hkv, D, n_rot;
    bool neox;
    const float *bias, *q_norm, *k_norm; /* may be NULL */
    float eps;
    const float *rope_cos, *rope_sin;    /* (pos0 + n, n_rot/2) */
    uint32_t pos0, layer;
    uint16_t *q_out;
    kvb_cuda_test_cache cache;           /* pool updated in place */
} kvb_cuda_test_qkv_args;
kvb_status kvb_cuda_test_qkv_post(const kvb_cuda_test_qkv_args *a, kvb_err *err);

/* out (n, H*D) bf16 = causal attention of q (n, H*D) bf16 at positions pos0 .. pos0+n-1 over the
 * cache's K/V of `layer` for positions 0 .. pos0+n-1 (window > 0: only keys k with p - k < window);
 * scores times scale (0: 1/sqrt(D)); GQA head h -> h/(H/Hkv). variant 0: the engine's choice
 * (tensor-core kernel for D = 64 or 128), 1: the generic kernel, 2 / 3: the tensor-core kernel with
 * 64 / 128 query rows per CTA, 4: cuDNN's fused attention after the K/V gather (window must be 0;
 * KVB_ERR_UNSUPPORTED when cuDNN cannot be loaded or has no engine for the shape). */
kvb_status kvb_cuda_test_attention(const uint16_t *q, uint32_t n, uint32_t H, uint32_t pos0, uint32_t layer,
                                   uint32_t window, float scale, const kvb_cuda_test_cache *cache, int variant,
                                   uint16_t *out, kvb_err *err);
/* k_out, v_out (Hkv, n_pos, D) bf16 = the cache's K and V rows of `layer` for positions 0 ..
 * n_pos-1 (the gather that feeds cuDNN's attention). */
/* The engine's choice of kernel over a sequence of calls through one cuDNN attention object
 * (query capacity max_q, key capacity max_kv): for call i, took[i] = whether cuDNN takes a chunk of
 * n[i] queries at pos0[i] of a model with layers[i] global layers (kvb_cudnn_attn_take), then
 * out[i] (n[i], H*D) bf16 = its attention from q[i] over the cache's `layer` on cuDNN or, when not
 * taken, the engine's kernel; *plans = execution plans built over the sequence. */
kvb_status kvb_cuda_test_cudnn_sequence(const kvb_cuda_test_cache *cache, uint32_t layer, uint32_t H, uint32_t max_q,
                                        uint32_t max_kv, uint32_t calls, const uint32_t *n, const uint32_t *pos0,
                                        const uint32_t *layers, const uint16_t *const *q, uint16_t *const *out,
                                        bool *took, uint32_t *plans, kvb_err *err);
kvb_status kvb_cuda_test_gather_kv(const kvb_cuda_test_cache *cache, uint32_t layer, uint32_t n_pos, uint16_t *k_out,
                                   uint16_t *v_out, kvb_err *err);
/* out (rows, cols) bf16 = the packed-weight expansion of src (rows, src_row_bytes) of `type`
 * (what the engine runs before each layer with KVB_CUDA_WEIGHTS_PACKED); cols % 32 == 0. */
kvb_status kvb_cuda_test_expand_bf16(uint32_t type, const void *src, size_t src_row_bytes, uint32_t rows,
                                     uint32_t cols, uint16_t *out, kvb_err *err);

/* ---- mixtures of experts ------------------------------------------------------------------- */

/* The router kernel: logits (n, X) f32 replaced by each row's softmax; sel (n, K) the top K experts
 * (largest first, the lower index on a tie), w (n, K) their probabilities, divided by their sum when
 * norm. */
kvb_status kvb_cuda_test_moe_route(float *logits, uint32_t n, uint32_t X, uint32_t K, bool norm, int32_t *sel,
                                   float *w, kvb_err *err);
/* The router kernel as cfg routes (moe_math.h): logits (n, X) replaced by the probabilities, bias (X)
 * the selection bias or NULL, sel and w (n, K) as above. */
kvb_status kvb_cuda_test_moe_route_cfg(float *logits, const float *bias, uint32_t n, uint32_t X, uint32_t K,
                                       const kvb_moe_route_cfg *cfg, int32_t *sel, float *w, kvb_err *err);
/* The permutation and gather: off (X + 1) each expert's first position in the grouped order, slot
 * (n K) the (token, rank) slots t*K + k in that order (slot order within an expert), inv (n K) each
 * slot's position, xp (n K, E) bf16 row p = h (n, E) bf16 row slot[p] / K; E % 8 == 0. */
kvb_status kvb_cuda_test_moe_permute(const int32_t *sel, uint32_t n, uint32_t K, uint32_t X, const uint16_t *h,
                                     uint32_t E, int32_t *off, int32_t *slot, int32_t *inv, uint16_t *xp, kvb_err *err);
/* The weighted un-permute: x (n, E) f32 += sum over k in rank order of w[t,k] y[inv[t K + k]], y
 * (n K, E) f32, or bf16 (raw bits) when y_bf16. */
kvb_status kvb_cuda_test_moe_unpermute(const void *y, bool y_bf16, const int32_t *inv, const float *w, uint32_t n,
                                       uint32_t K, uint32_t E, float *x, kvb_err *err);
/* One layer's experts in bf16 (raw bits): router (X, E); gu (X 2F, E), expert x's gate rows then its
 * up rows at x 2F; down (X E, F). */
typedef struct {
    const uint16_t *router, *gu, *down;
    uint32_t X, K, F, E;
    bool norm;
} kvb_cuda_test_moe_w;
/* The engine's whole MoE MLP (kvb_cu_moe_ffn): x (n, E) f32 += the routed experts' weighted outputs
 * of h (n, E) bf16, the expert GEMMs looped per expert or grouped; sel, wts (n, K) the routing it
 * used. */
kvb_status kvb_cuda_test_moe_ffn(const kvb_cuda_test_moe_w *w, const uint16_t *h, uint32_t n, bool grouped, float *x,
                                 int32_t *sel, float *wts, kvb_err *err);

/* ---- latent attention (mla.cu) -------------------------------------------------------------- */

/* The latent cache as tests see it: n_pool_blocks blocks of the mla kvformat layout (BF16), each
 * n_layer * block_tokens rows of R + P. */
typedef struct {
    uint8_t *pool;           /* host copy (n_pool_blocks * block bytes) */
    uint32_t n_pool_blocks;
    const int32_t *blocks;   /* the sequence's block table */
    uint32_t n_table;
    uint32_t block_tokens;   /* power of two */
    uint32_t n_layer, R, P;
} kvb_cuda_test_mla_cache;
/* The cache rows (layer, pos0 + t), t < n, = [lat[t][0 : R], bf16(rope(c[t][R : R + P]))] (c (n,
 * R + P) f32, lat (n, R + P) bf16; rope_cos/sin (pos0 + n, P/2)); pool updated in place. */
kvb_status kvb_cuda_test_mla_kv_store(const float *c, const uint16_t *lat, uint32_t n, uint32_t pos0,
                                      const float *rope_cos, const float *rope_sin, uint32_t layer,
                                      kvb_cuda_test_mla_cache *cache, kvb_err *err);
/* out (n, H, N + P) bf16 = per head [bf16(q_nope), bf16(rope(q_pe))] of q (n, H, N + P) f32. */
kvb_status kvb_cuda_test_mla_q_rope(const float *q, uint32_t n, uint32_t H, uint32_t N, uint32_t P, uint32_t pos0,
                                    const float *rope_cos, const float *rope_sin, uint16_t *out, kvb_err *err);
/* The expansion's copies: lat (n_pos, R + P) = the cache rows of `layer` for positions 0 .. n_pos-1
 * (the gather), then the assembled K and V read back as k_out, v_out (H, n_pos, N + P) bf16 from up
 * (n_pos, H (N + Vd)) bf16 and lat (kvb_cu_mla_assemble's layout). */
kvb_status kvb_cuda_test_mla_expand(const kvb_cuda_test_mla_cache *cache, uint32_t layer, uint32_t n_pos,
                                    const uint16_t *up, uint32_t H, uint32_t N, uint32_t Vd, uint16_t *lat,
                                    uint16_t *k_out, uint16_t *v_out, kvb_err *err);
/* One latent attention layer as the engine runs it (weights through kvb_cu_mla_weights_upload, the
 * cache rows, then the attention, mla.c), over n tokens at positions 0 .. n-1 fed in chunks of
 * `chunk`: h (n, E) bf16 the normed attention inputs; x (n, E) f32 += the attention's output; rows
 * (n, R + P) bf16 the latent cache rows it wrote. */
kvb_status kvb_cuda_test_mla_layer(const kvb_model *m, uint32_t layer, const uint16_t *h, uint32_t n, uint32_t chunk,
                                   float *x, uint16_t *rows, kvb_err *err);

#endif
