// bridge/cuda/bridge.cu — the CUDA bridge kernels: the decoder's cache-producing arithmetic
// (kvb_engine_cpu.h, "the decoder's cache-producing arithmetic") reproduced operation for
// operation: the canonical dot (16 lanes, fmaf, fixed tree; exact integer block sums for
// Q8_0/Q4_0/Q5_0 weights against Q8_0 activations), bias add, k-norm, RoPE with products rounded
// separately, and the encoders — every rounding spelled with an _rn intrinsic so nvcc cannot
// contract or reorder, and the scalar conversions shared with the CPU (kvb_quant_scalar.h).
#include <cuda_runtime.h>

#include "bridge_kernels.h"
#include "bridge_quant.cuh"
#include "kvb_quant_scalar.h"

#define QK 32
#define T_F32 0u
#define T_F16 1u
#define T_Q4_0 2u
#define T_Q5_0 6u
#define T_Q8_0 8u
#define T_BF16 30u

__device__ static inline uint16_t ld_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

__device__ static inline float tree16(float *acc) {
    for (int h = 8; h >= 1; h >>= 1)
        for (int i = 0; i < h; i++) acc[i] = __fadd_rn(acc[i], acc[i + h]);
    return acc[0];
}

// Canonical dot over elements [e0, e1) of one weight row and one activation row, lanes counted
// from e0 (so a split dot is two independent canonical dots).
__device__ static float canon_dot(uint32_t wtype, const uint8_t *w, const uint8_t *x, int e0, int e1) {
    if (wtype != T_F32 && wtype != T_F16 && wtype != T_BF16 && wtype != T_Q8_0 && wtype != T_Q4_0 && wtype != T_Q5_0)
        return __int_as_float(0x7fc00000); // a type this kernel does not reproduce (K-quants): NaN, not a wrong number
    float acc[16];
    for (int i = 0; i < 16; i++) acc[i] = 0.0f;
    if (wtype == T_Q8_0 || wtype == T_Q4_0 || wtype == T_Q5_0) {
        const int wbb = wtype == T_Q8_0 ? 34 : wtype == T_Q4_0 ? 18 : 22;
        for (int b = e0 / QK; b < e1 / QK; b++) {
            const uint8_t *wb = w + (size_t)b * wbb, *xb = x + (size_t)b * 34;
            const int8_t *xq = (const int8_t *)(xb + 2);
            int s = 0;
            if (wtype == T_Q8_0) {
                const int8_t *wq = (const int8_t *)(wb + 2);
                for (int j = 0; j < QK; j++) s += (int)wq[j] * (int)xq[j];
            } else if (wtype == T_Q4_0) {
                for (int j = 0; j < QK / 2; j++) {
                    const int lo = (wb[2 + j] & 15) - 8, hi = (wb[2 + j] >> 4) - 8;
                    s += lo * (int)xq[j] + hi * (int)xq[j + QK / 2];
                }
            } else { // Q5_0: d, qh (bit j = fifth bit of element j), qs as Q4_0; q - 16
                const uint32_t qh = (uint32_t)wb[2] | (uint32_t)wb[3] << 8 | (uint32_t)wb[4] << 16 | (uint32_t)wb[5] << 24;
                for (int j = 0; j < QK / 2; j++) {
                    const int lo = ((wb[6 + j] & 15) | (int)((qh >> j) & 1u) << 4) - 16;
                    const int hi = ((wb[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4) - 16;
                    s += lo * (int)xq[j] + hi * (int)xq[j + QK / 2];
                }
            }
            const float d = __fmul_rn(kvb_fp16_to_f32_inl(ld_u16(wb)), kvb_fp16_to_f32_inl(ld_u16(xb)));
            const int lane = (b - e0 / QK) & 15;
            acc[lane] = __fmaf_rn(__int2float_rn(s), d, acc[lane]);
        }
    } else {
        const float *xf = (const float *)x;
        for (int i = e0; i < e1; i++) {
            float wi;
            if (wtype == T_F32) wi = ((const float *)w)[i];
            else if (wtype == T_F16) wi = kvb_fp16_to_f32_inl(ld_u16(w + 2 * (size_t)i));
            else wi = kvb_bf16_to_f32_inl(ld_u16(w + 2 * (size_t)i));
            const int lane = (i - e0) & 15;
            acc[lane] = __fmaf_rn(wi, xf[i], acc[lane]);
        }
    }
    return tree16(acc);
}

__global__ static void k_quantize_act(const float *x, uint8_t *act, size_t act_stride, int n, int E) {
    const int nb = E / QK;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * nb) return;
    const int t = idx / nb, b = idx % nb;
    const float *xb = x + (size_t)t * E + (size_t)b * QK;
    uint8_t *y = act + (size_t)t * act_stride + (size_t)b * 34;
    const uint16_t dh = kvb_f32_to_fp16_inl(kvb_bq_quantize32(xb, (int8_t *)(y + 2)));
    y[0] = (uint8_t)(dh & 0xff);
    y[1] = (uint8_t)(dh >> 8);
}

__global__ static void k_copy_act(const float *x, uint8_t *act, size_t act_stride, int n, int E) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * E) return;
    const int t = idx / E, i = idx % E;
    ((float *)(act + (size_t)t * act_stride))[i] = x[idx];
}

