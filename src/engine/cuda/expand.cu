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

/* dst (rows, units * 32) bf16 from src (rows, src_row_bytes) of type T: thread i expands unit
 * i % units of row i / units. */
template <uint32_t T>
__global__ void k_expand_bf16(const uint8_t *__restrict__ src, size_t src_row_bytes, int64_t rows, int64_t units,
                              uint16_t *__restrict__ dst) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * units) return;
    const int64_t r = i / units, u = i % units;
    float v[32];
    kvb_row_unit_to_f32(T, src + (size_t)r * src_row_bytes, u, v);
    uint32_t w[16]; /* two bf16 per word, the lower element in the low half (little endian) */
#pragma unroll
    for (int j = 0; j < 16; j++)
        w[j] = (uint32_t)kvb_f32_to_bf16_inl(v[2 * j]) | (uint32_t)kvb_f32_to_bf16_inl(v[2 * j + 1]) << 16;
    uint4 *out = reinterpret_cast<uint4 *>(dst + (size_t)i * 32); /* 64 bytes, 16-byte aligned */
#pragma unroll
    for (int q = 0; q < 4; q++) out[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
}

template <uint32_t T>
static cudaError_t launch(const void *src, size_t src_row_bytes, int64_t rows, int64_t units, void *dst,
                          cudaStream_t st) {
    const int64_t n = rows * units, per = 256, blocks = (n + per - 1) / per;
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
    k_expand_bf16<T><<<(unsigned)blocks, (unsigned)per, 0, st>>>((const uint8_t *)src, src_row_bytes, rows, units,
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
