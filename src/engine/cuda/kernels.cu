/* engine/cuda/kernels.cu — the elementwise and row kernels of the CUDA forward pass: embedding
 * gather (gemma3: times sqrt(n_embd)), RMSNorm (f32 in, bf16 out; or, for gemma3's post norms,
 * f32 added into the residual stream), the fused QKV epilogue (bias, per-head q/k RMSNorm, RoPE,
 * q out, K/V into the paged cache), SwiGLU / GeGLU, the tensor-parallel all-reduce's sum of up to
 * 8 buffers (rank order, plain f32 adds), and a random fill for benchmarks. Each has a CPU twin in
 * tests/test_cuda_kernels.c. RoPE products are rounded one by one (__fmul_rn/__fsub_rn/__fadd_rn)
 * like the CPU engine's; reductions use f32 in a fixed tree order. */
#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda_kernels.h"

typedef __nv_bfloat16 bf16;

/* ---- embedding --------------------------------------------------------------------------- */

/* scale == 0: the row as is; else each element times scale (one f32 product, as the CPU engine) */
__device__ __forceinline__ float embed_scaled(float v, float scale) { return scale != 0.0f ? __fmul_rn(v, scale) : v; }

__global__ void embed_kernel(const bf16 *__restrict__ table, const int32_t *__restrict__ tok, int E, float scale,
                             float *__restrict__ x) {
    const int t = blockIdx.x;
    const bf16 *row = table + (size_t)tok[t] * E;
    float *out = x + (size_t)t * E;
    if ((E & 1) == 0) {
        const __nv_bfloat162 *r2 = reinterpret_cast<const __nv_bfloat162 *>(row);
        float2 *o2 = reinterpret_cast<float2 *>(out);
        for (int i = threadIdx.x; i < E / 2; i += blockDim.x) {
            const float2 v = __bfloat1622float2(r2[i]);
            o2[i] = make_float2(embed_scaled(v.x, scale), embed_scaled(v.y, scale));
        }
    } else {
        for (int i = threadIdx.x; i < E; i += blockDim.x) out[i] = embed_scaled(__bfloat162float(row[i]), scale);
    }
}

extern "C" cudaError_t kvb_cu_embed(const void *table, const int32_t *tok, int n, int E, float scale, float *x,
                                    cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    embed_kernel<<<n, 256, 0, st>>>((const bf16 *)table, tok, E, scale, x);
    return cudaGetLastError();
}

/* ---- RMSNorm ----------------------------------------------------------------------------- */

/* Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result. */
__device__ __forceinline__ float block_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads(); /* red may still be read from a previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = lane < nw ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

/* Row blockIdx.x of x: o = (x * (1/sqrtf(ss/E + eps))) * w; then y = bf16(o) (when y), y32 = o (when
 * y32) and acc += o (when acc; acc rows at x_stride, like x's). */