__global__ static void k_project(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int rows, const uint8_t *act,
                                 size_t act_stride, int n, int E, float *y, int split) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * rows) return;
    const int t = idx / rows, r = idx % rows;
    const uint8_t *wr = w + (size_t)r * w_row_bytes, *xa = act + (size_t)t * act_stride;
    float v;
    if (split > 0) v = __fadd_rn(canon_dot(wtype, wr, xa, 0, split), canon_dot(wtype, wr, xa, split, E));
    else v = canon_dot(wtype, wr, xa, 0, E);
    y[(size_t)t * rows + r] = v;
}

__device__ static void encode_row(uint32_t dtype, const float *x, int hd, uint8_t *dst) {
    if (dtype == T_F32) {
        for (int i = 0; i < hd; i++) ((float *)dst)[i] = x[i];
    } else if (dtype == T_F16 || dtype == T_BF16) {
        for (int i = 0; i < hd; i++) {
            const uint16_t h = dtype == T_F16 ? kvb_f32_to_fp16_inl(x[i]) : kvb_f32_to_bf16_inl(x[i]);
            dst[2 * i] = (uint8_t)(h & 0xff);
            dst[2 * i + 1] = (uint8_t)(h >> 8);
        }
    } else { /* Q8_0, ggml's reference quantiser */
        for (int b = 0; b < hd / QK; b++) {
            const float *xb = x + b * QK;
            uint8_t *y = dst + (size_t)b * 34;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) {
                const float a = fabsf(xb[j]);
                amax = amax > a ? amax : a;
            }
            float id;
            const float d = kvb_bq_scale(amax, &id);
            const uint16_t dh = kvb_f32_to_fp16_inl(d);
            y[0] = (uint8_t)(dh & 0xff);
            y[1] = (uint8_t)(dh >> 8);
            for (int j = 0; j < QK; j++) y[2 + j] = (uint8_t)kvb_q8_roundf(__fmul_rn(xb[j], id));
        }
    }
}

