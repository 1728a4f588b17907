/* engine/cuda/expand.cu — packed weights expanded to bf16 on the device: a matrix kept in its
 * file's type (Q4_0, Q8_0, Q4_K, ... as the GGUF stores it) becomes the bf16 GEMM operand the
 * engine would have uploaded, one 32-element unit per thread, decoded by the very function the CPU
 * uses (kvb_row_unit_to_f32, kvb_quant_scalar.h) and rounded by kvb_f32_to_bf16_inl, so every
 * expanded value is the same bits as the CPU's conversion at load. Its CPU twin is that conversion
 * (tests/test_cuda_kernels.c). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_kernels.h"
#include "kvb_quant.h"
#include "kvb_quant_scalar.h"

#define EXPAND_THREADS 256
#define EXPAND_PITCH 20 /* u32 words per unit in shared memory: 16 used, padded so that a quarter
                           warp's 16-byte writes and reads fall in different banks */

/* dst (rows, units * 32) bf16 from src (rows, src_row_bytes) of type T: thread i decodes unit
 * i % units of row i / units (units are back to back in dst, rows too). Each warp's 32 units (2 KiB
 * of dst) go through shared memory, so every store instruction writes 512 contiguous bytes
 * instead of 16-byte pieces 64 bytes apart. */
template <uint32_t T>
__global__ void __launch_bounds__(EXPAND_THREADS)
    k_expand_bf16(const uint8_t *__restrict__ src, size_t src_row_bytes, int64_t rows, int64_t units,
                  uint16_t *__restrict__ dst) {
    __shared__ __align__(16) uint32_t tile[EXPAND_THREADS * EXPAND_PITCH];
    const int64_t n = rows * units, i = (int64_t)blockIdx.x * EXPAND_THREADS + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint32_t w[16]; /* two bf16 per word, the lower element in the low half (little endian) */
    if (i < n) {
        float v[32];
        kvb_row_unit_to_f32(T, src + (size_t)(i / units) * src_row_bytes, i % units, v);
#pragma unroll
        for (int j = 0; j < 16; j++)
            w[j] = (uint32_t)kvb_f32_to_bf16_inl(v[2 * j]) | (uint32_t)kvb_f32_to_bf16_inl(v[2 * j + 1]) << 16;
    }
    const int64_t w0 = i - lane; /* the warp's first unit */
    if (w0 + 32 > n) { /* the grid's last, partial warp: each thread stores its own 64 bytes */
        if (i < n) {
            uint4 *out = reinterpret_cast<uint4 *>(dst + (size_t)i * 32);
#pragma unroll
            for (int q = 0; q < 4; q++) out[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        }
        return;
    }
    uint32_t *t = tile + (size_t)warp * 32 * EXPAND_PITCH;
#pragma unroll
    for (int q = 0; q < 4; q++)
        *reinterpret_cast<uint4 *>(t + lane * EXPAND_PITCH + 4 * q) =
            make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    __syncwarp();
    uint4 *out = reinterpret_cast<uint4 *>(dst + (size_t)w0 * 32); /* 128 uint4: unit k, quarter c = 4k + c */
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int k = lane + 32 * q;
        out[k] = *reinterpret_cast<const uint4 *>(t + (k >> 2) * EXPAND_PITCH + 4 * (k & 3));
    }
}

template <uint32_t T>
static cudaError_t launch(const void *src, size_t src_row_bytes, int64_t rows, int64_t units, void *dst,
                          cudaStream_t st) {
    const int64_t n = rows * units, blocks = (n + EXPAND_THREADS - 1) / EXPAND_THREADS;
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
    k_expand_bf16<T><<<(unsigned)blocks, EXPAND_THREADS, 0, st>>>((const uint8_t *)src, src_row_bytes, rows, units,
                                                                 (uint16_t *)dst);
    return cudaGetLastError();
}

extern "C" bool kvb_cu_expand_type_ok(uint32_t type) {
    float v[32];
    const uint8_t zero[256] = {0};
    return kvb_row_unit_to_f32(type, zero, 0, v);
}

extern "C" cudaError_t kvb_cu_expand_bf16(uint32_t type, const void *src, size_t src_row_bytes, int64_t rows,
                                          int64_t cols, void *dst, cudaStream_t st) {
    if (rows < 0 || cols < 0 || cols % 32 || ((uintptr_t)dst & 15)) return cudaErrorInvalidValue;
    if (rows == 0 || cols == 0) return cudaSuccess;
    const int64_t units = cols / 32;
    switch (type) {
    case KVB_TYPE_F32: return launch<KVB_TYPE_F32>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_F16: return launch<KVB_TYPE_F16>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_BF16: return launch<KVB_TYPE_BF16>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_Q8_0: return launch<KVB_TYPE_Q8_0>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_Q4_0: return launch<KVB_TYPE_Q4_0>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_Q5_0: return launch<KVB_TYPE_Q5_0>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_Q4_K: return launch<KVB_TYPE_Q4_K>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_Q5_K: return launch<KVB_TYPE_Q5_K>(src, src_row_bytes, rows, units, dst, st);
    case KVB_TYPE_Q6_K: return launch<KVB_TYPE_Q6_K>(src, src_row_bytes, rows, units, dst, st);
    default: return cudaErrorInvalidValue;
    }
}