__global__ void rmsnorm_kernel(const float *__restrict__ x, size_t x_stride, int E, const float *__restrict__ w,
                               float eps, bf16 *__restrict__ y, size_t y_stride, float *__restrict__ y32,
                               float *__restrict__ acc) {
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * x_stride;
    bf16 *yr = y ? y + (size_t)blockIdx.x * y_stride : nullptr;
    float *ar = acc ? acc + (size_t)blockIdx.x * x_stride : nullptr;
    float ss = 0.0f;
    if ((E & 3) == 0) {
        const float4 *x4 = reinterpret_cast<const float4 *>(xr);
        for (int i = threadIdx.x; i < E / 4; i += blockDim.x) {
            float4 v = x4[i];
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
        }
    } else {
        for (int i = threadIdx.x; i < E; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    }
    ss = block_sum(ss, red);
    const float r = 1.0f / sqrtf(__fdiv_rn(ss, (float)E) + eps);
    if ((E & 3) == 0) {
        const float4 *x4 = reinterpret_cast<const float4 *>(xr);
        const float4 *w4 = reinterpret_cast<const float4 *>(w);
        __nv_bfloat162 *y2 = reinterpret_cast<__nv_bfloat162 *>(yr); /* NULL when yr is */
        float4 *o4 = y32 ? reinterpret_cast<float4 *>(y32 + (size_t)blockIdx.x * E) : nullptr;
        float4 *a4 = reinterpret_cast<float4 *>(ar);
        for (int i = threadIdx.x; i < E / 4; i += blockDim.x) {
            float4 v = x4[i], g = w4[i];
            float4 o = make_float4(__fmul_rn(__fmul_rn(v.x, r), g.x), __fmul_rn(__fmul_rn(v.y, r), g.y),
                                   __fmul_rn(__fmul_rn(v.z, r), g.z), __fmul_rn(__fmul_rn(v.w, r), g.w));
            if (y2) {
                y2[2 * i] = __floats2bfloat162_rn(o.x, o.y);
                y2[2 * i + 1] = __floats2bfloat162_rn(o.z, o.w);
            }
            if (o4) o4[i] = o;
            if (a4) {
                const float4 s = a4[i];
                a4[i] = make_float4(__fadd_rn(s.x, o.x), __fadd_rn(s.y, o.y), __fadd_rn(s.z, o.z), __fadd_rn(s.w, o.w));
            }
        }
    } else {
        float *o32 = y32 ? y32 + (size_t)blockIdx.x * E : nullptr;
        for (int i = threadIdx.x; i < E; i += blockDim.x) {
            const float o = __fmul_rn(__fmul_rn(xr[i], r), w[i]);
            if (yr) yr[i] = __float2bfloat16_rn(o);
            if (o32) o32[i] = o;
            if (ar) ar[i] = __fadd_rn(ar[i], o);
        }
    }
}

static int rmsnorm_threads(int E) { return E >= 4096 ? 512 : E >= 1024 ? 256 : 128; }

extern "C" cudaError_t kvb_cu_rmsnorm(const float *x, size_t x_stride, int n, int E, const float *w, float eps,
                                      void *y, size_t y_stride, float *y32, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (!y) return cudaErrorInvalidValue;
    rmsnorm_kernel<<<n, rmsnorm_threads(E), 0, st>>>(x, x_stride, E, w, eps, (bf16 *)y, y_stride, y32, nullptr);
    return cudaGetLastError();
}

extern "C" cudaError_t kvb_cu_rmsnorm_add(const float *src, int n, int E, const float *w, float eps, float *x,
                                          cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (!x || x == src) return cudaErrorInvalidValue;
    rmsnorm_kernel<<<n, rmsnorm_threads(E), 0, st>>>(src, (size_t)E, E, w, eps, nullptr, 0, nullptr, x);
    return cudaGetLastError();
}

/* ---- fused QKV epilogue -------------------------------------------------------------------- */

#define QKV_WARPS 4
#define QKV_MAX_D 256

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__global__ void qkv_post_kernel(kvb_cu_qkv_post_args a) {
    __shared__ float buf[QKV_WARPS][QKV_MAX_D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int S = a.H + 2 * a.Hkv, D = a.D;
    const long long wid = (long long)blockIdx.x * QKV_WARPS + warp;
    if (wid >= (long long)a.n * S) return; /* whole warp leaves together: no block barrier below */
    const int t = (int)(wid / S), slot = (int)(wid % S);
    const float *src = a.qkv + (size_t)t * S * D + (size_t)slot * D;
    float *b = buf[warp];
    float ss = 0.0f;
    for (int i = lane; i < D; i += 32) {
        float v = src[i];
        if (a.bias) v = __fadd_rn(v, a.bias[(size_t)slot * D + i]);
        b[i] = v;
        ss = fmaf(v, v, ss);
    }
    const bool is_q = slot < a.H, is_k = !is_q && slot < a.H + a.Hkv;
    const float *nw = is_q ? a.q_norm : is_k ? a.k_norm : nullptr;
    if (nw) {
        ss = warp_sum(ss);
        const float r = 1.0f / sqrtf(__fdiv_rn(ss, (float)D) + a.eps);
        for (int i = lane; i < D; i += 32) b[i] = __fmul_rn(__fmul_rn(b[i], r), nw[i]);
    }
    __syncwarp();
    const int pos = a.pos0 + t, half = a.n_rot / 2;
    bf16 *dst;
    if (is_q) {
        dst = (bf16 *)a.q_out + (size_t)t * a.H * D + (size_t)slot * D;
    } else {
        const int kv = is_k ? 0 : 1, kvh = is_k ? slot - a.H : slot - a.H - a.Hkv;
        const kvb_cu_cache *c = &a.cache;
        const size_t row = (((size_t)a.layer * 2 + kv) * c->n_head_kv + kvh) << c->bt_shift;
        const int blk = c->blocks[pos >> c->bt_shift];
        dst = (bf16 *)(c->pool + (size_t)blk * c->block_bytes) +
              (row + (size_t)(pos & ((1 << c->bt_shift) - 1))) * (size_t)D;
    }
    const float *cs = a.rope_cos + (size_t)pos * half, *sn = a.rope_sin + (size_t)pos * half;
    for (int i = lane; i < D; i += 32) {
        float o = b[i];
        if ((is_q || is_k) && i < a.n_rot) {
            if (a.neox) {
                if (i < half) {
                    float x0 = b[i], x1 = b[i + half];
                    o = __fsub_rn(__fmul_rn(x0, cs[i]), __fmul_rn(x1, sn[i]));
                } else {
                    const int k = i - half;
                    float x0 = b[k], x1 = b[i];
                    o = __fadd_rn(__fmul_rn(x0, sn[k]), __fmul_rn(x1, cs[k]));
                }
            } else {
                const int k = i >> 1;
                if ((i & 1) == 0) {
                    float x0 = b[i], x1 = b[i + 1];
                    o = __fsub_rn(__fmul_rn(x0, cs[k]), __fmul_rn(x1, sn[k]));
                } else {
                    float x0 = b[i - 1], x1 = b[i];
                    o = __fadd_rn(__fmul_rn(x0, sn[k]), __fmul_rn(x1, cs[k]));
                }
            }
        }
        dst[i] = __float2bfloat16_rn(o);
    }
}

extern "C" cudaError_t kvb_cu_qkv_post(const kvb_cu_qkv_post_args *a, cudaStream_t st) {
    if (a->n <= 0) return cudaSuccess;
    if (a->D > QKV_MAX_D || a->D <= 0) return cudaErrorInvalidValue;
    const long long warps = (long long)a->n * (a->H + 2 * a->Hkv);
    const long long blocks = (warps + QKV_WARPS - 1) / QKV_WARPS;
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
    qkv_post_kernel<<<(unsigned)blocks, QKV_WARPS * 32, 0, st>>>(*a);
    return cudaGetLastError();
}

/* ---- SwiGLU / GeGLU --------------------------------------------------------------------------- */

__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

/* gelu_tanh(g) * u in the CPU engine's order (kvb_cpu_gelu_tanh): x3 = (g g) g, inner =
 * 0.7978845608 (g + 0.044715 x3), (0.5 g) (1 + tanhf(inner)), then times u; each step rounded. */
__device__ __forceinline__ float gelu_mul(float g, float u) {
    const float x3 = __fmul_rn(__fmul_rn(g, g), g);
    const float inner = __fmul_rn(0.7978845608f, __fadd_rn(g, __fmul_rn(0.044715f, x3)));
    return __fmul_rn(__fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, tanhf(inner))), u);
}

