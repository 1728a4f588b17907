/* engine/cuda/cuda_internal.h — private to the CUDA engine's host files (not a contract): error
 * helpers that turn CUDA/cuBLAS failures into kvb_status + message, and the one GEMM call. */
#ifndef KVB_CUDA_INTERNAL_H
#define KVB_CUDA_INTERNAL_H

#include <stdbool.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "cuda_kernels.h"
#include "kvb_engine_cuda.h"

/* Sets err: "CUDA: <what> failed: <name> (<string>) at file:line"; NOMEM for allocation failures. */
kvb_status kvb_cu_fail(kvb_err *err, cudaError_t e, const char *what, const char *file, int line);
kvb_status kvb_cublas_fail(kvb_err *err, cublasStatus_t s, const char *what, const char *file, int line);

/* Returns from the enclosing function (which has a kvb_err *err) on failure. */
#define KVB_CU(call)                                                                                           \
    do {                                                                                                       \
        cudaError_t kvb_e_ = (call);                                                                           \
        if (kvb_e_ != cudaSuccess) return kvb_cu_fail(err, kvb_e_, #call, __FILE__, __LINE__);                 \
    } while (0)
/* Sets st and jumps to fail on failure. */
#define KVB_CU_GOTO(call)                                                                                      \
    do {                                                                                                       \
        cudaError_t kvb_e_ = (call);                                                                           \
        if (kvb_e_ != cudaSuccess) {                                                                           \
            st = kvb_cu_fail(err, kvb_e_, #call, __FILE__, __LINE__);                                          \
            goto fail;                                                                                         \
        }                                                                                                      \
    } while (0)

/* Y (n, rows) = beta * Y + W X^T for W (rows, cols) bf16 row-major and X (n, cols) bf16 row-major:
 * cuBLAS column-major "TN" with f32 compute; Y is f32, or bf16 when y_bf16 (beta must be 0). */
kvb_status kvb_cu_gemm(cublasHandle_t h, const void *W, int rows, int cols, const void *X, int n, float beta, void *Y,
                       bool y_bf16, kvb_err *err);
/* The same with X's rows ldx elements apart (ldx >= cols): X's first cols columns. */
kvb_status kvb_cu_gemm_ldx(cublasHandle_t h, const void *W, int rows, int cols, const void *X, int ldx, int n,
                           float beta, void *Y, bool y_bf16, kvb_err *err);

/* ---- mixtures of experts (moe_ffn.c) ---------------------------------------------------------- */

/* How the experts' GEMMs run: one cuBLAS GEMM per non-empty expert on the engine's stream (LOOP,
 * expert outputs in f32), or one cublasGemmGroupedBatchedEx per projection over the non-empty
 * experts (GROUPED, cuBLAS 12.5+; its bf16 GEMMs write bf16, so the expert outputs are rounded to
 * bf16 before the weighted sum). KVB_CUDA_MOE_GEMM=loop|grouped chooses; loop by default. */
typedef enum { KVB_CU_MOE_LOOP = 0, KVB_CU_MOE_GROUPED = 1 } kvb_cu_moe_gemm;
/* The path KVB_CUDA_MOE_GEMM names (unset or empty: LOOP); INVALID for another value. */
kvb_status kvb_cu_moe_gemm_from_env(kvb_cu_moe_gemm *out, kvb_err *err);
const char *kvb_cu_moe_gemm_name(kvb_cu_moe_gemm g);

/* One layer's experts in bf16 on the device: router (X, E); gu (X * 2F, E), expert x's gate rows at
 * [x 2F, x 2F + F) and its up rows after them (one GEMM gives the SwiGLU kernel its [g | u] rows);
 * down (X * E, F), expert x's rows at [x E, (x + 1) E). */
typedef struct {
    const void *router, *gu, *down;
    const float *bias; /* (X) f32 the selection bias (exp_probs_b, DeepSeek-V3), or NULL */
} kvb_cu_moe_weights;

/* The scratch of the MoE MLP for chunks of up to max_n tokens (device unless said). */
typedef struct {
    int X, K, F, E, max_n;
    float *logits;                /* (max_n, X) router logits, then probabilities */
    float *score;                 /* (max_n, X) selection scores (bias, groups) */
    float *w;                     /* (max_n, K) routing weights */
    int32_t *sel, *slot, *inv;    /* (max_n K) */
    int32_t *cnt, *off;           /* (X), (X + 1) */
    int32_t *h_off;               /* pinned host (X + 1): off, read after the layer's one wait */
    void *xp;                     /* (max_n K, E) bf16 normed rows, grouped by expert */
    void *gup;                    /* (max_n K, 2F) bf16 [g | u] */
    void *actp;                   /* (max_n K, F) bf16 SwiGLU */
    void *yp;                     /* (max_n K, E) f32 (loop) or bf16 (grouped) expert outputs */
    void **d_ptrs;                /* (6 X) grouped: the A, B, C pointer arrays of both projections */
    void **h_ptrs;                /* pinned host (6 X): their staging */
    int *h_dims;                  /* host (8 X) grouped: m, n, k, lda, ldb, ldc, group size; ops */
    float *h_scal;                /* host (2 X) grouped: alpha, beta */
    cublasOperation_t *h_ops;     /* host (2 X) grouped: transa, transb */
} kvb_cu_moe_scratch;

/* Allocates s for chunks of max_n tokens of X experts top-K of inner size F on embedding E, its
 * device bytes added to *acct. kvb_cu_moe_scratch_free releases what was allocated. */
kvb_status kvb_cu_moe_scratch_alloc(kvb_cu_moe_scratch *s, int max_n, int X, int K, int F, int E, size_t *acct,
                                    kvb_err *err);
void kvb_cu_moe_scratch_free(kvb_cu_moe_scratch *s);
/* Device bytes kvb_cu_moe_scratch_alloc takes for these sizes. */
size_t kvb_cu_moe_scratch_bytes(int max_n, int X, int K, int F, int E);

/* The MoE MLP of n <= max_n tokens, queued on st (cuBLAS handle h bound to st): x (n, E) f32 +=
 * sum over each token's K routed experts (routed as route says) of weight * down(silu(gate h) *
 * up h), h (n, E) bf16 the normed rows. The host waits once on st, for the expert offsets the
 * GEMMs' sizes come from. */
kvb_status kvb_cu_moe_ffn(cublasHandle_t h, cudaStream_t st, const kvb_cu_moe_weights *w,
                          const kvb_moe_route_cfg *route, const void *hin, int n, float *x, kvb_cu_moe_scratch *s,
                          kvb_cu_moe_gemm path, kvb_err *err);
/* How model d routes its tokens (moe_math.h), from its description. */
kvb_moe_route_cfg kvb_cu_moe_route_cfg_of(const kvb_model_desc *d);

/* ---- DeepSeek's latent attention (mla.c) ------------------------------------------------------
 * H = n_head, R = n_lora_kv, P = n_rot, K = head_dim_k_mla (N = K - P nope), Vd = head_dim_v_mla,
 * QL = n_lora_q, E = n_embd; the attention runs with head size D = K for keys and (zero-padded)
 * values alike. */

/* One layer's attention weights on the device (bf16 unless said). */
typedef struct {
    void *wq_a;       /* (QL, E) attn_q_a, or NULL without a query latent (V2-Lite) */
    float *q_a_norm;  /* (QL) f32, or NULL likewise */
    void *wq;         /* (H K, QL) attn_q_b, or (H K, E) attn_q without a query latent */
    void *wkv_a;      /* (R + P, E) attn_kv_a_mqa */
    float *kv_a_norm; /* (R) f32 */
    void *wkv_b;      /* (H (N + Vd), R): row h N + j = column j of head h's attn_k_b (R, N) (its key
                         up-projection transposed), then row H N + h Vd + i = attn_v_b's row h Vd + i */
    void *wo;         /* (E, H D): attn_output's columns h Vd .. h Vd + Vd - 1 at h D, zeros after */
} kvb_cu_mla_weights;

/* The latent attention's scratch for chunks of max_n tokens and contexts of max_ctx (device). */
typedef struct {
    int max_n, max_ctx;
    float *qa;     /* (max_n, QL) f32 query latent (q_lora only) */
    void *qa_h;    /* (max_n, QL) normed */
    float *q;      /* (max_n, H K) f32 queries */
    void *qr;      /* (max_n, H D) roped queries */
    float *c;      /* (max_n, R + P) f32 kv_a projection */
    void *cn;      /* (max_n, R + P) its normed latent in the first R */
    void *lat;     /* (max_ctx, R + P) latent rows of positions 0 .. */
    void *up;      /* (max_ctx, H (N + Vd)) keys' nope parts, then values */
    void *att;     /* (max_n, H D) attention output */
    kvb_cu_cache kv; /* one layer of expanded K/V, (2, H, max_ctx, D) in blocks; its own identity table */
} kvb_cu_mla_scratch;

/* Device bytes of one layer's kvb_cu_mla_weights, and of the scratch for these sizes. */
size_t kvb_cu_mla_weight_bytes(const kvb_model_desc *d);
size_t kvb_cu_mla_scratch_bytes(const kvb_model_desc *d, int max_n, int max_ctx, int block_tokens);
/* Allocates s, its device bytes added to *acct; kvb_cu_mla_scratch_free releases what was allocated. */
kvb_status kvb_cu_mla_scratch_alloc(kvb_cu_mla_scratch *s, const kvb_model_desc *d, int max_n, int max_ctx,
                                    int block_tokens, size_t *acct, kvb_err *err);
void kvb_cu_mla_scratch_free(kvb_cu_mla_scratch *s);
void kvb_cu_mla_weights_free(kvb_cu_mla_weights *w);
/* Layer weights w of model d converted to bf16 (as the engine converts every weight: kvb_row_to_f32,
 * then kvb_f32_to_bf16; rows split over pool, which may be NULL) and uploaded in mw's layout, the
 * device bytes added to *acct; on failure mw holds nothing. */
kvb_status kvb_cu_mla_weights_upload(const kvb_model_desc *d, const kvb_layer_weights *w, kvb_pool *pool,
                                     kvb_cu_mla_weights *mw, size_t *acct, kvb_err *err);
/* Whether the engine can run model d's latent attention; err says why not. */
kvb_status kvb_cu_mla_check(const kvb_model_desc *d, kvb_err *err);

/* The cache rows of n tokens at pos0 (h (n, E) bf16, the normed attention inputs) into `layer` of
 * the latent cache: c = W_kv_a h, the latent RMS-normed (bf16), the rope part rotated. */
kvb_status kvb_cu_mla_cache_rows(cublasHandle_t cb, cudaStream_t st, const kvb_model_desc *d,
                                 const kvb_cu_mla_weights *w, const void *h, int n, int pos0, const float *rope_cos,
                                 const float *rope_sin, kvb_cu_mla_cache cache, int layer, kvb_cu_mla_scratch *s,
                                 kvb_err *err);
/* The attention of the same n tokens over positions 0 .. pos0 + n - 1 of `layer` (rows already in
 * the cache): x (n, E) f32 += W_o attention. skip_attention leaves the attention kernel out
 * (diagnostics: KVB_CUDA_DEBUG_SKIP_ATTENTION). */
kvb_status kvb_cu_mla_attend(cublasHandle_t cb, cudaStream_t st, const kvb_model_desc *d, const kvb_cu_mla_weights *w,
                             const void *h, int n, int pos0, const float *rope_cos, const float *rope_sin,
                             kvb_cu_mla_cache cache, int layer, bool skip_attention, float *x, kvb_cu_mla_scratch *s,
                             kvb_err *err);

#endif