// One (token t, kv head h) row: bias, k-norm of elements [0, norm_dim), RoPE of elements [rot0,
// rot0 + n_rot), then K and V encoded into kdst / vdst (vdst NULL: no V, vh unused). kh, vh (hd)
// are modified in place; they and the destinations may be global or shared memory.
__device__ static void post_row(float *kh, float *vh, int t, int h, int hd, const float *bk, const float *bv,
                                const float *knorm, int norm_dim, float eps, int n_rot, int rot0, int neox,
                                const float *cos_t, const float *sin_t, uint32_t dtype, uint8_t *kdst,
                                uint8_t *vdst) {
    const int half = n_rot / 2;
    if (bk)
        for (int i = 0; i < hd; i++) kh[i] = __fadd_rn(kh[i], bk[(size_t)h * hd + i]);
    if (bv && vdst)
        for (int i = 0; i < hd; i++) vh[i] = __fadd_rn(vh[i], bv[(size_t)h * hd + i]);
    if (knorm) {
        float acc[16];
        for (int i = 0; i < 16; i++) acc[i] = 0.0f;
        for (int i = 0; i < norm_dim; i++) acc[i & 15] = __fmaf_rn(kh[i], kh[i], acc[i & 15]);
        const float ss = tree16(acc);
        const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)norm_dim), eps)));
        for (int i = 0; i < norm_dim; i++) kh[i] = __fmul_rn(__fmul_rn(kh[i], r), knorm[i]);
    }
    const float *c = cos_t + (size_t)t * half, *s = sin_t + (size_t)t * half;
    for (int i = 0; i < half; i++) {
        const int i0 = rot0 + (neox ? i : 2 * i), i1 = rot0 + (neox ? i + half : 2 * i + 1);
        const float x0 = kh[i0], x1 = kh[i1];
        const float a = __fmul_rn(x0, c[i]), b = __fmul_rn(x1, s[i]), e = __fmul_rn(x0, s[i]), f = __fmul_rn(x1, c[i]);
        kh[i0] = __fsub_rn(a, b);
        kh[i1] = __fadd_rn(e, f);
    }
    encode_row(dtype, kh, hd, kdst);
    if (vdst) encode_row(dtype, vh, hd, vdst);
}

// POST_ROWS consecutive (token, kv head) rows per CTA, one per thread, staged through shared
// memory: the rows come in and the encoded rows go out in coalesced runs, and each thread works on
// its own padded shared row (no bank conflicts). With each thread on its own global row the loads
// were a row (256 bytes) apart and the kernel took 337 us per 8K-token layer of the 1B shape
// (H200, ncu), 29 % of the bridge's GPU time. Same arithmetic (post_row), same bytes. Without V
// (v, v_rows NULL: a latent row) its shared rows are not there.
#define POST_ROWS 32
__global__ static void __launch_bounds__(POST_ROWS)
k_post(float *k, float *v, int n, int nkv, int hd, const float *bk, const float *bv, const float *knorm, int norm_dim,
       float eps, int n_rot, int rot0, int neox, const float *cos_t, const float *sin_t, uint32_t dtype,
       uint8_t *k_rows, uint8_t *v_rows, int row_bytes) {
    extern __shared__ __align__(16) unsigned char post_smem[];
    const int fstride = hd + 1, bstride = row_bytes + 4, parts = v ? 2 : 1; // padded: row r starts r banks further on
    float *sk = (float *)post_smem, *sv = sk + POST_ROWS * fstride;                          // (POST_ROWS, hd + 1) each
    uint8_t *ok = (uint8_t *)(sk + parts * POST_ROWS * fstride), *ov = ok + POST_ROWS * bstride; // (POST_ROWS, row_bytes + 4)
    const long long row0 = (long long)blockIdx.x * POST_ROWS, total = (long long)n * nkv;
    const int rows = (int)(total - row0 < POST_ROWS ? total - row0 : POST_ROWS), tid = (int)threadIdx.x;
    for (int i = tid; i < rows * hd; i += POST_ROWS) {
        sk[(i / hd) * fstride + i % hd] = k[row0 * hd + i];
        if (v) sv[(i / hd) * fstride + i % hd] = v[row0 * hd + i];
    }
    __syncthreads();
    if (tid < rows) {
        const long long idx = row0 + tid;
        post_row(sk + tid * fstride, sv + tid * fstride, (int)(idx / nkv), (int)(idx % nkv), hd, bk, bv, knorm,
                 norm_dim, eps, n_rot, rot0, neox, cos_t, sin_t, dtype, ok + tid * bstride,
                 v ? ov + tid * bstride : NULL);
    }
    __syncthreads();
    if (row_bytes % 4 == 0) { // 4-byte pieces (row0 * row_bytes is then a multiple of 4 too)
        const int words = row_bytes / 4;
        for (int i = tid; i < rows * words; i += POST_ROWS) {
            const int r = i / words, o = (i % words) * 4;
            ((uint32_t *)(k_rows + row0 * row_bytes))[i] = *(const uint32_t *)(ok + r * bstride + o);
            if (v_rows) ((uint32_t *)(v_rows + row0 * row_bytes))[i] = *(const uint32_t *)(ov + r * bstride + o);
        }
    } else {
        for (int i = tid; i < rows * row_bytes; i += POST_ROWS) {
            const int r = i / row_bytes, o = i % row_bytes;
            k_rows[row0 * row_bytes + i] = ok[r * bstride + o];
            if (v_rows) v_rows[row0 * row_bytes + i] = ov[r * bstride + o];
        }
    }
}

