/* engine/cuda/mla.cu — the kernels of DeepSeek's latent attention (deepseek2) in the CUDA engine's
 * prefill, the expanded form (mla.c drives them): the cache row of each token (the normed latent,
 * already bf16, and its roped key part) stored into the latent cache; the queries' rope part
 * rotated and every query rounded to bf16; the latent rows of positions 0 .. n_pos-1 gathered out
 * of the paged cache for the up-projection GEMM; and the per-head keys [k_nope, k_pe] and values
 * [v, zeros] assembled into a one-layer paged K/V scratch that the engine's attention kernel
 * reads (its head size is N + P for keys and values alike, so the values are padded with zeros
 * from Vd to N + P). RoPE rotates pairs (2i, 2i+1) with the engine's tables, each product and sum
 * rounded once (__fmul_rn/__fsub_rn/__fadd_rn) as the CPU engine's kvb_cpu_rope does; the rest
 * are copies. Each kernel has a CPU twin in tests/test_cuda_moe.c. */
#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda_kernels.h"

typedef __nv_bfloat16 bf16;

/* Element i (< P) of a rope part x (P f32) rotated as pairs (2k, 2k+1) with cos/sin (P/2). */
__device__ __forceinline__ float mla_rope_at(const float *x, int i, const float *cs, const float *sn) {
    const int k = i >> 1;
    if ((i & 1) == 0) return __fsub_rn(__fmul_rn(x[i], cs[k]), __fmul_rn(x[i + 1], sn[k]));
    return __fadd_rn(__fmul_rn(x[i - 1], sn[k]), __fmul_rn(x[i], cs[k]));
}

/* Row (layer, pos) of the latent cache. */
__device__ __forceinline__ bf16 *mla_cache_row(const kvb_cu_mla_cache &c, int layer, int pos) {
    const int bt = 1 << c.bt_shift;
    const int blk = c.blocks[pos >> c.bt_shift];
    return (bf16 *)(c.pool + (size_t)blk * c.block_bytes) +
           ((size_t)layer * bt + (size_t)(pos & (bt - 1))) * (size_t)(c.R + c.P);
}

/* Block t: token t's cache row [lat[t][0:R], bf16(rope(c[t][R:R+P]))] at (layer, pos0 + t). */
__global__ void mla_kv_store_kernel(const float *__restrict__ c, const bf16 *__restrict__ lat, int pos0,
                                    const float *__restrict__ rope_cos, const float *__restrict__ rope_sin,
                                    kvb_cu_mla_cache cache, int layer) {
    const int t = blockIdx.x, R = cache.R, P = cache.P, RP = R + P, pos = pos0 + t;
    bf16 *dst = mla_cache_row(cache, layer, pos);
    const bf16 *src = lat + (size_t)t * RP;
    const float *pe = c + (size_t)t * RP + R;
    const float *cs = rope_cos + (size_t)pos * (P / 2), *sn = rope_sin + (size_t)pos * (P / 2);
    for (int i = threadIdx.x; i < RP; i += blockDim.x)
        dst[i] = i < R ? src[i] : __float2bfloat16_rn(mla_rope_at(pe, i - R, cs, sn));
}

extern "C" cudaError_t kvb_cu_mla_kv_store(const float *c, const void *lat, int n, int pos0, const float *rope_cos,
                                           const float *rope_sin, kvb_cu_mla_cache cache, int layer,
                                           cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (cache.R <= 0 || cache.P <= 0 || cache.P % 2 || pos0 < 0 || layer < 0) return cudaErrorInvalidValue;
    mla_kv_store_kernel<<<n, 128, 0, st>>>(c, (const bf16 *)lat, pos0, rope_cos, rope_sin, cache, layer);
    return cudaGetLastError();
}

