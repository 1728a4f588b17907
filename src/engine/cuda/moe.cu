/* engine/cuda/moe.cu — the mixture-of-experts kernels of the CUDA forward pass (qwen3moe, deepseek2):
 * the router's softmax or sigmoid / selection bias / group-limited top-k / renormalisation and
 * scale (one thread a token, moe_math.h's arithmetic, the CPU engine's order), the permutation of
 * the (token, rank) slots by expert (counts, offsets, and a stable compaction that keeps each
 * expert's slots in slot order, tokens ascending, as the CPU engine's counting sort does), the
 * gather of the normed rows into that order, and the weighted un-permute that adds each token's k
 * expert outputs into the residual stream in rank order (one thread an element: no atomics, the
 * same bits every run). The expert GEMMs between them are cuBLAS's (moe_ffn.c). Each kernel has a
 * CPU twin in tests/test_cuda_moe.c. */
#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda_kernels.h"
#include "moe_math.h"

typedef __nv_bfloat16 bf16;

/* ---- router ------------------------------------------------------------------------------- */

__global__ void moe_route_kernel(float *__restrict__ logits, float *__restrict__ score, const float *__restrict__ bias,
                                 int n, int X, int K, kvb_moe_route_cfg cfg, int32_t *__restrict__ sel,
                                 float *__restrict__ w) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    float *p = logits + (size_t)t * X;
    kvb_moe_route_one_cfg(p, score ? score + (size_t)t * X : p, bias, X, K, &cfg, sel + (size_t)t * K,
                          w + (size_t)t * K);
}

extern "C" cudaError_t kvb_cu_moe_route(float *logits, int n, int X, int K, int norm, int32_t *sel, float *w,
                                        cudaStream_t st) {
    const kvb_moe_route_cfg cfg = {1, norm, 0.0f, 0, 0};
    return kvb_cu_moe_route_cfg(logits, NULL, NULL, n, X, K, &cfg, sel, w, st);
}

extern "C" cudaError_t kvb_cu_moe_route_cfg(float *logits, float *score, const float *bias, int n, int X, int K,
                                            const kvb_moe_route_cfg *cfg, int32_t *sel, float *w, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (X <= 0 || K <= 0 || K > X) return cudaErrorInvalidValue;
    const bool groups = cfg->n_groups > 1;
    if ((bias || groups) && !score) return cudaErrorInvalidValue; /* the scores need their own buffer */
    if (groups && (cfg->n_groups > KVB_MOE_MAX_GROUPS || X % cfg->n_groups || X / cfg->n_groups < 2 ||
                   cfg->n_groups_used < 1 || cfg->n_groups_used > cfg->n_groups))
        return cudaErrorInvalidValue;
    float *sc = bias || groups ? score : NULL;
    moe_route_kernel<<<(n + 127) / 128, 128, 0, st>>>(logits, sc, bias, n, X, K, *cfg, sel, w);
    return cudaGetLastError();
}

/* ---- permutation -------------------------------------------------------------------------- */

#define MOE_PERM_THREADS 256

/* Block x: cnt[x] = the slots routed to expert x. */
__global__ void moe_count_kernel(const int32_t *__restrict__ sel, int n_slots, int32_t *__restrict__ cnt) {
    __shared__ int red[MOE_PERM_THREADS / 32];
    const int x = blockIdx.x;
    int c = 0;
    for (int s = threadIdx.x; s < n_slots; s += blockDim.x) c += sel[s] == x;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int tot = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) tot += red[i];
        cnt[x] = tot;
    }
}

/* off (X + 1): the exclusive prefix sum of cnt, off[X] = every slot. */
__global__ void moe_offsets_kernel(const int32_t *__restrict__ cnt, int X, int32_t *__restrict__ off) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int32_t acc = 0;
    for (int x = 0; x < X; x++) {
        off[x] = acc;
        acc += cnt[x];
    }
    off[X] = acc;
}

#define MOE_FILL_PER 8 /* consecutive slots a thread reads per tile */

/* Block x writes expert x's slots in slot order: slot[off[x] + j] = its j-th slot s, inv[s] = that
 * position. A tile of blockDim * MOE_FILL_PER slots at a time, thread i reading MOE_FILL_PER
 * consecutive ones; its first position from a scan of the threads' counts (within the warp by
 * shuffles, across warps through shared memory). */