// ---- the same post with 16 lanes per row -----------------------------------------------------
// k_post gives each row one thread, whose rows staged in shared memory limit an SM to ~9 warps:
// 50 us per 8K-token layer of the 1B shape (H200, ncu, 29 % of issue slots used). Here 16 lanes
// share a row, lane l holding elements l, l + 16, ... (slot j: element l + 16 j) in registers,
// and each step is the serial one's, value for value:
//   k-norm   acc[i & 15] is lane l's own chain over its elements (those below norm_dim) in order;
//            the tree's pairs (acc[i] + acc[i + h]) are a shuffle down by h within the 16
//   RoPE     each element's pair partner is read before any is written: the same lane (neox,
//            half % 16 == 0) or the neighbour lane (interleaved pairs); the rotated elements start
//            at rot0, a multiple of 16, so a pair's partner is where it is at rot0 0
//   Q8_0     amax as the serial loop computes it, NaNs included: `amax > a ? amax : a` restarts at
//            the element after the block's last NaN (and is NaN when that NaN is the last
//            element); a maximum of non-negative numbers is the same in any order
// Rows whose shape this does not cover (hd not a multiple of 16 or above 256, neox with half not
// a multiple of 16, rot0 not a multiple of 16) take k_post. Without V (v, v_rows NULL) only K.
#define P16_ROWS 8 // rows per CTA: 128 threads
#define P16_FULL 0xffffffffu

// One row's slots x (J) -> dtype bytes at dst (live lanes store).
template <int J>
__device__ static inline void p16_encode(uint32_t dtype, const float *x, int l, bool live, uint8_t *dst) {
    if (dtype == T_F32 || dtype == T_F16 || dtype == T_BF16) {
        if (!live) return;
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int e = l + 16 * j;
            if (dtype == T_F32) ((float *)dst)[e] = x[j];
            else ((uint16_t *)dst)[e] = dtype == T_F16 ? kvb_f32_to_fp16_inl(x[j]) : kvb_f32_to_bf16_inl(x[j]);
        }
        return;
    }
    const int seg = (int)(threadIdx.x & 16u); // this row's half of the warp
