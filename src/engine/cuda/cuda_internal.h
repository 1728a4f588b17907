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

#endif