__global__ void moe_fill_kernel(const int32_t *__restrict__ sel, int n_slots, const int32_t *__restrict__ off,
                                int32_t *__restrict__ slot, int32_t *__restrict__ inv) {
    __shared__ int warp_n[MOE_PERM_THREADS / 32];
    const int x = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int base = off[x];
    for (int t0 = 0; t0 < n_slots; t0 += blockDim.x * MOE_FILL_PER) {
        const int s0 = t0 + threadIdx.x * MOE_FILL_PER;
        int c = 0;
        for (int j = 0; j < MOE_FILL_PER; j++) c += s0 + j < n_slots && sel[s0 + j] == x;
        int incl = c; /* inclusive scan over the warp's lanes */
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) warp_n[warp] = incl;
        __syncthreads();
        int before = 0, total = 0;
        for (int i = 0; i < nw; i++) {
            before += i < warp ? warp_n[i] : 0;
            total += warp_n[i];
        }
        int pos = base + before + incl - c;
        for (int j = 0; j < MOE_FILL_PER && c; j++) {
            const int s = s0 + j;
            if (s < n_slots && sel[s] == x) {
                slot[pos] = s;
                inv[s] = pos;
                pos++;
            }
        }
        base += total;
        __syncthreads(); /* warp_n is rewritten by the next tile */
    }
}

extern "C" cudaError_t kvb_cu_moe_permute(const int32_t *sel, int n, int K, int X, int32_t *cnt, int32_t *off,
                                          int32_t *slot, int32_t *inv, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (X <= 0 || K <= 0) return cudaErrorInvalidValue;
    const int n_slots = n * K;
    moe_count_kernel<<<X, MOE_PERM_THREADS, 0, st>>>(sel, n_slots, cnt);
    moe_offsets_kernel<<<1, 1, 0, st>>>(cnt, X, off);
    moe_fill_kernel<<<X, MOE_PERM_THREADS, 0, st>>>(sel, n_slots, off, slot, inv);
    return cudaGetLastError();
}

/* Row p of xp = row slot[p] / K of h, in 16-byte vectors (E % 8 == 0). */
__global__ void moe_gather_kernel(const uint4 *__restrict__ h, const int32_t *__restrict__ slot, int K, int vecs,
                                  long long total, uint4 *__restrict__ xp) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / vecs, v = i % vecs;
        const long long t = slot[p] / K;
        xp[i] = h[t * vecs + v];
    }
}

extern "C" cudaError_t kvb_cu_moe_gather(const void *h, const int32_t *slot, int n_slots, int K, int E, void *xp,
                                         cudaStream_t st) {
    if (n_slots <= 0) return cudaSuccess;
    if (E % 8 || K <= 0) return cudaErrorInvalidValue;
    const int vecs = E / 8;
    const long long total = (long long)n_slots * vecs;
    long long blocks = (total + 255) / 256;
    if (blocks > 132 * 32) blocks = 132 * 32;
    moe_gather_kernel<<<(unsigned)blocks, 256, 0, st>>>((const uint4 *)h, slot, K, vecs, total, (uint4 *)xp);
    return cudaGetLastError();
}

/* ---- weighted un-permute ------------------------------------------------------------------ */

__device__ __forceinline__ float moe_load(const float *y, size_t i) { return y[i]; }
__device__ __forceinline__ float moe_load(const bf16 *y, size_t i) { return __bfloat162float(y[i]); }

/* x[t][i] += (w[t,0] y[inv[t K]][i] + w[t,1] y[inv[t K + 1]][i]) + ... in rank order, each product
 * and sum rounded once (the CPU engine's combine, then its residual add). */
template <typename Y>
__global__ void moe_unpermute_kernel(const Y *__restrict__ y, const int32_t *__restrict__ inv,
                                     const float *__restrict__ w, int K, int E, long long total, float *__restrict__ x) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / E, c = i % E;
        float acc = 0.0f;
        for (int k = 0; k < K; k++) {
            const float v = __fmul_rn(w[t * K + k], moe_load(y, (size_t)inv[t * K + k] * E + c));
            acc = k ? __fadd_rn(acc, v) : v;
        }
        x[i] = __fadd_rn(x[i], acc);
    }
}

extern "C" cudaError_t kvb_cu_moe_unpermute(const void *y, int y_bf16, const int32_t *inv, const float *w, int n,
                                            int K, int E, float *x, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (K <= 0 || E <= 0) return cudaErrorInvalidValue;
    const long long total = (long long)n * E;
    long long blocks = (total + 255) / 256;
    if (blocks > 132 * 32) blocks = 132 * 32;
    if (y_bf16)
        moe_unpermute_kernel<bf16><<<(unsigned)blocks, 256, 0, st>>>((const bf16 *)y, inv, w, K, E, total, x);
    else moe_unpermute_kernel<float><<<(unsigned)blocks, 256, 0, st>>>((const float *)y, inv, w, K, E, total, x);
    return cudaGetLastError();
}