#pragma unroll
    for (int b = 0; b < J / 2; b++) { // block b: slot 2b (elements 32b + l) and 2b + 1 (32b + 16 + l)
        const float lo = x[2 * b], hi = x[2 * b + 1];
        const unsigned nlo = (__ballot_sync(P16_FULL, lo != lo) >> seg) & 0xffffu;
        const unsigned nhi = (__ballot_sync(P16_FULL, hi != hi) >> seg) & 0xffffu;
        const unsigned nan = nlo | nhi << 16; // bit p: block element p is NaN
        const int last = nan ? 31 - __clz((int)nan) : -1;
        float amax = 0.0f;
        if (l > last) amax = fabsf(lo);
        if (16 + l > last) amax = fmaxf(amax, fabsf(hi));
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(P16_FULL, amax, o, 16));
        if (last == 31) amax = __int_as_float(0x7fc00000);
        float id;
        const float d = kvb_bq_scale(amax, &id);
        if (!live) continue;
        uint8_t *y = dst + (size_t)b * 34;
        if (l == 0) {
            const uint16_t dh = kvb_f32_to_fp16_inl(d);
            y[0] = (uint8_t)(dh & 0xff);
            y[1] = (uint8_t)(dh >> 8);
        }
        y[2 + l] = (uint8_t)kvb_q8_roundf(__fmul_rn(lo, id));
        y[2 + 16 + l] = (uint8_t)kvb_q8_roundf(__fmul_rn(hi, id));
    }
}

template <int J>
__global__ static void __launch_bounds__(16 * P16_ROWS)
k_post16(const float *k, const float *v, int n, int nkv, const float *bk, const float *bv, const float *knorm,
         int norm_dim, float eps, int n_rot, int rot0, int neox, const float *cos_t, const float *sin_t,
         uint32_t dtype, uint8_t *k_rows, uint8_t *v_rows, int row_bytes) {
    const int hd = 16 * J, l = (int)(threadIdx.x & 15u);
    const long long total = (long long)n * nkv, row = (long long)blockIdx.x * P16_ROWS + (threadIdx.x >> 4);
    const bool live = row < total;
    const long long rr = live ? row : total - 1; // a dead half-warp works on a live row's values, storing nothing
    const int t = (int)(rr / nkv), h = (int)(rr % nkv);
    float kx[J], vx[J];
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int e = l + 16 * j;
        kx[j] = k[rr * hd + e];
        vx[j] = v ? v[rr * hd + e] : 0.0f;
        if (bk) kx[j] = __fadd_rn(kx[j], bk[(size_t)h * hd + e]);
        if (bv && v) vx[j] = __fadd_rn(vx[j], bv[(size_t)h * hd + e]);
    }
    if (knorm) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < J; j++)
            if (l + 16 * j < norm_dim) acc = __fmaf_rn(kx[j], kx[j], acc);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_down_sync(P16_FULL, acc, o, 16));
        const float ss = __shfl_sync(P16_FULL, acc, 0, 16);
        const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)norm_dim), eps)));
#pragma unroll
        for (int j = 0; j < J; j++)
            if (l + 16 * j < norm_dim) kx[j] = __fmul_rn(__fmul_rn(kx[j], r), knorm[l + 16 * j]);
    }
    // neox: rotated element e (e - rot0 < half) pairs with e + half, slot j + hs
    const int half = n_rot / 2, hs = half / 16, js = rot0 / 16;
    float px[J]; // each slot's pair partner, before any is rotated
#pragma unroll
    for (int j = 0; j < J; j++) {
        if (neox) {
            px[j] = 0.0f;
#pragma unroll
            for (int j2 = 0; j2 < J; j2++)
                if (j2 == (j - js < hs ? j + hs : j - hs)) px[j] = kx[j2];
        } else {
            px[j] = __shfl_xor_sync(P16_FULL, kx[j], 1, 16);
        }
    }
    const float *c = cos_t + (size_t)t * half, *s = sin_t + (size_t)t * half;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int e = l + 16 * j - rot0; // its place among the rotated elements
        if (e < 0 || e >= n_rot) continue;
        const bool first = neox ? e < half : !(e & 1); // x0 of its pair (i0), else x1 (i1)
        const int i = neox ? (first ? e : e - half) : e >> 1;
        const float x0 = first ? kx[j] : px[j], x1 = first ? px[j] : kx[j];
        kx[j] = first ? __fsub_rn(__fmul_rn(x0, c[i]), __fmul_rn(x1, s[i]))
                      : __fadd_rn(__fmul_rn(x0, s[i]), __fmul_rn(x1, c[i]));
    }
    p16_encode<J>(dtype, kx, l, live, k_rows + rr * row_bytes);
    if (v_rows) p16_encode<J>(dtype, vx, l, live, v_rows + rr * row_bytes);
}

