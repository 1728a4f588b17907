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
} kvb_cu_moe_weights;

/* The scratch of the MoE MLP for chunks of up to max_n tokens (device unless said). */
typedef struct {
    int X, K, F, E, max_n;
    float *logits;                /* (max_n, X) router logits, then probabilities */
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
 * sum over each token's K routed experts of weight * down(silu(gate h) * up h), h (n, E) bf16 the
 * normed rows. The host waits once on st, for the expert offsets the GEMMs' sizes come from. */
kvb_status kvb_cu_moe_ffn(cublasHandle_t h, cudaStream_t st, const kvb_cu_moe_weights *w, bool norm, const void *hin,
                          int n, float *x, kvb_cu_moe_scratch *s, kvb_cu_moe_gemm path, kvb_err *err);

#endif