/* Block (t, h): out[t][h] = [bf16(q[t][h][0:N]), bf16(rope(q[t][h][N:N+P]))]. */
__global__ void mla_q_rope_kernel(const float *__restrict__ q, int H, int N, int P, int pos0,
                                  const float *__restrict__ rope_cos, const float *__restrict__ rope_sin,
                                  bf16 *__restrict__ out) {
    const int t = blockIdx.x / H, K = N + P, pos = pos0 + t;
    const float *src = q + (size_t)blockIdx.x * K;
    bf16 *dst = out + (size_t)blockIdx.x * K;
    const float *cs = rope_cos + (size_t)pos * (P / 2), *sn = rope_sin + (size_t)pos * (P / 2);
    for (int i = threadIdx.x; i < K; i += blockDim.x)
        dst[i] = __float2bfloat16_rn(i < N ? src[i] : mla_rope_at(src + N, i - N, cs, sn));
}

extern "C" cudaError_t kvb_cu_mla_q_rope(const float *q, int n, int H, int N, int P, int pos0, const float *rope_cos,
                                         const float *rope_sin, void *out, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (H <= 0 || N <= 0 || P <= 0 || P % 2 || pos0 < 0) return cudaErrorInvalidValue;
    mla_q_rope_kernel<<<(unsigned)((long long)n * H), 64, 0, st>>>(q, H, N, P, pos0, rope_cos, rope_sin, (bf16 *)out);
    return cudaGetLastError();
}

/* Block p: lat[p] = the cache row (layer, p). */
__global__ void mla_gather_kernel(kvb_cu_mla_cache cache, int layer, bf16 *__restrict__ lat) {
    const int p = blockIdx.x, RP = cache.R + cache.P;
    const bf16 *src = mla_cache_row(cache, layer, p);
    bf16 *dst = lat + (size_t)p * RP;
    for (int i = threadIdx.x; i < RP; i += blockDim.x) dst[i] = src[i];
}

extern "C" cudaError_t kvb_cu_mla_gather(kvb_cu_mla_cache cache, int layer, int n_pos, void *lat, cudaStream_t st) {
    if (n_pos <= 0) return cudaSuccess;
    if (cache.R <= 0 || cache.P <= 0 || layer < 0) return cudaErrorInvalidValue;
    mla_gather_kernel<<<n_pos, 128, 0, st>>>(cache, layer, (bf16 *)lat);
    return cudaGetLastError();
}

/* Block (p, h): head h's key row [up[p][h N .. h N + N), lat[p][R .. R + P)] and value row
 * [up[p][H N + h Vd .. + Vd), zeros] at position p of layer 0 of kv (head size D = N + P). */
__global__ void mla_assemble_kernel(const bf16 *__restrict__ up, const bf16 *__restrict__ lat, int H, int N, int Vd,
                                    int R, int P, kvb_cu_cache kv) {
    const int p = blockIdx.x / H, h = blockIdx.x % H, D = N + P, bt = 1 << kv.bt_shift;
    const bf16 *u = up + (size_t)p * H * (N + Vd);
    const bf16 *pe = lat + (size_t)p * (R + P) + R;
    uint8_t *blk = kv.pool + (size_t)kv.blocks[p >> kv.bt_shift] * kv.block_bytes;
    const size_t tok = (size_t)(p & (bt - 1));
    bf16 *krow = (bf16 *)blk + (((size_t)0 * H + h) * bt + tok) * D;         /* (kv 0, head h) */
    bf16 *vrow = (bf16 *)blk + (((size_t)1 * H + h) * bt + tok) * D;         /* (kv 1, head h) */
    const bf16 zero = __float2bfloat16_rn(0.0f);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        krow[i] = i < N ? u[(size_t)h * N + i] : pe[i - N];
        vrow[i] = i < Vd ? u[(size_t)H * N + (size_t)h * Vd + i] : zero;
    }
}

extern "C" cudaError_t kvb_cu_mla_assemble(const void *up, const void *lat, int n_pos, int H, int N, int Vd, int R,
                                           int P, kvb_cu_cache kv, cudaStream_t st) {
    if (n_pos <= 0) return cudaSuccess;
    if (H <= 0 || N <= 0 || P <= 0 || R <= 0 || Vd <= 0 || Vd > N + P || kv.n_head_kv != H || kv.head_dim != N + P)
        return cudaErrorInvalidValue;
    mla_assemble_kernel<<<(unsigned)((long long)n_pos * H), 64, 0, st>>>((const bf16 *)up, (const bf16 *)lat, H, N, Vd,
                                                                       R, P, kv);
    return cudaGetLastError();
}