static int grid(long long threads) { return (int)((threads + 127) / 128); }

extern "C" int kvb_bk_quantize_act(const float *x, uint8_t *act, size_t act_stride, int n, int E, int quantized,
                                   void *stream) {
    cudaStream_t st = (cudaStream_t)stream;
    if (quantized) k_quantize_act<<<grid((long long)n * (E / QK)), 128, 0, st>>>(x, act, act_stride, n, E);
    else k_copy_act<<<grid((long long)n * E), 128, 0, st>>>(x, act, act_stride, n, E);
    return (int)cudaGetLastError();
}

extern "C" int kvb_bk_project(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int rows, const uint8_t *act,
                              size_t act_stride, int n, int E, float *y, int split, void *stream) {
    k_project<<<grid((long long)n * rows), 128, 0, (cudaStream_t)stream>>>(wtype, w, w_row_bytes, rows, act,
                                                                           act_stride, n, E, y, split);
    return (int)cudaGetLastError();
}

#define P16_CASE(J)                                                                                            \
    case J:                                                                                                    \
        k_post16<J><<<blocks, 16 * P16_ROWS, 0, st>>>(k, v, n, nkv, bk, bv, knorm, norm_dim, eps, n_rot, rot0, neox, \
                                                      cos_t, sin_t, dtype, k_rows, v_rows, (int)row_bytes);    \
        break;

extern "C" int kvb_bk_post(float *k, float *v, int n, int nkv, int hd, const float *bk, const float *bv,
                           const float *knorm, int norm_dim, float eps, int n_rot, int rot0, int neox,
                           const float *cos_t, const float *sin_t, uint32_t dtype, uint8_t *k_rows, uint8_t *v_rows,
                           size_t row_bytes, int serial, void *stream) {
    if (!v != !v_rows || norm_dim < 1 || norm_dim > hd || rot0 < 0 || n_rot < 0 || rot0 + n_rot > hd)
        return (int)cudaErrorInvalidValue;
    const bool lanes16 = !serial && hd % 16 == 0 && hd <= 256 && (!neox || (n_rot / 2) % 16 == 0) && rot0 % 16 == 0 &&
                         (dtype != T_Q8_0 || hd % 32 == 0);
    if (lanes16) {
        cudaStream_t st = (cudaStream_t)stream;
        const unsigned blocks = (unsigned)(((long long)n * nkv + P16_ROWS - 1) / P16_ROWS);
        switch (hd / 16) {
            P16_CASE(1) P16_CASE(2) P16_CASE(3) P16_CASE(4) P16_CASE(5) P16_CASE(6) P16_CASE(7) P16_CASE(8)
            P16_CASE(9) P16_CASE(10) P16_CASE(11) P16_CASE(12) P16_CASE(13) P16_CASE(14) P16_CASE(15) P16_CASE(16)
        }
        return (int)cudaGetLastError();
    }
    const size_t parts = v ? 2 : 1, smem = (size_t)POST_ROWS * parts * ((hd + 1) * sizeof(float) + row_bytes + 4);
    if (smem > 48 * 1024) { // large heads in f32: opt in to more shared memory
        const cudaError_t e = cudaFuncSetAttribute(k_post, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    const long long rows = (long long)n * nkv;
    k_post<<<(unsigned)((rows + POST_ROWS - 1) / POST_ROWS), POST_ROWS, smem, (cudaStream_t)stream>>>(
        k, v, n, nkv, hd, bk, bv, knorm, norm_dim, eps, n_rot, rot0, neox, cos_t, sin_t, dtype, k_rows, v_rows,
        (int)row_bytes);
    return (int)cudaGetLastError();
}