template <bool GELU> __device__ __forceinline__ float glu_mul(float g, float u) {
    return GELU ? gelu_mul(g, u) : silu_mul(g, u);
}

template <bool GELU>
__global__ void glu2_kernel(const __nv_bfloat162 *__restrict__ gu, long long n_pairs, int FF2,
                            __nv_bfloat162 *__restrict__ out) {
    /* FF2 = FF / 2 pairs per row; row t: g pairs [t*2*FF2, +FF2), u pairs after them */
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n_pairs;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / FF2, i = idx % FF2;
        const float2 g = __bfloat1622float2(gu[t * 2 * FF2 + i]);
        const float2 u = __bfloat1622float2(gu[t * 2 * FF2 + FF2 + i]);
        out[idx] = __floats2bfloat162_rn(glu_mul<GELU>(g.x, u.x), glu_mul<GELU>(g.y, u.y));
    }
}

template <bool GELU>
__global__ void glu1_kernel(const bf16 *__restrict__ gu, long long n_el, int FF, bf16 *__restrict__ out) {
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n_el;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / FF, i = idx % FF;
        out[idx] = __float2bfloat16_rn(
            glu_mul<GELU>(__bfloat162float(gu[t * 2 * FF + i]), __bfloat162float(gu[t * 2 * FF + FF + i])));
    }
}

template <bool GELU> static void glu_launch(const void *gu, int n, int FF, void *out, cudaStream_t st) {
    if ((FF & 1) == 0) {
        long long pairs = (long long)n * (FF / 2);
        long long blocks = (pairs + 255) / 256;
        if (blocks > 132 * 64) blocks = 132 * 64;
        glu2_kernel<GELU><<<(unsigned)blocks, 256, 0, st>>>((const __nv_bfloat162 *)gu, pairs, FF / 2,
                                                            (__nv_bfloat162 *)out);
    } else {
        long long el = (long long)n * FF;
        long long blocks = (el + 255) / 256;
        if (blocks > 132 * 64) blocks = 132 * 64;
        glu1_kernel<GELU><<<(unsigned)blocks, 256, 0, st>>>((const bf16 *)gu, el, FF, (bf16 *)out);
    }
}

extern "C" cudaError_t kvb_cu_glu(const void *gu, int n, int FF, int gelu, void *out, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    if (gelu) glu_launch<true>(gu, n, FF, out, st);
    else glu_launch<false>(gu, n, FF, out, st);
    return cudaGetLastError();
}

/* ---- sum of buffers (the tensor-parallel all-reduce, tp_comm.c) ------------------------------- */

#define SUM_MAX_IN 8

/* The inputs travel by value in the kernel's parameters (a host array of device pointers). */
typedef struct {
    const float *p[SUM_MAX_IN];
} sum_inputs;

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

/* out[j] = ((in[0][j] + in[1][j]) + in[2][j]) ... over the first N inputs, each add rounded once;
 * V = float4 (n = count / 4 vectors, every pointer 16-byte aligned) or float (n = count). */
template <int N, typename V> __global__ void sum_kernel(sum_inputs in, V *__restrict__ out, size_t n) {
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        V acc = reinterpret_cast<const V *>(in.p[0])[j];
#pragma unroll
        for (int i = 1; i < N; i++) {
            const V v = reinterpret_cast<const V *>(in.p[i])[j];
            if constexpr (sizeof(V) == sizeof(float4)) acc = add4(acc, v);
            else acc = __fadd_rn(acc, v);
        }
        out[j] = acc;
    }
}

template <typename V> static void sum_launch(const sum_inputs &in, int n_in, V *out, size_t n, cudaStream_t st) {
    size_t blocks = (n + 255) / 256;
    if (blocks > 132 * 16) blocks = 132 * 16;
    const dim3 g((unsigned)blocks), b(256);
    switch (n_in) {
    case 1: sum_kernel<1, V><<<g, b, 0, st>>>(in, out, n); break;
    case 2: sum_kernel<2, V><<<g, b, 0, st>>>(in, out, n); break;
    case 3: sum_kernel<3, V><<<g, b, 0, st>>>(in, out, n); break;
    case 4: sum_kernel<4, V><<<g, b, 0, st>>>(in, out, n); break;
    case 5: sum_kernel<5, V><<<g, b, 0, st>>>(in, out, n); break;
    case 6: sum_kernel<6, V><<<g, b, 0, st>>>(in, out, n); break;
    case 7: sum_kernel<7, V><<<g, b, 0, st>>>(in, out, n); break;
    default: sum_kernel<8, V><<<g, b, 0, st>>>(in, out, n); break;
    }
}

extern "C" cudaError_t kvb_cu_sum_f32(float *out, const float *const *in, int n_in, size_t count, cudaStream_t st) {
    if (n_in < 1 || n_in > SUM_MAX_IN || !in || !out) return cudaErrorInvalidValue;
    if (count == 0) return cudaSuccess;
    sum_inputs a = {};
    bool aligned = (count & 3) == 0 && ((uintptr_t)out & 15) == 0;
    for (int i = 0; i < n_in; i++) {
        if (!in[i] || in[i] == out) return cudaErrorInvalidValue;
        a.p[i] = in[i];
        aligned = aligned && ((uintptr_t)in[i] & 15) == 0;
    }
    if (aligned) sum_launch<float4>(a, n_in, reinterpret_cast<float4 *>(out), count / 4, st);
    else sum_launch<float>(a, n_in, out, count, st);
    return cudaGetLastError();
}

/* ---- random fill (benchmarks) ----------------------------------------------------------------- */

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

__global__ void fill_random_kernel(bf16 *p, size_t n, uint64_t seed, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = mix64(seed + 0x9e3779b97f4a7c15ULL * (i + 1));
        float u = (float)(h >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
        p[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * scale);
    }
}

extern "C" cudaError_t kvb_cu_fill_random_bf16(void *p, size_t n, uint64_t seed, float scale, cudaStream_t st) {
    if (n == 0) return cudaSuccess;
    fill_random_kernel<<<132 * 16, 256, 0, st>>>((bf16 *)p, n, seed, scale);
    return cudaGetLastError();
}

/* A diagnostic gate: one thread waits until the host writes non-zero to *flag (host-mapped
 * memory), so work enqueued behind it runs back to back once released. */
__global__ void gate_kernel(volatile int *flag) {
    while (*flag == 0) __nanosleep(2000);
}

extern "C" cudaError_t kvb_cu_gate(volatile int *flag, cudaStream_t st) {
    gate_kernel<<<1, 1, 0, st>>>(flag);
    return cudaGetLastError();
}
